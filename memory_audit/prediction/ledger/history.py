"""A compiled CUDA step's allocator gaps and reserved memory, from its ledger played as a history.

Every eager step's totals come from the shadow run's process through the allocator's model
(shadow/replay). A compiled step's come from inductor's plan, which lists the step's buffers
but not the process before it; on CUDA this module gives that plan's ledger a simplified
history through the same model (reading/allocator_model.py):

  model.to(device): weights and buffers in order; the first batch;
  step 1: the forward's saved tensors in order, with the tensors the forward makes and drops
  on the way (`forward_temporaries`), the lines of the peak where the backward starts, then
  the backward (saved tensors freed from the last layer down, each layer's gradients allocated
  as it is passed), AdamW's state (exp_avg, exp_avg_sq, step per parameter), zero_grad and the
  next batch; step 2's forward, then its peak lines (what they let go first, then what they add).

The backward's short-lived temporaries are left out: a model, not a trace. It is what the two
committed H100 compiled audits were predicted with (+60,928 and +262,656 B over their peaks;
docs/compile.md); a compiled CUDA plan needs a GPU, so nothing here re-predicts them.
"""

from ...reading.allocator_model import CachingAllocatorModel, segment_size
from ...reading.allocator_sim import round_size


def _logits_bytes(log_softmax, cfg):
    """The lm_head output a loop that does not keep it still makes: B*T*V in the autocast dtype."""
    rows, vocab = log_softmax["shape"]
    return rows * vocab * (4 if cfg["dtype"] == "float32" else 2)


def _module_op(line):
    """('h.3.attn.c_proj', 'mm.self') from 'activations/h.3.attn.c_proj/mm.self'."""
    parts = line["key"].split("/")
    return parts[1], parts[-1]


def _block(module):
    """'h.3' for the modules of block 3; other modules are their own block."""
    return ".".join(module.split(".")[:2]) if module.startswith("h.") else module


def forward_order(acts):
    """Indices of the saved tensors in the order the forward makes them. The ledger lists a
    matmul's weight cast (mm.mat2) before its input (mm.self), which is the order autocast casts
    them in; a c_proj's input is the output of the op before it (att @ v made contiguous, the
    activation), so it exists before the weight is cast (the H100 reference series)."""
    order = list(range(len(acts)))
    for j in range(len(acts) - 1):
        (module, op), (next_module, next_op) = _module_op(acts[j]), _module_op(acts[j + 1])
        if module == next_module and module.endswith("c_proj") and (op, next_op) == ("mm.mat2", "mm.self"):
            order[j], order[j + 1] = j + 1, j
    return order


def forward_temporaries(acts, cfg):
    """The tensors an eager forward makes and drops before it ends, which the ledger (the saved
    tensors) does not list, as steps around the saved tensors they come with:
    {(index into acts, "before" | "after"): [("alloc" | "free", name, bytes)]}. Read off the
    H100's step-2 allocation series (GPT-2 small, fp16, manual attention: the reference run) and
    the committed tiny bf16 SDPA trace:
      tok_emb and pos_emb (fp32) live until the forward returns; under autocast each LayerNorm
      writes an fp32 output the next matmul casts and drops; each c_proj writes its output in the
      matmul dtype, dropped once the residual add has made the block's next fp32 stream.
      Manual attention: qkv (3 x q's bytes) lives until c_proj has run; q @ k^T and its scaled
      copy, then masked_fill's copy (each B*H*T*T in the matmul dtype) come and go around the
      fp32 softmax; att @ v is made contiguous for c_proj and dropped. SDPA keeps qkv (q, k, v
      are views of it) and writes its output in the layout c_proj reads.
    Sizes come from the saved tensors themselves, so tensor-parallel widths carry through."""
    low = 2 if cfg["dtype"] in ("float16", "bfloat16") else 4  # bytes per element matmuls write
    manual = cfg["attention"] == "manual"
    by_key = {l["key"]: l["bytes"] for l in acts if l.get("role") != "att_v_input"}  # bmm.self: q
    order = forward_order(acts)
    last_matmul_line = {}  # c_proj: its output comes after its last saved operand
    for i in order:
        module, op = _module_op(acts[i])
        if module.endswith("c_proj") and op in ("mm.self", "mm.mat2"):
            last_matmul_line[module] = i
    steps = {}

    def at(i, when, *actions):
        steps.setdefault((i, when), []).extend(actions)

    previous_block = None
    for i in order:
        l = acts[i]
        module, op = _module_op(l)
        block = _block(module)
        _stream_temporaries(at, i, l, (module, op, block, previous_block), by_key, cfg, low)
        if manual:
            _attention_temporaries(at, i, l, (module, op, block), by_key, low)
        if module.endswith("attn.c_proj") and op == "mm.self":
            at(i, "after", ("free", f"{block}.y", 0))
        if module.endswith("c_proj") and last_matmul_line.get(module) == i:
            stream = by_key.get(f"activations/{block}.ln_2/native_layer_norm.input", 0)  # (B, T, C) fp32
            at(i, "after", ("alloc", f"{module}.out", stream * low // 4))
            if module.endswith("attn.c_proj"):
                at(i, "after", ("free", f"{block}.qkv", 0))
        if block.startswith("h."):
            previous_block = block
    return steps


def _stream_temporaries(at, i, l, where, by_key, cfg, low):
    """forward_temporaries' embeddings and LayerNorm outputs around saved line i (`where`: its
    module, op, block and the block before)."""
    module, op, block, previous_block = where
    if l["key"] == "activations/wpe/embedding.indices":
        tok = by_key.get("activations/h.0.ln_1/native_layer_norm.input", 0)
        at(i, "after", ("alloc", "tok_emb", tok), ("alloc", "pos_emb", tok // cfg["batch_size"]))
    elif op == "native_layer_norm.result1" and low == 2:
        at(i, "before", ("alloc", f"{module}.out", by_key.get(f"activations/{module}/native_layer_norm.input", 0)))
    elif op == "native_layer_norm.input" and module.endswith("ln_2"):
        at(i, "before", ("free", f"{block}.ln_1.out", 0))
        at(i, "after", ("free", f"{block}.attn.c_proj.out", 0))
    elif op == "native_layer_norm.input" and previous_block and block != previous_block:
        at(i, "before", ("free", f"{previous_block}.ln_2.out", 0))  # the next block's stream
        at(i, "after", ("free", f"{previous_block}.mlp.c_proj.out", 0))


def _attention_temporaries(at, i, l, where, by_key, low):
    """forward_temporaries' manual attention around saved line i (`where`: its module, op, block)."""
    module, op, block = where
    scores = by_key.get(f"activations/{block}.attn/softmax.result", 0) * low // 4
    if module.endswith("attn.c_attn") and op == "mm.self":
        at(i, "after", ("alloc", f"{block}.qkv", 3 * by_key.get(f"activations/{block}.attn/bmm.self", 0)))
    elif op == "bmm.mat2":
        at(i, "after", ("alloc", f"{block}.scores", scores), ("alloc", f"{block}.scaled", scores),
           ("free", f"{block}.scores", 0))
    elif op == "masked_fill.mask":
        at(i, "after", ("alloc", f"{block}.masked", scores), ("free", f"{block}.scaled", 0))
    elif op == "softmax.result":
        at(i, "after", ("free", f"{block}.masked", 0))
    elif module.endswith("attn.c_proj") and op == "mm.self":  # att @ v, before its copy
        at(i, "before", ("alloc", f"{block}.y", l["bytes"]))


def play_forward(acts, temporaries, cfg, alloc, free, live):
    """One forward through the model: the saved tensors in order with the temporaries around
    them (`forward_temporaries`); when it returns, the temporaries still held go, newest first
    (the LayerNorm output before lm_head, pos_emb, tok_emb), then the logits a loop that does not
    keep them lets go."""
    def play(actions):
        for what, name, nbytes in actions:
            if what == "alloc" and nbytes:
                alloc(("tmp", name), nbytes)
            elif what == "free" and ("tmp", name) in live:  # absent where checkpointing saved no anchor
                free(("tmp", name))

    for i in forward_order(acts):
        l = acts[i]
        play(temporaries.get((i, "before"), ()))
        if l["key"] == "activations/gpt/log_softmax.result" and not cfg["keep_logits"]:
            alloc("logits", _logits_bytes(l, cfg))  # made by lm_head, dropped once the loss exists
        alloc(("act", i), l["bytes"])
        play(temporaries.get((i, "after"), ()))
    for key in reversed([k for k in live if isinstance(k, tuple) and k[0] == "tmp"]):
        free(key)
    if "logits" in live:
        free("logits")


def play_backward_and_step(acts, weights, cfg, alloc, free, live):
    """Step 1 after its peak: the saved tensors freed from the last layer down, each layer's
    gradients made as it is passed (the tied wte with lm_head), AdamW's state parameter by
    parameter (exp_avg, exp_avg_sq, fused's step), then zero_grad."""
    pending = list(weights)
    for i in reversed(range(len(acts))):
        module = acts[i]["key"].split("/")[1]
        if ("act", i) in live:  # not already let go at the peak moment
            free(("act", i))
        for w in list(pending):
            name = w["key"][len("weights/"):].replace("transformer.", "")
            if name.startswith(module + ".") or (module == "lm_head" and name.startswith("wte.")):
                pending.remove(w)
                alloc(("grad", w["key"]), w["bytes"])
    for w in pending:
        alloc(("grad", w["key"]), w["bytes"])
    for w in weights:
        alloc(("exp_avg", w["key"]), w["bytes"])
        alloc(("exp_avg_sq", w["key"]), w["bytes"])
        if cfg["optimizer_impl"] == "fused":
            alloc(("step", w["key"]), 4)
    if cfg["set_to_none"]:
        for w in weights:
            free(("grad", w["key"]))


def predicted_gaps(ledger, cfg, expandable=False):
    """Bytes beyond the 512 B rounding held at steady state, before backward and at the peak,
    and the bytes reserved then (reserved_steady, reserved_before_backward, reserved_peak)."""
    model = CachingAllocatorModel(expandable)
    live = {}

    def alloc(key, nbytes):
        live[key] = model.alloc(nbytes)

    def free(key):
        model.release(live.pop(key)[0])

    def held():
        return sum(extra for _, extra in live.values())

    weights = [l for l in ledger if l["category"] == "weights"]
    workspaces, batch = _before_the_step(ledger, model, alloc)
    acts = [l for l in ledger if l["category"] == "activations"]
    peak_extra = [l for l in ledger if "peak" in l["phases"] and l["bytes"] > 0]
    index = {l["key"]: ("act", i) for i, l in enumerate(acts)}
    index["inputs.y"] = index["nll_loss.target"] = ("batch", 1)  # the old targets, freed with nll_loss's node
    # what the peak moment has let go (a block's backward: the head's saved tensors, later blocks')
    spent = [index[l["key"][len("released/"):]] for l in ledger
             if "peak" in l["phases"] and l["key"][len("released/"):] in index]

    def play_peak():
        for key in spent:
            free(key)
        for i, l in enumerate(peak_extra):
            alloc(("peak", i), l["bytes"])

    result = {}
    temporaries = forward_temporaries(acts, cfg)
    for step in (1, 2):
        play_forward(acts, temporaries, cfg, alloc, free, live)
        if step == 2:
            result["before_backward"] = held()
            result["reserved_before_backward"] = model.reserved
            play_peak()
            result["peak"] = held()
            result["reserved_peak"] = model.reserved
            result["allocated_peak"] = sum(model.used[addr] for addr, _ in live.values()) + sum(workspaces)
            break
        play_peak()
        for i in range(len(peak_extra)):
            free(("peak", i))
        play_backward_and_step(acts, weights, cfg, alloc, free, live)
        for i in range(len(batch)):
            if ("batch", i) in live:
                free(("batch", i))
            alloc(("batch", i), batch[i])
        result["steady"] = held()
        result["reserved_steady"] = model.reserved
    return result


def _before_the_step(ledger, model, alloc):
    """model.to(device) and the first batch: the weights and buffers, DDP's buckets, the batch;
    cuBLAS workspaces hold segments of their own size class, out of the free lists (where they
    fall in the history is not modelled), counted in reserved only. Returns (the workspaces'
    rounded bytes, the batch's bytes)."""
    for l in ledger:
        if l["category"] in ("weights", "buffers"):
            alloc(l["key"], l["bytes"])
    for i, l in enumerate(l for l in ledger if l["key"] == "grads/ddp_buckets"):  # made by DDP(model)
        alloc(("ddp_bucket", i), l["bytes"])
    workspaces = [round_size(l["bytes"]) for l in ledger if l["category"] == "workspace"]
    model.reserved += sum(segment_size(n) for n in workspaces)
    batch = [l["bytes"] for l in ledger if l["key"] in ("inputs/x", "inputs/y")]
    for i, n in enumerate(batch):
        alloc(("batch", i), n)
    return workspaces, batch
