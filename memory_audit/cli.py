"""python -m memory_audit {attribute,predict,fit,report,diff,sweep,accuracy} ...

Every failure the user can cause ends in one line on stderr and exit status 2.
"""

import argparse
import json
import os
import pickle
import sys
from ast import literal_eval

from .loader import SnapshotError, find_snapshots, load_meta, load_snapshot
from .report import fmt_bytes, table, write_report, totals_table

GiB = 2 ** 30


# -- attribute --------------------------------------------------------------------------------

def cmd_attribute(args):
    from .attribute import attribute, check_against_meta
    from .timeline import categorize_trace, replay
    from .trace import plain
    pairs, run_dir = find_snapshots(args.path)
    meta = load_meta(run_dir)
    out = {}
    for phase, path in pairs:
        snap = load_snapshot(path)
        res = attribute(snap, meta, phase if meta else None)
        checks = check_against_meta(res, meta, phase)
        out[phase] = {"file": path, "devices": {str(d): r for d, r in res.items()}}
        for dev, r in res.items():
            measured, reported = checks[dev]["memory_allocated"]
            if reported is not None and measured != reported:
                print(f"warning: {phase} device {dev}: active blocks {measured:,} B != memory_allocated {reported:,} B",
                      file=sys.stderr)
            traces = snap.get("device_traces", [])
            if dev < len(traces) and traces[dev]:
                rp = replay(snap, meta, device=dev, max_points=200)
                r["peak_in_trace"] = {k: v for k, v in rp["peak"].items() if k != "lines"}
                if rp["overflow"]:
                    print(f"warning: {phase} device {dev}: the trace ring buffer overflowed or began late; "
                          f"{rp['unmatched_free_bytes']:,} B were freed that the trace never saw allocated",
                          file=sys.stderr)
            if not args.json:
                print(f"\n{phase} (device {dev}): reserved {fmt_bytes(r['reserved_bytes'])}, "
                      f"allocated {fmt_bytes(r['allocated_bytes'])} in {r['blocks']} blocks")
                if args.by == "name":
                    rows = sorted(r["lines"].items(), key=lambda kv: -kv[1])
                    print(table(("name", "bytes", "MiB"), [(k, f"{v:,}", f"{v / 2**20:.2f}") for k, v in rows]))
                else:
                    total = r["reserved_bytes"] or 1
                    print(table(("category", "bytes", "MiB", "share"),
                                [(c, f"{v:,}", f"{v / 2**20:.2f}", f"{100 * v / total:.2f}%")
                                 for c, v in r["categories"].items() if v]))
                if r["unattributed"]:
                    print("largest unattributed blocks: " + "; ".join(
                        f"{b['size']:,} B at {b['frames'] or '(no frames)'} ({b['why']})" for b in r["unattributed"][:3]))
        if args.categorize:
            categorize_trace(snap, meta)
            dest = os.path.splitext(path)[0] + ".categorized.pickle"
            with open(dest, "wb") as f:
                pickle.dump(plain(snap), f, protocol=4)  # lists of dicts, as MemoryViz reads them
            if not args.json:
                print(f"wrote {dest}")
    if args.json:
        text = json.dumps(out, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
            print(f"wrote {args.json}")


# -- predict / fit ---------------------------------------------------------------------------

def _overrides(extra):
    """--KEY=VALUE pairs (train.py keys) -> dict with Python values."""
    from .predict import DEFAULTS
    from model import PRESETS  # the presets live beside the model
    cfg = {}
    for arg in extra:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"expected --KEY=VALUE, got {arg!r}")
        key, value = arg[2:].split("=", 1)
        if key == "preset":
            if value not in PRESETS:
                raise ValueError(f"unknown preset {value!r}; one of {', '.join(PRESETS)}")
            cfg.update(PRESETS[value])
            continue
        if key not in DEFAULTS:
            raise ValueError(f"unknown config key {key!r}")
        try:
            cfg[key] = literal_eval(value)
        except (ValueError, SyntaxError):
            cfg[key] = value
        if isinstance(DEFAULTS[key], bool) and not isinstance(cfg[key], bool):
            raise ValueError(f"--{key} expects True or False, got {value!r}")
    return cfg


def _device(args):
    from .predict import device_facts
    if args.gpu.lower() == "cpu":
        return device_facts("cpu")
    return device_facts("cuda", gpu=args.gpu, total_memory=args.memory)


def cmd_predict(args, extra):
    from .predict import predict
    cfg = _overrides(extra)
    pred = predict(cfg, _device(args), gaps_bytes=args.gaps)
    if args.json:
        print(json.dumps(pred, indent=1))
        return
    t = pred["totals"]
    print(table(("line", "bytes", "dtype", "formula"),
                [(l["key"], f"{l['bytes']:,}", l["dtype"], l["formula"]) for l in pred["ledger"]
                 if "h.0." in l["key"] or not l["key"].startswith(
                     ("activations/h.", "weights/transformer.h.", "grads/transformer.h.", "optimizer/"))]))
    print("(layers 1.. repeat layer 0's lines; --json lists every line)")
    print(table(("total", "bytes", "GiB"), [(k, f"{v:,}", f"{v / GiB:.3f}") for k, v in t.items() if isinstance(v, int)]))
    print(f"peak at: {pred['backward']['peak_at']}")


def cmd_fit(args, extra):
    from .predict import predict
    cfg = _overrides(extra)
    dev = _device(args)
    if not dev.get("total_memory"):
        raise ValueError(f"unknown GPU {args.gpu!r}: give its memory with --memory=BYTES")
    budget = int(dev["total_memory"] * (1 - args.headroom))

    def peak(b, t):
        return predict(dict(cfg, batch_size=b, block_size=t), dev)["totals"]["peak_allocated_bytes"]

    t = cfg.get("block_size", 1024)
    if peak(1, t) > budget:
        print(f"batch 1 at block {t} does not fit: predicted peak {fmt_bytes(peak(1, t))} > budget {fmt_bytes(budget)}")
        return
    lo, hi = 1, 2
    while peak(hi, t) <= budget and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid, t) <= budget else (lo, mid)
    print(f"{args.gpu}: budget {fmt_bytes(budget)} ({100 * (1 - args.headroom):.0f}% of {fmt_bytes(dev['total_memory'])})")
    print(f"largest batch_size at block_size {t}: {lo} (predicted peak {fmt_bytes(peak(lo, t))}; "
          f"batch {lo + 1} needs {fmt_bytes(peak(lo + 1, t))})")
    tb = t
    while peak(cfg.get("batch_size", 1), tb * 2) <= budget and tb < 1 << 20:
        tb *= 2
    print(f"largest power-of-two block_size at batch_size {cfg.get('batch_size', 1)}: {tb}")


# -- report ----------------------------------------------------------------------------------

def cmd_report(args):
    if not os.path.isdir(args.run_dir):
        raise SnapshotError(f"{args.run_dir}: not a run directory")
    rec = write_report(args.run_dir)
    if args.json:
        print(json.dumps(rec["totals"], indent=1))
    else:
        print(totals_table(rec))
        print(f"wrote {os.path.join(args.run_dir, 'report.md')} and report.json")


def cmd_diff(args):
    from .diff import diff, diff_text, load_side
    d = diff(load_side(args.a), load_side(args.b))
    print(json.dumps(d, indent=1) if args.json else diff_text(d))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m memory_audit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("attribute", help="where every byte of a snapshot went")
    a.add_argument("path", help="a snapshot pickle or a run directory")
    a.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to a file, or - for stdout)")
    a.add_argument("--by", choices=("category", "name"), default="category")
    a.add_argument("--categorize", action="store_true", help="also write *.categorized.pickle for MemoryViz")
    for name, helptext in (("predict", "the predicted ledger for a config"),
                           ("fit", "the largest batch that fits a GPU")):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("--gpu", default="H100", help="A100, H100, H200, L4, ... or cpu")
        q.add_argument("--memory", type=int, default=None, help="GPU memory in bytes (unknown GPUs)")
        q.add_argument("--json", action="store_true")
        q.add_argument("--gaps", type=int, default=None, help="measured allocator gaps (bytes) to use")
        q.add_argument("--headroom", type=float, default=0.05, help="fraction of memory kept free (fit)")
    r = sub.add_parser("report", help="predicted vs actual for an audit run")
    r.add_argument("run_dir")
    r.add_argument("--json", action="store_true")
    df = sub.add_parser("diff", help="two audits (or an audit and a `predict --json` file) line by line")
    df.add_argument("a", help="run directory or prediction JSON (the baseline)")
    df.add_argument("b", help="run directory or prediction JSON (with the lever)")
    df.add_argument("--json", nargs="?", const="-", choices=["-"], default=None, help="JSON on stdout")
    s = sub.add_parser("sweep", help="audit a grid of configs and record predicted vs actual")
    s.add_argument("--grid", default=None)
    s.add_argument("--configs", default=None, help="a JSON file: a list of train.py override dicts")
    s.add_argument("--device", default="auto")
    s.add_argument("--out", default=None, help="results .jsonl (default snapshots/results/<device>.jsonl)")
    s.add_argument("--timeout", type=int, default=900)
    s.add_argument("--keep", action="store_true", help="keep each run's snapshots")
    s.add_argument("--audit-dir", default=None, help="where runs go (default snapshots/sweep)")
    t = sub.add_parser("accuracy", help="markdown table of sweep results (the README's table)")
    t.add_argument("results", nargs="+", help="results .jsonl files")
    args, extra = p.parse_known_args(argv)
    try:
        if extra and args.cmd not in ("predict", "fit"):
            raise ValueError(f"unrecognized arguments: {' '.join(extra)}")
        if args.cmd == "attribute":
            cmd_attribute(args)
        elif args.cmd == "predict":
            cmd_predict(args, extra)
        elif args.cmd == "fit":
            cmd_fit(args, extra)
        elif args.cmd == "report":
            cmd_report(args)
        elif args.cmd == "diff":
            cmd_diff(args)
        elif args.cmd == "accuracy":
            from .sweep import accuracy_table
            print("\n\n".join(accuracy_table(path) for path in args.results))
        elif args.cmd == "sweep":
            from .sweep import run_sweep
            run_sweep(args)
    except (SnapshotError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
