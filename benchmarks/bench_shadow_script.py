"""Seconds to predict library models' step 2 from their own training code (memory_audit.shadow()
around scripts/zoo.py's loop, CPU, fake tensors), whole process each: the import of torch and
transformers, the model built fake, three steps shadow-run.

    python benchmarks/bench_shadow_script.py [--repeat=3]

Models at their libraries' usual sizes, built from configs (no download): GPT-2 small (124M),
BERT base, a Llama of 1B parameters in bf16 autocast, T5 small, each with AdamW. Prints the
median seconds of `--repeat` runs and the predicted peak (the real step is not run: it would take
the memory the prediction is for).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "GPT-2 small (124M), batch 8 x 512": {"lib": "hf", "name": "gpt2", "width": 768, "layers": 12, "heads": 12,
                                          "kv_heads": 12, "vocab": 50257, "seq": 512, "batch": 8, "dtype": "float32"},
    "BERT base, batch 8 x 512": {"lib": "hf", "name": "bert", "width": 768, "layers": 12, "heads": 12, "kv_heads": 12,
                                 "vocab": 30522, "seq": 512, "batch": 8, "dtype": "float32"},
    "Llama 1B (16 x 2048, GQA 32/8), bf16, batch 4 x 1024": {"lib": "hf", "name": "llama", "width": 2048, "layers": 16,
                                                              "heads": 32, "kv_heads": 8, "vocab": 32000, "seq": 1024,
                                                              "batch": 4, "dtype": "bfloat16"},
    "T5 small, batch 8 x 512": {"lib": "hf", "name": "t5", "width": 512, "layers": 6, "heads": 8, "kv_heads": 8,
                                "vocab": 32128, "seq": 512, "batch": 8, "dtype": "float32"},
}

RUN = """
import json, sys, time
sys.path.insert(0, {scripts!r})
import zoo, memory_audit
spec = dict(json.loads(sys.argv[1]), size="big", optimizer="adamw", impl="foreach", checkpointing=False, seed=0,
            attention="sdpa")
with memory_audit.shadow() as s:
    zoo.train(spec, "cpu", steps=10)
print(json.dumps({{"peak": s.summary["peak"]}}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    code = RUN.format(scripts=os.path.join(ROOT, "scripts"))
    print(f"{os.cpu_count()} CPUs; whole process each (python, torch, transformers, the model, three steps)")
    print("| model | seconds (median) | predicted peak |")
    print("| --- | --- | --- |")
    for name, spec in MODELS.items():
        times, peak = [], None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT, capture_output=True, text=True,
                               timeout=900)
            times.append(time.perf_counter() - t0)
            if p.returncode:
                raise SystemExit(f"error: {name}: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
            peak = json.loads(p.stdout.strip().splitlines()[-1])["peak"]
        print(f"| {name} | {statistics.median(times):.1f} | {peak / 2**30:.2f} GiB |", flush=True)


if __name__ == "__main__":
    main()
