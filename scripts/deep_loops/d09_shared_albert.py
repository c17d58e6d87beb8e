"""ALBERT-style weight sharing: one transformer block object repeated 12 times in an
nn.ModuleList, each depth with its own learnable residual scale whose shape differs
(a 0-d scalar, a (1,) scalar or a per-channel vector); fp32, RMSprop."""
import torch
from torch import nn
import torch.nn.functional as F


class SharedBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln1 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ln2 = nn.LayerNorm(dim)

    def forward(self, x, scale):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + scale * a
        return x + scale * self.ff(self.ln2(x))


class TinyAlbert(nn.Module):
    def __init__(self, vocab=300, emb=16, dim=48, heads=4, depth=12, n_classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.emb_proj = nn.Linear(emb, dim)
        block = SharedBlock(dim, heads)
        self.layers = nn.ModuleList([block] * depth)
        scales = []
        for i in range(depth):
            if i % 3 == 0:
                scales.append(nn.Parameter(torch.tensor(1.0)))
            elif i % 3 == 1:
                scales.append(nn.Parameter(torch.ones(1)))
            else:
                scales.append(nn.Parameter(torch.ones(dim)))
        self.scales = nn.ParameterList(scales)
        self.pool = nn.Linear(dim, dim)
        self.cls = nn.Linear(dim, n_classes)

    def forward(self, ids):
        x = self.emb_proj(self.embed(ids))
        for layer, s in zip(self.layers, self.scales):
            x = layer(x, s)
        return self.cls(torch.tanh(self.pool(x[:, 0])))


torch.manual_seed(0)
model = TinyAlbert().cuda()
opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.99, momentum=0.5)

for step in range(4):
    ids = torch.randint(0, 300, (8, 20), device="cuda")
    y = torch.randint(0, 3, (8,), device="cuda")
    loss = F.cross_entropy(model(ids), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
