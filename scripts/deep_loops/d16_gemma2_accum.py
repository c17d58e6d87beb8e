"""Gemma2ForCausalLM from a tiny config (8 layers alternating sliding-window and global
attention, logit soft-capping, tied embeddings), fp32, Adam with a cosine schedule, gradient
accumulation over 2 micro-batches and gradient clipping."""
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

torch.manual_seed(0)
config = Gemma2Config(
    vocab_size=384,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    sliding_window=8,
)
model = Gemma2ForCausalLM(config)
model = model.to("cuda")
model.train()
model.config.use_cache = False

optimizer = torch.optim.Adam(model.parameters(), lr=5e-4)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
ACCUM_STEPS = 2

step = 0
optimizer.zero_grad(set_to_none=True)
while step < 4:
    for micro in range(ACCUM_STEPS):
        input_ids = torch.randint(0, 384, (2, 24), device="cuda")
        outputs = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        (outputs.loss / ACCUM_STEPS).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    step += 1
    print("step", step, "loss", outputs.loss.item())
