"""LlamaForCausalLM from a tiny config (10 decoder layers), gradient checkpointing on,
bf16 autocast, AdamW."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=10,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
model = LlamaForCausalLM(config).cuda()
model.gradient_checkpointing_enable()
model.config.use_cache = False
model.train()

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

for step in range(4):
    input_ids = torch.randint(0, config.vocab_size, (4, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(step, out.loss.item())
