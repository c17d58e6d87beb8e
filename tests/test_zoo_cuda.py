"""Library models nobody here wrote, audited on an H100 in the loop users write (scripts/zoo.py,
scripts/zoo_audit.py; snapshots/results/zoo/): read back on CPU, every byte of step 2's end is
named and the replayed peak is the one the H100 run recorded. The truth a CPU-only prediction of
these loops on CUDA is checked against (issues #46, #49)."""

import json
import os
import tarfile

import pytest

from conftest import ROOT

ZOO = os.path.join(ROOT, "snapshots", "results", "zoo")


SETS = {  # archive of runs -> (rows files, top folder, runs in it)
    "h100-zoo-408334-runs.tgz": (("h100-zoo-408334.jsonl",), "zoo2", 52),
    "h200-zoo-256239-runs.tgz": (("h200-zoo-256239.jsonl", "h200-zoo-256239-rerun.jsonl"), "zoo", 60),
}


@pytest.fixture(scope="module", params=sorted(SETS))
def runs(request, tmp_path_factory):
    rows_files, top, count = SETS[request.param]
    out = tmp_path_factory.mktemp("zoo")
    with tarfile.open(os.path.join(ZOO, request.param)) as tar:
        tar.extractall(out, filter="data")
    rows = {}
    for name in rows_files:
        with open(os.path.join(ZOO, name)) as f:
            for line in f:
                row = json.loads(line)
                if "error" not in row:
                    rows[f"zoo-{row['seed']}-{row['index']:02d}"] = row
    return out / top, rows, count


def test_every_byte_of_every_library_loop_is_named(runs):
    """52 loops on an H100 and 60 on an H200 (transformers, timm, torchvision, plain torch; fp32
    and bf16; six optimizers; the libraries' own checkpointing, with dropout on the H200):
    nothing unattributed at step 2's end. The cuBLAS workspaces
    are made where each loop's first GEMM runs: a Linear, a rotary embedding's `@`, GPT-2's
    Conv1D addmm, Adafactor's step (a U-Net's convolutions use none), autograd's thread."""
    from memory_audit.reading.attribute import attribute
    from memory_audit.reading.loader import load_meta, load_snapshot
    from memory_audit.reading.timeline import replay
    folder, rows, count = runs
    names = sorted(os.listdir(folder))
    assert len(names) == count
    for name in names:
        run = os.path.join(folder, name)
        meta = load_meta(run)
        snap = load_snapshot(os.path.join(run, "step2_end.pickle"))
        measured = attribute(snap, meta, "step2_end")[0]
        assert measured["unattributed_bytes"] == 0, (name, measured["unattributed"][:2])
        # one cuBLAS workspace per thread that ran a GEMM (none where only convolutions ran)
        assert measured["lines"].get("workspace/cublas", 0) in (0, 32 << 20, 64 << 20), name
        assert measured["lines"].get("workspace/cublaslt", 0) in (0, 1 << 20, 2 << 20), name
        assert measured["balanced"], name
        assert replay(snap, meta, device=0)["peak"]["bytes"] == rows[name]["peak"]["bytes"], name


def test_a_measured_event_is_named_by_the_code_that_made_it(runs):
    """The audit's torch-function mode (naming/loop_calls.py) sits above every call the loop
    makes in a CUDA trace's frames: the event a comparison prints names the function under it."""
    from memory_audit.comparison.reconcile import step_events
    folder, _, _ = runs
    names = {e[1] for name in sorted(os.listdir(folder)) for e in step_events(os.path.join(folder, name))}
    assert "__torch_function__" not in names and "handle_torch_function" not in names
