"""The name and category of every entry of a trace (timeline.py replays it over time).

Names come from the phases: at each phase's position in the trace (meta.json's
`trace_entries`), the allocations live at that moment are matched to that phase's registry and
saved-tensor ledger by address. Addresses are reused all the time, so a name sticks to the one
allocation live at that moment, never to the address.
"""


import numpy as np

from .attribute import BASELINE, distributed_name, name_from_frames, phase_names, trace_workspaces
from ..schema import CATEGORIES, RECOMPUTE_LABEL
from .trace import A, FREES, as_trace, is_action


def phase_cuts(meta):
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
            table = np.array([category_code(self.by_stack(int(k), f)) for k in keys], dtype=np.int8)
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
        name = name_at(cuts, int(addr[i]), i) if cuts else BASELINE  # a snapshot from elsewhere
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
    cuts = phase_cuts(meta)
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


def entry_categories(trace, meta, cuts, pair):
    """Category code of every entry: an alloc's from its name (phases' registry and saved
    tensors, recomputation), else workspace, else by its stack (StackNames: a temporary when
    freed in the trace; without meta.json the end table's frame rules first), else
    unattributed; a free takes its alloc's (one older than the trace, its name's). Returns (cat,
    event_name, unmatched_free, unnamed): unnamed is the StackNames the codes came from (the
    peak's lines read the same names)."""
    act, addr = trace.act, trace.addr
    event_name, freed, unmatched_free = name_events(trace, cuts, (meta or {}).get("compiled_wrappers"))
    allocs = np.flatnonzero(act == A["alloc"])
    cat = np.full(trace.n, CODE["unattributed"], dtype=np.int8)  # a CATEGORIES index: 15 of them
    unnamed = StackNames(trace, meta)
    cat[allocs] = unnamed.codes(allocs, freed[allocs])
    workspaces = trace_workspaces(trace, meta)
    ws = allocs[np.isin(addr[allocs], np.fromiter(workspaces, dtype=np.int64))]
    cat[ws] = CODE["workspace"]
    for i, name in event_name.items():
        cat[i] = CODE.get(name.split("/", 1)[0], CODE["unattributed"])
    matched = is_action(act, FREES) & (pair >= 0)
    cat[matched] = cat[pair[matched]]
    return cat, event_name, unmatched_free, unnamed


def name_at(cuts, address, before=None):
    """The name a phase gave `address` at a cut not after entry `before` (None: any phase)."""
    for cut, names, _ in cuts:
        if before is not None and cut > before:
            break
        if address in names:
            return names[address]
    return None


CODE = {c: k for k, c in enumerate(CATEGORIES)}  # a category's index in CATEGORIES: the codes entries carry


def category_code(name):
    """The code of a name's category (its first part); unattributed for none."""
    return CODE.get(name.split("/", 1)[0], CODE["unattributed"]) if name else CODE["unattributed"]
