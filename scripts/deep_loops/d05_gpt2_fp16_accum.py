"""GPT2LMHeadModel from a tiny config (12 blocks), fp16 autocast with GradScaler, Adam,
gradient accumulation over 2 micro-batches, unscale + clip before the step."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
cfg = GPT2Config(vocab_size=300, n_positions=64, n_embd=48, n_layer=12, n_head=4,
                 resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
model = GPT2LMHeadModel(cfg)
model.to("cuda")
model.train()

opt = torch.optim.Adam(model.parameters(), lr=2e-4)
scaler = torch.amp.GradScaler("cuda")
accum = 2

for step in range(4):
    for micro in range(accum):
        ids = torch.randint(0, cfg.vocab_size, (4, 48), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(ids, labels=ids).loss / accum
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
