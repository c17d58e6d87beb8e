"""The shadow run of one rank under torchrun: the process group a fake one, the mesh real.

train.py's strategies (parallelize.py: FSDP2, tensor parallelism, the 2-D mesh) run on fake
tensors in one process that stands for rank `rank` of `world_size`: torch.distributed's "fake"
backend answers every collective at once without moving data (the buffers FSDP2 and DTensor
make for them are ordinary ops the tracker sees), and each DeviceMesh (and each part of a 2-D
one), whose small tensor of rank ids it reads values from, is made on real tensors outside the
fake mode. DDP runs its own C++ reducer: where it reads tensor data (the parameter shapes it
checks at construction, the bucket indices it broadcasts when it rebuilds its buckets in the
second step's forward) the small integer tensors it makes are real (reducer_reads; for a GPU's
step they are meta tensors whose values host twins hold: reducer_op). A comm hook
hands each bucket back (the fake group all-reduces nothing); with no hook of its own the reducer
scales each gradient by 1/world_size as it copies it into its bucket, through a wrapped scalar
and its cast (8 B and the gradient's element size, made and freed in the gradient's
accumulation: measured), which a hook after each accumulation adds.

A rank runs on the threads torchrun gives it: OMP_NUM_THREADS where it is set, else 1 (torchrun
sets 1 when it starts more than one process per node). The CPU kernels' own buffers (oneDNN's
bf16 matmul scratch, LayerNorm's backward, flash attention's) are per thread, so the shadow runs
on that many threads too.
"""

import contextlib
import logging
import os
import warnings

@contextlib.contextmanager
def rank_of(cfg):
    """Inside: torch.distributed initialised as rank cfg["rank"] of cfg["world_size"] (a fake
    group) where cfg["parallel"] is a strategy, else nothing changes."""
    if cfg.get("parallel", "none") == "none":
        yield
        return
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise ValueError("a shadow run of a rank needs a process with no process group of its own")
    made, init = device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__

    def real(fn):  # a mesh's rank table on real tensors: the mesh reads their values
        def call(*args, **kwargs):
            with unset_fake_temporarily():
                return fn(*args, **kwargs)
        return call
    import sys
    import torch
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank<r>]" to every traceback
    _forget_meshes()
    dist.init_process_group("fake", rank=cfg["rank"], world_size=cfg["world_size"], store=FakeStore())
    device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__ = real(made), real(init)
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads())
    # FSDP2's and DTensor's advice to the user (a view returned, sequential all-reduces): about
    # train.py's strategies, which the audit of the run itself prints; not the prediction's
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        redistribute.setLevel(level)
        torch.set_num_threads(threads)
        device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__ = made, init
        dist.destroy_process_group()
        sys.excepthook = hook
        _forget_meshes()


def _forget_meshes():
    """Clear DTensor's caches (Python's and the C++ fast path's sharding propagation): they key on
    meshes by their layout, not their process groups, so a second shadow run in one process (a
    2-D mesh's rank 2 after its rank 0) would get the first one's (destroyed) groups."""
    import torch
    from torch.distributed.tensor import DTensor
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if clear is not None:
        clear()


def rank_threads(env=None):
    """The threads a rank's CPU ops run on: torchrun's OMP_NUM_THREADS, 1 unless set."""
    value = (os.environ if env is None else env).get("OMP_NUM_THREADS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else 1


def tp_size(cfg):
    """The tensor-parallel group's size train.py resolves (tp, tp-sp: the world), else 0."""
    if "tp" not in cfg["parallel"]:
        return 0
    return cfg.get("tp_size") or cfg["world_size"]


def parallelize(model, cfg):
    """Shard `model` as train.py does for cfg's strategy (parallelize.py), in place."""
    if cfg.get("parallel", "none") == "none":
        return model
    from parallelize import parallelize as shard
    return shard(model, cfg["parallel"], "cpu", cfg["world_size"], tp_size(cfg))


def wrap(model, cfg, tracker):
    """The module train.py trains: DDP around the model for parallel=ddp (its buckets made here,
    with the reducer's own reads on real tensors or host twins), else the model itself."""
    if cfg.get("parallel") != "ddp":
        return model
    from torch.nn.parallel import DistributedDataParallel
    with reducer_reads(tracker):
        ddp = buckets(tracker, DistributedDataParallel, model, gradient_as_bucket_view=cfg.get("ddp_bucket_view", False))
    return ddp_shadowed(ddp, model, tracker)


def ddp_shadowed(ddp, model, tracker, host=contextlib.nullcontext, register=None):
    """A DDP made on the shadow's tensors, as the fake group and the tracker need it (`host`: the
    context its reducer's own reads run in). Its all-reduce is handed back by the fake group
    (_handed_back), registered now, or, where `register` is given (a user's script, which may
    register a hook of its own after construction: noted and not run, script_ddp), with it at the
    first forward."""
    if register is None:
        ddp.register_comm_hook(None, _handed_back)
    gpu = ddp.device_type == "meta"  # a GPU's: the runtime timers (CUDA events: no memory) have no
    if gpu:  # meta kind, and the 1/world_size scalar is a host tensor there (no scaled hook)
        ddp.logger = _Untimed(ddp.logger)
    forward, syncs = ddp._pre_forward, [False]

    def pre_forward(*args, **kwargs):  # the bucket rebuild of the second step reads its indices
        if register is not None and not getattr(ddp, "_shadow_hooked", False):
            ddp._shadow_hooked = True
            register(ddp, None, _handed_back)
        syncs[0] = ddp.require_backward_grad_sync  # this forward's backward reduces (not no_sync)
        with reducer_reads(tracker), host():
            return buckets(tracker, forward, *args, **kwargs)
    ddp._pre_forward = pre_forward
    post = ddp._post_forward

    def post_forward(*args, **kwargs):  # find_unused_parameters' graph walk, static_graph's reads
        with reducer_reads(tracker), host():
            return post(*args, **kwargs)
    ddp._post_forward = post_forward

    def scaled(param):  # the reducer's 1/world_size for this gradient, a wrapped scalar and its cast
        if syncs[0]:
            key = f"temporary/backward/{tracker.label or 'gpt'}/ddp_scale"
            wrapped, cast = (tracker.alloc(f"{key}/scalar", 8)[0], tracker.alloc(f"{key}/scalar_cast", param.element_size())[0])
            tracker.free(cast)
            tracker.free(wrapped)
    for p in model.parameters():
        if p.requires_grad and not gpu:
            p.register_post_accumulate_grad_hook(scaled)
    return ddp


class _Untimed:
    """DDP's logger without its runtime stats (a warning on a meta device, no memory on a GPU)."""

    def __init__(self, logger):
        self._logger = logger

    def set_runtime_stats_and_log(self):
        pass

    def __getattr__(self, name):
        return getattr(self._logger, name)


def buckets(tracker, fn, *args, **kwargs):
    """fn(...), what it made and still holds when it returns named grads/ddp_buckets: DDP's
    construction and its forward's bucket rebuild keep only the buckets (their staging copies
    are let go inside), which audits name so from the stack (attribute.distributed_name)."""
    first = len(tracker.allocs)
    out = fn(*args, **kwargs)
    for aid, _ in tracker.live.values():
        if aid >= first:
            tracker.allocs[aid][0] = "grads/ddp_buckets"
    return out


def _handed_back(state, bucket):
    """The all-reduce of a bucket: the fake group moves nothing, so the bucket comes back as it is."""
    import torch
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


@contextlib.contextmanager
def reducer_reads(tracker):
    """Inside: the ops the tracker sees on real tensors only, and the empty integer tensors made
    with no tensor argument, run on real tensors (the reducer fills and reads them); on a GPU's
    meta tensors, integer ops also run on host twins (reducer_op)."""
    tracker.real_ints = True
    try:
        yield
    finally:
        tracker.real_ints = False


def runs_real(func, args, kwargs):
    """An op DDP's reducer runs on tensors it reads (shadow/distributed.reducer_reads): every tensor
    argument real, or an empty integer tensor made from nothing."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if tensors:
        return not any(isinstance(t, FakeTensor) for t in tensors)
    return func is torch.ops.aten.empty.memory_format and kwargs.get("dtype") in (torch.int32, torch.int64)


def reducer_op(tracker, func, args, kwargs, run):
    """An op of DDP's reducer on a CUDA step's shadow (meta tensors stand for the GPU's): run(),
    the tracker's device op (what it allocates on the GPU), and, where every tensor is an integer
    one, again on the host values its meta tensors stand for (tracker.twins), which a read (a
    copy to the host, .item()) then gets. The reducer broadcasts and gathers small integer
    tensors it made on the host and reads them back (the parameter shapes, the bucket indices)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.utils._pytree import tree_leaves, tree_map
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    ints = not any(t.is_floating_point() or t.is_complex() for t in tensors)
    if not ints or (not tensors and kwargs.get("dtype") not in (torch.int32, torch.int64)):
        return run()
    twins = tracker.twins

    def stands_in(t):  # a GPU's meta tensor, or a fake host tensor (a user's script runs under FakeTensorMode)
        return isinstance(t, torch.Tensor) and (t.device.type == "meta" or isinstance(t, FakeTensor))

    def twin(t):
        if not stands_in(t):
            return t
        sid = t.untyped_storage()._cdata
        if sid not in twins:
            twins[sid] = torch.zeros(t.shape, dtype=t.dtype)
        return twins[sid]
    with unset_fake_temporarily():
        host = func(*tree_map(twin, args), **tree_map(lambda v: torch.device("cpu") if isinstance(v, torch.device) else v,
                                                           kwargs))
    host_read = (func is torch.ops.aten._local_scalar_dense.default or kwargs.get("device") == torch.device("cpu")
                 or (not tensors and kwargs.get("device") is None)  # a factory on the default device: the host
                 or (func is torch.ops.aten.copy_.default and args[0].device.type == "cpu"))
    if host_read:  # the host's copy: host memory, its values the twins'
        return host, [], []
    out, held, scalars = run()
    for t, h in zip(tree_leaves(out), tree_leaves(host)):
        if stands_in(t) and isinstance(h, torch.Tensor):
            twins[t.untyped_storage()._cdata] = h
    return out, held, scalars
