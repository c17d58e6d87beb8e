"""The peak of the step, found by walking the backward block by block.

Without recomputation the peak is the start of backward: cross-entropy's gradient on top of
everything saved. With activation checkpointing each checkpointed block's backward first
recomputes what it saved, so the peak can move inside a block's backward. For every
recomputed block this module builds the moment its backward begins in earnest (the MLP's
c_proj backward has just made its input gradient, with the whole recomputation live) as
changes from the before-backward ledger, and the peak is the largest candidate:

  released  the head's saved tensors (but the logits the loop holds), the old targets, and
            what every later block kept (its checkpoint input, or all it saved)
  new       the next batch, the backward's grad seed (and fp16's scaled loss), the gradients
            of every later block, ln_f and the tied wte/lm_head weight (a temporary until
            the embedding's gradient is added to it), the block's mlp.c_proj weight gradient,
            the gradient flowing into the block (fp32 residual stream), c_proj's input gradient,
            and the recomputed tensors (less those that are the region's own input)

Measured on CPU (torch 2.13) for fp32; other moments inside a block's backward (attention's
T^2 gradients) are not modelled, so a model where those dominate is under-predicted.
"""

from .parts import line

PEAK = ("peak",)


def _delta(s, key, nbytes, formula, note=""):
    return line(s, key, nbytes, "", [], formula, PEAK, note)


def _param_grads(s, params, prefixes):
    return sum(4 * _numel(sh) for n, sh in params if n.startswith(prefixes))


def _numel(shape):
    n = 1
    for x in shape:
        n *= x
    return n


def _block_of(key):
    """'activations/h.3.attn/...' -> 3; None outside the blocks."""
    part = key.split("/")[1]
    return int(part.split(".")[1]) if part.startswith("h.") else None


def _released_after(acts, b):
    """Activation lines freed by the time block b's backward starts: what later blocks kept and
    the head's saved tensors (not the logits the loop holds)."""
    head = ("activations/ln_f/", "activations/lm_head/", "activations/gpt/")
    return [l for l in acts if (_block_of(l["key"]) or -1) > b
            or (l["key"].startswith(head) and l["key"] != "activations/lm_head/output")]


def block_moment(s, cfg, params, acts, b, redo):
    """Changes from the before-backward ledger at block b's first backward matmul."""
    B, T, d, L = s["B"], s["T"], s["d"], s["L"]
    out = [_delta(s, f"released/{l['key']}", -l["bytes"], "-" + l["formula"]) for l in _released_after(acts, b)]
    out.append(_delta(s, "released/inputs.y", -8 * B * T, "-8*B*T", "old targets, freed with nll_loss"))
    out.append(_delta(s, "inputs/next_batch", 2 * 8 * B * T, "2*8*B*T", "prefetched X, Y"))
    if cfg["dtype"] == "float16":
        out.append(_delta(s, "temporary/scaled_loss", 4, "4", "scaler.scale(loss)"))
    out.append(_delta(s, "temporary/grad_seed", 4, "4", "ones_like(loss), held until backward returns"))
    if "step2_before_backward" not in _grad_phases(cfg):  # fresh gradients, made as backward goes
        later = tuple(f"transformer.h.{j}." for j in range(b + 1, L)) + ("transformer.ln_f.",)
        out.append(_delta(s, "grads/later_blocks", _param_grads(s, params, later), "4*numel",
                          f"blocks {b + 1}..{L - 1} and ln_f"))
        out.append(_delta(s, "temporary/lm_head_grad", 4 * s["V"] * d, "4*V*d",
                          "tied wte/lm_head gradient, until the embedding's is added"))
        out.append(_delta(s, f"grads/transformer.h.{b}.mlp.c_proj.weight", 4 * 4 * d * d, "4*4d*d"))
    out.append(_delta(s, f"temporary/h.{b}/grad_output", 4 * s["Ne"], "4*B*T*d", "gradient into the block"))
    out.append(_delta(s, f"temporary/h.{b}.mlp.c_proj/grad_input", 4 * 4 * s["Ne"], "4*4*B*T*d",
                      "c_proj's input gradient"))
    for l in redo["freed"]:
        out.append(_delta(s, f"released/{l['key']}", -l["bytes"], "-" + l["formula"], "consumed by the recomputation"))
    for l in redo["new"]:
        out.append(_delta(s, "recomputed/" + l["key"][len("activations/"):], l["bytes"], l["formula"], l["note"]))
    return out


def _grad_phases(cfg):
    from .predict import grad_phases
    return grad_phases(cfg)


def peak_lines(s, cfg, params, acts, recomputed, start):
    """(lines of the peak moment, as changes from the before-backward ledger; a summary)."""
    candidates = [("start of backward", start)]
    for b in sorted(recomputed, reverse=True):
        candidates.append((f"backward of h.{b}", block_moment(s, cfg, params, acts, b, recomputed[b])))

    def total(lines):
        return sum(l["allocated"] for l in lines)
    best = max(candidates, key=lambda c: total(c[1]))  # the first of equals: the earliest moment
    return best[1], {"peak_at": best[0], "candidates": [{"at": name, "delta_bytes": total(lines)}
                                                        for name, lines in candidates]}
