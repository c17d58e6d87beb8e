"""A training script as users write them, nothing of memory_audit in it: a small pre-norm
transformer classifier (torch's own nn.TransformerEncoder) with AdamW, the loss rebound and
logged each step, on the GPU where there is one. `python -m memory_audit predict-script
examples/train_classifier.py -- --batch=8` predicts its step 2 before it runs, and with
`--gpu=H100` on one H100 on a machine without a GPU (README)."""

import argparse

import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self, vocab, width, layers, heads, classes):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Classifier(1000, args.width, args.layers, 4, 10).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(args.steps):
        tokens = torch.randint(0, 1000, (args.batch, args.seq)).to(device)
        labels = torch.randint(0, 10, (args.batch,)).to(device)
        loss = nn.functional.cross_entropy(model(tokens), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
