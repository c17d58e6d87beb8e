"""Tables (pandas) and figures (matplotlib) of one run's reconciliation, for analysis.ipynb
(the committed rows' tables and figures: sweep_views).

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


def frame(rows, columns):
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
    return frame(rows, ["", "value"]).set_index("")


def totals_table(rec):
    rows = [(k, v["predicted"], v["actual"], v["diff"], v["diff_pct"]) for k, v in rec["totals"].items()]
    df = frame(rows, ["total", "predicted", "actual", "diff", "diff %"]).set_index("total")
    df["predicted GiB"] = (df["predicted"] / GiB).round(3)
    df["actual GiB"] = (df["actual"] / GiB).round(3)
    return formatted(df)


def category_table(rec, phase):
    rows = [(r["key"], r["predicted"], r["actual"], r["diff"], r["diff_pct"]) for r in rec["phases"][phase]["categories"]]
    return formatted(_with_units(frame(rows, ["category", "predicted", "actual", "diff", "diff %"]).set_index("category")))


def named_lines(rec, phase, category=None, layer_prefix=None):
    rows = [(r["key"], r["dtype"], r["formula"], r["predicted"], r["actual"], r["diff"], r["diff_pct"])
            for r in rec["rows"] if r["phase"] == phase and (category is None or r["category"] == category)
            and (layer_prefix is None or r["key"].startswith(layer_prefix))]
    return formatted(_with_units(frame(rows, ["line", "dtype", "formula", "predicted", "actual", "diff", "diff %"]).set_index("line")))


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
    return formatted(_with_units(frame(rows, ["lines", "count", "predicted", "actual", "diff", "diff %"]).set_index("lines")))


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
    return formatted(_with_units(frame(rows, ["layer", "predicted", "actual", "diff"]).set_index("layer")))


def peak_table(rec, top=12):
    pk = rec["peak"]
    rows = [(k, v) for k, v in list(pk.get("lines", {}).items())[:top]]
    df = frame(rows, ["live at the peak", "bytes"]).set_index("live at the peak")
    df["MiB"] = (df["bytes"] / MiB).round(2)
    return formatted(df)


def formulas_table(rec):
    t = rec["totals"]
    rows = [("this ledger", t["activations"]["predicted"], t["peak"]["predicted"])]
    rows += [(k, v["activations"], v["peak"]) for k, v in rec["other_formulas"].items()]
    df = frame(rows, ["formula", "activations", "peak"]).set_index("formula")
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


def save(fig, run_dir, name):
    """Save a figure as PNG beside the run (skipped where the run directory is read-only)."""
    path = os.path.join(run_dir, name)
    try:
        fig.savefig(path, dpi=110)
    except OSError:
        return None
    return path
