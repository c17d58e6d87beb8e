"""Every op PyTorch's own tests sample (torch.testing's OpInfo database), each as a training loop:
the shadow run of the loop against an Audit of it, as scripts/user_loops.py checks whole models.
Ops no model here was built from: a census of which kernels the shadow gets wrong on CPU.

Each op's first float32 sample whose input is a tensor becomes one loop: a module holding that
input as its parameter calls the op on it (the sample's other tensors made inside the audited
run, so the CPU audit sees them), the loss is the sum of every differentiable output, SGD with
momentum steps it. The audited run (3 steps, step 2 recorded) and the shadow run (10 steps, the
tool stops it after step 2) go through user_loops.check.

    python scripts/op_loops.py [--seed=S] [--only=name,name] [--start=K] [--count=N] [--pick=K]

Prints one line per op (OK / MISS with the lines that differ / FAILED with the first line of the
error) and a summary; ops whose output no sample makes differentiable are skipped.
"""

import argparse
import random
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

import user_loops as harness


class OpModule(nn.Module):
    def __init__(self, op, weight):
        super().__init__()
        self.op = op
        self.weight = nn.Parameter(weight)

    def forward(self, args, kwargs):
        return self.op(self.weight, *args, **kwargs)


def _sample(op, pick=0):
    """The op's `pick`-th (from 0) float32 sample with a tensor input of at least two elements whose output has
    a differentiable float tensor, or None."""
    try:
        samples = op.sample_inputs("cpu", torch.float32, requires_grad=False)
        for s in samples:
            if not isinstance(s.input, torch.Tensor) or s.input.numel() < 2 or not s.input.is_floating_point():
                continue
            if any(isinstance(t, torch.Tensor) and (t.layout != torch.strided or t.is_nested)
                   for t in tree_leaves((s.input, s.args, s.kwargs))):
                continue  # a sparse or nested tensor: not what a script writes as a list of values
            w = s.input.detach().clone().requires_grad_(True)
            out = op(w, *s.args, **s.kwargs)
            if any(isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point() for o in tree_leaves(out)):
                if pick == 0:
                    return s
                pick -= 1
    except Exception:  # noqa: BLE001 -- an op whose samples do not run on CPU
        return None
    return None


def _as_data(t):
    """A tensor as what a script would write to make it again: its values, dtype and shape."""
    return ("tensor", t.detach().reshape(-1).tolist(), t.dtype, tuple(t.shape))


def _made(d):
    return torch.tensor(d[1], dtype=d[2]).reshape(d[3])


def loop_for(op, sample):
    weight = _as_data(sample.input)
    data = tree_map(lambda a: _as_data(a) if isinstance(a, torch.Tensor) else a, (list(sample.args), dict(sample.kwargs)))

    def train(steps, make_audit):
        torch.manual_seed(harness.SEED)
        model = OpModule(op, _made(weight))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        with make_audit(model, optimizer) as audit:
            # the sample's other tensors made inside the audited run (a CPU audit cannot size older ones)
            args, kwargs = tree_map(lambda a: _made(a) if isinstance(a, tuple) and a[:1] == ("tensor",) else a, data,
                                    is_leaf=lambda a: isinstance(a, tuple) and a[:1] == ("tensor",))
            for step in range(steps):
                with audit.step(step):
                    out = model(args, kwargs)
                    loss = sum(o.float().sum() for o in tree_leaves(out)
                               if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point())
                    audit.before_backward(loss)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                del out
    train.__name__ = "train_" + op.name.replace(".", "_")
    return train


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--only", default="")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=10 ** 6)
    ap.add_argument("--pick", type=int, default=0, help="each op's K-th usable sample (0: the first)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    harness.SEED = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 20)
    print(f"seed {harness.SEED} (replay: --seed={harness.SEED}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    from torch.testing._internal.common_methods_invocations import op_db
    only = set(filter(None, a.only.split(",")))
    ops = [op for op in op_db if (not only or op.name in only) and torch.float32 in op.supported_dtypes("cpu")
           and op.supports_autograd][a.start:a.start + a.count]
    counts = {"OK": 0, "MISS": 0, "FAILED": 0, "skipped": 0}
    start = time.time()
    for op in ops:
        sample = _sample(op, a.pick)
        if sample is None:
            counts["skipped"] += 1
            continue
        name, ok, text = harness.check(loop_for(op, sample))
        tag = "OK" if ok else "MISS" if ok is False else "FAILED"
        counts[tag] += 1
        print(f"{tag:6s} {op.name}: {text}", flush=True)
    print(f"seed {harness.SEED}: {sum(counts.values())} ops, {counts['OK']} peak and every line exact, "
          f"{counts['MISS']} miss, {counts['FAILED']} failed, {counts['skipped']} skipped "
          f"(no differentiable float sample), {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
