"""The byte formula: every line of the step's ledger from the config alone, with its formula text.

config (train.py's keys, model.py's presets, the GPUs) -> parts (what each model part saves) ->
levers (checkpointing and the other levers, as rules over each block's lines) -> fsdp,
tensor_parallel (one rank's share) -> steady (the steady-state lines and the totals); history
plays a compiled CUDA step's ledger through the allocator's model. Pure Python, no torch.
"""
