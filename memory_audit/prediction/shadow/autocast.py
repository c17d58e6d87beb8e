"""CUDA autocast on the meta tensors a GPU shadow runs (shadow/gpu, and train.py's CUDA shadow):
torch.autocast("cuda") turns itself off on a machine without CUDA, and CUDA's Autocast kernels
need CUDA's device guard, so the policy is applied here, at the Python level, from ATen's op
lists (AUTOCAST): Autocast is the region, autocast() stands it in for torch's, and recomputed()
runs a checkpoint's recomputation again under the shadow's modes and its forward's region.
Plain Python until a shadow starts.
"""

import contextlib

from . import cuda, patches

# CUDA autocast's policy, by the name a torch function (or Tensor method) has at the Python
# level; from ATen/autocast_mode.h (torch 2.11-2.13): lower_precision_fp, fp32,
# fp32_set_opt_dtype (the output dtype set to float when the first argument is eligible and no
# dtype is given) and promote (every eligible input cast to the widest floating dtype among them).
AUTOCAST = {
    "lower": frozenset((
        "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__",
        "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "multi_dot",
        "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
        "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")),
    "fp32": frozenset((
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "native_layer_norm", "rms_norm",
        "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
        "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
        "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
        "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
        "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d", "interpolate",
        "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
        "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")),
    # norm's policy is fp32_append_dtype (the fp32 output dtype appended): the same effect
    "fp32_set_opt_dtype": frozenset((
        "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
        "norm")),
    "promote": frozenset((
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "grid_sample",
        "index_put", "tensordot", "scatter_add")),
}
_POLICY = {name: policy for policy, names in AUTOCAST.items() for name in names}
# ops CUDA autocast refuses (ATen's autocast_mode.cpp bans them: unsafe in low precision)
_BANNED = {"binary_cross_entropy": "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
                                   "autocast (CUDA autocast raises): use binary_cross_entropy_with_logits"}
# Python-level functions whose aten ops underneath follow the policy op by op (a torch-function
# mode sees the outer call only): cross_entropy is log_softmax in the logits' own dtype (it names
# its dtype) then nll_loss in fp32 (shadow/cuda.cross_entropy_cuda)
_COMPOSITE = {"cross_entropy"}

_REGIONS = []  # the autocast regions entered and not left, innermost last: [Autocast]


def _state():
    """(enabled, dtype) of the innermost region."""
    import torch
    for region in reversed(_REGIONS):
        return region.enabled, region.dtype
    return False, torch.float16


class Autocast:
    """torch.autocast(device_type="cuda", dtype=..., enabled=...) on the shadow's meta tensors. A
    region with enabled=False inside another turns it off until it ends (transformers' rotary
    embeddings do); the cache of fp32 weight casts lives until the outermost region ends."""

    def __init__(self, device_type="cuda", dtype=None, enabled=True, cache_enabled=None):
        self.dtype = dtype if dtype is not None else _state()[1]  # torch.get_autocast_dtype("cuda") now
        self.enabled = bool(enabled)
        self.cache = cache_enabled is not False  # None: torch's default, on
        self.mode = None

    def __enter__(self):
        import torch
        from torch.overrides import TorchFunctionMode
        region = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if patches.composite(func):  # its linears and SDPA under the region too
                    return patches.inside_modes(self, func, args, kwargs or {})
                return region.call(func, args, kwargs or {})
        if not _REGIONS:
            _CACHE.clear()
        _REGIONS.append(self)
        self.mode = _Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        _REGIONS.remove(self)
        if not _REGIONS:
            _CACHE.clear()  # the outermost region ends: its weight casts go
        return False

    def __call__(self, fn):  # used as a decorator
        import functools

        @functools.wraps(fn)
        def run(*a, **k):
            with Autocast(dtype=self.dtype, enabled=self.enabled):
                return fn(*a, **k)
        return run

    def call(self, func, args, kwargs):
        import torch
        if not self.enabled or _REGIONS[-1] is not self:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        policy = _POLICY.get(name)
        if name in _BANNED and any(_eligible(a) for a in args[:1]):
            raise RuntimeError(_BANNED[name])
        if name in _COMPOSITE:
            return cuda.cross_entropy_cuda(*args, **kwargs)
        if policy == "lower":
            args, kwargs = _cast_all(args, kwargs, self.dtype, self.cache)
        elif policy == "fp32":
            args, kwargs = _cast_all(args, kwargs, torch.float32)
        elif policy == "fp32_set_opt_dtype":
            if args and _eligible(args[0]) and kwargs.get("dtype") is None and not _dtype_given(name, args):
                if name in ("softmax", "log_softmax"):
                    return cuda.softmax_fp32(name, args, kwargs)
                kwargs = dict(kwargs, dtype=torch.float32)
        elif policy == "promote":
            to = _widest(args, kwargs, self.dtype)
            args, kwargs = _cast_all(args, kwargs, to)
        return func(*args, **kwargs)


def _dtype_given(name, args):
    """Whether a positional argument already names the output dtype (softmax(x, dim, dtype))."""
    import torch
    return any(isinstance(a, torch.dtype) for a in args[1:])


_CACHE = {}  # id(fp32 leaf parameter) -> (parameter, its low-precision copy)


def _eligible(t):
    """A floating device tensor other than fp64 (CUDA autocast's is_eligible; meta stands for cuda)."""
    import torch
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == "meta")


def _cast(t, to, cache=True):
    """ATen's cached_cast: a fp32 leaf that needs a gradient (a weight), not a view, cast to the
    low dtype once per outermost region."""
    import torch
    if isinstance(t, (list, tuple)):
        return type(t)(_cast(x, to, cache) for x in t)
    if not _eligible(t) or t.dtype == to:
        return t
    if cache and to != torch.float32 and t.is_leaf and t.requires_grad and t.dtype == torch.float32 and not t._is_view():
        if id(t) not in _CACHE:
            _CACHE[id(t)] = (t, t.to(to))
        return _CACHE[id(t)][1]
    return t.to(to)


def _cast_all(args, kwargs, to, cache=True):
    """Right to left, as the C++ wrapper's arguments are evaluated: kwargs, then args (the order
    the casts' allocations take in the committed bf16 traces: snapshots/examples/cuda-tiny-*)."""
    kw = {k: _cast(v, to, cache) for k, v in reversed(list(kwargs.items()))}
    args = [_cast(a, to, cache) for a in reversed(args)][::-1]
    return args, dict(reversed(list(kw.items())))


def _widest(args, kwargs, low):
    import torch
    from torch.utils._pytree import tree_leaves
    out = low
    for t in tree_leaves((args, kwargs)):
        if _eligible(t) and t.dtype == torch.float32:
            out = torch.float32
    return out


@contextlib.contextmanager
def autocast():
    """torch.autocast / torch.amp.autocast / torch.cuda.amp.autocast for "cuda" (and "meta": a
    tensor's device type) as Autocast; "cpu" as torch has it. torch.is_autocast_enabled and
    torch.get_autocast_dtype answer for the regions entered here (checkpointing reads them to
    enter the forward's region again when it recomputes), and torch.amp.is_autocast_available
    says yes for "meta"."""
    import torch
    import torch.amp
    import torch.amp.autocast_mode as amp_mode
    real = amp_mode.autocast
    is_enabled, get_dtype, available = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.amp.is_autocast_available

    def make(device_type="cuda", dtype=None, enabled=True, cache_enabled=None):
        if str(device_type) in ("cuda", "meta"):
            return Autocast(device_type, dtype, enabled, cache_enabled)
        return real(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def cuda_amp(enabled=True, dtype=None, cache_enabled=True):
        return Autocast("cuda", dtype or torch.float16, enabled)

    def enabled(device_type=None):
        if device_type is None or device_type in ("cuda", "meta"):
            return _state()[0]
        return is_enabled(device_type)

    def dtype_of(device_type):
        if device_type in ("cuda", "meta"):
            return _state()[1]
        return get_dtype(device_type)
    owners = [(torch, "autocast", make), (torch.amp, "autocast", make), (amp_mode, "autocast", make),
              (torch.cuda.amp, "autocast", cuda_amp), (torch, "is_autocast_enabled", enabled),
              (torch, "get_autocast_dtype", dtype_of),
              (torch.amp, "is_autocast_available", lambda t: t in ("cuda", "meta") or available(t)),
              (amp_mode, "is_autocast_available", lambda t: t in ("cuda", "meta") or available(t))]
    try:
        with patches.patched(owners):
            yield
    finally:
        _REGIONS.clear()
        _CACHE.clear()


@contextlib.contextmanager
def recomputed(modes):
    """torch.utils.checkpoint's function, when it runs again in backward, under the shadow's
    torch-function modes (`modes`, entered again where none of them is on the stack: a
    recomputation runs with none) and, on top, a region in the autocast state its forward ran
    in (checkpointing enters its own region for the device, "meta" here, below them). Without
    it the recomputation takes the meta tensors' own kernels and saves other tensors than its
    forward did (torch's CheckpointError)."""
    import torch.utils.checkpoint as ckpt
    from torch.overrides import _get_current_function_mode_stack
    real_apply, real_generator = ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator

    def again(fn):
        state = _state()

        def run(*args, **kwargs):
            if any(m in _get_current_function_mode_stack() for m in modes):  # the forward itself
                return fn(*args, **kwargs)
            with contextlib.ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                stack.enter_context(Autocast(dtype=state[1], enabled=state[0]))
                return fn(*args, **kwargs)
        return run

    class _Reentrant:
        @staticmethod
        def apply(function, preserve, *args):
            return real_apply.apply(again(function), preserve, *args)
    with patches.patched([(ckpt, "CheckpointFunction", _Reentrant),
                          (ckpt, "_checkpoint_without_reentrant_generator",
                           lambda fn, *a, **k: real_generator(again(fn), *a, **k))]):
        yield
