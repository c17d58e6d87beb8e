"""What a torchrun rank's collectives allocate that the dispatcher's ops do not show, by backend.

gloo (CPU ranks): the buffers gloo stages and makes on its own thread in FSDP2's and sequence
parallelism's collectives, and CPU _chunk_cat's padded copies (FSDP2's reduce-scatter input).
Read from CPU audits under torchrun, and held by tests/test_distributed.py (the rows of
snapshots/results/cpu-parallel.jsonl and random 2-rank configs, event by event).

NCCL (GPU ranks): what the shadow assumes of each strategy's collectives over several ranks,
which no trace has measured; a prediction that uses it lists it as not measured on a GPU.
Plain Python: no torch imported here.
"""

from . import rule

NCCL = {  # what a CUDA rank's shadow assumes of its strategy's collectives under NCCL over several
    # ranks; at world size 1 the H100 audits of snapshots/examples/nccl-ws1 (ddp, fsdp, tp) are predicted
    # to the byte (tests/test_ranks_on_gpu.py), the reduce-scatter stream's pool included
    "fsdp": "FSDP2's all-gather and reduce-scatter buffers on streams of their own, a caching-allocator pool "
            "per stream, freed in program order (no record_stream); NCCL's own buffers outside PyTorch's "
            "allocator (measured at world size 1 only, where no all-gather runs)",
    "ddp": "DDP's buckets and the reducer's small index tensors on the compute stream; NCCL's all-reduce in "
           "place, its own buffers outside PyTorch's allocator (measured at world size 1 only); the old bucket "
           "freed at the rebuild in step 2's first forward, where NCCL still holding step 1's last all-reduce "
           "keeps it longer (a race: 5 of 22 H200 runs at world size 1; 74 ms in one)",
    "tp": "DTensor's collectives' outputs on the compute stream, freed in program order; NCCL's own buffers "
          "outside PyTorch's allocator (measured at world size 1 only)",
}


def nccl_assumptions(parallel, world_size):
    """The lines a CUDA rank's prediction lists as not measured on a GPU for `parallel` (train.py's
    strategy name, "fsdp+tp-sp" naming two) over `world_size` ranks."""
    if world_size <= 1:
        return []
    return [f"parallel={parallel} on NCCL over {world_size} ranks: {text}" for kind, text in NCCL.items() if kind in parallel]


# gloo on CPU ranks, as rules/cpu.py's rules: each an "events" part (before, after) of the op,
# the buffers made after its outputs and let go before it returns

@rule("cpu", "_c10d_functional.all_gather_into_tensor.default", "events")
def functional_all_gather_buffers(args):
    """Sequence parallelism's functional all_gather_into_tensor: gloo stages its input on the
    calling thread, then gloo's thread makes one of the output's size (args[1] ranks), each let go
    before the next is made (CPU audits of tp-sp under torchrun: tests/test_distributed.py's
    tensor and sequence parallel ranks, event by event)."""
    n = _nbytes(args[0])
    return (), [("alloc", n), ("free", 0), ("alloc", n * args[1]), ("free", 1)]


@rule("cpu", "_c10d_functional.reduce_scatter_tensor.default", "events")
def functional_reduce_scatter_buffers(args):
    """Sequence parallelism's functional reduce_scatter_tensor: its input staged, let go as it
    returns (tests/test_distributed.py's tensor and sequence parallel ranks)."""
    return (), [("alloc", _nbytes(args[0])), ("free", 0)]


@rule("cpu", "c10d._allgather_base_.default", "events")
def all_gather_buffers(args):
    """FSDP2's all-gather: a flat output staged on the calling thread, then another of the same
    size made by gloo's thread, each let go before the next (CPU audits of FSDP2 under torchrun:
    snapshots/results/cpu-parallel.jsonl's fsdp rows, tests/test_distributed.py)."""
    n = _nbytes(args[0])
    return (), [("alloc", n), ("free", 0), ("alloc", n), ("free", 1)]


@rule("cpu", "c10d._reduce_scatter_base_.default", "events")
def reduce_scatter_buffers(args):
    """FSDP2's reduce-scatter with ReduceOp.AVG: its input staged while gloo's thread divides the
    result by the world size through a wrapped scalar (8 B) and its cast to the output's dtype,
    let go in reverse (snapshots/results/cpu-parallel.jsonl's fsdp rows,
    tests/test_distributed.py)."""
    out, inp = args[0], args[1]
    return (), [("alloc", _nbytes(inp)), ("alloc", 8), ("alloc", out.element_size()),
                ("free", 2), ("free", 1), ("free", 0)]


@rule("cpu", "fsdp.chunk_cat.default", "events")
def chunk_cat_pads(args):
    """The padded copies CPU _chunk_cat makes (FSDP2's reduce-scatter input: each gradient split
    into `chunks` rows of the buffer) of the tensors whose size along `dim` the chunks do not
    divide: padded up to the next multiple, made in order after the output, let go in order as it
    returns (tests/test_distributed.py's FSDP2 with dimensions that do not split evenly)."""
    tensors, dim, chunks = args[0], args[1], args[2]
    pads = [_nbytes(t) // max(t.shape[dim], 1) * (-(-t.shape[dim] // chunks) * chunks)
            for t in tensors if t.shape[dim] % chunks]
    return (), [("alloc", n) for n in pads] + [("free", k) for k in range(len(pads))]


def _nbytes(t):
    return t.numel() * t.element_size()
