"""The peak of the step: the start of backward, and the moments a lever makes compete with it.

Without recomputation the peak is the start of backward: cross-entropy's gradient on top of
everything saved. With activation checkpointing each checkpointed block's backward first
recomputes what it saved, so the peak can move inside a block's backward. For every
recomputed block this module builds the moment its backward begins in earnest (the MLP's
c_proj backward has just made its input gradient, with the whole recomputation live) as
changes from the before-backward ledger, and the peak is the largest candidate (selective
checkpointing recomputes only the attention core, later, when the backward reaches it: its
moment at c_proj holds no recomputation, and the core's own moment is not a candidate):

  released  the head's saved tensors (but the logits the loop holds), the old targets, and
            what every later block kept (its checkpoint input, or all it saved)
  new       the next batch, the backward's grad seed (and fp16's scaled loss), the gradients
            of every later block and ln_f (when set_to_none made them fresh), the tied
            wte/lm_head weight's gradient (a temporary until the embedding's arrives), the
            block's mlp.c_proj weight gradient, the gradient flowing into the block (fp32
            residual stream, and its low-precision cast under autocast), c_proj's input
            gradient, and the recomputed tensors (less the region's own input and what SAC
            kept), with SAC's cached outputs that nothing saved released

One node later (the MLP activation's backward) is a second candidate; and because a lever
shrinks what is saved, the end of the forward (cross-entropy's fp32 temporaries, autocast's
cached weight copies of checkpointed blocks) is a third. The end of backward (the token
embedding's node: every gradient made, the tied weight's two halves not yet added) is a fourth;
at micro-batch 1 it can be the peak (GPT-2 small with full checkpointing).

Where the attention core makes B*n_head*T^2 tensors (manual attention; CPU SDPA's math path
with dropout), two moments inside every block's attention backward compete too, with or without
a lever (`attention_core_moment`): right after att @ v's backward and right after softmax's.
They win when n_head*T outgrows the vocabulary's share (the head's B*T*V tensors): predicted
for GPT-2 small with full checkpointing from T=4096 (not at 2048).

Measured on CPU (torch 2.13) to the byte for every mode, fp32 and bf16, manual and SDPA, GELU
and ReLU, bias, dropout, accumulation, batch 1, and under FSDP2 and tensor parallelism
(snapshots/results/cpu-long.jsonl for the attention core). Not a candidate: a moment inside a
checkpointed block's forward, which SAC keeping the scores (bmm) can make the peak with CPU
SDPA's math path, dropout and bf16. The CUDA moments follow the same rules but are not yet
measured.
"""

from .levers import block_mode
from .parts import grad_phases, line, materialized_scores, numel as _numel

PEAK = ("peak",)


def delta(s, key, nbytes, formula, note=""):
    return line(s, key, nbytes, "", [], formula, PEAK, note)


def _released(s, l, note=""):
    """The release of saved line l at a moment."""
    return delta(s, f"released/{l['key']}", -l["bytes"], "-" + l["formula"], note)


def backward_begun(s, cfg):
    """What every moment after backward() is called holds: the prefetched batch, fp16's scaled
    loss and the grad seed backward() keeps until it returns."""
    out = [delta(s, "inputs/next_batch", 2 * 8 * s["B"] * s["T"], "2*8*B*T", "prefetched X, Y")]
    if cfg["dtype"] == "float16":
        out.append(delta(s, "temporary/scaled_loss", 4, "4", "scaler.scale(loss)"))
    out.append(delta(s, "temporary/grad_seed", 4, "4", "ones_like(loss) for backward"))
    return out


def start_of_backward(s, cfg):
    """The peak of an eager step: the start of backward, when cross-entropy's gradient appears."""
    B, T, Nl = s["B"], s["T"], s["Nl"]
    out = backward_begun(s, cfg)
    if s["pol"]["nll_fp32_copy"]:
        out.append(delta(s, "temporary/grad_into_nll", 4, "4", "d loss / d nll output"))
        out.append(delta(s, "temporary/nll_grad", 4 * Nl, "4*B*T*V", "nll_loss_backward output, fp32"))
        return out
    # the peak comes one node later, at log_softmax's backward; nll_loss has let go
    out.append(delta(s, "temporary/nll_grad", 4 * Nl, "4*B*T*V", "nll_loss_backward output, fp32"))
    out.append(delta(s, "temporary/log_softmax_grad", 4 * Nl, "4*B*T*V", "log_softmax backward output, fp32"))
    out.append(delta(s, "released/nll_loss.target", -8 * B * T, "-8*B*T", "the old targets, saved by nll_loss"))
    out.append(delta(s, "released/nll_loss.total_weight", -4, "-4"))
    if s["dt"] == "cpu":
        out.append(delta(s, "released/div.other", -8, "-8"))
    return out


def _param_grads(s, params, prefixes):
    return sum(4 * _numel(sh) for n, sh in params if n.startswith(prefixes))


def _block_of(key):
    """'activations/h.3.attn/...' -> 3; None outside the blocks."""
    part = key.split("/")[1]
    return int(part.split(".")[1]) if part.startswith("h.") else None


def _released_after(acts, b):
    """Activation lines freed by the time block b's backward starts: what later blocks kept and
    the head's saved tensors (not the logits the loop holds)."""
    head = ("activations/ln_f/", "activations/lm_head/", "activations/gpt/")
    later = [l for l in acts if _block_of(l["key"]) is not None and _block_of(l["key"]) > b]
    return later + [l for l in acts if _block_of(l["key"]) is None
                    and l["key"].startswith(head) and l["key"] != "activations/lm_head/output"]


def block_entry(s, cfg, params, acts, b):
    """Changes from the before-backward ledger when block b's backward begins: the later blocks
    are done, and the gradient into block b has arrived."""
    B, T, d, L = s["B"], s["T"], s["d"], s["L"]
    out = [_released(s, l) for l in _released_after(acts, b)]
    out.append(delta(s, "released/inputs.y", -8 * B * T, "-8*B*T", "old targets, freed with nll_loss"))
    out += backward_begun(s, cfg)
    if "step2_before_backward" not in grad_phases(cfg):  # fresh gradients, made as backward goes
        later = tuple(f"transformer.h.{j}." for j in range(b + 1, L)) + ("transformer.ln_f.",)
        out.append(delta(s, "grads/later_blocks", _param_grads(s, params, later), "4*numel",
                          f"blocks {b + 1}..{L - 1} and ln_f"))
    # the tied weight's gradient waits in the engine's input buffer for the embedding's
    out.append(delta(s, "temporary/lm_head_grad", 4 * s["V"] * d, "4*V*d",
                      "tied wte/lm_head gradient, until the embedding's is added"))
    rows = s["Ne"] // (s["tp"] if s["sp"] else 1)  # sequence parallelism: the residual stream is /t
    return out + [delta(s, f"temporary/h.{b}/grad_output", 4 * rows, "4*B*T*d", "gradient into the block (fp32)")]


def block_moment(s, cfg, params, acts, b, redo):
    """Changes from the before-backward ledger at block b's first backward matmul."""
    out = block_entry(s, cfg, params, acts, b) + _first_matmul(s, cfg, b)
    mlp_dropout = f"h.{b}.mlp.dropout/"  # its mask (recomputed, or kept when the MLP is not) is spent
    for l in [l for l in (redo["new"] or acts) if s["drop"] and l["key"].split("/", 1)[1].startswith(mlp_dropout)]:
        out.append(_released(s, l, "spent by dropout's backward"))
    for l in redo["freed"]:
        out.append(_released(s, l, "consumed by the recomputation"))
    for l in redo["new"]:
        out.append(delta(s, "recomputed/" + l["key"][len("activations/"):], l["bytes"], l["formula"], l["note"]))
    return out


def forward_end(s, cfg, acts):
    """Changes from the before-backward ledger at the forward's cross-entropy (CPU autocast:
    the logits' fp32 copy and log_softmax's output are both live). Autocast still caches the
    low-precision weight copies a checkpointed block made (its saved tensors are placeholders,
    the cache is not) until the forward's autocast region ends; GPT.forward still holds the
    two embeddings and ln_f's output; the loop has not yet divided the loss."""
    T, d, Ne = s["T"], s["d"], s["Ne"]
    out = []
    if s["pol"]["weight_copies"]:
        for i in range(s["L"]):
            if block_mode(cfg, i) in ("full", "sac"):
                for mod, n_in, n_out in (("attn.c_attn", d, 3 * d), ("attn.c_proj", d, d),
                                         ("mlp.c_fc", d, 4 * d), ("mlp.c_proj", 4 * d, d)):
                    out.append(delta(s, f"temporary/autocast_cache/h.{i}.{mod}", s["a"] * n_in * n_out // s["tp"],
                                      f"{s['a']}*{n_in}*{n_out}/t", "weight copy, cached until autocast exits"))
    out.append(delta(s, "temporary/tok_emb", 4 * Ne, "4*B*T*d", "held by GPT.forward"))
    out.append(delta(s, "temporary/pos_emb", 4 * T * d, "4*T*d", "held by GPT.forward"))
    if s["autocast"]:  # ln_f's fp32 output; lm_head saved its low-precision cast
        out.append(delta(s, "temporary/ln_f_output", 4 * Ne, "4*B*T*d", "held by GPT.forward"))
    if s["pol"]["log_softmax"] == "fp32" and s["autocast"]:
        out.append(delta(s, "temporary/logits_fp32", 4 * s["Nl"], "4*B*T*V", "cross_entropy's fp32 copy"))
    out.append(delta(s, "temporary/new_loss", 4, "4", "the loss, before the loop divides it"))
    out += [_released(s, l, "not made yet")
            for l in acts if l["key"] == "activations/gpt/div.other"]
    return out


def _tied_bytes(params):
    """The tied wte/lm_head weight's gradient (fp32): 4*V*d."""
    return sum(4 * _numel(sh) for n, sh in params if n == "transformer.wte.weight")


def backward_end(s, cfg, params, acts, grads=None):
    """Changes from the before-backward ledger at the last node of backward, the token
    embedding's: its weight gradient (4*V*d) has just been made while the tied lm_head's, which
    arrived first, waits in the engine's input buffer; every other gradient exists, and every
    saved tensor is gone but the logits the loop holds. With checkpointing at small batches
    this beats the start of backward (the gradients outweigh what is saved). grads: what a
    strategy has made of the other gradients by then, instead of every one of them whole
    (FSDP2: fsdp.during("wte"))."""
    fresh = "step2_before_backward" not in grad_phases(cfg) and grads is None
    tied = _tied_bytes(params)
    out = [_released(s, l)
           for l in acts if l["key"] != "activations/lm_head/output"]
    out.append(delta(s, "released/inputs.y", -8 * s["B"] * s["T"], "-8*B*T", "old targets, freed with nll_loss"))
    out += backward_begun(s, cfg)
    if fresh:
        out.append(delta(s, "grads/all_but_wte", sum(4 * _numel(sh) for n, sh in params) - tied, "4*numel",
                          "every gradient but the tied weight's"))
    out += grads or []
    out.append(delta(s, "temporary/lm_head_grad", tied, "4*V*d", "tied wte/lm_head gradient, waiting for wte's"))
    out.append(delta(s, "temporary/wte/grad_weight", tied, "4*V*d", "embedding backward's weight gradient"))
    return out + [delta(s, "temporary/wte/grad_output", 4 * s["Ne"], "4*B*T*d", "gradient into the embedding (fp32)")]


def tied_sum(s, params):
    """One step later, measured on CPU without autocast: the engine adds the two tied gradients
    out of place (under autocast it adds in place, and this moment does not exist). The old
    tokens, saved by the embedding, and the gradient into it are gone."""
    tied = _tied_bytes(params)
    return [delta(s, "released/inputs.x", -8 * s["B"] * s["T"], "-8*B*T", "old tokens, freed with the embedding's node"),
            delta(s, "released/wte/grad_output", -4 * s["Ne"], "-4*B*T*d"),
            delta(s, "temporary/tied_grad_sum", tied, "4*V*d", "lm_head's + wte's gradient, out of place")]


def _c_proj_incoming(s, b):
    """The temporaries that carry the gradient into mlp.c_proj's backward (none in fp32 without
    dropout: there it is the residual stream's own gradient)."""
    a, rows, out = s["a"], s["Ne"] // (s["tp"] if s["sp"] else 1), []
    if s["drop"]:  # the MLP's dropout ran its backward first: its output is c_proj's gradient
        g = a if s["autocast"] else 4  # (under autocast the gradient's low-precision cast is gone)
        out.append(delta(s, f"temporary/h.{b}.mlp.dropout/grad_input", g * rows, f"{g}*B*T*d",
                          "dropout's input gradient"))
    elif s["autocast"]:
        out.append(delta(s, f"temporary/h.{b}.mlp/grad_output_cast", a * rows, f"{a}*B*T*d",
                          "its cast for the low-precision MLP output"))
    if s["sp"]:  # the row-parallel c_proj's reduce-scatter: its backward all-gathers the gradient
        g = a if s["autocast"] else 4
        out.append(delta(s, f"temporary/h.{b}.mlp.c_proj/grad_output_gathered", g * s["Ne"], f"{g}*B*T*d",
                          "all-gathered over the ranks"))
    return out


def _first_matmul(s, cfg, b):
    """What mlp.c_proj's backward has made when its input gradient appears. Under autocast
    the matmul runs in low precision: the gradient coming in is cast down first, and the weight
    gradient is still the low-precision one (its fp32 copy comes with AccumulateGrad). Where
    gradients already exist (accumulation, set_to_none=False) the new one is a temporary until
    it is added in place."""
    d, Ne, a, fresh = s["d"], s["Ne"], s["a"], "step2_before_backward" not in grad_phases(cfg)
    t, w = s["tp"], f"h.{b}.mlp.c_proj"  # tensor parallelism: c_proj's input and weight are /t
    out = _c_proj_incoming(s, b)
    if s["autocast"]:
        out.append(delta(s, f"temporary/{w}/grad_weight", a * 4 * d * d // t, f"{a}*4d*d/t", "low-precision weight gradient"))
    else:
        key = f"grads/transformer.{w}.weight" if fresh else f"temporary/{w}/grad_weight"
        out.append(delta(s, key, 4 * 4 * d * d // t, "4*4d*d/t"))
    if s["bias"]:  # addmm's bias gradient, a sum over the rows (measured for fp32 only)
        key = f"grads/transformer.{w}.bias" if fresh and not s["autocast"] else f"temporary/{w}/grad_bias"
        out.append(delta(s, key, (a if s["autocast"] else 4) * d, "4*d"))
    out.append(delta(s, f"temporary/{w}/grad_input", a * 4 * Ne // t, f"{a}*4*B*T*d/t", "c_proj's input gradient"))
    return out


def _after_c_proj(s, b, saved):
    """mlp.c_proj's backward is done: the temporaries that carried its gradient in (dropout's
    input gradient, autocast's low-precision cast, SP's all-gathered copy), its saved input where
    nothing else saved it (GELU's output), and the low-precision weight copy it saved
    (recomputed, or `saved` in the forward) are let go; under autocast its weight gradient's fp32
    copy (ToCopyBackward, for AccumulateGrad) is made while the low-precision gradient still
    exists. Measured on CPU: with ReLU this moment, or the activation's backward after it, is
    the peak."""
    a, Ne = s["a"], s["Ne"] // s["tp"]  # the MLP's hidden units are /t with tensor parallelism
    out = [delta(s, "released/" + l["key"][len("temporary/"):], -l["bytes"], "-" + l["formula"], "spent by c_proj's backward")
           for l in _c_proj_incoming(s, b)]
    if s["activation"] == "gelu":  # GELU's output was saved by c_proj alone (ReLU's by ReLU too)
        out.append(delta(s, f"released/h.{b}.mlp.c_proj.input", -a * 4 * Ne, f"-{a}*4*B*T*d/t", "GELU output"))
    if s["autocast"]:
        out += [_released(s, l, "c_proj's weight copy, spent")
                for l in saved if l["key"].split("/", 1)[1] in (f"h.{b}.mlp.c_proj/mm.mat2", f"h.{b}.mlp.c_proj/addmm.mat2")]
        if s["bias"]:  # the bias gradient was cast first (its low-precision one is gone)
            out.append(delta(s, f"temporary/h.{b}.mlp.c_proj/grad_bias_fp32", (4 - a) * s["d"], f"(4-{a})*d",
                              "the bias gradient cast to fp32, the low-precision one freed"))
        out.append(delta(s, f"temporary/h.{b}.mlp.c_proj/grad_weight_fp32", 4 * 4 * s["d"] * s["d"] // s["tp"], "4*4d*d/t",
                          "the weight gradient cast to fp32"))
    return out


def _low_precision_grad_freed(s, b):
    """Once the fp32 copy exists, the low-precision weight gradient goes (autocast only)."""
    if not s["autocast"]:
        return []
    return [delta(s, f"released/h.{b}.mlp.c_proj/grad_weight", -s["a"] * 4 * s["d"] * s["d"] // s["tp"], f"-{s['a']}*4d*d/t")]


def _activation_backward(s, b):
    """One node later: the MLP activation's input gradient (ReLU's output, its own saved tensor,
    is still there; GELU's went with c_proj's backward)."""
    a, Ne = s["a"], s["Ne"] // s["tp"]  # the MLP's hidden units are /t with tensor parallelism
    return [delta(s, f"temporary/h.{b}.mlp.act/grad_input", a * 4 * Ne, f"{a}*4*B*T*d/t", "activation's input gradient")]


# what block b's attention still holds inside its backward: ln_1's and c_attn's saved tensors,
# q, k^T, the mask, the probabilities, the checkpoint's inputs (and the graph's own lines, like
# CPU's 1/sqrt(hs) scalar, always); right after att @ v's backward also dropout's mask and
# output (math SDPA's noise is attn/mul.other), att @ v's low-precision input and v
_HELD = {"softmax": ("bmm.self", "bmm.mat2", "masked_fill.mask", "softmax.result", "safe_softmax.result",
                     "checkpoint.input", "checkpoint.rng_state")}
_HELD["att @ v"] = _HELD["softmax"] + ("bmm.self#2", "bmm.mat2#2", "mul.other")  # math SDPA's dropout noise


def _held_line(l, b, at):
    """_held for a line: att @ v's input (named bmm.self or bmm.self#2, parts.manual_attention)
    is held until att @ v's backward has run."""
    if l.get("role") == "att_v_input":
        return at == "att @ v" and l["key"].split("/")[1] == f"h.{b}.attn"
    return _held(l["key"], b, at)


def _held(key, b, at):
    part, op = key.split("/")[1], key.split("/")[-1]
    if part in (f"h.{b}", f"h.{b}.ln_1", f"h.{b}.attn.c_attn") or (at == "att @ v" and part == f"h.{b}.attn.attn_dropout"):
        return True
    return part == f"h.{b}.attn" and op in _HELD[at]


def _spent(l, b, spent, at):
    """Is block b's kept line l gone at moment `at`? SAC's cached outputs go when the recompute
    consumes them (`spent`), with the saved tensor they are (`feeds`), or never before the
    block's backward ends (mlp.c_proj's, which the recompute does not rerun)."""
    if l["key"] in spent:
        return True
    if l.get("feeds"):
        return not _held(l["feeds"], b, at)
    return not l.get("graph") and ".sac_output" not in l["key"] and not _held_line(l, b, at)


def attention_core_moment(s, cfg, params, acts, b, redo, at, own=None):
    """Changes from the before-backward ledger inside block b's attention core (manual
    attention), at = "att @ v": its backward has just made the gradient of the probabilities
    (or of dropout's output) beside the gradient for v and the contiguous copy of c_proj's input
    gradient it read; at = "softmax": softmax's backward has just made its input gradient, so
    three B*n_head*T^2 tensors are live: the probabilities, the gradient into softmax (after
    dropout's backward and under CUDA autocast the cast up to fp32, each replacing the one
    before) and the new one. The MLP and c_proj are done: their saved (or recomputed) tensors
    are spent, their weight gradients made. Measured on CPU: with long sequences one of the two
    is the step's peak, in every checkpointing mode and without one (att @ v with dropout).
    own: the parameters as block b's backward sees them (FSDP2: all-gathered, so its gradients
    are whole until the block's reduce-scatter); params: as this rank keeps them."""
    redo = redo or {"new": [], "freed": []}
    spent = {l["key"] for l in redo["freed"]}  # SAC's cached outputs, consumed by the recompute
    out = block_entry(s, cfg, params, acts, b)
    out += [_released(s, l, f"spent before {at}'s backward")
            for l in acts if _block_of(l["key"]) == b and _spent(l, b, spent, at)]
    out += [delta(s, "recomputed/" + l["key"][len("activations/"):], l["bytes"], l["formula"], l["note"])
            for l in redo["new"] if _held_line(l, b, at)]
    # fresh gradients; FSDP2's are whole inside a block's backward and new whatever set_to_none
    # says (the kept ones are shards), unless earlier micro-steps accumulated them whole
    fsdp_fresh = str(cfg["parallel"]).startswith("fsdp") and cfg["gradient_accumulation_steps"] == 1
    if "step2_before_backward" not in grad_phases(cfg) or fsdp_fresh:
        done = tuple(f"transformer.h.{b}.{m}." for m in ("mlp", "ln_2", "attn.c_proj"))
        out.append(delta(s, f"grads/h.{b}.after_attention_core", _param_grads(s, own or params, done), "4*numel",
                          f"h.{b}'s mlp, ln_2 and attn.c_proj"))
    by_key = {l["key"]: l for l in acts + redo["new"]}
    core = f"activations/h.{b}.attn/"
    probs = by_key.get(core + "softmax.result") or by_key[core + "safe_softmax.result"]
    # v's dtype (math SDPA: fp32 under autocast too); no line for v where q, k, v are views
    v = by_key.get(core + "bmm.mat2#2") or {"bytes": s["a"] * s["Ne"] // s["tp"], "formula": f"{s['a']}*B*T*d/t"}
    out.append(delta(s, f"temporary/h.{b}.attn/grad_v", v["bytes"], v["formula"], "att @ v's gradient for v"))
    if at == "att @ v":
        att = next((l for l in acts + redo["new"] if l.get("role") == "att_v_input" and l["key"].startswith(core)),
                   probs)  # what att @ v saved
        return out + [delta(s, f"temporary/h.{b}.attn/grad_y", v["bytes"], v["formula"], "c_proj's input gradient, made contiguous"),
                      delta(s, f"temporary/h.{b}.attn/grad_att", att["bytes"], att["formula"], "the gradient of att @ v's input")]
    return out + [delta(s, f"temporary/h.{b}.attn/grad_probs", probs["bytes"], probs["formula"], "the gradient into softmax"),
                  delta(s, f"temporary/h.{b}.attn/grad_scores", probs["bytes"], probs["formula"], "softmax's input gradient")]


def attention_blocks(L, every):
    """The blocks whose attention moments can hold the most, last first. From one block to the
    next of the same checkpointing mode (every `every`-th) a moment changes by the same bytes
    (one period of later blocks' kept tensors released, their gradients made), except next to
    the ends (block 0 prefetches nothing under FSDP2, the last has no later block): so per
    residue class the first two and the last two blocks hold its largest (a test checks it
    against every block)."""
    out = set()
    for r in range(min(every, L)):
        same = list(range(r, L, every))
        out.update(same[:2] + same[-2:])
    return sorted(out, reverse=True)


def peak_lines(s, cfg, params, acts, recomputed, start, during=lambda moment: [], unsharded=None):
    """(lines of the peak moment, as changes from the before-backward ledger; a summary).
    during(moment): what a parallel strategy adds at the end of the forward ("forward end"), as
    block b's backward begins (("entry", b)) or inside it (b), e.g. fsdp.during. unsharded: the
    parameters before FSDP2 shards them (a block's gradients are whole inside its backward)."""
    candidates = [("start of backward", start)]
    if recomputed:  # only a lever that shrinks what is saved lets the forward's end compete
        candidates.append(("end of forward", forward_end(s, cfg, acts) + during("forward end")))
    for b in range(s["L"] - 1, 0, -1):  # a strategy's own moments: FSDP2's prefetch as block b's backward begins
        extra = during(("entry", b))
        if extra:
            candidates.append((f"backward of h.{b} begins", block_entry(s, cfg, params, acts, b) + extra))
    if cfg["parallel"] in ("none", "ddp", "tp", "tp-sp", "fsdp"):
        # FSDP2: the blocks reduce-scattered as they went; the root's gradients are whole
        root = (unsharded, during("wte")) if cfg["parallel"] == "fsdp" else (params, None)
        end = backward_end(s, cfg, root[0], acts, root[1])
        candidates.append(("backward of wte", end))
        if not s["autocast"] or s["tp"] > 1:
            candidates.append(("tied gradients summed", end + tied_sum(s, root[0])))
    for b in sorted(recomputed, reverse=True):
        # selective: the MLP's c_proj backward runs before the attention core is recomputed
        redo = {"new": [], "freed": []} if block_mode(cfg, b) == "selective" else recomputed[b]
        moment = block_moment(s, cfg, params, acts, b, redo) + during(b)
        candidates.append((f"backward of h.{b}", moment))
        after = moment + _after_c_proj(s, b, redo["new"] or acts)
        if s["autocast"]:
            candidates.append((f"backward of h.{b}.mlp.c_proj done", after))
        if block_mode(cfg, b) != "selective":  # the MLP was recomputed too
            act_moment = after + _low_precision_grad_freed(s, b) + _activation_backward(s, b)
            candidates.append((f"backward of h.{b}.mlp.act", act_moment))
    if materialized_scores(s):  # the attention core's T^2 gradients
        for b in attention_blocks(s["L"], cfg.get("ac_every", 1) if cfg["activation_checkpointing"] != "none" else 1):
            for at in ("att @ v", "softmax"):
                moment = attention_core_moment(s, cfg, params, acts, b, recomputed.get(b), at, unsharded) + during(b)
                candidates.append((f"backward of h.{b}.attn {at}", moment))

    def total(lines):
        return sum(l["allocated"] for l in lines)
    best = max(candidates, key=lambda c: total(c[1]))  # the first of equals: the earliest moment
    return best[1], {"peak_at": best[0], "candidates": [{"at": name, "delta_bytes": total(lines)}
                                                        for name, lines in candidates]}
