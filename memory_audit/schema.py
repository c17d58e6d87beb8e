"""The plain-dict formats that cross module boundaries, described once.

Snapshot dicts are kept as torch wrote them (see torch/cuda/memory.py), except that each device
trace is held as columns (trace.Trace); this module describes what memory_audit itself writes
(meta.json, attributions, ledgers, reports) and the model-config rules that both model.py and
the torch-free predictor apply. All byte counts are Python ints.
"""

from typing import TypedDict

META_SCHEMA_VERSION = 1
REPORT_SCHEMA_VERSION = 1

def check_model_config(cfg):
    """Raise ValueError with a one-line reason if a model config (a dict) cannot build a GPT."""
    for key in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if cfg["n_embd"] % cfg["n_head"]:
        raise ValueError(f"n_embd={cfg['n_embd']} is not divisible by n_head={cfg['n_head']}")
    if cfg["attention"] not in ("manual", "sdpa"):
        raise ValueError(f"attention must be 'manual' or 'sdpa', got {cfg['attention']!r}")
    if cfg["activation"] not in ("gelu", "relu"):
        raise ValueError(f"activation must be 'gelu' or 'relu', got {cfg['activation']!r}")
    if not 0.0 <= float(cfg["dropout"]) < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {cfg['dropout']!r}")
    check_checkpointing(cfg)


AC_MODES = ("none", "full", "selective", "sac")
# SAC's default policy keeps the outputs of the matmuls and of the attention kernels (seed 002's
# "compute intensive" policy, with the SDPA kernels this project's GPUs and CPUs pick)
SAC_DEFAULT_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                   "_scaled_dot_product_flash_attention_for_cpu")


def sac_ops(cfg):
    """The aten op names (without overload) SAC saves, as a tuple."""
    text = cfg.get("sac_save_ops") or ""
    return tuple(n.strip() for n in text.split(",") if n.strip()) or SAC_DEFAULT_OPS


def check_checkpointing(cfg):
    """The activation-checkpointing keys: mode, ac_every, sac_save_ops (names checked for syntax
    here; model.py also checks that each is an aten op, which needs torch)."""
    mode = cfg.get("activation_checkpointing", "none")
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(AC_MODES)}, got {mode!r}")
    every = cfg.get("ac_every", 1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"ac_every must be an integer of at least 1, got {every!r}")
    for name in sac_ops(cfg):
        if not name.isidentifier():
            raise ValueError(f"sac_save_ops: {name!r} is not an aten op name (e.g. mm,bmm,addmm)")


PHASES = ("step2_start", "step2_before_backward", "step2_end")

# Names the recorder leaves in a profile or trace: phase markers (CPU profiler ranges) and the
# label of a checkpoint's recomputation (CUDA: allocator memory metadata; CPU: a profiler range,
# copied into the trace entries' user_metadata).
MARKER_PREFIX = "memory_audit::"
RECOMPUTE_LABEL = "recompute:"
# The filename of the one frame each event of a predicted snapshot (shadow/step.snapshot) carries;
# the frame's name is the event's ledger key, which attribution reads back.
PREDICTED_FRAME = "<predicted>"
# A predicted snapshot's own top-level key: {phase: the trace entry at which it begins}, what
# meta.json's phases say of an audit (MemoryViz reads no key it does not know)
PHASES_KEY = "memory_audit_phases"

# Categories an active or cached byte can land in, in the order tables print them.
# `user`: what a script's own code made outside forward, backward and the optimizer and still
# holds (snapshots without meta.json, named by allocation site).
CATEGORIES = (
    "weights", "buffers", "grads", "optimizer", "inputs", "activations", "recomputed",
    "workspace", "user", "temporary", "baseline", "gaps", "cached_free", "pending_free", "unattributed",
)


class RegistryEntry(TypedDict):
    name: str  # "weights/transformer.h.0.attn.c_attn.weight", "inputs/x", ...
    data_ptr: int  # storage data_ptr: equals the allocation's address
    nbytes: int  # storage nbytes
    dtype: str
    shape: list


class SavedTensor(TypedDict):
    key: str  # "activations/h.0.attn/softmax.result"
    module: str  # module path that saved it ("" for the root GPT module)
    op: str  # grad_fn name and saved attribute, e.g. "softmax.result"
    grad_fn: str
    savers: list  # every (grad_fn.attr) that saved this storage
    data_ptr: int
    nbytes: int
    dtype: str
    shape: list


class PhaseMeta(TypedDict, total=False):
    file: str
    memory_allocated: int | None  # None on CPU: there is no caching allocator to ask
    memory_reserved: int | None
    max_memory_allocated: int | None
    trace_entries: int
    ring_buffer_full: bool
    time_us: int | None
    registry: list  # of RegistryEntry


class LedgerLine(TypedDict):
    """One line of predict()'s ledger."""
    key: str  # same names as the attribution: "activations/h.0.attn/softmax.result"
    category: str
    bytes: int  # requested bytes (negative for tensors released before the peak)
    allocated: int  # after the caching allocator's 512 B rounding (CUDA)
    dtype: str
    shape: list
    formula: str  # "4*B*n_head*T^2"
    phases: list  # the PHASES it is live in, or ["peak"] for the backward's first moments
    note: str


class ReportRow(TypedDict):
    """One row of reconcile()'s report: a ledger line beside its measurement."""
    phase: str
    key: str
    category: str
    dtype: str
    formula: str
    predicted: int | None  # None: measured but not predicted
    actual: int | None  # None: predicted but not measured
    diff: int | None  # actual - predicted
    diff_pct: float | None
    note: str
