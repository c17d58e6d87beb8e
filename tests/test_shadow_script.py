"""A user's own training code shadow-run as written (`with memory_audit.shadow():`, issue #46):
against an Audit of the same code on CPU, step 2's peak and every line of its three phases to the
byte, with Python's own lifetimes (the loss rebound each step), `loss.item()` logged, and
nothing restructured."""

import contextlib
import os
import sys

import pytest
import torch
from torch import nn

import memory_audit
from memory_audit import Audit
from memory_audit.comparison.reconcile import measure
from memory_audit.prediction.shadow.step import ShadowError

class Net(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind == "encoder":  # torch's own encoder: it deep-copies its layer (fake tensors: one mode)
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, activation="gelu", batch_first=True,
                                               norm_first=True)
            self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.embed = nn.Embedding(50, 32)
        else:
            self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                                      nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Linear(32 if kind == "encoder" else 16, 10)

    def forward(self, x):
        if self.kind == "encoder":
            return self.head(self.body(self.embed(x)).mean(1))
        return self.head(self.body(x).mean((2, 3)))


def loop(kind, audit_dir=None, zero_first=False, steps=3, log=True):
    """The loop as users write it: the batch made each step, the loss rebound, logged with
    .item() (log); zero_grad after the optimizer step or (zero_first) at the top of the loop;
    an Audit of step 2 where `audit_dir` is given."""
    torch.manual_seed(0)
    model = Net(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    audit = Audit(model, optimizer, out_dir=audit_dir, step=2) if audit_dir else None
    losses = []
    for step in range(steps):
        with audit.step(step) if audit is not None else contextlib.nullcontext():
            if zero_first:
                optimizer.zero_grad()
            x = torch.randint(0, 50, (4, 12)) if kind == "encoder" else torch.randn(4, 3, 16, 16)
            y = torch.randint(0, 10, (4,))
            loss = nn.functional.cross_entropy(model(x), y)
            if audit is not None:
                audit.before_backward(loss)
            loss.backward()
            optimizer.step()
            if not zero_first:
                optimizer.zero_grad()
            if log:
                losses.append(loss.item())
    if audit is not None:
        audit.close()
    return losses


LOGGED = next(i for i, line in enumerate(open(__file__), 1) if line.strip() == "losses.append(loss.item())")


@pytest.mark.parametrize("kind, zero_first, log", [("conv", False, True), ("encoder", False, True),
                                                   ("conv", True, False)])
def test_a_loop_as_written_is_its_audit(tmp_path, kind, zero_first, log):
    """A conv net with GroupNorm and SiLU, torch's own TransformerEncoder (it deep-copies its layer:
    the copies stay in the shadow's fake mode), and a loop that zeroes the gradients first (its
    zero_grad, written above the optimizer step, starts the next step: the grads of step 1 live
    when step 2 starts, as the Audit's `with audit.step(2)` sees them)."""
    loop(kind, str(tmp_path / "r"), zero_first=zero_first, log=log)
    m = measure(str(tmp_path / "r"))
    with memory_audit.shadow() as s:
        loop(kind, zero_first=zero_first, steps=100, log=log)  # stopped as step 2 ends
    assert s.summary["steps"] == 3
    assert s.result["peak"] == m["phases"]["step2_end"]["replay"]["peak"]["bytes"]
    for phase, lines in s.summary["phase_lines"].items():
        assert lines == m["phases"][phase]["attribution"]["lines"], phase
    assert all(p["attribution"]["unattributed_bytes"] == 0 for p in m["phases"].values())
    # steps 0 and 1 logged their loss: a placeholder each, with the user's line
    assert [p["where"].split(":")[:2] for p in s.summary["placeholders"]] == [["test_shadow_script.py", str(LOGGED)]] * 2 * log
    assert all(p["answer"] == 0.0 for p in s.summary["placeholders"])


def test_the_with_block_is_left_as_step_2_ends_and_the_code_after_it_runs():
    after = []
    with memory_audit.shadow() as s:
        loop("conv", steps=100)
        after.append("never")  # the loop was stopped: the rest of the block does not run
    after.append("after")
    assert after == ["after"] and s.summary["steps"] == 3


def test_code_that_fake_tensors_cannot_run_is_one_line_with_the_users_line():
    with pytest.raises(ShadowError) as e:
        with memory_audit.shadow():
            model = nn.Linear(8, 8)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                x = torch.randn(4, 8)
                keep = x[x > 0]  # a data-dependent shape: nonzero under the mask
                model(keep.view(-1, 8)[:1]).sum().backward()
                optimizer.step()
    text = str(e.value)
    assert "\n" not in text and "test_shadow_script.py" in text and "keep = x[x > 0]" in text
    assert text.startswith("the shadow run stopped at nonzero, ") and "--assume test_shadow_script.py:" in text


def test_code_that_ends_before_step_2_says_so():
    with pytest.raises(ShadowError, match="ran 1 optimizer step"):
        with memory_audit.shadow():
            model = nn.Linear(8, 8)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()


def test_a_device_it_does_not_run_is_refused_in_one_line():
    with pytest.raises(ShadowError, match="for 'cpu' or 'cuda'"):
        memory_audit.shadow(device="mps")


HF = [  # scripts/zoo.py specs: small configs, no download
    {"lib": "hf", "name": "gpt2", "attention": "eager", "dtype": "bfloat16", "optimizer": "adamw", "impl": "foreach"},
    {"lib": "hf", "name": "llama", "attention": "sdpa", "dtype": "float32", "optimizer": "adafactor", "impl": "default"},
    {"lib": "hf", "name": "bert", "attention": "sdpa", "dtype": "float32", "optimizer": "adam", "impl": "for"},
    {"lib": "hf", "name": "t5", "attention": "sdpa", "dtype": "bfloat16", "optimizer": "sgd", "impl": "foreach"},
    # the library's own gradient checkpointing: its layers are recomputed in backward (not the
    # model's forward), and the mask and rotary cos/sin reach each layer through a partial's keywords
    {"lib": "hf", "name": "llama", "attention": "eager", "dtype": "float32", "optimizer": "sgd", "impl": "for",
     "checkpointing": True},
    {"lib": "hf", "name": "bert", "attention": "eager", "dtype": "float32", "optimizer": "adam", "impl": "for",
     "checkpointing": True},
    # transformers takes a fake tensor for a trace (is_tracing) and builds the masks a real run
    # reads it can skip; with checkpointing they are kept (known_values, patches.NOT_A_TRACE)
    {"lib": "hf", "name": "qwen2", "attention": "sdpa", "dtype": "float32", "optimizer": "adamw", "impl": "fused",
     "checkpointing": True},
    # T5 with its checkpointing makes its cross-attention's position bias need a gradient: a leaf
    # that is no Parameter, named on both sides from the loss's graph (loop_names.graph_leaves)
    {"lib": "hf", "name": "t5", "attention": "sdpa", "dtype": "bfloat16", "optimizer": "adamw", "impl": "fused",
     "checkpointing": True},
]


@pytest.mark.parametrize("spec", HF, ids=[s["name"] + ("-ckpt" if s.get("checkpointing") else "") for s in HF])
def test_transformers_models_as_written(tmp_path, spec):
    """The library most users train from (transformers, from configs): GPT-2 in bf16 autocast,
    Llama (GQA, rotary, RMSNorm) with Adafactor, BERT's masked LM (labels at -100 ignored), T5's
    encoder-decoder; the usual `model(**batch).loss` step in scripts/zoo.py's loop."""
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import zoo
    spec = dict({"checkpointing": False}, **spec, size="tiny", batch=3, seed=7, heads=2, kv_heads=1 if spec["name"] in ("llama", "qwen2")
                else 2, width=32, layers=2, seq=24, vocab=300)
    model, optimizer = zoo.build(spec, "cpu")
    with Audit(model, optimizer, out_dir=str(tmp_path / "r"), step=2) as audit:
        zoo.train(spec, "cpu", audit, model=model, optimizer=optimizer)
    del model, optimizer
    m = measure(audit.run_dir)
    with memory_audit.shadow() as s:
        zoo.train(spec, "cpu", steps=10)
    assert s.result["peak"] == m["phases"]["step2_end"]["replay"]["peak"]["bytes"]
    for phase, lines in s.summary["phase_lines"].items():
        assert lines == m["phases"][phase]["attribution"]["lines"], phase
    assert all(p["attribution"]["unattributed_bytes"] == 0 for p in m["phases"].values())


def _cli(*args):
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-m", "memory_audit", *args], cwd=root, capture_output=True, text=True,
                          timeout=300)


def test_predict_script_runs_a_script_with_its_own_arguments(tmp_path):
    """`python -m memory_audit predict-script SCRIPT -- ARGS`: the script as `python SCRIPT ARGS`
    runs it, stopped as step 2 ends; the numbers are shadow()'s of the same code, the
    placeholder the script's log line read, the trace a snapshot `attribute` reads."""
    import json
    trace = tmp_path / "step2.pickle"
    p = _cli("predict-script", "--json", f"--trace={trace}", "examples/train_classifier.py", "--", "--batch=8", "--seq=32")
    assert p.returncode == 0, p.stderr[-800:]
    out = json.loads(p.stdout[p.stdout.index("{"):])
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import train_classifier
    argv = sys.argv
    sys.argv = ["train_classifier.py", "--batch=8", "--seq=32"]
    try:
        with memory_audit.shadow() as s:
            train_classifier.main()
    finally:
        sys.argv = argv
    assert out["peak"] == s.summary["peak"] and out["phase_lines"] == s.summary["phase_lines"]
    assert [p["where"].split(":")[0] for p in out["placeholders"]] == ["train_classifier.py"]  # step 0's log line
    from memory_audit.reading.attribute import attribute
    from memory_audit.reading.loader import load_snapshot
    snap = load_snapshot(str(trace))
    assert attribute(snap)[0]["unattributed_bytes"] == 0


@pytest.mark.parametrize("body, message", [
    ("raise SystemExit(3)\n", "exited (code 3) before its step 2 ended"),
    ("import torch\nx = torch.randn(4)\nprint(x[x > 0])\n", "bad.py:3: print(x[x > 0])"),
])
def test_predict_script_bad_input_is_one_line(tmp_path, body, message):
    bad = tmp_path / "bad.py"
    bad.write_text(body)
    p = _cli("predict-script", str(bad))
    assert p.returncode == 2 and p.stdout == ""
    lines = [line for line in p.stderr.splitlines() if not line.startswith("USDT")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], p.stderr


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.embed(x))


def test_a_script_ending_with_the_step_a_dtype_move_and_a_formatted_loss():
    """A loop of exactly three steps that zeroes first and ends at its optimizer step (nothing
    after it ends step 2), a model moved to another dtype after its optimizer was made (its tied
    weights stay one Parameter, the optimizer's own), an f-string formatting the loss."""
    with memory_audit.shadow() as s:
        model = Tied()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model.to(torch.float64)
        assert model.head.weight is model.embed.weight
        for _ in range(3):
            optimizer.zero_grad()
            x = torch.randint(0, 50, (4, 8))
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            print(f"loss {loss:.4f}")
            loss.backward()
            optimizer.step()
    assert s.summary["steps"] == 3 and len(s.summary["placeholders"]) == 3
    assert s.summary["lines"]["weights/embed.weight"] == 50 * 16 * 8  # fp64, once


def test_every_patch_is_undone_after_a_failure():
    originals = [torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.backward, torch.Tensor.__deepcopy__,
                 torch.Tensor.__format__, torch.nn.Module._apply, torch.nn.Module.zero_grad,
                 torch.optim.Optimizer.zero_grad]
    with pytest.raises(ShadowError):
        with memory_audit.shadow():
            x = torch.randn(4)
            x[x > 0]
    assert originals == [torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.backward, torch.Tensor.__deepcopy__,
                         torch.Tensor.__format__, torch.nn.Module._apply, torch.nn.Module.zero_grad,
                         torch.optim.Optimizer.zero_grad]
    assert torch.ones(2).sum().item() == 2.0  # real tensors again


class FailsOnce(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("the first call fails")
        return self.linear(x)


def test_a_forward_that_raised_and_was_caught_leaves_the_model_found():
    """A forward that raises (caught by the code) still returns the depth of top-level calls, with
    no warning from the hook that counts them: the model is found at the first optimizer step."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with memory_audit.shadow() as s:
            model = FailsOnce()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with contextlib.suppress(RuntimeError):
                model(torch.randn(2, 4))
            for _ in range(5):
                model(torch.randn(2, 4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert s.summary["steps"] == 3 and s.summary["lines"]["weights/linear.weight"] == 64


def _regression_loop(audit_dir=None, steps=3):
    """A GRU regressor with MSE, written plainly (scripts/zoo.py has no MSE loop)."""
    torch.manual_seed(0)
    gru, head = nn.GRU(8, 16, batch_first=True, bidirectional=True), nn.Linear(32, 3)
    model = nn.ModuleDict({"gru": gru, "head": head})
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
    audit = Audit(model, optimizer, out_dir=audit_dir, step=2) if audit_dir else None

    def forward(x):
        return model["head"](model["gru"](x)[0])
    model.forward = forward
    for step in range(steps):
        with audit.step(step) if audit is not None else contextlib.nullcontext():
            x, y = torch.randn(4, 6, 8), torch.randn(4, 6, 3)
            loss = nn.functional.mse_loss(model(x), y)
            if audit is not None:
                audit.before_backward(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if audit is not None:
        audit.close()


def test_mse_loss_keeps_its_element_wise_buffer_on_cpu(tmp_path):
    """F.mse_loss's 0-dim result on CPU keeps the whole element-wise buffer as its storage (72
    elements: 288 B, not 4), as the loss the loop holds: the peak and every line exact."""
    _regression_loop(str(tmp_path / "r"))
    m = measure(str(tmp_path / "r"))
    with memory_audit.shadow() as s:
        _regression_loop(steps=10)
    assert m["phases"]["step2_end"]["attribution"]["lines"]["temporary/loop/loss"] == 4 * 6 * 3 * 4
    assert s.result["peak"] == m["phases"]["step2_end"]["replay"]["peak"]["bytes"]
    for phase, lines in s.summary["phase_lines"].items():
        assert lines == m["phases"][phase]["attribution"]["lines"], phase
