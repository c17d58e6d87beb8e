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


def _block_numel(params, b, t):
    """Elements of block b's parameters as FSDP2 lays them out: t padded shards."""
    return t * sum(numel(local_shape(sh, t)) for name, sh in params if name.startswith(f"transformer.h.{b}."))


def _gathered(s, params, j, t, why):
    return line(s, f"temporary/fsdp_all_gather/h.{j}", 4 * _block_numel(params, j, t), "float32", [],
                "4*t*(padded shards of the block)", PEAK, why)


def _root_grads(s, cfg, params, t):
    """ln_f's gradient inside the blocks' backward: whole, as the root reduce-scatters only
    after the embeddings. With set_to_none its shard is already counted with the later blocks'
    gradients; with accumulation it is whole already (grads/<name>/unsharded)."""
    if cfg["gradient_accumulation_steps"] > 1:
        return []
    fresh = cfg.get("set_to_none", True)
    return [line(s, "grads/transformer.ln_f/whole", 4 * (numel(sh) - fresh * numel(local_shape(sh, t))),
                 "float32", [], "4*(numel - shard)" if fresh else "4*numel", PEAK,
                 "the root's gradients stay whole until its reduce-scatter")
            for name, sh in params if name.startswith("transformer.ln_f.")]


def _reduced(s, cfg, params, b, t):
    """After the later blocks' reduce-scatters: block b+1's input buffer (its whole gradients),
    kept until the next reduce-scatter (reduce_scatter_max_input_buffers = 1); with
    accumulation the whole gradients of every later block are gone, their shards made."""
    L, out = cfg["n_layer"], []
    if b + 1 < L:
        n = _block_numel(params, b + 1, t)
        out.append(line(s, f"temporary/fsdp_reduce_scatter/h.{b + 1}", 4 * n, "float32", [n],
                        "4*t*(padded shards of the block)", PEAK, "the previous block's whole gradients"))
    if cfg["gradient_accumulation_steps"] > 1:  # with set_to_none the shards are new
        for j in range(b + 1, L):
            mine = [(numel(sh), numel(local_shape(sh, t))) for n, sh in params if n.startswith(f"transformer.h.{j}.")]
            whole, shard = sum(w for w, _ in mine), sum(p for _, p in mine) * cfg.get("set_to_none", True)
            out.append(line(s, f"released/grads/h.{j}/unsharded", 4 * (shard - whole), "float32", [],
                            "4*(shard - numel)", PEAK, "reduce-scattered: whole gradients freed, shards made"))
    return out


def during(s, cfg, params, moment):
    """What FSDP2 adds at a peak candidate a lever makes, as changes from the before-backward
    ledger. moment "forward end" (cross-entropy, inside the root's forward): the last block's
    all-gathered parameters, which FSDP2's all-gather state keeps until the root's forward
    ends. moment b (inside checkpointed block b's backward): block b's all-gathered parameters
    and block b-1's, prefetched when b's backward began (moment ("entry", b): while that
    prefetch runs, with gloo's staging copy on CPU), what the later blocks' reduce-scatters
    left (_reduced) and the root's gradients (_root_grads). params: (name, shape) as FSDP2
    shards them."""
    t = shards(cfg)
    if not t:
        return []
    if moment == "forward end":
        return [_gathered(s, params, cfg["n_layer"] - 1, t, "kept by FSDP2's all-gather state")]
    if moment == "wte":
        return _at_backward_end(s, cfg, params, t)
    b = moment[1] if isinstance(moment, tuple) else moment
    out = [_gathered(s, params, b, t, "this block's parameters, unsharded")]
    if b > 0:
        out.append(_gathered(s, params, b - 1, t, "prefetched for the next backward"))
    if isinstance(moment, tuple) and s["dt"] == "cpu" and b > 0:  # gloo all-gathers into a buffer of its own
        out.append(line(s, f"temporary/gloo_all_gather/h.{b - 1}", 4 * _block_numel(params, b - 1, t), "float32", [],
                        "4*t*(padded shards of the block)", PEAK, "gloo's staging copy, while the prefetch runs"))
    return out + _reduced(s, cfg, params, b, t) + _root_grads(s, cfg, params, t)


def _at_backward_end(s, cfg, params, t):
    """The gradients as the token embedding's backward runs (the root's last node): every block
    reduce-scattered (with set_to_none its shards new, one buffer a unit; accumulated whole ones
    freed), block 0's reduce-scatter input kept until the next one (the root's, after this), the
    root's other gradients whole (new, unless accumulated whole already). params: (name, shape)
    as FSDP2 shards them."""
    acc, fresh, out = cfg["gradient_accumulation_steps"] > 1, cfg.get("set_to_none", True), []
    for j in range(cfg["n_layer"]):
        mine = [(numel(sh), numel(local_shape(sh, t))) for n, sh in params if n.startswith(f"transformer.h.{j}.")]
        change = 4 * (fresh * sum(p for _, p in mine) - acc * sum(w for w, _ in mine))
        out.append(line(s, f"grads/h.{j}/reduce_scattered", change, "float32", [], "4*(shards*set_to_none - whole*accumulated)",
                        PEAK, "its shards made, its whole gradients (accumulated) freed"))
    n0 = _block_numel(params, 0, t)
    out.append(line(s, "temporary/fsdp_reduce_scatter/h.0", 4 * n0, "float32", [n0], "4*t*(padded shards of the block)",
                    PEAK, "block 0's reduce-scatter input, kept until the root's"))
    if not acc:
        root = [(n, sh) for n, sh in params if not n.startswith("transformer.h.") and n != "transformer.wte.weight"]
        out += [line(s, f"grads/{n}/whole", 4 * numel(sh), "float32", sh, "4*numel", PEAK,
                     "the root's gradients stay whole until its reduce-scatter") for n, sh in root]
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
