"""Library-model loops (scripts/zoo.py) audited on a GPU, predicted on this machine without one:
each committed CUDA row of `snapshots/results/zoo/` is shadow-run as written with
`memory_audit.shadow(device="cuda", gpu=...)` around the same loop code (nothing named, nothing
restructured), and its predicted step 2 set beside the measured one: memory_allocated() at the
step's start, before backward and at its end, the peak (max_memory_allocated()), reserved memory,
and, where the run's trace is committed (--traces, a .tgz of run directories), the first event
where the two step-2 sequences part. Reserved memory is compared only where the trace shows that
every segment was made by the loop itself (zoo_audit runs its loops in one process, and a segment
an earlier loop left is in the next one's reserved memory). Loops whose library is not installed here are skipped (one
line each); a loop the shadow cannot run is a row with its one-line reason.

    python scripts/zoo_cuda_check.py snapshots/results/zoo/h100-zoo-691115.jsonl [--traces=runs.tgz] [--only=3,7]
"""

import argparse
import json
import os
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import torch  # noqa: E402

import zoo  # noqa: E402
import memory_audit  # noqa: E402
from memory_audit.comparison.reconcile import first_divergence, step_events  # noqa: E402

PHASES = ("step2_start", "step2_before_backward", "step2_end")
GPUS = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H200": "H200"}


def predicted(spec, gpu):
    """The loop's shadow run for one `gpu`: (its summary, the step's events, seconds)."""
    t0 = time.time()
    with memory_audit.shadow(device="cuda", gpu=gpu) as s:
        zoo.train(spec, "cuda", steps=10)
    return s.summary, s.result["events"], round(time.time() - t0, 2)


def compare(row, run_dir=None):
    """{"differ": [what differs, in words], "seconds", "unmeasured", "divergence"} of one row."""
    gpu = GPUS.get(row["gpu"], "H100")
    summary, events, seconds = predicted(row["spec"], gpu)
    alloc = summary["allocator"]
    ours = {"step2_start": alloc["steady_state"], "step2_before_backward": alloc["before_backward"],
            "step2_end": alloc["end"]}
    differ = [f"{p} {ours[p] - row['phases'][p]['memory_allocated']:+,}" for p in PHASES
              if ours[p] != row["phases"][p]["memory_allocated"]]
    if alloc["peak"] != row["peak"]["bytes"]:
        differ.append(f"peak {alloc['peak'] - row['peak']['bytes']:+,}")
    reserved = row["phases"]["step2_end"]["reserved_bytes"]
    inherited = None if run_dir is None else inherited_segments(run_dir)
    if alloc["reserved"] != reserved:
        differ.append(f"reserved {alloc['reserved'] - reserved:+,}"
                      + ("" if not inherited else f" (the process held {inherited} segment(s) from earlier loops)"))
    out = {"differ": differ, "seconds": seconds, "unmeasured": summary["unmeasured"], "peak": row["peak"]["bytes"],
           "inherited": inherited}
    if run_dir is not None:
        out["divergence"] = first_divergence(step_events(run_dir), events)
    return out


def inherited_segments(run_dir):
    """How many segments of the run's step-2 snapshot no segment_alloc of its trace made: memory the
    process reserved for an earlier loop (zoo_audit runs its loops in one process), which a
    prediction of this loop alone does not hold; reserved memory is compared only where it is 0."""
    from memory_audit.reading.loader import find_snapshots, load_snapshot
    from memory_audit.reading.trace import A
    snap = load_snapshot(dict(find_snapshots(run_dir)[0])["step2_end"])
    t = snap["device_traces"][0]
    made = {int(t.addr[i]) for i in range(t.n) if int(t.act[i]) == A["segment_alloc"]}
    return sum(seg["address"] not in made for seg in snap["segments"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("--traces", default=None, help="a .tgz of the rows' run directories (zoo-SEED-INDEX/)")
    ap.add_argument("--only", default=None, help="row indexes, comma-separated")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.rows)]
    only = None if args.only is None else {int(i) for i in args.only.split(",")}
    tmp = tempfile.TemporaryDirectory()
    runs = {}
    if args.traces:
        with tarfile.open(args.traces) as tar:
            tar.extractall(tmp.name, filter="data")
        for root, dirs, _ in os.walk(tmp.name):
            for d in dirs:
                if d.startswith("zoo-"):
                    runs[int(d.rsplit("-", 1)[1])] = os.path.join(root, d)
    import transformers
    print(f"{args.rows}: {len(rows)} rows; here torch {torch.__version__}, transformers {transformers.__version__} "
          f"(the GPU runs: torch {rows[0].get('torch')}, transformers 5.17.0)", flush=True)
    done = exact = peaks = reserved = clean = 0
    for row in rows:
        i = row["index"]
        if only is not None and i not in only:
            continue
        if row.get("error"):
            print(f"{i:3d} not measured ({row['error'][:80]}): {row['describe']}", flush=True)
            continue
        lib = zoo.missing(row["spec"])
        if lib:
            print(f"{i:3d} skipped ({lib} not installed): {row['describe']}", flush=True)
            continue
        try:
            r = compare(row, runs.get(i))
        except Exception as e:  # a loop the shadow cannot run is a row too
            print(f"{i:3d} {row['describe']}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            done += 1
            continue
        done += 1
        peaks += not any(d.startswith("peak") for d in r["differ"])
        if r["inherited"] == 0:  # reserved memory comparable: every segment made by this loop
            clean += 1
            reserved += not any(d.startswith("reserved") for d in r["differ"])
            exact += not r["differ"]
        d = r.get("divergence")
        print(f"{i:3d} {row['describe']}: peak {r['peak']:,} {'exact' if not r['differ'] else ' '.join(r['differ'])}"
              f"{'' if d is None else f' first divergence {d}'}"
              f"{' unmeasured: ' + '; '.join(r['unmeasured']) if r['unmeasured'] else ''} ({r['seconds']} s)", flush=True)
    print(f"{args.rows}: {done} loops run; peak exact {peaks}/{done}; of the {clean} whose trace shows every segment "
          f"made by the loop itself: reserved exact {reserved}/{clean}, every phase total, peak and reserved {exact}/{clean}")


if __name__ == "__main__":
    main()
