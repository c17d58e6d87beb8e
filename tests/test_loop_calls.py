"""What a loop makes and keeps that no other rule names (naming/loop_calls.py): a padding mask
it builds, lengths it hands a loss, a validation loss, clip_grad_norm_'s total, a target picked
by a mask. The Audit names each by the torch call that made it, and the shadow run of the same
code gives the same names: step 2's three phases line by line, 0 B unattributed."""

import torch
import torch.nn.functional as F
from torch import nn

import memory_audit
from memory_audit import Audit
from memory_audit.comparison.reconcile import measure


class Positions(nn.Module):
    def forward(self, x):
        self.cache = torch.ones(x.shape[1], 16)  # made inside a submodule, kept by it between steps
        return x + self.cache


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(30, 16), nn.LayerNorm(16), nn.Linear(16, 5)
        self.blocks = nn.Sequential(Positions())

    def forward(self, ids, mask):
        return self.head(self.norm(self.blocks(self.embed(ids) * mask[..., None])))


def loop(audit_dir=None, steps=3, micro=1):
    torch.manual_seed(0)
    model = Tagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    audit = Audit(model, optimizer, out_dir=audit_dir, step=2) if audit_dir else None
    for step in range(steps):
        with audit.step(step) if audit else _nothing():
            for _ in range(micro):
                kept = micro_step(model, audit)  # held by the loop into the next step
            optimizer.step()
            optimizer.zero_grad()
    if audit:
        audit.close()
    return kept


def micro_step(model, audit):
    """One forward and backward, with what the loop makes and keeps."""
    ids = torch.randint(0, 30, (3, 7))
    mask = torch.zeros(3, 7)
    mask[:, :5] = 1
    lengths = torch.tensor([7, 5, 4])
    keep = torch.arange(3) != 1  # known without data: the shadow sizes ids[keep] from it
    val = F.mse_loss(model(ids, mask).detach(), torch.zeros(3, 7, 5))
    logits = model(ids, mask)
    loss = F.cross_entropy(logits.flatten(0, 1), (ids % 5).flatten()) + lengths.float().mean() * 0
    if audit:
        audit.before_backward(loss)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    picked = ids[keep]  # made after backward: the optimizer's phase
    return lengths, keep, val, norm, picked


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_what_the_loop_keeps_is_named_by_its_call_in_the_audit_and_the_shadow(tmp_path):
    loop(str(tmp_path / "r"))
    m = measure(str(tmp_path / "r"))
    assert all(p["attribution"]["unattributed_bytes"] == 0 for p in m["phases"].values())
    start = m["phases"]["step2_start"]["attribution"]["lines"]  # step 1's, kept by the loop
    assert start["activations/tensor"] == 3 * 8  # the lengths
    assert start["activations/ne"] == 3  # the mask picking rows
    assert start["activations/mse_loss"] == 3 * 7 * 5 * 4  # the validation loss (CPU keeps its element-wise buffer)
    assert start["activations/blocks.0/ones"] == 7 * 16 * 4  # a submodule's own cache
    assert start["temporary/optimizer/linalg_vector_norm"] == 4  # clip_grad_norm_'s total, made after backward
    assert start["temporary/optimizer/getitem"] == 2 * 7 * 8  # ids[keep]
    with memory_audit.shadow() as s:
        loop(steps=10)
    _same(s, m)
    assert torch.overrides._get_current_function_mode_stack() == []  # the audit's mode left with it


def _same(s, m):
    assert s.result["peak"] == m["phases"]["step2_end"]["replay"]["peak"]["bytes"]
    for phase, lines in s.summary["phase_lines"].items():
        assert lines == m["phases"][phase]["attribution"]["lines"], phase


def test_micro_steps_name_alike_in_the_audit_and_the_shadow(tmp_path):
    """With two micro-steps per step, the second's forward starts a forward again (the model's
    forward resets the phase): the same names on both sides, nothing unattributed."""
    loop(str(tmp_path / "r"), micro=2)
    m = measure(str(tmp_path / "r"))
    assert all(p["attribution"]["unattributed_bytes"] == 0 for p in m["phases"].values())
    with memory_audit.shadow() as s:
        loop(steps=10, micro=2)
    _same(s, m)


def test_the_audit_leaves_no_mode_or_hook_behind_even_on_error(tmp_path):
    from torch.optim.optimizer import _global_optimizer_post_hooks
    hooks = len(_global_optimizer_post_hooks)
    model = Tagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Audit(model, optimizer, out_dir=str(tmp_path / "r"), step=2) as audit:
            with audit.step(0):
                model(torch.randint(0, 30, (3, 7)), torch.ones(3, 7)).sum().backward()
                raise KeyError("the loop's own error")
    except KeyError:
        pass
    assert torch.overrides._get_current_function_mode_stack() == []
    assert len(_global_optimizer_post_hooks) == hooks and not model._forward_pre_hooks
    assert optimizer._optimizer_step_post_hooks == {}


def test_torch_compile_traces_through_it_in_one_graph():
    """Under torch.compile the mode steps aside: a compiled function the audited code calls is one
    graph, as without the audit (it broke at the naming's own Python before)."""
    from memory_audit.naming.loop_calls import LoopCalls

    def f(x):
        return (x.sin() + 1).cos().sum()
    with LoopCalls():
        explained = torch._dynamo.explain(f)(torch.randn(4))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_a_call_whose_output_has_no_storage_to_name_runs_unnamed():
    """Sparse and nested outputs have no storage to name: the call runs and nothing is named."""
    from memory_audit.naming.loop_calls import LoopCalls
    with LoopCalls() as calls:
        s = torch.randn(3, 3).to_sparse()
        n = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
        assert s.is_sparse and n.is_nested
    assert {e["name"] for e in calls.entries()} <= {"activations/randn"}  # the dense inputs at most


class Flow(nn.Module):
    """A flow trained through a method of its own (flow.log_prob(x)): its forward is never called,
    only its layers are, each holding part of the parameters."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def log_prob(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x
        return -(x ** 2).sum(-1)


def flow_loop(audit_dir=None, steps=3):
    torch.manual_seed(0)
    model = Flow()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    audit = Audit(model, optimizer, out_dir=audit_dir, step=2) if audit_dir else None
    for step in range(steps):
        with audit.step(step) if audit else _nothing():
            loss = -model.log_prob(torch.randn(4, 6)).mean()
            if audit:
                audit.before_backward(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if audit:
        audit.close()


def test_a_model_trained_through_a_method_is_found_by_its_parameters(tmp_path):
    """The shadow takes as the model the module holding all the optimizer's parameters (here not
    called itself), as the Audit is given it: every line as the audit's."""
    flow_loop(str(tmp_path / "r"))
    m = measure(str(tmp_path / "r"))
    with memory_audit.shadow() as s:
        flow_loop(steps=10)
    _same(s, m)
    assert "activations/layers.2/addmm.mat1" in s.summary["phase_lines"]["step2_before_backward"]
