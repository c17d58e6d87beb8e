"""Audit step 2 of random library-model loops (scripts/zoo.py) and write one JSONL row each.

    python scripts/zoo_audit.py --device=cuda --n=30 [--seed=S] [--size=tiny|gpt2] \
        --out=rows.jsonl [--keep=DIR]

A row: the spec, the device's name, torch's version, and what the audit measured: step 2's peak
(bytes, entry, categories), memory_allocated and reserved at each phase, every phase's lines and
categories, the unattributed bytes, the trace's entry count, the losses. --keep keeps each audit's
step2_end.pickle (it holds the whole trace: the truth a CPU-only prediction of the same loop is
checked against) and meta.json, when the pickle is under 3 MiB. The seed is new each run and printed; --seed replays it. Stops cleanly
at $DEADLINE (seconds since the epoch) when set.
"""

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import torch  # noqa: E402

import zoo  # noqa: E402
from memory_audit import Audit  # noqa: E402
from memory_audit.comparison.reconcile import measure  # noqa: E402


def _versions():
    """The libraries' versions (a model's code, and so its memory, changes with them)."""
    import importlib.metadata as md
    out = {}
    for name in ("transformers", "timm", "torchvision"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


VERSIONS = _versions()


def row_of(spec, run_dir, losses, seconds):
    m = measure(run_dir)
    phases = {}
    for phase, p in m["phases"].items():
        a = p["attribution"]
        phases[phase] = {"memory_allocated": p["memory_allocated"], "max_memory_allocated": p["max_memory_allocated"],
                         "allocated_bytes": a["allocated_bytes"], "reserved_bytes": a["reserved_bytes"],
                         "categories": a["categories"], "lines": a["lines"],
                         "unattributed_bytes": a["unattributed_bytes"], "balanced": a["balanced"]}
    rep = m["phases"]["step2_end"]["replay"]
    peak = rep["peak"]
    return {"spec": spec, "describe": zoo.describe(spec), "losses": losses, "seconds": round(seconds, 2),
            "peak": {"bytes": peak["bytes"], "index": peak["index"], "categories": peak["categories"]},
            "entries": rep["entries"], "phases": phases}


KEEP_MAX = 3 << 20  # a kept run's step2_end.pickle above this is dropped (its row stays)


def _trim(run_dir, keep_max=KEEP_MAX):
    if not os.path.isdir(run_dir):
        return
    end = os.path.join(run_dir, "step2_end.pickle")
    if not os.path.exists(end) or os.path.getsize(end) > keep_max:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for name in os.listdir(run_dir):
        if name not in ("step2_end.pickle", "meta.json"):
            os.remove(os.path.join(run_dir, name))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--size", default="tiny", choices=["tiny", "gpt2"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep", default=None)
    ap.add_argument("--only", default=None, help="the loops of the seed to run, by index (9,11,33)")
    ap.add_argument("--names", default=None, help="only the drawn loops of these models (gru,lstm,unet): "
                    "drawn until --n of them are found")
    ap.add_argument("--keep-max", type=int, default=KEEP_MAX, help="bytes: a kept step2_end.pickle above this is dropped")
    args = ap.parse_args()
    only = {int(i) for i in args.only.split(",")} if args.only else None
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 20)
    deadline = float(os.environ.get("DEADLINE", "inf"))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    print(f"seed {seed}, device {args.device} ({gpu}), torch {torch.__version__}", flush=True)
    done = failed = 0
    with open(args.out, "a") as f:
        for i, spec in enumerate(zoo.specs(seed, args.n, args.size, names=args.names and args.names.split(","))):
            if only is not None and i not in only:
                continue
            if time.time() > deadline - 20:
                print(f"deadline: stopped before loop {i}", flush=True)
                break
            lib = zoo.missing(spec)
            if lib:
                print(f"{i:3d} skipped ({lib} not installed): {zoo.describe(spec)}", flush=True)
                continue
            run_dir = os.path.join(args.keep, f"zoo-{seed}-{i:02d}") if args.keep else tempfile.mkdtemp()
            t0 = time.time()
            # what the process holds before this loop (earlier loops' segments and cuBLASLt
            # workspaces): a prediction of this loop alone holds none of it
            held = ({"allocated_before": torch.cuda.memory_allocated(), "reserved_before": torch.cuda.memory_reserved()}
                    if args.device == "cuda" else {})
            try:
                model, opt = zoo.build(spec, args.device)
                audit = Audit(model, opt, out_dir=run_dir, step=2, config={"zoo": spec})
                with audit:
                    losses = zoo.train(spec, args.device, audit, model=model, optimizer=opt)
                row = row_of(spec, audit.run_dir, losses, time.time() - t0)
            except Exception as e:  # a loop that fails is a row too (what failed, where)
                failed += 1
                tb = traceback.format_exc().strip().splitlines()
                row = {"spec": spec, "describe": zoo.describe(spec), "error": f"{type(e).__name__}: {e}"[:500],
                       "where": tb[-3:]}
                print(f"{i:3d} FAILED {zoo.describe(spec)}: {row['error'][:200]}", flush=True)
            else:
                done += 1
                s = row["phases"]["step2_end"]
                print(f"{i:3d} {zoo.describe(spec)}: peak {row['peak']['bytes']:,} B, reserved {s['reserved_bytes']:,} B, "
                      f"unattributed {max(p['unattributed_bytes'] for p in row['phases'].values()):,} B, "
                      f"{row['entries']} entries, {row['seconds']} s", flush=True)
            f.write(json.dumps(dict(row, seed=seed, index=i, device=args.device, gpu=gpu, torch=torch.__version__,
                                    versions=VERSIONS, **held)) + "\n")
            f.flush()
            if not args.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
            else:  # step2_end.pickle holds the whole trace; the other phases' files repeat it
                _trim(run_dir, args.keep_max)
            model = opt = audit = None  # this loop's tensors go before the next loop starts
            gc.collect()
            if args.device == "cuda":  # the next loop makes its own cuBLAS workspaces, as in a process of its own
                getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
                torch.cuda.empty_cache()
    print(f"seed {seed}: {done} audited, {failed} failed", flush=True)


if __name__ == "__main__":
    main()
