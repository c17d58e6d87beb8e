"""A training script with top-1 routed experts, nothing of memory_audit in it: each token goes to
its expert through `nonzero`, a shape that depends on the data. `python -m memory_audit
predict-script --assume=nonzero=0.25 examples/train_moe.py -- --experts=4` predicts its step 2
with each expert given a quarter of the tokens (docs/any_model.md)."""

import argparse

import torch
from torch import nn


class Routed(nn.Module):
    def __init__(self, vocab, width, experts):
        super().__init__()
        self.embed, self.router = nn.Embedding(vocab, width), nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                     for _ in range(experts))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.embed(tokens).flatten(0, 1)
        weight, choice = self.router(h).softmax(-1).max(-1)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(1)
            y = y.index_add(0, idx, expert(h[idx]) * weight[idx, None])
        return self.head(y.view(*tokens.shape, -1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--experts", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Routed(500, args.width, args.experts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(args.steps):
        tokens = torch.randint(0, 500, (args.batch, args.seq))
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
