"""Random single-process CPU configs: the measured peak beside the shadow run's and the predictor's.

    python scripts/shadow_check.py [--n=10] [--seed=S] [--jobs=1] [--out=FILE.jsonl]

Draws --n configs over cpu-tiny-sized shapes (a new seed each run unless --seed replays one;
the seed is printed first), audits each with `train.py --audit` on CPU, shadow-runs it
(memory_audit/shadow.py) and prints, per config, the measured peak, the shadow's and the
ledger predictor's (report.json), and for a shadow miss the first event where the two traces
part (measured trace of step 2 against the shadow's events, by action and bytes). Not a test:
each config takes ~10 s.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def draw(rng):
    """One config over the space issue "Predict the step as one trace" names."""
    n_head = rng.randint(1, 4)
    cfg = dict(n_layer=rng.randint(1, 4), n_head=n_head, n_embd=n_head * rng.choice((16, 32)),
               vocab_size=rng.choice((97, 512, 1000, 3001)), batch_size=rng.randint(1, 3),
               block_size=rng.choice((16, 32, 64, 128, 256)), dtype=rng.choice(("float32", "bfloat16")),
               attention=rng.choice(("manual", "sdpa")), activation=rng.choice(("gelu", "relu")),
               dropout=rng.choice((0.0, 0.0, 0.1)), bias=rng.choice((False, True)),
               activation_checkpointing=rng.choice(("none", "none", "full", "selective", "sac")),
               ac_every=rng.choice((1, 1, 2)), gradient_accumulation_steps=rng.choice((1, 1, 2)),
               set_to_none=rng.choice((True, False)), keep_logits=rng.choice((True, False)),
               optimizer_impl=rng.choice(("fused", "foreach", "for")))
    return cfg


def measured_events(run_dir):
    """[(action, op, bytes)] of step 2 as the audit recorded it (allocs and frees)."""
    from memory_audit.loader import load_meta, load_snapshot
    from memory_audit.trace import A
    meta = load_meta(run_dir)
    t = load_snapshot(os.path.join(run_dir, "step2_end.pickle"))["device_traces"][0]
    out = []
    for i in range(meta["phases"]["step2_start"]["trace_entries"], t.n):
        a = int(t.act[i])
        if a in (A["alloc"], A["free_requested"], A["free"]):
            fr = t.frames(i)
            out.append(("alloc" if a == A["alloc"] else "free", fr[0].get("name") if fr else "?", int(t.size[i])))
    return out


def first_divergence(measured, shadow):
    """(position, measured event, shadow event) where the two sequences first differ, or None."""
    for k in range(max(len(measured), len(shadow))):
        m = measured[k] if k < len(measured) else None
        s = shadow[k] if k < len(shadow) else None
        if m is None or s is None or (m[0], m[2]) != (s[0], s[2]):
            return k, m, s
    return None


def check(cfg, tmp):
    from memory_audit import shadow
    from memory_audit.predict import DEFAULTS
    args = [f"--{k}={v}" for k, v in cfg.items()]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--audit", "--device=cpu", "--preset=cpu-tiny",
                        f"--audit_dir={tmp}", "--run_name=r", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    if p.returncode:
        return {"config": cfg, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    run = os.path.join(tmp, "r")
    with open(os.path.join(run, "report.json")) as f:
        report = json.load(f)
    peak = report["totals"]["peak"]
    full = dict(DEFAULTS, **{k: v for k, v in report["config"].items() if k in DEFAULTS})
    sh = shadow.run(full)
    row = {"config": cfg, "measured": peak["actual"], "shadow": sh["peak"], "predictor": peak["predicted"]}
    if sh["peak"] != peak["actual"]:
        div = first_divergence(measured_events(run), sh["events"])
        row["first_divergence"] = div
    import shutil
    shutil.rmtree(run, ignore_errors=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10 ** 6)
    print(f"seed {seed} (replay: --seed={seed})", flush=True)
    rng = random.Random(seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.n):
            row = check(draw(rng), tmp)
            rows.append(row)
            if "error" in row:
                print(f"{i}: error {row['error']}", flush=True)
                continue
            d = lambda v: f"{v - row['measured']:+,}"  # noqa: E731
            print(f"{i}: measured {row['measured']:,}  shadow {d(row['shadow'])}  predictor {d(row['predictor'])}"
                  + (f"  first divergence {row['first_divergence']}" if "first_divergence" in row else ""), flush=True)
    ok = [r for r in rows if "error" not in r]
    print(f"peak exact: shadow {sum(r['shadow'] == r['measured'] for r in ok)}/{len(ok)}, "
          f"predictor {sum(r['predictor'] == r['measured'] for r in ok)}/{len(ok)} (seed {seed})")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, seed=seed)) + "\n")


if __name__ == "__main__":
    main()
