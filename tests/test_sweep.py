"""The cpu-small grid: every row fully attributed and every activation line predicted exactly."""

import json
import os

from conftest import PLAIN_BF16_ENV, ROOT, assert_repredicted_exactly, committed_rows, run_cli
from memory_audit.comparison.grids import grid
from memory_audit.comparison.sweep import accuracy_rows, accuracy_table


def _sweep(tmp_path, name, rows=None):
    """Run a grid (or `rows` of it, through --configs) in child processes (bf16 matmuls in PyTorch's
    own kernels on any CPU: conftest.PLAIN_BF16_ENV); its rows and the results file."""
    out = tmp_path / f"{name}.jsonl"
    source = [f"--grid={name}"]
    if rows is not None:
        (tmp_path / "configs.json").write_text(json.dumps(rows))
        source = [f"--configs={tmp_path}/configs.json"]
    p = run_cli("sweep", *source, f"--out={out}", f"--audit-dir={tmp_path}/runs", "--jobs=2", timeout=1800,
                env=PLAIN_BF16_ENV)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(line) for line in open(out)], out


# cpu-small's second size as a half fraction of its dtype x attention x activation cube: each
# level of each factor, and each pair of two factors' levels, once (2 x 2 x 2 would be 8 audits)
CPU_SMALL_LIVE = (("float32", "manual", "gelu"), ("float32", "sdpa", "relu"),
                  ("bfloat16", "manual", "relu"), ("bfloat16", "sdpa", "gelu"))


def test_cpu_small_grid(tmp_path):
    """cpu-small's second size (1 layer, 4 heads, block 32, batch 3) runs here, half of its
    eight; its first half, cpu-tiny at batch 2 in every dtype x attention x activation, is what
    test_predict.test_cpu_audit_matches_prediction_line_by_line audits line by line."""
    rows = grid("cpu-small")
    assert len(rows) == 16 and [r["preset"] for r in rows[:8]] == ["cpu-tiny"] * 8 and all(r.get("n_layer") == 1 for r in rows[8:])
    live = [r for r in rows[8:] if (r["dtype"], r["attention"], r["activation"]) in CPU_SMALL_LIVE]
    rows, out = _sweep(tmp_path, "cpu-small", live)
    assert len(rows) == 4
    assert not list((tmp_path / "runs").rglob("*.pickle"))  # without --keep each run's snapshots go, reports stay
    for r in rows:
        assert r["status"] == "ok", r
        assert r["unattributed_bytes"] == 0
        assert r["activation_lines"] > 20 and r["activation_lines_mismatched"] == []
        assert r["steady_lines_mismatched"] == []
        assert r["totals"]["peak"]["diff"] == 0, r["config"]
    # the accuracy table re-predicts the rows with the current predictor: its peaks are the measured
    assert [r["totals"]["peak"]["diff"] for r in accuracy_rows(str(out))] == [0] * 4
    assert accuracy_table(str(out)).count("\n") == 5


# cpu-ac rows run live here: both attentions and dtypes, every mode, every 2nd block, the peak at
# each of its three moments; test_checkpointing audits full/selective/sac with fp32 manual attention
CPU_AC_LIVE = (5, 7, 11, 14, 17, 19)


def test_cpu_ac_grid(tmp_path):
    """Every checkpointing mode (and every 2nd block): 0 unattributed, every line and the peak
    predicted to the byte, and the recorded cost says where the peak is. Six of the 20 rows run
    here; all 20 are committed (snapshots/results/cpu-ac.jsonl) and re-predicted below."""
    configs = grid("cpu-ac")
    assert len(configs) == 20
    rows, out = _sweep(tmp_path, "cpu-ac", [configs[i] for i in CPU_AC_LIVE])
    for r in rows:
        assert r["status"] == "ok", r
        assert r["unattributed_bytes"] == 0
        assert r["activation_lines_mismatched"] == [] and r["steady_lines_mismatched"] == [], r["config"]
        assert r["totals"]["peak"]["diff"] == 0, (r["config"], r["cost"])
    assert all(r["cost"]["peak_at"].startswith("event ") for r in rows)  # the shadow's event
    assert [r["totals"]["peak"]["diff"] for r in accuracy_rows(str(out))] == [0] * len(CPU_AC_LIVE)


def test_committed_cpu_ac_rows_are_predicted_to_the_byte():
    """All 20 cpu-ac rows as measured (snapshots/results/cpu-ac.jsonl), re-predicted by the current
    predictor: every line, steady state, activations and peak to the byte, 0 unattributed."""
    rows = committed_rows("cpu-ac.jsonl")
    assert [r["config"] for r in rows] == grid("cpu-ac")
    assert_repredicted_exactly(rows)


def test_committed_cpu_mini_ac_rows_are_predicted_to_the_byte():
    """The 16 cpu-mini rows (7.2M parameters, every checkpointing mode; about 11 minutes to
    measure, so never live here), re-predicted line by line."""
    import json
    rows = committed_rows("cpu-mini-ac.jsonl")
    assert [r["config"] for r in rows] == json.load(open(os.path.join(ROOT, "scripts", "cpu_mini_ac.json")))
    assert_repredicted_exactly(rows)


# cpu-long rows run live here: eager fp32 (softmax's moment) and selective with dropout (att @ v's)
CPU_LONG_LIVE = (0, 10)


def test_cpu_long_grid(tmp_path):
    """Long sequences (T=512, 8 heads on cpu-tiny): the attention core's T^2 gradients are the
    peak, with and without checkpointing. Two of the 20 configs run here; all 23 rows (20
    configs, 3 of them on 2 ranks) are committed and re-predicted below."""
    configs = grid("cpu-long")
    rows, _ = _sweep(tmp_path, "cpu-long", [configs[i] for i in CPU_LONG_LIVE])
    for r in rows:
        assert r["status"] == "ok" and r["unattributed_bytes"] == 0, r
        assert r["activation_lines_mismatched"] == [] and r["steady_lines_mismatched"] == [], r["config"]
        assert r["totals"]["peak"]["diff"] == 0, (r["config"], r["cost"])
    # the shadow's peak: softmax's backward (eager), att @ v's (selective with dropout)
    assert [r["cost"]["peak_at"].rsplit("/", 1)[1] for r in rows] == ["_softmax_backward_data", "bmm"]


def test_committed_cpu_long_rows_are_predicted_to_the_byte():
    """All 23 cpu-long rows as measured, re-predicted to the byte; in every one the shadow's peak
    is an attention core's backward (softmax's, or att @ v's bmm)."""
    from memory_audit.comparison.sweep import row_prediction
    rows = committed_rows("cpu-long.jsonl")
    assert [{k: v for k, v in r["config"].items() if k != "rank"} for r in rows] == \
        [c for c in grid("cpu-long") for _ in range(c.get("nproc", 1))]
    assert_repredicted_exactly(rows)
    at = [row_prediction(r)["backward"]["peak_at"].rsplit("/", 1)[1] for r in rows]
    assert set(at) == {"_softmax_backward_data", "bmm"}, at


def test_unknown_grid_is_one_line():
    p = run_cli("sweep", "--grid=nope")
    assert p.returncode == 2 and "unknown grid" in p.stderr



def test_a_refused_torchrun_config_keeps_its_own_error_line():
    """Under torchrun each rank prints train.py's one line and torchrun ends its log with a rule
    of '=': the row keeps the rank's line, not the rule (a row with the rule says nothing about
    why the config was refused)."""
    from memory_audit.comparison.sweep import error_line
    log = ("iter 0\nerror: parallel=tp-sp needs set_to_none=True: the sequence-parallel LayerNorms' gradients are Partial\n"
           "error: parallel=tp-sp needs set_to_none=True: the sequence-parallel LayerNorms' gradients are Partial\n"
           "Root Cause (first observed failure):\n============================================================\n")
    assert error_line(log) == "error: parallel=tp-sp needs set_to_none=True: the sequence-parallel LayerNorms' gradients are Partial"
    assert error_line("step 1\nRuntimeError: boom\n") == "RuntimeError: boom"
    assert error_line("") == ""
