#!/usr/bin/env bash
# torch.compile on a GPU (issue #11). From the repo root, two commands of under 10 minutes each:
#   OUT=$OUT bash scripts/gpu_compile.sh tests    # CUDA tests (compiled tiny audits) + nanoGPT's defaults
#   OUT=$OUT bash scripts/gpu_compile.sh sweep    # GPT-2 small fp16 at budgets 1.0, 0.5, 0.1
# tests: tests/test_cuda.py -k compiled (losses unchanged, lines exact, peak within 0.5%), then
#        nanoGPT's own defaults (GPT-2 small, batch 12, bf16, flash/SDPA attention, compile=True)
#        audited; its report.md goes to $OUT/nanogpt-defaults-report.md (commit under snapshots/results/).
# sweep: grid gpu-compile-budget, rows to $OUT/h100-compile.jsonl (commit as snapshots/results/h100-compile.jsonl).
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
case "${1:-tests}" in
tests)
    python3 -m pytest -q tests/test_cuda.py -k compiled 2>&1 | tail -15
    python3 train.py --audit --compile=True --preset=gpt2 --batch_size=12 --dtype=bfloat16 --attention=sdpa \
        --audit_dir=/tmp/compile-runs --run_name=nanogpt-defaults 2>&1 | tail -12
    cp /tmp/compile-runs/nanogpt-defaults/report.md "$OUT/nanogpt-defaults-report.md" 2>/dev/null
    cp /tmp/compile-runs/nanogpt-defaults/meta.json "$OUT/nanogpt-defaults-meta.json" 2>/dev/null
    ;;
sweep)
    python3 -m memory_audit sweep --grid=gpu-compile-budget --out="$OUT/h100-compile.jsonl" \
        --audit-dir=/tmp/compile-runs --timeout=540
    ;;
esac
