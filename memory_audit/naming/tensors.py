"""Names of the long-lived tensors a training step holds, as the audit and the shadow run both
write them: weights, buffers, gradients, optimizer and GradScaler state (FSDP2's shards and
unsharded copies included), by the storage that holds them; and the module and op names of the
saved-tensor ledger's keys."""

import re

import torch


def local_tensor(t):
    """The tensor whose memory this rank holds: a DTensor's (FSDP2's sharded parameters, their
    gradients and Adam state) local shard, a functional collective's result not yet waited on
    (sequence parallelism's all-gather with batch 1 hands linear one to save) its buffer, else
    the tensor itself."""
    t = getattr(t, "_local_tensor", t)
    return t.elem if type(t).__name__ == "AsyncCollectiveTensor" else t




def tensor_entry(name, t):
    t = local_tensor(t)
    st = t.untyped_storage()
    return {"name": name, "data_ptr": st.data_ptr(), "nbytes": st.nbytes(),
            "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}


def _fsdp_units(model):
    """FSDP2's (fully_shard) units of this model: [(unit name, its per-parameter records)], the
    root unit named "root"; [] without FSDP2."""
    out = []
    for name, module in model.named_modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        if group is not None:
            out.append((name or "root", list(getattr(group, "fsdp_params", ()) or ())))
    return out


def _fsdp_params(model):
    """FSDP2's per-parameter records of this model, [] without FSDP2."""
    return [fp for _, fps in _fsdp_units(model) for fp in fps]


def named_tensors(model, optimizer=None, scaler=None, tensors=None):
    """(name, tensor) of every long-lived tensor: weights, buffers, grads, optimizer state
    (exp_avg, exp_avg_sq, step), the GradScaler's state, plus `tensors` (name -> tensor).
    FSDP2: a parameter's padded local shard is weights/<name>; while the parameter is
    unsharded (the root after forward, a block inside its forward or backward) the module holds
    the all-gathered copy, weights/<name>/unsharded; gradients accumulated between micro-steps
    without a reduce-scatter are whole too, grads/<name>/unsharded."""
    names, unsharded = {}, {}
    params = dict(model.named_parameters())
    for fp in _fsdp_params(model):
        name = next((n for n, p in params.items() if p is fp.sharded_param or p is getattr(fp, "_unsharded_param", None)), None)
        if name is not None:
            names[fp.sharded_param] = name
            unsharded[id(getattr(fp, "_unsharded_param", None))] = name
            yield f"weights/{name}", fp._sharded_param_data
    for name, p in params.items():  # tied weights appear once, under their first name
        if id(p) in unsharded:
            yield f"weights/{name}/unsharded", p
            continue
        names.setdefault(p, name)
        yield f"weights/{name}", p
    for name, b in model.named_buffers():
        yield f"buffers/{name}", b
    for fp in _fsdp_params(model):  # accumulating without reduce-scatter: whole gradients
        g = getattr(getattr(fp, "_unsharded_param", None), "grad", None)
        for held in (g, getattr(fp, "unsharded_accumulated_grad", None)):
            if held is not None and fp.sharded_param in names:
                yield f"grads/{names[fp.sharded_param]}/unsharded", held
    shared = set()
    for unit, fps in _fsdp_units(model):  # gradient shards kept across steps (set_to_none=False)
        for fp in fps:  # are views into their unit's first reduce-scatter output: one buffer a unit
            g = fp.sharded_param.grad
            if g is not None and is_view_into_more(g) and local_tensor(g).untyped_storage()._cdata not in shared:
                shared.add(local_tensor(g).untyped_storage()._cdata)  # one storage (fake ones have no data_ptr)
                yield f"grads/{unit}/shards", g
    for p, name in names.items():
        g = p.grad
        # a gradient that is a view into a larger buffer (DDP's gradient_as_bucket_view, FSDP2's
        # kept shards above) is not an allocation of its own
        if g is not None and (g.is_sparse or not is_view_into_more(g)):
            yield from dense_parts(f"grads/{name}", g)
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device == p.device:
                    yield from dense_parts(f"optimizer/{key}/{names.get(p, '?')}", value)
    if scaler is not None and scaler.is_enabled() and getattr(scaler, "_scale", None) is not None:
        yield "optimizer/grad_scaler/scale", scaler._scale
        yield "optimizer/grad_scaler/growth_tracker", scaler._growth_tracker
    for name, t in (tensors or {}).items():
        if torch.is_tensor(t):
            yield from dense_parts(name, t)


def dense_parts(name, t):
    """(name, tensor) of what holds t's memory: t itself, or a sparse COO tensor's values under its
    name and its indices under name/indices (nn.Embedding(sparse=True)'s gradient)."""
    if t.is_sparse:
        yield name, t._values()
        yield f"{name}/indices", t._indices()
    else:
        yield name, t


def is_view_into_more(t):
    """Whether t is a view into a larger storage (a gradient in DDP's bucket or FSDP2's kept shards)."""
    return local_tensor(t).untyped_storage().nbytes() > local_tensor(t).numel() * t.element_size()


def build_registry(model, optimizer=None, scaler=None, tensors=None):
    """Name every long-lived tensor by its storage address: a list of RegistryEntry dicts."""
    return [tensor_entry(name, t) for name, t in named_tensors(model, optimizer, scaler, tensors)]


def op_name(grad_fn_name, attr):
    """'NativeLayerNormBackward0', '_saved_mean' -> 'native_layer_norm.mean'."""
    base = re.sub(r"Backward\d*$", "", grad_fn_name)
    base = re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()
    return f"{base}.{attr[len('_saved_'):]}"


def short_module(path, prefix="", root="model"):
    """Module path as ledger keys write it: the model's own prefix dropped (GPT: 'transformer.'),
    '' (the model itself) as its class name, None (outside the model: the loop's loss) as 'loop'."""
    if path is None:
        return "loop"
    if prefix and path.startswith(prefix):
        return path[len(prefix):]
    return path or root


def module_namer(model):
    """short_module for this model: its `audit_prefix` (model.py's GPT: 'transformer.') and its
    class name for the model itself."""
    cls = type(model)
    if cls.__name__.startswith("FSDP") and len(cls.__mro__) > 2:  # fully_shard swaps in FSDP<Class>
        cls = cls.__mro__[2]
    prefix, root = getattr(model, "audit_prefix", ""), cls.__name__.lower()
    return lambda path: short_module(path, prefix, root)

def tensors_in(output):
    """The tensors of a module's output or an op's result (a tensor, or a tuple/list/dict of them)."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    return [t for t in output if torch.is_tensor(t)] if isinstance(output, (list, tuple)) else []
