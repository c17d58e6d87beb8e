"""Rules as data (issue #45): each CUDA rule is one registry entry per op and part, registered
beside its definition in memory_audit/prediction/shadow/rules/cuda.py, its docstring naming the GPU
traces it was read from; the shadow's tracker finds it by the op it runs."""

import glob
import math
import os
import re

import pytest
import torch

from conftest import ROOT
from memory_audit.prediction.shadow import cuda as shadow_cuda
from memory_audit.prediction.shadow.rules import REGISTRY, cuda, parts, rule

SOURCES = ("tiny H100 audit", "random H200 audits", "random H100 audits", "GPT-2-sized H200 runs", "zoo H100 traces", "zoo H200 traces",
           "H200 reduction probe")


def test_every_cuda_rule_is_found_by_its_op_and_names_its_trace():
    ops = torch.ops.aten
    assert len(REGISTRY["cuda"]) >= 12
    for name, found in REGISTRY["cuda"].items():
        packet, op, overload = name.split(".")
        func = getattr(getattr(getattr(torch.ops, packet), op), overload)
        assert parts("cuda", func) == found, name  # the tracker's lookup reaches it
        for part, fn in found.items():
            if part != "outside":  # a source the module's docstring lists with its committed paths
                assert any(src in " ".join((fn.__doc__ or "").split()) for src in SOURCES), (name, part)
    listed = re.findall(r"snapshots/[\w/.*-]+", cuda.__doc__)
    assert len(listed) >= 6
    for path in listed:  # every committed trace the rules name is in the repository
        assert glob.glob(os.path.join(ROOT, path.rstrip(",."))), path
    assert parts("cuda", ops.mm.default) == {}  # no rule: the dispatcher's view alone


def test_a_rule_registers_each_part_once():
    with pytest.raises(ValueError, match="two 'after' parts"):
        rule("cuda", "aten.cumsum.default", "after")(lambda args: [])
    with pytest.raises(ValueError, match="part is one of"):
        rule("cuda", "aten.cumsum.default", "during")(lambda args: [])


def test_a_rule_outside_its_sample_is_said_in_words():
    q = torch.empty(1, 2, 512, 64, device="meta")
    assert shadow_cuda.outside_sample(torch.ops.aten._scaled_dot_product_cudnn_attention.default, (q, q, q)) == \
        "cuDNN attention's buffers at head size 64, T 512 (measured: head size 16 or 32 with T up to 256, or 64 at T 1,024 (H100, H200))"
    q = torch.empty(1, 2, 1024, 64, device="meta")
    assert shadow_cuda.outside_sample(torch.ops.aten._scaled_dot_product_cudnn_attention.default, (q, q, q)) is None


def test_every_cpu_rule_is_found_by_its_op_and_names_where_it_was_read():
    """shadow/rules/cpu.py: each op's rule reached by the tracker's lookup, its docstring naming the
    audits it was read from by a file in the repository (a test, a script or a results file)."""
    from memory_audit.prediction.shadow.rules import collectives, cpu  # noqa: F401 -- registers
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 -- defines fsdp.chunk_cat
    assert len(REGISTRY["cpu"]) >= 14
    for name, found in REGISTRY["cpu"].items():
        packet, op, overload = name.split(".")
        assert parts("cpu", getattr(getattr(getattr(torch.ops, packet), op), overload)) == found, name
        for part, fn in found.items():
            named = re.findall(r"(?:tests|scripts|snapshots)/[\w/.*-]+\.(?:py|txt|jsonl)", " ".join((fn.__doc__ or "").split()))
            assert named, (name, part)
            for path in named:
                assert glob.glob(os.path.join(ROOT, path)), (name, part, path)


def _probe_rows(name):
    import json
    with open(os.path.join(ROOT, "snapshots/results/reduce", name)) as f:
        head, *rows = [json.loads(line) for line in f]
    return head, rows


def test_a_reductions_global_buffer_is_every_measured_one():
    """rules/reduce.py against the H200 reduction probe (scripts/gpu_reduce.py): the 42 grid
    shapes and the 150 drawn ones, then 200 drawn in four layouts after the rule was written,
    each op's buffer and semaphores to the byte, through the registry's events part on meta
    tensors (of the measured strides and offset) as the shadow calls it."""
    from memory_audit.prediction.shadow.rules import reduce
    head, rows = _probe_rows("h200-reduce-187258.jsonl")
    strided_head, strided = _probe_rows("h200-reduce-strided-215222.jsonl")
    for h in (head, strided_head):
        assert (h["sm_count"], h["max_threads_per_sm"]) == reduce.MEASURED_CORES
    ops = torch.ops.aten
    calls = {"sum0": (ops.sum.dim_IntList, lambda x: (x, [0])), "sum01": (ops.sum.dim_IntList, lambda x: (x, [0, 1])),
             "sum_last": (ops.sum.dim_IntList, lambda x: (x, [-1])), "mean0": (ops.mean.dim, lambda x: (x, [0])),
             "sum0_fp32": (ops.sum.dim_IntList, lambda x: (x, [0])), "amax0": (ops.amax.default, lambda x: (x, [0])),
             "norm": (ops.linalg_vector_norm.default, lambda x: (x,)), "sum_all": (ops.sum.default, lambda x: (x,))}
    split = 0
    for row in rows + strided:
        func, args = calls[row["op"]]
        x = torch.empty(row["shape"], dtype=getattr(torch, row["dtype"]), device="meta")
        if "strides" in row:
            size = row["offset"] + 1 + sum((n - 1) * s for n, s in zip(row["shape"], row["strides"]))
            x = torch.empty(size, dtype=x.dtype, device="meta").as_strided(row["shape"], row["strides"], row["offset"])
        made = [size for action, size in row["events"] if action == "alloc"][1:]  # after the output
        found = shadow_cuda.kernel_events(func, args(x))
        if not made:
            assert found is None, row
            continue
        split += 1
        assert found == ([], [("alloc", made[0]), ("alloc", made[1]), ("free", 1), ("free", 0)]), row
        frees = [n for action, n in row["events"] if action == "free_completed"]
        assert frees == [made[1], made[0]]  # the semaphores first
    assert split >= 100 and len(rows) == 192 and len(strided) == 200
    assert sum(r["strides"] != [math.prod(r["shape"][i + 1:]) for i in range(len(r["shape"]))]
               and len(r["events"]) > 2 for r in strided) == 15  # non-contiguous inputs that split


def test_a_reduction_on_another_gpu_is_sized_by_its_sms_and_said_unmeasured():
    from memory_audit.prediction.shadow.rules import reduce
    x = torch.empty(16384, 3072, device="meta")
    h200 = reduce.global_buffers([16384, 3072], [3072, 1], 0, {0}, 4)
    assert h200 == [138412032, 96]  # the probe's row, measured: 88 blocks per output (132 SMs x 16 / 24)
    assert shadow_cuda.outside_sample(torch.ops.aten.sum.dim_IntList, (x, [0])) is None
    with reduce.on_cores((108, 2048)):  # an A100's 108 SMs: 72 blocks per output
        a100 = shadow_cuda.kernel_events(torch.ops.aten.sum.dim_IntList, (x, [0]))
        assert a100[1][:2] == [("alloc", 4 * 3072 * 72 * 128), ("alloc", 96)]
        assert shadow_cuda.outside_sample(torch.ops.aten.sum.dim_IntList, (x, [0])).startswith(
            "a CUDA reduction's global buffer at sum of (16384, 3072) on 108 SMs x 2048 threads (measured: ")
    assert reduce.global_buffers([512, 768], [768, 1], 0, {0}, 4) == []  # within one block per output
    with reduce.on_cores(None):  # a GPU the table does not know: sized as the H200, said unmeasured
        assert shadow_cuda.kernel_events(torch.ops.aten.sum.dim_IntList, (x, [0]))[1][0] == ("alloc", 138412032)
        assert "on a GPU of unknown SMs" in shadow_cuda.outside_sample(torch.ops.aten.sum.dim_IntList, (x, [0]))


def test_a_reduction_the_probe_did_not_measure_is_said_so():
    """Integer and fp64 inputs (an 8 B accumulator), kept dims out of the output's order, 0-d
    inputs (nothing to split) and a dim given as an int."""
    sum_dims, mean_all = torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.default
    mask = torch.empty(16384, 3072, dtype=torch.bool, device="meta")
    assert shadow_cuda.kernel_events(sum_dims, (mask, [0]))[1][0] == ("alloc", 8 * 3072 * 88 * 128)
    assert shadow_cuda.outside_sample(sum_dims, (mask, [0])).startswith(
        "a CUDA reduction's global buffer at sum of (16384, 3072), bool strides (3072, 1) on 132 SMs")
    x = torch.empty(16384, 3072, device="meta")
    assert shadow_cuda.kernel_events(sum_dims, (x, 0)) == shadow_cuda.kernel_events(sum_dims, (x, [0]))
    assert shadow_cuda.outside_sample(sum_dims, (x, [0])) is None
    scalar = torch.empty((), device="meta")
    assert shadow_cuda.kernel_events(mean_all, (scalar,)) is None and shadow_cuda.outside_sample(mean_all, (scalar,)) is None
    # kept dims 0 and 2 out of the output's order: TensorIterator (as read) splits nothing here,
    # the input's order would; neither is measured, so it is said
    swapped = torch.empty(16, 65536, 64, device="meta").permute(2, 1, 0)
    assert shadow_cuda.kernel_events(sum_dims, (swapped, [1])) is None
    assert "strides (1, 64, 4194304)" in shadow_cuda.outside_sample(sum_dims, (swapped, [1]))
