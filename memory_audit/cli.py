"""python -m memory_audit {attribute,predict,fit,plan,report,diff,sweep,accuracy,viz} ...

Every failure the user can cause ends in one line on stderr and exit status 2.
"""

import json
import os
import pickle
import sys

from .reading.loader import SnapshotError, find_snapshots, load_meta, load_snapshot
from .cli_args import device, gpu_config, overrides, parser
from .text import GiB, fmt_bytes, table

# Only what every command needs is imported here; each command imports its own side when it runs,
# so reading a snapshot pays for neither the predictor nor torch.


# -- attribute --------------------------------------------------------------------------------

def _print_attributed(phase, dev, r, by, last):
    """attribute's table of one phase on one device (by "name" or by category), the step's peak
    replayed from the trace (the last phase), and the largest unattributed blocks."""
    print(f"\n{phase} (device {dev}): reserved {fmt_bytes(r['reserved_bytes'])}, "
          f"allocated {fmt_bytes(r['allocated_bytes'])} in {r['blocks']} blocks")
    if by == "name":
        rows = sorted(r["lines"].items(), key=lambda kv: -kv[1])
        print(table(("name", "bytes", "MiB"), [(k, f"{v:,}", f"{v / 2**20:.2f}") for k, v in rows]))
    else:
        total = r["reserved_bytes"] or 1
        print(table(("category", "bytes", "MiB", "share"),
                    [(c, f"{v:,}", f"{v / 2**20:.2f}", f"{100 * v / total:.2f}%")
                     for c, v in r["categories"].items() if v]))
    pk = r.get("peak_in_trace") or {}
    if last and pk.get("index") is not None:  # the step's peak, not only its end
        cats = sorted((pk.get("categories") or {}).items(), key=lambda kv: -kv[1])
        print(f"peak since step2_start (replayed from this trace): {fmt_bytes(pk['bytes'])} "
              f"({pk['bytes']:,} B) at trace entry {pk['index']:,}: "
              + ", ".join(f"{c} {fmt_bytes(v)}" for c, v in cats if v))
    if r["unattributed"]:
        print("largest unattributed blocks: " + "; ".join(
            f"{b['size']:,} B at {b['frames'] or '(no frames)'} ({b['why']})" for b in r["unattributed"][:3]))


def cmd_attribute(args):
    from .reading.attribute import attribute, check_against_meta
    from .reading.event_names import categorize_trace
    from .reading.timeline import replay
    from .reading.trace import plain
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
                _print_attributed(phase, dev, r, args.by, last=phase == pairs[-1][0])
        if args.categorize:
            categorize_trace(snap, meta)
            dest = os.path.splitext(path)[0] + ".categorized.pickle"
            with open(dest, "wb") as f:
                pickle.dump(plain(snap), f, protocol=4)  # lists of dicts, as MemoryViz reads them
            if not args.json:
                print(f"wrote {dest}")
    text = json.dumps(out, indent=1)
    if args.out:
        _check_overwrite(args.out, args.force)
        with open(args.out, "w") as f:
            f.write(text)
        if not args.json:
            print(f"wrote {args.out}")
    if args.json:
        print(text)


def _check_overwrite(path, force):
    """Refuse to replace a file this command did not write (a snapshot, anything else)."""
    from .schema import PHASES
    if force or not os.path.exists(path):
        return
    try:
        with open(path) as f:
            data = json.load(f)
        ours = isinstance(data, dict) and data and set(data) <= set(PHASES)
    except (OSError, ValueError, UnicodeDecodeError):
        ours = False
    if not ours:
        raise ValueError(f"refusing to overwrite {path}: it is not a JSON file `attribute` wrote (--force to replace it)")


# -- predict / fit ---------------------------------------------------------------------------

def cmd_predict(args, extra):
    from .prediction.predict import traced
    cfg = overrides(extra)
    dev = device(args)
    # a trace names its allocations as an audit does (on a GPU, every block run: a repeated step has no names)
    pred, replay = traced(cfg, dev, names=bool(args.trace))
    if args.trace:
        if replay is None:
            raise ValueError(f"--trace: no shadow run for this config: {pred['totals']['from']}")
        pred["shadow"] = _write_trace(replay, dev, args.trace)
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
    print(f"peak, phases and reserved from: {t['from']}")
    print(f"peak at: {pred['backward']['peak_at']}")
    for rule in t.get("unmeasured_on_gpu", []):
        print(f"not measured on a GPU: {rule}")
    if args.trace:
        print(f"wrote the shadow run's {pred['shadow']['events']:,} events of step 2 to {args.trace}")
    from .prediction.ledger import tensor_parallel
    if tensor_parallel.tp_size(pred["config"]) > 1:
        print(_korthikanti_predicted(pred))


def _write_trace(replay, dev, path):
    """Write the shadow run's predicted process (predict.traced's replay) as a snapshot to `path`."""
    if os.path.exists(path) and not path.endswith(".pickle"):
        raise ValueError(f"--trace: refusing to overwrite {path}: not a .pickle file")
    from .prediction.predict import predicted_snapshot
    with open(path, "wb") as f:
        pickle.dump(predicted_snapshot(replay, dev), f, protocol=4)
    return {"peak": replay["peak"], "start_bytes": replay["steady_state"], "reserved": replay["reserved"],
            "events": len(replay["result"]["events"]), "phases": replay["result"]["phases"], "trace": path}


def _korthikanti_predicted(pred):
    """Markdown: Korthikanti et al.'s per-layer terms beside block 0's predicted bytes on one rank."""
    from .prediction.ledger import tensor_parallel
    from .comparison.report import korthikanti_table
    layer = {l["key"]: l["bytes"] for l in pred["ledger"]
             if l["key"].startswith("activations/h.0.") and "step2_before_backward" in l["phases"]}
    return korthikanti_table(tensor_parallel.korthikanti_rows(pred["config"], layer, layer), measured=False)


def cmd_fit(args, extra):
    from .comparison.plan import fit_result
    cfg, dev = gpu_config(args, extra)
    r = fit_result(cfg, dev, args.headroom)
    if args.json:
        print(json.dumps(r, indent=1))
        return
    t = r["block_size"]
    if not r["fits"]:
        print(f"batch 1 at block {t} does not fit: it needs {fmt_bytes(r['batch_1_need'])} > budget {fmt_bytes(r['budget'])}")
        return
    print(f"{r['gpu']}: budget {fmt_bytes(r['budget'])} ({100 * (1 - args.headroom):.0f}% of {fmt_bytes(r['total_memory'])}); "
          f"need = predicted memory_reserved() + {fmt_bytes(r['outside_pytorch'])} outside PyTorch")
    print(f"largest batch_size at block_size {t}: {r['largest_batch_size']} (needs {fmt_bytes(r['its_need'])}; "
          f"batch {r['largest_batch_size'] + 1} needs {fmt_bytes(r['next_batch_need'])})")
    print(f"largest power-of-two block_size at batch_size {r['batch_size']}: {r['largest_pow2_block_size']}")


def cmd_plan(args, extra):
    from .comparison.plan import plan, smallest_miss
    cfg, dev = gpu_config(args, extra)
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs={args.jobs}: at least 1")
    r = plan(cfg, dev, args.headroom, jobs=args.jobs)
    if not r["baseline"]["fits"] and not any(o["fits"] for o in r["options"]):
        raise ValueError(smallest_miss(r))
    if args.json:
        print(json.dumps(r, indent=1))
        return
    b = r["baseline"]
    print(f"{r['gpu']}: budget {fmt_bytes(r['budget'])} ({100 * (1 - args.headroom):.0f}% of {fmt_bytes(r['total_memory'])})")
    print(f"baseline {'fits' if b['fits'] else 'does not fit'}: needs {fmt_bytes(b['need'])} (reserved "
          f"{fmt_bytes(b['reserved_peak'])} + outside PyTorch {fmt_bytes(b['outside_pytorch'])}), "
          f"{'headroom' if b['fits'] else 'over by'} {fmt_bytes(abs(b['headroom_bytes']))}; from the {_source(b['from'])}")
    print(table(("option", "fits", "need", "reserved peak", "headroom", "extra matmul FLOPs", "cost", "sends/step", "from"),
                [(o["option"], "yes" if o["fits"] else "no", fmt_bytes(o["need"]), fmt_bytes(o["reserved_peak"]),
                  fmt_bytes(o["headroom_bytes"]), f"{100 * o['extra_flops_fraction']:.1f}%", f"{o['cost']:.3f}",
                  fmt_bytes(o["comm_bytes_per_step"]) if o["comm_bytes_per_step"] else "-", _source(o["from"]))
                 for o in r["options"]]))
    if any(o["comm_bytes_per_step"] for o in r["options"]):
        print("(parallel options: memory per rank; sends/step: bytes each rank sends per step, ring estimate)")
    said = ("shadow run", "shadow run (blocks repeated)")  # the usual: a table cell says enough
    for reason in sorted({o["from"] for o in [b] + r["options"] if o["from"] not in said}):
        print(f"{_source(reason)} rows: {_why(reason)}")
    rows = {}  # rule -> the rows whose prediction applied it
    for o in [b] + r["options"]:
        for rule in o.get("unmeasured", []):
            rows.setdefault(rule, []).append(o["option"])
    for rule, names in rows.items():
        print(f"not measured on a GPU ({', '.join(names)}): {rule}")


def _why(text):
    """totals["from"]'s parentheses as one line: "inductor's plan (a (b); c)" -> "a (b); c",
    "shadow run (x) (y)" -> "x; y"."""
    rest = text[len(_source(text)):].strip()
    if rest.startswith("(") and rest.endswith(")"):
        rest = rest[1:-1]
    return rest.replace(") (", "; ")


def _source(text):
    """A plan row's numbers, prediction()'s totals["from"] without its parenthesis (printed below
    the table): "shadow run" or "inductor's plan"."""
    return text.split(" (", 1)[0]


# -- report ----------------------------------------------------------------------------------

def cmd_report(args):
    from .comparison.report import totals_table, write_report
    if not os.path.isdir(args.run_dir):
        raise SnapshotError(f"{args.run_dir}: not a run directory")
    if args.repredict:
        from .comparison.reconcile import store_prediction
        store_prediction(args.run_dir)
    rec = write_report(args.run_dir, trace=args.trace)
    if args.json:
        print(json.dumps(rec["totals"], indent=1))
    else:
        print(totals_table(rec))
        if args.trace:
            from .comparison.report import trace_section
            print("\n".join(trace_section(rec["trace"])[2:]).strip())
        print(f"wrote {os.path.join(args.run_dir, 'report.md')} and report.json")


def cmd_diff(args):
    from .comparison.diff import diff, diff_text, load_side
    d = diff(load_side(args.a), load_side(args.b))
    print(json.dumps(d, indent=1) if args.json else diff_text(d))


# allowed values of the config keys that take a word, for --help
def cmd_accuracy(args):
    from .comparison.sweep import accuracy_rows, accuracy_table
    if args.json:
        print(json.dumps([row for path in args.results for row in accuracy_rows(path)], indent=1))
    else:
        print("\n\n".join(accuracy_table(path) for path in args.results))


def cmd_sweep(args):
    from .comparison.sweep import run_sweep
    run_sweep(args)


def cmd_viz(args):
    from .reading.viz import write_viz
    span = None
    if args.window is not None:
        a, sep, b = args.window.partition(":")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise ValueError(f"--window={args.window}: expected START:END, two trace entry indexes")
        span = (int(a), int(b))
    for path, what in write_viz(args.path, args.phase, args.view, args.out, args.detail, span):
        print(f"wrote {path}: {what}")

def _script_totals(args, summary):
    """predict-script's table of the recorded step's totals (on a GPU as memory_allocated() and
    memory_reserved() count them)."""
    counted = summary.get("allocator") or summary
    rows = [("steady state (its start)", counted["steady_state"]), ("before backward", counted["before_backward"]),
            ("peak", counted["peak"]), ("end", counted["end"])]
    if args.gpu:
        rows.append(("reserved (memory_reserved())", counted["reserved"]))
    where = f"CUDA on one {args.gpu}" if args.gpu else "CPU"
    if args.world_size:
        where = f"rank {args.rank} of {args.world_size} {args.gpu}s"
    print(table((f"step {args.step}, counted from 0 ({where}, fake tensors)", "bytes", "MiB"),
                [(k, f"{v:,}", f"{v / 2**20:.2f}") for k, v in rows if v is not None]))
    return counted


def cmd_predict_script(args):
    """Shadow-run a training script as written (prediction/shadow/script.py) and print step 2."""
    from .prediction.shadow.step import snapshot
    from .prediction.shadow.replay import snapshot as gpu_snapshot
    from .prediction.shadow.entry import shadow_file
    from .prediction.shadow.known_values import parse_assume
    script = args.script
    if not os.path.isfile(script) or not script.endswith(".py"):
        raise ValueError(f"{script}: not a Python file")
    if args.world_size is not None and not args.gpu:
        raise ValueError("--world_size: ranks are shadow-run for a GPU; give --gpu=NAME too")
    if args.trace and os.path.exists(args.trace) and not args.trace.endswith(".pickle"):
        raise ValueError(f"--trace: refusing to overwrite {args.trace}: not a .pickle file")
    rest = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    if args.repeat_blocks and (not args.gpu or args.world_size is not None):
        raise ValueError("--repeat-blocks: blocks are repeated for one GPU only; give --gpu=NAME without --world_size")
    s = shadow_file(script, rest, repeat=args.repeat_blocks, device="cuda" if args.gpu else "cpu", gpu=args.gpu,
                    step=args.step, assume=parse_assume(args.assume), world_size=args.world_size, rank=args.rank)
    summary = s.summary
    if args.trace:
        with open(args.trace, "wb") as f:
            pickle.dump(gpu_snapshot(s.result) if args.gpu else snapshot(s.result), f, protocol=4)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items()}, indent=1, default=str))
        return
    counted = _script_totals(args, summary)
    if getattr(s, "depth_note", None) == "repeated":
        print(summary["source"])
    if args.gpu:
        dev = summary["device"]
        need = counted["reserved"] + dev["outside_pytorch"]
        print(f"{args.gpu}: need {need / 2**30:.2f} GiB (memory_reserved() + {dev['outside_pytorch'] / 2**20:.0f} MiB "
              f"outside PyTorch, an estimate) of {dev['total_memory'] / 2**30:.2f} GiB: "
              f"{'fits' if need <= dev['total_memory'] else 'does not fit'}")
        for rule in summary["unmeasured"]:
            print(f"not measured on a GPU: {rule}")
    print(table(("at the peak", "bytes"), [(k, f"{v:,}") for k, v in sorted(summary["peak_categories"].items(),
                                                                          key=lambda kv: -kv[1])]))
    reads = {}
    for p in summary["placeholders"]:
        reads[(p["read"], p["where"])] = reads.get((p["read"], p["where"]), 0) + 1
    for (read, where), n in sorted(reads.items(), key=lambda kv: -kv[1]):
        print(f"placeholder: {read} answered without data {n} time(s) at {where}")
    sizes = {}
    for z in summary["sizes"]:
        key = (z["op"], z["where"], z["from"].split(", call")[0])
        sizes.setdefault(key, []).append(z["rows"] if "rows" in z else "x".join(map(str, z["shape"][0])))
    for (op, where, why), rows in sizes.items():
        print(f"data-dependent size: {op} took {', '.join(map(str, rows[:8]))}{' ...' if len(rows) > 8 else ''} "
              f"{'row(s)' if op == 'nonzero' else '(its first output)'} from {why} at {where}")
    if args.trace:
        print(f"wrote the shadow run's {len(s.result['events']):,} events of step {args.step} to {args.trace}")


COMMANDS = {"attribute": cmd_attribute, "predict": cmd_predict, "fit": cmd_fit, "plan": cmd_plan, "report": cmd_report,
            "diff": cmd_diff, "accuracy": cmd_accuracy, "sweep": cmd_sweep, "viz": cmd_viz,
            "predict-script": cmd_predict_script}


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    argv = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(argv) - 1, 0, -1):  # `--json -` is the flag: JSON on stdout
        if argv[i] == "-" and argv[i - 1] == "--json":
            del argv[i]
    args, extra = p.parse_known_args(argv)
    try:
        if extra and args.cmd not in ("predict", "fit", "plan"):
            raise ValueError(f"unrecognized arguments: {' '.join(extra)}")
        if args.cmd in ("predict", "fit", "plan"):
            COMMANDS[args.cmd](args, extra)
        else:
            COMMANDS[args.cmd](args)
    except (SnapshotError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
