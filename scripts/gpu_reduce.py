"""What a CUDA reduction allocates beside its output (scripts/GPU_RUNS.md, "CUDA's reduction buffers").

    python3 scripts/gpu_reduce.py --out=FILE.jsonl [--seed=S] [--n=N]

A sum over many rows into few outputs reduces across thread blocks through a global buffer and
a semaphore array, both from the caching allocator; which shapes do so, and how large the two
are, is what a rule needs. Each case runs one reduction on a fresh input and writes one row: the
op, the input's shape and dtype, the output's dtype, and every allocator event the op made
(action, size) in order, read from the allocator's history. A fixed grid first (the shapes of
bias gradients), then N random shapes drawn with the printed seed (rules read from the grid are
checked on them). The first row holds the device's properties the kernel's launch depends on.
"""

import argparse
import json
import random
import sys

import torch

OPS = {
    "sum0": lambda x: x.sum(0),
    "sum01": lambda x: x.sum((0, 1)),
    "sum_last": lambda x: x.sum(-1),
    "mean0": lambda x: x.mean(0),
    "sum0_fp32": lambda x: x.sum(0, dtype=torch.float32),
    "amax0": lambda x: x.amax(0),
    "norm": lambda x: torch.linalg.vector_norm(x),
    "sum_all": lambda x: x.sum(),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def strided(shape, dtype, layout):
    """A tensor of `shape` laid out as `layout`: contiguous, the transpose of a contiguous one,
    every other column of a wider one (offset by one element), or a permuted 3-d one."""
    kw = dict(device="cuda", dtype=DTYPES[dtype])
    if layout == "transposed":
        return torch.randn(tuple(reversed(shape)), **kw).transpose(0, -1)
    if layout == "sliced":
        return torch.randn(tuple(shape[:-1]) + (2 * shape[-1] + 1,), **kw)[..., 1::2]
    if layout == "permuted" and len(shape) == 3:
        return torch.randn(shape[1], shape[0], shape[2], **kw).transpose(0, 1)
    return torch.randn(shape, **kw)  # "permuted" of a 2-d shape too: the row says its strides


def case(op, shape, dtype, layout="contiguous"):
    x = strided(shape, dtype, layout)
    torch.cuda.synchronize()
    marker = torch.empty(1, device="cuda")
    addr = marker.data_ptr()
    out = OPS[op](x)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    start = max(i for i, e in enumerate(trace) if e["action"] == "alloc" and e["addr"] == addr)
    events = [[e["action"], e["size"]] for e in trace[start + 1:]]
    if layout == "permuted" and len(shape) != 3:
        layout = "contiguous"
    row = dict(op=op, shape=list(shape), dtype=dtype, layout=layout, strides=list(x.stride()),
               offset=x.storage_offset(), out_dtype=str(out.dtype).split(".")[-1],
               out_bytes=out.numel() * out.element_size(), events=events)
    del x, out, marker
    return row


def grid():
    for dtype in DTYPES:
        for rows in (512, 1568, 4096, 16384):
            for cols in (64, 768, 3072):
                yield "sum0", (rows, cols), dtype, "contiguous"
        yield "sum01", (8, 196, 768), dtype, "contiguous"
        yield "sum_last", (4096, 768), dtype, "contiguous"


def draws(rng, n, layouts=("contiguous",)):
    for _ in range(n):
        layout = rng.choice(layouts)  # (the draw's order as the committed seeds drew it)
        op = rng.choice(sorted(OPS))
        dtype = rng.choice(sorted(DTYPES))
        rows = int(2 ** rng.uniform(0, 17))
        cols = int(2 ** rng.uniform(0, 13))
        shape = (rng.randint(1, 16), max(1, rows // 8), cols) if op == "sum01" else (rows, cols)
        yield op, shape, dtype, layout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--strided", action="store_true", help="draw non-contiguous inputs too (transposed, "
                    "sliced, permuted), and no grid")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(10 ** 6)
    print("seed", seed, file=sys.stderr)
    p = torch.cuda.get_device_properties(0)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=200000)
    with open(a.out, "w") as f:
        f.write(json.dumps(dict(device=p.name, sm_count=p.multi_processor_count,
                                max_threads_per_sm=p.max_threads_per_multi_processor, seed=seed,
                                torch=torch.__version__)) + "\n")
        fixed = [] if a.strided else list(grid())
        layouts = ("contiguous", "transposed", "sliced", "permuted") if a.strided else ("contiguous",)
        for i, (op, shape, dtype, layout) in enumerate(fixed + list(draws(random.Random(seed), a.n, layouts))):
            row = case(op, shape, dtype, layout)
            row["drawn"] = i >= len(fixed)
            f.write(json.dumps(row) + "\n")
            f.flush()  # a run stopped at its deadline keeps every row written
            extra = [e for e in row["events"] if e[0] == "alloc"]
            print(op, shape, dtype, layout, extra, flush=True)


if __name__ == "__main__":
    main()
