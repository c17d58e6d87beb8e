"""Rules as data: what a kernel does that the dispatcher cannot see, one entry per op.

A rule is registered beside its definition (`@rule("cuda", "aten.cumsum.default", "after")`),
as torch's flop counter registers its formulas, and each rule's docstring names the committed
trace it was read from and the check it passed. A rule has parts, each a function of the op's
arguments; their signatures are the device's (shadow/rules/cuda.py, shadow/rules/cpu.py say them):
  before    what the kernel allocates before its outputs and frees before it returns
  after     what it allocates after its outputs and frees before it returns
  events    (before, after): temporaries that interleave with the outputs, as ("alloc", bytes) |
            ("free", k) (k: the k-th alloc of both lists together)
  outputs   [(tensor, bytes or None)] of the result in the order the device allocates them (CUDA)
  outside   where the call lies outside the shapes the rule was measured at: (the rule's name
            in SAMPLES, the call's shape in words), else None (CUDA)
The shadow's tracker asks `parts(device, func)` for each op (a dict lookup after an overload's
first). Plain Python: no torch imported here.
"""

REGISTRY = {}  # device -> {"aten.<op>.<overload>": {part: function}}
_PARTS = ("before", "after", "events", "outputs", "outside")
_BY_FUNC = {}  # (device, op overload) -> its parts: the registry read once per overload


def rule(device, ops, part):
    """Register the decorated function as `part` of the rule for each op of `ops` (one name or a
    tuple; "aten.<op>.<overload>")."""
    if part not in _PARTS:
        raise ValueError(f"a rule's part is one of {', '.join(_PARTS)}, not {part!r}")

    def register(fn):
        for op in (ops,) if isinstance(ops, str) else ops:
            if part in REGISTRY.setdefault(device, {}).setdefault(op, {}):
                raise ValueError(f"{device} rule for {op} has two {part!r} parts")
            REGISTRY[device][op][part] = fn
        return fn
    return register


def parts(device, func):
    """{part: function} of `func`'s rule on `device` ({} where none is registered)."""
    key = (device, func)
    found = _BY_FUNC.get(key)
    if found is None:  # (a rules module registers its rules when imported: shadow/cuda imports
        # rules.cuda, shadow/cpu rules.cpu)
        found = _BY_FUNC[key] = REGISTRY.get(device, {}).get(str(func), {})
    return found


def meta_args(args, kwargs):
    """A compiled wrapper's kernel call as inductor_plan hands it ((size, stride, dtype name) per
    tensor, other values as they are) with meta tensors in place of the tuples, for a rule or a
    meta kernel (shadow/cpu.plan_kernel, shadow/cuda.plan_kernel)."""
    import torch

    def meta(a):
        return torch.empty_strided(a[0], a[1], dtype=getattr(torch, a[2]), device="meta") if isinstance(a, tuple) else a
    return [meta(a) for a in args], {k: meta(v) for k, v in kwargs.items()}
