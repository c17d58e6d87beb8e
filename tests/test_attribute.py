"""Attribution: every byte named, books balanced, registry byte counts exact."""

import os

import pytest
import torch.cuda._memory_viz as memory_viz

from conftest import EXAMPLES, load_json, run_cli
from memory_audit.reading.attribute import attribute
from memory_audit.reading.loader import _PlainDataUnpickler, load_meta, load_snapshot
from memory_audit.schema import PHASES
from memory_audit.reading.timeline import replay

CUDA_EXAMPLES = [os.path.join(EXAMPLES, d) for d in ("cuda-tiny-fp16-manual", "cuda-tiny-bf16-sdpa")]


def _registry_bytes(meta, phase, prefix):
    return sum(r["nbytes"] for r in meta["phases"][phase]["registry"] if r["name"].startswith(prefix))


def _check_run(run_dir):
    meta = load_meta(run_dir)
    for phase in PHASES:
        snap = load_snapshot(os.path.join(run_dir, f"{phase}.pickle"))
        r = attribute(snap, meta, phase)[0]
        assert r["unattributed_bytes"] == 0, (phase, r["unattributed"])
        # against the snapshot itself, summed here: segments and active blocks
        assert r["reserved_bytes"] == sum(seg["total_size"] for seg in snap["segments"])
        assert r["allocated_bytes"] == sum(b["size"] for seg in snap["segments"] for b in seg["blocks"]
                                           if b["state"] == "active_allocated")
        for category in ("weights", "grads", "optimizer", "inputs", "buffers"):
            assert r["categories"][category] == _registry_bytes(meta, phase, category + "/"), (phase, category)
        reported = meta["phases"][phase]["memory_allocated"]
        if reported is not None:  # CUDA: the active blocks are exactly what the allocator reported
            assert r["allocated_bytes"] == reported
        if phase == "step2_before_backward":
            saved = sum(s["nbytes"] for s in meta["saved_tensors"]
                        if s["data_ptr"] not in {e["data_ptr"] for e in meta["phases"][phase]["registry"]})
            assert r["categories"]["activations"] == saved
    return meta


def test_cpu_audit_has_no_unattributed_bytes(cpu_run):
    meta = _check_run(cpu_run)
    assert meta["device"]["type"] == "cpu"


@pytest.mark.parametrize("run_dir", CUDA_EXAMPLES, ids=os.path.basename)
def test_committed_cuda_audit_is_exact(run_dir):
    meta = _check_run(run_dir)
    assert meta["device"]["type"] == "cuda"
    start = attribute(load_snapshot(os.path.join(run_dir, "step2_start.pickle")), meta, "step2_start")[0]
    # two cuBLAS workspaces (forward thread, backward thread), named from the trace; sm90: 32 MiB each
    assert start["lines"]["workspace/cublas"] == 2 * 33_554_432
    assert start["rules"]["workspace"] == 2 * 33_554_432
    # fused AdamW keeps one 4-byte step tensor per parameter on the GPU
    n_params = sum(1 for r in meta["phases"]["step2_start"]["registry"] if r["name"].startswith("weights/"))
    steps = [k for k in start["lines"] if k.startswith("optimizer/step/")]
    assert len(steps) == n_params and all(start["lines"][k] == 4 for k in steps)


@pytest.mark.parametrize("run_dir", CUDA_EXAMPLES, ids=os.path.basename)
def test_replayed_peak_equals_max_memory_allocated(run_dir):
    meta = load_meta(run_dir)
    rp = replay(load_snapshot(os.path.join(run_dir, "step2_end.pickle")), meta)
    assert rp["baseline_bytes"] == 0 and not rp["overflow"]
    assert rp["peak"]["bytes"] == meta["phases"]["step2_end"]["max_memory_allocated"]


def test_h100_reference_attribution_committed():
    """The GPT-2 small reference audit on the H100 (attribution.json written by the CLI there)."""
    att = load_json(os.path.join(EXAMPLES, "h100-gpt2-reference", "attribution.json"))
    meta = load_json(os.path.join(EXAMPLES, "h100-gpt2-reference", "meta.json"))
    for phase in PHASES:
        r = att[phase]["devices"]["0"]
        assert r["unattributed_bytes"] == 0
        assert r["allocated_bytes"] == meta["phases"][phase]["memory_allocated"]
        for category in ("weights", "grads", "optimizer"):
            assert r["categories"][category] == _registry_bytes(meta, phase, category + "/")
    start = att["step2_start"]["devices"]["0"]["categories"]
    assert start["weights"] == 497_495_040 and start["buffers"] == 50_331_648  # 4N, 12 fp32 masks
    assert start["grads"] == 497_495_040  # set_to_none=False keeps them
    assert start["optimizer"] == 994_990_080 + 300 + 8  # 8N + 75 step tensors + GradScaler's two
    assert start["workspace"] == 2 * 33_554_432
    # the current predictor, from the run's config and GPU, gives each measured category
    from memory_audit.prediction.predict import predict
    from memory_audit.comparison.reconcile import device_from_meta
    ledger = predict(meta["config"], device_from_meta(meta))["ledger"]
    for category in ("weights", "buffers", "grads", "optimizer", "workspace"):
        assert sum(l["bytes"] for l in ledger if l["category"] == category and "step2_start" in l["phases"]) \
            == start[category], category


def test_categorized_pickle_loads_in_memory_viz(tmp_path, cpu_run):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(cpu_run, run)
    p = run_cli("attribute", str(run), "--categorize")
    assert p.returncode == 0, p.stderr
    with open(run / "step2_end.categorized.pickle", "rb") as f:
        snap = _PlainDataUnpickler(f).load()  # plain data only: no class of ours inside
    assert type(snap["device_traces"][0]) is list and type(snap["device_traces"][0][0]) is dict
    cats = {e.get("category") for e in snap["device_traces"][0]}
    assert {"weights", "optimizer", "activations", "temporary/backward"} <= cats
    assert "<html" in memory_viz.trace_plot(snap).lower()
    assert memory_viz.trace(snap)


def test_attribute_cli_json_and_by_name(tmp_path, cpu_run):
    out = tmp_path / "a.json"
    p = run_cli("attribute", cpu_run, "--out", str(out))
    assert p.returncode == 0, p.stderr
    data = load_json(out)
    assert set(data) == set(PHASES)
    p = run_cli("attribute", os.path.join(cpu_run, "step2_start.pickle"), "--by", "name")
    assert p.returncode == 0 and "weights/transformer.wte.weight" in p.stdout


@pytest.mark.parametrize("run_dir", CUDA_EXAMPLES, ids=os.path.basename)
def test_stored_report_refreshes_to_the_same_reconciliation(run_dir):
    """A report kept without its pickles gets the same predicted side as a full reconcile."""
    import json
    from memory_audit.comparison.reconcile import reconcile, refresh_predictions
    full = reconcile(run_dir)
    stored = json.loads(json.dumps(full))
    for r in stored["rows"]:
        r["predicted"] = r["diff"] = r["diff_pct"] = None  # as if written by an older predictor
    refreshed = refresh_predictions(stored)
    assert refreshed["rows"] == full["rows"] and refreshed["totals"] == full["totals"]
    # and against the measurement, which the refresh keeps: every line exact
    from memory_audit.comparison.reconcile import mismatched
    assert mismatched(refreshed["rows"]) == []
    totals = {k: refreshed["totals"][k]["diff"] for k in ("steady_state", "activations", "peak", "reserved")}
    assert totals == dict.fromkeys(totals, 0), totals  # the peak and reserved too, as README says


def test_the_shared_step_function_names_nothing_optimizer_state():
    """train.py's step runs in train_step.run_step: a stack through it is the loop's (an activation
    by its forward; a temporary the step itself makes, `loop`), not the optimizer's: the stack
    rules read "optim" and "step" as an optimizer's step, and the function's name says neither."""
    import train_step
    from memory_audit.reading.attribute import name_from_frames
    from memory_audit.reading.event_names import temporary_name
    step = {"filename": train_step.__file__, "name": train_step.run_step.__name__, "line": 1}
    loop = {"filename": "/x/train.py", "name": "train", "line": 2}
    forward = [{"filename": "/x/model.py", "name": "forward", "line": 3}, step, loop]
    assert name_from_frames(forward) == ("activations/model.py:3", "frames:forward")
    assert name_from_frames([step, loop], live=False) == (None, None)
    assert temporary_name([step]) == "temporary/loop"


def test_extreme_points_keep_every_runs_highest_and_lowest_entry():
    """The overview's sampling: on a random walk of 100,003 entries cut into 500 runs, the points
    hold each run's highest and lowest entry, the first and the last, and nothing else (so the
    walk's own maximum and minimum are drawn exactly)."""
    import numpy as np
    from memory_audit.reading.timeline import _extreme_points
    rng = np.random.default_rng(7)
    level = np.cumsum(rng.integers(-5000, 5000, 100_003))
    lo = 17
    points = _extreme_points(level, lo, 500)
    span = level[lo:]
    width = -(-len(span) // 500)
    want = {lo, lo + len(span) - 1}
    for start in range(0, len(span), width):
        part = span[start:start + width]
        want |= {lo + start, lo + start + int(np.argmax(part)), lo + start + int(np.argmin(part))}
    assert set(points.tolist()) == want and list(points) == sorted(points)
    assert level[points].max() == span.max() and level[points].min() == span.min()


def _one_block_snapshot(frames, size=32 * 1024 * 1024):
    """A CUDA snapshot from elsewhere (no meta.json): one block of `size`, made while recording
    and never freed, with these frames."""
    block = {"address": 1 << 40, "size": size, "requested_size": size, "state": "active_allocated", "frames": frames}
    seg = {"device": 0, "address": 1 << 40, "total_size": size, "allocated_size": size, "active_size": size,
           "requested_size": size, "stream": 0, "segment_type": "large", "blocks": [block]}
    trace = [{"action": "segment_alloc", "addr": 1 << 40, "size": size, "stream": 0, "frames": frames},
             {"action": "alloc", "addr": 1 << 40, "size": size, "stream": 0, "frames": frames}]
    return {"segments": [seg], "device_traces": [trace]}


def test_a_never_freed_workspace_sized_block_is_a_workspace_only_where_a_frame_shows_a_gemm():
    """Without meta.json no registry names a 32 MiB weight first (a 4096 x 4096 bf16 projection is
    32 MiB): such a block is a cuBLAS workspace only where a frame shows a GEMM (or it has none)."""
    from memory_audit.reading.attribute import attribute
    from memory_audit.reading.loader import normalize
    gemm = [{"filename": "/x/torch/nn/modules/linear.py", "name": "forward", "line": 125}]
    mine = [{"filename": "/home/me/train.py", "name": "make_cache", "line": 7}]
    named = attribute(normalize(_one_block_snapshot(gemm)))[0]["lines"]
    assert named == {"workspace/cublas": 32 * 1024 * 1024}
    other = attribute(normalize(_one_block_snapshot(mine)))[0]["lines"]
    assert "workspace/cublas" not in other and sum(other.values()) == 32 * 1024 * 1024
