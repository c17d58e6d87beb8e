"""What a CUDA step does that a CPU shadow run must be told: autocast's CUDA policy, CUDA's kernel
choices and the allocations made inside CUDA kernels (issue #26).

The shadow of a CUDA step runs on meta tensors that stand for the GPU's (meta(): shapes, dtypes
and storage sizes, C++ kernels, no memory): on the CPU build autograd's engine cannot run a fake
CUDA tensor's backward, and torch.autocast("cuda") turns itself off without a GPU. So what CUDA
does differently is added here, each rule read from the committed tiny CUDA audits
(snapshots/examples/cuda-tiny-*, H100, torch 2.11) event by event:
  autocast_casts     CUDA autocast's policy (shadow_gpu.Autocast: ATen's op lists), its fp32
                     leaf casts cached until the region ends, F.softmax/F.log_softmax called by
                     the model in fp32 (fp16 in: one fp32 output, CUDA's half-to-float kernel;
                     bf16 in: a cast first: softmax_fp32); cross_entropy's own log_softmax in
                     the logits' dtype (measured: log_softmax.result fp16, nll_loss.self fp32:
                     cross_entropy_cuda)
  kernel_choices     clip_grad_norm_'s foreach path; SDPA through cuDNN's attention (fp16/bf16 on
                     an H100: philox seed and offset, 8 B each, made before its output) or
                     efficient attention (fp32: logsumexp padded to 32, seed and offset on the
                     host); dropout through the fused kernel (a bool mask, made before the output)
  foreach_norm_buffer  CUDA's _foreach_norm writes per-chunk partial norms to a buffer of
                     4 B x tensors x (the largest tensor's chunks of 65,536 elements), made
                     before its outputs and freed before it returns
  softmax_backward_buffer  softmax's backward makes a buffer of grad's size (grad * output's
                     dtype: fp32 for the half-to-float softmax, fp16 input) after its output,
                     freed first; fp32 in and out too (H200, torch 2.11: manual attention, fp32
                     and bf16)
  cudnn_attention_buffers  256 B after cuDNN attention's forward outputs; after its backward's,
                     an fp32 copy of q + the logsumexp + 256 B (one shape measured)
  cublas_workspace   each thread's first GEMM makes its workspace (shadow_tracker), after the
                     GEMM's output; each thread's first addmm (a Linear with a bias: cuBLASLt's
                     bias epilogue) then makes cuBLASLt's, CUBLASLT_WORKSPACE_SIZE KiB (1 MiB;
                     measured on an H200, torch 2.11: every random config with bias=True, one per
                     thread that ran an addmm, the backward thread's under full checkpointing)
The inputs: train.py makes the batch on the host and copies it to the GPU; only the copies (x,
then y) are device memory. Wrapped scalars, RNG states and the foreach/for AdamW's `step` are
host tensors on a CUDA run: no device memory (any CPU tensor an op of the step returns is
left out: shadow_tracker). Checkpointing's recomputation runs under the same
rules (shadow_gpu.recomputed). Plain Python until a shadow run starts: torch is imported inside.
"""

import contextlib


RULES = ("autocast_casts", "kernel_choices", "foreach_norm_buffer", "softmax_backward_buffer",
         "cudnn_attention_buffers", "cublas_workspace")
GEMMS = frozenset(("mm", "addmm", "bmm", "baddbmm"))  # the aten ops that reach cuBLAS
_FOREACH_CHUNK = 65536  # elements per chunk of multi_tensor_apply's kernels
# made and freed by cuDNN's attention kernels after their outputs, one H100 config measured (B 4,
# 2 heads, T 64, head 32, bf16): 256 B in forward; 67,840 B in backward, read as an fp32 copy of
# q (65,536) + the logsumexp (2,048) + the same 256. How either scales, no committed trace tells.
_CUDNN_ATTENTION_BUFFER = 256
_EMBEDDING_DIRECT = 3072  # indices up to which CUDA's embedding backward needs no sort
_CUB_SCAN = 1279  # cub's scan storage in the embedding backward (the same at N 4,096-12,288)


def softmax_fp32(name, args, kwargs):
    """F.softmax/F.log_softmax under CUDA autocast: computed in fp32. CUDA's kernel reads fp16
    and writes fp32 in one step; other dtypes are cast first (aten's softmax with dtype=float)."""
    import torch
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    op = torch._softmax if name == "softmax" else torch._log_softmax
    if x.dtype == torch.float16:
        return op(x, dim, True)
    return op(x.to(torch.float32), dim, False)


def cross_entropy_cuda(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """cross_entropy as CUDA autocast runs it: log_softmax in the logits' dtype, nll_loss in fp32."""
    import torch
    import torch.nn.functional as F
    if (weight is not None or label_smoothing or size_average is not None or reduce is not None
            or target.is_floating_point()):
        raise ValueError("the shadow's CUDA autocast covers cross_entropy with class-index targets, weight=None and "
                         "label_smoothing=0 only")
    lsm = torch.log_softmax(input, 1 if input.dim() > 1 else 0)
    return F.nll_loss(lsm.to(torch.float32), target, ignore_index=ignore_index, reduction=reduction)


def before_outputs(func, args):
    """[bytes] a CUDA kernel allocates before its outputs and frees before it returns."""
    import torch
    if func is torch.ops.aten._foreach_norm.Scalar:  # per-chunk partial norms, one group
        chunks = max((-(-t.numel() // _FOREACH_CHUNK) for t in args[0]), default=0)
        return [4 * len(args[0]) * chunks]
    if func is torch.ops.aten.embedding.default and not args[1].is_contiguous():
        # non-contiguous indices (BERT's token type ids, expanded) copied before the output (zoo
        # H100 traces, seed 408334: BERT)
        return [args[1].numel() * args[1].element_size()]
    return []


def kernel_events(func, args):
    """(before, after): the temporaries a CUDA kernel makes and frees before and after its
    outputs, where they interleave, as ("alloc", bytes) | ("free", k) (k: the k-th alloc of the
    two lists together); None for the other ops. Read from the H200 audits (torch 2.11):
      efficient attention's backward (fp32 SDPA; 91 random tiny configs, head size 16 and 32,
        T 16-256): a buffer of q's size and an fp32 row buffer (B x heads x T), a second row
        buffer made and freed at once with several heads, then a workspace of
        B x heads x ceil(T/64) x (64 x 64 fp32 + 16 B);
      the embedding's backward over more than 3,072 indices (CUDA sorts them; 11 GPT-2-sized
        runs, N = B x T 4,096-12,288, vocabulary 50,304): three int64 index arrays and cub's
        radix-sort storage (16N + 1,024 x ceil(N/4,608) + 16,895 B, fitted to the four N) before
        the output, then segment arrays, cub's scan storage (1,279 B) twice and the partial
        sums of N + N/10 segments in fp32."""
    import torch
    if func is torch.ops.aten._scaled_dot_product_efficient_attention_backward.default:
        B, nh, T, _ = args[1].shape  # grad_out, query, key, value, bias, out, logsumexp, ...
        row = 4 * B * nh * T
        after = [("alloc", 4 * args[1].numel()), ("alloc", row)]  # allocs 0 and 1
        if nh > 1:
            after += [("alloc", row), ("free", 2)]
        workspace = B * nh * -(-T // 64) * (64 * 64 * 4 + 16)
        last = 3 if nh > 1 else 2  # the workspace's place among the allocs
        return [], after + [("free", 0), ("alloc", workspace), ("free", 1), ("free", last)]
    if func is torch.ops.aten.embedding_dense_backward.default:
        grad, indices, scale_by_freq = args[0], args[1], args[4]
        n = indices.numel()
        if n <= _EMBEDDING_DIRECT or scale_by_freq:
            return None
        idx, parts = 8 * n, n + n // 10
        sort = 16 * n + 1024 * -(-n // 4608) + 16895
        before = [("alloc", idx), ("alloc", idx), ("alloc", idx), ("alloc", sort), ("free", 3), ("free", 2)]
        after = [("alloc", idx), ("alloc", 8), ("alloc", idx), ("alloc", _CUB_SCAN), ("free", 7), ("free", 6),
                 ("alloc", idx), ("alloc", idx), ("alloc", _CUB_SCAN), ("free", 10),
                 ("alloc", 8), ("alloc", 8 * parts), ("alloc", 4 * parts * grad.shape[-1]),
                 ("free", 13), ("free", 12), ("free", 11), ("free", 9), ("free", 8), ("free", 5), ("free", 4),
                 ("free", 1), ("free", 0)]
        return before, after
    return None


# Where the shape-dependent CUDA rules were measured (the committed traces they were read from and
# checked against, event by event): a call outside a rule's sample is predicted by the rule all
# the same, and named in the result's "unmeasured" (predict prints it). The tiny audits
# (snapshots/examples/cuda-tiny-*, H100) and the random H200 audits (snapshots/examples/shadow-cuda,
# 91 in snapshots/results/random/h200-*) have head sizes 16 and 32 and T up to 256; the GPT-2-sized
# H200 runs (snapshots/results/reserved-traces) head size 64 at T 1,024 and vocabulary 50,304.
EFFICIENT_BACKWARD = "efficient attention's backward temporaries"
EMBEDDING_SORT = "the embedding backward's sort storage"
CUDNN_BUFFERS = "cuDNN attention's buffers"
CUMULATIVE_CAST = "a cumulative op's cast of its input"
SAMPLES = {
    EFFICIENT_BACKWARD: "head size 16 or 32, T up to 256 (fp32 SDPA, H200)",
    EMBEDDING_SORT: "N = B x T of 4,096, 8,192, 10,240 or 12,288 over 50,304 rows (H200)",
    CUDNN_BUFFERS: "head size 16 or 32 with T up to 256, or 64 at T 1,024 (H100, H200)",
    CUMULATIVE_CAST: "cumsum of a bool mask to int64 (H100, zoo seed 408334)",
}


def outside_sample(func, args):
    """The SAMPLES rule this call applies outside the shapes it was measured at, in words, or None."""
    import torch
    ops = torch.ops.aten
    rule = shape = None
    if func is ops._scaled_dot_product_efficient_attention_backward.default:
        _, _, T, head = args[1].shape
        if head not in (16, 32) or T > 256:
            rule, shape = EFFICIENT_BACKWARD, f"head size {head}, T {T}"
    elif func is ops.embedding_dense_backward.default:
        n, rows = args[1].numel(), args[2]
        if n > _EMBEDDING_DIRECT and not args[4] and (n not in (4096, 8192, 10240, 12288) or rows != 50304):
            rule, shape = EMBEDDING_SORT, f"N {n} over {rows} rows"
    elif func in (ops._scaled_dot_product_cudnn_attention.default,
                  ops._scaled_dot_product_cudnn_attention_backward.default):
        q = args[0] if func is ops._scaled_dot_product_cudnn_attention.default else args[1]
        _, _, T, head = q.shape
        if not ((head in (16, 32) and T <= 256) or (head == 64 and T == 1024)):
            rule, shape = CUDNN_BUFFERS, f"head size {head}, T {T}"
    elif func in (ops.cumsum.default, ops.cumprod.default) and after_outputs(func, args):
        if func is ops.cumprod.default or args[0].is_floating_point():
            rule, shape = CUMULATIVE_CAST, f"{func.__name__.split('.')[0]} of {str(args[0].dtype).replace('torch.', '')}"
    return None if rule is None else f"{rule} at {shape} (measured: {SAMPLES[rule]})"


def after_outputs(func, args):
    """[bytes] a CUDA kernel allocates after its outputs and frees (first) before it returns."""
    import torch
    if func is torch.ops.aten._scaled_dot_product_cudnn_attention.default:
        return [_CUDNN_ATTENTION_BUFFER]
    if func is torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default:
        q, lse = args[1], args[5]  # grad_out, query, key, value, out, logsumexp, ...
        return [4 * q.numel() + lse.numel() * lse.element_size() + _CUDNN_ATTENTION_BUFFER]
    if func is torch.ops.aten.native_group_norm.default:
        # per-(sample, channel) scale and shift in fp32 after the outputs, where the kernel is not
        # the 1-d or the affine-free one (zoo H100 traces, seed 408334: a U-Net's GroupNorm)
        x, weight, bias, n, c, hxw = args[:6]
        return [4 * n * c] * 2 if hxw != 1 and (weight is not None or bias is not None) else []
    if func in (torch.ops.aten.cumsum.default, torch.ops.aten.cumprod.default):
        # the input cast to the output's dtype (a bool or int mask's cumsum in int64), made after
        # the output (zoo H100 traces, seed 408334: transformers' find_packed_sequence_indices;
        # ATen's impl_func_cum_ops casts `self.to(result dtype)` for cumsum and cumprod alike,
        # but for a 0-dim or empty input; cumprod and a float cast are not measured)
        x, dtype = args[0], (args[2] if len(args) > 2 else None)
        to = dtype or (torch.int64 if not x.is_floating_point() and not x.is_complex() else x.dtype)
        return [x.numel() * to.itemsize] if to != x.dtype and x.dim() and x.numel() else []
    if func is torch.ops.aten._softmax_backward_data.default:
        grad, output = args[0], args[1]  # grad * output, in their promoted dtype
        return [grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize]
    return []


@contextlib.contextmanager
def device_kernels(sdpa_backend, note=None):
    """CUDA's choices where they differ from the CPU's, for the meta tensors that stand for the
    GPU's: clip_grad_norm_ takes its foreach
    path (one _foreach_norm, one _foreach_mul_) as on CUDA tensors, SDPA in fp16/bf16 runs the
    kernel the device picks (cuDNN's on an H100 with torch 2.11), and dropout runs CUDA's fused
    kernel. Yields the torch-function mode (shadow_gpu.recomputed enters it again around a
    recomputation)."""
    import torch
    from torch.nn.utils import clip_grad
    from torch.overrides import TorchFunctionMode

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.scaled_dot_product_attention:
                return _sdpa(sdpa_backend, note, *args, **(kwargs or {}))
            if func is torch.nn.functional.dropout:
                return _dropout(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
    mode = _Mode()
    saved = clip_grad._has_foreach_support, clip_grad._device_has_foreach_support
    clip_grad._has_foreach_support = lambda tensors, device: True
    clip_grad._device_has_foreach_support = lambda device: True
    try:
        with mode:
            yield mode
    finally:
        clip_grad._has_foreach_support, clip_grad._device_has_foreach_support = saved


def _dropout(input, p=0.5, training=True, inplace=False):
    """CUDA's fused dropout (aten native_dropout: the output and a bool mask) where the CPU
    multiplies by a mask of the input's dtype."""
    import torch
    if not training or p == 0.0 or p == 1.0 or inplace or input.numel() == 0:
        return torch.nn.functional.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _sdpa(backend, note, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The kernel CUDA's SDPA picks on an H100 (torch 2.11): without a mask, cuDNN's for fp16/bf16
    (grouped k and v as they are: bf16 Qwen2, zoo H100 traces, seed 408334) and efficient
    attention for fp32 (the fused kernels take no fp32); the math path op by op for fp32 with
    grouped heads (fp32 Qwen2, the same traces). With a mask the math path too, which no trace has
    measured (`note` is told: "not measured on a GPU"). Flash (older GPUs, fp16/bf16) has no
    measured trace: refused."""
    import torch
    low = q.dtype in (torch.float16, torch.bfloat16)
    dt = str(q.dtype).replace("torch.", "")
    if attn_mask is not None or (enable_gqa and not low):
        if attn_mask is not None and note is not None:
            note(f"SDPA with a mask ({dt}) as its math path, op by op (no trace has measured the kernel CUDA picks)")
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                                 scale=scale, enable_gqa=enable_gqa)[0]
    if low and backend != "cudnn":
        raise ValueError(f"the shadow's CUDA SDPA covers cuDNN's kernel (fp16/bf16) and efficient attention "
                         f"(fp32); this call ({dt}, {backend}) takes a kernel no committed trace has measured")
    if low:
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, dropout_p, is_causal, False,
                                                                 scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                                 scale=scale)[0]


def outputs(func, out):
    """[(tensor, bytes)] of an op's outputs in the order CUDA allocates them: the
    cuDNN attention kernel makes its philox seed and offset (8 B each) first, then the output
    and logsumexp; efficient attention's seed and offset stay on the CPU; the fused dropout
    makes its mask before its output."""
    import torch
    from torch.utils._pytree import tree_leaves
    if func is torch.ops.aten._scaled_dot_product_cudnn_attention.default:
        o, lse, seed, offset = out[0], out[1], out[6], out[7]
        return [(seed, 8), (offset, 8), (o, None), (lse, None)]
    if func is torch.ops.aten._scaled_dot_product_efficient_attention.default:
        o, lse = out[0], out[1]  # its philox seed and offset are CPU tensors; lse's T is padded to 32
        B, nh, T = lse.shape
        return [(o, None), (lse, 4 * B * nh * (-(-T // 32) * 32))]
    if func is torch.ops.aten.native_dropout.default:  # the fused kernel makes its bool mask first
        return [(out[1], None), (out[0], None)]
    if isinstance(out, torch.Tensor):  # the common case, without pytree
        return [(out, None)] if out.untyped_storage().nbytes() else []
    return [(t, None) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()]


def to_device(model, tracker):
    """model.to(device): each parameter and buffer copied to the GPU in Module._apply's order
    (a module's children first, then its parameters, then its buffers; a tied weight once)."""
    def visit(module):
        for child in module.children():
            visit(child)
        for t in list(module._parameters.values()) + list(module._buffers.values()):
            if t is not None:
                tracker.adopt(t.untyped_storage())
    visit(model)


@contextlib.contextmanager
def meta():
    """Meta tensors stand for the GPU's: shapes, dtypes and storages of the right size with no
    memory, their kernels in C++ (several times faster than FakeTensorMode's Python dispatch).
    Fused AdamW is allowed on them as on CUDA tensors. The model is built under
    torch.device("meta") (shadow._setup); after that every factory the step calls names its
    device (a tensor's), so no device context stands between each torch call and its kernel."""
    from torch.optim import optimizer
    saved = optimizer._get_fused_kernels_supported_devices
    optimizer._get_fused_kernels_supported_devices = lambda: saved() + ["meta"]
    try:
        yield
    finally:
        optimizer._get_fused_kernels_supported_devices = saved


def batch(B, T):
    """The device copies of train.py's CUDA batch: x, then y (int64)."""
    import torch
    return torch.empty(B, T, dtype=torch.long, device="meta"), torch.empty(B, T, dtype=torch.long, device="meta")
