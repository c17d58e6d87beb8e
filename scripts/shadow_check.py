"""Random single-process CPU configs: the measured peak beside the shadow run's and the predictor's.

    python scripts/shadow_check.py [--n=10] [--seed=S] [--dtype=float32] [--attention=sdpa] [--out=FILE.jsonl] [--device=cuda --keep=DIR]
    python scripts/shadow_check.py --rows snapshots/results/cpu-mini-ac.jsonl ...

Draws --n configs over cpu-tiny-sized shapes (a new seed each run unless --seed replays one;
the seed is printed first), audits each with `train.py --audit` on CPU, shadow-runs it
(memory_audit/prediction/shadow/step.py) and prints, per config, the measured peak, the shadow's and the
one the audit's own report.json predicts (prediction(), stored in its meta.json), the lines the ledger names that differ from the audit's (every
phase), the lines the shadow itself names that differ (shadow.lines), and for a shadow miss the first event where the two traces part (measured trace of step 2
against the shadow's events, by action and bytes). Not a test: each config takes ~10 s.
"""

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def check(cfg, tmp, device="cpu", keep=None, compare=None):
    """Audit cfg with train.py on cpu-tiny and compare the run (compare(run, cfg); default the
    shadow run beside it)."""
    args = [f"--{k}={v}" for k, v in cfg.items()]
    shutil.rmtree(os.path.join(tmp, "r"), ignore_errors=True)  # what a failed config left
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--audit", f"--device={device}", "--preset=cpu-tiny",
                        f"--audit_dir={tmp}", "--run_name=r", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    if p.returncode:
        return {"config": cfg, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    run = os.path.join(tmp, "r")
    if keep:  # the audited step with its whole trace: what CUDA rules for the shadow are read from
        name = "-".join(f"{k}{v}" for k, v in cfg.items()).replace(".", "p")
        tag = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:8]  # names cut short can collide
        dest = os.path.join(keep, f"{name[:120]}-{tag}")
        shutil.copytree(run, dest, ignore=shutil.ignore_patterns("step2_start*", "step2_before*"))
    row = (compare or shadow_compare)(run, cfg)
    shutil.rmtree(run, ignore_errors=True)
    return row


def shadow_compare(run, cfg=None):
    """One audited run (its report.json, meta.json and step2_end snapshot with the whole trace)
    against the shadow run of its config: peaks, steady state, lines, the first divergent event."""
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.prediction.predict import resolved
    from memory_audit.reading.loader import load_meta
    from memory_audit.comparison.reconcile import device_from_meta, first_divergence, mismatched, shadow_lines_off, step_events
    with open(os.path.join(run, "report.json")) as f:
        report = json.load(f)
    peak = report["totals"]["peak"]
    cfg = cfg if cfg is not None else report["config"]
    full = resolved(report["config"])
    try:  # on CUDA through the allocator's model, with the device's facts (SDPA kernel, workspaces)
        sh = shadow.replayed(full, device_from_meta(load_meta(run)), names=True)
    except Exception as e:  # noqa: BLE001 -- a row that says why, and the next config still runs
        return {"config": cfg, "measured": peak["actual"], "shadow": None, "shadow_error": f"{type(e).__name__}: {e}",
                "predictor": peak["predicted"]}
    row = {"config": cfg, "measured": peak["actual"], "shadow": sh["peak"], "predictor": peak["predicted"],
           "predictor_from": report.get("predicted_from"),  # what train.py --audit's report read
           "cpu": load_meta(run)["device"].get("cpu"),  # which CPU measured it (None on CUDA)
           "steady_state_exact": sh["steady_state"] == report["totals"]["steady_state"]["actual"],
           # memory_reserved() (CUDA: the allocator model's; None on CPU and in reports without it)
           "reserved_exact": None if sh.get("reserved") is None or "reserved" not in report["totals"]
           else sh["reserved"] == report["totals"]["reserved"]["actual"],
           # the ledger's lines (what predict names) against the audit's, every phase
           "lines": len(report["rows"]),
           "lines_off": [f"{r['phase']}:{r['key']} {r['predicted']} vs {r['actual']}" for r in mismatched(report["rows"], skip=())],
           # the shadow's own lines (shadow.lines: the audit's names for what it made) against the audit's
           "shadow_lines_off": shadow_lines_off(report["rows"], sh["result"])}
    divergence = first_divergence(step_events(run), sh["result"]["events"])
    row["events_agree"] = divergence is None  # every allocation and free of step 2, in order
    if divergence is not None:
        row["first_divergence"] = divergence
    return row


def checked(n, seed, draw, out=None, device="cpu", keep=None, compare=None):
    """Yield (i, row) for n configs drawn by draw(random.Random(seed)), each audited and compared
    (check()); each row appended to `out` (JSON lines, with the seed) as it comes, so a run
    stopped at a time limit keeps what it measured. A timeout or a broken snapshot is a row with
    "error"; the next config still runs."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            cfg = draw(rng)
            try:
                row = check(cfg, tmp, device, keep, compare)
            except Exception as e:  # noqa: BLE001 -- say so, go on
                row = {"config": cfg, "error": f"{type(e).__name__}: {e}"}
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(dict(row, seed=seed)) + "\n")
            yield i, row


def kept_runs(dirs):
    """Audits kept earlier (--keep; snapshots/examples/shadow-cuda): each against the shadow run
    of this checkout, without auditing again (a CUDA run's rules checked on a machine without one)."""
    rows = []
    for run in dirs:
        row = shadow_compare(run)
        rows.append(row)
        c = row["config"]
        label = f"{c.get('dtype')} {c.get('attention')} {c.get('activation_checkpointing')} {c.get('optimizer_impl')} " \
                f"bias={c.get('bias')} dropout={c.get('dropout')}"
        d = "-" if row["shadow"] is None else f"{row['shadow'] - row['measured']:+,}"
        print(f"{os.path.basename(run.rstrip('/'))[:60]}  {label}  shadow {d}"
              + ("" if row.get("steady_state_exact", True) else "  STEADY STATE OFF")
              + ("  RESERVED OFF" if row.get("reserved_exact") is False else "")
              + (f"  {row['shadow_error']}" if "shadow_error" in row else "")
              + (f"  first divergence {row['first_divergence']}" if "first_divergence" in row else ""), flush=True)
    ok = [r for r in rows if r["shadow"] is not None]
    reserved = [r["reserved_exact"] for r in ok if r.get("reserved_exact") is not None]
    print(f"kept runs: shadow peak exact {sum(r['shadow'] == r['measured'] for r in ok)}/{len(rows)}, steady state "
          f"{sum(r['steady_state_exact'] for r in ok)}/{len(rows)}, step 2 event by event "
          f"{sum(r['events_agree'] for r in ok)}/{len(rows)}"
          + (f", reserved {sum(reserved)}/{len(reserved)}" if reserved else ""))
    return rows


def committed_rows(paths):
    """The CPU rows of committed results files (single-process, and torchrun ranks): measured beside the shadow's steady state, peak and every line it names itself."""
    from memory_audit.comparison.reconcile import shadow_lines_off
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.prediction.predict import resolved
    from memory_audit.prediction.shadow.probe import plain_bf16
    exact = total = lines_exact = 0
    for path in paths:
        for line in open(path):
            row = json.loads(line)
            rc = row.get("resolved_config") or {}
            if row["status"] != "ok" or rc.get("device", "cpu") != "cpu" or rc.get("compile"):
                continue
            full = resolved(rc)
            with plain_bf16():  # the committed grid rows were measured without oneDNN's bf16 matmuls
                result = shadow.run(full, names=True)
            t = row["totals"]
            ok = (result["start_bytes"], result["peak"]) == (t["steady_state"]["actual"], t["peak"]["actual"])
            off = shadow_lines_off(row["measured_lines"], result)
            exact, total, lines_exact = exact + ok, total + 1, lines_exact + (not off)
            print(f"{os.path.basename(path)}: measured {t['peak']['actual']:,}  shadow {result['peak'] - t['peak']['actual']:+,}"
                  f"  lines off {len(off)} {off[:3]}  {row['config']}", flush=True)
    print(f"committed rows: shadow steady state and peak exact in {exact}/{total}, every line it names "
          f"itself in {lines_exact}/{total}")


def main():
    from memory_audit.comparison.sweep import random_config
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cpu", help="cuda: audit only (and --keep the runs), no shadow yet")
    p.add_argument("--keep", default=None, help="copy each run's step2_end snapshot, meta and report here")
    p.add_argument("--dtype", default=None, help="run every drawn config at this dtype (float32 on a CPU whose "
                   "bf16 matmuls go through oneDNN: docs/limits.md)")
    p.add_argument("--attention", default=None, help="run every drawn config with this attention (manual, sdpa)")
    p.add_argument("--configs", default=None, help="instead of drawing: the configs of these JSON lines' "
                   "\"config\" (rows of an earlier run, e.g. its errors), in order")
    p.add_argument("--rows", nargs="+", default=None, help="instead: re-predict committed results rows "
                   "(snapshots/results/*.jsonl, single-process CPU ones) with the shadow run")
    p.add_argument("--runs", nargs="+", default=None, help="instead: kept audits (run dirs, e.g. "
                   "snapshots/examples/shadow-cuda/*) against the shadow run, without auditing again")
    args = p.parse_args()
    if args.rows:
        return committed_rows(args.rows)
    if args.runs:
        return kept_runs(args.runs)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10 ** 6)
    print(f"seed {seed} (replay: --seed={seed})", flush=True)
    overrides = {k: v for k, v in (("dtype", args.dtype), ("attention", args.attention)) if v}
    rows = []
    draw = lambda rng: dict(random_config(rng), **overrides)  # noqa: E731
    if args.configs:
        with open(args.configs) as f:
            given = [json.loads(line)["config"] for line in f if line.strip()]
        args.n, draw = len(given), lambda rng, left=iter(given): next(left)  # noqa: E731
    for i, row in checked(args.n, seed, draw, args.out, args.device, args.keep):
        rows.append(row)
        if "error" in row:
            print(f"{i}: error {row['error']}", flush=True)
            continue
        d = lambda v: "-" if v is None else f"{v - row['measured']:+,}"  # noqa: E731
        print(f"{i}: measured {row['measured']:,}  shadow {d(row['shadow'])}  report {d(row['predictor'])}"
              + ("" if row.get("steady_state_exact", True) else "  STEADY STATE OFF")
              + ("  RESERVED OFF" if row.get("reserved_exact") is False else "")
              + (f"  lines off {row['lines_off'][:4]}" if row.get("lines_off") else "")
              + (f"  shadow's lines off {row['shadow_lines_off'][:4]}" if row.get("shadow_lines_off") else "")
              + (f"  first divergence {row['first_divergence']}" if "first_divergence" in row else ""), flush=True)
    ok = [r for r in rows if "error" not in r]
    print(f"peak exact: shadow {sum(r['shadow'] == r['measured'] for r in ok if r['shadow'] is not None)}/{len(ok)}, "
          f"train.py --audit's report {sum(r['predictor'] == r['measured'] for r in ok)}/{len(ok)}; step 2 event by event: shadow "
          f"{sum(r.get('events_agree', False) for r in ok)}/{len(ok)}; every line exact: "
          f"{sum(not r.get('lines_off', [None]) for r in ok)}/{len(ok)}, the shadow's own lines "
          f"{sum(not r.get('shadow_lines_off', [None]) for r in ok)}/{len(ok)} (seed {seed})")


if __name__ == "__main__":
    main()
