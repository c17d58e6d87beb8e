"""What a shadow run knows without data (prediction/shadow/known_values.py): values made from constants
alone steer the code as in a real run, and data-dependent shapes take the size the user assumed.
Each loop is checked against an Audit of the same code on CPU: step 2's peak and every line of
its three phases to the byte."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memory_audit
from memory_audit import Audit
from memory_audit.comparison.reconcile import first_divergence, measure, step_events
from memory_audit.prediction.shadow.known_values import parse_assume
from memory_audit.prediction.shadow.step import ShadowError


class Packed(nn.Module):
    """transformers' packed-sequence check, in small: position ids from `arange`, and a (B, T, T)
    mask built only where a row holds several sequences, which a real run reads off the positions."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(40, 16), nn.Linear(16, 40)

    def forward(self, ids):
        x = self.embed(ids)
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
        seq = (torch.diff(pos, prepend=pos[:, :1] - 1) != 1).cumsum(-1)
        if not (seq[:, -1] == 0).all():  # never, for these positions: the mask is not built
            mask = (seq[:, :, None] == seq[:, None, :]).float()
            x = mask @ x
        return self.head(x)


class Routed(nn.Module):
    """Top-1 routing: each token goes to its expert through `nonzero` (a data-dependent shape)."""

    def __init__(self, experts=3):
        super().__init__()
        self.embed, self.router = nn.Embedding(40, 16), nn.Linear(16, experts)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(experts))
        self.head = nn.Linear(16, 40)

    def forward(self, ids):
        h = self.embed(ids).flatten(0, 1)
        weight, choice = self.router(h).softmax(-1).max(-1)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(1)
            y = y.index_add(0, idx, expert(h[idx]) * weight[idx, None])
        return self.head(y.view(ids.shape[0], ids.shape[1], -1))


def per_token(model, ids):
    """Cross-entropy per token over logits.movedim(-1, 1) (classes on dim 1)."""
    return F.cross_entropy(model(ids).movedim(-1, 1), ids)


def bce(model, ids):
    """Binary cross-entropy of a sigmoid over random targets."""
    return F.binary_cross_entropy(torch.sigmoid(model(ids)), torch.rand(3, 10, 40))


def loop(model_cls, audit_dir=None, steps=3, reads=None, loss_of=per_token):
    """The usual loop, Adam, the loss `loss_of` gives; reads collects what the loop reads of the
    optimizer's step count."""
    torch.manual_seed(0)
    model = model_cls()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    audit = Audit(model, optimizer, out_dir=audit_dir, step=2) if audit_dir else None
    for step in range(steps):
        with audit.step(step) if audit is not None else _nothing():
            ids = torch.randint(0, 40, (3, 10))
            loss = loss_of(model, ids)
            if audit is not None:
                audit.before_backward(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if reads is not None:
                reads.append(float(optimizer.state[model.head.weight]["step"]))
    if audit is not None:
        audit.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _audited(tmp_path, model_cls):
    loop(model_cls, str(tmp_path / "r"))
    return measure(str(tmp_path / "r")), step_events(str(tmp_path / "r"))


def _same(s, m):
    assert s.result["peak"] == m["phases"]["step2_end"]["replay"]["peak"]["bytes"]
    for phase, lines in s.summary["phase_lines"].items():
        assert lines == m["phases"][phase]["attribution"]["lines"], phase
    assert all(p["attribution"]["unattributed_bytes"] == 0 for p in m["phases"].values())


def test_values_made_from_constants_steer_the_code_as_in_a_real_run(tmp_path):
    """The positions' check is read from their known values (no placeholder), so the mask a real
    run never builds is not built; the optimizer's step counts read back as 1.0 and 2.0; the
    per-token loss's softmax runs on a contiguous copy of its input, as CPU's kernel does: step
    2's events are the audit's, one by one."""
    m, events = _audited(tmp_path, Packed)
    reads = []
    with memory_audit.shadow() as s:
        loop(Packed, steps=100, reads=reads)
    _same(s, m)
    assert s.summary["placeholders"] == []
    assert reads == [1.0, 2.0]  # step 2's read comes after its end: the loop is stopped before it
    assert first_divergence(events, s.result["events"]) is None


def test_a_routed_model_takes_the_sizes_assumed_for_nonzero(tmp_path):
    """nonzero's row counts taken from the audited run's own kernel (as a user gives them with
    --assume), in order within each step: the peak and every line are the audit's."""
    m, events = _audited(tmp_path, Routed)
    rows = [e[2] // 8 for e in events if e[0] == "alloc" and e[1] == "aten::nonzero"]
    assert len(rows) == 3  # one per expert: idx is long, so h[idx] and the backward run no nonzero
    with memory_audit.shadow(assume={"nonzero": rows}) as s:
        loop(Routed, steps=100)
    _same(s, m)
    taken = [z["rows"] for z in s.summary["sizes"]]
    assert taken == rows * 3 and all(z["where"].startswith("test_known_values.py:") for z in s.summary["sizes"])


def test_a_data_dependent_shape_with_no_size_is_one_line_naming_the_line_and_the_flag():
    with pytest.raises(ShadowError) as e:
        with memory_audit.shadow():
            loop(Routed, steps=100)
    text = str(e.value)
    assert "\n" not in text and text.startswith("the shadow run stopped at nonzero, test_known_values.py:")
    assert "idx = (choice == e).nonzero().squeeze(1)" in text and "--assume test_known_values.py:" in text


def test_a_fraction_or_a_line_sizes_a_boolean_mask_and_its_backward():
    """x[mask] runs nonzero in its forward and again in index_put's backward, as CPU's kernels do;
    the backward's takes the forward's rows (the same mask), whatever the assumption says."""
    def run(assume):
        with memory_audit.shadow(assume=assume) as s:
            model = nn.Linear(8, 8)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                x = torch.randn(6, 8, requires_grad=True)
                keep = x[x[:, 0] > 0]
                model(keep).sum().backward()
                optimizer.step()
        return s.summary["sizes"]
    sizes = run({"nonzero": 0.5})
    assert [z["rows"] for z in sizes] == [3, 3] * 3
    assert [z["from"] for z in sizes[:2]] == ["--assume nonzero=0.5 of 6 elements", "the same mask's earlier call"]
    assert sizes[0]["where"].split(": ", 1)[1] == "keep = x[x[:, 0] > 0]"
    line = sizes[0]["where"].split(": ")[0]
    sizes = run({line: [2, 5], "nonzero": 1})  # the line, before the op; a list taken in order each step
    assert [z["rows"] for z in sizes] == [2, 2] * 3


@pytest.mark.parametrize("assume", [{"nonzero": 7}, {"nonzero": []}, {"nonzero": "0.5"}, {"nonzero": 2.0}])
def test_an_assumption_that_cannot_hold_is_one_line(assume):
    with pytest.raises((ShadowError, ValueError)) as e:
        with memory_audit.shadow(assume=assume):
            model = nn.Linear(8, 8)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                x = torch.randn(6, 8)
                model(x[x[:, 0] > 0]).sum().backward()
                optimizer.step()
    assert "\n" not in str(e.value) and "--assume" in str(e.value)


def _known_after(body):
    """What KnownValues knows of the tensor `body` returns, run on fake tensors under it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from memory_audit.prediction.shadow.known_values import KnownValues
    known = KnownValues(assume={"nonzero": 2})
    with FakeTensorMode(allow_non_fake_inputs=True), known.watching():
        t = body()
        v = known.value(t)
        return None if v is None else v.tolist()


def test_what_is_written_with_an_unknown_is_forgotten():
    """In place, through a view, by a mask, through out=, by set_, by resize_: each leaves the
    tensor unknown where anything unknown went in; with only known inputs, the real value."""
    def masked():
        k = torch.ones(4)
        k[torch.randn(4) > 0] = 0
        return k

    def masked_known():
        k = torch.ones(4)
        k[torch.arange(4) > 1] = 5
        return k

    def view_written():
        k = torch.arange(6.)
        k[:3].add_(torch.randn(3))
        return k

    def out_written():
        k = torch.zeros(3)
        torch.add(torch.randn(3), 1, out=k)
        return k

    def set_written():
        k = torch.zeros(4)
        k.set_(torch.randn(4))
        return k

    def resized():
        return torch.arange(2.).resize_(6)
    assert _known_after(lambda: torch.arange(4) * 2) == [0, 2, 4, 6]
    assert _known_after(masked_known) == [1, 1, 5, 5]
    for body in (masked, view_written, out_written, set_written, resized, lambda: torch.randn(3), lambda: torch.empty(3)):
        assert _known_after(body) is None, body.__name__


def test_a_real_tensor_handed_in_is_never_written():
    import numpy as np
    from torch._subclasses.fake_tensor import FakeTensorMode
    from memory_audit.prediction.shadow.known_values import KnownValues
    arr = np.zeros(3, dtype=np.float32)
    with FakeTensorMode(allow_non_fake_inputs=True), KnownValues().watching():
        torch.from_numpy(arr).add_(1)
    assert arr.tolist() == [0.0, 0.0, 0.0]


def test_transformers_is_told_no_trace_only_while_the_shadow_runs():
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    original, seen = import_utils.is_fake_tensor, []
    with pytest.raises(ShadowError, match="RuntimeError: the code fails"):
        with memory_audit.shadow():
            x = nn.Linear(2, 2)(torch.randn(1, 2))  # the first forward: transformers is imported
            seen.append((import_utils.is_fake_tensor, import_utils.is_fake_tensor(x)))
            raise RuntimeError("the code fails")
    assert seen[0][0] is not original and seen[0][1] is False
    assert import_utils.is_fake_tensor is original


@pytest.mark.parametrize("item", ["nonzero", "nonzero=x", "=3", "a.py:3=1.5", "nonzero=-1"])
def test_a_bad_assumption_is_one_line(item):
    with pytest.raises(ValueError) as e:
        parse_assume([item])
    assert "\n" not in str(e.value) and "--assume" in str(e.value)


class Head(nn.Module):
    """BERT's prediction head in small: Linear, GELU, then an fp32 LayerNorm fed bf16 under autocast."""

    def __init__(self):
        super().__init__()
        self.embed, self.dense, self.norm, self.head = nn.Embedding(40, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 40)

    def forward(self, ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(self.norm(F.gelu(self.dense(self.embed(ids)))))


class Gathered(nn.Module):
    """Tokens taken in reverse order by long indices: indexing's backward (index_put_)."""

    def __init__(self):
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(40, 16), nn.Linear(16, 16), nn.Linear(16, 40)

    def forward(self, ids):
        h = self.embed(ids).flatten(0, 1)
        idx = torch.arange(h.shape[0]).flip(0)
        return self.head(self.mix(h[idx]).view(ids.shape[0], ids.shape[1], -1))


def test_predict_script_takes_assume_and_says_what_it_took():
    """`predict-script --assume=nonzero=0.25 examples/train_moe.py`: every nonzero takes a quarter
    of the 512 tokens, printed with the script's line; without it, one line and a non-zero exit."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "memory_audit", "predict-script", *args], cwd=root,
                              capture_output=True, text=True, timeout=300)
    p = cli("--json", "--assume=nonzero=0.25", "examples/train_moe.py", "--", "--experts=4", "--width=16")
    assert p.returncode == 0, p.stderr[-800:]
    sizes = json.loads(p.stdout[p.stdout.index("{"):])["sizes"]
    assert len(sizes) == 4 * 3 and {z["rows"] for z in sizes} == {128}
    assert {z["where"] for z in sizes} == {"train_moe.py:25: idx = (choice == e).nonzero().squeeze(1)"}
    p = cli("examples/train_moe.py", "--", "--width=16")
    assert p.returncode != 0 and p.stderr.count("\n") == 1
    assert "--assume train_moe.py:25=ROWS" in p.stderr


class Permuted(nn.Module):
    """Whisper's encoder in small: a conv over time, permuted, positions added, then a LayerNorm
    of that non-contiguous input; a sigmoid head under binary cross-entropy."""

    def __init__(self):
        super().__init__()
        self.embed, self.conv = nn.Embedding(40, 16), nn.Conv1d(16, 16, 3, padding=1)
        self.pos, self.norm, self.head = nn.Parameter(torch.zeros(10, 16)), nn.LayerNorm(16), nn.Linear(16, 40)

    def forward(self, ids):
        x = self.conv(self.embed(ids).transpose(1, 2)).permute(0, 2, 1) + self.pos
        return self.head(self.norm(x))


def test_layer_norm_of_a_non_contiguous_input_and_bce_keep_what_cpu_kernels_keep(tmp_path):
    """F.binary_cross_entropy's 0-dim loss keeps its element-wise buffer, and LayerNorm copies a
    non-contiguous input contiguous: the peak and every line are the audit's."""
    loop(Permuted, str(tmp_path / "r"), loss_of=bce)
    m, events = measure(str(tmp_path / "r")), step_events(str(tmp_path / "r"))
    with memory_audit.shadow() as s:
        loop(Permuted, steps=100, loss_of=bce)
    _same(s, m)
    assert s.summary["phase_lines"]["step2_start"]["temporary/loop/loss"] == 3 * 10 * 40 * 4
    # event by event up to the loss's own mean inside the BCE kernel (its 4, 8 and 4 B scratch
    # are not modelled): the forward's layer norm copy is where the audit has it
    d = first_divergence(events, s.result["events"])
    assert d is not None and d["measured"][1] == "aten::mean", d


def test_ctc_loss_takes_its_shapes_from_a_real_run_at_known_lengths():
    """ctc_loss's shapes follow the targets' lengths, which fake tensors cannot give: with the
    lengths known (torch.tensor of ints) the op runs at the shapes a real CPU run gives, listed."""
    with memory_audit.shadow() as s:
        model = nn.Linear(10, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            logp = model(torch.randn(30, 3, 10)).log_softmax(-1)
            loss = F.ctc_loss(logp, torch.randint(1, 10, (3, 8)), torch.tensor([30, 26, 20]), torch.tensor([8, 5, 6]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    sizes = [z for z in s.summary["sizes"] if z["op"] == "_ctc_loss"]
    assert len(sizes) == 3 and sizes[0]["shape"] == [[3], [3, 30, 17]]  # 2 x the longest target (8) + 1


class Acoustic(nn.Module):
    """A small CTC acoustic model: (B, T) ids in, (T, B, V) log-probabilities out."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(40, 16), nn.Linear(16, 12)

    def forward(self, ids):
        return self.head(self.embed(ids)).log_softmax(-1).transpose(0, 1)


def ctc_lists(model, ids):
    """CTC with its lengths as Python lists, zero_infinity (ATen writes them into a tensor)."""
    return F.ctc_loss(model(ids), torch.randint(1, 12, (3, 4)), [10, 8, 6], [4, 3, 2], zero_infinity=True)


def ctc_tensors(model, ids):
    """CTC with tensor lengths, summed (a real tensor takes the lists' path; a fake one did not)."""
    return F.ctc_loss(model(ids), torch.randint(1, 12, (3, 4)), torch.tensor([10, 9, 6]), torch.tensor([4, 4, 1]),
                      reduction="sum")


@pytest.mark.parametrize("loss_of", [ctc_lists, ctc_tensors])
def test_ctc_loss_runs_as_on_real_tensors(tmp_path, loss_of):
    """torch.ctc_loss in the shadow takes the path real tensors take (patches.ctc_as_on_real_tensors):
    the peak and every line of the three phases are the audit's, lists or tensors."""
    loop(Acoustic, str(tmp_path / "r"), loss_of=loss_of)
    m = measure(str(tmp_path / "r"))
    with memory_audit.shadow() as s:
        loop(Acoustic, steps=100, loss_of=loss_of)
    _same(s, m)


def integer_ops(model, ids):
    """Scalar overloads that wrap their number (remainder, fmod, &, |, ^, <<, >>) on the batch and
    the logits, feeding the loss."""
    shifted = ((ids % 7) & 3 | 1) ^ 2
    shifted = (shifted << 1) >> 1
    return F.cross_entropy((torch.fmod(model(ids), 1.5) % 2.0).movedim(-1, 1), shifted)


def test_scalar_overloads_that_wrap_their_number(tmp_path):
    """x % 5, torch.fmod(x, 1.5), x & 3, x << 1, ...: each wraps its number in a 0-dim tensor (and
    casts it to a float operand's dtype) around its output, as the shadow's events have it."""
    m, events = _audited_with(tmp_path, integer_ops)
    with memory_audit.shadow() as s:
        loop(Head, steps=100, loss_of=integer_ops)
    _same(s, m)
    assert first_divergence(events, s.result["events"]) is None


def _audited_with(tmp_path, loss_of):
    loop(Head, str(tmp_path / "r"), loss_of=loss_of)
    return measure(str(tmp_path / "r")), step_events(str(tmp_path / "r"))


def test_unique_of_known_values_is_sized_and_of_data_stops_in_one_line():
    def run(known):
        with memory_audit.shadow() as s:
            model = nn.Linear(4, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                y = model(torch.randn(8, 4))
                u = torch.unique(torch.arange(6) % 3) if known else torch.unique(y.detach())  # noqa: F841
                y.sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        return s.summary["sizes"]
    assert [z["shape"][0] for z in run(True)] == [[3]] * 3
    with pytest.raises(ShadowError) as e:
        run(False)
    assert "\n" not in str(e.value) and "_unique2" in str(e.value) and "test_known_values.py:" in str(e.value)


class CrossAttended(nn.Module):
    """Whisper's decoder in small: positions from `arange(T).repeat(B, 1)` (repeat's host-side
    permutation, shadow/rules/cpu.py) and SDPA from 10 queries over 24 keys of a memory (CPU flash
    attention's buffers sized by the key's length, not the query's)."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(40, 16), nn.Embedding(10, 16)
        self.memory, self.q = nn.Parameter(torch.randn(1, 2, 24, 8)), nn.Linear(16, 16)
        self.head = nn.Linear(16, 40)

    def forward(self, ids):
        B, T = ids.shape
        x = self.embed(ids) + self.pos(torch.arange(T).repeat(B, 1))
        q = self.q(x).view(B, T, 2, 8).transpose(1, 2)
        kv = self.memory.expand(B, -1, -1, -1)
        a = F.scaled_dot_product_attention(q, kv, kv)
        return self.head(a.transpose(1, 2).reshape(B, T, 16))


@pytest.mark.parametrize("model_cls", ["Head", "Gathered", "Permuted", "CrossAttended"])
def test_step_2_event_by_event(tmp_path, model_cls):
    """Every event of step 2 as the audit has it: Head, a CPU layer norm of a bf16 input with an
    fp32 weight (fp32 mean and rstd, where the fake kernel says bf16); Gathered, indexing's
    backward, zeros.index_put_(indices, grad, accumulate=True), out of place for a fake tensor (the
    output takes the zeros' memory); Permuted, layer norm's copies of a non-contiguous input in
    forward and backward (X and dY); CrossAttended, repeat's permutation and cross-attention's
    flash buffers."""
    model_cls = globals()[model_cls]
    m, events = _audited(tmp_path, model_cls)
    with memory_audit.shadow() as s:
        loop(model_cls, steps=100)
    _same(s, m)
    assert first_divergence(events, s.result["events"]) is None
