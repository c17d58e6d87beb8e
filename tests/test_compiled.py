"""torch.compile groundwork (#11): the partitioner's saved values name a compiled step's saved
tensors, and the same partition is predicted without generating code. One compile of cpu-tiny
(~30-45 s on 2 cores) and three stopped compiles (~3-6 s each)."""

import os
import shutil

import pytest
import torch

from memory_audit import Audit
from memory_audit.compiled import predict_saved
from model import GPT, GPTConfig, PRESETS

pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                reason="inductor needs a C++ compiler on CPU")


def _tiny():
    torch.manual_seed(0)
    cfg = GPTConfig(**{k: v for k, v in PRESETS["cpu-tiny"].items() if k in GPTConfig.__dataclass_fields__})
    return GPT(cfg), cfg


def test_compiled_saved_tensors_are_named_by_the_partition_and_predicted(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model, cfg = _tiny()
    x = torch.randint(cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(1))
    predicted = predict_saved(model, (x, x), 1.0, "transformer.")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    audit = Audit(model, opt, out_dir=str(tmp_path / "run"), step=2, compiled=True)
    compiled = torch.compile(model)
    audited_losses = []
    for step in range(3):
        with audit.step(step, tensors={"inputs/x": x}):
            _, loss = compiled(x, x)
            audit.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        audited_losses.append(loss.item())
    assert len(audit._graphs) == 1  # one graph, no break, no recompile in the audited step
    measured = audit.recording.saved_tensors
    by_key = {s["key"]: s for s in measured}
    # the partitioner's values, as predicted without code generation, name what was packed
    assert [v["node"] for v in predicted[0]] == [v["node"] for v in audit._graphs[0]]
    assert "activations/h.0.ln_1/mul" in by_key and by_key["activations/h.0.ln_1/mul"]["shape"] == [2, 64, 64]
    named = {s["op"] for s in measured if s["grad_fn"] == "CompiledFunctionBackward"}
    assert named <= {v["node"] for v in predicted[0]} and len(named) > 10
    torch._dynamo.reset()


def test_a_lower_memory_budget_saves_fewer_bytes():
    model, cfg = _tiny()
    x = torch.randint(cfg.vocab_size, (2, cfg.block_size))
    total = {b: sum(v["nbytes"] for g in predict_saved(model, (x, x), b) for v in g) for b in (1.0, 0.1)}
    assert total[0.1] < total[1.0]
    print(f"saved bytes: budget 1.0 {total[1.0]:,} B, budget 0.1 {total[0.1]:,} B")
