#!/usr/bin/env bash
# GPT-2-sized CUDA audits kept as compact traces (issues #13, #26). From the repo root:
#   OUT=$OUT bash scripts/gpu_reserved.sh [NAME ...]     (no NAME: every row below, in order)
# For each row: `train.py --audit`, then the measured reserved memory (the snapshot's segments),
# the allocator model fed the run's own requests in order (allocator_model.replay_requests: equal to
# the measured when the rules are right, as on the committed tiny audits and 6 foreign traces) and
# the prediction's (the shadow run's); writes $OUT/reserved/<name>.json.gz (every trace entry's action code, size
# and op, the first frame: about 1 MB a run, to commit under snapshots/results/reserved-traces/)
# and the run's report.json/meta.json beside it. With TRACE=1 also `report RUN --trace` (the shadow
# run against the measured step, event by event) into $OUT/reserved/<name>.trace.txt.
# The runs themselves (large pickles) stay in $RUNS (default /tmp/reserved-runs). DEADLINE (epoch
# seconds) stops each command there and skips a row that would start with under a minute left.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
RUNS=${RUNS:-/tmp/reserved-runs}
mkdir -p "$OUT/reserved" "$RUNS"
declare -A ROWS=(
  # the reserved-memory misses (#13), gpt2 manual fp16 beside its bf16 twin (same tensors, 0.53 GiB
  # less reserved), one xl row the forward's temporaries bring from -3.7% to -0.8% (out of sample)
  [medium-sdpa-fp16]="--preset=gpt2-medium --batch_size=12 --dtype=float16 --attention=sdpa"
  [medium-sdpa-bf16]="--preset=gpt2-medium --batch_size=12 --dtype=bfloat16 --attention=sdpa"
  [medium-manual-fp16]="--preset=gpt2-medium --batch_size=12 --dtype=float16 --attention=manual"
  [gpt2-manual-bf16]="--preset=gpt2 --batch_size=12 --dtype=bfloat16 --attention=manual"
  [gpt2-manual-fp16]="--preset=gpt2 --batch_size=12 --dtype=float16 --attention=manual"
  [xl-manual-bf16]="--preset=gpt2-xl --batch_size=4 --dtype=bfloat16 --attention=manual"
  # H100 rows whose peak the shadow run misses by 1.6-8.7 MB (scripts/shadow_h100.py, #26)
  [large-sdpa-fp16-b8]="--preset=gpt2-large --batch_size=8 --dtype=float16 --attention=sdpa"
  [large-sdpa-bf16-b8]="--preset=gpt2-large --batch_size=8 --dtype=bfloat16 --attention=sdpa"
  [large-manual-fp16-b8]="--preset=gpt2-large --batch_size=8 --dtype=float16 --attention=manual"
  [gpt2-sdpa-fp16]="--preset=gpt2 --batch_size=12 --dtype=float16 --attention=sdpa"
  # out of sample for the H200 rules (e1a5f2b, dea00f6, c2af077, e6532a9): efficient attention's
  # backward at head size 64 and T 1024, the embedding sort at another vocabulary and N, cuBLASLt
  # at GPT-2 size, full checkpointing's recomputation at size
  [gpt2-sdpa-fp32-b4]="--preset=gpt2 --batch_size=4 --dtype=float32 --attention=sdpa"
  [gpt2-vocab32000-b8]="--preset=gpt2 --batch_size=8 --vocab_size=32000 --dtype=bfloat16 --attention=sdpa"
  [gpt2-bias-b8]="--preset=gpt2 --batch_size=8 --bias=True --dtype=bfloat16 --attention=sdpa"
  [medium-full-b8]="--preset=gpt2-medium --batch_size=8 --activation_checkpointing=full --dtype=bfloat16 --attention=sdpa"
  [large-manual-fp16-b10]="--preset=gpt2-large --batch_size=10 --dtype=float16 --attention=manual"
  [gpt2-manual-fp16-nonone]="--preset=gpt2 --batch_size=12 --dtype=float16 --attention=manual --set_to_none=False"
  [gpt2-manual-fp16-nonone-nologits]="--preset=gpt2 --batch_size=12 --dtype=float16 --attention=manual --set_to_none=False --keep_logits=False"
)
ORDER="gpt2-sdpa-fp32-b4 gpt2-vocab32000-b8 gpt2-bias-b8 medium-full-b8 medium-sdpa-fp16 medium-sdpa-bf16 medium-manual-fp16 gpt2-manual-bf16 gpt2-manual-fp16 xl-manual-bf16
       large-sdpa-fp16-b8 large-sdpa-bf16-b8 large-manual-fp16-b8 gpt2-sdpa-fp16 large-manual-fp16-b10 gpt2-manual-fp16-nonone gpt2-manual-fp16-nonone-nologits"
left() { echo $(( ${DEADLINE:-9999999999} - $(date +%s) )); }
lim() { local l; l=$(left); if [ "$l" -gt 1 ]; then echo "$l"; else echo 1; fi; }  # timeout 0 would mean none
run() {  # name
    local name=$1 dir="$RUNS/$1"
    [ -n "${ROWS[$name]+x}" ] || { echo "no row named $name" >&2; return 2; }
    [ "$(left)" -gt 60 ] || { echo "$name: skipped, $(left) s left"; return 0; }
    rm -rf "$dir"
    # shellcheck disable=SC2086
    timeout "$(lim)" python3 train.py --audit --audit_dir="$RUNS" --run_name="$name" ${ROWS[$name]} 2>&1 | tail -2
    [ -f "$dir/step2_end.pickle" ] || { echo "$name: no step-2 snapshot"; return 1; }
    cp "$dir/report.json" "$OUT/reserved/$name.report.json"
    cp "$dir/meta.json" "$OUT/reserved/$name.meta.json"
    timeout "$(lim)" python3 - "$dir" "$OUT/reserved/$name.json.gz" <<'PY'
import gzip, json, sys
from memory_audit.reading.allocator_model import replay_requests
from memory_audit.reading.loader import load_meta, load_snapshot
from memory_audit.prediction.predict import prediction
from memory_audit.comparison.reconcile import device_from_meta
run, out = sys.argv[1], sys.argv[2]
snap = load_snapshot(run + "/step2_end.pickle")
tr = snap["device_traces"][0]
r = replay_requests(tr.act, tr.addr, tr.size, stream=tr.stream)
meta = load_meta(run)
pred = prediction(meta["config"], device_from_meta(meta))["totals"]["reserved_peak_bytes"]
measured = sum(s["total_size"] for s in snap["segments"])
print(run.split("/")[-1], "measured", measured, "requests replayed", r["reserved"], "trace's own segments", r["trace_reserved"],
      "predicted", pred, "segments model/trace", len(r["segments"]), len(r["trace_segments"]))
ops = [((tr.entry(i).get("frames") or [{}])[0].get("name", "")) for i in range(len(tr))]
with gzip.open(out, "wt") as f:
    json.dump({"config": meta["config"], "measured_reserved": measured, "replayed": r, "predicted": pred,
               "act": [int(a) for a in tr.act], "size": [int(s) for s in tr.size], "addr": [int(a) for a in tr.addr],
               "op": ops}, f)
PY
    if [ "${TRACE:-0}" = 1 ]; then
        timeout "$(lim)" python3 -m memory_audit report "$dir" --trace > "$OUT/reserved/$name.trace.txt" 2>&1
        tail -3 "$OUT/reserved/$name.trace.txt"
    fi
}
# shellcheck disable=SC2086
for name in ${*:-$ORDER}; do run "$name"; done
ls -la "$OUT/reserved"
