#!/usr/bin/env bash
# The real OOM edge and reserved memory on a GPU, in one command (issue #13). From the repo root:
#   OUT=$OUT bash scripts/gpu_fit.sh
# For GPT-2 small, medium and large at block 1024 (fp16, manual attention): `fit`'s largest batch
# must run and the next one must OOM (one process per try, each OOM leaves its snapshot under
# $OUT/fit-runs); then one audited run with expandable segments against its prediction, and the
# memory outside PyTorch that audits record (meta.json's outside_pytorch).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT/fit-runs"
for preset in gpt2 gpt2-medium gpt2-large; do
    b=$(python3 -m memory_audit fit --gpu=H100 --preset=$preset --attention=manual --json \
        | python3 -c "import json,sys; print(json.load(sys.stdin)['largest_batch_size'])")
    for bb in $b $((b + 1)); do
        echo "== $preset batch $bb (fit says $b)"
        python3 train.py --preset=$preset --attention=manual --batch_size=$bb --audit --audit_dir="$OUT/fit-runs" \
            --run_name=$preset-b$bb 2>&1 | tail -3
    done
done
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m memory_audit predict --preset=gpt2 --gpu=H100 --json \
    | python3 -c "import json,sys; t=json.load(sys.stdin)['totals']; print('expandable predicted reserved', t['reserved_peak_bytes'])"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 train.py --preset=gpt2 --audit --audit_dir="$OUT/fit-runs" \
    --run_name=gpt2-expandable 2>&1 | tail -8
python3 - "$OUT/fit-runs" <<'PY'
import glob, json, sys
for meta in sorted(glob.glob(sys.argv[1] + "/*/meta.json")):
    m = json.load(open(meta))
    ph = m["phases"]
    print(meta.split("/")[-2], "reserved max", max((p.get("memory_reserved") or 0) for p in ph.values()),
          "outside_pytorch", [p.get("outside_pytorch") for p in ph.values()], "error", (m.get("error") or {}).get("type"))
PY
