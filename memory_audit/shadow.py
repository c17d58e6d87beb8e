"""The shadow run: train.py's step on fake tensors, every allocation and free in autograd's order.

model.py's GPT, the loss, autograd's backward (checkpointing's recomputation included), the
gradient clipping and the AdamW step run at the target config on FakeTensorMode tensors: shapes
and dtypes, no memory, any size. A dispatch mode above the fake mode records each op's outputs
whose storage it has not seen (an allocation of storage.nbytes() bytes) and, through a weakref
on that storage, the moment it is freed. The order and the lifetimes are PyTorch's own; nothing
here knows which op saves what.

Watching changes one thing autograd decides: it adds a gradient into a buffer in place only when
it holds the buffer's last reference, and a tensor Python has seen never qualifies. So the
shadow's backward adds out of place where the real one does not; RULES undoes that.

What the dispatcher cannot see is added by rules, each measured on CPU audits (RULES below):
  inplace_accumulate  autograd's gradient sum (an add during backward whose first operand, not a
                      view and contiguous, dies with it) reuses that operand's memory
  wrapped_scalar      a Python number passed for a Tensor argument (and the Scalar overloads of
                      the arithmetic and comparison ops) is an 8 B CPU tensor (1 B for a bool)
                      made before the op and freed after it unless its autograd node saves it;
                      a cast of it to the op's dtype lives while the output is made; a CPU
                      _foreach_ op with a Scalar(List) runs that op tensor by tensor
  dtype_cast          a CPU elementwise op on two dtypes (fp32 residual + bf16 branch) copies
                      the other-dtype operand to the common dtype while the output is made
  rng_state           torch.get_rng_state() (checkpointing, per region with dropout) is a real
                      tensor the generator makes: counted when made, freed when let go
This is a first cut on CPU: the CUDA rules (allocator rounding, cuBLAS workspaces, the SDPA
kernels' outputs, fused Adam's temporaries) and torchrun are not in it yet.

Returns plain data: events [(action, key, bytes)] of the audited step in order (action "alloc"
or "free"), the bytes live when the step starts, the phase positions, the peak.
"""

import contextlib
import weakref

RULES = ("inplace_accumulate", "wrapped_scalar", "dtype_cast", "rng_state")
# elementwise ops whose CPU kernels copy an operand of another dtype to the common one first
_MIXED = frozenset(("add", "sub", "mul", "div"))
# ops whose Scalar overload the CPU kernels run as the Tensor one, on a wrapped 0-dim tensor
_WRAPS_SCALAR = frozenset(("eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "div", "rsub"))


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
        self.pending = []  # allocation ids of the wrapped scalars the last op made
        self.pending_out = _none  # weakref to that op's output (its grad_fn may save them)
        self.saved = []  # (StorageWeakRef, allocation id) of real tensors an autograd node holds
        self.accumulate = None  # (out storage id, first operand's storage id) of the last backward add
        self.freed_at = {}  # storage id -> index of its free event (read by the next op)

    def key(self, name):
        where = f"{self.label}/{name}" if self.label else name
        return {"forward": "activations/", "backward": "temporary/backward/",
                "optimizer": "temporary/optimizer/", "inputs": "inputs/"}.get(self.phase, "") + where

    def alloc(self, key, nbytes):
        """A new allocation; returns (its id, the index of its event or None)."""
        aid = len(self.allocs)
        self.allocs[aid] = [key, nbytes]
        return aid, self._event("alloc", aid)

    def free(self, aid):
        return self._event("free", aid)

    def _event(self, action, aid):
        if self.recording:
            self.events.append([action, aid])
            return len(self.events) - 1
        return None

    def add(self, storage, key):
        sid = storage._cdata
        if sid in self.live:
            return
        self.live[sid] = list(self.alloc(key, storage.nbytes()))
        weakref.finalize(storage, self._freed, sid)

    def _freed(self, sid):
        entry = self.live.pop(sid, None)
        if entry is not None:
            self.freed_at[sid] = self.free(entry[0])

    def before_op(self):
        """Settle what the previous op left: its wrapped scalars are freed unless its autograd
        node saved them (then with the node's saved tensors), and a backward add whose operand
        died with it took that operand's memory."""
        for entry in [w for w in self.saved if w[0].expired()]:  # real tensors their holders let go
            self.saved.remove(entry)
            self.free(entry[1])
        if self.pending:
            from torch.multiprocessing.reductions import StorageWeakRef
            saved = _saved_scalars(self.pending_out())
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


def _scalar_bytes(value):
    return 1 if isinstance(value, bool) else 8


def _scalar_allocs(tracker, key, value, like):
    """A wrapped scalar (8 B; 1 B for a bool) and, where the op computes in another dtype than
    the scalar's (double, int64, bool), its cast to `like`'s dtype: (scalar id, cast id or None)."""
    import torch
    scalar = tracker.alloc(f"{key}/scalar", _scalar_bytes(value))[0]
    own = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
    if like is None or like.dtype == own:
        return scalar, None
    return scalar, tracker.alloc(f"{key}/scalar_cast", like.element_size())[0]


def _mixed_dtype_casts(func, tensors):
    """[(operand, bytes)] of the copies a CPU elementwise op makes of the operands whose dtype is
    not the common one (fp32 + bf16 under autocast: the bf16 side cast to fp32) before it runs."""
    import torch
    name = func.__name__.split(".")[0].rstrip("_")
    if name not in _MIXED or func._overloadname != "Tensor" or len(tensors) != 2:
        return []
    a, b = tensors
    if a.dtype == b.dtype or a.dim() == 0 or b.dim() == 0:
        return []
    common = torch.result_type(a, b)
    return [(t, t.numel() * common.itemsize) for t in (a, b) if t.dtype != common]


def _foreach_scalars(func, args):
    """[(value, tensor)] for each tensor of a _foreach_ op's Scalar or ScalarList overload whose
    per-tensor op wraps its scalar: on CPU the foreach ops run that op tensor by tensor."""
    name = func.__name__.split(".")[0]
    if not name.startswith("_foreach_") or func._overloadname not in ("Scalar", "ScalarList"):
        return []
    if name[len("_foreach_"):].rstrip("_") not in _WRAPS_SCALAR or len(args) < 2:
        return []
    tensors, values = args[0], args[1]
    values = values if isinstance(values, (list, tuple)) else [values] * len(tensors)
    return [(v, t) for v, t in zip(values, tensors) if isinstance(v, (bool, int, float))]


def _wrapped_scalars(func, args):
    """[(value, Tensor argument position)] of Python numbers the op gets for Tensor arguments
    (CPU wraps each in a 0-dim tensor), and the comparison ops' Scalar operand."""
    out = []
    schema = func._schema.arguments
    for i, a in enumerate(args[:len(schema)]):
        if isinstance(a, (bool, int, float)) and str(schema[i].type) == "Tensor":
            out.append(a)
    name, overload = func.__name__.split(".")[0].rstrip("_"), func._overloadname
    if not out and overload == "Scalar" and name in _WRAPS_SCALAR:
        out = [a for a in args[1:2] if isinstance(a, (bool, int, float))]
    return out


def _mode(tracker, device_type):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "prim":  # metadata queries (a fake tensor's device): no memory
                return func(*args, **(kwargs or {}))
            tracker.before_op()
            key = tracker.key(func.__name__.split(".")[0])
            cpu = device_type == "cpu"
            scalars = _wrapped_scalars(func, args) if cpu else []
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            held = []  # freed once the outputs are made: casts, and a foreach op's last scalar
            for value in scalars:
                scalar, cast = _scalar_allocs(tracker, key, value, tensors[0] if tensors else None)
                tracker.pending.append(scalar)
                held += [cast] if cast is not None else []
            for t, nbytes in (_mixed_dtype_casts(func, tensors) if cpu else []):
                held.append(tracker.alloc(f"{key}/dtype_cast", nbytes)[0])
            per_tensor = _foreach_scalars(func, args) if cpu else []
            for j, (value, t) in enumerate(per_tensor):  # the CPU foreach loop: one op per tensor
                ids = [i for i in reversed(_scalar_allocs(tracker, key, value, t)) if i is not None]
                if j < len(per_tensor) - 1:
                    for aid in ids:
                        tracker.free(aid)
                else:
                    held += ids
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    tracker.add(t.untyped_storage(), key)
            for aid in held:
                tracker.free(aid)
            if scalars and isinstance(out, torch.Tensor):
                tracker.pending_out = weakref.ref(out)
            first = tensors[0] if len(tensors) == 2 else None
            if (tracker.phase == "backward" and func is torch.ops.aten.add.Tensor and first is not None
                    and isinstance(out, torch.Tensor) and first.shape == out.shape and first.dtype == out.dtype
                    and first.is_contiguous() and not first._is_view()):
                tracker.accumulate = (out.untyped_storage()._cdata, first.untyped_storage()._cdata)
            return out

    return _Mode()


def _none():
    return None


@contextlib.contextmanager
def _rng_states(tracker):
    """torch.get_rng_state() made visible: the CPU generator's state, a real uint8 tensor the
    generator makes outside the dispatcher, which checkpointing saves per region (with dropout)
    until its recomputation has run."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    original = torch.get_rng_state

    def get_rng_state():
        state = original()
        tracker.before_op()
        aid, _ = tracker.alloc(tracker.key("checkpoint.rng_state"), state.untyped_storage().nbytes())
        tracker.saved.append((StorageWeakRef(state.untyped_storage()), aid))
        return state
    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _saved_scalars(out):
    """The wrapped scalars (real 0-dim tensors among fake ones) that `out`'s autograd node
    saved (autograd saves them without the saved-tensor hooks: read from the node)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    node = getattr(out, "grad_fn", None)
    if node is None:
        return []
    found = []
    for attr in dir(node):
        if attr.startswith("_saved_"):
            v = getattr(node, attr)
            if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) and v.dim() == 0:
                found.append(v)
    return found


def _module_labels(model, tracker):
    """Forward pre/post hooks that keep tracker.label at the innermost module path."""
    stack, handles = [], []
    for name, mod in model.named_modules():
        def pre(_m, _a, name=name):
            stack.append(tracker.label)
            tracker.label = name or "gpt"

        def post(_m, _a, _o):
            tracker.label = stack.pop() if stack else ""
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    return handles


def _names(model, optimizer, held):
    """{storage id: name} of what the loop holds between steps, named as an audit names it."""
    import torch
    out = {}

    def put(t, name):
        if isinstance(t, torch.Tensor):
            out.setdefault(t.untyped_storage()._cdata, name)
    param_name = {}
    for name, p in model.named_parameters():
        param_name[id(p)] = name
        put(p, f"weights/{name}")
        put(p.grad, f"grads/{name}")
    for name, b in model.named_buffers():
        put(b, f"buffers/{name}")
    for p, state in optimizer.state.items():
        for k, v in state.items():
            put(v, f"optimizer/{k}/{param_name.get(id(p), '?')}")
    for name, t in held.items():
        put(t, name)
    return out


def _held(X, Y, loss, scaler):
    """What the loop itself holds between steps, by the names an audit gives it."""
    return {"inputs/x": X, "inputs/y": Y, "temporary/loss": loss,
            "optimizer/grad_scaler/scale": getattr(scaler, "_scale", None),
            "optimizer/grad_scaler/growth_tracker": getattr(scaler, "_growth_tracker", None)}


def _setup(cfg, device_type):
    """(model, optimizer, scaler, get_batch, autocast) at cfg, as train.py builds them."""
    import torch
    from model import GPT, GPTConfig
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["dtype"]]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{k: v for k, v in cfg.items() if k in GPTConfig.__dataclass_fields__}))
    # the values do not change memory; train.py's defaults
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), cfg["optimizer_impl"])
    B, T, V = cfg["batch_size"], cfg["block_size"], cfg["vocab_size"]

    def get_batch():
        buf = torch.randint(V, (B, T + 1))
        return (buf[:, :-1].clone(memory_format=torch.contiguous_format),
                buf[:, 1:].clone(memory_format=torch.contiguous_format))
    autocast = torch.autocast(device_type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    # A fake found_inf cannot be read (.item()): the shadow takes the step, as a finite step does.
    scaler._maybe_opt_step = lambda opt, state, *a, **k: opt.step(*a, **k)
    return model, optimizer, scaler, get_batch, autocast


def run(cfg, device_type="cpu", fake=True):
    """Shadow-run two steps of train.py's loop at `cfg` (train.py's keys, resolved) on fake
    tensors and return the second (see _result). fake=False runs the same on real tensors (a
    check of the tracker itself)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    tracker = Tracker()
    with FakeTensorMode() if fake else contextlib.nullcontext(), _mode(tracker, device_type), _rng_states(tracker):
        model, optimizer, scaler, get_batch, autocast = _setup(cfg, device_type)
        handles = _module_labels(model, tracker)
        accum = cfg["gradient_accumulation_steps"]
        tracker.phase = "inputs"
        X, Y = get_batch()
        loss = None
        phases = {}
        for it in range(2):
            if it == 1:
                tracker.before_op()
                start = _names(model, optimizer, _held(X, Y, loss, scaler))
                pre = [(aid, start.get(sid)) for sid, (aid, _) in tracker.live.items()]
                tracker.recording = True
            for micro in range(accum):
                tracker.phase = "forward"
                with autocast:
                    logits, loss = model(X, Y)
                    loss = loss / accum
                if not cfg["keep_logits"]:
                    logits = None
                if it == 1 and micro == accum - 1:
                    tracker.before_op()
                    phases["step2_before_backward"] = len(tracker.events)
                tracker.phase = "inputs"
                X, Y = get_batch()
                tracker.phase = "backward"
                scaler.scale(loss).backward()
                del logits
            tracker.phase = "optimizer"
            if cfg["grad_clip"] != 0.0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=cfg["set_to_none"])
        tracker.before_op()
        tracker.recording = False
        end = _names(model, optimizer, _held(X, Y, loss, scaler))
        for sid, name in end.items():  # what the step made and the loop keeps: grads, new batch, loss
            if sid in tracker.live:
                tracker.allocs[tracker.live[sid][0]][0] = name
        for h in handles:
            h.remove()
    return _result(tracker, pre, phases)


def _result(tracker, pre, phases):
    """{"events": [(action, key, bytes, id)] of the step in order, "pre": [(id, key, bytes)]
    live when it starts, "start_bytes", "phases": {phase: event position}, "peak"}."""
    events, cut = [], {"step2_start": 0}
    for i, (action, aid) in enumerate(tracker.events):
        for phase, at in phases.items():
            if at == i:
                cut[phase] = len(events)
        if action is not None:
            key, nbytes = tracker.allocs[aid]
            events.append((action, key, nbytes, aid))
    cut["step2_end"] = len(events)
    for phase in phases:
        cut.setdefault(phase, len(events))
    pre = [(aid, name or tracker.allocs[aid][0], tracker.allocs[aid][1]) for aid, name in pre]
    start_bytes = sum(n for _, _, n in pre)
    level = peak = 0
    for action, _, nbytes, _ in events:
        level += nbytes if action == "alloc" else -nbytes
        peak = max(peak, level)
    return {"events": events, "pre": pre, "start_bytes": start_bytes, "phases": cut, "peak": start_bytes + peak}


PREDICTED_FRAME = "<predicted>"  # attribute.name_from_frames reads a predicted event's key here


def snapshot(result):
    """The shadow's step as a snapshot (CPU schema: one segment per live allocation, as CPU
    audits write them) that MemoryViz opens and `attribute`/`viz` name by the events' keys. The
    trace starts with what is live when the step starts (at time 0), then the step's events;
    addresses are made up, one range per allocation."""
    from .cpu_timeline import snapshot_at
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
    for action, key, nbytes, aid in result["events"]:
        t += 1000
        where = place(aid, nbytes) if action == "alloc" else addr[aid]
        events.append((t, action, where, nbytes, frames(key), key.split("/", 1)[0], ""))
    return snapshot_at(events, t)
