"""A CPU step's ops in the shadow run: what the kernels make that fake tensors do not show.

shadow/tracker's dispatch mode hands each op of a CPU step to cpu_op, which adds the CPU rules
over many ops (below: wrapped scalars and their casts, mixed-dtype copies, a foreach op's
per-tensor scalars, CPU mean's divide, reduced losses, layer norm's fp32 statistics), one op's
own buffers from shadow/rules/cpu.py, and the kernels asked for their own buffers (shadow/probe).
shadow/cuda is the CUDA side's counterpart. The rules over many ops, each measured on CPU
audits (inplace_accumulate and index_accumulate live in shadow/rules/autograd, rng_state and
storage_resize in patches, gloo_collectives in shadow/rules/collectives, the rest here):
  inplace_accumulate  autograd's gradient sum (an add during backward whose first operand, not a
                      view and contiguous, dies with it) reuses that operand's memory; autograd
                      decides so only for a tensor Python has never seen, so watching prevents it;
                      so does CPU math SDPA's mask add (in place on real tensors: cpu_rules); a
                      DTensor's sum (run on its shards) never: autograd steals only a gradient
                      with storage of its own; nor a backward formula's own sum (FORMULA_ADDS)
  wrapped_scalar      a Python number passed for a Tensor argument (and the Scalar overloads of
                      the arithmetic and comparison ops) is an 8 B CPU tensor (1 B for a bool)
                      made before the op and freed after it unless its autograd node saves it;
                      a cast of it to the op's dtype lives while the output is made; a CPU
                      _foreach_ op with a Scalar(List) runs that op tensor by tensor; under
                      SAC's dispatch mode the number is wrapped a second time before the cast
                      and freed after it
  dtype_cast          a CPU elementwise op on two dtypes (fp32 residual + bf16 branch) copies
                      the other-dtype operand to the common dtype while the output is made
  rng_state           torch.get_rng_state() (checkpointing, per region with dropout) is a real
                      tensor the generator makes: counted when made, freed when let go
  mean_divide         CPU mean is a sum divided in place by the element count, a wrapped int64
                      scalar and its cast, made after the output, freed in reverse; in bf16/fp16
                      the sum runs in fp32 (an fp32 result, the input cast to fp32) first
  kernel_probe        oneDNN's kernels (LSTM layers, convolution, batch norm; bf16 matmuls on
                      CPUs with native bf16): their own buffers asked of the kernel (shadow/probe)
  gloo_collectives    under torchrun on CPU, gloo's buffers in the collectives and CPU _chunk_cat's
                      padded copies of uneven gradients (shadow/rules/collectives, registered as rules/cpu.py's are)
  storage_resize      untyped_storage().resize_ (FSDP2's unsharded parameters: freed with
                      resize_(0), made again with resize_(n)) frees the storage's allocation and
                      makes one of the new size; no op the dispatcher sees
  layer_norm_stats    CPU layer norm of a bf16 (fp16) input with an fp32 weight makes fp32 mean
                      and rstd, where the fake kernel says the input's dtype
  reduced_loss        CPU mse, smooth_l1, soft_margin and binary cross-entropy losses reduce in
                      their element-wise buffer, which stays the 0-dim result's storage
  index_accumulate    indexing's backward (zeros.index_put_(indices, grad, accumulate=True)) is
                      in place in a real run, out of place for a tensor subclass: folded as
                      inplace_accumulate folds a gradient sum
Plain Python until a shadow run starts: torch is imported inside the functions.
"""

import math

from . import rules, probe
from .rules import collectives  # noqa: F401 -- gloo's rules register themselves
from .rules import cpu as cpu_rules  # noqa: F401 -- its rules register themselves

# elementwise ops whose CPU kernels copy an operand of another dtype to the common one first
_MIXED = frozenset(("add", "sub", "mul", "div"))
# ops whose Scalar overload the CPU kernels run as the Tensor one, on a wrapped 0-dim tensor
_COMPARISONS = frozenset(("eq", "ne", "lt", "le", "gt", "ge"))
# ... and the Scalar overloads that wrap their number as the integer and bitwise ops do (a triplet
# loop's `(a + b) % 5`: scripts/user_loops_b.py; remainder, fmod, &, |, ^, <<, >> by CPU audits)
_WRAPS_SCALAR = _COMPARISONS | frozenset(("add", "sub", "mul", "div", "rsub", "remainder", "fmod", "bitwise_and",
                                          "bitwise_or", "bitwise_xor", "__and", "__or", "__xor", "__lshift",
                                          "__rshift"))


def _scalar_bytes(value):
    return 1 if isinstance(value, bool) else 8


def _scalar_allocs(tracker, key, value, like, exists=False, again=False):
    """A wrapped scalar (8 B; 1 B for a bool) and, where the op computes in another dtype than
    the scalar's (double, int64, bool), its cast to `like`'s dtype: (scalar id, cast id or None,
    second wrap id or None). exists: the scalar is a tensor already (a backward formula reading
    the wrapped scalar its node saved, measured for div): only the cast is new (scalar id None).
    again: a Python dispatch mode (SAC's) re-dispatched the op, whose argument parser wraps the
    number a second time, after the first and before the cast (measured on CPU audits)."""
    import torch
    scalar = None if exists else tracker.alloc(f"{key}/scalar", _scalar_bytes(value))[0]
    second = tracker.alloc(f"{key}/scalar", _scalar_bytes(value))[0] if again else None
    own = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
    if like is None or like.dtype == own:
        return scalar, None, second
    return scalar, tracker.alloc(f"{key}/scalar_cast", like.element_size())[0], second


_TORCH_DISTRIBUTED_TENSOR = None  # torch's own distributed/tensor/ folder (set at the first call)


def _under_python_mode():
    """Whether the op reached the tracker through SAC's dispatch mode (torch.utils.checkpoint's
    __torch_dispatch__ on the Python stack): its arguments were re-parsed there. Not where
    DTensor's own code called it on the way (its redistribution's divide of a Replicate bias into
    Partial: SAC's mode is off inside its handler, the number is wrapped once; tp-sp with SAC,
    tests/test_distributed.py's random torchrun config at seed 674815)."""
    import os
    import sys
    global _TORCH_DISTRIBUTED_TENSOR
    if _TORCH_DISTRIBUTED_TENSOR is None:
        import torch
        _TORCH_DISTRIBUTED_TENSOR = os.path.join(os.path.dirname(torch.__file__), "distributed", "tensor", "")
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        if name.startswith(_TORCH_DISTRIBUTED_TENSOR):
            return False
        if code.co_name == "__torch_dispatch__" and name.endswith(("utils/checkpoint.py", "utils\\checkpoint.py")):
            return True
        frame = frame.f_back
    return False


def _mixed_dtype_casts(func, tensors):
    """[(operand, bytes)] of the copies a CPU elementwise op makes of the operands whose dtype is
    not the common one (fp32 + bf16 under autocast: the bf16 side cast to fp32) before it runs."""
    import torch
    name = func.__name__.split(".")[0].rstrip("_")
    if name not in _MIXED or func._overloadname != "Tensor" or len(tensors) != 2:
        return []
    a, b = tensors
    if a.dtype == b.dtype or a.dim() == 0 or b.dim() == 0:
        return []
    common = torch.result_type(a, b)
    return [(t, t.numel() * common.itemsize) for t in (a, b) if t.dtype != common]


def _foreach_scalars(func, args):
    """[(value, tensor)] for each tensor of a _foreach_ op's Scalar or ScalarList overload whose
    per-tensor op wraps its scalar: on CPU the foreach ops run that op tensor by tensor."""
    name = func.__name__.split(".")[0]
    if not name.startswith("_foreach_") or func._overloadname not in ("Scalar", "ScalarList"):
        return []
    if name[len("_foreach_"):].rstrip("_") not in _WRAPS_SCALAR or len(args) < 2:
        return []
    tensors, values = args[0], args[1]
    values = values if isinstance(values, (list, tuple)) else [values] * len(tensors)
    return [(v, t) for v, t in zip(values, tensors) if isinstance(v, (bool, int, float))]


def _wrapped_scalars(func, args):
    """([values], local): the Python numbers the op gets for Tensor arguments (CPU wraps each in
    a 0-dim tensor that the op's autograd node may keep), or, local=True, the Scalar operand of
    a Scalar overload, which the op wraps itself and lets go as it returns (measured on CPU:
    `mask == 0` frees the scalar before its cast, dropout's `div_` after)."""
    out = []
    schema = func._schema.arguments
    for i, a in enumerate(args[:len(schema)]):
        if isinstance(a, (bool, int, float)) and str(schema[i].type) == "Tensor":
            out.append(a)
    name, overload = func.__name__.split(".")[0].rstrip("_"), func._overloadname
    if not out and overload == "Scalar" and name in _WRAPS_SCALAR:
        return [a for a in args[1:2] if isinstance(a, (bool, int, float))], True
    return out, False


_SHORT = {}  # op -> its name without the overload ("mm" for aten.mm.default)


def short_name(func):
    name = _SHORT.get(func)
    if name is None:
        name = _SHORT[func] = func.__name__.split(".")[0]
    return name


def cpu_op(tracker, func, args, kwargs, key):
    """An op of a CPU step's shadow under the rules (module docstring, shadow/rules/cpu.py): wrapped scalars and their
    casts, mixed-dtype copies, a foreach op's per-tensor scalars, the outputs, then the kernels'
    own buffers. Returns (out, [ids freed as it returns], the scalars its node may keep)."""
    import torch
    from torch.utils._pytree import tree_leaves
    scalars, local = _wrapped_scalars(func, args)
    wrapped = bool(scalars)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    held = []  # freed once the outputs are made: casts, and a foreach op's last scalar
    # a backward formula (grad mode off: not a checkpoint's recomputation) reads the
    # wrapped scalar its node saved: a 0-dim tensor already
    saved_scalar = tracker.phase == "backward" and not torch.is_grad_enabled() and not local
    # no autograd node will be made: the wrapped scalar goes as the op returns, after its cast
    graphless = not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    for value in scalars:
        again = not local and not saved_scalar and _under_python_mode()
        scalar, cast, second = _scalar_allocs(tracker, key, value, tensors[0] if tensors else None, saved_scalar, again)
        held += [i for i in (cast, second) if i is not None]  # the second wrap goes after the cast
        if scalar is not None and not local:
            (held if graphless else tracker.pending).append(scalar)
        if local:  # comparisons let the scalar go before its cast, arithmetic after
            held.insert(0 if short_name(func) in _COMPARISONS else len(held), scalar)
    if local:
        scalars = []  # nothing for the output's autograd node to keep
    casts = _mixed_dtype_casts(func, tensors)
    for t, nbytes in casts:
        held.append(tracker.alloc(f"{key}/dtype_cast", nbytes)[0])
    rule = rules.parts("cpu", func)  # shadow/rules/cpu.py: what the kernel makes before and after its outputs
    for name, nbytes in rule["before"](args) if "before" in rule else ():
        held.append(tracker.alloc(f"{key}/{name}" if name else _buffer(key), nbytes)[0])
    before, after = rule["events"](args) if "events" in rule else ((), ())
    made = []  # a kernel's temporaries that interleave with its outputs, made and freed in order
    play_events(tracker, _buffer(key), before, made)
    per_tensor = _foreach_scalars(func, args)
    for j, (value, t) in enumerate(per_tensor):  # the CPU foreach loop: one op per tensor
        ids = [i for i in reversed(_scalar_allocs(tracker, key, value, t)[:2]) if i is not None]
        if j < len(per_tensor) - 1:
            for aid in ids:
                tracker.free(aid)
        else:
            held += ids
    # a functional collective's wait returns the tensor it waited on (the fake kernel, a new one)
    out = args[0] if func.namespace == "_c10d_functional" and short_name(func) == "wait_tensor" else func(*args, **kwargs)
    # an op the rules answer (its wrapped scalars, casts, a rule of its own, mean's buffers) is
    # not asked for an expanded input: the probe would count what they give a second time
    ruled = wrapped or bool(casts) or bool(rule) or func in (torch.ops.aten.mean.dim, torch.ops.aten.mean.default)
    probed = probe.wanted(short_name(func), args, ruled) and _probed_op(tracker, func, args, kwargs, key, out)
    reduced = _reduced_loss_bytes(func, args, kwargs, out)
    stats = _mixed_layer_norm_stats(func, args, out)
    _add_outputs(tracker, out, key, reduced, stats)
    play_events(tracker, _buffer(key), after, made)
    if "after" in rule and not probed:  # made after the outputs, freed in reverse (a probed kernel answered itself)
        held[:0] = [tracker.alloc(_buffer(key), n)[0] for n in rule["after"](args, out)][::-1]
    if func in (torch.ops.aten.mean.dim, torch.ops.aten.mean.default):
        held[:0] = _mean_buffers(tracker, key, args[0], out)
    return out, held, scalars


def _add_outputs(tracker, out, key, reduced, stats):
    """The op's outputs as allocations: a reduced loss at its buffer's bytes, a mixed layer norm's
    statistics in fp32, a sparse COO tensor as its indices' and values' storages."""
    import torch
    from torch.utils._pytree import tree_leaves
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.is_sparse:
            for part in (t._indices(), t._values()):
                tracker.add(part.untyped_storage(), key)
        elif isinstance(t, torch.Tensor):
            tracker.add(t.untyped_storage(), key, reduced if t is out else t.numel() * 4 if any(t is u for u in stats) else None)


# CPU losses whose mean or sum is taken in place in the element-wise buffer: the 0-dim result's
# storage is the whole buffer (F.mse_loss of 24 fp32 elements: 96 B, not 4; bf16: 48). Found by
# an independent set of loops (a GRU and an autoencoder with MSE; F.binary_cross_entropy after a
# sigmoid: 37,632 B, not 4, scripts/user_loops.py's conv_autoencoder); l1, huber and BCE with logits reduce
# into a new 0-dim tensor.
_ELEMENTWISE_LOSSES = frozenset(("mse_loss", "smooth_l1_loss", "soft_margin_loss", "binary_cross_entropy"))


def _mixed_layer_norm_stats(func, args, out):
    """The mean and rstd of a CPU layer norm whose input is bf16 (fp16) and its weight fp32 (the
    mixed type a model's fp32 LayerNorm meets under autocast, which leaves layer_norm alone on
    CPU): fp32, where the fake kernel makes them in the input's dtype (BERT's prediction head in bf16:
    576 B short; scripts/zoo_check.py seeds 461854 and 418482). With a weight of the input's dtype,
    or none, they are the input's dtype, as the fake kernel says."""
    import torch
    if func is not torch.ops.aten.native_layer_norm.default:
        return ()
    x, weight = args[0], args[2] if len(args) > 2 else None
    if x.dtype not in (torch.bfloat16, torch.float16) or weight is None or weight.dtype != torch.float32:
        return ()
    return out[1:]


def _reduced_loss_bytes(func, args, kwargs, out):
    """The bytes of a reduced loss's storage where the CPU kernel keeps its element-wise buffer
    (_ELEMENTWISE_LOSSES), else None."""
    import torch
    if short_name(func) not in _ELEMENTWISE_LOSSES or not isinstance(out, torch.Tensor) or out.dim():
        return None
    at = [a.name for a in func._schema.arguments].index("reduction")  # binary_cross_entropy: after its weight
    reduction = kwargs.get("reduction", args[at] if len(args) > at else 1)
    if reduction == 0:  # none: the element-wise tensor is the output already
        return None
    return math.prod(torch.broadcast_shapes(args[0].shape, args[1].shape)) * out.element_size()


def play_events(tracker, name, events, made):
    """("alloc", bytes) | ("free", k): the k-th of `made`, the allocations these events made (each
    under `name`), on either device's path."""
    for action, n in events:
        if action == "alloc":
            made.append(tracker.alloc(name, n)[0])
        else:
            tracker.free(made[n])


def _buffer(key):
    """The name of a kernel's own buffer, made and freed inside the op: a temporary in any phase,
    as the audit names it (a forward op's buffer is no activation)."""
    return ("temporary/forward/" + key[len("activations/"):] if key.startswith("activations/") else key) + "/buffer"


def _mean_buffers(tracker, key, x, out):
    """CPU mean: its sum divided in place by the element count (a wrapped int64 and its cast,
    freed in reverse as it returns: the ids returned). For bf16/fp16 the sum runs in fp32: an fp32
    result, the input cast to fp32 (freed after the sum), the divide, then the result freed."""
    import torch
    if out.dtype in (torch.float32, torch.float64):
        scalar, cast, _ = _scalar_allocs(tracker, f"{key}/div_", 1, out)
        return [i for i in (cast, scalar) if i is not None]
    if out.dtype not in (torch.bfloat16, torch.float16):
        return []
    result = tracker.alloc(_buffer(key), out.numel() * 4)[0]
    tracker.free(tracker.alloc(_buffer(key), x.numel() * 4)[0])
    scalar, cast = (tracker.alloc(f"{key}/div_/{name}", n)[0] for name, n in (("scalar", 8), ("scalar_cast", 4)))
    for i in (cast, scalar, result):  # the int64 count and its fp32 cast, then the fp32 result
        tracker.free(i)
    return []


def _probed_op(tracker, func, args, kwargs, key, out):
    """The kernel's own allocations and frees around its outputs, in its order, as a kernel
    probe found them (shadow/probe): an output at its real size (remembered when the fake one
    differs, for the op that reads it next), a buffer as a temporary (_buffer). False where no
    probe could run (the call keeps its fake sizes and is listed as unprobed)."""
    import torch
    outs = list(out) if isinstance(out, (tuple, list)) else [out]

    def real_shape(t):
        return tracker.real_shapes.get(t.untyped_storage()._cdata)
    made = sum(t.untyped_storage().nbytes() for t in outs if isinstance(t, torch.Tensor))
    found = probe.sequence(func, args, kwargs, real_shape, made)
    if found is None:
        tracker.unprobed.add(short_name(func))
        return False
    tracker.probed.add(short_name(func))
    entries, shapes = found
    ids = {}
    for i, (action, which, nbytes) in enumerate(entries):
        if action == "free":
            tracker.free(ids[which])
        elif action == "alloc" and which is None:
            ids[i] = tracker.alloc(_buffer(key), nbytes)[0]
        elif action == "alloc" and isinstance(outs[which], torch.Tensor):
            t, storage = outs[which], outs[which].untyped_storage()
            tracker.add(storage, key, nbytes)
            if (tuple(t.shape), tuple(t.stride()), t.dtype) != shapes[which]:  # what the next probe must feed it
                tracker.real_shapes[storage._cdata] = shapes[which]
    return True


def saved_scalars(out):
    """The wrapped scalars (real 0-dim tensors among fake ones) that `out`'s autograd node
    saved (autograd saves them without the saved-tensor hooks: read from the node)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    node = getattr(out, "grad_fn", None)
    if node is None:
        return []
    found = []
    for attr in dir(node):
        if attr.startswith("_saved_"):
            v = getattr(node, attr)
            if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) and v.dim() == 0:
                found.append(v)
    return found




def plan_kernel(op, args, kwargs):
    """What a kernel a compiled wrapper calls allocates inside itself (inductor_plan.replay's
    `kernel`), answered as cpu_op answers the same op in an eager step: asked of the kernel where
    shadow/probe asks it (bf16/fp16 matmuls through oneDNN; `extern_kernels.mm(a, b, out=buf)` is
    op "mm", its out= variant), else, for a fallback kernel (op "aten.<name>.<overload>"), its
    outputs and shadow/rules/cpu.py's buffers (CPU flash attention's). Returns [("alloc", output index or
    None, bytes) | ("free", index, bytes)]; None where nothing is asked; a reason (str) where the
    kernel would be asked but cannot be. args and kwargs: (size, stride, dtype name) per tensor."""
    import torch
    fallback = op.startswith("aten.")
    name, overload = op.split(".")[1:] if fallback else (op, "out")
    func = getattr(getattr(torch.ops.aten, name), overload)
    m_args, m_kwargs = rules.meta_args(args, kwargs)
    if probe.wanted(name, m_args):
        found = probe.sequence(func, m_args, m_kwargs, lambda t: None)
        if found is not None:  # an out= buffer is the caller's: the kernel's entries are its own
            return found[0]
        if not fallback:
            return "not asked (a profile recording, its tensors over shadow/probe.LIMIT, or refused)"
    rule = rules.parts("cpu", func) if fallback else {}
    if not rule:
        return None
    out = func(*m_args, **m_kwargs)
    outs = [(j, t) for j, t in enumerate(out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
    before = [n for _, n in rule["before"](m_args)] if "before" in rule else []
    after = rule["after"](m_args, out) if "after" in rule else []
    return [("alloc", None, n) for n in before] + [("alloc", j, t.untyped_storage().nbytes()) for j, t in outs] + \
        [("alloc", None, n) for n in after]
