"""The plain-dict formats that cross module boundaries, described once.

Snapshot dicts are kept exactly as torch wrote them (see torch/cuda/memory.py); this module
describes only what memory_audit itself writes: meta.json, attributions, ledgers, reports.
All byte counts are Python ints.
"""

from typing import TypedDict

META_SCHEMA_VERSION = 1
REPORT_SCHEMA_VERSION = 1

PHASES = ("step2_start", "step2_before_backward", "step2_end")

# Categories an active or cached byte can land in, in the order tables print them.
CATEGORIES = (
    "weights", "buffers", "grads", "optimizer", "inputs", "activations",
    "workspace", "temporary", "gaps", "cached_free", "pending_free", "unattributed",
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
