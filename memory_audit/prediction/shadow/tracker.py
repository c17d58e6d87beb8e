"""What the shadow run sees: a dispatch mode that records allocations and frees in order.

Each op's outputs whose storage it has not seen are an allocation of storage.nbytes() bytes; a
weakref on that storage gives the moment it is freed. Rules add what the dispatcher
cannot see, each measured on CPU audits (shadow/step.py runs the step). What one op's kernel makes
before and after its outputs is a rule of its own in shadow/rules/cpu.py (layer norm's buffers and
copies, CPU flash attention's work buffers, _safe_softmax's temporaries, softmax's and
embedding's copies of non-contiguous inputs); the rules over many ops (shadow/cpu.py applies
the CPU ones, with shadow/rules/cpu.py's and the kernel probes, to each op of a CPU step) are listed
in shadow/cpu's docstring, with the module each lives in.
Plain Python until a shadow run starts: torch is imported inside the functions.
"""

import contextlib
import weakref

from . import cpu as shadow_cpu, cuda, distributed
from .rules import autograd
from .cpu import short_name
from .blocks import foreach_blocks, label_block, op_block

class Tracker:
    """Allocations and frees of the storages ops return, in order (see module docstring).

    Each allocation has an id; events are [action, id] ("alloc"/"free"; None once a rule drops
    it), and allocs[id] = [key, nbytes]."""

    def __init__(self):
        self.events = []
        self.allocs = {}  # id -> [key, nbytes]
        self.live = {}  # storage id -> [allocation id, index of its alloc event]
        self.recording = False
        self.phase = "setup"  # forward | backward | optimizer: the key's first level
        self.label = ""  # the module path the forward is in (module hooks set it)
        self.last = ("no op yet", "")  # the last op dispatched and the module it ran in
        self.pending = []  # allocation ids of the wrapped scalars the last op made
        self.pending_out = _none  # weakref to that op's output (its grad_fn may save them)
        self.saved = []  # (StorageWeakRef, allocation id) of real tensors an autograd node holds
        self.accumulate = None  # (out storage id, first operand's storage id) of the last backward add
        self.node_start = {}  # sequence number of a FORMULA_ADDS node -> the event its backward began at (one backward's)
        self.freed_at = {}  # storage id -> index of its free event (read by the next op)
        self.workspace_bytes = 0  # a cuBLAS workspace per thread (the shadow of a CUDA step)
        self.lt_workspace_bytes = 0  # a cuBLASLt workspace per thread that runs an addmm (CUDA)
        self.host = set()  # storage ids that are host memory on the device stood for (forget)
        self.adds_in_place = False  # inside F.scaled_dot_product_attention or F.linear (a CPU shadow: cpu_rules)
        self.meta_cache = None  # a shadow/metacache.MetaCache on meta tensors: kernels asked once,
        # and a view op (no storage, nothing pending) straight to its kernel
        self.tagging = False  # each allocation and event tagged with its block (shadow/repeat)
        self.tags = {}  # allocation id -> the block (transformer.h.N) it belongs to, or None
        self.event_tags = []  # parallel to events: the block of the op a free happened in (or None)
        self.context = None  # the block of the op running (or last run), or None
        self.in_block = []  # the blocks whose forward is running, innermost last (shadow/depth's hooks)
        self.block_label = label_block  # a key or module path -> the block it names, or None
        self.micro = None  # the micro-step running (shadow/step.py sets it), or None: the second channel
        self.micro_tags = {}  # allocation id -> the micro-step it was made in
        self.event_micro = []  # parallel to events: the micro-step a free happened in (or None)
        self.real_shapes = {}  # storage id -> (shape, stride, dtype) a kernel probe found (shadow/probe)
        self.probed, self.unprobed = set(), set()  # the ops kernel probes answered, and could not
        self.unmeasured = set()  # CUDA rules applied outside the shapes a trace measured (shadow/rules/cuda.py's SAMPLES)
        self.real_ints = False  # inside DDP's reducer: what it reads runs on real tensors, or on a GPU's
        # meta tensors with host twins of their values (shadow/distributed)
        self.twins = {}  # storage id -> the host values a meta tensor DDP's reducer reads stands for (shadow/distributed)
        self.subclass_op = None  # the op a DTensor was handed back for: its run on the shards comes next
        self.saved_names = {}  # allocation id -> the audit's name of what the audited forward saved (shadow/names.naming)
        self.made_names = {}  # allocation id -> what else the code made, named by its call (naming/loop_calls)
        self.end_names = {}  # allocation id -> the name the loop gives it as the audited step ends
        self.naming = False  # name what the audited forward makes as an audit does (step.run(names=True))
        self.recomputing = None  # the module whose checkpointed region backward is recomputing (names=True)
        self.unseen = False  # inside DTensor's sharding propagation: ops on tensors no run allocates (shadow/distributed)
        self.on_op = None  # called with each op before it runs (shadow/script's step boundaries), or None
        self.on_free = None  # called with each free's event index and allocation id as it happens (shadow/script)
        self.stream = 0  # the stream allocations are made on (a CUDA step's FSDP2: shadow/streams.Streams)
        self.streams = {}  # allocation id -> its stream, where not the default one (0)
        self.stand_in = None  # the name of the op the next one stands in for (known_values: nonzero as nonzero_static)

    @property
    def op(self):
        """The last op dispatched, in words."""
        func, label = self.last
        return f"{func} in {label or 'the loop'}"

    def key(self, name):
        where = f"{self.label}/{name}" if self.label else name
        if self.recomputing:  # the audited forward's checkpointed region run again in backward
            return f"recomputed/{self.recomputing}/{where}"
        return {"forward": "activations/", "backward": "temporary/backward/",
                "optimizer": "temporary/optimizer/", "inputs": "inputs/"}.get(self.phase, "") + where

    def alloc(self, key, nbytes, tag=None):
        """A new allocation (of block `tag`, else the running op's); returns (its id, the index
        of its event or None)."""
        aid = len(self.allocs)
        self.allocs[aid] = [key, nbytes]
        self.tags[aid] = self.context if tag is None else tag
        self.micro_tags[aid] = self.micro
        if self.stream:
            self.streams[aid] = self.stream
        return aid, (self._event("alloc", aid) if nbytes else None)  # 0 bytes: no allocation

    def free(self, aid):
        return self._event("free", aid) if self.allocs[aid][1] else None

    def _event(self, action, aid):
        if self.recording:
            self.events.append([action, aid])
            self.event_tags.append(self.context if action == "free" else None)
            self.event_micro.append(self.micro if action == "free" else None)
            return len(self.events) - 1
        return None

    def add(self, storage, key, nbytes=None, tag=None):
        """A storage an op returned: an allocation of its bytes (or `nbytes`, what it stands
        for on the device) the first time it is seen."""
        sid = storage._cdata
        if sid in self.live or sid in self.host:  # host memory: an in-place op's output stays there
            return
        self.live[sid] = list(self.alloc(key, storage.nbytes() if nbytes is None else nbytes, tag))
        weakref.finalize(storage, self._freed, sid)

    def resized(self, storage, nbytes):
        """A storage resized in place (FSDP2 frees and re-makes an unsharded parameter's memory
        with untyped_storage().resize_): its allocation freed, a new one of `nbytes` made under
        the same name."""
        entry = self.live.get(storage._cdata)
        if entry is None:
            return self.add(storage, self.key("resize_"), nbytes)
        key = self.allocs[entry[0]][0]
        self.free(entry[0])
        self.live[storage._cdata] = list(self.alloc(key, nbytes))

    @contextlib.contextmanager
    def unseeing(self):
        """Ops inside go straight to their kernels, unrecorded (they are no op of the step)."""
        outer, self.unseen = self.unseen, True
        try:
            yield
        finally:
            self.unseen = outer

    def block_of(self, aid):
        """An allocation's block: the one it was made in, else the one its name says (a
        parameter's optimizer state made by an op with no tensor of the block)."""
        tag = self.tags.get(aid)
        return self.block_label(self.allocs[aid][0]) if tag is None else tag

    def tag_of(self, t):
        """The block of a tensor's storage, or None."""
        entry = self.live.get(t.untyped_storage()._cdata)
        return None if entry is None else self.tags.get(entry[0])

    def adopt(self, storage):
        """Record now the allocation of a storage made while not recording (model.to(device)
        copies the weights made on the host, in its own order)."""
        entry = self.live.get(storage._cdata)
        if entry is not None and entry[1] is None:
            entry[1] = self._event("alloc", entry[0])

    def forget(self, storage):
        """A storage that is host memory on the device the shadow stands for: its alloc is
        dropped and its free never recorded."""
        sid = storage._cdata
        entry = self.live.pop(sid, None)
        if entry is not None and entry[1] is not None:
            self.events[entry[1]][0] = None
        if sid not in self.host:
            self.host.add(sid)
            weakref.finalize(storage, self.host.discard, sid)

    def hold(self, name, key, nbytes):
        """An allocation that no op returns and nothing frees (a cuBLAS workspace), once."""
        if name not in self.live:
            self.live[name] = list(self.alloc(key, nbytes))

    def _freed(self, sid):
        self._settle_saved()  # a real tensor let go before this storage died is freed first
        entry = self.live.pop(sid, None)
        self.real_shapes.pop(sid, None)
        self.twins.pop(sid, None)
        if entry is not None:
            self.freed_at[sid] = self.free(entry[0])
            if self.on_free is not None:
                self.on_free(self.freed_at[sid], entry[0])

    def before_op(self):
        """Settle what the previous op left: its wrapped scalars are freed unless its autograd
        node saved them (then with the node's saved tensors), and a backward add whose operand
        died with it took that operand's memory."""
        self._settle_saved()
        if self.pending:
            from torch.multiprocessing.reductions import StorageWeakRef
            saved = shadow_cpu.saved_scalars(self.pending_out())
            for aid in self.pending:
                if saved:  # a real tensor's storage: watched through a C++ weak reference
                    self.saved.append((StorageWeakRef(saved.pop(0).untyped_storage()), aid))
                else:
                    self.free(aid)
            self.pending, self.pending_out = [], _none
        if self.accumulate is not None:
            out, first = self.accumulate
            self.accumulate = None
            if first not in self.live and out in self.live:
                self._fold(out, first)
        self.freed_at.clear()

    def _settle_saved(self):
        """Free the real tensors (wrapped scalars a node saved, RNG states) their holders let go."""
        for entry in [w for w in self.saved if w[0].expired()]:
            self.saved.remove(entry)
            self.free(entry[1])

    def _fold(self, out, operand):
        """The add's output lives in `operand`'s memory: drop its alloc and the operand's free,
        and the output's later free frees the operand's allocation."""
        alloc_at, free_at = self.live[out][1], self.freed_at.get(operand)
        if alloc_at is None or free_at is None or free_at < alloc_at:
            return
        self.live[out][0] = self.events[free_at][1]
        self.events[alloc_at][0] = self.events[free_at][0] = None

    def live_bytes(self):
        return sum(self.allocs[aid][1] for aid, _ in self.live.values())


def dispatch_mode(tracker, device_type):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    cpu = device_type == "cpu"

    class _Mode(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):  # nothing compiles in a shadow run: no dynamo guard per op
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "prim" or tracker.unseen:  # metadata queries (a fake tensor's device): no memory
                return func(*args, **kwargs)
            if tracker.on_op is not None:  # shadow/script: the first op after an optimizer step ends the step
                tracker.on_op(func)
            if any(t not in _PLAIN for t in types):  # a DTensor: its own dispatch runs the ops on
                tracker.subclass_op = func  # its shards, and those come back through this mode
                return NotImplemented
            on_shards = tracker.subclass_op is func  # the DTensor op handed back, run on its shards
            if on_shards:
                tracker.subclass_op = None
            if tracker.tagging:
                tracker.context = op_block(tracker, args)
            if (tracker.meta_cache is not None and _is_view(func) and not tracker.pending and tracker.accumulate is None
                    and not tracker.saved):  # a view on the device: no storage, nothing to settle first
                return _view_op(tracker, func, args, kwargs)
            tracker.before_op()
            if tracker.phase == "backward":
                autograd.note_node(tracker)
            tracker.last = (func, tracker.label)  # named if the step fails here
            key = tracker.key(tracker.stand_in or short_name(func))
            tracker.stand_in = None
            if tracker.real_ints and not cpu:  # DDP's reducer on the GPU: its reads from host twins
                out, held, scalars = distributed.reducer_op(tracker, func, args, kwargs,
                                                            lambda: _device_op(tracker, func, args, kwargs, key))
            elif tracker.real_ints and distributed.runs_real(func, args, kwargs):  # DDP's reducer reads these
                from torch._subclasses.fake_tensor import unset_fake_temporarily
                with unset_fake_temporarily():
                    out, held, scalars = shadow_cpu.cpu_op(tracker, func, args, kwargs, key)
            else:
                out, held, scalars = (shadow_cpu.cpu_op if cpu else _device_op)(tracker, func, args, kwargs, key)
            for aid in held:
                tracker.free(aid)
            if scalars and isinstance(out, torch.Tensor):
                tracker.pending_out = weakref.ref(out)
            autograd.after_op(tracker, func, args, out, on_shards)
            return out

    global _PLAIN
    from torch._subclasses.fake_tensor import FakeTensor
    _PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)
    return _Mode()


_PLAIN = ()  # the tensor types the tracker records ops on (dispatch_mode sets them)
def _view_op(tracker, func, args, kwargs):
    """A view op on meta tensors with nothing pending: its kernel, and a storage first seen here
    (made where no op showed it) registered."""
    tracker.freed_at.clear()
    tracker.last = (func, tracker.label)
    out = func(*args, **kwargs)
    for t, nbytes in cuda.outputs(func, out):
        if t.device.type == "cpu":  # host memory (torch.tensor(1.0, device="cpu") lifted): see _device_op
            tracker.forget(t.untyped_storage())
        elif t.untyped_storage()._cdata not in tracker.live:
            tracker.add(t.untyped_storage(), tracker.key(short_name(func)), nbytes)
    return out


def _device_op(tracker, func, args, kwargs, key):
    """An op of a CUDA step's shadow: what its kernel allocates before its outputs, the outputs
    (in CUDA's order; host tensors left out), the temporaries that interleave with them
    (kernel_events), what it allocates after them (freed first) and a thread's first GEMM's
    cuBLAS and cuBLASLt workspaces (shadow/cuda). Returns (out, [ids freed as it returns], [])."""
    held = [tracker.alloc(f"{key}/kernel_temporary", n)[0] for n in cuda.before_outputs(func, args)]
    outside = cuda.outside_sample(func, args)
    if outside:
        tracker.unmeasured.add(outside)
    before, after = cuda.kernel_events(func, args) or ((), ())
    made = []  # a kernel's temporaries that interleave with its outputs, made and freed in order
    shadow_cpu.play_events(tracker, f"{key}/kernel_temporary", before, made)
    cache = tracker.meta_cache
    out = func(*args, **kwargs) if cache is None else cache.call(func, args, kwargs)
    outs = cuda.outputs(func, out)
    tags = foreach_blocks(tracker, func, args, len(outs))
    for (t, nbytes), tag in zip(outs, tags):
        if t.device.type == "cpu":  # meta tensors stand for the GPU's: a CPU one is host memory there
            tracker.forget(t.untyped_storage())  # (torch.tensor(1.0, device="cpu") in foreach AdamW)
            continue
        tracker.add(t.untyped_storage(), key, nbytes, tag)
    shadow_cpu.play_events(tracker, f"{key}/kernel_temporary", after, made)
    held[:0] = [tracker.alloc(f"{key}/kernel_temporary", n)[0] for n in cuda.after_outputs(func, args)]
    if tracker.workspace_bytes and short_name(func) in cuda.GEMMS and any(t.device.type != "cpu" for t, _ in outs):
        thread = "backward" if tracker.phase == "backward" else "main"
        tracker.hold(("cublas", thread), "workspace/cublas", tracker.workspace_bytes)  # one line, as audits name it
        if tracker.lt_workspace_bytes and short_name(func) == "addmm":  # a bias epilogue: cuBLASLt's own
            tracker.hold(("cublaslt", thread), "workspace/cublaslt", tracker.lt_workspace_bytes)
    return out, held, []


def _none():
    return None


_VIEWS = {}  # op -> whether every output is a view of an input (its schema's alias, no write)


def _is_view(func):
    if func not in _VIEWS:
        returns = func._schema.returns
        _VIEWS[func] = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return _VIEWS[func]
