#!/usr/bin/env bash
# DDP on a lent GPU (issue #12), world size 1 with nccl, in one call. From the repo root:
#   OUT=$OUT bash scripts/gpu_ddp.sh
# GPT-2 small fp16 (manual attention) and a tiny model under torchrun: every line named
# (grads/ddp_buckets among them; each bucket is its own CUDA allocation, rounded to 512 B) and
# predicted; the reports go to $OUT. What only more GPUs could verify: nccl's own buffers
# across ranks, buckets on ranks > 0.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
for spec in "gpt2 12" "cpu-tiny 4"; do
    set -- $spec
    torchrun --standalone --nproc_per_node=1 train.py --audit --device=cuda --preset=$1 --batch_size=$2 \
        --dtype=float16 --attention=manual --audit_dir=/tmp/ddp-runs --run_name=ddp-$1 2>&1 | tail -8
    cp /tmp/ddp-runs/ddp-$1/rank0/report.md "$OUT/ddp-$1-report.md" 2>/dev/null
done
