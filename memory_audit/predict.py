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
"""

from .allocator_sim import round_size
from .attribute import workspace_size_from_env
from .gap_sim import predicted_gaps
from .schema import PHASES, check_model_config

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

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "bool": 1}

# Autocast policies, per (device type, autocast on). Measured with the saved-tensor ledger:
# CUDA on torch 2.11 (H100), CPU on torch 2.13.
POLICIES = {
    # softmax output dtype, log_softmax output dtype, nll_loss keeps an fp32 copy, weight copies saved
    ("cuda", True): {"softmax": "fp32", "log_softmax": "low", "nll_fp32_copy": True, "weight_copies": True},
    ("cpu", True): {"softmax": "low", "log_softmax": "fp32", "nll_fp32_copy": False, "weight_copies": True},
    ("cuda", False): {"softmax": "fp32", "log_softmax": "fp32", "nll_fp32_copy": False, "weight_copies": False},
    ("cpu", False): {"softmax": "fp32", "log_softmax": "fp32", "nll_fp32_copy": False, "weight_copies": False},
}

DEFAULTS = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False,
                dropout=0.0, batch_size=12, gradient_accumulation_steps=1, dtype="float16",
                attention="manual", activation="gelu", optimizer_impl="fused", set_to_none=True,
                keep_logits=True, grad_clip=1.0)


def round_block(nbytes, device_type):
    """Bytes the CUDA caching allocator hands out for a request; CPU memory is not rounded."""
    return round_size(nbytes) if device_type == "cuda" else nbytes


def device_facts(device="cuda", gpu="H100", capability=None, torch_version="2.11",
                 env=None, sdpa_backend=None, total_memory=None):
    """What the predictor needs to know about the machine, as a plain dict."""
    env = env or {}
    if device == "cpu":
        return {"type": "cpu", "gpu": None, "capability": None, "workspace_bytes": 0,
                "workspaces": 0, "sdpa_backend": "flash_cpu", "total_memory": total_memory,
                "torch_version": torch_version}
    cap, mem = GPUS.get(gpu, (capability or (8, 0), total_memory))
    cap = tuple(capability or cap)
    # CUBLAS_WORKSPACE_CONFIG wins; else sm90 uses 4096 KiB x 8 = 33,554,432 B (measured on an
    # H100, torch 2.11) and older GPUs ":4096:2:16:8" = 8,519,680 B
    ws = workspace_size_from_env(env) or (4096 * 1024 * 8 if cap >= (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8)
    if sdpa_backend is None:
        sdpa_backend = "cudnn" if cap >= (9, 0) else "flash"
    return {"type": "cuda", "gpu": gpu, "capability": list(cap), "workspace_bytes": ws, "workspaces": 2,
            "sdpa_backend": sdpa_backend, "total_memory": total_memory or mem, "torch_version": torch_version}


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


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _validate(cfg):
    """The model rules model.py applies, plus the run's own keys."""
    check_model_config(cfg)
    for k in ("batch_size", "gradient_accumulation_steps"):
        if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1:
            raise ValueError(f"{k} must be a positive integer, got {cfg[k]!r}")
    if cfg["dtype"] not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {cfg['dtype']!r}")


def predict(config=None, device=None, gaps_bytes=None):
    """The predicted ledger for one audited training step.

    Args:
        config: train.py keys (missing ones take DEFAULTS: the reference run).
        device: device_facts() dict; default an H100.
        gaps_bytes: measured allocator gaps at steady state, to use instead of the allocator
            model's (gap_sim.py); they depend on allocation history.
    Returns:
        {"config", "device", "ledger": [line...], "totals": {...}} with integer bytes.
    """
    cfg = dict(DEFAULTS)
    cfg.update({k: v for k, v in (config or {}).items() if k in DEFAULTS})
    _validate(cfg)
    dev = device or device_facts()
    dt = dev["type"]
    B, T, d, nh, L, V = (cfg["batch_size"], cfg["block_size"], cfg["n_embd"], cfg["n_head"],
                         cfg["n_layer"], cfg["vocab_size"])
    autocast = cfg["dtype"] != "float32"
    pol = POLICIES[(dt, autocast)]
    lowp = cfg["dtype"] if autocast else "float32"
    a = DTYPE_BYTES[lowp]  # bytes per element of matmul outputs
    sm = ("float32" if pol["softmax"] == "fp32" else lowp)
    ledger = []

    def line(key, nbytes, dtype, shape, formula, phases, note=""):
        alloc = round_block(abs(int(nbytes)), dt) if nbytes else 0
        ledger.append({"key": key, "category": key.split("/", 1)[0], "bytes": int(nbytes),
                       "allocated": alloc if nbytes >= 0 else -alloc, "dtype": dtype,
                       "shape": shape, "formula": formula, "phases": list(phases), "note": note})

    every = PHASES
    grads_at = [p for p, alive in (("step2_start", not cfg["set_to_none"]),
                                   ("step2_before_backward", not cfg["set_to_none"] or cfg["gradient_accumulation_steps"] > 1),
                                   ("step2_end", not cfg["set_to_none"])) if alive]
    params = param_shapes(cfg)
    # -- steady state: weights, buffers, grads, optimizer state, inputs, workspaces
    for name, shape in params:
        line(f"weights/{name}", 4 * _numel(shape), "float32", shape, "4*" + "*".join(map(str, shape)), every)
    if cfg["attention"] == "manual":
        for i in range(L):
            line(f"buffers/transformer.h.{i}.attn.bias", 4 * T * T, "float32", [1, 1, T, T],
                 "4*T^2 (causal mask)", every)
    for name, shape in params:
        if grads_at:
            line(f"grads/{name}", 4 * _numel(shape), "float32", shape, "4*numel", grads_at)
    step_on_device = dt == "cpu" or cfg["optimizer_impl"] == "fused"
    for state in ("exp_avg", "exp_avg_sq"):
        for name, shape in params:
            line(f"optimizer/{state}/{name}", 4 * _numel(shape), "float32", shape, "4*numel", every)
    if step_on_device:
        for name, _ in params:
            line(f"optimizer/step/{name}", 4, "float32", [], "4 (0-dim step count)", every,
                 "fused AdamW keeps `step` on the device" if dt == "cuda" else "")
    if cfg["dtype"] == "float16":
        line("optimizer/grad_scaler/scale", 4, "float32", [1], "4", every)
        line("optimizer/grad_scaler/growth_tracker", 4, "int32", [1], "4", every)
    line("inputs/x", 8 * B * T, "int64", [B, T], "8*B*T", every)
    line("inputs/y", 8 * B * T, "int64", [B, T], "8*B*T", every)
    line("temporary/loss", 4, "float32", [], "4 (the loss the loop holds)", every)
    for i in range(dev["workspaces"]):
        line("workspace/cublas", dev["workspace_bytes"], "uint8", [dev["workspace_bytes"]],
             "CUBLAS_WORKSPACE_CONFIG size", every, ("forward thread", "backward thread")[i])

    # -- activations live before backward
    bb = ("step2_before_backward",)
    Ne = B * T * d

    def act(key, nbytes, dtype, shape, formula, note=""):
        line(f"activations/{key}", nbytes, dtype, shape, formula, bb, note)

    def layer_norm(mod):
        act(f"{mod}/native_layer_norm.input", 4 * Ne, "float32", [B, T, d], "4*B*T*d", "fp32 residual stream")
        act(f"{mod}/native_layer_norm.result1", 4 * B * T, "float32", [B, T, 1], "4*B*T", "mean")
        act(f"{mod}/native_layer_norm.result2", 4 * B * T, "float32", [B, T, 1], "4*B*T", "rstd")

    def linear(mod, n_in, n_out, input_saved_here=True, input_note=""):
        op = "addmm" if cfg["bias"] else "mm"
        x_attr, w_attr = ("mat1", "mat2") if cfg["bias"] else ("self", "mat2")
        if pol["weight_copies"]:
            act(f"{mod}/{op}.{w_attr}", a * n_in * n_out, lowp, [n_in, n_out], f"{a}*{n_in}*{n_out}",
                "low-precision weight copy (autocast cache)")
        if input_saved_here:
            act(f"{mod}/{op}.{x_attr}", a * B * T * n_in, lowp, [B * T, n_in], f"{a}*B*T*{n_in}", input_note)

    drop = cfg["dropout"] > 0

    def dropout(mod, numel, dtype, shape, formula):
        """A dropout's saved mask: CUDA keeps a bool mask, CPU the scaled noise in the input's dtype."""
        if not drop:
            return
        if dt == "cuda":
            act(f"{mod}/native_dropout.result1", numel, "bool", shape, formula, "dropout mask")
        else:
            act(f"{mod}/mul.other", DTYPE_BYTES[dtype] * numel, dtype, shape, f"{DTYPE_BYTES[dtype]}*{formula}",
                "dropout noise (mask / (1-p))")

    act("wpe/embedding.indices", 8 * T, "int64", [T], "8*T", "position ids")
    dropout("drop", Ne, "float32", [B, T, d], "B*T*d")
    for i in range(L):
        h = f"h.{i}"
        layer_norm(f"{h}.ln_1")
        linear(f"{h}.attn.c_attn", d, 3 * d, input_note="LayerNorm output" + (", cast" if autocast else ""))
        Na = B * nh * T * T
        if cfg["attention"] == "sdpa" and drop and dt == "cpu":
            # CPU SDPA with dropout in training runs the math fallback, in fp32 even under autocast
            act(f"{h}.attn/bmm.self", 4 * Ne, "float32", [B * nh, T, d // nh], "4*B*T*d", "q (math SDPA)")
            act(f"{h}.attn/bmm.mat2", 4 * Ne, "float32", [B * nh, d // nh, T], "4*B*T*d", "k^T (math SDPA)")
            act(f"{h}.attn/safe_softmax.result", 4 * Na, "float32", [B, nh, T, T], "4*B*n_head*T^2")
            act(f"{h}.attn/mul.other", 4 * Na, "float32", [B, nh, T, T], "4*B*n_head*T^2", "dropout noise")
            act(f"{h}.attn/bmm.mat2#2", 4 * Ne, "float32", [B * nh, T, d // nh], "4*B*T*d", "v (math SDPA)")
            act(f"{h}.attn/bmm.self#2", 4 * Na, "float32", [B * nh, T, T], "4*B*n_head*T^2", "dropout output")
            linear(f"{h}.attn.c_proj", d, d, input_note="attention output, back in the autocast dtype")
        elif cfg["attention"] == "manual":
            act(f"{h}.attn/bmm.self", a * Ne, lowp, [B * nh, T, d // nh], f"{a}*B*T*d", "q, made contiguous")
            act(f"{h}.attn/bmm.mat2", a * Ne, lowp, [B * nh, d // nh, T], f"{a}*B*T*d", "k^T, made contiguous")
            act(f"{h}.attn/masked_fill.mask", T * T, "bool", [1, 1, T, T], "T^2", "bias[:T,:T] == 0")
            act(f"{h}.attn/softmax.result", DTYPE_BYTES[sm] * Na, sm, [B, nh, T, T],
                f"{DTYPE_BYTES[sm]}*B*n_head*T^2")
            dropout(f"{h}.attn.attn_dropout", Na, sm, [B, nh, T, T], "B*n_head*T^2")
            if sm != lowp:  # CUDA autocast: att @ v casts the fp32 probabilities back down
                act(f"{h}.attn/bmm.self#2", a * Na, lowp, [B * nh, T, T], f"{a}*B*n_head*T^2",
                    "softmax output cast for att @ v")
            elif drop:  # att @ v saves the dropout's output, a new tensor
                act(f"{h}.attn/bmm.self#2", a * Na, lowp, [B * nh, T, T], f"{a}*B*n_head*T^2",
                    "attention dropout output")
            act(f"{h}.attn/bmm.mat2#2", a * Ne, lowp, [B * nh, T, d // nh], f"{a}*B*T*d", "v, made contiguous")
            if dt == "cpu":
                act(f"{h}.attn/mul.other", 8, "float64", [], "8",
                    "the 1/sqrt(hs) scalar, a CPU tensor")
            linear(f"{h}.attn.c_proj", d, d, input_note="heads side by side (contiguous copy)")
        else:
            backend = dev["sdpa_backend"]
            if dt == "cuda" and not autocast and backend in ("cudnn", "flash"):
                backend = "efficient"  # flash and cuDNN kernels take no fp32 (measured: H100 picks efficient)
            sd = {"cudnn": "scaled_dot_product_cudnn_attention", "flash": "scaled_dot_product_flash_attention",
                  "efficient": "scaled_dot_product_efficient_attention",
                  "flash_cpu": "scaled_dot_product_flash_attention_for_cpu"}[backend]
            act(f"{h}.attn/{sd}.key", a * 3 * Ne, lowp, [B, nh, T, d // nh], f"{a}*3*B*T*d",
                "q, k, v: views of the c_attn output")
            lse_T = T if backend != "efficient" else 32 * ((T + 31) // 32)
            act(f"{h}.attn/{sd}.{'log_sumexp' if backend == 'efficient' else 'logsumexp'}",
                4 * B * nh * lse_T, "float32", [B, nh, lse_T], "4*B*n_head*T")
            act(f"{h}.attn/{sd}.output", a * Ne, lowp, [B, nh, T, d // nh], f"{a}*B*T*d",
                "also c_proj's input: the transpose back is already contiguous")
            if backend == "cudnn":  # measured on H100; efficient attention saves none on the device
                act(f"{h}.attn/{sd}.philox_offset", 8, "int64", [], "8")
                act(f"{h}.attn/{sd}.philox_seed", 8, "int64", [], "8")
            linear(f"{h}.attn.c_proj", d, d, input_saved_here=False)
        dropout(f"{h}.attn.resid_dropout", Ne, lowp, [B, T, d], "B*T*d")
        layer_norm(f"{h}.ln_2")
        linear(f"{h}.mlp.c_fc", d, 4 * d, input_note="LayerNorm output" + (", cast" if autocast else ""))
        if cfg["activation"] == "gelu":
            act(f"{h}.mlp.act/gelu.self", a * 4 * Ne, lowp, [B, T, 4 * d], f"{a}*4*B*T*d", "GELU input")
            linear(f"{h}.mlp.c_proj", 4 * d, d, input_note="GELU output")
        else:
            act(f"{h}.mlp.act/relu.result", a * 4 * Ne, lowp, [B, T, 4 * d], f"{a}*4*B*T*d",
                "ReLU output, also c_proj's input")
            linear(f"{h}.mlp.c_proj", 4 * d, d, input_saved_here=False)
        dropout(f"{h}.mlp.dropout", Ne, lowp, [B, T, d], "B*T*d")
    layer_norm("ln_f")
    linear("lm_head", d, V, input_note="LayerNorm output" + (", cast" if autocast else ""))
    Nl = B * T * V
    lsm = "float32" if pol["log_softmax"] == "fp32" else lowp
    act("gpt/log_softmax.result", DTYPE_BYTES[lsm] * Nl, lsm, [B * T, V], f"{DTYPE_BYTES[lsm]}*B*T*V")
    if pol["nll_fp32_copy"]:
        act("gpt/nll_loss.self", 4 * Nl, "float32", [B * T, V], "4*B*T*V", "fp32 copy for nll_loss")
    act("gpt/nll_loss.total_weight", 4, "float32", [], "4")
    if dt == "cpu":
        act("gpt/div.other", 8, "int64", [], "8", "gradient_accumulation_steps, a CPU tensor")
    if cfg["keep_logits"]:
        act("lm_head/output", a * Nl, lowp, [B, T, V], f"{a}*B*T*V", "logits held by the training loop")

    # -- the peak: the start of backward, when cross-entropy's gradient appears
    extras = [("inputs/next_batch", 2 * 8 * B * T, "2*8*B*T", "prefetched X, Y")]
    if cfg["dtype"] == "float16":
        extras.append(("temporary/scaled_loss", 4, "4", "scaler.scale(loss)"))
    extras.append(("temporary/grad_seed", 4, "4", "ones_like(loss) for backward"))
    if pol["nll_fp32_copy"]:
        extras.append(("temporary/grad_into_nll", 4, "4", "d loss / d nll output"))
        extras.append(("temporary/nll_grad", 4 * Nl, "4*B*T*V", "nll_loss_backward output, fp32"))
    else:  # the peak comes one node later, at log_softmax's backward; nll_loss has let go
        extras.append(("temporary/nll_grad", 4 * Nl, "4*B*T*V", "nll_loss_backward output, fp32"))
        extras.append(("temporary/log_softmax_grad", 4 * Nl, "4*B*T*V", "log_softmax backward output, fp32"))
        extras.append(("released/nll_loss.target", -8 * B * T, "-8*B*T", "the old targets, saved by nll_loss"))
        extras.append(("released/nll_loss.total_weight", -4, "-4", ""))
        if dt == "cpu":
            extras.append(("released/div.other", -8, "-8", ""))
    for key, nbytes, formula, note in extras:
        line(key, nbytes, "", [], formula, ("peak",), note)

    return {"config": cfg, "device": dev, "ledger": ledger,
            "totals": _totals(ledger, params, dt, gaps_bytes, cfg)}


def _sum(ledger, phase, field="bytes", category=None):
    return sum(l[field] for l in ledger if phase in l["phases"] and (category is None or l["category"] == category))


def _totals(ledger, params, device_type, gaps_bytes, cfg):
    steady = _sum(ledger, "step2_start")
    steady_alloc = _sum(ledger, "step2_start", "allocated")
    rounding = steady_alloc - steady
    # Bytes the allocator holds beyond the rounding (unsplit blocks): measured when given, else
    # modelled by replaying the predicted tensors through the allocator's rules (CUDA only).
    modelled = predicted_gaps(ledger, cfg) if device_type == "cuda" else {"steady": 0, "before_backward": 0, "peak": 0}
    if gaps_bytes is not None:
        extra = {"steady": int(gaps_bytes) - rounding}
        extra["before_backward"] = extra["peak"] = extra["steady"]
    else:
        extra = modelled
    acts = _sum(ledger, "step2_before_backward", category="activations")
    bb_alloc = _sum(ledger, "step2_before_backward", "allocated") + extra["before_backward"]
    peak = _sum(ledger, "step2_before_backward", "allocated") + _sum(ledger, "peak", "allocated") + extra["peak"]
    return {
        "params": sum(_numel(s) for _, s in params),
        "steady_state_bytes": steady,  # requested bytes at the start of step 2
        "steady_state_gaps": rounding + extra["steady"],  # 512 B rounding + unsplit blocks
        "steady_state_allocated": steady + rounding + extra["steady"],  # comparable with memory_allocated()
        "activations_bytes": acts,  # saved for backward + held logits, requested bytes
        "activations_allocated": _sum(ledger, "step2_before_backward", "allocated", "activations"),
        "before_backward_allocated": bb_alloc,
        "peak_allocated_bytes": peak,  # comparable with max_memory_allocated()
        "end_allocated": _sum(ledger, "step2_end", "allocated") + extra["steady"],
        "unsplit_block_bytes": extra,  # the allocator model's (or the measured) remainders
    }


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
    }
