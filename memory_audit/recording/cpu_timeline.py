"""CPU: turn the profiler's memory timeline into the CUDA snapshot schema.

Like torch.cuda._memory_viz._profile_to_snapshot, but it keeps the time of every event and
cuts the trace at a phase marker, so one profile gives the three phase snapshots. CPU memory
has no caching allocator: each live allocation becomes its own segment with one active block
(size == requested_size), so reserved == allocated and there are no gaps.
"""

import re

from ..reading.attribute import distributed_name
from ..schema import MARKER_PREFIX, RECOMPUTE_LABEL

RECOMPUTE_RANGE = MARKER_PREFIX + RECOMPUTE_LABEL  # naming.checkpoints._RecomputeLabel's profiler range
_FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<name>.*)$")


def _frame(name):
    m = _FRAME.match(name)
    if m:
        return {"filename": m["file"], "line": int(m["line"]), "name": m["name"]}
    return {"filename": "??", "line": 0, "name": name}


def _name(event):
    try:
        return event.name
    except UnicodeDecodeError:  # the profiler sometimes hands back undecodable names
        return "<undecodable>"


def timeline_events(prof, markers, keep=(), info=None, alive=(), keyed=True, named_at=None):
    """Allocation events of a finished profile and the times of the named markers.

    Returns (events, marker_times): events is a time-ordered list of
    (t_ns, "alloc"|"free"|"pre", addr, size, frames, category, user_metadata); "pre" is a tensor
    that existed before the profile began and whose address is in `keep` (the recorder's named
    addresses: weights made before an Audit was; a dict gives each storage's bytes); marker_times maps
    marker -> t_ns. user_metadata is "recompute:<module>" for an allocation made inside a
    labelled recomputation (as CUDA's allocator records it), else "". info: a dict that gets
    "source": "memory_profile" or "raw allocations" (the road taken, below). alive: addresses the
    recorder named at the last phase (a tensor there was alive then): no free is inferred for
    the last allocation at one of them (FSDP2's gradient shards kept with set_to_none=False live
    in their unit's reduce-scatter output, which the rules below would otherwise let go).
    keyed=False takes the raw road without trying the memory profile (the default: building it
    walks every op of the step again, about half an audit's time; under torchrun its checks
    often fail anyway, and it walks every Python call DTensor and FSDP2 make). named_at: {marker:
    the addresses its phase named}, which tells the raw road a storage older than the profile
    from one allocated in it (_unseen_events).
    """
    from torch.profiler._memory_profiler import OpTree

    mp = None
    if keyed:
        try:
            mp = prof._memory_profile()
        except AssertionError:
            # The memory profiler's data-flow graph checks fail when another thread's ops
            # interleave (gloo's collectives under torchrun): every allocation is then taken by
            # address, as compiled code's are below (the raw road).
            mp = None
    tree = mp._op_tree if mp is not None else OpTree(prof.profiler.kineto_results)
    if info is not None:
        info["source"] = "memory_profile" if mp is not None else "raw allocations"
    seen = _scan(tree, mp is not None, markers)
    order = lambda e: (e[0], 0 if e[1] == "free" else 1)  # noqa: E731
    events = _tensor_events(mp, keep, seen["stacks"], seen["ranges"]) if mp is not None else []
    older = {}  # the raw road: named address -> the first time a phase named it
    for marker, addrs in (named_at or {}).items() if mp is None else ():
        t = seen["marker_times"].get(marker)
        for a in addrs if t is not None else ():
            older[a] = min(older.get(a, t), t)
    unseen = _unseen_events(seen["unseen"], seen["ranges"], keep if mp is None else (), older)
    events = sorted(events + unseen, key=order)
    staged = seen["staged"]
    staged.update(_last_reads(events, seen["reads"], seen["outputs"]))
    staged.update(_rebuild_broadcasts(events, seen["rebuilt"], seen["reads"]))
    staged.update(_superseded_buckets(events, seen["rebuilt"]))
    events = sorted(_free_staged(events, staged, alive), key=order) if staged else events
    return events, seen["marker_times"]


def _scan(tree, by_key, markers):
    """One pass over the profile's op tree: {"stacks": TensorKey -> the frames of its
    allocation (by_key: the memory profile's keys were made), "marker_times", "ranges" (the
    labelled recomputations' [start, end, label]), "unseen" (allocations no aten op saw, by
    address), "staged"/"rebuilt"/"outputs" (gloo's staging copies, DDP's rebuild broadcasts and
    functional collectives' outputs, by (address, time)), "reads" (address -> the ops reading
    it)}."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import TensorKey
    stacks, marker_times, ranges, unseen, staged, rebuilt = {}, {}, [], [], {}, {}
    reads, outputs = {}, set()  # address -> [(start, end, collective) of ops reading it]; functional outputs
    for event in tree.sorted_nodes:
        if event.tag == _EventType.TorchOp:
            name = _name(event)
            _note_reads(event, name, reads)
            if name in markers and name not in marker_times:
                marker_times[name] = event.start_time_ns
            if name.startswith(RECOMPUTE_RANGE):  # a range across Python frames: nothing nests in it
                ranges.append((event.start_time_ns, event.end_time_ns, name[len(MARKER_PREFIX):]))
        # CPU memory only, as the memory profile's timeline keeps
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            key = TensorKey.from_allocation(event.extra_fields) if by_key else None
            grow = event.extra_fields.alloc_size > 0
            frames = _stack(event) if grow else []
            if key is None:  # memory no aten op saw (compiled code's own buffers): by address
                unseen.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size, frames))
            elif grow:
                stacks[key] = frames
            kind, end = _collective(event) if grow else (None, None)
            if kind == "staging":
                staged[(event.extra_fields.ptr, event.start_time_ns)] = end
            elif kind == "rebuild":
                rebuilt[(event.extra_fields.ptr, event.start_time_ns)] = end
            elif kind == "functional":
                outputs.add((event.extra_fields.ptr, event.start_time_ns))
    return {"stacks": stacks, "marker_times": marker_times, "ranges": ranges, "unseen": unseen,
            "staged": staged, "rebuilt": rebuilt, "reads": reads, "outputs": outputs}


def _tensor_events(mp, keep, stacks, ranges):
    """The memory profile's timeline as (t_ns, "alloc"|"free"|"pre", addr, size, frames,
    category, user_metadata) of CPU tensors (timeline_events' docstring)."""
    from torch.profiler._memory_profiler import Action, TensorKey
    events, live = [], {}
    for t, action, (key, version), size in mp.timeline:
        if not isinstance(key, TensorKey) or key.device.type != "cpu":
            continue
        if action == Action.PREEXISTING:
            # Before the profile: kept when a phase named it (weights of a model made before the
            # Audit). Others are left out: numpy's memory wrapped by torch.from_numpy (memmap
            # batches) shows up this way too, and its free is never reported.
            if key.storage.ptr in keep:
                # its storage's bytes as the recorder read them: the profiler sizes an older
                # tensor from the views it saw, which overshoots a strided one (a (5,) diagonal
                # with stride 6 of a 100 B weight: 120 B)
                size = (keep.get(key.storage.ptr) or size) if isinstance(keep, dict) else size
                live[key] = (key.storage.ptr, size)
                events.append((-1, "pre", key.storage.ptr, size, stacks.get(key, []), None, ""))
            continue
        if action == Action.CREATE:
            category = mp._categories.get(key, version)
            category = category.name.lower() if category is not None else "unknown"
            live[key] = (key.storage.ptr, size)
            label = next((text for a, b, text in ranges if a <= t <= b), "") if ranges else ""
            events.append((t, "alloc", key.storage.ptr, size, stacks.get(key, []), category, label))
        elif action == Action.DESTROY and key in live:
            addr, size0 = live.pop(key)
            events.append((t, "free", addr, size0, stacks.get(key, []), None, ""))
        # INCREMENT_VERSION: an in-place write, the same bytes stay allocated
    return events


def _stack(event):
    """Python frames of an allocation event, innermost first, with the op that allocated it as a
    frame of its own (CUDA stacks name Python only)."""
    from torch._C._profiler import _EventType
    frames, parent, op = [], event.parent, None
    while parent:
        if parent.tag in (_EventType.PyCall, _EventType.PyCCall):
            frames.append(_frame(_name(parent)))
        elif op is None and parent.tag == _EventType.TorchOp and not _name(parent).startswith(MARKER_PREFIX):
            op = _name(parent)  # the innermost op: aten::mm, or an autograd node in backward
        parent = parent.parent
    return ([{"filename": "<op>", "line": 0, "name": op}] if op else []) + frames


# c10d calls that stage tensors in a buffer of their own and wait for the collective to finish
_COLLECTIVES = re.compile(r"<built-in method (_broadcast_coalesced|_verify_params_across_processes|reduce_scatter_single|all_gather_single)\b")


_FUNCTIONAL = re.compile(r"^_c10d_functional\w*::(?!wait_tensor|_wrap)")
# DDP's Reducer rebuilding its buckets on the first step: it makes the new buckets (kept) and
# the small int32 tensors it broadcasts the bucket layout in (the bucket count, 4 B, and the
# indices), which gloo may let go on its own thread once the broadcast is done
_REBUILD = re.compile(r"<built-in method _rebuild_buckets\b")


def _collective(event):
    """What collective an allocation was made in, from its parents: ("staging", the call's end
    time) inside a synchronous c10d call (its staging buffer may be let go on gloo's thread,
    whose frees the profiler does not record); ("rebuild", the call's end time) inside DDP's
    bucket rebuild; ("functional", None) for a functional collective's output (tensor
    parallelism: gloo's work holds it too); else (None, None)."""
    from torch._C._profiler import _EventType
    parent = event.parent
    while parent:
        if parent.tag == _EventType.PyCCall and _COLLECTIVES.match(_name(parent)):
            return "staging", parent.end_time_ns
        if parent.tag == _EventType.PyCCall and _REBUILD.match(_name(parent)):
            return "rebuild", parent.end_time_ns
        if parent.tag == _EventType.TorchOp and _FUNCTIONAL.match(_name(parent)):
            return "functional", None
        parent = parent.parent
    return None, None


def _note_reads(event, name, reads):
    """Note the tensors an op reads: (start, end, whether the op is a collective) per address."""
    collective = name.startswith(("c10d::", "_c10d_functional", "gloo:"))
    todo = list(event.extra_fields.inputs)  # tensors, lists of them (scatter: lists of lists), scalars
    while todo:
        value = todo.pop()
        if isinstance(value, list):
            todo.extend(value)
            continue
        ptr = getattr(value, "storage_data_ptr", None)
        if ptr is not None:
            reads.setdefault(ptr, []).append((event.start_time_ns, event.end_time_ns, collective))


def _last_reads(events, reads, outputs):
    """{(address, alloc time): end of the last op that read it} for the allocations gloo may have
    let go on its own thread, among those a collective made or read: a functional collective's
    output (`outputs`), a tensor whose last read was a collective (a scatter's source chunks),
    one whose address was allocated again (it was freed by then), or a buffer its stack names a
    temporary (FSDP2's all-gather and reduce-scatter buffers, freed after each use). Reads count
    until the next allocation there. A tensor still live at the end and used after its
    collectives (weights) is not one of them, nor are DDP's buckets (named from their stack),
    whose last read is their all-reduce when the optimizer reads them through views: the
    profiler saw that all-reduce end after later reads in some runs, and the buckets vanished
    from the end of the step (a flaky test, 3b16daf)."""
    touched = {addr for addr, rs in reads.items() if any(r[2] for r in rs)} | {addr for addr, _ in outputs}
    allocs, passing, lasting = {}, set(), set()
    for t, action, addr, _, frames, *_ in events:
        if action == "alloc" and addr in touched:
            allocs.setdefault(addr, []).append(t)
            name = distributed_name(frames) or ""
            if name.startswith("temporary/"):  # FSDP2's per-use buffers
                passing.add((addr, t))
            elif name == "grads/ddp_buckets":  # live as long as the DDP module, whoever read them last
                lasting.add((addr, t))
    out = {}
    for addr, times in allocs.items():
        times.append(float("inf"))
        for t, t_next in zip(times, times[1:]):
            last = max((r for r in reads.get(addr, ()) if t < r[0] < t_next), key=lambda r: r[1], default=None)
            if (addr, t) in lasting and t_next == float("inf"):
                continue
            if last is not None and (last[2] or (addr, t) in outputs or t_next != float("inf") or (addr, t) in passing):
                out[(addr, t)] = last[1]
    return out


def _rebuild_broadcasts(events, rebuilt, reads):
    """{(address, alloc time): the rebuild's end} for what DDP's bucket rebuild made and nothing
    read after it returned (until the address was allocated again): the layout tensors it
    broadcast, not the buckets (the all-reduces of every later backward read those)."""
    allocs, addrs = {}, {addr for addr, _ in rebuilt}
    for t, action, addr, *_ in events:
        if action == "alloc" and addr in addrs:
            allocs.setdefault(addr, []).append(t)
    out = {}
    for (addr, t), end in rebuilt.items():
        t_next = min((u for u in allocs.get(addr, ()) if u > t), default=float("inf"))
        if not any(end < start < t_next for start, *_ in reads.get(addr, ())):
            out[(addr, t)] = end
    return out


def _superseded_buckets(events, rebuilt):
    """{(address, alloc time): the rebuild's end} for DDP's buckets made before its rebuild:
    the rebuild replaces them, and the last reference may be step 1's all-reduce, which gloo's
    thread lets go of unrecorded (a rank's old bucket then stayed to the end, counted twice
    beside the new one: 1 run of tests/test_cpu_oracle.py's torchrun job in about 30, on 2 busy
    cores). Freed where the rebuild returns, as the shadow frees them; a free this thread
    recorded comes first (_free_staged frees only what no recorded free did)."""
    ends = [end for (addr, t), end in rebuilt.items()]
    if not ends:
        return {}
    start = min(t for (addr, t) in rebuilt)
    return {(addr, t): max(ends) for t, action, addr, _, frames, *_ in events
            if action == "alloc" and t < start and distributed_name(frames) == "grads/ddp_buckets"}


def _unseen_events(unseen, ranges, keep=(), named=None):
    """Allocations the memory profiler gives no tensor key (no aten op saw the memory: compiled
    code's buffers; every allocation on the raw road), paired with their frees by address (a
    free carries its allocation's frames, as the memory profile's do). keep: the recorder's named
    addresses (a dict gives each storage's bytes); on the raw road one named by a phase before
    any allocation there (named: address -> the first such time; without it, one with no
    allocation at all) was made before the profile (the weights of a model built before the
    Audit): it is "pre", at its storage's bytes. The profiler records no free of such a storage:
    one whose address is allocated again is freed then; one let go without that stays to the end
    (unattributed in the phases that no longer name it)."""
    out, live, first, older = [], {}, {}, set()
    for t, ptr, size, frames in sorted(unseen, key=lambda u: u[0]):
        if size > 0:
            first.setdefault(ptr, t)
    for ptr, nbytes in (keep.items() if isinstance(keep, dict) else ()):
        made = first.get(ptr)
        if nbytes and (made is None or (named is not None and named.get(ptr, made) < made)):
            live[ptr] = (nbytes, [])  # (an empty shard, 0 B, holds no memory)
            older.add(ptr)
            out.append((-1, "pre", ptr, nbytes, [], None, ""))
    for t, ptr, size, frames in sorted(unseen, key=lambda u: u[0]):
        if size > 0:
            if ptr in older:  # an older storage's address allocated again: it was let go first
                older.discard(ptr)
                if ptr in live:
                    out.append((t, "free", ptr, *live.pop(ptr), None, ""))
            live[ptr] = (size, frames)
            label = next((text for a, b, text in ranges if a <= t <= b), "") if ranges else ""
            out.append((t, "alloc", ptr, size, frames, "unknown", label))
        elif ptr in live:
            size, made = live.pop(ptr)
            out.append((t, "free", ptr, size, made, None, ""))
    return out


def _free_staged(events, staged, alive=()):
    """An allocation whose free this thread never saw (gloo let it go on its own thread) is freed
    at the time `staged` gives: a synchronous collective's staging buffer when the call returned,
    a functional collective's output after its last read. staged: {(address, alloc time): time}.
    An allocation is unfreed when it is live at the end or its address is allocated again first;
    one live at the end at an address in `alive` (named at the last phase) stays."""
    live, unfreed = {}, []
    for t, action, addr, size, *_ in events:
        if action == "alloc":
            if addr in live:
                unfreed.append((addr, *live[addr], t))
            live[addr] = (t, size)
        elif action == "free":
            live.pop(addr, None)
    unfreed += [(addr, t, size, float("inf")) for addr, (t, size) in live.items()]
    return events + [(min(staged[(addr, t)], t_next), "free", addr, size, [], None, "")
                     for addr, t, size, t_next in unfreed
                     if (addr, t) in staged and not (t_next == float("inf") and addr in alive)]


def name_compiled(events, wrappers):
    """Name the allocations a compiled graph's wrapper makes by its own buffer names
    (inductor_plan.PlanCursor). The name rides as a first frame ("<inductor>", "backward/buf12")
    that event_names.temporary_name reads."""
    from ..reading.inductor_plan import PlanCursor
    cursor, out = PlanCursor(wrappers), []
    if not cursor.plans:
        return events
    for e in events:
        t, action, addr, size, frames, category, label = e
        path = cursor.file_of(frames) if action == "alloc" else None
        if path:
            e = (t, action, addr, size, [{"filename": "<inductor>", "line": 0, "name": cursor.name(path, size)}] + frames,
                 category, label)
        out.append(e)
    return out
