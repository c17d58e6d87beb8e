"""A CPU step's allocation events as the CUDA snapshot schema, cut at a moment.

CPU memory has no caching allocator: each allocation live at the cut is a segment of its own with
one active block (size == requested_size), so reserved == allocated and there are no gaps. The
CPU audit (recording/cpu_timeline's events) and the CPU shadow run's predicted trace
(prediction/shadow/names) both write their snapshots here.

events: (t ns, action "pre" | "alloc" | "free", address, bytes, frames, category, label), in
time order; "pre" is live before the trace began (in the segments, not in the trace).
"""


def snapshot_at(events, t_cut):
    """The snapshot dict of the allocations live at time t_cut (ns), with the trace up to it."""
    trace, live = [], {}
    for t, action, addr, size, frames, category, label in events:
        if t > t_cut:
            break
        time_us = max(t, 0) // 1000
        if action == "pre":  # live before the trace began: in the segments, not in the trace
            live[addr] = (size, frames)
        elif action == "alloc":
            live[addr] = (size, frames)
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                          "frames": frames, "time_us": time_us, "category": category})
            if label:
                trace[-1]["user_metadata"] = label
        else:
            live.pop(addr, None)
            for a in ("free_requested", "free_completed"):
                trace.append({"action": a, "addr": addr, "size": size, "stream": 0,
                              "frames": frames, "time_us": time_us})
    segments = []
    for addr, (size, frames) in sorted(live.items()):
        block = {"address": addr, "size": size, "requested_size": size,
                 "state": "active_allocated", "frames": frames}
        segments.append({"device": 0, "address": addr, "total_size": size, "allocated_size": size,
                         "active_size": size, "requested_size": size, "stream": 0,
                         "segment_type": "large", "segment_pool_id": [0, 0], "is_expandable": False,
                         "frames": frames, "blocks": [block]})
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"cpu_profiler_timeline": True}}
