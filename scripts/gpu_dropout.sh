#!/usr/bin/env bash
# CUDA check of the dropout lines: tiny audits with dropout=0.1, reconciled on the GPU machine.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
for a in "--dtype=float16 --attention=manual" "--dtype=bfloat16 --attention=sdpa" "--dtype=float32 --attention=manual" "--dtype=float32 --attention=sdpa" "--dtype=float16 --attention=sdpa"; do
    python3 train.py --audit --device=cuda --preset=cpu-tiny --batch_size=4 --dropout=0.1 --audit_dir=snapshots/dropout $a 2>&1 | grep -E "^error|^\| peak"
done
python3 - <<'PY'
import glob, json
from memory_audit.reconcile import reconcile
for d in sorted(glob.glob("snapshots/dropout/*")):
    rec = reconcile(d)
    bad = [(r["phase"], r["key"], r["predicted"], r["actual"]) for r in rec["rows"] if r["diff"] and r["category"] != "gaps"]
    print(d.split("/")[-1], "peak", rec["totals"]["peak"], "unattributed", rec["unattributed_bytes"], "mismatches", len(bad), bad[:8])
    if bad:
        meta = json.load(open(d + "/meta.json"))
        print("   ledger h.0.attn:", [(s["key"], s["nbytes"], s["dtype"]) for s in meta["saved_tensors"] if s["key"].startswith(("activations/h.0.attn", "activations/drop"))])
PY
tar -C snapshots -cJf "$OUT/dropout.tar.xz" dropout
