"""The committed H100 rows against train.py shadow-run as a user's script (predict-script --gpu).

    python scripts/script_h100_rows.py [--only=I,J] [--repeat-blocks]

For each row of snapshots/results/h100*.jsonl, `python -m memory_audit predict-script --gpu=H100
--step=1 --json train.py -- <the row's config> --dataset=synthetic --device=cuda` in a process of
its own (--step=1: the index of train.py's 1-based audited step 2):
train.py's own code (its GradScaler, its loop, its model) run as written on fake tensors, not the
nanoGPT shadow that `predict` runs. Prints a markdown table: measured minus predicted step-2 start
(memory_allocated()), peak and memory_reserved(). The rows were measured with torch 2.11 on an
H100 80GB HBM3 (each row names its own).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("h100.jsonl", "h100-variants.jsonl", "h100-dropout.jsonl")


def rows():
    for name in FILES:
        for line in open(os.path.join(ROOT, "snapshots", "results", name)):
            yield json.loads(line)


def args_of(config):
    return [f"--{k}={v}" for k, v in config.items()]


def diff(actual, predicted):
    if actual is None:
        return "-"
    return f"{actual - predicted:+,} B"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="comma-separated row numbers")
    ap.add_argument("--repeat-blocks", dest="repeat_blocks", action="store_true",
                    help="predict-script --repeat-blocks: the blocks of the deeper rows repeated from 3 and 4")
    args = ap.parse_args()
    only, repeat = args.only, ["--repeat-blocks"] if args.repeat_blocks else []
    only = None if only is None else {int(i) for i in only.split(",")}
    print("| row | config | start diff | peak measured | peak diff | reserved diff | s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    exact = {"peak": 0, "reserved": 0, "start": 0, "rows": 0, "reserved_rows": 0}
    for i, row in enumerate(rows()):
        if only is not None and i not in only:
            continue
        cmd = [sys.executable, "-m", "memory_audit", "predict-script", "--gpu=H100", "--step=1", "--json", *repeat, "train.py", "--",
               *args_of(row["config"]), "--dataset=synthetic", "--device=cuda"]
        t = time.time()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        took = time.time() - t
        label = ", ".join(f"{k}={v}" for k, v in row["config"].items())
        if p.returncode != 0:
            print(f"| {i} | {label} | error: {p.stderr.strip().splitlines()[-1][:200]} | | | | {took:.0f} |", flush=True)
            continue
        text = p.stdout  # the script's own prints come first: the JSON is the last "{" line on
        got = json.loads(text[0 if text.startswith("{\n") else text.rindex("\n{\n") + 1:])["allocator"]
        peak, res, start = row["totals"]["peak"]["actual"], row.get("reserved_actual"), row["totals"]["steady_state"]["actual"]
        exact["rows"] += 1
        exact["peak"] += peak == got["peak"]
        exact["start"] += start == got["steady_state"]
        if res is not None:
            exact["reserved_rows"] += 1
            exact["reserved"] += res == got["reserved"]
        print(f"| {i} | {label} | {diff(start, got['steady_state'])} | {peak:,} B | {diff(peak, got['peak'])} | "
              f"{diff(res, got['reserved'])} | {took:.0f} |", flush=True)
    print(f"\nrows run {exact['rows']}: step 2's start exact {exact['start']}, peak exact {exact['peak']}, "
          f"reserved exact {exact['reserved']} of {exact['reserved_rows']} that measured it")


if __name__ == "__main__":
    main()
