"""The committed H100 rows against the shadow run of their CUDA step.

    python scripts/shadow_h100.py

For each row of snapshots/results/h100*.jsonl: measured minus predicted peak and reserved
memory (memory_allocated()'s peak and memory_reserved() of step 2), the shadow run replayed
through the allocator's model (memory_audit/prediction/shadow/step.py, shadow/replay.py). Prints
a markdown table. Each row is a shadow run on meta tensors (0.1-3 s).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.prediction.predict import resolved
    from memory_audit.comparison.sweep import row_config
    print("| row | peak measured | peak diff | reserved diff |")
    print("| --- | --- | --- | --- |")
    for name in ("h100.jsonl", "h100-variants.jsonl", "h100-dropout.jsonl"):
        for line in open(os.path.join(ROOT, "snapshots", "results", name)):
            row = json.loads(line)
            cfg, device = row_config(row)
            r = shadow.replayed(resolved(cfg), device)
            peak, res = row["totals"]["peak"]["actual"], row.get("reserved_actual")
            label = ", ".join(f"{k}={v}" for k, v in row["config"].items())

            def diff(actual, predicted):
                return "-" if actual is None else f"{actual - predicted:+,} B ({100 * (actual - predicted) / actual:+.4f}%)"
            print(f"| {label} | {peak:,} B | {diff(peak, r['peak'])} | {diff(res, r['reserved'])} |", flush=True)


if __name__ == "__main__":
    main()
