"""Add the measured reserved memory to the stored H100 sweep rows, from their committed reports.

The H100 rows (snapshots/results/h100*.jsonl) were recorded before sweep rows carried
`reserved_actual`. Each run's report.md (snapshots/results/h100-runs/<run>/report.md) has it in
exact bytes: memory_reserved() at step2_end = the bytes allocated there (the steady state: the
step2_end category rows equal step2_start's, which the script checks) + cached_free +
pending_free, whose "diff B" columns are exact (predicted 0). Segments are never released
inside a step (no empty_cache, no OOM retry), so that is the step's largest memory_reserved().
Checked against the one run whose meta.json is committed (snapshots/examples/h100-gpt2-reference).

    python scripts/backfill_reserved.py   # rewrites the rows in place, idempotent
"""

import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "snapshots", "results")


def report_table(text, phase):
    """The rows of a report.md's "<phase>: by category" table, as lists of cell strings."""
    block = text.split(f"## {phase}: by category", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()
            if line.startswith("| ") and not line.startswith("| category")]


def measured_reserved(report_md):
    text = open(report_md).read()
    steady = re.search(r"\| steady_state \|[^\n]*", text)[0].split("|")
    allocated = int(steady[5].strip().replace(",", ""))  # the "actual B" column
    start, end = report_table(text, "step2_start"), report_table(text, "step2_end")
    allocated_rows = [r for r in end if r[0] not in ("cached_free", "pending_free")]
    if allocated_rows != [r for r in start if r[0] not in ("cached_free", "pending_free")]:
        raise ValueError(f"{report_md}: step2_end's allocations differ from step2_start's")
    free = sum(int(r[3].replace(",", "").replace("+", "")) for r in end if r[0] in ("cached_free", "pending_free"))
    return allocated + free


def main():
    for name in ("h100.jsonl", "h100-variants.jsonl"):
        path = os.path.join(RESULTS, name)
        rows = [json.loads(l) for l in open(path) if l.strip()]
        for r in rows:
            report = os.path.join(RESULTS, "h100-runs", r["run"], "report.md")
            r["reserved_actual"] = measured_reserved(report)
            r["reserved_source"] = f"h100-runs/{r['run']}/report.md (scripts/backfill_reserved.py)"
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{name}: {len(rows)} rows")
    ref = json.load(open(os.path.join(ROOT, "snapshots", "examples", "h100-gpt2-reference", "meta.json")))
    ref_reserved = max(p["memory_reserved"] for p in ref["phases"].values())
    row = json.loads(open(os.path.join(RESULTS, "h100.jsonl")).readline())
    print(f"check: {row['run']} {row['reserved_actual']:,} B; the reference run's meta.json: {ref_reserved:,} B")


if __name__ == "__main__":
    main()
