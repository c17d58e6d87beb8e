"""A user's script shadow-run as one rank of a torchrun job on GPUs this machine does not have
(shadow(device="cuda", world_size=N, rank=R), predict-script --world_size --rank): torchrun's
environment, the fake process group made before the script asks for one (shadow/distributed.rank_of),
DDP made as train.py's shadow makes it (shadow/distributed.ddp_shadowed), FSDP2 on its GPU path, and
what each strategy assumes of NCCL over several ranks listed.
"""

import contextlib
import os

from .distributed import buckets, ddp_shadowed, rank_of, reducer_reads


def node_size(world_size):
    """GPUs per node of a torchrun job of `world_size` ranks: one node of up to 8, else nodes of 8."""
    if world_size > 8 and world_size % 8:
        raise ValueError(f"world_size={world_size}: a job is shadow-run on one node of up to 8 GPUs or on "
                         "nodes of 8 (a multiple of 8)")
    return min(world_size, 8)


@contextlib.contextmanager
def script_ranks(world_size, rank, tracker):
    """A user's script shadow-run as rank `rank` of `world_size`, as torchrun starts it on one
    node of up to 8 GPUs: torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, ...); the fake
    process group made first (rank_of), so the script's own init_process_group (any backend, any
    rendezvous) finds it made and its destroy_process_group leaves it for the shadow to destroy;
    DDP made as train.py's shadow makes it (script_ddp); FSDP2 on the GPU's path
    (patches.fsdp_on_gpu: meta device, a pool per stream; its
    unsharded parameters' resize_ seen: storage_resizes); DTensor's sharding propagation
    unseen (patches.propagation_unseen)."""
    import torch.distributed as dist
    from .patches import fsdp_on_gpu, patched, propagation_unseen, storage_resizes
    per_node = node_size(world_size)
    env = {"RANK": rank, "LOCAL_RANK": rank % per_node, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": per_node,
           "GROUP_RANK": rank // per_node, "GROUP_WORLD_SIZE": world_size // per_node, "ROLE_RANK": rank,
           "ROLE_WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    cfg = {"parallel": "script", "world_size": world_size, "rank": rank}
    given = [(dist, "init_process_group", lambda *a, **k: None), (dist, "destroy_process_group", lambda *a, **k: None)]
    try:
        with rank_of(cfg), patched(given), fsdp_on_gpu({"parallel": "fsdp"}, tracker), storage_resizes(tracker), \
                propagation_unseen(tracker, cfg), script_ddp(tracker):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def script_notes(model, world_size):
    """What a rank's prediction assumes of NCCL over several ranks (shadow/rules/collectives.NCCL), one line
    per strategy the model was wrapped in (script_strategies)."""
    from .rules.collectives import NCCL
    if not world_size or world_size < 2:
        return []
    return [f"{kind} on NCCL over {world_size} ranks: {NCCL[kind]}" for kind in script_strategies(model)] or [
        f"collectives on NCCL over {world_size} ranks: their outputs as the fake process group makes them; NCCL's "
        "own buffers outside PyTorch's allocator"]


def script_strategies(model):
    """The torchrun strategies a user's model was wrapped in, as shadow/rules/collectives.NCCL names them:
    "fsdp" (a module fully_shard made), "ddp" (DistributedDataParallel around it), "tp" (a
    parameter sharded other than FSDP2's dim-0 shards)."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard
    found = set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            found.add("fsdp")
        if isinstance(m, torch.nn.parallel.DistributedDataParallel):
            found.add("ddp")
    for p in model.parameters():  # FSDP2 shards dim 0 (and replicates it across HSDP's groups)
        shards = [pl for pl in getattr(p, "placements", ()) if isinstance(pl, Shard)]
        if isinstance(p, DTensor) and ("fsdp" not in found or len(shards) > 1 or any(pl.dim != 0 for pl in shards)):
            found.add("tp")
    return sorted(found)


@contextlib.contextmanager
def script_ddp(tracker):
    """DistributedDataParallel as a user's script builds it, made as wrap() makes train.py's: its
    reducer's reads on host twins, its all-reduce handed back by the fake group. The module's
    meta parameters stand for one GPU's, so device_ids and output_device (that GPU) are left to
    the module's own device."""
    import inspect
    from torch.nn.parallel import DistributedDataParallel
    from .patches import patched
    init, register = DistributedDataParallel.__init__, DistributedDataParallel.register_comm_hook
    signature = inspect.signature(init)

    def made(ddp, *args, **kwargs):
        given = signature.bind(ddp, *args, **kwargs).arguments
        given.pop("device_ids", None), given.pop("output_device", None)
        for option in ("find_unused_parameters", "static_graph"):
            if given.get(option):
                from .error import ShadowError
                raise ShadowError(f"DistributedDataParallel({option}=True) is not shadow-run: its reducer reads "
                                  "which parameters backward used, on values fake tensors do not hold")
        with reducer_reads(tracker), real_inputs():  # its host reads real, as train.py's shadow's
            buckets(tracker, init, **given)
        ddp_shadowed(ddp, given["module"], tracker, host=real_inputs, register=register)

    def hooked(ddp, state, hook):  # the script's own comm hook is not run: the fake group hands buckets back
        tracker.unmeasured.add(f"DDP's comm hook {getattr(hook, '__name__', hook)!s} not run: its buffers (a "
                               "compressed copy of each bucket) are not in the prediction")
    with patched([(DistributedDataParallel, "__init__", made), (DistributedDataParallel, "register_comm_hook", hooked)]):
        yield


@contextlib.contextmanager
def real_inputs():
    """Inside: the running FakeTensorMode takes real tensors (the reducer's host reads) as inputs,
    making them fake, as a shadow without one (train.py's on a GPU: meta tensors) does."""
    import torch
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None:
        yield
        return
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    try:
        yield
    finally:
        mode.allow_non_fake_inputs = allowed
