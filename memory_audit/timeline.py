"""Attribution over time: replay a snapshot's trace and name what is live at every moment.

The trace of the last phase (step2_end) holds every allocation since recording began, so one
replay gives bytes per category over the audited step, the peak and what was live at it. On a
CPU run this is how the peak is measured at all.

Names come from the phases: at each phase's position in the trace (meta.json's
`trace_entries`), the allocations live at that moment are matched to that phase's registry and
saved-tensor ledger by address. Addresses are reused all the time, so a name sticks to the one
allocation live at that moment, never to the address.
"""

from .allocator_sim import BlockSim
from .attribute import trace_workspaces
from .schema import CATEGORIES

_FREE = ("free_requested", "free")  # memory_allocated() drops at free_requested, not free_completed


def _phase_names(meta):
    """[(trace index, {addr: name})] for each phase with a known trace position."""
    cuts = []
    for phase, info in (meta or {}).get("phases", {}).items():
        n = info.get("trace_entries")
        if n is None or info.get("ring_buffer_full"):
            continue
        names = {r["data_ptr"]: r["name"] for r in reversed(info.get("registry", []))}
        if phase == "step2_before_backward":
            for s in meta.get("saved_tensors", []):
                names.setdefault(s["data_ptr"], s["key"])
        cuts.append((n, names, phase))
    cuts.sort(key=lambda c: c[0])
    return cuts


def name_events(trace, cuts):
    """Name each alloc event by the phases at which it is live.

    Returns (event_name {index: name}, freed_events {index}, unmatched_free_bytes).
    """
    cut_at = {}
    for n, names, _ in cuts:
        cut_at.setdefault(n, []).append(names)
    live, event_name, freed_events = {}, {}, set()
    unmatched_free = 0

    def name_live(i):
        for names in cut_at.get(i, ()):
            for addr, idx in live.items():
                if addr in names and idx not in event_name:
                    event_name[idx] = names[addr]

    for i, e in enumerate(trace):
        name_live(i)
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = i
        elif a in _FREE:
            idx = live.pop(e["addr"], None)
            if idx is None:
                unmatched_free += e["size"]
            else:
                freed_events.add(idx)
    name_live(len(trace))
    return event_name, freed_events, unmatched_free


def categorize_trace(snap, meta=None):
    """Set `category` on every trace entry (in place), so MemoryViz colours by category."""
    cuts = _phase_names(meta)
    for trace in snap.get("device_traces", []):
        workspaces = trace_workspaces(trace, meta)
        event_name, freed, _ = name_events(trace, cuts)
        live = {}
        for i, e in enumerate(trace):
            a = e["action"]
            if a == "alloc":
                name = event_name.get(i)
                cat = name.split("/", 1)[0] if name else (
                    "workspace" if e["addr"] in workspaces else "temporary" if i in freed else "unknown")
                live[e["addr"]] = cat
                e["category"] = cat
            elif a in ("free_requested", "free_completed", "free"):
                e["category"] = live.get(e["addr"], "unknown")
                if a != "free_requested":
                    live.pop(e["addr"], None)
            else:
                e["category"] = "unknown"
    return snap


def replay(snap, meta=None, device=0, start_phase="step2_start", max_points=4000):
    """Replay one device's trace.

    Returns a dict: entries, start_index (where `start_phase` begins), baseline_bytes (live
    before the trace began), series (downsampled points: index, time_us, allocated, reserved,
    {category: bytes}), phase_index {phase: index}, peak {bytes, index, time_us, categories,
    lines (largest named allocations live at the peak)}, overflow (bool).
    """
    traces = snap.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    cuts = _phase_names(meta)
    workspaces = trace_workspaces(trace, meta)

    event_name, freed_events, unmatched_free = name_events(trace, cuts)
    def category_of(idx):
        name = event_name.get(idx)
        if name is None:
            e = trace[idx]
            if e["addr"] in workspaces:
                return "workspace", "workspace/cublas"
            return ("temporary", None) if idx in freed_events else ("unattributed", None)
        cat = name.split("/", 1)[0]
        return (cat if cat in CATEGORIES else "unattributed"), name

    # baseline: bytes live before the first entry (0 when recording began before any allocation)
    end_allocated = sum(b["size"] for s in snap["segments"] if s.get("device", 0) == device
                        for b in s["blocks"] if b["state"] == "active_allocated")
    end_reserved = sum(s["total_size"] for s in snap["segments"] if s.get("device", 0) == device)
    seg_net = sum(e["size"] if e["action"] in ("segment_alloc", "segment_map") else -e["size"]
                  for e in trace if e["action"] in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"))
    reserved = end_reserved - seg_net
    cpu = bool((snap.get("allocator_settings") or {}).get("cpu_profiler_timeline"))

    # pass 2: running totals
    start = 0
    phase_index = {phase: n for n, _, phase in cuts}
    if start_phase in phase_index:
        start = phase_index[start_phase]
    totals = {c: 0 for c in CATEGORIES}
    allocated = 0  # relative to what was live before the trace began; fixed up below
    live, sim = {}, BlockSim()
    step = max(1, (len(trace) - start) // max_points)
    series, peak = [], {"bytes": -1, "index": None}
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "alloc":
            cat, _ = category_of(i)
            # the block, as memory_allocated() counts it (CPU: no caching allocator, exact bytes)
            size = e["size"] if cpu else sim.alloc(e["addr"], e["size"])
            live[e["addr"]] = (i, size, cat)
            totals[cat] += size
            allocated += size
        elif a in _FREE:
            hit = live.pop(e["addr"], None)
            if hit is not None:
                totals[hit[2]] -= hit[1]
                allocated -= hit[1]
            else:  # allocated before the trace began
                totals["unattributed"] -= e["size"]
                allocated -= e["size"]
            if a == "free":
                sim.complete(e["addr"])
        elif a == "free_completed":
            sim.complete(e["addr"])
        elif a in ("segment_alloc", "segment_map"):
            reserved += e["size"]
            sim.segment_alloc(e["addr"], e["size"])
        elif a in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
            sim.segment_free(e["addr"], e["size"])
        if i + 1 < start:
            continue
        if allocated > peak["bytes"]:
            peak = {"bytes": allocated, "index": i, "time_us": e.get("time_us"),
                    "categories": {c: v for c, v in totals.items() if v}, "_live": dict(live)}
        if (i - start) % step == 0 or i == len(trace) - 1:
            series.append({"index": i, "time_us": e.get("time_us"), "allocated": allocated,
                           "reserved": reserved, "categories": {c: v for c, v in totals.items() if v}})
    # what was live before the first entry (0 when recording began before any allocation)
    baseline = end_allocated - allocated
    for point in series + ([peak] if peak["index"] is not None else []):
        point["allocated" if "allocated" in point else "bytes"] += baseline
        if baseline:
            point["categories"]["unattributed"] = point["categories"].get("unattributed", 0) + baseline
    if peak["index"] is not None:
        lines = {}
        for idx, size, cat in peak.pop("_live").values():
            _, name = category_of(idx)
            key = name or cat
            lines[key] = lines.get(key, 0) + size
        if baseline:
            lines["unattributed/before-trace"] = baseline
        peak["lines"] = dict(sorted(lines.items(), key=lambda kv: -kv[1]))
        peak["action"] = trace[peak["index"]]["action"]
        peak["frames"] = [f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')}:{f.get('name')}"
                          for f in (trace[peak["index"]].get("frames") or [])[:4]]
    return {"entries": len(trace), "start_index": start, "baseline_bytes": baseline,
            "unmatched_free_bytes": unmatched_free, "series": series, "phase_index": phase_index,
            "peak": peak, "overflow": bool(unmatched_free) or any(
                info.get("ring_buffer_full") for info in (meta or {}).get("phases", {}).values())}
