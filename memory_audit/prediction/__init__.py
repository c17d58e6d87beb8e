"""The prediction side: the step's memory before it runs.

predict.prediction() is the one prediction every command reads: the byte formula's lines
(ledger/: no torch) with the totals of the step's trace, the shadow run's (shadow/: the step run
on fake tensors, every allocation and free in autograd's order, replayed through the caching
allocator's model on a GPU) or inductor's plan for a compiled step (compiled.py; on CUDA its
gaps from ledger/history). Only the shadow and the compiled predictor import torch.
"""
