"""Step time of each activation-checkpointing mode against `none`, plain training (no audit).

    python benchmarks/bench_ac.py [--preset=cpu-mini] [--device=cpu] [--batch_size=8]

Each mode runs train.py for 6 steps in its own process; the median of steps 3-6 is its step
time. Prints measured ratios beside the predicted recompute share of forward matmul FLOPs.
"""

import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
STEP = re.compile(r"^iter (\d+) \(step \d+\): loss \S+, time ([0-9.]+)ms", re.M)


def step_ms(args, mode):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--max_iters=6", f"--activation_checkpointing={mode}",
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"error: {mode}: {p.stderr.strip().splitlines()[-1]}")
    times = [float(t) for i, t in STEP.findall(p.stdout) if int(i) >= 2]
    return statistics.median(times)


def main():
    from memory_audit.cli_args import overrides
    from memory_audit.prediction.predict import device_facts, prediction
    args = sys.argv[1:] or ["--preset=cpu-mini", "--device=cpu", "--batch_size=8", "--dtype=float32"]
    cfg = overrides([a for a in args if not a.startswith("--device")])
    dev = device_facts("cpu") if "--device=cpu" in args else device_facts("cuda")
    base = step_ms(args, "none")
    print(f"{'mode':<10} {'step ms':>9} {'vs none':>8} {'pred recompute/forward FLOPs':>30} {'pred peak':>14}")
    for mode in ("none", "full", "selective", "sac"):
        ms = base if mode == "none" else step_ms(args, mode)
        t = prediction(dict(cfg, activation_checkpointing=mode), dev)["totals"]
        print(f"{mode:<10} {ms:>9.2f} {ms / base:>8.3f} {t['recompute_flops'] / t['forward_flops']:>30.3f} "
              f"{t['peak_allocated_bytes']:>14,}")


if __name__ == "__main__":
    main()
