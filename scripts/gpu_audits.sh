#!/usr/bin/env bash
# The CUDA audits this project commits results from. Run on a GPU machine from the repo root:
#   OUT=/tmp/out bash scripts/gpu_audits.sh
# Each run lands in snapshots/<name>/; a tar.xz of each run directory is written to $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
run() {  # name, then train.py arguments
    local name=$1; shift
    echo "=== $name: $*"
    /usr/bin/time -v python3 train.py --audit --run_name="$name" "$@" 2>&1 | grep -v -E "^\s+(Page|Swaps|Socket|Signals|File sys|Average|Voluntary|Invol|Minor|Major|Exit|Percent|System time|User time|Elapsed)" 
    tar -C snapshots -cJf "$OUT/$name.tar.xz" "$name"
    ls -la "$OUT/$name.tar.xz"
}
run tiny-fp16 --preset=cpu-tiny --batch_size=4 --dtype=float16
run gpt2-fp16-manual --preset=gpt2 --batch_size=12 --dtype=float16 --attention=manual
run gpt2-bf16-sdpa --preset=gpt2 --batch_size=12 --dtype=bfloat16 --attention=sdpa
run gpt2-fp16-manual-relu --preset=gpt2 --batch_size=12 --dtype=float16 --attention=manual --activation=relu
run gpt2medium-fp16-manual --preset=gpt2-medium --batch_size=12 --dtype=float16 --attention=manual
echo "=== plain gpt2 steps (no audit), for the overhead ratio"
python3 train.py --preset=gpt2 --batch_size=12 --dtype=float16 --max_iters=6 2>&1 | tail -6
