"""Attribute every byte of a snapshot: at the moment it was taken, and over its trace.

Pure functions over the loaded snapshot dict and, when present, the run's meta.json.

At a moment, each active block's requested bytes go to one named line and its rounding
(size - requested_size) to `gaps`; inactive blocks are `cached_free`, blocks freed but not yet
reusable `pending_free`. The books balance per device: categories sum to the reserved bytes
(segment total_size), active blocks to memory_allocated. Naming rules, strongest first:
  registry       meta.json's address registry for that phase (weights, grads, Adam, inputs)
  saved-tensors  meta.json's saved-tensor ledger (activations, at the phase it was taken)
  workspace      trace: a block of a cuBLAS(Lt) workspace's size made while recording, never freed
  frames         the allocation's Python stack (for snapshots with no meta.json)
Whatever no rule names is `unattributed`, listed with its frames, never hidden.
"""

import numpy as np

from ..schema import CATEGORIES, PREDICTED_FRAME
from .trace import A, as_trace

# Sizes the cuBLAS workspace takes (CublasHandlePool.cpp): ":4096:2:16:8" = 8,519,680 B by
# default, 4096 KiB x 8 = 33,554,432 B on sm90 (measured on an H100, torch 2.11).
# Only a hint: a block must also have been allocated at a GEMM and never freed (see below).
CUBLAS_WORKSPACE_SIZES = (8_519_680, 33_554_432)
# Which blocks are workspaces: a workspace's size, made while recording and never freed, on a CUDA
# trace, named by no stronger rule (with no meta.json, a frame must also show a GEMM). Their Python frames say nothing certain: the first GEMM of a
# thread runs from a Linear, inductor's generated code, SAC's policy mode (_ops.py under
# checkpoint.py), a `@` in a library's rotary embedding, an optimizer's step (Adafactor's) or no
# frames at all (autograd's thread); every one of these was measured on an H100, torch 2.11,
# 2026-11-27 (scripts/zoo_audit.py, shadow_check, tests/test_cuda.py's compiled audits).
# cuBLASLt's workspace (CUBLASLT_WORKSPACE_SIZE KiB, default 1024): made by each thread's first
# addmm with a bias epilogue (a Linear with a bias), after that thread's cuBLAS workspace; measured
# on an H200, torch 2.11 (2026-11-26, 0e54def: every random tiny config with bias=True)
CUBLASLT_WORKSPACE_SIZE = 1024 * 1024


def workspace_size_from_env(env):
    """Bytes of one cuBLAS workspace given CUBLAS_WORKSPACE_CONFIG (':SIZE_KiB:COUNT' pairs)."""
    conf = (env or {}).get("CUBLAS_WORKSPACE_CONFIG")
    if not conf:
        return None
    parts = [p for p in conf.split(":") if p]
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        return None
    return sum(nums[i] * 1024 * nums[i + 1] for i in range(0, len(nums) - 1, 2))


def _frame_text(frames, n=4):
    return " <- ".join(f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line', 0)}:{f.get('name', '?')}"
                       for f in frames[:n])


# Python functions that make a model's weights (by exact name: C++ frames such as
# "torch::unwind" or "at::_to_copy" must not match "to")
_INIT_FUNCTIONS = frozenset(("reset_parameters", "_init_weights", "__init__", "_apply", "to", "load_state_dict"))


def name_from_frames(frames, live=True):
    """Best-effort (name, rule) from a stack, for snapshots without meta.json; the first rule
    that matches wins: optimizer state (_init_group, or made in a step and still live), the
    GradScaler, gradients (zero_grad; made in backward and still live), weights (module
    construction, _apply/to, load_state_dict, outside any forward), backward, forward
    (activations, by the forward's file:line), and, for an allocation still `live` that the
    user's own code made outside all of these, the user (by that file:line). The same rules name a block at the snapshot's end and an allocation at
    any moment of its trace (timeline.py), so the peak and the end table agree."""
    if not frames:
        return None, None
    if frames[0].get("filename") == PREDICTED_FRAME:  # a predicted snapshot (shadow/step.snapshot): its key
        return frames[0].get("name"), "predicted"
    text = " ".join(f"{f.get('filename', '')}:{f.get('name', '')}" for f in frames)
    if "_init_group" in text and ("adam" in text or "optim" in text):
        return "optimizer/state", "frames:optimizer-init"
    if "optim" in text and ("step" in text or "_single_tensor" in text or "_multi_tensor" in text):
        if not live:  # made in a step and freed in it: the step's own temporary
            return None, None
        # live in a snapshot yet made inside a step: state an optimizer makes on its first step
        # outside _init_group (older torch, hand-written optimizers)
        return "optimizer/state-made-in-step", "frames:optimizer-step"
    if "grad_scaler" in text:
        return "optimizer/grad_scaler", "frames:grad-scaler"
    if "zero_grad" in text:
        return "grads/zero_grad", "frames:zero-grad"
    if any(f.get("name") in _INIT_FUNCTIONS for f in frames) and "forward" not in text:
        return "weights/init", "frames:module-init"
    if "backward" in text or "autograd::Engine" in text:  # Python's backward, or autograd's own thread
        # still live when the snapshot was taken: what backward leaves behind, the gradients
        return ("grads/made-in-backward", "frames:backward-live") if live else ("temporary/backward", "frames:backward")
    if "forward" in text:
        fwd = next((f for f in frames if f.get("name") == "forward"), frames[0])
        where = f"{fwd.get('filename', '?').rsplit('/', 1)[-1]}:{fwd.get('line', 0)}"
        return f"activations/{where}", "frames:forward"
    site = user_site(frames) if live else None
    if site:
        return f"user/{site}", "frames:user-site"
    return None, None


# Where library code lives: a frame in none of these (and a Python file) is the user's own code.
_LIBRARY_PATHS = ("/site-packages/", "/dist-packages/", "/lib/python", "/torch/", "<frozen")


def user_site(frames):
    """'file.py:line' of the innermost frame in the user's own Python code (not torch, not an
    installed package, not the standard library), or None."""
    for f in frames:
        filename = f.get("filename") or ""
        if filename.endswith(".py") and not any(k in filename for k in _LIBRARY_PATHS):
            return f"{filename.rsplit('/', 1)[-1]}:{f.get('line', 0)}"
    return None


_DDP_BUCKETS = ("_ddp_init_helper", "_rebuild_buckets")
_DDP_FILE = "torch/nn/parallel/distributed.py"


def distributed_name(frames):
    """Names from the stack for what torch.distributed keeps: "grads/ddp_buckets" for DDP's
    gradient buckets (made by its Reducer when DDP is built and when it rebuilds them on the first
    step), "buffers/device_mesh" for a DeviceMesh's rank tensor, FSDP2's all-gather and
    reduce-scatter buffers "temporary/fsdp_all_gather" / "temporary/fsdp_reduce_scatter"; else None."""
    frames = frames or ()
    if frames and frames[0].get("name") == "_pre_forward" and frames[0].get("filename", "").endswith(_DDP_FILE):
        # the Reducer's C++ _rebuild_buckets, called from DDP's _pre_forward (no frame of its own on
        # CUDA: torch 2.11 on an H100, NCCL, 2026-11-27)
        return "grads/ddp_buckets"
    for f in frames:
        name = f.get("name") or ""
        if any(k in name for k in _DDP_BUCKETS):
            return "grads/ddp_buckets"
        if name == "init_device_mesh":
            return "buffers/device_mesh"
        if name == "foreach_all_gather":  # FSDP2's flat buffer for a unit's all-gather
            return "temporary/fsdp_all_gather"
        if name == "foreach_reduce":  # FSDP2's reduce-scatter input and output
            return "temporary/fsdp_reduce_scatter"
    return None


BASELINE = "baseline/before-recording"


def baseline_name(snap):
    """A block with no frames that no entry of the trace made existed before recording began
    (what ptmem calls the baseline): the weights and state a script made before it called
    _record_memory_history. Which of them it is the snapshot cannot say; that it predates the
    recording it can, and the name says which evidence: a trace that began late, or no trace."""
    traces = snap.get("device_traces") or []
    return BASELINE if any(len(t) for t in traces) else "baseline/no-trace"


def workspace_sizes(meta):
    """Sizes a cuBLAS workspace may have: the run's CUBLAS_WORKSPACE_CONFIG, else the defaults."""
    expected = workspace_size_from_env((meta or {}).get("env"))
    return (expected,) if expected else CUBLAS_WORKSPACE_SIZES


def live_at_end(trace):
    """{addr: entry index} of the allocations still live when the trace ends (an alloc not
    followed by a free_requested at its address). Computed once per trace."""
    t = as_trace(trace)
    if "live_at_end" not in t.cache:
        act = t.act
        if not (act == A["free"]).any():
            # the replay's pairing ends an alloc at its free_requested (or at a later alloc at
            # the same address), which is this rule exactly when there are no legacy `free`s
            ends = np.flatnonzero((act == A["alloc"]) & (t.pairing() < 0))
        else:
            idx = np.flatnonzero((act == A["alloc"]) | (act == A["free_requested"]))
            addr = t.addr[idx]
            order = np.lexsort((idx, addr))  # by address, then in trace order
            last = np.r_[addr[order][1:] != addr[order][:-1], True] if len(idx) else np.zeros(0, bool)
            ends = idx[order][last]
            ends = np.sort(ends[act[ends] == A["alloc"]])
        t.cache["live_at_end"] = dict(zip(t.addr[ends].tolist(), ends.tolist()))
    return t.cache["live_at_end"]


def lt_workspace_size(meta):
    """Bytes of one cuBLASLt workspace: the run's CUBLASLT_WORKSPACE_SIZE (KiB), else 1 MiB."""
    kib = ((meta or {}).get("env") or {}).get("CUBLASLT_WORKSPACE_SIZE")
    return int(kib) * 1024 if str(kib or "").isdigit() else CUBLASLT_WORKSPACE_SIZE


def trace_workspaces(trace, meta=None):
    """{address: ledger key} of the cuBLAS and cuBLASLt workspaces in a CUDA trace: of a
    workspace's size, made while recording and still live at its end (cuBLAS never frees one;
    without meta.json, made where a frame shows a GEMM or with no frames);
    cuBLASLt's only in a trace that holds a cuBLAS workspace (every CUDA GEMM makes that one
    first). A stronger rule (the registry, the saved tensors) names a block first."""
    t = as_trace(trace)
    if t.cpu:
        return {}
    sizes, lt_size = workspace_sizes(meta), lt_workspace_size(meta)
    out = {}
    for addr, i in live_at_end(t).items():
        size = int(t.size[i])
        # a snapshot from elsewhere has no registry to name its weights first (a 4096 x 4096 bf16
        # projection is 32 MiB too): there a frame must show a GEMM, or none be there
        if (size in sizes or size == lt_size) and (meta is not None or _gemm_frames(t.frames(i))):
            out[addr] = "workspace/cublas" if size in sizes else "workspace/cublaslt"
    if "workspace/cublas" not in out.values():
        return {}
    return out


_GEMMS = ("linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "einsum", "call")  # "call": inductor's code


def _gemm_frames(frames):
    """Evidence a block was made by a GEMM's first call on its thread: no Python frames
    (autograd's thread), or a frame of a function that runs one."""
    return not frames or any(f.get("name") in _GEMMS or (f.get("filename") or "").endswith("linear.py")
                             for f in frames)


def phase_names(meta, phase):
    """{address: (name, rule)} a phase of an audit run names: its registry (weights, buffers,
    grads, optimizer state, what the loop named), the saved tensors (before backward), then
    what the loop holds that nothing else named (the model's output, the loss)."""
    by_addr = {}
    info = (meta or {}).get("phases", {}).get(phase)
    if info is None:
        return by_addr
    for r in info.get("registry", []):
        by_addr.setdefault(r["data_ptr"], (r["name"], "registry"))
    if phase == "step2_before_backward":
        for s in meta.get("saved_tensors", []):
            by_addr.setdefault(s["data_ptr"], (s["key"], "saved-tensors"))
    for r in info.get("held", []):
        by_addr.setdefault(r["data_ptr"], (r["name"], "held"))
    return by_addr


def earlier_names(snap, meta, phase):
    """{address: (name, rule)} for the allocations live in this phase's snapshot that an earlier
    phase of the same run named: the same allocation (made before that phase's position in the
    trace, not freed since) keeps its name, such as the previous step's loss and output a loop
    still holds before backward. Needs each phase's trace position (meta.json)."""
    phases = (meta or {}).get("phases", {})
    here = phases.get(phase, {}).get("trace_entries")
    earlier = sorted(((info["trace_entries"], name) for name, info in phases.items()
                      if info.get("trace_entries") is not None and here is not None and info["trace_entries"] < here
                      and not info.get("ring_buffer_full")), reverse=True)  # the latest name first
    out = {}
    for trace in snap.get("device_traces", [])[:1] if earlier else []:
        live = live_at_end(trace)  # address -> index of its alloc entry
        for at, name in earlier:
            for addr, named in phase_names(meta, name).items():
                if addr in live and live[addr] < at:
                    out.setdefault(addr, (named[0], f"{named[1]}@{name}"))
    return out


def block_namer(snap, meta=None, phase=None):
    """Return name(block) -> (name, rule), built for one snapshot and its phase."""
    by_addr = phase_names(meta, phase)
    for addr, hit in earlier_names(snap, meta, phase).items():
        by_addr.setdefault(addr, hit)
    workspaces = {}
    for trace in snap.get("device_traces", []):
        workspaces.update(trace_workspaces(trace, meta))

    made = {r["data_ptr"]: r["name"] for r in (meta or {}).get("phases", {}).get(phase, {}).get("made", [])}
    seen = set()  # allocations the trace saw made (and not freed since)
    if meta is None:
        for trace in snap.get("device_traces", []):
            seen |= set(live_at_end(trace))

    def name(block):
        hit = by_addr.get(block.get("address"))
        if hit:
            return hit
        kept = distributed_name(block.get("frames"))
        if kept:
            return kept, "frames:distributed"
        if block.get("address") in workspaces:
            return workspaces[block["address"]], "workspace"
        if block.get("address") in made:  # what the code made that nothing above names (loop_calls)
            return made[block["address"]], "made"
        if meta is None:  # a snapshot from elsewhere: fall back to its stacks
            nm, rule = name_from_frames(block.get("frames") or [])
            if nm:
                return nm, rule
            if not block.get("frames") and block.get("address") not in seen:
                return baseline_name(snap), "baseline"
        return None, None

    return name


def attribute(snap, meta=None, phase=None, top_unattributed=10):
    """Attribute one snapshot. Returns {device: result} with integer bytes.

    result: reserved_bytes, allocated_bytes (active_allocated block sizes, what
    torch.cuda.memory_allocated() counts), categories {category: bytes}, lines {name: bytes},
    rules {rule: bytes}, unattributed [largest blocks with frames], balanced (bool).
    """
    namer = block_namer(snap, meta, phase)
    # device -> addresses of allocations the trace saw and that are still live
    in_trace = {dev: live_at_end(trace) for dev, trace in enumerate(snap.get("device_traces", []))}
    out = {}
    for seg in snap["segments"]:
        dev = seg.get("device", 0)
        r = out.setdefault(dev, {"device": dev, "reserved_bytes": 0, "allocated_bytes": 0,
                                 "categories": {c: 0 for c in CATEGORIES}, "lines": {}, "rules": {},
                                 "unattributed": [], "blocks": 0})
        r["reserved_bytes"] += seg["total_size"]
        for block in seg["blocks"]:
            size, state = block["size"], block["state"]
            if state == "inactive":
                r["categories"]["cached_free"] += size
                continue
            if state == "active_pending_free":
                r["categories"]["pending_free"] += size
                continue
            r["blocks"] += 1
            r["allocated_bytes"] += size
            requested = block.get("requested_size") or size
            requested = min(requested, size)
            r["categories"]["gaps"] += size - requested
            name, rule = namer(block)
            if name is None:
                name, rule = "unattributed", "none"
                seen = block.get("address") in in_trace.get(dev, ())
                why = ("no rule matched its frames" if block.get("frames") else
                       "no frames, allocated while recording (another thread or stacks off)" if seen else
                       "no frames, allocated before recording began")
                r["unattributed"].append({"address": block.get("address"), "size": size,
                                          "requested_size": requested, "why": why,
                                          "frames": _frame_text(block.get("frames") or [], 6)})
            category = name.split("/", 1)[0]
            if category not in r["categories"]:
                category = "unattributed"
            r["categories"][category] += requested
            r["lines"][name] = r["lines"].get(name, 0) + requested
            r["rules"][rule] = r["rules"].get(rule, 0) + requested
    for r in out.values():
        r["unattributed"].sort(key=lambda b: -b["size"])
        r["unattributed_bytes"] = r["categories"]["unattributed"]
        r["unattributed"] = r["unattributed"][:top_unattributed]
        total = sum(r["categories"].values())
        r["balanced"] = total == r["reserved_bytes"]
        assert r["balanced"], f"device {r['device']}: categories sum to {total}, reserved is {r['reserved_bytes']}"
    return out


def check_against_meta(result, meta, phase):
    """Compare attributed totals with what the allocator reported at that phase.

    Returns a dict of (measured, reported) pairs; reported is None where meta has no number
    (CPU runs, foreign snapshots).
    """
    info = (meta or {}).get("phases", {}).get(phase, {})
    checks = {}
    for dev, r in result.items():
        checks[dev] = {"memory_allocated": (r["allocated_bytes"], info.get("memory_allocated")),
                       "memory_reserved": (r["reserved_bytes"], info.get("memory_reserved"))}
    return checks
