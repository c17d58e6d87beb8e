"""The prediction side: the step's memory before it runs.

predict.prediction() is the one prediction every command reads: the byte formula's lines
(predict(): ledger, parts, levers, fsdp, tensor_parallel) with the totals of the step's trace, the
shadow run's (the step run on fake tensors, every allocation and free in autograd's order:
shadow, shadow_tracker, shadow_cpu, shadow_cuda, rules, shadow_probe, shadow_metacache, shadow_repeat,
shadow_allocator, and for a torchrun rank shadow_dist) or inductor's plan for a compiled step
(compiled_predict; on CUDA its gaps from ledger_history). Only the shadow and the compiled
predictor import torch.
"""
