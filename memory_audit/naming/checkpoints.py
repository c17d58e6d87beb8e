"""Checkpointed regions as the saved-tensor ledger sees them: which autograd nodes a checkpoint
made (their saved tensors are placeholders the graph walk must not read), what selective
checkpointing kept, and the label that marks a recomputation in the trace."""

import os
import sys
from contextlib import contextmanager

import torch

from ..schema import MARKER_PREFIX, RECOMPUTE_LABEL
from .tensors import tensors_in


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
