"""Predict the allocator's gaps by playing the predicted tensors through its rules.

The CUDA caching allocator rounds every request up to 512 B, carves requests of at most 1 MiB
out of 2 MiB segments, requests under 10 MiB out of 20 MiB segments and larger ones out of a
segment rounded up to 2 MiB; it serves a request from the smallest cached free block that fits
and splits that block only if more than 1 MiB would remain (512 B in the small pool). So a
block can hold up to 1 MiB nobody asked for, and which blocks do depends on what was freed
before. This module replays a simplified history of one training run, built from the
predicted ledger:

  model.to(device): weights and buffers in order; the first batch;
  step 1: the forward's saved tensors in order, with the tensors the forward makes and drops
  on the way (`forward_temporaries`), the cross-entropy gradients of the backward's start,
  then the backward (saved tensors freed from the last layer down, each layer's gradients
  allocated as it is passed), AdamW's state (exp_avg, exp_avg_sq, step per parameter),
  zero_grad and the next batch; step 2's forward. In both steps the peak moment the ledger
  names is played where the backward starts: what it has let go first (inside a block's
  attention backward, the head's saved tensors and the later blocks'), then what it adds.

The backward's short-lived temporaries are left out, which is why this is a model, not a
measurement: on the H100 sweep it lands within 0.1% of the measured peak where rounding alone
missed by up to 1.5% (GPT-2 xl). The segments it makes are the predicted memory_reserved():
within 2% of the measured on 19 of the 23 H100 rows, 4.9% under at worst, and to the byte on
the two committed tiny CUDA audits (README, "Will it fit?").

The model is the replay's own block bookkeeping (allocator_sim.BlockSim), which the
byte-exact replay of a trace uses unchanged: the trace says which address each allocation got;
here the best-fit choice and the new segments are made instead.
"""

import bisect

from ..reading.allocator_sim import SMALL_SIZE as MiB, BlockSim, round_size
from ..reading.allocator_sim import ALLOC, FREE, FREE_COMPLETED, SEG_ALLOC, SEG_MAP


def segment_size(rounded):
    """cudaMalloc size for a request that no cached block can serve."""
    if rounded <= MiB:
        return 2 * MiB
    if rounded < 10 * MiB:
        return 20 * MiB
    return 2 * MiB * ((rounded + 2 * MiB - 1) // (2 * MiB))


# expandable_segments:True maps one growing segment per pool, in pages of these sizes
EXPANDABLE_PAGE = {True: 2 * MiB, False: 20 * MiB}  # small pool? -> page bytes


class CachingAllocatorModel(BlockSim):
    """The replay's block bookkeeping (allocator_sim.BlockSim: free blocks per segment, the split
    rule, merging on free) with the choices the replay reads from a trace made here instead:
    the smallest cached free block of the request's pool that fits, else a new segment
    (`segment_size`), or with `expandable` the pool's one segment grown at its end by pages."""

    def __init__(self, expandable=False):
        super().__init__()
        self.by_size = {True: [], False: []}  # small pool? -> sorted [(size, start)] of free blocks
        self.pool_of = {}  # segment start -> small pool?
        self.next_segment = 1 << 60  # the next segment ends here (they go down)
        self.reserved = 0  # bytes of all segments (cudaMalloc'd, never released in a step)
        self.expandable = expandable
        self.grown = {}  # expandable: small pool? -> its segment's start

    def _add_free(self, start, size, seg):
        super()._add_free(start, size, seg)
        bisect.insort(self.by_size[self.pool_of[seg]], (size, start))

    def _take_free(self, start):
        pool = self.by_size[self.pool_of[self.segment_of[start]]]
        del pool[bisect.bisect_left(pool, (self.free[start], start))]
        return super()._take_free(start)

    def _new_segment(self, small, size):
        # each below the last, never touching (no merging across segments): the address breaks
        # best fit's ties, and cudaMalloc hands out lower addresses as it goes (73 of 85 large
        # segments of a GPT-2 run on an H200; the small pool's 2 MiB ones go either way). Made
        # upwards, the model missed 7 of 11 GPT-2-sized H200 peaks by up to 8.65 MB fed the runs'
        # own requests; downwards none (and 1 of 91 tiny runs' reserved either way)
        self.next_segment -= size + (1 << 30)
        seg = self.next_segment
        self.pool_of[seg] = small
        self.segment_alloc(seg, size)
        self.reserved += size
        return seg

    def _grow(self, small, rounded):
        """Map pages at the end of the pool's segment (joining its free tail); returns the start."""
        if small not in self.grown:
            self.next_segment -= 1 << 44  # room above it to grow into
            self.grown[small] = self._new_segment(small, 0)
        seg = self.grown[small]
        end = seg + self.segments[seg]
        tail = self.free_by_end.get(end)
        start, have = (tail, self._take_free(tail)) if tail is not None else (end, 0)
        page = EXPANDABLE_PAGE[small]
        pages = -(-(rounded - have) // page) * page
        self.segments[seg] += pages
        self.reserved += pages
        self._add_free(start, have + pages, seg)
        return start

    def alloc(self, nbytes):
        """Returns (address, bytes in the block beyond the 512 B rounding)."""
        rounded = round_size(nbytes)
        small = rounded <= MiB
        pool = self.by_size[small]
        i = bisect.bisect_left(pool, (rounded, -1))
        if i < len(pool):
            start = pool[i][1]
        elif self.expandable:
            start = self._grow(small, rounded)
        else:
            start = self._new_segment(small, segment_size(rounded))
        return start, super().alloc(start, nbytes) - rounded

    def release(self, addr):
        self.complete(addr)


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
        stream = by_key.get(f"activations/{block}.ln_2/native_layer_norm.input", 0)  # (B, T, C) fp32
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
        elif manual and module.endswith("attn.c_attn") and op == "mm.self":
            at(i, "after", ("alloc", f"{block}.qkv", 3 * by_key.get(f"activations/{block}.attn/bmm.self", 0)))
        elif manual and op == "bmm.mat2":
            scores = by_key.get(f"activations/{block}.attn/softmax.result", 0) * low // 4
            at(i, "after", ("alloc", f"{block}.scores", scores), ("alloc", f"{block}.scaled", scores),
               ("free", f"{block}.scores", 0))
        elif manual and op == "masked_fill.mask":
            at(i, "after", ("alloc", f"{block}.masked", by_key.get(f"activations/{block}.attn/softmax.result", 0) * low // 4),
               ("free", f"{block}.scaled", 0))
        elif manual and op == "softmax.result":
            at(i, "after", ("free", f"{block}.masked", 0))
        elif manual and module.endswith("attn.c_proj") and op == "mm.self":  # att @ v, before its copy
            at(i, "before", ("alloc", f"{block}.y", l["bytes"]))
        if module.endswith("attn.c_proj") and op == "mm.self":
            at(i, "after", ("free", f"{block}.y", 0))
        if module.endswith("c_proj") and last_matmul_line.get(module) == i:
            at(i, "after", ("alloc", f"{module}.out", stream * low // 4))
            if module.endswith("attn.c_proj"):
                at(i, "after", ("free", f"{block}.qkv", 0))
        if block.startswith("h."):
            previous_block = block
    return steps


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
    for l in ledger:
        if l["category"] in ("weights", "buffers"):
            alloc(l["key"], l["bytes"])
    for i, l in enumerate(l for l in ledger if l["key"] == "grads/ddp_buckets"):  # made by DDP(model)
        alloc(("ddp_bucket", i), l["bytes"])
    # cuBLAS workspaces hold segments of their own size class; they stay out of the free lists
    # (where they fall in the history is not modelled) and count in reserved only
    workspaces = [round_size(l["bytes"]) for l in ledger if l["category"] == "workspace"]
    model.reserved += sum(segment_size(n) for n in workspaces)
    batch = [l["bytes"] for l in ledger if l["key"] in ("inputs/x", "inputs/y")]
    for i, n in enumerate(batch):
        alloc(("batch", i), n)
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


def replay_requests(act, addr, size, expandable=False):
    """The allocator model fed a real trace's requests in their order (the sizes asked for and
    when each block came back), choosing blocks and segments itself. For a trace that starts
    with the process (an audit records from before the model exists) the segments it makes
    should be the ones the snapshot shows: where they are, the allocator rules are right and a
    reserved-memory miss lies in the predicted history (which tensors, in which order), not in
    the rules. Returns {"reserved": bytes of the model's segments, "segments": their sizes,
    "trace_reserved": bytes of the trace's own segment_alloc/map entries, "trace_segments"}."""
    model, placed, real = CachingAllocatorModel(expandable), {}, []
    for a, ad, sz in zip(act, addr, size):
        a, ad, sz = int(a), int(ad), int(sz)
        if a == ALLOC:
            placed[ad] = model.alloc(sz)[0]
        elif a in (FREE_COMPLETED, FREE) and ad in placed:
            model.release(placed.pop(ad))
        elif a in (SEG_ALLOC, SEG_MAP):
            real.append(sz)
    return {"reserved": model.reserved, "segments": sorted(model.segments.values()),
            "trace_reserved": sum(real), "trace_segments": sorted(real)}
