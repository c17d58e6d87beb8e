"""The cpu-small grid: every row fully attributed and every activation line predicted exactly."""

import json

from conftest import assert_repredicted_exactly, committed_rows, run_cli
from memory_audit.sweep import accuracy_table, grid


def _sweep(tmp_path, name, rows=None):
    """Run a grid (or `rows` of it, through --configs) in child processes; its rows and the results file."""
    out = tmp_path / f"{name}.jsonl"
    source = [f"--grid={name}"]
    if rows is not None:
        (tmp_path / "configs.json").write_text(json.dumps(rows))
        source = [f"--configs={tmp_path}/configs.json"]
    p = run_cli("sweep", *source, f"--out={out}", f"--audit-dir={tmp_path}/runs", "--jobs=2", timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(line) for line in open(out)], out


def test_cpu_small_grid(tmp_path):
    """cpu-small's second size (1 layer, 4 heads, block 32, batch 3) runs here; its first half,
    cpu-tiny at batch 2 in every dtype x attention x activation, is what
    test_predict.test_cpu_audit_matches_prediction_line_by_line audits line by line."""
    rows = grid("cpu-small")
    assert len(rows) == 16 and [r["preset"] for r in rows[:8]] == ["cpu-tiny"] * 8 and all(r.get("n_layer") == 1 for r in rows[8:])
    rows, out = _sweep(tmp_path, "cpu-small", rows[8:])
    assert len(rows) == 8
    for r in rows:
        assert r["status"] == "ok", r
        assert r["unattributed_bytes"] == 0
        assert r["activation_lines"] > 20 and r["activation_lines_mismatched"] == []
        assert r["steady_lines_mismatched"] == []
        assert r["totals"]["peak"]["diff"] == 0, r["config"]
    table = accuracy_table(str(out))
    assert table.count("\n") == 9 and "+0.000%" in table


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
    at = {r["cost"]["peak_at"].split(" of ")[0] for r in rows}
    assert {"start", "backward", "end"} <= at  # the lever moves the peak to each of the three moments
    assert accuracy_table(str(out)).count("+0.000%") >= len(CPU_AC_LIVE)


def test_committed_cpu_ac_rows_are_predicted_to_the_byte():
    """All 20 cpu-ac rows as measured (snapshots/results/cpu-ac.jsonl), re-predicted by the current
    predictor: steady state, activations and peak to the byte, 0 unattributed."""
    rows = committed_rows("cpu-ac.jsonl")
    assert [r["config"] for r in rows] == grid("cpu-ac")
    assert_repredicted_exactly(rows)


def test_unknown_grid_is_one_line():
    p = run_cli("sweep", "--grid=nope")
    assert p.returncode == 2 and "unknown grid" in p.stderr

