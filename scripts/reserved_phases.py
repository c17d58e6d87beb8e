"""Where a reserved-memory miss enters: the predicted memory_reserved() (the shadow run's trace
through the caching allocator's model) at the start of step 2, before backward and at its end, beside the measured one at the same points, for
every stored H100 row with a committed report.

Segments are never released inside a step, so each phase's measured reserved is what its
report.md says was allocated there plus the cached and pending free bytes. The reports print
the allocated categories in GiB with 3 decimals, so the measured side is good to about 1 MB:
enough to see in which phase the model and the allocator part ways, not a byte count.

    python scripts/reserved_phases.py   # GiB, model / measured, per phase
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backfill_reserved import report_table  # noqa: E402  (beside this script)
from memory_audit.comparison.sweep import row_config  # noqa: E402
from memory_audit.prediction.predict import resolved  # noqa: E402
from memory_audit.prediction.shadow.step import replayed  # noqa: E402

RESULTS = os.path.join(ROOT, "snapshots", "results")
UNIT = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}
PHASES = ("step2_start", "step2_before_backward", "step2_end")


def measured(report_md):
    """Bytes reserved at each phase: every category's actual column (allocated, cached_free,
    pending_free) summed."""
    text = open(report_md).read()
    return {phase: sum(float(r[2].split()[0].replace(",", "")) * UNIT[r[2].split()[1]]
                       for r in report_table(text, phase) if not r[0].startswith("---"))
            for phase in PHASES}


def modelled(row):
    cfg, dev = row_config(row)
    r = replayed(resolved(cfg), dev)
    return dict(zip(PHASES, (r["reserved_steady"], r["reserved_before_backward"], r["reserved"])))


def main():
    print("run | " + " | ".join(f"{p}: model / measured GiB" for p in PHASES))
    for name in ("h100.jsonl", "h100-variants.jsonl"):
        for line in open(os.path.join(RESULTS, name)):
            row = json.loads(line)
            report = os.path.join(RESULTS, "h100-runs", row["run"], "report.md")
            if not os.path.isfile(report):
                continue
            m, a = modelled(row), measured(report)
            print(row["run"].replace("sweep-preset", "") + " | "
                  + " | ".join(f"{m[p] / 2**30:.3f} / {a[p] / 2**30:.3f}" for p in PHASES))


if __name__ == "__main__":
    main()
