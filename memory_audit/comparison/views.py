"""Tables (pandas) and figures (matplotlib) of a reconciliation, for analysis.ipynb.

Pure functions of the plain dicts that reconcile() and the sweep write; the notebook only
calls these, so everything it shows is reachable from the tests.
"""

import glob
import json
import os


GiB, MiB = 2 ** 30, 2 ** 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLORS = {"weights": "#4c72b0", "buffers": "#8172b3", "grads": "#dd8452", "optimizer": "#55a868",
          "inputs": "#937860", "activations": "#c44e52", "recomputed": "#e8a33d", "workspace": "#64b5cd", "user": "#8de5a1", "temporary": "#da8bc3",
          "baseline": "#a1c9f4", "gaps": "#8c8c8c", "cached_free": "#cccccc", "pending_free": "#bbbbbb", "unattributed": "#000000"}


def default_run_dir(root=ROOT):
    """The newest audit run under snapshots/, else the committed H100 reference run."""
    base = os.path.join(root, "snapshots")
    runs = [d for d in glob.glob(os.path.join(base, "*", "meta.json"))
            if os.path.basename(os.path.dirname(d)) not in ("examples", "results", "sweep")]
    if runs:
        return os.path.dirname(max(runs, key=os.path.getmtime))
    return os.path.join(base, "examples", "h100-gpt2-reference")


def load_reconciliation(run_dir):
    """Reconcile a run from its snapshots; where the pickles are not kept, read its report.json
    and recompute the predicted side with the current predictor."""
    from .reconcile import refresh_predictions
    from .report import write_report
    if os.path.exists(os.path.join(run_dir, "step2_end.pickle")):
        return write_report(run_dir)
    with open(os.path.join(run_dir, "report.json")) as f:
        return refresh_predictions(json.load(f))


def _frame(rows, columns):
    import pandas as pd
    return pd.DataFrame(rows, columns=columns)


_BYTE_COLUMNS = ("predicted", "actual", "diff", "bytes", "activations", "peak")


def formatted(df):
    """A table for reading: bytes with thousands separators and a unit in the column name,
    differences signed, fractions rounded, and "-" where a side has no value (never NaN)."""
    import math
    import numbers

    def cell(col, v):
        if v is None or (isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral) and math.isnan(v)):
            return "-"
        if isinstance(v, (bool, str)) or not isinstance(v, numbers.Real):
            return v
        signed = col.startswith(("diff", "peak diff")) or " vs " in col
        if col in _BYTE_COLUMNS or isinstance(v, numbers.Integral):
            return f"{int(v):+,}" if signed else f"{int(v):,}"
        return f"{v:+.4f}" if "%" in col else f"{v:+,.3f}" if signed else f"{v:,.3f}"
    out = df.copy().astype(object)
    for c in out.columns:
        out[c] = [cell(c, v) for v in df[c]]
    return out.rename(columns={c: f"{c} B" for c in out.columns if c in _BYTE_COLUMNS})


def _with_units(df, cols=("predicted", "actual", "diff")):
    for c in cols:
        if c in df:
            df[f"{c} MiB"] = df[c].map(lambda v: None if v is None else round(v / MiB, 3))
    return df


def setup_table(rec):
    c, d = rec["config"], rec["device"]
    rows = [("model", f"GPT n_layer={c['n_layer']} n_head={c['n_head']} n_embd={c['n_embd']} vocab={c['vocab_size']}"),
            ("parameters", f"{rec['params']:,}"),
            ("batch x block", f"{c['batch_size']} x {c['block_size']} (grad accumulation {c['gradient_accumulation_steps']})"),
            ("dtype", c["dtype"]), ("attention / activation", f"{c['attention']} / {c['activation']}"),
            ("optimizer", f"AdamW {c['optimizer_impl']}, zero_grad(set_to_none={c['set_to_none']})"),
            ("device", d.get("name") if d.get("capability") is None else f"{d.get('name')} (capability {d.get('capability')})"),
            ("torch", rec["torch_version"]), ("run", rec["run"])]
    return _frame(rows, ["", "value"]).set_index("")


def totals_table(rec):
    rows = [(k, v["predicted"], v["actual"], v["diff"], v["diff_pct"]) for k, v in rec["totals"].items()]
    df = _frame(rows, ["total", "predicted", "actual", "diff", "diff %"]).set_index("total")
    df["predicted GiB"] = (df["predicted"] / GiB).round(3)
    df["actual GiB"] = (df["actual"] / GiB).round(3)
    return formatted(df)


def category_table(rec, phase):
    rows = [(r["key"], r["predicted"], r["actual"], r["diff"], r["diff_pct"]) for r in rec["phases"][phase]["categories"]]
    return formatted(_with_units(_frame(rows, ["category", "predicted", "actual", "diff", "diff %"]).set_index("category")))


def named_lines(rec, phase, category=None, layer_prefix=None):
    rows = [(r["key"], r["dtype"], r["formula"], r["predicted"], r["actual"], r["diff"], r["diff_pct"])
            for r in rec["rows"] if r["phase"] == phase and (category is None or r["category"] == category)
            and (layer_prefix is None or r["key"].startswith(layer_prefix))]
    return formatted(_with_units(_frame(rows, ["line", "dtype", "formula", "predicted", "actual", "diff", "diff %"]).set_index("line")))


def steady_state_lines(rec):
    """Named steady-state lines, grouped: one row per kind of line (weights, exp_avg, step, ...)."""
    groups = {}
    for r in rec["rows"]:
        if r["phase"] != "step2_start":
            continue
        parts = r["key"].split("/")
        group = "/".join(parts[:2]) if parts[0] == "optimizer" else parts[0]
        g = groups.setdefault(group, [0, 0, 0])
        g[0] += 1
        g[1] += r["predicted"] or 0
        g[2] += r["actual"] or 0
    rows = [(k, n, p, a, a - p, None if not p else round(100 * (a - p) / p, 4)) for k, (n, p, a) in groups.items()]
    return formatted(_with_units(_frame(rows, ["lines", "count", "predicted", "actual", "diff", "diff %"]).set_index("lines")))


def activations_per_layer(rec):
    per = {}
    for r in rec["rows"]:
        if r["phase"] != "step2_before_backward" or r["category"] != "activations":
            continue
        module = r["key"].split("/")[1]
        layer = ".".join(module.split(".")[:2]) if module.startswith("h.") else module
        p = per.setdefault(layer, [0, 0])
        p[0] += r["predicted"] or 0
        p[1] += r["actual"] or 0
    rows = [(k, p, a, a - p) for k, (p, a) in per.items()]
    return formatted(_with_units(_frame(rows, ["layer", "predicted", "actual", "diff"]).set_index("layer")))


def peak_table(rec, top=12):
    pk = rec["peak"]
    rows = [(k, v) for k, v in list(pk.get("lines", {}).items())[:top]]
    df = _frame(rows, ["live at the peak", "bytes"]).set_index("live at the peak")
    df["MiB"] = (df["bytes"] / MiB).round(2)
    return formatted(df)


def formulas_table(rec):
    t = rec["totals"]
    rows = [("this ledger", t["activations"]["predicted"], t["peak"]["predicted"])]
    rows += [(k, v["activations"], v["peak"]) for k, v in rec["other_formulas"].items()]
    df = _frame(rows, ["formula", "activations", "peak"]).set_index("formula")
    for col, actual in (("activations", t["activations"]["actual"]), ("peak", t["peak"]["actual"])):
        df[f"{col} GiB"] = (df[col] / GiB).round(3)
        df[f"{col} vs actual %"] = None if actual is None else ((df[col] - actual) / actual * 100).round(2)
    return formatted(df)


# -- figures ----------------------------------------------------------------------------------

def fig_categories(rec, phase="step2_before_backward"):
    """Stacked bars: predicted and actual bytes by category at one phase."""
    import matplotlib.pyplot as plt
    cats = [r for r in rec["phases"][phase]["categories"] if r["key"] not in ("cached_free", "pending_free")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, field in enumerate(("predicted", "actual")):
        bottom = 0
        for r in cats:
            v = (r[field] or 0) / GiB
            ax.bar(i, v, bottom=bottom, color=COLORS.get(r["key"], "#999"), label=r["key"] if i == 0 else None)
            bottom += v
    ax.set_xticks([0, 1], ["predicted", "actual"])
    ax.set_ylabel("GiB")
    ax.set_title(f"{rec['run']}: {phase}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def fig_timeline(rec):
    """Bytes per category over the audited step (from the trace), phases and the peak marked."""
    import matplotlib.pyplot as plt
    series = rec.get("series") or []
    fig, ax = plt.subplots(figsize=(9, 4))
    if not series:
        ax.text(0.5, 0.5, "no trace in this run", ha="center")
        return fig
    x = [p["index"] for p in series]
    cats = [c for c in COLORS if any(p["categories"].get(c) for p in series)]
    ys = [[p["categories"].get(c, 0) / GiB for p in series] for c in cats]
    ax.stackplot(x, ys, labels=cats, colors=[COLORS[c] for c in cats])
    for phase, idx in rec.get("phase_index", {}).items():
        ax.axvline(idx, color="k", lw=0.8, ls="--")
        ax.text(idx, ax.get_ylim()[1] * 0.98, phase.replace("step2_", ""), rotation=90, va="top", fontsize=7)
    pk = rec["peak"]
    if pk.get("index") is not None:
        ax.plot([pk["index"]], [pk["bytes"] / GiB], "kv")
        ax.annotate(f"peak {pk['bytes'] / GiB:.3f} GiB", (pk["index"], pk["bytes"] / GiB), fontsize=8,
                    xytext=(5, 5), textcoords="offset points")
    ax.set_xlabel("trace entry")
    ax.set_ylabel("GiB allocated")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


_REPREDICTED = {}  # the notebook's sections ask for the same rows again: each is predicted once


def _repredicted(row):
    """sweep.repredict(row), made once per row and process (what row_config and repredict read
    of the row is the key: its config, device, CPU, plan and measured totals); a fresh copy."""
    import copy
    from .sweep import repredict
    actual = {k: v.get("actual") for k, v in (row.get("totals") or {}).items() if isinstance(v, dict)}
    key = json.dumps([row.get("resolved_config") or row.get("config"), row.get("device"), row.get("cpu"),
                      row.get("inductor_plan"), actual, row.get("reserved_actual")], sort_keys=True, default=str)
    if key not in _REPREDICTED:
        _REPREDICTED[key] = repredict(row)
    return copy.deepcopy(_REPREDICTED[key])


def sweep_rows(results_dir=None):
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir or os.path.join(ROOT, "snapshots", "results"), "*.jsonl"))):
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                r["file"] = os.path.basename(path)
                rows.append(r)
    return rows


def sweep_table(rows):
    """One row per configuration; predictions recomputed by the current predictor."""
    from .sweep import variant_label
    out = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        r["totals"] = _repredicted(r)
        c, t = r["config"], r["totals"]
        variant = variant_label(c)
        out.append((r["file"], c.get("preset"), c.get("batch_size"), _dtype(r), c.get("attention", "manual"), variant,
                    round(t["peak"]["predicted"] / GiB, 3), round(t["peak"]["actual"] / GiB, 3), t["peak"]["diff_pct"],
                    len(r["activation_lines_mismatched"]), r["unattributed_bytes"]))
    return formatted(_frame(out, ["file", "preset", "batch", "dtype", "attention", "variant", "peak predicted GiB",
                                  "peak actual GiB", "peak diff %", "activation lines off", "unattributed B"]))


def fig_sweep(rows):
    """Predicted vs actual peak over the sweep results."""
    import matplotlib.pyplot as plt
    ok = [dict(r, totals=_repredicted(r)) for r in rows if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(5, 5))
    if not ok:
        ax.text(0.5, 0.5, "no sweep results", ha="center")
        return fig
    xs = [r["totals"]["peak"]["predicted"] / GiB for r in ok]
    ys = [r["totals"]["peak"]["actual"] / GiB for r in ok]
    ax.scatter(xs, ys, c=["#c44e52" if r["config"].get("attention", "manual") == "manual" else "#4c72b0" for r in ok])
    hi = max(xs + ys) * 1.05
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.set_xlabel("predicted peak (GiB)")
    ax.set_ylabel("measured max_memory_allocated (GiB)")
    ax.set_title("peak: prediction vs measurement (red manual, blue sdpa)")
    fig.tight_layout()
    return fig


LEVER_KEYS = ("activation_checkpointing", "ac_every", "sac_save_ops")  # what sets a lever row apart from its `none` row


def _dtype(r):
    """The row's dtype as train.py resolved it (a config may leave it to the default)."""
    return (r.get("resolved_config") or r["config"]).get("dtype", "auto")


def _setup(c):
    """A row's setup: its config but the checkpointing keys, as a hashable key."""
    return tuple(sorted((k, str(v)) for k, v in c.items() if k not in LEVER_KEYS))


def _setup_label(r):
    """'cpu-tiny bfloat16 manual' and what else sets the setup apart (block_size=512, n_layer=3...)."""
    from .sweep import variant_label
    c = r["config"]
    extra = variant_label({k: v for k, v in c.items() if k not in LEVER_KEYS})
    return f"{c.get('preset')} {_dtype(r)} {c.get('attention', 'manual')}" + ("" if extra == "-" else f" {extra}")


def _lever_rows(rows):
    """(mode, its row, the `none` row of the same setup) for every measured lever row on one
    process (torchrun rows, which have `nproc`, are section 9's)."""
    ok = [dict(r, totals=_repredicted(r)) for r in rows if r.get("status") == "ok" and "nproc" not in r["config"]]
    base = {}
    for r in ok:
        c = r["config"]
        if c.get("activation_checkpointing", "none") == "none":
            base[_setup(c)] = r
    out = []
    for r in ok:
        c = r["config"]
        b = base.get(_setup(c))
        if b is not None and "activation_checkpointing" in c:
            mode = c["activation_checkpointing"] + (f" (every {c['ac_every']})" if c.get("ac_every", 1) > 1 else "")
            out.append((mode, r, b))
    return out


def levers_table(rows):
    """Measured activations and peak of each checkpointing mode beside its own `none` run, the
    prediction's difference from the measurement, and the recompute it costs."""
    out = []
    for mode, r, b in _lever_rows(rows):
        t, tb = r["totals"], b["totals"]
        cost = r.get("cost") or {}
        share = cost.get("recompute_flops", 0) / cost["forward_flops"] if cost.get("forward_flops") else None
        out.append((_setup_label(r), mode, t["activations"]["actual"], t["activations"]["actual"] - tb["activations"]["actual"],
                    t["peak"]["actual"], t["peak"]["actual"] - tb["peak"]["actual"], t["peak"]["diff"],
                    cost.get("peak_at", ""), None if share is None else round(share, 3)))
    return formatted(_frame(out, ["setup", "mode", "activations B", "diff vs none B", "peak B", "peak diff vs none B",
                                  "diff peak measured - predicted B", "peak at (predicted)", "recompute / forward FLOPs"]))


def levers_predicted(config, device):
    """The prediction for every mode of one config (no measurement: what a GPU run would show),
    with the largest recompute it costs."""
    from ..prediction.predict import prediction
    out = []
    for mode in ("none", "full", "selective", "sac"):
        p = prediction(dict(config, activation_checkpointing=mode), device)
        t = p["totals"]
        out.append((mode, round(t["activations_bytes"] / GiB, 3), round(t["peak_allocated_bytes"] / GiB, 3),
                    p["backward"]["peak_at"], round(t["recompute_flops"] / t["forward_flops"], 3)))
    return _frame(out, ["mode", "activations GiB", "peak GiB", "peak at", "recompute / forward FLOPs"])


def fig_levers(rows):
    """Peak of each mode, measured (bars) and predicted (ticks), per setup."""
    import matplotlib.pyplot as plt
    lever = _lever_rows(rows)
    fig, ax = plt.subplots(figsize=(8, 4))
    if not lever:
        ax.text(0.5, 0.5, "no lever results", ha="center")
        return fig
    fig.set_size_inches(max(8, 0.22 * len(lever)), 6)
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "cpu-tiny ": "", "block_size=": "T=", "n_head=": "H="}

    def label(mode, r):
        text = _setup_label(r)
        for a, b in short.items():
            text = text.replace(a, b)
        return f"{text}: {mode}"
    labels = [label(mode, r) for mode, r, _ in lever]
    actual = [r["totals"]["peak"]["actual"] / 2 ** 20 for _, r, _ in lever]
    predicted = [r["totals"]["peak"]["predicted"] / 2 ** 20 for _, r, _ in lever]
    xs = range(len(lever))
    ax.bar(xs, actual, color=["#999999" if m.startswith("none") else COLORS["recomputed"] for m, _, _ in lever])
    ax.scatter(xs, predicted, marker="_", s=300, color="k", zorder=3, label="predicted")
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    ax.set_yscale("log")  # cpu-tiny's few MiB beside cpu-mini's hundreds
    ax.set_ylabel("peak (MiB, log scale)")
    ax.set_title("what each checkpointing mode buys (CPU runs; bars measured)")
    ax.legend()
    fig.tight_layout()
    return fig


def _budget_rows(rows):
    """The compiled rows (compile=True), predictions recomputed, by device then budget."""
    ok = [dict(r, totals=_repredicted(r)) for r in rows if r.get("status") == "ok" and r["config"].get("compile")]
    return sorted(ok, key=lambda r: (r.get("device") or "cpu", r["config"].get("activation_memory_budget", 1.0)))


def compile_budget_table(rows):
    """torch.compile's activation memory budget: what each budget saves for backward, the step's
    peak (predicted beside measured) and the recomputation it costs (share of the forward's FLOPs)."""
    out = []
    for r in _budget_rows(rows):
        c, t, cost = r["config"], r["totals"], r.get("cost") or {}
        share = cost.get("recompute_flops", 0) / cost["forward_flops"] if cost.get("forward_flops") else None
        dtype = (r.get("resolved_config") or c).get("dtype", "auto")
        out.append((f"{c.get('preset')} b{c.get('batch_size')} {dtype} ({r.get('device') or 'cpu'})",
                    c.get("activation_memory_budget", 1.0), t["activations"]["predicted"], t["activations"]["actual"],
                    t["peak"]["predicted"], t["peak"]["actual"], t["peak"]["diff"],
                    None if share is None else round(share, 3), r["unattributed_bytes"]))
    return formatted(_frame(out, ["setup", "budget", "saved predicted B", "saved measured B", "peak predicted B",
                                  "peak measured B", "peak diff B", "recompute / forward FLOPs", "unattributed B"]))


def fig_compile_budget(rows):
    """The memory/recompute curve of the activation memory budget: saved bytes and peak against
    recomputed FLOPs, predicted (lines) beside measured (open markers), one colour per setup."""
    import matplotlib.pyplot as plt
    ok = _budget_rows(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    if not ok:
        ax.text(0.5, 0.5, "no compiled results", ha="center")
        return fig
    setups = {}
    for r in ok:
        setups.setdefault((r["config"].get("preset"), r["config"].get("batch_size"), r.get("device")), []).append(r)
    for (preset, batch, device), rs in setups.items():
        rs = sorted(rs, key=lambda r: r["cost"]["recompute_flops"])
        x = [r["cost"]["recompute_flops"] / r["cost"]["forward_flops"] for r in rs]
        for what, style in (("activations", "-"), ("peak", "--")):
            pred = [r["totals"][what]["predicted"] / 2 ** 20 for r in rs]
            meas = [r["totals"][what]["actual"] / 2 ** 20 for r in rs]
            line, = ax.plot(x, pred, style, marker=".", label=f"{preset} b{batch} {what} (predicted)")
            ax.scatter(x, meas, s=60, facecolors="none", edgecolors=line.get_color(), label=f"{what} (measured)")
        for r, xi in zip(rs, x):
            ax.annotate(f"{r['config'].get('activation_memory_budget', 1.0):g}", (xi, r["totals"]["activations"]["actual"] / 2 ** 20),
                        textcoords="offset points", xytext=(3, -10), fontsize=7)
    ax.set_xlabel("recomputed FLOPs / forward FLOPs")
    ax.set_ylabel("MiB")
    ax.set_title("torch.compile activation_memory_budget (labels: budget)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _parallel_rows(rows):
    """torchrun rows (one per rank) and the one-process row of the same setup, predictions
    recomputed, in grid order."""
    ok = [r for r in rows if r.get("status") == "ok" and r["file"] == "cpu-parallel.jsonl"]
    return [dict(r, totals=_repredicted(r)) for r in ok]


def _strategy(r):
    c = r.get("resolved_config") or r["config"]
    p = c.get("parallel", "none")
    mesh = f" (tp_size {c['tp_size']})" if p.startswith("fsdp+") else ""
    m = c.get("gradient_accumulation_steps", 1)
    return f"{p}{mesh} x{c.get('world_size', 1)}, {m} micro-step{'s' if m > 1 else ''}"


def parallel_table(rows):
    """Memory per rank of each torchrun strategy (CPU, gloo): predicted beside measured for each
    rank, the lines that differ and what is unattributed."""
    out = []
    for r in _parallel_rows(rows):
        t = r["totals"]
        out.append((_strategy(r), r["config"].get("rank", 0), t["steady_state"]["predicted"], t["steady_state"]["actual"],
                    t["activations"]["predicted"], t["activations"]["actual"], t["peak"]["predicted"], t["peak"]["actual"],
                    t["peak"]["diff"], len(r["activation_lines_mismatched"]) + len(r["steady_lines_mismatched"]),
                    r["unattributed_bytes"]))
    return formatted(_frame(out, ["strategy", "rank", "steady predicted B", "steady measured B", "activations predicted B",
                                  "activations measured B", "peak predicted B", "peak measured B", "peak diff B",
                                  "lines off", "unattributed B"]))


def fig_parallel(rows):
    """Each strategy's largest rank: steady state, activations and peak, measured (bars) and
    predicted (ticks)."""
    import matplotlib.pyplot as plt
    largest = {}
    for r in _parallel_rows(rows):
        k = _strategy(r)
        if k not in largest or r["totals"]["peak"]["actual"] > largest[k]["totals"]["peak"]["actual"]:
            largest[k] = r
    fig, ax = plt.subplots(figsize=(8, 4))
    if not largest:
        ax.text(0.5, 0.5, "no torchrun results", ha="center")
        return fig
    what, width = ("steady_state", "activations", "peak"), 0.27
    for j, w in enumerate(what):
        xs = [i + (j - 1) * width for i in range(len(largest))]
        ax.bar(xs, [r["totals"][w]["actual"] / 2 ** 20 for r in largest.values()], width, label=f"{w} (measured)")
        ax.scatter(xs, [r["totals"][w]["predicted"] / 2 ** 20 for r in largest.values()], marker="_", s=200,
                   color="black", label="predicted" if j == 0 else None)
    ax.set_xticks(range(len(largest)))
    ax.set_xticklabels(list(largest), rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("MiB per rank")
    ax.set_title("cpu-tiny, fp32, batch 2: the largest rank of each strategy (gloo)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def save(fig, run_dir, name):
    """Save a figure as PNG beside the run (skipped where the run directory is read-only)."""
    path = os.path.join(run_dir, name)
    try:
        fig.savefig(path, dpi=110)
    except OSError:
        return None
    return path
