"""The user's own training code, shadow-run as written (issue #46; CPU).

    with memory_audit.shadow() as s:
        model = ...; optimizer = ...
        for step in range(steps):
            loss = model(x).loss
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            print(loss.item())
    print(s.summary["peak"])

Every tensor made inside is fake (FakeTensorMode: shapes, dtypes and storage sizes, no memory)
and every allocation and free goes through the shadow's tracker, and nothing is restructured
(shadow/entry.py: the ways in; predict_loop runs a `make`/`step` pair through it). Python's own lifetimes apply: a loss rebound
in the next step is freed when the new one exists, as in a real run.

Steps are counted by the optimizer's `step()` (the first optimizer stepped; the model is found
there from the modules called at top level: loop.trained_model). A step ends when `zero_grad()`
(the optimizer's or a module's) written below its optimizer step follows it before any other
op (a GradScaler's update() between them is the step's), else where the loop comes round (loop.placed:
an op written below the step inside its loop body, an evaluation or an EMA update, is the step's;
one outside the body is no step's; a zero_grad written above it starts the next step); step `audited` (an index from 0, as `Audit(step=...)` takes it: 2 is the third step; train.py's
1-based `audit_step=2` is index 1) is recorded as an Audit records it
(its before-backward moment at its last `.backward()`), and the loop is stopped as it ends: the
`with` block is left there, the exception that stopped it swallowed.

Reads of fake tensors (`.item()`, `.tolist()`, `bool()`, `float()`, `int()`) are answered with
the real value where it is known without data (known_values: small tensors made from constants,
an optimizer's step count), else with a placeholder (0, False), listed in
`summary["placeholders"]` with the line of the user's code that read it. Data-dependent shapes
(nonzero, a boolean mask's index) take a known or assumed size (`assume`), listed in
`summary["sizes"]`. Any other failure ends in one ShadowError line naming the op, the line of
the user's code and the reason.
"""

import contextlib
import warnings

from .step import ShadowError, begin_step, end_step, step_result
from .names import address, held_names, name_grads
from .known_values import DataDependentShape, KnownValues, answered_read, checked_assume
from .loop import (LoopHead, LoopLedger, MarkedStep, above, call_site, fake_ident, freed_before_start, gpu_counted,
                   loop_device, loop_summary, merged, placed, scaler_classes, trained_model, user_frames, user_line)
from .gpu import on_gpu
from .ranks import node_size, script_notes, script_ranks
from .patches import LibraryBranches, cpu_rules, ctc_as_on_real_tensors, cut_lists, fake_modules
from .depth import Cut
from .blocks import module_labels
from .tracker import Tracker, dispatch_mode
from ...reading.attribute import CUBLASLT_WORKSPACE_SIZE
from ...naming.loop_calls import LoopCalls


class _Stopped(BaseException):
    """Raised as the audited step ends: the user's loop stops there (BaseException: a loop's own
    `except Exception` does not catch it)."""


class Shadow:
    """The context manager `memory_audit.shadow()` returns (see the module docstring).
    `result`: run()'s dict for the audited step; `summary`: loop_summary(result) plus
    "placeholders" (the data-dependent reads answered without data), "sizes" (the data-dependent
    shapes' sizes taken, with where from) and "steps" (optimizer steps seen)."""

    def __init__(self, device="cpu", step=2, assume=None, gpu="H100", world_size=None, rank=0, depth=None):
        if device not in ("cpu", "cuda"):
            raise ShadowError(f"shadow(device={device!r}): the shadow runs a user's code for 'cpu' or 'cuda'")
        if (world_size is None and rank != 0) or (world_size is not None and (
                device != "cuda" or not isinstance(world_size, int) or world_size < 1
                or not isinstance(rank, int) or not 0 <= rank < world_size)):
            raise ShadowError(f"shadow(world_size={world_size!r}, rank={rank!r}): ranks are shadow-run on a GPU "
                              "(device='cuda'), world_size an int >= 1 and 0 <= rank < world_size")
        if world_size is not None:
            try:
                node_size(world_size)
            except ValueError as e:
                raise ShadowError(str(e)) from None
        self.world_size, self.rank = world_size, rank
        if not isinstance(step, int) or step < 1:
            raise ShadowError(f"shadow(step={step!r}): the audited step must be an int >= 1 (step 0 makes the optimizer's state)")
        try:
            self.audited, self.assume = step, checked_assume(assume)
            self.device = loop_device(device, gpu)
        except ValueError as e:
            raise ShadowError(str(e)) from None
        self.result = self.summary = self.given = None  # given: {name: tensor} the code names (predict_loop's inputs)
        self.depth = depth  # a deep model's equal blocks cut to this many (shadow/depth), or None

    # -- entering and leaving
    def __enter__(self):
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from ... import nosympy
        from ...nodynamo import stood_in
        from ...naming.loop_names import LoopNames
        self.tracker = tracker = Tracker()
        tracker.naming = True
        self.placeholders, self.marked, self.updating, self.starting = [], False, False, False
        self.phases, self.made, self.pre = {}, {}, None
        self.steps, self.pending, self.optimizer, self.model = 0, False, None, None
        self.step_site, self.step_frames, self.ended, self.head = None, [], False, None
        self.found = LoopNames(ident=fake_ident)
        self._tops, self._depth, self._handles = {}, 0, []  # the modules called at top level, in order
        self._stack = stack = contextlib.ExitStack()
        try:
            stack.enter_context(warnings.catch_warnings())  # torch's own data_ptr check on fake tensors
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            stack.enter_context(stood_in())
            stack.enter_context(nosympy.stood_in())
            stack.enter_context(fake_modules())
            self.branches = stack.enter_context(LibraryBranches(gpu=self.device["type"] == "cuda"))
            self.cut = Cut(self.depth, tracker)
            if self.depth is not None:
                stack.enter_context(cut_lists(self.cut.take))
                stack.callback(self.cut.remove)
            stack.enter_context(FakeTensorMode())
            if self.world_size is not None:  # torchrun's rank: the process group made for the script
                stack.enter_context(script_ranks(self.world_size, self.rank, tracker))
            if self.device["type"] == "cuda":  # every request from the first on: the allocator's model reads them all
                stack.enter_context(on_gpu(self.device, note=tracker.unmeasured.add))
                tracker.workspace_bytes = self.device["workspace_bytes"]
                tracker.lt_workspace_bytes = CUBLASLT_WORKSPACE_SIZE
                tracker.recording = True
            stack.enter_context(dispatch_mode(tracker, self.device["type"]))
            if self.device["type"] == "cpu":
                stack.enter_context(cpu_rules(tracker))
            self.known = KnownValues(tracker=tracker, assume=self.assume, where=user_line)
            stack.enter_context(self.known.watching())
            stack.enter_context(ctc_as_on_real_tensors(self.known))
            # what else the code made, as an audit names it: on top of the shadow's own function
            # modes (a GPU's device and kernel choices), so that it sees the calls the code makes
            self.calls = stack.enter_context(LoopCalls(ident=address))
            stack.callback(self.calls.remove)
            stack.callback(self._unhook)
            self._hook(torch)
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self.pending and self.steps == self.audited + 1:
            self._end_now()  # the code ended right after the audited step's optimizer step
        # stopped: also when the code's own `finally:` or bare `except:` replaced the stop
        stopped = self.ended and (exc_type is None or issubclass(exc_type, _Stopped) or not
                                  isinstance(exc, (KeyboardInterrupt, SystemExit)))
        try:  # last opened, first closed: the ledger's checkpoint patch sits on the shadow's
            if "ledger" in self.made:
                self.made["ledger"].close()
        finally:
            self._stack.close()
        if stopped:
            self.summarize(step_result(self.tracker, self.pre, self.phases))
            return True
        if exc_type is None:
            raise ShadowError(f"the code ran {self.steps} {'marked' if self.marked else 'optimizer'} step(s) and ended "
                              f"before step {self.audited} did: nothing to predict")
        if isinstance(exc, (ShadowError, KeyboardInterrupt, SystemExit)):
            return False
        if isinstance(exc, DataDependentShape):
            raise ShadowError(str(exc)) from None
        where = user_line(tb) or "the loop"
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ShadowError(f"the shadow run stopped at {self.tracker.op}, {where}: {exc_type.__name__}: {reason}") from None

    def summarize(self, result, repeated=None):
        """self.result and self.summary from the audited step's run() dict (step_result's, or
        shadow/depth's built at the model's depth: `repeated` says from what)."""
        source = "shadow(): the user's code on fake tensors" + (f" ({repeated})" if repeated else "")
        self.result = result
        self.summary = dict(loop_summary(result), steps=self.steps, placeholders=self.placeholders,
                            sizes=self.known.sizes, device=self.device, source=source)
        if self.device["type"] == "cuda":  # as memory_allocated() and memory_reserved() count it
            self.summary.update(gpu_counted(result, script_notes(self.model, self.world_size)))

    # -- what the session hooks
    def _hook(self, torch):
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optim_mod
        session = self

        def pre(mod, args):
            if torch._C._current_autograd_node() is not None:  # a checkpoint's recomputation, not a forward
                return
            if session._depth == 0:
                session.branches.apply()  # a library imported by now (lazily, by the forward itself)
                if session.tracker.phase == "optimizer" and session.model in (None, mod):
                    session.tracker.phase = "forward"  # the next micro-step's forward, as loop_calls has it
            if session._depth == 0 and session.model is None:  # the last call last
                session._tops.pop(mod, None)
                session._tops[mod] = None
            session._depth += 1

        def post(mod, args, kwargs, out=None):  # out: None where the forward raised (always_call)
            if torch._C._current_autograd_node() is not None:
                return
            session._depth -= 1
            if session._depth == 0 and session.model is None and out is not None:  # before the model is known (step 0), every
                session.found.note_output(mod, args, kwargs, out)  # top-level call, as an Audit's hook on it sees
        self._handles += [module_mod.register_module_forward_pre_hook(pre),
                          module_mod.register_module_forward_hook(post, with_kwargs=True, always_call=True),
                          optim_mod.register_optimizer_step_post_hook(self._stepped)]
        self._saved = {}
        self._instrument(torch)

    def _set(self, owner, name, new):
        """owner.name is `new` until _unhook; a torch-function mode (loop_calls) that hands the
        call back reaches the original (once: the second time it is torch's own)."""
        original = self._saved[(owner, name)] = getattr(owner, name)
        active = []

        def once(*args, **kwargs):
            if active:
                return original(*args, **kwargs)
            active.append(True)
            try:
                return new(*args, **kwargs)
            finally:
                active.pop()
        setattr(owner, name, once)

    def _comparisons(self, torch, patch):
        """torch.allclose and torch.equal (functions and methods), which answer a bool that fake
        tensors do not have (parametrizations.orthogonal asks allclose of the weight it is
        handed). allclose runs as CPU's kernel does, isclose(...).all() read as a bool: the real
        answer where the values are known (constants), else a placeholder False, listed. equal
        (no memory of its own) is True for a tensor against itself, else a placeholder False."""
        def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
            n = len(self.placeholders)
            value = bool(torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan).all())
            for p in self.placeholders[n:]:  # (a placeholder: the bool() read, listed as allclose)
                p["read"] = "torch.allclose()"
            return value
        for owner, name in ((torch, "equal"), (torch.Tensor, "equal")):
            same = answered_read(name, getattr(owner, name), False, self.placeholders, user_line)
            patch(owner, name, lambda a, b, _same=same: True if a is b else _same(a, b))
        patch(torch, "allclose", allclose)
        patch(torch.Tensor, "allclose", allclose)

    def _instrument(self, torch):
        """The session's instruments on the code's calls: backward, zero_grad, the value reads,
        GradScaler.update, and the step's end at the first op after an optimizer step."""
        session, patch = self, self._set
        backward = torch.Tensor.backward
        patch(torch.Tensor, "backward", lambda t, *a, **k: self._backward(backward, t, *a, **k))
        for owner in (torch.optim.Optimizer, torch.nn.Module):
            zero = owner.zero_grad
            patch(owner, "zero_grad", lambda obj, *a, _zero=zero, **k: self._zero_grad(_zero, obj, *a, **k))
        for name, answer in (("item", None), ("tolist", None), ("__bool__", False), ("__float__", 0.0), ("__int__", 0)):
            patch(torch.Tensor, name, answered_read(name, getattr(torch.Tensor, name), answer, self.placeholders,
                                                    user_line))
        self._comparisons(torch, patch)
        form = torch.Tensor.__format__
        patch(torch.Tensor, "__format__", lambda t, spec: t.item().__format__(spec) if t.dim() == 0 else form(t, spec))

        def scaler_update(update):  # GradScaler.update after its step is that step's
            def call(scaler, *args, **kwargs):
                session.updating = True
                try:
                    return update(scaler, *args, **kwargs)
                finally:
                    session.updating = False
            return call
        for scaler in scaler_classes(torch):
            patch(scaler, "update", scaler_update(scaler.update))

        def on_op(func):  # the first op after an optimizer step, zero_grad not called first, written above
            if session.starting:  # it (the loop come round): the step ends; one written below is the step's
                session._freed_before_start()
            if session.pending and not session.updating and func.namespace != "profiler":  # (record_function's exit)
                where = placed(session.step_frames, user_frames())
                if where in ("head", "same") or (where == "outside" and session.steps == session.audited + 1):
                    session._boundary()  # (the audited step ends before code outside its loop body)
                elif session.head is not None:  # what the code let go before this op is not the next step's
                    session.head.freed.clear()
        self.tracker.on_op = on_op

    def _unhook(self):
        for h in self._handles:
            h.remove()
        for (owner, name), value in self._saved.items():
            setattr(owner, name, value)
        self.found.remove()
        for h in self.made.get("labels", []):
            h.remove()

    # -- steps
    def _stepped(self, optimizer, args, kwargs):
        if self.optimizer is None:
            self.optimizer = optimizer
            self._found_model()
        if optimizer is not self.optimizer or self.marked:  # marked steps: the code says where they end
            return
        self.step_site, self.step_frames = call_site(), user_frames()
        self.steps += 1
        self.pending = True
        if self.steps in (self.audited, self.audited + 1):
            self._watch_head()

    def _watch_head(self):
        """The audited step is next, or ends next: what the loop lets go at its head is the next
        step's (loop.LoopHead), named as it is named now."""
        self.head = LoopHead(self.tracker, self._made_now(), self._named(merged(self.found.held(), {})),
                             lambda: self.pending and placed(self.step_frames, user_frames()) == "head")

    def _zero_grad(self, original, obj, *args, **kwargs):
        first = self.pending and above(call_site(), self.step_site)
        if first:  # zero_grad written above the optimizer step: the next step's first line
            self._boundary()
        self.pending_zero = self.pending
        self.pending = False  # zero_grad written after the optimizer step belongs to its step
        try:
            return original(obj, *args, **kwargs)
        finally:
            if self.pending_zero:
                self._boundary()

    def _end_now(self):
        try:
            self._boundary()
        except _Stopped:
            pass

    def step(self, held=None):
        """`with s.step(held):` around one training step marks its bounds where the code says
        them, as `with audit.step(i):` does (then every step is marked so, and the optimizer's
        steps mark none). held: {name: tensor} the loop keeps across the bounds (the last step's
        output and loss), read as the step starts and as it ends: the body may update it."""
        return MarkedStep(self, {} if held is None else held)

    def _boundary(self, held=None):
        """A step has ended (its optimizer step, and zero_grad if that came next; or a marked
        step's end)."""
        self.pending = False
        self.known.new_step()
        if self.steps == self.audited:  # the audited step starts
            self._begin(held or {})
        elif self.steps == self.audited + 1:  # it ends: the loop stops here
            if self.head is not None:  # let go at the loop's head: the next step's
                self.head.kept_out()
            self._made()
            end_step(self.tracker, self._named(merged(self.found.held(), held or {})))
            self.ended = True
            raise _Stopped()
        self.tracker.phase = "forward"

    def _begin(self, held):
        if self.model is None:
            raise ShadowError(f"step {self.audited} started before any optimizer step: shadow() finds the model "
                              "at the first one (the step that makes the optimizer's state)")
        self.pre = begin_step(self.tracker, {**self._made_now(), **self._named(merged(self.found.held(), held))},
                              self.phases)
        if self.head is not None:  # let go at the loop's head, before its first op: the step's
            self.pre += self.head.taken_in()
        self.head, self.tracker.on_free = None, None
        self.made["ledger"] = LoopLedger(self.tracker, self.model)
        self.starting = not self.marked  # an optimizer's step: the frees before the next op are the last step's
        if self.starting:
            self.free_sites = {}
            self.tracker.on_free = lambda at, aid: self.free_sites.__setitem__(at, call_site())

    def _freed_before_start(self):
        self.starting, self.tracker.on_free = False, None
        self.pre = freed_before_start(self.tracker, self.phases, self.pre, self.free_sites, self.step_site)

    def _found_model(self):
        self.use(trained_model(self.optimizer, self._tops, self.device))
        self._tops = {}

    def use(self, model, optimizer=None):
        """The model (and optimizer) the loop trains, where the code says which (predict_loop's
        make()); else found at the first optimizer step."""
        self.model, self.optimizer = model, optimizer or self.optimizer
        self.cut.place(model)
        self.calls.watch(model, self.optimizer)
        self.made["labels"] = module_labels(model, self.tracker, root=type(model).__name__.lower())
        self.found.watch(model)

    def _named(self, held):
        return held_names(self.model, self.optimizer, merged(self.found.tensors(self.given), held))

    def _made_now(self):
        """{storage: name} of what else the code made and is live now, by its call (loop_calls):
        where the shadow's own key is an op's, in a step or before the first (a tensor the code
        makes before its loop, `torch.tensor(...)`, is named by its call, as an Audit made
        before it names it); what the shadow stands in for itself (DDP's buckets, cuBLAS's
        workspaces) keeps its name, as the audit's rules name those first."""
        live, allocs = self.tracker.live, self.tracker.allocs

        def an_op(key):
            return key.startswith(("activations/", "temporary/")) or "/" not in key
        return {sid: name for sid, name in self.calls.names().items() if sid in live and an_op(allocs[live[sid][0]][0])}

    def _made(self):
        """_made_now() kept for the phases' lines."""
        for sid, name in self._made_now().items():
            self.tracker.made_names.setdefault(self.tracker.live[sid][0], name)

    def _backward(self, original, t, *args, **kwargs):
        tracker = self.tracker
        audited = self.pre is not None and not self.ended
        if audited:
            tracker.before_op()
            self.phases["step2_before_backward"] = len(tracker.events)
        with tracker.unseeing():
            self.found.note_loss(t)
        if audited:
            self.made["ledger"].name(t, self._named({}), self._named(self.found.held()))
            self._made()
        tracker.phase, tracker.node_start = "backward", {}  # (autograd's sequence numbers are per thread)
        try:
            return original(t, *args, **kwargs)
        finally:
            tracker.phase = "optimizer"
            if self.model is not None:
                name_grads(tracker, self.model)
