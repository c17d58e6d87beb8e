#!/usr/bin/env bash
# CUDA runs for the committed examples, the reference audit and the sweeps.
#   OUT=/tmp/out bash scripts/gpu_run2.sh {examples|sizes|variants}
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
case "$1" in
examples)
    python3 train.py --audit --audit_dir=snapshots/examples --run_name=cuda-tiny-fp16-manual --preset=cpu-tiny --batch_size=4 --dtype=float16
    python3 train.py --audit --audit_dir=snapshots/examples --run_name=cuda-tiny-bf16-sdpa --preset=cpu-tiny --batch_size=4 --dtype=bfloat16 --attention=sdpa
    python3 train.py --audit --audit_dir=snapshots/examples --run_name=h100-gpt2-reference --preset=gpt2 --batch_size=12 --dtype=float16 --attention=manual --keep_logits=False --set_to_none=False
    python3 -m memory_audit attribute snapshots/examples/h100-gpt2-reference --json snapshots/examples/h100-gpt2-reference/attribution.json
    rm -f snapshots/examples/h100-gpt2-reference/*.pickle
    tar -C snapshots -cJf "$OUT/examples.tar.xz" examples ;;
sizes)
    timeout 540 python3 -m memory_audit sweep --grid=gpt2-sizes --out="$OUT/h100.jsonl" --timeout=240
    tar -C snapshots -cJf "$OUT/sweep_sizes.tar.xz" sweep ;;
variants)
    timeout 540 python3 -m memory_audit sweep --grid=variants --out="$OUT/h100-variants.jsonl" --timeout=240
    tar -C snapshots -cJf "$OUT/sweep_variants.tar.xz" sweep ;;
esac
# the rest of gpt2-sizes when `timeout 540` stops the sizes grid (sweep rows append):
#   python3 -m memory_audit sweep --configs=scripts/xl_rest.json --out=$OUT/h100.jsonl
