#!/usr/bin/env bash
# GPU_RUNS.md's items 1, 5, 6 and 8 side by side in ONE command of under 10 minutes (every stream
# stops SECONDS_FOR_WORK seconds after the start, default 470). From the repo root, with the
# machine's own python3:
#   OUT=$OUT SECONDS_FOR_WORK=470 bash scripts/gpu_batch.sh
# Streams, all started at once, each stopped at the deadline (one process's CUDA allocator never sees
# another's, so running them together changes no byte measured):
#   - 2 x scripts/shadow_check.py --device=cuda (random tiny configs, seeds printed; one stream at
#     fp16, which the CPU draw lacks), every audited step kept with its whole trace (--keep);
#   - tests/test_cuda.py and tests/test_nodynamo.py (the OOM test last and alone: it fills the GPU);
#   - scripts/zoo_audit.py: random library-model loops (transformers, timm, torchvision, plain
#     torch) audited, tiny ones kept with their traces, and a few GPT-2-sized ones (rows only);
#   - NCCL at world size 1 (ddp, fsdp, tp on cpu-tiny, rank traces kept, `report --trace` each)
#     and the full-checkpointing-with-dropout run;
#   - NCCL at world size 1 on random draws as well (random_config's space, every strategy; seed printed);
#   - scripts/gpu_probe.py 3,2: which part of an Audit raises the SystemError of checkpointing with
#     dropout, and who imports torch._dynamo in a CUDA shadow step;
#   - scripts/gpu_scale_audit.py: step 2 of benchmarks/scale_llama.py's 1.5B loop audited (GPU_RUNS.md 13);
#   - RESERVED=1: scripts/gpu_reserved.sh with TRACE=1 on GPT-2-sized rows as well.
# Returns at most 8 files in $OUT: logs.tgz, keep-{a,d}.tgz, zoo.tgz, nccl.tgz, scale.tgz (reserved.tgz).
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

for s in a d; do
    extra=(); [ "$s" = d ] && extra=(--dtype=float16)
    [ "$DEVICE" = cpu ] && [ "$s" = d ] && extra=()
    timeout "$(left)" python3 scripts/shadow_check.py --device="$DEVICE" --n=60 "${extra[@]}" \
        --out="$W/shadow-$s.jsonl" --keep="$W/keep-$s" > "$W/shadow-$s.log" 2>&1 &
done
if [ "$DEVICE" = cuda ]; then
    timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -n 3 tests/test_cuda.py tests/test_nodynamo.py \
        -k "not oom" > "$W/tests.log" 2>&1 &
fi
timeout "$(left)" python3 scripts/zoo_audit.py --device="$DEVICE" --n=60 --out="$W/zoo.jsonl" --keep="$W/zoo" \
    > "$W/zoo.log" 2>&1 &
[ "$DEVICE" = cuda ] && timeout "$(left)" python3 scripts/zoo_audit.py --device=cuda --size=gpt2 --n=10 \
    --out="$W/zoo-gpt2.jsonl" > "$W/zoo-gpt2.log" 2>&1 &
if [ "$DEVICE" = cuda ]; then
    (   # NCCL at world size 1: its streams and record_stream frees, one rank's trace per strategy (kept)
        for par in ddp fsdp tp; do
            timeout "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node=1 train.py --audit --device=cuda --preset=cpu-tiny \
                --parallel=$par --audit_dir="$W/nccl" --run_name=$par
            d="$W/nccl/$par"; [ -d "$d/rank0" ] && d="$d/rank0"
            timeout "$(left)" python3 -m memory_audit report "$d" --trace | tail -25
        done
        # random draws at world size 1 (seed printed), each rank's trace kept and reported
        python3 - > "$W/nccl-draws.txt" <<'PY'
import random, sys
from memory_audit.comparison.sweep import random_config
from memory_audit.prediction.ledger.tensor_parallel import check
seed = random.randrange(10**6); print("seed", seed, file=sys.stderr); rng = random.Random(seed)
for i in range(8):
    while True:
        cfg = dict(parallel=rng.choice(("ddp", "fsdp", "tp", "fsdp+tp")), **random_config(rng))
        cfg["dtype"] = rng.choice(("float16", "bfloat16", "float32"))
        try:
            check(dict(cfg, world_size=1)); break
        except ValueError:
            continue
    print(" ".join(f"--{k}={v}" for k, v in cfg.items()))
PY
        i=0
        while read -r flags; do
            i=$((i+1)); [ "$(left)" -gt 20 ] || break
            echo "== draw $i: $flags"
            timeout "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node=1 train.py --audit --device=cuda \
                --preset=cpu-tiny $flags --audit_dir="$W/nccl" --run_name=draw$i < /dev/null 2>&1 | tail -3
            d="$W/nccl/draw$i"; [ -d "$d/rank0" ] && d="$d/rank0"
            timeout "$(left)" python3 -m memory_audit report "$d" --trace < /dev/null | tail -12
        done < "$W/nccl-draws.txt"
        # the SystemError of full checkpointing with dropout (torch 2.11): audited, then not
        timeout "$(left)" python3 train.py --audit --device=cuda --preset=cpu-tiny --activation_checkpointing=full \
            --dropout=0.1 --audit_dir="$W/nccl" --run_name=ac-dropout 2>&1 | tail -5
        timeout "$(left)" python3 train.py --device=cuda --preset=cpu-tiny --activation_checkpointing=full --dropout=0.1 2>&1 | tail -3
    ) > "$W/nccl.log" 2>&1 &
fi
if [ "$DEVICE" = cuda ]; then
    timeout "$(left)" python3 scripts/gpu_probe.py 3,2 > "$W/probe.log" 2>&1 &
    timeout "$(left)" python3 scripts/gpu_scale_audit.py --out="$W/scale" > "$W/scale.log" 2>&1 &
fi
G1="gpt2-sdpa-fp32-b4 gpt2-bias-b8 gpt2-manual-fp16 xl-manual-bf16"
G2="gpt2-vocab32000-b8 medium-full-b8 large-sdpa-fp16-b8 large-manual-fp16-b10"
if [ "$DEVICE" = cpu ] || [ "${RESERVED:-0}" = 0 ]; then
    :   # the GPT-2-sized reserved rows (RESERVED=1): 11 of them are committed from an H200
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

tar czf "$OUT/logs.tgz" -C "$W" --exclude='keep-*' --exclude='runs*' --exclude=reserved --exclude=zoo --exclude=nccl --exclude=scale .
[ -d "$W/zoo" ] && tar czf "$OUT/zoo.tgz" -C "$W" zoo
[ -d "$W/nccl" ] && tar czf "$OUT/nccl.tgz" -C "$W" nccl
[ -d "$W/reserved" ] && tar czf "$OUT/reserved.tgz" -C "$W" reserved
[ -d "$W/scale" ] && tar czf "$OUT/scale.tgz" -C "$W" scale
for s in a d; do [ -d "$W/keep-$s" ] && tar czf "$OUT/keep-$s.tgz" -C "$W" "keep-$s"; done
echo "== probe"; grep -v USDT "$W/probe.log" | cut -c1-300 | tail -60
echo "== scale"; grep -v USDT "$W/scale.log" | cut -c1-300 | tail -12
for f in "$W"/shadow-?.log; do echo "== $f"; grep -v -e "^ *$" -e USDT "$f" | cut -c1-400 | tail -8; done
echo "== zoo"; grep -v -e USDT -e transformers "$W/zoo.log" | cut -c1-300 | tail -70
echo "== nccl"; cut -c1-300 "$W/nccl.log" 2>/dev/null | tail -60
echo "== tests"; tail -15 "$W/tests.log" 2>/dev/null; tail -3 "$W/tests-oom.log" 2>/dev/null
for f in "$W"/reserved-?.log; do echo "== $f"; cut -c1-300 "$f" | tail -40; done
ls -la "$OUT"
