"""A small Llama-style decoder for the any-model tests (issue #28): RMSNorm, a SwiGLU MLP, rotary
position embeddings and grouped-query attention through SDPA, untied head. Written here, not
imported: the shadow run knows nothing of it."""

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


def rotary(T, head_dim, base=10000.0):
    """(cos, sin) of shape (T, head_dim): the rotation angle of each position and frequency."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(T).float(), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.mlp = Attention(dim, heads, kv_heads), SwiGLU(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab=97, dim=64, layers=2, heads=4, kv_heads=2, hidden=160, T=32, checkpointing=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary(T, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.checkpointing = checkpointing

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            if self.checkpointing:
                x = checkpoint(block, x, self.cos, self.sin, use_reentrant=False)
            else:
                x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


def llama_loop(checkpointing=False):
    """(model, AdamW, tokens, targets): batch 2 of 32 tokens."""
    torch.manual_seed(0)
    model = Llama(checkpointing=checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.randint(97, (2, 32)), torch.randint(97, (2, 32))


def llama_step(dtype):
    """One training step at `dtype` (float32, or bfloat16 under CPU autocast) of any model that
    returns logits: returns what the loop keeps until the next step, by the names an audit
    gives it."""
    def step(model, opt, x, y, audit=None):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        if audit is not None:
            audit.before_backward(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return {"temporary/loop/output": logits, "temporary/loop/loss": loss}
    return step
