"""The shadow run of any model's training loop (issue #28; CPU): the loop's own step on fake
tensors, every allocation named as an Audit of the same loop names it.

`run_loop(make, step)` (memory_audit.predict_loop) runs the loop's steps under the shadow's
tracker (shadow_tracker, with its CPU rules and oneDNN kernel probes) as shadow.run runs
train.py's, and names what it records with the audit's own code: the loop's names from
recording.loop_names (the model's arguments and output, the loss and its targets), the saved
tensors from recording.recorder.saved_tensor_ledger opened over the audited step and read at each
backward, as `Audit.before_backward` reads it. `loop_summary` is what an Audit keeps
(`Audit(predicted=...)`) and `report` sets beside the measurement.
"""

import contextlib

from .shadow import begin_step, end_step, one_line, step_levels, step_result
from .shadow_names import address, held_names, lines, live_names, name_grads
from .patches import cpu_rules
from .shadow_tracker import Tracker, dispatch_mode, module_labels


def run_loop(make, step, inputs=None, audited=1):
    """The shadow run of any loop (issue #28; CPU): `make()` builds (model, optimizer, *batch)
    and is called on fake CPU tensors; `step(model, optimizer, *batch)` is one training step
    (forward, loss, backward, optimizer step, zero_grad) and returns what the loop keeps until
    the next step (its loss, its output: {name: tensor}, or the loss). Steps 0..audited run; step
    `audited` is recorded, as Audit(step=...) records it, its before-backward moment at its last
    `.backward()`. Every allocation is named as an Audit of the same loop names it when the loop
    calls `audit.before_backward(loss)` before each backward (the loop's own names found by
    recording.loop_names, the same code: the model's arguments, its output, the loss and its
    targets; the saved tensors by the audit's ledger); `inputs`: names for the batch, as the
    loop would give them with `audit.step(i, tensors=...)`; what `step` returns is named by its
    keys where nothing else names it. Returns run()'s dict, lines() reads any phase; raises
    ShadowError (one line, naming the op) for a step fake tensors cannot run. oneDNN's kernels
    (LSTM layers, convolution, batch norm, bf16 matmuls on CPUs with native bf16) are asked for
    their own buffers at the step's shapes (shadow_probe: one real kernel per call signature);
    result["unprobed"] names those a probe could not ask (inside another profile)."""
    tracker = Tracker()
    tracker.naming = True
    return one_line(tracker, _run_loop, make, step, inputs, audited, tracker)


def _run_loop(make, step, inputs, audited, tracker):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ..recording.loop_names import LoopNames
    phases, original, made = {}, torch.Tensor.backward, {}
    found = LoopNames(ident=fake_ident)

    def backward(self, *args, **kwargs):  # the last one in the audited step: before backward
        if tracker.recording:
            tracker.before_op()
            phases["step2_before_backward"] = len(tracker.events)
        with tracker.unseeing():  # the loss's targets: reading what its nodes saved is no op of the step
            found.note_loss(self)
        if tracker.recording:  # the registry, then the saved tensors, then what the loop holds
            made["ledger"].name(self, named({}), named(found.held()))
        tracker.phase = "backward"
        try:
            return original(self, *args, **kwargs)
        finally:
            tracker.phase = "optimizer"
            name_grads(tracker, made["model"])

    def named(last):
        return held_names(made["model"], made["optimizer"], merged(found.tensors(given), last))
    with FakeTensorMode(), dispatch_mode(tracker, "cpu"), cpu_rules(tracker):
        model, optimizer, *batch = make()
        made.update(model=model, optimizer=optimizer)
        handles = module_labels(model, tracker, root=type(model).__name__.lower())
        given, kept = dict(zip(inputs or (), batch)), {}
        found.watch(model)
        torch.Tensor.backward = backward
        try:
            for it in range(audited + 1):
                if it == audited:
                    pre = begin_step(tracker, named(merged(found.held(), kept)), phases)
                    made["ledger"] = LoopLedger(tracker, model)
                tracker.phase = "forward"
                kept = step(model, optimizer, *batch)
                kept = {"temporary/loop/loss": kept} if isinstance(kept, torch.Tensor) else dict(kept or {})
        finally:
            torch.Tensor.backward = original
            found.remove()
            if "ledger" in made:
                made["ledger"].close()
            for h in handles:
                h.remove()
        end_step(tracker, named(merged(found.held(), kept)))
    result = step_result(tracker, pre, phases)
    result["summary"] = loop_summary(result)
    return result


def fake_ident(t):
    from ..recording.recorder import local_tensor
    return address(local_tensor(t).untyped_storage())


def merged(first, then):
    """{name: tensor}: `first`'s, then `then`'s names not taken."""
    return dict(first, **{k: v for k, v in then.items() if k not in first})


class LoopLedger:
    """The audit's saved-tensor ledger over a loop's audited step (recorder.saved_tensor_ledger,
    as Audit runs it): open from the step's start, named at each backward (the last one
    counts), open again for the next micro-step's forward."""

    def __init__(self, tracker, model):
        self.tracker, self.model = tracker, model
        self._open()

    def _open(self):
        from ..recording.recorder import saved_tensor_ledger
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
    were asked, and could not be: shadow_probe)}."""
    start = {}
    for _, key, nbytes in result["pre"]:
        start[key] = start.get(key, 0) + nbytes
    levels = step_levels(result)
    at = {phase: levels[i] for phase, i in result["phases"].items()}
    phase_lines = {"step2_start": start}
    if "saved" in result:
        phase_lines.update((phase, lines(result, phase)) for phase in ("step2_before_backward", "step2_end")
                           if phase in result["phases"])
    return {"source": "predict_loop: the loop's shadow run on fake tensors", "steady_state": result["start_bytes"],
            "before_backward": at.get("step2_before_backward"), "peak": result["peak"], "end": levels[-1],
            "lines": start, "phase_lines": phase_lines, "peak_categories": peak_categories(result),
            "probed": result.get("probed", []), "unprobed": result.get("unprobed", [])}
