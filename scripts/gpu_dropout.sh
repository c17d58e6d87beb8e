#!/usr/bin/env bash
# CUDA check of the dropout lines: tiny audits with dropout=0.1 (scripts/h100_dropout.json),
# one process each, rows in the sweep's format (step_ms, overhead, dump size) to
# $OUT/h100-dropout.jsonl; commit it as snapshots/results/h100-dropout.jsonl.
#   OUT=$OUT bash scripts/gpu_dropout.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
python3 -m memory_audit sweep --configs=scripts/h100_dropout.json --device=cuda --out="$OUT/h100-dropout.jsonl" \
    --audit-dir=/tmp/dropout-runs --timeout=240
