"""BertForMaskedLM from a tiny config (10 encoder layers), fp32, AdamW with a linear warmup
scheduler, 15% masking with -100 labels, gradient clipping."""
import torch
from transformers import BertConfig, BertForMaskedLM

torch.manual_seed(0)
config = BertConfig(vocab_size=400, hidden_size=64, num_hidden_layers=10, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=64, type_vocab_size=2)
model = BertForMaskedLM(config).to("cuda")
model.train()

no_decay = ["bias", "LayerNorm.weight"]
groups = [
    {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
     "weight_decay": 0.01},
    {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
     "weight_decay": 0.0},
]
optimizer = torch.optim.AdamW(groups, lr=5e-4)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2))

MASK_ID = 3
for step in range(4):
    input_ids = torch.randint(5, config.vocab_size, (8, 40), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, 32:] = 0
    masked = torch.rand(input_ids.shape, device="cuda") < 0.15
    labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
    input_ids = torch.where(masked, torch.full_like(input_ids, MASK_ID), input_ids)
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
