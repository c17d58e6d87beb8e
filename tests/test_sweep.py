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


def test_a_torchrun_config_gives_one_row_per_rank(tmp_path):
    """A sweep config with `nproc` runs under torchrun (gloo); each rank's books are a row, exact."""
    cfg = tmp_path / "tp.json"
    cfg.write_text(json.dumps([dict(preset="cpu-tiny", batch_size=2, device="cpu", nproc=2, parallel="tp-sp")]))
    out = tmp_path / "tp.jsonl"
    p = run_cli("sweep", f"--configs={cfg}", f"--out={out}", f"--audit-dir={tmp_path}/runs", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in open(out)]
    assert [r["config"]["rank"] for r in rows] == [0, 1] and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert r["resolved_config"]["world_size"] == 2 and r["unattributed_bytes"] == 0
        assert r["activation_lines_mismatched"] == [] and r["steady_lines_mismatched"] == []
        assert r["totals"]["peak"]["diff"] == 0
    assert not list((tmp_path / "runs").rglob("*.pickle"))  # each rank's snapshots removed, reports kept
    assert len(list((tmp_path / "runs").rglob("report.json"))) == 2
