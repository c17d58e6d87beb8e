"""Benchmark: `python -m memory_audit attribute FILE` as a user runs it, beside torch's summary.

    python benchmarks/bench_attribute.py [SNAPSHOT] [--entries=1000000] [--runs=5] [--keep=FILE]

Builds a large snapshot from a real one (default: the committed CUDA example; see build()),
writes it to a temporary file, then times whole processes, imports included, each run fresh:
  ours:   python -m memory_audit attribute FILE            (what a user types)
  small:  the same on a ~1 MB file built the same way      (target < 0.3 s)
  torch:  python -c 'pickle.load + torch.cuda._memory_viz.trace'
and prints the median wall time, the peak RSS (the child's VmHWM, read by a wrapper) and the
ratios against the targets of issue "The reading side as a user runs it" (< 1.0 s and < 2x the
pickle's size on the big file). MEMORY_AUDIT_PURE_PYTHON=1 times our pure-Python road. Not a
test: the numbers depend on the machine.
"""

import argparse
import bisect
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Runs argv[1:] as a child, waits for it and prints its peak RSS (VmHWM of the child, read from
# /proc before it is reaped; ru_maxrss of RUSAGE_CHILDREN would do too on Linux).
WRAPPER = r"""
import os, resource, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
p.wait()
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, p.returncode)
"""
TORCH = r"""
import contextlib, io, pickle, sys
import torch.cuda._memory_viz as mv
with open(sys.argv[1], "rb") as f:
    snap = pickle.load(f)
with contextlib.redirect_stdout(io.StringIO()):
    mv.trace(snap)
"""


def _free_ranges(snap, device=0):
    """Sorted [(start, end)] of the address ranges no active block holds at the snapshot's end."""
    out = []
    for seg in snap["segments"]:
        if seg.get("device", 0) != device:
            continue
        for b in seg["blocks"]:
            if b["state"] == "inactive":
                if out and out[-1][1] == b["address"]:
                    out[-1] = (out[-1][0], b["address"] + b["size"])
                else:
                    out.append((b["address"], b["address"] + b["size"]))
    return sorted(out)


def _fits(ranges, addr, size):
    i = bisect.bisect_right(ranges, (addr, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= addr and addr + size <= ranges[i][1]


def build(src, entries, fresh_frames=False):
    """A snapshot of at least `entries` trace entries that every reader can load.

    The source's whole trace comes first, as recorded, so the blocks that are still live at its
    end (the cuBLAS workspace, the weights) are made where they were and the segments agree with
    the trace. Then its complete alloc..free pairs are repeated, in trace order, each repetition
    later in time than the last: only pairs whose block lies in memory the end state leaves free,
    so a repetition never overlaps a live block and every reader that rebuilds the allocator's
    history from the end state finds each block's gap. Entries are written as torch writes them:
    a dict per entry, a frames list per traceback, one dict per distinct frame (torch's
    symbolizer dedups frames, so the pickle memoizes each once; --fresh-frames: no sharing).
    """
    from memory_audit.reading.loader import _PlainDataUnpickler
    with open(src, "rb") as f:  # the source as torch wrote it (shared frames), not as we load it
        snap = _PlainDataUnpickler(f).load()
    trace = snap["device_traces"][0]
    free = _free_ranges(snap)
    opened, pairs = {}, {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            opened[e["addr"]] = i
        elif e["action"] == "free_completed" and e["addr"] in opened:
            j = opened.pop(e["addr"])
            if _fits(free, e["addr"], trace[j]["size"]):
                pairs[j] = i
    keep, open_pair = [], set()
    for i, e in enumerate(trace):
        if e["action"] == "alloc" and i in pairs:
            open_pair.add(e["addr"])
            keep.append(e)
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in open_pair:
            keep.append(e)
            if e["action"] == "free_completed":
                open_pair.discard(e["addr"])
    times = [e["time_us"] for e in trace if e.get("time_us") is not None]
    span = (max(times) - min(times) + 1) if times else 1
    reps = max(0, (entries - len(trace)) // max(1, len(keep)) + 1)
    out = list(trace)
    lists = {}
    for r in range(1, reps + 1):
        for e in keep:
            e2 = dict(e)
            if e2.get("time_us") is not None:
                e2["time_us"] += r * span
            frames = e.get("frames")
            if frames is not None and fresh_frames:  # a harder file than torch writes: no sharing
                e2["frames"] = [dict(f) for f in frames]
            elif frames is not None:  # one list per traceback, shared frame dicts
                e2["frames"] = lists.setdefault(id(frames), list(frames))
            out.append(e2)
    snap["device_traces"][0] = out
    return snap


def timed(argv, runs):
    """(median wall s, max peak RSS bytes) of `runs` fresh processes."""
    walls, rss = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", WRAPPER, sys.executable, *argv], capture_output=True, text=True, cwd=ROOT)
        walls.append(time.perf_counter() - t0)
        peak, rc = p.stdout.split()
        if int(rc):
            raise SystemExit(f"error: {' '.join(argv)[:200]} exited {rc}")
        rss.append(int(peak))
    return statistics.median(walls), max(rss)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("snapshot", nargs="?", default=os.path.join(ROOT, "snapshots", "examples",
                                                              "cuda-tiny-fp16-manual", "step2_end.pickle"))
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--fresh-frames", action="store_true",
                   help="a new dict per frame per entry (no sharing, unlike torch): the worst case")
    p.add_argument("--keep", default=None, help="also copy the built file here")
    p.add_argument("--no-torch", action="store_true", help="skip timing torch's summary")
    args = p.parse_args()
    snap = build(args.snapshot, args.entries, args.fresh_frames)
    n = len(snap["device_traces"][0])
    ours = ["-m", "memory_audit", "attribute"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.pickle")
        with open(path, "wb") as f:
            pickle.dump(snap, f, protocol=4)
        del snap
        if args.keep:
            import shutil
            shutil.copy(path, args.keep)
        mb_path = os.path.join(tmp, "one_mb.pickle")  # ~1 MB: the size of a small real snapshot
        with open(mb_path, "wb") as f:
            pickle.dump(build(args.snapshot, 12_000, args.fresh_frames), f, protocol=4)
        size, mb_size = os.path.getsize(path), os.path.getsize(mb_path)
        rows = [("ours, big file", size, *timed(ours + [path], args.runs)),
                ("ours, 1 MB file", mb_size, *timed(ours + [mb_path], args.runs))]
        if not args.no_torch:
            rows.append(("torch pickle.load + _memory_viz.trace, big", size,
                         *timed(["-c", TORCH, path], max(1, args.runs // 2))))
    print(f"big file: {n:,} trace entries, {size / 2**20:.1f} MiB pickle; small file: {mb_size / 2**20:.2f} MiB; "
          f"{args.runs} runs each (median wall, whole process, imports included)")
    for name, nbytes, wall, rss in rows:
        print(f"{name:>44}: {wall:.2f} s, peak RSS {rss / 2**20:.0f} MiB ({rss / nbytes:.2f}x the file)")
    big, small = rows[0], rows[1]
    print(f"targets: big file {big[2]:.2f} s (< 1.0 s: {big[2] < 1.0}), RSS {big[3] / size:.2f}x the file "
          f"(< 2x: {big[3] < 2 * size}); 1 MB file {small[2]:.2f} s (< 0.3 s: {small[2] < 0.3})")
    if len(rows) > 2:
        print(f"torch / ours on the big file: {rows[2][2] / big[2]:.2f}x the time")


if __name__ == "__main__":
    main()
