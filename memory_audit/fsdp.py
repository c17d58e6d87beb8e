"""FSDP2 (fully_shard on each block, then the root) as rules over the ledger, per rank.

train.py's parallel=fsdp shards every parameter along dim 0 over t ranks, padded so that each
rank holds ceil(dim0 / t) rows: weights, gradients and Adam state are those padded shards. What
else one rank holds (measured on CPU, gloo, 2 ranks, cpu-tiny):

  before backward   the root's parameters (wte = lm_head, wpe, ln_f) stay unsharded after the
                    forward: weights/<name>/unsharded, whole
  start of backward the last block's all-gather buffer (every parameter of the unit, whole):
                    temporary/fsdp_all_gather, on top of cross-entropy's gradients

The reduce-scatter's buffers and the other blocks' all-gathers come later in backward, after
the logits' gradients are gone: on cpu-tiny they do not reach the peak (not modelled further).
"""

from .parts import line, numel

PEAK = ("peak",)


def shards(cfg):
    """Ranks a fully_shard run splits each parameter over (0 for anything else: FSDP2 on one rank
    still unshards into buffers of its own)."""
    return cfg.get("world_size", 1) if cfg.get("parallel") == "fsdp" else 0


def check(cfg):
    """One-line ValueError for an FSDP2 config the predictor does not model."""
    if shards(cfg) and cfg.get("activation_checkpointing", "none") != "none":
        raise ValueError("parallel=fsdp with activation checkpointing is not modelled yet")


def local_shape(shape, t):
    """The padded shard of a parameter one rank holds: ceil(dim0 / t) rows."""
    return shape if t <= 1 else [-(-shape[0] // t)] + list(shape[1:])


def unsharded_root(s, cfg, params):
    """The root unit's parameters, unsharded from its forward to the end of backward."""
    if not shards(cfg):
        return []
    return [line(s, f"weights/{n}/unsharded", 4 * numel(sh), "float32", sh, "4*numel (unsharded)",
                 ("step2_before_backward",), "the root keeps its parameters unsharded after the forward")
            for n, sh in params if not n.startswith("transformer.h.")]


def backward_all_gather(s, cfg, params):
    """The all-gather buffer of the last block, made at the start of backward."""
    t = shards(cfg)
    if t <= 1:  # one rank: no all-gather buffer at the peak (measured on CPU)
        return []
    last = f"transformer.h.{cfg['n_layer'] - 1}."
    n = t * sum(numel(local_shape(sh, t)) for name, sh in params if name.startswith(last))
    return [line(s, "temporary/fsdp_all_gather", 4 * n, "float32", [n], "4*t*(padded shards of the last block)",
                 PEAK, "FSDP2 unshards the last block for its backward")]
