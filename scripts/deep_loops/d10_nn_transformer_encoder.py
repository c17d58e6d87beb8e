"""nn.TransformerEncoder of 16 nn.TransformerEncoderLayer (batch_first, norm_first) with a key
padding mask, fp16 autocast with torch.amp.GradScaler, SGD with Nesterov momentum,
zero_grad(set_to_none=False)."""
import math
import torch
from torch import nn


class SeqClassifier(nn.Module):
    def __init__(self, vocab=1000, d_model=64, nhead=4, layers=16, n_classes=4, max_len=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model, padding_idx=0)
        self.pos = nn.Embedding(max_len, d_model)
        enc_layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=128, dropout=0.1,
                                               batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, num_layers=layers,
                                             norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, ids, pad_mask):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) * math.sqrt(self.tok.embedding_dim) + self.pos(pos)
        x = self.encoder(x, src_key_padding_mask=pad_mask)
        keep = (~pad_mask).unsqueeze(-1).float()
        x = (x * keep).sum(1) / keep.sum(1).clamp(min=1)
        return self.head(x)


torch.manual_seed(0)
device = "cuda"
model = SeqClassifier().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
scaler = torch.amp.GradScaler("cuda")
loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)

for step in range(4):
    ids = torch.randint(1, 1000, (6, 48), device=device)
    pad_mask = torch.zeros(6, 48, dtype=torch.bool, device=device)
    pad_mask[:, 40:] = True
    y = torch.randint(0, 4, (6,), device=device)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(ids, pad_mask), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=False)
