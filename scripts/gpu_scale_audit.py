"""Audit step 2 of benchmarks/scale_llama.py's loop on one GPU (scripts/GPU_RUNS.md item 13): the
deep library model whose prediction `predict-script --gpu --repeat-blocks` builds from shadow runs
of 3 and 4 of its decoder layers.

    python scripts/gpu_scale_audit.py --out=DIR [--size=1.5b] [--seq=2048]

The loop is scale_llama.py's, step for step (the model built on the CPU and moved, AdamW, bf16
autocast, zero_grad(set_to_none=True)), with `Audit(model, optimizer, step=2)` around it. Writes
DIR/scale-<size>.json: every phase's memory_allocated, memory_reserved and max_memory_allocated
as meta.json has them, step 2's peak from the trace, the versions, and the seconds; DIR/run/ keeps
meta.json and step2_end.pickle (the whole trace) for `report --trace` on a machine without a GPU.
Set beside:

    python -m memory_audit predict-script --gpu=H100 --json --repeat-blocks benchmarks/scale_llama.py -- --size=1.5b
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import scale_llama  # noqa: E402
from memory_audit import Audit  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", choices=scale_llama.SIZES, default="1.5b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the plumbing at a tiny shape")
    args = ap.parse_args()
    shape = scale_llama.SIZES[args.size]
    if args.device == "cpu":
        shape = dict(shape, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
        args.seq = min(args.seq, 32)
    t0 = time.time()
    run_dir = os.path.join(args.out, "run")
    cfg = LlamaConfig(max_position_embeddings=8192, **shape)
    model = LlamaForCausalLM(cfg).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    audit = Audit(model, optimizer, out_dir=run_dir, step=2, config={"script": "benchmarks/scale_llama.py",
                                                                      "size": args.size, "seq": args.seq})
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq), device=args.device)
    losses = []
    for step in range(3):
        with audit.step(step):
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            audit.before_backward(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    meta = json.load(open(os.path.join(run_dir, "meta.json")))
    import transformers
    row = {"script": "benchmarks/scale_llama.py", "size": args.size, "seq": args.seq, "losses": losses,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "torch": torch.__version__, "transformers": transformers.__version__,
           "phases": {name: {k: p.get(k) for k in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                                                  "trace_entries", "ring_buffer_full")}
                      for name, p in meta["phases"].items()},
           "error": meta.get("error"), "seconds": round(time.time() - t0, 1)}
    try:
        from memory_audit.comparison.reconcile import measure
        rep = measure(run_dir)["phases"]["step2_end"]["replay"]
        row["peak"] = {"bytes": rep["peak"]["bytes"], "categories": rep["peak"]["categories"], "entries": rep["entries"]}
    except Exception as e:  # the row stands without the trace's reading
        row["peak_error"] = f"{type(e).__name__}: {e}"[:300]
    for name in os.listdir(run_dir):
        if name not in ("meta.json", "step2_end.pickle"):
            os.remove(os.path.join(run_dir, name))
    with open(os.path.join(args.out, f"scale-{args.size}.json"), "w") as f:
        json.dump(row, f, indent=1)
    print(json.dumps({k: row[k] for k in row if k != "peak"}, indent=1))
    print("peak:", row.get("peak", {}).get("bytes"), row.get("peak_error", ""))


if __name__ == "__main__":
    main()
