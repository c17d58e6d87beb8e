"""Benchmark: attribute a large snapshot, beside torch.cuda._memory_viz summarising the same file.

    python benchmarks/bench_attribute.py [SNAPSHOT] [--entries=1000000]

Builds a snapshot of at least --entries trace entries by replaying the audited step of a real
snapshot (default: the committed CUDA example) over and over, as torch would have written it
(a dict per entry and a frames list per traceback, one dict per distinct frame), writes it to a
temporary file, then times, each in a fresh process:
  ours:   load_snapshot() (the compiled decoder when built, else the restricted unpickler)
          + attribute() + replay()
  torch:  pickle.load + torch.cuda._memory_viz.trace()
(--fresh-frames: every entry gets its own frame dicts, a file bigger than torch would write)
and prints events per second, peak RSS (the child's own VmHWM) and the ratios.
MEMORY_AUDIT_PURE_PYTHON=1 times our pure-Python road instead. Not a test: the numbers depend
on the machine.
"""

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import json, pickle, resource, sys, time
sys.path.insert(0, {root!r})
path, which = sys.argv[1], sys.argv[2]
if which == "ours":
    from memory_audit.loader import load_snapshot
    from memory_audit.attribute import attribute
    from memory_audit.timeline import replay
else:
    import torch.cuda._memory_viz as mv
t0 = time.perf_counter()  # imports are not timed: torch's import alone takes seconds
if which == "ours":
    snap = load_snapshot(path)
    t1 = time.perf_counter()
    attribute(snap)
    rp = replay(snap, None, max_points=2000)
    n = rp["entries"]
else:
    with open(path, "rb") as f:
        snap = pickle.load(f)
    t1 = time.perf_counter()
    import io, contextlib
    with contextlib.redirect_stdout(io.StringIO()):
        mv.trace(snap)
    n = sum(len(t) for t in snap["device_traces"])
t2 = time.perf_counter()
# peak RSS of this process: VmHWM (ru_maxrss would include the parent's peak: Linux carries it
# across fork+exec, and the parent held the whole snapshot while building it)
try:
    with open("/proc/self/status") as f:
        rss = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
except (OSError, StopIteration):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"entries": n, "load_s": t1 - t0, "work_s": t2 - t1, "total_s": t2 - t0, "peak_rss": rss}}))
"""


def build(src, entries, fresh_frames=False):
    from memory_audit.loader import _PlainDataUnpickler
    with open(src, "rb") as f:  # the source as torch wrote it (shared frames), not as we load it
        snap = _PlainDataUnpickler(f).load()
    trace = snap["device_traces"][0]
    # complete alloc..free pairs only, in trace order, so that every repetition balances
    opened, complete = {}, set()
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            opened[e["addr"]] = i
        elif e["action"] == "free_completed" and e["addr"] in opened:
            complete.add(opened.pop(e["addr"]))
    balanced, open_pair = [], {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc" and i in complete:
            open_pair[e["addr"]] = True
            balanced.append(e)
        elif e["action"] in ("free_requested", "free_completed") and open_pair.get(e["addr"]):
            balanced.append(e)
            if e["action"] == "free_completed":
                open_pair.pop(e["addr"])
    reps = max(1, entries // max(1, len(balanced)) + 1)
    out = []
    span = max(1, (balanced[-1].get("time_us") or 0) - (balanced[0].get("time_us") or 0) + 1)
    for r in range(reps):
        # As torch writes a snapshot: a fresh dict per entry and a fresh frames list per
        # traceback, but one dict per distinct frame, shared by every traceback that has it
        # (torch's symbolizer dedups frames), so the pickle memoizes each frame once.
        lists = {}
        for e in balanced:
            e2 = dict(e)
            if e2.get("time_us") is not None:
                e2["time_us"] += r * span
            frames = e.get("frames")
            if frames is not None and fresh_frames:  # a harder file than torch writes: no sharing
                e2["frames"] = [dict(f) for f in frames]
            elif frames is not None:
                e2["frames"] = lists.setdefault(id(frames), list(frames))
            out.append(e2)
    snap["device_traces"][0] = out
    return snap


def main():
    p = argparse.ArgumentParser()
    p.add_argument("snapshot", nargs="?", default=os.path.join(ROOT, "snapshots", "examples",
                                                              "cuda-tiny-fp16-manual", "step2_end.pickle"))
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--fresh-frames", action="store_true",
                   help="a new dict per frame per entry (no sharing, unlike torch): the worst case")
    args = p.parse_args()
    snap = build(args.snapshot, args.entries, args.fresh_frames)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.pickle")
        with open(path, "wb") as f:
            pickle.dump(snap, f, protocol=4)
        if os.environ.get("BENCH_KEEP"):
            import shutil
            shutil.copy(path, os.environ["BENCH_KEEP"])
        size = os.path.getsize(path)
        del snap
        results = {}
        for which in ("ours", "torch"):
            code = CHILD.format(root=ROOT)
            out = subprocess.run([sys.executable, "-c", code, path, which], capture_output=True, text=True)
            if out.returncode:
                print(out.stderr[-2000:])
                raise SystemExit(1)
            results[which] = json.loads(out.stdout.strip().splitlines()[-1])
    n = results["ours"]["entries"]
    print(f"snapshot: {n:,} trace entries, {size / 2**20:.1f} MiB pickle")
    for which, r in results.items():
        print(f"{which:>5}: load {r['load_s']:.2f} s, work {r['work_s']:.2f} s, total {r['total_s']:.2f} s, "
              f"{n / r['total_s']:,.0f} events/s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB "
              f"({r['peak_rss'] / size:.2f}x the pickle)")
    print(f"speed-up of the work after loading (torch / ours): {results['torch']['work_s'] / results['ours']['work_s']:.2f}x")
    print(f"speed-up (total time, torch / ours): {results['torch']['total_s'] / results['ours']['total_s']:.2f}x "
          f"(target >= 5x); ours peak RSS / pickle size: {results['ours']['peak_rss'] / size:.2f}x (target < 3x)")


if __name__ == "__main__":
    main()
