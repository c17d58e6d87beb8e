"""A Llama-shaped training script as a user writes it (transformers, bf16 autocast, AdamW), the
workload of benchmarks/bench_scale.py: `--size=1.5b` on one GPU, `--size=8b --fsdp` under FSDP2
(fully_shard per decoder layer and at the root, the model built on the meta device and
materialised on the GPU) for torchrun."""

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SIZES = {  # Qwen2-1.5B's and Llama-3-8B's shapes
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=SIZES, default="1.5b")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    cfg = LlamaConfig(max_position_embeddings=8192, **SIZES[args.size])
    if args.fsdp:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cuda")
    else:
        model = LlamaForCausalLM(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq), device="cuda")
    for _ in range(args.steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
