"""Every change the shadow run makes to torch or to a library while it runs, in one place: each a
context manager that says why and puts back what it replaced.

  cpu_rules         F.scaled_dot_product_attention, F.linear and the recurrent layers' C++ entry
                    points marked as regions where a real CPU run adds in place (adds_in_place),
                    with rng_states and storage_resizes
  storage_resizes   UntypedStorage.resize_ reported to the tracker (FSDP2 frees and re-makes an
                    unsharded parameter's memory with it; no op the dispatcher sees)
  rng_states        torch.get_rng_state counted (checkpointing saves the CPU generator's state)
  no_init           torch.nn.init's initialisers as no-ops (a fake weight has no values to set)
  fsdp_on_gpu       FSDP2's GPU code path on meta tensors (its device, its device handle: the
                    streams of _Streams, and its meta-parameter check), with UNMEASURED's notes
  propagation_unseen  DTensor's sharding propagation on fake tensors of the global shapes left
                    out of the tracker (a real run does it in a FakeTensorMode of its own)
  meta              fused AdamW allowed on meta tensors, as on CUDA tensors
Plain Python until a shadow run starts: torch is imported inside.
"""

import contextlib


@contextlib.contextmanager
def cpu_rules(tracker):
    """The CPU rules that need a hook outside the dispatcher: rng_states, and the regions where
    a real run adds in place what a tensor subclass (a fake tensor, or any tensor while a Python
    dispatch mode runs) adds out of place (adds_in_place): CPU math SDPA's mask add
    (attn.add_(mask)), and at::linear's bias add where its input is not flattened into one addmm
    (a non-contiguous input: output.add_(bias) after the matmul), from F.linear or from the
    recurrent layers' input projections (torch._VF's rnn functions). An add there whose first
    operand dies with it took that operand's memory (the inplace_accumulate fold)."""
    import torch
    import torch.nn.functional as F
    # the recurrent layers call at::linear from C++ (their input projections: mm, then the bias)
    hooks = [(F, "scaled_dot_product_attention"), (F, "linear")] + [(torch._VF, n) for n in ("lstm", "gru", "rnn_tanh", "rnn_relu")]
    originals = {(owner, name): getattr(owner, name) for owner, name in hooks}

    def in_place(original):
        def call(*args, **kwargs):
            outer, tracker.adds_in_place = tracker.adds_in_place, True
            try:
                return original(*args, **kwargs)
            finally:
                tracker.adds_in_place = outer
        return call
    for (owner, name), original in originals.items():
        setattr(owner, name, in_place(original))
    try:
        with rng_states(tracker), storage_resizes(tracker):
            yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


@contextlib.contextmanager
def storage_resizes(tracker):
    """untyped_storage().resize_ made visible (storage_resize: no op the dispatcher sees), on
    either device: FSDP2 frees an unsharded parameter's memory with resize_(0) and makes it again
    with resize_(n)."""
    import torch
    resize = torch.UntypedStorage.resize_

    def resized(storage, nbytes):
        tracker.before_op()
        resize(storage, nbytes)
        tracker.resized(storage, nbytes)
    torch.UntypedStorage.resize_ = resized
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = resize


@contextlib.contextmanager
def rng_states(tracker):
    """torch.get_rng_state() made visible: the CPU generator's state, a real uint8 tensor the
    generator makes outside the dispatcher, which checkpointing saves per region (with dropout)
    until its recomputation has run."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    original = torch.get_rng_state

    def get_rng_state():
        state = original()
        tracker.before_op()
        aid, _ = tracker.alloc(tracker.key("checkpoint.rng_state"), state.untyped_storage().nbytes())
        tracker.saved.append((StorageWeakRef(state.untyped_storage()), aid))
        return state
    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


@contextlib.contextmanager
def no_init():
    """torch.nn.init's in-place initialisers as no-ops (a fake weight has no values to set)."""
    from torch.nn import init
    names = ("normal_", "uniform_", "zeros_", "ones_", "kaiming_uniform_", "trunc_normal_")
    saved = {n: getattr(init, n) for n in names}
    for n in names:
        setattr(init, n, lambda tensor, *a, **k: tensor)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


UNMEASURED = {  # what a CUDA rank's shadow assumes of its strategy's collectives under NCCL over several
    # ranks; at world size 1 the H100 audits of snapshots/examples/nccl-ws1 (ddp, fsdp, tp) are predicted
    # to the byte (tests/test_ranks_on_gpu.py), the reduce-scatter stream's pool included
    "fsdp": "FSDP2's all-gather and reduce-scatter buffers on streams of their own, a caching-allocator pool "
            "per stream, freed in program order (no record_stream); NCCL's own buffers outside PyTorch's "
            "allocator (measured at world size 1 only, where no all-gather runs)",
    "ddp": "DDP's buckets and the reducer's small index tensors on the compute stream; NCCL's all-reduce in "
           "place, its own buffers outside PyTorch's allocator (measured at world size 1 only)",
    "tp": "DTensor's collectives' outputs on the compute stream, freed in program order; NCCL's own buffers "
          "outside PyTorch's allocator (measured at world size 1 only)",
}


@contextlib.contextmanager
def fsdp_on_gpu(cfg, tracker):
    """Inside: a torchrun strategy's CUDA step on meta tensors, each assumption about NCCL's
    collectives over several ranks noted in tracker.unmeasured (UNMEASURED). FSDP2 takes the GPU's path: its device
    is "meta" rather than the mesh's; its device handle is _Streams (each stream FSDP2 makes an
    id, `stream(s)` that id for the allocations made inside, events and waits nothing: the shadow
    runs in program order, as the caching allocator frees without record_stream); and its check
    that no parameter is on the meta device is off (the shadow's weights are all meta)."""
    parallel = cfg.get("parallel", "none")
    for kind, text in UNMEASURED.items():
        if kind in parallel and cfg.get("world_size", 1) > 1:
            tracker.unmeasured.add(f"parallel={parallel} on NCCL over {cfg['world_size']} ranks: {text}")
    if "fsdp" not in parallel:
        yield
        return
    import torch
    from torch.distributed.fsdp._fully_shard import (_fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state,
                                                     _fully_shard)
    streams = _Streams(tracker)
    handle = _fsdp_init._get_device_handle

    def get_handle(device_type):
        return streams if device_type == "meta" else handle(device_type)
    saved = [(m, "_get_device_handle", getattr(m, "_get_device_handle"))
             for m in (_fsdp_collectives, _fsdp_param_group, _fsdp_state, _fsdp_init)]
    saved += [(_fully_shard, "_get_device_from_mesh", _fully_shard._get_device_from_mesh),
              (_fsdp_param_group.FSDPParamGroup, "_validate_no_meta_params",
               _fsdp_param_group.FSDPParamGroup._validate_no_meta_params)]
    for m, name, _ in saved[:4]:
        setattr(m, name, get_handle)
    _fully_shard._get_device_from_mesh = lambda mesh: torch.device("meta")
    _fsdp_param_group.FSDPParamGroup._validate_no_meta_params = lambda self: None
    try:
        yield
    finally:
        for m, name, f in saved:
            setattr(m, name, f)


class _Streams:
    """torch.cuda's stream API as FSDP2 calls it, for a shadow on meta tensors: Stream() a new
    id, stream(s) makes it the one the tracker's allocations are made on (tracker.stream: the
    caching allocator keeps a pool per stream), events and waits nothing."""

    def __init__(self, tracker):
        self.tracker, self.made = tracker, 0

    def Stream(self, priority=0):
        self.made += 1
        return _Stream(self.made)

    def current_stream(self):
        return _Stream(self.tracker.stream)

    def current_device(self):
        return 0

    def Event(self, *args, **kwargs):
        return _Event()

    @contextlib.contextmanager
    def stream(self, s):
        outer = self.tracker.stream
        self.tracker.stream = outer if s is None else s.id
        try:
            yield
        finally:
            self.tracker.stream = outer


class _Event:
    def record(self, stream=None):
        return self

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    def __init__(self, sid):
        self.id = sid

    def __eq__(self, other):
        return isinstance(other, _Stream) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def record_event(self, event=None):
        return event or _Event()

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


@contextlib.contextmanager
def propagation_unseen(tracker, cfg):
    """Inside: DTensor's sharding propagation runs its op on fake tensors of the global shapes
    to learn the output's metadata (a cache miss), which a real run does in a FakeTensorMode of
    its own, with no memory. In a shadow run those ops reach the tracker: they are left out.
    (A miss in step 2 came when the audit's saved-tensor hooks were added to the shadow's
    audited forward: 18 allocations no audit has, under tp.) Only a torchrun strategy makes
    DTensors; importing their module would cost a single-process shadow run 0.2 s."""
    if cfg.get("parallel", "none") == "none":
        yield
        return
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # a torch without DTensor's propagator: nothing to leave out
        yield
        return
    real = ShardingPropagator._propagate_tensor_meta_non_cached

    def unseen(self, *args, **kwargs):
        with tracker.unseeing():
            return real(self, *args, **kwargs)
    ShardingPropagator._propagate_tensor_meta_non_cached = unseen
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = real


@contextlib.contextmanager
def meta():
    """Meta tensors stand for the GPU's: shapes, dtypes and storages of the right size with no
    memory, their kernels in C++ (several times faster than FakeTensorMode's Python dispatch).
    Fused AdamW is allowed on them as on CUDA tensors. The model is built under
    torch.device("meta") (shadow._model); after that every factory the step calls names its
    device (a tensor's), so no device context stands between each torch call and its kernel."""
    from torch.optim import optimizer
    saved = optimizer._get_fused_kernels_supported_devices
    optimizer._get_fused_kernels_supported_devices = lambda: saved() + ["meta"]
    try:
        yield
    finally:
        optimizer._get_fused_kernels_supported_devices = saved
