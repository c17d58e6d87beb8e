"""Kernel probes: what a CPU kernel allocates inside itself, asked of the kernel (issue #28).

Fake tensors give an op's outputs, not what its kernel allocates while it runs, and oneDNN's
kernels on CPU allocate by rules that depend on the CPU (its ISA, the primitive chosen, the
thread count), not only on shapes: an LSTM layer's workspace is an output whose fake tensor has
0 bytes (151,552 B real for a 12 x 4 x 48 layer), a convolution reorders its weight into a
buffer before its output, batch norm's CPU kernel makes two statistics buffers beside its outputs,
and on CPUs with native bf16 a bf16 matmul runs through oneDNN with scratch buffers after its
output. For the ops in PROBED (and the bf16 matmuls where the CPU has that path) the shadow runs
the real kernel once, at the same shapes, strides and dtypes, on zero-filled CPU tensors, under
the profiler's memory events, and replays its allocations and frees in their order: which are
its outputs (and their real size), which are its own buffers. The answer is cached per call
signature, thread count, grad mode and whether oneDNN is on, for the process: GPT-2's 48
blocks ask once.

What it costs: one real kernel per distinct call, at the size predicted (for a CPU step, the
size it will run at), its inputs and outputs at most LIMIT bytes. What it cannot do: probe a larger call,
or inside another profile (an Audit recording on CPU): such a call keeps its fake sizes and the
result lists it under "unprobed".
Plain Python until called: torch is imported inside the functions.
"""

import contextlib

PROBED = frozenset((
    "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward",  # LSTM layers: the workspace, weight reorders, scratch
    "convolution", "convolution_backward",  # the weight's reorder into oneDNN's layout
    "native_batch_norm", "native_batch_norm_backward",  # the CPU kernel's statistics buffers
    # group norm's mean and rstd: fp32 for a bf16 input on CPU, where the fake kernel says bf16
    # (a GroupNorm U-Net in bf16 autocast: 64 B each instead of 128; scripts/zoo_check.py seed 554003)
    "native_group_norm", "native_group_norm_backward",
    # cumsum: every call asked; for a bool or integer input the CPU kernel sums into a temporary of
    # the output's size, made after the output and freed before it returns (transformers'
    # packed-sequence check, (position_diff != 1).cumsum(-1): 648 B for 81 positions;
    # scripts/zoo_check.py seed 418482)
    "cumsum",
    # F.fold / F.unfold: the CPU kernel makes its output empty_like(input), then resize_s it to
    # the output's shape (a fold's output keeps the input's larger storage: 49,152 B for a
    # 12,288 B (4, 3, 16, 16) result; an unfold's grows it, reallocating). A patch denoiser
    # trained through fold and unfold: 86,016 B under at its peak (scripts/user_loops_c.py)
    "col2im", "im2col",
    # CPU kernels that make buffers of their own beside their outputs (index and weight tables,
    # a contiguous copy of their input, a transposed layout, a sort's scratch): each a miss of
    # 8 B to 188 KB at the peak of its op's training loop in scripts/op_loops.py (PyTorch's
    # OpInfo samples as loops), exact once asked
    *(f"{op}{bw}" for bw in ("", "_backward") for op in (
        "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool2d", "adaptive_max_pool3d",
        "avg_pool2d", "avg_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
        "grid_sampler_2d", "grid_sampler_3d", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
        "replication_pad1d", "replication_pad2d", "replication_pad3d")),
    "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle",
    "_fft_r2c", "_fft_c2r", "_fft_c2c", "kthvalue", "median", "nanmedian", "sort", "var_mean", "std_mean",
    "_embedding_bag", "_embedding_bag_backward", "_embedding_bag_dense_backward", "_embedding_bag_per_sample_weights_backward",
    # nn.Bilinear: the CPU kernel contracts through bmm on permuted copies of its inputs (a 1,536 B
    # buffer beside a 96 B output for a (24, 16) x (24, 16) -> 1 call; its backward calls it again):
    # a factorisation machine's loop 14,592 B under at its peak (scripts/user_loops_f.py)
    "_trilinear",
    # householder_product's CPU kernel: a workspace of n + 1 elements beside its output (28 B for a
    # 6 x 6 orthogonal weight, parametrizations.orthogonal's householder map)
    "linalg_householder_product",
))
# bf16 (fp16) matmuls on CPUs where they run through oneDNN (torch.ops.mkldnn._is_mkldnn_bf16_supported(),
# _is_mkldnn_fp16_supported())
MATMULS = frozenset(("mm", "addmm", "bmm", "baddbmm"))
# and CPU flash attention in bf16 (fp16) there: its blocks run through oneDNN's brgemm, which packs
# and allocates per block inside the backward (a bf16 SDPA audit on an AMD EPYC with avx512_bf16:
# 67,328 B, 4 B and 71,296 B made and freed per block at T=256, head size 16); elsewhere, and in
# fp32, flash_cpu_buffers' rule answers
FLASH_CPU = frozenset(("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"))

LIMIT = 256 << 20  # a call whose inputs and outputs take more is not run (named in "unprobed")
_CACHE = {}  # call signature -> (entries, {output index: (shape, stride, dtype)})
_NATIVE = {}  # dtype -> whether its matmuls go through oneDNN here, asked once


@contextlib.contextmanager
def plain_bf16():
    """Predict as on a CPU whose bf16 matmuls do not go through oneDNN (where the committed grid
    rows and snapshots/shadow-grids were measured), whatever this CPU does."""
    import torch
    native(torch.bfloat16)
    saved = dict(_NATIVE)
    _NATIVE[torch.bfloat16] = False
    try:
        yield
    finally:
        _NATIVE.clear()
        _NATIVE.update(saved)


@contextlib.contextmanager
def on_cpu(facts, dtype):
    """Predict as on the CPU an audit ran on (recorder.cpu_info's facts; None: this one): its
    thread count (per-thread kernel buffers) and whether its bf16 matmuls went through oneDNN.
    A bf16 step measured through oneDNN cannot be asked of this CPU's kernels where they do not:
    ValueError."""
    if not facts:
        yield
        return
    import torch
    plain = dtype == "bfloat16" and not facts.get("onednn_bf16", False)
    if dtype == "bfloat16" and not plain and not native(torch.bfloat16):
        raise ValueError("this bf16 step ran its matmuls through oneDNN (the audit's CPU); this CPU's do not, so "
                         "their buffers cannot be asked of its kernels: predict it on a CPU with oneDNN bf16")
    threads = torch.get_num_threads()
    torch.set_num_threads(facts.get("threads") or threads)
    try:
        with plain_bf16() if plain else contextlib.nullcontext():
            yield
    finally:
        torch.set_num_threads(threads)


def wanted(name, args, ruled=False):
    """Whether a CPU op (its short name) is one whose kernel the shadow asks: an op of PROBED,
    any op given an expanded tensor (a zero stride: the gradient a sum's backward hands on),
    which a kernel may first copy whole (mm, softmax's and gelu's backward: scripts/op_loops.py),
    a native bf16 matmul or flash attention. ruled: shadow/cpu's rules answer this call (its
    wrapped scalars, casts, a rule of its own): an expanded input does not make it asked."""
    if name in PROBED:
        return True
    if _expanded(args) and not ruled and not name.endswith("_") and name not in NOT_PROBED:
        return True
    if name not in MATMULS and name not in FLASH_CPU:
        return False
    import torch
    return any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) and native(a.dtype)
               for a in args)


def _expanded(args):
    import torch
    return any(isinstance(a, torch.Tensor) and a.layout == torch.strided and a.device.type == "cpu"
               and any(st == 0 and sz > 1 for sz, st in zip(a.shape, a.stride())) for a in args)


# ops that make no memory of their own from an expanded input (views, copies into place)
NOT_PROBED = frozenset(("expand", "view", "as_strided", "alias", "detach", "clone", "copy", "_to_copy", "contiguous",
                        "slice", "select", "transpose", "permute", "t", "unsqueeze", "squeeze", "reshape",
                        "_reshape_alias", "unfold", "lift_fresh", "empty_like", "zeros_like", "ones_like"))


def native(dtype):
    """Whether this CPU runs `dtype` (bf16, fp16) matmuls through oneDNN."""
    if dtype not in _NATIVE:
        import torch
        ask = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
        _NATIVE[dtype] = bool(getattr(torch.ops.mkldnn, ask)())
    return _NATIVE[dtype]


def flash_cpu_buffers(func, args):
    """[bytes] CPU flash attention allocates after its outputs, in order (FlashAttentionKernel.cpp,
    no mask): per thread, forward an accumulate-type buffer of qS*kvS + 2*qS + qS*head and, for
    bf16/fp16, qS*kvS of the input's type; backward 2*qS*kvS of each, then the calling thread's
    row sums (qS; the other threads' are made where the CPU profiler does not see them), and first
    a copy of grad_out where it is not laid out (B, L, H, E), freed last (nn.MultiheadAttention's,
    whose output it permutes to (L, B, H, E): 6,144 B under in scripts/user_loops_d.py's token
    pruning loop; the kernel run at grad_out in (B, L, H, E), (B, H, L, E) and (L, B, H, E)). qS is
    32, 64 from the query's length 192, 256 from 768, and at most that length; kvS is min(the key's
    length, 512) (cross-attention: Whisper's decoder over its encoder, 12 queries and 32 keys,
    scripts/user_loops.py; tests/test_known_values.py's CrossAttended)."""
    import torch
    ops = torch.ops.aten
    forward = func is ops._scaled_dot_product_flash_attention_for_cpu.default
    if not forward and func is not ops._scaled_dot_product_flash_attention_for_cpu_backward.default:
        return []
    q, k = (args[0], args[1]) if forward else (args[1], args[2])
    T, head = q.shape[2], q.shape[3]
    qs = min(T, 256 if T >= 768 else 64 if T >= 192 else 32)
    kvs, threads, low = min(k.shape[2], 512), torch.get_num_threads(), q.dtype in (torch.bfloat16, torch.float16)
    if forward:
        out = [4 * threads * (qs * kvs + 2 * qs + qs * head)]
        return out + ([threads * qs * kvs * q.element_size()] if low else [])
    grad_out = args[0]
    copy = [] if grad_out.transpose(1, 2).is_contiguous() else [grad_out.numel() * grad_out.element_size()]
    out = copy + [4 * threads * 2 * qs * kvs] + ([threads * 2 * qs * kvs * q.element_size()] if low else [])
    return out + [4 * qs]


def sequence(func, args, kwargs, real_shape, out_bytes=0):
    """The kernel's allocations and frees at these arguments: ([("alloc", output index or None,
    bytes) | ("free", index of the entry it frees)], {output index: (shape, stride, dtype) of the
    real output}), or None where no probe can run (a profile is already recording).
    real_shape(t) gives a fake tensor's real (shape, stride, dtype) where a probe learnt one that
    differs (an LSTM workspace fed back to its backward), else None. None also where the real
    kernel refuses the arguments the fake kernels made, or where its inputs and outputs
    (out_bytes, the fake outputs') take more than LIMIT."""
    import torch
    from torch.utils._pytree import tree_map
    if torch.autograd.profiler._is_profiler_enabled:
        return None
    if any(isinstance(a, torch.Tensor) and a.numel() == 0 and real_shape(a) is None for a in args):
        return None  # a buffer whose real size no probe learnt: the kernel would read past it
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    # an expanded input counts whole: the kernel may copy it so (a 4 B storage seen as 8192 x 50257)
    if sum(max(a.untyped_storage().nbytes(), a.numel() * a.element_size()) for a in tensors) + out_bytes > LIMIT:
        return None  # too large to run for a prediction: left unasked (the result says so)
    key = _signature(func, args, kwargs, real_shape, torch)
    if key not in _CACHE:
        _CACHE[key] = _probe(func, args, kwargs, real_shape, torch, tree_map)
    return _CACHE[key]  # None: the kernel refused the call


def _signature(func, args, kwargs, real_shape, torch):
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("T", real_shape(a) or (tuple(a.shape), tuple(a.stride()), a.dtype), a.requires_grad)
        if isinstance(a, (list, tuple)):
            return tuple(one(x) for x in a)
        return a
    return (func, one(list(args)), one(sorted(kwargs.items())), torch.get_num_threads(), torch.is_grad_enabled(),
            torch.backends.mkldnn.enabled)  # oneDNN switched off: PyTorch's own CPU kernels answer


def _probe(func, args, kwargs, real_shape, torch, tree_map):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real(a):
        if not isinstance(a, torch.Tensor):
            return a
        shape, stride, dtype = real_shape(a) or (a.shape, a.stride(), a.dtype)
        return torch.empty_strided(shape, stride, dtype=dtype, device="cpu").zero_()
    # grad mode as the call has it: an LSTM layer makes its workspace only with grad enabled
    with unset_fake_temporarily(), torch.autocast("cpu", enabled=False):
        r_args, r_kwargs = tree_map(real, list(args)), tree_map(real, dict(kwargs))
        try:
            events, out = _profiled(func, r_args, r_kwargs, torch)
        except Exception:  # the kernel refuses what the fake kernels made (a dtype): not asked
            return None
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])]
        at = {o.untyped_storage().data_ptr(): j for j, o in reversed(list(enumerate(outs)))
              if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes()}
        shapes = {j: (tuple(o.shape), tuple(o.stride()), o.dtype) for j, o in enumerate(outs)
                  if isinstance(o, torch.Tensor)}
    return _entries(events, at), shapes


def _profiled(func, args, kwargs, torch):
    """[(ptr, bytes: + alloc, - free)] of the CPU allocations the call makes, in order, and its
    result."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import OpTree
    from ...nodynamo import inductor_not_offered
    cpu = torch.profiler.ProfilerActivity.CPU
    with inductor_not_offered(), torch.profiler.profile(activities=[cpu], profile_memory=True) as prof:
        out = func(*args, **kwargs)
    events = [(e.extra_fields.ptr, e.extra_fields.alloc_size) for e in OpTree(prof.profiler.kineto_results).sorted_nodes
              if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"]
    return events, out


def _entries(events, outputs):
    """The probe's events as entries: an allocation still live at the end at an output's address
    is that output; one freed inside is the kernel's own buffer; one neither (a cache the kernel
    keeps past the call, made once per process) is left out (its action None)."""
    entries, live = [], {}
    for ptr, size in events:
        if size > 0:
            live[ptr] = len(entries)
            entries.append(["alloc", None, size])
        elif ptr in live:
            entries.append(["free", live.pop(ptr), -size])
    for ptr, i in live.items():
        if ptr in outputs:
            entries[i][1] = outputs[ptr]
        else:
            entries[i][0] = None
    return [tuple(e) for e in entries]
