"""Residual MLP stack (12 identical pre-norm blocks in an nn.ModuleList), fp32, AdamW."""
import torch
from torch import nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResMLP(nn.Module):
    def __init__(self, in_dim=32, dim=64, depth=12, n_classes=10):
        super().__init__()
        self.inp = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList([Block(dim, 4 * dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


torch.manual_seed(0)
model = ResMLP().to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

for step in range(4):
    x = torch.randn(8, 32, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(step, loss.item())
