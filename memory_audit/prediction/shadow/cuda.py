"""What a CUDA step does that a CPU shadow run must be told: autocast's CUDA policy, CUDA's kernel
choices and the allocations made inside CUDA kernels (issue #26).

The shadow of a CUDA step runs on meta tensors that stand for the GPU's (patches.meta: shapes, dtypes
and storage sizes, C++ kernels, no memory): on the CPU build autograd's engine cannot run a fake
CUDA tensor's backward, and torch.autocast("cuda") turns itself off without a GPU. So what CUDA
does differently is added here, each rule read from the committed tiny CUDA audits
(snapshots/examples/cuda-tiny-*, H100, torch 2.11) event by event:
  autocast_casts     CUDA autocast's policy (shadow/autocast.Autocast: ATen's op lists), its fp32
                     leaf casts cached until the region ends, F.softmax/F.log_softmax called by
                     the model in fp32 (fp16 in: one fp32 output, CUDA's half-to-float kernel;
                     bf16 in: a cast first: softmax_fp32); cross_entropy's own log_softmax in
                     the logits' dtype (measured: log_softmax.result fp16, nll_loss.self fp32:
                     cross_entropy_cuda)
  kernel_choices     clip_grad_norm_'s foreach path; SDPA through cuDNN's attention (fp16/bf16 on
                     an H100: philox seed and offset, 8 B each, made before its output) or
                     efficient attention (fp32: logsumexp padded to 32, seed and offset on the
                     host); dropout through the fused kernel (a bool mask, made before the output)
  kernel_buffers     what kernels allocate inside themselves, before, between and after their
                     outputs, and the order of their outputs: one rule per op in shadow/rules/cuda.py
                     (the _foreach_norm partials, cuDNN and efficient attention's buffers, the
                     softmax backward's, the embedding backward's sort, GroupNorm's, a cumulative
                     op's cast, non-contiguous embedding indices), each naming its trace
  cublas_workspace   each thread's first GEMM makes its workspace (shadow/tracker), after the
                     GEMM's output; each thread's first addmm (a Linear with a bias: cuBLASLt's
                     bias epilogue) then makes cuBLASLt's, CUBLASLT_WORKSPACE_SIZE KiB (1 MiB;
                     measured on an H200, torch 2.11: every random config with bias=True, one per
                     thread that ran an addmm, the backward thread's under full checkpointing)
The inputs: train.py makes the batch on the host and copies it to the GPU; only the copies (x,
then y) are device memory. Wrapped scalars, RNG states and the foreach/for AdamW's `step` are
host tensors on a CUDA run: no device memory (any CPU tensor an op of the step returns is
left out: shadow/tracker). Checkpointing's recomputation runs under the same
rules (shadow/autocast.recomputed). Plain Python until a shadow run starts: torch is imported inside.
"""

import contextlib

from .rules import meta_args, parts
from .rules.cuda import SAMPLES

GEMMS = frozenset(("mm", "addmm", "bmm", "baddbmm"))  # the aten ops that reach cuBLAS

# what CUDA runs through cuDNN that the shadow runs op by op or without its workspace: no rule,
# listed as not measured on a GPU wherever a step calls it (the misses are the zoo's H100 and
# H200 loops': snapshots/results/zoo/zoo-cuda-check-*.txt)
UNMODELLED = {
    "rnn": "nn.LSTM/GRU/RNN through cuDNN's RNN kernel, run here op by op: its workspace and reserve space are "
           "not modelled (every GRU and LSTM loop of the H100 and H200 zoo 6 to 50 MB under at the peak)",
    "conv": "convolutions through cuDNN: the workspace of the algorithm it picks is not modelled (the fp32 U-Nets "
            "of the H100 and H200 zoo 0.2 to 4.3 MB off at the peak; the bf16 ones exact)",
}
UNMODELLED_FUNCS = {  # names looked up in torch and torch.nn.functional (torch-function overridable)
    "rnn": ("lstm", "gru", "rnn_tanh", "rnn_relu"),
    "conv": ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
}


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
    """[bytes] a CUDA kernel allocates before its outputs and frees before it returns (its
    shadow/rules/cuda.py rule's)."""
    f = parts("cuda", func).get("before")
    return f(args) if f else []


def after_outputs(func, args):
    """[bytes] a CUDA kernel allocates after its outputs and frees (first) before it returns."""
    f = parts("cuda", func).get("after")
    return f(args) if f else []


def kernel_events(func, args):
    """(before, after): the temporaries a CUDA kernel makes and frees before and after its
    outputs, where they interleave, as ("alloc", bytes) | ("free", k); None for the other ops."""
    f = parts("cuda", func).get("events")
    return f(args) if f else None


def outside_sample(func, args):
    """The rule this call applies outside the shapes it was measured at, in words, or None."""
    f = parts("cuda", func).get("outside")
    found = f(args) if f else None
    return None if found is None else f"{found[0]} at {found[1]} (measured: {SAMPLES[found[0]]})"


@contextlib.contextmanager
def device_kernels(sdpa_backend, note=None):
    """CUDA's choices where they differ from the CPU's, for the meta tensors that stand for the
    GPU's: clip_grad_norm_ takes its foreach
    path (one _foreach_norm, one _foreach_mul_) as on CUDA tensors, SDPA in fp16/bf16 runs the
    kernel the device picks (cuDNN's on an H100 with torch 2.11), and dropout runs CUDA's fused
    kernel, caught by a torch-function mode (inside nn.MultiheadAttention too: patches.inside_modes).
    Yields the torch-function mode (shadow/autocast.recomputed enters it again around a
    recomputation)."""
    import torch
    from torch.nn.utils import clip_grad
    from torch.overrides import TorchFunctionMode
    from .patches import composite, inside_modes, patched

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.scaled_dot_product_attention:
                return _sdpa(sdpa_backend, note, *args, **(kwargs or {}))
            if func is torch.nn.functional.dropout:
                return _dropout(*args, **(kwargs or {}))
            if func is torch.nn.functional.linear:
                return _linear(*args, **(kwargs or {}))
            if note is not None and func in unmodelled:
                note(unmodelled[func])
            if composite(func):
                return inside_modes(self, func, args, kwargs or {})
            return func(*args, **(kwargs or {}))
    unmodelled = {f: UNMODELLED[kind] for kind, names in UNMODELLED_FUNCS.items() for f in
                  [getattr(torch, n, None) for n in names] + [getattr(torch.nn.functional, n, None) for n in names] if f}
    mode = _Mode()
    with patched([(clip_grad, "_has_foreach_support", lambda tensors, device: True),
                  (clip_grad, "_device_has_foreach_support", lambda device: True)]), mode:
        yield mode


def _linear(input, weight, bias=None):
    """F.linear as ATen runs it on device tensors: a 2-D input, or a contiguous one of 3 or more
    dimensions, with a bias as one addmm; otherwise a matmul and, with a bias, `add_` into its
    output. Under a dispatch mode (the shadow's) ATen takes every input for a tensor subclass and
    adds out of place, a second output-sized buffer: nn.MultiheadAttention's packed projection of
    its transposed (batch_first) input, 14.5 MB more than measured in the GPT-2-sized encoder
    ViTs (H200 zoo seeds 424047, 575634). (The CPU path folds such an add into its operand after
    the fact, patches.cpu_rules; here the matmul's output is a view of the mm's, which the fold
    does not take.)"""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter, FakeTensor) for t in (input, weight, bias))
    fused = input.dim() == 2 or (input.dim() >= 3 and input.is_contiguous())
    if bias is None or fused or not plain:  # a real subclass (DTensor): ATen adds out of place itself
        return torch.nn.functional.linear(input, weight, bias)
    out = torch.matmul(input, weight.t())
    return out.add_(bias)


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
    measured trace, nor efficient attention in fp16/bf16 (V100, T4): their meta kernels' outputs,
    and `note` is told."""
    import torch
    low = q.dtype in (torch.float16, torch.bfloat16)
    dt = str(q.dtype).replace("torch.", "")
    if attn_mask is not None or (enable_gqa and not low):
        if attn_mask is not None and note is not None:
            note(f"SDPA with a mask ({dt}) as its math path, op by op (no trace has measured the kernel CUDA picks)")
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                                 scale=scale, enable_gqa=enable_gqa)[0]
    if low and backend in ("flash", "efficient"):  # before Hopper: the kernel's outputs, as its meta kernel gives them
        if note is not None:
            note(f"SDPA through {backend} attention ({dt}) from its meta kernel's outputs (no trace has measured the "
                 f"kernel or its backward's buffers)")
        if backend == "flash":  # sm80 and later (A100)
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                                     scale=scale)[0]  # sm70/sm75 (V100, T4)
    if low and backend != "cudnn":
        raise ValueError(f"the shadow's CUDA SDPA covers cuDNN's, flash and efficient attention (fp16/bf16) and "
                         f"efficient attention (fp32); this call ({dt}, {backend}) takes a kernel it does not know")
    if low:
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, dropout_p, is_causal, False,
                                                                 scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                                 scale=scale)[0]


def outputs(func, out):
    """[(tensor, bytes or None)] of an op's outputs in the order CUDA allocates them: its rule's
    order where shadow/rules/cuda.py has one (cuDNN attention's philox seed and offset first, the fused
    dropout's mask before its output), else the result's tensors as they come."""
    import torch
    from torch.utils._pytree import tree_leaves
    f = parts("cuda", func).get("outputs")
    if f:
        return f(out)
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


def batch(B, T):
    """The device copies of train.py's CUDA batch: x, then y (int64)."""
    import torch
    return torch.empty(B, T, dtype=torch.long, device="meta"), torch.empty(B, T, dtype=torch.long, device="meta")


def plan_kernel(thread, seen):
    """kernel(op, args, kwargs) for inductor_plan.replay of a compiled CUDA wrapper run on
    `thread` ("forward thread": the main one; "backward thread": autograd's): what a kernel the wrapper
    calls allocates inside itself, as the eager shadow's CUDA ops allocate it (shadow/tracker's
    _device_op: the buffers before its outputs, the temporaries among them, its outputs in CUDA's
    order, the buffers after them; each rule of shadow/rules/cuda.py). The extern matmuls
    (`extern_kernels.mm(a, b, out=buf)`) allocate nothing of their own: cuBLAS's workspace is held
    from step 1 on; an addmm with a 1-D bias (cuBLASLt's bias epilogue) adds `thread` to
    seen["cublaslt"] (its first on a thread makes cuBLASLt's workspace, held from then on).
    Rules applied outside the shapes they were read at go to seen["unmeasured"]. Returns
    [("alloc", output index or None, bytes) | ("free", entry index, 0) | ("host", output index, 0):
    an output on the host], or None for no buffers.
    args and kwargs: (size, stride, dtype name) per tensor, as inductor_plan hands them."""
    def kernel(op, args, kwargs):
        import torch
        from torch.utils._pytree import tree_leaves
        if not op.startswith("aten."):
            if op == "addmm" and args and isinstance(args[0], tuple) and len(args[0][0]) == 1:
                seen.setdefault("cublaslt", set()).add(thread)
            return None
        name, overload = op.split(".")[1:]
        func = getattr(getattr(torch.ops.aten, name), overload)
        m_args, m_kwargs = meta_args(args, kwargs)
        outside = outside_sample(func, m_args)
        if outside:
            seen.setdefault("unmeasured", set()).add(outside)
        entries = [("alloc", None, n) for n in before_outputs(func, m_args)]
        made = []
        before, after = kernel_events(func, m_args) or ((), ())
        _play(entries, made, before)
        try:
            out = func(*m_args, **m_kwargs)
        except Exception as e:  # noqa: BLE001 -- no meta kernel: listed as not asked (replay's "unasked")
            return f"its meta kernel failed ({type(e).__name__})"
        flat = tree_leaves(out)
        inputs = {a.untyped_storage()._cdata for a in tree_leaves((m_args, m_kwargs)) if isinstance(a, torch.Tensor)}
        listed = outputs(func, out)
        for t, nbytes in listed:
            # a host tensor (a philox seed kept on the host) is no device memory; an output that is
            # an input's storage (an in-place or aliasing op) is no new allocation
            j = next(i for i, o in enumerate(flat) if o is t)
            if t.device.type == "cpu":
                entries.append(("host", j, 0))
            elif t.untyped_storage()._cdata not in inputs:
                entries.append(("alloc", j, nbytes if nbytes is not None else t.untyped_storage().nbytes()))
        # an output its rule leaves out is not device memory (efficient attention's seed and offset)
        entries += [("host", j, 0) for j, o in enumerate(flat) if isinstance(o, torch.Tensor)
                    and o.untyped_storage().nbytes() and all(o is not t for t, _ in listed)
                    and o.untyped_storage()._cdata not in inputs]
        _play(entries, made, after)
        entries += [("alloc", None, n) for n in after_outputs(func, m_args)]
        return entries or None
    return kernel


def _play(entries, made, events):
    """A rule's ("alloc", bytes) | ("free", k) events as replay's entries (k: the k-th alloc)."""
    for action, n in events:
        if action == "alloc":
            made.append(len(entries))
            entries.append(("alloc", None, n))
        else:
            entries.append(("free", made[n], 0))
