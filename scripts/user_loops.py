"""The shadow run of a script as written against an Audit of it, on 21 training loops written as
users write them, none drawn from scripts/zoo.py (transformers models from tiny configs, plain
torch models: CTC, scatter-add graph nets, autoencoders, SimCLR, EmbeddingBag, ...).

Each loop is one function `train_X(steps, make_audit)`: it seeds, builds its model, optimizer
(and scheduler), then runs `steps` steps. `make_audit(model, optimizer)` returns the real Audit
(audited run, 3 steps, step 2 recorded) or a do-nothing stand-in (shadow run: the same code
inside `with memory_audit.shadow()`, 10 steps, the tool stops it after step 2).

    python scripts/user_loops.py [--seed=S] [--only=name,name]
"""

import argparse
import contextlib
import gc
import math
import os
import random
import shutil
import sys
import tempfile
import traceback

import torch
from torch import nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensor

import memory_audit
from memory_audit import Audit
from memory_audit.comparison.reconcile import first_divergence, measure, step_events

SEED = 0  # set in main (drawn fresh)
STATS = []  # (peak exact, lines equal, events equal, 0 unattributed) per loop that ran on both sides
COUNTS = {}  # real sizes of data-dependent shapes, recorded on the audited (real) run


class NoAudit:
    """The shadow side's stand-in: no tensor op, no state."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self, i):
        return contextlib.nullcontext()

    def before_backward(self, loss):
        pass


def gen(step, salt=0):
    return torch.Generator().manual_seed(SEED * 1000 + step * 17 + salt)


def padded_ids(g, lengths, T, vocab, pad, low=3):
    """Token ids padded on the right with `pad`, and the 0/1 attention mask."""
    B = len(lengths)
    ids = torch.randint(low, vocab, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = ids.masked_fill(mask == 0, pad)
    return ids, mask


# ---------------------------------------------------------------- transformers loops
def train_distilbert_cls(steps, make_audit):
    """DistilBERT sequence classification, real padding, AdamW with no-decay groups,
    clip_grad_norm_, linear warmup schedule, loss printed."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification, get_linear_schedule_with_warmup
    torch.manual_seed(SEED)
    cfg = DistilBertConfig(vocab_size=500, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                           max_position_embeddings=64, num_labels=3)
    model = DistilBertForSequenceClassification(cfg)
    model.train()
    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=5e-4)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                input_ids, attention_mask = padded_ids(g, [24, 17, 9, 20], 24, 500, 0)
                labels = torch.randint(0, 3, (4,), generator=g)
                out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
                loss = out.loss
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f}")


def roberta_batch(step, count=False):
    """A data collator's masked-LM batch: 15% of the real tokens masked, the rest -100.
    count=True (the harness, outside any run): how many labels the boolean setitem writes."""
    g = gen(step)
    ids, attention_mask = padded_ids(g, [30, 22, 14], 30, 300, 1)
    labels = ids.clone()
    pick = (torch.rand(ids.shape, generator=g) < 0.15) & (attention_mask == 1)
    if count:
        return int((~pick).sum())
    labels[~pick] = -100  # ASSUME-R
    input_ids = ids.masked_fill(pick, 4)  # <mask>
    return input_ids, attention_mask, labels


def train_roberta_mlm(steps, make_audit):
    """RoBERTa masked LM (eager attention), padding id 1, 15% masking, SGD nesterov."""
    from transformers import RobertaConfig, RobertaForMaskedLM
    torch.manual_seed(SEED + 1)
    cfg = RobertaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=40, type_vocab_size=1, pad_token_id=1,
                        attn_implementation="eager")
    model = RobertaForMaskedLM(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                input_ids, attention_mask, labels = roberta_batch(step)
                loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            if step % 2 == 0:
                print(f"  step {step} mlm loss {loss.item():.3f}")


def train_gptneox_bf16(steps, make_audit):
    """GPT-NeoX causal LM under bf16 autocast, fused AdamW."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    torch.manual_seed(SEED + 2)
    cfg = GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, rotary_pct=0.25, max_position_embeddings=64)
    model = GPTNeoXForCausalLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=True)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                x = torch.randint(0, 256, (3, 32), generator=gen(step))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            print(f"  step {step}: {loss.item():.4f}")


def train_opt_accum(steps, make_audit):
    """OPT causal LM, right padding with -100 labels, 2 micro-batches per optimizer step, NAdam."""
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(SEED + 3)
    cfg = OPTConfig(vocab_size=300, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                    max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1)
    model = OPTForCausalLM(cfg)
    optimizer = torch.optim.NAdam(model.parameters(), lr=1e-3)
    accum = 2
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                for micro in range(accum):
                    ids, attention_mask = padded_ids(gen(step, micro), [20, 13], 20, 300, 1)
                    labels = ids.masked_fill(attention_mask == 0, -100)
                    loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss / accum
                    audit.before_backward(loss)
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item() * accum:.3f}")


def train_falcon_ckpt(steps, make_audit):
    """Falcon (multi-query, parallel attention) with the library's gradient checkpointing, eager, RAdam."""
    from transformers import FalconConfig, FalconForCausalLM
    torch.manual_seed(SEED + 4)
    cfg = FalconConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       multi_query=True, parallel_attn=True, new_decoder_architecture=False, alibi=False,
                       attn_implementation="eager")
    model = FalconForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.RAdam(model.parameters(), lr=1e-3)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                x = torch.randint(0, 256, (2, 24), generator=gen(step))
                loss = model(input_ids=x, labels=x).loss
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f}")


def train_phi_bf16(steps, make_audit):
    """Phi causal LM (partial rotary) in bf16 autocast, Adamax, StepLR."""
    from transformers import PhiConfig, PhiForCausalLM
    torch.manual_seed(SEED + 5)
    cfg = PhiConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    partial_rotary_factor=0.5, max_position_embeddings=64)
    model = PhiForCausalLM(cfg)
    optimizer = torch.optim.Adamax(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                x = torch.randint(0, 256, (4, 16), generator=gen(step))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(input_ids=x).logits
                    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1))
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")


def train_whisper(steps, make_audit):
    """Whisper encoder-decoder from a tiny config: log-mel features in, padded labels, AdamW, cosine LR."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(SEED + 6)
    cfg = WhisperConfig(vocab_size=120, num_mel_bins=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        d_model=32, max_source_positions=32, max_target_positions=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[],
                        begin_suppress_tokens=[])
    model = WhisperForConditionalGeneration(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                feats = torch.randn(2, 16, 64, generator=g)
                labels, lab_mask = padded_ids(g, [12, 7], 12, 120, 0)
                labels = labels.masked_fill(lab_mask == 0, -100)
                loss = model(input_features=feats, labels=labels).loss
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.3f}")


def train_bart_smooth(steps, make_audit):
    """BART seq2seq, padded sources, own label-smoothed loss on the logits, Adagrad."""
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(SEED + 7)
    cfg = BartConfig(vocab_size=200, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    model = BartForConditionalGeneration(cfg)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    criterion = nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                src, src_mask = padded_ids(g, [18, 11, 6], 18, 200, 1)
                tgt, tgt_mask = padded_ids(g, [9, 5, 9], 9, 200, 1)
                dec_in = torch.cat([torch.full((3, 1), 2), tgt[:, :-1]], dim=1)
                labels = tgt.masked_fill(tgt_mask == 0, -100)
                logits = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec_in).logits
                loss = criterion(logits.view(-1, logits.size(-1)), labels.view(-1))
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.3f}")


def train_electra_disc(steps, make_audit):
    """ELECTRA discriminator (replaced-token detection), padding mask, SGD momentum + weight decay,
    clip_grad_value_."""
    from transformers import ElectraConfig, ElectraForPreTraining
    torch.manual_seed(SEED + 8)
    cfg = ElectraConfig(vocab_size=250, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    model = ElectraForPreTraining(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                ids, attention_mask = padded_ids(g, [28, 28, 19, 8], 28, 250, 0)
                replaced = (torch.rand(ids.shape, generator=g) < 0.2).long() * attention_mask
                loss = model(input_ids=ids, attention_mask=attention_mask, labels=replaced).loss
                audit.before_backward(loss)
                loss.backward()
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f}")


def train_mobilebert(steps, make_audit):
    """MobileBERT (bottlenecks, NoNorm) sequence classification with padding, Adam amsgrad."""
    from transformers import MobileBertConfig, MobileBertForSequenceClassification
    torch.manual_seed(SEED + 9)
    cfg = MobileBertConfig(vocab_size=200, hidden_size=32, embedding_size=16, intra_bottleneck_size=16,
                           true_hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                           num_feedforward_networks=2, max_position_embeddings=64, num_labels=2)
    model = MobileBertForSequenceClassification(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                ids, attention_mask = padded_ids(g, [16, 10, 16, 4, 12], 16, 200, 0)
                labels = torch.randint(0, 2, (5,), generator=g)
                loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f}")


# ---------------------------------------------------------------- plain torch loops
class AudioNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        layers, c = [], 1
        for o, k, s in [(16, 9, 4), (32, 5, 2), (32, 3, 1)]:
            layers += [nn.Conv1d(c, o, k, stride=s, padding=k // 2), nn.BatchNorm1d(o), nn.GELU(), nn.MaxPool1d(2)]
            c = o
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, wav):
        return self.fc(self.pool(self.features(wav)).squeeze(-1))


def train_conv1d_audio(steps, make_audit):
    """1-D conv audio classifier, in-memory dataset sliced per step, centered RMSprop, OneCycleLR."""
    torch.manual_seed(SEED + 10)
    waves = torch.randn(64, 1, 1600)
    targets = torch.randint(0, 10, (64,))
    model = AudioNet()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=20)
    B = 8
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                x, y = waves[step * B:(step + 1) * B], targets[step * B:(step + 1) * B]
                loss = F.cross_entropy(model(x), y)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f}")


class GraphNet(nn.Module):
    """GCN-style message passing with scatter_add / index_add_."""

    def __init__(self, d_in, d_hid, classes, layers=2):
        super().__init__()
        dims = [d_in] + [d_hid] * (layers - 1) + [classes]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.drop = nn.Dropout(0.2)

    def forward(self, x, edge_index):
        src, dst = edge_index
        n = x.size(0)
        deg = torch.zeros(n).index_add_(0, dst, torch.ones(dst.numel())) + 1.0
        norm = deg.rsqrt()
        for i, lin in enumerate(self.lins):
            h = lin(x)
            msg = h[src] * (norm[src] * norm[dst]).unsqueeze(-1)
            agg = torch.zeros_like(h).scatter_add(0, dst.unsqueeze(-1).expand_as(msg), msg)
            x = agg + h * (norm * norm).unsqueeze(-1)
            if i < len(self.lins) - 1:
                x = self.drop(F.relu(x))
        return x


def train_gnn_scatter(steps, make_audit):
    """Full-graph node classification (Planetoid style): train_mask boolean indexing (data-dependent:
    the shadow is given the real count), Adam with weight decay."""
    torch.manual_seed(SEED + 11)
    N, E = 300, 1200
    feats = torch.randn(N, 24)
    edge_index = torch.randint(0, N, (2, E))
    y = torch.randint(0, 5, (N,))
    train_mask = torch.rand(N) < 0.4
    if not isinstance(train_mask, FakeTensor):
        COUNTS["gnn_scatter"] = int(train_mask.sum())
    model = GraphNet(24, 32, 5, layers=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                out = model(feats, edge_index)
                logits = out[train_mask]  # ASSUME-A
                target = y[train_mask]  # ASSUME-B
                loss = F.cross_entropy(logits, target)
                audit.before_backward(loss)
                loss.backward()  # ASSUME-C
                optimizer.step()
                optimizer.zero_grad()
            print(f"  epoch {step} loss {loss.item():.4f}")


class TinyCaptioner(nn.Module):
    """nn.TransformerDecoder over a projected 'image feature' memory, tied input/output embedding."""

    def __init__(self, vocab=150, d=32, heads=4, layers=2, feat=20, max_len=32, pad=0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=pad)
        self.pos = nn.Parameter(torch.randn(1, max_len, d) * 0.02)
        self.mem_proj = nn.Linear(feat, d)
        layer = nn.TransformerDecoderLayer(d, heads, 2 * d, dropout=0.1, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, layers)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight  # weight tying

    def forward(self, tokens, feats, pad_mask):
        T = tokens.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(T)
        x = self.embed(tokens) + self.pos[:, :T]
        h = self.decoder(x, self.mem_proj(feats), tgt_mask=causal, tgt_key_padding_mask=pad_mask, tgt_is_causal=True)
        return self.out(h)


def train_transformer_decoder(steps, make_audit):
    """nn.TransformerDecoder captioner: causal + key padding masks, tied weights, label smoothing,
    AdamW with a LambdaLR warmup."""
    torch.manual_seed(SEED + 12)
    model = TinyCaptioner()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    criterion = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                tokens, mask = padded_ids(g, [20, 15, 9, 20], 20, 150, 0)
                feats = torch.randn(4, 7, 20, generator=g)
                logits = model(tokens[:, :-1], feats, mask[:, :-1] == 0)
                loss = criterion(logits.reshape(-1, 150), tokens[:, 1:].reshape(-1))
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.3f}")


class ConvAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.LeakyReLU(0.2),
                                 nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.LeakyReLU(0.2))
        self.dec = nn.Sequential(nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.ConvTranspose2d(16, 1, 4, stride=2, padding=1), nn.Sigmoid())

    def forward(self, x):
        return self.dec(self.enc(x))


def train_conv_autoencoder(steps, make_audit):
    """Conv/ConvTranspose autoencoder with BCE reconstruction; a no_grad validation pass in eval mode
    at the start of each step; Adam + StepLR."""
    torch.manual_seed(SEED + 13)
    images = torch.rand(48, 1, 28, 28)
    val = torch.rand(8, 1, 28, 28)
    model = ConvAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
    B = 12
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                model.eval()
                with torch.no_grad():
                    val_loss = F.mse_loss(model(val), val)
                model.train()
                x = images[(step * B) % 48:(step * B) % 48 + B]
                recon = model(x)
                loss = F.binary_cross_entropy(recon, x)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            print(f"  step {step} train {loss.item():.4f} val {val_loss.item():.4f}")


class ResMLP(nn.Module):
    def __init__(self, d=64, blocks=4, classes=10, ckpt_every=2):
        super().__init__()
        self.inp = nn.Linear(40, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(4 * d, d)) for _ in range(blocks))
        self.head = nn.Linear(d, classes)
        self.ckpt_every = ckpt_every

    def forward(self, x):
        x = self.inp(x)
        for i, blk in enumerate(self.blocks):
            if self.training and i % self.ckpt_every == 0:
                x = x + torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = x + blk(x)
        return self.head(x)


def train_checkpoint_resmlp(steps, make_audit):
    """Residual MLP, torch.utils.checkpoint on every other block, SGD momentum, clip_grad_norm_."""
    torch.manual_seed(SEED + 14)
    model = ResMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                x, y = torch.randn(32, 40, generator=g), torch.randint(0, 10, (32,), generator=g)
                loss = F.cross_entropy(model(x), y)
                audit.before_backward(loss)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=2.0)
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f} |g| {grad_norm.item():.3f}")


class BagClassifier(nn.Module):
    def __init__(self, vocab=1000, d=32, classes=4):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, d, mode="sum")
        self.fc = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, classes))

    def forward(self, text, offsets, weights):
        return self.fc(self.bag(text, offsets, per_sample_weights=weights))


def train_embedding_bag(steps, make_audit):
    """torchtext-style EmbeddingBag classifier: flat token stream + offsets, tf-idf-like
    per_sample_weights, Adagrad."""
    torch.manual_seed(SEED + 15)
    model = BagClassifier()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    lengths = [7, 12, 3, 9, 15, 6]
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                text = torch.randint(0, 1000, (sum(lengths),), generator=g)
                offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
                weights = torch.rand(sum(lengths), generator=g)
                label = torch.randint(0, 4, (len(lengths),), generator=g)
                loss = F.cross_entropy(model(text, offsets, weights), label)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item():.4f}")


class SetEncoder(nn.Module):
    """nn.MultiheadAttention over padded sets, masked mean pooling."""

    def __init__(self, d_in=12, d=32, heads=4, classes=6):
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x, pad):
        h = self.proj(x)
        a, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        h = self.norm(h + a)
        h = h + self.ff(h)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1)
        return self.head(pooled)


def train_mha_bf16_accum(steps, make_audit):
    """Set classifier with nn.MultiheadAttention + key padding mask under bf16 autocast, 2-step
    gradient accumulation, SGD momentum."""
    torch.manual_seed(SEED + 16)
    model = SetEncoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    accum = 2
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                for micro in range(accum):
                    g = gen(step, micro)
                    x = torch.randn(6, 10, 12, generator=g)
                    pad = torch.arange(10).unsqueeze(0) >= torch.tensor([10, 7, 4, 9, 10, 2]).unsqueeze(1)
                    y = torch.randint(0, 6, (6,), generator=g)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = F.cross_entropy(model(x, pad), y) / accum
                    audit.before_backward(loss)
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} loss {loss.item() * accum:.4f}")


class Projector(nn.Module):
    def __init__(self, d_in=48, d=64, out=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d), nn.BatchNorm1d(d), nn.ReLU(), nn.Linear(d, d), nn.BatchNorm1d(d),
                                 nn.ReLU(), nn.Linear(d, out))

    def forward(self, x):
        return F.normalize(self.net(x), dim=-1)


def train_simclr_infonce(steps, make_audit):
    """SimCLR-style contrastive loss (2N x 2N similarity, masked diagonal), zero_grad at the top of
    the loop, AdamW amsgrad."""
    torch.manual_seed(SEED + 17)
    model = Projector()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    temperature = 0.2
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                optimizer.zero_grad()
                g = gen(step)
                base = torch.randn(16, 48, generator=g)
                v1 = base + 0.1 * torch.randn(16, 48, generator=g)
                v2 = base * (1 + 0.1 * torch.randn(16, 48, generator=g))
                z = model(torch.cat([v1, v2]))
                sim = z @ z.t() / temperature
                sim = sim.masked_fill(torch.eye(32, dtype=torch.bool), float("-inf"))
                target = torch.cat([torch.arange(16, 32), torch.arange(0, 16)])
                loss = F.cross_entropy(sim, target)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
            print(f"  step {step} nt-xent {loss.item():.4f}")


class CTCNet(nn.Module):
    def __init__(self, n_mels=20, d=32, vocab=12):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(n_mels, d, 5, stride=2, padding=2), nn.ReLU())
        self.rnn = nn.LSTM(d, d, num_layers=1, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(2 * d, vocab)

    def forward(self, mels):
        h = self.conv(mels).transpose(1, 2)
        h, _ = self.rnn(h)
        return self.fc(h).log_softmax(-1)


def train_ctc_lstm(steps, make_audit):
    """Conv front end + BiLSTM acoustic model trained with CTC loss (variable lengths), Adam."""
    torch.manual_seed(SEED + 18)
    model = CTCNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                mels = torch.randn(3, 20, 60, generator=g)
                logp = model(mels)  # (B, T', V)
                input_lengths = torch.tensor([30, 26, 20])
                target_lengths = torch.tensor([8, 5, 6])
                targets = torch.randint(1, 12, (3, 8), generator=g)
                loss = ctc(logp.transpose(0, 1), targets, input_lengths, target_lengths)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} ctc {loss.item():.3f}")


def train_ctc_lstm_intlens(steps, make_audit):
    """The same CTC acoustic model, lengths given as Python lists (the other common way), RAdam with
    decoupled weight decay."""
    torch.manual_seed(SEED + 20)
    model = CTCNet()
    optimizer = torch.optim.RAdam(model.parameters(), lr=1e-3, weight_decay=1e-2, decoupled_weight_decay=True)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                mels = torch.randn(3, 20, 60, generator=g)
                logp = model(mels)
                targets = torch.randint(1, 12, (3, 8), generator=g)
                loss = F.ctc_loss(logp.transpose(0, 1), targets, [30, 26, 20], [8, 5, 6], blank=0, zero_infinity=True)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"  step {step} ctc {loss.item():.3f}")


class TwoTower(nn.Module):
    def __init__(self, users=200, items=300, d=24):
        super().__init__()
        self.user = nn.Embedding(users, d)
        self.item = nn.Embedding(items, d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, u, i):
        eu, ei = self.user(u), self.item(i)
        return (eu * ei).sum(-1) + self.mlp(torch.cat([eu, ei], -1)).squeeze(-1)


def train_recsys_groups(steps, make_audit):
    """Recommender: embeddings at a higher LR than the MLP (two param groups), BCE-with-logits on
    implicit feedback, zero_grad(set_to_none=False), Adam for-loop implementation."""
    torch.manual_seed(SEED + 19)
    model = TwoTower()
    optimizer = torch.optim.Adam([{"params": list(model.user.parameters()) + list(model.item.parameters()), "lr": 1e-2},
                                  {"params": model.mlp.parameters(), "lr": 1e-3}], foreach=False)
    with make_audit(model, optimizer) as audit:
        for step in range(steps):
            with audit.step(step):
                g = gen(step)
                u = torch.randint(0, 200, (64,), generator=g)
                i = torch.randint(0, 300, (64,), generator=g)
                clicked = (torch.rand(64, generator=g) < 0.3).float()
                loss = F.binary_cross_entropy_with_logits(model(u, i), clicked)
                audit.before_backward(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            print(f"  step {step} bce {loss.item():.4f}")


LOOPS = [train_distilbert_cls, train_roberta_mlm, train_gptneox_bf16, train_opt_accum, train_falcon_ckpt,
         train_phi_bf16, train_whisper, train_bart_smooth, train_electra_disc, train_mobilebert,
         train_conv1d_audio, train_gnn_scatter, train_transformer_decoder, train_conv_autoencoder,
         train_checkpoint_resmlp, train_embedding_bag, train_mha_bf16_accum, train_simclr_infonce,
         train_ctc_lstm, train_ctc_lstm_intlens, train_recsys_groups]


def _marker_line(tag):
    with open(__file__) as f:
        for n, line in enumerate(f, 1):
            if line.rstrip().endswith("# " + tag) and "def _marker_line" not in line:
                return n
    raise RuntimeError(tag)


def assume_for(name):
    """Real sizes of the data-dependent shapes, for the shadow: counted on real tensors (the audited
    run's own mask for the GNN, recorded before its Audit starts; the collator's step-2 batch for
    RoBERTa, the step the shadow records, computed outside both runs from the same seeded data)."""
    base = os.path.basename(__file__)
    if name == "gnn_scatter":
        n = COUNTS[name]  # train_mask.sum(): the same fixed mask in every step
        return {f"{base}:{_marker_line(t)}": n for t in ("ASSUME-A", "ASSUME-B", "ASSUME-C")}
    if name == "roberta_mlm":
        n = roberta_batch(2, count=True)  # rows of nonzero(~pick) in step 2
        COUNTS[name] = [roberta_batch(s, count=True) for s in range(3)]
        return {f"{base}:{_marker_line('ASSUME-R')}": n}
    return None


def _fmt(v):
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)


def line_diffs(audit_lines, shadow_lines, limit=6):
    keys = sorted(set(audit_lines) | set(shadow_lines))
    d = [(k, audit_lines.get(k), shadow_lines.get(k)) for k in keys if audit_lines.get(k) != shadow_lines.get(k)]
    parts = [f"{k} audit={_fmt(a)} shadow={_fmt(s)}" for k, a, s in d[:limit]]
    return "; ".join(parts) + (f"; +{len(d) - limit} more" if len(d) > limit else "")


def check(fn):
    name = fn.__name__[len("train_"):]
    d = tempfile.mkdtemp(prefix=f"oos-{name}-")
    holder = {}
    try:
        try:
            def real_audit(model, optimizer):
                holder["audit"] = Audit(model, optimizer, out_dir=os.path.join(d, "run"), step=2)
                return holder["audit"]
            fn(3, real_audit)
            run_dir = holder["audit"].run_dir
            del holder["audit"]
            gc.collect()
            m = measure(run_dir)
            events = step_events(run_dir)
        except Exception as e:
            return name, None, f"AUDIT FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        measured = m["phases"]["step2_end"]["replay"]["peak"]["bytes"]
        lines = {ph: m["phases"][ph]["attribution"]["lines"] for ph in m["phases"]}
        unattributed = max(p["attribution"]["unattributed_bytes"] for p in m["phases"].values())
        assume = assume_for(name)
        try:
            with memory_audit.shadow(assume=assume) as s:
                fn(10, lambda model, optimizer: NoAudit())
            r, summary = s.result, s.summary
        except Exception as e:
            return name, None, (f"measured {measured:,} unattributed {unattributed:,} SHADOW FAILED "
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        peak = r["peak"]
        differ = []
        for ph, ls in lines.items():
            sl = summary["phase_lines"].get(ph)
            if sl is None:
                differ.append(f"{ph}: missing in shadow")
            elif sl != ls:
                differ.append(f"{ph}: {line_diffs(ls, sl)}")
        for ph in summary["phase_lines"]:
            if ph not in lines:
                differ.append(f"{ph}: only in shadow")
        div = first_divergence(events, r["events"])
        ok = peak == measured and not differ
        STATS.append((peak == measured, not differ, div is None, unattributed == 0))
        text = (f"measured {measured:,} shadow-measured {peak - measured:+,} lines "
                f"{'equal' if not differ else 'DIFFER [' + ' | '.join(differ) + ']'} unattributed {unattributed:,} "
                f"divergence {div}" + (f" assume {assume}" if assume else "")
                + f" placeholders {len(summary['placeholders'])} sizes {summary['sizes']}")
        return name, ok, text
    finally:
        shutil.rmtree(d, ignore_errors=True)
        gc.collect()


def main(loops=None):
    """Run `loops` (this file's LOOPS by default; scripts/user_loops_b.py passes its own)."""
    global SEED
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    SEED = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 20)
    print(f"seed {SEED} (replay: --seed={SEED}); torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    loops = loops or LOOPS
    loops = loops if not args.only else [f for f in loops if f.__name__[6:] in args.only.split(",")]
    results = []
    for fn in loops:
        try:
            name, ok, text = check(fn)
        except Exception as e:  # the harness itself
            name, ok, text = fn.__name__[6:], None, f"HARNESS {type(e).__name__}: {e}\n{traceback.format_exc()}"
        results.append((name, ok, text))
        print(f"RESULT {name}: {text}", flush=True)
    print("\n==== per-loop results ====")
    for name, ok, text in results:
        print(f"{'OK  ' if ok else 'MISS' if ok is False else 'FAIL'} {name}: {text}")
    exact = sum(ok is True for _, ok, _ in results)
    miss = sum(ok is False for _, ok, _ in results)
    fail = sum(ok is None for _, ok, _ in results)
    print(f"seed {SEED}: {len(results)} loops; peak and every line exact {exact}, miss {miss}, failed {fail}")
    n = len(STATS)
    print(f"of the {n} that ran on both sides: peak exact {sum(s[0] for s in STATS)}/{n}, every line of the three "
          f"phases equal {sum(s[1] for s in STATS)}/{n}, event sequence identical {sum(s[2] for s in STATS)}/{n}, "
          f"audit 0 unattributed {sum(s[3] for s in STATS)}/{n}")


if __name__ == "__main__":
    main()
