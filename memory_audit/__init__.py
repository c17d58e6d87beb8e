"""memory_audit: where every byte of GPU memory goes in nanoGPT training.

record (audit.Audit over recorder.py, the only modules touching live tensors) -> snapshot files
-> load (loader.py) -> attribute (attribute.py, timeline.py) -> predict (predict.py) ->
reconcile (reconcile.py) -> report (report.py). Everything after the recorder reads files only.

`from memory_audit import Audit` imports torch; reading snapshots does not (it stays light).
"""


def __getattr__(name):  # the recorder (and torch) only for those who record
    if name == "Audit":
        from .audit import Audit
        return Audit
    if name == "AuditError":
        from .recorder import AuditError
        return AuditError
    raise AttributeError(f"module 'memory_audit' has no attribute {name!r}")
