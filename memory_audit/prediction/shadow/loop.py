"""What every shadow run of a user's loop shares (shadow/script.Shadow, and predict_loop
through it): the audit's saved-tensor ledger over the audited step (LoopLedger), the loop's
names merged with the model's, the user's own lines (user_line: where a read or a stop is
reported; call_site/above: where a zero_grad is written against the optimizer step) and the
summary an Audit keeps (loop_summary), and a step the code marks itself (MarkedStep).
"""

import contextlib
import linecache
import os
import traceback

from .names import address, lines, live_names
from .step import step_levels
from .error import ShadowError

_HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # memory_audit/
_LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python", "<frozen", _HERE)


class MarkedStep:
    """One step whose bounds the code marks (`with s.step(held):`, Shadow.step; predict_loop's
    steps)."""

    def __init__(self, session, held):
        self.session, self.held = session, held

    def __enter__(self):
        s = self.session
        if not s.marked and s.steps:
            raise ShadowError("s.step() marks every step or none: the code ran optimizer steps before its first "
                              "marked one")
        s.marked = True
        if s.steps == s.audited:
            s._begin(self.held)
        s.tracker.phase = "forward"
        return self.held

    def __exit__(self, exc_type, exc, tb):
        s = self.session
        if exc_type is None:
            s.steps += 1
            if s.steps == s.audited + 1:  # the audited step ends: the loop stops here
                s._boundary(self.held)
            s.known.new_step()
        return False


def _user_frame(frames):
    """The innermost frame of the user's code (not torch, not an installed package, not this
    package) among traceback frames, or None."""
    for f in reversed(frames):
        name = f.filename or ""
        if name.endswith(".py") and not any(k in name for k in _LIBRARY) and "/torch/" not in name:
            return f
    return None


def user_line(tb=None):
    """'file.py:line: code' of the user's innermost frame, in a traceback or the current stack."""
    f = _user_frame(traceback.extract_tb(tb) if tb is not None else traceback.extract_stack())
    if f is None:
        return None
    code = (f.line or linecache.getline(f.filename, f.lineno) or "").strip()
    return f"{os.path.basename(f.filename)}:{f.lineno}: {code}"


def call_site():
    """(file, line) of the innermost frame of the user's code now, or None."""
    f = _user_frame(traceback.extract_stack())
    return None if f is None else (f.filename, f.lineno)


def user_frames():
    """The user's code's frames running now, outermost first, as (id, code object, line): where a
    later op stands against the optimizer step (`placed`). Holds no frame (a frame holds its locals)."""
    import sys
    out, f = [], sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename or ""
        if name.endswith(".py") and not any(k in name for k in _LIBRARY) and "/torch/" not in name:
            out.append((id(f), f.f_code, f.f_lineno))
        f = f.f_back
    return out[::-1]


def placed(step_frames, frames):
    """Where code running in `frames` (user_frames) stands against the optimizer step that ran in
    `step_frames`, decided in the outermost frame both share whose lines differ: "below" (written
    below the step inside the loop body around it: an evaluation, an EMA update, a log line after
    the step), "outside" (below that loop body, or above it: an epoch's validation after the inner
    loop, the epoch's own lines before it), "head" (the loop come round to its top; a new call
    from the line that made the step, `train_step(batch)` called again) or "same" (the statement
    that made the step: GradScaler.step's own work after the optimizer's, or a library's loop, all
    of whose ops come from one line of the user's)."""
    for (fid, code, line), (sid, scode, sline) in zip(frames, step_frames):
        if (fid, code) != (sid, scode):
            return "head"
        if line != sline:
            first, last = _body(code, sline)
            return "below" if sline < line <= last else "head" if first <= line < sline else "outside"
    return "same"


_BODIES = {}  # (file, first line) of a code object -> [(first, last line)] of the file's loops' bodies


def _body(code, line):
    """(first, last line) of the innermost loop body in `code` holding `line`; the code's lines
    where no loop holds it."""
    key = (code.co_filename, code.co_firstlineno)
    if key not in _BODIES:
        _BODIES[key] = _loop_bodies(code)
    inner = [(a, b) for a, b in _BODIES[key] if a <= line <= b]
    if inner:
        return min(inner, key=lambda ab: ab[1] - ab[0])
    lines = [ln for _, _, ln in code.co_lines() if ln]
    return min(lines, default=line), max(lines, default=line)


def _loop_bodies(code):
    import ast
    try:
        tree = ast.parse(open(code.co_filename).read())
    except (OSError, SyntaxError, ValueError):
        return []
    return [(n.body[0].lineno, n.end_lineno) for n in ast.walk(tree)
            if isinstance(n, (ast.For, ast.AsyncFor, ast.While)) and n.body]


def above(site, step_site):
    """Whether a call at `site` is written above the optimizer step at `step_site`, in the same
    file: a loop that zeroes the gradients first (its zero_grad starts the next step)."""
    return site is not None and step_site is not None and site[0] == step_site[0] and site[1] < step_site[1]


def fake_ident(t):
    from ...naming.tensors import local_tensor
    return address(local_tensor(t).untyped_storage())


def merged(first, then):
    """{name: tensor}: `first`'s, then `then`'s names not taken."""
    return dict(first, **{k: v for k, v in then.items() if k not in first})


class LoopLedger:
    """The audit's saved-tensor ledger over a loop's audited step (naming.saved.saved_tensor_ledger,
    as Audit runs it): open from the step's start, named at each backward (the last one
    counts), open again for the next micro-step's forward."""

    def __init__(self, tracker, model):
        self.tracker, self.model = tracker, model
        self._open()

    def _open(self):
        from ...naming.saved import saved_tensor_ledger
        self.records, self.stack = [], contextlib.ExitStack()
        self.label = self.stack.enter_context(saved_tensor_ledger(self.model, self.records, "cpu", ident=address))

    def name(self, loss, registry, held):
        """At a backward: {allocation id: name} in tracker.saved_names, the loop's `registry`
        ({storage: name}) first, then the saved tensors', then `held`'s (the model's output,
        the loss), as attribute.phase_names orders them."""
        with self.tracker.unseeing():
            self.label(loss)
        self.close()
        self.tracker.saved_names = live_names(self.tracker, list(registry.items()), self.records,
                                                list(held.items()))
        self._open()

    def close(self):
        self.stack.close()


def peak_categories(result):
    """{category: bytes} live at the step's peak (the first level of each allocation's name)."""
    level, best, now = 0, 0, {}  # the start is the peak unless an event goes above it
    for _, key, nbytes in result["pre"]:
        now[key.split("/")[0]] = now.get(key.split("/")[0], 0) + nbytes
    at = dict(now)
    for action, key, nbytes, aid in result["events"]:
        c = key.split("/")[0]
        step = nbytes if action == "alloc" else -nbytes
        now[c] = now.get(c, 0) + step
        level += step
        if level > best:
            best, at = level, dict(now)
    return {c: v for c, v in at.items() if v}


def loop_summary(result):
    """A loop's shadow run as plain numbers an Audit keeps in meta.json (Audit(predicted=...))
    and `report` sets beside the measurement: {"source", "steady_state", "before_backward",
    "peak", "end" (bytes live), "lines" {key: bytes live when step 2 starts}, "phase_lines"
    {phase: {key: bytes}} at step2_start, step2_before_backward and step2_end (named as the
    audit names them: lines()), "peak_categories", "probed", "unprobed" (the ops whose kernels
    were asked, and could not be: shadow/probe)}."""
    start = {}
    for _, key, nbytes in result["pre"]:
        start[key] = start.get(key, 0) + nbytes
    levels = step_levels(result)
    at = {phase: levels[i] for phase, i in result["phases"].items()}
    phase_lines = {"step2_start": start}
    if "saved" in result:
        phase_lines.update((phase, lines(result, phase)) for phase in ("step2_before_backward", "step2_end")
                           if phase in result["phases"])
    return {"source": "shadow(): the user's code on fake tensors", "steady_state": result["start_bytes"],
            "before_backward": at.get("step2_before_backward"), "peak": result["peak"], "end": levels[-1],
            "lines": start, "phase_lines": phase_lines, "peak_categories": peak_categories(result),
            "probed": result.get("probed", []), "unprobed": result.get("unprobed", [])}


def owning_module(params, called):
    """The module holding every one of `params` (ids) with the fewest parameters, among the live
    ones (a model whose forward is not called, whose parts are); `called` where none does."""
    best = None
    for m in _live_modules():
        own = {id(p) for p in m.parameters()}
        if params <= own and (best is None or len(own) < best[0]):
            best = (len(own), m)
    return called if best is None else best[1]


class LoopHead:
    """What a loop lets go at its head, after the last op written below its optimizer step and
    before the first op comes round (last step's batch rebound: `parts = []`): the next step's.
    Watched from the optimizer step of the step before the audited one (its first events, taken_in)
    and of the audited one (out of its end, kept_out), each named as it was named at that step
    (made: by its call; named: as the audit's registry names it)."""

    def __init__(self, tracker, made, named, at_head):
        live = tracker.live
        self.tracker, self.at_head, self.freed = tracker, at_head, []  # freed: (allocation id, event index)
        self.made, self.named = ({live[sid][0]: n for sid, n in names.items() if sid in live} for names in (made, named))
        tracker.on_free = self.on_free

    def on_free(self, at, aid):
        if self.tracker.allocs[aid][1] and self.at_head():
            self.freed.append((aid, at))

    def taken_in(self):
        """[(allocation id, name)] to add to the starting step's `pre`, each then freed as its first
        events (a free the history recorded, a CUDA shadow's, moved there)."""
        out = [(aid, self.named.get(aid, self.made.get(aid))) for aid, _ in self.freed]
        for aid, at in self.freed:
            if at is not None:
                self.tracker.events[at][0] = None
            self.tracker.free(aid)
        return out

    def kept_out(self):
        """The ending step's frees at the loop's head undone, the allocations named as the end names what is live."""
        t = self.tracker
        for aid, at in self.freed:
            t.events[at][0] = None
            if aid in self.named:  # as end_step names what is live
                t.allocs[aid][0] = t.end_names[aid] = self.named[aid]
            if aid in self.made:  # as the session's _made() does
                t.made_names.setdefault(aid, self.made[aid])


def freed_before_start(tracker, phases, pre, free_sites, step_site):
    """The audited step began at the last step's zero_grad (or optimizer step); what the loop
    let go after it and before its next op, on lines written below that optimizer step (`del
    loss, out` after the step's block, where an Audit's step ends), was let go before this
    step, as an Audit counts it: out of the step's start and its events. A free on a line
    above it (the loop's first line rebinding last step's batch) stays in the step; one with
    no line of the code's own, or in another file, counts as below. Returns `pre` without them
    (phases' step2_start moved past them)."""
    start = phases["step2_start"]
    late = tracker.events[start:]
    if any(action != "free" for action, _ in late):
        return pre
    k = 0
    while k < len(late) and not above(free_sites.get(start + k), step_site):
        k += 1
    if not k:
        return pre
    freed = {aid for _, aid in late[:k]}
    phases["step2_start"] = start + k  # those frees go to the step's history
    return [(aid, name) for aid, name in pre if aid not in freed]


def trained_model(optimizer, tops, device):
    """The model a loop trains, found at its first optimizer step from the modules it called at
    top level (`tops`, in order): the one holding the most of the optimizer's parameters (ties:
    the last called); where it holds only some, the module holding them all (the model's parts
    called from a method of its own: flow.log_prob(x)); where it holds them all, the smallest
    module holding every part with parameters the loop called (a teacher and a student, or a
    generator and a critic, in one container), then the outermost holding that and nothing else
    (a part called alone: model.body(x))."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    held = [(sum(id(p) in params for p in m.parameters()), i, m) for i, m in enumerate(tops)]
    count, _, top = max(held, key=lambda h: h[:2]) if held else (0, 0, None)
    if not count:
        moved = (" (on a GPU shadow, an optimizer made before model.to('cuda') holds the host Parameters: "
                 "the move makes new ones; make it after the move)") if device["type"] == "cuda" else ""
        raise ShadowError("the optimizer stepped, but no module holding its parameters ran a forward before it: "
                          "shadow() follows a model's forward, loss, backward and optimizer step" + moved)
    if count < len(params):
        return owning_module(params, top)
    parts = [m for m in tops if next(m.parameters(), None) is not None]
    return outermost_holder(holding_all(parts) or top if len(parts) > 1 else top)


def holding_all(parts):
    """The live module with the fewest submodules that holds every one of `parts`, or None."""
    best = None
    for m in _live_modules():
        subs = {id(c) for c in m.modules()}
        if all(id(p) in subs for p in parts) and (best is None or len(subs) < best[0]):
            best = (len(subs), m)
    return None if best is None else best[1]


def outermost_holder(module):
    """The outermost live module that holds `module` and no parameter besides its own, of a class
    of the code's own (`module` where none is): the model a loop that calls only its part
    (`model.net(x)`, the model's own forward unused) was built as, and which an Audit of it is
    handed. A container of torch's (a ModuleDict keeping models by name) is no such model."""
    own = {id(p) for p in module.parameters()}
    best = (0, module)
    for m in _live_modules():
        if m is not module and not type(m).__module__.startswith("torch."):
            subs = list(m.modules())
            if len(subs) > best[0] and any(c is module for c in subs) and {id(p) for p in m.parameters()} == own:
                best = (len(subs), m)
    return best[1]


def gpu_counted(result, notes):
    """A GPU shadow's step as memory_allocated() and memory_reserved() count it (its replay through
    the allocator's model) and the rules it applied unmeasured on a GPU, with `notes`."""
    from ..ledger.config import expandable_from_env
    from .replay import replay
    if not result["history"] and not result["events"]:
        raise ShadowError("the code put nothing on the GPU (no tensor on 'cuda'): it would train on "
                          "the CPU there too; nothing to predict for the GPU")
    expandable = expandable_from_env(dict(os.environ))  # the code may set it itself
    return {"allocator": replay(result, expandable), "unmeasured": result["unmeasured"] + notes}


def _live_modules():
    """Every live torch.nn.Module (type(): a dead weak proxy raises on isinstance)."""
    import gc
    import torch
    return (m for m in gc.get_objects() if issubclass(type(m), torch.nn.Module))


def scaler_classes(torch):
    """GradScaler and the subclasses that define their own update() (FSDP's ShardedGradScaler)."""
    found, todo = [], [torch.amp.GradScaler]
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: F401 (a subclass)
    except ImportError:
        pass
    while todo:
        cls = todo.pop()
        if "update" in vars(cls):
            found.append(cls)
        todo += cls.__subclasses__()
    return found


def loop_device(device, gpu):
    """ledger/config.device_facts for the device the code is shadow-run for (the torch it will run under
    is taken to be this one's)."""
    import torch
    from ..ledger.config import GPUS, device_facts, gpu_name
    if device == "cpu":
        return device_facts("cpu", torch_version=torch.__version__.split("+")[0])
    if gpu_name(gpu) is None:
        raise ValueError(f"gpu={gpu!r}: not a GPU the shadow knows ({', '.join(GPUS)})")
    return device_facts("cuda", gpu=gpu_name(gpu), torch_version=torch.__version__.split("+")[0], env=dict(os.environ))
