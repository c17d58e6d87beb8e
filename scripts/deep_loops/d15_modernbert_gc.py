"""ModernBertForMaskedLM from a tiny config (12 layers; every 3rd layer global attention, the
others a sliding local window), gradient checkpointing on, bf16 autocast, AdamW."""
import torch
from transformers import ModernBertConfig, ModernBertForMaskedLM

torch.manual_seed(0)
config = ModernBertConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=12,
    num_attention_heads=4,
    max_position_embeddings=128,
    global_attn_every_n_layers=3,
    local_attention=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    cls_token_id=1,
    sep_token_id=2,
    mask_token_id=4,
)
model = ModernBertForMaskedLM(config, ).to("cuda")
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()
optim = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.01)

for step in range(4):
    ids = torch.randint(5, 320, (4, 48), device="cuda")
    mask = torch.rand(ids.shape, device="cuda") < 0.3
    labels = torch.where(mask, ids, -100)
    inputs = torch.where(mask, 4, ids)
    attn = torch.ones_like(ids)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=inputs, attention_mask=attn, labels=labels).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
