"""What a CUDA reduction allocates beside its output: a buffer and semaphores when it splits each
output's inputs across thread blocks (ATen's ReduceConfig in aten/src/ATen/native/cuda/Reduce.cuh).

A sum over many rows into few outputs (a bias gradient over B x T rows, a loss's mean) has each
output reduced by several blocks that meet in a global buffer: `acc_size x outputs x blocks per
output` bytes (x block width x output vector size where the reduced dimension is not the fastest
one), then `4 x grid columns` bytes of semaphores; both are made after the output and freed before
the kernel returns, the semaphores first. Whether a reduction splits, and into how many blocks,
follows from the shape as TensorIterator lays it out and from the GPU's SM count and threads per
SM (target grid = SMs x (threads per SM // threads per block)).

Measured: `scripts/gpu_reduce.py` on an H200 (132 SMs, 2,048 threads each; torch 2.11,
2026-11-28). `snapshots/results/reduce/h200-reduce-187258.jsonl`: a grid of 42 shapes read with
the source, then 150 random ones (seed 187258: sum, mean, amax, vector norm; rows 1 to 131,072,
outputs 1 to 8,192; fp32, bf16, fp16), all 192 exact, buffer and semaphores.
`h200-reduce-strided-215222.jsonl` (`--strided`, drawn after this rule was written): 200 random
inputs, contiguous, transposed, every other column (offset by one) and, for 3-d ones, permuted
(the file labels 57 contiguous 2-d rows "permuted": their strides say what they are), all 200
exact (49 of them split, 15 of those non-contiguous). Neither file has two kept dims, inputs
other than fp32, fp16 and bf16, or 2 GiB of offsets: those calls are listed as not measured. Plain Python: torch is imported inside the rules.
"""

import contextlib
import contextvars

from . import rule

REDUCTION = "a CUDA reduction's global buffer"
MEASURED_CORES = (132, 2048)  # the H100's and the H200's SMs and threads per SM
_CORES = contextvars.ContextVar("the predicted GPU's (SMs, threads per SM)", default=MEASURED_CORES)
MAX_THREADS = 512  # a reduction block's threads
MIN_VALUES, MAX_VALUES = 16, 256  # values per thread a block split aims between


@contextlib.contextmanager
def on_cores(cores):
    """Reductions sized for a GPU of `cores` = (SMs, threads per SM) inside the block; None: a
    GPU whose SMs are not known (sized as the H200's, and every split listed as not measured)."""
    token = _CORES.set(tuple(cores) if cores else None)
    try:
        yield
    finally:
        _CORES.reset(token)


def _last_pow2(n):
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def _cdiv(a, b):
    return -(-a // b)


def layout(shape, strides, reduced, kept_by_input=False):
    """TensorIterator's dims for a reduction: the reduced ones first, innermost in the input
    first, then the kept ones in the (contiguous) output's order, last dim first; adjacent dims
    merged where the input's strides allow and size-1 dims dropped, as [(size, stride)] per group.
    kept_by_input: the kept ones innermost in the input first instead (what an unmeasured layout
    may take: `outside` asks both)."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    groups = []
    for group in (sorted((d for d in dims if d in reduced), key=lambda d: strides[d]),
                  sorted((d for d in dims if d not in reduced), key=lambda d: strides[d]) if kept_by_input
                  else [d for d in reversed(dims) if d not in reduced]):
        merged = []
        for d in group:
            if merged and merged[-1][0] * merged[-1][1] == strides[d]:
                merged[-1] = (merged[-1][0] * shape[d], merged[-1][1])
            else:
                merged.append((shape[d], strides[d]))
        groups.append(merged)
    return groups


def _output_vector(offset, dims, first_kept):
    """How many outputs one thread loads at once (4, 2 or 1): the largest that divides the
    input's offset, the first kept dim's size and every other dim's stride, in elements."""
    v = 4
    for n in [offset, dims[first_kept][0]] + [s for j, (_, s) in enumerate(dims) if j != first_kept]:
        while n % v:
            v //= 2
    return v


def global_buffers(shape, strides, offset, reduced, acc_size, cores=MEASURED_CORES, kept_by_input=False):
    """[buffer bytes, semaphore bytes] a reduction of a tensor (`shape`, `strides` and `offset`
    in elements) over the dims `reduced` makes beside its output, or [] where each output is
    reduced within one block."""
    red, keep = layout(shape, strides, reduced, kept_by_input)
    dims, n_red = red + keep, len(red)
    inputs = outputs = 1
    for size, _ in red:
        inputs *= size
    for size, _ in keep:
        outputs *= size
    if inputs <= 1 or outputs == 0:
        return []
    fastest = n_red == len(dims) or dims[0][1] < dims[n_red][1]  # reduce along the fastest dim
    dim0, dim1 = (inputs, outputs) if fastest else (outputs, inputs)
    vec = 1
    if dims[0 if fastest else n_red][1] == 1:  # contiguous along that dim: loads vectorized
        if fastest and dim0 > 128 and n_red == 1:
            dim0 //= 4
        elif not fastest:
            vec = _output_vector(offset, dims, n_red)
            dim0 //= vec
    most = MAX_THREADS // vec
    p0 = most if dim0 >= most else _last_pow2(dim0)
    p1 = most if dim1 >= most else _last_pow2(dim1)
    height = min(p1, most // min(p0, 32))
    width = min(p0, most // height)
    step_in, step_out = (width, 1) if fastest else (1, width)
    split_warps = _cdiv(inputs, step_in) >= min(height * 16, MAX_VALUES)
    step_in, step_out = (step_in * height, step_out) if split_warps else (step_in, step_out * height)
    sms, threads = cores
    target = sms * (threads // (width * height))
    grid = _cdiv(outputs // vec, step_out)
    per_thread = _cdiv(inputs, step_in)
    if not (split_warps and per_thread >= MAX_VALUES and grid <= target):
        return []
    blocks = max(min(_cdiv(target, grid), _cdiv(per_thread, MIN_VALUES)), _cdiv(per_thread, MAX_VALUES))
    if blocks <= 1:
        return []
    size = acc_size * outputs * blocks * (1 if fastest else width * vec)
    return [size, 4 * grid]


# op -> (where its reduced dims are among the args, whether it accumulates in the input's dtype)
INDEX_LIMIT = 2 ** 31 - 1  # past this many bytes of offset ATen splits a reduction in 32-bit pieces
_OPS = {
    "aten.sum.dim_IntList": (1, False), "aten.sum.default": (None, False),
    "aten.mean.dim": (1, False), "aten.mean.default": (None, False),
    "aten.amax.default": (1, True), "aten.amin.default": (1, True),
    "aten.linalg_vector_norm.default": (2, False),
}
_FLOATS = ("torch.float32", "torch.float16", "torch.bfloat16")  # the dtypes measured


def _call(op, args):
    """(input, reduced dims, accumulator bytes, the measured kind?) of a reduction's call, or None
    where nothing splits (a 0-d input) or the rule knows no accumulator (complex)."""
    x = args[0]
    if x.dim() == 0 or x.is_complex():
        return None
    at, own_dtype = _OPS[op]
    dims = args[at] if at is not None and len(args) > at else None
    dims = [dims] if isinstance(dims, int) else (dims or [])
    reduced = {d % x.dim() for d in dims} if dims else set(range(x.dim()))
    acc = x.element_size() if own_dtype else 8 if x.dtype.itemsize == 8 or not x.is_floating_point() else 4
    return x, reduced, acc, _measured(x, reduced)


def _measured(x, reduced):
    """Whether a call is of the kind the probe measured: fp32, fp16 or bf16; under 2 GiB of offsets
    (one 32-bit-indexed reduction); kept dims in the input in the output's order."""
    span = x.element_size() * (1 + sum((n - 1) * abs(s) for n, s in zip(x.shape, x.stride())))
    kept = [x.stride(d) for d in range(x.dim()) if d not in reduced and x.shape[d] != 1]
    return str(x.dtype) in _FLOATS and span <= INDEX_LIMIT and kept == sorted(kept, reverse=True)


def _split(call, kept_by_input=False):
    x, reduced, acc, _ = call
    return global_buffers(list(x.shape), list(x.stride()), x.storage_offset(), reduced, acc,
                          _CORES.get() or MEASURED_CORES, kept_by_input)


def _events(op):
    def events(args):
        """The global buffer and the semaphores after the output, the semaphores freed first (the
        H200 reduction probe: snapshots/results/reduce/h200-reduce-*.jsonl, 392 of 392; the zoo
        H200 traces' GPT-2-sized encoder ViTs, 9,830,400 + 24 B in a bias gradient)."""
        call = _call(op, args)
        found = _split(call) if call else []
        if not found:
            return None
        return [], [("alloc", found[0]), ("alloc", found[1]), ("free", 1), ("free", 0)]
    return events


def _outside(op):
    def outside(args):
        """A reduction that splits where the probe did not measure: on a GPU of other (or unknown)
        SMs than the H200's, over another dtype, past 2 GiB of offsets (ATen then reduces in
        32-bit pieces, not modelled), or with kept dims out of the output's order."""
        call = _call(op, args)
        if call is None or (_CORES.get() == MEASURED_CORES and call[3]) or not (_split(call) or _split(call, True)):
            return None
        x, cores = call[0], _CORES.get()
        where = f"{cores[0]} SMs x {cores[1]} threads" if cores else "a GPU of unknown SMs"
        what = "" if call[3] else f", {str(x.dtype).replace('torch.', '')} strides {tuple(x.stride())}"
        return REDUCTION, f"{op.split('.')[1]} of {tuple(x.shape)}{what} on {where}"
    return outside


for _op in _OPS:
    rule("cuda", _op, "events")(_events(_op))
    rule("cuda", _op, "outside")(_outside(_op))
