"""Benchmark: `attribute` and `viz` as a user runs them on big snapshots, beside torch's summary.

    python benchmarks/bench_attribute.py [SNAPSHOT] [--entries=1000000,10000000] [--runs=5] [--keep=FILE]

Builds large snapshots from a real one (default: the committed CUDA example; see build()),
writes each to a temporary file, then times whole processes, imports included, each run fresh:
  attribute:  python -m memory_audit attribute FILE   (also on a ~1 MB file: target < 0.3 s)
  viz:        python -m memory_audit viz FILE --out big.html, and whether headless Chromium
              draws the page offline (tests/headless.py)
  torch:      python -c 'pickle.load + torch.cuda._memory_viz.trace'
and prints the median wall time, the cost per entry, the peak RSS (the child's, read by a
wrapper) and the page's size. Targets at 10M entries (740 MiB): attribute < 3 s and < 1.5x the
file in RSS; viz < 15 s, page < 20 MB. MEMORY_AUDIT_PURE_PYTHON=1 times our pure-Python road.
Not a test: the numbers depend on the machine.
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
from memory_audit.reading.viz import REAL_VIEWER_MAX_ENTRIES  # noqa: E402

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


def rendered(page):
    """Whether headless Chromium draws the overview page offline, and its time (s), or why not."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import re
    import headless
    why = headless.missing()
    if why:
        return why
    with tempfile.TemporaryDirectory() as tmp:
        dom, wall, _ = headless.chromium(f"file://{page}", os.path.join(tmp, "profile"), network=False)
    drawn = 'data-drawn="yes"' in dom and len(re.findall("<polygon", dom)) > 0
    return f"drawn offline, {wall:.1f} s in Chromium" if drawn else "NOT drawn"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("snapshot", nargs="?", default=os.path.join(ROOT, "snapshots", "examples",
                                                              "cuda-tiny-fp16-manual", "step2_end.pickle"))
    p.add_argument("--entries", default="1000000", help="trace sizes, comma-separated (1000000,10000000)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--fresh-frames", action="store_true",
                   help="a new dict per frame per entry (no sharing, unlike torch): the worst case")
    p.add_argument("--keep", default=None, help="also copy the (last) built file here")
    p.add_argument("--no-torch", action="store_true", help="skip timing torch's summary")
    args = p.parse_args()
    ours = ["-m", "memory_audit", "attribute"]
    with tempfile.TemporaryDirectory() as tmp:
        mb_path = os.path.join(tmp, "one_mb.pickle")  # ~1 MB: the size of a small real snapshot
        with open(mb_path, "wb") as f:
            pickle.dump(build(args.snapshot, 12_000, args.fresh_frames), f, protocol=4)
        small = timed(ours + [mb_path], args.runs)
        print(f"1 MB file ({os.path.getsize(mb_path) / 2**20:.2f} MiB): attribute {small[0]:.2f} s (< 0.3 s: "
              f"{small[0] < 0.3}), peak RSS {small[1] / 2**20:.0f} MiB; {args.runs} runs each, median wall, "
              "whole process, imports included")
        for entries in (int(x) for x in args.entries.split(",")):
            path = os.path.join(tmp, "big.pickle")
            snap = build(args.snapshot, entries, args.fresh_frames)
            n = len(snap["device_traces"][0])
            with open(path, "wb") as f:
                pickle.dump(snap, f, protocol=4)
                f.flush()
                os.fsync(f.fileno())  # written back before timing: not competing with the runs' reads
            del snap
            if args.keep:
                import shutil
                shutil.copy(path, args.keep)
            size = os.path.getsize(path)
            wall, rss = timed(ours + [path], args.runs)
            out = os.path.join(tmp, "big.html")
            vwall, vrss = timed(["-m", "memory_audit", "viz", path, "--out", out], max(1, args.runs // 2))
            print(f"\n{n:,} trace entries, {size / 2**20:.1f} MiB pickle:")
            print(f"  attribute: {wall:.2f} s ({wall / n * 1e6:.3f} us per entry), peak RSS {rss / 2**20:.0f} MiB "
                  f"({rss / size:.2f}x the file)")
            print(f"  viz: {vwall:.2f} s, peak RSS {vrss / 2**20:.0f} MiB, page {os.path.getsize(out) / 2**20:.2f} MiB "
                  f"({'overview' if n > REAL_VIEWER_MAX_ENTRIES else 'MemoryViz'}); {rendered(out)}")
            if not args.no_torch:
                twall, trss = timed(["-c", TORCH, path], max(1, args.runs // 2))
                print(f"  torch pickle.load + _memory_viz.trace: {twall:.2f} s ({twall / wall:.2f}x ours), "
                      f"peak RSS {trss / 2**20:.0f} MiB")
            for f in os.listdir(tmp):
                if f.startswith("big."):
                    os.remove(os.path.join(tmp, f))


if __name__ == "__main__":
    main()
