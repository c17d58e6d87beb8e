"""Library-model loops (scripts/zoo.py) audited on a GPU, predicted on this machine without one:
each committed CUDA row of `snapshots/results/zoo/` is shadow-run as written with
`memory_audit.shadow(device="cuda", gpu=...)` around the same loop code (nothing named, nothing
restructured), and its predicted step 2 set beside the measured one: memory_allocated() at the
step's start, before backward and at its end, the peak (max_memory_allocated()), reserved memory,
and, where the run's trace is committed (--traces, a .tgz of run directories), the first event
where the two step-2 sequences part. Reserved memory is printed, not checked: zoo_audit runs its
loops one after another in one process, so a loop's reserved memory holds what earlier loops left
(the trace starts after the model is on the GPU and cannot tell those segments apart), and the
rows of seed 691115 also hold cuBLASLt workspaces earlier loops made (1-2 MiB more at every phase
in loops that run no addmm). Loops whose library is not installed here are skipped (one
line each); a loop the shadow cannot run is a row with its one-line reason.

    python scripts/zoo_cuda_check.py snapshots/results/zoo/h100-zoo-408334.jsonl [--traces=runs.tgz] [--only=3,7]
    python scripts/zoo_cuda_check.py snapshots/results/zoo/h100-zoo-691115.jsonl --inherited-workspaces
"""

import argparse
import gzip
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


def compare(row, run_dir=None, inherited_workspaces=False):
    """{"differ": [what differs, in words], "seconds", "unmeasured", "divergence"} of one row.
    inherited_workspaces: the row's process kept cuBLAS/cuBLASLt workspaces earlier loops made
    (seed 691115's stream did not clear them between loops): its unattributed bytes at step 2's
    start are every workspace, and what exceeds this loop's own predicted workspaces is counted
    as the process's, added to each predicted number (the offset is printed)."""
    gpu = GPUS.get(row["gpu"], "H100")
    summary, events, seconds = predicted(row["spec"], gpu)
    alloc = summary["allocator"]
    offset = 0
    if inherited_workspaces:
        own = sum(v for k, v in summary["lines"].items() if k.startswith("workspace/"))
        offset = row["phases"]["step2_start"]["lines"].get("unattributed", 0) - own
    ours = {"step2_start": alloc["steady_state"] + offset, "step2_before_backward": alloc["before_backward"] + offset,
            "step2_end": alloc["end"] + offset}
    differ = [f"{p} {ours[p] - row['phases'][p]['memory_allocated']:+,}" for p in PHASES
              if ours[p] != row["phases"][p]["memory_allocated"]]
    if alloc["peak"] + offset != row["peak"]["bytes"]:
        differ.append(f"peak {alloc['peak'] + offset - row['peak']['bytes']:+,}")
    if offset:
        differ.append(f"(workspaces of earlier loops {offset:+,} counted)")
    reserved = row["phases"]["step2_end"]["reserved_bytes"]
    out = {"differ": differ, "seconds": seconds, "unmeasured": summary["unmeasured"], "peak": row["peak"]["bytes"],
           "reserved": alloc["reserved"] - reserved}
    if run_dir is not None:
        out["divergence"] = first_divergence(step_events(run_dir), events)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("--traces", default=None, help="a .tgz of the rows' run directories (zoo-SEED-INDEX/)")
    ap.add_argument("--only", default=None, help="row indexes, comma-separated")
    ap.add_argument("--inherited-workspaces", action="store_true",
                    help="the rows' process kept earlier loops' cuBLAS workspaces (compare's docstring)")
    args = ap.parse_args()
    with (gzip.open if args.rows.endswith(".gz") else open)(args.rows, "rt") as f:
        rows = [json.loads(line) for line in f]
    only = None if args.only is None else {int(i) for i in args.only.split(",")}
    tmp = tempfile.TemporaryDirectory()
    runs = {}
    if args.traces:
        with tarfile.open(args.traces) as tar:
            tar.extractall(tmp.name, filter="data")
        for root, dirs, _ in os.walk(tmp.name):
            for d in dirs:
                if d.startswith("zoo-"):  # zoo-SEED-INDEX
                    _, seed, index = d.rsplit("-", 2)
                    runs[int(seed), int(index)] = os.path.join(root, d)
    import transformers
    print(f"{args.rows}: {len(rows)} rows; here torch {torch.__version__}, transformers {transformers.__version__} "
          f"(the GPU runs: torch {rows[0].get('torch')}, transformers 5.17.0)", flush=True)
    done = exact = peaks = reserved = 0
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
            r = compare(row, runs.get((row["seed"], i)), args.inherited_workspaces)
        except Exception as e:  # a loop the shadow cannot run is a row too
            print(f"{i:3d} {row['describe']}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            done += 1
            continue
        done += 1
        peaks += not any(d.startswith("peak") for d in r["differ"])
        exact += not [d for d in r["differ"] if not d.startswith("(")]
        reserved += r["reserved"] == 0
        d = r.get("divergence")
        print(f"{i:3d} {row['describe']}: peak {r['peak']:,} {' '.join(r['differ']) if [d for d in r['differ'] if not d.startswith('(')] else ' '.join(['exact'] + r['differ'])}"
              f" (reserved {r['reserved']:+,})"
              f"{'' if d is None else f' first divergence {d}'}"
              f"{' unmeasured: ' + '; '.join(r['unmeasured']) if r['unmeasured'] else ''} ({r['seconds']} s)", flush=True)
    print(f"{args.rows}: {done} loops run; peak exact {peaks}/{done}, the three phases' totals and the peak exact "
          f"{exact}/{done}; reserved equal in {reserved}/{done} (not a check: see the docstring)")


if __name__ == "__main__":
    main()
