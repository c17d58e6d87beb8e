"""Activation checkpointing: training unchanged, bad input refused, every byte named and predicted."""

import json

import pytest

from conftest import load_json, run_cli, run_train
from memory_audit.prediction.predict import device_facts, predict, published_formulas
from memory_audit.comparison.reconcile import mismatched, reconcile

TINY = ["--device=cpu", "--preset=cpu-tiny", "--batch_size=2", "--max_iters=3", "--dtype=float32"]


def test_losses_bitwise_equal_in_every_mode(tmp_path):
    """Recomputation replays the forward exactly (dropout included: the RNG state is restored)."""
    losses = {}
    for mode in ("none", "full", "selective", "sac"):
        p = run_train(*TINY, "--dropout=0.1", f"--activation_checkpointing={mode}",
                      f"--losses_out={tmp_path}/{mode}.json")
        assert p.returncode == 0, p.stderr[-2000:]
        losses[mode] = load_json(tmp_path / f"{mode}.json")
    assert len(losses["none"]) == 3
    assert losses["full"] == losses["none"] and losses["selective"] == losses["none"] and losses["sac"] == losses["none"]


@pytest.mark.parametrize("args, message", [
    (["--activation_checkpointing=most"], "activation_checkpointing must be one of none, full, selective, sac"),
    (["--ac_every=0"], "ac_every must be an integer of at least 1"),
    (["--activation_checkpointing=sac", "--sac_save_ops=mm,not_an_op"], "'not_an_op' is not an aten op"),
])
def test_bad_checkpointing_input_is_one_line(args, message):
    p = run_train(*TINY, *args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert "tokens per iteration" not in p.stdout  # refused before any work
    q = run_cli("predict", "--gpu=cpu", *args)
    assert q.returncode == 2 and "Traceback" not in q.stderr, q.stderr


def test_predict_prints_a_good_checkpointing_config():
    ok = run_cli("predict", "--gpu=cpu", "--preset=cpu-tiny", "--activation_checkpointing=sac")  # text output
    assert ok.returncode == 0 and "peak at: " in ok.stdout, ok.stderr


@pytest.mark.parametrize("mode", ["full", "selective", "sac"])
def test_audit_names_every_byte_and_matches_prediction(audits, mode):
    run = audits(f"ac-{mode}", "--dtype=float32", "--attention=manual", f"--activation_checkpointing={mode}")
    rec = reconcile(run)
    assert rec["unattributed_bytes"] == 0
    assert mismatched(rec["rows"], skip=()) == []
    assert rec["totals"]["peak"]["diff"] == 0
    keys = [r["key"] for r in rec["rows"] if r["phase"] == "step2_before_backward"]
    assert "activations/h.0/checkpoint.input" in keys or "activations/h.0.attn/checkpoint.input" in keys
    if mode == "sac":
        assert "activations/h.0.attn.c_attn/mm.sac_output" in keys
    # the recomputation is named as such in the replay of the whole step
    assert any(p["categories"].get("recomputed") for p in rec["series"])


def test_full_checkpointing_moves_the_peak_into_the_backward(audits):
    rec = reconcile(audits("ac-full", "--dtype=float32", "--attention=manual", "--activation_checkpointing=full"))
    assert rec["cost"]["peak_at"].startswith("event ") and "backward/" in rec["cost"]["peak_at"]  # the shadow's
    assert rec["peak"]["categories"]["recomputed"] > 0  # measured: recomputed tensors live at the peak


@pytest.mark.parametrize("name, args", [
    ("b1-fp32", ["--dtype=float32"]),
    ("b1-bf16", ["--dtype=bfloat16"]),
    ("b1-bf16-dropout", ["--dtype=bfloat16", "--dropout=0.1"]),
])
def test_batch_one_full_checkpointing_to_the_byte(plain_audits, name, args):
    """At batch 1 with full checkpointing the gradients outweigh what is saved: the measured peak
    (the shadow run's, to the byte) is the embedding's backward, the last node (fp32 adds the tied wte/lm_head gradients out of place,
    one allocation later; bf16 adds them in place). Dropout: each region keeps the CPU RNG state.
    The batch is two tensors of B*T int64 (not views of one buffer, at batch 1 too)."""
    run = plain_audits(f"ac-full-{name}", "--batch_size=1", "--attention=manual", "--activation_checkpointing=full", *args)
    rec = reconcile(run)
    assert rec["unattributed_bytes"] == 0 and mismatched(rec["rows"], skip=()) == []
    assert [rec["totals"][k]["diff"] for k in ("steady_state", "activations", "peak")] == [0, 0, 0]
    assert rec["cost"]["peak_at"].startswith("event "), rec["cost"]["peak_at"]  # the shadow's event
    start = {r["key"]: r["actual"] for r in rec["rows"] if r["phase"] == "step2_start"}
    assert start["inputs/x"] == start["inputs/y"] == 8 * 64
    before = {r["key"]: r["actual"] for r in rec["rows"] if r["phase"] == "step2_before_backward"}
    states = {k: v for k, v in before.items() if k.endswith("checkpoint.rng_state")}
    if "--dropout=0.1" in args:  # and the MLP dropout's mask is spent before c_proj's backward
        assert states == {"activations/h.0/checkpoint.rng_state": 5056, "activations/h.1/checkpoint.rng_state": 5056}
    else:
        assert states == {}


@pytest.mark.parametrize("name, args", [
    ("relu-bias-bf16", ["--activation=relu", "--bias=True", "--dtype=bfloat16", "--activation_checkpointing=full"]),
    ("selective-dropout", ["--dropout=0.1", "--dtype=float32", "--activation_checkpointing=selective"]),
])
def test_moments_inside_a_block_backward_to_the_byte(plain_audits, name, args):
    """n_embd=128, 3 layers; the shadow run's peak and lines to the byte where a lever moves the
    peak inside a block's backward. ReLU under autocast: the peak comes once mlp.c_proj's backward is done
    (its weight gradient cast to fp32 while the bf16 one exists; its weight copy and the gradient
    it was handed gone). Selective checkpointing with dropout: the attention core is recomputed
    only when the backward reaches it, so c_proj's moment holds no recomputation (counting it
    there is 331,264 B over)."""
    run = plain_audits(f"moment-{name}", "--n_embd=128", "--n_layer=3", "--attention=manual", *args)
    rec = reconcile(run)
    assert rec["unattributed_bytes"] == 0 and mismatched(rec["rows"], skip=()) == []
    assert [rec["totals"][k]["diff"] for k in ("steady_state", "activations", "peak")] == [0, 0, 0]


def test_cpu_rng_state_size():
    """The predictor's constant is the size torch.get_rng_state() returns here."""
    import torch
    from memory_audit.prediction.ledger.levers import CPU_RNG_STATE_BYTES
    assert torch.get_rng_state().nbytes == CPU_RNG_STATE_BYTES


def test_diff_none_against_full(audits, tmp_path):
    none = audits("fp32-manual-gelu", "--dtype=float32", "--attention=manual", "--activation=gelu")
    full = audits("ac-full", "--dtype=float32", "--attention=manual", "--activation_checkpointing=full")
    p = run_cli("diff", none, full, "--json", "-")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    bb = {l["key"]: l for l in d["phases"]["step2_before_backward"]["lines"]}
    assert bb["activations/h.0.attn/softmax.result"]["diff"] == -bb["activations/h.0.attn/softmax.result"]["a"] < 0
    assert bb["activations/h.1/checkpoint.input"]["a"] == 0 and bb["activations/h.1/checkpoint.input"]["diff"] == 4 * 2 * 64 * 64
    assert d["totals"]["activations"]["diff"] < 0 and d["totals"]["peak"]["diff"] < 0
    assert d["totals"]["activations"]["diff"] == (d["phases"]["step2_before_backward"]["categories"]["activations"]["diff"])
    # an audit against its own prediction: nothing left over
    pred = tmp_path / "pred.json"
    q = run_cli("predict", "--gpu=cpu", "--preset=cpu-tiny", "--batch_size=2", "--dtype=float32",
                "--activation_checkpointing=full", "--json")
    pred.write_text(q.stdout)
    r = run_cli("diff", full, str(pred), "--json", "-")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert all(v["diff"] == 0 for v in d["totals"].values())
    assert all(ph["lines"] == [] for ph in d["phases"].values())
    flag = run_cli("diff", full, "--json", str(pred))  # --json takes no file name: both paths are read
    assert flag.returncode == 0 and json.loads(flag.stdout)["b"]["kind"] == "prediction"


def test_full_checkpointing_activations_by_hand():
    """GPT-2 small, the reference batch on an A100: full AC keeps each block's fp32 input and
    what lies outside the blocks; summed here from the shapes, not from the predictor's lines."""
    B, T, d, L, V = 12, 1024, 768, 12, 50304
    cfg = dict(batch_size=B, dtype="float16", attention="manual", activation_checkpointing="full")
    t = predict(cfg, device_facts("cuda", gpu="A100"))["totals"]
    outside = (8 * T  # position ids
               + 4 * B * T * d + 2 * 4 * B * T  # ln_f input, mean, rstd
               + 2 * V * d + 2 * B * T * d  # lm_head's fp16 weight copy and input
               + 2 * B * T * V + 4 * B * T * V + 4  # log_softmax (fp16), nll_loss's fp32 copy, total_weight
               + 2 * B * T * V)  # the logits the loop holds
    assert t["activations_bytes"] == L * 4 * B * T * d + outside
    assert t["recompute_flops"] == L * (2 * B * T * d * 8 * d + 4 * B * T * T * d)


def test_korthikanti_selective_and_full_columns():
    f = published_formulas(dict(batch_size=12))
    s, b, h, L = 1024, 12, 768, 12
    assert f["korthikanti2022_selective"]["activations"] == L * 34 * s * b * h
    assert f["korthikanti2022_full"]["activations"] == L * 2 * s * b * h


def test_sac_op_the_predictor_does_not_model_is_refused():
    with pytest.raises(ValueError, match="not for native_layer_norm"):
        predict(dict(activation_checkpointing="sac", sac_save_ops="mm,native_layer_norm"), device_facts("cpu"))


def _sac_saved(tmp_path, name):
    """The sac_output records an Audit of a model.py SAC step on CPU keeps: (key, bytes)."""
    import os
    import torch
    from memory_audit import Audit
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, bias=True,
                          activation_checkpointing="sac", sac_save_ops="addmm,bmm"))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 64, (2, 16))
    with Audit(model, opt, out_dir=str(tmp_path / name), step=1) as audit:
        for step in range(2):
            with audit.step(step):
                _, loss = model(x, x)
                audit.before_backward(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
    meta = load_json(os.path.join(audit.run_dir, "meta.json"))
    return sorted((r["key"], r["nbytes"]) for r in meta["saved_tensors"] if ".sac_output" in r["key"])


def test_sac_outputs_are_named_by_their_module_when_the_policy_runs_before_the_op(tmp_path, monkeypatch):
    """torch 2.11 asks SAC's policy before the op runs (no ctx.op_output): the audit reads what SAC
    kept from the region's storage as it ends, and names each output by the module the policy's
    call ran in, as a torch that hands the policy the output is named (the ledger's names; on an
    H100 with torch 2.11 they were named by block until this). Simulated here by a context
    without op_output."""
    import torch.utils.checkpoint as ckpt
    seen = _sac_saved(tmp_path, "with-output")
    assert ("activations/h.0.attn.c_attn/addmm.sac_output", 2 * 16 * 48 * 4) in seen

    class Before:  # torch 2.11's context: the policy is asked before the op runs
        def __init__(self, *, is_recompute, **_):
            self.is_recompute = is_recompute
    monkeypatch.setattr(ckpt, "SelectiveCheckpointContext", Before)
    from memory_audit.naming.checkpoints import _sac_policy_sees_outputs
    assert not _sac_policy_sees_outputs()
    assert _sac_saved(tmp_path, "before") == seen
