"""Predict a compiled (torch.compile) training step, line by line.

The eager predictor's rules (ledger/parts.py) describe what autograd saves op by op; a compiled step
saves what AOTAutograd's partitioner chose and runs the buffers inductor planned. Both are
decided before anything runs, so the prediction asks inductor itself: naming/compiled.inductor_plans
traces the model, partitions it at the run's activation memory budget and generates the
wrappers' code, stopping before any kernel is compiled (seconds, no step, no GPU memory). Then:

  steady state   the eager predictor's lines (weights, grads, Adam state, batch, workspaces)
  activations    one line per storage the forward hands to backward, keyed
                 activations/<module>/<FX node> as the audit names them, its bytes the
                 storage inductor allocated for it (inductor_plan.replay of the forward); the
                 loop's own tensors as in eager (CPU's wrapped divisor, held logits)
  peak           the largest of the forward's busiest line, the backward's (the backward
                 wrapper replayed from the before-backward ledger, with the tangents autograd
                 hands it: the logits' gradient is materialized as zeros even though the loss
                 does not use it; its buffers, and the saved storages it frees) and, on CPU, the
                 eager stretch after backward (clipping, the optimizer's step: after_backward_lines)
On CPU the kernels a wrapper calls are asked for their own buffers as the eager shadow asks
them (shadow/cpu.plan_kernel: oneDNN's bf16 matmul scratch, CPU flash attention's buffers); on
CUDA the CUDA rules answer them (shadow/cuda.plan_kernel: cuDNN and efficient attention's
buffers), an addmm with a 1-D bias makes cuBLASLt's workspace on its thread (the forward's, and
autograd's where the backward recomputes a biased Linear), and the tangents stay held through the
backward's call (measured in 22 random H200 compiled steps: snapshots/results/compile/).

Needs torch and model.py (it builds the model); the eager predictor stays torch-free.
"""

import contextlib

from ..reading.inductor_plan import asserted, replay, strided_bytes
from .ledger.levers import forward_flops
from .ledger.parts import act, grad_phases, line, round_block, shape_facts
from .ledger.config import DEFAULTS, device_facts, validate
from .ledger.steady import param_shapes, plain, steady_lines, totals as totals_of
from ..naming.tensors import short_module

# what a compiled CUDA step's reserved memory leaves out, with the committed runs that measured it
# (tests/test_compiled.py recomputes the range from their rows)
RESERVED_UNPREDICTED = ("memory_reserved() of a compiled step: inductor's benchmarking while it compiles in step 1 "
                        "(cache-flush buffers the size of the GPU's L2, pad_mm's trial matmuls) leaves segments "
                        "this prediction does not play; 22 tiny H200 compiled runs reserved 73,400,320 to "
                        "123,731,968 B more than predicted (snapshots/results/compile/)")
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout", "attention", "activation")
COMPILED_DEFAULTS = dict(DEFAULTS, activation_memory_budget=1.0)


def delta(s, key, nbytes, formula, note=""):
    """A change at the peak's moment from the before-backward ledger (phase "peak")."""
    return line(s, key, nbytes, "", [], formula, ("peak",), note)


def backward_begun(s, cfg):
    """What every moment after backward() is called holds: the prefetched batch, fp16's scaled
    loss and the grad seed backward() keeps until it returns."""
    out = [delta(s, f"inputs/next_{v}", 8 * s["B"] * s["T"], "8*B*T", f"prefetched {v.upper()}") for v in ("x", "y")]
    if cfg["dtype"] == "float16":
        out.append(delta(s, "temporary/scaled_loss", 4, "4", "scaler.scale(loss)"))
    out.append(delta(s, "temporary/grad_seed", 4, "4", "ones_like(loss) for backward"))
    return out


_PLANS = {}  # the plans made in this process, by config: inductor's answer does not change


def plan_for(cfg, device="cpu"):
    """inductor_plans for train.py's GPT at this config (seeded weights, a zero batch: memory
    does not depend on values), under the autocast the loop uses."""
    key = (device,) + tuple(cfg[k] for k in MODEL_KEYS + ("batch_size", "dtype", "activation_memory_budget"))
    if key not in _PLANS:
        _PLANS[key] = _make_plan(cfg, device)
    return _PLANS[key]


def _make_plan(cfg, device):
    import torch

    from model import GPT, GPTConfig

    from ..naming.compiled import inductor_plans
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})).to(device)
    x = torch.zeros((cfg["batch_size"], cfg["block_size"]), dtype=torch.long, device=device)
    y = torch.zeros_like(x)
    ctx = None
    if cfg["dtype"] != "float32":
        ctx = torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, cfg["dtype"]))
    return inductor_plans(model, (x, y), cfg["activation_memory_budget"], model.audit_prefix, ctx)


def _primals(plan):
    """{wrapper input name: (storage id, bytes)} of the forward's inputs (weights, the batch)."""
    return {f"primals_{i + 1}": (f"primal:{i + 1}", p["nbytes"]) for i, p in enumerate(plan["inputs"])}


def _counted(s):
    """What the device counts for a buffer: its busiest line is the busiest in these bytes."""
    return lambda nbytes: round_block(nbytes, s["dt"]) if nbytes else 0


def _forward(plan, kernel=None, count=None):
    """Replay the forward: every input is the caller's (weights, the batch)."""
    inputs = _primals(plan)
    fw = replay(plan["forward"], inputs, held=frozenset(sid for sid, _ in inputs.values()), tag="forward",
                layouts=plan.get("forward_layouts"), kernel=kernel, count=count)
    n_user = len(fw["outputs"]) - len(plan["saved"])
    if n_user < 1:
        raise ValueError("the forward returns fewer values than the partition saved")
    return fw, fw["outputs"][:n_user], fw["outputs"][n_user:]


def compiled_activation_lines(s, cfg, plan, short=short_module, kernel=None):
    """(activation lines, {storage id: key} of what the forward saved, the forward's replay).
    kernel: what the extern kernels the wrappers call allocate inside themselves (replay's)."""
    fw, user, saved = _forward(plan, kernel, _counted(s))
    lines, keys = [], {}
    for v, (sid, nbytes) in zip(plan["saved"], saved):
        if sid is None or sid.startswith("primal:") or sid in keys:
            continue  # a weight or the batch (named as themselves), or a storage named already
        keys[sid] = f"activations/{short(v['module'])}/{v['node']}"
        lines.append(act(s, keys[sid][len("activations/"):], nbytes, v["dtype"], v["shape"],
                         f"inductor buffer, {v['target']}"))
    if s["dt"] == "cpu":  # the loop's division keeps its wrapped divisor (eager, outside the graph)
        lines.append(act(s, "gpt/div.other", 8, "int64", [], "8", "gradient_accumulation_steps, a CPU tensor"))
    logits_sid, logits_bytes = user[0]
    if cfg["keep_logits"] and logits_sid not in keys:
        lines.append(act(s, "lm_head/output", logits_bytes, s["lowp"], [s["B"], s["T"], s["V"]], "compiled output",
                         "logits held by the training loop"))
    return lines, keys, (fw, user)


def _tangent_bytes(plan, name, output_sid, output_bytes):
    """Bytes of the gradient autograd hands the backward for one of the forward's outputs: a new
    tensor at the layout the backward asserts for it (contiguous: 4,800 B for fp16 (3, 16, 50)
    logits whose forward buffer is padded to rows of 56, 5,376 B; an H200 trace), in the output's
    dtype; the output's own bytes where the wrapper or the forward's layouts do not say."""
    layout = asserted(plan["backward"], name)
    buffer = (output_sid or "").split(":")[-1].split("@")[0]
    dtype = ((plan.get("forward_layouts") or {}).get(buffer) or [None, None, None])[2]
    if layout is None or dtype is None:
        return output_bytes
    return strided_bytes(layout[0], layout[1], dtype)


def compiled_peak_lines(s, cfg, plan, keys, fw_user, kernel=None):
    """(the backward's busiest line as changes from the before-backward ledger, the backward's
    replay)."""
    fw, user = fw_user
    inputs = _primals(plan)
    # the model keeps its weights; the batch only the graph
    held = {f"primal:{i + 1}" for i, p in enumerate(plan["inputs"]) if p["param"]}
    for v, (sid, nbytes) in zip(plan["saved"], fw["outputs"][len(user):]):
        inputs.setdefault(v["node"], (sid, nbytes))
    if cfg["keep_logits"]:
        held.add(user[0][0])
    for j, (sid, nbytes) in enumerate(user):
        inputs[f"tangents_{j + 1}"] = (f"tangent:{j + 1}", _tangent_bytes(plan, f"tangents_{j + 1}", sid, nbytes))
        if s["dt"] != "cpu":  # held through the backward's call on CUDA (the 22 H200 compiled traces);
            held.add(f"tangent:{j + 1}")  # a CPU backward's wrapper frees them (the committed CPU rows)
    # the saved values' dtypes (an input's assert line gives its size and stride)
    layouts = dict({v["node"]: [v["shape"], [], v["dtype"]] for v in plan["saved"]}, **(plan.get("backward_layouts") or {}))
    bw = replay(plan["backward"], inputs, frozenset(held), tag="backward", layouts=layouts, kernel=kernel,
                count=_counted(s))
    batch = [f"primal:{i + 1}" for i, p in enumerate(plan["inputs"]) if not p["param"]]
    names = dict(keys, **dict(zip(batch, ("inputs/x", "inputs/y"))))
    tangents = [t for t in bw["inputs"] if t.startswith("tangents_") and inputs[t][0] not in bw["freed_at_peak"]]
    lines = backward_begun(s, cfg)
    if s["dt"] == "cpu":  # the loop's division ran its backward first and let its divisor go
        lines.append(delta(s, "released/activations/gpt/div.other", -8, "-8", "DivBackward has run"))
    lines += [delta(s, f"temporary/compiled_backward/{t}", inputs[t][1], "output size",
                     "the output's gradient handed to the backward") for t in tangents]
    grads = {}  # buffers the backward returns as a parameter's gradient: grads/<name> where fresh
    if "step2_before_backward" not in grad_phases(cfg):
        grads = {b: f"grads/{plan['inputs'][j]['name']}" for j, b in enumerate(bw["output_buffers"])
                 if b and j < len(plan["inputs"]) and plan["inputs"][j].get("name")}
    lines += [delta(s, grads.get(b, f"temporary/compiled_backward/{b}"), n, "inductor buffer")
              for b, n in bw["peak_live"].items()]
    size = {sid: n for sid, n in inputs.values()}
    lines += [delta(s, f"released/{names.get(sid, sid)}", -size[sid], "freed by the backward")
              for sid in bw["freed_at_peak"] if not sid.startswith("tangent:")]
    return lines, bw


def forward_peak_lines(s, fw, acts):
    """The forward's busiest line as changes from the before-backward ledger: its buffers live
    then instead of what the forward ends with (the saved storages and the loop's tensors)."""
    lines = [delta(s, f"released/{l['key']}", -l["bytes"], "not made yet") for l in acts]
    return lines + [delta(s, f"temporary/compiled_forward/{b}", n, "inductor buffer") for b, n in fw["peak_live"].items()]


def after_backward_lines(s, cfg, ledger):
    """The busiest moment of what runs eagerly after the compiled backward (gradient clipping,
    the optimizer's step, zero_grad: the foreach AdamW's temporaries), as changes from the
    before-backward ledger: the eager shadow run of the same config (CPU) gives that stretch of
    the step event by event, and what the compiled step holds there differs from the eager one's
    by what both hold at the step's end (the ledger's step2_end lines). [] where the shadow shows
    no such stretch; a reason (str) where the eager step cannot be shadow-run."""
    from .shadow import step as shadow
    from .ledger.config import resolved
    try:
        r = shadow.run(resolved({k: v for k, v in cfg.items() if k not in ("compile", "activation_memory_budget")}),
                       names=True)
    except shadow.ShadowError as e:
        return f"the eager step after backward not shadow-run: {e}"
    events = r["events"]
    start = next((i for i, (a, k, _, _) in enumerate(events) if a == "alloc" and k.startswith("temporary/optimizer/")), None)
    if start is None:
        return []
    levels = shadow.step_levels(r)
    at_top, at_end = _live_at(r, max(range(start + 1, len(levels)), key=lambda i: levels[i]))
    out = {}  # held at the busiest moment and not at the end, and the other way round
    for aid in set(at_top) ^ set(at_end):
        key, n = at_top[aid] if aid in at_top else (f"released/{at_end[aid][0]}", -at_end[aid][1])
        out[key] = out.get(key, 0) + n
    before = {}
    end = {}
    for l in ledger:
        for phase, into in (("step2_before_backward", before), ("step2_end", end)):
            if phase in l["phases"]:
                into[l["key"]] = into.get(l["key"], 0) + l["bytes"]
    lines = [delta(s, k, end.get(k, 0) - before.get(k, 0), "held at the step's end less before backward")
             for k in sorted(set(before) | set(end)) if end.get(k, 0) != before.get(k, 0)]
    return lines + [delta(s, k, n, "the eager shadow run after backward") for k, n in sorted(out.items()) if n]


def _live_at(result, moment):
    """({allocation id: (key, bytes)} live after event moment - 1 of a shadow run's step, the same at
    its end)."""
    live = {aid: (key, n) for aid, key, n in result["pre"]}
    at = None
    for i, (action, key, n, aid) in enumerate(result["events"]):
        if i == moment:
            at = dict(live)
        if action == "alloc":
            live[aid] = (key, n)
        else:
            live.pop(aid, None)
    return (live if at is None else at), live


def peak_candidates(s, cfg, plan, acts, keys, fw_user, kernel=None, ledger=None):
    """(the peak's lines, a summary): the largest of the backward's, the forward's and (on CPU,
    given the ledger's steady and activation lines) the eager stretch after backward's busiest
    lines."""
    back, bw = compiled_peak_lines(s, cfg, plan, keys, fw_user, kernel)
    candidates = [("compiled backward", back), ("compiled forward", forward_peak_lines(s, fw_user[0], acts))]
    notes = [f"{op} at backward line {i}: {why}" for i, op, why in bw["unasked"]]
    if ledger is not None:
        after = after_backward_lines(s, cfg, ledger)
        if isinstance(after, str):
            notes.append(after)
        else:
            candidates.append(("after backward (eager)", after))

    def total(lines):
        return sum(l["allocated"] for l in lines)
    best = max(candidates, key=lambda c: total(c[1]))
    return best[1], {"peak_at": best[0], "backward_peak_line": bw["peak_line"], "notes": notes,
                     "candidates": [{"at": name, "delta_bytes": total(lines)} for name, lines in candidates]}


def _on_cpu(dev, cfg):
    if dev["type"] != "cpu":
        return contextlib.nullcontext()
    from .shadow import probe as shadow_probe
    return shadow_probe.on_cpu(dev.get("cpu"), cfg["dtype"])


def predict_compiled(config=None, device=None, plan=None):
    """predict() for a compiled run: the same dict (config, device, ledger, totals, backward)."""
    cfg = dict(COMPILED_DEFAULTS)
    cfg.update({k: v for k, v in (config or {}).items() if k in COMPILED_DEFAULTS})
    validate(cfg)
    if cfg["activation_checkpointing"] != "none":
        raise ValueError("compiled runs with activation checkpointing are not predicted yet")
    if not 0.0 <= float(cfg["activation_memory_budget"]) <= 1.0:
        raise ValueError(f"activation_memory_budget must be between 0 and 1, got {cfg['activation_memory_budget']}")
    dev = device or device_facts("cpu")
    s = shape_facts(cfg, dev)
    if plan is None and dev["type"] == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("a compiled CUDA step is predicted from inductor's CUDA plan, which needs a GPU here "
                             "(fake CUDA tensors cannot be made without one); --gpu=cpu predicts the CPU plan")
    plan = plan or plan_for(cfg, dev["type"])
    params = param_shapes(cfg)
    seen = {}  # the CUDA kernels' cuBLASLt threads and unmeasured rules, as the wrappers call them
    if dev["type"] == "cpu":  # the kernels answered as the eager shadow answers them, as on the audited CPU
        from .shadow import cpu as shadow_cpu
        fw_kernel = bw_kernel = shadow_cpu.plan_kernel
    else:
        from .shadow import cuda as shadow_cuda
        fw_kernel = shadow_cuda.plan_kernel("forward thread", seen)
        bw_kernel = shadow_cuda.plan_kernel("backward thread", seen)
    with _on_cpu(dev, cfg):
        acts, keys, fw_user = compiled_activation_lines(s, cfg, plan, lambda m: short_module(m, "", "gpt"), fw_kernel)
        if dev["type"] == "cpu":
            steady = [plain(l) for l in steady_lines(s, cfg, dev, params) + acts]
            peak, backward = peak_candidates(s, cfg, plan, acts, keys, fw_user, bw_kernel, steady)
        else:  # the wrappers' replays say which threads make a cuBLASLt workspace
            peak, backward = peak_candidates(s, cfg, plan, acts, keys, fw_user, bw_kernel)
            lt = sorted(seen.get("cublaslt", ()), reverse=True)  # an addmm with a 1-D bias: cuBLASLt's, per thread
            steady = [plain(l) for l in steady_lines(s, cfg, dev, params, lt=lt) + acts]
    unmeasured = sorted(seen.get("unmeasured", ()))
    backward["notes"] += [f"not measured on a GPU: {u}" for u in unmeasured]
    backward["notes"] = [f"{op} at forward line {i}: {why}" for i, op, why in fw_user[0]["unasked"]] + backward["notes"]
    ledger = steady + [plain(l) for l in peak]
    totals = totals_of(ledger, params, dev, None, cfg)
    totals["saved_bytes"] = sum(l["bytes"] for l in acts)
    totals["forward_flops"] = forward_flops(s) * cfg["gradient_accumulation_steps"]
    totals["recompute_flops"] = plan.get("recompute_flops", 0) * cfg["gradient_accumulation_steps"]
    if dev["type"] == "cuda":  # fit and plan print these beside the need they judge
        totals["unmeasured_on_gpu"] = unmeasured + [RESERVED_UNPREDICTED]
    return {"config": cfg, "device": dev, "ledger": ledger, "totals": totals, "backward": backward,
            "compiled": {"saved_values": len(plan["saved"]), "budget": cfg["activation_memory_budget"],
                         "plan": plan}}
