"""CUDA-only checks; they skip on machines without a GPU (CI) and run on any machine with one."""

import os

import pytest
import torch

from conftest import load_json, run_train
from memory_audit.reading.loader import load_snapshot
from memory_audit.comparison.reconcile import mismatched, reconcile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _audit_beside_plain(tmp_path, *args):
    """A tiny CUDA run with and without --audit: the losses must match bit for bit."""
    common = ["--device=cuda", "--preset=cpu-tiny", "--batch_size=4", "--max_iters=3", *args]
    plain = run_train(*common, f"--losses_out={tmp_path}/plain.json")
    audited = run_train(*common, "--audit", f"--audit_dir={tmp_path}", "--run_name=r",
                        f"--losses_out={tmp_path}/audited.json")
    assert plain.returncode == 0 and audited.returncode == 0, audited.stderr[-3000:]
    assert load_json(tmp_path / "plain.json") == load_json(tmp_path / "audited.json")
    return reconcile(str(tmp_path / "r"))


@pytest.mark.parametrize("dtype, attention", [("float16", "manual"), ("bfloat16", "sdpa"), ("float32", "manual")])
def test_cuda_audit_is_exact_and_does_not_change_training(tmp_path, dtype, attention):
    """As the two committed tiny CUDA audits are (README): every line of every phase, the steady
    state, the activations, the peak and the reserved memory to the byte."""
    rec = _audit_beside_plain(tmp_path, f"--dtype={dtype}", f"--attention={attention}")
    _assert_exact(rec)


def _assert_exact(rec):
    assert rec["unattributed_bytes"] == 0
    assert mismatched(rec["rows"]) == []
    assert rec["checks"]["replayed_peak_equals_max_memory_allocated"] is True
    totals = {k: rec["totals"][k]["diff"] for k in ("steady_state", "activations", "peak", "reserved")}
    print("predicted peak at", rec["cost"]["peak_at"], totals)
    assert totals == dict.fromkeys(totals, 0), totals


def test_oom_leaves_a_snapshot_and_one_line(tmp_path):
    p = run_train("--device=cuda", "--preset=gpt2", "--batch_size=512", "--audit", f"--audit_dir={tmp_path}",
                  "--run_name=oom")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and "OutOfMemoryError" in p.stderr and "oom.pickle" in p.stderr
    snap = load_snapshot(str(tmp_path / "oom" / "oom.pickle"))
    assert any(e["action"] == "oom" for e in snap["device_traces"][0])
    assert load_json(tmp_path / "oom" / "meta.json")["error"]["oom"] is True


@pytest.mark.parametrize("mode, dtype, attention", [("full", "float16", "manual"), ("selective", "float16", "sdpa"),
                                                    ("sac", "bfloat16", "manual")])
def test_cuda_checkpointing_audit(tmp_path, mode, dtype, attention):
    """Every checkpointing mode on CUDA: training unchanged, every line named and predicted, the
    totals and the peak exact as on CPU (the rules are CPU-measured: README's list of what a
    GPU run would settle), the recomputation labelled in the trace."""
    rec = _audit_beside_plain(tmp_path, f"--dtype={dtype}", f"--attention={attention}",
                              f"--activation_checkpointing={mode}")
    _assert_exact(rec)
    assert hasattr(torch.cuda.memory, "_set_memory_metadata")  # the recorder labels recomputation with it
    assert any(p["categories"].get("recomputed") for p in rec["series"])


@pytest.mark.parametrize("mode, dtype", [("full", "float16"), ("sac", "bfloat16")])
def test_cuda_checkpointing_with_dropout_audit(tmp_path, mode, dtype):
    """A recomputation that stops inside dropout (its mask the last tensor the region saved)
    frees the op's outputs as its exception passes: with stacks gathered on frees the exception
    was lost and backward died with a SystemError (torch 2.11; recorder.py records stacks on
    allocations only). Training unchanged, every line and total exact."""
    rec = _audit_beside_plain(tmp_path, f"--dtype={dtype}", f"--activation_checkpointing={mode}", "--dropout=0.1")
    _assert_exact(rec)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_batch_one_full_checkpointing_peak(tmp_path, dtype):
    """The end-of-backward moments measured on CPU (the token embedding's backward; fp32 adds the
    tied gradients out of place): at batch 1 with full checkpointing one of them is the peak.
    Whether CUDA's engine adds in place the same way is what this checks."""
    rec = _audit_beside_plain(tmp_path, f"--dtype={dtype}", "--attention=manual", "--batch_size=1",
                              "--activation_checkpointing=full")
    print("predicted peak at", rec["cost"]["peak_at"], "diff", rec["totals"]["peak"]["diff"])
    assert rec["unattributed_bytes"] == 0 and mismatched(rec["rows"]) == []
    assert rec["totals"]["peak"]["diff"] == 0


def test_api_on_a_cuda_loop_that_is_not_gpt(tmp_path):
    """The Audit made after the model: the weights predate the trace and are named from the
    segments by the phases' registry; every phase and the peak fully named."""
    import subprocess
    import sys
    from conftest import ROOT
    from memory_audit.comparison.reconcile import measure
    out = tmp_path / "any-loop"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "any_loop.py"), str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    m = measure(str(out))
    for phase, info in m["phases"].items():
        assert info["attribution"]["unattributed_bytes"] == 0, (phase, info["attribution"]["unattributed"])
        assert info["attribution"]["allocated_bytes"] == info["memory_allocated"]
    rp = m["phases"]["step2_end"]["replay"]
    assert not [k for k in rp["peak"]["lines"] if k.startswith("unattributed")], rp["peak"]["lines"]
    assert rp["peak"]["bytes"] == m["phases"]["step2_end"]["max_memory_allocated"]
    assert any(k.startswith("weights/") for k in rp["peak"]["lines"])


@pytest.mark.parametrize("dtype, attention, budget", [("float16", "manual", 1.0), ("bfloat16", "sdpa", 0.5)])
def test_cuda_compiled_audit(tmp_path, dtype, attention, budget):
    """A compiled step on CUDA: training unchanged, every saved storage named by its FX node and
    predicted from inductor's plan (made on this GPU); the peak within 0.5% (allocator gaps)."""
    rec = _audit_beside_plain(tmp_path, f"--dtype={dtype}", f"--attention={attention}", "--compile=True",
                              f"--activation_memory_budget={budget}")
    assert rec["unattributed_bytes"] == 0
    assert mismatched(rec["rows"], categories=("activations",)) == []
    assert rec["checks"]["replayed_peak_equals_max_memory_allocated"] is True
    assert abs(rec["totals"]["peak"]["diff_pct"]) < 0.5, rec["totals"]["peak"]
