"""The lines both predictors share (predict.py eager, compiled.py compiled): the steady-state
lines (weights, buffers, grads, optimizer state, the batch, workspaces), GPT's parameter shapes
and DDP's buckets, and the totals a ledger sums to. Pure Python, no torch."""

from ...reading.attribute import CUBLASLT_WORKSPACE_SIZE
from .history import predicted_gaps
from .parts import grad_phases, line, numel as _numel
from ...schema import PHASES, sac_ops
from . import fsdp

GiB = 2 ** 30


def param_shapes(cfg):
    """[(name, shape)] of GPT's parameters in model order (lm_head tied to wte, listed once)."""
    d, L, bias = cfg["n_embd"], cfg["n_layer"], cfg["bias"]
    out = [("transformer.wte.weight", [cfg["vocab_size"], d]), ("transformer.wpe.weight", [cfg["block_size"], d])]
    for i in range(L):
        p = f"transformer.h.{i}."
        out.append((p + "ln_1.weight", [d]))
        if bias:
            out.append((p + "ln_1.bias", [d]))
        for name, o, n in (("attn.c_attn", 3 * d, d), ("attn.c_proj", d, d)):
            out.append((p + name + ".weight", [o, n]))
            if bias:
                out.append((p + name + ".bias", [o]))
        out.append((p + "ln_2.weight", [d]))
        if bias:
            out.append((p + "ln_2.bias", [d]))
        for name, o, n in (("mlp.c_fc", 4 * d, d), ("mlp.c_proj", d, 4 * d)):
            out.append((p + name + ".weight", [o, n]))
            if bias:
                out.append((p + name + ".bias", [o]))
    out.append(("transformer.ln_f.weight", [d]))
    if bias:
        out.append(("transformer.ln_f.bias", [d]))
    return out


DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 2 ** 20, 25 * 2 ** 20  # torch's defaults (bucket_cap_mb=25)


def ddp_bucket_numels(params):
    """Elements per DDP gradient bucket after the Reducer rebuilds them on the first step: the
    gradients in the order backward makes them (the parameters in reverse, the tied wte last),
    a bucket closing once it holds at least 1 MiB (the first) or 25 MiB (the rest). The order is
    an approximation of autograd's; the total is exact (measured on CPU: one bucket for
    cpu-tiny)."""
    sizes, cur, limit = [], 0, DDP_FIRST_BUCKET_BYTES
    for _, shape in reversed(params):
        cur += _numel(shape)
        if 4 * cur >= limit:
            sizes.append(cur)
            cur, limit = 0, DDP_BUCKET_BYTES
    return sizes + ([cur] if cur else [])


def steady_lines(s, cfg, dev, params, owned=None, lt=None):
    """Weights, buffers, grads, optimizer state, the batch, the loss and the cuBLAS workspaces.
    params: (name, shape) as this rank holds them (FSDP2: padded shards); owned: the rows it
    owns (FSDP2: unpadded, which the optimizer's state follows), else params. lt: the threads
    that make a cuBLASLt workspace where the step says so (a compiled step's wrappers), else
    lt_threads' (a biased Linear's)."""
    dt, L, T, B = dev["type"], cfg["n_layer"], cfg["block_size"], cfg["batch_size"]
    out = [line(s, f"weights/{n}", 4 * _numel(sh), "float32", sh, "4*" + "*".join(map(str, sh)), PHASES)
           for n, sh in params]
    if cfg["parallel"] not in ("none", "ddp"):  # parallelize.py's one DeviceMesh: an int32 rank per rank
        mesh = 4 * cfg["world_size"]
        out.append(line(s, "buffers/device_mesh", mesh, "int32", [cfg["world_size"]], "4*world_size", PHASES,
                        "the DeviceMesh's tensor of ranks"))
    if cfg["attention"] == "manual":
        out += [line(s, f"buffers/transformer.h.{i}.attn.bias", 4 * T * T, "float32", [1, 1, T, T],
                     "4*T^2 (causal mask)", PHASES) for i in range(L)]
    grads_at = fsdp.sharded_grad_phases(cfg, grad_phases(cfg))
    if grads_at and fsdp.shards(cfg) and cfg.get("set_to_none", True) is False:  # views into reduce-scatter outputs
        out += fsdp.kept_grad_lines(s, cfg, params, grads_at)
    elif grads_at and not (cfg["parallel"] == "ddp" and cfg["ddp_bucket_view"]):  # else views into the buckets
        out += [line(s, f"grads/{n}", 4 * _numel(sh), "float32", sh, "4*numel", grads_at) for n, sh in params]
    if cfg["parallel"] == "ddp":  # the Reducer's flat fp32 buckets: a copy of every gradient
        out += [line(s, "grads/ddp_buckets", 4 * n, "float32", [n], f"4*{n} (DDP gradient bucket {i})", PHASES,
                     "DDP averages the gradients in these; they live as long as the DDP module")
                for i, n in enumerate(ddp_bucket_numels(params))]
    for state in ("exp_avg", "exp_avg_sq"):
        out += [line(s, f"optimizer/{state}/{n}", 4 * _numel(sh), "float32", sh, "4*numel", PHASES)
                for n, sh in (owned or params) if _numel(sh)]
    if dt == "cpu" or cfg["optimizer_impl"] == "fused":  # where AdamW keeps its `step` tensors
        out += [line(s, f"optimizer/step/{n}", 4, "float32", [], "4 (0-dim step count)", PHASES,
                     "fused AdamW keeps `step` on the device" if dt == "cuda" else "") for n, _ in params]
    if cfg["dtype"] == "float16":
        out.append(line(s, "optimizer/grad_scaler/scale", 4, "float32", [1], "4", PHASES))
        out.append(line(s, "optimizer/grad_scaler/growth_tracker", 4, "int32", [1], "4", PHASES))
    out.append(line(s, "inputs/x", 8 * B * T, "int64", [B, T], "8*B*T", PHASES))
    out.append(line(s, "inputs/y", 8 * B * T, "int64", [B, T], "8*B*T", PHASES))
    out.append(line(s, "temporary/loss", 4, "float32", [], "4 (the loss the loop holds)", PHASES))
    out += [line(s, "workspace/cublas", dev["workspace_bytes"], "uint8", [dev["workspace_bytes"]],
                 "CUBLAS_WORKSPACE_CONFIG size", PHASES, ("forward thread", "backward thread")[i])
            for i in range(dev["workspaces"])]
    if lt is None:  # cuBLASLt's, one per thread that runs an addmm (a biased Linear)
        lt = lt_threads(cfg) if cfg.get("bias") else []
    if dev["workspaces"]:
        out += [line(s, "workspace/cublaslt", CUBLASLT_WORKSPACE_SIZE, "uint8", [CUBLASLT_WORKSPACE_SIZE],
                     "CUBLASLT_WORKSPACE_SIZE (1024 KiB)", PHASES, thread) for thread in lt]
    return out


def lt_threads(cfg):
    """The threads whose first addmm makes a cuBLASLt workspace: the forward's, and autograd's
    when the backward recomputes a Linear (full checkpointing; SAC when addmm is not kept)."""
    ac = cfg.get("activation_checkpointing", "none")
    again = ac == "full" or (ac == "sac" and "addmm" not in sac_ops(cfg))
    return ["forward thread"] + (["backward thread"] if again else [])


_LEVER_FIELDS = ("region", "alias", "graph", "input_alias", "feeds")


def plain(l):
    return {k: v for k, v in l.items() if k not in _LEVER_FIELDS}


def sum_lines(ledger, phase, field="bytes", category=None):
    return sum(l[field] for l in ledger if phase in l["phases"] and (category is None or l["category"] == category))


def totals(ledger, params, dev, gaps_bytes, cfg, allocator_model=True):
    steady = sum_lines(ledger, "step2_start")
    steady_alloc = sum_lines(ledger, "step2_start", "allocated")
    rounding = steady_alloc - steady
    # Bytes the allocator holds beyond the rounding (unsplit blocks): measured when given, else
    # modelled by replaying the predicted tensors through the allocator's rules (CUDA only).
    # (allocator_model=False: a caller that takes these from the shadow run's replay skips the model)
    modelled = predicted_gaps(ledger, cfg, dev.get("expandable_segments", False)) \
        if dev["type"] == "cuda" and allocator_model else {}
    if gaps_bytes is not None:
        extra = {"steady": int(gaps_bytes) - rounding}
        extra["before_backward"] = extra["peak"] = extra["steady"]
    else:
        extra = {k: modelled.get(k, 0) for k in ("steady", "before_backward", "peak")}
    acts = sum_lines(ledger, "step2_before_backward", category="activations")
    bb_alloc = sum_lines(ledger, "step2_before_backward", "allocated") + extra["before_backward"]
    peak = sum_lines(ledger, "step2_before_backward", "allocated") + sum_lines(ledger, "peak", "allocated") + extra["peak"]
    return {
        "params": sum(_numel(s) for _, s in params),
        "steady_state_bytes": steady,  # requested bytes at the start of step 2
        "steady_state_gaps": rounding + extra["steady"],  # 512 B rounding + unsplit blocks
        "steady_state_allocated": steady + rounding + extra["steady"],  # comparable with memory_allocated()
        "activations_bytes": acts,  # saved for backward + held logits, requested bytes
        "activations_allocated": sum_lines(ledger, "step2_before_backward", "allocated", "activations"),
        "before_backward_allocated": bb_alloc,
        "peak_allocated_bytes": peak,  # comparable with max_memory_allocated()
        "end_allocated": sum_lines(ledger, "step2_end", "allocated") + extra["steady"],
        "unsplit_block_bytes": extra,  # the allocator model's (or the measured) remainders
        # memory_reserved(): segments the allocator model made (CPU: no cache, = allocated)
        "reserved_steady_bytes": modelled.get("reserved_steady", steady + rounding),
        "reserved_peak_bytes": reserved_peak(modelled, peak),
        "outside_pytorch_bytes": (dev.get("outside_pytorch") or 0) if dev["type"] == "cuda" else 0,
    }


def reserved_peak(modelled, peak):
    """memory_reserved() at the peak: the allocator model's segments at the start of backward;
    where the predicted peak lies elsewhere (inside a checkpointed block's backward) and holds
    more than those segments, at least that peak in whole 2 MiB units (CPU: the peak itself)."""
    if "reserved_peak" not in modelled:
        return peak
    segment = 2 * 2 ** 20  # every segment, and every expandable page, is a multiple of 2 MiB
    return max(modelled["reserved_peak"], -(-peak // segment) * segment)
