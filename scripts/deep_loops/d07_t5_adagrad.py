"""T5ForConditionalGeneration from a tiny config (8 encoder + 8 decoder blocks), bf16 autocast,
Adagrad, zero_grad(set_to_none=False)."""
import torch
from transformers import T5Config, T5ForConditionalGeneration

torch.manual_seed(0)
cfg = T5Config(vocab_size=256, d_model=48, d_kv=12, d_ff=96, num_layers=8, num_decoder_layers=8,
               num_heads=4, relative_attention_num_buckets=16, dropout_rate=0.1,
               decoder_start_token_id=0, pad_token_id=0)
model = T5ForConditionalGeneration(cfg).cuda()
model.train()
opt = torch.optim.Adagrad(model.parameters(), lr=1e-2)

for step in range(4):
    src = torch.randint(1, cfg.vocab_size, (4, 24), device="cuda")
    tgt = torch.randint(1, cfg.vocab_size, (4, 12), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=src, labels=tgt).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    print("loss", loss.item())
