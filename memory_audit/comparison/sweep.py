"""Audit a grid of configurations, each in its own process, and record predicted vs actual.

One row per configuration is appended to snapshots/results/<device>.jsonl. A run that runs out
of memory or crashes is a result too (status "oom" / "error"), and the sweep goes on.
"""

import json
import os
import re
import subprocess
import sys
import time

from ..reading.loader import is_recorded
from .grids import grid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




# SAC op lists drawn by random_config: the default set ("", the key left out) and lists that keep less
SAC_OP_LISTS = ("", "", "mm", "mm,bmm", "addmm,mm", "bmm,_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_flash_attention_for_cpu,_scaled_dot_product_efficient_attention")


def random_config(rng):
    """One single-process CPU config drawn with `rng` (random.Random) over cpu-tiny-sized shapes
    and every knob that changes memory: head sizes 8-64, T 16-384, 1-6 layers, vocabularies
    50-8,191, clipping on or off, dropout up to 0.25, checkpointing every 1st-3rd block with SAC
    op lists, 1-3 micro-steps."""
    n_head = rng.randint(1, 4)
    mode = rng.choice(("none", "none", "full", "selective", "sac"))
    cfg = dict(n_layer=rng.randint(1, 6), n_head=n_head, n_embd=n_head * rng.choice((8, 16, 24, 32, 48, 64)),
               vocab_size=rng.choice((50, 97, 512, 1000, 3001, rng.randint(50, 8191))), batch_size=rng.randint(1, 3),
               block_size=rng.choice((16, 32, 64, 96, 128, 256, 384)), dtype=rng.choice(("float32", "bfloat16")),
               attention=rng.choice(("manual", "sdpa")), activation=rng.choice(("gelu", "relu")),
               dropout=rng.choice((0.0, 0.0, 0.1, 0.25)), bias=rng.choice((False, True)),
               activation_checkpointing=mode, ac_every=rng.choice((1, 1, 2, 3)),
               gradient_accumulation_steps=rng.choice((1, 1, 2, 3)), grad_clip=rng.choice((1.0, 1.0, 0.0)),
               set_to_none=rng.choice((True, False)), keep_logits=rng.choice((True, False)),
               optimizer_impl=rng.choice(("fused", "foreach", "for")))
    ops = rng.choice(SAC_OP_LISTS) if mode == "sac" else ""
    if ops:
        cfg["sac_save_ops"] = ops
    return cfg


BUDGETS = tuple(i / 10 for i in range(11))  # torch.compile's activation memory budget, 0 to 1


def random_compiled_config(rng):
    """One compiled (torch.compile) single-process CPU config drawn with `rng`: random_config's
    space without activation checkpointing (compiled runs do not combine with it), fp32 or bf16,
    an activation memory budget from BUDGETS."""
    cfg = random_config(rng)
    for k in ("activation_checkpointing", "ac_every", "sac_save_ops"):
        cfg.pop(k, None)
    return dict(cfg, compile=True, activation_memory_budget=rng.choice(BUDGETS))


def _args(cfg):
    return [f"--{k}={v}" for k, v in cfg.items() if k != "nproc"]


def _launch(cfg):
    """train.py, or under torchrun with nproc ranks on this host (a sweep config's `nproc`)."""
    train = os.path.join(ROOT, "train.py")
    if "nproc" not in cfg:
        return [sys.executable, train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg['nproc']}", train]


_STEP = re.compile(r"^iter (\d+) \(step (\d+)\): loss ([0-9.naninf-]+), time ([0-9.]+)ms")


def _step_ms(log):
    return {int(m[2]): float(m[4]) for m in map(_STEP.match, log.splitlines()) if m}


_SIGNALLED = re.compile(r"Signal (6|11) \(SIG(ABRT|SEGV)\)")


def _child(cmd, timeout, env):
    """(stdout + stderr, exit status; -1 on timeout) of one child process."""
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        return p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        return (e.stdout or "") if isinstance(e.stdout, str) else "", -1


def run_one(cfg, audit_dir, timeout, overhead):
    """Audit one config in a child process; returns (status, run_dir, log, plain step times)."""
    name = "sweep-" + "-".join(f"{k}{v}" for k, v in cfg.items() if k != "device").replace(".", "p")
    name = re.sub(r"[^\w+-]", "_", name)[:120]  # one directory, whatever the values (paths, too)
    cmd = _launch(cfg) + ["--audit", f"--audit_dir={audit_dir}", f"--run_name={name}"] + _args(cfg)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE") if "nproc" in cfg else None
    t0 = time.time()
    log, rc = _child(cmd, timeout, env)
    if "nproc" in cfg and _SIGNALLED.search(log):  # README: gloo's rare crash inside torch; once more
        log, rc = _child(cmd, timeout, env)
        log = "sweep: a rank died by a signal inside torch; this is the rerun\n" + log
    wall = time.time() - t0
    m = list(re.finditer(r"audit: recording allocator history into (\S+)", log))
    run_dir = m[-1][1] if m else None
    if run_dir and "nproc" in cfg:  # each rank records into run/rank<r>/
        run_dir = os.path.dirname(run_dir)
    if rc != 0:
        status = "oom" if ("OutOfMemory" in log or "out of memory" in log) else ("timeout" if rc == -1 else "error")
    else:
        status = "ok"
    plain = {}
    if overhead and status == "ok" and "nproc" not in cfg:
        p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--max_iters=4"] + _args(cfg),
                           cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        plain = _step_ms(p.stdout)
    return status, run_dir, log, wall, plain


def rows_for(cfg, status, run_dir, log, wall, plain):
    """row_for, once per rank for a torchrun config (config["rank"] says which)."""
    if "nproc" not in cfg or status != "ok":
        return [row_for(cfg, status, run_dir, log, wall, plain)]
    return [row_for(dict(cfg, rank=r), status, os.path.join(run_dir, f"rank{r}"), log, wall, plain)
            for r in range(cfg["nproc"])]


def error_line(log):
    """The child's own one-line error (train.py's `error: ...`, the first when torchrun's ranks
    each said it), else its last line (torchrun's summary ends in a rule of '=')."""
    lines = [line.strip() for line in log.strip().splitlines()]
    own = next((line for line in lines if line.startswith("error: ")), None)
    return (own or (lines or [""])[-1])[:300]


def row_for(cfg, status, run_dir, log, wall, plain):
    from .reconcile import mismatched, reconcile
    row = {"config": cfg, "status": status, "wall_s": round(wall, 1)}
    audited = _step_ms(log)
    row["step_ms"] = {"audited_step2": audited.get(2), "after_recording_step3": audited.get(3),
                      "plain_step2": plain.get(2), "plain_step3": plain.get(3), "plain_step4": plain.get(4)}
    if status != "ok":
        row["error"] = error_line(log)
        return row
    rec = reconcile(run_dir)
    a = rec["config"].get("audit_step", 2)  # compiled CPU audits record step 3
    row["step_ms"].update({"audited": audited.get(a), "after_recording": audited.get(a + 1)})
    row.update({"run": rec["run"], "device": rec["device"].get("name"), "cpu": rec["device"].get("cpu"),
                "torch": rec["torch_version"],
                "params": rec["params"], "totals": rec["totals"], "unattributed_bytes": rec["unattributed_bytes"],
                "checks": rec["checks"], "cost": rec["cost"], "resolved_config": rec["config"],
                "reserved_actual": rec["totals"].get("reserved", {}).get("actual"),
                "outside_pytorch": _outside(run_dir)})
    acts = [r for r in rec["rows"] if r["phase"] == "step2_before_backward" and r["category"] == "activations"]
    steady = [r for r in rec["rows"] if r["phase"] == "step2_start" and r["category"] not in ("gaps",)]
    if rec.get("compiled"):  # inductor's plan: repredict() reads it instead of compiling again
        row["inductor_plan"] = rec["compiled"]["plan"]
    row["activation_lines"] = len(acts)
    row["activation_lines_mismatched"] = sorted(r["key"] for r in mismatched(acts))[:20]
    row["steady_lines"] = len(steady)
    row["steady_lines_mismatched"] = sorted(r["key"] for r in mismatched(steady))[:20]
    row["measured_lines"] = measured_lines(rec)
    row["dump_bytes"] = sum(os.path.getsize(os.path.join(run_dir, f)) for f in os.listdir(run_dir) if is_recorded(f))
    s2, s3 = row["step_ms"]["audited_step2"], row["step_ms"]["after_recording_step3"]
    p3 = row["step_ms"]["plain_step3"]
    row["overhead"] = {"audited_over_plain": None if not (s2 and p3) else round(s2 / p3, 3),
                       "after_recording_over_plain": None if not (s3 and p3) else round(s3 / p3, 3)}
    return row


def _outside(run_dir):
    """The largest memory outside PyTorch the audit measured (CUDA), else None."""
    with open(os.path.join(run_dir, "meta.json")) as f:
        phases = json.load(f).get("phases", {}).values()
    values = [p["outside_pytorch"] for p in phases if p.get("outside_pytorch") is not None]
    return max(values) if values else None


def _runs(configs, audit_dir, timeout, jobs):
    """run_one for every config, `jobs` child processes at a time, results in config order.
    The overhead runs (plain step times) are for GPUs, where one process runs at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(cfg):
        return run_one(cfg, audit_dir, timeout, overhead=cfg.get("device", "auto") != "cpu" and jobs == 1)
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        yield from pool.map(one, configs)


def run_sweep(args):
    configs = grid(args.grid) if args.grid else None
    if args.configs:
        with open(args.configs) as f:
            configs = json.load(f)
    if not configs:
        raise ValueError("give --grid=NAME or --configs=FILE")
    if args.device != "auto":
        configs = [dict(c, device=args.device) for c in configs]
    audit_dir = args.audit_dir or os.path.join(ROOT, "snapshots", "sweep")
    out = args.out
    rows = []
    for i, (cfg, run) in enumerate(zip(configs, _runs(configs, audit_dir, args.timeout, args.jobs))):
        status, run_dir, log, wall, plain = run
        for row in rows_for(cfg, status, run_dir, log, wall, plain):
            row["produced_by"] = "python -m memory_audit sweep " + (f"--grid={args.grid}" if args.grid else f"--configs={args.configs}")
            out = out or _results_file(row)
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
            t = row.get("totals", {})
            print(f"[{i + 1}/{len(configs)}] {status} {json.dumps(row['config'])}"
                  + (f" peak pred {t['peak']['predicted']:,} actual {t['peak']['actual']:,} ({t['peak']['diff_pct']:+.3f}%)"
                     f" act mismatches {len(row['activation_lines_mismatched'])} unattributed {row['unattributed_bytes']}"
                     if t else f" {row.get('error', '')}"), flush=True)
        if run_dir and not args.keep:  # keep meta.json and the reports (each rank's, for torchrun)
            for d, _, files in os.walk(run_dir):
                for f in files:
                    if f.endswith(".pickle"):
                        os.remove(os.path.join(d, f))
    print(f"wrote {len(rows)} rows to {out}")
    return rows


def _results_file(row):
    """snapshots/results/<device tag>.jsonl for a row."""
    dev = (row.get("device") or "cpu").lower()
    tag = "h100" if "h100" in dev else "h200" if "h200" in dev else "a100" if "a100" in dev else re.sub(r"\W+", "-", dev)
    return os.path.join(ROOT, "snapshots", "results", f"{tag}.jsonl")


def row_config(row):
    """(config, device) of a results row: the config train.py ran (its preset expanded, or the
    resolved config the row keeps) and the device facts of the machine it names."""
    from .reconcile import device_from_meta
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from ..prediction.ledger.config import presets
    PRESETS = presets()  # model.py's, read without importing torch
    if "resolved_config" in row:  # what train.py ran, its defaults resolved
        cfg = dict(row["resolved_config"])
    else:
        cfg = dict(row["config"])
        cfg.update({k: v for k, v in PRESETS.get(cfg.pop("preset", None), {}).items() if k not in row["config"]})
    name = row.get("device") or "cpu"
    # a CPU row without its CPU's record was measured where bf16 matmuls do not go through oneDNN
    device = {"type": "cpu", "cpu": row.get("cpu") or PLAIN_CPU} if name == "cpu" else {"type": "cuda", "name": name}
    return cfg, device_from_meta({"device": device})


PLAIN_CPU = {"threads": 2, "onednn_bf16": False, "onednn_fp16": False}  # the committed grids' CPUs


def row_prediction(row):
    """prediction() of the config a results row ran (its preset expanded), on its device."""
    from ..prediction.predict import prediction
    cfg, device = row_config(row)
    return prediction(cfg, device, plan=row.get("inductor_plan"))


def repredict(row, pred=None):
    """The row's totals with `predicted` recomputed by the current predictor (pred: its
    row_prediction() made before).

    Measurements are data; predictions come from the config alone, so a results file stays
    comparable after the predictor improves.
    """
    name = row.get("device") or "cpu"
    t = (pred or row_prediction(row))["totals"]
    out = {"reserved": _pair(t["reserved_peak_bytes"] if name != "cpu" else None, row.get("reserved_actual"))}
    for key, pkey in (("steady_state", "steady_state_allocated"), ("activations", "activations_bytes"),
                      ("peak", "peak_allocated_bytes")):
        actual = row["totals"][key]["actual"]
        diff = None if actual is None else actual - t[pkey]
        out[key] = {"predicted": t[pkey], "actual": actual, "diff": diff,
                    "diff_pct": None if diff is None else round(100.0 * diff / t[pkey], 4)}
    return out


MEASURED_PHASES = ("step2_start", "step2_before_backward", "step2_end")


def measured_lines(rec):
    """{phase: {ledger key: measured bytes}}: every measured line of a report but the gaps, so a
    committed row can be re-predicted line by line, not only on its totals."""
    out = {p: {} for p in MEASURED_PHASES if p in rec["phases"]}
    for r in rec["rows"]:
        if r["phase"] in out and r["key"] != "gaps" and r["actual"] is not None:
            out[r["phase"]][r["key"]] = r["actual"]
    return out


def repredict_lines(row):
    """The lines where the current predictor and a row's stored measurement differ (reconcile's
    rows, gaps left out): [] when every line of every measured phase is exact."""
    from .reconcile import join, mismatched
    pred = row_prediction(row)
    bad = []
    for phase, lines in row["measured_lines"].items():
        bad += mismatched(join(pred, phase, lines, {})[0])
    return bad


def _pair(predicted, actual):
    diff = None if predicted is None or actual is None else actual - predicted
    return {"predicted": predicted, "actual": actual, "diff": diff,
            "diff_pct": None if diff is None else round(100.0 * diff / predicted, 4)}


def variant_label(cfg):
    """What sets a configuration apart beyond model, batch, dtype and attention."""
    return ", ".join(f"{k}={v}" for k, v in cfg.items()
                     if k not in ("preset", "batch_size", "dtype", "attention", "device")) or "-"


def accuracy_rows(path):
    """The rows of a results .jsonl with their totals re-predicted by the current predictor, as
    plain dicts: config, status, run, device, the four totals (steady_state, activations, peak,
    reserved: predicted / actual / diff / diff_pct), reserved_predicted / reserved_actual and
    "from": where the prediction's totals come from (prediction()'s totals["from"])."""
    rows = [json.loads(l) for l in open(path) if l.strip()]
    out = []
    for r in rows:
        row = {"file": os.path.basename(path), "config": r["config"], "status": r["status"], "run": r.get("run"),
               "dtype": r["config"].get("dtype", (r.get("resolved_config") or {}).get("dtype")),
               "device": r.get("device"), "unattributed_bytes": r.get("unattributed_bytes")}
        if r.get("status") == "ok":
            pred = row_prediction(r)
            row["totals"] = repredict(r, pred)
            row["reserved_predicted"] = row["totals"]["reserved"]["predicted"]
            row["reserved_actual"] = row["totals"]["reserved"]["actual"]
            row["from"] = pred["totals"]["from"]
        out.append(row)
    return out


def _pct(v):
    return "-" if v is None else f"{v:+.3f}%"


def accuracy_table(path):
    """Markdown table of a results .jsonl (the README's accuracy table is generated by this),
    with predictions recomputed by the current predictor."""
    from .report import fmt_bytes
    rows = accuracy_rows(path)
    out = ["| model | batch | dtype | attention | variant | steady pred / actual | activations pred / actual | "
           "peak pred / actual | steady diff | peak diff | reserved pred / actual | reserved diff | unattributed | "
           "totals from |", "|" + " --- |" * 14]
    for r in rows:
        c = r["config"]
        variant = variant_label(c)
        if r["status"] != "ok":
            out.append(f"| {c.get('preset')} | {c.get('batch_size')} | {c.get('dtype')} | {c.get('attention')} | "
                       f"{variant} | {r['status']} | | | | | | | | |")
            continue
        t, rv = r["totals"], r["totals"]["reserved"]
        out.append(f"| {c.get('preset')} | {c.get('batch_size')} | {r['dtype']} | {c.get('attention', 'manual')} | {variant} | "
                   f"{fmt_bytes(t['steady_state']['predicted'])} / {fmt_bytes(t['steady_state']['actual'])} | "
                   f"{fmt_bytes(t['activations']['predicted'])} / {fmt_bytes(t['activations']['actual'])} | "
                   f"{fmt_bytes(t['peak']['predicted'])} / {fmt_bytes(t['peak']['actual'])} | "
                   f"{t['steady_state']['diff_pct']:+.3f}% | {t['peak']['diff_pct']:+.3f}% | "
                   f"{fmt_bytes(rv['predicted'])} / {fmt_bytes(rv['actual'])} | {_pct(rv['diff_pct'])} | "
                   f"{r['unattributed_bytes']:,} B | {r['from'].split(' (', 1)[0]} |")
    return "\n".join(out)
