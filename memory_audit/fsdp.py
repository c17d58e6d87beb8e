"""FSDP2 (fully_shard on each block, then the root) as rules over the ledger, per rank.

train.py's parallel=fsdp shards every parameter along dim 0 over t ranks, padded so that each
rank holds ceil(dim0 / t) rows: weights, gradients and Adam state are those padded shards. What
else one rank holds (measured on CPU, gloo, 2 ranks, cpu-tiny):

  before backward   the root's parameters (wte = lm_head, wpe, ln_f) stay unsharded after the
                    forward: weights/<name>/unsharded, whole; with more than one micro-step per
                    rank the gradients accumulate whole (set_requires_gradient_sync(False)):
                    grads/<name>/unsharded, and no shards until the last backward
  start of backward the last block's all-gather buffer (every parameter of the unit, whole):
                    temporary/fsdp_all_gather, on top of cross-entropy's gradients

The reduce-scatter's buffers and the other blocks' all-gathers come later in backward, after
the logits' gradients are gone: on cpu-tiny they do not reach the peak (not modelled further).
"""

from .parts import line, numel
from .tensor_parallel import tp_size

PEAK = ("peak",)


def shards(cfg):
    """Ranks a fully_shard run splits each parameter over: the world, or with fsdp+tp the
    tensor-parallel groups (0 for anything else: FSDP2 on one rank still unshards into buffers
    of its own)."""
    if not str(cfg.get("parallel", "none")).startswith("fsdp"):
        return 0
    return cfg.get("world_size", 1) // tp_size(cfg)


def check(cfg):
    """One-line ValueError for an FSDP2 config the predictor does not model."""
    if shards(cfg) and cfg.get("activation_checkpointing", "none") != "none":
        raise ValueError("parallel=fsdp with activation checkpointing is not modelled yet")


def local_shape(shape, t):
    """The padded shard of a parameter one rank holds: ceil(dim0 / t) rows."""
    return shape if t <= 1 else [-(-shape[0] // t)] + list(shape[1:])


def sharded_grad_phases(cfg, phases):
    """The phases a rank's gradient shards (p.grad) are allocated in: before the last micro-step's
    backward, FSDP2 has reduce-scattered nothing yet, so with set_to_none they do not exist."""
    if not shards(cfg) or cfg.get("set_to_none", True) is False:
        return phases
    return [p for p in phases if p != "step2_before_backward"]


def unsharded(s, cfg, params):
    """Before backward: the root unit's parameters, unsharded from its forward to the end of
    backward, and the whole gradients of the earlier micro-steps (no reduce-scatter until the
    last one's backward). params: (name, shape) as FSDP2 shards them (tensor-parallel local)."""
    if not shards(cfg):
        return []
    bb = ("step2_before_backward",)
    out = [line(s, f"weights/{n}/unsharded", 4 * numel(sh), "float32", sh, "4*numel (unsharded)",
                bb, "the root keeps its parameters unsharded after the forward")
           for n, sh in params if not n.startswith("transformer.h.")]
    if cfg["gradient_accumulation_steps"] > 1:
        out += [line(s, f"grads/{n}/unsharded", 4 * numel(sh), "float32", sh, "4*numel (unsharded)", bb,
                     "accumulated whole until the last micro-step's reduce-scatter") for n, sh in params]
    return out


def backward_all_gather(s, cfg, params):
    """The all-gather buffer of the last block, made at the start of backward."""
    t = shards(cfg)
    if t <= 1:  # one rank: no all-gather buffer at the peak (measured on CPU)
        return []
    last = f"transformer.h.{cfg['n_layer'] - 1}."
    n = t * sum(numel(local_shape(sh, t)) for name, sh in params if name.startswith(last))
    return [line(s, "temporary/fsdp_all_gather", 4 * n, "float32", [n], "4*t*(padded shards of the last block)",
                 PEAK, "FSDP2 unshards the last block for its backward")]
