"""Seconds to predict a large model's step on GPUs this machine does not have, whole process
each (`python -m memory_audit predict-script --gpu=H100 ...`: the import of torch and
transformers, the model built fake, three steps shadow-run), against issue #49's targets: a
Llama-shaped 1.5B model on one H100 in under 10 s, and one rank of a Llama-shaped 8B model
under FSDP2 on 8 H100s in under 30 s (benchmarks/scale_llama.py, bf16 autocast, AdamW, T 2048).

    python benchmarks/bench_scale.py [--repeat=3]

Prints the median seconds of `--repeat` runs, its ratio to the target, and the predicted peak
and memory_reserved().
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "scale_llama.py")
CASES = (("Llama 1.5B, one H100 (--repeat-blocks)", ["--repeat-blocks"], ["--size=1.5b"], 10.0),
         ("Llama 8B, FSDP2, rank 0 of 8 H100s", ["--world_size=8", "--rank=0"], ["--size=8b", "--fsdp"], 30.0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    repeat = ap.parse_args().repeat
    print("| workload | seconds (median) | of the target | peak | reserved |")
    print("| --- | --- | --- | --- | --- |")
    for name, ranks, args, target in CASES:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "memory_audit", "predict-script", "--gpu=H100", "--json", *ranks,
                                SCRIPT, "--", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
            times.append(time.perf_counter() - t)
            if p.returncode != 0:
                raise SystemExit(f"error: {name}: {p.stderr.strip().splitlines()[-1]}")
        got = json.loads(p.stdout)["allocator"]
        s = statistics.median(times)
        print(f"| {name} | {s:.1f} | {s / target:.2f} of {target:.0f} s | {got['peak']:,} B | {got['reserved']:,} B |",
              flush=True)


if __name__ == "__main__":
    main()
