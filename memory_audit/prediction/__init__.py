"""The prediction side: the step's memory before it runs.

predict (the ledger of an eager step: ledger, parts, levers, backward, fsdp, tensor_parallel,
gap_sim) and compiled_predict (a compiled step, from inductor's own plan); shadow (the step run on
fake tensors, every allocation and free in autograd's order: shadow_tracker, shadow_cuda,
shadow_probe, shadow_metacache, shadow_repeat, shadow_allocator; stepped puts its replay into
predict's totals). Only the shadow and the compiled predictor import torch.
"""
