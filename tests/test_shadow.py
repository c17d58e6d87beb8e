"""The shadow run (memory_audit/prediction/shadow/step.py): train.py's step on fake tensors, checked against CPU
audits of configs nobody chose. The seed is new each run and printed; SHADOW_SEED=N replays it."""

import collections
import json
import os
import pickle
import random

import pytest

from conftest import run_cli, run_train
from memory_audit.prediction.predict import predicted_snapshot
from memory_audit.reading.loader import load_meta
from memory_audit.reading.viz import categorized
from memory_audit.prediction.predict import resolved
from memory_audit.prediction.shadow.probe import plain_bf16
from memory_audit.comparison.reconcile import first_divergence, mismatched, shadow_lines_off, step_events
from memory_audit.comparison.sweep import random_config

SEED = int(os.environ["SHADOW_SEED"])  # conftest draws it once per run
N_RANDOM = 3


def _resolved(run_dir):
    with open(os.path.join(run_dir, "report.json")) as f:
        report = json.load(f)
    return resolved(report["config"]), report


@pytest.mark.parametrize("i", range(N_RANDOM))
def test_random_config_peak_is_the_shadow_runs(tmp_path, i):
    """A config drawn at random (seed printed; SHADOW_SEED replays it): every line the ledger
    names is the audit's, in every phase (a line on one side only counts), so is every line the
    shadow run names itself (shadow.lines), and the measured peak of its CPU audit equals the
    shadow run's to the byte; a miss names the first event where the two traces part."""
    from memory_audit.prediction.shadow import step as shadow
    rng = random.Random(SEED)
    for _ in range(i + 1):
        cfg = random_config(rng)
    print(f"shadow seed {SEED} (replay: SHADOW_SEED={SEED}), config {i}: {cfg}")
    p = run_train("--audit", "--device=cpu", "--preset=cpu-tiny", f"--audit_dir={tmp_path}", "--run_name=r",
                  *[f"--{k}={v}" for k, v in cfg.items()], timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    run = os.path.join(tmp_path, "r")
    full, report = _resolved(run)
    result = shadow.run(full, names=True)
    measured = report["totals"]["peak"]["actual"]
    off = [(r["phase"], r["key"], r["predicted"], r["actual"]) for r in mismatched(report["rows"], skip=())]
    assert off == [], f"seed {SEED} config {i} {cfg}: lines off {off[:6]}"
    own = shadow_lines_off(report["rows"], result)
    assert own == [], f"seed {SEED} config {i} {cfg}: the shadow's own lines off {own[:6]}"
    assert report["unattributed_bytes"] == 0, f"seed {SEED} config {i}"
    assert result["start_bytes"] == report["totals"]["steady_state"]["actual"], f"seed {SEED}"
    assert result["peak"] == measured, (f"seed {SEED} config {i} {cfg}: shadow {result['peak']:,} B, measured "
                                        f"{measured:,} B; first divergence "
                                        f"{first_divergence(step_events(run), result['events'])}")
    # train.py --audit's own report reads the one prediction: the shadow's peak
    assert report["predicted_from"].startswith("shadow run") and report["totals"]["peak"]["predicted"] == measured
    # predict --trace's categories are the audit's: allocation by allocation where the two steps
    # agree event by event (math SDPA's softmax buffers can come in another order), else as a set
    ours = _step_categories(predicted_snapshot({"result": result}, {"type": "cpu"}), None)
    theirs = _step_categories(categorized(os.path.join(run, "step2_end.pickle"), load_meta(run)), load_meta(run))
    if first_divergence(step_events(run), result["events"]) is not None:
        ours, theirs = {c for c, _ in ours}, {c for c, _ in theirs}
    assert ours == theirs, f"seed {SEED} config {i} {cfg}: predict --trace's categories are not the audit's"


def _step_categories(snap, meta):
    """{(category, bytes): allocations} of step 2 in a categorized snapshot: an audit's from the
    step's first trace entry, predict --trace's after its time-0 entries (what the step starts with)."""
    trace = snap["device_traces"][0]
    start = meta["phases"]["step2_start"]["trace_entries"] if meta else 0
    return collections.Counter((e["category"], e["size"]) for e in trace[start:]
                               if e["action"] == "alloc" and (meta or e["time_us"] > 0))


# the config that first showed CPU flash attention's bf16 backward packing per block through
# oneDNN's brgemm (shadow/probe.FLASH_CPU): 3 layers, bf16 SDPA at T=256, SAC every 2nd block
FLASH_BF16 = dict(n_layer=3, n_head=2, n_embd=32, vocab_size=97, batch_size=1, block_size=256, dtype="bfloat16",
                  attention="sdpa", activation="relu", activation_checkpointing="sac", ac_every=2,
                  set_to_none=False, keep_logits=False, optimizer_impl="foreach")


def test_bf16_flash_attention_is_asked_of_its_kernel(tmp_path):
    """bf16 SDPA on CPU as this CPU runs it: the shadow's step 2 is the audit's event by event and
    its peak the measured one (on a CPU with oneDNN bf16 the flash kernels are probed; elsewhere
    flash_cpu_buffers' rule answers)."""
    from memory_audit.prediction.shadow import step as shadow
    p = run_train("--audit", "--device=cpu", "--preset=cpu-tiny", f"--audit_dir={tmp_path}", "--run_name=r",
                  *[f"--{k}={v}" for k, v in FLASH_BF16.items()], timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    run = os.path.join(tmp_path, "r")
    full, report = _resolved(run)
    result = shadow.run(full)
    assert first_divergence(step_events(run), result["events"]) is None
    assert result["peak"] == report["totals"]["peak"]["actual"]


def test_predicted_trace_is_a_snapshot_named_like_the_audit(tmp_path, cpu_run):
    """predict --trace writes the shadow's step as a snapshot: replayed, its peak is the audit's
    measured peak, and at the peak every category holds the audit's bytes."""
    out = tmp_path / "predicted.pickle"
    full, report = _resolved(cpu_run)
    args = [f"--{k}={v}" for k, v in full.items() if k in ("n_layer", "n_head", "n_embd", "block_size",
                                                            "vocab_size", "batch_size", "dtype", "attention")]
    p = run_cli("predict", "--gpu=cpu", f"--trace={out}", "--json", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    shadow = json.loads(p.stdout)["shadow"]
    assert shadow["peak"] == report["totals"]["peak"]["actual"]
    with open(out, "rb") as f:
        snap = pickle.load(f)
    assert type(snap["device_traces"][0]) is list  # plain data, as MemoryViz reads it
    a = json.loads(run_cli("attribute", str(out), "--json").stdout)
    predicted = next(iter(a.values()))["devices"]["0"]
    assert predicted["unattributed_bytes"] == 0
    measured = json.loads(run_cli("attribute", cpu_run, "--json").stdout)["step2_end"]["devices"]["0"]
    assert predicted["peak_in_trace"]["bytes"] == measured["peak_in_trace"]["bytes"]
    assert predicted["peak_in_trace"]["categories"] == measured["peak_in_trace"]["categories"]


@pytest.mark.parametrize("gpu, dtype, kernel", [("A100", "bfloat16", "flash"), ("V100", "float16", "efficient")])
def test_a_kernel_no_trace_measured_is_run_and_said(tmp_path, gpu, dtype, kernel):
    """An A100 picks flash attention for bf16 SDPA, a V100 (no flash before sm80) efficient
    attention for fp16; no committed trace has measured either: the shadow runs the kernel's meta
    outputs, writes its trace, and says so in one line."""
    out = tmp_path / "kernel.pickle"
    p = run_cli("predict", f"--gpu={gpu}", "--preset=cpu-tiny", f"--dtype={dtype}", "--attention=sdpa", f"--trace={out}")
    assert p.returncode == 0 and out.exists(), p.stderr
    said = [l for l in p.stdout.splitlines() if l.startswith("not measured on a GPU: SDPA through")]
    assert said == [f"not measured on a GPU: SDPA through {kernel} attention ({dtype}) from its meta kernel's "
                    f"outputs (no trace has measured the kernel or its backward's buffers)"]


@pytest.mark.parametrize("grid", ["cpu-long", "cpu-ac"])
def test_committed_cpu_rows_are_the_shadow_runs(grid):
    """Every committed single-process CPU row (the ledger's rules were derived from these; the
    shadow run knows none of them): its measured steady state and peak, to the byte, and every
    line of every phase as the shadow names it itself (shadow.lines). cpu-mini-ac's
    16 rows (larger models, 14 s) are left out for CI's time: `python scripts/shadow_check.py --rows
    snapshots/results/cpu-mini-ac.jsonl` checks them (16 of 16 exact when this test was written)."""
    from memory_audit.prediction.shadow import step as shadow
    from conftest import ROOT
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "snapshots", "results", f"{grid}.jsonl"))]
    rows = [r for r in rows if r["status"] == "ok" and "nproc" not in r["config"]
            and r["resolved_config"].get("parallel", "none") == "none" and not r["resolved_config"].get("compile")]
    assert rows
    for row in rows:
        cfg = resolved(row["resolved_config"])
        with plain_bf16():  # the rows' CPUs: bf16 matmuls outside oneDNN
            result = shadow.run(cfg, names=True)
        t = row["totals"]
        assert (result["start_bytes"], result["peak"]) == (t["steady_state"]["actual"], t["peak"]["actual"]), row["config"]
        assert shadow_lines_off(row["measured_lines"], result) == [], row["config"]


def test_a_step_the_shadow_cannot_run_is_one_line_naming_the_op(monkeypatch, tmp_path, capsys):
    """An op that fails on fake tensors ends `predict --trace` in one line that names where it
    stopped; no number is printed."""
    import torch
    from memory_audit.cli import main

    def broken(*args, **kwargs):
        raise RuntimeError("cannot run on fake tensors\nsecond line")
    monkeypatch.setattr(torch.nn.functional, "gelu", broken)
    code = main(["predict", "--gpu=cpu", "--preset=cpu-tiny", "--activation=gelu", f"--trace={tmp_path / 'p.pickle'}"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "the shadow run stopped at aten." in err and "cannot run on fake tensors" in err
    assert not (tmp_path / "p.pickle").exists()


def test_report_trace_names_the_first_event_where_the_step_and_the_shadow_part(tmp_path, cpu_run, monkeypatch):
    """`report --trace`: the audited step and the shadow run's, event by event. On cpu-tiny (fp32,
    manual attention) they agree on every allocation and free, in order (388 events); with a
    wrong rule (LayerNorm's backward buffer sized for one thread more than the audit had) the
    first divergence is that buffer, at LayerNorm's backward, with both sizes."""
    import shutil

    import torch

    from memory_audit.comparison.reconcile import against_shadow
    run = tmp_path / "run"
    shutil.copytree(cpu_run, run)
    p = run_cli("report", str(run), "--trace")
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.load(open(run / "report.json"))
    tr = rec["trace"]
    assert tr["measured_events"] == tr["predicted_events"] and tr["measured_peak"] == tr["predicted_peak"]
    assert tr["first_divergence"] is None, tr
    assert "They agree event by event" in open(run / "report.md").read()
    threads = torch.get_num_threads()  # the audit's, on this machine
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    wrong = against_shadow(str(run), rec)["first_divergence"]
    assert wrong is not None and wrong["position"] < tr["measured_events"]
    measured, predicted = wrong["measured"], wrong["predicted"]
    assert measured[:3] == ("alloc", "aten::resize_", 2 * threads * 64 * 4)
    assert predicted[0] == "alloc" and predicted[1].endswith("native_layer_norm_backward/buffer")
    assert predicted[2] == 2 * (threads + 1) * 64 * 4
