"""Decoder-only LM in a ModuleList subclass whose layers know their index (layer_idx): every
3rd layer attends globally, the others through a local causal window; RMSNorm, rotary
embeddings written by hand, SwiGLU MLP, fp32, AdamW, tied embeddings."""
import torch
from torch import nn
import torch.nn.functional as F


def rope_cache(seq_len, head_dim, base=10000.0, device=None):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    t = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, dim, heads, layer_idx, window):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.layer_idx = layer_idx
        self.is_global = layer_idx % 3 == 0
        self.window = window
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.is_global:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            i = torch.arange(T, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class Layer(nn.Module):
    def __init__(self, dim, heads, layer_idx, window=8):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, layer_idx, window)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LayerStack(nn.ModuleList):
    def __init__(self, n_layers, dim, heads):
        super().__init__([Layer(dim, heads, layer_idx=i) for i in range(n_layers)])

    def forward(self, x, cos, sin):
        for layer in self:
            x = layer(x, cos, sin)
        return x


class LM(nn.Module):
    def __init__(self, vocab=512, dim=64, heads=4, n_layers=12, max_len=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = LayerStack(n_layers, dim, heads)
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        cos, sin = rope_cache(max_len, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.embed(idx)
        x = self.layers(x, self.cos[:T], self.sin[:T])
        return self.lm_head(self.norm(x))


torch.manual_seed(0)
model = LM().to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

for step in range(4):
    tokens = torch.randint(0, 512, (4, 33), device="cuda")
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
