"""A deep model's step built from shallow runs of itself (prediction/shadow/depth.py) against the
same script shadow-run with every block, on one GPU (predict-script --gpu=H100's path).

    python scripts/depth_check.py [--seed=S] [--n=N] [--dir=scripts/deep_loops]

Draws N training scripts at random (a new seed each run unless given, printed): transformers'
Llama, GPT-2 and BERT from tiny configs, hand-written residual stacks in a ModuleList or an
nn.Sequential, nn.TransformerEncoder, train.py itself; 8 to 24 blocks; fp32, bf16 autocast or fp16
with a GradScaler; AdamW, Adam, SGD or RMSprop; micro-steps and checkpointing at random. With
--dir, the scripts there too. For each: how shadow/depth answered (repeated from 3 and 4
blocks, nothing cut, or cut and run whole) and whether every event of the step (action, key,
bytes, allocation), the step's lines and the allocator's numbers equal the whole run's.
"""

import argparse
import contextlib
import glob
import io
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HEAD = """import torch
from torch import nn
import torch.nn.functional as F
import torch.utils.checkpoint
"""

LOOP = """
opt = {opt}
scaler = torch.amp.GradScaler() if {fp16} else None
for step in range(5):
    for micro in range({micro}):
        x = torch.randint(0, {vocab}, ({batch}, {seq}), device="cuda")
        with {cast}:
            loss = model_loss(x) / {micro}
        (scaler.scale(loss) if scaler else loss).backward()
    if {clip}:
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none={none})
"""

FAMILIES = {
    "llama": """from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size={d}, intermediate_size={ff}, num_hidden_layers={n}, num_attention_heads={h},
                  num_key_value_heads={kv}, vocab_size={vocab}, max_position_embeddings=256,
                  tie_word_embeddings={tie})
model = LlamaForCausalLM(cfg).cuda()
if {ckpt}:
    model.gradient_checkpointing_enable()
def model_loss(x):
    return model(input_ids=x, labels=x).loss
""",
    "gpt2": """from transformers import GPT2Config, GPT2LMHeadModel
cfg = GPT2Config(n_embd={d}, n_layer={n}, n_head={h}, vocab_size={vocab}, n_positions=256,
                 resid_pdrop={p}, embd_pdrop={p}, attn_pdrop={p})
model = GPT2LMHeadModel(cfg).to("cuda")
if {ckpt}:
    model.gradient_checkpointing_enable()
def model_loss(x):
    return model(input_ids=x, labels=x).loss
""",
    "bert": """from transformers import BertConfig, BertForMaskedLM
cfg = BertConfig(hidden_size={d}, num_hidden_layers={n}, num_attention_heads={h}, intermediate_size={ff},
                 vocab_size={vocab}, max_position_embeddings=256, hidden_dropout_prob={p})
model = BertForMaskedLM(cfg).cuda()
def model_loss(x):
    return model(input_ids=x, labels=x).loss
""",
    "residual": """class Block(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.layer_idx = i
        self.norm = nn.{norm}({d})
        self.up, self.down = nn.Linear({d}, {ff}), nn.Linear({ff}, {d})
        self.drop = nn.Dropout({p})
    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding({vocab}, {d})
        self.body = nn.{container}
        self.head = nn.Linear({d}, {vocab}, bias=False)
    def forward(self, x):
        h = self.emb(x)
        for b in self.body:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False) if {ckpt} else b(h)
        return self.head(h)
model = Net().cuda()
def model_loss(x):
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())
""",
    "encoder": """layer = nn.TransformerEncoderLayer({d}, {h}, {ff}, dropout={p}, batch_first=True, norm_first={tie})
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding({vocab}, {d})
        self.enc = nn.TransformerEncoder(layer, {n}, enable_nested_tensor=False)
        self.head = nn.Linear({d}, {vocab})
    def forward(self, x):
        return self.head(self.enc(self.emb(x)))
model = Net().cuda()
def model_loss(x):
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())
""",
}

OPTS = ("torch.optim.AdamW(model.parameters(), lr=1e-3)", "torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)",
        "torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)", "torch.optim.RMSprop(model.parameters(), lr=1e-3)",
        "torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)")
CASTS = {"fp32": "torch.autocast('cuda', enabled=False)", "bf16": "torch.autocast('cuda', dtype=torch.bfloat16)",
         "fp16": "torch.autocast('cuda', dtype=torch.float16)"}


def draw(rng):
    """(name, script text) of one random case."""
    family = rng.choice(list(FAMILIES) + ["train.py"])
    n = rng.randint(8, 24)
    if family == "train.py":
        args = [f"--n_layer={n}", f"--n_head={rng.choice([1, 2, 4])}", f"--n_embd={rng.choice([32, 64])}",
                f"--block_size={rng.choice([16, 32, 64])}", f"--batch_size={rng.randint(1, 4)}",
                f"--dtype={rng.choice(['float16', 'bfloat16', 'float32'])}",
                f"--attention={rng.choice(['sdpa', 'manual'])}", f"--dropout={rng.choice([0.0, 0.1])}",
                f"--gradient_accumulation_steps={rng.randint(1, 3)}",
                f"--activation_checkpointing={rng.choice(['none', 'none', 'full'])}", "--vocab_size=512"]
        return "train.py " + " ".join(args), None, args
    h = rng.choice([1, 2, 4])
    d = h * rng.choice([8, 16, 24])
    dtype = rng.choice(list(CASTS))
    fill = dict(d=d, ff=d * rng.choice([2, 4]), n=n, h=h, kv=rng.choice([k for k in (1, 2, 4) if h % k == 0]),
                vocab=rng.randint(50, 3000), tie=rng.choice([True, False]), ckpt=rng.random() < 0.25,
                p=rng.choice([0.0, 0.1]), norm=rng.choice(["LayerNorm", "RMSNorm"]),
                container=rng.choice([f"ModuleList([Block(i) for i in range({n})])",
                                      f"Sequential(*[Block(i) for i in range({n})])"]))
    text = HEAD + FAMILIES[family].format(**fill) + LOOP.format(
        opt=rng.choice(OPTS), fp16=dtype == "fp16", micro=rng.randint(1, 3), vocab=fill["vocab"],
        batch=rng.randint(1, 4), seq=rng.choice([8, 16, 32, 64]), cast=CASTS[dtype], clip=rng.random() < 0.3,
        none=rng.choice([True, False]))
    name = f"{family} n={n} d={d} h={h} {dtype} " + ", ".join(k for k in ("ckpt",) if fill[k])
    return name, text, []


def shadow_runs(script, argv):
    """(the whole run's Shadow, shadow/depth.predicted's, seconds of each) for a script."""
    from memory_audit.prediction.shadow.entry import shadow_file
    kw = dict(device="cuda", gpu="H100", step=2)
    with contextlib.redirect_stdout(io.StringIO()):
        t = time.perf_counter()
        whole = shadow_file(script, argv, repeat=False, **kw)
        t_whole = time.perf_counter() - t
        t = time.perf_counter()
        built = shadow_file(script, argv, repeat=True, **kw)
        t_built = time.perf_counter() - t
    return whole, built, t_whole, t_built


def canonical(result):
    ids = {}
    return [(a, k, b, ids.setdefault(i, len(ids))) for a, k, b, i in result["history"] + result["events"]]


def compare(whole, built):
    """'' where every event, line and allocator number is equal, else the first difference."""
    a, b = canonical(whole.result), canonical(built.result)
    if a != b:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"event {i} of {len(a)}/{len(b)}: {a[i] if i < len(a) else '-'} vs {b[i] if i < len(b) else '-'}"
    for key in ("allocator", "lines", "phase_lines", "peak_categories"):
        if whole.summary.get(key) != built.summary.get(key):
            return f"{key} differ"
    if whole.result["phases"] != built.result["phases"]:
        return "phases differ"
    return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    seed = random.SystemRandom().randrange(10**6) if args.seed is None else args.seed
    print(f"seed {seed}")
    rng = random.Random(seed)
    cases = [draw(rng) for _ in range(args.n)]
    if args.dir:
        cases += [(os.path.relpath(p, ROOT), p, []) for p in sorted(glob.glob(os.path.join(args.dir, "*.py")))]
    tmp = tempfile.mkdtemp()
    print("| case | answered | equal to the whole run | whole s | built s |")
    print("| --- | --- | --- | --- | --- |")
    tally = {}
    for i, (name, text, argv) in enumerate(cases):
        if text is None:
            script = os.path.join(ROOT, "train.py")
            argv = [os.path.join(ROOT, "config", "audit_cpu_tiny.py"), *argv, "--dataset=synthetic", "--device=cuda"]
        elif os.path.isfile(text):
            script = text
        else:
            script = os.path.join(tmp, f"case{i}.py")
            with open(script, "w") as f:
                f.write(text)
        try:
            whole, built, t_whole, t_built = shadow_runs(script, argv)
        except Exception as e:  # noqa: BLE001 (a case the shadow cannot run: listed)
            print(f"| {name} | error: {type(e).__name__}: {str(e).splitlines()[0][:120]} | - | - | - |", flush=True)
            tally["error"] = tally.get("error", 0) + 1
            continue
        how = ("repeated" if "repeated" in built.summary["source"] else
               built.depth_note)
        diff = compare(whole, built)
        tally[how, not diff] = tally.get((how, not diff), 0) + 1
        print(f"| {name} | {how} | {'yes' if not diff else 'NO: ' + diff} | {t_whole:.1f} | {t_built:.1f} |", flush=True)
    print()
    for key, count in sorted(tally.items(), key=str):
        print(f"{key}: {count}")


if __name__ == "__main__":
    main()
