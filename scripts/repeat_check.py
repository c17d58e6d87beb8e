"""Check shadow/repeat on random configs: the CUDA shadow of n blocks (and k micro-steps) built
from runs of 3 and 4 against the shadow run of all of them, event by event (action, key, bytes,
which allocation) and phase by phase.

    python scripts/repeat_check.py [--seed=N] [--configs=40] [--gpu=H100]

Configs: comparison/sweep.random_config's space (every knob), fp16/bf16/fp32, 8 to 20 blocks
(or 2-4), 8 to 12 micro-steps in about a third.
A new seed each run, printed; --seed replays it. Prints one line per config and a summary;
exits 1 on any config where the repeat returns a different step (None, its refusal, is
counted apart: the caller then runs every block).
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memory_audit.comparison.sweep import random_config  # noqa: E402
from memory_audit.prediction.shadow import step as shadow, repeat as shadow_repeat  # noqa: E402
from memory_audit.prediction.predict import DEFAULTS, device_facts, gpu_name  # noqa: E402


def first_difference(a, b):
    """None if two run() results are the same process, else a line naming the first difference."""
    x, y = a["history"] + a["events"], b["history"] + b["events"]
    ids = {}
    for i, (e, f) in enumerate(zip(x, y)):
        if e[:3] != f[:3] or ids.setdefault(e[3], f[3]) != f[3]:
            return f"event {i}: {e[:3]} vs {f[:3]}"
    if len(x) != len(y):
        return f"{len(x)} events vs {len(y)}"
    if a["phases"] != b["phases"] or a["start_bytes"] != b["start_bytes"] or a["peak"] != b["peak"]:
        return f"phases/start/peak {a['phases']} {a['start_bytes']} {a['peak']} vs {b['phases']} {b['start_bytes']} {b['peak']}"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--configs", type=int, default=40)
    ap.add_argument("--gpu", default="H100")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10 ** 6)
    print(f"seed {seed} (replay: --seed={seed})")
    rng = random.Random(seed)
    dev = device_facts("cuda", gpu=gpu_name(args.gpu))
    kw = dict(sdpa_backend=dev["sdpa_backend"], workspace_bytes=dev["workspace_bytes"])
    same = refused = differ = skipped = 0
    for i in range(args.configs):
        cfg = dict(DEFAULTS, **random_config(rng))
        cfg.update(n_layer=rng.choice((rng.randint(2, 4), rng.randint(8, 20), rng.randint(8, 20))),
                   dtype=rng.choice(("float16", "bfloat16", "float32")))
        if rng.random() < 0.3:  # many micro-steps: repeated too
            cfg["gradient_accumulation_steps"] = rng.randint(8, 12)
        if not (shadow_repeat.repeatable(cfg) or shadow_repeat.micro_repeatable(cfg)):
            skipped += 1
            print(f"{i:3d} not repeatable (ac_every={cfg['ac_every']}, {cfg['activation_checkpointing']})")
            continue
        t = time.perf_counter()
        try:
            full = shadow.run(cfg, "cuda", **kw)
        except shadow.ShadowError as e:
            skipped += 1
            print(f"{i:3d} the shadow cannot run it: {e}")
            continue
        t_full = time.perf_counter() - t
        t = time.perf_counter()
        rep = shadow.repeated(cfg, **kw)
        t_rep = time.perf_counter() - t
        if rep is None:
            refused += 1
            print(f"{i:3d} refused  {cfg}")
            continue
        diff = first_difference(rep, full)
        if diff is None:
            same += 1
        else:
            differ += 1
        print(f"{i:3d} {'same' if diff is None else 'DIFFERENT: ' + diff}  n_layer {cfg['n_layer']}  "
              f"micro-steps {cfg['gradient_accumulation_steps']}  "
              f"full {t_full:.2f}s repeated {t_rep:.2f}s  {cfg if diff else ''}")
    print(f"seed {seed}: same {same}, different {differ}, refused {refused}, not repeatable/not run {skipped}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
