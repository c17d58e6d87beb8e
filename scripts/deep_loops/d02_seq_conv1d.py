"""Conv1d + BatchNorm1d + ReLU blocks flattened into one nn.Sequential(*layers) (10 blocks),
fp32, SGD with momentum, zero_grad(set_to_none=False)."""
import torch
from torch import nn

torch.manual_seed(0)

layers = [nn.Conv1d(4, 48, kernel_size=3, padding=1), nn.BatchNorm1d(48), nn.ReLU()]
for i in range(10):
    layers += [nn.Conv1d(48, 48, kernel_size=3, padding=1, bias=False),
               nn.BatchNorm1d(48),
               nn.ReLU(inplace=True)]
layers += [nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(48, 5)]
model = nn.Sequential(*layers).cuda()

opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
criterion = nn.CrossEntropyLoss()

model.train()
for step in range(4):
    x = torch.randn(6, 4, 64, device="cuda")
    y = torch.randint(0, 5, (6,), device="cuda")
    out = model(x)
    loss = criterion(out, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
