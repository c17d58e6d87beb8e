"""Audit one step of your own training loop: a small conv net with BatchNorm and Adam.

    python examples/any_loop.py [OUT_DIR]     # CUDA if there is one, else CPU
    python -m memory_audit attribute OUT_DIR  # every byte of each phase, by name
    python -m memory_audit report OUT_DIR     # the same as report.md (no prediction: not a GPT)
"""

import sys

import torch
from torch import nn

from memory_audit import Audit

device = "cuda" if torch.cuda.is_available() else "cpu"
out_dir = sys.argv[1] if len(sys.argv) > 1 else "snapshots/any-loop"
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                      nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 3, 32, 32, device=device), torch.randint(10, (32,), device=device)

audit = Audit(model, optimizer, out_dir=out_dir)  # records step index 1, the first with Adam state
for step in range(3):
    with audit.step(step, tensors={"inputs/x": x, "inputs/y": y}):
        loss = nn.functional.cross_entropy(model(x), y)
        audit.before_backward(loss)  # the snapshot with the activations live
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")
print(f"audit: wrote {', '.join(audit.files)} and meta.json to {audit.run_dir}")
