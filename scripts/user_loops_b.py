"""The shadow run of a script as written against an Audit of it, on 12 more training loops written as
users write them, in plain torch, none drawn from scripts/zoo.py or scripts/user_loops.py (a VAE, a GAN
with two optimizers, a triplet-loss siamese net, PixelShuffle super-resolution, 3-D convs, ...).

Each loop is one function `train_X(steps, make_audit)`, run by `user_loops.check` exactly as the loops of
scripts/user_loops.py are: the audited run (3 steps, step 2 recorded) and the shadow run (10 steps, the
tool stops it after step 2).

    python scripts/user_loops_b.py [--seed=S] [--only=name,name]
"""

import math

import torch
from torch import nn
import torch.nn.functional as F

import user_loops as harness


class VAE(nn.Module):
    def __init__(self, d=64, h=32, z=8):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.mu, self.logvar = nn.Linear(h, z), nn.Linear(h, z)
        self.dec = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, d))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.dec(z), mu, logvar


def train_vae_kl(steps, make_audit):
    """MLP VAE on binary vectors: reparameterisation, BCE + KL, Adam with amsgrad."""
    torch.manual_seed(harness.SEED + 101)
    model = VAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                x = (torch.rand(8, 64, generator=harness.gen(step, 1)) > 0.5).float()
                logits, mu, logvar = model(x)
                recon = F.binary_cross_entropy_with_logits(logits, x, reduction="sum") / x.size(0)
                kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.size(0)
                loss = recon + kl
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} (recon {recon.item():.3f} kl {kl.item():.3f})")


def train_gan_two_opt(steps, make_audit):
    """Small MLP GAN: discriminator step then generator step, each with its own Adam(0.5, 0.999)."""
    torch.manual_seed(harness.SEED + 102)
    G = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 24), nn.Tanh())
    D = nn.Sequential(nn.Linear(24, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    g_opt = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
    with make_audit(G, g_opt) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 2)
                real = torch.tanh(torch.randn(8, 24, generator=g) * 0.5 + 0.3)
                fake = G(torch.randn(8, 16, generator=g))
                d_opt.zero_grad()
                d_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)
                audit.before_backward(d_loss)
                d_loss.backward()
                d_opt.step()
                g_opt.zero_grad()
                g_loss = bce(D(fake), ones)
                audit.before_backward(g_loss)
                g_loss.backward()
                g_opt.step()
            print(f"  step {step} d_loss {d_loss.item():.4f} g_loss {g_loss.item():.4f}")


class EmbedNet(nn.Module):
    def __init__(self, d=32, h=64, e=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, e))

    def forward(self, x):
        return F.normalize(self.net(x), dim=-1)


def train_triplet_siamese(steps, make_audit):
    """Siamese embedding net applied to anchor/positive/negative, TripletMarginLoss, SGD nesterov, StepLR."""
    torch.manual_seed(harness.SEED + 103)
    protos = torch.randn(5, 32)
    model = EmbedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    criterion = nn.TripletMarginLoss(margin=0.5)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 3)
                ca = torch.randint(0, 5, (8,), generator=g)
                cn = (ca + torch.randint(1, 5, (8,), generator=g)) % 5
                anchor = protos[ca] + torch.randn(8, 32, generator=g)
                pos = protos[ca] + torch.randn(8, 32, generator=g)
                neg = protos[cn] + torch.randn(8, 32, generator=g)
                loss = criterion(model(anchor), model(pos), model(neg))
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f}")


class SRNet(nn.Module):
    def __init__(self, scale=2, c=32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, c, 5, padding=2), nn.PReLU(),
            nn.Conv2d(c, c, 3, padding=1), nn.PReLU(),
            nn.Conv2d(c, 3 * scale * scale, 3, padding=1),
        )
        self.shuffle = nn.PixelShuffle(scale)

    def forward(self, x):
        return self.shuffle(self.body(x)) + F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


def train_pixelshuffle_sr(steps, make_audit):
    """ESPCN-style 2x super-resolution with PixelShuffle, L1 loss, AdamW, clip_grad_norm_, MultiStepLR."""
    torch.manual_seed(harness.SEED + 104)
    model = SRNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[3, 6], gamma=0.1)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                hr = torch.rand(4, 3, 16, 16, generator=harness.gen(step, 4))
                lr_img = F.avg_pool2d(hr, 2)
                loss = F.l1_loss(model(lr_img), hr)
                optimizer.zero_grad(set_to_none=True)
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
            print(f"  step {step} l1 {loss.item():.4f}")


def train_conv3d_volumes(steps, make_audit):
    """3-D conv classifier on tiny 8^3 volumes with BatchNorm3d and MaxPool3d, Adagrad."""
    torch.manual_seed(harness.SEED + 105)
    model = nn.Sequential(
        nn.Conv3d(1, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(), nn.MaxPool3d(2),
        nn.Conv3d(8, 16, 3, padding=1), nn.BatchNorm3d(16), nn.ReLU(),
        nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(16, 3),
    )
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2, lr_decay=1e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 5)
                vol = torch.randn(4, 1, 8, 8, 8, generator=g)
                label = torch.randint(0, 3, (4,), generator=g)
                loss = F.cross_entropy(model(vol), label)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


def sep_block(cin, cout, stride):
    return nn.Sequential(
        nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False), nn.BatchNorm2d(cin), nn.SiLU(),
        nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU(),
    )


def train_depthwise_silu_bf16(steps, make_audit):
    """Depthwise-separable conv net, SiLU, AdaptiveAvgPool2d, CPU bf16 autocast, NAdam, CosineAnnealingLR."""
    torch.manual_seed(harness.SEED + 106)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.SiLU(),
        sep_block(16, 24, 2), sep_block(24, 32, 1), sep_block(32, 48, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(48, 10),
    )
    optimizer = torch.optim.NAdam(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 6)
                images = torch.randn(8, 3, 16, 16, generator=g)
                labels = torch.randint(0, 10, (8,), generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(images)
                    loss = F.cross_entropy(logits, labels)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}")


class CharRNN(nn.Module):
    def __init__(self, vocab=27, e=16, h=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, e)
        self.rnn = nn.RNN(e, h, nonlinearity="tanh", batch_first=True)
        self.out = nn.Linear(h, vocab)

    def forward(self, x, hidden):
        y, hidden = self.rnn(self.emb(x), hidden)
        return self.out(y), hidden


def train_char_rnn_tbptt(steps, make_audit):
    """Char-level tanh nn.RNN LM, truncated BPTT with the hidden state detached and carried, RMSprop."""
    torch.manual_seed(harness.SEED + 107)
    model = CharRNN()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=2e-3, alpha=0.95)
    hidden = torch.zeros(1, 4, 32)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                chunk = torch.randint(0, 27, (4, 13), generator=harness.gen(step, 7))
                hidden = hidden.detach()
                logits, hidden = model(chunk[:, :-1], hidden)
                loss = F.cross_entropy(logits.reshape(-1, 27), chunk[:, 1:].reshape(-1))
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} ppl {math.exp(loss.item()):.2f}")


class MultiTaskNet(nn.Module):
    def __init__(self, d=20, h=48, classes=5):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, h), nn.LayerNorm(h), nn.GELU(), nn.Dropout(0.1), nn.Linear(h, h), nn.GELU())
        self.cls_head = nn.Linear(h, classes)
        self.reg_head = nn.Sequential(nn.Linear(h, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        f = self.trunk(x)
        return self.cls_head(f), self.reg_head(f).squeeze(-1)


def train_multitask_heads(steps, make_audit):
    """Shared trunk with a classification and a regression head, weighted sum of losses, Adamax, ExponentialLR."""
    torch.manual_seed(harness.SEED + 108)
    model = MultiTaskNet()
    optimizer = torch.optim.Adamax(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 8)
                x = torch.randn(8, 20, generator=g)
                y_cls = torch.randint(0, 5, (8,), generator=g)
                y_reg = x[:, :4].sum(-1) + 0.1 * torch.randn(8, generator=g)
                logits, pred = model(x)
                cls_loss = F.cross_entropy(logits, y_cls)
                reg_loss = F.smooth_l1_loss(pred, y_reg)
                loss = 1.0 * cls_loss + 0.5 * reg_loss
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f} (cls {cls_loss.item():.3f} reg {reg_loss.item():.3f})")


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class EinsumBlock(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.h, self.dh).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.dh)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        attn = scores.masked_fill(causal, float("-inf")).softmax(-1)
        y = torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(B, T, -1)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class EinsumLM(nn.Module):
    def __init__(self, vocab=48, d=32, layers=2, T=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, T, d))
        self.blocks = nn.ModuleList(EinsumBlock(d) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos[:, :ids.size(1)]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def train_einsum_rmsnorm_bf16(steps, make_audit):
    """Hand-written causal einsum attention with RMSNorm, CPU bf16 autocast, AdamW, warmup LambdaLR, clipping."""
    torch.manual_seed(harness.SEED + 109)
    model = EinsumLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                ids = torch.randint(0, 48, (4, 17), generator=harness.gen(step, 9))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.float().view(-1, 48), ids[:, 1:].reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f}")


class DeepSets(nn.Module):
    def __init__(self, d=6, h=32):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.rho = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1))

    def forward(self, x, mask):
        h = self.phi(x) * mask.unsqueeze(-1)
        pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return self.rho(pooled).squeeze(-1)


def train_deepsets_masked_mean(steps, make_audit):
    """Deep Sets on padded variable-size sets with masked mean pooling, regression of the set mean, RAdam."""
    torch.manual_seed(harness.SEED + 110)
    model = DeepSets()
    optimizer = torch.optim.RAdam(model.parameters(), lr=1e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 10)
                x = torch.randn(8, 12, 6, generator=g)
                lengths = torch.randint(3, 13, (8,), generator=g)
                mask = (torch.arange(12).unsqueeze(0) < lengths.unsqueeze(1)).float()
                target = (x[..., 0] * mask).sum(1) / lengths
                loss = F.mse_loss(model(x, mask), target)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} mse {loss.item():.4f}")


class TiedConvLM(nn.Module):
    def __init__(self, vocab=40, d=32, k=3):
        super().__init__()
        self.k = k
        self.emb = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, k)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids).transpose(1, 2)
        x = self.conv(F.pad(x, (self.k - 1, 0))).transpose(1, 2)
        return self.head(self.ln(F.gelu(x)))


def train_tied_lm_smooth_accum(steps, make_audit):
    """Causal conv LM with tied embedding/output weights, label smoothing, 2-micro-step gradient accumulation."""
    torch.manual_seed(harness.SEED + 111)
    model = TiedConvLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    accum = 2
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                total = 0.0
                for micro in range(accum):
                    ids = torch.randint(0, 40, (4, 21), generator=harness.gen(step, 20 + micro))
                    logits = model(ids[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, 40), ids[:, 1:].reshape(-1), label_smoothing=0.1) / accum
                    audit.before_backward(loss)
                    loss.backward()
                    total += loss.item()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {total:.4f}")


class Coupling(nn.Module):
    def __init__(self, mask, h=32):
        super().__init__()
        d = mask.numel()
        self.register_buffer("mask", mask)
        self.s = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, d), nn.Tanh())
        self.t = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d))

    def forward(self, x):
        xm = x * self.mask
        s = self.s(xm) * (1 - self.mask)
        t = self.t(xm) * (1 - self.mask)
        return xm + (1 - self.mask) * (x * torch.exp(s) + t), s.sum(-1)


class RealNVP(nn.Module):
    def __init__(self, d=8, n=4):
        super().__init__()
        base = (torch.arange(d) % 2).float()
        self.layers = nn.ModuleList(Coupling(base if i % 2 == 0 else 1 - base) for i in range(n))

    def log_prob(self, x):
        logdet = torch.zeros(x.size(0))
        for layer in self.layers:
            x, ld = layer(x)
            logdet = logdet + ld
        return -0.5 * (x ** 2).sum(-1) - 0.5 * x.size(1) * math.log(2 * math.pi) + logdet


def train_realnvp_flow(steps, make_audit):
    """RealNVP affine-coupling normalizing flow trained by maximum likelihood, SGD momentum, LinearLR."""
    torch.manual_seed(harness.SEED + 112)
    model = RealNVP()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=5)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 12)
                z = torch.randn(8, 8, generator=g)
                x = torch.cat([z[:, :4], z[:, 4:] * 0.5 + z[:, :4] ** 2 * 0.3], dim=1)
                loss = -model.log_prob(x).mean()
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                optimizer.step()
                scheduler.step()
            print(f"  step {step} nll {loss.item():.4f}")


LOOPS = [train_vae_kl, train_gan_two_opt, train_triplet_siamese, train_pixelshuffle_sr, train_conv3d_volumes,
         train_depthwise_silu_bf16, train_char_rnn_tbptt, train_multitask_heads, train_einsum_rmsnorm_bf16,
         train_deepsets_masked_mean, train_tied_lm_smooth_accum, train_realnvp_flow]


def main():
    harness.main(LOOPS)  # its seed, --only and printout


if __name__ == "__main__":
    main()
