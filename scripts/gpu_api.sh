#!/usr/bin/env bash
# The public Audit API on a GPU, in one command (issue #14). From the repo root:
#   OUT=$OUT bash scripts/gpu_api.sh
# 1. the CUDA tests, the API's included (a conv net audited after it was built: the weights
#    predate the trace and must be named from the segments);
# 2. examples/any_loop.py on CUDA into $OUT/cuda-any-loop (commit as snapshots/examples/cuda-any-loop),
#    its attribution and report.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pytest -q tests/test_cuda.py 2>&1 | tail -15
python3 examples/any_loop.py "$OUT/cuda-any-loop"
python3 -m memory_audit attribute "$OUT/cuda-any-loop" | tail -40
python3 -m memory_audit report "$OUT/cuda-any-loop" | tail -8
