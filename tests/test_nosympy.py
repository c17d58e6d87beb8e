"""symbolic_shapes and sympy stood in for while a shadow runs (nosympy.py): the same step without
importing sympy, the stand-in's answers the real functions' on every value, and the real modules
intact afterwards. Each check runs in a fresh process (this one may have imported sympy)."""

import random

import torch

from test_nodynamo import _python

# CUDA shadows (meta tensors) over what a step asks the meta kernels: fp16 autocast with selective
# checkpointing, dropout and accumulation; bf16 SAC with fused AdamW; fp32 SDPA with full
# checkpointing, no clipping, set_to_none=False; then a CPU one (FakeTensorMode), which imports
# symbolic_shapes itself
STEP = """
import hashlib, json, sys
from memory_audit.prediction.shadow import step as shadow
from memory_audit.prediction.ledger.config import resolved
out = {}
for i, extra in enumerate(({"dtype": "float16", "activation_checkpointing": "selective", "dropout": 0.1,
                            "gradient_accumulation_steps": 2},
                           {"dtype": "bfloat16", "activation_checkpointing": "sac", "optimizer_impl": "fused"},
                           {"dtype": "float32", "attention": "sdpa", "activation_checkpointing": "full",
                            "grad_clip": 0.0, "set_to_none": False})):
    cfg = resolved(dict({"preset": "cpu-tiny", "n_layer": 2, "batch_size": 2}, **extra))
    r = shadow.run(cfg, "cuda", workspace_bytes=1 << 20)
    out[i] = [len(r["events"]), r["peak"], hashlib.sha1(repr(r["history"] + r["events"]).encode()).hexdigest()]
out["sympy_imported"] = "sympy" in sys.modules
r = shadow.run(resolved({"preset": "cpu-tiny", "n_layer": 2, "batch_size": 2}), "cpu")
out["cpu"] = [len(r["events"]), r["peak"], hashlib.sha1(repr(r["events"]).encode()).hexdigest()]
print(json.dumps(out))
"""


def test_the_shadow_step_is_the_same_without_importing_sympy():
    import json
    alone = json.loads(_python(STEP))
    imported = json.loads(_python("import torch.fx.experimental.symbolic_shapes, sympy\n" + STEP))
    assert alone.pop("sympy_imported") is False  # the three CUDA shadows asked it nothing it could not answer
    assert imported.pop("sympy_imported") is True
    assert alone == imported  # every event of every step, in order, named and sized alike
    assert all(alone[k][0] > 0 for k in alone)


def test_the_stand_ins_answers_are_the_real_functions():
    """On plain values each function answers what torch's own does (type included), its error
    where torch's raises one; on a SymInt it asks the real module."""
    code = """
import sys, warnings
from memory_audit import nosympy
with nosympy.stood_in():
    import torch.fx.experimental.symbolic_shapes as mine
    assert type(mine).__name__ == "_StandIn"
    names = ["expect_true", "guard_or_false", "guard_or_true", "statically_known_true", "guard_size_oblivious",
             "guard_int", "guarding_hint_or_throw", "has_guarding_hint", "is_nested_int", "sym_and", "sym_or", "sym_eq"]
    ours = {n: getattr(mine, n) for n in names}
    assert type(sys.modules["sympy"]).__name__ == "_StandIn"
assert "torch.fx.experimental.symbolic_shapes" not in sys.modules
import torch
import torch.fx.experimental.symbolic_shapes as real
cases = {n: [(True,), (False,), (1,), (0,), (2.0,), (None,)] for n in names}
cases["sym_and"] = cases["sym_or"] = [(True,), (True, False), (True, True, True), (False, True), (1, True), ()]
cases["sym_eq"] = [(3, 3), (3, 4), ((2, 3), (2, 3)), ([2, 3], (2, 4)), ((2,), (2, 3)), ([[1], 2], [[1], 2]), (True, 1),
                   (2.0, 2.0), ((2, 3.0), (2, 3.0))]
n = 0
for name in names:
    for args in cases[name]:
        def answer(fn):
            try:
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    out = fn(*args)
                return ("value", out, type(out), [x.category for x in w])
            except Exception as e:
                return ("error", type(e))
        assert answer(ours[name]) == answer(getattr(real, name)), (name, args, answer(ours[name]))
        n += 1
env = real.ShapeEnv()
s = env.create_unbacked_symint()
assert ours["is_nested_int"](s) is False and ours["has_guarding_hint"](s) is real.has_guarding_hint(s) is False
assert ours["guard_or_false"](s == 3) is real.guard_or_false(s == 3) is False
assert ours["expect_true"](True, skip=1) is True  # a keyword: the real function's
print(n)
"""
    assert int(_python(code)) == 9 * 6 + 2 * 6 + 9  # every case compared


def test_sympy_stood_in_then_real():
    code = """
import sys
from memory_audit import nosympy
with nosympy.stood_in():
    import sympy
    assert type(sympy).__name__ == "_StandIn" and not isinstance(1, sympy.Basic)
    x = sympy.Symbol("x")  # anything else: the real package, imported now
    assert type(sys.modules["sympy"]).__name__ == "module" and isinstance(x, sys.modules["sympy"].Basic)
with nosympy.stood_in():  # imported: nothing stood in for
    assert type(sys.modules["sympy"]).__name__ == "module"
print("ok")
"""
    assert _python(code) == "ok"
    code = EXECUTED + """
from memory_audit import nosympy
with nosympy.stood_in():
    from sympy.core import numbers  # a submodule: the real package first, each file executed once
    import sympy.core.numbers as again
    assert type(sys.modules["sympy"]).__name__ == "module"
assert numbers is again is sys.modules["sympy.core.numbers"] and sys.modules["sympy"].core is sys.modules["sympy.core"]
assert "torch.fx.experimental.symbolic_shapes" not in sys.modules
import torch.fx.experimental.symbolic_shapes
print(sorted(k for k, v in executed.items() if v > 1))
"""
    assert _python(code) == "[]"


def test_the_real_modules_bind_the_real_sympy_when_imported_under_the_stand_in():
    """A CPU shadow's FakeTensorMode imports the real symbolic_shapes while sympy is stood in for:
    it binds the real sympy, and a module that bound the stand-in meanwhile reads the real
    sympy.Basic once sympy is imported. Then a compiled prediction in the same process lowers its
    graph (it stopped with "cannot extract sympy expressions from 8 <class 'sympy...Integer'>")."""
    code = """
import sys
from memory_audit import nosympy
with nosympy.stood_in():
    import sympy as bound  # a module's `import sympy` under the stand-in
    import torch.fx.experimental.symbolic_shapes as shapes
    shapes.ShapeEnv  # anything past the stand-in's answers: the real module, imported now
real = sys.modules["sympy"]
assert type(real).__name__ == "module" and type(bound).__name__ == "_StandIn"
assert shapes.sympy is real and bound.Basic is real.Basic and isinstance(real.Integer(8), bound.Basic)
assert bound.__version__ == real.__version__  # inductor's lowering asked it: AttributeError before
from memory_audit.prediction.predict import device_facts, prediction
cpu = device_facts("cpu")
tiny = dict(n_layer=1, n_head=1, n_embd=8, vocab_size=64, block_size=16, batch_size=1, dtype="float32")
prediction(tiny, cpu)  # a CPU shadow: its FakeTensorMode imports symbolic_shapes
print(prediction(dict(tiny, compile=True), cpu)["totals"]["from"])
"""
    assert _python(code) == "inductor's plan (compile=True)"


# counts each module file executed, for the checks that a submodule asked for under a stand-in
# is executed once (the import under way would run it again once the real package had)
EXECUTED = """
import collections, importlib._bootstrap_external as external, sys
executed, _run = collections.Counter(), external._LoaderBasics.exec_module
def _counted(self, module):
    executed[module.__name__] += 1
    return _run(self, module)
external._LoaderBasics.exec_module = _counted
"""


def test_dense_is_what_cpp_decides():
    """shadow/rules/autograd.dense (autograd's in-place gradient sum asks it; torch's Python reference
    imports sympy) against c10's own answer, read through empty_like (which keeps the strides of
    a non-overlapping, dense tensor) on random layouts: permuted contiguous ones, some spoiled,
    and random strides, sizes 0-5 over 1-5 dims."""
    from memory_audit.prediction.shadow.rules.autograd import dense
    seed = random.randrange(1 << 20)
    rng = random.Random(seed)
    dense_seen = 0
    for _ in range(3000):
        dim = rng.randint(1, 5)
        sizes = [rng.choice([0, 1, 1, 2, 3, 4, 5]) for _ in range(dim)]
        if rng.random() < 0.6:
            strides, acc = [0] * dim, 1
            for d in rng.sample(range(dim), dim):
                strides[d], acc = acc, acc * max(sizes[d], 1)
            if rng.random() < 0.3:
                strides[rng.randrange(dim)] = rng.choice([0, 1, 2, 7])
        else:
            strides = [rng.choice([0, 1, 2, 3, 4, 6, 12, 20]) for _ in range(dim)]
        t = torch.empty_strided(sizes, strides)
        cpp = t.is_contiguous() or torch.empty_like(t).stride() == t.stride()
        assert dense(sizes, strides) == cpp, (seed, sizes, strides)
        dense_seen += cpp and not t.is_contiguous()
    assert dense_seen > 100, seed  # not only contiguous ones


def test_dtensors_guard_class_is_the_real_one_once_symbolic_shapes_is_imported():
    """DTensor's decompositions bind symbolic_shapes.GuardOnDataDependentSymNode as they are
    imported (an FSDP2 or TP rank's shadow): the stand-in hands out a class of its own, so the
    import needs no sympy; once symbolic_shapes is imported, by a plain import after the shadow
    or through the stand-in inside it, the module's global is the real class again (its
    `except` catches what the real module raises)."""
    code = """
import sys, torch
from memory_audit import nosympy
with nosympy.stood_in():
    import torch.distributed.tensor._decompositions as dec
assert "sympy" not in sys.modules, "DTensor's import imported sympy"
import torch.fx.experimental.symbolic_shapes as ss
assert dec.GuardOnDataDependentSymNode is ss.GuardOnDataDependentSymNode
import inspect
assert "class GuardOnDataDependentSymNode" in inspect.getsource(ss)
assert type(ss.__loader__).__name__ == "SourceFileLoader" and ss.__spec__.loader is ss.__loader__  # its own
assert nosympy._GuardOnDataDependentSymNode is not ss.GuardOnDataDependentSymNode  # the stand-in's own stays
assert nosympy._WATCH not in sys.meta_path  # the watch has gone with the import
print("ok")
"""
    assert _python(code) == "ok"
    inside = """
import sys, torch
from memory_audit import nosympy
with nosympy.stood_in():
    import torch.distributed.tensor._decompositions as dec
    import torch.fx.experimental.symbolic_shapes as ss  # the stand-in's
    ss.ShapeEnv  # a name the stand-in does not answer: the real module imported now
real = sys.modules["torch.fx.experimental.symbolic_shapes"]
assert dec.GuardOnDataDependentSymNode is real.GuardOnDataDependentSymNode
print("ok")
"""
    assert _python(inside) == "ok"
