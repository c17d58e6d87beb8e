"""The audit's names for what a shadow run made, and the step written as a snapshot.

What the loop holds between steps by the names an audit gives it (held_names), what the audited
forward saved by the saved-tensor ledger's names (naming: naming.saved.saved_tensor_ledger run over
the fake tensors), each gradient by its parameter (name_grads), and what a forward made and let
go within the step as the temporary the audit calls it (audit_names). lines() reads a run's
result at a phase by those names; snapshot() writes a CPU step in the snapshot schema.
"""

import contextlib

from ...schema import PHASES_KEY, PREDICTED_FRAME


def held_names(model, optimizer, held):
    """{storage id: name} of what the loop holds between steps, named as an audit names it."""
    import torch
    from ...naming.tensors import dense_parts, is_view_into_more, local_tensor, named_tensors
    out = {}

    def put(t, name):
        if isinstance(t, torch.Tensor):  # a DTensor's memory is its shard's, as the audit names it
            out.setdefault(local_tensor(t).untyped_storage()._cdata, name)
    for name, t in named_tensors(model, optimizer, None, held):  # the audit's own registry first
        put(t, name)
    param_name = {}
    for name, p in model.named_parameters():
        param_name[id(p)] = name
        put(p, f"weights/{name}")
        if p.grad is not None and (p.grad.is_sparse or not is_view_into_more(p.grad)):  # a view into DDP's
            for part, g in dense_parts(f"grads/{name}", p.grad):  # bucket is the bucket's
                put(g, part)
    for name, b in model.named_buffers():
        put(b, f"buffers/{name}")
    for p in model.parameters():  # DTensors' mesh: its tensor of ranks (read as stored: .mesh makes a view)
        put(getattr(getattr(p, "device_mesh", None), "_rank_map", None), "buffers/device_mesh")
    for p, state in optimizer.state.items():
        for k, v in state.items():
            put(v, f"optimizer/{k}/{param_name.get(id(p), '?')}")
    for name, t in held.items():
        put(t, name)
    return out


@contextlib.contextmanager
def naming(tracker, model, device_type):
    """Around the audited forward: the audit's own names of what it saves for backward
    (naming.saved.saved_tensor_ledger: the module and op that saved each storage, #n for a second
    one; storages told apart by their C++ address, fake tensors having none). Yields
    name(loss, held, loop): {allocation id: name} in tracker.saved_names for what the forward
    made, the loop's names first (naming.tensors.named_tensors(*loop): FSDP2's unsharded weights, the
    batch, the loss), then the saved tensors' and `held`'s, as attribute.phase_names orders them."""
    from ...naming.saved import saved_tensor_ledger
    from ...naming.tensors import local_tensor, named_tensors
    records = []
    device = "meta" if device_type == "cuda" else "cpu"  # a CUDA step's wrapped scalars are host memory
    def recomputing(context, module):
        return _Recomputing(tracker, context, module)
    with saved_tensor_ledger(model, records, device, ident=address, recomputing=recomputing) as label:
        def name(loss, held, loop):
            label(loss, held=held)
            names = [(address(local_tensor(t).untyped_storage()), n) for n, t in named_tensors(*loop)]
            tracker.saved_names = live_names(tracker, names, records)  # the held outputs among them, last
        yield name


class _Recomputing:
    """Around a checkpoint's recompute context (as naming.checkpoints._RecomputeLabel is in an audit): what
    the recomputation makes is keyed recomputed/<module>. A class with the audit's __enter__ and
    __exit__, not a generator: a @contextmanager generator in its place (the early stop raises
    through it) lets a SAC block's 262,144 B forward output go earlier than the audit measures
    (cpu-long's bf16 SAC row); which part of contextlib does it is not pinned down."""

    def __init__(self, tracker, inner, module):
        self.tracker, self.inner, self.module = tracker, inner, module

    def __enter__(self):
        self.tracker.recomputing = self.module
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.tracker.recomputing = None


def live_names(tracker, names, records, last=()):
    """{allocation id: name} of what is live: `names` [(storage address, name)] first, then the
    saved-tensor ledger's records, then `last`, as attribute.phase_names orders them."""
    ids = {sid: aid for sid, (aid, _) in tracker.live.items()}
    ids.update((ref.cdata, aid) for ref, aid in tracker.saved)  # real scalars and RNG states
    out = {}
    for sid, n in names + [(r["data_ptr"], r["key"]) for r in records] + list(last):
        if sid in ids:
            out.setdefault(ids[sid], n)
    return out


def name_grads(tracker, model):
    """After a backward, each parameter's gradient names its allocation from its making on, as
    the audit names it (a gradient zero_grad lets go has no name at the step's end; a sharded
    one by its local shard; a storage several gradients view, DDP's bucket, keeps its own name)."""
    from ...naming.tensors import dense_parts, local_tensor
    owners = {}  # allocation id -> the parameters whose gradient lives in it
    for name, p in model.named_parameters():
        for part, grad in dense_parts(name, local_tensor(p.grad)) if p.grad is not None else ():
            entry = tracker.live.get(address(grad.untyped_storage()))
            if entry is not None:
                owners.setdefault(entry[0], []).append(part)
    for aid, names in owners.items():  # a storage several gradients view (DDP's bucket) keeps its name
        if len(names) == 1 and not tracker.allocs[aid][0].startswith("grads/"):
            tracker.allocs[aid][0] = f"grads/{names[0]}"


def address(storage):
    return storage._cdata


def lines(result, phase="step2_before_backward"):
    """{name: bytes} live at a phase of the shadow's step, named as an audit names them
    (attribute.block_namer's order): at the step's end what the loop holds then
    (result["end"]), what the audited forward made by the audit's names (result["saved"]:
    run(..., names=True)), what is live when the step starts by the loop's names then, what else
    the code made by its call (result["made"]: loop_calls), the rest by the shadow's own keys.
    A result without names (names=False, or a repeated step: shadow/repeat) raises ValueError."""
    if "saved" not in result:
        raise ValueError("this shadow run was made without names (run(..., names=True); a repeated step has none)")
    saved, made = result["saved"], result.get("made", {})
    end = result.get("end", {}) if phase == "step2_end" else {}
    pre = {aid: key for aid, key, _ in result["pre"]}
    live = {aid: (key, nbytes) for aid, key, nbytes in result["pre"]}
    for action, key, nbytes, aid in result["events"][:result["phases"][phase]]:
        if action == "alloc":
            live[aid] = (key, nbytes)
        else:
            live.pop(aid, None)
    out = {}
    for aid, (key, nbytes) in live.items():
        if nbytes:
            name = end.get(aid) or saved.get(aid) or pre.get(aid) or made.get(aid) or key
            out[name] = out.get(name, 0) + nbytes
    return out


def snapshot(result):
    """The shadow's step as a snapshot (CPU schema: one segment per live allocation, as CPU
    audits write them) that MemoryViz opens and `attribute`/`viz` name by the events' keys. The
    trace starts with what is live when the step starts (at time 0), then the step's events;
    addresses are made up, one range per allocation. What the audited forward made is named as
    the audit names it (result["saved"]: lines)."""
    from ...reading.cpu_snapshot import snapshot_at
    addr, events, t = {}, [], 0
    next_addr = 1 << 32

    def place(aid, nbytes):
        nonlocal next_addr
        addr[aid] = next_addr
        next_addr += -(-max(nbytes, 1) // 512) * 512
        return addr[aid]

    def frames(key):
        return [{"filename": PREDICTED_FRAME, "line": 0, "name": key}]
    for aid, key, nbytes in result["pre"]:
        events.append((0, "alloc", place(aid, nbytes), nbytes, frames(key), key.split("/", 1)[0], ""))
    names = audit_names(result)
    at = [len(events)]  # the trace entry each step event starts at (a free is two entries)
    for action, key, nbytes, aid in result["events"]:
        t += 1000
        where = place(aid, nbytes) if action == "alloc" else addr[aid]
        key = names.get(aid, key)
        events.append((t, action, where, nbytes, frames(key), key.split("/", 1)[0], ""))
        at.append(at[-1] + (1 if action == "alloc" else 2))
    snap = snapshot_at(events, t)
    snap[PHASES_KEY] = {phase: at[i] for phase, i in result["phases"].items()}
    return snap


def audit_names(result):
    """{allocation id: name} where the audit of the step names an allocation otherwise than the
    shadow's key: what the audited forward made by its saved-tensor names (names=True), and what a
    forward or a batch made and let go within the step, not live at its before-backward snapshot
    (a checkpointed block's outputs, an earlier micro-step's activations and batch, the batch's
    index tensor), as the temporary the audit calls it."""
    names = dict(result.get("saved") or {})
    cut = result["phases"].get("step2_before_backward")
    made = {}  # forward allocations without a name: {id: (position, key)}
    for i, (action, key, _, aid) in enumerate(result["events"]):
        if action == "alloc" and key.startswith(("activations/", "inputs/")) and aid not in names:
            made[aid] = (i, key)
        elif action == "free" and aid in made:
            at, key = made.pop(aid)
            if cut is None or not at < cut <= i:  # not live at the snapshot
                phase, rest = key.split("/", 1)
                names[aid] = f"temporary/{'forward' if phase == 'activations' else phase}/{rest}"
    return names
