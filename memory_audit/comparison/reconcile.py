"""Set the prediction beside the measurement, line by line, and say where they differ.

measure(run_dir) reads a run directory (snapshots + meta.json) into plain numbers;
reconcile(run_dir) joins them with the run's prediction (prediction_of: the one its audit stored,
else prediction()) on the same keys.
"""

import os

from ..reading.attribute import attribute
from ..reading.loader import PREDICTED_FILE, find_snapshots, load_meta, load_snapshot, SnapshotError
from ..prediction.ledger import tensor_parallel
from ..prediction.predict import (device_facts, phase_allocated, predicted_snapshot, prediction,  # noqa: F401
                                  published_formulas, traced)
from ..schema import CATEGORIES, PHASES, REPORT_SCHEMA_VERSION
from ..reading.timeline import replay


def device_from_meta(meta):
    d = meta.get("device") or {}
    if d.get("type") != "cuda":
        return device_facts("cpu", torch_version=meta.get("torch_version", ""), cpu=d.get("cpu"))
    name = d.get("name", "")
    gpu = next((g for g in ("H200", "H100", "A100", "L4", "A10G", "V100") if g in name), name)
    cap = d.get("capability")  # absent: the GPU table's, by name
    return device_facts("cuda", gpu=gpu, capability=tuple(cap) if cap else None,
                        torch_version=meta.get("torch_version", ""), env=meta.get("env"),
                        total_memory=d.get("total_memory"))


def measure(run_dir):
    """Attribution of each phase snapshot plus the replayed step. Plain dict, integer bytes."""
    meta = load_meta(run_dir)
    if meta is None:
        raise SnapshotError(f"{run_dir}: no meta.json; `attribute` works on any snapshot, `report` needs an audit run")
    files = dict(find_snapshots(run_dir)[0])
    phases = {}
    for phase in PHASES:
        if phase not in files:
            continue
        snap = load_snapshot(files[phase])
        res = attribute(snap, meta, phase)
        dev = min(res)  # the audited device is the only one in our runs
        info = meta["phases"].get(phase, {})
        phases[phase] = {"attribution": res[dev], "memory_allocated": info.get("memory_allocated"),
                         "max_memory_allocated": info.get("max_memory_allocated")}
        if phase == PHASES[-1]:
            phases[phase]["replay"] = replay(snap, meta, device=dev)
    if not phases:
        raise SnapshotError(f"{run_dir}: none of {', '.join(p + '.pickle' for p in PHASES)} found")
    return {"meta": meta, "phases": phases}


def prediction_of(meta, dev=None):
    """The run's prediction: the one its audit stored in meta.json (train.py --audit stores it after
    the audited steps: no torch is needed to report the run again), else prediction() made now
    (imports torch)."""
    if meta.get("prediction"):
        return meta["prediction"]
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SnapshotError("this run keeps no prediction in its meta.json and torch is not importable here to "
                            "make one: `report` it where torch is installed") from None
    return prediction(meta["config"], dev or device_from_meta(meta))


def store_prediction(run_dir):
    """Make a train.py audit's prediction and keep it in its meta.json (what `report` reads), and
    the shadow run's step as a snapshot in PREDICTED_FILE where the shadow gives the totals:
    after the audited steps, so that what the prediction runs (the shadow's kernel probes, a
    compiled plan) is not in the measured process. Raises ValueError (one line) where the step
    cannot be predicted."""
    import json
    import pickle
    meta = load_meta(run_dir)
    if meta is None or "n_layer" not in (meta.get("config") or {}):
        return None  # another model: Audit(predicted=...) is its prediction
    dev = device_from_meta(meta)
    # the step named as its audit names it (on a GPU, every block run: a repeated step has no names)
    meta["prediction"], shadow_replay = traced(meta["config"], dev, names=True)
    snap_path = os.path.join(run_dir, PREDICTED_FILE)
    if shadow_replay is not None:
        with open(snap_path + ".tmp", "wb") as f:
            pickle.dump(predicted_snapshot(shadow_replay, dev), f, protocol=4)
        os.replace(snap_path + ".tmp", snap_path)
    elif os.path.exists(snap_path):  # an older prediction's trace: not this prediction's
        os.remove(snap_path)
    path = os.path.join(run_dir, "meta.json")
    with open(path + ".tmp", "w") as f:  # the audit's record is replaced whole or not at all
        json.dump(meta, f, indent=1)
    os.replace(path + ".tmp", path)
    return meta["prediction"]


def cost_of(pred):
    """A report's "cost": the recompute and forward matmul FLOPs and the moment the peak is at."""
    t = pred["totals"]
    return {"recompute_flops": t["recompute_flops"], "forward_flops": t["forward_flops"], "peak_at": pred["backward"]["peak_at"]}


def mismatched(rows, phase=None, categories=None, skip=("gaps",)):
    """The rows where prediction and measurement differ: a byte off, or a line present on one
    side only (its diff is None). The one test of "exact" that tests, sweep and report share."""
    return [r for r in rows
            if (phase is None or r["phase"] == phase)
            and (categories is None or r["category"] in categories)
            and r["category"] not in skip
            and (r["diff"] is None or r["diff"] != 0)]


def _row(phase, key, category, predicted, actual, dtype="", formula="", note=""):
    diff = None if predicted is None or actual is None else actual - predicted
    pct = None if diff is None or not predicted else round(100.0 * diff / predicted, 4)
    return {"phase": phase, "key": key, "category": category, "dtype": dtype, "formula": formula,
            "predicted": predicted, "actual": actual, "diff": diff, "diff_pct": pct, "note": note}


def join(pred, phase, actual_lines, actual_categories):
    """Rows (per line, plus gaps) and category rows of one phase; and its predicted memory_allocated()."""
    predicted_lines, ledger_lines, rows = {}, {}, []
    for l in pred["ledger"]:
        if phase in l["phases"]:
            predicted_lines[l["key"]] = predicted_lines.get(l["key"], 0) + l["bytes"]
            ledger_lines.setdefault(l["key"], l)
    for key in list(predicted_lines) + [k for k in actual_lines if k not in predicted_lines]:
        l = ledger_lines.get(key, {})
        rows.append(_row(phase, key, key.split("/", 1)[0], predicted_lines.get(key), actual_lines.get(key),
                         l.get("dtype", ""), l.get("formula", ""), l.get("note", "")))
    allocated = phase_allocated(pred)[phase]
    pred_gaps = allocated - sum(predicted_lines.values())  # the books balance by construction
    rows.append(_row(phase, "gaps", "gaps", pred_gaps, actual_categories.get("gaps", 0),
                     formula="memory_allocated() predicted at the phase minus the lines' bytes: 512 B rounding "
                             "per block and unsplit blocks (" + pred["totals"].get("from", "ledger") + ")"))
    cats = []
    for c in CATEGORIES:
        p = pred_gaps if c == "gaps" else sum(v for k, v in predicted_lines.items() if k.split("/", 1)[0] == c)
        a = actual_categories.get(c, 0)
        if p or a:
            cats.append(_row(phase, c, c, p, a))
    return rows, cats, allocated


def _totals_rows(pred, actual):
    t = pred["totals"]
    out = {}
    for key, pkey in (("steady_state", "steady_state_allocated"), ("activations", "activations_bytes"),
                      ("peak", "peak_allocated_bytes"), ("reserved", "reserved_peak_bytes")):
        a = actual.get(key)
        if key == "reserved" and (key not in actual or pred["device"]["type"] == "cpu"):
            continue  # a stored report from before reserved was measured; CPU: no caching allocator
        out[key] = total_row(t[pkey], a)
    return out


def total_row(predicted, actual):
    """A total beside its measurement: {predicted, actual, diff (actual - predicted), diff_pct (of
    the predicted)}; diff None where a side is missing."""
    if predicted is None or actual is None:
        return {"predicted": predicted, "actual": actual, "diff": None, "diff_pct": None}
    diff = actual - predicted
    return {"predicted": predicted, "actual": actual, "diff": diff,
            "diff_pct": round(100.0 * diff / predicted, 4) if predicted else None}


def refresh_predictions(rec):
    """A stored report with its predicted side recomputed by the current predictor (in place).

    The measured side (rows' actual bytes, categories, totals) is kept as it was measured.
    """
    dev = device_from_meta({"device": rec["device"], "torch_version": rec["torch_version"],
                            "env": rec.get("env")})
    pred = prediction(rec["config"], dev, plan=(rec.get("compiled") or {}).get("plan"))
    rows = []
    for phase, ph in rec["phases"].items():
        actual_lines = {r["key"]: r["actual"] for r in rec["rows"]
                        if r["phase"] == phase and r["actual"] is not None and r["key"] != "gaps"}
        actual_categories = {r["key"]: r["actual"] for r in ph["categories"]}
        phase_rows, cats, allocated = join(pred, phase, actual_lines, actual_categories)
        rows += phase_rows
        ph["categories"] = cats
        ph["allocated"] = _row(phase, "memory_allocated", "total", allocated, ph["allocated"]["actual"])
    rec["rows"] = rows
    rec["totals"] = _totals_rows(pred, {k: v["actual"] for k, v in rec["totals"].items()})
    rec["predicted_device"] = dev
    rec["predicted_from"] = pred["totals"].get("from", "ledger")
    rec["cost"] = cost_of(pred)
    return rec


def _measured_totals(m):
    """The step's measured totals from measure()'s dict: steady state, activations before
    backward, the peak (max_memory_allocated, else the trace's replay) and reserved memory."""
    start = m["phases"].get("step2_start", {})
    bb = m["phases"].get("step2_before_backward", {})
    end = m["phases"].get("step2_end", {})
    peak = end.get("max_memory_allocated")
    return {
        "steady_state": start.get("memory_allocated") if start.get("memory_allocated") is not None
        else start.get("attribution", {}).get("allocated_bytes"),
        "activations": bb.get("attribution", {}).get("categories", {}).get("activations"),
        "peak": peak if peak is not None else end.get("replay", {}).get("peak", {}).get("bytes"),
        # the step's largest memory_reserved() (CUDA; segments are not released inside a step)
        "reserved": max((i.get("memory_reserved") or 0 for i in m["meta"]["phases"].values()), default=0) or None}


def reconcile(run_dir):
    """Predicted vs actual for one audit run: rows, category tables and the three totals."""
    m = measure(run_dir)
    meta = m["meta"]
    dev = device_from_meta(meta)
    pred = prediction_of(meta, dev)
    rows, by_phase = [], {}
    for phase, info in m["phases"].items():
        attr = info["attribution"]
        phase_rows, cats, allocated = join(pred, phase, attr["lines"], attr["categories"])
        rows += phase_rows
        alloc_actual = info["memory_allocated"] if info["memory_allocated"] is not None else attr["allocated_bytes"]
        by_phase[phase] = {"categories": cats, "allocated": _row(phase, "memory_allocated", "total", allocated, alloc_actual),
                           "reserved_bytes": attr["reserved_bytes"], "unattributed_bytes": attr["unattributed_bytes"],
                           "unattributed": attr["unattributed"], "balanced": attr["balanced"],
                           "rules": attr["rules"]}
    end = m["phases"].get("step2_end", {})
    rp = end.get("replay", {})
    totals = _totals_rows(pred, _measured_totals(m))
    t = pred["totals"]
    formulas = published_formulas(meta["config"], dev["workspace_bytes"] * dev["workspaces"])
    replayed = rp.get("peak", {}).get("bytes")
    peak = {k: v for k, v in rp.get("peak", {}).items() if k != "lines"}
    peak["lines"] = dict(list(rp.get("peak", {}).get("lines", {}).items())[:15])
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "run": os.path.basename(os.path.normpath(run_dir)),
        "config": meta["config"], "device": meta["device"], "torch_version": meta["torch_version"],
        "predicted_device": dev,
        "predicted_from": t.get("from", "ledger"),
        "totals": totals,
        "params": t["params"],
        "unattributed_bytes": max((p["unattributed_bytes"] for p in by_phase.values()), default=0),
        "phases": by_phase,
        "rows": rows,
        "peak": peak,
        "series": rp.get("series", []),
        "phase_index": rp.get("phase_index", {}),
        "cost": cost_of(pred),
        "other_formulas": {name: {**f, "actual_activations": totals["activations"]["actual"],
                                  "actual_peak": totals["peak"]["actual"]} for name, f in formulas.items()},
        "checks": {
            "books_balance": all(p["balanced"] for p in by_phase.values()),
            "replayed_peak_bytes": replayed,
            "replayed_peak_equals_max_memory_allocated":
                None if end.get("max_memory_allocated") is None else replayed == end.get("max_memory_allocated"),
            "trace_overflow": rp.get("overflow", False),
        },
        "error": meta.get("error"),
        "env": meta.get("env"),
        "compiled": pred.get("compiled"),  # compile=True: inductor's plan the prediction read
        "korthikanti_per_layer": _korthikanti(meta["config"], rows),
    }


def _korthikanti(cfg, rows):
    """Tensor-parallel runs: Korthikanti et al.'s per-layer terms beside block 0's bytes."""
    if tensor_parallel.tp_size(cfg) == 1:
        return None
    layer = [r for r in rows if r["phase"] == "step2_before_backward" and r["key"].startswith("activations/h.0.")]
    return tensor_parallel.korthikanti_rows(cfg, {r["key"]: r["predicted"] for r in layer},
                                            {r["key"]: r["actual"] for r in layer})


_HAND_OFF = ("loop_calls.py", "overrides.py")  # the audit's torch-function mode, torch's dispatch to it


def step_events(run_dir, phase="step2_start"):
    """[(action, op, bytes, trace entry)] of an audited step from `phase` on, as the trace
    recorded it: "alloc" or "free" (memory_allocated() drops at the free request), the op or
    function that made it (the first frame's name, past the audit's own torch-function mode and
    torch's hand-off to it), its bytes, its index in the trace."""
    from ..reading.trace import A
    meta = load_meta(run_dir)
    files = dict(find_snapshots(run_dir)[0])
    t = load_snapshot(files["step2_end"])["device_traces"][0]
    out = []
    for i in range(meta["phases"][phase]["trace_entries"], t.n):
        a = int(t.act[i])
        if a in (A["alloc"], A["free_requested"], A["free"]):
            frames = t.frames(i)
            name = next((f.get("name") for f in frames if not (f.get("filename") or "").endswith(_HAND_OFF)), "?")
            out.append(("alloc" if a == A["alloc"] else "free", name, int(t.size[i]), i))
    return out


SHADOW_SCOPE = "the shadow run covers train.py's GPT, eager, one process or one torchrun rank"


def against_shadow(run_dir, rec):
    """The audited step beside the shadow run's (issue #26): both as one ordered list of
    allocations and frees, their peaks (on CUDA as the allocator's model counts them) and the
    first event where they part. Runs the shadow (imports torch); {"error": one line} where it
    cannot run."""
    from ..prediction.predict import resolved
    from ..prediction.shadow.step import ShadowError, replayed
    if rec["config"].get("compile"):
        return {"error": f"{SHADOW_SCOPE}: not compile=True"}
    cfg = resolved(rec["config"])
    dev = device_from_meta({"device": rec["device"], "torch_version": rec.get("torch_version", ""),
                            "env": rec.get("env")})
    try:
        sh = replayed(cfg, dev, names=True)
    except (ShadowError, ValueError) as e:
        return {"error": str(e)}
    measured = step_events(run_dir)
    events = sh["result"]["events"]
    return {"measured_events": len(measured), "predicted_events": len(events),
            "measured_peak": rec["totals"]["peak"]["actual"], "predicted_peak": sh["peak"],
            "first_divergence": first_divergence(measured, events),
            "lines_off": shadow_lines_off(rec["rows"], sh["result"])}


def shadow_lines_off(measured, result):
    """The lines of each phase the shadow names otherwise than the audit measured them
    (shadow/step.lines against a report's rows, or a results row's measured_lines {phase: {key:
    bytes}}; the allocator's gaps are not the shadow's to name): ["phase:key shadow B vs
    measured B"], [] where every line agrees."""
    from ..prediction.shadow.step import lines
    if isinstance(measured, list):  # report rows
        by_phase = {}
        for r in measured:
            by_phase.setdefault(r["phase"], {})[r["key"]] = r["actual"]
        measured = by_phase
    out = []
    for phase in result["phases"]:
        theirs = {k: v for k, v in measured.get(phase, {}).items() if v and k != "gaps"}
        if not theirs:
            continue
        ours = lines(result, phase)
        out += [f"{phase}:{k} {ours.get(k, 0)} vs {theirs.get(k, 0)}" for k in sorted(set(ours) | set(theirs))
                if ours.get(k, 0) != theirs.get(k, 0)]
    return out


def first_divergence(measured, predicted):
    """The first place two event sequences part, by action and bytes: {"position", "measured",
    "predicted"} (an event or None past an end), or None when they agree throughout. A run of
    frees with no allocation between them is compared as a set (their order can change no
    level of memory; CPU autocast lets its cached casts go in a hash map's order)."""
    k, n = 0, max(len(measured), len(predicted))
    while k < n:
        m = measured[k] if k < len(measured) else None
        p = predicted[k] if k < len(predicted) else None
        if m is None or p is None or m[0] != p[0]:
            return {"position": k, "measured": m, "predicted": p}
        end = k + 1
        if m[0] == "free":
            while end < n and all(end < len(s) and s[end][0] == "free" for s in (measured, predicted)):
                end += 1
        ours, theirs = sorted(e[2] for e in measured[k:end]), sorted(e[2] for e in predicted[k:end])
        if ours != theirs:  # the first place in the run where they differ in order
            j = next(i for i in range(k, end) if measured[i][2] != predicted[i][2])
            return {"position": j, "measured": measured[j], "predicted": predicted[j]}
        k = end
    return None
