"""Tables and figures of the committed rows (snapshots/results/*.jsonl), for analysis.ipynb:
every row predicted again beside what it measured, the levers against their `none` rows, the
compiled step's memory budgets, and the parallel strategies per rank.
"""

import glob
import json
import os

from .views import COLORS, GiB, ROOT, formatted, frame


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
    return formatted(frame(out, ["file", "preset", "batch", "dtype", "attention", "variant", "peak predicted GiB",
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
    return formatted(frame(out, ["setup", "mode", "activations B", "diff vs none B", "peak B", "peak diff vs none B",
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
    return frame(out, ["mode", "activations GiB", "peak GiB", "peak at", "recompute / forward FLOPs"])


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
    return formatted(frame(out, ["setup", "budget", "saved predicted B", "saved measured B", "peak predicted B",
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
    return formatted(frame(out, ["strategy", "rank", "steady predicted B", "steady measured B", "activations predicted B",
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
