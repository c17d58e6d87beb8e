"""The named grids of train.py configurations `sweep --grid=NAME` runs (and tests read): one
function each, its rows as override dicts.
"""

import itertools

COMPILE_BUDGETS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


def _product(**axes):
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*axes.values())]


def _cpu_small():
    """cpu-tiny and a one-layer variant over both dtypes, attentions and activations (CPU)."""
    sizes = [dict(preset="cpu-tiny"), dict(preset="cpu-tiny", n_layer=1, n_head=4, n_embd=64, block_size=32)]
    rows = []
    for size, batch in zip(sizes, (2, 3)):
        for c in _product(dtype=["float32", "bfloat16"], attention=["manual", "sdpa"], activation=["gelu", "relu"]):
            rows.append(dict(size, batch_size=batch, device="cpu", **c))
    return rows


def _gpt2_sizes():
    """For a GPU: GPT-2 small to xl at the batch each fits, fp16 and bf16, both attentions."""
    sizes = [("gpt2", 12), ("gpt2-medium", 12), ("gpt2-large", 8), ("gpt2-xl", 4)]
    return [dict(preset=p, batch_size=b, **c) for p, b in sizes
            for c in _product(dtype=["float16", "bfloat16"], attention=["manual", "sdpa"])]


def _variants():
    """For a GPU: GPT-2 small fp16 with one knob changed per row."""
    base = dict(preset="gpt2", batch_size=12, dtype="float16", attention="manual")
    return [dict(base, gradient_accumulation_steps=4), dict(base, set_to_none=False),
            dict(base, optimizer_impl="foreach"), dict(base, keep_logits=False, set_to_none=False),
            dict(base, dtype="float32", attention="sdpa", batch_size=4),
            dict(base, dtype="float16", attention="sdpa"),
            dict(preset="gpt2-large", batch_size=10, dtype="float16", attention="manual")]


def _cpu_ac():
    """Every checkpointing mode, both attentions, fp32 and bf16, and every 2nd block."""
    rows = [dict(preset="cpu-tiny", batch_size=2, device="cpu", activation_checkpointing=m, **c)
            for m in ("none", "full", "selective", "sac")
            for c in _product(attention=["manual", "sdpa"], dtype=["float32", "bfloat16"])]
    return rows + [dict(preset="cpu-tiny", batch_size=2, device="cpu", n_layer=3, dtype="float32",
                        activation_checkpointing=m, ac_every=2) for m in ("none", "full", "selective", "sac")]


def _cpu_compile_budget():
    """torch.compile's activation memory budget, cpu-tiny."""
    return [dict(preset="cpu-tiny", batch_size=2, device="cpu", compile=True, activation_memory_budget=b)
            for b in COMPILE_BUDGETS]


def _gpu_compile_budget():
    """For a GPU: GPT-2 small fp16 compiled (manual attention)."""
    return [dict(preset="gpt2", batch_size=12, dtype="float16", attention="manual", compile=True,
                 activation_memory_budget=b) for b in (1.0, 0.5, 0.1)]


def _cpu_parallel():
    """Every torchrun strategy on cpu-tiny (and FSDP2 with checkpointing), gloo; a row per rank."""
    base = dict(preset="cpu-tiny", batch_size=2, device="cpu", dtype="float32")
    return [base, dict(base, nproc=2, parallel="ddp", gradient_accumulation_steps=2),
            dict(base, nproc=2, parallel="fsdp", gradient_accumulation_steps=2),
            dict(base, nproc=2, parallel="fsdp", gradient_accumulation_steps=4),
            dict(base, nproc=2, parallel="tp"), dict(base, nproc=2, parallel="tp-sp"),
            dict(base, nproc=4, parallel="fsdp+tp", tp_size=2, gradient_accumulation_steps=2),
            dict(base, nproc=4, parallel="fsdp+tp-sp", tp_size=2, gradient_accumulation_steps=2),
            dict(base, nproc=2, parallel="fsdp", activation_checkpointing="full", gradient_accumulation_steps=2),
            dict(base, nproc=2, parallel="fsdp", activation_checkpointing="selective", gradient_accumulation_steps=4,
                 n_embd=128, n_head=4, n_layer=3, dtype="bfloat16"),
            dict(base, nproc=4, parallel="fsdp+tp-sp", tp_size=2, activation_checkpointing="full",
                 gradient_accumulation_steps=2, n_head=4)]


def _cpu_long():
    """Sequences long enough (T=512, 8 heads) that the attention core's T^2 gradients are the peak."""
    base = dict(preset="cpu-tiny", batch_size=2, device="cpu", block_size=512, n_head=8, attention="manual")
    return ([dict(base, activation_checkpointing=m, dtype=d) for m in ("none", "full", "selective", "sac")
             for d in ("float32", "bfloat16")]
            + [dict(base, activation_checkpointing=m, dropout=0.1) for m in ("none", "full", "selective", "sac")]
            + [dict(base, attention="sdpa", dropout=0.1, activation_checkpointing=m) for m in ("none", "full")]
            + [dict(base, dtype="float16", activation_checkpointing="full", bias=True),
               dict(base, activation_checkpointing="full", set_to_none=False, activation="relu"),
               dict(base, batch_size=1, block_size=256, n_head=4, activation_checkpointing="full"),
               dict(base, nproc=2, parallel="fsdp", activation_checkpointing="full", gradient_accumulation_steps=2),
               dict(base, nproc=2, parallel="tp-sp", activation_checkpointing="full", dtype="bfloat16"),
               dict(base, nproc=2, parallel="tp", dtype="bfloat16")])


def _smoke():
    """One tiny CPU run, for tests."""
    return [dict(preset="cpu-tiny", batch_size=2, device="cpu")]


def _gpu_long():
    """For a GPU: cpu-long's attention-core peak on CUDA (autocast: fp32 softmax)."""
    tiny = dict(preset="cpu-tiny", batch_size=2, block_size=512, n_head=8, attention="manual")
    return ([dict(tiny, dtype=d, activation_checkpointing=m) for d in ("float16", "bfloat16", "float32")
             for m in ("none", "full", "selective")]
            + [dict(preset="gpt2", batch_size=2, block_size=4096, dtype="float16", attention="manual",
                    activation_checkpointing=m) for m in ("full", "selective")])


def _gpu_ac():
    """For a GPU: GPT-2 small and medium, fp16, full and selective."""
    return [dict(preset=p, batch_size=12, dtype="float16", attention=a, activation_checkpointing=m)
            for p in ("gpt2", "gpt2-medium") for a in ("manual", "sdpa") for m in ("none", "full", "selective")]


GRID_ROWS = {"cpu-small": _cpu_small, "cpu-ac": _cpu_ac, "cpu-long": _cpu_long, "cpu-compile-budget": _cpu_compile_budget, "cpu-parallel": _cpu_parallel, "gpt2-sizes": _gpt2_sizes, "variants": _variants, "gpu-ac": _gpu_ac, "gpu-long": _gpu_long, "gpu-compile-budget": _gpu_compile_budget, "smoke": _smoke}
GRIDS = tuple(GRID_ROWS)


def grid(name):
    """A named list of train.py override dicts."""
    if name not in GRID_ROWS:
        raise ValueError(f"unknown grid {name!r}; one of {', '.join(GRIDS)}")
    return GRID_ROWS[name]()
