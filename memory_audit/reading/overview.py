"""A snapshot of any size, drawn without the real viewer: what `viz` shows when MemoryViz cannot.

overview() reads one device's trace the way `attribute` does (columns, no per-entry Python) and
keeps what a page of a few hundred KB can draw: bytes live per category at the highest and
lowest entry of each of ~1,500 runs of entries (so every peak and valley wider than a pixel
survives), the allocated and reserved lines, where each phase begins, and the peak with its
largest live allocations by name and stack. window() cuts a span of the trace out as a snapshot
of its own, with what was live at its start, small enough for the real MemoryViz.
"""

import numpy as np

from ..schema import CATEGORIES, PHASES_KEY
from .event_names import category_code, viewer_needs_unknown
from .timeline import alloc_name, frame_text, read_trace, replay
from .trace import A, FREES, is_action

BUCKETS = 1500  # runs of entries per timeline: about the width of the plot in pixels
LARGEST = 25  # live allocations listed at the peak


def overview(snap, meta=None, device=0, start_phase="step2_start", buckets=BUCKETS, largest=LARGEST, reading=None):
    """{entries, start_index, phases {phase: entry}, x (entry indexes), allocated, reserved (none
    on a CPU timeline: no caching allocator), categories {category: bytes per x}, peak {bytes, index, categories, largest: [{name, bytes,
    index, frames}]}} for one device's trace from `start_phase` (a predicted snapshot's phases
    from its schema.PHASES_KEY). `reading`: read_trace()'s, when the caller has it."""
    reading = reading or read_trace(snap, meta, device)
    rp = replay(snap, meta, device, start_phase, buckets=buckets, phases=snap.get(PHASES_KEY), reading=reading)
    series = rp["series"]
    cpu = bool((snap.get("allocator_settings") or {}).get("cpu_profiler_timeline"))  # no caching allocator
    present = [c for c in CATEGORIES if any(c in p["categories"] for p in series)]
    peak = dict(rp["peak"])
    if peak.get("index") is not None:
        peak["largest"] = peak_allocations(reading, peak["index"], largest)
    return {"entries": rp["entries"], "start_index": rp["start_index"], "phases": rp["phase_index"],
            "x": [p["index"] for p in series], "allocated": [p["allocated"] for p in series],
            "reserved": [] if cpu else [p["reserved"] for p in series],
            "categories": {c: [p["categories"].get(c, 0) for p in series] for c in present},
            "peak": {k: peak.get(k) for k in ("bytes", "index", "categories", "largest")}}


def _live_at(r, at):
    """Indexes of the alloc entries before entry `at` whose allocation is still live there."""
    pair = r.pair[:at]
    return np.flatnonzero((r.trace.act[:at] == A["alloc"]) & ((pair < 0) | (pair >= at)))


def peak_allocations(r, peak_i, top=LARGEST):
    """The `top` largest allocations live just after entry peak_i (a Reading's): [{name, bytes,
    index (the entry that made it; None: before the trace), frames}], largest first."""
    live = _live_at(r, peak_i + 1)
    live = live[np.argsort(-r.block[live], kind="stable")[:top]]
    out = []
    for i in live.tolist():
        freed = bool(r.pair[i] >= 0 and is_action(r.trace.act[r.pair[i]:r.pair[i] + 1], FREES)[0])
        out.append({"name": alloc_name(i, freed, r.event_name, r.cat, r.unnamed), "bytes": int(r.block[i]),
                    "index": i, "frames": frame_text(r.trace.frames(i))})
    for name, size, freed_at, _ in r.pre:
        if freed_at is None or freed_at > peak_i:
            out.append({"name": name or "unattributed/before-trace", "bytes": int(size), "index": None,
                        "frames": []})
    return sorted(out, key=lambda a: -a["bytes"])[:top]


def window(snap, start, end, meta=None, device=0, reading=None):
    """Entries [start, end) of one device's trace as a plain snapshot MemoryViz opens: each
    allocation live at `start` first, as an alloc entry at the window's first time (its own
    stack and category, its block's bytes), then the window's entries, each with its category.
    A window that ends where the trace ends keeps the snapshot's segments (the state at its
    end); any other has none (the viewer's Active Memory Timeline needs none), so an allocation
    made in it and live at the trace's end counts at its rounded size, not at the block the end
    table may show larger (a remainder the allocator left unsplit)."""
    r = reading or read_trace(snap, meta, device)
    t = r.trace
    if not 0 <= start < end <= t.n:
        raise ValueError(f"window {start}:{end} is not within the trace's {t.n:,} entries")
    when = t.time_us(start)
    head = []
    for i in _live_at(r, start).tolist():  # at its block's size (a remainder the allocator left unsplit included)
        e = t.entry(i)
        head.append({"action": "alloc", "addr": e["addr"], "size": int(r.block[i]), "stream": e.get("stream", 0),
                     "frames": e["frames"], "time_us": when, "category": CATEGORIES[r.cat[i]]})
    for name, size, freed_at, addr in r.pre:
        if freed_at is None or freed_at >= start:
            head.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": [],
                         "time_us": when, "category": CATEGORIES[category_code(name)]})
    body = []
    for i in range(start, end):
        e = t.entry(i)
        e["category"] = CATEGORIES[r.cat[i]]
        body.append(e)
    entries = head + body
    cats = [e["category"] for e in entries]
    viewer_needs_unknown(cats, [A.get(e["action"], 0) for e in entries])
    for e, c in zip(entries, cats):
        e["category"] = c
    if "unknown" not in cats:  # no free to carry it: an entry of torch's own 'snapshot' kind does
        entries.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": [],
                        "time_us": t.time_us(end - 1), "category": "unknown"})
    segments = [seg for seg in snap.get("segments", []) if seg.get("device", 0) == device] if end == t.n else []
    return {"segments": segments, "device_traces": [entries], "allocator_settings": dict(snap.get("allocator_settings") or {}),
            "memory_audit_window": {"start": start, "end": end, "entries": t.n, "live_at_start": len(head)}}


def peak_window(view, size):
    """(start, end): a span of at most `size` entries around an overview's peak."""
    n, at = view["entries"], view["peak"].get("index") or 0
    start = max(0, min(at - size // 2, n - size))
    return start, min(n, start + size)
