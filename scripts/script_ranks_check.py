"""train.py run as a user's script on one rank of a torchrun job (predict-script --gpu=H100
--world_size=N --rank=R --step=1) against the nanoGPT shadow of the same rank (prediction(),
what `predict --parallel=... --world_size=N --rank=R --gpu=H100` prints), on random configs: the
two roads build the step differently (train.py's own code with its own init_process_group, DDP,
fully_shard and parallelize_module, against shadow/step.py's setup of the same), so where they agree
on step 2's start, peak, end and memory_reserved() neither has a setup error of its own. Over
several ranks neither is measured on a GPU.

    python scripts/script_ranks_check.py [--n=10] [--seed=S]

Prints one line per config and the count that agree; the seed is new each run and printed.
"""

import argparse
import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def draw(rng):
    """A small config and a rank: the strategy, its world size, the shapes, dtype and levers."""
    from memory_audit.prediction.ledger.tensor_parallel import check
    from memory_audit.prediction.predict import DEFAULTS
    while True:
        heads = rng.choice([2, 4, 8])
        cfg = {"n_layer": rng.randint(1, 3), "n_head": heads, "n_embd": heads * rng.choice([8, 16, 32]),
               "block_size": rng.choice([32, 64, 128]), "vocab_size": rng.choice([256, 512, 1000]),
               "batch_size": rng.randint(1, 8), "dtype": rng.choice(["float16", "bfloat16", "float32"]),
               "attention": rng.choice(["manual", "sdpa"]), "dropout": 0.0, "bias": rng.random() < 0.5,
               "gradient_accumulation_steps": rng.choice([1, 2]),
               "parallel": rng.choice(["ddp", "fsdp", "tp", "tp-sp"]), "world_size": rng.choice([1, 2, 4, 8])}
        if cfg["parallel"] == "fsdp":
            cfg["activation_checkpointing"] = rng.choice(["none", "full"])
        cfg["rank"] = rng.randrange(cfg["world_size"])
        try:
            check({**DEFAULTS, **cfg})
        except ValueError:
            continue
        return cfg


def by_script(cfg):
    """train.py's --gradient_accumulation_steps is the job's, each data-parallel rank taking its
    share; predict's is one rank's."""
    dp = cfg["world_size"] if cfg["parallel"] in ("ddp", "fsdp") else 1
    given = dict(cfg, gradient_accumulation_steps=cfg["gradient_accumulation_steps"] * dp)
    args = [f"--{k}={v}" for k, v in given.items() if k not in ("world_size", "rank")]
    p = subprocess.run([sys.executable, "-m", "memory_audit", "predict-script", "--gpu=H100", "--step=1", "--json",
                        f"--world_size={cfg['world_size']}", f"--rank={cfg['rank']}", "train.py", "--",
                        "config/audit_cpu_tiny.py", *args, "--dataset=synthetic", "--device=cuda"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1][:300]}
    text = p.stdout
    return json.loads(text[0 if text.startswith("{\n") else text.rindex("\n{\n") + 1:])["allocator"]


def by_predict(cfg):
    p = subprocess.run([sys.executable, "-m", "memory_audit", "predict", "--json", "--gpu=H100", "--preset=cpu-tiny",
                        *[f"--{k}={v}" for k, v in cfg.items()]], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1][:300]}
    t = json.loads(p.stdout)["totals"]
    return {"steady_state": t["steady_state_allocated"], "peak": t["peak_allocated_bytes"], "end": t["end_allocated"],
            "reserved": t["reserved_peak_bytes"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1_000_000)
    rng, agree = random.Random(seed), 0
    for i in range(a.n):
        cfg = draw(rng)
        s, p = by_script(cfg), by_predict(cfg)
        keys = ("steady_state", "peak", "end", "reserved")
        if "error" in s or "error" in p:
            line = f"error: script {s.get('error', 'ok')} | predict {p.get('error', 'ok')}"
        else:
            diffs = {k: s[k] - p[k] for k in keys if s[k] != p[k]}
            agree += not diffs
            line = "agree" if not diffs else "script minus predict " + ", ".join(f"{k} {v:+,} B" for k, v in diffs.items())
        print(f"{i:3d} {cfg}: {line}", flush=True)
    print(f"seed {seed}: {agree}/{a.n} agree on step 2's start, peak, end and memory_reserved()")


if __name__ == "__main__":
    main()
