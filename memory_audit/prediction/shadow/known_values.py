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
bool, int, float) is answered with the real value; anything else stays a placeholder. Only aten
ops are followed (a collective or a library's own op could have effects, or answer otherwise
across ranks). What it never knows: the results of random ops (nondeterministic_seeded),
uninitialized memory (empty, resize_), and anything with an unknown input. A tensor an op
writes (in place, through out=, set_) with anything unknown is forgotten, with every known
tensor that shared its storage before the op; a value whose shape or dtype no longer matches
its tensor's (`.data =` swapped it) is dropped when read. A real tensor handed in is read,
never written: an op that writes one runs on a copy.

Data-dependent shapes. `nonzero` (and what runs it: `torch.where(mask)`, `nonzero(as_tuple=True)`,
indexing or index_put with a boolean mask) has an output whose size is the mask's count. A known
mask gives its real count; any other takes the size the user assumed (`assume`: the user's line
"file.py:205", else the op "nonzero"; a count of rows, a fraction of the mask's elements, or a
list of counts taken in order within each step), once per mask: the same mask indexed again (in
the forward, or by index_put in its backward) keeps its rows. The op then runs as nonzero_static at that size,
named "nonzero" as the audit names it: one allocation of rows x mask dims x 8 B, as CPU's kernel
makes for it (an index by a mask: the nonzero output made, the indexed output made, the nonzero
output freed, as the real kernel does). Another op whose fake kernel cannot give its output
shape (tagged dynamic_output_shape: ctc_loss, whose shapes follow the targets' lengths) takes the
shapes a real run of it gives on the CPU at the step's shapes where every input that decides
them is known: SHAPED_BY's arguments (the others run zero-filled), else every input (unique of
known values; of data it stops in one line). Each size taken is listed in `sizes` with where and why.
A data-dependent shape with neither ends in DataDependentShape, one line naming the line and the
way to give it.
"""

import contextlib
import weakref

LIMIT = 1 << 16  # elements: the index arithmetic of a sequence, not activations

# ops tagged dynamic_output_shape whose shapes only these arguments decide (the rest may be
# unknown, and run zero-filled): CTC's log_alpha is (batch, time, 2 x the longest target + 1)
SHAPED_BY = {"_ctc_loss": ("input_lengths", "target_lengths")}

# ops whose output does not depend on their tensor inputs' values (only shapes and dtypes)
VALUE_FREE = ("ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full")
# ops whose output is uninitialized memory
UNDEFINED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
             "resize_", "resize_as_")


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
    return checked_assume(out)


def checked_assume(assume):
    """assume ({key: rows | fraction | [rows...]}) as given, or ValueError in one line."""
    for key, v in (assume or {}).items():
        rows = v if isinstance(v, list) else [v]
        if (not isinstance(key, str) or not key or not rows
                or any(isinstance(n, bool) or not isinstance(n, (int, float)) for n in rows)
                or any(n < 0 for n in rows) or (isinstance(v, list) and any(isinstance(n, float) for n in v))
                or (isinstance(v, float) and v > 1)):
            raise ValueError(f"--assume {key}={v!r}: a count of rows (an int >= 0), a fraction within 0..1, "
                             "or a non-empty list of counts")
    return dict(assume or {})


class KnownValues:
    """Follows known values over the ops of a shadow run (enter it above the shadow's modes)."""

    def __init__(self, limit=LIMIT, tracker=None, assume=None, where=None):
        import torch
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils.weak import WeakIdKeyDictionary
        self.tracker, self.assume, self.where = tracker, checked_assume(assume), where or (lambda: None)
        self.sizes, self._taken = [], {}  # the data-dependent sizes taken; key -> how many this step
        self.rows = WeakIdKeyDictionary()  # mask -> (its version, the rows its nonzero took)
        self.limit, self.values = limit, WeakIdKeyDictionary()  # fake tensor -> real CPU tensor
        self.storages = {}  # storage id -> weakref.WeakSet of the known tensors on it
        self._kinds = {}  # op -> _kind(op)
        self._torch, self._fake = torch, FakeTensor
        aten = torch.ops.aten
        self._indexing = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                          aten._index_put_impl_.default)
        self._nonzero_op, self._read_op = aten.nonzero.default, aten._local_scalar_dense.default
        self._dynamic = torch.Tag.dynamic_output_shape

    def value(self, t):
        """t's real value, or None where it is not known."""
        if not isinstance(t, self._fake):
            return None if t.device.type == "meta" else t
        v = self.values.get(t)
        if v is not None and (v.shape != t.shape or v.dtype != t.dtype):  # swapped by `.data =`
            self.values.pop(t, None)
            return None
        return v

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
        if func is self._nonzero_op:
            return self._nonzero(args[0])
        if func is self._read_op:
            real = self.value(args[0])
            if real is not None:
                from torch.utils._python_dispatch import _disable_current_modes
                with _disable_current_modes():
                    return real.item()
        written = self._written(func, args, kwargs)
        before = [(t, t.untyped_storage()._cdata) for t in written] if self.storages else []
        if func in self._indexing and any(self._is_mask(i) for i in args[1]):
            out = self._by_mask(func, args, kwargs)
        elif self._dynamic in func.tags:
            out = self._dynamic_shape(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if func.namespace != "aten" or not self._follow(func, args, kwargs, out, written):
            self._forget(before)
        return out

    def _by_mask(self, func, args, kwargs):
        """An index (index_put) by boolean masks: each mask's nonzero made first, as CPU's kernel
        makes it, its columns the long indices."""
        indices = []
        for i in args[1]:  # a k-dim mask: k index columns of its nonzero
            if self._is_mask(i):
                nz = self._nonzero(i)
                indices += [nz.select(1, j) for j in range(i.dim())]
            else:
                indices.append(i)
        return func(args[0], indices, *args[2:], **kwargs)

    def _dynamic_shape(self, func, args, kwargs):
        """An op whose output shape the fake kernel cannot give (ctc_loss: the targets' lengths):
        where every input that decides its shapes is known (SHAPED_BY's arguments, else all of
        them), its shapes are the ones a real run of it at these shapes gives on the CPU (what it
        does not know zero), and its outputs are made at them through the modes below; else the
        fake kernel's exception stands."""
        from torch._subclasses.fake_tensor import DynamicOutputShapeException
        try:
            return func(*args, **kwargs)
        except DynamicOutputShapeException:
            torch = self._torch
            tensors = _tensors(args, kwargs, torch.Tensor)
            name = func.overloadpacket.__name__
            shaping = SHAPED_BY.get(name)
            if shaping is not None:  # only these arguments decide the shapes
                named = [a.name for a in func._schema.arguments]
                tensors_read = _tensors([args[named.index(n)] if named.index(n) < len(args) else kwargs.get(n)
                                         for n in shaping], {}, torch.Tensor)
            else:  # unique, masked_select, repeat_interleave: any input may decide them
                tensors_read = tensors
            if any(self.value(t) is None for t in tensors_read):
                raise
            from torch.utils._pytree import tree_map
            done = self._real_run(func, args, kwargs)
            device = tensors[0].device

            def made(t):
                if not isinstance(t, torch.Tensor):
                    return t
                if self.tracker is not None:
                    self.tracker.stand_in = name  # named as the audit names the real op's outputs
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            out = tree_map(made, done)
            self.sizes.append({"op": name, "shape": [list(t.shape) for t in _tensors((done,), {}, torch.Tensor)],
                               "where": self.where() or "torch",
                               "from": "a real run of the op at these shapes on the CPU (what is unknown zero)"})
            return out

    def _is_mask(self, t):
        torch = self._torch
        return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)

    def _nonzero(self, mask):
        """nonzero(mask) at its known or assumed count, through the modes below as nonzero_static."""
        torch = self._torch
        from torch.utils._python_dispatch import _disable_current_modes
        real = self.value(mask)
        real_out = None
        if real is not None:
            with _disable_current_modes():
                real_out = torch.nonzero(real)
            rows, why = real_out.shape[0], "its mask's known values"
        elif self.rows.get(mask, (None,))[0] == mask._version:  # the same mask again (its backward)
            rows, why = self.rows[mask][1], "the same mask's earlier call"
        else:
            rows, why = self._assumed(mask)
            self.rows[mask] = (mask._version, rows)
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
                rows, why = value[n % len(value)], f"--assume {key}, call {n + 1} of the step"
            elif isinstance(value, float):
                rows, why = round(value * mask.numel()), f"--assume {key}={value} of {mask.numel()} elements"
            else:
                rows, why = value, f"--assume {key}={value}"
            if rows > mask.numel():
                raise DataDependentShape(f"the shadow run stopped at nonzero, {here or 'in a library'}: --assume {key} "
                                         f"gives {rows} rows to a mask of {mask.numel()} elements")
            return rows, why
        raise DataDependentShape(
            f"the shadow run stopped at nonzero, {here or 'in a library'}: its output size depends on the data; "
            f"give it with --assume {site or 'nonzero'}=ROWS or =FRACTION of the mask's {mask.numel()} elements "
            f"(shadow(assume={{{(site or 'nonzero')!r}: ROWS}}))")

    def _follow(self, func, args, kwargs, out, written):
        """Knows func's outputs (and updates what it wrote) where every input is known; False
        where it does not know them (what func wrote is then forgotten)."""
        torch = self._torch
        free, never, _ = self._kind(func)
        tensors = _tensors(args, kwargs, torch.Tensor)
        if never or (not free and any(self.value(t) is None for t in tensors)):
            return False
        outs = _tensors((out,), {}, torch.Tensor)
        if not (outs or written) or any(t.numel() > self.limit for t in outs + tensors):
            return False
        try:
            done = self._real_run(func, args, kwargs)
        except Exception:  # the real kernel refuses what the fake one took: not known
            return False
        for fake, value in zip(outs, _tensors((done,), {}, torch.Tensor)):
            self._know(fake, value)
        return True

    def _real_run(self, func, args, kwargs):
        """func run on real CPU values, outside every mode: known values as they are (a real tensor
        handed in as a copy: it is never written), unknown ones zero (VALUE_FREE's input, or what
        SHAPED_BY says does not decide the shapes)."""
        torch = self._torch
        from torch.utils._pytree import tree_map
        from torch.utils._python_dispatch import _disable_current_modes
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        def real(x):
            if isinstance(x, torch.Tensor):
                v = self.value(x)
                if v is None:
                    return torch.zeros(x.shape, dtype=x.dtype)
                return v.clone() if v is x else v
            return torch.device("cpu") if isinstance(x, torch.device) else x
        with _disable_current_modes(), unset_fake_temporarily():
            return func(*tree_map(real, args), **{k: real(v) for k, v in kwargs.items()})

    def _kind(self, func):
        """(its output ignores its inputs' values, it is never known, (position, name) of what it writes)."""
        kind = self._kinds.get(func)
        if kind is None:
            name = func.overloadpacket.__name__
            never = name in UNDEFINED or self._torch.Tag.nondeterministic_seeded in func.tags
            writes = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                           if a.alias_info is not None and a.alias_info.is_write)
            kind = self._kinds[func] = (name in VALUE_FREE, never, writes)
        return kind

    def _written(self, func, args, kwargs):
        """The tensors func writes: in place, out=, set_ (positional or keyword; a foreach op's lists)."""
        out = []
        for i, name in self._kind(func)[2]:
            a = args[i] if i < len(args) else kwargs.get(name)
            out += _tensors((a,), {}, self._torch.Tensor)
        return out

    def _know(self, fake, value):
        if isinstance(fake, self._fake) and fake not in self.values:
            self.values[fake] = value
            self.storages.setdefault(fake.untyped_storage()._cdata, weakref.WeakSet()).add(fake)

    def _forget(self, written):
        """[(tensor, its storage id before the op)] written with something unknown: each tensor,
        and every known tensor on that storage, unknown."""
        for t, sid in written:
            self.values.pop(t, None)
            for fake in list(self.storages.pop(sid, ())):
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


def answered_read(name, original, answer, placeholders, where):
    """Tensor.<name> (item, tolist, __bool__, ...) for a shadow run: the real answer where the
    fake tensor knows it (a constant), else a placeholder (`answer`, or zeros for item and
    tolist), noted in `placeholders` with where() (the user's line)."""
    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException

    def read(t, *args, **kwargs):
        try:
            return original(t, *args, **kwargs)
        except DataDependentOutputException:
            value = answer
            if name in ("item", "tolist"):
                zero = False if t.dtype is torch.bool else 0.0 if t.dtype.is_floating_point else 0
                value = zero if name == "item" else _filled(list(t.shape), zero)
            placeholders.append({"read": f"Tensor.{name}()", "answer": value, "where": where() or "torch"})
            return value
    return read


def _filled(shape, value):
    if not shape:
        return value
    return [_filled(shape[1:], value) for _ in range(shape[0])]
