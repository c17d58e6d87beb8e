"""The naming side: what a training step's tensors are called, for the audit of a live run and
the shadow run of a fake one alike (one set of names, so the two ledgers line up key by key).

tensors (long-lived tensors by storage; module and op names) -> checkpoints (checkpointed
regions, the recomputation's label) -> saved (the saved-tensor ledger) -> loop_names, loop_calls
(what a loop feeds, keeps and makes); compiled: what torch.compile saves and inductor plans.
"""
