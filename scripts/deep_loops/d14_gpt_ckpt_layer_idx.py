"""Hand-written GPT (14 blocks in an nn.ModuleList) whose blocks carry their own layer_idx,
used for depth-scaled init and attention scaled by 1/(layer_idx+1); each block run under
torch.utils.checkpoint (use_reentrant=False); bf16 autocast, SGD with momentum, gradient
accumulation over 2 micro-batches, gradient clipping."""
import math
import torch
from torch import nn
import torch.nn.functional as F
import torch.utils.checkpoint


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head, layer_idx):
        super().__init__()
        self.n_head = n_head
        self.layer_idx = layer_idx
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        scale = 1.0 / (math.sqrt(C // self.n_head) * (self.layer_idx + 1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d, n_head, layer_idx, n_layer):
        super().__init__()
        self.layer_idx = layer_idx
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, layer_idx)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d, d))
        std = 0.02 / math.sqrt(2 * (layer_idx + 1))
        nn.init.normal_(self.attn.c_proj.weight, std=std)
        nn.init.normal_(self.mlp[2].weight, std=std)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, block_size=64, d=64, n_head=4, n_layer=14):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.h = nn.ModuleList([Block(d, n_head, i, n_layer) for i in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


torch.manual_seed(0)
model = GPT()
model.to("cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
grad_accum = 2

for step in range(4):
    for micro in range(grad_accum):
        data = torch.randint(0, 256, (4, 57), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(data[:, :-1], data[:, 1:])
        (loss / grad_accum).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
