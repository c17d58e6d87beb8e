"""Random compiled (torch.compile) single-process CPU configs: the measured peak beside what
train.py --audit's own report predicted and what `predict` prints for the same config.

    python scripts/compile_check.py [--n=20] [--seed=S] [--dtype=bfloat16] [--out=FILE.jsonl]
    python scripts/compile_check.py --device=cuda --keep=DIR ...   # on a GPU: the step's traces kept

Draws --n configs with sweep.random_compiled_config (the eager random space without
checkpointing, fp32 or bf16, an activation memory budget from 0 to 1; a new seed each run unless
--seed replays one; the seed is printed first), audits each with `train.py --audit --compile=True`
on CPU (or --device=cuda, each audited step kept with its whole trace under --keep), and prints per config the measured peak, report.json's prediction, prediction()'s
(what `predict --compile=True` prints; inductor's plan made again in this process) and the
report's lines that differ. Not a test: each config compiles twice (~1 min on 2 cores).
"""

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def compare(run, cfg):
    """One audited compiled run: its report's peak and lines beside prediction()'s peak."""
    from memory_audit.comparison.reconcile import device_from_meta, mismatched
    from memory_audit.prediction.predict import prediction
    from memory_audit.comparison.sweep import measured_lines
    from memory_audit.reading.loader import load_meta
    with open(os.path.join(run, "report.json")) as f:
        report = json.load(f)
    peak, dev = report["totals"]["peak"], load_meta(run)["device"]
    row = {"config": cfg, "measured": peak["actual"], "predictor": peak["predicted"],
           "predictor_from": report.get("predicted_from"), "cpu": dev.get("cpu"), "gpu": dev.get("name"),
           "torch": report.get("torch_version"), "resolved_config": report["config"], "status": "ok",
           "device": dev.get("type", "cpu"),
           "unattributed_bytes": report["unattributed_bytes"],
           # what re-predicts the row without compiling again: the measured totals and lines, inductor's plan
           "totals": {k: {"actual": v["actual"]} for k, v in report["totals"].items()},
           "measured_lines": measured_lines(report), "inductor_plan": report["compiled"]["plan"],
           "lines": len(report["rows"]),
           "lines_off": [f"{r['phase']}:{r['key']} {r['predicted']} vs {r['actual']}" for r in mismatched(report["rows"], skip=())]}
    try:
        row["predict"] = prediction(report["config"], device_from_meta(load_meta(run)))["totals"]["peak_allocated_bytes"]
    except Exception as e:  # noqa: BLE001 -- a row that says why; the next config still runs
        row["predict"], row["predict_error"] = None, f"{type(e).__name__}: {e}"
    return row


def main():
    from memory_audit.comparison.sweep import random_compiled_config
    from shadow_check import checked
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None, help="run every drawn config at this dtype")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--keep", default=None, help="copy each run's step2_end snapshot, meta and report here")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10 ** 6)
    print(f"seed {seed} (replay: --seed={seed})", flush=True)
    overrides = {"dtype": args.dtype} if args.dtype else {}
    rows = []
    for i, row in checked(args.n, seed, lambda rng: dict(random_compiled_config(rng), **overrides), args.out,
                          device=args.device, keep=args.keep, compare=compare):
        rows.append(row)
        if "error" in row:
            print(f"{i}: error {row['error']}", flush=True)
            continue
        cfg = row["config"]
        d = lambda v: "-" if v is None else f"{v - row['measured']:+,}"  # noqa: E731
        print(f"{i}: {cfg['dtype']} budget {cfg['activation_memory_budget']}  measured {row['measured']:,}  "
              f"report {d(row['predictor'])}  predict {d(row['predict'])}"
              + (f"  {row['predict_error']}" if "predict_error" in row else "")
              + (f"  lines off {row['lines_off'][:4]}" if row["lines_off"] else ""), flush=True)
    ok = [r for r in rows if "error" not in r]
    print(f"peak exact: train.py --audit's report {sum(r['predictor'] == r['measured'] for r in ok)}/{len(ok)}, "
          f"predict {sum(r['predict'] == r['measured'] for r in ok)}/{len(ok)}; every line exact: "
          f"{sum(not r['lines_off'] for r in ok)}/{len(ok)}; errors {len(rows) - len(ok)} (seed {seed})")


if __name__ == "__main__":
    main()
