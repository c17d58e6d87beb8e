"""Models nobody here wrote, trained in the loop shape users write (issues #46, #49).

Each loop is drawn at random from a seed (`draw`), built from a small config with no download
(`build`), and trained by `train` exactly as a user's script would: the batch made on the host
and moved, the loss rebound each step, `loss.item()` logged, AdamW (or another torch.optim
optimizer) stepped, `zero_grad()`. An Audit, when given, records step 2 through its public API only.

Families:
- transformers (from configs): GPT-2 (eager or SDPA attention), BERT (masked LM, ignore_index
  labels), Llama, Qwen2, Mistral (GQA, RMSNorm, rotary, SwiGLU), T5 (encoder-decoder), ViT; with
  the library's own gradient checkpointing or not;
- timm and torchvision image models (ResNet, ConvNeXt, MobileNet, EfficientNet, ViT), timm's own
  checkpointing (`set_grad_checkpointing`);
- plain torch: a pre-norm `nn.TransformerEncoder` ViT, a GroupNorm/SiLU/ConvTranspose U-Net with a
  skip concat, a GRU or LSTM tagger, a routed mixture of experts (`nonzero` routing);
fp32 or bf16 autocast; AdamW, Adam, SGD momentum, RMSprop, Adagrad, Adafactor; foreach or fused.

A family whose library is not installed is skipped with one line (`missing`).
"""

import contextlib
import importlib.util
import random

import torch
from torch import nn
import torch.nn.functional as F

HF = ("gpt2", "bert", "llama", "qwen2", "mistral", "t5", "vit")
TIMM = ("resnet10t", "resnet18", "convnext_atto", "mobilenetv3_small_050", "efficientnet_b0", "vit_tiny_patch16_224")
TORCHVISION = ("resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "squeezenet1_1")
PLAIN = ("encoder_vit", "unet", "gru", "lstm", "moe")
LIBRARY = {"hf": "transformers", "timm": "timm", "tv": "torchvision", "plain": None}


def missing(spec):
    """The library a spec needs that is not installed here, or None."""
    lib = LIBRARY[spec["lib"]]
    return lib if lib and importlib.util.find_spec(lib) is None else None


def draw(rng, size="tiny"):
    """One loop's spec. size: "tiny" (dims of tens) or "gpt2" (GPT-2 small's width and depth)."""
    lib = rng.choice(["hf", "hf", "timm", "tv", "plain", "plain"])
    name = rng.choice({"hf": HF, "timm": TIMM, "tv": TORCHVISION, "plain": PLAIN}[lib])
    spec = {"lib": lib, "name": name, "size": size, "dtype": rng.choice(["float32", "bfloat16"]),
            "optimizer": rng.choice(["adamw", "adamw", "adam", "sgd", "rmsprop", "adagrad", "adafactor"]),
            "impl": rng.choice(["default", "foreach", "for", "fused"]),
            "checkpointing": rng.random() < 0.3, "batch": rng.randint(1, 8), "seed": rng.randrange(1 << 30)}
    if spec["optimizer"] in ("adafactor",) and spec["impl"] == "fused":
        spec["impl"] = "default"
    if spec["optimizer"] in ("rmsprop", "adagrad", "sgd") and spec["impl"] == "fused":
        spec["impl"] = "foreach"
    big = size == "gpt2"
    if lib == "hf" and name != "vit":
        heads = 12 if big else rng.choice([1, 2, 4])
        spec.update(heads=heads, width=768 if big else heads * rng.choice([8, 16, 32]), layers=12 if big else rng.randint(1, 4),
                    seq=rng.choice([256, 512]) if big else rng.randint(8, 128),
                    vocab=50257 if big else rng.randint(50, 4000), attention=rng.choice(["eager", "sdpa"]))
        spec["kv_heads"] = rng.choice([h for h in (1, 2, heads) if heads % h == 0])
    elif lib in ("timm", "tv") or name in ("vit", "encoder_vit", "unet"):
        spec.update(image=rng.choice([224] if big else [32, 48, 64]), classes=rng.randint(2, 100),
                    width=768 if big else rng.choice([16, 32, 64]), layers=12 if big else rng.randint(1, 4),
                    heads=12 if big else rng.choice([1, 2, 4]), patch=16 if big else rng.choice([4, 8, 16]))
        if lib == "tv" and name == "squeezenet1_1":
            spec["image"] = max(spec["image"], 64)
        if lib in ("timm", "tv"):  # BatchNorm in training needs two values per channel (1 x 1 maps)
            spec["batch"] = max(spec["batch"], 2)
    else:  # gru, lstm, moe
        spec.update(width=768 if big else rng.choice([16, 32, 64]), layers=12 if big else rng.randint(1, 3),
                    seq=512 if big else rng.randint(4, 64), vocab=50257 if big else rng.randint(50, 2000),
                    experts=rng.randint(2, 6), bidirectional=rng.random() < 0.5, classes=rng.randint(2, 40))
    return spec


def describe(spec):
    keys = [k for k in ("width", "layers", "heads", "kv_heads", "seq", "image", "vocab", "attention", "experts") if k in spec]
    return (f"{spec['lib']}/{spec['name']} {spec['dtype']} {spec['optimizer']}:{spec['impl']} b{spec['batch']}"
            + (" ckpt" if spec["checkpointing"] else "") + " " + " ".join(f"{k}={spec[k]}" for k in keys))


# -- models
def _hf(spec):
    import transformers as tf
    w, L, h, kv, v, T = (spec[k] for k in ("width", "layers", "heads", "kv_heads", "vocab", "seq"))
    name = spec["name"]
    if name == "gpt2":
        cfg = tf.GPT2Config(n_embd=w, n_layer=L, n_head=h, n_positions=max(T, 16), vocab_size=v)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(hidden_size=w, num_hidden_layers=L, num_attention_heads=h, intermediate_size=4 * w,
                            vocab_size=v, max_position_embeddings=max(T, 16))
        model = tf.BertForMaskedLM(cfg)
    elif name == "t5":
        cfg = tf.T5Config(d_model=w, d_ff=2 * w, num_layers=L, num_heads=h, d_kv=w // h, vocab_size=v,
                          decoder_start_token_id=0, pad_token_id=0)
        model = tf.T5ForConditionalGeneration(cfg)
    else:
        Config = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[name]
        cfg = Config(hidden_size=w, intermediate_size=int(8 * w / 3) // 8 * 8 or 8, num_hidden_layers=L,
                     num_attention_heads=h, num_key_value_heads=kv, vocab_size=v, max_position_embeddings=max(T, 16))
        model = tf.AutoModelForCausalLM.from_config(cfg)
    model.config._attn_implementation = spec["attention"]
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _hf_vit(spec):
    import transformers as tf
    cfg = tf.ViTConfig(image_size=spec["image"], patch_size=spec["patch"], hidden_size=spec["width"],
                       num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                       intermediate_size=4 * spec["width"], num_labels=spec["classes"])
    model = tf.ViTForImageClassification(cfg)
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _timm(spec):
    import timm
    kw = {"img_size": spec["image"]} if spec["name"].startswith("vit") else {}
    model = timm.create_model(spec["name"], pretrained=False, num_classes=spec["classes"], **kw)
    if spec["checkpointing"]:
        model.set_grad_checkpointing(True)
    return model


def _torchvision(spec):
    import torchvision
    return getattr(torchvision.models, spec["name"])(weights=None, num_classes=spec["classes"])


class EncoderViT(nn.Module):
    def __init__(self, image, patch, width, layers, heads, classes, checkpointing):
        super().__init__()
        self.patch = nn.Conv2d(3, width, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)
        self.checkpointing = checkpointing

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        for layer in self.encoder.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if self.checkpointing else layer(x)
        return self.head(x.mean(1))


class UNet(nn.Module):
    def __init__(self, width, classes, checkpointing):
        super().__init__()
        c = width

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(min(8, o), o), nn.SiLU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(min(8, o), o), nn.SiLU())
        self.down1, self.down2 = block(3, c), block(c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = block(2 * c, c)
        self.out = nn.Conv2d(c, classes, 1)
        self.checkpointing = checkpointing

    def forward(self, x):
        run = (lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False)) if self.checkpointing \
            else (lambda f, *a: f(*a))
        a = run(self.down1, x)
        b = run(self.down2, F.max_pool2d(a, 2))
        return self.out(run(self.dec, torch.cat([a, self.up(b)], 1)))


class Tagger(nn.Module):
    def __init__(self, cell, vocab, width, layers, bidirectional, classes):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = cell(width, width, num_layers=layers, bidirectional=bidirectional, batch_first=True)
        self.out = nn.Linear(width * (2 if bidirectional else 1), classes)

    def forward(self, tokens):
        h, _ = self.rnn(self.embed(tokens))
        return self.out(h)


class MoE(nn.Module):
    """Top-1 routed experts: each token goes to its expert's MLP through `nonzero` (data-dependent)."""

    def __init__(self, vocab, width, layers, experts, classes):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.routers = nn.ModuleList(nn.Linear(width, experts) for _ in range(layers))
        self.experts = nn.ModuleList(nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                                 nn.Linear(2 * width, width)) for _ in range(experts))
                                     for _ in range(layers))
        self.out = nn.Linear(width, classes)

    def forward(self, tokens):
        x = self.embed(tokens)
        for norm, router, experts in zip(self.norms, self.routers, self.experts):
            h = norm(x).flatten(0, 1)
            gate = router(h).softmax(-1)
            weight, choice = gate.max(-1)
            y = torch.zeros_like(h)
            for e, expert in enumerate(experts):
                idx = (choice == e).nonzero().squeeze(1)
                y = y.index_add(0, idx, (expert(h[idx]) * weight[idx, None]).to(y.dtype))
            x = x + y.view_as(x)
        return self.out(x)


def _plain(spec):
    n = spec["name"]
    if n == "encoder_vit":
        return EncoderViT(spec["image"], spec["patch"], spec["width"], spec["layers"], spec["heads"], spec["classes"],
                          spec["checkpointing"])
    if n == "unet":
        return UNet(spec["width"], spec["classes"], spec["checkpointing"])
    if n in ("gru", "lstm"):
        return Tagger(nn.GRU if n == "gru" else nn.LSTM, spec["vocab"], spec["width"], spec["layers"],
                      spec["bidirectional"], spec["classes"])
    return MoE(spec["vocab"], spec["width"], spec["layers"], spec["experts"], spec["classes"])


def make_model(spec):
    if spec["lib"] == "hf":
        return _hf_vit(spec) if spec["name"] == "vit" else _hf(spec)
    return {"timm": _timm, "tv": _torchvision, "plain": _plain}[spec["lib"]](spec)


def make_optimizer(spec, params):
    kind, impl = spec["optimizer"], spec["impl"]
    kw = {} if impl == "default" else {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    if kind in ("adamw", "adam"):
        return (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)(params, lr=1e-4, **kw)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kw)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-4, **kw)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-3, **kw)
    return torch.optim.Adafactor(params, lr=1e-3, **kw)


def batch(spec, step):
    """The step's batch, made on the host as a data loader would (moved to the device by `train`)."""
    g = torch.Generator().manual_seed(spec["seed"] + step)
    B = spec["batch"]
    if spec["lib"] == "hf" and spec["name"] != "vit":
        ids = torch.randint(0, spec["vocab"], (B, spec["seq"]), generator=g)
        if spec["name"] == "bert":
            labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, torch.full_like(ids, -100))
            return {"input_ids": ids, "labels": labels}
        if spec["name"] == "t5":
            return {"input_ids": ids, "labels": torch.randint(1, spec["vocab"], (B, max(spec["seq"] // 2, 1)), generator=g)}
        return {"input_ids": ids, "labels": ids}
    if "image" in spec:
        x = torch.randn(B, 3, spec["image"], spec["image"], generator=g)
        if spec["name"] == "unet":
            return {"x": x, "y": torch.randint(0, spec["classes"], (B, spec["image"], spec["image"]), generator=g)}
        return {"x": x, "y": torch.randint(0, spec["classes"], (B,), generator=g)}
    return {"x": torch.randint(0, spec["vocab"], (B, spec["seq"]), generator=g),
            "y": torch.randint(0, spec["classes"], (B, spec["seq"]), generator=g)}


def loss_of(spec, model, inputs):
    if spec["lib"] == "hf":
        if spec["name"] == "vit":
            return model(pixel_values=inputs["x"], labels=inputs["y"]).loss
        return model(**inputs).loss
    out = model(inputs["x"])
    if out.dim() > 2:  # per token or per pixel: classes on dim 1
        out = out.movedim(-1, 1) if spec["name"] != "unet" else out
    return F.cross_entropy(out, inputs["y"])


def build(spec, device):
    torch.manual_seed(spec["seed"])
    model = make_model(spec).to(device)
    model.train()
    return model, make_optimizer(spec, model.parameters())


def train(spec, device, audit=None, steps=3, model=None, optimizer=None):
    """The user's loop: `steps` steps, step 2 under `audit.step(2)` when an Audit is given.
    Returns the logged losses."""
    if model is None:
        model, optimizer = build(spec, device)
    cast = (torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if spec["dtype"] == "bfloat16"
            else contextlib.nullcontext())
    losses = []
    for step in range(steps):
        with audit.step(step) if audit is not None else contextlib.nullcontext():
            inputs = {k: v.to(device) for k, v in batch(spec, step).items()}
            with cast:
                loss = loss_of(spec, model, inputs)
            if audit is not None:
                audit.before_backward(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses  # a non-finite loss (fused AdamW on a tiny BERT) changes no byte: kept as it is


def specs(seed, n, size="tiny", names=None):
    """n loops drawn from seed; with names, the first n drawn of those models (gru, unet, ...)."""
    rng = random.Random(seed)
    if not names:
        return [draw(rng, size) for _ in range(n)]
    out = []
    while len(out) < n:
        spec = draw(rng, size)
        if spec["name"] in names:
            out.append(spec)
    return out
