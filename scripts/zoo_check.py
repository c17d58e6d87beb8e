"""Library-model loops (scripts/zoo.py) on CPU: each audited through the public Audit API and
shadow-run as written (`with memory_audit.shadow():` around the same code, nothing named,
nothing restructured); prints, per loop, the measured peak, the shadow's difference, the phases
whose lines differ, the first divergent event, the audit's unattributed bytes and the seconds the
shadow took. The seed is new each run and printed; --seed replays it. Loops whose library is not
installed are skipped (one line each).

    python scripts/zoo_check.py [--n=20] [--seed=S] [--out=rows.jsonl]
"""

import argparse
import json
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
    t0 = time.time()
    with memory_audit.shadow() as s:
        zoo.train(spec, "cpu", steps=10)
    seconds = time.time() - t0
    r, summary = s.result, s.summary
    differ = [phase for phase, lines in summary["phase_lines"].items()
              if lines != m["phases"][phase]["attribution"]["lines"]]
    unattributed = max(p["attribution"]["unattributed_bytes"] for p in m["phases"].values())
    return {"measured": m["phases"]["step2_end"]["replay"]["peak"]["bytes"], "predicted": r["peak"],
            "differ": differ, "divergence": first_divergence(events, r["events"]), "unattributed": unattributed,
            "seconds": round(seconds, 2), "placeholders": len(summary["placeholders"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 20)
    print(f"seed {seed} (replay: --seed={seed}), torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    done = exact = lines_exact = 0
    out = open(args.out, "a") if args.out else None
    for i, spec in enumerate(zoo.specs(seed, args.n)):
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
            done += 1
            exact += row["predicted"] == row["measured"]
            lines_exact += not row["differ"]
            d = row["divergence"]
            print(f"{i:3d} {zoo.describe(spec)}: measured {row['measured']:,} shadow {row['predicted'] - row['measured']:+,}"
                  f" lines {'equal' if not row['differ'] else 'DIFFER ' + ','.join(row['differ'])}"
                  f" unattributed {row['unattributed']}{'' if d is None else f' first divergence {d}'}"
                  f" ({row['seconds']} s, {row['placeholders']} placeholders)", flush=True)
        if out:
            out.write(json.dumps(dict(row, spec=spec, seed=seed, index=i, torch=torch.__version__)) + "\n")
            out.flush()
    print(f"seed {seed}: {done} loops run; peak exact {exact}/{done}, every line {lines_exact}/{done}")


if __name__ == "__main__":
    main()
