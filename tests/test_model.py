import pytest
import torch

from model import GPT, GPTConfig, PRESETS, num_params


@pytest.mark.parametrize("preset", list(PRESETS))
def test_param_count_matches_closed_form(preset):
    cfg = GPTConfig(**PRESETS[preset])
    expected = num_params(n_layer=cfg.n_layer, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                          block_size=cfg.block_size, bias=cfg.bias)
    with torch.device("meta"):  # shapes only: GPT-2 xl would take 6 GB to build for real
        model = GPT(cfg)
    assert model.get_num_params() == expected


def test_gpt2_small_is_124_373_760():
    assert num_params(n_layer=12, n_embd=768, vocab_size=50304, block_size=1024) == 124_373_760


def test_bias_adds_the_linear_and_layernorm_biases():
    kw = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    model = GPT(GPTConfig(bias=True, **kw))
    assert model.get_num_params() == num_params(bias=True, **kw)
    assert num_params(bias=True, **kw) - num_params(bias=False, **kw) == 2 * (2 * 32 + 3 * 32 + 32 + 4 * 32 + 32) + 32


def test_lm_head_is_tied_to_wte():
    model = GPT(GPTConfig(**PRESETS["cpu-tiny"]))
    assert model.lm_head.weight is model.transformer.wte.weight


def test_manual_and_sdpa_attention_agree():
    """Two different kernels (masked softmax by hand, fused SDPA) on the same weights."""
    torch.manual_seed(0)
    cfg = dict(PRESETS["cpu-tiny"])
    a = GPT(GPTConfig(attention="manual", **cfg))
    b = GPT(GPTConfig(attention="sdpa", **cfg))
    b.load_state_dict(a.state_dict(), strict=False)
    idx = torch.randint(cfg["vocab_size"], (2, 16))
    la, _ = a(idx)
    lb, _ = b(idx)
    assert torch.allclose(la, lb, atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(n_embd=100, n_head=12), "not divisible"),
    (dict(attention="flash"), "attention must be"),
    (dict(activation="swish"), "activation must be"),
    (dict(n_layer=0), "positive integer"),
])
def test_invalid_configs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**bad).validate()
