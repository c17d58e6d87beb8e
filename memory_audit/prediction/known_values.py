"""The values a shadow run knows without data: small tensors made from constants alone.

A fake tensor has a shape and no values, so a read of one (`.item()`, `bool()`, `if t.all():`)
has no answer. Yet much of what library code reads is not data: position ids are an `arange`,
a mask built from them is index arithmetic, an attention mask may be `torch.ones(...)`. A real
run reads those and takes a branch (transformers' packed-sequence check reads
`(positions[:, -1] == 0).all()` and builds no mask when it holds), and a shadow that answers
them with a placeholder takes the other branch and allocates what the real run never did.

KnownValues is a dispatch mode above the shadow's: it lets every op through, and where every
input of a deterministic op has a known value (a real tensor handed in, or an output it knew),
it runs the same op on the real values on the CPU, outside every mode, and keeps the result for
outputs of at most LIMIT elements. A read of a known tensor (aten._local_scalar_dense: item,
bool, int, float) is answered with the real value; anything else stays a placeholder. What it
never knows: the results of random ops (nondeterministic_seeded), uninitialized memory (empty),
and anything with an unknown input. A tensor written in place by an op with an unknown input is
forgotten, with every known tensor sharing its storage.

Data-dependent shapes. `nonzero` (and what runs it: `torch.where(mask)`, `nonzero(as_tuple=True)`,
indexing or index_put with a boolean mask) has an output whose size is the mask's count. A known
mask gives its real count; any other takes the size the user assumed (`assume`: the user's line
"file.py:205", else the op "nonzero"; a count of rows, a fraction of the mask's elements, or a
list of counts taken in order within each step). The op then runs as nonzero_static at that size,
named "nonzero" as the audit names it: one allocation of rows x mask dims x 8 B, as CPU's kernel
makes for it (an index by a mask: the nonzero output made, the indexed output made, the nonzero
output freed, as the real kernel does). Each size taken is listed in `sizes` with where and why.
A data-dependent shape with neither ends in DataDependentShape, one line naming the line and the
way to give it.
"""

import contextlib
import weakref

LIMIT = 1 << 16  # elements: the index arithmetic of a sequence, not activations

# ops whose output does not depend on their tensor inputs' values (only shapes and dtypes)
VALUE_FREE = ("ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full")
# ops whose output is uninitialized memory
UNDEFINED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")


class DataDependentShape(Exception):
    """An op whose output size depends on values nobody knows, with no size assumed for it."""


def parse_assume(items):
    """{key: rows | fraction | [rows...]} from "KEY=VALUE" strings (the CLI's --assume);
    ValueError in one line for anything else."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        try:
            if not sep or not key:
                raise ValueError
            if "," in value:
                out[key] = [int(v) for v in value.split(",")]
            else:
                out[key] = float(value) if "." in value else int(value)
        except ValueError:
            raise ValueError(f"--assume {item!r}: give KEY=ROWS, KEY=FRACTION (0.25) or KEY=R1,R2,... with KEY "
                             "the line (file.py:205) or the op (nonzero)") from None
    for key, v in out.items():
        if any(n < 0 for n in (v if isinstance(v, list) else [v])) or (isinstance(v, float) and v > 1):
            raise ValueError(f"--assume {key}: a count of rows is >= 0, a fraction within 0..1")
    return out


class KnownValues:
    """Follows known values over the ops of a shadow run (enter it above the shadow's modes)."""

    def __init__(self, limit=LIMIT, tracker=None, assume=None, where=None):
        import torch
        from torch.utils.weak import WeakIdKeyDictionary
        self.tracker, self.assume, self.where = tracker, dict(assume or {}), where or (lambda: None)
        self.sizes, self._taken = [], {}  # the data-dependent sizes taken; key -> how many this step
        self.limit, self.values = limit, WeakIdKeyDictionary()  # fake tensor -> real CPU tensor
        self.storages = {}  # storage id -> [weakref(fake)] of the known tensors on it
        self._kinds = {}  # op -> _kind(op)
        self._torch = torch

    def value(self, t):
        """t's real value, or None where it is not known."""
        from torch._subclasses.fake_tensor import FakeTensor
        if not isinstance(t, FakeTensor):
            return None if t.device.type == "meta" else t
        return self.values.get(t)

    @contextlib.contextmanager
    def watching(self):
        """The mode on top of the dispatch stack while the block runs."""
        from torch.utils._python_dispatch import TorchDispatchMode
        known = self

        class _Mode(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls):
                return False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return known.dispatch(func, args, kwargs or {})
        with _Mode():
            yield self

    def new_step(self):
        """A step starts: each list of assumed sizes is taken from its start again."""
        self._taken = {}

    def dispatch(self, func, args, kwargs):
        aten = self._torch.ops.aten
        if func is aten.nonzero.default:
            return self._nonzero(args[0])
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._index_put_impl_.default) and any(self._is_mask(i) for i in args[1]):
            masks = [self._nonzero(i) if self._is_mask(i) else None for i in args[1]]
            indices = []
            for i, nz in zip(args[1], masks):  # a k-dim mask: k index columns of its nonzero
                indices += [i] if nz is None else [nz.select(1, j) for j in range(i.dim())]
            return func(args[0], indices, *args[2:], **kwargs)
        if func is aten._local_scalar_dense.default:
            real = self.value(args[0])
            if real is not None:
                from torch.utils._python_dispatch import _disable_current_modes
                with _disable_current_modes():
                    return real.item()
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        try:
            self._follow(func, args, kwargs, out)
        except Exception:  # a value it cannot follow is a value it does not know
            for t in _tensors((out,), {}, self._torch.Tensor):
                self._forget_storage(t)
            self._forget_written(self._kind(func)[2], args)
        return out

    def _is_mask(self, t):
        torch = self._torch
        return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)

    def _nonzero(self, mask):
        """nonzero(mask) at its known or assumed count, through the modes below as nonzero_static."""
        torch = self._torch
        from torch.utils._python_dispatch import _disable_current_modes
        real = self.value(mask)
        if real is not None:
            with _disable_current_modes():
                real_out = torch.nonzero(real)
            rows, why = real_out.shape[0], "its mask's known values"
        else:
            real_out = None
            rows, why = self._assumed(mask)
        self.sizes.append({"op": "nonzero", "rows": rows, "of": mask.numel(), "where": self.where() or "torch",
                           "from": why})
        if self.tracker is not None:
            self.tracker.stand_in = "nonzero"  # named as the audit names the real op
        out = torch.ops.aten.nonzero_static.default(mask, size=rows)
        if real_out is not None:
            self._know(out, real_out)
        return out

    def _assumed(self, mask):
        here = self.where()
        site = here.split(": ", 1)[0] if here else None
        for key in (site, "nonzero"):
            if key is None or key not in self.assume:
                continue
            value = self.assume[key]
            if isinstance(value, list):
                n = self._taken.get(key, 0)
                self._taken[key] = n + 1
                return value[n % len(value)], f"--assume {key}, call {n + 1} of the step"
            if isinstance(value, float):
                return round(value * mask.numel()), f"--assume {key}={value} of {mask.numel()} elements"
            return value, f"--assume {key}={value}"
        raise DataDependentShape(
            f"the shadow run stopped at nonzero, {here or 'in a library'}: its output size depends on the data; "
            f"give it with --assume {site or 'nonzero'}=ROWS (or =FRACTION of the mask's {mask.numel()} elements)")

    def _follow(self, func, args, kwargs, out):
        torch = self._torch
        free, never, written = self._kind(func)
        tensors = _tensors(args, kwargs, torch.Tensor)
        if never or (not free and any(self.value(t) is None for t in tensors)):
            self._forget_written(written, args)
            return
        outs = _tensors((out,), {}, torch.Tensor)
        if not (outs or written) or any(t.numel() > self.limit for t in outs + tensors):
            self._forget_written(written, args)
            return
        from torch.utils._pytree import tree_map
        from torch.utils._python_dispatch import _disable_current_modes
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        def real(x):
            if isinstance(x, torch.Tensor):
                v = self.value(x)
                return torch.empty(x.shape, dtype=x.dtype) if v is None else v  # VALUE_FREE's input
            return torch.device("cpu") if isinstance(x, torch.device) else x
        with _disable_current_modes(), unset_fake_temporarily():
            done = func(*tree_map(real, args), **{k: real(v) for k, v in kwargs.items()})
        for fake, value in zip(outs, _tensors((done,), {}, torch.Tensor)):
            self._know(fake, value)

    def _kind(self, func):
        """(its output ignores its inputs' values, it is never known, the arguments it writes)."""
        kind = self._kinds.get(func)
        if kind is None:
            name = func.overloadpacket.__name__
            never = name in UNDEFINED or self._torch.Tag.nondeterministic_seeded in func.tags
            written = tuple(i for i, a in enumerate(func._schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write)
            kind = self._kinds[func] = (name in VALUE_FREE, never, written)
        return kind

    def _know(self, fake, value):
        from torch._subclasses.fake_tensor import FakeTensor
        if isinstance(fake, FakeTensor) and fake not in self.values:
            self.values[fake] = value
            self.storages.setdefault(fake.untyped_storage()._cdata, []).append(weakref.ref(fake))

    def _forget_written(self, written, args):
        """Every argument an op wrote with what it did not know: unknown, with what shares its storage."""
        if not self.storages:
            return
        for i in written:  # a tensor, or a list of them (a foreach op's)
            if i < len(args):
                for t in _tensors((args[i],), {}, self._torch.Tensor):
                    self._forget_storage(t)

    def _forget_storage(self, t):
        try:
            sid = t.untyped_storage()._cdata
        except Exception:
            return
        for ref in self.storages.pop(sid, []):
            fake = ref()
            if fake is not None:
                self.values.pop(fake, None)


def _tensors(args, kwargs, tensor_type):
    """The tensors among args (and in their lists and tuples, one level down) and kwargs' values."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, tensor_type):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, tensor_type)]
    return out
