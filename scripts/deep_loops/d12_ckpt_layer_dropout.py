"""MLP-Mixer of 16 blocks, each run under torch.utils.checkpoint (use_reentrant=False), with a
dropout rate that grows with the block index; bf16 autocast, AdamW, gradient clipping."""
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class MixerBlock(nn.Module):
    def __init__(self, tokens, dim, p):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mix = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(),
                                       nn.Dropout(p), nn.Linear(2 * tokens, tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.chan_mix = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                      nn.Dropout(p), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        x = x + self.drop(self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2))
        return x + self.drop(self.chan_mix(self.norm2(x)))


class Mixer(nn.Module):
    def __init__(self, tokens=16, patch_dim=27, dim=64, depth=16, n_classes=10):
        super().__init__()
        self.stem = nn.Linear(patch_dim, dim)
        self.blocks = nn.ModuleList(
            [MixerBlock(tokens, dim, p=0.3 * i / (depth - 1)) for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)
        self.use_checkpoint = True

    def forward(self, x):
        x = self.stem(x)
        for blk in self.blocks:
            if self.use_checkpoint and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.head(self.norm(x).mean(dim=1))


torch.manual_seed(0)
model = Mixer().to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)

for step in range(4):
    x = torch.randn(8, 16, 27, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"{step}: {loss.item():.3f}")
