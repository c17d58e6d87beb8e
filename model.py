"""
A GPT-2 language model in the shape nanoGPT gives it, written for memory accounting.

Every tensor this file creates in training is one the predictor in memory_audit/prediction/predict.py
must account for, so the forward passes are written plainly and the choices that change
memory are config options:
  attention = "manual": fp32 causal-mask buffer per layer, masked_fill, softmax, dropout
  attention = "sdpa":   F.scaled_dot_product_attention (flash / memory-efficient kernels)
  activation = "gelu" | "relu"
  activation_checkpointing = "none" | "full" | "selective" | "sac", on every ac_every-th block:
    full:      torch.utils.checkpoint around the block: only its input is kept
    selective: checkpoint around the attention core (Korthikanti's selective recomputation)
    sac:       selective activation checkpointing: the block keeps the outputs of sac_save_ops
"""

import math
import inspect
from contextlib import nullcontext
from dataclasses import dataclass, asdict
from functools import partial

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy

from memory_audit.schema import check_model_config, sac_ops


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm layers, as GPT-2 has them
    attention: str = "manual"  # "manual" | "sdpa"
    activation: str = "gelu"  # "gelu" | "relu"
    activation_checkpointing: str = "none"  # "none" | "full" | "selective" | "sac"
    ac_every: int = 1  # checkpoint blocks 0, ac_every, 2*ac_every, ...
    sac_save_ops: str = ""  # comma-separated aten ops whose outputs SAC keeps; "" = schema.SAC_DEFAULT_OPS

    def validate(self):
        """Raise ValueError with a one-line reason if this config cannot build a model."""
        check_model_config(asdict(self))
        for name in sac_ops(asdict(self)):
            if not hasattr(torch.ops.aten, name):
                raise ValueError(f"sac_save_ops: {name!r} is not an aten op")


def no_contexts():
    return nullcontext(), nullcontext()


def run_checkpointed(module, fn, *args):
    """Run fn(*args) under non-reentrant activation checkpointing with the module's contexts.

    `module.ac_context_fn` makes the (forward, recompute) context pair; the audit wraps it to see
    what SAC keeps and to label the recomputation. The RNG state is kept only where a dropout
    needs it (saving it allocates a tensor per region and changes nothing without dropout).
    """
    return checkpoint(fn, *args, use_reentrant=False, context_fn=module.ac_context_fn,
                      preserve_rng_state=module.ac_preserve_rng)


# Model shapes; vocab 50304 and no biases as nanoGPT trains them. The small ones run on a CPU.
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "cpu-mini": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "cpu-tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512),
}


def num_params(n_layer, n_embd, vocab_size, block_size, bias=False, **_):
    """Closed-form parameter count of GPT (lm_head tied to wte, so counted once)."""
    d = n_embd
    per_layer = 12 * d * d + 2 * d  # qkv 3d^2, proj d^2, fc 4d^2, proj 4d^2, two LayerNorm weights
    if bias:
        per_layer += 2 * d + 3 * d + d + 4 * d + d  # LayerNorm biases, then the four Linear biases
    final_ln = d + (d if bias else 0)
    return n_layer * per_layer + d * (vocab_size + block_size) + final_ln


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's nn.LayerNorm has no bias=False before 2.1)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.manual = config.attention == "manual"
        self.checkpoint_core = False  # set by Block for selective recomputation
        self.ac_context_fn = no_contexts
        self.ac_preserve_rng = config.dropout > 0
        if self.manual:
            # fp32 lower-triangular mask, one per layer: 4 * block_size^2 bytes each
            mask = torch.tril(torch.ones(config.block_size, config.block_size))
            self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3 * width): width = n_embd, or n_embd / t on a tensor-parallel rank
        B, T, W = qkv.size()
        q, k, v = qkv.split(W // 3, dim=2)
        hs = self.n_embd // self.n_head
        nh = W // 3 // hs  # the heads this rank holds: all of them unless tensor parallelism splits them
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        if self.checkpoint_core:  # selective recomputation: keep q, k, v, recompute the rest
            y = run_checkpointed(self, self.core, q, k, v)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))

    def core(self, q, k, v):
        """Attention proper, (B, nh, T, hs) in and out: the part that grows with T^2."""
        T, hs = q.size(-2), q.size(-1)
        if self.manual:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            return att @ v  # (B, nh, T, hs)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.act = nn.GELU() if config.activation == "gelu" else nn.ReLU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config, checkpointing="none"):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.checkpointing = checkpointing  # this block's mode: none | full | selective | sac
        self.attn.checkpoint_core = checkpointing == "selective"
        self.ac_preserve_rng = config.dropout > 0
        self.ac_context_fn = no_contexts
        if checkpointing == "sac":
            self.sac_save = {getattr(torch.ops.aten, n) for n in sac_ops(asdict(config))}
            self.sac_observer = None  # the audit's callback (op, output) for every output SAC keeps
            self.ac_context_fn = partial(create_selective_checkpoint_contexts, self.sac_policy)

    def sac_policy(self, ctx, op, *args, **kwargs):
        """Keep the outputs of the listed ops; recompute everything else in backward."""
        if op.overloadpacket in self.sac_save:
            output = getattr(ctx, "op_output", None)  # torch 2.11 asks before the op runs: None
            if self.sac_observer is not None and not ctx.is_recompute:
                self.sac_observer(op, output)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def forward(self, x):
        if self.checkpointing in ("full", "sac"):
            return run_checkpointed(self, self.inner, x)
        return self.inner(x)

    def inner(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    audit_prefix = "transformer."  # memory_audit's ledger keys drop it: activations/h.0/...

    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, config.activation_checkpointing if i % config.ac_every == 0 else "none")
                             for i in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying: one tensor, two uses
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"sequence of length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # (t,)
        tok_emb = self.transformer.wte(idx)  # (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)  # (b, t, vocab_size)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: only the last position
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, optimizer_impl="fused"):
        """AdamW with weight decay on matrices only.

        optimizer_impl: "fused" (one CUDA kernel; its `step` tensors live on the device),
        "foreach" (multi-tensor kernels; `step` on the CPU) or "for" (a loop per tensor).
        """
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        kwargs = {}
        if optimizer_impl == "fused":
            if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
                raise ValueError("this PyTorch has no fused AdamW")
            kwargs["fused"] = True
        elif optimizer_impl == "foreach":
            kwargs["foreach"] = True
        elif optimizer_impl == "for":
            kwargs["foreach"] = False
        else:
            raise ValueError(f"optimizer_impl must be fused, foreach or for, got {optimizer_impl!r}")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **kwargs)


def config_dict(config):
    return asdict(config)
