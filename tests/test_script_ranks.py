"""A user's script shadow-run as one rank of a torchrun job on GPUs this machine does not have
(`shadow(device="cuda", world_size=N, rank=R)`, `predict-script --gpu --world_size`;
shadow/ranks.script_ranks): its own init_process_group, DDP, FSDP2 and tensor parallelism on the
fake process group. train.py itself, run as a user's script at world size 1, against the H100
audits of the same three strategies on NCCL (snapshots/examples/nccl-ws1; no rule of the
script path was read from them)."""

import json
import os

import pytest

from conftest import ROOT, run_cli

NCCL = os.path.join(ROOT, "snapshots", "examples", "nccl-ws1")
TRAIN_ARGS = ["config/audit_cpu_tiny.py", "--dtype=float16", "--batch_size=12", "--gradient_accumulation_steps=1",
              "--dataset=synthetic", "--device=cuda"]


def _measured(parallel):
    with open(os.path.join(NCCL, parallel, "meta.json")) as f:
        phases = json.load(f)["phases"]
    return {"steady_state": phases["step2_start"]["memory_allocated"],
            "before_backward": phases["step2_before_backward"]["memory_allocated"],
            "end": phases["step2_end"]["memory_allocated"],
            "peak": max(p["max_memory_allocated"] for p in phases.values()),
            "reserved": phases["step2_end"]["memory_reserved"]}


def _train_py(parallel):
    """predict-script --gpu=H100 --world_size=1 --step=1 train.py (step=1: train.py's 1-based audited
    step 2, as shadow() counts from 0), in a process of its own: train.py sets signal handlers
    and torch's global flags as it starts."""
    p = run_cli("predict-script", "--gpu=H100", "--world_size=1", "--step=1", "--json", "train.py", "--",
                *TRAIN_ARGS, f"--parallel={parallel}")
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout[p.stdout.rindex("\n{\n") + 1:])  # the JSON after train.py's own prints


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "tp"])
def test_train_py_as_a_script_is_the_nccl_audit_of_its_rank(parallel):
    """train.py --parallel=ddp|fsdp|tp run as written (its own init_process_group("nccl"), DDP,
    fully_shard, parallelize_module) on a fake group of one: step 2's start, end, peak and
    memory_reserved() are the H100 audit's to the byte. Before backward the script's shadow
    marks the moment at `.backward()`, where train.py's audit marks it before its next batch is
    fetched and before GradScaler scales the loss: the two batch tensors on the GPU (12 x 64
    int64 each) and the scaled loss's 512 B block later, exactly."""
    summary = _train_py(parallel)
    got, measured = summary["allocator"], _measured(parallel)
    for key in ("steady_state", "end", "peak", "reserved"):
        assert got[key] == measured[key], (parallel, key, got[key], measured[key])
    assert got["before_backward"] - measured["before_backward"] == 2 * 12 * 64 * 8 + 512
    assert not any("NCCL" in u for u in summary["unmeasured"])  # one rank: no collective over several


def test_a_users_fsdp2_script_on_eight_ranks(tmp_path):
    """A user's FSDP2 script (init_process_group("nccl"), init_device_mesh("cuda"), fully_shard
    per block and at the root) as rank 5 of 8: each weight and AdamW moment is its 1/8 shard,
    the output says what it assumes of NCCL over 8 ranks, and --world_size without --gpu or a
    rank outside the job is one line."""
    script = tmp_path / "fsdp_train.py"
    script.write_text(FSDP_SCRIPT)
    p = run_cli("predict-script", "--gpu=H100", "--world_size=8", "--rank=5", "--json", str(script))
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout)
    lines = summary["lines"]
    assert lines["weights/emb.weight"] == 1000 * 64 * 4 // 8
    assert lines["optimizer/exp_avg/emb.weight"] == lines["optimizer/exp_avg_sq/emb.weight"] == 1000 * 64 * 4 // 8
    assert lines["weights/blocks.0.fc.weight"] == 256 * 64 * 4 // 8
    assert [u.split(":")[0] for u in summary["unmeasured"]] == ["fsdp on NCCL over 8 ranks"]
    text = run_cli("predict-script", "--gpu=H100", "--world_size=8", "--rank=5", str(script))
    assert text.returncode == 0, text.stderr[-2000:]
    assert f"| peak | {summary['allocator']['peak']:,} |" in text.stdout and "rank 5 of 8 H100s" in text.stdout
    assert "of 79.18 GiB: fits" in text.stdout and "not measured on a GPU: fsdp on NCCL over 8 ranks" in text.stdout
    for args, says in ((["--world_size=8", str(script)], "give --gpu=NAME too"),
                       (["--gpu=H100", "--world_size=8", "--rank=8", str(script)], "0 <= rank < world_size")):
        p = run_cli("predict-script", *args)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr


def test_a_users_ddp_script_on_two_ranks(tmp_path):
    """A user's DDP script as rank 1 of 2: device_ids given positionally as written for the GPU,
    each rank holding whole gradients and DDP's buckets; its own comm hook is listed as not run
    (its buffers are not predicted), and find_unused_parameters=True, which the shadow cannot
    run, stops in one line naming the script's line."""
    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_SCRIPT)
    plain = run_cli("predict-script", "--gpu=H100", "--world_size=2", "--rank=1", "--json", str(script), "--", "plain")
    assert plain.returncode == 0, plain.stderr[-2000:]
    summary = json.loads(plain.stdout)
    assert summary["lines"]["weights/module.1.weight"] == 256 * 64 * 4  # DDP replicates the weights
    assert summary["lines"]["grads/ddp_buckets"] >= sum(n * 4 for n in (1000 * 64, 256 * 64, 256, 1000 * 256, 1000))
    assert [u.split(":")[0] for u in summary["unmeasured"]] == ["ddp on NCCL over 2 ranks"]
    hooked = run_cli("predict-script", "--gpu=H100", "--world_size=2", "--rank=1", "--json", str(script), "--", "hook")
    assert hooked.returncode == 0, hooked.stderr[-2000:]
    noted = json.loads(hooked.stdout)
    assert noted["allocator"] == summary["allocator"]
    assert any(u.startswith("DDP's comm hook fp16_compress_hook not run") for u in noted["unmeasured"])
    unused = run_cli("predict-script", "--gpu=H100", "--world_size=2", "--rank=1", str(script), "--", "find_unused")
    assert unused.returncode == 2 and unused.stderr.count("\n") == 1, unused.stderr
    assert "find_unused_parameters=True) is not shadow-run" in unused.stderr


def test_a_rank_that_fails_puts_everything_back():
    """A rank's shadow that stops: torch.distributed's group, DDP's and GradScaler's methods,
    init_process_group and torchrun's environment are as they were, and a world size that is
    not one node or nodes of 8, or a rank given alone, is refused in one line."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import memory_audit
    from memory_audit.prediction.shadow.step import ShadowError
    before = (dist.init_process_group, dist.destroy_process_group, DistributedDataParallel.__init__,
              DistributedDataParallel.register_comm_hook, torch.amp.GradScaler.update, os.environ.get("RANK"))
    with pytest.raises(ShadowError):
        with memory_audit.shadow(device="cuda", world_size=4, rank=2):
            assert os.environ["RANK"] == "2" and os.environ["LOCAL_WORLD_SIZE"] == "4"
            x = torch.randn(4, device="cuda")
            x[x > 0]  # a data-dependent size with none given: the shadow stops here
    assert not dist.is_initialized()
    assert before == (dist.init_process_group, dist.destroy_process_group, DistributedDataParallel.__init__,
                      DistributedDataParallel.register_comm_hook, torch.amp.GradScaler.update, os.environ.get("RANK"))
    for kwargs, says in ((dict(world_size=12), "nodes of 8"), (dict(rank=3), "world_size an int"),
                         (dict(world_size=2, rank=2), "0 <= rank < world_size")):
        with pytest.raises(ShadowError, match=says):
            memory_audit.shadow(device="cuda", **kwargs)


DDP_SCRIPT = '''
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

dist.init_process_group("nccl")
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1000)).cuda()
ddp = DDP(model, [local], find_unused_parameters=sys.argv[1] == "find_unused")
if sys.argv[1] == "hook":
    ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
x = torch.randint(0, 1000, (4, 32), device="cuda")
for step in range(4):
    loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
'''


FSDP_SCRIPT = '''
import os, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self, d=64, n=4, vocab=1000):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (dist.get_world_size(),))
model = Net().cuda()
for b in model.blocks:
    fully_shard(b, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 1000, (4, 32), device="cuda")
for step in range(5):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(step, loss.item())
dist.destroy_process_group()
'''
