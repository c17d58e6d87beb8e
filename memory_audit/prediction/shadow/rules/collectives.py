"""What a torchrun rank's collectives allocate that the dispatcher's ops do not show, by backend.

gloo (CPU ranks): the buffers gloo stages and makes on its own thread in FSDP2's and sequence
parallelism's collectives, and CPU _chunk_cat's padded copies (FSDP2's reduce-scatter input).
Read from CPU audits under torchrun, and held by tests/test_distributed.py (the rows of
snapshots/results/cpu-parallel.jsonl and random 2-rank configs, event by event).

NCCL (GPU ranks): what the shadow assumes of each strategy's collectives over several ranks,
which no trace has measured; a prediction that uses it lists it as not measured on a GPU.
Plain Python: no torch imported here.
"""

NCCL = {  # what a CUDA rank's shadow assumes of its strategy's collectives under NCCL over several
    # ranks; at world size 1 the H100 audits of snapshots/examples/nccl-ws1 (ddp, fsdp, tp) are predicted
    # to the byte (tests/test_ranks_on_gpu.py), the reduce-scatter stream's pool included
    "fsdp": "FSDP2's all-gather and reduce-scatter buffers on streams of their own, a caching-allocator pool "
            "per stream, freed in program order (no record_stream); NCCL's own buffers outside PyTorch's "
            "allocator (measured at world size 1 only, where no all-gather runs)",
    "ddp": "DDP's buckets and the reducer's small index tensors on the compute stream; NCCL's all-reduce in "
           "place, its own buffers outside PyTorch's allocator (measured at world size 1 only)",
    "tp": "DTensor's collectives' outputs on the compute stream, freed in program order; NCCL's own buffers "
          "outside PyTorch's allocator (measured at world size 1 only)",
}


def nccl_assumptions(parallel, world_size):
    """The lines a CUDA rank's prediction lists as not measured on a GPU for `parallel` (train.py's
    strategy name, "fsdp+tp-sp" naming two) over `world_size` ranks."""
    if world_size <= 1:
        return []
    return [f"parallel={parallel} on NCCL over {world_size} ranks: {text}" for kind, text in NCCL.items() if kind in parallel]


def gloo_buffers(func, args):
    """[[bytes]]: the groups of buffers gloo makes in a collective FSDP2 calls, one group after
    the other, each made in order and let go in reverse (measured on CPU audits under torchrun):
    all_gather_into_tensor stages a flat output on the calling thread, then gloo's thread makes
    another (each the output's size); reduce_scatter_tensor stages its input while gloo's thread
    divides the result by the world size (ReduceOp.AVG) through a wrapped scalar (8 B) and its
    cast to the output's dtype. Sequence parallelism's functional all_gather_into_tensor stages
    its input, then gloo's thread makes one of the output's size; its reduce_scatter_tensor
    stages its input."""
    import torch
    if func.namespace == "_c10d_functional" and func.__name__.startswith("all_gather_into_tensor."):
        return [[_nbytes(args[0])], [_nbytes(args[0]) * args[1]]]  # input, args[1] ranks
    if func.namespace == "_c10d_functional" and func.__name__.startswith("reduce_scatter_tensor."):
        return [[_nbytes(args[0])]]
    c10d = getattr(torch.ops, "c10d", None)
    if c10d is None or func not in (c10d._allgather_base_.default, c10d._reduce_scatter_base_.default):
        return []
    out, inp = args[0], args[1]
    if func is c10d._allgather_base_.default:
        return [[_nbytes(out)], [_nbytes(out)]]
    return [[_nbytes(inp), 8, out.element_size()]]


def chunk_cat_pads(tensors, dim, chunks):
    """[bytes] of the padded copies CPU _chunk_cat makes (FSDP2's reduce-scatter input: each
    gradient split into `chunks` rows of the buffer) of the tensors whose size along `dim` the
    chunks do not divide: padded up to the next multiple, made in order, freed as it returns."""
    out = []
    for t in tensors:
        size = t.shape[dim]
        if size % chunks:
            out.append(_nbytes(t) // max(size, 1) * (-(-size // chunks) * chunks))
    return out


def _nbytes(t):
    return t.numel() * t.element_size()
