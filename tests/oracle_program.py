"""A training loop whose every allocation is known by hand (tests/test_cpu_oracle.py).

Two bias-free linears, a product-sum loss against a fixed target, SGD with momentum; fp32 on
CPU; under torchrun the model is wrapped in DDP (gloo), whose collectives are where the CPU
timeline infers frees the profiler did not record (recording/cpu_timeline.py). The test
computes each phase's bytes and the step's peak from the shapes below.

    python tests/oracle_program.py OUT_DIR ROAD...        # one process
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/oracle_program.py OUT_DIR ROAD...

Each ROAD ("memory_profile", "raw allocations": Audit's cpu_timeline) is one audit, written to
OUT_DIR/<road_dir(road)>/rank<r> (rank0 on one process).
"""

import os
import sys

import torch
from torch import nn

B, D, H, O = 8, 128, 512, 256  # batch, input width, hidden width, output width
STEPS = 3  # the audit records step index 1 (step 2)


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, H, bias=False)  # weight (H, D)
        self.fc2 = nn.Linear(H, O, bias=False)  # weight (O, H)

    def forward(self, x):  # x (B, D)
        return self.fc2(self.fc1(x))  # (B, H) -> (B, O)


def audited_run(out_dir, road):
    """Audit step 2 of STEPS steps; the Audit is made before the model, so every allocation is
    in the profile (the raw road sees no tensor older than it)."""
    from memory_audit import Audit
    audit = Audit(out_dir=out_dir, device="cpu", cpu_timeline=road)
    torch.manual_seed(0)
    model = TwoLinear()
    if distributed():
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    audit.watch(model, opt)
    g = torch.Generator().manual_seed(1 + rank())
    x, y = torch.randn(B, D, generator=g), torch.randn(B, O, generator=g)
    for step in range(STEPS):
        with audit.step(step, tensors={"inputs/x": x, "inputs/y": y}):
            loss = (model(x) * y).sum()
            audit.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return audit.run_dir


def road_dir(road):
    return road.replace(" ", "_")


def distributed():
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def rank():
    import torch.distributed as dist
    return dist.get_rank() if distributed() else 0


def main(out_dir, roads):
    import datetime
    import torch.distributed as dist
    torchrun = "WORLD_SIZE" in os.environ
    if torchrun:  # a rank that waits for the other gives up after a minute (the test's timeout is longer)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        for road in roads:
            audited_run(os.path.join(out_dir, road_dir(road), f"rank{rank()}"), road)
    finally:
        if torchrun:
            dist.destroy_process_group()
    if torchrun:  # every file is written and the group is gone: leave without static destructors, where a
        sys.stdout.flush()  # rank that ran the profiler under gloo has aborted ("terminate called without
        sys.stderr.flush()  # an active exception", no Python frame) in about 1 of 10 two-rank jobs here
        os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1], sys.argv[2:])
