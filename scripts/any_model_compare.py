"""Any model (issue #28): the peak of step 2 of a few loops that are not our GPT, measured by an
Audit, predicted by the shadow run of the loop itself (shadow/entry.predict_loop), and by torch's own
MemTracker (torch.distributed._tools.mem_tracker) on the same loop in the same process.

    python scripts/any_model_compare.py [--device=cpu|cuda]

Loops (tests/test_api.py, tests/llama.py): a conv net with BatchNorm and Adam, a 2-layer LSTM
tagger with SGD momentum, a Llama-style decoder (RMSNorm, SwiGLU, rotary, GQA through SDPA,
AdamW) in fp32 and bf16 autocast, with and without torch.utils.checkpoint. Prints a markdown
table: measured peak, our error, MemTracker's error (and its categories at its peak). On CUDA
the shadow of an arbitrary loop is not there yet (its CUDA rules cover model.py's ops): that
column says so, and the script still measures and runs MemTracker (scripts/GPU_RUNS.md).
"""

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

from memory_audit import Audit  # noqa: E402
from memory_audit.comparison.reconcile import measure  # noqa: E402


def loops():
    from llama import llama_loop, llama_step
    from test_api import conv_loop, lstm_loop
    plain_step = llama_step("float32")  # forward, cross-entropy, backward, step, zero_grad: any model's
    yield "conv + BatchNorm + Adam", conv_loop, plain_step
    yield "LSTM + SGD momentum", lstm_loop, plain_step
    for dtype in ("float32", "bfloat16"):
        for ck in (False, True):
            yield (f"Llama-style {dtype}" + (" + checkpointing" if ck else ""),
                   (lambda ck=ck: llama_loop(ck)), llama_step(dtype))


def on(device, made):
    """The loop's (model, optimizer, batch) on `device` (the optimizer made again over the moved
    parameters, with the same settings)."""
    if device == "cpu":
        return made
    model, opt, *batch = made
    model.to(device)
    return (model, type(opt)(model.parameters(), **opt.defaults), *[b.to(device) for b in batch])


# the groups a row of the per-category table compares: ours (the audit's categories, the shadow's
# key prefixes) and MemTracker's; "the rest" is everything else (activations, inputs, temporaries)
GROUPS = (("weights and buffers", ("weights", "buffers"), ("param", "buffer")),
          ("gradients", ("grads",), ("grad",)), ("optimizer state", ("optimizer",), ("opt",)))


def grouped(cats, ours=True):
    """{group: bytes} of a category dict (ours, or MemTracker's), "the rest" for the others."""
    out, rest = {}, dict(cats)
    for name, mine, theirs in GROUPS:
        out[name] = sum(rest.pop(c, 0) for c in (mine if ours else theirs))
    out["the rest"] = sum(rest.values())
    return out


def measured_peak(make, step, device):
    model, opt, x, y = on(device, make())
    with tempfile.TemporaryDirectory() as d:
        audit = Audit(model, opt, out_dir=d)
        kept = None  # what the loop holds from one step to the next (its loss, its output)
        for s in range(3):
            with audit.step(s, tensors={"inputs/x": x, "inputs/y": y}):
                kept = step(model, opt, x, y, audit)
        m = measure(d)
    peak = m["phases"]["step2_end"]["replay"]["peak"]
    return peak["bytes"], peak["categories"]


def memtracker_peak(make, step, device):
    from torch.distributed._tools.mem_tracker import MemTracker
    model, opt, x, y = on(device, make())
    kept = step(model, opt, x, y)  # step 1 untracked (the optimizer's state made); the loop holds its output
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        kept = step(model, opt, x, y)
    snap = mt.get_tracker_snapshot("peak")
    dev = next(iter(snap.values()))
    return dev["Total"], {str(k).split(".")[-1].lower(): v for k, v in dev.items() if k != "Total" and v}


def shadow_peak(make, step, device):
    if device != "cpu":
        return None, {}
    from memory_audit.prediction.shadow import entry as shadow_entry, loop as shadow_loop
    r = shadow_entry.predict_loop(make, step)
    return r["peak"], shadow_loop.peak_categories(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    native = args.device == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads"
          + (" (bf16 matmuls through oneDNN: see docs/limits.md)" if native else ""))
    print("| loop | measured peak | shadow run (ours) | MemTracker | MemTracker at its peak |")
    print("| --- | --- | --- | --- | --- |")
    by_category = []
    for name, make, step in loops():
        m, measured_cats = measured_peak(make, step, args.device)
        ours, our_cats = shadow_peak(make, step, args.device)
        theirs, cats = memtracker_peak(make, step, args.device)

        def err(p):
            return "not yet (CPU only)" if p is None else f"{p - m:+,} B ({100 * (p - m) / m:+.2f}%)"
        print(f"| {name} | {m:,} B | {err(ours)} | {err(theirs)} | "
              f"{', '.join(f'{k} {v:,}' for k, v in cats.items())} |", flush=True)
        a, b, c = grouped(measured_cats), grouped(our_cats), grouped(cats, ours=False)
        by_category += [(name, g, a[g], b[g] - a[g] if ours is not None else None, c[g] - a[g]) for g in a]
    print("\nAt each one's peak, by category (measured: the audit's; the rest: activations, inputs, temporaries):\n")
    print("| loop | category | measured | ours | MemTracker |")
    print("| --- | --- | --- | --- | --- |")
    for name, g, m, ours, theirs in by_category:
        print(f"| {name} | {g} | {m:,} B | {'-' if ours is None else f'{ours:+,} B'} | {theirs:+,} B |")


if __name__ == "__main__":
    main()
