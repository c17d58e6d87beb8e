"""Two runs side by side, line by line: what a lever added and what it took away.

A side is an audit run directory (measured) or a prediction (predict --json's output, or a
dict from predict()). Both become the same plain shape, so any two can be compared:

  {"name", "kind": "audit"|"prediction", "config",
   "phases": {phase: {"lines": {key: bytes}, "categories": {category: bytes}}},
   "totals": {"steady_state", "activations", "peak"}}

diff(a, b) gives b - a for every line, category and total; a line on one side only counts
with 0 bytes on the other, so what went away is negative and what is new is positive.
"""

import json
import os

from ..schema import CATEGORIES, PHASES


def side_from_run(run_dir):
    from .reconcile import measure
    m = measure(run_dir)
    phases = {p: {"lines": dict(info["attribution"]["lines"]),
                  "categories": {c: v for c, v in info["attribution"]["categories"].items() if v}}
              for p, info in m["phases"].items()}
    start, bb, end = (m["phases"].get(p, {}) for p in PHASES)
    peak = end.get("max_memory_allocated")
    if peak is None:
        peak = end.get("replay", {}).get("peak", {}).get("bytes")
    steady = start.get("memory_allocated")
    if steady is None:
        steady = start.get("attribution", {}).get("allocated_bytes")
    return {"name": os.path.basename(os.path.normpath(run_dir)), "kind": "audit", "config": m["meta"]["config"],
            "phases": phases, "totals": {"steady_state": steady, "peak": peak,
                                         "activations": bb.get("attribution", {}).get("categories", {}).get("activations")}}


def side_from_prediction(pred, name="prediction"):
    phases = {}
    for phase in PHASES:
        lines, cats = {}, {}
        for l in pred["ledger"]:
            if phase in l["phases"]:
                lines[l["key"]] = lines.get(l["key"], 0) + l["bytes"]
                cats[l["category"]] = cats.get(l["category"], 0) + l["bytes"]
        phases[phase] = {"lines": lines, "categories": cats}
    t = pred["totals"]
    return {"name": name, "kind": "prediction", "config": pred["config"], "phases": phases,
            "totals": {"steady_state": t["steady_state_allocated"], "activations": t["activations_bytes"],
                       "peak": t["peak_allocated_bytes"]}}


def load_side(path):
    """A run directory, or a JSON file that `predict --json` wrote."""
    if os.path.isdir(path):
        return side_from_run(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: neither a run directory nor a prediction JSON ({e})") from None
    if not isinstance(data, dict) or "ledger" not in data or "totals" not in data:
        raise ValueError(f"{path}: not a prediction (write one with `predict --json`)")
    return side_from_prediction(data, os.path.basename(path))


def _pair(a, b):
    return {"a": a, "b": b, "diff": (b or 0) - (a or 0) if a is not None or b is not None else None}


def diff(a, b):
    """b - a per phase (lines and categories) and for the three totals. Plain dict, int bytes."""
    phases = {}
    for phase in PHASES:
        pa, pb = a["phases"].get(phase), b["phases"].get(phase)
        if pa is None or pb is None:
            continue
        la, lb = pa["lines"], pb["lines"]
        keys = list(la) + [k for k in lb if k not in la]
        lines = [dict(key=k, **_pair(la.get(k, 0), lb.get(k, 0))) for k in keys]
        lines = [l for l in lines if l["diff"]]
        lines.sort(key=lambda l: (l["diff"] > 0, -abs(l["diff"])))  # what went away first
        ca, cb = pa["categories"], pb["categories"]
        cats = {c: _pair(ca.get(c, 0), cb.get(c, 0)) for c in CATEGORIES if ca.get(c) or cb.get(c)}
        phases[phase] = {"lines": lines, "categories": cats,
                         "removed": sum(1 for l in lines if not l["b"]), "added": sum(1 for l in lines if not l["a"])}
    totals = {k: _pair(a["totals"].get(k), b["totals"].get(k)) for k in ("steady_state", "activations", "peak")}
    changed = {k: v for k, v in b["config"].items()
               if a["config"].get(k) != v and k not in ("run_name", "audit_dir", "losses_out")}
    return {"a": {"name": a["name"], "kind": a["kind"]}, "b": {"name": b["name"], "kind": b["kind"]},
            "config_changes": changed, "totals": totals, "phases": phases}


def diff_text(d, top=25):
    from .report import fmt_bytes, table
    out = [f"A = {d['a']['name']} ({d['a']['kind']}), B = {d['b']['name']} ({d['b']['kind']}); "
           f"B differs in {json.dumps(d['config_changes']) or '{}'}"]
    out.append(table(("total", "A", "B", "B - A"), [(k, fmt_bytes(v["a"]), fmt_bytes(v["b"]), f"{v['diff']:+,}")
                                                    for k, v in d["totals"].items() if v["diff"] is not None]))
    for phase, ph in d["phases"].items():
        out.append(f"\n{phase}: {ph['removed']} lines only in A, {ph['added']} only in B")
        cats = [(c, f"{v['a']:,}", f"{v['b']:,}", f"{v['diff']:+,}") for c, v in ph["categories"].items() if v["diff"]]
        if cats:
            out.append(table(("category", "A", "B", "B - A"), cats))
        rows = [(l["key"], f"{l['a']:,}", f"{l['b']:,}", f"{l['diff']:+,}") for l in ph["lines"][:top]]
        if rows:
            out.append(table(("line", "A", "B", "B - A"), rows))
        if len(ph["lines"]) > top:
            out.append(f"({len(ph['lines']) - top} more lines; --json lists them all)")
    return "\n".join(out)
