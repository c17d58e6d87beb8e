"""The saved-tensor ledger: every tensor autograd saves in a forward, one record per storage,
named activations/<module>/<op> by the graph node that saved it (the audit's and the shadow
run's names for activations)."""

import bisect
import weakref
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .checkpoints import checkpoint_observers
from .tensors import local_tensor, module_namer, op_name, short_module, tensors_in


class _SavedStorages:
    """What autograd saved in a forward, one record per storage in forward order (the module,
    device, bytes, dtype and shape of the first tensor seen there), and weak references to the
    saved tensors whose grad_fns lead into the graph. `ident(storage)` names a storage: its
    data_ptr (real tensors), or its C++ address where tensors have no memory (the shadow run's
    fake tensors)."""

    def __init__(self, stack, ident=None):
        self.stack = stack  # the modules running now, innermost last
        self.ident = ident or storage_ptr
        self.first_seen = {}  # storage data_ptr -> record, in forward order
        self.alive = {}  # storage data_ptr -> a weak reference to the storage recorded there
        self.impls = {}  # storage data_ptr -> the storage (its C++ address) first seen there
        self.weak = []  # weak references to what was saved: their grad_fns find the graph without a loss

    def record(self, t, op=None, held=False, module=None):
        t = local_tensor(t)  # tensor parallelism saves DTensors: this rank holds their local tensors
        st = t.untyped_storage()
        ptr = self.ident(st)
        first_seen, impls, stack = self.first_seen, self.impls, self.stack
        if impls.setdefault(ptr, st._cdata) != st._cdata or (ptr in self.alive and self.alive[ptr].expired()):
            self.forget(ptr)  # the first storage here was resized away (FSDP2 frees an unsharded weight a
            # matmul saved) or freed, and the address taken again
        if ptr not in first_seen:
            impls[ptr] = st._cdata
            self.alive[ptr] = StorageWeakRef(st)
            first_seen[ptr] = {"module": module or (stack[-1] if stack else None), "data_ptr": ptr, "device": str(t.device),
                               "nbytes": st.nbytes(), "dtype": str(t.dtype).replace("torch.", ""),
                               "shape": list(t.shape)}
            if op:
                first_seen[ptr]["op"] = op
            if held:
                first_seen[ptr]["held"] = True
            if t.grad_fn is not None:
                self.weak.append(weakref.ref(t))

    def forget(self, ptr):
        for d in (self.first_seen, self.impls, self.alive):
            d.pop(ptr, None)

    def drop_freed(self):
        """Forget the storages freed since they were recorded: their address may be another
        storage's now (CPU's malloc, a shadow run's C++ objects)."""
        for ptr in [p for p, ref in self.alive.items() if ref.expired()]:
            self.forget(ptr)


def storage_ptr(storage):
    return storage.data_ptr()


@contextmanager
def saved_tensor_ledger(model, out, device, ident=None, recomputing=None):
    """Record every tensor autograd saves for backward in this forward, deduplicated by storage.

    Fills `out` with SavedTensor dicts once `label(loss)` has walked the graph. The hooks return
    each tensor unchanged, so the forward computes exactly what it computes without them.
    Activation checkpointing: a region's own saved tensors are not stored (the graph walk skips
    its nodes); its inputs are (`checkpoint.input`), and so are the outputs SAC keeps
    (`<op>.sac_output`). Tensors saved outside the model (the loop's loss) have module None.
    `ident`: how a storage is told apart (_SavedStorages; each record's "data_ptr" holds it), for
    the shadow run's tensors without memory. There every saved tensor is read raw (unpacking
    dispatches a detach per tensor that needs a gradient, an op the step does not run: FSDP2's
    LayerNorm weights were not all-gathered again in backward after it), and recomputations are
    labelled by `recomputing(context, module)` instead (a profiler range would be an op too).
    """
    modules = _ModuleStack(model)
    saved = _SavedStorages(modules.stack, ident)
    modules.weak = saved.weak
    record, first_seen, impls, weak = saved.record, saved.first_seen, saved.impls, saved.weak
    windows = []  # [start, end) autograd sequence numbers of checkpointed regions
    short = module_namer(model)
    keep = _SacKept(modules.stack, record)

    def pack(t):
        record(t)
        return t

    def label(loss=None, held=None):
        """Name each saved storage; `held` maps a module path to an output the caller keeps."""
        saved.drop_freed()
        for module, t in (held or {}).items():
            modules.stack.append(module)
            record(t, held=True)
            modules.stack.pop()
        roots = [loss.grad_fn] if loss is not None else []
        roots += [r().grad_fn for r in weak if r() is not None]
        savers, tensor_info = graph_savers(roots, windows, ident, raw=ident is not None)
        _name_unpacked(first_seen, savers, tensor_info, modules.seq_log, impls)
        out.extend(saved_records(first_seen, savers, device, checkpointed=bool(windows), short=short))

    modules.hook()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                checkpoint_observers(model, windows, keep, device.startswith("cuda"), short,
                                     lambda t: record(t, "checkpoint.rng_state"),
                                     label=True if ident is None else recomputing, inputs=record):
            yield label
    finally:
        modules.remove()


class _ModuleStack:
    """The model's modules running in the forward, innermost last (stack), the autograd sequence
    number from which each ran (seq_log: (number, module)), and weak references to the model's
    outputs (weak: their grad_fns find the graph without a loss). A checkpoint's recomputation
    (in backward) runs the modules again and may stop midway (early stop): the hooks leave it
    alone, so the stack stays the forward's."""

    def __init__(self, model):
        self.stack, self.seq_log, self.weak, self.handles = [], [], [], []
        self.names = {m: n for n, m in model.named_modules()}

    def hook(self):
        self.handles = [h for m in self.names for h in (m.register_forward_pre_hook(self.pre),
                                                       m.register_forward_hook(self.post))]

    def pre(self, mod, args):
        if torch._C._current_autograd_node() is None:
            self.stack.append(self.names[mod])
            self.seq_log.append((torch._C._autograd._get_sequence_nr(), self.stack[-1]))

    def post(self, mod, args, output):
        if torch._C._current_autograd_node() is not None or not self.stack or self.stack[-1] != self.names[mod]:
            return  # (a module whose forward began before the hooks were placed: a step that starts mid-forward)
        self.stack.pop()  # the last module to run keeps the wrapped scalars that follow it
        self.seq_log.append((torch._C._autograd._get_sequence_nr(), self.stack[-1] if self.stack else ""))
        if not self.stack:
            self.weak.extend(weakref.ref(t) for t in tensors_in(output))

    def remove(self):
        for h in self.handles:
            h.remove()


class _SacKept:
    """SAC's `keep(op, output, late=False)`: an output the policy keeps for backward, recorded as
    the op runs (output None: the policy was asked before the op ran, and the module running is
    noted), or, late, read from the region's storage as it ends (named by the module noted for
    it: a torch whose SAC policy runs before the op)."""

    def __init__(self, stack, record):
        self.stack, self.record, self.kept_at = stack, record, {}  # op -> the modules it ran in, in order

    def __call__(self, op, output, late=False):
        if output is None:
            self.kept_at.setdefault(op, []).append(self.stack[-1] if self.stack else None)
            return
        modules = self.kept_at.get(op) if late else None
        module = modules.pop(0) if modules else None
        tensors = tensors_in(output)
        for i, t in enumerate(tensors):
            self.record(t, f"{op.overloadpacket.__name__}.sac_output{i if len(tensors) > 1 else ''}", module=module)


def _name_unpacked(first_seen, savers, tensor_info, seq_log, impls=None):
    """Wrapped Python scalars (x * 0.125) are saved without calling pack hooks: give each the
    module that was running when its node was made (nodes are numbered in forward order, and the
    module hooks logged the sequence number where each module began and ended). A record the
    pack hook made at the same address for another storage (freed since, the scalar made there
    after) is stale: the scalar replaces it."""
    starts = [seq for seq, _ in seq_log]
    for ptr, found in savers.items():
        if ptr in first_seen and (impls is None or impls.get(ptr) == tensor_info[ptr]["impl"]):
            continue
        at = bisect.bisect_right(starts, min(found)[0]) - 1
        first_seen[ptr] = {"module": seq_log[at][1] if at >= 0 else None, "inferred_module": True,
                           **{k: v for k, v in tensor_info[ptr].items() if k != "impl"}}


def saved_records(first_seen, savers, device, checkpointed, short=short_module):
    """SavedTensor dicts, keyed activations/<module>/<op>[#n], for the storages on `device`."""
    used, out = {}, []
    for ptr, rec in first_seen.items():
        if rec["device"] != device:  # wrapped CPU scalars of a CUDA run live in host memory
            continue
        found = sorted(savers.get(ptr, []))
        # packed but held by no autograd node: what torch.utils.checkpoint keeps of its inputs
        op = (op_name(found[0][1], found[0][2]) if found else rec.get("op") or
              ("output" if rec.get("held") else "checkpoint.input" if checkpointed else "unknown"))
        base = f"activations/{short(rec['module'])}/{op}"
        used[base] = used.get(base, 0) + 1
        out.append({"key": base if used[base] == 1 else f"{base}#{used[base]}", "module": rec["module"], "op": op,
                    "grad_fn": found[0][1] if found else "", "savers": [op_name(s[1], s[2]) for s in found],
                    "data_ptr": ptr, "nbytes": rec["nbytes"], "dtype": rec["dtype"], "shape": rec["shape"]})
    return out


def saved_values_of(node, in_region):
    """(attribute, tensor or list) of what a graph node saved. Inside a checkpointed region the
    raw SavedTensor's `data` is read: it is what the node holds itself (wrapped scalars), the
    checkpoint's holder for what it packed, and reading it never runs the recomputation.
    Elsewhere a saved tensor is unpacked only where no hook packed it into something else: a
    checkpoint region nobody noted (a loop's own) would otherwise be recomputed in the forward,
    its tensors kept until backward."""
    out = []
    for attr in dir(node):
        if in_region and attr.startswith("_raw_saved_"):
            raw = getattr(node, attr)
            value = [r.data for r in raw] if isinstance(raw, (list, tuple)) else raw.data
            out.append(("_saved_" + attr[len("_raw_saved_"):], value))
        elif not in_region and attr.startswith("_saved_") and not _packed_by_hook(getattr(node, "_raw" + attr, None)):
            try:
                out.append((attr, getattr(node, attr)))
            except Exception:  # released or not unpackable: nothing to name
                continue
    return out


def _packed_by_hook(raw):
    """Whether a raw SavedTensor (or a list of them) holds what a saved-tensor hook packed in
    place of a tensor (torch.utils.checkpoint's holder, an offloading hook's record): unpacking
    it runs the hook."""
    try:
        packed = [r.data for r in raw] if isinstance(raw, (list, tuple)) else [] if raw is None else [raw.data]
    except Exception:  # released: nothing is unpacked
        return False
    return any(p is not None and not torch.is_tensor(p) for p in packed)


def graph_savers(roots, skip=(), ident=None, raw=False):
    """Walk the autograd graph from `roots` (grad_fns); nodes whose sequence number falls in a `skip`
    window [start, end) (checkpointed regions), or every node with `raw`, are read through their
    raw saved tensors.

    Returns (savers, info): storage data_ptr -> [(sequence_nr, grad_fn name, attribute)], and
    data_ptr -> {data_ptr, nbytes, dtype, shape} of that storage (`ident(storage)` in place of
    data_ptr where given: _SavedStorages).
    """
    ident = ident or storage_ptr
    savers, info, seen, todo = {}, {}, set(), list(roots)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        seq = node._sequence_nr()
        in_region = raw or any(a <= seq < b for a, b in skip)
        for attr, value in saved_values_of(node, in_region):
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if torch.is_tensor(t):
                    t = local_tensor(t)
                    st = t.untyped_storage()
                    ptr = ident(st)
                    savers.setdefault(ptr, []).append((node._sequence_nr(), node.name(), attr))
                    info.setdefault(ptr, {"data_ptr": ptr, "nbytes": st.nbytes(), "device": str(t.device),
                                          "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                                          "impl": st._cdata})
        todo.extend(fn for fn, _ in node.next_functions)
    return savers, info
