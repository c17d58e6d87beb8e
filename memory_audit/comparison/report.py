"""Format reconciliations and attributions for people: tables in MiB/GiB, exact bytes kept."""

import json
import os

from ..reading.loader import load_meta
from .reconcile import measure, reconcile, total_row
from ..schema import PHASES
from ..text import fmt_bytes, fmt_pct, table  # noqa: F401  (callers import them from here too)

def totals_table(rec):
    rows = []
    for name, v in rec["totals"].items():
        rows.append((name, fmt_bytes(v["predicted"]), fmt_bytes(v["actual"]),
                     "-" if v["predicted"] is None else f"{v['predicted']:,}",
                     "-" if v["actual"] is None else f"{v['actual']:,}",
                     "-" if v["diff"] is None else f"{v['diff']:+,}", fmt_pct(v["diff_pct"])))
    return table(("total", "predicted", "actual", "predicted B", "actual B", "diff B", "diff %"), rows)


def markdown(rec, top=25):
    c = rec["config"]
    dev = rec["device"]
    lines = [f"# Memory report: {rec['run']}", "",
             f"GPT n_layer={c['n_layer']} n_head={c['n_head']} n_embd={c['n_embd']} vocab={c['vocab_size']}, "
             f"batch {c['batch_size']} x block {c['block_size']}, {c['dtype']}, {c['attention']} attention, "
             f"{c['activation']}; {rec['params']:,} parameters; {dev.get('name')} "
             f"(capability {dev.get('capability')}), torch {rec['torch_version']}.", "",
             "## Totals", "", totals_table(rec), "",
             f"Predicted totals from: {rec.get('predicted_from', 'ledger')}; the lines from the byte formula.", "",
             f"Unattributed: {rec['unattributed_bytes']:,} B. Books balance: {rec['checks']['books_balance']}. "
             f"Replayed peak: {rec['checks']['replayed_peak_bytes']:,} B"
             + ("" if rec["checks"]["replayed_peak_equals_max_memory_allocated"] is None else
                f" (equals max_memory_allocated: {rec['checks']['replayed_peak_equals_max_memory_allocated']})") + ".", ""]
    for phase in PHASES:
        ph = rec["phases"].get(phase)
        if not ph:
            continue
        lines += [f"## {phase}: by category", "",
                  table(("category", "predicted", "actual", "diff B", "diff %"),
                        [(r["key"], fmt_bytes(r["predicted"]), fmt_bytes(r["actual"]),
                          "-" if r["diff"] is None else f"{r['diff']:+,}", fmt_pct(r["diff_pct"]))
                         for r in ph["categories"]]), ""]
    from .reconcile import mismatched
    diffs = mismatched(rec["rows"], skip=())
    lines += ["## Lines where prediction and measurement differ", ""]
    if diffs:  # a line on one side only counts with its whole size
        diffs.sort(key=lambda r: -abs(r["diff"] if r["diff"] is not None else (r["predicted"] or r["actual"] or 0)))
        lines.append(table(("phase", "key", "predicted B", "actual B", "diff B", "note"),
                           [(r["phase"], r["key"], "-" if r["predicted"] is None else f"{r['predicted']:,}",
                             "-" if r["actual"] is None else f"{r['actual']:,}",
                             "one side only" if r["diff"] is None else f"{r['diff']:+,}", r["note"])
                            for r in diffs[:top]]))
    else:
        lines.append("None: every line matches to the byte.")
    lines += ["", "## Other published formulas on this run", "",
              table(("formula", "activations", "actual activations", "peak", "actual peak"),
                    [(k, fmt_bytes(v["activations"]), fmt_bytes(v["actual_activations"]), fmt_bytes(v["peak"]),
                      fmt_bytes(v["actual_peak"])) for k, v in rec["other_formulas"].items()]), ""]
    if rec.get("korthikanti_per_layer"):
        lines += korthikanti_section(rec)
    if rec.get("trace"):
        lines += trace_section(rec["trace"])
    pk = rec["peak"]
    if pk.get("lines"):
        lines += ["## Live at the peak", "", f"At trace entry {pk.get('index')} ({pk.get('action')}), "
                  f"{fmt_bytes(pk.get('bytes'))}:", "",
                  table(("allocation", "bytes"), [(k, f"{v:,}") for k, v in list(pk["lines"].items())[:10]]), ""]
    return "\n".join(lines)


def _event(e):
    return "-" if e is None else f"{e[0]} {e[2]:,} B, {e[1]}"


def trace_section(tr):
    """Markdown: the audited step against the shadow run's, event by event."""
    lines = ["## The step as one trace: measured against the shadow run", ""]
    if "error" in tr:
        return lines + [f"Not compared: {tr['error']}.", ""]
    lines.append(f"{tr['measured_events']:,} events measured, {tr['predicted_events']:,} predicted; peak "
                 f"{tr['measured_peak']:,} B measured, {tr['predicted_peak']:,} B shadow-run.")
    off = tr.get("lines_off", [])
    lines += ["", "The shadow names every line of every phase as the audit measured it." if not off else
              f"The shadow names {len(off)} lines otherwise than measured (phase:line shadow vs measured): "
              + "; ".join(off[:8]) + ("; ..." if len(off) > 8 else "") + "."]
    d = tr["first_divergence"]
    if d is None:
        return lines + ["", "They agree event by event: every allocation and free, in order, to the byte.", ""]
    m = d["measured"]
    where = f" (trace entry {m[3]:,})" if m is not None and len(m) > 3 else ""
    return lines + ["", f"First divergence at event {d['position']:,}{where}:", "",
                    table(("side", "event"), [("measured", _event(m)), ("predicted", _event(d["predicted"]))]), ""]


def korthikanti_section(rec):
    """Markdown: Korthikanti et al.'s per-layer terms against block 0 on this rank."""
    c = rec["config"]
    return [f"## Korthikanti et al. 2022, one layer on this rank ({c['parallel']}, t={c['world_size']})", "",
            "Their accounting is 16-bit activations with dropout; the terms group this run's saved tensors "
            "the same way (block 0, step2_before_backward).", "",
            korthikanti_table(rec["korthikanti_per_layer"]), ""]


def korthikanti_table(rows, measured=True):
    """Markdown of tensor_parallel.korthikanti_rows: the paper's bytes, predicted and actual (a
    report), or the predicted bytes alone (`predict`, measured=False)."""
    if measured:
        return table(("term", "formula", "formula B", "predicted B", "actual B", "why they differ"),
                     [(r[0], r[1], f"{r[2]:,}", f"{r[3]:,}", f"{r[4]:,}", r[5]) for r in rows])
    return table(("term", "formula", "formula B", "this run, one rank B", "why they differ"),
                 [(r[0], r[1], f"{r[2]:,}", f"{r[3]:,}", r[5]) for r in rows])


def measured(run_dir):
    """The report of a run the predictor cannot model (any loop through the Audit API): what
    was measured only, in the reconciliation's shape where it has one (totals, phases, peak)."""
    m = measure(run_dir)
    meta, phases = m["meta"], {}
    for phase, info in m["phases"].items():
        a = info["attribution"]
        phases[phase] = {"categories": [{"key": c, "predicted": None, "actual": v, "diff": None, "diff_pct": None}
                                        for c, v in a["categories"].items() if v],
                         "lines": dict(sorted(a["lines"].items(), key=lambda kv: -kv[1])),
                         "reserved_bytes": a["reserved_bytes"], "unattributed_bytes": a["unattributed_bytes"],
                         "balanced": a["balanced"]}
    rp = m["phases"].get(PHASES[-1], {}).get("replay", {})
    actual = {"steady_state": m["phases"].get(PHASES[0], {}).get("attribution", {}).get("allocated_bytes"),
              "activations": m["phases"].get(PHASES[1], {}).get("attribution", {}).get("categories", {}).get("activations"),
              "peak": rp.get("peak", {}).get("bytes")}
    pred = meta.get("predicted") or {}  # Audit(predicted=predict_loop(...)): the loop's shadow run
    before = (pred.get("phase_lines") or {}).get(PHASES[1])
    guess = {"steady_state": pred.get("steady_state"), "peak": pred.get("peak"),
             "activations": None if before is None else sum(v for k, v in before.items() if k.startswith("activations/"))}
    peak = dict(rp.get("peak", {}))
    if pred.get("peak_categories") is not None:
        peak["predicted_categories"] = pred["peak_categories"]
    # each phase's lines predicted beside measured (a summary from before phase_lines: step2_start's)
    for phase, guessed in (pred.get("phase_lines") or ({PHASES[0]: pred["lines"]} if "lines" in pred else {})).items():
        if phase in phases:
            phases[phase]["predicted_lines"] = guessed
    return {"run": os.path.basename(os.path.normpath(run_dir)), "config": meta["config"], "device": meta["device"],
            "torch_version": meta["torch_version"], "predicted": bool(pred), "predicted_by": pred.get("source"),
            "probed": pred.get("probed", []), "unprobed": pred.get("unprobed", []),
            "totals": {k: total_row(guess[k], v) for k, v in actual.items()},
            "unattributed_bytes": max((p["unattributed_bytes"] for p in phases.values()), default=0),
            "phases": phases, "peak": peak,
            "series": rp.get("series", []), "error": meta.get("error")}


def _probes(rec):
    """The kernels the prediction asked for their own buffers, and the ones it could not ask (their
    buffers are missing from the prediction)."""
    out = ""
    if rec.get("probed"):
        out += f" Kernels asked for their own buffers: {', '.join(rec['probed'])}."
    if rec.get("unprobed"):
        out += f" Not asked (their own buffers are missing from the prediction): {', '.join(rec['unprobed'])}."
    return out


def measured_markdown(rec, top=15):
    c = rec["config"]
    how = (f"Predicted by {rec['predicted_by']} (Audit(predicted=...)): the totals, each phase's lines and "
           "the peak's categories." + _probes(rec) if rec.get("predicted") else "Measured only: the ledger predictor models train.py's GPT; "
           "memory_audit.predict_loop predicts any loop (docs/any_model.md).")
    lines = [f"# Memory report: {rec['run']}", "",
             f"{c.get('model_class', 'model')} with {c.get('optimizer_class', 'an optimizer')} on "
             f"{rec['device'].get('name')}, torch {rec['torch_version']}. {how}", "", "## Totals", "",
             totals_table(rec), "", f"Unattributed: {rec['unattributed_bytes']:,} B.", ""]
    for phase, ph in rec["phases"].items():
        guess = ph.get("predicted_lines")
        if guess is not None:
            keys = list(dict.fromkeys(list(ph["lines"]) + list(guess)))
            rows = [(k, f"{guess[k]:,}" if k in guess else "-", f"{ph['lines'][k]:,}" if k in ph["lines"] else "-")
                    for k in keys[:top]]
            lines += [f"## {phase}", "", table(("allocation", "predicted", "bytes"), rows), ""]
            continue
        lines += [f"## {phase}", "", table(("allocation", "bytes"), [(k, f"{v:,}") for k, v in
                                                                      list(ph["lines"].items())[:top]]), ""]
    peak = rec["peak"]
    if peak.get("predicted_categories") is not None and peak.get("categories") is not None:
        guess, got = peak["predicted_categories"], peak["categories"]
        keys = list(dict.fromkeys(list(got) + list(guess)))
        lines += ["## At the peak, by category", "", table(("category", "predicted", "bytes"), [
            (k, f"{guess[k]:,}" if k in guess else "-", f"{got[k]:,}" if k in got else "-") for k in keys]), ""]
    if peak.get("lines"):
        lines += ["## Live at the peak", "", table(("allocation", "bytes"), [
            (k, f"{v:,}") for k, v in list(peak["lines"].items())[:top]]), ""]
    return "\n".join(lines)


def write_report(run_dir, trace=False):
    """Reconcile a run and write report.json and report.md into it. Returns the reconciliation
    (a run of another model than train.py's GPT: what was measured, see `measured`). trace:
    also the step against the shadow run's, event by event (runs it: imports torch)."""
    meta = load_meta(run_dir)
    gpt = meta is None or "n_layer" in (meta.get("config") or {})
    rec = reconcile(run_dir) if gpt else measured(run_dir)
    if trace:
        from .reconcile import SHADOW_SCOPE, against_shadow
        rec["trace"] = against_shadow(run_dir, rec) if gpt else {"error": SHADOW_SCOPE}
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(rec, f, indent=1)
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write(markdown(rec) if gpt else measured_markdown(rec))
    return rec


def summarize_run(run_dir):
    """What train.py prints at the end of an audit: the totals table."""
    rec = write_report(run_dir)
    where = []
    for phase in PHASES:
        ph = rec["phases"].get(phase)
        if ph:
            parts = [f"{r['key']} {fmt_bytes(r['actual'])}" for r in ph["categories"]
                     if r["actual"] and r["key"] not in ("cached_free", "pending_free")]
            where.append(f"{phase}: " + ", ".join(parts))
    return ("where it went (measured):\n" + "\n".join(where)
            + f"\nmemory report ({os.path.join(run_dir, 'report.md')}):\n" + totals_table(rec)
            + f"\nunattributed: {rec['unattributed_bytes']:,} B")


def _mesh_of(run_dir, d):
    """meta.json's torch.distributed record of one rank ({} for runs made before it existed)."""
    try:
        with open(os.path.join(run_dir, d, "meta.json")) as f:
            return json.load(f).get("distributed") or {}
    except (OSError, ValueError):
        return {}


def ranks_report(run_dir):
    """A torchrun audit (run_dir/rank0, rank1, ...): each rank's totals, predicted beside
    measured, side by side, with its place on the DeviceMesh, the largest rank and the sum;
    written to run_dir/report.md and returned. Reads each rank's report.json and meta.json."""
    ranks = sorted((d for d in os.listdir(run_dir) if d.startswith("rank") and d[4:].isdigit()), key=lambda d: int(d[4:]))
    recs = {}
    for d in ranks:
        with open(os.path.join(run_dir, d, "report.json")) as f:
            recs[d] = json.load(f)
    if not recs:
        raise FileNotFoundError(f"{run_dir}: no rank<N>/report.json")
    keys = ("steady_state", "activations", "peak")
    dist = {d: _mesh_of(run_dir, d) for d in recs}
    first = next(iter(recs.values()))["config"]
    mesh = next((m["mesh"] for m in dist.values() if m.get("mesh")), None)
    shape = " x ".join(f"{n} {s}" for n, s in zip(mesh["dim_names"] or [f"dim{i}" for i in range(len(mesh["shape"]))],
                                                 mesh["shape"])) if mesh else "none (DDP or one process)"
    out = [f"# Memory report per rank: {os.path.basename(os.path.normpath(run_dir))}", "",
           f"parallel={first.get('parallel', '?')}, world size {first.get('world_size', len(recs))}, "
           f"backend {next((m['backend'] for m in dist.values() if m), '?')}, DeviceMesh: {shape}.", "",
           "| rank | mesh coordinate | " + " | ".join(f"{k} predicted / actual" for k in keys)
           + " | peak diff B | unattributed |",
           "| --- | --- |" + " --- |" * (len(keys) + 2)]
    for d, rec in recs.items():
        t, m = rec["totals"], dist[d].get("mesh") or {}
        where = ", ".join(f"{n} {c}" for n, c in zip(m.get("dim_names") or (), m.get("coordinate") or ())) or "-"
        out.append(f"| {d[4:]} | {where} | " + " | ".join(f"{t[k]['predicted']:,} / {t[k]['actual']:,}" for k in keys)
                   + f" | {t['peak']['diff']:+,} | {rec['unattributed_bytes']:,} B |")
    peaks = {d: rec["totals"]["peak"]["actual"] for d, rec in recs.items()}
    top = max(peaks, key=peaks.get)
    out += ["", f"Largest peak: rank {top[4:]}, {peaks[top]:,} B. Sum of the ranks' peaks: {sum(peaks.values()):,} B "
            f"over {len(recs)} ranks (each rank's report.md has its lines)."]
    text = "\n".join(out) + "\n"
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write(text)
    return text
