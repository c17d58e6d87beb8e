"""The public recorder: audit one step of any PyTorch training loop.

    from memory_audit import Audit
    audit = Audit(model, optimizer, out_dir="runs/mine")   # CPU or CUDA, from the model's device
    for step in range(n):
        with audit.step(step):          # records only the audited step (default: index 1)
            loss = loss_fn(model(x), y)
            audit.before_backward(loss) # activations live (the loss is optional: it names more)
            loss.backward(); optimizer.step(); optimizer.zero_grad()

Recording starts when the Audit is made and ends with the audited step. The run directory then
holds the snapshots and meta.json that `attribute`, `report` and `diff` read. The gradients are
named at the end of each backward of the audited step (a post-accumulate-grad hook queues the
callback), so no call is needed between backward and zero_grad.

train.py uses the same class: it makes the Audit before the model (`Audit(out_dir=..., device=...)`)
so that the weights' allocations are in the trace, then `watch(model, optimizer, scaler)`.
An Audit made after the model finds the weights already allocated: CPU keeps them through the
profiler's pre-existing tensors, CUDA through the snapshot's segments (a named baseline).
"""

import weakref
from contextlib import ExitStack, contextmanager

import torch

from .recorder import AuditError, AuditRecording, tensors_in, named_tensors, saved_tensor_ledger, distributed_info


class Audit:
    """Record the CUDA allocator (or, on CPU, the profiler's memory timeline) over one step.

    model, optimizer: any torch.nn.Module and any torch.optim optimizer over its parameters
    (None for both to start recording before they exist; then call `watch`). out_dir: the run
    directory, made new (an existing audit there is never replaced). step: the index given to
    `step()` that is audited. scaler: a GradScaler whose state should be named. device: needed
    only without a model. config: a dict stored in meta.json (train.py's keys let `report`
    predict the run; any other dict is kept as it is).
    """

    def __init__(self, model=None, optimizer=None, out_dir="snapshots/audit", *, step=1, scaler=None,
                 device=None, config=None, max_entries=1_000_000, compiled=False, predicted=None):
        if model is None and device is None:
            raise AuditError("Audit needs a model, or a device when it starts before the model exists")
        if model is not None:
            device = _model_device(model)
        if not isinstance(step, int) or step < 0:
            raise AuditError(f"step must be a step index >= 0, got {step!r}")
        if compiled and torch.device(device).type == "cpu" and step < 2:
            raise AuditError(f"a compiled CPU audit needs step >= 2 (got {step}): it profiles from the step before "
                             "the audited one, and the first step compiles (profiling that takes gigabytes)")
        self.audit_step = step
        self.model = self.optimizer = self.scaler = None
        self.state = "waiting"  # -> "recording" (inside the audited step) -> "done"
        self._tensors = None
        self._inside = False  # within any `with audit.step(...)`
        self._ledger = None
        self._hooks = []
        self._output_hook = None
        self._graphs = self._compile_ctx = None  # compiled: the partitioner's saved values
        self._loop = {}  # name -> weak reference: the model's last output and loss, as the loop holds them
        self._inputs = {}  # name -> weak reference: what the step was fed (the model's arguments, the loss's targets)
        self._returned_at = -1  # the autograd sequence number of the model output's node
        self.recording = AuditRecording(out_dir, device, config or {}, max_entries=max_entries, defer_cpu=compiled)
        self.recording.predicted = _prediction(predicted)
        self.recording.__enter__()
        if model is not None:
            self.watch(model, optimizer, scaler, compiled)

    @property
    def run_dir(self):
        return self.recording.run_dir

    @property
    def files(self):
        return self.recording.files

    def watch(self, model, optimizer, scaler=None, compiled=False):
        """Name this model's parameters, buffers and gradients and this optimizer's state.
        compiled: the loop runs `torch.compile(model)`; call watch before its first step, so the
        partitioner's saved values are captured (they name the saved tensors)."""
        _check_pair(model, optimizer)
        if torch.device(_model_device(model)) != self.recording.device:
            raise AuditError(f"the model is on {_model_device(model)} but the audit records {self.recording.device}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        if self._output_hook is not None:
            self._output_hook.remove()
        if compiled:  # hooks on the compiled model would change its graph
            from .compiled import capture, no_cache
            self._graphs = []
            self._compile_ctx = ExitStack()
            self._compile_ctx.enter_context(no_cache())
            self.recording.compiled_wrappers = []  # names inductor's buffers in the trace
            self._compile_ctx.enter_context(capture(self._graphs, getattr(model, "audit_prefix", ""),
                                                    wrappers=self.recording.compiled_wrappers))
        else:
            self._output_hook = model.register_forward_hook(self._note_output, with_kwargs=True)
        self.recording.distributed = distributed_info(model)
        config = self.recording.config
        config.setdefault("model_class", type(model).__name__)
        config.setdefault("optimizer_class", type(optimizer).__name__)

    # -- the audited step
    @contextmanager
    def step(self, index, tensors=None):
        """Around one training step; only step `index == step` (the constructor's) is recorded.

        tensors: {name: tensor} to name as well ("inputs/x"), or a callable returning it (read
        at each phase, so a loop that rebinds its batch names the current one).
        """
        if index != self.audit_step or self.state != "waiting":
            if index == self.audit_step - 1 and self.state == "waiting" and self.model is not None:
                # compiled on CPU: profile from the step before, so the batch and loss that the
                # audited step frees were allocated under the profiler (it drops frees of older ones)
                self.recording.begin_cpu(self._live_tensors)
            self._inside = True
            try:
                yield self
            finally:
                self._inside = False
            return
        if self.model is None:
            raise AuditError("Audit.step: call watch(model, optimizer) first")
        self.state, self._tensors, self._inside = "recording", tensors, True
        try:
            self.recording.begin_cpu(self._live_tensors)  # compiled on CPU: profile from the audited step
            self._phase("step2_start")
            self._start_ledger()
            self._hook_gradients()
            yield self
            self._stop_ledger()
            self._phase("step2_end")
        except BaseException as e:
            self.state = "done"
            self._cleanup()
            self.recording.__exit__(type(e), e, e.__traceback__)
            raise
        self.state = "done"
        self._cleanup()
        self.recording.__exit__(None, None, None)

    def before_backward(self, loss=None, held=None):
        """Snapshot with the activations live. `loss`: the tensor backward starts from (its graph
        names every saved tensor by the op that saved it; without it the graph is found from the
        saved tensors themselves). `held`: {module path: tensor} the loop keeps (logits).

        Call it in every step (it does nothing in the steps not audited) and, with gradient
        accumulation, in every micro-step: the last one is kept.
        """
        if not self._inside:
            raise AuditError("Audit.before_backward() called outside `with audit.step(...)`")
        if torch.is_tensor(loss):
            self._loop["temporary/loop/loss"] = weakref.ref(loss)
            if self.state != "done" and self._graphs is None:
                self._note_loss_inputs(loss)
        if self.state != "recording":
            return
        _, label, saved = self._ledger
        label(loss, held=held)
        self._stop_ledger()
        self.recording.saved_tensors = saved
        self._phase("step2_before_backward")
        self._start_ledger()  # the next micro-step's forward, if any

    # -- ending early or on error
    def close(self, error=None):
        """Stop recording and write meta.json now (idempotent). `error`: the exception that ended
        the loop, kept in meta.json with a crash snapshot (CUDA: oom.pickle / crash.pickle)."""
        if self.state == "done":
            return
        self.state = "done"
        self._cleanup()
        if error is None:
            self.recording.__exit__(None, None, None)
        else:
            self.recording.__exit__(type(error), error, error.__traceback__)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(exc)
        return False

    # -- internals
    def _current_tensors(self):
        t = dict((self._tensors() if callable(self._tensors) else self._tensors) or {})
        named = {_storage_ptr(v) for v in t.values() if torch.is_tensor(v)}
        for name, r in self._inputs.items():  # found without help; what the loop names comes first
            v = r()
            if v is not None and _storage_ptr(v) not in named:
                named.add(_storage_ptr(v))
                t.setdefault(name, v)
        return t

    def _live_tensors(self):
        """Every tensor a phase would name now (registry, the loop's tensors)."""
        named = named_tensors(self.model, self.optimizer, self.scaler, self._current_tensors())
        return [t for _, t in named] + [r() for r in self._loop.values() if r() is not None]

    def _note_output(self, module, args, kwargs, output):
        if torch._C._current_autograd_node() is None:  # a forward, not a checkpoint's recompute
            tensors = tensors_in(output)
            for k in [k for k in self._loop if k.startswith("temporary/loop/output")]:
                del self._loop[k]
            for i, t in enumerate(tensors):
                self._loop["temporary/loop/output" + (f"{i}" if len(tensors) > 1 else "")] = weakref.ref(t)
            self._inputs = {k: r for k, r in self._inputs.items() if not k.startswith("inputs/model.")}
            for name, t in _arguments(module, args, kwargs):  # what the model's forward receives
                self._inputs[f"inputs/model.{name}"] = weakref.ref(t)
            # autograd numbers nodes as they are made: the loss's come after these
            self._returned_at = max((t.grad_fn._sequence_nr() for t in tensors if t.grad_fn is not None), default=-1)

    def _note_loss_inputs(self, loss):
        """What the loss was computed from outside the model without needing a gradient (the
        targets): the tensors the loss's own autograd nodes saved, up to the model's output,
        that no op made (no grad_fn) and that need no gradient."""
        self._inputs = {k: r for k, r in self._inputs.items() if not k.startswith("inputs/loop/")}
        for name, t in _loss_inputs(loss.grad_fn, self._returned_at):
            self._inputs.setdefault(f"inputs/loop/{name}", weakref.ref(t))

    def _phase(self, name, dump=True):
        held = {k: r() for k, r in self._loop.items() if r() is not None}
        self.recording.phase(name, self.model, self.optimizer, self.scaler, self._current_tensors(),
                             dump=dump, held=held)

    def _start_ledger(self):
        stack, saved = ExitStack(), []
        if self._graphs is not None:
            from .compiled import compiled_ledger
            from .recorder import module_namer
            ledger = compiled_ledger(saved, str(self.recording.device), self._graphs, module_namer(self.model))
        else:
            ledger = saved_tensor_ledger(self.model, saved, str(self.recording.device))
        label = stack.enter_context(ledger)
        self._ledger = (stack, label, saved)

    def _stop_ledger(self):
        if self._ledger is not None:
            self._ledger[0].close()
            self._ledger = None

    def _hook_gradients(self):
        """At the end of every backward of the audited step, register the gradients by name."""
        queued = []

        def after_backward():
            queued.clear()
            if self.state == "recording":
                self._phase("step2_after_backward", dump=False)

        def on_grad(param):
            if not queued:
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(after_backward)

        for p in self.model.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(on_grad))

    def _cleanup(self):
        self._inside = False
        self._stop_ledger()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.state == "done" and self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None
        if self.state == "done" and self._compile_ctx is not None:
            self._compile_ctx.close()
            self._compile_ctx = None


def _storage_ptr(t):
    from .recorder import local_tensor
    return local_tensor(t).untyped_storage().data_ptr()


def _arguments(module, args, kwargs):
    """(parameter name, tensor) of a forward call's tensor arguments: x for forward(self, x),
    arg<i> where the signature does not say."""
    import inspect
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"arg{i}": a for i, a in enumerate(args)} | dict(kwargs)
    return [(k, v) for k, v in bound.items() if torch.is_tensor(v)]


def _loss_inputs(root, returned_at, limit=64):
    """(op.attr, tensor) of leaf tensors that need no gradient, saved by the autograd nodes made
    after the model returned (sequence number above `returned_at`: the loss's; at most `limit`);
    a saved view stands for its base tensor."""
    from .recorder import op_name, saved_values_of
    out, seen, todo = [], set(), [root]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen or node._sequence_nr() <= returned_at:
            continue
        seen.add(node)
        for attr, value in saved_values_of(node, False):
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if torch.is_tensor(t) and t.grad_fn is None and not t.requires_grad and t.dim() > 0:
                    # a view made for the loss (y.view(-1)) dies with the step: keep its base, the loop's
                    out.append((op_name(node.name(), attr), t._base if t._base is not None else t))
        todo.extend(fn for fn, _ in node.next_functions)
    return out


def _prediction(predicted):
    """What `report` sets beside the measurement of a loop that is not train.py's GPT: the
    summary of memory_audit.predict_loop(...) (its result, or the summary itself), or None."""
    if predicted is None:
        return None
    summary = predicted.get("summary", predicted) if isinstance(predicted, dict) else None
    if not isinstance(summary, dict) or not all(isinstance(summary.get(k), int) for k in ("steady_state", "peak")):
        raise AuditError("predicted= expects what memory_audit.predict_loop(...) returned")
    return summary


def _model_device(model):
    for p in model.parameters():
        return str(p.device)
    raise AuditError(f"the model ({type(model).__name__}) has no parameters: nothing to audit")


def _check_pair(model, optimizer):
    _model_device(model)  # refuses a model without parameters
    params = list(model.parameters())
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        raise AuditError(f"expected a torch.optim optimizer, got {type(optimizer).__name__}")
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not owned & {id(p) for p in params}:
        raise AuditError(f"the optimizer ({type(optimizer).__name__}) holds none of the model's parameters")
