"""The shadow run of a script as written against an Audit of it, on 14 more training loops written as
users write them, in plain torch, none drawn from scripts/zoo.py, scripts/user_loops.py,
scripts/user_loops_b.py or scripts/user_loops_c.py (a model whose forward is never called, hand-written
LayerNorm / RMSNorm, BCE with pos_weight, focal loss, knowledge distillation from a frozen teacher,
WGAN-GP, sparse embeddings with SparseAdam beside Adam, top-k token pruning, a small UNet, causal
linear attention with cumsum, batch-hard triplet mining, R-Drop, ...).

Each loop is one function `train_X(steps, make_audit)`, run by `user_loops.check` exactly as the loops of
scripts/user_loops.py are: the audited run (3 steps, step 2 recorded) and the shadow run (10 steps, the
tool stops it after step 2).

    python scripts/user_loops_d.py [--seed=S] [--only=name,name]
"""

import math

import torch
from torch import nn
import torch.nn.functional as F

import user_loops as harness


# ---------------------------------------------------------------- 1. encoder + head called directly
class VarMeanLayerNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        var, mean = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class EncoderHead(nn.Module):
    def __init__(self, d_in=20, h=48, classes=6):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, h), VarMeanLayerNorm(h), nn.GELU(),
                                     nn.Linear(h, h), VarMeanLayerNorm(h), nn.GELU())
        self.head = nn.Linear(h, classes)

    def forward(self, x):
        return self.head(self.encoder(x))


def train_encoder_head_direct_varmean_ln(steps, make_audit):
    """MLP classifier whose forward is never called (the loop calls model.encoder then model.head), a
    hand-written LayerNorm from torch.var_mean, a feature-norm penalty on the encoding, Adam, ExponentialLR."""
    torch.manual_seed(harness.SEED + 301)
    model = EncoderHead()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 51)
                x = torch.randn(24, 20, generator=g)
                y = torch.randint(0, 6, (24,), generator=g)
                h = model.encoder(x)
                logits = model.head(h)
                loss = F.cross_entropy(logits, y) + 1e-3 * h.pow(2).sum(-1).mean()
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 2. RMSNorm (rsqrt) + SDPA + SwiGLU
class RsqrtRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * x.pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt() * self.weight


class SdpaBlock(nn.Module):
    def __init__(self, d=32, heads=4, ff=64):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = RsqrtRMSNorm(d), RsqrtRMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.w_gate = nn.Linear(d, ff, bias=False)
        self.w_up = nn.Linear(d, ff, bias=False)
        self.w_down = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, D))
        h = self.n2(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class SdpaLM(nn.Module):
    def __init__(self, vocab=64, d=32, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(SdpaBlock(d) for _ in range(layers))
        self.norm = RsqrtRMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


def train_rmsnorm_rsqrt_sdpa_swiglu(steps, make_audit):
    """Llama-style LM in fp32: RMSNorm written with pow(2).mean(-1, keepdim=True).rsqrt(), causal
    F.scaled_dot_product_attention, SwiGLU MLP, AdamW, PolynomialLR stepped each step, clip_grad_norm_."""
    torch.manual_seed(harness.SEED + 302)
    model = SdpaLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=10, power=2.0)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                ids = torch.randint(0, 64, (4, 17), generator=harness.gen(step, 52))
                logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 3. multi-label BCE with pos_weight
class NetWrapper(nn.Module):
    def __init__(self, d=30, h=64, labels=8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Dropout(0.1), nn.Linear(h, h), nn.ReLU(),
                                 nn.Linear(h, labels))

    def forward(self, x):
        return torch.sigmoid(self.net(x))


def train_multilabel_pos_weight_clamp(steps, make_audit):
    """Multi-label classifier trained through model.net only (its forward, which applies sigmoid, is
    never used): inputs clamped with per-feature tensor bounds and scaled by x / x.abs().amax(1),
    BCE-with-logits with pos_weight, SGD momentum, zero_grad(set_to_none=False), clip_grad_value_."""
    torch.manual_seed(harness.SEED + 303)
    model = NetWrapper()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with make_audit(model, optimizer) as audit:
        lo = -2.0 * torch.ones(30)
        hi = torch.linspace(1.0, 3.0, 30)
        pos_weight = torch.linspace(1.0, 4.0, 8)
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 53)
                x = torch.randn(32, 30, generator=g) * 1.5
                y = (torch.rand(32, 8, generator=g) < 0.25).float()
                x = torch.clamp(x, min=lo, max=hi)
                x = x / x.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
                logits = model.net(x)
                loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight)
                optimizer.zero_grad(set_to_none=False)
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 4. CNN with focal loss
class ConvBnPoolNet(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(12, 24, 3, padding=1), nn.BatchNorm2d(24), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(24 * 4 * 4, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def focal_loss(logits, target, gamma=2.0, alpha=None):
    logp = F.log_softmax(logits, dim=-1)
    logp_t = logp.gather(1, target.unsqueeze(1)).squeeze(1)
    p_t = logp_t.exp()
    loss = -((1 - p_t) ** gamma) * logp_t
    if alpha is not None:
        loss = alpha[target] * loss
    return loss.mean()


def train_conv_bn_maxpool_focal(steps, make_audit):
    """Conv2d + BatchNorm2d + MaxPool2d image classifier on 16x16 greyscale images, a hand-written
    focal loss with per-class alpha, Adam, MultiStepLR."""
    torch.manual_seed(harness.SEED + 304)
    model = ConvBnPoolNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 5], gamma=0.3)
    with make_audit(model, optimizer) as audit:
        alpha = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.0])
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 54)
                x = torch.randn(8, 1, 16, 16, generator=g)
                y = torch.randint(0, 5, (8,), generator=g)
                loss = focal_loss(model(x), y, alpha=alpha)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} focal {loss.item():.4f}")


# ---------------------------------------------------------------- 5. knowledge distillation
class DistillPair(nn.Module):
    def __init__(self, d=24, classes=10):
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                     nn.Linear(128, classes))
        self.student = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, classes))


def train_distill_frozen_teacher_kl(steps, make_audit):
    """Knowledge distillation: a frozen teacher (requires_grad_(False), eval, under no_grad) and a student
    held in one container module, KL divergence between temperature-scaled log_softmaxes times T^2
    plus cross-entropy, AdamW over the student's parameters only."""
    torch.manual_seed(harness.SEED + 305)
    model = DistillPair()
    model.teacher.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.student.parameters(), lr=2e-3)
    T, w = 3.0, 0.7
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                model.teacher.eval()
                model.student.train()
                g = harness.gen(step, 55)
                x = torch.randn(32, 24, generator=g)
                y = torch.randint(0, 10, (32,), generator=g)
                with torch.no_grad():
                    t_logits = model.teacher(x)
                s_logits = model.student(x)
                kd = F.kl_div(F.log_softmax(s_logits / T, dim=-1), F.log_softmax(t_logits / T, dim=-1),
                              reduction="batchmean", log_target=True) * T * T
                loss = w * kd + (1 - w) * F.cross_entropy(s_logits, y)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} kd {kd.item():.4f}")


# ---------------------------------------------------------------- 6. WGAN-GP
class WGAN(nn.Module):
    def __init__(self, z=16, d=24, h=48):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d))
        self.D = nn.Sequential(nn.Linear(d, h), nn.LeakyReLU(0.2), nn.Linear(h, h), nn.LeakyReLU(0.2),
                               nn.Linear(h, 1))


def train_wgan_gp_two_opt(steps, make_audit):
    """WGAN-GP in one container module: two critic updates per step with a gradient penalty from
    torch.autograd.grad(create_graph=True) on real/fake interpolates, then a generator update with the
    critic's requires_grad toggled off; separate Adam(0, 0.9) optimizers for critic and generator."""
    torch.manual_seed(harness.SEED + 306)
    model = WGAN()
    d_opt = torch.optim.Adam(model.D.parameters(), lr=1e-4, betas=(0.0, 0.9))
    g_opt = torch.optim.Adam(model.G.parameters(), lr=1e-4, betas=(0.0, 0.9))
    n_critic, lam = 2, 10.0
    with make_audit(model, d_opt) as audit:
        for step in range(steps):
            with audit.step(step):
                for p in model.D.parameters():
                    p.requires_grad_(True)
                for it in range(n_critic):
                    g = harness.gen(step, 56 + it)
                    real = torch.randn(16, 24, generator=g) * 0.5 + 1.0
                    with torch.no_grad():
                        fake = model.G(torch.randn(16, 16, generator=g))
                    eps = torch.rand(16, 1, generator=g)
                    inter = (eps * real + (1 - eps) * fake).requires_grad_(True)
                    (grad,) = torch.autograd.grad(model.D(inter).sum(), inter, create_graph=True)
                    gp = ((grad.norm(2, dim=1) - 1) ** 2).mean()
                    d_loss = model.D(fake).mean() - model.D(real).mean() + lam * gp
                    d_opt.zero_grad()
                    audit.before_backward(d_loss)
                    d_loss.backward()
                    d_opt.step()
                for p in model.D.parameters():
                    p.requires_grad_(False)
                z = torch.randn(16, 16, generator=harness.gen(step, 58))
                g_loss = -model.D(model.G(z)).mean()
                g_opt.zero_grad()
                audit.before_backward(g_loss)
                g_loss.backward()
                g_opt.step()
            print(f"  step {step} d_loss {d_loss.item():.4f} g_loss {g_loss.item():.4f} gp {gp.item():.4f}")


# ---------------------------------------------------------------- 7. BiLSTM with masked attention pooling
class AttnPoolLSTM(nn.Module):
    def __init__(self, vocab=80, e=16, h=24, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, e, padding_idx=0)
        self.lstm = nn.LSTM(e, h, batch_first=True, bidirectional=True)
        self.score = nn.Linear(2 * h, 1)
        self.out = nn.Linear(2 * h, classes)

    def forward(self, ids):
        pad = ids == 0
        hs, _ = self.lstm(self.emb(ids))
        scores = self.score(hs).squeeze(-1).masked_fill(pad, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        pooled = torch.bmm(attn.unsqueeze(1), hs).squeeze(1)
        return self.out(pooled), attn


def train_bilstm_masked_attention_pool(steps, make_audit):
    """Padded-text classifier: bidirectional nn.LSTM, attention pooling with masked_fill(-inf) on the
    padding and bmm, an entropy bonus on the attention computed with torch.where, Adagrad."""
    torch.manual_seed(harness.SEED + 307)
    model = AttnPoolLSTM()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, lr_decay=1e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 59)
                ids, _ = harness.padded_ids(g, [14, 9, 12, 5, 14, 7], 14, 80, 0, low=1)
                y = torch.randint(0, 3, (6,), generator=g)
                logits, attn = model(ids)
                ent = -torch.where(attn > 0, attn * attn.clamp_min(1e-12).log(), torch.zeros_like(attn)).sum(-1)
                loss = F.cross_entropy(logits, y) - 0.01 * ent.mean()
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 8. two-tower with sparse embeddings
class TwoTower(nn.Module):
    def __init__(self, users=200, items=300, e=16, d=24):
        super().__init__()
        self.user_emb = nn.Embedding(users, e, sparse=True)
        self.item_emb = nn.Embedding(items, e, sparse=True)
        self.user_tower = nn.Sequential(nn.Linear(e, d), nn.ReLU(), nn.Linear(d, d))
        self.item_tower = nn.Sequential(nn.Linear(e, d), nn.ReLU(), nn.Linear(d, d))


def train_two_tower_sparse_adam_cosine(steps, make_audit):
    """Two-tower retrieval model: nn.Embedding(sparse=True) tables updated by SparseAdam and the dense
    towers by Adam (two optimizers over disjoint parameters), towers called directly,
    CosineEmbeddingLoss with positives and torch.roll in-batch negatives."""
    torch.manual_seed(harness.SEED + 308)
    model = TwoTower()
    sparse_opt = torch.optim.SparseAdam(list(model.user_emb.parameters()) + list(model.item_emb.parameters()),
                                        lr=1e-2)
    dense_opt = torch.optim.Adam(list(model.user_tower.parameters()) + list(model.item_tower.parameters()),
                                 lr=1e-3)
    criterion = nn.CosineEmbeddingLoss(margin=0.2)
    with make_audit(model, dense_opt) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 60)
                users = torch.randint(0, 200, (16,), generator=g)
                items = torch.randint(0, 300, (16,), generator=g)
                u = model.user_tower(model.user_emb(users))
                v = model.item_tower(model.item_emb(items))
                v_neg = torch.roll(v, shifts=1, dims=0)
                target = torch.cat([torch.ones(16), -torch.ones(16)])
                loss = criterion(torch.cat([u, u]), torch.cat([v, v_neg]), target)
                sparse_opt.zero_grad()
                dense_opt.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                sparse_opt.step()
                dense_opt.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 9. top-k token pruning + MHA
class TokenPruner(nn.Module):
    def __init__(self, d=32, heads=4, keep=6):
        super().__init__()
        self.keep = keep
        self.inp = nn.Linear(10, d)
        self.scorer = nn.Linear(d, 1)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x):  # (B, T, 10)
        h = self.inp(x)
        s = self.scorer(h).squeeze(-1)
        top_s, top_i = torch.topk(s, self.keep, dim=1)
        order, perm = torch.sort(top_i, dim=1)  # keep the kept tokens in sequence order
        gate = torch.sigmoid(top_s.gather(1, perm)).unsqueeze(-1)
        kept = h.gather(1, order.unsqueeze(-1).expand(-1, -1, h.size(-1))) * gate
        y, _ = self.attn(kept, kept, kept, need_weights=False)
        y = self.norm(kept + y)
        return self.out(y.mean(1)).squeeze(-1)


def train_topk_sort_token_pruning_mha(steps, make_audit):
    """Token pruning: a scorer picks the top-k tokens (topk, then sort to keep sequence order, gather),
    sigmoid-gated so the scorer gets gradients, nn.MultiheadAttention over the kept tokens, MSE
    regression, RAdam, zero_grad(set_to_none=False)."""
    torch.manual_seed(harness.SEED + 309)
    model = TokenPruner()
    optimizer = torch.optim.RAdam(model.parameters(), lr=1e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 61)
                x = torch.randn(8, 20, 10, generator=g)
                y = x[..., 0].amax(1)
                loss = F.mse_loss(model(x), y)
                optimizer.zero_grad(set_to_none=False)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} mse {loss.item():.4f}")


# ---------------------------------------------------------------- 10. small UNet, bf16, accumulation
def double_conv(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinyUNet(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.d1 = double_conv(1, c)
        self.d2 = double_conv(c, 2 * c)
        self.pool = nn.MaxPool2d(2)
        self.mid = double_conv(2 * c, 2 * c)
        self.u2 = double_conv(4 * c, c)
        self.u1 = double_conv(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        s1 = self.d1(x)
        s2 = self.d2(self.pool(s1))
        m = self.mid(self.pool(s2))
        u = self.u2(torch.cat([F.interpolate(m, scale_factor=2, mode="nearest"), s2], dim=1))
        u = self.u1(torch.cat([F.interpolate(u, size=s1.shape[-2:], mode="bilinear", align_corners=False), s1],
                              dim=1))
        return self.out(u)


def train_unet_bce_dice_bf16_accum(steps, make_audit):
    """Segmentation UNet (Conv2d + BatchNorm2d + MaxPool2d down, F.interpolate nearest/bilinear up,
    torch.cat skips) under CPU bf16 autocast, BCE-with-logits + soft Dice computed in fp32, 2 micro-batches
    of gradient accumulation per optimizer step, Adam."""
    torch.manual_seed(harness.SEED + 310)
    model = TinyUNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    accum = 2
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                total = 0.0
                for micro in range(accum):
                    g = harness.gen(step, 62 + micro)
                    img = torch.rand(2, 1, 16, 16, generator=g)
                    mask = (F.avg_pool2d(img, 3, stride=1, padding=1) > 0.5).float()
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        logits = model(img)
                    logits = logits.float()
                    prob = torch.sigmoid(logits)
                    inter = (prob * mask).sum((1, 2, 3))
                    dice = 1 - (2 * inter + 1) / (prob.sum((1, 2, 3)) + mask.sum((1, 2, 3)) + 1)
                    loss = (F.binary_cross_entropy_with_logits(logits, mask) + dice.mean()) / accum
                    audit.before_backward(loss)
                    loss.backward()
                    total += loss.item()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {total:.4f}")


# ---------------------------------------------------------------- 11. eval pass inside the step
class BNDropMLP(nn.Module):
    def __init__(self, d=16, h=64, classes=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.3),
                                  nn.Linear(h, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.3),
                                  nn.Linear(h, classes))

    def forward(self, x):
        return self.body(x)


def train_eval_toggle_smoothing_clipvalue(steps, make_audit):
    """MLP with BatchNorm1d and Dropout, label smoothing written by hand (one_hot, mix, -sum log_softmax),
    a validation batch scored under torch.no_grad() with model.eval() then model.train() inside every
    step, SGD nesterov, clip_grad_value_, CosineAnnealingLR stepped each step."""
    torch.manual_seed(harness.SEED + 311)
    model = BNDropMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, eta_min=1e-4)
    eps = 0.1
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 64)
                x = torch.randn(32, 16, generator=g)
                y = torch.randint(0, 4, (32,), generator=g)
                xv = torch.randn(64, 16, generator=g)
                yv = torch.randint(0, 4, (64,), generator=g)
                model.train()
                logits = model(x)
                target = F.one_hot(y, 4).float() * (1 - eps) + eps / 4
                loss = -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.25)
                optimizer.step()
                scheduler.step()
                model.eval()
                with torch.no_grad():
                    val_logits = model(xv)
                    val_loss = F.cross_entropy(val_logits, yv)
                    val_acc = (val_logits.argmax(-1) == yv).float().mean()
                model.train()
            print(f"  step {step} loss {loss.item():.4f} val {val_loss.item():.4f} acc {val_acc.item():.2f}")


# ---------------------------------------------------------------- 12. causal linear attention with cumsum
class LinearAttention(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q = F.elu(self.q(x).view(B, T, self.h, -1)) + 1
        k = F.elu(self.k(x).view(B, T, self.h, -1)) + 1
        v = self.v(x).view(B, T, self.h, -1)
        kv = torch.einsum("bthd,bthe->bthde", k, v).cumsum(dim=1)
        z = 1.0 / (torch.einsum("bthd,bthd->bth", q, k.cumsum(dim=1)) + 1e-6)
        y = torch.einsum("bthd,bthde,bth->bthe", q, kv, z)
        return self.o(y.reshape(B, T, D))


class LinearAttnLM(nn.Module):
    def __init__(self, vocab=40, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LinearAttention(d) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return self.head(x)


def train_linear_attention_cumsum_bf16(steps, make_audit):
    """Causal linear-attention LM (ELU+1 features, running key-value sums by einsum + cumsum over time)
    under CPU bf16 autocast, Adamax, StepLR."""
    torch.manual_seed(harness.SEED + 312)
    model = LinearAttnLM()
    optimizer = torch.optim.Adamax(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                ids = torch.randint(0, 40, (3, 21), generator=harness.gen(step, 66))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, 40), ids[:, 1:].reshape(-1))
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 13. batch-hard triplet mining
def train_batch_hard_triplet_mining(steps, make_audit):
    """Metric learning with batch-hard triplet mining: L2-normalised embeddings, pairwise distances from
    a matmul, hardest positive / negative per anchor via torch.where + amax / amin, soft-margin
    (softplus) triplet loss, Adam, CyclicLR without momentum cycling."""
    torch.manual_seed(harness.SEED + 313)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 16))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=1e-4, max_lr=1e-3, step_size_up=3,
                                                  cycle_momentum=False)
    P, K = 4, 4  # identities per batch, samples per identity
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 67)
                centers = torch.randn(P, 32, generator=g) * 2
                labels = torch.arange(P).repeat_interleave(K)
                x = centers[labels] + torch.randn(P * K, 32, generator=g)
                e = F.normalize(model(x), dim=-1)
                dist = (2 - 2 * e @ e.t()).clamp_min(1e-12).sqrt()
                same = labels.unsqueeze(0) == labels.unsqueeze(1)
                hardest_pos = torch.where(same, dist, torch.zeros_like(dist)).amax(1)
                hardest_neg = torch.where(same, torch.full_like(dist, 1e4), dist).amin(1)
                loss = F.softplus(hardest_pos - hardest_neg).mean()
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 14. R-Drop
class TextCNN(nn.Module):
    def __init__(self, vocab=120, e=24, c=32, classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, e)
        self.convs = nn.ModuleList(nn.Conv1d(e, c, k, padding=k // 2) for k in (3, 5))
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, ids):
        x = self.emb(ids).transpose(1, 2)
        feats = [F.relu(conv(x)).amax(dim=-1) for conv in self.convs]
        return self.fc(self.drop(torch.cat(feats, dim=1)))


def train_rdrop_symmetric_kl(steps, make_audit):
    """R-Drop regularisation: the batch goes through a dropout TextCNN (Conv1d over embeddings, max over
    time, torch.cat of the pooled features) twice, cross-entropy on both passes plus the symmetric KL
    between them (F.kl_div with log_target=True), NAdam."""
    torch.manual_seed(harness.SEED + 314)
    model = TextCNN()
    optimizer = torch.optim.NAdam(model.parameters(), lr=2e-3)
    alpha = 1.0
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 68)
                ids = torch.randint(0, 120, (8, 18), generator=g)
                y = torch.randint(0, 5, (8,), generator=g)
                logits1, logits2 = model(ids), model(ids)
                lp1, lp2 = F.log_softmax(logits1, dim=-1), F.log_softmax(logits2, dim=-1)
                ce = 0.5 * (F.nll_loss(lp1, y) + F.nll_loss(lp2, y))
                kl = 0.5 * (F.kl_div(lp1, lp2, reduction="batchmean", log_target=True)
                            + F.kl_div(lp2, lp1, reduction="batchmean", log_target=True))
                loss = ce + alpha * kl
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} kl {kl.item():.4f}")


LOOPS = [train_encoder_head_direct_varmean_ln, train_rmsnorm_rsqrt_sdpa_swiglu, train_multilabel_pos_weight_clamp,
         train_conv_bn_maxpool_focal, train_distill_frozen_teacher_kl, train_wgan_gp_two_opt,
         train_bilstm_masked_attention_pool, train_two_tower_sparse_adam_cosine, train_topk_sort_token_pruning_mha,
         train_unet_bce_dice_bf16_accum, train_eval_toggle_smoothing_clipvalue, train_linear_attention_cumsum_bf16,
         train_batch_hard_triplet_mining, train_rdrop_symmetric_kl]


def main():
    harness.main(LOOPS)  # its seed, --only and printout


if __name__ == "__main__":
    main()
