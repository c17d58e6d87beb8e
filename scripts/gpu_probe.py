"""Two CUDA-only questions, each asked in fresh processes (scripts/GPU_RUNS.md):

    python scripts/gpu_probe.py

1. `SystemError: ... returned NULL without setting an exception` in dropout or run_backward when a
   step with non-reentrant checkpointing and dropout runs under the allocator's history: which
   recording settings (context "all"/"alloc"/"state", stacks "python"/"all") and checkpoint
   early stop (on/off) raise it, and whether it happens with no recording at all.
3. Which part of an Audit raises that SystemError (a checkpointed encoder with dropout through
   the public Audit API): the whole Audit, then with one of its parts replaced by a no-op.
2. What imports the real torch._dynamo while the shadow runs a CUDA step, then a CPU one
   (tests/test_nodynamo.py's STEP): the Python stack at that import.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEP = """
import sys, torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
context, stacks, early = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
torch.manual_seed(0)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64)) for _ in range(3)).cuda()
if context != "none":
    torch.cuda.memory._record_memory_history(enabled="all", context=None if context == "None" else context,
                                            stacks=stacks, max_entries=100000)
with set_checkpoint_early_stop(early):
    for step in range(3):
        x = torch.randn(8, 32, 64, device="cuda")
        for b in blocks:
            x = checkpoint(b, x, use_reentrant=False)
        x.square().mean().backward()
print("ok")
"""

WHO = """
import sys, traceback, importlib.abc
class Hook(importlib.abc.MetaPathFinder):
    shown = 0
    def find_spec(self, name, path, target=None):
        stack = traceback.extract_stack()
        if name == "torch._dynamo" and self.shown < 2 and not any(f.name == "_install" for f in stack):
            self.shown += 1  # the stand-in's own find_spec (nodynamo._install) is not an import
            print("torch._dynamo imported from:")
            print("".join(traceback.format_list(stack[-30:-1])))
        return None
import torch
sys.meta_path.insert(0, Hook())
from memory_audit.prediction.shadow import step as shadow
from memory_audit.prediction.ledger.config import resolved
for device, extra in (("cuda", {"dtype": "float16"}), ("cpu", {}),  # as tests/test_nodynamo.py's STEP
                      ("cuda", {"parallel": "fsdp", "world_size": 2, "rank": 1, "activation_checkpointing": "none"})):
    cfg = resolved(dict({"preset": "cpu-tiny", "n_layer": 2, "batch_size": 2, "gradient_accumulation_steps": 2,
                         "activation_checkpointing": "selective", "dropout": 0.1}, **extra))
    shadow.run(cfg, device)
    print(f"after the {device} {extra.get('parallel', '')} step: dynamo imported:", "torch._dynamo" in sys.modules, flush=True)
"""


KNOBS = """
import sys, torch
knobs = set(",".join(sys.argv[1:2]).split(","))
if "all_stacks" in knobs:  # stacks on frees too (context "all"), as audits recorded before e8c7043
    _history = torch.cuda.memory._record_memory_history
    torch.cuda.memory._record_memory_history = lambda enabled="all", context="alloc", **k: _history(
        enabled=enabled, context="all" if enabled and context == "alloc" else context, **k)
if "early_stop" in knobs:  # checkpoint's early stop off (the exception that ends a recomputation)
    import torch.utils.checkpoint as _ckpt
    _ckpt._enable_checkpoint_early_stop = False
"""


AUDIT = KNOBS + """
import contextlib, sys, tempfile, torch
sys.path[:0] = ["scripts"]
import zoo
from memory_audit import Audit
from memory_audit.recording import audit as audit_module, recorder
parts = set(sys.argv[1].split(",")) - {""}  # the parts of an Audit replaced by no-ops
if "ledger" in parts:  # the saved-tensor ledger: its hooks, RNG-state notes, checkpoint regions
    audit_module.saved_tensor_ledger = lambda *a, **k: contextlib.nullcontext(lambda *a, **k: None)
if "loop_names" in parts:  # the hooks that find the batch, the output and the loss
    audit_module.LoopNames.watch = lambda self, model: None
if "grads" in parts:  # the gradients' registration at the end of backward
    audit_module.Audit._hook_gradients = lambda self: None
if "dumps" in parts:  # the phases' snapshots (step 2's start, before backward, end)
    recorder.AuditRecording.phase = lambda self, *a, **k: None
if "oom" in parts:  # the out-of-memory observer
    torch._C._cuda_attach_out_of_memory_observer = lambda f: None
if "calls" in parts:  # the torch-function mode naming what the loop makes (loop_calls)
    audit_module.Audit._watch_calls = lambda self, model: None
spec = {"lib": "plain", "name": "encoder_vit", "size": "tiny", "dtype": "float32", "optimizer": "adamw", "impl": "for",
        "checkpointing": True, "batch": 7, "seed": 1, "image": 32, "classes": 10, "width": 32, "layers": 3, "heads": 4,
        "patch": 8}
model, opt = zoo.build(spec, "cuda")
real_step = opt.step
def step(*a, **k):
    out = real_step(*a, **k)
    print("optimizer step done", flush=True)
    return out
opt.step = step
if "raises" in sys.argv[2:]:  # every exception raised in Python code, the last 30 printed at exit
    import atexit, collections
    seen = collections.deque(maxlen=400)
    def note(exc, code):
        seen.append(f"{type(exc).__name__}: {str(exc)[:80]!r} in {code.co_name} "
                    f"({code.co_filename.split('site-packages/')[-1]}:{code.co_firstlineno})")
    if hasattr(sys, "monitoring"):  # Python 3.12: every thread, the autograd engine's too
        mon = sys.monitoring
        mon.use_tool_id(3, "probe")
        mon.register_callback(3, mon.events.RAISE, lambda code, off, exc: note(exc, code))
        mon.set_events(3, mon.events.RAISE)
    else:
        def tracer(frame, event, arg):
            if event == "exception":
                note(arg[1], frame.f_code)
            return tracer
        sys.settrace(tracer)
    atexit.register(lambda: print("raised:", *[line for line in seen if "<frozen" not in line][-30:], sep="\\n  ",
                                  flush=True))
audit = Audit(model, opt, out_dir=tempfile.mkdtemp() + "/r", step=2) if "audit" not in parts else None
with audit if audit else contextlib.nullcontext():
    zoo.train(spec, "cuda", audit, model=model, optimizer=opt)
print("ok")
"""

# Measured on an H200 (torch 2.11, 2026-11-28, stacks on frees as audits then recorded): no Audit:
# ok; the whole Audit and every variant below with one or more parts off: the SystemError at step
# 0's backward. Its cause is the history's stacks on frees (part 4), not a part of the Audit.
AUDIT_VARIANTS = ("audit", "", "early_stop", "calls", "ledger,loop_names,calls", "ledger,loop_names,calls,grads",
                  "ledger,loop_names,calls,grads,dumps", "ledger,loop_names,calls,grads,dumps,oom", "dumps", "grads",
                  "oom")


TOY = """
import sys, torch
from torch import nn
from torch.utils.checkpoint import checkpoint
context = sys.argv[1]
torch.manual_seed(0)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1)) for _ in range(2)).cuda()
if context != "none":
    torch.cuda.memory._record_memory_history(enabled="all", context=context, stacks="python")
for step in range(2):
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    for b in blocks:
        x = checkpoint(b, x, use_reentrant=False)
    x.sum().backward()
print("ok")
"""

TRAIN = KNOBS + """
import runpy
sys.argv = ["train.py"] + sys.argv[2:]
runpy.run_path("train.py", run_name="__main__")
"""


def part4():
    """A checkpointed region whose last saved tensor is an output (dropout's mask): its
    recomputation stops inside the op by an exception, and the op's outputs are freed on the way
    out. Toy blocks under the allocator's history alone; train.py's audit and the Audit on the
    zoo's encoder as they record (stacks on allocations only), with stacks on frees too
    (`all_stacks`: the SystemError), and with those and early stop off."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    print("4. dropout last in a checkpoint region", flush=True)
    cfg = ["--audit", "--device=cuda", "--preset=cpu-tiny", "--activation_checkpointing=full", "--dropout=0.1"]
    tmp = tempfile.mkdtemp()
    runs = [("toy history " + c, TOY, (c,)) for c in ("none", "all", "alloc", "state")]
    runs += [("train.py audit, " + m, TRAIN, (m, *cfg, f"--audit_dir={tmp}", f"--run_name={m.replace(',', '-')}"))
             for m in ("as_is", "all_stacks", "all_stacks,early_stop")]
    runs += [("zoo encoder Audit: " + (knobs or "as is"), AUDIT, (knobs,)) for knobs in ("", "all_stacks")]
    with ThreadPoolExecutor(5) as pool:
        for (name, _, _), (rc, out) in zip(runs, pool.map(lambda r: run(r[1], *r[2]), runs)):
            err = next((line for line in reversed(out) if "Error" in line), "") if rc else ""
            print(f"  {name:48s}: {'ok' if rc == 0 else 'FAILED ' + err[:110]}", flush=True)
            if rc == 0 and name.startswith("train.py"):
                print("\n".join("    " + line for line in out if line.startswith("| peak") or "event" in line), flush=True)


def run(code, *args):
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    last = (p.stdout + p.stderr).strip().splitlines()
    return p.returncode, last


def main():
    """`python scripts/gpu_probe.py [PARTS]`: PARTS (default 1,3,2) picks the parts; part 3's
    variants run four at a time, then the whole Audit once more with every exception raised in
    Python code logged (`raises`)."""
    parts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["1", "3", "2"]
    if "1" in parts:
        part1()
    if "4" in parts:
        part4()
    if "3" in parts:
        part3()
    if "2" in parts:
        print("2. who imports torch._dynamo in a CUDA shadow step, then a CPU one")
        rc, out = run(WHO)
        print("\n".join("  " + line for line in out[-90:]))


def part1():
    print("1. checkpoint + dropout under the allocator's history")
    for context, stacks, early in (("none", "python", "on"), ("all", "python", "on"), ("all", "python", "off"),
                                   ("alloc", "python", "on"), ("state", "python", "on"), ("all", "all", "on"),
                                   ("alloc", "all", "on")):
        rc, out = run(STEP, context, stacks, early)
        err = next((line for line in reversed(out) if "Error" in line), "") if rc else ""
        print(f"  context={context:5s} stacks={stacks:6s} early_stop={early:3s}: {'ok' if rc == 0 else 'FAILED ' + err[:160]}",
              flush=True)


def part3():
    from concurrent.futures import ThreadPoolExecutor
    print("3. which part of an Audit raises it (the parts named replaced by no-ops)", flush=True)
    runs = [("", "raises")] + [(parts,) for parts in AUDIT_VARIANTS]
    with ThreadPoolExecutor(4) as pool:
        for args, (rc, out) in zip(runs, pool.map(lambda args: run(AUDIT, *args), runs)):
            steps = sum(line == "optimizer step done" for line in out)
            err = next((line for line in reversed(out) if "Error" in line), "") if rc else ""
            print(f"  off: {args[0] or '(none)':58s} {steps} steps: {'ok' if rc == 0 else 'FAILED ' + err[:120]}",
                  flush=True)
            if len(args) > 1:  # the whole Audit with every exception raised in Python code logged
                print("\n".join("    " + line for line in out[-40:]), flush=True)


if __name__ == "__main__":
    main()
