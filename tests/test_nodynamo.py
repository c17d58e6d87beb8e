"""torch._dynamo stood in for while a shadow runs (nodynamo.py): the same step, no
import of torch._dynamo, and the real one intact afterwards. Each check runs in a fresh process
(this one may have imported torch._dynamo already)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a CUDA shadow (meta tensors, autocast fp16, the optimizer's step, selective checkpointing: every
# thing the step asks of torch._dynamo), a CPU one on fake tensors (FakeTensorMode's dispatch) and
# an FSDP2 rank's (init_process_group clears dynamo's trace-rule caches)
STEP = """
import hashlib, json, sys
from memory_audit.prediction.shadow import step as shadow
from memory_audit.prediction.ledger.config import resolved
out = {}
for device, extra in (("cuda", {"dtype": "float16"}), ("cpu", {}),
                      ("cuda", {"parallel": "fsdp", "world_size": 2, "rank": 1, "activation_checkpointing": "none"})):
    cfg = resolved(dict({"preset": "cpu-tiny", "n_layer": 2, "batch_size": 2, "gradient_accumulation_steps": 2,
                         "activation_checkpointing": "selective", "dropout": 0.1}, **extra))
    r = shadow.run(cfg, device)
    out[device + extra.get("parallel", "")] = [len(r["events"]), r["peak"], hashlib.sha1(repr(r["history"] + r["events"]).encode()).hexdigest()]
out["dynamo_imported"] = "torch._dynamo" in sys.modules
print(json.dumps(out))
"""


def _python(code):
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1]


def test_the_shadow_step_is_the_same_without_importing_dynamo():
    alone = json.loads(_python(STEP))
    with_dynamo = json.loads(_python("import torch._dynamo\n" + STEP))
    assert alone.pop("dynamo_imported") is False
    assert with_dynamo.pop("dynamo_imported") is True
    assert alone == with_dynamo  # every event of both steps, in order, named and sized alike
    assert alone["cuda"][0] > 0 and alone["cpu"][0] > 0 and alone["cudafsdp"][0] > 0


def test_real_dynamo_works_after_the_stand_in_and_takes_over_what_it_handed_out():
    code = """
import sys, torch
from memory_audit.nodynamo import stood_in
w = torch._disable_dynamo(lambda x: x + 1)
with stood_in():
    assert type(sys.modules["torch._dynamo"]).__name__ == "_StandIn"
    assert w(torch.ones(1)).item() == 2.0  # cached on the function: the stand-in's disable
    assert torch._dynamo.config.error_on_nested_fx_trace is True  # config.py, loaded on its own
assert "torch._dynamo" not in sys.modules
with stood_in():  # anything else: the real module imported and asked
    assert torch._dynamo.is_compiling() is False
    assert type(sys.modules["torch._dynamo"]).__name__ == "module"
from torch._dynamo.utils import counters
out = torch.compile(lambda x: w(x) * 2, backend="eager")(torch.ones(2))
assert out.tolist() == [4.0, 4.0]
# the function disabled under the stand-in is skipped by the real dynamo, not traced
assert any("disable" in k for k in counters["graph_break"]), dict(counters["graph_break"])
print("ok")
"""
    assert _python(code) == "ok"


def test_a_submodule_asked_for_under_the_stand_in_is_executed_once():
    """`import torch._dynamo.utils` under the stand-in: the real package is imported first (it
    imports utils itself), and the import under way hands back that module instead of executing
    the file again (that would make two copies of utils' counters and caches). Some modules are
    executed twice by the real import alone (torch.utils._cxx_pytree; on a CUDA machine
    triton.language.extra.cuda and .hip): the stand-in may add none."""
    from test_nosympy import EXECUTED
    code = EXECUTED + """
import contextlib, torch
from memory_audit.nodynamo import stood_in
with {}:
    import torch._dynamo.utils as utils
assert utils is sys.modules["torch._dynamo.utils"] is sys.modules["torch._dynamo"].utils
print(sorted(k for k, v in executed.items() if v > 1))
"""
    alone = _python(code.format("contextlib.nullcontext()"))
    assert "torch._dynamo.utils" not in alone
    assert _python(code.format("stood_in()")) == alone


def test_a_config_that_cannot_load_alone_is_read_from_the_real_module():
    code = """
import importlib, sys, torch
from memory_audit.nodynamo import stood_in
real_import = importlib.import_module
def import_module(name, *args, **kwargs):  # a torch whose config.py needs its package
    if name == "torch._dynamo.config":
        raise ImportError("needs the package")
    return real_import(name, *args, **kwargs)
with stood_in():
    importlib.import_module = import_module
    try:
        flag = torch._dynamo.config.error_on_nested_fx_trace
    finally:
        importlib.import_module = real_import
    print(flag, type(sys.modules["torch._dynamo"]).__name__)
"""
    assert _python(code) == "True module"


TRAIN = """
import runpy, sys
sys.argv = ["train.py", "config/audit_cpu_tiny.py", "--device=cpu", "--audit", "--audit_dir={out}", "--run_name={name}",
            "--dropout=0.1", "--activation_checkpointing=selective", "--losses_out={out}/{name}.json"]
runpy.run_path("train.py", run_name="__main__")
print(type(sys.modules["torch._dynamo"]).__name__)
"""


def test_an_eager_train_py_audit_computes_the_same_without_importing_dynamo(tmp_path):
    """train.py stands in for torch._dynamo in an eager run (1.8 s of a 5 s cpu-tiny audit): the
    run never imports the real one, and gives the same losses bit for bit and the same measured
    lines as a run in a process that had imported it first."""
    from memory_audit.comparison.report import reconcile
    alone = _python(TRAIN.format(out=tmp_path, name="alone"))
    real = _python("import torch._dynamo\n" + TRAIN.format(out=tmp_path, name="real"))
    assert (alone, real) == ("_StandIn", "module")
    losses = [json.load(open(tmp_path / f"{n}.json")) for n in ("alone", "real")]
    assert losses[0] == losses[1] and len(losses[0]) >= 3
    rows = [{(r["phase"], r["key"]): r["actual"] for r in reconcile(str(tmp_path / n))["rows"]} for n in ("alone", "real")]
    assert rows[0] == rows[1] and len(rows[0]) > 50


def test_a_kernel_probe_does_not_import_inductor_or_dynamo():
    # the shadow's CPU kernel probe runs under the profiler, whose start asks
    # hasattr(torch, "_inductor"); where the probe's cache misses (another torch: the GPU machine's
    # 2.11) that imported torch._inductor and the real torch._dynamo inside the step
    code = """
import json, sys, torch
from memory_audit import nodynamo
from memory_audit.prediction.shadow import probe
with nodynamo.stood_in():
    events, out = probe._profiled(torch.mm, (torch.randn(64, 64), torch.randn(64, 64)), {}, torch)
print(json.dumps([len(events), "torch._inductor" in sys.modules, "torch._dynamo" in sys.modules]))
"""
    n, inductor, dynamo = json.loads(_python(code))
    assert n > 0 and not inductor and not dynamo


def test_compiled_autograd_is_off_under_the_stand_in_and_real_after():
    """torch 2.11's FSDP2 asks whether compiled autograd is on by importing
    torch._dynamo.compiled_autograd (a shadow rank's lazy init on the GPU machine imported the
    real torch._dynamo for it): under the stand-in its three flags are False and nothing is
    imported; anything else asked of it imports the real module and answers from it."""
    code = """
import sys, torch
from memory_audit.nodynamo import stood_in
with stood_in():
    import torch._dynamo.compiled_autograd as ca
    flags = (ca.compiled_autograd_enabled, ca.compiled_autograd_enabled_force_eager, ca.in_compiled_autograd_region)
    assert flags == (False, False, False) and type(sys.modules["torch._dynamo"]).__name__ == "_StandIn"
assert "torch._dynamo" not in sys.modules and "torch._dynamo.compiled_autograd" not in sys.modules
with stood_in():
    import torch._dynamo.compiled_autograd as ca
    real = ca._enable  # not a flag: the real module's
    assert type(sys.modules["torch._dynamo"]).__name__ == "module"
assert type(sys.modules["torch._dynamo.compiled_autograd"]).__name__ == "module"
assert real is sys.modules["torch._dynamo.compiled_autograd"]._enable
print("ok")
"""
    assert _python(code) == "ok"
