"""Benchmark: whole commands as a user runs them (fresh processes, imports included), for issue
#26's targets: `predict --preset=gpt2-xl` under 1 s after imports, `plan` (a dozen options)
under 5 s in all.

    python benchmarks/bench_commands.py [--runs=3]

Each command runs `runs` times in a fresh process; prints the median wall time, the time a bare
`python -c "import torch, memory_audit.cli"` takes on this machine (the imports every
shadow-backed command pays before it computes anything), their difference, and the ratio to
the target. Not a test: the numbers depend on the machine.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MA = [sys.executable, "-m", "memory_audit"]
COMMANDS = [  # (name, argv, target seconds after imports or None)
    ("predict gpt2-xl (shadow)", MA + ["predict", "--preset=gpt2-xl", "--batch_size=4"], 1.0),
    ("predict gpt2-xl --ledger", MA + ["predict", "--preset=gpt2-xl", "--batch_size=4", "--ledger"], None),
    ("fit gpt2-large", MA + ["fit", "--preset=gpt2-large"], None),
    ("plan gpt2-large b16 (shadow)", MA + ["plan", "--preset=gpt2-large", "--batch_size=16"], 5.0),
    ("plan gpt2-large b16 --ledger", MA + ["plan", "--preset=gpt2-large", "--batch_size=16", "--ledger"], None),
]
IMPORTS = [sys.executable, "-c", "import torch, torch._dynamo, model, memory_audit.cli"]


def timed(argv, runs):
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        out.append(time.perf_counter() - t)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(argv[2:])}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    imports = timed(IMPORTS, args.runs)
    print(f"imports (torch, torch._dynamo, model, memory_audit.cli): {imports:.2f}s")
    print(f"{'command':32s} {'wall':>6s} {'after imports':>14s} {'target':>7s} {'ratio':>6s}")
    for name, argv, target in COMMANDS:
        wall = timed(argv, args.runs)
        after = wall - imports
        ratio = f"{after / target:5.2f}x" if target else ""
        print(f"{name:32s} {wall:5.2f}s {after:13.2f}s {str(target or '-'):>7s} {ratio:>6s}")


if __name__ == "__main__":
    main()
