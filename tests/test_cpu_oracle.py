"""The CPU timeline against a program whose every allocation is known by hand (#47, item 4).

On CPU the audit's measured side is partly built by the project's own rules (cpu_timeline.py
infers the frees gloo's thread made and the profiler did not record), and the measured and the
predicted side name lines with the same code. Here nothing is predicted by the project: each
phase's bytes, every line and the step's peak are computed below from the shapes of
tests/oracle_program.py (two bias-free linears, SGD with momentum, fp32; DDP under torchrun) and
compared, to the byte, with what the audit measured through both roads from the profile to a
trace (the memory profile, raw allocations paired by address), on one process and on two
torchrun ranks. The peak is also replayed here from the step2_end pickle by a plain sum.

CPU sizes are the tensors' own: c10's CPU allocator aligns the pointer, not the size, and the
profiler reports the bytes asked for (nbytes), so no rounding enters the arithmetic.
"""

import os
import pickle
import re
import subprocess
import sys

import pytest

import oracle_program
from conftest import ROOT
from memory_audit.comparison.report import measured

B, D, H, O = oracle_program.B, oracle_program.D, oracle_program.H, oracle_program.O
F32 = 4  # bytes per float32

# -- every tensor of the audited step, by hand
W1 = F32 * H * D  # fc1.weight (H, D): 262,144 B
W2 = F32 * O * H  # fc2.weight (O, H): 524,288 B
P = W1 + W2  # all parameters: 786,432 B; their gradients and momentum buffers are the same sizes
X = F32 * B * D  # the batch x (B, D): 4,096 B
Y = F32 * B * O  # the target y (B, O): 8,192 B
HID = F32 * B * H  # fc1's output (B, H), and its gradient in backward: 16,384 B
OUT = F32 * B * O  # fc2's output (B, O), and its gradient: 8,192 B
SCALAR = F32  # a 0-dim fp32 tensor: the loss, backward's seed
BUCKET = P  # DDP's gradient bucket: one flat fp32 buffer of every gradient (one bucket: under the 1 MiB cap of the first)

ROADS = ("memory_profile", "raw allocations")


def hand_books(ddp):
    """{phase: {line: bytes}} and the peak's {line: bytes}, from the shapes above."""
    p = "module." if ddp else ""  # DDP's parameter names
    # step 2 starts with the weights, SGD's momentum buffers (made by step 1's optimizer step),
    # the batch, and the loss of step 1 that the loop still holds (the grads were set to None)
    start = {f"weights/{p}fc1.weight": W1, f"weights/{p}fc2.weight": W2,
             f"optimizer/momentum_buffer/{p}fc1.weight": W1, f"optimizer/momentum_buffer/{p}fc2.weight": W2,
             "inputs/x": X, "inputs/y": Y,
             "temporary/loop/loss": SCALAR}
    if ddp:
        start["grads/ddp_buckets"] = BUCKET  # made when DDP is built, made again by its rebuild in step 2's forward
    # before backward: fc1's output h, which fc2's mm saved for fc2.weight's gradient. fc2's
    # output is freed after the product (mul saves only y: out's gradient is grad * y, and y needs
    # none), the product after the sum; the new loss took the old one's place (the same 4 B)
    before = dict(start, **{f"activations/{p}fc2/mm.self": HID})
    # the end: zero_grad set the gradients to None; SGD's update was in place (buf.mul_().add_(),
    # param.add_()): the step starts and ends with the same bytes
    end = dict(start)
    # the peak: fc1's mm backward allocating fc1.weight's gradient, while fc2.weight's gradient
    # (AccumulateGrad kept it), the gradient of h (B, H) that fc1's node reads, and backward's seed
    # (ones_like(loss), which torch.autograd.backward holds until the whole backward returns)
    # are live; h itself was released when fc2's node finished, fc2's output gradient too
    peak = dict(start, **{f"grads/{p}fc1.weight": W1, f"grads/{p}fc2.weight": W2,
                          "temporary/backward/aten::mm": HID, "temporary/backward/grad_seed": SCALAR})
    return {"step2_start": start, "step2_before_backward": before, "step2_end": end}, peak


def test_the_hand_arithmetic():
    """The sums the books above add up to, written out, and why the peak is where it is."""
    books, peak = hand_books(ddp=False)
    start = 2 * P + X + Y + SCALAR  # weights + momentum + batch + the held loss
    assert sum(books["step2_start"].values()) == start == 1_585_156
    assert sum(books["step2_before_backward"].values()) == start + HID == 1_601_540
    assert sum(books["step2_end"].values()) == start
    assert sum(peak.values()) == start + P + HID + SCALAR == 2_387_976
    # the other candidate, fc2's backward: h (saved), out's gradient, h's gradient, fc2.weight's
    # gradient and the seed; smaller, so fc1.weight's gradient is the peak
    assert start + HID + OUT + HID + W2 + SCALAR < start + P + HID + SCALAR
    ddp_books, ddp_peak = hand_books(ddp=True)
    assert sum(ddp_peak.values()) == sum(peak.values()) + BUCKET == 3_174_408
    import torch.distributed as dist
    assert BUCKET <= dist._DEFAULT_FIRST_BUCKET_BYTES  # one bucket before and after DDP's rebuild


def categories(lines):
    out = {}
    for k, v in lines.items():
        out[k.split("/", 1)[0]] = out.get(k.split("/", 1)[0], 0) + v
    return out


def replayed_peak(run_dir):
    """The step's peak from the step2_end pickle alone (a plain running sum over its trace, from
    step2_start's position in it, meta.json's trace_entries): no project code reads it, though the
    pickle's frees are the audit's own conversion of the profile (cpu_timeline's rules)."""
    import json
    with open(os.path.join(run_dir, "step2_end.pickle"), "rb") as f:
        snap = pickle.load(f)
    with open(os.path.join(run_dir, "meta.json")) as f:
        start = json.load(f)["phases"]["step2_start"]["trace_entries"]
    live, running = 0, []
    for e in snap["device_traces"][0]:
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        running.append(live)
    end = sum(s["total_size"] for s in snap["segments"])
    assert live == end  # everything live at the end was made in the trace: the Audit began before the model
    return max(running[start - 1:])


def assert_books(run_dir, ddp, road):
    """Every phase, line by line, the peak and its lines: the hand's books."""
    import json
    books, peak = hand_books(ddp)
    m = measured(run_dir)
    with open(os.path.join(run_dir, "meta.json")) as f:
        taken = json.load(f)["cpu_timeline"]
    # under torchrun the memory profile's data-flow checks may fail as gloo's thread interleaves
    # (about 1 rank audit in 6 here): the raw road is then taken, and the books must be the same
    assert taken == road or (ddp and road == "memory_profile" and taken == "raw allocations"), (run_dir, taken)
    for phase, lines in books.items():
        got = m["phases"][phase]
        assert got["lines"] == lines, (run_dir, phase)
        assert got["reserved_bytes"] == sum(lines.values()), (run_dir, phase)  # CPU: no cache, no gaps
        assert {c["key"]: c["actual"] for c in got["categories"]} == categories(lines), (run_dir, phase)
    t = m["totals"]
    assert t["steady_state"]["actual"] == sum(books["step2_start"].values())
    assert t["activations"]["actual"] == HID
    assert t["peak"]["actual"] == m["peak"]["bytes"] == replayed_peak(run_dir) == sum(peak.values()), run_dir
    if not ddp:  # under DDP the rebuilt bucket goes unnamed at the peak: test_ddp_bucket_named_at_the_peak
        assert m["peak"]["lines"] == peak, run_dir
        assert m["peak"]["categories"] == categories(peak), run_dir
    return taken


@pytest.mark.parametrize("road", ROADS)
def test_one_process(tmp_path, road):
    run = oracle_program.audited_run(str(tmp_path / "run"), road)
    assert_books(run, ddp=False, road=road)


def test_an_unknown_road_is_one_line(tmp_path):
    from memory_audit import Audit, AuditError
    with pytest.raises(AuditError, match="cpu_timeline must be one of None, 'memory_profile', 'raw allocations', got 'raw'"):
        Audit(out_dir=str(tmp_path / "run"), device="cpu", cpu_timeline="raw")
    assert not (tmp_path / "run").exists()


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    """Both roads audited on both ranks of one torchrun job: {(road, rank): run dir}. A rank
    that dies by a signal inside torch (SIGSEGV as the profiler starts under gloo, about 1 job in
    20 here; tests/test_distributed.py's _torchrun) is rerun, up to twice, into a fresh directory;
    gloo's own timeout (60 s) and the subprocess's bound each job."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    for attempt in (1, 2, 3):
        out = tmp_path_factory.mktemp(f"torchrun{attempt}")
        p = subprocess.run(TORCHRUN + [os.path.join(ROOT, "tests", "oracle_program.py"), str(out), *ROADS],
                           cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
        if not re.search(r"Signal (6|11) \(SIG(ABRT|SEGV)\)", p.stderr):
            break
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return {(road, rank): os.path.join(out, oracle_program.road_dir(road), f"rank{rank}")
            for road in ROADS for rank in (0, 1)}


@pytest.mark.parametrize("road", ROADS)
def test_torchrun_ddp(torchrun_runs, road):
    """Two gloo ranks, DDP: the same books plus the bucket, on each rank. DDP's construction
    stages the weights in a flat buffer to broadcast them (786,432 B here), checks the shapes
    across ranks in small int64 tensors, and its rebuild in step 2's forward broadcasts the bucket
    layout in 4 B int32 tensors; gloo's thread lets some of them go, and which ones changes from
    run to run: each must be freed where cpu_timeline's rules put it for the books to hold."""
    for rank in (0, 1):
        assert_books(torchrun_runs[road, rank], ddp=True, road=road)


def test_ddp_bucket_named_at_the_peak(torchrun_runs):
    """DDP's bucket, rebuilt in step 2's forward and live at the end, is grads/ddp_buckets at the
    peak too (reading/event_names.name_events names it by its stack), on both roads and ranks."""
    _, peak = hand_books(ddp=True)
    for road in ROADS:
        for rank in (0, 1):
            m = measured(torchrun_runs[road, rank])
            assert m["peak"]["lines"] == peak and m["peak"]["categories"] == categories(peak)
