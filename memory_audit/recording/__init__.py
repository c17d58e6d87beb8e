"""The recording side: the only modules that touch live tensors during a run.

audit (the Audit API train.py and any loop use) -> recorder (allocator history on CUDA, the
profiler's memory timeline on CPU, the tensors' names) -> snapshot files; cpu_timeline turns a
CPU profile into the CUDA snapshot schema; compiled captures what torch.compile saves and plans.
"""
