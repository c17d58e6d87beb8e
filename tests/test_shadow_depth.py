"""A deep model's step on a GPU built from shadow runs of its script with 3 and 4 of its blocks
(prediction/shadow/depth.py, issue #49): event by event the whole run's, or the whole run where
the blocks are not alike or the repeat rule does not hold."""

import contextlib
import io

import pytest
from torch import nn

from memory_audit.prediction.shadow.step import ShadowError
from memory_audit.prediction.shadow.depth import alike
from memory_audit.prediction.shadow.entry import shadow_file

SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F

class Block(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.layer_idx = i
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, {width}), nn.Linear({width}, 16)
        self.drop = nn.Dropout({drop})
    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.blocks = nn.ModuleList([Block(i) for i in range({n})])
        self.head = nn.Linear(16, 100)
    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)

model = Net().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler()
for step in range(4):
    for micro in range({micro}):
        x = torch.randint(0, 100, (2, 8), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten()) / {micro}
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=False)
    print("step", step)
"""


def runs(tmp_path, text=None, **fill):
    """(the whole run's Shadow, the one predict-script --gpu=H100 makes, what the second let the
    script print)."""
    script = tmp_path / "deep.py"
    script.write_text(text or SCRIPT.format(**{"width": 32, "drop": 0.0, "micro": 1, **fill}))
    kw = dict(device="cuda", gpu="H100", step=2)
    with contextlib.redirect_stdout(io.StringIO()):
        whole = shadow_file(str(script), repeat=False, **kw)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        built = shadow_file(str(script), repeat=True, **kw)
    return whole, built, out.getvalue()


def canonical(result):
    ids = {}
    return [(a, k, b, ids.setdefault(i, len(ids))) for a, k, b, i in result["history"] + result["events"]]


@pytest.mark.parametrize("micro", [1, 2])
def test_repeated_step_is_the_whole_run_event_by_event(tmp_path, micro):
    """12 equal blocks (each holding its own layer_idx) under fp16 autocast and a GradScaler,
    one or two micro-steps: built from runs of 3 and 4 blocks, every event of step 2 and of the
    history before it, the phases, the lines and the allocator's numbers equal the whole run's;
    what the script prints in its cut runs is not shown."""
    whole, built, printed = runs(tmp_path, n=12, micro=micro)
    assert built.depth_note == "repeated"
    assert "the 12 blocks of blocks, repeated" in built.summary["source"]
    assert canonical(built.result) == canonical(whole.result)
    assert built.result["phases"] == whole.result["phases"]
    for key in ("allocator", "lines", "phase_lines", "peak_categories"):
        assert built.summary[key] == whole.summary[key], key
    assert printed == ""


def test_a_shallow_model_is_run_once_as_it_is(tmp_path):
    """11 blocks: nothing is cut, the first run is the prediction and the script's output shows."""
    whole, built, printed = runs(tmp_path, n=11)
    assert built.depth_note == "no list of 12 or more equal blocks"
    assert canonical(built.result) == canonical(whole.result)
    assert printed.splitlines() == ["step 0", "step 1"]


def test_micro_steps_after_the_first_run_in_the_forward_phase(tmp_path):
    """The second micro-step's forward is a forward (its keys activations/...), not the
    optimizer's temporaries its backward left the phase at."""
    whole, _, _ = runs(tmp_path, n=2, micro=2)
    keys = {k for _, k, _, _ in whole.result["events"][:whole.result["phases"]["step2_before_backward"]]}
    forward = {k for k in keys if "blocks.1.up/" in k}
    assert forward and all(k.startswith("activations/") for k in forward), sorted(forward)


def block(i, width=32, drop=0.0):
    b = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, width), nn.Dropout(drop))
    b.layer_idx = i
    return b


def test_alike():
    """Alike: the same types, parameters and attributes, save one that is each block's index."""
    assert alike([block(i) for i in range(9)])
    assert alike([block(7 - i) for i in range(8)]) is False  # an index counted down
    assert not alike([block(i + 1) if i else block(0) for i in range(9)] + [block(3)])  # not each one's index
    assert not alike([block(i, width=64 if i % 3 == 2 else 32) for i in range(9)])  # every third wider
    assert not alike([block(i, drop=0.1 * i) for i in range(9)])  # a dropout rising with depth
    one = block(0)
    assert not alike([one] * 9)  # one module repeated: its weights shared
    shared = [block(i) for i in range(9)]
    for b in shared[1:]:
        b[1].weight = shared[0][1].weight
    assert not alike(shared)
    assert not alike([block(i) for i in range(8)] + [nn.Linear(16, 32)])


def test_unlike_blocks_run_whole(tmp_path):
    """A model whose blocks are alike but whose parent treats every third differently (dropout
    by position, unseen by alike()): the 4-block run does not match the repeat, every block runs."""
    text = SCRIPT.format(width=32, drop=0.0, micro=1, n=13).replace(
        "for b in self.blocks:\n            h = b(h)",
        "for i, b in enumerate(self.blocks):\n            h = b(h) if i % 3 else torch.nn.functional.dropout(b(h), 0.1)")
    whole, built, _ = runs(tmp_path, text=text)
    assert built.depth_note.startswith("every block run: the 4-block run differs")
    assert canonical(built.result) == canonical(whole.result)


def test_a_script_that_exits_early_says_so(tmp_path):
    """sys.exit() before the audited step ends: one line, from the cut run's retry as a whole."""
    script = tmp_path / "short.py"
    script.write_text(SCRIPT.format(width=32, drop=0.0, micro=1, n=12).replace('print("step", step)',
                                                                               'raise SystemExit(3)'))
    with pytest.raises(ShadowError, match=r"short.py exited \(code 3\) before its step 2 ended"):
        shadow_file(str(script), repeat=True, device="cuda", gpu="H100", step=2)


def test_an_inner_list_cut_first_runs_whole(tmp_path):
    """Each block holds 12 alike experts, built before the stack's own list: the experts of
    block 0 are the first list of 12, cut; the stack's list then holds it, and the step is the
    whole run's (nothing repeated from a cut that stands for no block of the stack)."""
    text = SCRIPT.format(width=32, drop=0.0, micro=1, n=12).replace(
        "        self.drop = nn.Dropout({drop})".format(drop=0.0),
        "        self.drop = nn.Dropout(0.0)\n        self.experts = nn.ModuleList([nn.Linear(16, 16) for _ in range(12)])").replace(
        "return x + self.drop(", "return x + sum(e(x) for e in self.experts[:2]) + self.drop(")
    whole, built, _ = runs(tmp_path, text=text)
    assert built.depth_note == "every block run: the cut list is inside a deeper list's blocks"
    assert canonical(built.result) == canonical(whole.result)


def test_a_slice_of_the_cut_list_is_the_same_blocks(tmp_path):
    """A forward that loops over a slice of its list (transformers' `self.layers[:n]`, a new
    ModuleList of the same blocks each call) is repeated as the list itself is."""
    text = SCRIPT.format(width=32, drop=0.0, micro=1, n=12).replace("for b in self.blocks:", "for b in self.blocks[:12]:")
    whole, built, _ = runs(tmp_path, text=text)
    assert built.depth_note == "repeated"
    assert canonical(built.result) == canonical(whole.result)


def test_the_measured_deep_llama_step():
    """benchmarks/scale_llama.py's 1.5B step (Qwen2-1.5B's shape as a Llama: 28 decoder layers,
    T 2048, bf16 autocast, AdamW) predicted for one GPU with its layers repeated, beside its audit
    on an H200 (torch 2.11, snapshots/results/scale/): step 2's start, before backward, end, peak
    and reserved memory, each to the byte."""
    import json
    import os
    from conftest import ROOT
    pytest.importorskip("transformers")
    with open(os.path.join(ROOT, "snapshots", "results", "scale", "h200-scale-llama-1.5b.json")) as f:
        row = json.load(f)
    s = shadow_file(os.path.join(ROOT, "benchmarks", "scale_llama.py"), ["--size=1.5b"], repeat=True,
                    device="cuda", gpu="H200")
    a = s.summary["allocator"]
    measured = row["phases"]
    assert "repeated" in s.summary["source"]
    assert (a["steady_state"], a["before_backward"], a["end"], a["peak"], a["reserved"]) == (
        measured["step2_start"]["memory_allocated"], measured["step2_before_backward"]["memory_allocated"],
        measured["step2_end"]["memory_allocated"], measured["step2_end"]["max_memory_allocated"],
        measured["step2_end"]["memory_reserved"])
