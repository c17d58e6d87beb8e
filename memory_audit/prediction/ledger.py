"""The ground both predictors stand on (predict.py eager, compiled_predict.py compiled): the
configs and machines they take, the steady-state lines (weights, buffers, grads, optimizer
state, the batch, workspaces) and the totals a ledger sums to. Pure Python, no torch."""

from ..reading.attribute import CUBLASLT_WORKSPACE_SIZE, workspace_size_from_env
from .ledger_history import predicted_gaps
from .parts import grad_phases, line, numel as _numel
from ..schema import PHASES, check_model_config, sac_ops
from . import fsdp, tensor_parallel as tp

GiB = 2 ** 30

# name -> (compute capability, total memory in bytes as torch reports it)
GPUS = {
    "A100": ((8, 0), 85_899_345_920),  # A100-SXM4-80GB
    "A100-40GB": ((8, 0), 42_505_273_344),
    "H100": ((9, 0), 85_017_493_504),  # measured: NVIDIA H100 80GB HBM3
    "H200": ((9, 0), 150_110_011_392),
    "L4": ((8, 9), 23_580_639_232),
    "A10G": ((8, 6), 23_836_033_024),
    "V100": ((7, 0), 34_089_730_048),
    "RTX4090": ((8, 9), 25_386_352_640),
}

DEFAULTS = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False,
                dropout=0.0, batch_size=12, gradient_accumulation_steps=1, dtype="float16",
                attention="manual", activation="gelu", optimizer_impl="fused", set_to_none=True,
                keep_logits=True, grad_clip=1.0, activation_checkpointing="none", ac_every=1,
                sac_save_ops="", parallel="none", world_size=1, tp_size=0, ddp_bucket_view=False, rank=0)


def gpu_name(name):
    """The GPU table's name for `name`, any case ("h100" -> "H100"), or None."""
    return next((g for g in GPUS if g.lower() == str(name).lower()), None)


# Memory a CUDA process holds outside PyTorch's allocator (context, cuBLAS/cuDNN handles and
# kernels): an estimate until a GPU run measures it (meta.json's outside_pytorch: the card's
# used bytes from mem_get_info() minus memory_reserved()); `--outside=BYTES` overrides it.
OUTSIDE_PYTORCH_DEFAULT = 768 * 2 ** 20


def expandable_from_env(env):
    """Whether PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) turns expandable_segments on."""
    conf = (env or {}).get("PYTORCH_CUDA_ALLOC_CONF") or (env or {}).get("PYTORCH_ALLOC_CONF") or ""
    opts = dict(o.split(":", 1) for o in conf.replace(" ", "").split(",") if ":" in o)
    return opts.get("expandable_segments", "False").lower() == "true"


def device_facts(device="cuda", gpu="H100", capability=None, torch_version="2.11",
                 env=None, sdpa_backend=None, total_memory=None, outside_pytorch=OUTSIDE_PYTORCH_DEFAULT, cpu=None):
    """What the predictor needs to know about the machine, as a plain dict. cpu: the CPU an audit
    ran on (recorder.cpu_info: threads, whether bf16 matmuls go through oneDNN), None for this one."""
    env = env or {}
    if device == "cpu":
        return {"type": "cpu", "gpu": None, "capability": None, "workspace_bytes": 0,
                "workspaces": 0, "sdpa_backend": "flash_cpu", "total_memory": total_memory,
                "torch_version": torch_version, "cpu": cpu}
    cap, mem = GPUS.get(gpu_name(gpu), (capability or (8, 0), total_memory))
    cap = tuple(capability or cap)
    # CUBLAS_WORKSPACE_CONFIG wins; else sm90 uses 4096 KiB x 8 = 33,554,432 B (measured on an
    # H100, torch 2.11) and older GPUs ":4096:2:16:8" = 8,519,680 B
    ws = workspace_size_from_env(env) or (4096 * 1024 * 8 if cap >= (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8)
    if sdpa_backend is None:  # fp16/bf16 SDPA's kernel: flash attention needs sm80, cuDNN's is Hopper's here
        sdpa_backend = "cudnn" if cap >= (9, 0) else "flash" if cap >= (8, 0) else "efficient"
    return {"type": "cuda", "gpu": gpu, "capability": list(cap), "workspace_bytes": ws, "workspaces": 2,
            "sdpa_backend": sdpa_backend, "total_memory": total_memory or mem, "torch_version": torch_version,
            "expandable_segments": expandable_from_env(env), "outside_pytorch": outside_pytorch}


def presets():
    """model.py's PRESETS, read from its source (importing model.py imports torch, which the
    ledger's commands do not need): {name: {key: value}}."""
    import ast
    import importlib.util
    spec = importlib.util.find_spec("model")
    if spec is None or spec.origin is None:
        raise ValueError("model.py not found: run from the repository (or install it with pip install -e .)")
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["PRESETS"]:
            return {ast.literal_eval(k): {kw.arg: ast.literal_eval(kw.value) for kw in v.keywords}
                    for k, v in zip(node.value.keys, node.value.values)}
    raise ValueError(f"no PRESETS in {spec.origin}")


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


PARALLEL = ("none", "ddp", "fsdp", "tp", "tp-sp", "fsdp+tp", "fsdp+tp-sp")


def resolved(config):
    """train.py's keys of `config` over DEFAULTS, as a run resolves them; other keys (a
    report's run name, a sweep's nproc) are dropped."""
    return dict(DEFAULTS, **{k: v for k, v in config.items() if k in DEFAULTS})


def validate(cfg):
    """The model rules model.py applies, plus the run's own keys."""
    check_model_config(cfg)
    for k in ("batch_size", "gradient_accumulation_steps"):
        if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1:
            raise ValueError(f"{k} must be a positive integer, got {cfg[k]!r}")
    if cfg["dtype"] not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {cfg['dtype']!r}")
    if cfg["parallel"] not in PARALLEL:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {cfg['parallel']!r}")
    if not isinstance(cfg["world_size"], int) or isinstance(cfg["world_size"], bool) or cfg["world_size"] < 1:
        raise ValueError(f"world_size must be a positive integer, got {cfg['world_size']!r}")
    if not isinstance(cfg["rank"], int) or isinstance(cfg["rank"], bool) or not 0 <= cfg["rank"] < cfg["world_size"]:
        raise ValueError(f"rank must be an integer from 0 to world_size - 1 = {cfg['world_size'] - 1}, got {cfg['rank']!r}")
    tp.check(cfg)


def steady_lines(s, cfg, dev, params, owned=None):
    """Weights, buffers, grads, optimizer state, the batch, the loss and the cuBLAS workspaces.
    params: (name, shape) as this rank holds them (FSDP2: padded shards); owned: the rows it
    owns (FSDP2: unpadded, which the optimizer's state follows), else params."""
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
    if dev["workspaces"] and cfg.get("bias"):  # cuBLASLt's, one per thread that runs an addmm (a biased Linear)
        out += [line(s, "workspace/cublaslt", CUBLASLT_WORKSPACE_SIZE, "uint8", [CUBLASLT_WORKSPACE_SIZE],
                     "CUBLASLT_WORKSPACE_SIZE (1024 KiB)", PHASES, thread) for thread in lt_threads(cfg)]
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
