"""The cpu-small grid: every row fully attributed and every activation line predicted exactly."""

import json

from conftest import run_cli
from memory_audit.sweep import accuracy_table, grid


def _sweep(tmp_path, name):
    """Run a grid in child processes; its rows and the results file."""
    out = tmp_path / f"{name}.jsonl"
    p = run_cli("sweep", f"--grid={name}", f"--out={out}", f"--audit-dir={tmp_path}/runs", "--jobs=2", timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(line) for line in open(out)], out


def test_cpu_small_grid(tmp_path):
    rows, out = _sweep(tmp_path, "cpu-small")
    assert len(rows) == len(grid("cpu-small")) == 16
    for r in rows:
        assert r["status"] == "ok", r
        assert r["unattributed_bytes"] == 0
        assert r["activation_lines"] > 20 and r["activation_lines_mismatched"] == []
        assert r["steady_lines_mismatched"] == []
        assert r["totals"]["peak"]["diff"] == 0, r["config"]
    table = accuracy_table(str(out))
    assert table.count("\n") == 17 and "+0.000%" in table


def test_cpu_ac_grid(tmp_path):
    """Every checkpointing mode (and every 2nd block): 0 unattributed, every line and the peak
    predicted to the byte, and the recorded cost says where the peak is."""
    rows, out = _sweep(tmp_path, "cpu-ac")
    assert len(rows) == len(grid("cpu-ac")) == 20
    for r in rows:
        assert r["status"] == "ok", r
        assert r["unattributed_bytes"] == 0
        assert r["activation_lines_mismatched"] == [] and r["steady_lines_mismatched"] == [], r["config"]
        assert r["totals"]["peak"]["diff"] == 0, (r["config"], r["cost"])
    at = {r["cost"]["peak_at"].split(" of ")[0] for r in rows}
    assert {"start", "backward", "end"} <= at  # the lever moves the peak to each of the three moments
    assert accuracy_table(str(out)).count("+0.000%") >= 20


def test_unknown_grid_is_one_line():
    p = run_cli("sweep", "--grid=nope")
    assert p.returncode == 2 and "unknown grid" in p.stderr

