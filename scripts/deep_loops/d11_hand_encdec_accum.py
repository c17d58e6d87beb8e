"""Hand-written post-norm encoder-decoder (two stacks: 8 encoder layers, 8 decoder layers with
causal self-attention and cross-attention) for a toy copy task; fp32, Adam, gradient
accumulation over 3 micro-batches."""
import torch
from torch import nn
import torch.nn.functional as F


class EncLayer(nn.Module):
    def __init__(self, d, h, ff):
        super().__init__()
        self.sa = nn.MultiheadAttention(d, h, dropout=0.1, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Dropout(0.1), nn.Linear(ff, d))
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, mask):
        x = self.n1(x + self.drop(self.sa(x, x, x, key_padding_mask=mask, need_weights=False)[0]))
        return self.n2(x + self.drop(self.ff(x)))


class DecLayer(nn.Module):
    def __init__(self, d, h, ff):
        super().__init__()
        self.sa = nn.MultiheadAttention(d, h, dropout=0.1, batch_first=True)
        self.ca = nn.MultiheadAttention(d, h, dropout=0.1, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Dropout(0.1), nn.Linear(ff, d))
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(0.1)

    def forward(self, y, mem, causal, mem_mask):
        y = self.n1(y + self.drop(self.sa(y, y, y, attn_mask=causal, need_weights=False)[0]))
        y = self.n2(y + self.drop(self.ca(y, mem, mem, key_padding_mask=mem_mask,
                                          need_weights=False)[0]))
        return self.n3(y + self.drop(self.ff(y)))


class Seq2Seq(nn.Module):
    def __init__(self, vocab=128, d=48, h=4, ff=96, n_enc=8, n_dec=8, max_len=64):
        super().__init__()
        self.src_emb = nn.Embedding(vocab, d)
        self.tgt_emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        self.encoder = nn.ModuleList([EncLayer(d, h, ff) for _ in range(n_enc)])
        self.decoder = nn.ModuleList([DecLayer(d, h, ff) for _ in range(n_dec)])
        self.out = nn.Linear(d, vocab)

    def forward(self, src, tgt_in, src_pad):
        x = self.src_emb(src) + self.pos[: src.shape[1]]
        for layer in self.encoder:
            x = layer(x, src_pad)
        T = tgt_in.shape[1]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=src.device), diagonal=1)
        y = self.tgt_emb(tgt_in) + self.pos[:T]
        for layer in self.decoder:
            y = layer(y, x, causal, src_pad)
        return self.out(y)


torch.manual_seed(0)
model = Seq2Seq().cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
ACCUM = 3

optimizer.zero_grad()
for step in range(4):
    for micro in range(ACCUM):
        src = torch.randint(2, 128, (4, 20), device="cuda")
        src_pad = torch.zeros(4, 20, dtype=torch.bool, device="cuda")
        src_pad[:, 16:] = True
        tgt = torch.cat([torch.ones(4, 1, dtype=torch.long, device="cuda"), src[:, :16]], dim=1)
        logits = model(src, tgt[:, :-1], src_pad)
        loss = F.cross_entropy(logits.reshape(-1, 128), tgt[:, 1:].reshape(-1))
        (loss / ACCUM).backward()
    optimizer.step()
    optimizer.zero_grad()
