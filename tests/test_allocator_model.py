"""The allocator model's rules against real CUDA traces: fed a trace's requests in order, it
chooses blocks and segments itself; where it makes the very segments the real allocator made,
reserved-memory misses lie in the predicted history, not in the rules."""

import json
import os

import pytest

from conftest import EXAMPLES, FOREIGN, load_json
from memory_audit.reading.allocator_model import replay_requests
from memory_audit.reading.loader import load_snapshot


def _replay(path):
    if not os.path.isfile(path):
        pytest.skip("../shared/fixtures/foreign_snapshots not present")
    tr = load_snapshot(path)["device_traces"][0]
    return replay_requests(tr.act, tr.addr, tr.size, stream=tr.stream)


@pytest.mark.parametrize("run", ["cuda-tiny-fp16-manual", "cuda-tiny-bf16-sdpa"])
def test_committed_tiny_audits_get_their_segments(run):
    """Our H100 audits record from before the model exists: the whole history, 5 segments."""
    r = _replay(os.path.join(EXAMPLES, run, "step2_end.pickle"))
    assert r["segments"] == r["trace_segments"] == [2 * 2**20] * 3 + [32 * 2**20] * 2
    assert r["reserved"] == 73_400_320


def test_a_pool_per_stream_gives_the_nccl_fsdp_audit_its_segments():
    """FSDP2's reduce-scatter runs on a stream of its own (an H100 NCCL audit at world size 1):
    fed the trace's requests with each entry's stream, the model makes the trace's own segments
    (98 MiB); with one pool for every stream it makes one 2 MiB segment fewer."""
    tr = load_snapshot(os.path.join(EXAMPLES, "nccl-ws1", "fsdp", "step2_end.pickle"))["device_traces"][0]
    pools = replay_requests(tr.act, tr.addr, tr.size, stream=tr.stream)
    assert pools["segments"] == pools["trace_segments"] and pools["reserved"] == 102_760_448
    assert pools["reserved"] - replay_requests(tr.act, tr.addr, tr.size)["reserved"] == 2 << 20


# third-party training and forward traces (cs336 assignment 2, two repositories) in which the
# allocator made its segments while recording: one full step of 783 segments (56.9 GiB reserved)
SAME_SEGMENTS = {
    "kkaitlyn111__cs336-a2-systems__memory_files_memory_ctx128_fullstep.pickle": 783,
    "kkaitlyn111__cs336-a2-systems__memory_files_memory_ctx128_fullstep_.pickle": 782,
    "kkaitlyn111__cs336-a2-systems__memory_files_memory_ctx128_forward_mixed.pickle": 461,
    "kkaitlyn111__cs336-a2-systems__memory_files_memory_ctx512_forward_mixed.pickle": 638,
    "kkaitlyn111__cs336-a2-systems__cs336_systems_memory_logs_memory_ctx128_forward.pickle": 178,
    "silmont2000__assignment2-systems__mem_snapshot.pickle": 9,
}
# these two began with ~230 segments already made whose free space the real allocator could use
# (30.6 MB and 53.5 MB of it still free at the end, against 13,824 B in the two ctx128 fullstep
# traces above, which match); the model starts empty and makes more: (model, trace) segments
MORE_SEGMENTS = {
    "kkaitlyn111__cs336-a2-systems__memory_files_memory_ctx256_fullstep_.pickle": (799, 791),
    "kkaitlyn111__cs336-a2-systems__memory_files_memory_ctx512_fullstep_.pickle": (597, 589),
}


@pytest.mark.parametrize("name, n", sorted(SAME_SEGMENTS.items()))
def test_foreign_traces_get_the_same_segments(name, n):
    r = _replay(os.path.join(FOREIGN, name))
    assert len(r["trace_segments"]) == n
    assert r["segments"] == r["trace_segments"] and r["reserved"] == r["trace_reserved"]


@pytest.mark.parametrize("name, counts", sorted(MORE_SEGMENTS.items()))
def test_foreign_traces_begun_late_get_a_few_more_segments(name, counts):
    r = _replay(os.path.join(FOREIGN, name))
    assert (len(r["segments"]), len(r["trace_segments"])) == counts
    assert 0 < r["reserved"] - r["trace_reserved"] < r["trace_reserved"] // 100  # under 1% more


def test_forward_history_is_the_h100_reference_forward():
    """The history the reserved-memory model plays for a forward (saved tensors in the order
    they are made, and the temporaries the forward makes and drops) against the H100
    reference run's measured step-2 forward, GPT-2 small, fp16, manual attention: every
    large-pool request and release (over 1 MiB) in the same order with the same size. The
    small pool (a few 4 B scalars the ledger does not order) is left out."""
    from memory_audit.reading.allocator_sim import SMALL_SIZE, round_size
    from memory_audit.prediction.ledger.history import forward_temporaries, play_forward
    from memory_audit.prediction.predict import predict
    from memory_audit.comparison.reconcile import device_from_meta

    ref = os.path.join(EXAMPLES, "h100-gpt2-reference")
    meta, report = load_json(os.path.join(ref, "meta.json")), load_json(os.path.join(ref, "report.json"))
    acts = [l for l in predict(meta["config"], device_from_meta(meta))["ledger"] if l["category"] == "activations"]
    played, live = [], {}

    def alloc(key, nbytes):
        live[key] = nbytes
        played.append(round_size(nbytes))

    def free(key):
        played.append(-round_size(live.pop(key)))

    play_forward(acts, forward_temporaries(acts, meta["config"]), meta["config"], alloc, free, live)
    series, start, end = report["series"], report["phase_index"]["step2_start"], report["phase_index"]["step2_before_backward"]
    measured = [b["allocated"] - a["allocated"] for a, b in zip(series, series[1:]) if start < b["index"] <= end]
    large = [n for n in measured if abs(n) > SMALL_SIZE]
    assert len(large) == 421 and [n for n in played if abs(n) > SMALL_SIZE] == large
    # when the forward returns only the saved tensors are held: the temporaries and the logits
    # this loop does not keep are gone
    assert live and all(key[0] == "act" for key in live)


def test_reserved_phases_script_agrees_with_the_accuracy_rows():
    """Consistency, not accuracy: scripts/reserved_phases.py (where a reserved miss enters)
    prints, for each of the 23 stored H100 rows with a report, the predicted (the shadow run replayed) and the measured
    reserved per phase; its end-of-step columns are the accuracy table's reserved pair (two code
    paths over the same rows; the measured side to the reports' 3 decimals). How close the model
    is to the measurement is test_shadow_cuda's and docs/accuracy.md's."""
    import subprocess
    import sys

    from conftest import ROOT
    from memory_audit.comparison.sweep import accuracy_rows

    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "reserved_phases.py")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    printed = [l.split(" | ") for l in p.stdout.splitlines()[1:]]
    rows = [r for f in ("h100.jsonl", "h100-variants.jsonl")
            for r in accuracy_rows(os.path.join(ROOT, "snapshots", "results", f))]
    assert len(printed) == len(rows) == 23
    for cells, row in zip(printed, rows, strict=True):
        model, measured = (float(x) for x in cells[3].split(" / "))
        assert cells[0] == row["run"].replace("sweep-preset", "")
        assert abs(model * 2**30 - row["reserved_predicted"]) < 0.0005 * 2**30
        assert abs(measured * 2**30 - row["reserved_actual"]) < 0.005 * 2**30


def test_reserved_read_from_a_report_is_what_the_allocator_said():
    """The measured side of the reserved checks above comes from report.md files (the H100 rows
    carry no meta.json); both readings of a report are checked here against an independent
    source, the memory_reserved() that the one committed H100 meta.json recorded live:
    backfill_reserved's end-of-step bytes exactly, reserved_phases' per-phase sums within what
    the printed digits can lose (half a unit of the last digit per category row)."""
    import re
    import sys

    from conftest import EXAMPLES, ROOT
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from backfill_reserved import measured_reserved, report_table
    from reserved_phases import UNIT, measured

    run = os.path.join(EXAMPLES, "h100-gpt2-reference")
    live = {k: v["memory_reserved"] for k, v in json.load(open(os.path.join(run, "meta.json")))["phases"].items()}
    report = os.path.join(run, "report.md")
    assert measured_reserved(report) == max(live.values()) == 25_904_021_504
    read = measured(report)
    text = open(report).read()
    for phase, value in read.items():
        cells = [r[2].split() for r in report_table(text, phase) if not r[0].startswith("---")]
        slack = sum(0.5 * 10 ** -len((re.search(r"\.(\d+)", n) or [0, ""])[1]) * UNIT[u] for n, u in cells)
        assert abs(value - live[phase]) <= slack, (phase, value, live[phase], slack)
