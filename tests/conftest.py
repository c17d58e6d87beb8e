"""Shared fixtures: tiny CPU audits made once per session, paths to committed examples."""

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
FOREIGN = os.path.join(SHARED, "fixtures", "foreign_snapshots")
EXAMPLES = os.path.join(ROOT, "snapshots", "examples")
# Under CI=true what a test would otherwise skip for (the shared fixtures, the real viewer and
# what serves it) must be there: a skip there would hide a check that never ran.
STRICT = os.environ.get("CI", "").lower() in ("true", "1")
REQUIRED_UNDER_CI = {
    "../shared/fixtures/foreign_snapshots": lambda: os.path.isdir(FOREIGN) and bool(os.listdir(FOREIGN)),
    "../shared/fixtures/pt_snap_cli": lambda: os.path.isdir(os.path.join(SHARED, "fixtures", "pt_snap_cli")),
    "../shared/vendor/pytorch_memory_viz/MemoryViz.js":
        lambda: os.path.isfile(os.path.join(SHARED, "vendor", "pytorch_memory_viz", "MemoryViz.js")),
    "npm": lambda: shutil.which("npm") is not None,
    "chromium (.ci/run installs Debian's)": lambda: shutil.which("chromium") or shutil.which("chromium-browser"),
}


def pytest_configure(config):
    """One seed for every random draw of the run (test_shadow, test_distributed, test_shadow_repeat,
    test_shadow_cuda): drawn once here by the process that runs pytest, handed to xdist's workers
    through the environment (they start after this), printed at the start and the end, pass or
    fail. SHADOW_SEED=N replays it."""
    if not os.environ.get("SHADOW_SEED"):
        import random
        os.environ["SHADOW_SEED"] = str(random.SystemRandom().randrange(10 ** 6))


def _seed_line():
    return f"random draws: seed {os.environ['SHADOW_SEED']} (replay: SHADOW_SEED={os.environ['SHADOW_SEED']})"


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_seed_line())


def pytest_sessionstart(session):
    if STRICT:
        missing = [name for name, present in REQUIRED_UNDER_CI.items() if not present()]
        if missing:
            raise pytest.UsageError(f"CI=true and missing: {', '.join(missing)} (tests would skip without them)")


def same_bf16_kernels(cpu):
    """Whether a bf16 row measured on `cpu` (its recorder.cpu_info record; None for the files
    measured before rows carried one, on an AMD EPYC) is asked of the same bf16 kernels here: both
    CPUs run bf16 matmuls through oneDNN or neither does, and both have AMX's bf16 tiles or neither
    (an AMD EPYC's avx512_bf16 kernels and a Xeon's AMX ones make other scratch buffers: 11 of the
    70 bf16 rows of shadow-check-493858 differ, every fp32 row agrees). Records without
    "amx_bf16" were made on AMD EPYCs (Zen 4: no AMX)."""
    here = _this_cpu()
    cpu = cpu or {"model": "AMD EPYC", "onednn_bf16": True}
    amx = cpu.get("amx_bf16", False if cpu["model"].startswith("AMD") else None)
    same_vendor = cpu["model"].split()[:1] == here["model"].split()[:1]  # "AMD", "Intel(R)", ...
    return cpu["onednn_bf16"] == here["onednn_bf16"] and (
        not here["onednn_bf16"] or (same_vendor and amx == here["amx_bf16"]))


@functools.lru_cache(maxsize=1)
def _this_cpu():
    from memory_audit.recording.recorder import cpu_info
    return cpu_info()


def native_bf16_matmul():
    """Whether this CPU runs bf16 matmuls through oneDNN (avx512_bf16 or AMX: PyTorch's mkldnn
    bf16 path, e.g. AMD EPYC Zen 4). Those kernels allocate scratch buffers the ledger does not
    model (34,432 B after cpu-tiny's first c_attn mm at batch 1; docs/limits.md; the shadow run
    asks the kernels, shadow/probe), so the ledger's CPU bf16 predictions are held to the byte
    only where they take PyTorch's own kernels (PLAIN_BF16_ENV below)."""
    import torch
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# The ledger's CPU bf16 lines are held to the byte as measured where bf16 matmuls take PyTorch's own
# kernels. On a CPU that runs them through oneDNN (the CI machine's AMD EPYC: avx512_bf16) a child
# audit is run with oneDNN capped below that ISA (ONEDNN_MAX_CPU_ISA=AVX2: oneDNN's own knob;
# torch.ops.mkldnn._is_mkldnn_bf16_supported() then answers False), so the same cases run and are
# asserted on every CPU instead of being skipped. The shadow run needs no such cap: it asks the
# kernels (prediction/shadow/probe), and its tests run on the CPU as it is.
PLAIN_BF16_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2"} if native_bf16_matmul() else {}


def skip_or_fail(reason):
    """Skip off CI; under CI=true a check that cannot run fails instead."""
    (pytest.fail if STRICT else pytest.skip)(reason)


def run_train(*args, cwd=ROOT, timeout=300, env=None):
    """Run train.py in a child process (it is a script, as nanoGPT's is); env: variables added."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def run_cli(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "memory_audit", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def audit(tmp_dir, name, *args, env=None):
    """A CPU audit of a tiny model; returns its run directory."""
    p = run_train("--audit", "--device=cpu", "--preset=cpu-tiny", "--batch_size=2",
                  f"--audit_dir={tmp_dir}", f"--run_name={name}", *args, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return os.path.join(tmp_dir, name)


def made_once(tmp_path_factory, name, args, make):
    """The path <session tmp>/shared/<name>, made by make(path) once per test session: under
    pytest-xdist the workers share it (the session's temporary root, a lock per name), so what
    tests on both workers use is made once. `args` say what was made; a name asked for again
    with other args is an error."""
    import fcntl
    shared = os.environ.get("PYTEST_XDIST_WORKER") is not None
    base = tmp_path_factory.getbasetemp().parent / "shared" if shared else tmp_path_factory.getbasetemp() / "shared"
    base.mkdir(exist_ok=True)
    path, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker making this one: wait for it
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # one that failed half-way
            make(path)
            done.write_text(repr(args))
        assert done.read_text() == repr(args), f"{name!r} asked for with other arguments"
    return path


@pytest.fixture(scope="session")
def audits(tmp_path_factory):
    """name -> run dir, for a few CPU audits shared by the tests (made once: cpu_run alone is
    used by eight files, and each worker made its own, 4-6 s each on 2 cores)."""
    def get(name, *args):
        return str(made_once(tmp_path_factory, name, args, lambda path: audit(str(path.parent), name, *args)))
    return get


@pytest.fixture(scope="session")
def plain_audits(tmp_path_factory):
    """audits' twin for the ledger's bf16 checks: each audit made with PLAIN_BF16_ENV (bf16
    matmuls in PyTorch's own kernels, whatever this CPU is)."""
    def get(name, *args):
        run = str(made_once(tmp_path_factory, "plain-" + name, args,
                            lambda path: audit(str(path.parent), "plain-" + name, *args, env=PLAIN_BF16_ENV)))
        assert load_json(os.path.join(run, "meta.json"))["device"]["cpu"]["onednn_bf16"] is False, run
        return run
    return get


@pytest.fixture(scope="session")
def cpu_run(audits):
    return audits("fp32-manual-gelu", "--dtype=float32", "--attention=manual", "--activation=gelu")


def tiny_gpt(seed=0):
    """cpu-tiny's GPT (model.py), seeded, and its config."""
    import torch
    from model import GPT, GPTConfig, PRESETS
    torch.manual_seed(seed)
    cfg = GPTConfig(**{k: v for k, v in PRESETS["cpu-tiny"].items() if k in GPTConfig.__dataclass_fields__})
    return GPT(cfg), cfg


def gpt_steps(forward, opt, batches, audit=None, inputs=("inputs/x",)):
    """The loop the Audit API tests share: for each (x, y), forward(x, y) -> (output, loss),
    before_backward when audited, backward, optimizer step. Returns the losses. `inputs`: the
    names the audited step gives x (and y)."""
    from contextlib import nullcontext
    losses = []
    for step, (x, y) in enumerate(batches):
        with audit.step(step, tensors=dict(zip(inputs, (x, y)))) if audit else nullcontext():
            _, loss = forward(x, y)
            if audit:
                audit.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def load_json(path):
    with open(path) as f:
        return json.load(f)


def committed_rows(name):
    """The rows of snapshots/results/<name> (one JSON object a line)."""
    return [json.loads(line) for line in open(os.path.join(ROOT, "snapshots", "results", name))]


def assert_repredicted_exactly(rows):
    """Each measured row ok with 0 unattributed, every measured line of its three phases
    re-predicted by the current predictor to the byte (gaps aside: CPU has none), and its steady
    state, activations and peak too (no runs: the measurements are data)."""
    from memory_audit.comparison.sweep import repredict, repredict_lines
    for r in rows:
        assert r["status"] == "ok" and r["unattributed_bytes"] == 0, r["config"]
        assert set(r["measured_lines"]) == {"step2_start", "step2_before_backward", "step2_end"}, r["config"]
        off = [(x["phase"], x["key"], x["predicted"], x["actual"]) for x in repredict_lines(r)]
        assert off == [], (r["config"], off[:10])
        t = repredict(r)
        assert [t[k]["diff"] for k in ("steady_state", "activations", "peak")] == [0, 0, 0], (r["config"], t)


def assert_books_match_the_pickle(run_dir, phases):
    """Each phase's attribution against its snapshot read independently (plain pickle, our own
    files): the categories sum to the segments' bytes, the named lines to the active blocks'
    bytes but the gaps, cached_free and baseline memory (what `balanced` alone cannot show,
    since attribute() forces it)."""
    import pickle
    for phase, info in phases.items():
        with open(os.path.join(run_dir, f"{phase}.pickle"), "rb") as f:
            snap = pickle.load(f)
        segments = sum(s["total_size"] for s in snap["segments"])
        active = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
        attr = info["attribution"]
        assert attr["reserved_bytes"] == segments and attr["allocated_bytes"] == active, phase
        assert sum(attr["categories"].values()) == segments, (phase, attr["categories"], segments)
        named = sum(v for k, v in attr["lines"].items() if k.split("/", 1)[0] not in ("gaps", "cached_free", "pending_free"))
        assert named == active - attr["categories"].get("gaps", 0), (phase, named, active)
