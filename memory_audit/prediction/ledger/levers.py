"""Levers as rules over the per-block ledger: activation checkpointing (full, selective, SAC).

A rule takes the lines one block saves in an eager forward (parts.block) and returns what the
block keeps until backward and what its backward recomputes:

  full       keeps the block's input (`checkpoint.input`, the fp32 residual stream); recomputes
             everything the block saved
  selective  keeps everything outside the attention core plus the core's inputs (q, k, v: one
             storage, c_attn's output); recomputes the core (Korthikanti's selective recomputation)
  sac        keeps the block's input and the outputs of the ops in sac_save_ops; recomputes what
             the block saved (outputs SAC kept are handed back, not allocated again)

What the graph node holds itself (`graph` lines: CPU's wrapped scalars) stays under every rule.
Recompute cost is counted in matmul FLOPs (2*m*n*k per product; pointwise ops left out).
"""

from .parts import act, linear_input_key, materialized_scores, sdpa_kernel
from ...schema import sac_ops

# the ops whose outputs the SAC rule knows in this model; anything else is refused, not guessed
SAC_MODELLED = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu", "gelu", "relu")


def block_mode(cfg, i):
    """The checkpointing mode of block i: every ac_every-th block, counting from block 0."""
    mode = cfg.get("activation_checkpointing", "none")
    return mode if i % cfg.get("ac_every", 1) == 0 else "none"


def checkpoint_input(s, i):
    B, T, d = s["B"], s["T"], s["d"]
    return act(s, f"h.{i}/checkpoint.input", 4 * s["Ne"], "float32", [B, T, d], "4*B*T*d",
               "block input (fp32 residual stream), kept by torch.utils.checkpoint")


# torch.get_rng_state(): the CPU generator's (mt19937) state, a uint8 tensor of this size
CPU_RNG_STATE_BYTES = 5056


def rng_state(s, region):
    """What a checkpointed region keeps to replay its dropout masks: the CPU generator's state
    (on CUDA runs that is host memory, and the device's own state is a host tensor too)."""
    if not (s["drop"] and s["dt"] == "cpu"):
        return []
    return [act(s, f"{region}/checkpoint.rng_state", CPU_RNG_STATE_BYTES, "uint8", [CPU_RNG_STATE_BYTES],
                str(CPU_RNG_STATE_BYTES), "torch.get_rng_state(), kept by torch.utils.checkpoint for dropout")]


def _core_input(s, i):
    B, T, d, nh, a = s["B"], s["T"], s["d"], s["nh"], s["a"]
    return act(s, f"h.{i}.attn/checkpoint.input", a * 3 * s["Ne"], s["lowp"], [B, nh, T, d // nh],
               f"{a}*3*B*T*d", "q, k, v: views of c_attn's output, kept by torch.utils.checkpoint")


def selective(s, i, lines):
    """Keep what lies outside the attention core, the core's inputs, and aliases still saved."""
    kept, seen_core = [], False
    for l in lines:
        if l.get("region") != "core" or l.get("graph"):
            kept.append(l)
            continue
        if not seen_core:
            kept += rng_state(s, f"h.{i}.attn") + [_core_input(s, i)]
            seen_core = True
        if l.get("alias"):  # the same storage, now first saved by the op outside the core
            kept.append(dict(l, key=l["alias"], region="", alias="",
                             note="attention output, saved by c_proj (the core is recomputed)"))
    return kept, {"new": [l for l in lines if l.get("region") == "core" and not l.get("graph")
                          and l.get("input_alias") != "core"], "freed": []}


def sac_outputs(s, i):
    """[(op, line)] of every output block i's forward produces by an op SAC may keep, in order."""
    B, T, d, nh, Ne, Na, a, lowp = (s[k] for k in ("B", "T", "d", "nh", "Ne", "Na", "a", "lowp"))
    h, mm = f"h.{i}", "addmm" if s["bias"] else "mm"
    out = []

    def add(op, mod, nbytes, dtype, shape, formula, suffix="", feeds=""):
        """feeds: the saved line that is this same storage (recomputing it allocates nothing)."""
        out.append((op, act(s, f"{mod}/{op}.sac_output{suffix}", nbytes, dtype, shape, formula, "kept by SAC",
                            feeds=feeds)))

    math = materialized_scores(s)  # manual attention, or math SDPA (which computes in fp32)
    backend, sd = sdpa_kernel(s, s["autocast"])
    add(mm, f"{h}.attn.c_attn", a * 3 * Ne, lowp, [B * T, 3 * d], f"{a}*3*B*T*d",
        feeds="" if math else f"activations/{h}.attn/{sd}.key")
    if math:
        w, dt = (a, lowp) if s["attention"] == "manual" else (4, "float32")
        add("bmm", f"{h}.attn", w * Na, dt, [B * nh, T, T], f"{w}*B*n_head*T^2")
        add("bmm", f"{h}.attn", w * Ne, dt, [B * nh, T, d // nh], f"{w}*B*T*d")
    else:
        add("_" + sd, f"{h}.attn", a * Ne, lowp, [B, nh, T, d // nh], f"{a}*B*T*d", "0",
            feeds=f"activations/{h}.attn/{sd}.output")
        add("_" + sd, f"{h}.attn", 4 * B * nh * T, "float32", [B, nh, T], "4*B*n_head*T", "1",
            feeds=f"activations/{h}.attn/{sd}.{'log_sumexp' if backend == 'efficient' else 'logsumexp'}")
    add(mm, f"{h}.attn.c_proj", a * Ne, lowp, [B * T, d], f"{a}*B*T*d")
    gelu = s["activation"] == "gelu"
    add(mm, f"{h}.mlp.c_fc", a * 4 * Ne, lowp, [B * T, 4 * d], f"{a}*4*B*T*d",
        feeds=f"activations/{h}.mlp.act/gelu.self" if gelu else "")
    add(s["activation"], f"{h}.mlp.act", a * 4 * Ne, lowp, [B, T, 4 * d], f"{a}*4*B*T*d",
        feeds=linear_input_key(s, f"{h}.mlp.c_proj") if gelu else f"activations/{h}.mlp.act/relu.result")
    add(mm, f"{h}.mlp.c_proj", a * Ne, lowp, [B * T, d], f"{a}*B*T*d")
    return out


def _numbered(lines):
    """Repeated keys get #2, #3 as the recorder numbers them."""
    used, out = {}, []
    for l in lines:
        used[l["key"]] = used.get(l["key"], 0) + 1
        out.append(l if used[l["key"]] == 1 else dict(l, key=f"{l['key']}#{used[l['key']]}"))
    return out


def sac(s, i, lines, ops):
    unknown = [op for op in ops if op not in SAC_MODELLED]
    if unknown:
        raise ValueError(f"sac_save_ops: the predictor models SAC for {', '.join(SAC_MODELLED)}; "
                         f"not for {', '.join(unknown)}")
    keep = _numbered([l for op, l in sac_outputs(s, i) if op in ops])
    fed = {l["feeds"] for l in keep if l["feeds"]}
    # recomputation allocates what SAC did not keep; a kept output nothing saved is dropped
    # from SAC's cache once the recomputation has consumed it. The recomputation stops once the
    # last saved tensor exists: without dropout that is mlp.c_proj's input, so c_proj's own
    # output stays cached until the block's backward is over (measured on CPU)
    never_rerun = () if s["drop"] else (f"activations/h.{i}.mlp.c_proj/",)
    redo = {"new": [l for l in lines if not l.get("graph") and l.get("input_alias") != "block" and l["key"] not in fed],
            "freed": [l for l in keep if not l["feeds"] and not l["key"].startswith(never_rerun)]}
    return [checkpoint_input(s, i)] + rng_state(s, f"h.{i}") + keep + [l for l in lines if l.get("graph")], redo


def checkpointed(s, cfg, i, lines):
    """(kept until backward, recomputation) for block i under the config's mode; the
    recomputation is {"new": lines it allocates, "freed": kept lines it lets go}, or None."""
    mode = block_mode(cfg, i)
    if mode == "none":
        return lines, None
    if mode == "full":
        return [checkpoint_input(s, i)] + rng_state(s, f"h.{i}") + [l for l in lines if l.get("graph")], \
            {"new": [l for l in lines if not l.get("graph") and l.get("input_alias") != "block"], "freed": []}
    if mode == "selective":
        return selective(s, i, lines)
    return sac(s, i, lines, sac_ops(cfg))


def recompute_flops(s, cfg):
    """Matmul FLOPs the backward spends recomputing, per optimizer step."""
    B, T, d = s["B"], s["T"], s["d"]
    per = {"c_attn": 2 * B * T * d * 3 * d, "core": 2 * 2 * B * T * T * d, "c_proj": 2 * B * T * d * d,
           "c_fc": 2 * B * T * d * 4 * d}  # mlp.c_proj is never rerun: early stop after saving its input
    ops = sac_ops(cfg)
    total = 0
    for i in range(s["L"]):
        mode = block_mode(cfg, i)
        if mode == "full":
            total += sum(per.values())
        elif mode == "selective":
            total += per["core"]
        elif mode == "sac":
            mm = "addmm" if s["bias"] else "mm"
            attn_saved = "bmm" in ops if s["attention"] == "manual" else any(o.startswith("_scaled_dot") for o in ops)
            total += 0 if mm in ops else per["c_attn"] + per["c_proj"] + per["c_fc"]
            total += 0 if attn_saved else per["core"]
    return total * cfg["gradient_accumulation_steps"]


def forward_flops(s):
    """Matmul FLOPs of one forward (blocks and lm_head), for the recompute share."""
    B, T, d = s["B"], s["T"], s["d"]
    return s["L"] * (24 * B * T * d * d + 4 * B * T * T * d) + 2 * B * T * d * s["V"]
