"""Rules as data (issue #45): each CUDA rule is one registry entry per op and part, registered
beside its definition in memory_audit/prediction/shadow/rules/cuda.py, its docstring naming the GPU
traces it was read from; the shadow's tracker finds it by the op it runs."""

import glob
import os
import re

import pytest
import torch

from conftest import ROOT
from memory_audit.prediction.shadow import cuda as shadow_cuda
from memory_audit.prediction.shadow.rules import REGISTRY, cuda, parts, rule

SOURCES = ("tiny H100 audit", "random H200 audits", "random H100 audits", "GPT-2-sized H200 runs", "zoo H100 traces", "zoo H200 traces")


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
