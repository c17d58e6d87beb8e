"""The live side of the audit: the only module that touches tensors, CUDA and the profiler.

train.py opens an AuditRecording before it builds the model and calls `phase()` at three
moments of the audited step; everything after that reads the files written here:

  snapshots/<run>/step2_start.pickle            steady state
  snapshots/<run>/step2_before_backward.pickle  activations live
  snapshots/<run>/step2_end.pickle              whole step, so the peak is in the trace
  snapshots/<run>/meta.json                     config, device, stats, address registry,
                                                saved-tensor ledger

On CUDA the pickles are torch.cuda.memory._snapshot() as torch writes them. On CPU the
profiler's memory timeline is turned into the same schema (one segment per live allocation,
since CPU memory has no caching allocator).
"""

import bisect
import json
import os
import platform
import pickle
import re
import sys
import time
import traceback
import weakref
from contextlib import contextmanager, nullcontext

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import nodynamo
from ..schema import MARKER_PREFIX, META_SCHEMA_VERSION, PHASES, RECOMPUTE_LABEL

MEMORY_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG",
                   "CUBLASLT_WORKSPACE_SIZE", "PYTORCH_NO_CUDA_MEMORY_CACHING")
# CPU: the roads from the profile to a trace (cpu_timeline.timeline_events), as meta.json names
# the one taken; None picks by the process count
CPU_TIMELINES = (None, "memory_profile", "raw allocations")


class AuditError(RuntimeError):
    """A problem the user can fix; train.py prints it as one line."""


def _write_pickle(obj, path):
    try:
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=4)
    except OSError as e:  # a full disk, a read-only folder: say which file and why
        raise AuditError(f"could not write {path}: {e.strerror or e}") from None


def local_tensor(t):
    """The tensor whose memory this rank holds: a DTensor's (FSDP2's sharded parameters, their
    gradients and Adam state) local shard, a functional collective's result not yet waited on
    (sequence parallelism's all-gather with batch 1 hands linear one to save) its buffer, else
    the tensor itself."""
    t = getattr(t, "_local_tensor", t)
    return t.elem if type(t).__name__ == "AsyncCollectiveTensor" else t


def _tensor_entry(name, t):
    t = local_tensor(t)
    st = t.untyped_storage()
    return {"name": name, "data_ptr": st.data_ptr(), "nbytes": st.nbytes(),
            "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}


def _fsdp_units(model):
    """FSDP2's (fully_shard) units of this model: [(unit name, its per-parameter records)], the
    root unit named "root"; [] without FSDP2."""
    out = []
    for name, module in model.named_modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        if group is not None:
            out.append((name or "root", list(getattr(group, "fsdp_params", ()) or ())))
    return out


def _fsdp_params(model):
    """FSDP2's per-parameter records of this model, [] without FSDP2."""
    return [fp for _, fps in _fsdp_units(model) for fp in fps]


def named_tensors(model, optimizer=None, scaler=None, tensors=None):
    """(name, tensor) of every long-lived tensor: weights, buffers, grads, optimizer state
    (exp_avg, exp_avg_sq, step), the GradScaler's state, plus `tensors` (name -> tensor).
    FSDP2: a parameter's padded local shard is weights/<name>; while the parameter is
    unsharded (the root after forward, a block inside its forward or backward) the module holds
    the all-gathered copy, weights/<name>/unsharded; gradients accumulated between micro-steps
    without a reduce-scatter are whole too, grads/<name>/unsharded."""
    names, unsharded = {}, {}
    params = dict(model.named_parameters())
    for fp in _fsdp_params(model):
        name = next((n for n, p in params.items() if p is fp.sharded_param or p is getattr(fp, "_unsharded_param", None)), None)
        if name is not None:
            names[fp.sharded_param] = name
            unsharded[id(getattr(fp, "_unsharded_param", None))] = name
            yield f"weights/{name}", fp._sharded_param_data
    for name, p in params.items():  # tied weights appear once, under their first name
        if id(p) in unsharded:
            yield f"weights/{name}/unsharded", p
            continue
        names.setdefault(p, name)
        yield f"weights/{name}", p
    for name, b in model.named_buffers():
        yield f"buffers/{name}", b
    for fp in _fsdp_params(model):  # accumulating without reduce-scatter: whole gradients
        g = getattr(getattr(fp, "_unsharded_param", None), "grad", None)
        for held in (g, getattr(fp, "unsharded_accumulated_grad", None)):
            if held is not None and fp.sharded_param in names:
                yield f"grads/{names[fp.sharded_param]}/unsharded", held
    shared = set()
    for unit, fps in _fsdp_units(model):  # gradient shards kept across steps (set_to_none=False)
        for fp in fps:  # are views into their unit's first reduce-scatter output: one buffer a unit
            g = fp.sharded_param.grad
            if g is not None and is_view_into_more(g) and local_tensor(g).untyped_storage()._cdata not in shared:
                shared.add(local_tensor(g).untyped_storage()._cdata)  # one storage (fake ones have no data_ptr)
                yield f"grads/{unit}/shards", g
    for p, name in names.items():
        g = p.grad
        # a gradient that is a view into a larger buffer (DDP's gradient_as_bucket_view, FSDP2's
        # kept shards above) is not an allocation of its own
        if g is not None and not is_view_into_more(g):
            yield f"grads/{name}", g
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device == p.device:
                    yield f"optimizer/{key}/{names.get(p, '?')}", value
    if scaler is not None and scaler.is_enabled() and getattr(scaler, "_scale", None) is not None:
        yield "optimizer/grad_scaler/scale", scaler._scale
        yield "optimizer/grad_scaler/growth_tracker", scaler._growth_tracker
    for name, t in (tensors or {}).items():
        if torch.is_tensor(t):
            yield name, t


def is_view_into_more(t):
    """Whether t is a view into a larger storage (a gradient in DDP's bucket or FSDP2's kept shards)."""
    return local_tensor(t).untyped_storage().nbytes() > local_tensor(t).numel() * t.element_size()


def distributed_info(model):
    """{backend, world_size, rank, mesh} of this process's torch.distributed run (None without
    one). mesh: the DeviceMesh the model's DTensor parameters live on (FSDP2, tensor
    parallelism; the one with most dimensions), None for DDP or plain parameters."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    meshes = [p.device_mesh for p in model.parameters() if getattr(p, "device_mesh", None) is not None]
    mesh = max(meshes, key=lambda m: m.ndim, default=None)
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "rank": dist.get_rank(),
            "mesh": None if mesh is None else {
                "shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or ()),
                "coordinate": mesh.get_coordinate(), "ranks": mesh.mesh.tolist()}}


def _world_size():
    """Ranks in this process's torch.distributed run (1 without one)."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def build_registry(model, optimizer=None, scaler=None, tensors=None):
    """Name every long-lived tensor by its storage address: a list of RegistryEntry dicts."""
    return [_tensor_entry(name, t) for name, t in named_tensors(model, optimizer, scaler, tensors)]


# ---------------------------------------------------------------------------------------------
# saved-tensor ledger

def op_name(grad_fn_name, attr):
    """'NativeLayerNormBackward0', '_saved_mean' -> 'native_layer_norm.mean'."""
    base = re.sub(r"Backward\d*$", "", grad_fn_name)
    base = re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()
    return f"{base}.{attr[len('_saved_'):]}"


def short_module(path, prefix="", root="model"):
    """Module path as ledger keys write it: the model's own prefix dropped (GPT: 'transformer.'),
    '' (the model itself) as its class name, None (outside the model: the loop's loss) as 'loop'."""
    if path is None:
        return "loop"
    if prefix and path.startswith(prefix):
        return path[len(prefix):]
    return path or root


def module_namer(model):
    """short_module for this model: its `audit_prefix` (model.py's GPT: 'transformer.') and its
    class name for the model itself."""
    cls = type(model)
    if cls.__name__.startswith("FSDP") and len(cls.__mro__) > 2:  # fully_shard swaps in FSDP<Class>
        cls = cls.__mro__[2]
    prefix, root = getattr(model, "audit_prefix", ""), cls.__name__.lower()
    return lambda path: short_module(path, prefix, root)


class _Region:
    """Wraps a checkpoint's forward context: notes the autograd sequence numbers of the nodes made
    inside the region, whose saved tensors the checkpoint keeps as placeholders (reading them
    would run the recomputation, so the graph walk must not)."""

    def __init__(self, inner, windows, keep=None):
        self.inner, self.windows, self.keep = inner, windows, keep

    def __enter__(self):
        self.start = torch._C._autograd._get_sequence_nr()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        self.windows.append((self.start, torch._C._autograd._get_sequence_nr()))
        if self.keep is not None and exc[0] is None:
            _kept_by_sac(self.inner, self.keep)
        return self.inner.__exit__(*exc)


def _sac_policy_sees_outputs():
    """Whether torch hands SAC's policy the op's output (ctx.op_output: torch 2.13 does, 2.11
    not), which model.py passes on to the audit as the op runs."""
    import inspect
    from torch.utils.checkpoint import SelectiveCheckpointContext
    return "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


def _kept_by_sac(mode, keep):
    """An older torch asks SAC's policy before the op runs: the outputs it kept are read from the
    forward mode's storage ({op: [outputs]} in call order; {op: {index: output}} in later torch) as
    the region ends, each given to
    keep(op, output, late=True), which names it by the module the policy's call noted."""
    from torch.utils._pytree import tree_map
    storage = getattr(mode, "storage", None)
    for op, outputs in (list(storage.items()) if isinstance(storage, dict) else []):
        if isinstance(outputs, dict):  # a later torch's {call index: output or a recompute mark}
            outputs = [outputs[k] for k in sorted(outputs)]
        for out in outputs if isinstance(outputs, list) and hasattr(op, "overloadpacket") else []:
            value = tree_map(lambda x: getattr(x, "val", x), out)
            if tensors_in(value):
                keep(op, value, True)


class _RecomputeLabel:
    """Wraps a checkpoint's recompute context: every allocation of the recomputation carries
    `recompute:<module>` (CUDA: the allocator's memory metadata; CPU: a profiler range that
    cpu_timeline copies into the trace entries' user_metadata)."""

    def __init__(self, inner, module, cuda):
        self.inner, self.label = inner, RECOMPUTE_LABEL + module
        # CUDA labels allocations through the allocator (torch versions without the call: none)
        self.metadata = cuda and hasattr(torch.cuda.memory, "_set_memory_metadata")
        self.range = None if cuda else torch.profiler.record_function(MARKER_PREFIX + self.label)

    def __enter__(self):
        if self.metadata:
            torch.cuda.memory._set_memory_metadata(self.label)
        elif self.range is not None:
            self.range.__enter__()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            if self.metadata:
                torch.cuda.memory._set_memory_metadata("")
            elif self.range is not None:
                self.range.__exit__(None, None, None)


@contextmanager
def _rng_states_seen(note):
    """torch.utils.checkpoint keeps torch.get_rng_state() (a CPU tensor) per region that
    preserves the RNG state (model.py: where a dropout needs it); hand each one to `note` so it
    is named like what the region saved. The state returned is the one torch made, unchanged."""
    real = torch.get_rng_state

    def get_rng_state():
        state = real()
        if sys._getframe(1).f_code.co_filename.endswith(os.path.join("utils", "checkpoint.py")):
            note(state)  # only the states checkpoint keeps; a loop's own call is not one
        return state
    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = real


@contextmanager
def _checkpoint_regions(windows):
    """Note every non-reentrant checkpoint region of the audited forward, model.py's or a loop's
    own torch.utils.checkpoint call (its saved-tensor hooks are entered around the region): the
    autograd sequence numbers its nodes take. The graph walk must not read their saved tensors:
    reading one runs the recomputation and keeps what it made until backward."""
    from torch.utils import checkpoint as ckpt
    hook = getattr(ckpt, "_checkpoint_hook", None)
    if hook is None or "__enter__" in vars(hook) or "__exit__" in vars(hook):
        yield  # a torch whose checkpoint is built otherwise: only model.py's regions are known
        return
    enter, leave = hook.__enter__, hook.__exit__

    def __enter__(self):
        self.audit_start = torch._C._autograd._get_sequence_nr()
        return enter(self)

    def __exit__(self, *exc):
        windows.append((self.audit_start, torch._C._autograd._get_sequence_nr()))
        return leave(self, *exc)
    hook.__enter__, hook.__exit__ = __enter__, __exit__
    try:
        yield
    finally:
        del hook.__enter__, hook.__exit__


@contextmanager
def _checkpoint_inputs(note):
    """What torch.utils.checkpoint keeps of a region's inputs beside the tensors it saves for
    backward: the tensors inside its dict and tuple arguments and those a functools.partial it
    runs binds (transformers' layers pass the attention mask and the rotary cos/sin so), held by
    its context where no saved-tensor hook sees them; each given to `note`. Unchanged: the region
    torch runs."""
    import functools
    from torch.utils import checkpoint as ckpt
    from torch.utils._pytree import tree_leaves
    real = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    if real is None:
        yield  # a torch whose checkpoint runs its regions otherwise
        return

    def generator(fn, preserve_rng_state, context_fn, determinism_check, debug, *args, **kwargs):
        held = [fn.args, fn.keywords] if isinstance(fn, functools.partial) else []
        held += [a for a in args if not isinstance(a, torch.Tensor)] + [kwargs]  # a top-level tensor is saved
        for t in tree_leaves(held):
            if isinstance(t, torch.Tensor):
                note(t)
        return real(fn, preserve_rng_state, context_fn, determinism_check, debug, *args, **kwargs)
    ckpt._checkpoint_without_reentrant_generator = generator
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = real


@contextmanager
def checkpoint_observers(model, windows, keep, cuda, short, rng_state=lambda t: None, label=True,
                         inputs=lambda t: None):
    """For the audited forward, wrap every checkpointing module's `ac_context_fn` (model.py's
    convention) so its region is noted and its recomputation labelled (label=True: a label the
    trace keeps; a callable: label(recompute context, module) wraps it; falsy: none), let SAC blocks report the
    outputs they keep through `keep(op, output)`, give each region's saved RNG state to
    `rng_state` and what it keeps of its inputs beyond the tensors it saves to `inputs`. Restores the modules on exit; contexts already made keep labelling the backward."""
    wrapped = []
    for name, m in model.named_modules():
        fn = getattr(m, "ac_context_fn", None)
        if fn is None:
            continue

        late = hasattr(m, "sac_observer") and not _sac_policy_sees_outputs()

        def context_fn(fn=fn, name=name, late=late):
            fwd, rec = fn()
            region = _Region(fwd, windows, keep if late else None)
            if not label:
                return region, rec
            return region, _RecomputeLabel(rec, short(name), cuda) if label is True else label(rec, short(name))
        wrapped.append((m, fn, getattr(m, "sac_observer", None)))
        m.ac_context_fn = context_fn
        if hasattr(m, "sac_observer"):
            m.sac_observer = keep
    try:
        with _rng_states_seen(rng_state), _checkpoint_regions(windows), _checkpoint_inputs(inputs):
            yield
    finally:
        for m, fn, observer in wrapped:
            m.ac_context_fn = fn
            if hasattr(m, "sac_observer"):
                m.sac_observer = observer


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
    stack = []
    saved = _SavedStorages(stack, ident)
    record, first_seen, impls, weak = saved.record, saved.first_seen, saved.impls, saved.weak
    windows = []  # [start, end) autograd sequence numbers of checkpointed regions
    seq_log = []  # (next autograd sequence number, module running from then on)
    short = module_namer(model)

    # A checkpoint's recomputation (in backward) runs the modules again and may stop midway
    # (early stop): the hooks leave it alone, so the stack stays the forward's.
    def pre(mod, args):
        if torch._C._current_autograd_node() is None:
            stack.append(names[mod])
            seq_log.append((torch._C._autograd._get_sequence_nr(), stack[-1]))

    def post(mod, args, output):
        if torch._C._current_autograd_node() is not None:
            return
        stack.pop()  # the last module to run keeps the wrapped scalars that follow it
        seq_log.append((torch._C._autograd._get_sequence_nr(), stack[-1] if stack else ""))
        if not stack:
            weak.extend(weakref.ref(t) for t in tensors_in(output))

    def pack(t):
        record(t)
        return t

    kept_at = {}  # a torch whose SAC policy runs before the op: op -> the modules it ran in, in order

    def keep(op, output, late=False):
        """SAC: an output the policy keeps for backward, as the op runs (output None: the policy
        was asked before the op ran; the module running is noted), or, late, read from the
        region's storage as it ends (named by the module noted for it)."""
        if output is None:
            kept_at.setdefault(op, []).append(stack[-1] if stack else None)
            return
        modules = kept_at.get(op) if late else None
        module = modules.pop(0) if modules else None
        tensors = tensors_in(output)
        for i, t in enumerate(tensors):
            record(t, f"{op.overloadpacket.__name__}.sac_output{i if len(tensors) > 1 else ''}", module=module)

    names = {m: n for n, m in model.named_modules()}
    handles = [h for m in names for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]

    def label(loss=None, held=None):
        """Name each saved storage; `held` maps a module path to an output the caller keeps."""
        saved.drop_freed()
        for module, t in (held or {}).items():
            stack.append(module)
            record(t, held=True)
            stack.pop()
        roots = [loss.grad_fn] if loss is not None else []
        roots += [r().grad_fn for r in weak if r() is not None]
        savers, tensor_info = graph_savers(roots, windows, ident, raw=ident is not None)
        _name_unpacked(first_seen, savers, tensor_info, seq_log, impls)
        out.extend(saved_records(first_seen, savers, device, checkpointed=bool(windows), short=short))

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                checkpoint_observers(model, windows, keep, device.startswith("cuda"), short,
                                     lambda t: record(t, "checkpoint.rng_state"),
                                     label=True if ident is None else recomputing, inputs=record):
            yield label
    finally:
        for h in handles:
            h.remove()


def tensors_in(output):
    """The tensors of a module's output or an op's result (a tensor, or a tuple/list/dict of them)."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    return [t for t in output if torch.is_tensor(t)] if isinstance(output, (list, tuple)) else []


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


# ---------------------------------------------------------------------------------------------
# recording

def indexed_device(device):
    """torch.device("cuda") as the device it means, cuda:<current>: the index a tensor's device
    names (the saved tensors are kept by comparing the two; without the index none was)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


class AuditRecording:
    """Record allocator history from before the model exists to the end of the audited step.

    Use as a context manager; history recording is always turned off on exit, and a crash or
    an out-of-memory error still leaves a snapshot on disk.
    """

    def __init__(self, run_dir, device, config, max_entries=1_000_000, defer_cpu=False, cpu_timeline=None):
        if cpu_timeline not in CPU_TIMELINES:
            raise AuditError(f"cpu_timeline must be one of {', '.join(map(repr, CPU_TIMELINES))}, got {cpu_timeline!r}")
        self.run_dir = run_dir
        self.defer_cpu = defer_cpu
        self.cpu_road = cpu_timeline  # CPU: the road asked for (None: by the process count)
        self.device = indexed_device(device)
        self.cuda = self.device.type == "cuda"
        self.config = config
        self.max_entries = max_entries
        self.phases = {}
        self.saved_tensors = []
        self.compiled_wrappers = None  # compiled runs: the wrappers inductor loaded (compiled.capture)
        self.cpu_timeline = None
        self.distributed = None  # torch.distributed runs: distributed_info()
        self.markers = {}  # CPU: phase -> marker name in the profile
        self.markers_seen = []
        self.error = None
        self.files = []
        self.prof = None
        self._stand_in = False  # whether the profiler's start put nodynamo's stand-in in place
        self.active = False

    # -- lifecycle
    def __enter__(self):
        if os.path.isdir(self.run_dir) and os.listdir(self.run_dir):
            raise AuditError(f"{self.run_dir} already exists and is not empty: an audit never replaces one")
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as e:
            raise AuditError(f"could not create {self.run_dir}: {e.strerror or e}") from None
        if self.cuda:
            torch.cuda.init()  # before the OOM observer: attaching it earlier has crashed
            torch.cuda.reset_peak_memory_stats(self.device)
            # Stacks on allocations only (context "alloc"): with stacks gathered on frees too, a
            # checkpoint's recomputation that stops early inside an op saving its output (dropout's
            # mask) loses the stopping exception as the op's outputs are freed, and backward dies
            # with "SystemError: ... returned NULL without setting an exception" (torch 2.11,
            # H200; scripts/gpu_probe.py part 4 shows it without any audit). Frees are named by
            # the allocation they free.
            torch.cuda.memory._record_memory_history(
                enabled="all", context="alloc", stacks="python", max_entries=self.max_entries)
            torch._C._cuda_attach_out_of_memory_observer(self._on_oom)
        elif not self.defer_cpu:
            self._start_profiler()
        self.active = True
        self.t0 = time.time()
        return self

    def _start_profiler(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                           profile_memory=True, record_shapes=True, with_stack=True)
        # On one process torch._dynamo stays unimported while the profiler records. Under
        # torchrun DDP, FSDP2 and DTensor import it mid-step anyway, and an import inside the
        # profile costs far more than before it: there the profiler's start imports it, as torch does.
        alone = _world_size() == 1
        self._stand_in = nodynamo.enter() if alone else False
        with (nodynamo.inductor_not_offered() if alone else nullcontext()):
            self.prof.__enter__()

    def show_cpu(self, tensors):
        """CPU, profiling: an alias of each of `tensors` (no memory, no effect on training), so
        the profiler reports the ones older than itself that no op of the step uses (a buffer
        only read when the sequence grows: transformers' rotary original_inv_freq)."""
        if not self.cuda and self.prof is not None and self.active:
            for t in tensors:
                torch.ops.aten.alias.default(t)

    def begin_cpu(self, tensors=lambda: ()):
        """CPU, deferred: start the profiler now (a compiled run's audited step: profiling
        inductor's compilation with stacks would take more memory than the machine has). The
        profiler reports a tensor older than itself only once an op uses it, and compiled code
        uses them outside aten: an alias of each of `tensors` (a view: no memory, no effect on
        training) shows it the ones that exist now. `tensors` is called only then."""
        if not self.cuda and self.prof is None and self.active:
            self._start_profiler()
            for t in tensors():
                torch.ops.aten.alias.default(t)

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and self.error is None:
            oom = isinstance(exc, torch.OutOfMemoryError) if hasattr(torch, "OutOfMemoryError") else False
            self.error = {"type": exc_type.__name__, "message": str(exc).splitlines()[0][:500] if str(exc) else "",
                          "oom": oom, "where": traceback.format_exception(exc_type, exc, tb)[-2:-1]}
            if self.active:
                self._dump_crash("oom" if oom else "crash")
        self.stop()
        self.write_meta()
        return False

    def stop(self):
        """Turn recording off (idempotent); on CPU this is when the pickles are written."""
        if not self.active:
            return
        self.active = False
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
        elif self.prof is not None:
            try:
                self.prof.__exit__(None, None, None)
            finally:
                if self._stand_in:
                    nodynamo.leave()
            self._write_cpu_snapshots()

    # -- phases
    def phase(self, name, model, optimizer=None, scaler=None, tensors=None, dump=True, held=None, made=None):
        """Register every named tensor by address and dump a snapshot now.

        dump=False records the registry and the position in the trace only (used after
        backward, so that gradients that die at zero_grad still get their names). held: {name:
        tensor} the loop holds, named only where nothing else (registry, saved tensors) names it.
        made: registry entries of what the code made (loop_calls.LoopCalls), named last.
        """
        registry = build_registry(model, optimizer, scaler, tensors)
        info = {"file": f"{name}.pickle" if dump else None, "registry": registry,
                "held": [_tensor_entry(k, t) for k, t in (held or {}).items() if torch.is_tensor(t)]}
        if made:
            info["made"] = made
        if self.cuda:
            torch.cuda.synchronize(self.device)
            info.update(self._cuda_stats())
            snap = torch.cuda.memory._snapshot()
            info.update(self._trace_counts(snap))
            self.allocator_settings = snap.get("allocator_settings")
            if dump:
                _write_pickle(snap, os.path.join(self.run_dir, info["file"]))
                self._wrote(info["file"])
            if name == "step2_start":  # the step's own peak, from here to step2_end
                info["max_memory_allocated_before_reset"] = info["max_memory_allocated"]
                torch.cuda.reset_peak_memory_stats(self.device)
        else:  # a phase may come again (a micro-step's before_backward): the last one counts
            marker = f"{MARKER_PREFIX}{name}@{len(self.markers_seen)}"
            with torch.profiler.record_function(marker):
                pass
            self.markers[name] = marker
            self.markers_seen.append(marker)
            info.update({"memory_allocated": None, "memory_reserved": None, "max_memory_allocated": None})
        info["wall_time_s"] = round(time.time() - self.t0, 3)
        self.phases[name] = info

    @contextmanager
    def audited_forward(self, model):
        """Around the audited forward: yields `label(loss)` to call once the loss exists."""
        device = str(next(model.parameters()).device)
        with saved_tensor_ledger(model, self.saved_tensors, device) as label:
            yield label

    # -- CUDA helpers
    def _cuda_stats(self):
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return {"memory_allocated": torch.cuda.memory_allocated(self.device), "memory_reserved": reserved,
                "max_memory_allocated": torch.cuda.max_memory_allocated(self.device),
                # what the card holds that PyTorch's allocator did not reserve: the CUDA context,
                # cuBLAS/cuDNN handles, kernels (and any other process on this GPU)
                "outside_pytorch": total - free - reserved, "device_free": free}

    def _trace_counts(self, snap):
        idx = self.device.index or 0
        traces = snap.get("device_traces", [])
        n = len(traces[idx]) if idx < len(traces) else 0
        return {"trace_entries": n, "ring_buffer_full": n >= self.max_entries}

    def _on_oom(self, device, alloc, device_alloc, device_free):
        self._dump_crash("oom")

    def _dump_crash(self, kind):
        path = os.path.join(self.run_dir, f"{kind}.pickle")
        if os.path.exists(path):
            return
        try:
            if self.cuda:
                _write_pickle(torch.cuda.memory._snapshot(), path)
                self._wrote(f"{kind}.pickle")
            else:
                marker = f"{MARKER_PREFIX}{kind}"
                with torch.profiler.record_function(marker):
                    pass
                self.markers[kind] = marker
                self.phases.setdefault(kind, {"file": f"{kind}.pickle", "registry": []})
        except Exception as e:  # the crash itself is what the user must see: keep going
            self.error = dict(self.error or {}, dump_failed=str(e))

    def _wrote(self, file):
        if file not in self.files:
            self.files.append(file)

    def named_addresses(self):
        """Every storage address a phase named (registry, saved tensors)."""
        ptrs = {r["data_ptr"] for info in self.phases.values() for r in info.get("registry", []) + info.get("held", [])}
        return ptrs | {s["data_ptr"] for s in self.saved_tensors}

    # -- CPU: profiler timeline -> snapshot schema
    def _write_cpu_snapshots(self):
        from .cpu_timeline import timeline_events, snapshot_at
        road = {}
        end = self.phases.get(PHASES[-1], {})
        alive = {r["data_ptr"] for r in end.get("registry", []) + end.get("held", [])}
        events, marker_times = timeline_events(self.prof, set(self.markers.values()), self.named_addresses(), road,
                                               alive, keyed=self._keyed())
        self.cpu_timeline = road.get("source")
        if self.compiled_wrappers:
            from .cpu_timeline import name_compiled
            events = name_compiled(events, self.compiled_wrappers)
        for name, marker in self.markers.items():
            t = marker_times.get(marker)
            if t is None:
                continue
            snap = snapshot_at(events, t)
            info = self.phases[name]
            info["time_us"] = t // 1000
            info["trace_entries"] = len(snap["device_traces"][0])
            info["ring_buffer_full"] = False
            if info["file"]:
                _write_pickle(snap, os.path.join(self.run_dir, info["file"]))
                self._wrote(info["file"])

    def _keyed(self):
        """Whether to try the memory profile: asked for, else on one process only (under
        torchrun the raw road: cpu_timeline.timeline_events)."""
        return _world_size() == 1 if self.cpu_road is None else self.cpu_road == "memory_profile"

    # -- meta.json
    def write_meta(self):
        meta = {
            "schema_version": META_SCHEMA_VERSION,
            "torch_version": torch.__version__,
            "device": self.device_info(),
            "config": self.config,
            "env": {k: os.environ[k] for k in MEMORY_ENV_VARS if k in os.environ},
            "max_entries": self.max_entries,
            "phases": self.phases,
            "saved_tensors": self.saved_tensors,
            "compiled_wrappers": self.compiled_wrappers,
            "distributed": self.distributed,
            "cpu_timeline": self.cpu_timeline,  # CPU: how the profile became a trace
            "error": self.error,
            "files": self.files,
        }
        if getattr(self, "predicted", None) is not None:  # Audit(predicted=predict_loop(...))
            meta["predicted"] = self.predicted
        path = os.path.join(self.run_dir, "meta.json")
        try:
            with open(path, "w") as f:
                json.dump(meta, f, indent=1)
        except OSError as e:
            raise AuditError(f"could not write {path}: {e.strerror or e}") from None

    def device_info(self):
        if not self.cuda:
            return {"type": "cpu", "name": "cpu", "capability": None, "total_memory": None,
                    "allocator_settings": None, "cpu": cpu_info()}
        props = torch.cuda.get_device_properties(self.device)
        return {"type": "cuda", "name": props.name, "capability": list(torch.cuda.get_device_capability(self.device)),
                "total_memory": props.total_memory, "cuda_version": torch.version.cuda,
                "allocator_settings": getattr(self, "allocator_settings", None)}


def cpu_info():
    """Which CPU measured a CPU audit, and what of it changes what its kernels allocate: its model
    name, torch's thread count (per-thread kernel buffers) and whether its bf16 (fp16) matmuls run
    through oneDNN (scratch buffers after their outputs: prediction/shadow_probe)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"model": model, "threads": torch.get_num_threads(),
            "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "onednn_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())}
