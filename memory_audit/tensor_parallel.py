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

from .parts import round_block

COLWISE = ("attn.c_attn", "mlp.c_fc")  # weight rows (and bias) split over the ranks
ROWWISE = ("attn.c_proj", "mlp.c_proj")  # weight columns split; the bias stays whole


def tp_size(cfg):
    """Ranks a tensor-parallel run splits each block over (1 for anything else)."""
    return cfg.get("world_size", 1) if str(cfg.get("parallel", "none")).startswith("tp") else 1


def check(cfg):
    """One-line ValueError for a tensor-parallel config that cannot run."""
    t = tp_size(cfg)
    if t > 1 and cfg["n_head"] % t:
        raise ValueError(f"parallel={cfg['parallel']} over {t} ranks needs n_head divisible by {t}, "
                         f"got n_head={cfg['n_head']}")
    if t > 1 and cfg["dropout"] > 0:
        raise ValueError(f"parallel={cfg['parallel']} is built for dropout=0 only")


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
    if part.endswith((".ln_1", ".ln_2")) or part == "ln_f":
        return 1  # sequence parallelism: [B, T, ...]
    if part.endswith(".attn"):
        return 1 if attr.startswith(("softmax", "scaled_dot")) else 0  # [B, nh, ...] or [B*nh, ...]
    return -1  # features: a linear's input or weight copy, the MLP's hidden units


def _whole(key, s, sp):
    """Whether a block's saved tensor stays whole on a rank."""
    part, attr = key.split("/")[1:3]
    if part.endswith((".ln_1", ".ln_2")) or part == "ln_f":
        return not sp
    if not part.startswith("h."):  # embeddings, lm_head, the loss: replicated
        return True
    if part.endswith(COLWISE):
        return attr in ("mm.self", "addmm.mat1")  # the (gathered) input; the weight copy is split
    return attr in ("masked_fill.mask", "mul.other")  # the causal mask and the 1/sqrt(hs) scalar


def shard_lines(s, lines, cfg):
    """Activation lines as one rank of a tensor-parallel run holds them (a block's, or the head's:
    only ln_f's change, with sequence parallelism)."""
    t, sp = tp_size(cfg), cfg.get("parallel") == "tp-sp"
    if t == 1:
        return lines
    return [l if _whole(l["key"], s, sp) else _divided(s, l, t, _split_dim(l["key"])) for l in lines]


def korthikanti(cfg, t):
    """Korthikanti et al. 2022, activation bytes per transformer layer on one rank: tensor
    parallelism sbh(10 + 24/t + 5as/(ht)), with sequence parallelism sbh/t (34 + 5as/h). Their
    accounting: 16-bit activations, 1-byte dropout masks, fp32 nothing."""
    s_, b, h, a = cfg["block_size"], cfg["batch_size"], cfg["n_embd"], cfg["n_head"]
    tp = s_ * b * h * (10 + 24 / t + 5 * a * s_ / (h * t))
    tp_sp = s_ * b * h / t * (34 + 5 * a * s_ / h)
    return {"tp": int(tp), "tp-sp": int(tp_sp)}
