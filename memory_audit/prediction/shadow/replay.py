"""The shadow's CUDA history played through the caching allocator's model (reading/allocator_model): what
memory_allocated() and memory_reserved() would count, and the predicted step as a CUDA snapshot.

The shadow run (shadow/step.py) gives every request of the process in order, from model.to(device)
on; allocator_model.CachingAllocatorModel chooses the blocks and the segments as the allocator does
(rounding, best fit, the split rule, merging on free). The snapshot it writes has the schema a
real CUDA snapshot has (segments with their blocks, a trace with segment_alloc, alloc,
free_requested and free_completed), so `attribute`, `viz` and MemoryViz read it as they read a
measurement; each event's one frame names its ledger key (schema.PREDICTED_FRAME).
"""

from array import array
from itertools import accumulate

from ...reading.allocator_sim import round_size
from ...reading.trace import fastcore
from ...schema import PHASES_KEY, PREDICTED_FRAME


STREAM_SPAN = 1 << 52  # each stream's segments in an address range of their own


def placed(result, expandable=False):
    """The caching allocator's model over every event of the shadow's history and step:
    (is an alloc, block bytes, address, new segment's start or -1, reserved bytes added), one
    sequence each, one value per event. A pool per stream (result["streams"]: what FSDP2 makes
    on its collectives' streams), as the allocator keeps them: no block or segment of one
    serves another's requests."""
    events = result["history"] + result["events"]
    is_alloc = bytes(e[0] == "alloc" for e in events)
    streams = result.get("streams")
    if not streams:
        return (is_alloc, *_placed(events, expandable))
    cols = [array("q", bytes(8 * len(events))) for _ in range(4)]
    order = {}  # stream -> the positions of its events
    for i, e in enumerate(events):
        order.setdefault(streams.get(e[3], 0), []).append(i)
    for stream, at in order.items():
        block, addr, seg, grown = _placed([events[i] for i in at], expandable)
        for j, i in enumerate(at):
            cols[0][i], cols[1][i], cols[3][i] = block[j], addr[j] - stream * STREAM_SPAN, grown[j]
            cols[2][i] = seg[j] - stream * STREAM_SPAN if seg[j] != -1 else -1
    return (is_alloc, *cols)


def _placed(events, expandable):
    """placed()'s four sequences for one pool: the compiled model (_fastcore.model) where it is
    built, else the reference, allocator_model.CachingAllocatorModel: the same numbers (test_fastcore)."""
    core = fastcore()
    if core is None:
        return _placed_py(events, expandable)
    cols = core.model(bytes(e[0] == "alloc" for e in events), array("q", [e[2] for e in events]).tobytes(),
                      array("q", [e[3] for e in events]).tobytes(), expandable)
    return tuple(array("q", c) for c in cols)


def _placed_py(events, expandable):
    from ...reading.allocator_model import CachingAllocatorModel
    model, at = CachingAllocatorModel(expandable), {}
    block, addr, seg, grown = [], [], [], []
    for action, _, nbytes, aid in events:
        if action == "alloc":
            before = model.reserved
            a, extra = model.alloc(nbytes)
            b = round_size(nbytes) + extra
            at[aid] = (a, b)
            added = model.reserved - before
            seg.append(model.segment_of[a] if added else -1)
        else:
            a, b = at.pop(aid)
            model.release(a)
            added = 0
            seg.append(-1)
        grown.append(added)
        addr.append(a)
        block.append(b)
    return block, addr, seg, grown


def play(result, expandable=False, names=None):
    """Yields (position, action, name, bytes asked, block bytes, address, new segment or None,
    stream) for every event of the shadow's history and step, the step's by `names` where given
    (shadow/names.audit_names: as an audit names them); a new segment is (start, bytes)."""
    _, block, addr, seg, grown = placed(result, expandable)
    names, streams = names or {}, result.get("streams", {})
    for i, (action, key, nbytes, aid) in enumerate(result["history"] + result["events"]):
        key = names.get(aid, key) if i >= len(result["history"]) else key
        yield i, action, key, nbytes, block[i], addr[i], (seg[i], grown[i]) if grown[i] else None, streams.get(aid, 0)


def replay(result, expandable=False):
    """Plain numbers of step 2: {"steady_state", "before_backward", "end", "peak" (allocated
    bytes as memory_allocated() counts them), "peak_event" (the index of the step's event after
    which it is reached; -1: the start), "reserved" (the segments made by the end),
    "reserved_steady" (those made by the step's start), "reserved_before_backward"}."""
    is_alloc, block, _, _, grown = placed(result, expandable)
    # memory_allocated() and memory_reserved() before each event, then after the last
    levels = list(accumulate((b if a else -b for a, b in zip(is_alloc, block)), initial=0))
    reserved = list(accumulate(grown, initial=0))
    start = len(result["history"])
    at = {phase: levels[start + i] for phase, i in result["phases"].items()}
    peak = max(levels[start:])
    return {"steady_state": at["step2_start"], "before_backward": at.get("step2_before_backward"),
            "end": at["step2_end"], "peak": peak, "peak_event": levels.index(peak, start) - start - 1,
            "reserved": reserved[-1], "reserved_steady": reserved[start],
            "reserved_before_backward": reserved[start + result["phases"].get("step2_before_backward", 0)]}


def snapshot(result, expandable=False, names=None):
    """The predicted process as a CUDA snapshot: the trace of every request (one microsecond
    apart), the step's named by `names` (play's), and the segments as they stand at step 2's end
    with their blocks."""
    trace, live, segments = [], {}, {}  # segments: start -> [bytes, stream]
    start, step_at = len(result["history"]), {}  # step event -> the trace entry it starts at
    for i, action, key, nbytes, block, addr, seg, stream in play(result, expandable, names):
        step_at[i - start] = len(trace)
        frames = [{"filename": PREDICTED_FRAME, "line": 0, "name": key}]
        if seg:
            trace.append({"action": "segment_map" if expandable else "segment_alloc", "addr": seg[0],
                          "size": seg[1], "stream": stream, "frames": frames, "time_us": i})
            segments.setdefault(seg[0], [0, stream])[0] += seg[1]
        if action == "alloc":
            live[addr] = (block, nbytes, frames)
            trace.append({"action": "alloc", "addr": addr, "size": nbytes, "stream": stream, "frames": frames,
                          "time_us": i, "category": key.split("/", 1)[0]})
        else:
            live.pop(addr)
            for a in ("free_requested", "free_completed"):
                trace.append({"action": a, "addr": addr, "size": nbytes, "stream": stream, "frames": frames,
                              "time_us": i})
    step_at[len(result["events"])] = len(trace)
    return {"segments": [_segment(at, size, live, expandable, stream) for at, (size, stream) in sorted(segments.items())],
            "device_traces": [trace], "allocator_settings": {"expandable_segments": expandable},
            PHASES_KEY: {phase: step_at[i] for phase, i in result["phases"].items()}}


def _segment(start, size, live, expandable, stream=0):
    """A segment dict: its live blocks, and the free space between them as inactive blocks."""
    blocks, at = [], start
    for addr in sorted(a for a in live if start <= a < start + size):
        block, nbytes, frames = live[addr]
        if addr > at:
            blocks.append({"address": at, "size": addr - at, "requested_size": 0, "state": "inactive"})
        blocks.append({"address": addr, "size": block, "requested_size": nbytes, "state": "active_allocated",
                       "frames": frames})
        at = addr + block
    if at < start + size:
        blocks.append({"address": at, "size": start + size - at, "requested_size": 0, "state": "inactive"})
    used = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": 0, "address": start, "total_size": size, "allocated_size": used, "active_size": used,
            "requested_size": sum(b["requested_size"] for b in blocks), "stream": stream,
            "segment_type": "small" if size == 2 << 20 else "large", "segment_pool_id": [0, 0],
            "is_expandable": expandable, "frames": [], "blocks": blocks}
