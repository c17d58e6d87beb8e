"""The public Audit API on loops that are not GPT: every byte named, training unchanged."""

import pytest
import torch
from torch import nn

from conftest import assert_books_match_the_pickle, gpt_steps
from memory_audit import Audit, AuditError
from memory_audit.comparison.reconcile import measure


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.head = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.lstm = nn.LSTM(32, 48, num_layers=2, batch_first=True)
        self.out = nn.Linear(48, 7)

    def forward(self, tokens):
        h, _ = self.lstm(self.embed(tokens))
        return self.out(h)


class Checkpointed(nn.Module):
    """A model whose whole forward is one torch.utils.checkpoint region (recomputed in backward)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, x, use_reentrant=False)


def checkpointed(make):
    """A loop maker like conv_loop's whose model is wrapped in Checkpointed (its optimizer made again)."""
    def made():
        model, opt, x, y = make()
        outer = Checkpointed(model)
        return outer, type(opt)(outer.parameters(), **opt.defaults), x, y
    return made


def conv_loop():
    torch.manual_seed(0)
    model = ConvNet()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(8, 3, 16, 16), torch.randint(10, (8,))


def lstm_loop():
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, torch.randint(100, (4, 12)), torch.randint(7, (4, 12))


def train(make, audit_dir=None, steps=3):
    model, opt, x, y = make()
    audit = Audit(model, opt, out_dir=str(audit_dir)) if audit_dir else None

    def forward(x, y):
        out = model(x)
        return out, nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return gpt_steps(forward, opt, [(x, y)] * steps, audit, inputs=("inputs/x", "inputs/y")), model


@pytest.mark.parametrize("make", [conv_loop, lstm_loop], ids=["conv-bn-adam", "lstm-sgd-momentum"])
def test_any_loop_every_byte_named(make, tmp_path):
    plain, _ = train(make)
    audited, model = train(make, tmp_path / "run")
    assert audited == plain  # the audit only observes
    m = measure(str(tmp_path / "run"))
    assert set(m["phases"]) == {"step2_start", "step2_before_backward", "step2_end"}
    for phase, info in m["phases"].items():
        attr = info["attribution"]
        assert attr["unattributed_bytes"] == 0, (phase, attr["unattributed"])
    assert_books_match_the_pickle(str(tmp_path / "run"), m["phases"])
    names = [n for n, _ in model.named_parameters()]
    start = m["phases"]["step2_start"]["attribution"]["lines"]
    for n, p in model.named_parameters():  # weights and the optimizer's state, by parameter name
        assert start[f"weights/{n}"] == p.numel() * 4
    state = "exp_avg" if make is conv_loop else "momentum_buffer"
    assert all(f"optimizer/{state}/{n}" in start for n in names)
    acts = m["phases"]["step2_before_backward"]["attribution"]["lines"]
    modules = {k.split("/")[1] for k in acts if k.startswith("activations/")}
    # conv1 saves the batch and conv2 the relu's output (named by the model's own forward,
    # "convnet"); the loss is computed in the loop
    expected = {"convnet", "bn1", "bn2", "head", "loop"} if make is conv_loop else {"lstm", "out", "loop"}  # embed saves the batch
    assert expected <= modules, modules
    peak = m["phases"]["step2_end"]["replay"]["peak"]
    assert not [k for k in peak["lines"] if k.startswith("unattributed")], peak["lines"]
    assert peak["categories"].get("unattributed", 0) == 0
    # every parameter's gradient named as one, all of them at once before the optimizer step,
    # and nothing else counted as a gradient (both loops: set_to_none, so none at the phases)
    replayed = m["phases"]["step2_end"]["replay"]
    assert len(replayed["series"]) == replayed["entries"] - replayed["start_index"] + 1  # every entry of step 2
    assert max(p["categories"].get("grads", 0) for p in replayed["series"]) == 4 * sum(p.numel() for p in model.parameters())


def test_without_the_loss_the_graph_is_found_from_what_was_saved(tmp_path):
    model, opt, x, y = conv_loop()
    audit = Audit(model, opt, out_dir=str(tmp_path / "run"), step=0)
    with audit.step(0):
        loss = nn.functional.cross_entropy(model(x), y)
        audit.before_backward()
        loss.backward()
        opt.step()
        opt.zero_grad()
    m = measure(str(tmp_path / "run"))
    lines = m["phases"]["step2_before_backward"]["attribution"]["lines"]
    # bn1 saved conv1's output, named by the op; conv1 saved the batch, an input (what the model received)
    assert any(k.startswith("activations/bn1/native_batch_norm") for k in lines), sorted(lines)
    assert lines["inputs/model.x"] == x.numel() * 4
    assert any(k.startswith("activations/loop/") for k in lines), sorted(lines)  # the loss, outside the model


def test_bad_use_is_one_line(tmp_path):
    model, opt, x, y = conv_loop()
    with pytest.raises(AuditError, match="has no parameters"):
        Audit(nn.ReLU(), opt, out_dir=str(tmp_path / "a"))
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(AuditError, match="holds none of the model's parameters"):
        Audit(model, other, out_dir=str(tmp_path / "b"))
    audit = Audit(model, opt, out_dir=str(tmp_path / "c"))
    with pytest.raises(AuditError, match=r"outside `with audit.step"):
        audit.before_backward()
    audit.close()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep.txt").write_text("mine")
    with pytest.raises(AuditError, match="not empty"):
        Audit(model, opt, out_dir=str(tmp_path / "d"))
    assert (tmp_path / "d" / "keep.txt").read_text() == "mine"


def test_a_crash_in_the_audited_step_leaves_the_files(tmp_path):
    model, opt, x, y = conv_loop()
    audit = Audit(model, opt, out_dir=str(tmp_path / "run"), step=0)
    with pytest.raises(ValueError, match="boom"):
        with audit.step(0):
            model(x)
            raise ValueError("boom")
    assert (tmp_path / "run" / "crash.pickle").exists() and (tmp_path / "run" / "meta.json").exists()


def test_replay_names_blocks_older_than_the_trace():
    """A CUDA-shaped snapshot: a weight (live all along) and an old gradient (freed in the trace)
    predate the trace; the phases' registry names both, at the start and at the peak."""
    from memory_audit.reading.loader import normalize
    from memory_audit.reading.timeline import replay

    def block(addr, size, state="active_allocated"):
        return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": []}
    snap = normalize({
        "segments": [{"device": 0, "address": 0, "total_size": 2 ** 21, "stream": 0, "segment_type": "large",
                      "blocks": [block(0, 1024), block(1024, 2048), block(3072, 2 ** 21 - 3072, "inactive")]}],
        "device_traces": [[
            {"action": "alloc", "addr": 1024, "size": 2048, "stream": 0, "frames": []},   # an activation
            {"action": "free_requested", "addr": 4096, "size": 512, "stream": 0, "frames": []},  # the old grad
            {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0, "frames": []},
        ]]})
    meta = {"phases": {
        "step2_start": {"trace_entries": 0, "registry": [{"name": "weights/w", "data_ptr": 0},
                                                         {"name": "grads/w", "data_ptr": 4096}]},
        "step2_before_backward": {"trace_entries": 1, "registry": [{"name": "weights/w", "data_ptr": 0},
                                                                   {"name": "grads/w", "data_ptr": 4096}]}},
        "saved_tensors": [{"key": "activations/fc/addmm.self", "data_ptr": 1024}]}
    rp = replay(snap, meta)
    assert rp["baseline_bytes"] == 1024 + 512 and not rp["overflow"]
    assert rp["peak"]["bytes"] == 1024 + 512 + 2048
    assert rp["peak"]["lines"] == {"activations/fc/addmm.self": 2048, "weights/w": 1024, "grads/w": 512}
    assert rp["peak"]["categories"] == {"weights": 1024, "grads": 512, "activations": 2048}
    assert rp["series"][-1]["categories"] == {"weights": 1024, "activations": 2048}  # the old grad is gone


@pytest.mark.parametrize("inside", [False, True], ids=["batch-made-once", "batch-made-in-the-step"])
def test_a_loop_is_named_without_help(tmp_path, inside):
    """The loop as README writes it, no `tensors=`: the batch made before the Audit (or in each
    step) is named in every phase as what the model's forward received (inputs/model.x) and what
    the loss took beside the model's output (inputs/loop/nll_loss.target), the previous step's
    batch and loss at the start as the loop still holds them; 0 unattributed everywhere."""
    model, opt, x, y = conv_loop()
    audit = Audit(model, opt, out_dir=str(tmp_path / "run"))
    losses = []
    for step in range(3):
        with audit.step(step):
            if inside:
                x, y = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
            loss = nn.functional.cross_entropy(model(x), y)
            audit.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    m = measure(str(tmp_path / "run"))
    for phase, info in m["phases"].items():
        attr = info["attribution"]
        assert attr["unattributed_bytes"] == 0, (phase, attr["unattributed"])
        assert attr["lines"]["inputs/model.x"] == x.numel() * 4, phase
        assert attr["lines"]["inputs/loop/nll_loss.target"] == y.numel() * 8, phase
    peak = m["phases"]["step2_end"]["replay"]["peak"]
    assert peak["categories"].get("unattributed", 0) == 0
    assert_books_match_the_pickle(str(tmp_path / "run"), m["phases"])


def test_a_model_on_cuda_0_is_on_the_device_an_audit_of_cuda_records(monkeypatch):
    """Parameters name the index (cuda:0), `Audit(..., device="cuda")` does not: the recording
    resolves it to cuda:<current>, so the model check and the saved tensors' device filter
    (str(t.device) == the recording's) see one device. Without it both refuse every CUDA train.py
    audit (seen on an H200, 2026-11-26; CI has no GPU)."""
    from memory_audit.recording.audit import _same_device
    from memory_audit.recording.recorder import indexed_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert str(indexed_device("cuda")) == "cuda:0" == str(indexed_device(torch.device("cuda", 0)))
    assert _same_device("cuda:0", torch.device("cuda")) and _same_device("cuda", "cuda:0")
    assert not _same_device("cuda:1", torch.device("cuda"))
    assert not _same_device("cpu", torch.device("cuda")) and str(indexed_device("cpu")) == "cpu"


class _LossMethodNet(nn.Module):
    """Checkpointed blocks with dropout, the loss made by a method: the model's forward hooks
    never fire, so the Audit finds the loss's inputs by walking the whole graph."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1)) for _ in range(2))

    def loss(self, x):
        from torch.utils.checkpoint import checkpoint
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return x.square().mean()


def test_reading_what_the_graph_saved_never_recomputes_a_checkpoint(tmp_path, monkeypatch):
    """Reading a checkpointed node's saved tensor runs its unpack hook: the region's
    recomputation, in the forward, its tensors kept until backward (and on CUDA a SystemError).
    The Audit's walks read only what no saved-tensor hook packed."""
    import torch.utils.checkpoint as ck
    if not hasattr(ck, "_run_fn_with_dynamo_disabled"):
        pytest.skip("this torch's checkpoint recomputes otherwise")
    outside = []
    real = ck._run_fn_with_dynamo_disabled

    def spy(fn, *args, **kwargs):
        if torch._C._current_autograd_node() is None:  # not inside backward
            outside.append(fn)
        return real(fn, *args, **kwargs)
    monkeypatch.setattr(ck, "_run_fn_with_dynamo_disabled", spy)
    torch.manual_seed(0)
    model = _LossMethodNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    audit = Audit(model, opt, out_dir=str(tmp_path / "r"), step=2)
    with audit:
        for step in range(3):
            with audit.step(step):
                loss = model.loss(torch.randn(4, 16))
                audit.before_backward(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
    assert outside == []
    assert measure(audit.run_dir)["phases"]["step2_end"]["attribution"]["unattributed_bytes"] == 0
