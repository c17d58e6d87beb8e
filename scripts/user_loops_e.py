"""The shadow run of a script as written against an Audit of it, on 14 more training loops written as
users write them, in plain torch, none drawn from scripts/zoo.py, scripts/user_loops.py,
scripts/user_loops_b.py or scripts/user_loops_c.py (a small ResNet with a hand-written LR warmup, a
2-layer GRU LM with truncated BPTT, a conv VAE, supervised contrastive loss, a mixture-density net,
a GPT block with a triu/masked_fill causal mask, a dense-adjacency GCN, a straight-through
binary-weight net, a VQ-VAE, a DDPM noise predictor, ...).

Each loop is one function `train_X(steps, make_audit)`, run by `user_loops.check` exactly as the loops of
scripts/user_loops.py are: the audited run (3 steps, step 2 recorded) and the shadow run (10 steps, the
tool stops it after step 2).

    python scripts/user_loops_e.py [--seed=S] [--only=name,name]
"""

import math
import random

import torch
from torch import nn
import torch.nn.functional as F
import torch.utils.checkpoint

import user_loops as harness


# ---------------------------------------------------------------- 1. ResNet basic blocks + manual warmup
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        if stride == 1 and cin == cout:
            self.shortcut = nn.Identity()
        else:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def train_resnet_manual_warmup(steps, make_audit):
    """ResNet basic blocks (BatchNorm2d, residual adds, 1x1 strided shortcuts), SGD nesterov, LR warmup
    written by hand into every param_group["lr"] at the top of the step."""
    torch.manual_seed(harness.SEED + 401)
    model = TinyResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    base_lr, warmup = 0.1, 5
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                lr = base_lr * min(1.0, (step + 1) / warmup)
                for pg in optimizer.param_groups:
                    pg["lr"] = lr
                g = harness.gen(step, 61)
                x = torch.randn(8, 3, 16, 16, generator=g)
                y = torch.randint(0, 10, (8,), generator=g)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} lr {lr:.3f}")


# ---------------------------------------------------------------- 2. 2-layer GRU LM, truncated BPTT
class CharGRU(nn.Module):
    def __init__(self, vocab=40, e=16, h=48, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, e)
        self.gru = nn.GRU(e, h, num_layers=layers, dropout=0.1, batch_first=True)
        self.head = nn.Linear(h, vocab)

    def forward(self, ids, hidden=None):
        out, hidden = self.gru(self.emb(ids), hidden)
        return self.head(out), hidden


def train_gru_tbptt_asgd(steps, make_audit):
    """Char-level 2-layer nn.GRU LM over consecutive chunks, the hidden state carried across steps and
    detached (truncated BPTT), ASGD."""
    torch.manual_seed(harness.SEED + 402)
    model = CharGRU()
    optimizer = torch.optim.ASGD(model.parameters(), lr=0.05, t0=2)
    hidden = None
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 62)
                chunk = torch.randint(0, 40, (4, 17), generator=g)
                inp, tgt = chunk[:, :-1], chunk[:, 1:]
                if hidden is not None:
                    hidden = hidden.detach()
                logits, hidden = model(inp, hidden)
                loss = F.cross_entropy(logits.reshape(-1, 40), tgt.reshape(-1))
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 3. conv VAE
class ConvVAE(nn.Module):
    def __init__(self, z=8):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 8, 4, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 4, 2, 1), nn.ReLU(),
                                 nn.Flatten(), nn.Linear(16 * 4 * 4, 2 * z))
        self.fc = nn.Linear(z, 16 * 4 * 4)
        self.dec = nn.Sequential(nn.ConvTranspose2d(16, 8, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(8, 1, 4, 2, 1))

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        std = torch.exp(0.5 * logvar)
        z = mu + torch.randn_like(std) * std
        return self.dec(self.fc(z).view(-1, 16, 4, 4)), mu, logvar


def train_conv_vae_rprop(steps, make_audit):
    """Convolutional VAE on binary 16x16 images: reparameterisation with randn_like, BCE-with-logits
    reconstruction plus a linearly annealed KL term, Rprop."""
    torch.manual_seed(harness.SEED + 403)
    model = ConvVAE()
    optimizer = torch.optim.Rprop(model.parameters(), lr=1e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 63)
                x = (torch.rand(8, 1, 16, 16, generator=g) > 0.5).float()
                recon, mu, logvar = model(x)
                bce = F.binary_cross_entropy_with_logits(recon, x, reduction="sum") / x.size(0)
                kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.size(0)
                beta = min(1.0, step / 5)
                loss = bce + beta * kl
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} kl {kl.item():.3f}")


# ---------------------------------------------------------------- 4. supervised contrastive loss
class SupConNet(nn.Module):
    def __init__(self, d_in=32, h=64, z=16):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d_in, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.proj = nn.Linear(h, z)

    def forward(self, x):
        return F.normalize(self.proj(self.enc(x)), dim=1)


def train_supcon_logsumexp(steps, make_audit):
    """Supervised contrastive loss on two noisy views: cosine-similarity matrix z @ z.T, torch.eye diagonal
    masked with -inf, label-equality positives, logsumexp normaliser, AdamW amsgrad."""
    torch.manual_seed(harness.SEED + 404)
    model = SupConNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    tau = 0.1
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 64)
                x = torch.randn(12, 32, generator=g)
                labels = torch.randint(0, 4, (12,), generator=g)
                v1 = x + 0.1 * torch.randn(12, 32, generator=g)
                v2 = x * (torch.rand(12, 32, generator=g) > 0.2).float()
                z = model(torch.cat([v1, v2]))
                lab = labels.repeat(2)
                n = z.size(0)
                eye = torch.eye(n, dtype=torch.bool)
                logits = (z @ z.t() / tau).masked_fill(eye, float("-inf"))
                pos = ((lab.unsqueeze(0) == lab.unsqueeze(1)) & ~eye).float()
                log_prob = (logits - torch.logsumexp(logits, dim=1, keepdim=True)).masked_fill(eye, 0.0)
                loss = (-(pos * log_prob).sum(1) / pos.sum(1).clamp(min=1)).mean()
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 5. mixture-density network
class MDN(nn.Module):
    def __init__(self, d_in=1, h=64, k=5, d_out=2):
        super().__init__()
        self.k, self.d_out = k, d_out
        self.trunk = nn.Sequential(nn.Linear(d_in, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh())
        self.pi = nn.Linear(h, k)
        self.mu = nn.Linear(h, k * d_out)
        self.log_sigma = nn.Linear(h, k * d_out)

    def forward(self, x):
        h = self.trunk(x)
        shape = (-1, self.k, self.d_out)
        return F.log_softmax(self.pi(h), -1), self.mu(h).view(shape), self.log_sigma(h).clamp(-5, 5).view(shape)


def train_mdn_logsumexp(steps, make_audit):
    """Mixture-density network on a multi-valued inverse problem: log_softmax mixing weights, diagonal
    Gaussian log-densities per component, NLL by logsumexp over components, Adadelta with weight decay."""
    torch.manual_seed(harness.SEED + 405)
    model = MDN()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0, rho=0.95, weight_decay=1e-4)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 65)
                t = torch.rand(64, 1, generator=g) * 2 - 1
                y = torch.cat([torch.sin(3 * t), t], dim=1) + 0.05 * torch.randn(64, 2, generator=g)
                x = y[:, :1] + 0.3 * torch.sign(t)  # ambiguous inverse: x given, y multi-valued
                log_pi, mu, log_sigma = model(x)
                z = (y.unsqueeze(1) - mu) / log_sigma.exp()
                comp = (-0.5 * z.pow(2) - log_sigma - 0.5 * math.log(2 * math.pi)).sum(-1)
                loss = -torch.logsumexp(log_pi + comp, dim=1).mean()
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} nll {loss.item():.4f}")


# ---------------------------------------------------------------- 6. GPT block with a triu causal mask
class GPTBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=80, d=32, T=16, heads=4, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, T, d))
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        T = ids.size(1)
        upper = torch.triu(torch.ones(T, T), diagonal=1).bool()
        mask = torch.zeros(T, T).masked_fill(upper, float("-inf"))
        x = self.tok(ids) + self.pos[:, :T]
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln_f(x))


def train_gpt_triu_mask_tied(steps, make_audit):
    """Decoder-only GPT: float causal mask from torch.triu + masked_fill(-inf) fed to nn.MultiheadAttention,
    learned positional Parameter, embedding/head weight tying, AdamW, clip_grad_norm_(foreach=True)."""
    torch.manual_seed(harness.SEED + 406)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 66)
                ids = torch.randint(0, 80, (4, 17), generator=g)
                logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, 80), ids[:, 1:].reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                audit.before_backward(loss)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} gnorm {gnorm.item():.3f}")


# ---------------------------------------------------------------- 7. dense-adjacency GCN, link prediction
class DenseGCN(nn.Module):
    def __init__(self, d_in=12, h=32, z=16):
        super().__init__()
        self.lin1 = nn.Linear(d_in, h)
        self.lin2 = nn.Linear(h, z)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, a_hat):
        h = F.relu(a_hat @ self.lin1(x))
        return a_hat @ self.lin2(self.drop(h))


def train_dense_gcn_linkpred(steps, make_audit):
    """Two-layer GCN with a symmetric-normalised dense adjacency (D^-1/2 A D^-1/2 matmuls), link prediction
    scored by index_select'ed node-pair dot products, BCE-with-logits, Adagrad with lr_decay."""
    torch.manual_seed(harness.SEED + 407)
    model = DenseGCN()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.02, lr_decay=1e-3, initial_accumulator_value=0.1)
    N = 30
    with make_audit(model, optimizer) as audit:
        g0 = harness.gen(0, 67)
        adj = (torch.rand(N, N, generator=g0) < 0.15).float()
        adj = ((adj + adj.t()) > 0).float()
        adj.fill_diagonal_(1.0)
        dinv = adj.sum(1).pow(-0.5)
        a_hat = dinv.unsqueeze(1) * adj * dinv.unsqueeze(0)
        feats = torch.randn(N, 12, generator=g0)
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 68)
                src = torch.randint(0, N, (48,), generator=g)
                dst = torch.randint(0, N, (48,), generator=g)
                labels = adj[src, dst]
                z = model(feats, a_hat)
                score = (z.index_select(0, src) * z.index_select(0, dst)).sum(-1)
                loss = F.binary_cross_entropy_with_logits(score, labels)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 8. tabular net, 4 micro-batches
class TabularNet(nn.Module):
    def __init__(self, cards=(10, 7, 25), e=4, n_num=6):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, e) for c in cards)
        self.num_bn = nn.BatchNorm1d(n_num)
        self.mlp = nn.Sequential(nn.Linear(len(cards) * e + n_num, 64), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, cats, nums):
        parts = [emb(cats[:, i]) for i, emb in enumerate(self.embs)]
        return self.mlp(torch.cat(parts + [self.num_bn(nums)], dim=1)).squeeze(1)


def train_tabular_accum4(steps, make_audit):
    """Tabular regression (one nn.Embedding per categorical column, BatchNorm1d on numeric columns),
    gradient accumulation over 4 micro-batches with loss / 4, SGD momentum with dampening, StepLR."""
    torch.manual_seed(harness.SEED + 408)
    model = TabularNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, dampening=0.1, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    accum = 4
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                optimizer.zero_grad()
                total = 0.0
                for micro in range(accum):
                    g = harness.gen(step, 70 + micro)
                    cats = torch.stack([torch.randint(0, c, (8,), generator=g) for c in (10, 7, 25)], dim=1)
                    nums = torch.randn(8, 6, generator=g)
                    y = nums[:, 0] * 2 + (cats[:, 1] == 3).float() + 0.1 * torch.randn(8, generator=g)
                    loss = F.mse_loss(model(cats, nums), y) / accum
                    audit.before_backward(loss)
                    loss.backward()
                    total += loss.item()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} mse {total:.4f}")


# ---------------------------------------------------------------- 9. Embedding + EmbeddingBag(mean) retrieval
class QueryItemModel(nn.Module):
    def __init__(self, vocab=120, tags=60, d=24):
        super().__init__()
        self.q_emb = nn.Embedding(vocab, d, padding_idx=0)
        self.q_proj = nn.Linear(d, d)
        self.tag_bag = nn.EmbeddingBag(tags, d, mode="mean")
        self.i_proj = nn.Linear(d, d)

    def forward(self, q_ids, tag_flat, offsets):
        q_mask = (q_ids != 0).float().unsqueeze(-1)
        q = (self.q_emb(q_ids) * q_mask).sum(1) / q_mask.sum(1).clamp(min=1)
        q = self.q_proj(q)
        i = self.i_proj(self.tag_bag(tag_flat, offsets))
        return q @ i.t()


def train_embbag_inbatch_retrieval(steps, make_audit):
    """Query/item retrieval: padded query tokens through nn.Embedding with masked mean, item tags through
    nn.EmbeddingBag(mode="mean") with offsets, in-batch softmax over the B x B score matrix, fused Adam."""
    torch.manual_seed(harness.SEED + 409)
    model = QueryItemModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3, fused=True)
    B = 8
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                rng = random.Random(harness.SEED * 1000 + step)  # Python-side bag sizes: identical on both runs
                bag_lens = [rng.randint(1, 5) for _ in range(B)]
                q_lens = [rng.randint(2, 10) for _ in range(B)]
                g = harness.gen(step, 75)
                q_ids, _ = harness.padded_ids(g, q_lens, 10, 120, 0, low=1)
                tag_flat = torch.randint(0, 60, (sum(bag_lens),), generator=g)
                offsets = torch.tensor([0] + bag_lens[:-1]).cumsum(0)
                scores = model(q_ids, tag_flat, offsets)
                loss = F.cross_entropy(scores / 0.5, torch.arange(B))
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 10. straight-through binary weights
class SignSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        return torch.sign(w)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * (w.abs() <= 1).to(grad.dtype)


class BinaryLinear(nn.Linear):
    def forward(self, x):
        scale = self.weight.abs().mean()
        return F.linear(x, SignSTE.apply(self.weight) * scale, self.bias)


def train_binary_weights_ste(steps, make_audit):
    """Binary-weight MLP: a custom torch.autograd.Function (sign forward, clipped straight-through
    backward) on the weights, BatchNorm1d + Hardtanh, Adam, latent weights clamp_'ed under no_grad."""
    torch.manual_seed(harness.SEED + 410)
    model = nn.Sequential(BinaryLinear(64, 128), nn.BatchNorm1d(128), nn.Hardtanh(),
                          BinaryLinear(128, 128), nn.BatchNorm1d(128), nn.Hardtanh(),
                          nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 76)
                x = torch.randn(16, 64, generator=g)
                y = torch.randint(0, 10, (16,), generator=g)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                with torch.no_grad():
                    for m in model:
                        if isinstance(m, BinaryLinear):
                            m.weight.clamp_(-1.0, 1.0)
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 11. VQ-VAE
class VectorQuantizer(nn.Module):
    def __init__(self, k=32, d=8):
        super().__init__()
        self.codebook = nn.Embedding(k, d)
        self.codebook.weight.data.uniform_(-1 / k, 1 / k)

    def forward(self, z_e):  # (B, D, H, W)
        B, D, H, W = z_e.shape
        flat = z_e.permute(0, 2, 3, 1).reshape(-1, D)
        cb = self.codebook.weight
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ cb.t() + cb.pow(2).sum(1)
        idx = dist.argmin(1)
        z_q = self.codebook(idx).view(B, H, W, D).permute(0, 3, 1, 2)
        vq_loss = F.mse_loss(z_q, z_e.detach()) + 0.25 * F.mse_loss(z_e, z_q.detach())
        z_st = z_e + (z_q - z_e).detach()
        return z_st, vq_loss, idx


class VQVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, 8, 3, 1, 1))
        self.vq = VectorQuantizer()
        self.dec = nn.Sequential(nn.ConvTranspose2d(8, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, 3, 3, 1, 1))

    def forward(self, x):
        z, vq_loss, idx = self.vq(self.enc(x))
        return self.dec(z), vq_loss, idx


def train_vqvae_codebook(steps, make_audit):
    """VQ-VAE: nearest codebook entry by expanded squared distance + argmin, codebook and commitment
    losses, straight-through z_e + (z_q - z_e).detach(), perplexity from one_hot, centered RMSprop."""
    torch.manual_seed(harness.SEED + 411)
    model = VQVAE()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, centered=True, momentum=0.5)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 77)
                x = torch.rand(4, 3, 16, 16, generator=g)
                recon, vq_loss, idx = model(x)
                loss = F.mse_loss(recon, x) + vq_loss
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                with torch.no_grad():
                    usage = F.one_hot(idx, 32).float().mean(0)
                    perplexity = torch.exp(-(usage * (usage + 1e-10).log()).sum())
            print(f"  step {step} loss {loss.item():.4f} perplexity {perplexity.item():.2f}")


# ---------------------------------------------------------------- 12. dict-returning model under bf16 autocast
class DictHeadsNet(nn.Module):
    def __init__(self, labels=6, coarse=3):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                                  nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(inplace=True),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.multi = nn.Linear(32, labels)
        self.coarse = nn.Linear(32, coarse)

    def forward(self, x):
        feat = self.body(x)
        return {"logits": self.multi(feat), "coarse": self.coarse(feat), "feat": feat}


def train_dict_output_bf16_plateau(steps, make_audit):
    """Conv net whose forward returns a dict (multi-label logits, coarse-class logits, features) under CPU
    bf16 autocast, BCE-with-logits + CE + feature L2, AdamW(foreach=True), ReduceLROnPlateau on loss.item()."""
    torch.manual_seed(harness.SEED + 412)
    model = DictHeadsNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=1)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 78)
                x = torch.randn(8, 3, 12, 12, generator=g)
                multi = (torch.rand(8, 6, generator=g) > 0.7).float()
                coarse = torch.randint(0, 3, (8,), generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                loss = (F.binary_cross_entropy_with_logits(out["logits"].float(), multi)
                        + 0.5 * F.cross_entropy(out["coarse"].float(), coarse)
                        + 1e-3 * out["feat"].float().pow(2).sum(1).mean())
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step(loss.item())
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 13. mini ViT, one checkpointed block, manual EMA
class ViTBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class MiniViT(nn.Module):
    def __init__(self, d=32, patch=4, size=16, heads=4, depth=3, classes=5):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 1 + (size // patch) ** 2, d) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(d, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.size(0), -1, -1), t], dim=1) + self.pos
        for i, blk in enumerate(self.blocks):
            t = torch.utils.checkpoint.checkpoint(blk, t, use_reentrant=False) if i == 1 else blk(t)
        return self.head(self.norm(t[:, 0]))


def train_vit_ckpt_manual_ema(steps, make_audit):
    """Mini ViT (Conv2d patchify, cls token, SDPA attention) with only the middle block under
    torch.utils.checkpoint(use_reentrant=False), RAdam, a hand-kept EMA of the parameters (lerp_ under
    no_grad after the step) and the grad norm logged with torch.stack of per-parameter norms."""
    torch.manual_seed(harness.SEED + 413)
    model = MiniViT()
    optimizer = torch.optim.RAdam(model.parameters(), lr=1e-3, weight_decay=0.05, decoupled_weight_decay=True)
    with make_audit(model, optimizer) as audit:
        ema = [p.detach().clone() for p in model.parameters()]
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 79)
                x = torch.randn(6, 3, 16, 16, generator=g)
                y = torch.randint(0, 5, (6,), generator=g)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                with torch.no_grad():
                    for e, p in zip(ema, model.parameters()):
                        e.lerp_(p, 0.01)
                gnorm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()
            print(f"  step {step} loss {loss.item():.4f} grad norm {gnorm.item():.3f}")


# ---------------------------------------------------------------- 14. DDPM noise prediction, in-place ops
class EpsMLP(nn.Module):
    def __init__(self, d=2, t_dim=16, h=128):
        super().__init__()
        self.t_dim = t_dim
        self.inp = nn.Linear(d + t_dim, h)
        self.act = nn.ReLU(inplace=True)
        self.hid = nn.ModuleList(nn.Linear(h, h) for _ in range(2))
        self.out = nn.Linear(h, d)

    def time_embed(self, t):
        half = self.t_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        args = t.float().unsqueeze(1) * freqs.unsqueeze(0)
        return torch.cat([args.sin(), args.cos()], dim=1)

    def forward(self, x, t):
        h = self.act(self.inp(torch.cat([x, self.time_embed(t)], dim=1)))
        for lin in self.hid:
            y = lin(h)
            y.add_(h)  # pre-activation residual, in place on the Linear output
            h = self.act(y)
        return self.out(h)


def train_ddpm_inplace(steps, make_audit):
    """DDPM on 2-D swiss-roll points: linear beta schedule and cumprod alphas, per-sample timesteps
    gathered from it, sinusoidal time embedding, MLP with ReLU(inplace=True) and add_ residuals, Adam,
    PolynomialLR."""
    torch.manual_seed(harness.SEED + 414)
    model = EpsMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=10, power=2.0)
    T = 100
    with make_audit(model, optimizer) as audit:
        betas = torch.linspace(1e-4, 0.02, T)
        alphas_bar = torch.cumprod(1 - betas, dim=0)
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 80)
                s = torch.rand(32, generator=g) * 3 * math.pi + 1.5
                x0 = torch.stack([s * torch.cos(s), s * torch.sin(s)], dim=1) / 10
                t = torch.randint(0, T, (32,), generator=g)
                noise = torch.randn(32, 2, generator=g)
                ab = alphas_bar.gather(0, t).unsqueeze(1)
                xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
                loss = F.mse_loss(model(xt, t), noise)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f}")


LOOPS = [train_resnet_manual_warmup, train_gru_tbptt_asgd, train_conv_vae_rprop, train_supcon_logsumexp,
         train_mdn_logsumexp, train_gpt_triu_mask_tied, train_dense_gcn_linkpred, train_tabular_accum4,
         train_embbag_inbatch_retrieval, train_binary_weights_ste, train_vqvae_codebook,
         train_dict_output_bf16_plateau, train_vit_ckpt_manual_ema, train_ddpm_inplace]


def main():
    harness.main(LOOPS)  # its seed, --only and printout


if __name__ == "__main__":
    main()
