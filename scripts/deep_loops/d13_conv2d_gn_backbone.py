"""Conv2d + GroupNorm residual blocks held as nn.Sequential(*blocks) inside a Backbone
submodule (9 blocks; every 3rd block is a wider bottleneck, 2x inner channels); fp16 autocast
with torch.amp.GradScaler, Adam, zero_grad(set_to_none=False)."""
import torch
from torch import nn
import torch.nn.functional as F


class ResBlock(nn.Module):
    def __init__(self, ch, inner):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, inner, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(8, inner)
        self.conv2 = nn.Conv2d(inner, ch, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(8, ch)

    def forward(self, x):
        h = F.silu(self.gn1(self.conv1(x)))
        h = self.gn2(self.conv2(h))
        return F.silu(x + h)


class Backbone(nn.Module):
    def __init__(self, ch=32, depth=9):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, ch, 3, padding=1, bias=False),
                                  nn.GroupNorm(8, ch), nn.SiLU())
        blocks = []
        for i in range(depth):
            inner = 2 * ch if (i + 1) % 3 == 0 else ch
            blocks.append(ResBlock(ch, inner))
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x):
        return self.blocks(self.stem(x))


class Net(nn.Module):
    def __init__(self, n_classes=7):
        super().__init__()
        self.backbone = Backbone()
        self.fc = nn.Linear(32, n_classes)

    def forward(self, x):
        f = self.backbone(x)
        return self.fc(f.mean(dim=(2, 3)))


torch.manual_seed(0)
net = Net().cuda()
optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")

for it in range(4):
    images = torch.randn(4, 3, 24, 24, device="cuda")
    targets = torch.randint(0, 7, (4,), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out = net(images)
        loss = F.cross_entropy(out, targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=False)
