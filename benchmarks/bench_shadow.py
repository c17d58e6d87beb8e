"""Benchmark: the shadow run of a CUDA step (issue #26's speed target: GPT-2 xl under 1 s after
imports), each preset in a fresh process.

    python benchmarks/bench_shadow.py [--presets=gpt2,gpt2-xl] [--runs=3]

For each preset (H100, fp16, manual attention, the H100 rows' batch) a child process imports
torch and the package, then times shadow.replayed() (the shadow run on meta tensors and the
caching allocator's replay) once cold (the first call also imports what torch's meta kernels
import lazily; torch._dynamo is stood in for: nodynamo.py) and `runs` times warm, with and without the meta-kernel
cache and the view shortcut (shadow.run(cache=False)). Prints the medians and the ratios to the
1 s target and to the uncached run. Not a test: the numbers depend on the machine.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, statistics, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
import torch, model
from memory_audit.prediction.shadow import step as shadow
from memory_audit.prediction.predict import DEFAULTS, device_facts
t1 = time.perf_counter()
preset, batch, runs = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dev = device_facts()
cfg = dict(DEFAULTS, **{k: v for k, v in model.PRESETS[preset].items() if k in DEFAULTS}, batch_size=batch)
t = time.perf_counter(); r = shadow.replayed(cfg, dev); cold = time.perf_counter() - t

def timed(fn):
    out = []
    for _ in range(runs):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return statistics.median(out)
warm = timed(lambda: shadow.replayed(cfg, dev))
kw = dict(sdpa_backend=dev["sdpa_backend"], workspace_bytes=dev["workspace_bytes"])
run_cached = timed(lambda: shadow.run(cfg, "cuda", **kw))
run_uncached = timed(lambda: shadow.run(cfg, "cuda", cache=False, **kw))
print(json.dumps({"imports": t1 - t0, "cold": cold, "warm": warm, "run": run_cached, "run_uncached": run_uncached,
                  "events": len(r["result"]["events"]) + len(r["result"]["history"])}))
"""

BATCH = {"gpt2": 12, "gpt2-medium": 12, "gpt2-large": 8, "gpt2-xl": 4}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="gpt2,gpt2-xl")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print(f"{'preset':12s} {'events':>7s} {'imports':>8s} {'cold':>6s} {'warm':>6s} {'warm/1s':>8s} "
          f"{'run':>6s} {'uncached':>9s} {'speed-up':>9s}")
    for preset in args.presets.split(","):
        p = subprocess.run([sys.executable, "-c", CHILD, ROOT, preset, str(BATCH[preset]), str(args.runs)],
                           capture_output=True, text=True, cwd=ROOT)
        if p.returncode != 0:
            print(f"{preset}: failed: {p.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"{preset:12s} {r['events']:7d} {r['imports']:7.2f}s {r['cold']:5.2f}s {r['warm']:5.2f}s "
              f"{r['warm']:7.2f}x {r['run']:5.2f}s {r['run_uncached']:8.2f}s {r['run_uncached'] / r['run']:8.2f}x")


if __name__ == "__main__":
    main()
