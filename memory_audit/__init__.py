"""memory_audit: where every byte of GPU memory goes in nanoGPT training.

record (recorder.py, the only module touching live tensors) -> snapshot files -> load
(loader.py) -> attribute (attribute.py, timeline.py) -> predict (predict.py) -> reconcile
(reconcile.py) -> report (report.py). Everything after the recorder reads files only.
"""
