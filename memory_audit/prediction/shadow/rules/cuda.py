"""What CUDA kernels allocate that a shadow run on meta tensors cannot see, one rule per op.

Each rule was read from committed CUDA traces, event by event, and is held by the tests that
replay them; torch 2.11 throughout. The sources, as the rules' docstrings name them:
  the tiny H100 audits           snapshots/examples/cuda-tiny-fp16-manual, cuda-tiny-bf16-sdpa
  the random H200 audits         91 rows in snapshots/results/random/h200-shadow-cuda-*.jsonl (their
                                 peaks), 15 of them kept whole in snapshots/examples/shadow-cuda/h200-*
  the random H100 audits         51 rows in snapshots/results/random/h100-shadow-cuda-*.jsonl, 22
                                 kept whole in snapshots/examples/shadow-cuda/h100-*
  the GPT-2-sized H200 runs      snapshots/results/reserved-traces
  the zoo's H100 traces          snapshots/results/zoo/h100-zoo-408334-runs.tgz (seed 408334; seed
                                 691115's rows out of sample: scripts/zoo_cuda_check.py)
  the zoo's H200 traces          snapshots/results/zoo/h200-zoo-256239-runs.tgz (tiny loops),
                                 snapshots/results/zoo/h200-zoo-gpt2-vit-424047-575634-runs.tgz
                                 (GPT-2-sized encoder ViTs)
  the H200 reduction probe       snapshots/results/reduce/h200-reduce-187258.jsonl,
                                 snapshots/results/reduce/h200-reduce-strided-215222.jsonl
                                 (scripts/gpu_reduce.py; rules/reduce.py)
A shape-dependent rule says where a
call lies outside the shapes it was measured at (its "outside" part, SAMPLES), and the
prediction lists it as not measured on a GPU. The parts are described in shadow/rules/__init__.py.
Plain Python until a rule is called: torch is imported inside.
"""

from . import rule
from .reduce import REDUCTION  # its rules register themselves

FOREACH_CHUNK = 65536  # elements per chunk of multi_tensor_apply's kernels
# made and freed by cuDNN's attention kernels after their outputs, one H100 config measured (B 4,
# 2 heads, T 64, head 32, bf16): 256 B in forward; 67,840 B in backward, read as an fp32 copy of
# q (65,536) + the logsumexp (2,048) + the same 256. How either scales, no committed trace tells.
CUDNN_ATTENTION_BUFFER = 256
EMBEDDING_DIRECT = 3072  # indices up to which CUDA's embedding backward needs no sort
CUB_SCAN = 1279  # cub's scan storage in the embedding backward (the same at N 4,096-12,288)

# the shapes each shape-dependent rule's traces measured: the tiny audits and the random H200
# audits have head sizes 16 and 32 and T up to 256; the GPT-2-sized H200 runs head size 64 at T
# 1,024 and vocabulary 50,304
EFFICIENT_BACKWARD = "efficient attention's backward temporaries"
EMBEDDING_SORT = "the embedding backward's sort storage"
CUDNN_BUFFERS = "cuDNN attention's buffers"
CUMULATIVE_CAST = "a cumulative op's cast of its input"
SAMPLES = {
    EFFICIENT_BACKWARD: "head size 16 or 32, T up to 256 (fp32 SDPA, H200), or 64 at T 196 (the encoder ViTs)",
    EMBEDDING_SORT: "N = B x T of 4,096, 8,192, 10,240 or 12,288 over 50,304 rows (H200)",
    CUDNN_BUFFERS: "head size 16 or 32 with T up to 256, or 64 at T 1,024 (H100, H200)",
    CUMULATIVE_CAST: "cumsum of a bool mask to int64 (H100, zoo seed 408334)",
    REDUCTION: "fp32, fp16 and bf16 inputs on 132 SMs x 2,048 threads (H200, scripts/gpu_reduce.py)",
}

CUDNN_ATTENTION = "aten._scaled_dot_product_cudnn_attention.default"
CUDNN_ATTENTION_BACKWARD = "aten._scaled_dot_product_cudnn_attention_backward.default"
EFFICIENT_ATTENTION_BACKWARD = "aten._scaled_dot_product_efficient_attention_backward.default"
EMBEDDING_BACKWARD = "aten.embedding_dense_backward.default"
CUMULATIVE = ("aten.cumsum.default", "aten.cumprod.default")


@rule("cuda", "aten._foreach_norm.Scalar", "before")
def foreach_norm_buffer(args):
    """_foreach_norm writes per-chunk partial norms to a buffer of 4 B x tensors x (the largest
    tensor's chunks of 65,536 elements), made before its outputs and freed before it returns
    (clip_grad_norm_'s foreach path; the tiny H100 audits, the random H200 audits)."""
    chunks = max((-(-t.numel() // FOREACH_CHUNK) for t in args[0]), default=0)
    return [4 * len(args[0]) * chunks]


@rule("cuda", "aten.embedding.default", "before")
def embedding_index_copy(args):
    """Non-contiguous indices (BERT's token type ids, expanded) are copied before the output
    (zoo H100 traces, seed 408334: BERT; out of sample on seed 691115's BERT rows)."""
    ids = args[1]
    return [] if ids.is_contiguous() else [ids.numel() * ids.element_size()]


@rule("cuda", EFFICIENT_ATTENTION_BACKWARD, "events")
def efficient_attention_backward(args):
    """fp32 SDPA's backward (the random H200 audits, head size 16 and 32, T 16-256; the zoo H200
    traces' GPT-2-sized encoder ViTs, head size 64 at T 196, batch 6 to 8): after
    its outputs a buffer of q's size and an fp32 row buffer (B x heads x T), a second row buffer
    made and freed at once with several heads, then a workspace of
    B x heads x ceil(T/64) x (64 x 64 fp32 + 16 B). Where grad_out read as (B, T, heads, head
    size) is not contiguous (nn.MultiheadAttention's, batch > 1), a contiguous copy of it first,
    before the outputs as ATen's source makes it (the trace cannot tell: it is the outputs' size),
    freed as the kernel returns (zoo H200 traces: the GPT-2-sized encoder ViTs, head size 64, T 196)."""
    grad_out = args[0]  # grad_out, query, key, value, bias, out, logsumexp, ...
    B, nh, T, _ = args[1].shape
    row = 4 * B * nh * T
    copy = 0 if grad_out.transpose(1, 2).is_contiguous() else 1
    before = [("alloc", grad_out.numel() * grad_out.element_size())] if copy else []
    after = [("alloc", 4 * args[1].numel()), ("alloc", row)]  # allocs copy and copy + 1
    if nh > 1:
        after += [("alloc", row), ("free", copy + 2)]
    workspace = B * nh * -(-T // 64) * (64 * 64 * 4 + 16)
    last = copy + (3 if nh > 1 else 2)  # the workspace's place among the allocs
    after += [("free", copy), ("alloc", workspace), ("free", copy + 1), ("free", last)]
    return before, after + ([("free", 0)] if copy else [])


@rule("cuda", EFFICIENT_ATTENTION_BACKWARD, "outside")
def efficient_attention_backward_sample(args):
    _, _, T, head = args[1].shape
    measured = (head in (16, 32) and T <= 256) or (head, T) == (64, 196)
    return None if measured else (EFFICIENT_BACKWARD, f"head size {head}, T {T}")


@rule("cuda", EMBEDDING_BACKWARD, "events")
def embedding_backward_sort(args):
    """The embedding's backward over more than 3,072 indices sorts them (11 GPT-2-sized H200
    runs, N = B x T 4,096-12,288, vocabulary 50,304): three int64 index arrays and cub's
    radix-sort storage (16N + 1,024 x ceil(N/4,608) + 16,895 B, fitted to the four N) before the
    output, then segment arrays, cub's scan storage (1,279 B) twice and the partial sums of
    N + N/10 segments in fp32."""
    grad, indices, scale_by_freq = args[0], args[1], args[4]
    n = indices.numel()
    if n <= EMBEDDING_DIRECT or scale_by_freq:
        return None
    idx, parts = 8 * n, n + n // 10
    sort = 16 * n + 1024 * -(-n // 4608) + 16895
    before = [("alloc", idx), ("alloc", idx), ("alloc", idx), ("alloc", sort), ("free", 3), ("free", 2)]
    after = [("alloc", idx), ("alloc", 8), ("alloc", idx), ("alloc", CUB_SCAN), ("free", 7), ("free", 6),
             ("alloc", idx), ("alloc", idx), ("alloc", CUB_SCAN), ("free", 10),
             ("alloc", 8), ("alloc", 8 * parts), ("alloc", 4 * parts * grad.shape[-1]),
             ("free", 13), ("free", 12), ("free", 11), ("free", 9), ("free", 8), ("free", 5), ("free", 4),
             ("free", 1), ("free", 0)]
    return before, after


@rule("cuda", EMBEDDING_BACKWARD, "outside")
def embedding_backward_sample(args):
    n, rows = args[1].numel(), args[2]
    if n > EMBEDDING_DIRECT and not args[4] and (n not in (4096, 8192, 10240, 12288) or rows != 50304):
        return EMBEDDING_SORT, f"N {n} over {rows} rows"
    return None


@rule("cuda", CUDNN_ATTENTION, "outputs")
def cudnn_attention_outputs(out):
    """cuDNN's attention (fp16/bf16 SDPA on an H100) makes its philox seed and offset (8 B each)
    first, then the output and the logsumexp (the tiny H100 audit in bf16 SDPA)."""
    return [(out[6], 8), (out[7], 8), (out[0], None), (out[1], None)]


@rule("cuda", CUDNN_ATTENTION, "after")
def cudnn_attention_buffer(args):
    """256 B after cuDNN attention's forward outputs, freed before it returns (the tiny bf16 SDPA
    H100 audit and the random H100 audits)."""
    return [CUDNN_ATTENTION_BUFFER]


@rule("cuda", CUDNN_ATTENTION_BACKWARD, "after")
def cudnn_attention_backward_buffer(args):
    """After cuDNN attention's backward outputs: an fp32 copy of q + the logsumexp + 256 B, freed
    before it returns (read at one shape; the random H100 audits and the GPT-2-sized H200 runs
    check it)."""
    q, lse = args[1], args[5]  # grad_out, query, key, value, out, logsumexp, ...
    return [4 * q.numel() + lse.numel() * lse.element_size() + CUDNN_ATTENTION_BUFFER]


def _cudnn_sample(q):
    _, _, T, head = q.shape
    if (head in (16, 32) and T <= 256) or (head == 64 and T == 1024):
        return None
    return CUDNN_BUFFERS, f"head size {head}, T {T}"


@rule("cuda", CUDNN_ATTENTION, "outside")
def cudnn_attention_sample(args):
    return _cudnn_sample(args[0])


@rule("cuda", CUDNN_ATTENTION_BACKWARD, "outside")
def cudnn_attention_backward_sample(args):
    return _cudnn_sample(args[1])


@rule("cuda", "aten._scaled_dot_product_efficient_attention.default", "outputs")
def efficient_attention_outputs(out):
    """Efficient attention (fp32 SDPA): its philox seed and offset stay on the host; the
    logsumexp's T is padded to 32 (the random H200 audits)."""
    o, lse = out[0], out[1]
    B, nh, T = lse.shape
    return [(o, None), (lse, 4 * B * nh * (-(-T // 32) * 32))]


@rule("cuda", "aten.native_dropout.default", "outputs")
def fused_dropout_outputs(out):
    """CUDA's fused dropout makes its bool mask before its output (the random H200 audits with
    dropout)."""
    return [(out[1], None), (out[0], None)]


@rule("cuda", "aten.native_group_norm.default", "after")
def group_norm_scale_shift(args):
    """Per-(sample, channel) scale and shift in fp32 after the outputs, where the kernel is not
    the 1-d or the affine-free one (zoo H100 traces, seed 408334: a U-Net's GroupNorm; its
    peaks exact on seed 691115's three U-Nets)."""
    x, weight, bias, n, c, hxw = args[:6]
    return [4 * n * c] * 2 if hxw != 1 and (weight is not None or bias is not None) else []


@rule("cuda", CUMULATIVE, "after")
def cumulative_cast(args):
    """The input cast to the output's dtype (a bool or int mask's cumsum in int64), made after the
    output (zoo H100 traces, seed 408334: transformers' find_packed_sequence_indices; ATen's
    impl_func_cum_ops casts `self.to(result dtype)` for cumsum and cumprod alike, but for a 0-dim
    or empty input)."""
    import torch
    x, dtype = args[0], (args[2] if len(args) > 2 else None)
    to = dtype or (torch.int64 if not x.is_floating_point() and not x.is_complex() else x.dtype)
    return [x.numel() * to.itemsize] if to != x.dtype and x.dim() and x.numel() else []


@rule("cuda", "aten.cumsum.default", "outside")
def cumsum_cast_sample(args):
    """A float input's cast is not measured."""
    if cumulative_cast(args) and args[0].is_floating_point():
        return CUMULATIVE_CAST, f"cumsum of {str(args[0].dtype).replace('torch.', '')}"
    return None


@rule("cuda", "aten.cumprod.default", "outside")
def cumprod_cast_sample(args):
    """cumprod's cast is not measured."""
    if cumulative_cast(args):
        return CUMULATIVE_CAST, f"cumprod of {str(args[0].dtype).replace('torch.', '')}"
    return None


@rule("cuda", "aten._softmax_backward_data.default", "after")
def softmax_backward_buffer(args):
    """softmax's backward makes a buffer of grad's size (grad * output, in their promoted dtype:
    fp32 for the half-to-float softmax, fp16 input) after its output, freed first (the tiny fp16
    H100 audit; fp32 in and out too: random H200 audits, manual attention, fp32 and bf16)."""
    import torch
    grad, output = args[0], args[1]
    return [grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize]


@rule("cuda", "aten.native_layer_norm.default", "before")
def layer_norm_input_copy(args):
    """A non-contiguous X is copied contiguous before the outputs (X.expect_contiguous()), freed
    as it returns: every LayerNorm of a pre-norm encoder whose residual stream keeps a patch
    embedding's transposed layout (zoo H200 traces: the GPT-2-sized encoder ViTs of seeds 424047
    and 575634, 4.8 MB at B 8, the two un-checkpointed ones' forwards event by event; seed
    256239's row 37)."""
    x = args[0]
    return [] if x.is_contiguous() else [x.numel() * x.element_size()]


@rule("cuda", "aten.native_layer_norm_backward.default", "before")
def layer_norm_backward_input_copy(args):
    """The backward copies a non-contiguous saved X the same way, before its outputs (zoo H200
    traces: seed 256239's row 37, a tiny encoder ViT)."""
    x = args[1]  # grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
    return [] if x.is_contiguous() else [x.numel() * x.element_size()]


@rule("cuda", "aten.native_layer_norm_backward.default", "after")
def layer_norm_backward_grad_copy(args):
    """A non-contiguous grad_out is copied contiguous after the gradients are made, for the
    kernel's call alone: freed first (zoo H200 traces: the GPT-2-sized encoder ViTs, whose
    residual stream's gradient keeps the patch embedding's transposed layout)."""
    g = args[0]
    return [] if g.is_contiguous() else [g.numel() * g.element_size()]


@rule("cuda", "aten.convolution_backward.default", "before")
def convolution_backward_grad_copy(args):
    """A non-contiguous grad_output is copied contiguous before the gradients are made (zoo H200
    traces: seed 256239's row 37, a patch embedding flattened and transposed: its gradient comes
    back transposed). The kernel frees the copy before it makes the bias gradient; the rule holds
    it to the return (a "before" part cannot end between two outputs): those two events swap."""
    g = args[0]  # grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, ...
    return [] if g.is_contiguous() else [g.numel() * g.element_size()]
