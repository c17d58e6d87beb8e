"""memory_audit: where every byte of GPU memory goes in nanoGPT training.

record (audit.Audit over recorder.py, the only modules touching live tensors) -> snapshot files
-> load (loader.py) -> attribute (attribute.py, timeline.py) -> predict (predict.py) ->
reconcile (reconcile.py) -> report (report.py). Everything after the recorder reads files only.
"""

from .audit import Audit  # noqa: F401
from .recorder import AuditError  # noqa: F401
