"""torch._dynamo stood in for while a shadow runs or a CPU audit records, so an eager step does not import it (issue #26: speed).

An eager step asks torch._dynamo five things: `disable(fn)` (through torch._disable_dynamo's
wrappers: every dispatch mode's __torch_dispatch__, the prims references, the optimizer's
constructor and zero_grad, checkpoint), `graph_break()` (torch.optim's step), `config`
(checkpoint reads one flag) and, where a process group is made (a torchrun rank's shadow),
`trace_rules.clear_lru_cache()` (init_process_group: the caches of a module not imported are
empty, so there it does nothing) and, in torch 2.11's FSDP2, whether compiled autograd is on
(`import torch._dynamo.compiled_autograd`: off where the real module is not imported). Importing torch._dynamo for them costs about 1 s of a shadow-backed
command on 2 cores (measured with the shadow's other imports already done), more than the shadow
of GPT-2 xl; in a CPU audit it cost 1.8 s of a 5.7 s cpu-tiny run (the profiler's start probed
torch._inductor, which imports it), and imported inside the profile it is 40 s more (every
Python call of the import is recorded and walked).

Nothing can be compiling in a process that has not imported torch._dynamo, so there `disable(fn)`
is fn itself and `graph_break()` does nothing; `config` is the real module file, loaded on its own
(torch._dynamo's own import reuses it later). Anything else asked of the stand-in, as an attribute
or as a submodule, imports the real torch._dynamo first and answers from it, and what the
stand-in handed out (the `disable` wrappers torch caches on each function) defers to the real
module from then on: the stand-in changes how long a step takes, never what it does. It is in
place only while a shadow runs or a CPU audit's profiler records (`stood_in()`), or in an eager
train.py run from its setup on (`enter()`), and only where torch._dynamo is not imported yet.
"""

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
import types

NAME = "torch._dynamo"
OWN = {NAME + ".config"}  # submodules loaded under the stand-in, without the package's own import


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "config":
            try:
                return importlib.import_module(NAME + ".config")
            except Exception:  # a torch whose config.py needs its package: the real one
                pass
        if name == "trace_rules":
            return _TRACE_RULES
        return getattr(_real(), name)


class _TraceRules:
    """torch._dynamo.trace_rules asked of the stand-in: clear_lru_cache() clears nothing where
    the real module is not imported (its caches are made by its import), the real one's once it
    is; anything else is the real module's."""

    @staticmethod
    def clear_lru_cache():
        if _loaded() is not None:
            _loaded().trace_rules.clear_lru_cache()

    def __getattr__(self, name):
        return getattr(_real().trace_rules, name)


_TRACE_RULES = _TraceRules()


def _flag(name):
    """One of compiled autograd's flags: the real module's where it is loaded, else off."""
    def read(self):
        real = sys.modules.get(self.__name__)
        return False if real is None or real is self else getattr(real, name)
    return property(read)


class _CompiledAutograd(types.ModuleType):
    """torch._dynamo.compiled_autograd asked for while the stand-in is in place (FSDP2's lazy
    init asks whether compiled autograd is on, torch 2.11's by importing this module): it is off
    in a process that has not imported torch._dynamo, since turning it on imports the real
    module; once that is loaded, its flags are the real module's. Anything else asked of it is
    the real module's."""
    compiled_autograd_enabled = _flag("compiled_autograd_enabled")
    compiled_autograd_enabled_force_eager = _flag("compiled_autograd_enabled_force_eager")
    in_compiled_autograd_region = _flag("in_compiled_autograd_region")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        _real()
        if sys.modules.get(self.__name__) in (None, self):
            sys.modules.pop(self.__name__, None)
        return getattr(importlib.import_module(self.__name__), name)


_COMPILED_AUTOGRAD = _CompiledAutograd(NAME + ".compiled_autograd")


class _Guard(importlib.abc.MetaPathFinder):
    """A submodule other than config asked for while the stand-in is in place: the real
    package first (a submodule must not load without its package's import); compiled_autograd
    is answered by its stand-in."""

    def find_spec(self, name, path=None, target=None):
        if name == _COMPILED_AUTOGRAD.__name__ and sys.modules.get(NAME) is _STAND_IN:
            return importlib.util.spec_from_loader(name, _Loaded(_COMPILED_AUTOGRAD))
        if name.startswith(NAME + ".") and name not in OWN and sys.modules.get(NAME) is _STAND_IN:
            _real()
            return loaded_spec(name)
        return None


class _Loaded(importlib.abc.Loader):
    """Loads a module that is loaded already: hands it back as it is."""

    def __init__(self, module):
        self.module, self.spec = module, getattr(module, "__spec__", None)

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec  # module_from_spec set the spec it was handed


def loaded_spec(name):
    """For a stand-in's import guard, once the real package is imported: the spec of submodule
    `name` if that import loaded it, else None (the other finders find it). The import under way
    began before the package's and would execute the module's file a second time (it takes the
    spec of a module already in sys.modules and loads it again); taken out of sys.modules, the
    module is handed back as it is and put in again by that import."""
    module = sys.modules.pop(name, None)
    return None if module is None else importlib.util.spec_from_loader(name, _Loaded(module))


def _loaded():
    """The real torch._dynamo where it has been imported, else None."""
    m = sys.modules.get(NAME)
    return None if m is None or m is _STAND_IN else m


def _real():
    """The real torch._dynamo, imported now if the stand-in is in its place (or nothing is)."""
    if sys.modules.get(NAME) is _STAND_IN:
        _remove()
    return importlib.import_module(NAME)


def disable(fn=None, recursive=True, *, reason=None, wrapping=True):
    """torch._dynamo.disable(fn) in a process where nothing compiles: fn (a decorator without
    fn, as the real one); the real one's once torch._dynamo is imported."""
    if fn is None:
        return lambda f: disable(f, recursive, reason=reason, wrapping=wrapping)
    real = []

    def call(*args, **kwargs):
        if not real and _loaded() is not None:
            real.append(_loaded().disable(fn, recursive, reason=reason, wrapping=wrapping))
        return (real[0] if real else fn)(*args, **kwargs)
    return call


def graph_break(msg=""):
    """torch._dynamo.graph_break(): nothing outside a compilation; the real one once imported."""
    if _loaded() is not None:
        return _loaded().graph_break(msg)


_STAND_IN = _StandIn(NAME, __doc__)
_STAND_IN.disable, _STAND_IN.graph_break = disable, graph_break
_GUARD = _Guard()


def _install():
    import torch
    spec = importlib.util.find_spec(NAME)
    _STAND_IN.__path__ = list(spec.submodule_search_locations)  # config's file, loaded on its own
    sys.modules[NAME] = _STAND_IN
    torch._dynamo = _STAND_IN
    sys.meta_path.insert(0, _GUARD)


def _remove():
    import torch
    if sys.modules.get(NAME) is _STAND_IN:
        del sys.modules[NAME]
    if sys.modules.get(_COMPILED_AUTOGRAD.__name__) is _COMPILED_AUTOGRAD:
        del sys.modules[_COMPILED_AUTOGRAD.__name__]
    if _STAND_IN.__dict__.get("compiled_autograd") is _COMPILED_AUTOGRAD:  # set by the import
        del _STAND_IN.compiled_autograd
    if getattr(torch, "_dynamo", None) is _STAND_IN:
        del torch._dynamo
    if sys.meta_path is not None and _GUARD in sys.meta_path:  # None: the interpreter is shutting down
        sys.meta_path.remove(_GUARD)


def enter():
    """Stand in for torch._dynamo now, where it is not imported yet: True if this call did
    (then `leave()` takes it away), False where torch._dynamo (or the stand-in) is there."""
    if NAME in sys.modules:
        return False
    _install()
    return True


def leave():
    """Take the stand-in away (the real torch._dynamo, once imported, stays)."""
    _remove()


@contextlib.contextmanager
def stood_in():
    """torch._dynamo stood in for inside the block, where it is not imported yet."""
    mine = enter()
    try:
        yield
    finally:
        if mine:
            leave()


@contextlib.contextmanager
def inductor_not_offered():
    """The profiler's start asks hasattr(torch, "_inductor") (for inductor's cudagraphs setting),
    and torch's lazy attribute answers by importing torch._inductor and torch._dynamo: 1.8 s of
    a 5.7 s cpu-tiny audit on 2 cores. Nothing has compiled in a process that has not imported
    torch._inductor, so while the profiler starts, an unimported one is not offered (the answer
    is then False, as it is for a process that never compiles); imported, nothing changes."""
    import torch
    lazy = getattr(torch, "_lazy_modules", None)
    if "torch._inductor" in sys.modules or not isinstance(lazy, set) or "_inductor" not in lazy:
        yield
        return
    lazy.discard("_inductor")
    try:
        yield
    finally:
        lazy.add("_inductor")
