"""torch.fx.experimental.symbolic_shapes stood in for while a shadow runs, so a step on meta
tensors does not import sympy (issue #26: speed).

The meta kernels' Python references (torch._refs, torch._prims, torch._meta_registrations) ask
symbolic_shapes a dozen questions about their sizes and conditions (`guard_or_false(a)`,
`expect_true(a)` through torch._check, `sym_eq(shape, other)`, ...), each imported inside the
function that asks. The first import of that module imports sympy: 0.7 s of the 1.1 s that
`predict --preset=gpt2-xl` took after torch's own import on 2 cores, for questions about plain
ints and bools. A shadow of a CUDA step runs on meta tensors with plain int sizes, so there the
answers are the arguments themselves.

The stand-in answers those questions for plain Python values exactly as the real functions do
(each is written from torch 2.13's), and for anything else (a SymInt, a SymBool, any other name
asked of the module) imports the real module and answers from it. What it handed out (a function
a module imported by name while it was in place) does the same from then on: the stand-in
changes how long a step takes, never what it computes. It is in place only while a shadow runs
(`stood_in()`), and only where symbolic_shapes is not imported yet; a CPU shadow's FakeTensorMode
asks for more (its unbacked-symbol bookkeeping) and so imports the real module anyway.
"""

import contextlib
import functools
import importlib
import importlib.abc
import importlib.util
import operator
import sys
import types
import warnings

from .nodynamo import loaded_spec

NAME = "torch.fx.experimental.symbolic_shapes"


def _answer(name, plain_ok, answer):
    """A function of the module: answer(*args) where plain_ok(*args), else the real one's
    (keyword arguments too: the real one's)."""
    def fn(*args, **kwargs):
        if not kwargs and plain_ok(*args):
            return answer(*args)
        return getattr(_real(NAME), name)(*args, **kwargs)
    fn.__name__ = fn.__qualname__ = name
    return fn


def _is_bool(a, *rest):
    return type(a) is bool and not rest


def _eq(x, y):  # sym_eq on plain ints and lists or tuples of them
    if isinstance(x, (tuple, list)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_eq(a, b) for a, b in zip(x, y))
    return x == y


def _eq_plain(x, y):
    if isinstance(x, (tuple, list)) and isinstance(y, (list, tuple)):
        return all(_eq_plain(a, b) for a, b in zip(x, y))
    return type(x) is int and type(y) is int


def _size_oblivious(a):
    warnings.warn("guard_size_oblivious will be removed. Consider using explicit unbacked handling "
                  "potentially utilizing guard_or_false, guard_or_true, or statically_known_true",
                  FutureWarning, stacklevel=3)
    return a


_ANSWERS = {
    # bool in, the same bool out (expect_true through torch._check)
    **{name: (_is_bool, lambda a: a) for name in ("expect_true", "guard_or_false", "guard_or_true",
                                                   "statically_known_true")},
    "guard_size_oblivious": (_is_bool, _size_oblivious),
    "guard_int": (lambda a, *rest: type(a) is int and not rest, lambda a: a),
    "guarding_hint_or_throw": (lambda a, *rest: type(a) in (bool, int) and not rest, lambda a: a),
    "has_guarding_hint": (lambda a, *rest: type(a) in (bool, int, float) and not rest, lambda a: True),
    "is_nested_int": (lambda s, *rest: type(s) in (bool, int, float) and not rest, lambda s: False),
    "sym_and": (lambda *a: bool(a) and all(type(v) is bool for v in a), lambda x, *o: functools.reduce(operator.and_, o, x)),
    "sym_or": (lambda *a: bool(a) and all(type(v) is bool for v in a), lambda x, *o: functools.reduce(operator.or_, o, x)),
    "sym_eq": (lambda *a: len(a) == 2 and _eq_plain(*a), _eq),
}


class _NoSympyObject:
    """sympy.Basic while sympy is not imported: no sympy object can exist, so nothing is one
    (torch._prims_common.elementwise_dtypes asks isinstance(x, sympy.Basic) of every argument)."""


class _GuardOnDataDependentSymNode(RuntimeError):
    """symbolic_shapes.GuardOnDataDependentSymNode handed to a module imported while the stand-in
    is in place (DTensor's decompositions: `except GuardOnDataDependentSymNode`): nothing raises it
    where symbolic_shapes is not imported (no SymInt exists); once it is, every module global
    bound to this class is bound to the real one (_rebind), so an except clause catches what the
    real module raises."""


_LATE = {"GuardOnDataDependentSymNode": _GuardOnDataDependentSymNode}  # classes handed out for the real ones


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):  # the import machinery's questions: the real module's, once it is imported
            real = sys.modules.get(self.__name__)
            if real is None or real is self:
                raise AttributeError(name)
            return getattr(real, name)
        if name == "Basic" and self.__name__ == "sympy" and sys.modules.get("sympy") in (None, self):
            return _NoSympyObject  # asked again once the real sympy is imported (a module that
            # bound this stand-in while it was in place), the real class
        if name in _LATE and self.__name__ == NAME and sys.modules.get(NAME) in (None, self):
            _WATCH.place()
            return _LATE[name]
        return getattr(_real(self.__name__), name)


def _rebind(real):
    """Every module global bound to a class of _LATE, bound to the real module's own (this
    module's own names for them stay)."""
    late = {id(c): getattr(real, n) for n, c in _LATE.items() if hasattr(real, n)}
    for module in list(sys.modules.values()):
        d = getattr(module, "__dict__", None) if module is not sys.modules.get(__name__) else None
        for k, v in list(d.items()) if isinstance(d, dict) else ():
            if id(v) in late and isinstance(v, type):
                d[k] = late[id(v)]


class _Watch(importlib.abc.MetaPathFinder):
    """After a _LATE class was handed out: the real symbolic_shapes' import, however it comes
    (the stand-in's _real or a plain import once the stand-in is gone), ends in _rebind. It stays
    first in sys.meta_path until that import (each other import asks it one string comparison)."""

    finding = False  # inside its own search for the module's spec (the finders after it answer)

    def place(self):
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, name, path=None, target=None):
        if name != NAME or self.finding:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.finding = False
        if spec is not None and spec.loader is not None:
            spec.loader = _Rebinding(spec.loader)
        return spec


class _Rebinding(importlib.abc.Loader):
    """A module's own loader, then _rebind; the module keeps its own loader, and the watch goes."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _rebind(module)
        if _WATCH in sys.meta_path:
            sys.meta_path.remove(_WATCH)

    def __getattr__(self, name):  # get_source, get_filename, ...: the module's own loader's
        return getattr(self.loader, name)


_WATCH = _Watch()


_SHAPES = _StandIn(NAME, __doc__)
for _name, (_ok, _fn) in _ANSWERS.items():
    setattr(_SHAPES, _name, _answer(_name, _ok, _fn))
_SYMPY = _StandIn("sympy", "sympy, stood in for by memory_audit.nosympy")
_STAND_INS = {NAME: _SHAPES, "sympy": _SYMPY}


class _Guard(importlib.abc.MetaPathFinder):
    """A sympy submodule asked for while the stand-in is in place: the real package first."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("sympy.") and sys.modules.get("sympy") is _SYMPY:
            _real("sympy")
            return loaded_spec(name)
        return None


_GUARD = _Guard()


def _parent(name):
    """The package that holds symbolic_shapes as an attribute (imported with torch)."""
    return importlib.import_module("torch.fx.experimental") if name == NAME else None


def _real(name):
    """The real module, imported now if its stand-in is in its place (symbolic_shapes after the
    real sympy: its `import sympy` would otherwise bind the stand-in for good)."""
    if sys.modules.get(name) is _STAND_INS[name]:
        if name == NAME:
            _real("sympy")
        _remove(name)
    return importlib.import_module(name)


_SPECS = {}  # name -> its spec, found once (a search of sys.path each shadow run otherwise)


def _install(name):
    if name not in _SPECS:
        _SPECS[name] = importlib.util.find_spec(name)
    spec = _SPECS[name]
    if spec is None:  # not installed: the real import raises as it would
        return False
    _STAND_INS[name].__file__ = spec.origin
    if spec.submodule_search_locations is not None:  # a package: its submodules' imports reach _Guard
        _STAND_INS[name].__path__ = list(spec.submodule_search_locations)
    sys.modules[name] = _STAND_INS[name]
    if _parent(name) is not None:
        _parent(name).symbolic_shapes = _STAND_INS[name]
    return True


def _remove(name):
    if sys.modules.get(name) is _STAND_INS[name]:
        del sys.modules[name]
    parent = _parent(name)
    if parent is not None and getattr(parent, "symbolic_shapes", None) is _STAND_INS[name]:
        del parent.symbolic_shapes


@contextlib.contextmanager
def stood_in():
    """symbolic_shapes and sympy stood in for inside the block, where neither is imported yet."""
    if NAME in sys.modules or "sympy" in sys.modules:
        yield
        return
    mine = [name for name in _STAND_INS if _install(name)]
    sys.meta_path.insert(0, _GUARD)
    try:
        yield
    finally:
        if _GUARD in sys.meta_path:
            sys.meta_path.remove(_GUARD)
        for name in mine:
            _remove(name)
