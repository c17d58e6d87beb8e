"""The shadow run of a script as written against an Audit of it, on 14 more training loops written as
users write them, in plain torch, none drawn from scripts/zoo.py or scripts/user_loops.py to
scripts/user_loops_e.py (an LSTM seq2seq with Bahdanau attention stepped by two optimizers, a
Llama-style block with complex rotary embeddings, LoRA adapters on a frozen stack, a PixelCNN masked
conv, spectral_norm/weight_norm parametrizations with clip_grad_value_, a padded token tagger with
ignore_index, a segment-recurrent memory transformer, a bilinear/einsum factorisation machine, an
InstanceNorm style net, Fourier-feature coordinates, a Gumbel-softmax VAE, a neural ODE unrolled by
RK4, a deep & cross net, an orthogonal siamese encoder).

Each loop is one function `train_X(steps, make_audit)`, run by `user_loops.check` exactly as the loops of
scripts/user_loops.py are: the audited run (3 steps, step 2 recorded) and the shadow run (10 steps, the
tool stops it after step 2).

    python scripts/user_loops_f.py [--seed=S] [--only=name,name]
"""

import math
import random

import torch
from torch import nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations

import user_loops as harness


# ---------------------------------------------------------------- 1. LSTM seq2seq, Bahdanau attention, two optimizers
class Encoder(nn.Module):
    def __init__(self, vocab=20, e=16, h=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, e, padding_idx=0)
        self.rnn = nn.LSTM(e, h, batch_first=True, bidirectional=True)
        self.bridge_h = nn.Linear(2 * h, h)
        self.bridge_c = nn.Linear(2 * h, h)

    def forward(self, src):
        out, (h, c) = self.rnn(self.emb(src))
        h0 = torch.tanh(self.bridge_h(torch.cat([h[0], h[1]], dim=-1)))
        c0 = self.bridge_c(torch.cat([c[0], c[1]], dim=-1))
        return out, (h0, c0)


class AttnDecoder(nn.Module):
    def __init__(self, vocab=20, e=16, h=32, enc=64, a=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, e, padding_idx=0)
        self.W_h = nn.Linear(h, a, bias=False)
        self.W_e = nn.Linear(enc, a)
        self.v = nn.Linear(a, 1, bias=False)
        self.cell = nn.LSTMCell(e + enc, h)
        self.out = nn.Linear(h + enc, vocab)

    def forward(self, tok, state, enc_out, enc_keys, src_pad):
        h, c = state
        scores = self.v(torch.tanh(self.W_h(h).unsqueeze(1) + enc_keys)).squeeze(-1)
        scores = scores.masked_fill(src_pad, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        ctx = torch.bmm(attn.unsqueeze(1), enc_out).squeeze(1)
        h, c = self.cell(torch.cat([self.emb(tok), ctx], dim=-1), (h, c))
        return self.out(torch.cat([h, ctx], dim=-1)), (h, c)


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = AttnDecoder()


def train_seq2seq_bahdanau_two_opt(steps, make_audit):
    """Bidirectional LSTM encoder, LSTMCell decoder with additive (Bahdanau) attention over a padded
    source, teacher forcing decided per step by a seeded coin (else greedy argmax fed back), encoder
    stepped by Adam and decoder by SGD momentum in the same step, clip_grad_norm_ over both."""
    torch.manual_seed(harness.SEED + 501)
    model = Seq2Seq()
    enc_opt = torch.optim.Adam(model.encoder.parameters(), lr=1e-3)
    dec_opt = torch.optim.SGD(model.decoder.parameters(), lr=0.1, momentum=0.9)
    BOS, PAD, S, T = 1, 0, 9, 7
    with make_audit(model, enc_opt) as audit:
        for step in range(steps):
            with audit.step(step):
                enc_opt.zero_grad()
                dec_opt.zero_grad()
                g = harness.gen(step, 91)
                rng = random.Random(harness.SEED * 31 + step)
                lengths = [rng.randint(4, S) for _ in range(6)]
                src, src_mask = harness.padded_ids(g, lengths, S, 20, PAD)
                tgt = torch.flip(src[:, :T], dims=[1]).clone()
                tgt = tgt.masked_fill(tgt == PAD, 2)
                enc_out, state = model.encoder(src)
                enc_keys = model.decoder.W_e(enc_out)
                src_pad = src_mask == 0
                teacher = rng.random() < 0.5
                tok = torch.full((src.size(0),), BOS, dtype=torch.long)
                loss = 0.0
                for t in range(T):
                    logits, state = model.decoder(tok, state, enc_out, enc_keys, src_pad)
                    loss = loss + F.cross_entropy(logits, tgt[:, t], ignore_index=PAD)
                    tok = tgt[:, t] if teacher else logits.argmax(-1).detach()
                loss = loss / T
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                enc_opt.step()
                dec_opt.step()
            print(f"  step {step} loss {loss.item():.4f} teacher {teacher}")


# ---------------------------------------------------------------- 2. Llama-style block, complex RoPE, SwiGLU
def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    t = torch.arange(end).float()
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def apply_rotary(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(-2).type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, d, n_heads, n_kv):
        super().__init__()
        self.nh, self.nkv, self.hd = n_heads, n_kv, d // n_heads
        self.wq = nn.Linear(d, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(d, n_kv * self.hd, bias=False)
        self.wv = nn.Linear(d, n_kv * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, d, bias=False)

    def forward(self, x, freqs_cis):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, d, n_heads, n_kv, hidden):
        super().__init__()
        self.attention_norm = nn.RMSNorm(d, eps=1e-5)
        self.attention = LlamaAttention(d, n_heads, n_kv)
        self.ffn_norm = nn.RMSNorm(d, eps=1e-5)
        self.feed_forward = SwiGLU(d, hidden)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab=64, d=32, layers=2, n_heads=4, n_kv=2, max_len=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, n_heads, n_kv, 88) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.output = nn.Linear(d, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(d // n_heads, max_len), persistent=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        fc = self.freqs_cis[: ids.size(1)]
        for layer in self.layers:
            h = layer(h, fc)
        return self.output(self.norm(h))


def train_llama_rope_complex_swiglu(steps, make_audit):
    """Hand-written Llama block: nn.RMSNorm, rotary embeddings via torch.polar / view_as_complex, grouped
    KV heads with repeat_interleave, SDPA is_causal, SwiGLU; AdamW with decay only on >=2-D params,
    LambdaLR linear warmup + cosine, clip_grad_norm_."""
    torch.manual_seed(harness.SEED + 502)
    model = TinyLlama()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embeddings" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))
    warmup, total = 3, 10

    def lr_lambda(s):
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                optimizer.zero_grad(set_to_none=True)
                g = harness.gen(step, 92)
                seq = torch.randint(0, 64, (4, 17), generator=g)
                logits = model(seq[:, :-1])
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), seq[:, 1:].reshape(-1))
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}")


# ---------------------------------------------------------------- 3. LoRA adapters on a frozen stack, bf16
class LoRALinear(nn.Module):
    def __init__(self, base, r=4, alpha=8, dropout=0.05):
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad = False
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling = alpha / r
        self.lora_dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + (self.lora_dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scaling


def train_lora_frozen_stack_bf16(steps, make_audit):
    """A 'pretrained' Linear/GELU stack frozen with requires_grad=False, every Linear wrapped in a LoRA
    adapter (A random, B zeros, dropout on the adapter input), SGD momentum over the trainable params
    only, forward under bf16 autocast."""
    torch.manual_seed(harness.SEED + 503)
    model = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 96), nn.GELU(), nn.Linear(96, 10))
    for i in (0, 2, 4):
        model[i] = LoRALinear(model[i])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 93)
                x = torch.randn(16, 48, generator=g)
                y = torch.randint(0, 10, (16,), generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 4. PixelCNN masked convolutions
class MaskedConv2d(nn.Conv2d):
    def __init__(self, mask_type, *args, **kwargs):
        super().__init__(*args, **kwargs)
        kh, kw = self.kernel_size
        mask = torch.ones_like(self.weight)
        mask[:, :, kh // 2, kw // 2 + (mask_type == "B"):] = 0
        mask[:, :, kh // 2 + 1:] = 0
        self.register_buffer("mask", mask)

    def forward(self, x):
        return F.conv2d(x, self.weight * self.mask, self.bias, self.stride, self.padding)


class PixelCNN(nn.Module):
    def __init__(self, levels=4, ch=16, n=3):
        super().__init__()
        self.inp = MaskedConv2d("A", 1, ch, 7, padding=3)
        self.blocks = nn.ModuleList(MaskedConv2d("B", ch, ch, 3, padding=1) for _ in range(n))
        self.out = nn.Conv2d(ch, levels, 1)

    def forward(self, x):
        h = self.inp(x)
        for conv in self.blocks:
            h = h + conv(F.relu(h))
        return self.out(F.relu(h))


def train_pixelcnn_masked_conv(steps, make_audit):
    """PixelCNN on 4-level 12x12 images: type A/B masks as buffers multiplied into the weight inside
    forward, residual masked convs, per-pixel cross-entropy on (N, C, H, W) logits, RMSprop centered."""
    torch.manual_seed(harness.SEED + 504)
    model = PixelCNN()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, momentum=0.5, centered=True)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                optimizer.zero_grad()
                g = harness.gen(step, 94)
                base = torch.rand(8, 1, 3, 3, generator=g)
                img = F.interpolate(base, size=(12, 12), mode="bilinear", align_corners=False)
                levels = (img * 3.999).long().clamp(0, 3)
                x = levels.float() / 3
                logits = model(x)
                loss = F.cross_entropy(logits, levels.squeeze(1))
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} nll {loss.item():.4f} bits/dim {loss.item() / math.log(2):.3f}")


# ---------------------------------------------------------------- 5. spectral_norm + weight_norm, clip by value
def train_spectral_weight_norm_clipvalue(steps, make_audit):
    """MLP classifier with parametrizations.spectral_norm (power iteration each training forward) and
    parametrizations.weight_norm, PReLU activations, multi_margin_loss, clip_grad_value_, Adamax,
    zero_grad at the end of the step."""
    torch.manual_seed(harness.SEED + 505)
    model = nn.Sequential(
        parametrizations.spectral_norm(nn.Linear(20, 64)), nn.PReLU(64),
        parametrizations.weight_norm(nn.Linear(64, 64)), nn.PReLU(),
        nn.Linear(64, 5))
    optimizer = torch.optim.Adamax(model.parameters(), lr=2e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 95)
                x = torch.randn(32, 20, generator=g)
                y = (x[:, :5].argmax(1) + (torch.rand(32, generator=g) < 0.1).long()) % 5
                loss = F.multi_margin_loss(model(x), y, margin=1.0)
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.5)
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 6. padded token tagger, ignore_index + where mask
class Tagger(nn.Module):
    def __init__(self, vocab=50, e=24, h=32, tags=7):
        super().__init__()
        self.emb = nn.Embedding(vocab, e, padding_idx=0)
        self.conv = nn.Conv1d(e, h, 3, padding=1)
        self.rnn = nn.GRU(h, h, batch_first=True, bidirectional=True)
        self.tag_head = nn.Linear(2 * h, tags)
        self.reg_head = nn.Linear(2 * h, 1)

    def forward(self, ids):
        x = F.gelu(self.conv(self.emb(ids).transpose(1, 2))).transpose(1, 2)
        out, _ = self.rnn(x)
        return self.tag_head(out), self.reg_head(out).squeeze(-1)


def train_tagger_ignore_index_where(steps, make_audit):
    """Token tagger (Embedding, Conv1d, BiGRU) on right-padded ids: tags masked_fill'ed to -100 on padding
    and cross_entropy(ignore_index=-100), plus a per-token regression loss zeroed on padding with
    torch.where and divided by the token count; RAdam decoupled weight decay, OneCycleLR,
    zero_grad(set_to_none=False)."""
    torch.manual_seed(harness.SEED + 506)
    model = Tagger()
    optimizer = torch.optim.RAdam(model.parameters(), lr=2e-3, weight_decay=1e-2, decoupled_weight_decay=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-3, total_steps=10)
    T = 14
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                optimizer.zero_grad(set_to_none=False)
                g = harness.gen(step, 96)
                rng = random.Random(harness.SEED * 37 + step)
                lengths = [rng.randint(5, T) for _ in range(6)]
                ids, mask = harness.padded_ids(g, lengths, T, 50, 0)
                tags = (ids % 7).masked_fill(mask == 0, -100)
                target = torch.randn(6, T, generator=g)
                tag_logits, pred = model(ids)
                ce = F.cross_entropy(tag_logits.reshape(-1, 7), tags.reshape(-1), ignore_index=-100)
                per_tok = (pred - target) ** 2
                per_tok = torch.where(mask.bool(), per_tok, torch.zeros_like(per_tok))
                mse = per_tok.sum() / mask.sum()
                loss = ce + 0.5 * mse
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f} (ce {ce.item():.3f} mse {mse.item():.3f})")


# ---------------------------------------------------------------- 7. segment-recurrent memory, detached across steps
class MemBlock(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ff = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 64), nn.ReLU(inplace=True), nn.Linear(64, d))

    def forward(self, x, mem, mask):
        h = self.ln(x)
        kv = h if mem is None else torch.cat([mem, h], dim=1)
        a, _ = self.attn(h, kv, kv, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.ff(x)


class MemoryLM(nn.Module):
    def __init__(self, vocab=48, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MemBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, mems):
        x = self.emb(ids)
        T = ids.size(1)
        M = 0 if mems is None else mems[0].size(1)
        mask = torch.ones(T, M + T, dtype=torch.bool).triu(M + 1)
        new_mems = []
        for i, blk in enumerate(self.blocks):
            new_mems.append(x)
            x = blk(x, None if mems is None else mems[i], mask)
        return self.head(x), new_mems


def train_memory_lm_detached_mems(steps, make_audit):
    """Transformer-XL-style LM over consecutive segments: each block's input kept outside the model as
    memory, detached and truncated to the last 8 positions, concatenated to keys/values next step
    with a bool causal mask offset by the memory length; Adam, zero_grad after the step."""
    torch.manual_seed(harness.SEED + 507)
    model = MemoryLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    mems = None
    mem_len = 8
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 97)
                seg = torch.randint(0, 48, (4, 9), generator=g)
                logits, new_mems = model(seg[:, :-1], mems)
                loss = F.cross_entropy(logits.reshape(-1, 48), seg[:, 1:].reshape(-1))
                if mems is None:
                    mems = [m.detach()[:, -mem_len:] for m in new_mems]
                else:
                    mems = [torch.cat([old, m.detach()], dim=1)[:, -mem_len:] for old, m in zip(mems, new_mems)]
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 8. factorisation machine: einsum + nn.Bilinear
class FMBilinear(nn.Module):
    def __init__(self, fields=6, vocab=20, k=8, d_num=4):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(vocab, k) for _ in range(fields))
        self.lin = nn.ModuleList(nn.Embedding(vocab, 1) for _ in range(fields))
        self.user = nn.Linear(d_num, 16)
        self.item = nn.Embedding(30, 16)
        self.bil = nn.Bilinear(16, 16, 1)
        self.register_buffer("pair_mask", torch.ones(fields, fields).triu(1))

    def forward(self, cats, nums, items):
        E = torch.stack([emb(cats[:, f]) for f, emb in enumerate(self.embs)], dim=1)
        inter = torch.einsum("bfk,bgk->bfg", E, E)
        fm = (inter * self.pair_mask).sum(dim=(1, 2))
        first = sum(lin(cats[:, f]) for f, lin in enumerate(self.lin)).squeeze(1)
        return fm + first + self.bil(torch.tanh(self.user(nums)), self.item(items)).squeeze(1)


def train_fm_einsum_bilinear_ranking(steps, make_audit):
    """Factorisation machine: per-field embeddings stacked, pairwise dot products by torch.einsum masked
    to the upper triangle, plus an nn.Bilinear user x item term; BCE on clicks plus margin_ranking_loss
    against items rolled within the batch; SGD momentum, ExponentialLR, zero_grad(set_to_none=False)
    after the step."""
    torch.manual_seed(harness.SEED + 508)
    model = FMBilinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 98)
                cats = torch.randint(0, 20, (24, 6), generator=g)
                nums = torch.randn(24, 4, generator=g)
                items = torch.randint(0, 30, (24,), generator=g)
                clicked = ((cats[:, 0] + items) % 3 == 0).float()
                s_pos = model(cats, nums, items)
                s_neg = model(cats, nums, torch.roll(items, 1))
                bce = F.binary_cross_entropy_with_logits(s_pos, clicked)
                rank = F.margin_ranking_loss(s_pos, s_neg, torch.ones_like(s_pos), margin=0.5)
                loss = bce + 0.1 * rank
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=False)
            print(f"  step {step} loss {loss.item():.4f} (bce {bce.item():.3f} rank {rank.item():.3f})")


# ---------------------------------------------------------------- 9. InstanceNorm style net, gram loss, bf16
class ResIN(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c, affine=True),
                                  nn.ReLU(inplace=True), nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3),
                                  nn.InstanceNorm2d(c, affine=True))

    def forward(self, x):
        return x + self.body(x)


class StyleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.ReflectionPad2d(2), nn.Conv2d(3, 16, 5), nn.InstanceNorm2d(16, affine=True), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, 2, 1), nn.InstanceNorm2d(32, affine=True), nn.ReLU(inplace=True),
            ResIN(32), ResIN(32),
            nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(32, 16, 3, 1, 1),
            nn.InstanceNorm2d(16, affine=True), nn.ReLU(inplace=True),
            nn.ReflectionPad2d(2), nn.Conv2d(16, 3, 5), nn.Tanh())

    def forward(self, x):
        return self.net(x)


def gram(f):
    b, c, h, w = f.shape
    f = f.flatten(2)
    return f @ f.transpose(1, 2) / (c * h * w)


def train_instancenorm_style_gram_bf16(steps, make_audit):
    """Fast style transfer toy: ReflectionPad2d, InstanceNorm2d(affine), ReLU(inplace=True), residual
    blocks, nearest Upsample; a frozen random conv as feature extractor; content L1 + gram-matrix
    style loss + total variation, forward and losses under bf16 autocast; Adam."""
    torch.manual_seed(harness.SEED + 509)
    model = StyleNet()
    features = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, 2, 1), nn.ReLU())
    features.requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    style = torch.rand(1, 3, 24, 24, generator=harness.gen(0, 99))
    with torch.no_grad():
        style_gram = gram(features(style))
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                optimizer.zero_grad()
                g = harness.gen(step, 100)
                x = torch.rand(4, 3, 24, 24, generator=g) * 2 - 1
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = model(x)
                    fy, fx = features(y), features(x)
                    content = F.l1_loss(fy, fx)
                    style_l = F.mse_loss(gram(fy), style_gram.expand(4, -1, -1))
                    tv = (y[:, :, 1:] - y[:, :, :-1]).abs().mean() + (y[..., 1:] - y[..., :-1]).abs().mean()
                    loss = content + 10.0 * style_l + 0.1 * tv
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} (style {style_l.item():.4f})")


# ---------------------------------------------------------------- 10. Fourier-feature coordinate MLP, 2 chunks
class FourierMLP(nn.Module):
    def __init__(self, n_freq=32, scale=10.0, h=64):
        super().__init__()
        self.register_buffer("B", torch.randn(2, n_freq) * scale)
        self.mlp = nn.Sequential(nn.Linear(2 * n_freq, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 3))

    def forward(self, coords):
        proj = 2 * math.pi * coords @ self.B
        return torch.sigmoid(self.mlp(torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1)))


def train_fourier_features_chunks(steps, make_audit):
    """Coordinate MLP fitting a 16x16 RGB image through random Fourier features (a fixed Gaussian B
    buffer, sin/cos of 2*pi*xB), the 256 pixels shuffled by randperm and fed in 2 accumulated chunks;
    Adam, MultiStepLR."""
    torch.manual_seed(harness.SEED + 510)
    model = FourierMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[4, 8], gamma=0.3)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, 16), torch.linspace(0, 1, 16), indexing="ij")
    coords = torch.stack([xs, ys], dim=-1).reshape(-1, 2)
    chunks = 2
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 101)
                low = torch.rand(1, 3, 4, 4, generator=g)
                image = F.interpolate(low, size=(16, 16), mode="bicubic", align_corners=True).clamp(0, 1)
                pixels = image[0].permute(1, 2, 0).reshape(-1, 3)
                perm = torch.randperm(coords.size(0), generator=g)
                optimizer.zero_grad()
                total = 0.0
                for idx in perm.chunk(chunks):
                    loss = F.mse_loss(model(coords[idx]), pixels[idx]) / chunks
                    audit.before_backward(loss)
                    loss.backward()
                    total += loss.item()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} mse {total:.5f} psnr {-10 * math.log10(max(total, 1e-10)):.2f}")


# ---------------------------------------------------------------- 11. Gumbel-softmax categorical VAE
class GumbelVAE(nn.Module):
    def __init__(self, d=64, n_lat=6, k=8, h=128):
        super().__init__()
        self.n_lat, self.k = n_lat, k
        self.enc = nn.Sequential(nn.Linear(d, h), nn.ELU(), nn.Linear(h, n_lat * k))
        self.dec = nn.Sequential(nn.Linear(n_lat * k, h), nn.ELU(), nn.Linear(h, d))

    def forward(self, x, tau):
        logits = self.enc(x).view(-1, self.n_lat, self.k)
        z = F.gumbel_softmax(logits, tau=tau, hard=True, dim=-1)
        return self.dec(z.flatten(1)), logits


def train_gumbel_softmax_vae(steps, make_audit):
    """Categorical VAE: 6 latents x 8 categories sampled with F.gumbel_softmax(hard=True) (straight-through),
    temperature annealed per step, KL to the uniform prior from log_softmax, BCE-with-logits
    reconstruction; Adam(foreach=False)."""
    torch.manual_seed(harness.SEED + 511)
    model = GumbelVAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                optimizer.zero_grad()
                g = harness.gen(step, 102)
                proto = (torch.rand(4, 64, generator=g) > 0.5).float()
                pick = torch.randint(0, 4, (16,), generator=g)
                flip = (torch.rand(16, 64, generator=g) < 0.05).float()
                x = (proto[pick] - flip).abs()
                tau = max(0.5, math.exp(-0.1 * step))
                recon, logits = model(x, tau)
                rec = F.binary_cross_entropy_with_logits(recon, x, reduction="sum") / x.size(0)
                log_q = F.log_softmax(logits, dim=-1)
                kl = (log_q.exp() * (log_q + math.log(model.k))).sum() / x.size(0)
                loss = rec + kl
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} kl {kl.item():.3f} tau {tau:.3f}")


# ---------------------------------------------------------------- 12. neural ODE, RK4 unrolled
class ODEFunc(nn.Module):
    def __init__(self, d=4, h=48):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 1, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, d))

    def forward(self, t, y):
        return self.net(torch.cat([y, t.expand(y.size(0), 1)], dim=1))


def rk4_trajectory(f, y0, ts):
    ys = [y0]
    y = y0
    for i in range(len(ts) - 1):
        t, dt = ts[i], ts[i + 1] - ts[i]
        k1 = f(t, y)
        k2 = f(t + dt / 2, y + dt / 2 * k1)
        k3 = f(t + dt / 2, y + dt / 2 * k2)
        k4 = f(t + dt, y + dt * k3)
        y = y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        ys.append(y)
    return torch.stack(ys, dim=0)


def train_neural_ode_rk4(steps, make_audit):
    """Neural ODE with a time-conditioned MLP vector field, integrated by a hand-written RK4 unrolled over
    8 intervals (backprop through the solver), fitted to trajectories of a linear system computed with
    torch.matrix_exp; Adam, CosineAnnealingWarmRestarts."""
    torch.manual_seed(harness.SEED + 512)
    model = ODEFunc()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=3, T_mult=2)
    A = torch.tensor([[-0.1, 2.0, 0.0, 0.0], [-2.0, -0.1, 0.0, 0.0], [0.0, 0.0, -0.3, 1.0], [0.0, 0.0, -1.0, -0.3]])
    ts = torch.linspace(0, 1, 9).unsqueeze(1)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                optimizer.zero_grad()
                g = harness.gen(step, 103)
                y0 = torch.randn(16, 4, generator=g)
                true = torch.stack([y0 @ torch.matrix_exp(A * t).T for t in ts[:, 0]], dim=0)
                pred = rk4_trajectory(model, y0, ts)
                loss = F.mse_loss(pred, true)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.5f}")


# ---------------------------------------------------------------- 13. deep & cross net, bf16, 3 micro-batches
class DeepCross(nn.Module):
    def __init__(self, vocabs=(12, 9, 15), e=6, d_num=5, n_cross=3, h=48):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(v, e) for v in vocabs)
        d = e * len(vocabs) + d_num
        self.cross = nn.ModuleList(nn.Linear(d, d) for _ in range(n_cross))
        self.deep = nn.Sequential(nn.Linear(d, h), nn.BatchNorm1d(h), nn.PReLU(), nn.Linear(h, h), nn.BatchNorm1d(h),
                                  nn.PReLU())
        self.head = nn.Linear(d + h, 1)

    def forward(self, cats, nums):
        x0 = torch.cat([emb(cats[:, i]) for i, emb in enumerate(self.embs)] + [nums], dim=1)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.head(torch.cat([x, self.deep(x0)], dim=1)).squeeze(1)


def train_deep_cross_bf16_accum3(steps, make_audit):
    """DCN-v2 (cross layers x0 * W x + x beside a BatchNorm1d/PReLU deep tower) on categorical + numeric
    features under bf16 autocast, 3 accumulated micro-batches with loss / 3, SGD nesterov, CyclicLR
    (cycling momentum), zero_grad(set_to_none=False) at the end of the step."""
    torch.manual_seed(harness.SEED + 513)
    model = DeepCross()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=1e-3, max_lr=2e-2, step_size_up=3)
    accum = 3
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                total = 0.0
                for micro in range(accum):
                    g = harness.gen(step, 110 + micro)
                    cats = torch.stack([torch.randint(0, v, (16,), generator=g) for v in (12, 9, 15)], dim=1)
                    nums = torch.randn(16, 5, generator=g)
                    y = ((nums[:, 0] * nums[:, 1] > 0) ^ (cats[:, 0] < 4)).float()
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        logit = model(cats, nums)
                    loss = F.binary_cross_entropy_with_logits(logit.float(), y) / accum
                    audit.before_backward(loss)
                    loss.backward()
                    total += loss.item()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=False)
            print(f"  step {step} bce {total:.4f} lr {scheduler.get_last_lr()[0]:.4f}")


# ---------------------------------------------------------------- 14. orthogonal siamese, cosine_embedding_loss
class SiameseEncoder(nn.Module):
    def __init__(self, d_in=24, h=32, z=16):
        super().__init__()
        self.inp = nn.Linear(d_in, h)
        self.mix = parametrizations.orthogonal(nn.Linear(h, h))
        self.out = nn.Linear(h, z)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.out(torch.tanh(self.mix(self.drop(torch.tanh(self.inp(x))))))


def train_orthogonal_siamese_cosine(steps, make_audit):
    """Siamese encoder (one module called on both inputs) whose middle Linear is kept orthogonal by
    parametrizations.orthogonal, pairs labelled +1 (noisy copies) / -1 (unrelated), F.cosine_embedding_loss
    with a margin; Adadelta."""
    torch.manual_seed(harness.SEED + 514)
    model = SiameseEncoder()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 104)
                a = torch.randn(20, 24, generator=g)
                same = torch.rand(20, generator=g) < 0.5
                other = torch.randn(20, 24, generator=g)
                b = torch.where(same.unsqueeze(1), a + 0.2 * torch.randn(20, 24, generator=g), other)
                target = same.float() * 2 - 1
                e1, e2 = model(a), model(b)
                loss = F.cosine_embedding_loss(e1, e2, target, margin=0.2)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


LOOPS = [train_seq2seq_bahdanau_two_opt, train_llama_rope_complex_swiglu, train_lora_frozen_stack_bf16,
         train_pixelcnn_masked_conv, train_spectral_weight_norm_clipvalue, train_tagger_ignore_index_where,
         train_memory_lm_detached_mems, train_fm_einsum_bilinear_ranking, train_instancenorm_style_gram_bf16,
         train_fourier_features_chunks, train_gumbel_softmax_vae, train_neural_ode_rk4,
         train_deep_cross_bf16_accum3, train_orthogonal_siamese_cosine]


def main():
    harness.main(LOOPS)  # its seed, --only and printout


if __name__ == "__main__":
    main()
