"""memory_audit: where every byte of GPU memory goes in nanoGPT training.

The package's sides, in the order the data flows (each imports only from those before it and
from the base modules schema.py and text.py; tests/test_layout.py holds it to that):

  reading/      snapshot files -> load, trace, replay, attribute (no torch)
  naming/       a live or fake step's tensors -> their names (the audit and the shadow run alike)
  recording/    a live run -> snapshot files (Audit, the recorder)
  prediction/   a config -> the predicted ledger and the shadow run's trace
  comparison/   prediction beside measurement: reconcile, report, diff, sweep, fit/plan
  cli.py        python -m memory_audit ..., on top of them all

`from memory_audit import Audit` imports torch; reading snapshots does not (it stays light).
`from memory_audit import predict_loop` predicts any model's training step before it runs
(prediction/shadow/script.py: the loop shadow-run on fake tensors through shadow(); CPU), and
`with memory_audit.shadow() as s:` around a script's own code shadow-runs it as written
(prediction/shadow/script.py; CPU).
"""


def __getattr__(name):  # the recorder (and torch) only for those who record
    if name == "Audit":
        from .recording.audit import Audit
        return Audit
    if name == "AuditError":
        from .recording.recorder import AuditError
        return AuditError
    if name == "shadow":
        from .prediction.shadow.entry import shadow
        return shadow
    if name == "predict_loop":
        from .prediction.shadow.entry import predict_loop
        return predict_loop
    raise AttributeError(f"module 'memory_audit' has no attribute {name!r}")
