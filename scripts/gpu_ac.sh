#!/usr/bin/env bash
# Activation checkpointing on a GPU, in one command (issue #10). From the repo root:
#   OUT=$OUT bash scripts/gpu_ac.sh
# 1. the CUDA tests (3 tiny AC audits: losses unchanged, lines exact, recomputation labelled);
# 2. GPT-2 small and medium, fp16, manual and sdpa, none/full/selective (sweep grid gpu-ac),
#    rows to $OUT/h100-ac.jsonl (commit as snapshots/results/h100-ac.jsonl);
# 3. long sequences (sweep grid gpu-long): the peak inside the attention core's backward, which
#    the predictor puts at three fp32 B*n_head*T^2 tensors under autocast (CPU-measured rule),
#    rows to $OUT/h100-long.jsonl (commit as snapshots/results/h100-long.jsonl);
# 4. how large a batch fits with each mode: the predictor's answer, then the real OOM edge.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(),
hasattr(torch.cuda.memory, '_set_memory_metadata'))"
python3 -m pytest -q tests/test_cuda.py 2>&1 | tail -15
python3 -m memory_audit sweep --grid=gpu-ac --out="$OUT/h100-ac.jsonl" --audit-dir=/tmp/ac-runs --timeout=600
python3 -m memory_audit sweep --grid=gpu-long --out="$OUT/h100-long.jsonl" --audit-dir=/tmp/long-runs --timeout=600
for mode in none full selective; do
    python3 -m memory_audit fit --gpu=H100 --preset=gpt2 --attention=manual --activation_checkpointing=$mode
done
for mode in full selective; do  # the batch fit names, for real (one process each)
    b=$(python3 -m memory_audit fit --gpu=H100 --preset=gpt2 --attention=manual --activation_checkpointing=$mode \
        | sed -n 's/.*block_size 1024: \([0-9]*\) .*/\1/p')
    for bb in $b $((b + 1)); do
        python3 train.py --preset=gpt2 --attention=manual --activation_checkpointing=$mode --batch_size=$bb \
            --max_iters=3 2>&1 | tail -2
    done
done
