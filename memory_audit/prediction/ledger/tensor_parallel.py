"""Tensor (and sequence) parallelism as rules over the per-block ledger, per rank.

parallelize.py shards each block Megatron-style over t ranks: c_attn and c_fc column-parallel,
the two c_proj row-parallel; with sequence parallelism (tp-sp) the LayerNorms and the residual
stream hold T/t positions. Embeddings, ln_f and the tied lm_head are replicated. What one rank
then holds, line by line (measured on CPU, gloo, 2 ranks):

  weights, grads, Adam state  c_attn/c_fc rows and c_proj columns / t; the rest whole
  attention core              n_head/t heads: q, k, v, scores, softmax / t; the mask whole
  c_proj, GELU, mlp.c_proj    their inputs / t
  c_attn, c_fc inputs         whole: without SP the LayerNorm output is replicated; with SP
                              the all-gathered input is what the linear saves (Megatron-LM
                              saves the shard and gathers again in backward)
  LayerNorms                  whole with tp, / t with tp-sp
  the head                    whole: logits and cross-entropy on every rank

Korthikanti et al.'s per-layer formulas (fp16 activations, dropout masks, their accounting)
are given beside the measured bytes as reconciliation columns, not as predictions.
"""

from .parts import round_block, sequence_parallel, tp_size

COLWISE = ("attn.c_attn", "mlp.c_fc")  # weight rows (and bias) split over the ranks
ROWWISE = ("attn.c_proj", "mlp.c_proj")  # weight columns split; the bias stays whole


def check(cfg):
    """One-line ValueError for a tensor-parallel config that cannot run (train.py, parallelize.py
    and the predictor ask the same rule)."""
    p, world, given = cfg.get("parallel", "none"), cfg.get("world_size", 1), cfg.get("tp_size", 0)
    if "tp" in p and p.startswith("fsdp") and not given:
        raise ValueError(f"parallel={p} needs tp_size, the ranks of one tensor-parallel group (e.g. --tp_size=2)")
    if "tp" in p and p.startswith("tp") and given not in (0, world):
        raise ValueError(f"parallel={p} runs over every rank (tp_size={given} but the world size is {world}); "
                         f"parallel=fsdp+{p} combines a tensor-parallel group with FSDP2 across groups")
    if given < 0 or given and world % given:
        raise ValueError(f"tp_size={given} does not divide the world size {world}")
    t = tp_size(cfg)
    if t > 1 and cfg["n_head"] % t:
        raise ValueError(f"parallel={cfg['parallel']} over {t} ranks needs n_head divisible by {t}: "
                         f"n_head={cfg['n_head']} is not divisible by {t}")
    if t > 1 and cfg.get("dropout", 0.0) > 0:
        raise ValueError(f"parallel={cfg['parallel']} is built for dropout=0 only (each rank would need "
                         "its own attention-dropout RNG stream)")
    if cfg.get("parallel") == "tp-sp" and cfg.get("set_to_none", True) is False:  # at world size 1 too
        # (under fsdp+tp-sp FSDP2 reduce-scatters them into shards, which zero_ takes: it trains)
        raise ValueError("parallel=tp-sp needs set_to_none=True: the sequence-parallel LayerNorms' "
                         "gradients are Partial DTensors, which zero_grad cannot zero in place")


def local_shape(name, shape, t):
    """The shape of parameter `name` one rank holds."""
    if t == 1 or ".h." not in name:
        return shape
    mod = name.rsplit(".", 1)[0]
    if mod.endswith(COLWISE):
        return [shape[0] // t] + shape[1:]
    if mod.endswith(ROWWISE) and name.endswith(".weight"):
        return [shape[0], shape[1] // t]
    return shape


def _divided(s, l, t, dim):
    """A line whose tensor this rank holds 1/t of, split along `dim` of its shape."""
    n = l["bytes"] // t
    shape = list(l["shape"])
    if shape:
        shape[dim] //= t
    return {**l, "bytes": n, "allocated": round_block(n, s["dt"]), "shape": shape, "formula": f"({l['formula']})/t"}


def _split_dim(key):
    """Which dimension of a saved tensor's shape tensor parallelism splits."""
    part, attr = key.split("/")[1:3]
    if part.endswith((".ln_1", ".ln_2")) or part == "ln_f" or attr == "checkpoint.input" and "." not in part[2:]:
        return 1  # sequence parallelism: [B, T, ...]
    if part.endswith(".attn"):
        return 1 if attr.startswith(("softmax", "scaled_dot")) else 0  # [B, nh, ...] or [B*nh, ...]
    return -1  # features: a linear's input or weight copy, the MLP's hidden units


def _whole(key, sp):
    """Whether a block's saved tensor stays whole on a rank."""
    part, attr = key.split("/")[1:3]
    if part.endswith((".ln_1", ".ln_2")) or part == "ln_f" or "." not in part[2:] and attr == "checkpoint.input":
        return not sp  # the LayerNorms and the residual stream (a checkpointed block's input)
    if not part.startswith("h."):  # embeddings, lm_head, the loss: replicated
        return True
    if part.endswith(ROWWISE) and ".sac_output" in attr:  # a row-parallel matmul's partial sum: whole
        return True
    if part.endswith(COLWISE):
        return attr in ("mm.self", "addmm.mat1")  # the (gathered) input; the weight copy is split
    return attr in ("masked_fill.mask", "mul.other")  # the causal mask and the 1/sqrt(hs) scalar


def shard_lines(s, lines, cfg):
    """Activation lines as one rank of a tensor-parallel run holds them (a block's, or the head's:
    only ln_f's change, with sequence parallelism)."""
    t, sp = tp_size(cfg), sequence_parallel(cfg)
    if t == 1:
        return lines
    return [l if _whole(l["key"], sp) else _divided(s, l, t, _split_dim(l["key"])) for l in lines]


# -- Korthikanti et al. 2022 as reconciliation columns ------------------------------------------

TERMS = ("whole", "split", "scores", "outside")
PAPER = {  # bytes per layer on one rank, s = T, b = B, h = d, a = n_head
    "tp": {"whole": "10sbh", "split": "24sbh/t", "scores": "5as^2b/t"},
    "tp-sp": {"whole": "10sbh/t", "split": "24sbh/t", "scores": "5as^2b/t"},
}
PER_LAYER = {"tp": "sbh(10+24/t+5as/(ht))", "tp-sp": "sbh/t(34+5as/h)"}
WHY = {
    "whole": "their 2-byte LayerNorm inputs (ours: the fp32 residual stream, 4 B) and 1-byte dropout masks "
             "(ours: dropout=0); with SP, PyTorch's column-parallel linears save the all-gathered input "
             "(Megatron-LM saves the T/t shard and gathers again in backward)",
    "split": "q, k, v, c_proj's input, GELU's input and output at this run's activation dtype (theirs: "
             "2 B, as bf16/fp16 autocast; fp32: 4 B)",
    "scores": "softmax output (ours: fp32 on CUDA autocast) with dropout's mask and output (theirs); "
              "SDPA keeps no T^2 tensor",
    "outside": "not in the formula: the causal mask (T^2 bool, every rank), LayerNorm mean/rstd, SDPA's "
               "logsumexp, CPU scalars",
}


def term(key):
    """Which of Korthikanti's per-layer terms a block's saved tensor belongs to."""
    part, attr = key.split("/")[1:3]
    if attr.startswith(("native_layer_norm.result", "mul.other", "masked_fill", "scaled_dot_product")) \
            and not attr.endswith((".key", ".output")) or "philox" in attr:
        return "outside"
    if part.endswith(".attn") and attr.startswith(("softmax", "safe_softmax", "bmm.self#2", "native_dropout")):
        return "scores"
    return "whole" if _whole(key, sp=False) else "split"  # LayerNorm inputs are "whole" in both formulas


def paper_bytes(cfg, t, sp):
    """Korthikanti et al.'s per-layer terms for this shape, in their accounting (16-bit)."""
    s_, b, h, a = cfg["block_size"], cfg["batch_size"], cfg["n_embd"], cfg["n_head"]
    return {"whole": 10 * s_ * b * h // (t if sp else 1), "split": 24 * s_ * b * h // t,
            "scores": 5 * a * s_ * s_ * b // t, "outside": 0}


def korthikanti_rows(cfg, predicted, actual):
    """Rows [term, paper formula, paper bytes, predicted, actual, why they differ] for one layer on
    one rank; predicted/actual: {activation key of block 0: bytes}."""
    t, sp = tp_size(cfg), sequence_parallel(cfg)
    paper = paper_bytes(cfg, t, sp)
    formulas = PAPER["tp-sp" if sp else "tp"]
    sums = []
    for side in (predicted, actual):
        mine = dict.fromkeys(TERMS, 0)
        for key, n in side.items():
            mine[term(key)] += n or 0
        sums.append(mine)
    rows = [[k, formulas.get(k, "-"), paper[k], sums[0][k], sums[1][k], WHY[k]] for k in TERMS]
    rows.append(["per layer", PER_LAYER["tp-sp" if sp else "tp"], sum(paper.values()),
                 sum(sums[0].values()), sum(sums[1].values()), ""])
    return rows


def comm_bytes(cfg, params):
    """Bytes one rank sends per optimizer step (ring algorithms; an estimate, not measured), with
    `params` the parameters this rank holds and m its micro-steps:
      ddp     all-reduces the fp32 gradients once: 2(w-1)/w * 4N;
      fsdp    all-gathers its shard in each micro-step's forward and backward and
              reduce-scatters the gradients once, over d = w/t ranks: (2m+1)(d-1) * 4*params;
      tp      moves each block's activations four times a micro-step (two all-reduces forward,
              two backward; SP's all-gather/reduce-scatter pairs send the same):
              4 * 2(t-1)/t * a*B*T*d per layer and micro-step."""
    w, p = cfg.get("world_size", 1), cfg.get("parallel", "none")
    if w == 1 or p == "none":
        return 0
    if p == "ddp":
        return 2 * (w - 1) * 4 * params // w
    t, m = tp_size(cfg), cfg["gradient_accumulation_steps"]
    out = (2 * m + 1) * (w // t - 1) * 4 * params if p.startswith("fsdp") else 0
    if t > 1:
        a = 4 if cfg["dtype"] == "float32" else 2
        per_layer = 4 * 2 * (t - 1) * a * cfg["batch_size"] * cfg["block_size"] * cfg["n_embd"] // t
        out += per_layer * cfg["n_layer"] * m
    return out
