"""Random configurations at 2 ranks (torchrun, gloo, CPU), audited and reconciled per rank.

    python scripts/random_torchrun.py [--n=8] [--seed=S] [--parallel=fsdp,ddp] [--out=FILE.jsonl]

Draws --n configs with sweep.random_config (a new seed each run unless --seed replays one; the
seed is printed first), runs each under `torchrun --nproc_per_node=2` through the sweep (one
row per rank) and prints, per rank, the mismatched lines and the peak's difference (measured
minus predicted: the shadow run of that rank, as predict takes it on CPU) and the lines the shadow
names itself that differ. Exit 1 when any rank is not exact (every line, the shadow's own too, 0
unattributed, the peak).
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

from memory_audit.comparison.sweep import random_config, repredict_lines  # noqa: E402


def draw(rng, strategies):
    """A config the strategy can run: tensor parallelism's draws are redrawn until they pass its
    rule (tensor_parallel.check: heads split over the ranks, no dropout, tp-sp's set_to_none)."""
    from memory_audit.prediction.ledger.tensor_parallel import check
    parallel = rng.choice(strategies)
    while True:
        cfg = dict(preset="cpu-tiny", device="cpu", nproc=2, parallel=parallel, **random_config(rng))
        cfg["gradient_accumulation_steps"] = 2 * rng.choice((1, 1, 2))  # a multiple of the world size
        try:
            check(dict(cfg, world_size=2))
            return cfg
        except ValueError:
            continue


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--parallel", default="fsdp,ddp")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(10 ** 6)
    print(f"seed {seed} (replay: --seed={seed})", flush=True)
    rng = random.Random(seed)
    configs = [draw(rng, a.parallel.split(",")) for _ in range(a.n)]
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "configs.json"), a.out or os.path.join(tmp, "rows.jsonl")
        json.dump(configs, open(path, "w"))
        subprocess.run([sys.executable, "-m", "memory_audit", "sweep", f"--configs={path}", f"--out={out}",
                        f"--audit-dir={tmp}/runs"], cwd=ROOT, check=False, capture_output=True, text=True)
        rows = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    exact = n = 0
    for r in rows:
        c = {k: v for k, v in r["config"].items() if k not in ("preset", "device", "nproc")}
        if r["status"] != "ok":
            print(f"{r['status']}: {json.dumps(c)}: {r.get('error', '')}")
            continue
        n += 1
        off = [f"{x['phase']}:{x['key']} {x['predicted']} vs {x['actual']}" for x in repredict_lines(r)]
        peak = r["totals"]["peak"]["actual"] - predicted_peak(r)  # measured minus predicted
        own = shadow_lines(r)
        ok = not off and not own and peak == 0 and r["unattributed_bytes"] == 0
        exact += ok
        print(f"{'exact' if ok else 'MISS '} {json.dumps(c)} peak {peak:+,} B ({r['peak_from']}) lines off {off[:4]}"
              f" the shadow's own lines off {own[:4]}", flush=True)
    print(f"{exact} of {n} rank rows exact (seed {seed})")
    return 0 if n and exact == n else 1


def shadow_lines(row):
    """The lines the shadow run of this rank names itself (shadow.lines) that differ from the
    measured ones, every phase."""
    from memory_audit.comparison.reconcile import shadow_lines_off
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.prediction.predict import resolved
    cfg = resolved(row["resolved_config"])
    return shadow_lines_off(row["measured_lines"], shadow.run(cfg, names=True))


def predicted_peak(row):
    """The peak `predict` gives this rank (prediction() on CPU: the shadow run of the rank), noting
    where it came from in row["peak_from"]."""
    from memory_audit.prediction.predict import DEFAULTS, device_facts, prediction
    cfg = {k: v for k, v in row["resolved_config"].items() if k in DEFAULTS}
    t = prediction(cfg, device_facts("cpu"))["totals"]
    row["peak_from"] = "shadow" if t["from"].startswith("shadow") else t["from"]
    return t["peak_allocated_bytes"]


if __name__ == "__main__":
    sys.exit(main())
