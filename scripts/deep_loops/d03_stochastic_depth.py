"""Hand-written pre-norm transformer encoder (12 layers) with stochastic depth whose drop rate
grows linearly with depth (DropPath, timm style); bf16 autocast, AdamW, gradient clipping."""
import torch
from torch import nn
import torch.nn.functional as F


def drop_path(x, p, training):
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        att = att.softmax(dim=-1)
        out = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(out)


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, drop_path_rate):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop_path_rate = drop_path_rate

    def forward(self, x):
        x = x + drop_path(self.attn(self.norm1(x)), self.drop_path_rate, self.training)
        x = x + drop_path(self.mlp(self.norm2(x)), self.drop_path_rate, self.training)
        return x


class ViTish(nn.Module):
    def __init__(self, patch_dim=48, dim=64, depth=12, heads=4, n_patches=16, n_classes=10,
                 max_drop=0.3):
        super().__init__()
        self.patch = nn.Linear(patch_dim, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, dim) * 0.02)
        rates = [x.item() for x in torch.linspace(0, max_drop, depth)]
        self.layers = nn.ModuleList([EncoderLayer(dim, heads, r) for r in rates])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, patches):
        x = self.patch(patches)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


torch.manual_seed(0)
model = ViTish().to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.05)

for step in range(4):
    patches = torch.randn(4, 16, 48, device="cuda")
    labels = torch.randint(0, 10, (4,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(patches)
        loss = F.cross_entropy(logits, labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.4f}")
