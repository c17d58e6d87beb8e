"""Benchmark: whole commands as a user runs them (fresh processes, imports included), for issue
#26's targets: `predict --preset=gpt2-xl` under 1 s after imports, `plan` (a dozen options)
under 5 s in all.

    python benchmarks/bench_commands.py [--runs=3]

Each command runs `runs` times in a fresh process; prints the median wall time, the time a bare
`python -c "import torch, memory_audit.cli"` takes on this machine (the imports every
shadow-backed command pays before it computes anything), their difference, and the ratio to
the target (for plan, whose target is in all, the whole wall time). Not a test: the numbers depend
on the machine.

    python benchmarks/bench_commands.py --base=REV [--runs=5]

sets this tree beside git revision REV (checked out in a temporary worktree, its compiled core
built there): each command runs alternately from REV's tree and this one, `runs` times each, and
the medians and their ratio are printed. A machine whose speed drifts from minute to minute (2
shared cores: `import torch` 1.4 s or 2.0 s a quarter hour apart) gives comparable numbers only
within one window; this is how a change's speed-up is measured. `--only=TEXT` keeps the commands
whose name contains TEXT (`--only=train.py`: what --audit adds on CPU, beside the same run
unaudited).
"""

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from memory_audit.comparison.workers import cpus  # noqa: E402
MA = [sys.executable, "-m", "memory_audit"]
AUDITS = tempfile.mkdtemp(prefix="bench-audit-")  # the audit rows' runs, removed at exit
atexit.register(shutil.rmtree, AUDITS, True)
COMMANDS = [  # (name, argv, (target seconds, "after imports" or "in all") or None)
    ("predict gpt2-xl (shadow)", MA + ["predict", "--preset=gpt2-xl", "--batch_size=4"], (1.0, "after imports")),
    ("fit gpt2-large", MA + ["fit", "--preset=gpt2-large"], None),
    # 16 options; their shadow runs on every CPU (plan --jobs), in workers forked after the imports
    ("plan gpt2-large b16 (shadow)", MA + ["plan", "--preset=gpt2-large", "--batch_size=16"], (5.0, "in all")),
    ("plan gpt2-large b16, one process", MA + ["plan", "--preset=gpt2-large", "--batch_size=16", "--jobs=1"], None),
    # issue #45: 15 options, 3 of them FSDP2 / FSDP2+TP ranks (DTensor's sharding propagation)
    ("plan world_size 8 H100 (shadow)", MA + ["plan", "--world_size=8", "--gpu=H100"], (5.0, "in all")),
    ("predict fsdp rank 3 of 8 H100", MA + ["predict", "--parallel=fsdp", "--gpu=H100", "--world_size=8", "--rank=3"],
     None),
    # what --audit adds: train.py on CPU (the cpu-mini preset, batch 8) audited (3 steps, step 2
    # recorded, then named and reported beside its prediction) and the same 3 steps unaudited
    ("train.py on CPU, 3 steps", [sys.executable, "train.py", "--device=cpu", "--max_iters=3"], None),
    ("train.py on CPU --audit", [sys.executable, "train.py", "--device=cpu", "--audit", f"--audit_dir={AUDITS}"],
     None),
]
# what every shadow-backed command imports before it computes (not torch._dynamo: a shadow run
# stands in for it, nodynamo.py)
IMPORTS = [sys.executable, "-c", "import torch, model, memory_audit.cli"]


def once(argv, cwd=ROOT):
    t = time.perf_counter()
    p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv[2:])}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    return time.perf_counter() - t


def timed(argv, runs):
    return statistics.median(once(argv) for _ in range(runs))


def against(rev, runs):
    """Each command from REV's tree and from this one, alternately; the medians and their ratio."""
    base = tempfile.mkdtemp(prefix="bench-base-")
    subprocess.run(["git", "worktree", "add", "--detach", base, rev], cwd=ROOT, check=True, capture_output=True)
    try:
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=base, check=True,
                       capture_output=True)
        print(f"{'command':34s} {rev[:12]:>12s} {'this tree':>10s} {'ratio':>6s}")
        for name, argv, _ in COMMANDS:
            times = {base: [], ROOT: []}
            for _ in range(runs):
                for tree in times:  # -m memory_audit from the tree's root imports that tree's package
                    times[tree].append(once(argv, cwd=tree))
            was, now = (statistics.median(times[t]) for t in (base, ROOT))
            print(f"{name:34s} {was:11.2f}s {now:9.2f}s {now / was:5.2f}x")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base], cwd=ROOT, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--base", help="a git revision to set this tree beside, in one window")
    ap.add_argument("--only", help="run only the commands whose name contains this text")
    args = ap.parse_args()
    if args.only:
        COMMANDS[:] = [c for c in COMMANDS if args.only in c[0]]
    if args.base:
        return against(args.base, args.runs)
    imports = timed(IMPORTS, args.runs)
    print(f"imports (torch, model, memory_audit.cli): {imports:.2f}s")
    print(f"{'command':34s} {'wall':>6s} {'after imports':>14s} {'target':>20s} {'ratio':>6s}")
    walls = {}
    for name, argv, target in COMMANDS:
        wall = timed(argv, args.runs)
        after = wall - imports
        if target:
            seconds, kind = target
            ratio = f"{(after if kind == 'after imports' else wall) / seconds:5.2f}x"
            goal = f"{seconds:g} s {kind}"
        else:
            ratio, goal = "", "-"
        print(f"{name:34s} {wall:5.2f}s {after:13.2f}s {goal:>20s} {ratio:>6s}")
        walls[name] = wall
    plain, audited = walls.get("train.py on CPU, 3 steps"), walls.get("train.py on CPU --audit")
    if plain and audited:
        print(f"what --audit adds on CPU (recording, naming, the report with its prediction): {audited - plain:.2f}s "
              f"({audited / plain:.2f}x the unaudited run)")
    print(f"({cpus()} CPUs; ratio: the measured time over the target)")


if __name__ == "__main__":
    main()
