"""The predictor against published measurements and against this project's own CPU audits."""

import json
import os

import pytest

from conftest import load_json, run_cli
from memory_audit.reading.loader import load_meta
from memory_audit.prediction.predict import device_facts, predict, prediction, published_formulas
from memory_audit.comparison.reconcile import mismatched, reconcile

GiB = 2 ** 30
# The article's run (REFERENCE section 5): fp16 + GradScaler, manual attention, grads kept,
# and its loop let go of the logits before backward.
REFERENCE = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False,
                 batch_size=12, dtype="float16", attention="manual", set_to_none=False, keep_logits=False)
A100 = device_facts("cuda", gpu="A100")
ARTICLE_GAPS = 6_855_368  # its measured gaps; its "6,855,680" also counts 312 B of small tensors


def test_reference_parameters_and_steady_state():
    t = predict(REFERENCE, A100)["totals"]
    assert t["params"] == 124_373_760
    # The article's formula total, 2,057,547,776 B, leaves out 312 B it measured: 75 Adam `step`
    # tensors (4 B each, its footnote 1) and the GradScaler's scale and growth tracker (4 B each)
    # and the loss (4 B) that it lists as "others". The ledger has them.
    assert t["steady_state_bytes"] == 2_057_547_776 + 75 * 4 + 2 * 4 + 4
    # the shadow run's process through the allocator's model, without the article's measured gaps:
    # its steady state 786,432 B (0.04%) over the article's, its peak 0.0095% over
    t = prediction(REFERENCE, A100)["totals"]
    assert abs(t["steady_state_allocated"] - 2_064_403_456) < 0.0005 * 2_064_403_456
    assert abs(t["peak_allocated_bytes"] - 21.898 * GiB) < 0.0001 * 21.898 * GiB


def test_reference_activations_and_peak():
    t = predict(REFERENCE, A100, gaps_bytes=ARTICLE_GAPS)["totals"]
    assert round(t["activations_bytes"] / GiB, 3) == 17.673
    assert round(prediction(REFERENCE, A100)["totals"]["peak_allocated_bytes"] / GiB, 2) == 21.90  # the article's 21.898


def test_reference_gpt2_medium_peak():
    medium = dict(REFERENCE, n_layer=24, n_head=16, n_embd=1024)
    t = prediction(medium, A100)["totals"]
    assert round(t["peak_allocated_bytes"] / GiB, 2) == 49.03


def test_the_three_effects_the_article_left_out():
    ledger = predict(REFERENCE, A100)["ledger"]
    weight_copies = sum(l["bytes"] for l in ledger if l["key"].endswith("/mm.mat2"))
    masks = sum(l["bytes"] for l in ledger if l["key"].endswith("masked_fill.mask"))
    ln_stats = sum(l["bytes"] for l in ledger if l["key"].endswith(("result1", "result2")))
    assert weight_copies == 247_136_256
    assert masks == 12_582_912
    assert ln_stats == 2_457_600


def test_other_formulas():
    f = published_formulas(REFERENCE)
    assert round(f["korthikanti2022"]["activations"] / GiB, 2) == 12.02
    assert round(f["rees2023"]["activations"] / GiB, 3) == 17.429


def _mlp_saved(ledger, layer="h.0"):
    """Bytes the MLP saves for backward, without the weight copies (as seed 000 counts)."""
    return sum(l["bytes"] for l in ledger if l["key"].startswith(f"activations/{layer}.mlp")
               and not l["key"].endswith("mm.mat2"))


def test_relu_over_gelu_mlp_ratio_predicted():
    cfg = dict(batch_size=2, block_size=4096, n_embd=1024, n_head=16, dtype="bfloat16", attention="sdpa")
    gelu = predict(dict(cfg, activation="gelu"), device_facts("cuda", gpu="H100"))["ledger"]
    relu = predict(dict(cfg, activation="relu"), device_facts("cuda", gpu="H100"))["ledger"]
    assert round(_mlp_saved(relu) / _mlp_saved(gelu), 4) == 0.5556


def test_relu_over_gelu_mlp_ratio_measured(audits):
    def measured(run_dir):
        meta = load_meta(run_dir)
        return sum(s["nbytes"] for s in meta["saved_tensors"] if s["key"].startswith("activations/h.0.mlp")
                   and not s["key"].endswith("mm.mat2"))
    gelu = audits("bf16-sdpa-gelu", "--dtype=bfloat16", "--attention=sdpa", "--activation=gelu")
    relu = audits("bf16-sdpa-relu", "--dtype=bfloat16", "--attention=sdpa", "--activation=relu")
    assert round(measured(relu) / measured(gelu), 4) == 0.5556


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_cpu_audit_matches_prediction_line_by_line(audits, dtype, attention, activation):
    run = audits(f"{dtype}-{attention}-{activation}", f"--dtype={dtype}", f"--attention={attention}",
                 f"--activation={activation}")
    rec = reconcile(run)
    acts = [r for r in rec["rows"] if r["category"] == "activations"]
    assert len(acts) > 30
    assert mismatched(acts) == []
    steady = [r for r in rec["rows"] if r["phase"] == "step2_start"]
    assert mismatched(steady, skip=()) == []  # CPU: no gaps at all
    assert rec["totals"]["steady_state"]["diff"] == 0
    assert rec["totals"]["activations"]["diff"] == 0
    assert rec["totals"]["peak"]["diff"] == 0  # CPU: the replayed peak, to the byte
    assert rec["unattributed_bytes"] == 0


@pytest.mark.parametrize("extra", [["--bias=True"], ["--gradient_accumulation_steps=2", "--set_to_none=False"],
                                   ["--keep_logits=False", "--optimizer_impl=foreach"],
                                   ["--dropout=0.1"], ["--dropout=0.1", "--attention=sdpa", "--dtype=bfloat16"],
                                   ["--batch_size=1", "--attention=manual"],
                                   ["--batch_size=1", "--attention=manual", "--dropout=0.1"]])
def test_cpu_variants_match(audits, extra):
    rec = reconcile(audits("variant-" + "-".join(e.strip("-") for e in extra), *(["--dtype=float32"] + extra)))
    assert mismatched(rec["rows"], skip=()) == []
    assert rec["totals"]["peak"]["diff"] == 0
    if "--batch_size=1" in extra:  # q, k, v fold without copies: attention saves c_attn's output once
        saved = {r["key"]: r["actual"] for r in rec["rows"] if r["phase"] == "step2_before_backward"}
        assert saved["activations/h.0.attn/bmm.mat2"] == 4 * 3 * 64 * 64
        assert "activations/h.0.attn/bmm.mat2#2" not in saved
        # q has no storage of its own, so att @ v's input (the dropout output) is the first bmm.self
        assert ("activations/h.0.attn/bmm.self" in saved) == ("--dropout=0.1" in extra)
        assert "activations/h.0.attn/bmm.self#2" not in saved


def test_predict_cli_json():
    p = run_cli("predict", "--preset=gpt2", "--gpu=A100", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    for key in ("params", "steady_state_bytes", "activations_bytes", "peak_allocated_bytes"):
        assert isinstance(data["totals"][key], int)
    assert data["totals"]["params"] == 124_373_760
    assert all("formula" in l and isinstance(l["bytes"], int) for l in data["ledger"])


@pytest.mark.parametrize("args, message", [(["--n_embd=100", "--n_head=12"], "not divisible"),
                                           (["--nope=1"], "unknown config key"),
                                           (["--preset=gpt5"], "unknown preset")])
def test_predict_cli_errors(args, message):
    p = run_cli("predict", *args)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr


def test_fit_cli_finds_a_batch_that_fits_and_one_that_does_not():
    p = run_cli("fit", "--gpu=H100", "--preset=gpt2-large")
    assert p.returncode == 0, p.stderr
    assert "largest batch_size at block_size 1024: 10" in p.stdout


def _rows(name):
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "snapshots", "results", name)
    return [json.loads(l) for l in open(path)]


# README ("What is known"): the H100 rows re-predicted by accuracy's road (sweep.repredict: the one
# prediction, prediction()): peak, steady state, activations and memory_reserved() to the byte.
@pytest.mark.parametrize("name, n, reserved", [("h100.jsonl", 16, 16), ("h100-variants.jsonl", 7, 7),
                                               ("h100-dropout.jsonl", 5, 0)])
def test_committed_h100_rows_repredicted(name, n, reserved):
    """The current predictor against the measurements stored from the H100, as `accuracy` and the
    notebook read them: the peak, the steady state, the activations and (where measured) the
    reserved memory to the byte, as many activation and steady-state lines as were measured,
    parameters equal to model.py's closed form. Stored diff fields are not read."""
    import model
    from memory_audit.comparison.sweep import repredict, row_prediction
    rows = _rows(name)
    assert len(rows) == n and all(r["status"] == "ok" for r in rows)
    assert sum(r.get("reserved_actual") is not None for r in rows) == reserved
    for r in rows:
        assert r["unattributed_bytes"] == 0  # measured: every byte was named on the GPU
        t = repredict(r)
        for key in ("activations", "peak", "steady_state") + (("reserved",) if r.get("reserved_actual") else ()):
            assert t[key]["diff"] == 0, (r["config"], key, t[key])
        # these rows predate measured_lines: their per-line bytes are not stored, their line counts are
        ledger = row_prediction(r)["ledger"]
        acts = {l["key"] for l in ledger if "step2_before_backward" in l["phases"] and l["key"].startswith("activations/")}
        steady = {l["key"] for l in ledger if "step2_start" in l["phases"]}
        assert (len(acts), len(steady)) == (r["activation_lines"], r["steady_lines"]), r["config"]
        shape = dict(model.PRESETS[r["config"]["preset"]], **{k: v for k, v in r["config"].items()
                                                               if k in ("n_layer", "n_embd", "bias")})
        assert r["params"] == model.num_params(**{**dict(vocab_size=50304, block_size=1024), **shape})


UNIT = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


def h100_category_misses(rows):
    """[(run, phase, category, predicted B, measured cell)] where the current ledger's bytes of a
    category in a phase are not the measured bytes of its H100 report.md ("<phase>: by category",
    read to its printed digits: a cell in B exactly, one in KiB/MiB/GiB within half a unit of its
    last digit). The allocator's own categories (gaps, cached and pending free) are not lines."""
    import sys

    from conftest import ROOT
    from memory_audit.comparison.sweep import row_prediction
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from backfill_reserved import report_table
    misses = []
    for r in rows:
        text = open(os.path.join(ROOT, "snapshots", "results", "h100-runs", r["run"], "report.md")).read()
        ledger = row_prediction(r)["ledger"]
        for phase in ("step2_start", "step2_before_backward", "step2_end"):
            predicted = {}
            for line in ledger:
                if phase in line["phases"]:
                    predicted[line["category"]] = predicted.get(line["category"], 0) + line["bytes"]
            cells = {c[0]: c[2] for c in report_table(text, phase) if not c[0].startswith("---")}
            for cat in set(predicted) | set(cells):
                if cat in ("gaps", "cached_free", "pending_free"):
                    continue
                number, unit = cells.get(cat, "0 B").split()
                digits = number.replace(",", "")
                slack = 0.5 * 10 ** -len(digits.partition(".")[2]) * UNIT[unit] if "." in digits else 0
                if abs(predicted.get(cat, 0) - float(digits) * UNIT[unit]) > slack:
                    misses.append((r["run"], phase, cat, predicted.get(cat, 0), cells.get(cat)))
    return misses


def test_committed_h100_rows_by_category_in_every_phase():
    """The 23 H100 rows with a stored report.md: in each of the three phases, every category the
    current ledger predicts (weights, buffers, grads, optimizer, inputs, activations, workspace,
    temporary) holds the measured bytes, so two lines wrong in opposite directions do not hide
    behind an exact total. The rows predate per-line storage: the report's digits are the
    finest measured reading (a category in B to the byte, MiB to 0.05 MiB, GiB to 0.0005 GiB)."""
    rows = [r for n in ("h100.jsonl", "h100-variants.jsonl") for r in _rows(n)]
    assert len(rows) == 23
    assert h100_category_misses(rows) == []


def test_h100_reference_lines_repredicted():
    """Every line of the GPT-2 small reference audit (measured on the H100, stored per line in
    report.json) against the current predictor."""
    from memory_audit.comparison.reconcile import mismatched, refresh_predictions
    rec = load_json(os.path.join(os.path.dirname(os.path.dirname(__file__)), "snapshots", "examples",
                                 "h100-gpt2-reference", "report.json"))
    measured = {(r["phase"], r["key"]): r["actual"] for r in rec["rows"]}
    for r in rec["rows"]:
        r["predicted"] = r["diff"] = r["diff_pct"] = None
    refreshed = refresh_predictions(rec)
    assert len(refreshed["rows"]) > 300
    assert {(r["phase"], r["key"]): r["actual"] for r in refreshed["rows"] if r["actual"] is not None} == \
        {k: v for k, v in measured.items() if v is not None}  # the measured side is untouched
    assert mismatched(refreshed["rows"]) == []
    weights = next(r for r in refreshed["phases"]["step2_start"]["categories"] if r["key"] == "weights")
    assert weights["predicted"] == weights["actual"] == 4 * 124_373_760


@pytest.mark.parametrize("run", ["cuda-tiny-fp16-manual", "cuda-tiny-bf16-sdpa"])
def test_reserved_of_the_committed_cuda_audits(run):
    """The two real H100 audits whose meta.json is committed: the allocator model's segments are
    their memory_reserved() to the byte (two 32 MiB cuBLAS workspaces and three 2 MiB segments), from
    the shadow run's process through the allocator's model."""
    from conftest import ROOT
    from memory_audit.comparison.reconcile import device_from_meta
    meta = json.load(open(os.path.join(ROOT, "snapshots", "examples", run, "meta.json")))
    measured = max(p["memory_reserved"] for p in meta["phases"].values())
    assert prediction(meta["config"], device_from_meta(meta))["totals"]["reserved_peak_bytes"] == measured == 73_400_320
