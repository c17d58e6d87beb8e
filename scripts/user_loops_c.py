"""The shadow run of a script as written against an Audit of it, on 14 more training loops written as
users write them, in plain torch, none drawn from scripts/zoo.py, scripts/user_loops.py or
scripts/user_loops_b.py (a hand-unrolled GRUCell, top-k routed experts via topk/gather/index_add, a
weight-tied autoencoder, prototypical networks with cdist, unfold/fold patches, double backprop, an EMA
model, ...).

Each loop is one function `train_X(steps, make_audit)`, run by `user_loops.check` exactly as the loops of
scripts/user_loops.py are: the audited run (3 steps, step 2 recorded) and the shadow run (10 steps, the
tool stops it after step 2).

    python scripts/user_loops_c.py [--seed=S] [--only=name,name]
"""

import math

import torch
from torch import nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import user_loops as harness


# ---------------------------------------------------------------- 1. GRUCell unrolled by hand
class CellTagger(nn.Module):
    def __init__(self, vocab=50, e=16, h=32, tags=5):
        super().__init__()
        self.h = h
        self.emb = nn.Embedding(vocab, e)
        self.cell = nn.GRUCell(e, h)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(h, tags)

    def forward(self, ids):
        x = self.emb(ids)
        h = torch.zeros(ids.size(0), self.h)
        outs = []
        for t in range(ids.size(1)):
            h = self.cell(x[:, t], h)
            outs.append(h)
        return self.out(self.drop(torch.stack(outs, dim=1)))


def train_gru_cell_unrolled(steps, make_audit):
    """Sequence tagger with nn.GRUCell unrolled in a Python loop, hidden states stacked, RMSprop with
    momentum, clip_grad_norm_(foreach=False)."""
    torch.manual_seed(harness.SEED + 201)
    model = CellTagger()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 31)
                ids = torch.randint(0, 50, (6, 12), generator=g)
                tags = torch.randint(0, 5, (6, 12), generator=g)
                logits = model(ids)
                loss = F.cross_entropy(logits.reshape(-1, 5), tags.reshape(-1))
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 2. top-k mixture of experts
class TopKMoE(nn.Module):
    """Top-2 routing without boolean masks: every (token, slot) pair gathers its expert's weights."""

    def __init__(self, d=32, h=64, experts=4, k=2):
        super().__init__()
        self.k, self.experts = k, experts
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, h) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, h, d) * h ** -0.5)

    def forward(self, x):  # (N, d)
        n = x.size(0)
        probs = self.router(x).softmax(-1)
        _, topi = torch.topk(probs, self.k, dim=-1)
        gate = probs.gather(1, topi)
        gate = gate / gate.sum(-1, keepdim=True)
        tok = torch.arange(n).unsqueeze(1).expand(n, self.k).reshape(-1)
        eid = topi.reshape(-1)
        xin = x.index_select(0, tok)
        hid = F.gelu(torch.bmm(xin.unsqueeze(1), self.w1[eid]))
        y = torch.bmm(hid, self.w2[eid]).squeeze(1) * gate.reshape(-1, 1)
        out = torch.zeros_like(x).index_add(0, tok, y)
        load = torch.zeros(self.experts).index_add(0, eid, torch.ones(eid.numel())) / eid.numel()
        aux = self.experts * (load * probs.mean(0)).sum()
        return out, aux


class MoEClassifier(nn.Module):
    def __init__(self, vocab=64, d=32, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.moe = TopKMoE(d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        B, T = ids.shape
        x = self.emb(ids)
        y, aux = self.moe(self.norm(x).reshape(B * T, -1))
        x = x + y.view(B, T, -1)
        return self.head(x.mean(1)), aux


def train_moe_topk_index_add(steps, make_audit):
    """Top-2 mixture of experts (topk + gather + index_select/index_add), load-balancing aux loss,
    Adam with amsgrad, OneCycleLR."""
    torch.manual_seed(harness.SEED + 202)
    model = MoEClassifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=12)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 32)
                ids = torch.randint(0, 64, (4, 10), generator=g)
                y = torch.randint(0, 4, (4,), generator=g)
                logits, aux = model(ids)
                loss = F.cross_entropy(logits, y) + 0.01 * aux
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f} aux {aux.item():.3f}")


# ---------------------------------------------------------------- 3. weight-tied denoising autoencoder
class TiedAE(nn.Module):
    def __init__(self, d=64, h=24):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h, d) * 0.1)
        self.b_enc = nn.Parameter(torch.zeros(h))
        self.b_dec = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        code = torch.sigmoid(F.linear(x, self.weight, self.b_enc))
        return F.linear(code, self.weight.t(), self.b_dec), code


def train_tied_autoencoder(steps, make_audit):
    """Denoising autoencoder whose decoder is F.linear with the encoder weight transposed, sparsity
    penalty, SGD nesterov, zero_grad(set_to_none=False)."""
    torch.manual_seed(harness.SEED + 203)
    model = TiedAE()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 33)
                x = torch.rand(16, 64, generator=g)
                noisy = x * (torch.rand(16, 64, generator=g) > 0.3).float()
                recon, code = model(noisy)
                loss = F.mse_loss(recon, x) + 1e-3 * code.abs().sum(1).mean()
                optimizer.zero_grad(set_to_none=False)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 4. TransformerEncoder with padding mask
class PaddedEncoder(nn.Module):
    def __init__(self, vocab=100, d=32, T=20, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(T, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids, lengths):
        T = ids.size(1)
        pad = torch.arange(T).unsqueeze(0) >= lengths.unsqueeze(1)
        h = self.emb(ids) + self.pos(torch.arange(T))
        h = self.enc(h, src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))


def train_transformer_encoder_padmask(steps, make_audit):
    """nn.TransformerEncoder (pre-norm) with src_key_padding_mask from lengths, masked mean pooling,
    NAdam with decay / no-decay param groups, CosineAnnealingWarmRestarts."""
    torch.manual_seed(harness.SEED + 204)
    model = PaddedEncoder()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "emb" not in n and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "emb" not in n and "pos" not in n)]
    optimizer = torch.optim.NAdam([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=3, T_mult=2)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 34)
                lengths = torch.randint(5, 21, (5,), generator=g)
                ids = torch.randint(1, 100, (5, 20), generator=g)
                ids = ids.masked_fill(torch.arange(20).unsqueeze(0) >= lengths.unsqueeze(1), 0)
                y = torch.randint(0, 4, (5,), generator=g)
                loss = F.cross_entropy(model(ids, lengths), y)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")


# ---------------------------------------------------------------- 5. prototypical network with cdist
def train_protonet_cdist(steps, make_audit):
    """Few-shot prototypical network: episodes built with torch.stack over classes, prototypes as
    support means, torch.cdist to them, plus a pairwise_distance contrastive term, Adamax."""
    torch.manual_seed(harness.SEED + 205)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    optimizer = torch.optim.Adamax(model.parameters(), lr=2e-3)
    n_way, k_shot, n_query = 5, 3, 4
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 35)
                support, query = [], []
                for c in range(n_way):
                    center = torch.randn(20, generator=g) * 2
                    support.append(center + torch.randn(k_shot, 20, generator=g))
                    query.append(center + torch.randn(n_query, 20, generator=g))
                support = torch.stack(support)  # (way, shot, 20)
                query = torch.cat(query)  # (way * query, 20)
                labels = torch.arange(n_way).repeat_interleave(n_query)
                protos = model(support.view(-1, 20)).view(n_way, k_shot, -1).mean(1)
                zq = model(query)
                logits = -torch.cdist(zq, protos).pow(2)
                ce = F.cross_entropy(logits, labels)
                same = (labels[:-1] == labels[1:]).float()
                dist = F.pairwise_distance(zq[:-1], zq[1:])
                contrast = (same * dist.pow(2) + (1 - same) * F.relu(2.0 - dist).pow(2)).mean()
                loss = ce + 0.1 * contrast
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 6. GroupNorm + ConvTranspose2d decoder
class GLODecoder(nn.Module):
    """Generative latent optimisation: per-sample latent codes learned with the decoder."""

    def __init__(self, n=64, z=8):
        super().__init__()
        self.codes = nn.Embedding(n, z)
        self.fc = nn.Linear(z, 32 * 4 * 4)
        self.up = nn.Sequential(
            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
            nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
            nn.Conv2d(8, 1, 3, padding=1),
        )

    def forward(self, idx):
        return self.up(self.fc(self.codes(idx)).view(-1, 32, 4, 4))


def train_groupnorm_deconv_glo(steps, make_audit):
    """GLO-style decoder (Linear -> ConvTranspose2d + GroupNorm + SiLU) fit to a fixed image set
    under CPU bf16 autocast, Adam, clip_grad_norm_(foreach=False)."""
    torch.manual_seed(harness.SEED + 206)
    images = torch.rand(64, 1, 16, 16)
    model = GLODecoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                idx = torch.randint(0, 64, (8,), generator=harness.gen(step, 36))
                target = images[idx]
                with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                    out = model(idx)
                loss = F.mse_loss(out.float(), target)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
                optimizer.step()
            print(f"  step {step} mse {loss.item():.4f}")


# ---------------------------------------------------------------- 7. mixup + label smoothing
class SmallCNN(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.b2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = F.max_pool2d(self.b1(self.c1(x)).relu_(), 2)
        x = F.relu(self.b2(self.c2(x)), inplace=True)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def train_mixup_smoothing_onecycle(steps, make_audit):
    """CNN with in-place ReLUs, mixup on the inputs (Beta-sampled lambda, randperm partner), soft
    label-smoothed targets with a hand-written soft cross-entropy, SGD + weight decay, OneCycleLR."""
    torch.manual_seed(harness.SEED + 207)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=12)
    beta = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4))
    eps = 0.1
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 37)
                x = torch.randn(8, 3, 12, 12, generator=g)
                y = torch.randint(0, 10, (8,), generator=g)
                perm = torch.randperm(8, generator=g)
                lam = beta.sample()
                mixed = lam * x + (1 - lam) * x[perm]
                soft = F.one_hot(y, 10).float() * (1 - eps) + eps / 10
                target = lam * soft + (1 - lam) * soft[perm]
                logits = model(mixed)
                loss = torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} loss {loss.item():.4f} lam {lam.item():.2f}")


# ---------------------------------------------------------------- 8. checkpointed conv blocks + accumulation
class ResBlock1d(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(c, c, 5, padding=2), nn.BatchNorm1d(c), nn.ReLU(),
                                  nn.Conv1d(c, c, 5, padding=2), nn.BatchNorm1d(c))

    def forward(self, x):
        return F.relu(x + self.body(x))


class CkptSignalNet(nn.Module):
    def __init__(self, c=24, blocks=3, classes=6):
        super().__init__()
        self.stem = nn.Conv1d(2, c, 7, padding=3)
        self.blocks = nn.ModuleList(ResBlock1d(c) for _ in range(blocks))
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.stem(x)
        for blk in self.blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
        return self.head(x.mean(-1))


def train_checkpoint_accum_conv1d(steps, make_audit):
    """1-D residual conv net on 2-channel signals, every block under torch.utils.checkpoint
    (use_reentrant=False), 3 micro-steps of gradient accumulation, RAdam."""
    torch.manual_seed(harness.SEED + 208)
    model = CkptSignalNet()
    optimizer = torch.optim.RAdam(model.parameters(), lr=1e-3)
    accum = 3
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                running = 0.0
                for micro in range(accum):
                    g = harness.gen(step, 40 + micro)
                    x = torch.randn(4, 2, 48, generator=g)
                    y = torch.randint(0, 6, (4,), generator=g)
                    loss = F.cross_entropy(model(x), y) / accum
                    audit.before_backward(loss)
                    loss.backward()
                    running += loss.item()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {running:.4f}")


# ---------------------------------------------------------------- 9. frozen backbone fine-tuning
class FineTuneNet(nn.Module):
    def __init__(self, classes=7):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, classes))

    def forward(self, x):
        return self.head(self.backbone(x))


def train_frozen_backbone_bf16(steps, make_audit):
    """Fine-tuning: the first two conv stages frozen with requires_grad_(False) (their BatchNorms kept
    in eval), optimizer over the trainable parameters only, CPU bf16 autocast, Adagrad."""
    torch.manual_seed(harness.SEED + 209)
    model = FineTuneNet()
    for m in model.backbone[:6]:
        m.requires_grad_(False)
    optimizer = torch.optim.Adagrad([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                model.train()
                model.backbone[1].eval()
                model.backbone[4].eval()
                g = harness.gen(step, 38)
                x = torch.randn(8, 3, 16, 16, generator=g)
                y = torch.randint(0, 7, (8,), generator=g)
                with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 10. chunked LM loss, max_norm embedding
class MaxNormLSTMLM(nn.Module):
    def __init__(self, vocab=200, e=24, h=48):
        super().__init__()
        self.emb = nn.Embedding(vocab, e, padding_idx=0, max_norm=1.0)
        self.rnn = nn.LSTM(e, h, batch_first=True)
        self.head = nn.Linear(h, vocab)

    def forward(self, ids):
        return self.rnn(self.emb(ids))[0]


def train_chunked_loss_maxnorm_emb(steps, make_audit):
    """LSTM LM with nn.Embedding(padding_idx=0, max_norm=1.0); the vocab projection and loss computed
    chunk by chunk over time (summed, divided by the real token count), Adadelta."""
    torch.manual_seed(harness.SEED + 210)
    model = MaxNormLSTMLM()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 39)
                ids, _ = harness.padded_ids(g, [25, 19, 11, 25], 25, 200, 0, low=1)
                inp, tgt = ids[:, :-1], ids[:, 1:]
                hidden = model(inp)
                total = 0.0
                for h_c, t_c in zip(hidden.split(8, dim=1), tgt.split(8, dim=1)):
                    logits = model.head(h_c)
                    total = total + F.cross_entropy(logits.reshape(-1, 200), t_c.reshape(-1), ignore_index=0,
                                                    reduction="sum")
                loss = total / (tgt != 0).sum().clamp(min=1)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- 11. unfold / fold patch denoiser
class PatchDenoiser(nn.Module):
    """Overlapping 4x4 patches (stride 2) via F.unfold, an MLP-mixer over them, F.fold back with
    overlap normalisation."""

    def __init__(self, c=3, k=4, stride=2, size=16, d=64):
        super().__init__()
        self.k, self.stride, self.size = k, stride, size
        pd = c * k * k
        n = ((size + 2 - k) // stride + 1) ** 2
        self.inp = nn.Linear(pd, d)
        self.norm = nn.LayerNorm(d)
        self.token_mix = nn.Linear(n, n)
        self.channel_mix = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.out = nn.Linear(d, pd)

    def forward(self, x):
        kw = dict(kernel_size=self.k, stride=self.stride, padding=1)
        patches = F.unfold(x, **kw)  # (B, C*k*k, L)
        t = self.inp(patches.transpose(1, 2))
        t = t + self.token_mix(self.norm(t).transpose(1, 2)).transpose(1, 2)
        t = t + self.channel_mix(self.norm(t))
        rec = self.out(t).transpose(1, 2)
        counts = F.fold(torch.ones_like(patches), (self.size, self.size), **kw)
        return F.fold(rec, (self.size, self.size), **kw) / counts


def train_unfold_fold_denoiser(steps, make_audit):
    """Patch-based image denoiser with F.unfold / F.fold, residual mixer, Adam, CosineAnnealingWarmRestarts."""
    torch.manual_seed(harness.SEED + 211)
    model = PatchDenoiser()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=2, T_mult=2, eta_min=1e-5)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 41)
                clean = torch.rand(4, 3, 16, 16, generator=g)
                noisy = clean + 0.1 * torch.randn(4, 3, 16, 16, generator=g)
                loss = F.mse_loss(model(noisy), clean)
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
            print(f"  step {step} mse {loss.item():.4f}")


# ---------------------------------------------------------------- 12. in-place residual MLP
class InplaceResMLP(nn.Module):
    def __init__(self, d=16, h=64, blocks=3):
        super().__init__()
        self.fc_in = nn.Linear(d, h)
        self.blocks = nn.ModuleList(nn.ModuleList([nn.Linear(h, h), nn.Linear(h, h)]) for _ in range(blocks))
        self.fc_out = nn.Linear(h, 1)
        self.res_scale = 0.5

    def forward(self, x):
        h = self.fc_in(x)
        h.relu_()
        for fc1, fc2 in self.blocks:
            y = fc1(h)
            y.relu_()
            y = fc2(y)
            y.mul_(self.res_scale)
            y.add_(h)
            h = y
        return self.fc_out(h).squeeze(-1)


def train_inplace_resmlp(steps, make_audit):
    """Regression MLP whose forward uses relu_, mul_ and add_ on intermediates, Huber loss, two param
    groups (weights with decay, biases without), SGD momentum, zero_grad(set_to_none=False),
    clip_grad_norm_(foreach=False)."""
    torch.manual_seed(harness.SEED + 212)
    model = InplaceResMLP()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.SGD([{"params": weights, "weight_decay": 1e-3}, {"params": biases, "weight_decay": 0.0}],
                                lr=0.01, momentum=0.9)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 42)
                x = torch.randn(32, 16, generator=g)
                y = torch.sin(x[:, :3]).sum(-1) + 0.05 * torch.randn(32, generator=g)
                loss = F.huber_loss(model(x), y, delta=0.5)
                optimizer.zero_grad(set_to_none=False)
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0, foreach=False)
                optimizer.step()
            print(f"  step {step} huber {loss.item():.4f}")


# ---------------------------------------------------------------- 13. double backprop
def train_double_backprop_gradreg(steps, make_audit):
    """Input-gradient regularisation (double backprop): torch.autograd.grad(create_graph=True) of the
    cross-entropy w.r.t. the input, its squared norm added to the loss, Adam."""
    torch.manual_seed(harness.SEED + 213)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Softplus(), nn.Linear(64, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 43)
                x = torch.randn(16, 16, generator=g).requires_grad_(True)
                y = torch.randint(0, 3, (16,), generator=g)
                ce = F.cross_entropy(model(x), y)
                (gx,) = torch.autograd.grad(ce, x, create_graph=True)
                loss = ce + 0.1 * gx.pow(2).sum(1).mean()
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} loss {loss.item():.4f} (ce {ce.item():.3f})")


# ---------------------------------------------------------------- 14. EMA of a dilated causal conv net
class DilatedForecaster(nn.Module):
    def __init__(self, c=16, layers=3):
        super().__init__()
        self.inp = nn.Conv1d(1, c, 1)
        self.convs = nn.ModuleList(nn.Conv1d(c, c, 2, dilation=2 ** i) for i in range(layers))
        self.out = nn.Conv1d(c, 1, 1)

    def forward(self, x):
        h = self.inp(x)
        for conv in self.convs:
            h = h + torch.tanh(conv(F.pad(h, (conv.dilation[0], 0))))
        return self.out(h)


def train_ema_dilated_conv(steps, make_audit):
    """WaveNet-like causal dilated Conv1d forecaster, NAdam with decoupled weight decay, an EMA copy
    (swa_utils.AveragedModel with get_ema_multi_avg_fn) updated every step and evaluated under no_grad."""
    torch.manual_seed(harness.SEED + 214)
    model = DilatedForecaster()
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    optimizer = torch.optim.NAdam(model.parameters(), lr=2e-3, weight_decay=1e-2, decoupled_weight_decay=True)
    t = torch.linspace(0, 12, 65)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = harness.gen(step, 44)
                phase = torch.rand(8, 1, generator=g) * 6.28
                series = (torch.sin(t + phase) + 0.1 * torch.randn(8, 65, generator=g)).unsqueeze(1)
                pred = model(series[..., :-1])
                loss = F.mse_loss(pred, series[..., 1:])
                optimizer.zero_grad()
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                ema.update_parameters(model)
                with torch.no_grad():
                    ema_loss = F.mse_loss(ema(series[..., :-1]), series[..., 1:])
            print(f"  step {step} mse {loss.item():.4f} ema {ema_loss.item():.4f}")


LOOPS = [train_gru_cell_unrolled, train_moe_topk_index_add, train_tied_autoencoder, train_transformer_encoder_padmask,
         train_protonet_cdist, train_groupnorm_deconv_glo, train_mixup_smoothing_onecycle,
         train_checkpoint_accum_conv1d, train_frozen_backbone_bf16, train_chunked_loss_maxnorm_emb,
         train_unfold_fold_denoiser, train_inplace_resmlp, train_double_backprop_gradreg, train_ema_dilated_conv]


def main():
    harness.main(LOOPS)  # its seed, --only and printout


if __name__ == "__main__":
    main()
