"""The allocator model's rules against real CUDA traces: fed a trace's requests in order, it
chooses blocks and segments itself; where it makes the very segments the real allocator made,
reserved-memory misses lie in the predicted history, not in the rules."""

import os

import pytest

from conftest import EXAMPLES, FOREIGN
from memory_audit.gap_sim import replay_requests
from memory_audit.loader import load_snapshot


def _replay(path):
    if not os.path.isfile(path):
        pytest.skip("../shared/fixtures/foreign_snapshots not present")
    tr = load_snapshot(path)["device_traces"][0]
    return replay_requests(tr.act, tr.addr, tr.size)


@pytest.mark.parametrize("run", ["cuda-tiny-fp16-manual", "cuda-tiny-bf16-sdpa"])
def test_committed_tiny_audits_get_their_segments(run):
    """Our H100 audits record from before the model exists: the whole history, 5 segments."""
    r = _replay(os.path.join(EXAMPLES, run, "step2_end.pickle"))
    assert r["segments"] == r["trace_segments"] == [2 * 2**20] * 3 + [32 * 2**20] * 2
    assert r["reserved"] == 73_400_320


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
