"""FSDP2 (fully_shard on each block, then the root) as rules over the ledger, per rank.

train.py's parallel=fsdp shards every parameter along dim 0 over t ranks, padded so that each
rank holds ceil(dim0 / t) rows: weights, gradients and Adam state are those padded shards. What
else one rank holds (measured on CPU, gloo, 2 ranks, cpu-tiny):

  before backward   the root's parameters (wte = lm_head, wpe, ln_f) stay unsharded after the
                    forward: weights/<name>/unsharded, whole; with more than one micro-step per
                    rank the gradients accumulate whole (set_requires_gradient_sync(False)):
                    grads/<name>/unsharded, and no shards until the last backward

The all-gather and reduce-scatter buffers of backward, and when each is let go, are the shadow
run's (shadow/distributed): these lines are the ledger's steady and before-backward ones.
"""

from .parts import line, numel
from .tensor_parallel import tp_size


def shards(cfg):
    """Ranks a fully_shard run splits each parameter over: the world, or with fsdp+tp the
    tensor-parallel groups (0 for anything else: FSDP2 on one rank still unshards into buffers
    of its own)."""
    if not str(cfg.get("parallel", "none")).startswith("fsdp"):
        return 0
    return cfg.get("world_size", 1) // tp_size(cfg)


def local_shape(shape, t):
    """The padded shard of a parameter one rank holds: ceil(dim0 / t) rows."""
    return shape if t <= 1 else [-(-shape[0] // t)] + list(shape[1:])


def own_shape(shape, cfg):
    """The rows of a parameter this rank owns, unpadded: FSDP2's local tensor (a narrow of the
    padded shard), which the optimizer's state follows (zeros_like). The last ranks may own
    fewer rows than the padded ceil(dim0 / t), or none."""
    t = shards(cfg)
    if t <= 1:
        return shape
    rows = -(-shape[0] // t)
    i = cfg.get("rank", 0) // tp_size(cfg)  # this rank's place along the mesh's dp dimension
    return [max(0, min(rows, shape[0] - i * rows))] + list(shape[1:])


def unit(name):
    """The fully_shard unit a parameter belongs to: its block, or the root."""
    return ".".join(name.split(".")[:3]) if name.startswith("transformer.h.") else "root"


def kept_grad_lines(s, cfg, params, phases):
    """Gradient shards kept across steps (set_to_none=False): FSDP2 made each as a view into its
    unit's reduce-scatter output the first time and accumulates into it since, so one buffer per
    unit holds them, padded: grads/<unit>/shards. params: (name, padded local shape)."""
    units = {}
    for name, sh in params:
        units[unit(name)] = units.get(unit(name), 0) + numel(sh)
    return [line(s, f"grads/{u}/shards", 4 * n, "float32", [n], "4*(padded shards of the unit)", phases,
                 "the unit's first reduce-scatter output; the shards are views into it") for u, n in units.items()]


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
    bb, t = ("step2_before_backward",), shards(cfg)
    out = [line(s, f"weights/{n}/unsharded", 4 * t * numel(local_shape(sh, t)), "float32", sh,
                "4*t*(padded shard)", bb, "the root keeps its parameters unsharded after the forward, "
                "views into its all-gather output (t padded shards)")
           for n, sh in params if not n.startswith("transformer.h.")]
    if cfg["gradient_accumulation_steps"] > 1:
        out += [line(s, f"grads/{n}/unsharded", 4 * numel(sh), "float32", sh, "4*numel (unsharded)", bb,
                     "accumulated whole until the last micro-step's reduce-scatter") for n, sh in params]
    return out
