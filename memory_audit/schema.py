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
