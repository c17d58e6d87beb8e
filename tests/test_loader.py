"""Loading: refuse hostile pickles, explain bad files in one line, read every real generation."""

import glob
import os
import pickle

import pytest

from conftest import FOREIGN, run_cli
from memory_audit.reading.attribute import attribute
from memory_audit.reading.loader import SnapshotError, find_snapshots, load_snapshot


class _Creates:
    """Unpickling this with pickle.load would create a file (via os.system)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_hostile_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "x": _Creates(marker)}, protocol=4))
    with pytest.raises(SnapshotError, match="refused: the pickle asks for .*system"):
        load_snapshot(str(bad))
    assert not marker.exists()
    p = run_cli("attribute", str(bad))
    assert p.returncode == 2 and not marker.exists()
    assert p.stderr.count("\n") == 1 and "refused" in p.stderr and "Traceback" not in p.stderr


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("name, data, message", [
    ("empty.pickle", b"", "empty file"),
    ("text.pickle", b"hello, not a pickle", "not a pickle"),
    ("truncated.pickle", pickle.dumps({"segments": [{"a": 1}] * 50}, protocol=4)[:40], "truncated or corrupt"),
    ("shape.pickle", pickle.dumps([1, 2, 3], protocol=4), "not a memory snapshot"),
    ("blocks.pickle", pickle.dumps({"segments": [{"total_size": 1}], "device_traces": []}, protocol=4),
     "lacks 'blocks'"),
])
def test_bad_files_get_one_line_errors(tmp_path, name, data, message):
    path = _write(tmp_path, name, data)
    with pytest.raises(SnapshotError, match=message):
        load_snapshot(path)
    p = run_cli("attribute", path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and message in p.stderr


def test_directory_without_snapshots(tmp_path):
    with pytest.raises(SnapshotError, match="holds no snapshot"):
        find_snapshots(str(tmp_path))
    p = run_cli("attribute", str(tmp_path))
    assert p.returncode == 2 and "holds no snapshot" in p.stderr


def test_missing_path():
    p = run_cli("attribute", "/no/such/file.pickle")
    assert p.returncode == 2 and "no such file" in p.stderr


FOREIGN_FILES = sorted(glob.glob(os.path.join(FOREIGN, "*.pickle")))


@pytest.mark.skipif(not FOREIGN_FILES, reason="../shared/fixtures/foreign_snapshots not present")
@pytest.mark.parametrize("path", FOREIGN_FILES, ids=os.path.basename)
def test_every_foreign_snapshot_loads_and_balances_per_device(path):
    snap = load_snapshot(path)
    result = attribute(snap)
    reserved = {}
    for seg in snap["segments"]:
        reserved[seg["device"]] = reserved.get(seg["device"], 0) + seg["total_size"]
    assert set(result) == set(reserved)
    for dev, r in result.items():
        assert sum(r["categories"].values()) == reserved[dev] == r["reserved_bytes"]
        active = sum(b["size"] for s in snap["segments"] if s["device"] == dev for b in s["blocks"]
                     if b["state"] == "active_allocated")
        assert r["allocated_bytes"] == active


@pytest.mark.skipif(not FOREIGN_FILES, reason="../shared/fixtures/foreign_snapshots not present")
def test_foreign_snapshots_are_named_from_their_stacks_and_their_baseline():
    """Below 10% of the allocated bytes of all foreign snapshots stay unattributed (33.4% before
    the baseline rule); every block left over is listed with why."""
    allocated = unattributed = baseline = 0
    for path in FOREIGN_FILES:
        for r in attribute(load_snapshot(path), top_unattributed=10 ** 6).values():
            allocated += r["allocated_bytes"]
            unattributed += r["unattributed_bytes"]
            baseline += r["categories"]["baseline"]
            assert sum(b["requested_size"] for b in r["unattributed"]) == r["unattributed_bytes"]
            assert all(b["why"] for b in r["unattributed"])
    print(f"foreign: {unattributed:,} of {allocated:,} B unattributed ({100 * unattributed / allocated:.6f}%), "
          f"baseline {100 * baseline / allocated:.2f}%")
    assert unattributed < 0.10 * allocated
    assert baseline < 0.40 * allocated  # most bytes are named from frames, not set aside as baseline


@pytest.mark.skipif(not FOREIGN_FILES, reason="../shared/fixtures/foreign_snapshots not present")
def test_the_2023_generation_is_normalised():
    old = [p for p in FOREIGN_FILES if "Yiyi-philosophy" in p]
    assert old
    for path in old:
        snap = load_snapshot(path)
        for seg in snap["segments"]:
            for block in seg["blocks"]:
                assert "address" in block and "frames" in block  # filled in from `history`


@pytest.mark.skipif(not FOREIGN_FILES, reason="../shared/fixtures/foreign_snapshots not present")
def test_foreign_cli_attribute_prints_categories():
    p = run_cli("attribute", FOREIGN_FILES[0])
    assert p.returncode == 0, p.stderr
    assert "| category | bytes | MiB | share |" in p.stdout


def test_newer_generation_keys_and_actions_are_tolerated():
    """torch 2.14 adds host_segments/host_traces and `annotate` entries; oom entries carry
    device_free instead of addr. None of them may break loading, attribution or replay."""
    from memory_audit.reading.loader import normalize
    from memory_audit.reading.timeline import replay
    snap = normalize({
        "segments": [{"device": 0, "address": 4096, "total_size": 2 ** 21, "stream": 0, "segment_type": "small",
                      "blocks": [{"address": 4096, "size": 512, "requested_size": 4, "state": "active_allocated",
                                  "frames": []},
                                 {"address": 4608, "size": 2 ** 21 - 512, "requested_size": 0, "state": "inactive",
                                  "frames": []}]}],
        "device_traces": [[{"action": "segment_alloc", "addr": 4096, "size": 2 ** 21, "stream": 0},
                           {"action": "annotate", "size": 0, "stream": 0, "user_metadata": "step 2"},
                           {"action": "alloc", "addr": 4096, "size": 4, "stream": 0},
                           {"action": "oom", "device_free": 123, "size": 2 ** 40, "stream": 0}]],
        "host_segments": [], "host_traces": [], "allocator_settings": {},
    })
    r = attribute(snap)[0]
    assert r["reserved_bytes"] == 2 ** 21 and r["allocated_bytes"] == 512 and r["categories"]["gaps"] == 508
    assert replay(snap)["peak"]["bytes"] == 512  # the block the 4-byte request got


def test_reading_snapshots_does_not_import_torch():
    """attribute/replay stay light (the benchmark's RSS target): only the recorder needs torch."""
    import subprocess
    import sys
    code = ("import sys, memory_audit, memory_audit.reading.loader, memory_audit.reading.attribute, memory_audit.reading.timeline; "
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "False", p.stderr
