"""Library-model loops (scripts/zoo.py) on CPU: each audited through the public Audit API and
shadow-run as written (`with memory_audit.shadow():` around the same code, nothing named,
nothing restructured); prints, per loop, the measured peak, the shadow's difference, the phases
whose lines differ, the first divergent event, the audit's unattributed bytes, the seconds the
shadow took, and torch's MemTracker's peak over a real run of the same step beside it. A routed
model's nonzero sizes are taken from the audited run's own kernel, as a user gives them with
--assume. The seed is new each run and printed; --seed replays it. Loops whose library is not
installed are skipped (one line each).

    python scripts/zoo_check.py [--n=20] [--seed=S] [--out=rows.jsonl] [--libs=timm,tv] [--only=3,17]
"""

import argparse
import contextlib
import json
import statistics
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import torch  # noqa: E402

import zoo  # noqa: E402
import memory_audit  # noqa: E402
from memory_audit import Audit  # noqa: E402
from memory_audit.comparison.reconcile import first_divergence, measure, step_events  # noqa: E402


def check(spec):
    """{measured, predicted, differ: [phases], divergence, unattributed, seconds, placeholders}."""
    with tempfile.TemporaryDirectory() as d:
        model, opt = zoo.build(spec, "cpu")
        with Audit(model, opt, out_dir=os.path.join(d, "r"), step=2) as audit:
            zoo.train(spec, "cpu", audit, model=model, optimizer=opt)
        del model, opt
        m = measure(audit.run_dir)
        events = step_events(audit.run_dir)
    # nonzero's sizes (MoE routing): what the audited run's kernel made, in order, taken as assumed
    # sizes (the user's --assume); each step takes them again from the start
    rows = [e[2] // 8 for e in events if e[0] == "alloc" and e[1] == "aten::nonzero"]  # zoo's masks are 1-D
    t0 = time.time()
    with memory_audit.shadow(assume={"nonzero": rows} if rows else None) as s:
        zoo.train(spec, "cpu", steps=10)
    seconds = time.time() - t0
    r, summary = s.result, s.summary
    tracker = memtracker_peak(spec)
    differ = [phase for phase, lines in summary["phase_lines"].items()
              if lines != m["phases"][phase]["attribution"]["lines"]]
    unattributed = max(p["attribution"]["unattributed_bytes"] for p in m["phases"].values())
    return {"measured": m["phases"]["step2_end"]["replay"]["peak"]["bytes"], "predicted": r["peak"],
            "differ": differ, "divergence": first_divergence(events, r["events"]), "unattributed": unattributed,
            "seconds": round(seconds, 2), "placeholders": len(summary["placeholders"]), "memtracker": tracker,
            "assumed": len(summary["sizes"])}


class _Tracked:
    """Stands where the loop takes an Audit: step 2 under torch's MemTracker, nothing else."""

    def __init__(self, model, optimizer):
        from torch.distributed._tools.mem_tracker import MemTracker
        self.mt = MemTracker()
        self.mt.track_external(model, optimizer)

    def step(self, i):
        return self.mt if i == 2 else contextlib.nullcontext()

    def before_backward(self, loss):
        pass


def memtracker_peak(spec):
    """torch's MemTracker (torch.distributed._tools.mem_tracker) over a real run of step 2 of the
    same loop: its peak, or None where it fails."""
    try:
        model, opt = zoo.build(spec, "cpu")
        tracked = _Tracked(model, opt)
        zoo.train(spec, "cpu", tracked, model=model, optimizer=opt)
        snap = tracked.mt.get_tracker_snapshot("peak")
        return next(iter(snap.values()))["Total"]
    except Exception as e:  # a row still: the loop's own numbers stand, MemTracker's says why it has none
        print(f"    MemTracker failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--libs", default=None, help="run only these libraries' loops of the draw (hf,timm,tv,plain)")
    ap.add_argument("--only", default=None, help="run only these indices of the draw (3,17)")
    args = ap.parse_args()
    libs = set(args.libs.split(",")) if args.libs else None
    only = {int(i) for i in args.only.split(",")} if args.only else None
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 20)
    print(f"seed {seed} (replay: --seed={seed}), torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    done = exact = lines_exact = tracker_exact = 0
    rows = []
    out = open(args.out, "a") if args.out else None
    for i, spec in enumerate(zoo.specs(seed, args.n)):
        if libs is not None and spec["lib"] not in libs or only is not None and i not in only:
            continue
        lib = zoo.missing(spec)
        if lib:
            print(f"{i:3d} skipped ({lib} not installed): {zoo.describe(spec)}", flush=True)
            continue
        try:
            row = check(spec)
        except Exception as e:  # a loop the shadow cannot run is a row too
            row = {"error": f"{type(e).__name__}: {e}"[:400]}
            print(f"{i:3d} {zoo.describe(spec)}: {row['error']}", flush=True)
        else:
            rows.append(row)
            done += 1
            exact += row["predicted"] == row["measured"]
            lines_exact += not row["differ"]
            tracker_exact += row["memtracker"] == row["measured"]
            d = row["divergence"]
            print(f"{i:3d} {zoo.describe(spec)}: measured {row['measured']:,} shadow {row['predicted'] - row['measured']:+,}"
                  f" lines {'equal' if not row['differ'] else 'DIFFER ' + ','.join(row['differ'])}"
                  f" unattributed {row['unattributed']}{'' if d is None else f' first divergence {d}'}"
                  f" MemTracker {_diff(row['memtracker'], row['measured'])}"
                  f" ({row['seconds']} s, {row['placeholders']} placeholders)", flush=True)
        if out:
            out.write(json.dumps(dict(row, spec=spec, seed=seed, index=i, torch=torch.__version__)) + "\n")
            out.flush()
    errors = sorted(100 * (r["memtracker"] - r["measured"]) / r["measured"] for r in rows if r.get("memtracker") is not None)
    median = statistics.median(errors) if errors else float("nan")
    print(f"seed {seed}: {done} loops run; peak exact {exact}/{done}, every line {lines_exact}/{done}; "
          f"MemTracker's peak exact {tracker_exact}/{done}, its median error {median:+.1f}%")


def _diff(value, measured):
    return "failed" if value is None else f"{value - measured:+,} B"


if __name__ == "__main__":
    main()
