"""A torchrun training script as users write it, nothing of memory_audit in it: a small decoder
of pre-norm MLP blocks sharded with FSDP2 (fully_shard per block and at the root), AdamW, bf16
autocast, on NCCL. `torchrun --nproc_per_node=8 examples/train_fsdp.py` trains it on 8 GPUs;
`python -m memory_audit predict-script --gpu=H100 --world_size=8 --rank=0
examples/train_fsdp.py -- --width=256` predicts one rank's step before it runs, on a machine
without a GPU (docs/any_model.md)."""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self, vocab, width, layers):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = Decoder(args.vocab, args.width, args.layers).cuda()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
