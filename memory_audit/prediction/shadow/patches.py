"""Every change the shadow run makes to torch or to a library while it runs, in one place: each a
context manager that says why and puts back what it replaced.

  cpu_rules         F.scaled_dot_product_attention, F.linear and the recurrent layers' C++ entry
                    points marked as regions where a real CPU run adds in place (adds_in_place),
                    with rng_states and storage_resizes
  storage_resizes   UntypedStorage.resize_ reported to the tracker (FSDP2 frees and re-makes an
                    unsharded parameter's memory with it; no op the dispatcher sees)
  rng_states        torch.get_rng_state counted (checkpointing saves the CPU generator's state)
  no_init           torch.nn.init's initialisers as no-ops (a fake weight has no values to set)
  fsdp_on_gpu       FSDP2's GPU path on meta tensors (its device, its device handle: the streams
                    of shadow/streams, its meta-parameter check), with shadow/rules/collectives' notes
  propagation_unseen  DTensor's sharding propagation on fake tensors of the global shapes left
                    out of the tracker (a real run does it in a FakeTensorMode of its own)
  meta              fused AdamW allowed on meta tensors, as on CUDA tensors
  fake_modules      nn.Module._apply and Tensor.__deepcopy__ for modules of fake tensors (a
                    user's code run as written: shadow/script)
  cut_lists         nn.ModuleList and nn.Sequential given their modules through a function that
                    may keep fewer (shadow/depth: a deep model's equal blocks run at depths 3 and 4)
  LibraryBranches   a library's checks for tracing answered False (NOT_A_TRACE), and on a GPU
                    shadow its device-type branches taken for "cuda" (META_IS_CUDA)
  inside_modes      torch.nn.functional's override checks answered False once, so a composite
                    (multi_head_attention_forward) runs its body under the shadow's torch-function
                    modes (CUDA's kernels, autocast) rather than with every mode off
  patched           (owner, name, new) triples set for a block, put back on every exit (the
                    GPU shadow's torch.cuda and autocast stand-ins: shadow/gpu, shadow/autocast)
The GPU shadow's stand-ins go through `patched` beside the code they serve: torch.cuda's
answers, device arguments and the optimizers' foreach defaults (shadow/gpu), torch.autocast and
checkpointing's recomputation (shadow/autocast), clip_grad_norm_'s foreach path (shadow/cuda);
so does a user script's DDP (shadow/ranks.script_ddp). The hooks shadow/script's session itself
sets (backward, zero_grad, value reads) are its own instruments, as an Audit's hooks are, and
stay with it. Plain Python until a shadow run starts.
"""

import contextlib

from .rules.collectives import nccl_assumptions
from .streams import Streams


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
    with patched([(owner, name, in_place(original)) for (owner, name), original in originals.items()]), \
            rng_states(tracker), storage_resizes(tracker):
        yield


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
    with patched([(torch.UntypedStorage, "resize_", resized)]):
        yield


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
    with patched([(torch, "get_rng_state", get_rng_state)]):
        yield


@contextlib.contextmanager
def no_init():
    """torch.nn.init's in-place initialisers as no-ops (a fake weight has no values to set)."""
    from torch.nn import init
    names = ("normal_", "uniform_", "zeros_", "ones_", "kaiming_uniform_", "trunc_normal_")
    with patched([(init, n, lambda tensor, *a, **k: tensor) for n in names]):
        yield


@contextlib.contextmanager
def fsdp_on_gpu(cfg, tracker):
    """Inside: a torchrun strategy's CUDA step on meta tensors, each assumption about NCCL's
    collectives over several ranks noted in tracker.unmeasured (shadow/rules/collectives). FSDP2 takes the GPU's path: its device
    is "meta" rather than the mesh's; its device handle is shadow/streams.Streams (each stream FSDP2 makes an
    id, `stream(s)` that id for the allocations made inside, events and waits nothing: the shadow
    runs in program order, as the caching allocator frees without record_stream); and its check
    that no parameter is on the meta device is off (the shadow's weights are all meta)."""
    parallel = cfg.get("parallel", "none")
    tracker.unmeasured.update(nccl_assumptions(parallel, cfg.get("world_size", 1)))
    if "fsdp" not in parallel:
        yield
        return
    import torch
    from torch.distributed.fsdp._fully_shard import (_fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state,
                                                     _fully_shard)
    streams = Streams(tracker)
    handle = _fsdp_init._get_device_handle

    def get_handle(device_type):
        return streams if device_type == "meta" else handle(device_type)
    triples = [(m, "_get_device_handle", get_handle) for m in (_fsdp_collectives, _fsdp_param_group, _fsdp_state,
                                                                _fsdp_init)]
    triples += [(_fully_shard, "_get_device_from_mesh", lambda mesh: torch.device("meta")),
                (_fsdp_param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None)]
    with patched(triples):
        yield


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
    torch.device("meta") (shadow/step._model); after that every factory the step calls names its
    device (a tensor's), so no device context stands between each torch call and its kernel."""
    from torch.optim import optimizer
    devices_of = optimizer._get_fused_kernels_supported_devices
    with patched([(optimizer, "_get_fused_kernels_supported_devices", lambda: devices_of() + ["meta"])]):
        yield


@contextlib.contextmanager
def ctc_as_on_real_tensors(known):
    """torch.ctc_loss on CPU as it runs on real tensors, where the lengths are known (Python
    lists, or tensors whose values known_values knows): ATen takes a subclass's tensor lengths
    through a composite path (other ops, other saved tensors), and with list lengths it writes
    them into a new tensor's data, which a fake tensor has not (the run stopped there). The real
    path, as CPU audits show it: _ctc_loss at the lengths, zero_infinity's zeros, == inf and
    where, then the mean over the target lengths (a tensor of the result's dtype, clamped) or the
    sum (scripts/user_loops.py's two CTC loops, user-loops-54591.txt; tests/test_known_values.py)."""
    import torch
    original = torch.ctc_loss

    def lengths(x):
        if isinstance(x, torch.Tensor):
            v = known.value(x)
            return None if v is None or v.dim() != 1 else [int(i) for i in v.tolist()]
        return [int(i) for i in x]

    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False):
        il, tl = lengths(input_lengths), lengths(target_lengths)
        if log_probs.device.type != "cpu" or log_probs.dim() != 3 or il is None or tl is None:
            return original(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        res = torch._ctc_loss(log_probs, targets.to(log_probs.device, torch.long), il, tl, blank, zero_infinity)[0]
        if zero_infinity:
            zero = torch.zeros((), dtype=res.dtype)
            res = torch.where(res == float("inf"), zero, res)
            del zero
        if reduction == 1:  # mean
            return (res / torch.tensor(tl, dtype=res.dtype).clamp_min(1)).mean()
        return res.sum() if reduction == 2 else res
    with patched([(torch, "ctc_loss", ctc_loss)]):
        yield


@contextlib.contextmanager
def fake_modules():
    """nn.Module._apply and Tensor.__deepcopy__ for modules of fake tensors (fake_apply,
    same_mode_deepcopy), while a user's code runs in the shadow."""
    import torch
    from .fakes import fake_apply, same_mode_deepcopy
    with patched([(torch.nn.Module, "_apply", fake_apply(torch.nn.Module._apply)),
                  (torch.Tensor, "__deepcopy__", same_mode_deepcopy(torch.Tensor.__deepcopy__))]):
        yield


# Library checks that take a fake tensor for a trace (torch.compile, export) and run the branch
# written for tracing; the shadow runs eager code, so while it runs they answer False. (module,
# function, why), patched once the module is imported (at the first forward that finds it).
NOT_A_TRACE = (
    ("transformers.utils.import_utils", "is_fake_tensor",
     "transformers' is_tracing() skips, for a fake tensor, the reads that decide whether a causal or "
     "packed-sequence mask is built (masking_utils); a real run makes them (zoo-check seed 418482: "
     "Qwen2 and GPT-2 with checkpointing and SDPA, +6,561 to +43,350 B at the peak)"),
)

# Library functions that read a tensor's device type and, for "meta" (what a GPU shadow's device
# tensors are), take another branch than for "cuda"; while a GPU shadow runs they are called with
# "cuda". (module, function, why), replaced wherever a loaded module holds them.
META_IS_CUDA = (
    ("transformers.utils.generic", "maybe_autocast",
     "transformers' maybe_autocast(device_type='meta') is a no-op, so rotary embeddings' fp32 region "
     "(enabled=False) would stay under bf16 autocast (zoo H100 traces, seed 408334: Qwen2 bf16)"),
)


class LibraryBranches:
    """`with LibraryBranches(gpu) as b:` NOT_A_TRACE's functions answer False, and on a GPU
    shadow META_IS_CUDA's are called with "cuda", in the modules loaded when `b.apply()` is
    called (at each top-level forward: a library may be imported lazily by the forward itself);
    every one put back on leaving."""

    def __init__(self, gpu):
        self.gpu, self.saved, self.as_cuda = gpu, {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for (owner, name), value in self.saved.items():
            setattr(owner, name, value)
        self.saved = {}

    def apply(self):
        import sys
        for module, name, _why in NOT_A_TRACE:
            owner = sys.modules.get(module)
            if owner is not None and (owner, name) not in self.saved and hasattr(owner, name):
                self.saved[(owner, name)] = getattr(owner, name)
                setattr(owner, name, lambda *a, **k: False)
        for module, name, _why in META_IS_CUDA if self.gpu else ():
            home = sys.modules.get(module)
            original = self.saved.get((home, name), getattr(home, name, None))
            if original is None:
                continue
            as_cuda = self.as_cuda.setdefault((module, name), _as_cuda(original))
            for owner in list(sys.modules.values()):  # their own dicts: a lazy module's getattr imports
                held = getattr(owner, "__dict__", {}).get(name)
                if held is original and (owner, name) not in self.saved:
                    self.saved[(owner, name)] = original
                    setattr(owner, name, as_cuda)


@contextlib.contextmanager
def cut_lists(take):
    """nn.ModuleList(modules) and nn.Sequential(*modules) built from take(modules), which may keep
    fewer of them (shadow/depth.Cut: a deep model's equal blocks shadow-run at depths 3 and 4,
    the step repeated to its own depth). Sequential from an OrderedDict is left as it is."""
    import collections
    from torch import nn
    module_list, sequential = nn.ModuleList.__init__, nn.Sequential.__init__

    def list_init(self, modules=None):
        module_list(self, None if modules is None else take(list(modules)))

    def sequential_init(self, *args):
        whole = len(args) == 1 and isinstance(args[0], collections.OrderedDict)
        sequential(self, *(args if whole else take(list(args))))
    with patched([(nn.ModuleList, "__init__", list_init), (nn.Sequential, "__init__", sequential_init)]):
        yield


def composite(func):
    """Whether `func` is one of torch.nn.functional's composites that hand themselves to a
    torch-function mode whole (multi_head_attention_forward: nn.MultiheadAttention's forward)."""
    import torch.nn.functional as F
    return func is F.multi_head_attention_forward


def inside_modes(mode, func, args, kwargs):
    """Run a composite (`composite(func)`) with the shadow's torch-function modes on. Torch hands
    the call to the top mode with that mode taken off the stack, and each mode below in turn,
    so the composite's body runs with none: the SDPA, dropout and linear it calls would take the
    CPU's paths and no autocast (nn.TransformerEncoder at GPT-2's width in bf16 on an H200, seed
    69881: +150 to +545 MB). `mode` is put back on the stack and the body's own first check for
    a torch-function override answered False, so every call inside reaches the modes as the
    code's own calls do."""
    import torch.nn.functional as F
    names = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
    armed = [True]

    def skip_first(real):
        def check(*a):
            if armed[0]:
                armed[0] = False
                return False
            return real(*a)
        return check
    with patched([(F, n, skip_first(getattr(F, n))) for n in names]), mode:
        return func(*args, **kwargs)


def _as_cuda(original):
    """`original(device_type, ...)` called with "cuda" where the code passes "meta"."""
    def call(device_type, *args, **kwargs):
        return original("cuda" if device_type == "meta" else device_type, *args, **kwargs)
    return call


@contextlib.contextmanager
def patched(triples):
    """Each (owner, name, new) set for the block; the originals put back on every exit."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in triples]
    for owner, name, new in triples:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)
