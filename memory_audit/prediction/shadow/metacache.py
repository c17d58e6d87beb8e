"""A cache of meta kernels' output metadata, for the shadow of a CUDA step (issue #26: speed).

On meta tensors most of the shadow run's time is PyTorch's own Python meta functions (the prims'
elementwise rules, broadcasting, stride inference): GPT-2 XL's 48 identical blocks ask each the
same questions 48 times. An op whose outputs are fresh tensors (no view, no in-place or out=
write, every return a tensor or None, each in a storage of its own, at offset 0, sized as its
shape and strides need) gets the same output metadata from the same input metadata; the second
time, new meta tensors are made with torch.empty_strided (C++) instead of running the kernel.
Any other op (views, in-place ops, real host tensors among the inputs, other outputs) always
runs its kernel. The key is the op and every argument: a tensor by its shape, strides, dtype
and storage offset, anything else by its value.
"""

_SKIP = object()  # a key whose op cannot be cached


class MetaCache:
    def __init__(self):
        self.entries = {}  # key -> ([(shape, stride, dtype) or None per output], one|tuple|list) or _SKIP
        self.hits = self.misses = 0

    def call(self, func, args, kwargs):
        import torch
        key = _key(func, args, kwargs, torch)
        entry = self.entries.get(key, _SKIP) if key is not None else _SKIP
        if entry is not _SKIP:
            self.hits += 1
            outs = [None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2], device="meta") for m in entry[0]]
            return outs if entry[1] == "list" else tuple(outs) if entry[1] == "tuple" else outs[0]
        out = func(*args, **kwargs)
        if key is not None and key not in self.entries:
            self.misses += 1
            self.entries[key] = _entry(out, _storages(args, torch), torch)
        return out


def _key(func, args, kwargs, torch):
    """A hashable description of the call, or None (an op or an argument the cache leaves alone)."""
    fresh = _FRESH.get(func)
    if fresh is None:
        schema = func._schema
        fresh = _FRESH[func] = (all(r.alias_info is None for r in schema.returns)
                                and all(a.alias_info is None or not a.alias_info.is_write for a in schema.arguments))
    if not fresh:
        return None
    parts = _args(args, torch.Tensor)
    if parts is None:
        return None
    if kwargs:
        rest = _args([v for _, v in sorted(kwargs.items())], torch.Tensor)
        if rest is None:
            return None
        parts += (tuple(sorted(kwargs)),) + rest
    try:
        hash(parts)
    except TypeError:  # an unhashable argument
        return None
    return (func, parts)


_FRESH = {}  # op -> whether its schema says its outputs are fresh


def _args(values, Tensor):
    """A tuple describing `values` (a tensor by its shape, strides, dtype and storage offset,
    a list or tuple by its items, anything else as itself), or None for a real host tensor
    (a wrapped scalar, a step count: its values may matter)."""
    out = []
    for a in values:
        if isinstance(a, Tensor):
            if not a.is_meta:
                return None
            out.append(("T", a.shape, a.stride(), a.dtype, a.storage_offset()))
        elif isinstance(a, (list, tuple)):
            inner = _args(a, Tensor)
            if inner is None:
                return None
            out.append((type(a).__name__,) + inner)
        else:
            out.append(a)
    return tuple(out)


def _storages(args, torch):
    """The storage ids of the tensor arguments."""
    out, todo = set(), list(args)
    while todo:
        a = todo.pop()
        if isinstance(a, (list, tuple)):
            todo.extend(a)
        elif isinstance(a, torch.Tensor):
            out.add(a.untyped_storage()._cdata)
    return out


def _entry(out, inputs, torch):
    """What a later call makes instead of running the kernel, or _SKIP (an output that is not a
    fresh meta tensor: _unsafe_view's schema names no alias, yet its output is its input's)."""
    kind = "list" if isinstance(out, list) else "tuple" if isinstance(out, tuple) else "one"
    outs = list(out) if kind != "one" else [out]
    metas, storages = [], set()
    for t in outs:
        if t is None:
            metas.append(None)
            continue
        if not isinstance(t, torch.Tensor) or t.device.type != "meta" or t.storage_offset() != 0:
            return _SKIP
        storage = t.untyped_storage()
        need = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").untyped_storage().nbytes()
        if storage.nbytes() != need or storage._cdata in storages | inputs or t.requires_grad:
            return _SKIP
        storages.add(storage._cdata)
        metas.append((tuple(t.shape), t.stride(), t.dtype))
    return (metas, kind)


SHARED = MetaCache()  # one per process: the answers depend on nothing but the key
