"""The shadow run: train.py's step on fake tensors, every allocation and free in autograd's order.

model.py's GPT, the loss, autograd's backward (checkpointing's recomputation included), the
GradScaler, the gradient clipping and the AdamW step run at the target config on tensors with
shapes, dtypes and storage sizes but no memory (FakeTensorMode for a CPU step, meta tensors for
a CUDA one), under shadow/tracker's dispatch mode, which records each new storage and its free.
The order and the lifetimes are PyTorch's own; nothing here knows which op saves what. What the
dispatcher cannot see is added by rules: shadow/tracker's and shadow/rules/cpu.py's (measured on CPU audits) and, for
a GPU, shadow/cuda's (autocast, kernel choices) and shadow/rules/cuda.py's, one per op, each naming
the CUDA traces it was read from; a CUDA step's whole process is then
played through the caching allocator's model (shadow/replay). Eager: one process, or one rank
of a torchrun strategy on either device (shadow/distributed; on a GPU FSDP2's own streams, shadow/patches.py);
torch.compile is not in it. shadow/script.py shadow-runs a user's own code (and predict_loop a
make/step loop through it) with the same tracker and rules.

run() returns plain data: the step's events [(action, key, bytes, id)] in order (and on CUDA the
history before it), what is live when it starts, the phase positions, the peak; replayed()
counts them as the device would; snapshot() writes a CPU step in the snapshot schema.
"""

import contextlib
import gc

from . import autocast as shadow_autocast, cuda as shadow_cuda, distributed, probe, repeat as shadow_repeat
from ...reading.attribute import CUBLASLT_WORKSPACE_SIZE
from ... import nosympy
from ...nodynamo import stood_in
from .names import held_names, lines, name_grads, naming, snapshot  # noqa: F401 (lines, snapshot: read as shadow.*)
from .patches import cpu_rules, fsdp_on_gpu, meta, no_init, propagation_unseen, storage_resizes
from .blocks import block_tags, module_labels
from .tracker import Tracker, dispatch_mode
from .rules.reduce import MEASURED_CORES, on_cores
from .error import ShadowError  # noqa: F401 (read as shadow.ShadowError)

def _held(state, scaler):
    """What the loop itself holds between steps, by the names an audit gives it."""
    return {"inputs/x": state["X"], "inputs/y": state["Y"], "temporary/loss": state["loss"],
            "optimizer/grad_scaler/scale": getattr(scaler, "_scale", None),
            "optimizer/grad_scaler/growth_tracker": getattr(scaler, "_growth_tracker", None)}


def _model(cfg, device_type, fake=True):
    """model.py's GPT at cfg, as train.py builds it (on fake tensors without initialising the
    weights: in-place writes that change no memory, and on meta tensors each a Python kernel)."""
    import torch
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    where = torch.device("meta") if device_type == "cuda" and fake else contextlib.nullcontext()
    with no_init() if fake else contextlib.nullcontext(), where:
        return GPT(GPTConfig(**{k: v for k, v in cfg.items() if k in GPTConfig.__dataclass_fields__}))


def _loop_parts(model, cfg, device_type):
    """(optimizer, scaler, get_batch, autocast) at cfg, as train.py makes them for `model`."""
    import torch
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["dtype"]]
    # the values do not change memory; train.py's defaults
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), cfg["optimizer_impl"])
    B, T, V = cfg["batch_size"], cfg["block_size"], cfg["vocab_size"]

    def get_batch():
        if device_type == "cuda":  # made on the CPU, copied to the GPU: only the copies count
            return shadow_cuda.batch(B, T)
        buf = torch.randint(V, (B, T + 1))
        return (buf[:, :-1].clone(memory_format=torch.contiguous_format),
                buf[:, 1:].clone(memory_format=torch.contiguous_format))
    if dtype == torch.float32:
        autocast = contextlib.nullcontext()
    elif device_type == "cuda":  # torch.autocast("cuda") is off without a GPU: its policy, applied here
        autocast = shadow_autocast.Autocast(dtype=dtype)
    else:
        autocast = torch.autocast(device_type, dtype=dtype)
    # CPU or meta tensors whatever device they stand for: the CPU scaler drives them as train.py's
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    # A fake found_inf cannot be read (.item()): the shadow takes the step, as a finite step does.
    scaler._maybe_opt_step = lambda opt, state, *a, **k: opt.step(*a, **k)
    return optimizer, scaler, get_batch, autocast


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused inside the block: for the work on a step's
    events (repeating blocks, the allocator's replay), which makes 10^5 to 10^6 tuples that
    each full collection walks with all of torch's objects (a fifth of plan's time). Never
    around a shadow run itself: some storages are freed when the collector breaks a reference
    cycle (with SAC on CPU, 347,396 B of step 1 still live at step 2's start without it; seed
    970840 of test_shadow's random configs), as in the audited process."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run(cfg, device_type="cpu", fake=True, sdpa_backend="cudnn", workspace_bytes=0, cache=True, blocks=False,
        names=False, cores=MEASURED_CORES):
    """Shadow-run two steps of train.py's loop at `cfg` (train.py's keys, resolved) on fake
    tensors and return the second (see step_result). fake=False runs the same on real tensors (a
    check of the tracker itself). cache=False runs every meta kernel of a CUDA step and every
    view op through the tracker's whole path (the check of shadow/metacache and of that
    shortcut; otherwise the process's one cache, shadow/metacache.SHARED, answers). blocks=True
    tags each allocation and event with its block and micro-step (result["blocks"],
    result["micro"], for shadow/repeat). names=True also names what the audited forward made as
    an audit does (result["saved"], read by lines(); it costs a graph walk, which fit and plan do
    without). cores: the GPU's (SMs, threads per SM) its reductions are sized for (None: not
    known; shadow/rules/reduce.py). Raises ShadowError (one line) if the step cannot run."""
    tracker = Tracker()
    tracker.naming = names
    tracker.workspace_bytes = workspace_bytes if device_type == "cuda" else 0
    tracker.lt_workspace_bytes = CUBLASLT_WORKSPACE_SIZE if tracker.workspace_bytes else 0
    tracker.tagging = blocks
    if device_type == "cuda" and fake and cache:
        from .metacache import SHARED
        tracker.meta_cache = SHARED
    with on_cores(cores):
        return stopped_as_one_line(tracker, _run, cfg, device_type, fake, tracker, sdpa_backend)


def stopped_as_one_line(tracker, fn, *args):
    """fn(*args), an exception other than ValueError becoming one ShadowError line that names
    the op where the step stopped: no number is better than a wrong one. torch._dynamo is stood
    in for while it runs, where it is not imported yet, and so is symbolic_shapes, which imports
    sympy (nodynamo.py, nosympy.py: 1 s and 0.7 s less, the same step)."""
    try:
        with stood_in(), nosympy.stood_in():
            return fn(*args)
    except ValueError:
        raise
    except Exception as e:  # an op fake tensors cannot run
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise ShadowError(f"the shadow run stopped at {tracker.op}: {type(e).__name__}: {reason}") from None


@contextlib.contextmanager
def _cuda_kernels(sdpa_backend, tracker):
    """CUDA's kernel choices (shadow/cuda.device_kernels: a kernel no trace measured is noted in
    tracker.unmeasured), checkpointing's recomputation under them and the forward's autocast
    region (shadow/autocast.recomputed)."""
    with shadow_cuda.device_kernels(sdpa_backend, tracker.unmeasured.add) as mode, shadow_autocast.recomputed((mode,)):
        yield


def _run(cfg, device_type, fake, tracker, sdpa_backend):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from train_step import run_step  # beside model.py: the step train.py runs
    cuda = _cuda_kernels(sdpa_backend, tracker) if device_type == "cuda" else contextlib.nullcontext()
    if not fake:
        base = contextlib.nullcontext()
    else:  # meta tensors for a CUDA step: C++ kernels, several times faster than FakeTensorMode
        base = meta() if device_type == "cuda" else FakeTensorMode()
    # the rules outside the dispatcher: on CPU RNG states and the SDPA region (a CUDA run's RNG states are
    # host memory), on either device storage resizes (FSDP2's unsharded parameters)
    rules = cpu_rules(tracker) if device_type == "cpu" else storage_resizes(tracker)
    gpu = fsdp_on_gpu(cfg, tracker) if device_type == "cuda" else contextlib.nullcontext()
    with distributed.rank_of(cfg), base, dispatch_mode(tracker, device_type), rules, cuda, gpu, \
            propagation_unseen(tracker, cfg):
        model = _model(cfg, device_type, fake)
        if device_type == "cuda":  # the whole history, for the allocator's model: from model.to(device) on
            tracker.recording = True
            shadow_cuda.to_device(model, tracker)
        distributed.parallelize(model, cfg)  # torchrun's strategies: this rank's shards
        optimizer, scaler, get_batch, autocast = _loop_parts(model, cfg, device_type)
        train_model = distributed.wrap(model, cfg, tracker)  # DDP around it, as train.py does
        handles = module_labels(model, tracker)
        if tracker.tagging:  # each event's block, for shadow/repeat
            handles += block_tags(model, tracker)
        tracker.phase = "inputs"
        state = {"loss": None}
        state["X"], state["Y"] = get_batch()
        phases = {}
        watch = _Watch(tracker, cfg, device_type, (model, optimizer, scaler), state, phases)
        for it in range(2):  # train.py's optimizer step itself (train_step.py), twice
            if it == 1:
                pre = begin_step(tracker, held_names(model, optimizer, _held(state, scaler)), phases)
            watch.audited_step = it == 1
            run_step(state, cfg, model, train_model, optimizer, scaler, get_batch, autocast, watch)
        end_step(tracker, held_names(model, optimizer, _held(state, scaler)))
        for h in handles:
            h.remove()
    return step_result(tracker, pre, phases)


class _Watch:
    """The shadow's view of train.py's step (a train_step.Watch): which phase and micro-step each
    allocation belongs to, the before-backward cut of the audited step, and the audit's names
    for what its forward saves (names=True) and for the gradients."""

    def __init__(self, tracker, cfg, device_type, loop, state, phases):
        self.tracker, self.cfg, self.device_type, self.loop, self.state, self.phases = \
            tracker, cfg, device_type, loop, state, phases
        self.audited_step, self.audited, self.name = False, False, None

    @contextlib.contextmanager
    def forward(self, micro):
        t = self.tracker
        t.micro, t.phase = micro, "forward"
        self.audited = self.audited_step and micro == self.cfg["gradient_accumulation_steps"] - 1
        if not (self.audited_step and t.naming):  # the audit's ledger is on over every forward of its step
            yield
            return
        with naming(t, self.loop[0], self.device_type) as name:
            self.name = name if self.audited else None  # the last micro-step's forward is the one named
            yield
        self.name = None

    def forward_done(self, micro):
        pass

    def before_backward(self, micro, loss, logits):
        if self.audited:
            self.tracker.before_op()
            self.phases["step2_before_backward"] = len(self.tracker.events)
        if self.name is not None:
            self.name(loss, {"lm_head": logits} if self.cfg["keep_logits"] else None,
                      self.loop + ({"inputs/x": self.state["X"], "inputs/y": self.state["Y"], "temporary/loss": loss},))

    @contextlib.contextmanager
    def batch(self):
        self.tracker.phase = "inputs"
        yield

    @contextlib.contextmanager
    def backward(self, micro, model):
        self.tracker.phase, self.tracker.node_start = "backward", {}  # (autograd's sequence numbers are per thread)
        yield
        if self.tracker.naming:  # a written trace names the gradients as an audit does
            name_grads(self.tracker, model)

    @contextlib.contextmanager
    def optimizer(self):
        self.tracker.phase, self.tracker.micro = "optimizer", None
        yield


def begin_step(tracker, names, phases):
    """The audited step starts: what is live then, [(allocation id, its name or None)], and the
    recording on from here."""
    tracker.before_op()
    pre = [(aid, names.get(sid)) for sid, (aid, _) in tracker.live.items()]
    tracker.recording = True
    phases["step2_start"] = len(tracker.events)
    return pre


def end_step(tracker, names):
    """The audited step ends: recording off; what the step made and the loop keeps (grads, the
    new batch, the loss) takes the name the loop gives it."""
    tracker.before_op()
    tracker.recording = False
    for sid, name in names.items():
        if sid in tracker.live:
            tracker.allocs[tracker.live[sid][0]][0] = tracker.end_names[tracker.live[sid][0]] = name


def step_result(tracker, pre, phases):
    """{"events": [(action, key, bytes, id)] of the step in order, "history": the same before it
    (a CUDA shadow records from model.to(device) on; empty on CPU), "pre": [(id, key, bytes)]
    live when it starts, "start_bytes", "phases": {phase: position in events}, "peak", "probed"
    and "unprobed": the ops whose kernels a probe asked, and those it could not (shadow/probe),
    "unmeasured": the CUDA rules applied outside the shapes a trace measured (shadow/rules/cuda.py's SAMPLES)}."""
    events, cut, blocks, micros = [], {}, [], []
    for i, (action, aid) in enumerate(tracker.events):
        for phase, at in phases.items():
            if at == i:
                cut[phase] = len(events)
        if action is not None:
            key, nbytes = tracker.allocs[aid]
            events.append((action, key, nbytes, aid))
            if tracker.tagging:  # a free in a block's (micro-step's) op is that one's; else the allocation's
                blocks.append(tracker.event_tags[i] if action == "free" and tracker.event_tags[i] is not None
                              else tracker.block_of(aid))
                micros.append(tracker.event_micro[i] if action == "free" and tracker.event_micro[i] is not None
                              else tracker.micro_tags.get(aid))
    cut["step2_end"] = len(events)
    for phase in phases:
        cut.setdefault(phase, len(events))
    begin = cut.pop("step2_start")
    history, events = events[:begin], events[begin:]
    cut = {phase: at - begin for phase, at in cut.items()}
    cut["step2_start"] = 0
    names = {aid: name for aid, name in pre}
    pre = [(aid, names.get(aid) or tracker.allocs[aid][0], tracker.allocs[aid][1]) for aid, _ in pre]
    start_bytes = sum(n for _, _, n in pre)
    level = peak = 0
    for action, _, nbytes, _ in events:
        level += nbytes if action == "alloc" else -nbytes
        peak = max(peak, level)
    out = {"events": events, "history": history, "pre": pre, "start_bytes": start_bytes, "phases": cut,
           "peak": start_bytes + peak, "probed": sorted(tracker.probed), "unprobed": sorted(tracker.unprobed),
           "unmeasured": sorted(tracker.unmeasured)}
    if tracker.streams:  # the allocations made on a stream of their own (FSDP2's collectives on a GPU)
        out["streams"] = dict(tracker.streams)
    if tracker.naming:
        out["saved"] = dict(tracker.saved_names)
        out["made"], out["end"] = dict(tracker.made_names), dict(tracker.end_names)
    if tracker.tagging:  # each allocation's block and each event's (history, then step)
        out["blocks"] = {"allocs": {aid: tracker.block_of(aid) for aid in tracker.allocs}, "events": blocks}
        out["micro"] = {"allocs": dict(tracker.micro_tags), "events": micros}
    return out


_LAST = {}  # the last CUDA steps shadow-run by replayed, {key: result}: the same config replayed
_KEEP = 4  # again on another allocator setting (plan's expandable_segments option) runs once


def replayed(cfg, device, repeat=True, names=False):
    """The shadow run of `cfg` on `device` (predict.device_facts' dict) counted as the device
    counts it: {"steady_state", "before_backward", "peak", "peak_event", "end", "reserved"} of step 2, plus
    "result" (run()'s). On CUDA every request goes through the caching allocator's model from
    model.to(device) on (shadow/replay.replay); a CPU step is its own bytes (reserved: None).
    repeat: a deep CUDA step from the shadow runs of 3 and 4 blocks (shadow/repeat) where the
    rule holds; repeat=False runs every block. names: run(..., names=True) (a CUDA step is then
    run whole: a repeated one has no names)."""
    if device["type"] != "cuda":
        with probe.on_cpu(device.get("cpu"), cfg["dtype"]):
            result = run(cfg, names=names)
        levels = step_levels(result)
        at = {phase: levels[i] for phase, i in result["phases"].items()}
        return {"steady_state": result["start_bytes"], "before_backward": at.get("step2_before_backward"),
                "peak": result["peak"], "peak_event": levels.index(result["peak"]) - 1, "end": at["step2_end"],
                "reserved": None, "result": result}
    kw = dict(sdpa_backend=device["sdpa_backend"], workspace_bytes=device["workspace_bytes"],
              cores=device.get("cores", MEASURED_CORES))
    key = repr((sorted(cfg.items()), sorted(kw.items()), repeat, names))
    result = _LAST.get(key)
    if result is None:
        worth = shadow_repeat.repeatable(cfg) or shadow_repeat.micro_repeatable(cfg)
        result = repeated(cfg, **kw) if repeat and worth and not names else None
        if result is None:
            result = run(cfg, "cuda", names=names, **kw)
        while len(_LAST) >= _KEEP:  # the oldest goes
            _LAST.pop(next(iter(_LAST)))
        _LAST[key] = result
    from .replay import replay
    with collector_paused():
        return dict(replay(result, device.get("expandable_segments", False)), result=result)


def step_levels(result):
    """[bytes live before each event of step 2, then after the last] of a run() result counted
    as its own bytes (a CPU step: no allocator between)."""
    levels = [result["start_bytes"]]
    for action, _, nbytes, _ in result["events"]:
        levels.append(levels[-1] + (nbytes if action == "alloc" else -nbytes))
    return levels


def repeated(cfg, sdpa_backend="cudnn", workspace_bytes=0, cores=MEASURED_CORES):
    """run(cfg, "cuda") built by shadow/repeat from shadow runs of 3 and 4 blocks (and, with
    many micro-steps, of 3 and 4 micro-steps at each depth), or None where the repeat rule does
    not hold for this config (then run it whole)."""
    kw = dict(sdpa_backend=sdpa_backend, workspace_bytes=workspace_bytes, blocks=True, cores=cores)
    k, micro = cfg["gradient_accumulation_steps"], shadow_repeat.micro_repeatable(cfg)

    def at_depth(n):
        c = dict(cfg, n_layer=n)
        if not micro:
            return run(c, "cuda", **kw)
        m3, m4 = (run(dict(c, gradient_accumulation_steps=m), "cuda", **kw) for m in shadow_repeat.SOURCE)
        with collector_paused():
            return shadow_repeat.expand(m3, m4, k, "micro")
    if not shadow_repeat.repeatable(cfg):
        return at_depth(cfg["n_layer"]) if micro else None
    d3, d4 = (at_depth(n) for n in shadow_repeat.SOURCE)
    with collector_paused():
        return None if d3 is None or d4 is None else shadow_repeat.expand(d3, d4, cfg["n_layer"], carry=False)
