"""Will it fit, and what to change if not: the predicted reserved memory against the card.

What makes a job fail is the allocator's reserved memory (segments with their unused tails:
prediction.predict.prediction(): the step's trace replayed through the caching allocator's model)
plus what CUDA holds
outside PyTorch, against the card's memory. `need` is that sum; `fit_result` finds the largest batch whose need fits;
`plan` ranks the levers that make a config fit by their predicted cost.

Cost is extra work per optimizer step as a fraction of the step's FLOPs (forward + backward =
3x the forward's matmul FLOPs): activation checkpointing reruns `recompute_flops`. Splitting a
batch into micro-batches adds no FLOPs; it is charged MICRO_BATCH_COST per doubling of
gradient_accumulation_steps for its smaller, less efficient GEMMs: an assumption, not a
measurement. attention=sdpa and expandable_segments cost nothing here (SDPA is faster).
Parallel options (with --world_size=N: tp, tp-sp, fsdp, fsdp+tp-sp) are judged per rank and carry
the bytes each rank sends per step (tensor_parallel.comm_bytes) instead of a FLOP cost: they need
N GPUs and a fast link.
"""

from ..prediction.predict import DEFAULTS, prediction
from ..prediction.ledger.tensor_parallel import check, comm_bytes
from .workers import mapped

MICRO_BATCH_COST = 0.05  # assumed slowdown per doubling of gradient_accumulation_steps
AC_MODES = ("selective", "sac", "full")


def need(cfg, dev):
    """{allocated, reserved, outside, total, recompute_flops, forward_flops, from, unmeasured}: the
    predicted bytes of prediction() (compile=True: inductor's plan, which on CUDA needs a GPU) and
    the rules it applied that no GPU trace has measured."""
    t = prediction(cfg, dev)["totals"]
    outside = t["outside_pytorch_bytes"]
    return {"allocated": t["peak_allocated_bytes"], "reserved": t["reserved_peak_bytes"], "outside": outside,
            "total": t["reserved_peak_bytes"] + outside, "recompute_flops": t["recompute_flops"],
            "forward_flops": t["forward_flops"], "comm_bytes": comm_bytes(dict(DEFAULTS, **cfg), t["params"]),
            "from": t["from"], "unmeasured": t.get("unmeasured_on_gpu", [])}


def budget(dev, headroom):
    return int(dev["total_memory"] * (1 - headroom))


def fit_result(cfg, dev, headroom):
    """The largest batch (and power-of-two block) whose predicted need fits the GPU, as a dict."""
    limit = budget(dev, headroom)
    seen = {}

    def total(b, t):
        if (b, t) not in seen:
            seen[b, t] = need(dict(cfg, batch_size=b, block_size=t), dev)
        return seen[b, t]["total"]

    t = cfg.get("block_size", 1024)
    out = {"gpu": dev["gpu"], "total_memory": dev["total_memory"], "headroom": headroom, "budget": limit,
           "decides_by": "predicted memory_reserved() + memory outside PyTorch", "block_size": t,
           "batch_1_need": total(1, t), "outside_pytorch": seen[1, t]["outside"], "from": seen[1, t]["from"]}
    out["fits"] = out["batch_1_need"] <= limit
    if not out["fits"]:
        return out
    lo, hi = 1, 2
    while total(hi, t) <= limit and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid, t) <= limit else (lo, mid)
    tb, b = t, cfg.get("batch_size", 1)
    while total(b, tb * 2) <= limit and tb < 1 << 20:
        tb *= 2
    out.update({"largest_batch_size": lo, "its_need": total(lo, t), "next_batch_need": total(lo + 1, t),
                "batch_size": b, "largest_pow2_block_size": tb})
    return out


def candidates(cfg):
    """[(name, overrides)] of the levers to try on `cfg`, alone and combined."""
    ac = [(f"activation_checkpointing={m}", {"activation_checkpointing": m}) for m in AC_MODES
          if cfg.get("activation_checkpointing", "none") == "none"]
    attn = [("attention=sdpa", {"attention": "sdpa"})] if cfg.get("attention", "manual") == "manual" else []
    out = attn + ac + [(f"{a} + {n}", dict(o, **ao)) for a, ao in attn for n, o in ac]
    b, k = cfg.get("batch_size", 12), cfg.get("gradient_accumulation_steps", 1)
    split = 2
    while b % split == 0 and split <= b:
        mb = {"batch_size": b // split, "gradient_accumulation_steps": k * split}
        out.append((f"micro-batch {b // split} x {k * split} accumulation", mb))
        out += [(f"micro-batch {b // split} x {k * split} + {a}", dict(mb, **ao)) for a, ao in attn]
        split *= 2
    out.append(("expandable_segments:True", {"expandable_segments": True}))
    return out + parallel_candidates(cfg)


def parallel_candidates(cfg):
    """With --world_size=N ranks and parallel=none: tensor parallelism over them (heads split,
    dropout 0), alone and with sequence parallelism; FSDP2 over them (no checkpointing); and
    FSDP2 across tensor-parallel groups of each size k that divides N. Each rank keeps the
    config's micro-batch and micro-steps, so data-parallel options take N/k times the tokens per
    step. Each rank's memory is what `need` judges."""
    n = cfg.get("world_size", 1)
    if n == 1 or cfg.get("parallel", "none") != "none":
        return []
    out = []
    if cfg.get("activation_checkpointing", "none") == "none":
        out.append((f"fsdp over {n} ranks", {"parallel": "fsdp"}))
    for p, k in [("tp", n), ("tp-sp", n)] + [("fsdp+tp-sp", k) for k in range(2, n) if n % k == 0]:
        if p.startswith("fsdp") and cfg.get("activation_checkpointing", "none") != "none":
            continue
        try:
            check({**DEFAULTS, **cfg, "parallel": p, "tp_size": k})
        except ValueError:  # heads not divisible, dropout
            continue
        out.append((f"{p} over {n} ranks" + (f" (tp_size={k})" if k < n else ""), {"parallel": p, "tp_size": k}))
    return out


def _option(name, cfg, overrides, dev, limit, base_flops, needs):
    c, d = _asked(cfg, overrides, dev)
    n = needs(c, d)
    extra = n["recompute_flops"] / (3 * base_flops) if base_flops else 0.0
    doublings = (c.get("gradient_accumulation_steps", 1) // max(cfg.get("gradient_accumulation_steps", 1), 1)).bit_length() - 1
    return {"option": name, "overrides": overrides, "allocated_peak": n["allocated"], "reserved_peak": n["reserved"],
            "outside_pytorch": n["outside"], "need": n["total"], "fits": n["total"] <= limit,
            "headroom_bytes": limit - n["total"], "recompute_flops": n["recompute_flops"],
            "extra_flops_fraction": round(extra, 4), "comm_bytes_per_step": n["comm_bytes"],
            "cost": round(extra + MICRO_BATCH_COST * doublings, 4), "from": n["from"], "unmeasured": n["unmeasured"]}


def plan(cfg, dev, headroom, jobs=None):
    """{"budget", "baseline": {..., "fits"}, "options": [{..., "fits"}, ...]}: the options that fit
    first, cheapest first (one GPU before several); then the others, smallest need first. jobs:
    the options' shadow runs on that many forked workers (workers.py; default every CPU)."""
    limit = budget(dev, headroom)
    todo = candidates(cfg)
    groups = {}  # one task per config: its allocator settings replay the same step (shadow/step._LAST)
    for c, d in [(cfg, dev)] + [_asked(cfg, o, dev) for _, o in todo]:
        groups.setdefault(repr(sorted(c.items())), {})[_key(c, d)] = (c, d)
    tasks = sorted(groups.values(), key=lambda g: -_work(next(iter(g.values()))[0]))  # the longest first
    seen = {}
    for group, needs in zip(tasks, mapped(_needs, [list(g.values()) for g in tasks], jobs)):
        seen.update(zip(group, needs))

    def needs(c, d):
        return seen[_key(c, d)]
    base = needs(cfg, dev)
    baseline = _option("baseline", cfg, {}, dev, limit, base["forward_flops"], needs)
    options = [_option(name, cfg, o, dev, limit, base["forward_flops"], needs) for name, o in todo]
    # more GPUs are a bigger change than any single-GPU lever: parallel options come after those that fit
    options.sort(key=lambda o: (not o["fits"], "parallel" in o["overrides"] if o["fits"] else False,
                                o["cost"] if o["fits"] else o["need"], o["need"]))
    return {"gpu": dev["gpu"], "total_memory": dev["total_memory"], "headroom": headroom, "budget": limit,
            "baseline": baseline, "options": options}


def _asked(cfg, overrides, dev):
    """(config, device) an option is judged at: allocator settings go to the device."""
    d = dict(dev, expandable_segments=overrides.get("expandable_segments", dev.get("expandable_segments", False)))
    return dict(cfg, **{k: v for k, v in overrides.items() if k != "expandable_segments"}), d


def _key(c, d):
    return repr((sorted(c.items()), sorted(d.items())))


def _needs(asked):
    return [need(*args) for args in asked]


def _work(c):
    """A rough size of an option's shadow run, to hand the longest out first (a rank's strategy
    runs its blocks one by one: no repeat)."""
    return (c.get("gradient_accumulation_steps", 1) * (2 if c.get("activation_checkpointing", "none") != "none" else 1)
            * (4 if c.get("parallel", "none") != "none" else 1))


def smallest_miss(result):
    """The one line for a config no option can fit."""
    o = min([result["baseline"]] + result["options"], key=lambda o: o["need"])
    return (f"nothing fits in {result['budget']:,} B ({result['gpu']}): the smallest option, {o['option']}, "
            f"needs {o['need']:,} B, {o['need'] - result['budget']:,} B too many")
