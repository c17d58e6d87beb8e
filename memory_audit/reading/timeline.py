"""Attribution over time: replay a snapshot's trace and name what is live at every moment.

The trace of the last phase (step2_end) holds every allocation since recording began, so one
replay gives bytes per category over the audited step, the peak and what was live at it. On a
CPU run this is how the peak is measured at all.

Names come from the phases: at each phase's position in the trace (meta.json's
`trace_entries`), the allocations live at that moment are matched to that phase's registry and
saved-tensor ledger by address. Addresses are reused all the time, so a name sticks to the one
allocation live at that moment, never to the address.
"""

from dataclasses import dataclass

import numpy as np

from .attribute import (BASELINE, baseline_name, block_namer, distributed_name, name_from_frames, phase_names,
                        trace_workspaces)
from ..schema import CATEGORIES, RECOMPUTE_LABEL
from .trace import A, FREES, Trace, as_trace, fastcore, is_action


def _phase_names(meta):
    """[(trace index, {addr: name})] for each phase with a known trace position."""
    cuts = []
    for phase, info in (meta or {}).get("phases", {}).items():
        n = info.get("trace_entries")
        if n is None or info.get("ring_buffer_full"):
            continue
        names = {addr: name for addr, (name, _) in phase_names(meta, phase).items()}
        cuts.append((n, names, phase))
    cuts.sort(key=lambda c: c[0])
    return cuts


_MAKERS = (("_make_grads", "backward/grad_seed"), ("run_backward", "backward"), ("Backward", "backward"),
           ("clip_grad", "clip_grad_norm"), ("optim", "optimizer"), ("grad_scaler", "grad_scaler"),
           ("zero_grad", "zero_grad"), ("cross_entropy", "cross_entropy"), ("model.py", "forward"),
           ("train_step.py", "loop"), ("train.py", "loop"))


def temporary_name(frames):
    """'temporary/<what made it>[/<op>]' for a short-lived allocation: the innermost frame that
    says (the backward, the optimizer, clip_grad_norm, the GradScaler, the loss, the model's
    forward, the loop); <op> is the aten op or autograd node where the stack has one (CPU)."""
    kept = distributed_name(frames)
    if kept:  # torch.distributed's own: DDP's buckets, the DeviceMesh, FSDP2's per-use buffers
        return kept
    if frames and frames[0].get("filename") == "<inductor>":  # a compiled graph's buffer, by its wrapper name
        return f"temporary/compiled_{frames[0].get('name')}"
    op = frames[0].get("name") if frames and frames[0].get("filename") == "<op>" else ""
    for f in frames:
        text = f"{f.get('filename') or ''}:{f.get('name') or ''}"
        for word, what in _MAKERS:
            if word in text:
                if what == "forward":
                    what = f"forward/{f.get('name')}"
                if what == "backward/grad_seed":
                    return "temporary/backward/grad_seed"
                return f"temporary/{what}" + (f"/{op}" if op else "")
    return "temporary/no-frames" if not frames else "temporary/other" + (f"/{op}" if op else "")


class StackNames:
    """The name of an allocation that no phase names, by its stack and whether the trace frees
    it, computed once per distinct stack: only stacks someone reads (live at the peak, a
    categorized trace, a category column) are named.

    With meta.json (an audit): an allocation the trace frees is a temporary, by what made it
    (temporary_name); one still live that no phase named stays unnamed. Without it (a snapshot
    from elsewhere): attribute.name_from_frames first, the rules the end table uses for its
    blocks, so a block has one name at every moment; a freed allocation it does not name is a
    temporary as above.
    """

    def __init__(self, t, meta):
        col = t.columns.get("frames")
        self.values, self.table = col if col is not None and col[1] is not None else (None, None)
        self.foreign = meta is None
        self.cache = {}

    def stack(self, i):
        return -1 if self.values is None else int(self.values[i])

    def by_stack(self, k, freed):
        if (k, freed) not in self.cache:
            frames = self.table[k] if k >= 0 else []
            name = name_from_frames(frames, live=not freed)[0] if self.foreign else None
            self.cache[k, freed] = name or (temporary_name(frames) if freed else None)
        return self.cache[k, freed]

    def __call__(self, i, freed=True):
        return self.by_stack(self.stack(i), freed)

    def codes(self, idx, freed):
        """Category codes of the allocations at entry indexes `idx` (freed: bool per index)."""
        stacks = np.full(len(idx), -1, dtype=np.int64) if self.values is None else self.values[idx]
        out = np.empty(len(idx), dtype=np.int8)
        for f in (False, True):
            sel = freed == f
            keys, inverse = np.unique(stacks[sel], return_inverse=True)
            table = np.array([_code(self.by_stack(int(k), f)) for k in keys], dtype=np.int8)
            out[sel] = table[inverse] if len(keys) else 0
        return out


def recompute_labels(t):
    """{alloc index: module} for allocations made while a checkpoint recomputed (the recorder
    labels them `recompute:<module>` in the entries' user_metadata)."""
    col = t.columns.get("user_metadata")
    if col is None or col[1] is None:
        return {}
    values, table = col
    out = {}
    for j, text in enumerate(table):
        if isinstance(text, str) and text.startswith(RECOMPUTE_LABEL):
            for i in np.flatnonzero((values == j) & (t.act == A["alloc"])).tolist():
                out[i] = text[len(RECOMPUTE_LABEL):]
    return out


def name_events(trace, cuts, wrappers=None):
    """Name each alloc event by the phases at which it is live, and each free of an allocation
    older than the trace by the phases before it.

    Returns (event_name {index: name}, freed (bool per entry: an alloc whose free the trace
    holds), unmatched_free_bytes).
    """
    t = as_trace(trace)
    n = t.n
    pair = t.pairing()
    act, addr = t.act, t.addr
    allocs = np.flatnonzero(act == A["alloc"])
    ends = pair[allocs]
    ends = np.where(ends < 0, n + 1, ends)  # still live at the end
    named = np.zeros(len(allocs), dtype=bool)
    event_name = {}
    for cut, names, _ in cuts:
        if cut > n or not names:
            continue
        keys = np.fromiter((k for k in names if isinstance(k, int)), dtype=np.int64)
        hit = (allocs < cut) & (ends >= cut) & ~named & np.isin(addr[allocs], keys)
        for j in np.flatnonzero(hit).tolist():
            event_name[int(allocs[j])] = names[int(addr[allocs[j]])]
        named |= hit
    # live at the trace's end and named by no phase's registry: what torch.distributed keeps, by
    # its stack, when made before the step; DDP's buckets also when made in it (DDP rebuilds them
    # in step 2's forward). An FSDP2 buffer made in the step and still live is no such thing: it
    # stays unattributed.
    first_cut = min((cut for cut, names, _ in cuts if names), default=0)
    for j in np.flatnonzero(~named & (ends > n)).tolist():
        frames_name = distributed_name(t.frames(int(allocs[j])))
        if frames_name and (allocs[j] < first_cut or frames_name == "grads/ddp_buckets"):
            event_name[int(allocs[j])] = frames_name
    for i, name in compiled_names(t, wrappers).items():  # inductor's buffers, by wrapper name
        event_name.setdefault(i, name)
    for i, label in recompute_labels(t).items():  # what a checkpoint recomputed in backward
        event_name.setdefault(i, "recomputed/" + label)
    freed = np.zeros(n, dtype=bool)
    done = allocs[pair[allocs] >= 0]
    freed[done[is_action(act[pair[done]], FREES)]] = True
    frees = is_action(act, FREES)
    unmatched = frees & (pair < 0)
    for i in np.flatnonzero(unmatched).tolist():  # frees of what is older than the trace
        name = _name_at(cuts, int(addr[i]), i) if cuts else BASELINE  # a snapshot from elsewhere
        if name:
            event_name[i] = name
    return event_name, freed, int(t.size[unmatched].sum())


def compiled_names(t, wrappers):
    """{alloc index: "temporary/compiled_<forward|backward>/<buf>"} for the allocations compiled
    wrappers make in a CUDA trace (its frames carry the wrapper's file), by the buffers of their
    plans (inductor_plan.PlanCursor, the allocator's 512 B rounding allowed). CPU audits are named
    when the profile is converted (a first "<inductor>" frame) and are skipped here."""
    from .allocator_sim import round_size
    from .inductor_plan import PlanCursor
    cursor = PlanCursor(wrappers, sizes=lambda nbytes: (nbytes, round_size(nbytes)))
    col = t.columns.get("frames")
    if not cursor.plans or col is None or col[1] is None:
        return {}
    values, table = col
    stacks = {k: cursor.file_of(fr) for k, fr in enumerate(table) if fr and fr[0].get("filename") != "<inductor>"}
    stacks = {k: v for k, v in stacks.items() if v}
    if not stacks:
        return {}
    hits = np.flatnonzero((t.act == A["alloc"]) & np.isin(values, np.fromiter(stacks, dtype=np.int64)))
    return {i: "temporary/compiled_" + cursor.name(stacks[int(values[i])], int(t.size[i])) for i in hits.tolist()}


def categorize_trace(snap, meta=None, detail=True):
    """Set `category` on every trace entry, so MemoryViz colours by category. detail=False keeps
    the top level only (temporary/backward -> temporary): the viewer has ten colours."""
    cuts = _phase_names(meta)
    traces = snap.get("device_traces", [])
    for d, trace in enumerate(traces):
        t = traces[d] = as_trace(trace)
        workspaces = trace_workspaces(t, meta)
        event_name, freed, _ = name_events(t, cuts, (meta or {}).get("compiled_wrappers"))
        unnamed = StackNames(t, meta)
        act, addr = t.act.tolist(), t.addr.tolist()
        live, cats = {}, []
        for i in range(t.n):
            a = act[i]
            if a == A["alloc"]:
                name = event_name.get(i)
                if name:
                    cat = "/".join(name.split("/")[:2]) if name.startswith("temporary/") else name.split("/", 1)[0]
                elif addr[i] in workspaces:
                    cat = "workspace"
                else:  # temporaries keep their second level: temporary/backward, temporary/optimizer
                    name = unnamed(i, bool(freed[i])) or "unknown"
                    cat = "/".join(name.split("/")[:2]) if name.startswith("temporary/") else name.split("/", 1)[0]
                live[addr[i]] = cat
            elif a in (A["free_requested"], A["free_completed"], A["free"]):
                # a free of what predates the trace: the viewer draws it with the free's category
                cat = live.get(addr[i]) or (event_name[i].split("/", 1)[0] if i in event_name else "unknown")
                if i in event_name and a == A["free_requested"]:  # its free_completed follows
                    live[addr[i]] = cat
                if a != A["free_requested"]:
                    live.pop(addr[i], None)
            else:
                cat = "unknown"
            cats.append(cat)
        if not detail:
            cats = [c.split("/", 1)[0] for c in cats]
        viewer_needs_unknown(cats, act)
        t.set_values("category", cats)
    return snap


def viewer_needs_unknown(cats, act):
    """MemoryViz.js throws while it loads a trace whose categories do not include 'unknown' (it
    means to add the name itself, but misspells the list: `snapshot.categores.push`). Where no
    entry is 'unknown', the first free carries it: the viewer colours an allocation by its
    alloc entry, so the free's category only adds 'unknown' to the legend."""
    if any(c == "unknown" and a != A["free_completed"] for c, a in zip(cats, act)):
        return  # (the viewer folds a free_completed into its free_requested, category unread)
    frees = [i for i, a in enumerate(act) if a in (A["free_requested"], A["free"])]
    if frees:
        cats[frees[0]] = "unknown"


def _entry_categories(trace, meta, cuts, pair):
    """Category code of every entry: an alloc's from its name (phases' registry and saved
    tensors, recomputation), else workspace, else by its stack (StackNames: a temporary when
    freed in the trace; without meta.json the end table's frame rules first), else
    unattributed; a free takes its alloc's (one older than the trace, its name's). Returns (cat,
    event_name, unmatched_free, unnamed): unnamed is the StackNames the codes came from (the
    peak's lines read the same names)."""
    act, addr = trace.act, trace.addr
    event_name, freed, unmatched_free = name_events(trace, cuts, (meta or {}).get("compiled_wrappers"))
    allocs = np.flatnonzero(act == A["alloc"])
    cat = np.full(trace.n, _CODE["unattributed"], dtype=np.int8)  # a CATEGORIES index: 15 of them
    unnamed = StackNames(trace, meta)
    cat[allocs] = unnamed.codes(allocs, freed[allocs])
    workspaces = trace_workspaces(trace, meta)
    ws = allocs[np.isin(addr[allocs], np.fromiter(workspaces, dtype=np.int64))]
    cat[ws] = _CODE["workspace"]
    for i, name in event_name.items():
        cat[i] = _CODE.get(name.split("/", 1)[0], _CODE["unattributed"])
    matched = is_action(act, FREES) & (pair >= 0)
    cat[matched] = cat[pair[matched]]
    return cat, event_name, unmatched_free, unnamed


def _name_at(cuts, address, before=None):
    """The name a phase gave `address` at a cut not after entry `before` (None: any phase)."""
    for cut, names, _ in cuts:
        if before is not None and cut > before:
            break
        if address in names:
            return names[address]
    return None


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
            return _name_at(cuts, b["address"])
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


def _code(name):
    return _CODE.get(name.split("/", 1)[0], _CODE["unattributed"]) if name else _CODE["unattributed"]


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
    before the trace, see pre_trace_blocks; unnamed: see _entry_categories)."""
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
    return event_name.get(i) or ("workspace/cublas" if cat[i] == _CODE["workspace"] else
                                 unnamed(i, freed) or CATEGORIES[cat[i]])


def frame_text(frames, depth=8):
    """A stack as 'file:line:function' strings, innermost first."""
    return [f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')}:{f.get('name')}" for f in frames[:depth]]


_CODE = {c: k for k, c in enumerate(CATEGORIES)}


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
    unnamed: "StackNames"
    pre: list


def read_trace(snap, meta=None, device=0):
    """The Reading of one device's trace (no per-entry Python: ten million entries in seconds)."""
    traces = snap.get("device_traces", [])
    trace = as_trace(traces[device]) if device < len(traces) else Trace({}, 0)
    cuts = _phase_names(meta)
    cpu = bool((snap.get("allocator_settings") or {}).get("cpu_profiler_timeline"))
    # block sizes as memory_allocated() counts them (CPU: no caching allocator, exact bytes)
    block, pair = trace.replayed(cpu)
    block = _end_sizes(snap, trace, block, pair, device)
    cat, event_name, unmatched_free, unnamed = _entry_categories(trace, meta, cuts, pair)
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
    end_reserved = sum(s["total_size"] for s in snap["segments"] if s.get("device", 0) == device)
    # reserved bytes move only at the few segment entries: a running sum over those
    seg_at = np.flatnonzero(is_action(act, (A["segment_alloc"], A["segment_map"], A["segment_free"], A["segment_unmap"])))
    seg_delta = np.where(is_action(act[seg_at], (A["segment_alloc"], A["segment_map"])), size[seg_at], -size[seg_at])
    seg_run = np.r_[0, np.cumsum(seg_delta)] + end_reserved - int(seg_delta.sum())

    def reserved_at(i):
        return int(seg_run[np.searchsorted(seg_at, i, side="right")])

    phase_index = {phase: cut for cut, _, phase in cuts} or dict(phases or {})
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
    at_start = {}
    for name, size, _, _ in pre:
        at_start[CATEGORIES[_code(name)]] = at_start.get(CATEGORIES[_code(name)], 0) + size
    if baseline != sum(at_start.values()):  # a snapshot whose segments and trace disagree
        at_start["unattributed"] = at_start.get("unattributed", 0) + baseline - sum(at_start.values())
    for point in series + ([peak] if peak_i is not None else []):
        point["allocated" if "allocated" in point else "bytes"] += baseline
        cats = point["categories"]
        for c, v in at_start.items():
            cats[c] = cats.get(c, 0) + v
        point["categories"] = {c: v for c, v in cats.items() if v}
    if peak_i is not None:
        peak["lines"] = _peak_lines(trace, peak_i, pair, block, cat, event_name, pre, unnamed)
        peak["action"] = trace.action(peak_i)
        peak["frames"] = frame_text(trace.frames(peak_i), 4)
    return {"entries": n, "start_index": start, "baseline_bytes": baseline,
            "unmatched_free_bytes": r.unmatched_free, "series": series, "phase_index": phase_index,
            "peak": peak, "overflow": any(i is not None and (name is None or name.startswith("baseline/")) for name, _, i, _ in pre) or any(
                info.get("ring_buffer_full") for info in (meta or {}).get("phases", {}).values())}
