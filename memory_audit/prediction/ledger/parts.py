"""What each part of GPT saves for backward, as ledger lines: one small function per part.

Every function takes the step's shape facts `s` (from `shape_facts`) and returns a list of
activation lines in forward order, the order autograd saves them. A line is a plain dict
(schema.LedgerLine) with four fields the levers read and the ledger drops:
  region  "core" for the attention core (what selective recomputation recomputes), else ""
  alias   the key this storage keeps if its first saver is recomputed and a later op outside
          the region saves it too (SDPA's output is also c_proj's input)
  graph   True for what the graph node holds itself (CPU's wrapped Python scalars): no
          checkpoint can drop it
  input_alias  "block" or "core" where the tensor is that checkpointed region's own input (a
          block's ln_1 input; SDPA's q/k/v for the attention core): recomputing it allocates nothing
"""

from ...reading.allocator_sim import round_size

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

BB = ("step2_before_backward",)


def numel(shape):
    n = 1
    for x in shape:
        n *= x
    return n


def tp_size(cfg):
    """Ranks a tensor-parallel run splits each block over (1 for anything else): every rank with
    tp and tp-sp, tp_size of them with fsdp+tp and fsdp+tp-sp."""
    if "tp" not in str(cfg.get("parallel", "none")):
        return 1
    return cfg.get("tp_size") or cfg.get("world_size", 1)


def sequence_parallel(cfg):
    """Whether a tensor-parallel run also splits the LayerNorms and residual stream (tp-sp, fsdp+tp-sp)."""
    return tp_size(cfg) > 1 and str(cfg.get("parallel")).endswith("tp-sp")


def shape_facts(cfg, dev):
    """The sizes and dtypes every part needs, as one plain dict."""
    B, T, d, nh = cfg["batch_size"], cfg["block_size"], cfg["n_embd"], cfg["n_head"]
    autocast = cfg["dtype"] != "float32"
    pol = POLICIES[(dev["type"], autocast)]
    lowp = cfg["dtype"] if autocast else "float32"
    t = tp_size(cfg)
    return {"B": B, "T": T, "d": d, "nh": nh, "nh_local": nh // t, "L": cfg["n_layer"], "V": cfg["vocab_size"],
            "tp": t, "sp": sequence_parallel(cfg),  # tensor (and sequence) parallelism
            "Ne": B * T * d, "Na": B * nh * T * T, "Nl": B * T * cfg["vocab_size"],
            "dt": dev["type"], "autocast": autocast, "pol": pol, "lowp": lowp, "a": DTYPE_BYTES[lowp],
            "sm": "float32" if pol["softmax"] == "fp32" else lowp, "bias": cfg["bias"],
            "drop": cfg["dropout"] > 0, "attention": cfg["attention"], "activation": cfg["activation"],
            "sdpa_backend": dev.get("sdpa_backend")}


def grad_phases(cfg):
    """The phases gradients are allocated in: kept all step unless zero_grad sets them to None."""
    keep = not cfg["set_to_none"]
    return [p for p, alive in (("step2_start", keep),
                               ("step2_before_backward", keep or cfg["gradient_accumulation_steps"] > 1),
                               ("step2_end", keep)) if alive]


def round_block(nbytes, device_type):
    """Bytes the CUDA caching allocator hands out for a request; CPU memory is not rounded."""
    return round_size(nbytes) if device_type == "cuda" else nbytes


def line(s, key, nbytes, dtype, shape, formula, phases=BB, note="", **extra):
    """One ledger line; `extra` holds the levers' fields (region, alias, graph)."""
    alloc = round_block(abs(int(nbytes)), s["dt"]) if nbytes else 0
    out = {"key": key, "category": key.split("/", 1)[0], "bytes": int(nbytes),
           "allocated": alloc if nbytes >= 0 else -alloc, "dtype": dtype, "shape": shape,
           "formula": formula, "phases": list(phases), "note": note}
    out.update(extra)
    return out


def act(s, key, nbytes, dtype, shape, formula, note="", **extra):
    return line(s, f"activations/{key}", nbytes, dtype, shape, formula, BB, note, **extra)


def layer_norm(s, mod):
    B, T, d, Ne = s["B"], s["T"], s["d"], s["Ne"]
    return [act(s, f"{mod}/native_layer_norm.input", 4 * Ne, "float32", [B, T, d], "4*B*T*d", "fp32 residual stream",
                input_alias="block" if mod.endswith("ln_1") else ""),  # ln_1 saves the block's input
            act(s, f"{mod}/native_layer_norm.result1", 4 * B * T, "float32", [B, T, 1], "4*B*T", "mean"),
            act(s, f"{mod}/native_layer_norm.result2", 4 * B * T, "float32", [B, T, 1], "4*B*T", "rstd")]


def linear(s, mod, n_in, n_out, input_saved_here=True, input_note="", bias=None):
    """mm (addmm with bias): the low-precision weight copy under autocast, and the input."""
    a, lowp = s["a"], s["lowp"]
    bias = s["bias"] if bias is None else bias
    op = "addmm" if bias else "mm"
    x_attr, w_attr = ("mat1", "mat2") if bias else ("self", "mat2")
    out = []
    if s["pol"]["weight_copies"]:
        out.append(act(s, f"{mod}/{op}.{w_attr}", a * n_in * n_out, lowp, [n_in, n_out], f"{a}*{n_in}*{n_out}",
                       "low-precision weight copy (autocast cache)"))
    if input_saved_here:
        out.append(act(s, f"{mod}/{op}.{x_attr}", a * s["B"] * s["T"] * n_in, lowp, [s["B"] * s["T"], n_in],
                       f"{a}*B*T*{n_in}", input_note))
    return out


def linear_input_key(s, mod):
    return f"activations/{mod}/{'addmm.mat1' if s['bias'] else 'mm.self'}"


def dropout(s, mod, numel, dtype, shape, formula, **extra):
    """A dropout's saved mask: CUDA keeps a bool mask, CPU the scaled noise in the input's dtype."""
    if not s["drop"]:
        return []
    if s["dt"] == "cuda":
        return [act(s, f"{mod}/native_dropout.result1", numel, "bool", shape, formula, "dropout mask", **extra)]
    return [act(s, f"{mod}/mul.other", DTYPE_BYTES[dtype] * numel, dtype, shape, f"{DTYPE_BYTES[dtype]}*{formula}",
                "dropout noise (mask / (1-p))", **extra)]


def _cast_note(s):
    return "LayerNorm output" + (", cast" if s["autocast"] else "")


def math_sdpa(s, h):
    """CPU SDPA with dropout in training runs the math fallback, in fp32 even under autocast."""
    B, T, d, nh, Ne, Na = s["B"], s["T"], s["d"], s["nh"], s["Ne"], s["Na"]
    core = dict(region="core")
    if _views(s) and not s["autocast"]:  # fp32 v folds to 3-D without a copy: c_attn's output is saved
        v = act(s, f"{h}.attn/bmm.mat2#2", 4 * 3 * Ne, "float32", [B, T, 3 * d], "4*3*B*T*d",
                "v: a view of the c_attn output (one head or batch 1: no copy)", input_alias="core", **core)
    else:
        v = act(s, f"{h}.attn/bmm.mat2#2", 4 * Ne, "float32", [B * nh, T, d // nh], "4*B*T*d", "v (math SDPA)", **core)
    return [act(s, f"{h}.attn/bmm.self", 4 * Ne, "float32", [B * nh, T, d // nh], "4*B*T*d", "q (math SDPA)", **core),
            act(s, f"{h}.attn/bmm.mat2", 4 * Ne, "float32", [B * nh, d // nh, T], "4*B*T*d", "k^T (math SDPA)", **core),
            act(s, f"{h}.attn/safe_softmax.result", 4 * Na, "float32", [B, nh, T, T], "4*B*n_head*T^2", **core),
            act(s, f"{h}.attn/mul.other", 4 * Na, "float32", [B, nh, T, T], "4*B*n_head*T^2", "dropout noise", **core),
            v, act(s, f"{h}.attn/bmm.self#2", 4 * Na, "float32", [B * nh, T, T], "4*B*n_head*T^2", "dropout output",
                   role="att_v_input", **core)
            ] + linear(s, f"{h}.attn.c_proj", d, d, input_note="attention output, back in the autocast dtype")


def _views(s):
    """matmul folds (B, heads) into one batch dimension: q, k^T and v, transposed views of
    c_attn's output, fold without a copy only when one of the two is 1."""
    return s["nh_local"] == 1 or s["B"] == 1


def manual_attention(s, h):
    """q @ k^T, scale, mask, softmax, dropout, @ v: each saves its own copy."""
    B, T, d, nh, Ne, Na, a, lowp, sm = (s[k] for k in ("B", "T", "d", "nh", "Ne", "Na", "a", "lowp", "sm"))
    core = dict(region="core")
    if _views(s):  # q, k^T and v reshape to 3-D without copies; c_attn's output is saved
        out = [act(s, f"{h}.attn/bmm.mat2", a * 3 * Ne, lowp, [B, T, 3 * d], f"{a}*3*B*T*d",
                   "q, k^T, v: views of the c_attn output (one head or batch 1: no copies)", input_alias="core", **core)]
    else:
        out = [act(s, f"{h}.attn/bmm.self", a * Ne, lowp, [B * nh, T, d // nh], f"{a}*B*T*d", "q, made contiguous", **core),
               act(s, f"{h}.attn/bmm.mat2", a * Ne, lowp, [B * nh, d // nh, T], f"{a}*B*T*d", "k^T, made contiguous", **core)]
    out += [act(s, f"{h}.attn/masked_fill.mask", T * T, "bool", [1, 1, T, T], "T^2", "bias[:T,:T] == 0", **core),
            act(s, f"{h}.attn/softmax.result", DTYPE_BYTES[sm] * Na, sm, [B, nh, T, T],
                f"{DTYPE_BYTES[sm]}*B*n_head*T^2", **core)]
    out += dropout(s, f"{h}.attn.attn_dropout", Na, sm, [B, nh, T, T], "B*n_head*T^2", **core)
    # the audit numbers a name's second storage (naming.saved.saved_records): where q is a view of
    # c_attn's output, att @ v's input is the first storage saved as bmm.self
    att_v = f"{h}.attn/bmm.self" if _views(s) else f"{h}.attn/bmm.self#2"
    if sm != lowp:  # CUDA autocast: att @ v casts the fp32 probabilities back down
        out.append(act(s, att_v, a * Na, lowp, [B * nh, T, T], f"{a}*B*n_head*T^2",
                       "softmax output cast for att @ v", role="att_v_input", **core))
    elif s["drop"]:  # att @ v saves the dropout's output, a new tensor
        out.append(act(s, att_v, a * Na, lowp, [B * nh, T, T], f"{a}*B*n_head*T^2",
                       "attention dropout output", role="att_v_input", **core))
    if not _views(s):
        out.append(act(s, f"{h}.attn/bmm.mat2#2", a * Ne, lowp, [B * nh, T, d // nh], f"{a}*B*T*d", "v, made contiguous", **core))
    if s["dt"] == "cpu":
        out.append(act(s, f"{h}.attn/mul.other", 8, "float64", [], "8", "the 1/sqrt(hs) scalar, a CPU tensor",
                       region="core", graph=True))
    return out + linear(s, f"{h}.attn.c_proj", d, d, input_note="heads side by side (contiguous copy)")


def sdpa_kernel(s, autocast):
    """The aten kernel F.scaled_dot_product_attention picks."""
    backend = s["sdpa_backend"]
    if s["dt"] == "cuda" and not autocast and backend in ("cudnn", "flash"):
        backend = "efficient"  # flash and cuDNN kernels take no fp32 (measured: H100 picks efficient)
    name = {"cudnn": "scaled_dot_product_cudnn_attention", "flash": "scaled_dot_product_flash_attention",
            "efficient": "scaled_dot_product_efficient_attention",
            "flash_cpu": "scaled_dot_product_flash_attention_for_cpu"}[backend]
    return backend, name


def sdpa_attention(s, h):
    """One fused kernel: it saves q, k, v (views of c_attn's output), its output and logsumexp."""
    B, T, d, nh, Ne, a, lowp = (s[k] for k in ("B", "T", "d", "nh", "Ne", "a", "lowp"))
    backend, sd = sdpa_kernel(s, s["autocast"])
    core = dict(region="core")
    out = [act(s, f"{h}.attn/{sd}.key", a * 3 * Ne, lowp, [B, nh, T, d // nh], f"{a}*3*B*T*d",
               "q, k, v: views of the c_attn output", input_alias="core", **core)]
    lse_T = T if backend != "efficient" else 32 * ((T + 31) // 32)
    out.append(act(s, f"{h}.attn/{sd}.{'log_sumexp' if backend == 'efficient' else 'logsumexp'}",
                   4 * B * nh * lse_T, "float32", [B, nh, lse_T], "4*B*n_head*T", **core))
    out.append(act(s, f"{h}.attn/{sd}.output", a * Ne, lowp, [B, nh, T, d // nh], f"{a}*B*T*d",
                   "also c_proj's input: the transpose back is already contiguous", region="core",
                   alias=linear_input_key(s, f"{h}.attn.c_proj")))
    if backend == "cudnn":  # measured on H100; efficient attention saves none on the device
        out.append(act(s, f"{h}.attn/{sd}.philox_offset", 8, "int64", [], "8", **core))
        out.append(act(s, f"{h}.attn/{sd}.philox_seed", 8, "int64", [], "8", **core))
    return out + linear(s, f"{h}.attn.c_proj", d, d, input_saved_here=False)


def materialized_scores(s):
    """Does the attention core make B*n_head*T^2 tensors? Manual attention does, and so does
    CPU SDPA with dropout in training (the math fallback)."""
    return s["attention"] == "manual" or (s["drop"] and s["dt"] == "cpu")


def attention(s, h):
    d = s["d"]
    out = linear(s, f"{h}.attn.c_attn", d, 3 * d, input_note=_cast_note(s))
    if s["attention"] == "sdpa" and materialized_scores(s):
        out += math_sdpa(s, h)
    elif s["attention"] == "manual":
        out += manual_attention(s, h)
    else:
        out += sdpa_attention(s, h)
    return out + dropout(s, f"{h}.attn.resid_dropout", s["Ne"], s["lowp"], [s["B"], s["T"], d], "B*T*d")


def mlp(s, h):
    B, T, d, Ne, a, lowp = (s[k] for k in ("B", "T", "d", "Ne", "a", "lowp"))
    out = linear(s, f"{h}.mlp.c_fc", d, 4 * d, input_note=_cast_note(s))
    if s["activation"] == "gelu":
        out.append(act(s, f"{h}.mlp.act/gelu.self", a * 4 * Ne, lowp, [B, T, 4 * d], f"{a}*4*B*T*d", "GELU input"))
        out += linear(s, f"{h}.mlp.c_proj", 4 * d, d, input_note="GELU output")
    else:
        out.append(act(s, f"{h}.mlp.act/relu.result", a * 4 * Ne, lowp, [B, T, 4 * d], f"{a}*4*B*T*d",
                       "ReLU output, also c_proj's input"))
        out += linear(s, f"{h}.mlp.c_proj", 4 * d, d, input_saved_here=False)
    return out + dropout(s, f"{h}.mlp.dropout", Ne, lowp, [B, T, d], "B*T*d")


def block(s, i):
    """Everything block i saves in an eager forward, in order."""
    h = f"h.{i}"
    return layer_norm(s, f"{h}.ln_1") + attention(s, h) + layer_norm(s, f"{h}.ln_2") + mlp(s, h)


def embedding(s):
    return ([act(s, "wpe/embedding.indices", 8 * s["T"], "int64", [s["T"]], "8*T", "position ids")]
            + dropout(s, "drop", s["Ne"], "float32", [s["B"], s["T"], s["d"]], "B*T*d"))


def head(s, keep_logits):
    """ln_f, lm_head and cross-entropy (log_softmax + nll_loss), and the logits the loop holds."""
    a, lowp, Nl, B, T, V = s["a"], s["lowp"], s["Nl"], s["B"], s["T"], s["V"]
    out = layer_norm(s, "ln_f") + linear(s, "lm_head", s["d"], V, input_note=_cast_note(s), bias=False)
    lsm = "float32" if s["pol"]["log_softmax"] == "fp32" else lowp
    out.append(act(s, "gpt/log_softmax.result", DTYPE_BYTES[lsm] * Nl, lsm, [B * T, V], f"{DTYPE_BYTES[lsm]}*B*T*V"))
    if s["pol"]["nll_fp32_copy"]:
        out.append(act(s, "gpt/nll_loss.self", 4 * Nl, "float32", [B * T, V], "4*B*T*V", "fp32 copy for nll_loss"))
    out.append(act(s, "gpt/nll_loss.total_weight", 4, "float32", [], "4"))
    if s["dt"] == "cpu":
        out.append(act(s, "gpt/div.other", 8, "int64", [], "8", "gradient_accumulation_steps, a CPU tensor"))
    if keep_logits:
        out.append(act(s, "lm_head/output", a * Nl, lowp, [B, T, V], f"{a}*B*T*V", "logits held by the training loop"))
    return out
