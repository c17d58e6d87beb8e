"""The user's own code shadow-run for a GPU this machine does not have (shadow(device="cuda"),
memory_audit/prediction/shadow/gpu.py; issues #46, #49): torch.cuda as one GPU would answer,
device and host memory told apart, CUDA autocast's policy, checkpointing's recomputation under
the same kernels, and the committed H100 traces of library models predicted event by event."""

import json
import os
import tarfile

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from conftest import ROOT

import memory_audit

MiB = 1 << 20
V, D, B, T = 96, 32, 3, 16


def _loop(steps, checkpointed=False):
    """A user's loop as written for a GPU: the device from torch.cuda, the batch made on the host."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D), nn.Linear(D, V)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randint(0, V, (B, T)).to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            if checkpointed:  # a region with attention in it, recomputed in backward
                h = model[0](x)
                h = torch.utils.checkpoint.checkpoint(_attend, model[1:4], h, use_reentrant=checkpointed == "reentrant")
                logits = model[4](h)
            else:
                logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _attend(block, h):
    h = block(h)
    q = h.view(B, T, 2, D // 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(B, T, D)


def _patched():
    """What a GPU shadow patches, as it stands now."""
    import torch.utils.checkpoint as ckpt
    from torch.optim import optimizer
    from torch.overrides import _get_current_function_mode_stack
    from memory_audit.prediction.shadow import autocast as shadow_autocast
    return (torch.cuda.is_available, torch.accelerator.is_available, torch.autocast, torch.amp.autocast,
            torch.is_autocast_enabled, torch.get_autocast_dtype, torch.nn.Module.cuda, torch.nn.Module.to, ckpt.CheckpointFunction,
            ckpt._checkpoint_without_reentrant_generator, optimizer._get_foreach_kernels_supported_devices,
            # torch.distributed.tensor's import appends DTensor for good (torch's doing, kept)
            [t for t in optimizer._foreach_supported_types if t.__name__ != "DTensor"], len(_get_current_function_mode_stack()),
            len(shadow_autocast._REGIONS), len(shadow_autocast._CACHE))


def test_torch_cuda_answers_as_one_gpu_and_everything_is_restored():
    """Inside, torch.cuda and torch.accelerator answer as one H100; after a shadow that reached
    step 2 (its ledger patches checkpointing too), every patch is undone, and a CPU checkpoint
    with dropout recomputes as before."""
    before = _patched()
    with memory_audit.shadow(device="cuda", gpu="H100") as s:
        seen = (torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.get_device_name(),
                torch.cuda.is_bf16_supported(), torch.accelerator.current_accelerator().type)
        _loop(4, checkpointed="non-reentrant")
    assert seen == (True, 1, "NVIDIA H100", True, "cuda")
    assert _patched() == before
    assert s.summary["device"]["gpu"] == "H100" and s.summary["allocator"]["reserved"] > 0
    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    torch.utils.checkpoint.checkpoint(block, torch.ones(2, 4, requires_grad=True), use_reentrant=False).sum().backward()


def test_what_users_write_to_reach_the_gpu():
    """An index as the device, pin_memory() then a non-blocking copy, torch.tensor(..., device=
    "cuda", requires_grad=True) a leaf an optimizer takes; an optimizer made before the move, and
    a script that puts nothing on the GPU, each one line."""
    with memory_audit.shadow(device="cuda", gpu="H100") as s:
        w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="cuda", requires_grad=True)
        lin = nn.Linear(2, 2).to(0)
        opt = torch.optim.SGD([w, *lin.parameters()], lr=0.1)
        for _ in range(4):
            x = torch.ones(3, 2).pin_memory().to("cuda", non_blocking=True)
            lin(x @ w).sum().backward()
            opt.step()
            opt.zero_grad()
    lines = s.summary["lines"]
    assert w.is_leaf and lines["activations/loop/leaf0"] == 2 * 2 * 4  # w, on the GPU
    assert lines["activations/to"] == 3 * 2 * 4  # x's device copy, by the call that made it (loop_calls): its
    # host and pinned copies no memory
    assert lines["weights/weight"] == 2 * 2 * 4 and lines["weights/bias"] == 2 * 4
    from memory_audit.prediction.shadow.step import ShadowError
    with pytest.raises(ShadowError, match="made before model.to"):  # a known limit, said in one line
        with memory_audit.shadow(device="cuda", gpu="H100"):
            lin = nn.Linear(2, 2)
            opt = torch.optim.SGD(lin.parameters(), lr=0.1)
            lin.cuda()
            for _ in range(4):
                lin(torch.ones(3, 2, device="cuda")).sum().backward()
                opt.step()
    with pytest.raises(ShadowError, match="put nothing on the GPU"):
        with memory_audit.shadow(device="cuda", gpu="H100"):
            lin = nn.Linear(2, 2)
            opt = torch.optim.SGD(lin.parameters(), lr=0.1)
            for _ in range(4):
                lin(torch.ones(3, 2)).sum().backward()
                opt.step()
                opt.zero_grad()


def test_device_memory_is_what_the_code_put_on_the_gpu():
    """The weights, AdamW's two moments, the batch's device copy (int64) and the bf16 logits the
    loop holds: the host batch and the model's host copy made before `.to("cuda")` are no device
    memory. One cuBLAS workspace per
    thread that ran a GEMM (the forward's and autograd's), and cuBLASLt's for the Linear's addmm."""
    with memory_audit.shadow(device="cuda", gpu="H100") as s:
        _loop(4)
    weights = 4 * (V * D + D * D + D + 2 * D + D * V + V)  # fp32: embedding, linear, layer norm, linear
    lines = s.summary["lines"]
    assert sum(v for k, v in lines.items() if k.startswith("weights/")) == weights
    assert sum(v for k, v in lines.items() if k.startswith("optimizer/")) == 2 * weights  # the step counts stay on the host
    assert lines["inputs/model.input"] == B * T * 8  # step 1's batch on the device; its host copy no line
    assert lines["temporary/loop/output"] == B * T * V * 2  # the logits, bf16 under CUDA autocast
    assert lines["workspace/cublas"] == 2 * 32 * MiB
    assert lines["workspace/cublaslt"] == 1 * MiB


def test_cuda_autocast_policy_on_the_meta_tensors():
    """lower precision for linear and matmul, fp32 for exp, layer norm and norm, sum's output in
    fp32 (fp32_set_opt_dtype), a nested region's dtype the outer one's, an inner region with
    enabled=False turning it off, nothing outside a region; a weight cast once per region
    (cached) unless cache_enabled=False; binary_cross_entropy refused as CUDA autocast refuses it."""
    seen = {}
    with memory_audit.shadow(device="cuda", gpu="H100") as s:
        lin = nn.Linear(8, 8).cuda()
        x = torch.ones(4, 8, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(x)
            seen["linear"], seen["matmul"] = y.dtype, (x @ x.t()).dtype
            seen["exp"], seen["sum"], seen["norm"] = torch.exp(y).dtype, y.sum().dtype, y.norm().dtype
            seen["layer_norm"] = F.layer_norm(y, (8,)).dtype
            seen["enabled"] = torch.is_autocast_enabled("cuda")
            with torch.autocast("cuda"):
                seen["nested"] = lin(x).dtype
            with torch.autocast("cuda", enabled=False):
                seen["inner"] = lin(x).dtype
            try:
                F.binary_cross_entropy(torch.sigmoid(y), torch.ones_like(y))
            except RuntimeError as e:
                seen["bce"] = "unsafe to autocast" in str(e)
        seen["outside"] = lin(x).dtype
        casts = {}
        for cache in (True, False):
            start = len(s.tracker.events)
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache):
                lin(x), lin(x)
            casts[cache] = sum(1 for action, aid in s.tracker.events[start:]
                               if action == "alloc" and s.tracker.allocs[aid][1] == 8 * 8 * 2)
        _loop(4)
    assert seen == {"linear": torch.bfloat16, "matmul": torch.bfloat16, "exp": torch.float32, "sum": torch.float32,
                    "norm": torch.float32, "layer_norm": torch.float32, "enabled": True, "nested": torch.bfloat16,
                    "inner": torch.float32, "bce": True, "outside": torch.float32}
    assert casts == {True: 1, False: 2}


def test_multihead_attention_runs_the_gpu_kernels_under_autocast():
    """nn.MultiheadAttention hands F.multi_head_attention_forward to the torch-function modes whole,
    and torch runs its body with every mode off: its in-projection was fp32 under autocast and its
    SDPA the math path (H200 zoo rows of seed 69881, nn.TransformerEncoder at GPT-2's width:
    +150 to +545 MB). The body runs under the shadow's modes: bf16 projections, cuDNN attention
    with its dropout, and the fused dropout's bool mask after the attention."""
    with memory_audit.shadow(device="cuda", gpu="H100") as s:
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True).cuda()
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = layer(torch.randn(2, 16, 64, device="cuda"))
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    start, end = s.result["phases"]["step2_start"], s.result["phases"]["step2_before_backward"]
    made = [(e[1].rsplit("/", 1)[-1], e[2]) for e in s.result["events"][start:end] if e[0] == "alloc"]
    names = [n for n, _ in made]
    assert "_safe_softmax" not in names and "_scaled_dot_product_cudnn_attention" in names
    assert ("mm", 2 * 16 * 3 * 64 * 2) in made  # the in-projection's output in bf16 (fp32: twice)


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
def test_checkpointing_recomputes_under_the_same_kernels(how):
    """torch.utils.checkpoint's recomputation runs with no torch-function mode on: the shadow's
    modes and the forward's autocast region are entered again, so the recomputed Linear casts its
    weight to bf16 again and makes a bf16 output, as its forward did (SDPA and dropout would
    otherwise take the meta tensors' own kernels and save other tensors: CheckpointError)."""
    with memory_audit.shadow(device="cuda", gpu="H100") as s:
        _loop(4, checkpointed=how)
    start = s.result["phases"]["step2_before_backward"]
    again = [(e[1], e[2]) for e in s.result["events"][start:] if e[0] == "alloc" and e[1].startswith("temporary/backward/1/")]
    assert again[:4] == [("temporary/backward/1/_to_copy", D * 2), ("temporary/backward/1/_to_copy", D * D * 2),
                         ("temporary/backward/1/_to_copy", B * T * D * 2), ("temporary/backward/1/addmm", B * T * D * 2)]


def test_kernel_temporaries_read_from_the_zoo_traces():
    """CUDA's cumsum of a bool mask casts it to int64 after its output; embedding copies
    non-contiguous indices before it (shadow/cuda.after_outputs / before_outputs)."""
    from memory_audit.prediction.shadow import cuda as shadow_cuda
    ops = torch.ops.aten
    mask = torch.ones(5, 7, dtype=torch.bool)
    assert shadow_cuda.after_outputs(ops.cumsum.default, (mask, -1)) == [5 * 7 * 8]
    assert shadow_cuda.after_outputs(ops.cumsum.default, (torch.ones(5, 7), -1)) == []
    assert shadow_cuda.outside_sample(ops.cumsum.default, (mask, -1)) is None  # the case measured
    unmeasured = shadow_cuda.outside_sample(ops.cumsum.default, (torch.ones(5, 7), -1, torch.float64))
    assert unmeasured == ("a cumulative op's cast of its input at cumsum of float32 "
                          "(measured: cumsum of a bool mask to int64 (H100, zoo seed 408334))")
    ids = torch.zeros(1, 7, dtype=torch.long).expand(5, 7)
    weight = torch.ones(3, 4)
    assert shadow_cuda.before_outputs(ops.embedding.default, (weight, ids)) == [5 * 7 * 8]
    assert shadow_cuda.before_outputs(ops.embedding.default, (weight, ids.contiguous())) == []
    x = torch.ones(2, 6, 4, 4)  # GroupNorm: (N, C) fp32 scale and shift after its outputs, unless 1-d or affine-free
    assert shadow_cuda.after_outputs(ops.native_group_norm.default, (x, torch.ones(6), None, 2, 6, 16, 3, 1e-5)) == [48, 48]
    assert shadow_cuda.after_outputs(ops.native_group_norm.default, (x, None, None, 2, 6, 16, 3, 1e-5)) == []


# -- the committed H100 runs

ZOO = os.path.join(ROOT, "snapshots", "results", "zoo")


def _row(index):
    with open(os.path.join(ZOO, "h100-zoo-408334.jsonl")) as f:
        return next(r for r in map(json.loads, f) if r["index"] == index)


@pytest.mark.parametrize("index", (9, 29, 35, 40))
def test_committed_h100_unet_rows(index):
    """Plain-torch U-Nets (GroupNorm, SiLU, a transposed convolution, a skip concat; bf16
    autocast, with and without checkpointing) audited on an H100: step 2's start, before
    backward, end and peak as memory_allocated() counted them, predicted here to the byte. (Their
    events part at cuDNN's convolution workspaces, made and freed inside the op.)"""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import zoo
    row = _row(index)
    with memory_audit.shadow(device="cuda", gpu="H100") as s:
        zoo.train(row["spec"], "cuda", steps=10)
    alloc = s.summary["allocator"]
    assert [alloc["steady_state"], alloc["before_backward"], alloc["end"], alloc["peak"]] == [
        row["phases"]["step2_start"]["memory_allocated"], row["phases"]["step2_before_backward"]["memory_allocated"],
        row["phases"]["step2_end"]["memory_allocated"], row["peak"]["bytes"]]


# -- the committed H100 traces (transformers 5.17 on the GPU: another version writes other code)

# the loops of seed 408334 whose step 2 the shadow gives event by event (scripts/zoo_cuda_check.py):
# Llama, Mistral (eager, SDPA, checkpointed), Qwen2 (bf16, checkpointed), fp32 and bf16
EQUAL = (22, 27, 28, 32, 44, 50, 57)


def _transformers():
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


@pytest.mark.skipif(_transformers() != "5.17.0", reason="the committed traces ran transformers 5.17.0")
@pytest.mark.parametrize("index", EQUAL)
def test_committed_h100_traces_event_by_event(index, tmp_path):
    import sys
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import zoo
    from memory_audit.comparison.reconcile import first_divergence, step_events
    with tarfile.open(os.path.join(ZOO, "h100-zoo-408334-runs.tgz")) as tar:
        members = [m for m in tar.getmembers() if f"zoo-408334-{index:02d}/" in m.name]
        tar.extractall(tmp_path, members=members, filter="data")
    run = os.path.join(tmp_path, "zoo2", f"zoo-408334-{index:02d}")
    row = _row(index)
    with memory_audit.shadow(device="cuda", gpu="H100") as s:
        zoo.train(row["spec"], "cuda", steps=10)
    assert first_divergence(step_events(run), s.result["events"]) is None
    alloc = s.summary["allocator"]
    assert alloc["peak"] == row["peak"]["bytes"]
    assert alloc["steady_state"] == row["phases"]["step2_start"]["memory_allocated"]
    assert alloc["end"] == row["phases"]["step2_end"]["memory_allocated"]


def test_predict_script_on_a_gpu_it_does_not_have():
    """`predict-script --gpu=H100 SCRIPT -- ARGS`: the numbers are shadow(device="cuda")'s of the
    same code, as memory_allocated() counts them; an unknown GPU is one line and exit 2."""
    import subprocess
    import sys
    run = [sys.executable, "-m", "memory_audit", "predict-script"]
    p = subprocess.run(run + ["--json", "--gpu=H100", "examples/train_classifier.py", "--", "--batch=4", "--seq=16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout[p.stdout.index("{"):])
    argv, path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = ["train_classifier.py", "--batch=4", "--seq=16"], [os.path.join(ROOT, "examples")]
    try:
        import train_classifier
        with memory_audit.shadow(device="cuda", gpu="H100") as s:
            train_classifier.main()
    finally:
        sys.argv, sys.path[:] = argv, path
    assert out["allocator"] == s.summary["allocator"]
    assert out["device"]["gpu"] == "H100"
    bad = subprocess.run(run + ["--gpu=H1000", "examples/train_classifier.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "H1000" in bad.stderr


def test_what_torch_adds_to_the_foreach_types_during_a_gpu_shadow_stays():
    """The GPU shadow lets the optimizers take fake tensors for foreach ones (FakeTensor added to
    torch.optim's list of foreach types) and takes only that out again: DTensor, which
    torch.distributed.tensor appends at its import, stays when that import happens inside."""
    from test_nodynamo import _python
    code = """
import sys
import torch
from torch.optim import optimizer
import memory_audit
assert "torch.distributed.tensor" not in sys.modules
with memory_audit.shadow(device="cuda", gpu="H100") as s:
    import torch.distributed.tensor
    m = torch.nn.Linear(4, 4).cuda()
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    for _ in range(3):
        m(torch.randn(2, 4, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import FakeTensor
print(DTensor in optimizer._foreach_supported_types, FakeTensor in optimizer._foreach_supported_types)
"""
    assert _python(code) == "True False"


def test_a_gpt2_sized_encoder_vit_forward_event_by_event(tmp_path):
    """nn.TransformerEncoder at GPT-2's width over a patch embedding (H200, seed 424047 row 0,
    fp32, batch 8): its residual stream keeps the embedding's transposed layout, so CUDA's
    LayerNorm copies its input before its outputs, and nn.MultiheadAttention's packed projection
    of its transposed input is a matmul with the bias added in place. In the backward, the bias
    gradients' reductions split across blocks (rules/reduce.py), efficient attention's backward
    and LayerNorm's copy their transposed grad_out. The step agrees event by event through all
    12 blocks' backward (1,759 events); the first event apart is the patch embedding's
    convolution backward's cuDNN workspace (not modelled), and step 2's start, its moment before
    backward and its end are exact. In a process of its own: after a
    compiled plan was made in a process (a torch.compile whose backend raised), CPython 3.11 no
    longer inlines Python calls there, and `_sa_block(self.norm1(x))` holds LayerNorm's output
    until the call returns, three events later (docs/limits.md)."""
    import subprocess
    import sys
    with tarfile.open(os.path.join(ZOO, "h200-zoo-gpt2-vit-424047-575634-runs.tgz")) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("zoo-424047-00/")]
        tar.extractall(tmp_path, members=members, filter="data")
    code = f"""
import gzip, json, sys
sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "scripts")!r}]
import zoo, memory_audit
from memory_audit.comparison.reconcile import first_divergence, step_events
with gzip.open({os.path.join(ZOO, "h200-zoo-gpt2-vit-424047-575634.jsonl.gz")!r}, "rt") as f:
    row = next(r for r in map(json.loads, f) if r["seed"] == 424047 and r["index"] == 0)
with memory_audit.shadow(device="cuda", gpu="H200") as s:
    zoo.train(row["spec"], "cuda", steps=10)
a = s.summary["allocator"]
apart = first_divergence(step_events({os.path.join(str(tmp_path), "zoo-424047-00")!r}), s.result["events"])
print(json.dumps([apart, [a["steady_state"], a["before_backward"], a["end"]],
                  [row["phases"][p]["memory_allocated"] for p in ("step2_start", "step2_before_backward", "step2_end")]]))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    apart, predicted, measured = json.loads(p.stdout.strip().splitlines()[-1])
    assert apart["position"] == 1759 and apart["measured"][0] == "alloc" and apart["measured"][2] == 14385296, apart
    assert apart["predicted"][1] == "grads/patch.bias", apart
    assert predicted == measured

def test_a_tiny_encoder_vit_backward_through_its_layer_norms_and_patch_embedding(tmp_path):
    """Seed 256239's row 37 (H200, fp32, batch 1): the backward's LayerNorms copy their
    non-contiguous saved input and the patch embedding's convolution_backward its transposed
    grad_output; the step agrees event by event up to the convolution's last output (243 events).
    There the real kernel frees its copy before it makes the bias gradient, where the rule holds
    it to the return: the next two events swap (512 B blocks each), and the peak is exact."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import zoo
    from memory_audit.comparison.reconcile import first_divergence, step_events
    with tarfile.open(os.path.join(ZOO, "h200-zoo-256239-runs.tgz")) as tar:
        members = [m for m in tar.getmembers() if "zoo-256239-37/" in m.name]
        tar.extractall(tmp_path, members=members, filter="data")
    run = next(os.path.join(r, d) for r, ds, _ in os.walk(tmp_path) for d in ds if d == "zoo-256239-37")
    with open(os.path.join(ZOO, "h200-zoo-256239.jsonl")) as f:
        row = next(r for r in map(json.loads, f) if r["index"] == 37)
    with memory_audit.shadow(device="cuda", gpu="H200") as s:
        zoo.train(row["spec"], "cuda", steps=10)
    apart = first_divergence(step_events(run), s.result["events"])
    assert apart["position"] == 243 and apart["measured"][:3] == ("free", "?", 2304), apart
    assert apart["predicted"][2] == 64 and s.summary["allocator"]["peak"] == row["peak"]["bytes"]


def test_cudnn_paths_without_a_rule_are_listed_as_not_measured():
    """A convolution and a GRU on a GPU the shadow stands for: cuDNN's convolution workspaces and
    its RNN kernel have no rule (the zoo's fp32 U-Nets and every GRU/LSTM loop miss), so each is
    named once under "not measured on a GPU"; a Linear-only loop names neither."""
    from torch import nn
    from memory_audit.prediction.shadow.cuda import UNMODELLED

    def run(conv_and_gru):
        with memory_audit.shadow(device="cuda", gpu="H200") as s:
            lin = nn.Linear(8, 8).cuda()
            mods = [lin] + ([nn.Conv2d(3, 8, 3).cuda(), nn.GRU(8, 16, batch_first=True).cuda()] if conv_and_gru else [])
            opt = torch.optim.AdamW([p for m in mods for p in m.parameters()])
            for _ in range(3):
                if conv_and_gru:
                    y = mods[1](torch.randn(2, 3, 8, 8, device="cuda")).flatten(2).transpose(1, 2)
                    y = mods[2](lin(y))[0]
                else:
                    y = lin(torch.randn(2, 8, device="cuda"))
                y.sum().backward()
                opt.step()
                opt.zero_grad()
        return s.summary["unmeasured"]
    assert sorted(run(True)) == sorted([UNMODELLED["conv"], UNMODELLED["rnn"]])
    assert run(False) == []
