#!/usr/bin/env bash
# GPU_RUNS.md's items 1, 2, 5, 6 and 8 side by side in ONE command of under 10 minutes (every stream
# stops SECONDS_FOR_WORK seconds after the start, default 470). From the repo root, with the
# machine's own python3:
#   OUT=$OUT SECONDS_FOR_WORK=470 bash scripts/gpu_batch.sh
# Streams (STREAMS=name,name,... runs only those; unset: all but vittiny), all started at once, each
# stopped at the deadline (one process's CUDA allocator never sees another's, so running them
# together changes no byte measured):
#   - shadow: 2 x scripts/shadow_check.py --device=cuda (random tiny configs, seeds printed; one
#     stream at fp16, which the CPU draw lacks), every audited step kept with its whole trace (--keep);
#   - compile: 2 x scripts/compile_check.py --device=cuda (random compiled tiny configs, fp32/bf16
#     and fp16, every budget), each audited step kept with its whole trace and inductor's CUDA plan;
#   - tests: tests/test_cuda.py and tests/test_nodynamo.py (the OOM test last and alone: it fills
#     the GPU);
#   - zoo, rnn, zoogpt2, vit, vittiny: scripts/zoo_audit.py: random library-model loops
#     (transformers, timm, torchvision, plain torch) audited, tiny ones kept with their traces; GRU,
#     LSTM and U-Net loops at more shapes (kept); GPT-2-sized ones (rows only); GPT-2-sized encoder
#     ViTs (kept; VIT_GPT2_N of them); tiny encoder ViTs (kept; VIT_N);
#   - ddp, draws: NCCL at world size 1: DDP with set_to_none True and False at 1 and 2 micro-steps,
#     each twice (when DDP's old bucket is freed), and random draws (random_config's space, every
#     strategy; seed printed), each rank's trace kept and `report --trace` on it;
#   - reduce: scripts/gpu_reduce.py (REDUCE_ARGS: e.g. --strided --n=200);
#   - gpt2c: GPT-2 small compiled, step 2 kept (GPT2C="name:flag,flag name:flag ...");
#   - probe: scripts/gpu_probe.py 2: who imports torch._dynamo in a shadow step (tests/test_nodynamo.py);
#   - SCALE=1: scripts/gpu_scale_audit.py (step 2 of benchmarks/scale_llama.py's 1.5B loop audited);
#   - RESERVED=1: scripts/gpu_reserved.sh with TRACE=1 on GPT-2-sized rows as well.
# Writes to $OUT: logs.tgz, keep-{a,d}.tgz, compile.tgz, gpt2c.tgz, zoo.tgz, vit.tgz, nccl.tgz (and
# scale.tgz, reserved.tgz): 10 archives with SCALE=1 and RESERVED=1, 8 without.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=2
OUT=${OUT:-/tmp/gpu_out}
W=${W:-/tmp/gpu_batch}
DEVICE=${DEVICE:-cuda}   # DEVICE=cpu: a dry run of this script's plumbing on a machine without a GPU
rm -rf "$W"; mkdir -p "$OUT" "$W"
export DEADLINE=$(( $(date +%s) + ${SECONDS_FOR_WORK:-470} ))
left() { local l=$(( DEADLINE - $(date +%s) )); if [ "$l" -gt 1 ]; then echo "$l"; else echo 1; fi; }
want() { if [ -z "${STREAMS:-}" ]; then [ "$1" != vittiny ]; else [[ ",$STREAMS," == *",$1,"* ]]; fi; }
python3 setup.py -q build_ext --inplace > "$W/build.log" 2>&1 || echo "compiled core not built (pure Python path)" >> "$W/build.log"
{ python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$W/env.txt" 2>&1
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1); MEM_MIB=${MEM_MIB:-0}
cat "$W/env.txt"

for s in a d; do
    want shadow || break
    extra=(); [ "$s" = d ] && extra=(--dtype=float16)
    [ "$DEVICE" = cpu ] && [ "$s" = d ] && extra=()
    timeout "$(left)" python3 scripts/shadow_check.py --device="$DEVICE" --n=60 "${extra[@]}" \
        --out="$W/shadow-$s.jsonl" --keep="$W/keep-$s" > "$W/shadow-$s.log" 2>&1 &
done
for s in b e; do  # compiled steps: the draw's dtypes, then fp16
    want compile || break
    extra=(); [ "$s" = e ] && [ "$DEVICE" = cuda ] && extra=(--dtype=float16)
    timeout "$(left)" python3 scripts/compile_check.py --device="$DEVICE" --n=30 "${extra[@]}" \
        --out="$W/compile-$s.jsonl" --keep="$W/compile/keep-$s" > "$W/compile-$s.log" 2>&1 &
done
if [ "$DEVICE" = cuda ] && want tests; then
    timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -n 3 tests/test_cuda.py tests/test_nodynamo.py \
        -k "not oom" > "$W/tests.log" 2>&1 &
fi
want zoo && timeout "$(left)" python3 scripts/zoo_audit.py --device="$DEVICE" --n=60 --out="$W/zoo.jsonl" \
    --keep="$W/zoo/tiny" > "$W/zoo.log" 2>&1 &
want rnn && timeout "$(left)" python3 scripts/zoo_audit.py --device="$DEVICE" --n=16 --names=gru,lstm,unet \
    --out="$W/zoo-rnn-unet.jsonl" --keep="$W/zoo/rnn-unet" > "$W/zoo-rnn-unet.log" 2>&1 &
want vittiny && timeout "$(left)" python3 scripts/zoo_audit.py --device="$DEVICE" --n=${VIT_N:-12} --names=encoder_vit \
    --out="$W/zoo-vit-tiny.jsonl" --keep="$W/vit/tiny" > "$W/zoo-vit-tiny.log" 2>&1 &
if [ "$DEVICE" = cuda ]; then
    want zoogpt2 && timeout "$(left)" python3 scripts/zoo_audit.py --device=cuda --size=gpt2 --n=10 \
        --out="$W/zoo-gpt2.jsonl" > "$W/zoo-gpt2.log" 2>&1 &
    want vit && timeout "$(left)" python3 scripts/zoo_audit.py --device=cuda --size=gpt2 --n=${VIT_GPT2_N:-2} --names=encoder_vit \
        --keep-max=$((40 << 20)) --out="$W/zoo-gpt2-vit.jsonl" --keep="$W/vit" > "$W/zoo-gpt2-vit.log" 2>&1 &
fi
if [ "$DEVICE" = cuda ] && want ddp; then
    (   # DDP at world size 1: when the old bucket is freed, by set_to_none and micro-steps, each twice
        D6="--n_layer=2 --n_head=1 --n_embd=16 --vocab_size=50 --batch_size=2 --block_size=32 --dtype=float16
            --attention=manual --activation=relu --bias=True --activation_checkpointing=sac --ac_every=1
            --grad_clip=0.0 --keep_logits=True --optimizer_impl=for --sac_save_ops=addmm,mm"
        for stn in False True; do for acc in 2 1; do for rep in 1 2; do
            name=ddp-stn$stn-acc$acc-$rep; [ "$(left)" -gt 20 ] || break 3
            echo "== $name"
            timeout "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node=1 train.py --audit --device=cuda \
                --preset=cpu-tiny --parallel=ddp $D6 --set_to_none=$stn --gradient_accumulation_steps=$acc \
                --audit_dir="$W/nccl" --run_name=$name < /dev/null 2>&1 | tail -2
            d="$W/nccl/$name"; [ -d "$d/rank0" ] && d="$d/rank0"
            timeout "$(left)" python3 -m memory_audit report "$d" --trace < /dev/null | tail -10
        done; done; done
    ) > "$W/nccl-ddp.log" 2>&1 &
fi
if [ "$DEVICE" = cuda ] && want draws; then
    (
        # random draws at world size 1 (seed printed), each rank's trace kept and reported
        python3 - > "$W/nccl-draws.txt" <<'PY'
import random, sys
from memory_audit.comparison.sweep import random_config
from memory_audit.prediction.ledger.tensor_parallel import check
seed = random.randrange(10**6); print("seed", seed, file=sys.stderr); rng = random.Random(seed)
for i in range(14):
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
    ) > "$W/nccl.log" 2>&1 &
fi
if [ "$DEVICE" = cuda ]; then
    want reduce && timeout "$(left)" python3 scripts/gpu_reduce.py --out="$W/reduce.jsonl" ${REDUCE_ARGS:-} > "$W/reduce.log" 2>&1 &
    # GPT-2 small compiled, step 2's traces kept: GPT2C runs (name:flags, flags comma-separated), by default
    # nanoGPT's defaults (bf16) and fp16 at budget 0.5
    GPT2C=${GPT2C:-"defaults:--dtype=bfloat16 fp16-b05:--dtype=float16,--activation_memory_budget=0.5"}
    want gpt2c && (
        for run in $GPT2C; do
            [ "$(left)" -gt 60 ] || break
            timeout "$(left)" python3 train.py --audit --compile=True --preset=gpt2 --batch_size=12 --attention=sdpa \
                --audit_dir="$W/gpt2c" --run_name="${run%%:*}" $([[ $run == *:* ]] && echo "${run#*:}" | tr , ' ') \
                < /dev/null 2>&1 \
                | grep -v USDT | tail -14
        done
    ) > "$W/gpt2c.log" 2>&1 &
    want probe && timeout "$(left)" python3 scripts/gpu_probe.py 2 > "$W/probe.log" 2>&1 &
    [ "${SCALE:-0}" = 1 ] && timeout "$(left)" python3 scripts/gpu_scale_audit.py --out="$W/scale" > "$W/scale.log" 2>&1 &
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
if [ "$DEVICE" = cuda ] && want tests; then
    timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k oom \
        > "$W/tests-oom.log" 2>&1
fi

tar czf "$OUT/logs.tgz" -C "$W" --exclude='keep-*' --exclude='runs*' --exclude=reserved --exclude=zoo --exclude=nccl \
    --exclude=scale --exclude=compile --exclude=vit --exclude=gpt2c .
for d in zoo vit nccl compile gpt2c reserved scale keep-a keep-d; do [ -d "$W/$d" ] && tar czf "$OUT/$d.tgz" -C "$W" "$d"; done
echo "== reduce"; grep -v USDT "$W/reduce.log" | cut -c1-200 | tail -12
echo "== gpt2c"; cut -c1-300 "$W/gpt2c.log" | tail -30
echo "== probe"; grep -v USDT "$W/probe.log" | cut -c1-300 | tail -60
[ -f "$W/scale.log" ] && { echo "== scale"; grep -v USDT "$W/scale.log" | cut -c1-300 | tail -12; }
for f in "$W"/shadow-?.log "$W"/compile-?.log; do echo "== $f"; grep -v -e "^ *$" -e USDT "$f" | cut -c1-400 | tail -8; done
for f in "$W"/zoo*.log; do echo "== $f"; grep -v -e USDT -e transformers "$f" | cut -c1-250 | tail -30; done
echo "== nccl"; cut -c1-300 "$W/nccl-ddp.log" "$W/nccl.log" 2>/dev/null | grep -v -e "^ *$" | tail -90
echo "== tests"; tail -15 "$W/tests.log" 2>/dev/null; tail -3 "$W/tests-oom.log" 2>/dev/null
for f in "$W"/reserved-?.log; do echo "== $f"; cut -c1-300 "$f" | tail -40; done
ls -la "$OUT"
