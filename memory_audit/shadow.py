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
                      a cast of it to the op's dtype lives while the output is made
  rng_state           torch.get_rng_state() (checkpointing, per region with dropout) is a real
                      tensor the generator makes: counted when made, freed when let go
This is a first cut on CPU: the CUDA rules (allocator rounding, cuBLAS workspaces, the SDPA
kernels' outputs, fused Adam's temporaries) and torchrun are not in it yet.

Returns plain data: events [(action, key, bytes)] of the audited step in order (action "alloc"
or "free"), the bytes live when the step starts, the phase positions, the peak.
"""

import contextlib
import weakref

RULES = ("inplace_accumulate", "wrapped_scalar", "rng_state")
# ops whose Scalar overload the CPU kernels run as the Tensor one, on a wrapped 0-dim tensor
_WRAPS_SCALAR = frozenset(("eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "div", "rsub"))


class Tracker:
    """Allocations and frees of the storages ops return, in order (see module docstring)."""

    def __init__(self):
        self.events = []  # [action, key, nbytes]; a dropped event's action becomes None
        self.live = {}  # storage id -> [key, nbytes, index of its alloc event]
        self.recording = False
        self.in_backward = False
        self.label = ""  # the module path the forward is in (module hooks set it)
        self.pending = []  # (key, nbytes) of the wrapped scalars the last op made
        self.pending_out = _none  # weakref to that op's output (its grad_fn may save them)
        self.saved = []  # (StorageWeakRef, key, nbytes) of wrapped scalars an autograd node holds
        self.accumulate = None  # (out id, first id, second id) of the last backward add
        self.freed_at = {}  # storage id -> index of its free event (read by the next op)

    def _event(self, action, key, nbytes):
        if self.recording:
            self.events.append([action, key, nbytes])
            return len(self.events) - 1
        return None

    def add(self, storage, key):
        sid = storage._cdata
        if sid in self.live:
            return
        nbytes = storage.nbytes()
        self.live[sid] = [key, nbytes, self._event("alloc", key, nbytes)]
        weakref.finalize(storage, self._freed, sid)

    def _freed(self, sid):
        key, nbytes, _ = self.live.pop(sid, (None, 0, None))
        if key is not None:
            self.freed_at[sid] = self._event("free", key, nbytes)

    def before_op(self):
        """Settle what the previous op left: its wrapped scalars are freed unless its autograd
        node saved them (then with the node's saved tensors), and a backward add whose operand
        died with it took that operand's memory."""
        for entry in [w for w in self.saved if w[0].expired()]:  # real tensors their holders let go
            self.saved.remove(entry)
            self._event("free", entry[1], entry[2])
        if self.pending:
            from torch.multiprocessing.reductions import StorageWeakRef
            saved = _saved_scalars(self.pending_out())
            for key, nbytes in self.pending:
                if saved:  # a real tensor's storage: watched through a C++ weak reference
                    self.saved.append((StorageWeakRef(saved.pop(0).untyped_storage()), key, nbytes))
                else:
                    self._event("free", key, nbytes)
            self.pending, self.pending_out = [], _none
        if self.accumulate is not None:
            out, first, second = self.accumulate
            self.accumulate = None
            if first is not None and first not in self.live and out in self.live:
                self._fold(out, first)
        self.freed_at.clear()

    def _fold(self, out, operand):
        """The add's output lives in `operand`'s memory: drop its alloc and the operand's free."""
        alloc_at, free_at = self.live[out][2], self.freed_at.get(operand)
        if alloc_at is None or free_at is None or free_at < alloc_at:
            return False
        self.events[alloc_at][0] = self.events[free_at][0] = None
        return True

    def live_bytes(self):
        return sum(n for _, n, _ in self.live.values())


def _scalar_bytes(value):
    return 1 if isinstance(value, bool) else 8


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
            name = func.__name__.split(".")[0]
            key = f"{tracker.label}/{name}" if tracker.label else name
            scalars = _wrapped_scalars(func, args) if device_type == "cpu" else []
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            casts = []
            for value in scalars:
                tracker._event("alloc", f"{key}/scalar", _scalar_bytes(value))
                tracker.pending.append((f"{key}/scalar", _scalar_bytes(value)))
                if tensors and tensors[0].dtype != (torch.bool if isinstance(value, bool) else
                                                    torch.int64 if isinstance(value, int) else torch.float64):
                    nbytes = tensors[0].element_size()
                    tracker._event("alloc", f"{key}/scalar_cast", nbytes)
                    casts.append(nbytes)
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    tracker.add(t.untyped_storage(), key)
            for nbytes in casts:
                tracker._event("free", f"{key}/scalar_cast", nbytes)
            if scalars and isinstance(out, torch.Tensor):
                tracker.pending_out = weakref.ref(out)
            first = tensors[0] if len(tensors) == 2 else None
            if (tracker.in_backward and func is torch.ops.aten.add.Tensor and first is not None
                    and isinstance(out, torch.Tensor) and first.shape == out.shape and first.dtype == out.dtype
                    and first.is_contiguous() and not first._is_view()):
                tracker.accumulate = (out.untyped_storage()._cdata, first.untyped_storage()._cdata, None)
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
        key = f"{tracker.label}/checkpoint.rng_state" if tracker.label else "checkpoint.rng_state"
        tracker._event("alloc", key, state.untyped_storage().nbytes())
        tracker.saved.append((StorageWeakRef(state.untyped_storage()), key, state.untyped_storage().nbytes()))
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


def run(cfg, device_type="cpu", fake=True):
    """Shadow-run two steps of train.py's loop at `cfg` (train.py's keys, resolved) on fake
    tensors and return the second: {"events", "start_bytes", "phases", "peak"}. fake=False runs
    the same on real tensors (a check of the tracker itself)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from model import GPT, GPTConfig

    model_keys = GPTConfig.__dataclass_fields__
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["dtype"]]
    tracker = Tracker()
    with FakeTensorMode() if fake else contextlib.nullcontext(), _mode(tracker, device_type), _rng_states(tracker):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{k: v for k, v in cfg.items() if k in model_keys}))
        # the values do not change memory; train.py's defaults
        optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), cfg["optimizer_impl"])
        handles = _module_labels(model, tracker)
        B, T, V, accum = cfg["batch_size"], cfg["block_size"], cfg["vocab_size"], cfg["gradient_accumulation_steps"]

        def get_batch():
            buf = torch.randint(V, (B, T + 1))
            return (buf[:, :-1].clone(memory_format=torch.contiguous_format),
                    buf[:, 1:].clone(memory_format=torch.contiguous_format))
        autocast = torch.autocast(device_type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        X, Y = get_batch()
        loss = None
        phases, start_bytes = {}, 0
        for it in range(2):
            if it == 1:
                tracker.before_op()
                start_bytes = tracker.live_bytes()
                tracker.recording = True
                phases["step2_start"] = 0
            for micro in range(accum):
                with autocast:
                    logits, loss = model(X, Y)
                    loss = loss / accum
                if not cfg["keep_logits"]:
                    logits = None
                if it == 1 and micro == accum - 1:
                    tracker.before_op()
                    phases["step2_before_backward"] = len(tracker.events)
                X, Y = get_batch()
                tracker.in_backward = True
                loss.backward()
                tracker.in_backward = False
                del logits
            if cfg["grad_clip"] != 0.0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=cfg["set_to_none"])
        tracker.before_op()
        phases["step2_end"] = len(tracker.events)
        tracker.recording = False
        for h in handles:
            h.remove()
    return _result(tracker, start_bytes, phases)


def _result(tracker, start_bytes, phases):
    events = []
    cut = {}
    for i, (action, key, nbytes) in enumerate(tracker.events):
        for phase, at in phases.items():
            if at == i:
                cut[phase] = len(events)
        if action is not None:
            events.append((action, key, nbytes))
    for phase, at in phases.items():
        cut.setdefault(phase, len(events))
    level = peak = 0
    for action, _, nbytes in events:
        level += nbytes if action == "alloc" else -nbytes
        peak = max(peak, level)
    return {"events": events, "start_bytes": start_bytes, "phases": cut, "peak": start_bytes + peak}
