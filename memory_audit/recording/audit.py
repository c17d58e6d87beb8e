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
An Audit made after the model finds the weights already allocated: CPU keeps them from the
storages the phases named (cpu_timeline's "pre"), CUDA through the snapshot's segments (a named
baseline).
"""

from contextlib import ExitStack, contextmanager

import torch

from ..naming.loop_calls import LoopCalls
from ..naming.loop_names import LoopNames
from ..naming.saved import saved_tensor_ledger
from ..naming.tensors import named_tensors
from .recorder import AuditError, AuditRecording, distributed_info, indexed_device


class Audit:
    """Record the CUDA allocator (or, on CPU, the profiler's memory timeline) over one step.

    model, optimizer: any torch.nn.Module and any torch.optim optimizer over its parameters
    (None for both to start recording before they exist; then call `watch`). out_dir: the run
    directory, made new (an existing audit there is never replaced). step: the index given to
    `step()` that is audited. scaler: a GradScaler whose state should be named. device: needed
    only without a model. config: a dict stored in meta.json (train.py's keys let `report`
    predict the run; any other dict is kept as it is). cpu_timeline: on CPU, how the profile
    becomes a trace: "memory_profile" (the profiler's memory profile, falling back to the raw
    road where its checks fail) or "raw allocations" (every allocation paired with its free by
    address, tensors older than the profile from the storages the phases named); None takes the
    second, which gives the same books at half the audit's cost (building the memory profile
    walks every op of the step again). meta.json's `cpu_timeline` says which was taken.
    """

    def __init__(self, model=None, optimizer=None, out_dir="snapshots/audit", *, step=1, scaler=None,
                 device=None, config=None, max_entries=1_000_000, compiled=False, predicted=None,
                 cpu_timeline=None):
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
        self._graphs = self._compile_ctx = None  # compiled: the partitioner's saved values
        self._found = LoopNames()  # the batch, the model's output and the loss, found without being told
        self._calls = None  # what else the code made, by the call that made it (eager loops)
        self.recording = AuditRecording(out_dir, device, config or {}, max_entries=max_entries, defer_cpu=compiled,
                                        cpu_timeline=cpu_timeline)
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
        if not _same_device(_model_device(model), self.recording.device):
            raise AuditError(f"the model is on {_model_device(model)} but the audit records {self.recording.device}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self._found.remove()
        if compiled:  # hooks on the compiled model would change its graph
            from ..naming.compiled import capture, no_cache
            self._graphs = []
            self._compile_ctx = ExitStack()
            self._compile_ctx.enter_context(no_cache())
            self.recording.compiled_wrappers = []  # names inductor's buffers in the trace
            self._compile_ctx.enter_context(capture(self._graphs, getattr(model, "audit_prefix", ""),
                                                    wrappers=self.recording.compiled_wrappers))
        else:
            self._found.watch(model)
            self._watch_calls(model)
        self.recording.show_cpu([t for _, t in named_tensors(model, optimizer, scaler)])
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
            self._found.note_loss(loss, targets=self.state != "done" and self._graphs is None)
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
        return self._found.tensors(self._tensors() if callable(self._tensors) else self._tensors)

    def _live_tensors(self):
        """Every tensor a phase would name now (registry, the loop's tensors)."""
        named = named_tensors(self.model, self.optimizer, self.scaler, self._current_tensors())
        return [t for _, t in named] + list(self._found.held().values())

    def _phase(self, name, dump=True):
        held = self._found.held()
        self.recording.phase(name, self.model, self.optimizer, self.scaler, self._current_tensors(),
                             dump=dump, held=held, made=self._calls.entries() if self._calls is not None else None)

    def _watch_calls(self, model):
        self._unwatch_calls()
        calls = LoopCalls()
        calls.watch(model, self.optimizer)
        self._calls = calls.__enter__()

    def _unwatch_calls(self):
        if self._calls is not None:
            calls, self._calls = self._calls, None
            calls.close()

    def _start_ledger(self):
        stack, saved = ExitStack(), []
        if self._graphs is not None:
            from ..naming.compiled import compiled_ledger
            from ..naming.tensors import module_namer
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
        if self.state == "done":
            self._found.remove()
            self._unwatch_calls()
        if self.state == "done" and self._compile_ctx is not None:
            self._compile_ctx.close()
            self._compile_ctx = None


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


def _same_device(a, b):
    """cuda:0 and cuda are one device where 0 is the current one (the model's parameters name the
    index; an audit may be given the type alone)."""
    return indexed_device(a) == indexed_device(b)


def _check_pair(model, optimizer):
    _model_device(model)  # refuses a model without parameters
    params = list(model.parameters())
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        raise AuditError(f"expected a torch.optim optimizer, got {type(optimizer).__name__}")
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not owned & {id(p) for p in params}:
        raise AuditError(f"the optimizer ({type(optimizer).__name__}) holds none of the model's parameters")
