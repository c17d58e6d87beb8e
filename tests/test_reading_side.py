"""The commands that read snapshots, as a user runs them: no torch, the peak named by the rules
that name the end, what a script still holds named by its allocation site, and a benchmark file
that is a snapshot every reader can load."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import EXAMPLES, FOREIGN, ROOT, SHARED
from memory_audit.reading.attribute import attribute, block_namer
from memory_audit.reading.loader import load_snapshot
from memory_audit.schema import CATEGORIES
from memory_audit.reading.timeline import replay

PT_SNAP = sorted(glob.glob(os.path.join(SHARED, "fixtures", "pt_snap_cli", "*.pkl")))
FOREIGN_TRACED = sorted(glob.glob(os.path.join(FOREIGN, "*.pickle"))) + PT_SNAP
EXPANDABLE = os.path.join(SHARED, "fixtures", "pt_snap_cli", "snapshot_expandable.pkl")

# A child that cannot import torch: any `import torch...` raises, as on a machine without it.
NO_TORCH = r"""
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not importable in this test")
sys.meta_path.insert(0, NoTorch())
from memory_audit.cli import main
code = main(sys.argv[1:])
print("torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def _run_without_torch(*args):
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("command", ["attribute", "attribute --categorize", "report", "diff", "viz"])
def test_reading_commands_never_import_torch(tmp_path, command):
    """attribute, report, diff and viz run to the end with torch unimportable, on a committed
    CUDA audit (copied: report and --categorize write beside the snapshots). report reads the
    prediction an audit stores in its meta.json (train.py --audit stores it; here stored first)."""
    run = tmp_path / "run"
    shutil.copytree(os.path.join(EXAMPLES, "cuda-tiny-fp16-manual"), run)
    name, *flags = command.split()
    if name == "report":
        from memory_audit.comparison.reconcile import store_prediction
        assert store_prediction(str(run))["totals"]["from"].startswith("shadow run")
    args = {"attribute": [str(run), *flags], "report": [str(run)],
            "diff": [str(run), os.path.join(EXAMPLES, "cuda-tiny-bf16-sdpa")],
            "viz": [str(run), "--out", str(tmp_path / "page.html")]}[name]
    p = _run_without_torch(name, *args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == "False"
    if name == "viz":
        page = (tmp_path / "page.html").read_text()
        assert "add_local_files([{" in page and '"Active Memory Timeline"' in page


def test_report_of_a_run_without_a_stored_prediction_needs_torch_and_says_so(tmp_path):
    """A run whose meta.json keeps no prediction (one an earlier version wrote): without torch, one line."""
    run = tmp_path / "run"
    shutil.copytree(os.path.join(EXAMPLES, "cuda-tiny-fp16-manual"), run)
    meta = json.load(open(run / "meta.json"))
    del meta["prediction"]
    (run / "meta.json").write_text(json.dumps(meta))
    p = _run_without_torch("report", str(run))
    assert p.returncode == 2 and "keeps no prediction" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_predict_help_still_lists_the_config_keys():
    """The config keys (built from model.py's presets only when help is printed) are still there."""
    p = subprocess.run([sys.executable, "-m", "memory_audit", "predict", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "--preset=NAME" in p.stdout and "cpu-tiny" in p.stdout and "--gpu GPU" in p.stdout and "H100" in p.stdout


def _end_categories(snap, device):
    """{category: block bytes} of the active blocks at the snapshot's end, named as the end
    table names them (attribute's rules; what none names is unattributed)."""
    namer, out = block_namer(snap), {}
    for seg in snap["segments"]:
        if seg.get("device", 0) != device:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                name = namer(b)[0] or "unattributed"
                cat = name.split("/", 1)[0] if name.split("/", 1)[0] in CATEGORIES else "unattributed"
                out[cat] = out.get(cat, 0) + b["size"]
    return out


@pytest.mark.skipif(not FOREIGN_TRACED, reason="../shared/fixtures not present")
@pytest.mark.parametrize("path", FOREIGN_TRACED, ids=os.path.basename)
def test_every_moment_is_named_by_the_end_tables_rules(path):
    """Replayed to its last entry, a trace names the live bytes exactly as the end table names
    the snapshot's blocks, category by category; at the peak under 1% stays unattributed."""
    snap = load_snapshot(path)
    for dev, trace in enumerate(snap["device_traces"]):
        if not len(trace):
            continue
        rp = replay(snap, None, device=dev, max_points=50)
        last = rp["series"][-1]
        assert last["index"] == len(trace) - 1
        assert last["categories"] == {c: v for c, v in _end_categories(snap, dev).items() if v}
        peak = rp["peak"]
        assert peak["categories"].get("unattributed", 0) < 0.01 * peak["bytes"], peak["categories"]
        assert sum(peak["lines"].values()) == peak["bytes"]  # the lines name every byte at the peak


@pytest.mark.skipif(not os.path.exists(EXPANDABLE), reason="../shared/fixtures/pt_snap_cli not present")
def test_tensors_a_script_holds_are_named_by_their_allocation_site():
    """pt-snap-cli's demo keeps three 40 MiB tensors made at memory_leaks_demo.py:12; the Adam
    state is made in _init_group. Both named alike at the end and at the peak."""
    snap = load_snapshot(EXPANDABLE)
    end = attribute(snap)[0]
    assert end["lines"]["user/memory_leaks_demo.py:12"] == 3 * 40 * 2 ** 20
    assert end["lines"]["optimizer/state"] == 188_228_176
    assert end["unattributed_bytes"] == 0
    peak = replay(snap, None)["peak"]
    assert peak["lines"]["user/memory_leaks_demo.py:12"] == 3 * 41_943_552  # whole blocks, as the segments hold them
    assert peak["categories"]["optimizer"] == peak["lines"]["optimizer/state"] == 188_385_280  # blocks, not requests
    assert "unattributed" not in peak["categories"]


def _gaps_found(snap, device=0):
    """Rebuild the allocator's history backwards from the end state, as MemoryViz and pt-snap
    do: each free (seen backwards) must find its block's range free, each alloc its block
    active. Returns the first entry that breaks it, or None."""
    active = {}  # address -> size
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if seg.get("device", 0) == device and b["state"] == "active_allocated":
                active[b["address"]] = b["size"]
    trace = snap["device_traces"][device]
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        if e["action"] == "free_completed":
            lo, hi = e["addr"], e["addr"] + e["size"]
            if any(a < hi and a + s > lo for a, s in active.items()):
                return i
            active[e["addr"]] = e["size"]
        elif e["action"] == "alloc":
            if active.pop(e["addr"], None) is None:
                return i
    return None


def test_benchmark_file_is_a_snapshot_every_reader_can_load():
    """bench_attribute.build(): the source's trace whole, then its pairs repeated where the end
    state leaves memory free, so the history rebuilds backwards (the old builder dropped a
    never-freed allocation whose block the segments still held) and attributes like its source."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_attribute import build
    src = os.path.join(EXAMPLES, "cuda-tiny-fp16-manual", "step2_end.pickle")
    from memory_audit.reading.loader import _PlainDataUnpickler, normalize
    snap = build(src, 20_000)
    with open(src, "rb") as f:
        raw = _PlainDataUnpickler(f).load()["device_traces"][0]
    assert len(snap["device_traces"][0]) >= 20_000
    assert snap["device_traces"][0][:len(raw)] == raw  # the whole source trace first, as recorded
    assert _gaps_found(snap) is None
    built = attribute(normalize(snap))[0]
    assert built["categories"] == attribute(load_snapshot(src))[0]["categories"]
    assert built["lines"]["workspace/cublas"] == 2 * 33_554_432
