#!/usr/bin/env bash
# DDP, FSDP2, TP and FSDP2 x TP on a GPU (issue #12), world size 1 with nccl, in one command. From the repo root:
#   OUT=$OUT bash scripts/gpu_ddp.sh
# GPT-2 small fp16 (manual attention) and a tiny model under torchrun: every line named
# (grads/ddp_buckets, FSDP2's weights/<name>/unsharded and temporary/fsdp_all_gather, the
# DeviceMesh) and predicted; the reports go to $OUT. On CPU all three are exact at 1 and 2 ranks.
# What only more GPUs could verify: nccl's own buffers across ranks, real sharding (t > 1) on CUDA.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
for parallel in ddp fsdp tp fsdp+tp; do
    for spec in "gpt2 12" "cpu-tiny 4"; do
        set -- $spec
        torchrun --standalone --nproc_per_node=1 train.py --audit --device=cuda --preset=$1 --batch_size=$2 \
            --parallel=$parallel --tp_size=$([ $parallel = fsdp+tp ] && echo 1 || echo 0) --dtype=float16 --attention=manual --audit_dir=/tmp/ddp-runs \
            --run_name=$parallel-$1 2>&1 | tail -8
        cp /tmp/ddp-runs/$parallel-$1/rank0/report.md "$OUT/$parallel-$1-report.md" 2>/dev/null
    done
done
# FSDP2 with full checkpointing (the peak moves into a block's backward, where FSDP2 holds the
# block's all-gathered parameters and the previous reduce-scatter's input; exact on CPU)
torchrun --standalone --nproc_per_node=1 train.py --audit --device=cuda --preset=gpt2 --batch_size=12 \
    --parallel=fsdp --activation_checkpointing=full --dtype=float16 --attention=manual --audit_dir=/tmp/ddp-runs \
    --run_name=fsdp-ac-gpt2 2>&1 | tail -8
cp /tmp/ddp-runs/fsdp-ac-gpt2/rank0/report.md "$OUT/fsdp-ac-gpt2-report.md" 2>/dev/null
