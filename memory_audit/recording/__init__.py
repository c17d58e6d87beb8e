"""The recording side: a live run's memory, written as snapshot files.

audit (the Audit API train.py and any loop use) -> recorder (allocator history on CUDA, the
profiler's memory timeline on CPU) -> snapshot files, the tensors named by naming/;
cpu_timeline reads a CPU profile into events, which reading/cpu_snapshot writes in the
CUDA snapshot schema.
"""
