"""Predict the memory ledger of a nanoGPT training step from its config alone.

Pure Python: no GPU, no torch. The ledger is an ordered list of lines whose keys are the
names the attribution gives measured bytes (weights/<param>, activations/h.3.attn/softmax.result,
...), each with its bytes, dtype, shape, the phases it is live in and its formula as text, so a
reader can check any term by hand.

What is saved for backward depends on the device's autocast policy (measured, see POLICIES):
  cuda + float16/bfloat16: matmuls in low precision, LayerNorm and softmax in fp32; linear
      layers save the low-precision copy of their weight; cross-entropy keeps the
      low-precision log_softmax and an fp32 copy for nll_loss
  cpu + float16/bfloat16: softmax and LayerNorm outputs are low precision, log_softmax is fp32
  float32 (either device): no casts, so weights are saved as themselves (not activations)

The ledger is assembled from small parts: steady-state lines (weights, buffers, grads, optimizer
state, inputs, workspaces), the activations each model part saves (ledger/parts.py) and the levers'
rules over each block's lines (ledger/levers.py: activation checkpointing). Lines carry no state
between parts: data flows one way. The step's totals (its phases, the peak, reserved memory)
are its trace's: prediction().
"""

from .ledger.config import (DEFAULTS, GPUS, OUTSIDE_PYTORCH_DEFAULT, PARALLEL, device_facts,  # noqa: F401
                            expandable_from_env, gpu_name, resolved, validate)
from .ledger.steady import GiB, ddp_bucket_numels, param_shapes, plain, steady_lines  # noqa: F401
from .ledger.steady import totals as totals_of
from .ledger.levers import checkpointed, forward_flops, recompute_flops
from .ledger.parts import DTYPE_BYTES, POLICIES, block, embedding, head, line, round_block, shape_facts  # noqa: F401
from .ledger.parts import numel as _numel
from .ledger import fsdp, tensor_parallel as tp

def activation_lines(s, cfg):
    """What the forward leaves saved for backward, in forward order (a checkpointed block's
    recomputation is the shadow run's)."""
    lines = embedding(s)
    for i in range(cfg["n_layer"]):
        kept, _ = checkpointed(s, cfg, i, block(s, i))
        lines += tp.shard_lines(s, kept, cfg)  # one rank's share: a rule over what the lever kept
    return lines + tp.shard_lines(s, head(s, cfg["keep_logits"]), cfg)


def predict(config=None, device=None, gaps_bytes=None):
    """The byte formula's ledger for one audited training step (prediction() is what commands read).

    Args:
        config: train.py keys (missing ones take DEFAULTS: the reference run).
        device: device_facts() dict; default an H100.
        gaps_bytes: measured allocator gaps at steady state, added to the lines' rounding (else
            the totals count the lines and their 512 B rounding only; prediction() replaces
            the allocated, reserved and peak totals with the trace's).
    Returns:
        {"config", "device", "ledger": [line...], "totals": {...}, "backward": {...}} with
        integer bytes; the ledger's peak is the moment before backward.
    """
    cfg = dict(DEFAULTS)
    cfg.update({k: v for k, v in (config or {}).items() if k in DEFAULTS})
    validate(cfg)
    dev = device or device_facts()
    s = shape_facts(cfg, dev)
    t, shards, whole = tp.tp_size(cfg), fsdp.shards(cfg), param_shapes(cfg)
    tp_local = [(n, tp.local_shape(n, sh, t)) for n, sh in whole]  # what FSDP2 shards
    params = [(n, fsdp.local_shape(sh, shards)) for n, sh in tp_local]  # what this rank holds
    acts = activation_lines(s, cfg)
    owned = [(n, fsdp.own_shape(sh, cfg)) for n, sh in tp_local]  # FSDP2: the unpadded rows this rank owns
    ledger = [plain(l) for l in steady_lines(s, cfg, dev, params, owned) + fsdp.unsharded(s, cfg, tp_local) + acts]
    totals = totals_of(ledger, params, dev, gaps_bytes, cfg, allocator_model=False)
    totals["recompute_flops"] = recompute_flops(s, cfg)
    totals["forward_flops"] = forward_flops(s) * cfg["gradient_accumulation_steps"]
    return {"config": cfg, "device": dev, "ledger": ledger, "totals": totals, "backward": {"peak_at": None}}


def prediction(config=None, device=None, plan=None):
    """The prediction of one training step: what every command and file reads (train.py --audit's
    report, report, predict, fit, plan, sweep, accuracy, the notebook).

    The lines are the byte formula's (predict(): each with its formula). The totals (the phases'
    memory_allocated(), the peak, memory_reserved()) are the step's trace replayed as the device
    counts it: the shadow run's (eager), inductor's plan (compile=True: prediction/compiled, `plan`
    one made before for this config). totals["from"] says which, always.
    Needs torch and model.py for the shadow run and the compiled plan.
    """
    return traced(config, device, plan)[0]


def traced(config=None, device=None, plan=None, names=False):
    """(prediction(), the shadow run's replay or None where the totals are not the shadow's).
    names: the shadow names what it made as an audit does (a written trace; a CUDA step is then
    run whole)."""
    dev = device or device_facts()
    if (config or {}).get("compile"):
        from .compiled import predict_compiled
        pred = predict_compiled(config, dev, plan=plan)
        notes = pred["backward"].get("notes") or []
        pred["totals"]["from"] = "inductor's plan (compile=True)" + (f" ({'; '.join(notes)})" if notes else "")
        return pred, None
    cfg = resolved(config or {})
    pred = predict(cfg, dev)
    from .shadow import step as shadow
    r = shadow.replayed(cfg, dev, names=names)
    _from_trace(pred, r)
    return pred, r


def predicted_snapshot(replay, dev):
    """The shadow run's step (traced()'s replay) as a plain snapshot, categorized as `viz`
    categorizes an audit of it (grads, recomputed, temporaries by the audit's names; the viewer's
    'unknown' its loader needs), so MemoryViz opens the file itself; its phases' trace positions
    under schema.PHASES_KEY."""
    from .shadow import step as shadow, names as shadow_names
    from ..reading.loader import normalize
    from ..reading.event_names import categorize_trace
    from ..reading.trace import plain
    if dev["type"] == "cuda":
        from .shadow.replay import snapshot
        snap = snapshot(replay["result"], dev.get("expandable_segments", False), shadow_names.audit_names(replay["result"]))
    else:
        snap = shadow.snapshot(replay["result"])
    return plain(categorize_trace(normalize(snap), None, detail=False))


def _from_trace(pred, r):
    """pred's totals from the shadow's replay r (in place); the ledger's lines are unchanged."""
    t, cpu = pred["totals"], r["reserved"] is None  # CPU: no cache, reserved is what is allocated
    result = r["result"]
    t.update({"steady_state_allocated": r["steady_state"], "steady_state_gaps": r["steady_state"] - t["steady_state_bytes"],
              "before_backward_allocated": r["before_backward"], "peak_allocated_bytes": r["peak"],
              "end_allocated": r["end"], "reserved_steady_bytes": r["steady_state"] if cpu else r["reserved_steady"],
              "reserved_peak_bytes": r["peak"] if cpu else r["reserved"],
              "from": "shadow run" + (" (blocks repeated)" if result.get("repeated") else "")
              + (f" (kernels not asked for their own buffers: {', '.join(result['unprobed'])})"
                 if result.get("unprobed") else "")})
    if pred["device"]["type"] == "cuda":  # the CUDA rules it applied outside the shapes a trace measured
        t["unmeasured_on_gpu"] = result.get("unmeasured", [])
    i = r["peak_event"]
    pred["backward"] = dict(pred["backward"], peak_at="the step's start (no event adds to it)" if i < 0 else
                            f"event {i} of step 2 (shadow run): {result['events'][i][1]}")


def phase_allocated(pred):
    """{phase: memory_allocated() predicted at each snapshot}: the totals' (the trace's where it
    covers the config)."""
    t = pred["totals"]
    return {"step2_start": t["steady_state_allocated"], "step2_before_backward": t["before_backward_allocated"],
            "step2_end": t["end_allocated"]}


# -- other published formulas, for the report's comparison columns ---------------------------

def published_formulas(cfg, workspace_bytes=0):
    """Bytes by the formulas others use (REFERENCE section 6), for the same config."""
    c = dict(DEFAULTS)
    c.update(cfg)
    B, T, d, nh, L, V = c["batch_size"], c["block_size"], c["n_embd"], c["n_head"], c["n_layer"], c["vocab_size"]
    N = sum(_numel(s) for _, s in param_shapes(c))
    Nbuf = L * T * T if c["attention"] == "manual" else 0
    Ne, Na, Nl = B * T * d, B * nh * T * T, B * T * V
    rees_act = L * (36 * Ne + 6 * Na) + 6 * Ne + 6 * Nl
    korthikanti = L * (34 * T * B * d + 5 * nh * T * T * B)  # s*b*h*(34 + 5*a*s/h), kept integer
    steady = 16 * N + 4 * Nbuf + workspace_bytes + 2 * 8 * B * T
    return {
        "rees2023": {"steady_state": steady, "activations": rees_act,
                     "peak": L * (36 * Ne + 6 * Na) + 6 * Ne + 10 * Nl + 16 * N + 4 * Nbuf + workspace_bytes,
                     "formula": "steady 16N+4N_buf(+ws); act L(36Ne+6Na)+6Ne+6Nl; peak act+4Nl+steady"},
        "korthikanti2022": {"steady_state": steady, "activations": korthikanti,
                            "peak": steady + korthikanti,
                            "formula": "act per layer s*b*h*(34+5*a*s/h), all 16-bit"},
        # selective recomputation drops the 5as/h attention term; full keeps 2sbh per layer
        "korthikanti2022_selective": {"steady_state": steady, "activations": L * 34 * T * B * d,
                                      "peak": steady + L * 34 * T * B * d,
                                      "formula": "act per layer s*b*h*34 (attention core recomputed)"},
        **_korthikanti_tp(c, L, steady),
        "korthikanti2022_full": {"steady_state": steady, "activations": L * 2 * T * B * d,
                                 "peak": steady + L * 2 * T * B * d,
                                 "formula": "act per layer 2*s*b*h (block inputs only, 16-bit)"},
    }


def _korthikanti_tp(c, L, steady):
    """Tensor-parallel runs: the paper's per-rank formula for this strategy, over the layers."""
    t = tp.tp_size(c)
    if t == 1:
        return {}
    sp = tp.sequence_parallel(c)
    act = L * sum(tp.paper_bytes(c, t, sp).values())
    return {f"korthikanti2022_{c['parallel']}": {
        "steady_state": steady, "activations": act, "peak": steady + act,
        "formula": f"act per layer {tp.PER_LAYER['tp-sp' if sp else 'tp']}, 16-bit"}}
