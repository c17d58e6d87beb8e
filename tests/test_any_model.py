"""Any model (issue #28): a Llama-style decoder written in the tests (tests/llama.py: RMSNorm, SwiGLU,
rotary embeddings, grouped-query attention through SDPA, AdamW), audited through the public Audit
API without naming anything, and predicted before it runs by the shadow run of its own loop."""

import pytest
import torch

from conftest import plain_bf16
from llama import llama_loop, llama_step
from memory_audit import Audit
from memory_audit.comparison.reconcile import first_divergence, measure, step_events

CASES = [("float32", False), ("float32", True),
         pytest.param("bfloat16", False, marks=plain_bf16), pytest.param("bfloat16", True, marks=plain_bf16)]


def _train(make, step, audit_dir=None, steps=3):
    model, opt, x, y = make()
    audit = Audit(model, opt, out_dir=str(audit_dir)) if audit_dir else None
    losses = []
    for s in range(steps):
        if audit is None:
            kept = step(model, opt, x, y)
        else:
            with audit.step(s):  # nothing named: the audit finds the batch itself
                kept = step(model, opt, x, y, audit)
        losses.append(kept["temporary/loop/loss"].item())
    return losses


@pytest.mark.parametrize("dtype, checkpointing", CASES, ids=lambda v: str(v))
def test_llama_decoder_named_and_predicted_to_the_byte(tmp_path, dtype, checkpointing):
    """Every phase 0 unattributed without tensors= (the batch found as what the model receives and
    what the loss saved; the previous step's loss and output, which the loop still holds before
    backward, keep the names step2_start gave them); training
    unchanged by the audit; what is live when the step starts, line by line, and the step's
    peak equal to the shadow run of the same loop (shadow.run_loop), to the byte. With
    torch.utils.checkpoint called by the model itself the audit's graph walk must leave the
    regions' saved tensors alone: reading one runs the recomputation (it once held 21 MB more
    than the run without the audit)."""
    from memory_audit import predict_loop
    make, step = (lambda: llama_loop(checkpointing)), llama_step(dtype)
    plain = _train(make, step)
    assert _train(make, step, tmp_path / "run") == plain  # the audit only observes
    run = str(tmp_path / "run")
    m = measure(run)
    for phase, info in m["phases"].items():
        assert info["attribution"]["unattributed_bytes"] == 0, (phase, info["attribution"]["unattributed"])
    # the public name of prediction.shadow.run_loop; the batch by the names the audit found for it
    r = predict_loop(make, step, inputs=("inputs/model.tokens", "inputs/loop/nll_loss.target"))
    live = {}
    for _, key, nbytes in r["pre"]:
        live[key] = live.get(key, 0) + nbytes
    assert live == m["phases"]["step2_start"]["attribution"]["lines"]
    measured = m["phases"]["step2_end"]["replay"]["peak"]["bytes"]
    assert measured == r["peak"], (measured, r["peak"], first_divergence(step_events(run), r["events"]))


def test_checkpoint_regions_of_any_model_are_left_alone(tmp_path):
    """The audited forward of a model that calls torch.utils.checkpoint itself holds no more than
    the same forward unaudited just before backward (the checkpointed blocks' activations are
    not recomputed by the audit's graph walk)."""
    model, opt, x, y = llama_loop(True)
    step = llama_step("float32")
    audit = Audit(model, opt, out_dir=str(tmp_path))
    for s in range(3):
        with audit.step(s, tensors={"inputs/x": x, "inputs/y": y}):
            step(model, opt, x, y, audit)
    m = measure(audit.run_dir)
    acts = m["phases"]["step2_before_backward"]["attribution"]["categories"].get("activations", 0)
    # the blocks keep only their inputs (2 x 2*32*64*4 B) and the rotary buffers they were given;
    # the head and the loss keep theirs: well under one block's unrecomputed activations
    assert acts < 200_000, acts
    assert torch.is_grad_enabled()


def test_report_sets_the_loops_prediction_beside_the_measurement(tmp_path):
    """Audit(predicted=predict_loop(...)) keeps the loop's shadow run in meta.json; `report` (no
    torch) then shows it beside the measurement: the steady state and the peak predicted and
    measured (equal, for the fp32 Llama loop), and step2_start's lines side by side."""
    import json

    from conftest import run_cli
    from memory_audit import predict_loop
    make, step = (lambda: llama_loop(False)), llama_step("float32")
    predicted = predict_loop(make, step, inputs=("inputs/model.tokens", "inputs/loop/nll_loss.target"))
    model, opt, x, y = make()
    audit = Audit(model, opt, out_dir=str(tmp_path), predicted=predicted)
    kept = None  # the loop holds each step's output and loss until the next, as predict_loop's does
    for s in range(3):
        with audit.step(s):
            kept = step(model, opt, x, y, audit)
    assert kept is not None
    p = run_cli("report", str(tmp_path))
    assert p.returncode == 0, p.stderr
    with open(tmp_path / "report.json") as f:
        rec = json.load(f)
    assert rec["predicted"] and rec["predicted_by"].startswith("predict_loop")
    for key in ("steady_state", "peak"):
        assert rec["totals"][key]["diff"] == 0 and rec["totals"][key]["actual"] == predicted["summary"][key]
    assert rec["phases"]["step2_start"]["predicted_lines"] == rec["phases"]["step2_start"]["lines"]
    md = (tmp_path / "report.md").read_text()
    assert "Predicted by predict_loop" in md and "| allocation | predicted | bytes |" in md
    with pytest.raises(Exception, match="predicted= expects"):
        Audit(model, opt, out_dir=str(tmp_path / "bad"), predicted={"peak": "many"})
