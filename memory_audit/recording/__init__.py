"""The recording side: a live run's memory, written as snapshot files.

audit (the Audit API train.py and any loop use) -> recorder (allocator history on CUDA, the
profiler's memory timeline on CPU) -> snapshot files, the tensors named by naming/;
cpu_timeline turns a CPU profile into the CUDA snapshot schema.
"""
