"""Any model (issue #28): a Llama-style decoder written in the tests (tests/llama.py: RMSNorm, SwiGLU,
rotary embeddings, grouped-query attention through SDPA, AdamW), audited through the public Audit
API without naming anything, and predicted before it runs by the shadow run of its own loop."""

import pytest
import torch

from llama import llama_loop, llama_step
from test_api import checkpointed, conv_loop, lstm_loop
from memory_audit import Audit
from memory_audit.comparison.reconcile import first_divergence, measure, step_events

LOOPS = {}  # name: (make, dtype, the names the audit finds for the batch)
for _dtype in ("float32", "bfloat16"):
    for _ck in (False, True):
        _tail = f"-{_dtype}" + ("-checkpointing" if _ck else "")
        LOOPS["conv-bn-adam" + _tail] = (checkpointed(conv_loop) if _ck else conv_loop, _dtype,
                                         ("inputs/model.x", "inputs/loop/nll_loss.target"))
        LOOPS["lstm-sgd-momentum" + _tail] = (checkpointed(lstm_loop) if _ck else lstm_loop, _dtype,
                                              ("inputs/model.x" if _ck else "inputs/model.tokens",
                                               "inputs/loop/nll_loss.target"))
        LOOPS["llama" + _tail] = ((lambda ck=_ck: llama_loop(ck)), _dtype, ("inputs/model.tokens", "inputs/loop/nll_loss.target"))


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


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's note as the flag is set
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "onednn-off"])
@pytest.mark.parametrize("loop", list(LOOPS))
def test_any_loop_named_and_predicted_to_the_byte(tmp_path, loop, onednn):
    """Every phase 0 unattributed without tensors= (the batch found as what the model receives and
    what the loss saved; the previous step's loss and output, which the loop still holds before
    backward, keep the names step2_start gave them); training unchanged by the audit; what is
    live when the step starts, before backward and when it ends, line by line (the shadow names
    its allocations itself, with the audit's own code: nothing told), and the step's peak equal
    to the shadow run of the same loop (predict_loop), to the byte: a conv net with batch norm and Adam, an LSTM with SGD
    momentum (oneDNN's kernels asked for their own buffers: shadow/probe) and a Llama-style
    decoder, fp32 and bf16 autocast, with and without torch.utils.checkpoint called by the model
    itself (the audit's graph walk must leave the regions' saved tensors alone: reading one runs
    the recomputation: 21 MB more than the run without the audit); the conv net and
    the LSTM also with their whole forward checkpointed. Each also with oneDNN switched off
    (PyTorch's own CPU kernels, as on a CPU it does not serve). In fp32 (and with oneDNN off) the
    two steps are also the same allocations and frees in the same order, and in fp32 the
    categories at the peak are the audit's; in bf16 on CPUs whose bf16 kernels run through
    oneDNN, flash attention's backward makes per-thread scratch in the threads' order (the peak
    is unaffected), and at the conv net's peak 116 B the audit calls temporary are an activation
    in the shadow's names."""
    from memory_audit.prediction.shadow.probe import plain_bf16
    make, dtype, inputs = LOOPS[loop]
    step = llama_step(dtype)
    if onednn and loop.startswith("lstm") and dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # oneDNN then has no bf16 LSTM: the real loop itself stops ("could not create a primitive
        # descriptor for the LSTM forward propagation primitive"; an AMD EPYC without avx512_bf16)
        pytest.skip("oneDNN cannot run a bf16 LSTM on this CPU (no avx512_bf16 or AMX)")
    if not onednn:  # PyTorch's own CPU kernels, as on a CPU oneDNN does not serve
        with torch.backends.mkldnn.flags(enabled=False), plain_bf16():
            return _named_and_predicted(tmp_path, make, dtype, inputs, step, loop, onednn)
    return _named_and_predicted(tmp_path, make, dtype, inputs, step, loop, onednn)


def _named_and_predicted(tmp_path, make, dtype, inputs, step, loop, onednn):
    from memory_audit import predict_loop
    plain = _train(make, step)
    assert _train(make, step, tmp_path / "run") == plain  # the audit only observes
    run = str(tmp_path / "run")
    m = measure(run)
    for phase, info in m["phases"].items():
        assert info["attribution"]["unattributed_bytes"] == 0, (phase, info["attribution"]["unattributed"])
    r = predict_loop(make, step)  # nothing named: the batch found as the audit finds it
    assert set(inputs) <= set(r["summary"]["lines"])
    for phase in ("step2_start", "step2_before_backward", "step2_end"):
        assert r["summary"]["phase_lines"][phase] == m["phases"][phase]["attribution"]["lines"], phase
    peak = m["phases"]["step2_end"]["replay"]["peak"]
    divergence = first_divergence(step_events(run), r["events"])
    assert peak["bytes"] == r["peak"], (peak["bytes"], r["peak"], divergence)
    if dtype == "float32" or not onednn:
        assert divergence is None
        # at the peak, category by category (a parameter's gradient named from its making on)
        assert r["summary"]["peak_categories"] == peak["categories"]
    assert r["unprobed"] == []
    if loop.startswith("conv") or (loop.startswith("lstm") and onednn):  # without oneDNN the LSTM is aten ops
        assert set(r["probed"]) >= ({"convolution", "native_batch_norm"} if loop.startswith("conv")
                                    else {"mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"})


def test_names_the_loop_gives_are_the_predictions_too(tmp_path):
    """A loop that names its batch (`audit.step(i, tensors=...)`) and predict_loop given the same
    names (`inputs=`): every phase's lines equal, the given names in place of the found ones."""
    from memory_audit import predict_loop
    make, step = (lambda: llama_loop(False)), llama_step("float32")
    model, opt, x, y = make()
    audit = Audit(model, opt, out_dir=str(tmp_path / "run"))
    kept = None  # the loop holds each step's output and loss until the next, as predict_loop's does
    for s in range(3):
        with audit.step(s, tensors={"inputs/x": x, "inputs/y": y}):
            kept = step(model, opt, x, y, audit)
    assert kept is not None
    m = measure(str(tmp_path / "run"))
    r = predict_loop(make, step, inputs=("inputs/x", "inputs/y"))
    for phase in ("step2_start", "step2_before_backward", "step2_end"):
        assert r["summary"]["phase_lines"][phase] == m["phases"][phase]["attribution"]["lines"], phase
    assert {"inputs/x", "inputs/y"} <= set(r["summary"]["lines"])
    assert "inputs/model.tokens" not in r["summary"]["lines"]


def test_a_kernel_probe_inside_a_profile_is_named_not_guessed(tmp_path):
    """Inside another profile (an Audit recording on CPU) no probe can run: the LSTM's layers keep
    their fake sizes (the workspace 0 B), the result names them, and `report` says which
    kernels' buffers the prediction lacks."""
    from conftest import run_cli
    from memory_audit import predict_loop
    step = llama_step("float32")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        r = predict_loop(lstm_loop, step)
    assert r["unprobed"] == ["mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"]
    assert r["peak"] < predict_loop(lstm_loop, step)["peak"]
    model, opt, x, y = lstm_loop()
    audit = Audit(model, opt, out_dir=str(tmp_path), predicted=r)
    for s in range(3):
        with audit.step(s):
            step(model, opt, x, y, audit)
    assert run_cli("report", str(tmp_path)).returncode == 0
    md = (tmp_path / "report.md").read_text()
    assert "Not asked (their own buffers are missing from the prediction): mkldnn_rnn_layer, " in md


def test_checkpoint_regions_of_any_model_are_left_alone(tmp_path):
    """The audited forward of a model that calls torch.utils.checkpoint itself holds no more than
    the same forward unaudited just before backward (the checkpointed blocks' activations are
    not recomputed by the audit's graph walk)."""
    model, opt, x, y = llama_loop(True)
    step = llama_step("float32")
    audit = Audit(model, opt, out_dir=str(tmp_path))
    kept = None  # the loop holds each step's output and loss until the next, as predict_loop's does
    for s in range(3):
        with audit.step(s, tensors={"inputs/x": x, "inputs/y": y}):
            kept = step(model, opt, x, y, audit)
    assert kept is not None
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
    predicted = predict_loop(make, step)
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
    assert rec["totals"]["activations"]["diff"] == 0 and rec["totals"]["activations"]["actual"] > 0
    for phase in ("step2_start", "step2_before_backward", "step2_end"):
        assert rec["phases"][phase]["predicted_lines"] == rec["phases"][phase]["lines"], phase
    assert rec["peak"]["predicted_categories"] == rec["peak"]["categories"]
    md = (tmp_path / "report.md").read_text()
    assert "Predicted by predict_loop" in md and "| allocation | predicted | bytes |" in md
    assert "## At the peak, by category" in md
    with pytest.raises(Exception, match="predicted= expects"):
        Audit(model, opt, out_dir=str(tmp_path / "bad"), predicted={"peak": "many"})


@pytest.mark.parametrize("spoil", ["item", "numpy", "nonzero"])
def test_a_value_read_is_answered_and_what_cannot_run_is_one_line(tmp_path, spoil):
    """A step that logs loss.item() is predicted as shadow() predicts it (the read answered with a
    placeholder, listed with its line, one per step run) and its peak is the audit's of the same
    loop; one that reads data (.numpy()) or makes a data-dependent shape (nonzero, no size
    assumed) cannot run on fake tensors: predict_loop raises one ShadowError line naming the op
    it stopped at, never a number; an Audit of the same loop still measures it."""
    from memory_audit import predict_loop
    from memory_audit.prediction.shadow.step import ShadowError
    plain = llama_step("float32")

    def step(model, opt, x, y, audit=None):
        kept = plain(model, opt, x, y, audit)
        loss = kept["temporary/loop/loss"]
        {"item": lambda: loss.item(), "numpy": lambda: loss.detach().numpy(),
         "nonzero": lambda: torch.nonzero(x > 3)}[spoil]()
        return kept
    if spoil == "item":
        r = predict_loop(lambda: llama_loop(False), step)
        reads = r["summary"]["placeholders"]
        assert [(p["read"], p["answer"]) for p in reads] == [("Tensor.item()", 0.0)] * 2, reads
        assert all("loss.item()" in p["where"] for p in reads)
    else:
        with pytest.raises(ShadowError) as e:
            predict_loop(lambda: llama_loop(False), step)
        assert str(e.value).count("\n") == 0 and str(e.value).startswith("the shadow run stopped at ")
    model, opt, x, y = llama_loop(False)
    audit = Audit(model, opt, out_dir=str(tmp_path))
    kept = None  # the loop holds each step's output and loss until the next, as predict_loop's does
    for s in range(3):
        with audit.step(s):
            kept = step(model, opt, x, y, audit)
    assert kept is not None
    if spoil == "item":
        assert measure(audit.run_dir)["phases"]["step2_end"]["replay"]["peak"]["bytes"] == r["peak"]
    assert measure(audit.run_dir)["phases"]["step2_end"]["replay"]["peak"]["bytes"] > 0


class PatchNet(torch.nn.Module):
    """Overlapping patches through F.unfold, mixed, put back with F.fold and averaged: the CPU
    kernels make their output empty_like(input) and resize it (fold keeps the input's larger
    storage behind its smaller result; unfold grows its own)."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Linear(48, 48)
        self.head = torch.nn.Linear(3 * 16 * 16, 10)

    def forward(self, x):
        cols = torch.nn.functional.unfold(x, kernel_size=4, stride=2, padding=1)  # (B, 48, 64)
        cols = self.mix(cols.transpose(1, 2)).transpose(1, 2)
        back = torch.nn.functional.fold(cols, (16, 16), kernel_size=4, stride=2, padding=1)
        counts = torch.nn.functional.fold(torch.ones_like(cols), (16, 16), kernel_size=4, stride=2, padding=1)
        return self.head((back / counts).flatten(1))


def patch_loop():
    torch.manual_seed(0)
    model = PatchNet()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(4, 3, 16, 16), torch.randint(10, (4,))


def test_fold_and_unfold_are_asked_of_their_kernels(tmp_path):
    """F.fold's result lives in a storage the size of its input (4 x 48 x 64 floats behind a
    4 x 3 x 16 x 16 result), which no fake kernel says: the shadow asks the CPU kernels (col2im,
    im2col: shadow/probe.PROBED) and gets every line and the peak of the audit to the byte
    (without the probe: 86,016 B under on scripts/user_loops_c.py's patch denoiser)."""
    from memory_audit import predict_loop
    step = llama_step("float32")
    _train(patch_loop, step, tmp_path / "run")
    run = str(tmp_path / "run")
    m = measure(run)
    r = predict_loop(patch_loop, step)
    for phase in ("step2_start", "step2_before_backward", "step2_end"):
        assert r["summary"]["phase_lines"][phase] == m["phases"][phase]["attribution"]["lines"], phase
    assert m["phases"]["step2_end"]["replay"]["peak"]["bytes"] == r["peak"]
    assert {"col2im", "im2col"} <= set(r["probed"])


def _audit_beside_shadow(tmp_path, loop, **kw):
    """Run `loop(steps, audit_factory, **kw)` audited (3 steps, step 2 recorded) and under
    memory_audit.shadow() (10 steps, stopped after step 2); assert every line of the three phases
    and the peak equal; return (the audit's measure, the shadow session)."""
    import memory_audit
    holder = {}

    def audited(model, opt):
        holder["audit"] = Audit(model, opt, out_dir=str(tmp_path / "run"), step=2)
        return holder["audit"]
    loop(3, audited, **kw)
    m = measure(holder.pop("audit").run_dir)
    with memory_audit.shadow() as s:
        loop(10, **kw)
    for phase in ("step2_start", "step2_before_backward", "step2_end"):
        assert s.summary["phase_lines"][phase] == m["phases"][phase]["attribution"]["lines"], phase
    assert s.result["peak"] == m["phases"]["step2_end"]["replay"]["peak"]["bytes"]
    return m, s


def _script_loop(steps, audit=None, tail=True):
    """A loop as users write it: constants made before it (torch.tensor, zeros), the step's
    block, then `del` of what the step made: after zero_grad, outside the block (tail), or as the
    block's first line in the next step."""
    import contextlib
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if audit is not None:
        audit = audit(model, opt)
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
    shift = torch.zeros(4)
    out = loss = x = None
    for i in range(steps):
        with audit.step(i) if audit is not None else contextlib.nullcontext():
            if not tail:
                out = loss = x = None
            x = torch.randn(16, 8)
            out = model(x) * scale + shift
            loss = out.pow(2).mean()
            if audit is not None:
                audit.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        if tail:
            out = loss = x = None


@pytest.mark.parametrize("tail", [True, False], ids=["dels-after-the-block", "dels-first-in-the-block"])
def test_a_scripts_constants_and_its_dels_after_the_step_are_where_an_audit_has_them(tmp_path, tail):
    """memory_audit.shadow() around a loop that makes tensors before it (named by their call, as
    the Audit names them: activations/zeros) and lets the step's tensors go
    after zero_grad, outside the step's block (before the next step starts, as the Audit counts
    it: the shadow's step starts at the loop's next op), or as the block's first line (written
    above the optimizer step: in the step): every line of the three phases and the peak equal to
    the audit's."""
    _, s = _audit_beside_shadow(tmp_path, _script_loop, tail=tail)
    assert "activations/zeros" in s.summary["phase_lines"]["step2_start"]  # named by its call


class Diagonal(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(5, 5))

    def forward(self):
        return self.weight.diagonal()  # a strided view of the weight: (5,) at stride 6


def _module_loop(make, batch=tuple, part=lambda model: model):
    """loop(steps, audit_factory=None): `make()`'s model trained on the sum of what `part(model)`
    returns for `batch()`, SGD with momentum (_audit_beside_shadow's loop)."""
    import contextlib

    def loop(steps, audit=None):
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        audit = audit(model, opt) if audit is not None else None
        for i in range(steps):
            with audit.step(i) if audit is not None else contextlib.nullcontext():
                loss = part(model)(*batch()).sum()
                if audit is not None:
                    audit.before_backward(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
    return loop


def test_a_weight_read_through_a_strided_view_is_its_storage(tmp_path):
    """The CPU audit sizes a weight made before it from the recorder's own reading of its storage
    (100 B for a 5 x 5 weight), not from the profiler, which sizes an older tensor from the views
    it saw and makes a (5,) view at stride 6 120 B; the shadow agrees line by line and at the peak."""
    m, _ = _audit_beside_shadow(tmp_path, _module_loop(Diagonal))
    assert m["phases"]["step2_start"]["attribution"]["lines"]["weights/weight"] == 100

class Picks(torch.nn.Module):
    """A table read through gather, index_select and topk, and a dense layer through gelu and
    softmax, trained on the plain sum of what it makes: the sum's backward hands on an expanded
    gradient (a zero stride), and the picking ops' backward fills new zeros in place."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(12, 6))
        self.dense = torch.nn.Linear(6, 6)

    def forward(self, idx):
        picked = self.table.gather(0, idx) + self.table.index_select(0, idx[:, 0])
        top = picked.topk(3, dim=1).values
        return torch.nn.functional.gelu(self.dense(picked)).softmax(-1).sum() + top.sum()


def test_expanded_gradients_and_filled_zeros_are_the_kernels(tmp_path):
    """An op given an expanded tensor is asked of its CPU kernel (mm, gelu's and softmax's
    backward copy it whole first), and gather's, index_select's and topk's backward, which fill
    new zeros in place in a real run and out of place on fake tensors, hold one buffer, not two
    (shadow/rules/autograd.SCATTERED_BACKWARD): every line and the peak of the audit's, to the byte."""
    _audit_beside_shadow(tmp_path, _module_loop(Picks, lambda: (torch.randint(0, 12, (8, 6)),)))


class Zeroed(torch.nn.Module):
    """`w.scatter(1, idx, 0.0)`: its backward, grad.scatter(1, idx, 0), is out of place in a real
    run too; the gradient and its copy are both held there (no fold: the zeros are not new)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))
        self.register_buffer("idx", torch.randint(0, 64, (64, 8)))

    def forward(self):
        return self.w.scatter(1, self.idx, 0.0).mul_(2.0)


def test_a_scatter_out_of_place_in_a_real_backward_holds_both(tmp_path):
    """rules/autograd.SCATTERED_BACKWARD folds a scatter's output into zeros made for it only: a
    scatter over the incoming gradient holds both, as the audit measures (16,384 B under if it
    folded)."""
    _audit_beside_shadow(tmp_path, _module_loop(Zeroed))


class Holder(torch.nn.Module):
    """A model with no forward of its own: the loop calls its one part, which holds every
    parameter."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


class Applied(Holder):
    """The same, with a forward of its own the loop does not use."""

    def forward(self, x):
        return torch.sigmoid(self.body(x))


def test_a_loop_that_calls_only_a_part_names_by_the_model_holding_it(tmp_path):
    """`model.body(x)` in the loop, the Audit handed `model`: the shadow names the weights, their
    momentum and the batch by the model that holds the part (weights/body.0.weight), as the audit
    does, not by the part it saw called (weights/0.weight), whether or not the model has a forward
    of its own; a model called whole and kept in a ModuleDict is named as itself."""
    m, _ = _audit_beside_shadow(tmp_path, _module_loop(Holder, lambda: (torch.randn(6, 8),), lambda model: model.body))
    assert "weights/body.0.weight" in m["phases"]["step2_start"]["attribution"]["lines"]
    m, _ = _audit_beside_shadow(tmp_path / "own", _module_loop(Applied, lambda: (torch.randn(6, 8),), lambda model: model.body))
    assert "weights/body.0.weight" in m["phases"]["step2_start"]["attribution"]["lines"]
    kept = []  # a ModuleDict keeping the model by name, never called: a container of torch's, no model

    def kept_in_a_dict():
        model = torch.nn.Sequential(torch.nn.Linear(8, 4))
        kept.append(torch.nn.ModuleDict({"net": model}))
        return model
    m, _ = _audit_beside_shadow(tmp_path / "dict", _module_loop(kept_in_a_dict, lambda: (torch.randn(6, 8),)))
    assert "weights/0.weight" in m["phases"]["step2_start"]["attribution"]["lines"]


class VarMean(torch.nn.Module):
    """var_mean's and group_norm's statistics both used: their backward formulas sum two
    temporaries of their own out of place (var_mean_backward's gself + aux)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 5, 5))
        self.g = torch.nn.Parameter(torch.randn(2, 6, 4))

    def forward(self):
        v, m = torch.var_mean(self.w, dim=1)
        out, mean, rstd = torch.native_group_norm(self.g, None, None, 2, 6, 4, 3, 1e-5)
        return v.sum() + m.sum() + out.sum() + mean.sum() + rstd.sum()


def test_a_backward_formulas_own_sum_keeps_its_memory(tmp_path):
    """An add inside a FORMULA_ADDS node's backward whose first operand the node made is the
    formula's, out of place in a real run too; autograd's sum of what the node returns is still
    folded (shadow/rules/autograd.FORMULA_ADDS): every line and the peak, to the byte (300 B under if
    the formula's sum were folded)."""
    _audit_beside_shadow(tmp_path, _module_loop(VarMean))


def _eval_loop(steps, audit=None, epoch=0):
    """A training step with a validation pass after the optimizer's step (model.eval(), no_grad,
    model.train(); its batch, larger than the step's, made before the step, so the first op after
    the optimizer step is the model's), its zero_grad written above the backward. epoch > 0: the
    validation after the loop over `epoch` steps instead, once an epoch."""
    import contextlib
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    audit = audit(model, opt) if audit is not None else None
    i = 0
    for _ in range(steps // max(epoch, 1) + 1):
        for _ in range(max(epoch, 1)):
            with audit.step(i) if audit is not None else contextlib.nullcontext():
                model.train()
                xv = torch.randn(512, 8)
                loss = torch.nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
                opt.zero_grad()
                if audit is not None:
                    audit.before_backward(loss)
                loss.backward()
                opt.step()
                if not epoch:
                    model.eval()
                    with torch.no_grad():
                        val = model(xv).softmax(-1)
                    model.train()
            i += 1
            if i == steps:
                return
        if epoch:
            model.eval()
            with torch.no_grad():
                val = model(xv).softmax(-1)  # noqa: F841
            model.train()


def test_an_evaluation_after_the_optimizer_step_is_the_steps(tmp_path):
    """Ops written below the optimizer step inside the loop body (a validation pass) belong to its
    step, as the Audit wrapped around the body has them (the shadow stopped inside that forward,
    IndexError in the module stack, before); a validation after the loop over an epoch's steps
    belongs to no step (the Audit's blocks leave it out): every line and the peak, to the byte."""
    m, _ = _audit_beside_shadow(tmp_path, _eval_loop)
    assert m["phases"]["step2_end"]["replay"]["peak"]["bytes"] > 512 * 32 * 4  # the validation's is the peak
    for epoch in (2, 3):  # step 2 begins an epoch, or ends one
        _audit_beside_shadow(tmp_path / f"epoch{epoch}", _eval_loop, epoch=epoch)


class SparseBag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 16, sparse=True)
        self.out = torch.nn.Linear(16, 2)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def test_a_sparse_gradient_is_named_by_its_values_and_indices(tmp_path):
    """nn.Embedding(sparse=True): its gradient and SGD's momentum for it are COO tensors, whose
    memory is their values and indices (the audit stopped on them: a sparse tensor has no storage
    of its own); every byte named in every phase. The shadow stops there in one line (its fake
    sparse tensors have no storage either; docs/limits.md)."""
    import memory_audit
    from memory_audit.prediction.shadow.error import ShadowError
    holder = {}
    ids = lambda: (torch.arange(24).reshape(4, 6) % 10,)  # noqa: E731 -- 24 lookups of rows 0-9, every step

    def audited(model, opt):
        holder["audit"] = Audit(model, opt, out_dir=str(tmp_path / "run"), step=2)
        return holder["audit"]
    _module_loop(SparseBag, ids)(3, audited)
    m = measure(holder.pop("audit").run_dir)
    lines = m["phases"]["step2_start"]["attribution"]["lines"]
    # the momentum after two steps: SGD adds the sparse gradients uncoalesced, two steps' 24 lookups
    # each, 48 rows of 16 fp32 values and their int64 indices
    assert lines["optimizer/momentum_buffer/emb.weight"] == 48 * 16 * 4
    assert lines["optimizer/momentum_buffer/emb.weight/indices"] == 48 * 8
    assert all(p["attribution"]["unattributed_bytes"] == 0 for p in m["phases"].values())
    with pytest.raises(ShadowError, match="SparseTensorImpl"):
        with memory_audit.shadow():
            _module_loop(SparseBag, ids)(10)


def _head_loop(steps, audit=None, device="cpu"):
    """A loop whose first line lets go of last step's batch before any op (`parts = []`), its
    zero_grad written above the backward and nothing after the optimizer step."""
    import contextlib
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    audit = audit(model, opt) if audit is not None else None
    for i in range(steps):
        with audit.step(i) if audit is not None else contextlib.nullcontext():
            parts = []
            for _ in range(3):
                parts.append(torch.randn(4, 8, device=device))
            x = torch.cat(parts)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            if audit is not None:
                audit.before_backward(loss)
            loss.backward()
            opt.step()


def test_what_the_loops_first_line_lets_go_is_the_next_steps(tmp_path):
    """The step ends where the loop comes round; what its head lets go before the first op
    (last step's batch as `parts = []` rebinds it) is the next step's first events, and out of
    this step's end, as the Audit's block has them; on a GPU's shadow too, whose history has
    recorded those frees before the step begins (they move into it)."""
    import memory_audit
    _audit_beside_shadow(tmp_path, _head_loop)
    with memory_audit.shadow(device="cuda") as s:
        _head_loop(10, device="cuda")
    assert s.summary["steady_state"] > 0 and s.summary["peak"] > s.summary["steady_state"]


class SelfAttention(torch.nn.Module):
    """nn.MultiheadAttention over one sequence (fp32 CPU: flash attention), its output permuted to
    (L, B, H, E) for out_proj: the gradient reaching the flash backward is not laid out (B, L, H, E)."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0].pow(2)


def test_flash_attentions_backward_copies_a_gradient_not_laid_out_for_it(tmp_path):
    """CPU flash attention's backward copies grad_out where it is not (B, L, H, E) (probe's
    flash_cpu_buffers): nn.MultiheadAttention's is (L, B, H, E); every line and the peak to the
    byte (6,144 B under without the copy)."""
    _audit_beside_shadow(tmp_path, _module_loop(SelfAttention, lambda: (torch.randn(8, 6, 32),)))


class Traced(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(10, 10))

    def forward(self):
        return torch.trace(self.w)


def test_traces_backward_fills_the_zeros_made_for_it(tmp_path):
    """trace's backward, zeros.index_fill_(0, the diagonal, grad) in a real run, is out of place on
    fake tensors: its output takes the zeros' memory (rules/autograd.SCATTERED_BACKWARD; 400 B over
    without it)."""
    _audit_beside_shadow(tmp_path, _module_loop(Traced))


def test_bilinears_kernel_is_asked_for_its_contraction_buffers(tmp_path):
    """nn.Bilinear runs aten._trilinear, whose CPU kernel contracts through bmm on copies it makes
    beside its output (shadow/probe.PROBED; its backward calls it again): every line and the peak
    to the byte (3,576 B under without the probe; a factorisation machine's loop in
    scripts/user_loops_f.py was 14,592 B under)."""
    m, s = _audit_beside_shadow(tmp_path, _module_loop(lambda: torch.nn.Bilinear(8, 8, 1),
                                                       lambda: (torch.randn(512, 8), torch.randn(512, 8))))
    assert "_trilinear" in s.result["probed"]


class Symmetric(torch.nn.Module):
    """A weight made symmetric where it is not, asked with torch.allclose while the model is built
    (parametrizations.orthogonal asks the same of the weight it is handed)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        if not torch.allclose(self.lin.weight, self.lin.weight.T):
            with torch.no_grad():
                self.lin.weight.copy_((self.lin.weight + self.lin.weight.T) / 2)

    def forward(self, x):
        return self.lin(x).pow(2)


def test_a_comparison_read_of_a_weight_is_a_placeholder_not_a_stop(tmp_path):
    """torch.allclose on a fake weight has no answer: the shadow runs it as CPU's kernel does
    (isclose, all) and answers False, listed as bool() reads are, where it stopped before; the
    loop's lines and peak are the audit's. On constants it answers as the real run does."""
    m, s = _audit_beside_shadow(tmp_path, _module_loop(Symmetric, lambda: (torch.randn(5, 6),)))
    import memory_audit
    with memory_audit.shadow():
        one = torch.ones(3)
        answers = (torch.allclose(one, one * 1), one.allclose(one + 1), torch.equal(one, one))
        _module_loop(Symmetric, lambda: (torch.randn(5, 6),))(10)
    assert answers == (True, False, True)
    assert [p["read"] for p in s.summary["placeholders"]] == ["torch.allclose()"]
