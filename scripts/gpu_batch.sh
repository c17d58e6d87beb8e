#!/usr/bin/env bash
# GPU_RUNS.md's items 1, 3, 5 and 7 side by side in ONE command of under 10 minutes (every stream
# stops SECONDS_FOR_WORK seconds after the start, default 470). From the repo root, with the
# machine's own python3:
#   OUT=$OUT SECONDS_FOR_WORK=470 bash scripts/gpu_batch.sh
# Streams, all started at once, each stopped at the deadline (one process's CUDA allocator never sees
# another's, so running them together changes no byte measured):
#   - 4 x scripts/shadow_check.py --device=cuda (random tiny configs, seeds printed; one stream at
#     fp16, which the CPU draw lacks), every audited step kept with its whole trace (--keep);
#   - tests/test_cuda.py and tests/test_nodynamo.py (the OOM test last and alone: it fills the GPU);
#   - scripts/gpu_reserved.sh with TRACE=1 on GPT-2-sized rows: compact traces to commit, and the
#     shadow run against each measured step (`report --trace`); two streams on a GPU of over 120 GB.
# Returns at most 8 files in $OUT: logs.tgz, reserved.tgz, keep-{a,b,c,d}.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=2
OUT=${OUT:-/tmp/gpu_out}
W=${W:-/tmp/gpu_batch}
DEVICE=${DEVICE:-cuda}   # DEVICE=cpu: a dry run of this script's plumbing on a machine without a GPU
rm -rf "$W"; mkdir -p "$OUT" "$W"
export DEADLINE=$(( $(date +%s) + ${SECONDS_FOR_WORK:-470} ))
left() { local l=$(( DEADLINE - $(date +%s) )); if [ "$l" -gt 1 ]; then echo "$l"; else echo 1; fi; }
python3 setup.py -q build_ext --inplace > "$W/build.log" 2>&1 || echo "compiled core not built (pure Python path)" >> "$W/build.log"
{ python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$W/env.txt" 2>&1
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1); MEM_MIB=${MEM_MIB:-0}
cat "$W/env.txt"

for s in a b c d; do
    extra=(); [ "$s" = d ] && extra=(--dtype=float16)
    [ "$DEVICE" = cpu ] && [ "$s" = d ] && extra=()
    timeout "$(left)" python3 scripts/shadow_check.py --device="$DEVICE" --n=60 "${extra[@]}" \
        --out="$W/shadow-$s.jsonl" --keep="$W/keep-$s" > "$W/shadow-$s.log" 2>&1 &
done
if [ "$DEVICE" = cuda ]; then
    timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -n 3 tests/test_cuda.py tests/test_nodynamo.py \
        -k "not oom" > "$W/tests.log" 2>&1 &
fi
G1="gpt2-sdpa-fp32-b4 gpt2-bias-b8 gpt2-manual-fp16 xl-manual-bf16"
G2="gpt2-vocab32000-b8 medium-full-b8 large-sdpa-fp16-b8 large-manual-fp16-b10"
if [ "$DEVICE" = cpu ]; then
    :
elif [ "$MEM_MIB" -gt 120000 ]; then
    (OUT=$W RUNS=$W/runs1 TRACE=1 bash scripts/gpu_reserved.sh $G1 > "$W/reserved-1.log" 2>&1) &
    (OUT=$W RUNS=$W/runs2 TRACE=1 bash scripts/gpu_reserved.sh $G2 > "$W/reserved-2.log" 2>&1) &
else  # an 80 GB card: one big run at a time, and not the 80 GB one
    (OUT=$W RUNS=$W/runs1 TRACE=1 bash scripts/gpu_reserved.sh $G1 ${G2% large-manual-fp16-b10} > "$W/reserved-1.log" 2>&1) &
fi
wait
if [ "$DEVICE" = cuda ]; then
    timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k oom \
        > "$W/tests-oom.log" 2>&1
fi

tar czf "$OUT/logs.tgz" -C "$W" --exclude='keep-*' --exclude='runs*' --exclude=reserved .
[ -d "$W/reserved" ] && tar czf "$OUT/reserved.tgz" -C "$W" reserved
for s in a b c d; do [ -d "$W/keep-$s" ] && tar czf "$OUT/keep-$s.tgz" -C "$W" "keep-$s"; done
for f in "$W"/shadow-?.log; do echo "== $f"; grep -v -e "^ *$" -e USDT "$f" | cut -c1-400 | tail -8; done
echo "== tests"; tail -15 "$W/tests.log" 2>/dev/null; tail -3 "$W/tests-oom.log" 2>/dev/null
for f in "$W"/reserved-?.log; do echo "== $f"; cut -c1-300 "$f" | tail -40; done
ls -la "$OUT"
