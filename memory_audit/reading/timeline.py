"""Attribution over time: replay a snapshot's trace and say what is live at every moment.

The trace of the last phase (step2_end) holds every allocation since recording began, so one
replay gives bytes per category over the audited step, the peak and what was live at it. On a
CPU run this is how the peak is measured at all. Each entry's name and category come from
event_names.py.
"""

from dataclasses import dataclass

import numpy as np

from .attribute import baseline_name, block_namer
from ..schema import CATEGORIES
from .event_names import CODE, StackNames, category_code, entry_categories, name_at, phase_cuts
from .trace import A, FREES, Trace, as_trace, fastcore, is_action


def pre_trace_blocks(snap, trace, pair, block, cuts, event_name, device=0):
    """Allocations made before the trace began, named by the phases where they can be:
    [(name or None, bytes, index of their free in the trace or None, address)].

    They are the blocks live at the end that no alloc in the trace made (the weights of a
    model built before recording started) and the frees whose alloc the trace never saw.
    """
    act, addr = trace.act, trace.addr
    traced_live = set(addr[(act == A["alloc"]) & (pair < 0)].tolist())
    if cuts:
        def name(b):
            return name_at(cuts, b["address"])
    else:  # a snapshot from elsewhere: the end table's rules (frames, else its baseline)
        namer = block_namer(snap)

        def name(b):
            return namer(b)[0] or baseline_name(snap)
    out = [(name(b), b["size"], None, b["address"])
           for s in snap.get("segments", []) if s.get("device", 0) == device for b in s["blocks"]
           if b["state"] == "active_allocated" and b["address"] not in traced_live]
    for i in np.flatnonzero(is_action(act, FREES) & (pair < 0)).tolist():  # named by name_events
        out.append((event_name.get(i), int(block[i]), i, int(addr[i])))
    return out


def _end_sizes(snap, trace, block, pair, device):
    """The replayed block sizes, in which each allocation still live at the end has
    the size of its block in the snapshot's segments: the replay's rounding cannot know a
    remainder the allocator left unsplit (expandable segments, say), the segments do."""
    out = block
    live = np.flatnonzero((trace.act == A["alloc"]) & (pair < 0))
    if len(live):
        out = block.copy()  # the replay's own arrays are read-only (cached)
        end = {b["address"]: b["size"] for s in snap["segments"] if s.get("device", 0) == device
               for b in s["blocks"] if b["state"] == "active_allocated"}
        sizes = np.fromiter((end.get(a, -1) for a in trace.addr[live].tolist()), dtype=np.int64, count=len(live))
        known = sizes >= 0
        out[live[known]] = sizes[known]
    return out


def _per_category(delta, cat, sample):
    """{category: bytes at each sampled entry}: a running sum over each category's entries,
    for the categories whose entries move memory."""
    core = fastcore()
    if core is not None:  # one pass in C; the numpy road below is its reference
        order = np.argsort(sample, kind="stable")
        sums, present = core.per_category(np.ascontiguousarray(delta, dtype=np.int64),
                                          np.ascontiguousarray(cat, dtype=np.int8),
                                          np.ascontiguousarray(np.asarray(sample, dtype=np.int64)[order]),
                                          len(CATEGORIES))
        sums = np.frombuffer(sums, dtype=np.int64).reshape(len(CATEGORIES), len(order))
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        return {CATEGORIES[c]: sums[c][back] for c, on in enumerate(present) if on}
    per_cat = {}
    moving = delta != 0
    present = np.flatnonzero(np.bincount(cat[moving], minlength=len(CATEGORIES)))
    for code in present.tolist():  # a dozen categories at most: one pass each, no sort
        group = np.flatnonzero(moving & (cat == code))
        run = np.cumsum(delta[group])
        at = np.searchsorted(group, sample, side="right") - 1
        per_cat[CATEGORIES[code]] = np.where(at >= 0, run[np.maximum(at, 0)], 0)
    return per_cat


def _peak_lines(trace, peak_i, pair, block, cat, event_name, pre, unnamed):
    """{name: bytes} of the allocations live at entry peak_i, largest first (`pre`: those made
    before the trace, see pre_trace_blocks; unnamed: see entry_categories)."""
    is_alloc = trace.act[:peak_i + 1] == A["alloc"]
    live = np.flatnonzero(is_alloc & ((pair[:peak_i + 1] < 0) | (pair[:peak_i + 1] > peak_i)))
    freed = dict(zip(live.tolist(), ((pair[live] >= 0) & is_action(trace.act[np.maximum(pair[live], 0)], FREES)).tolist()))
    lines = {}
    for i in live.tolist():
        key = alloc_name(i, bool(freed[i]), event_name, cat, unnamed)
        lines[key] = lines.get(key, 0) + int(block[i])
    for name, size, freed_at, _ in pre:
        if freed_at is None or freed_at > peak_i:
            key = name or "unattributed/before-trace"
            lines[key] = lines.get(key, 0) + size
    return dict(sorted(lines.items(), key=lambda kv: -kv[1]))


def alloc_name(i, freed, event_name, cat, unnamed):
    """The name of the allocation entry i makes, as the peak's lines give it: a phase's name,
    else the cuBLAS workspace, else by its stack (freed: whether the trace frees it), else its
    category."""
    return event_name.get(i) or ("workspace/cublas" if cat[i] == CODE["workspace"] else
                                 unnamed(i, freed) or CATEGORIES[cat[i]])


def frame_text(frames, depth=8):
    """A stack as 'file:line:function' strings, innermost first."""
    return [f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')}:{f.get('name')}" for f in frames[:depth]]


def _sample_points(n, start, max_points):
    """Downsampled entry indexes from just before `start` to the end (the last always in)."""
    lo = max(start - 1, 0)  # the entry just before the start phase counts, as the loop always did
    step = max(1, (n - start) // max_points)
    points = np.arange(lo + (start - lo) % step, n, step)
    if n > lo and (not len(points) or points[-1] != n - 1):
        points = np.append(points, n - 1)
    return lo, points


@dataclass
class Reading:
    """One device's trace as the replay reads it: block bytes and the matching alloc/free per
    entry (pair), each entry's category code (an index in CATEGORIES), the names the phases
    give, and what was live before the trace began (pre_trace_blocks)."""
    trace: Trace
    cuts: list
    block: np.ndarray
    pair: np.ndarray
    cat: np.ndarray
    event_name: dict
    unmatched_free: int
    unnamed: StackNames
    pre: list


def read_trace(snap, meta=None, device=0):
    """The Reading of one device's trace (no per-entry Python: ten million entries in seconds)."""
    traces = snap.get("device_traces", [])
    trace = as_trace(traces[device]) if device < len(traces) else Trace({}, 0)
    cuts = phase_cuts(meta)
    cpu = bool((snap.get("allocator_settings") or {}).get("cpu_profiler_timeline"))
    # block sizes as memory_allocated() counts them (CPU: no caching allocator, exact bytes)
    block, pair = trace.replayed(cpu)
    block = _end_sizes(snap, trace, block, pair, device)
    cat, event_name, unmatched_free, unnamed = entry_categories(trace, meta, cuts, pair)
    pre = pre_trace_blocks(snap, trace, pair, block, cuts, event_name, device)
    return Reading(trace, cuts, block, pair, cat, event_name, unmatched_free, unnamed, pre)


def _extreme_points(allocated, lo, buckets):
    """Entry indexes from `lo` to the end: in each of `buckets` equal runs of entries, the one
    after which memory is highest and the one after which it is lowest, so that every peak and
    valley wider than a run survives; the first and last always."""
    span = allocated[lo:]
    if not len(span):
        return np.array([], dtype=np.int64)
    width = -(-len(span) // max(1, buckets))
    runs = np.arange(0, len(span), width)
    high = np.maximum.reduceat(span, runs)
    low = np.minimum.reduceat(span, runs)
    points = [runs, np.array([len(span) - 1])]
    for k, start in enumerate(runs.tolist()):  # a bucket's argmax/argmin: where the reduced value is
        part = span[start:start + width]
        points.append(np.array([start + int(np.argmax(part == high[k])), start + int(np.argmax(part == low[k]))]))
    return np.unique(np.concatenate(points)) + lo


def _reserved(snap, act, size, device):
    """reserved_at(i): memory_reserved() before trace entry i, from the segments at the end
    back through the few segment entries (a running sum over those)."""
    end_reserved = sum(s["total_size"] for s in snap["segments"] if s.get("device", 0) == device)
    seg_at = np.flatnonzero(is_action(act, (A["segment_alloc"], A["segment_map"], A["segment_free"], A["segment_unmap"])))
    seg_delta = np.where(is_action(act[seg_at], (A["segment_alloc"], A["segment_map"])), size[seg_at], -size[seg_at])
    seg_run = np.r_[0, np.cumsum(seg_delta)] + end_reserved - int(seg_delta.sum())

    def reserved_at(i):
        return int(seg_run[np.searchsorted(seg_at, i, side="right")])
    return reserved_at


def _add_baseline(points, baseline, pre):
    """What was live before the trace began (`baseline` bytes; by category from `pre`, the rest
    unattributed where the snapshot's segments and trace disagree) added to each point."""
    at_start = {}
    for name, nbytes, _, _ in pre:
        at_start[CATEGORIES[category_code(name)]] = at_start.get(CATEGORIES[category_code(name)], 0) + nbytes
    if baseline != sum(at_start.values()):
        at_start["unattributed"] = at_start.get("unattributed", 0) + baseline - sum(at_start.values())
    for point in points:
        point["allocated" if "allocated" in point else "bytes"] += baseline
        cats = point["categories"]
        for c, v in at_start.items():
            cats[c] = cats.get(c, 0) + v
        point["categories"] = {c: v for c, v in cats.items() if v}


def replay(snap, meta=None, device=0, start_phase="step2_start", max_points=4000, buckets=None, phases=None,
           reading=None):
    """Replay one device's trace.

    Returns a dict: entries, start_index (where `start_phase` begins), baseline_bytes (live
    before the trace began), series (downsampled points: index, time_us, allocated, reserved,
    {category: bytes}), phase_index {phase: index}, peak {bytes, index, time_us, categories,
    lines (largest named allocations live at the peak)}, overflow (bool).

    The points are every (n / max_points)-th entry, or with `buckets` the highest and lowest
    entry of each of that many runs (_extreme_points: what a plot of any length must keep).
    `phases`: {phase: trace index} where no meta.json says (a predicted snapshot's
    schema.PHASES_KEY). `reading`: read_trace()'s, when the caller has it already.
    """
    r = reading or read_trace(snap, meta, device)
    trace, cuts, block, pair, cat, event_name, unnamed, pre = (
        r.trace, r.cuts, r.block, r.pair, r.cat, r.event_name, r.unnamed, r.pre)
    n, act, size = trace.n, trace.act, trace.size
    delta = block.copy()  # +block at an alloc, -block at a free, 0 elsewhere (in place: 1M entries)
    frees = is_action(act, FREES)
    delta[~(frees | (act == A["alloc"]))] = 0
    np.negative(delta, out=delta, where=frees)
    del frees
    allocated = np.cumsum(delta)

    end_allocated = sum(b["size"] for s in snap["segments"] if s.get("device", 0) == device
                        for b in s["blocks"] if b["state"] == "active_allocated")
    reserved_at = _reserved(snap, act, size, device)
    # the phases this trace reaches (an earlier phase's snapshot stops before the later cuts)
    phase_index = {phase: cut for cut, _, phase in cuts if cut <= n} or dict(phases or {})
    start = phase_index.get(start_phase, 0)
    lo, points = _sample_points(n, start, max_points)
    if buckets:
        points = _extreme_points(allocated, lo, buckets)
    peak_i = int(lo + np.argmax(allocated[lo:])) if lo < n else None
    per_cat = _per_category(delta, cat, points if peak_i is None else np.append(points, peak_i))

    def categories_at(j):
        return {c: int(per_cat[c][j]) for c in CATEGORIES if c in per_cat and per_cat[c][j]}

    series = [{"index": int(i), "time_us": trace.time_us(int(i)), "allocated": int(allocated[i]),
               "reserved": reserved_at(i), "categories": categories_at(j)} for j, i in enumerate(points)]
    peak = {"bytes": -1, "index": None}
    if peak_i is not None:
        peak = {"bytes": int(allocated[peak_i]), "index": peak_i, "time_us": trace.time_us(peak_i),
                "categories": categories_at(len(points))}
    # what was live before the first entry (0 when recording began before any allocation)
    baseline = end_allocated - (int(allocated[-1]) if n else 0)
    _add_baseline(series + ([peak] if peak_i is not None else []), baseline, pre)
    if peak_i is not None:
        peak["lines"] = _peak_lines(trace, peak_i, pair, block, cat, event_name, pre, unnamed)
        peak["action"] = trace.action(peak_i)
        peak["frames"] = frame_text(trace.frames(peak_i), 4)
    return {"entries": n, "start_index": start, "baseline_bytes": baseline,
            "unmatched_free_bytes": r.unmatched_free, "series": series, "phase_index": phase_index,
            "peak": peak, "overflow": any(i is not None and (name is None or name.startswith("baseline/")) for name, _, i, _ in pre) or any(
                info.get("ring_buffer_full") for info in (meta or {}).get("phases", {}).values())}
