"""The user's own code shadow-run for a GPU this machine does not have (issues #46, #49).

`memory_audit.shadow(device="cuda", gpu="H100")` runs a script's code as written with every tensor
fake. What the code puts on "cuda" is a meta tensor (shapes, dtypes, storage sizes; autograd's
engine runs it on a CPU build, which a fake CUDA tensor's device guard does not); what stays on
the host is a fake CPU tensor and no device memory. The pieces, each a context manager with its
reason and its restore (`on_gpu` enters them all):

  devices        "cuda" (a string, a torch.device, an index) in a factory's or `.to()`'s
                 arguments, `Tensor.cuda()` and `Module.cuda()` mean "meta"; so a tensor made
                 `device=x.device` follows x, as on the GPU; pin_memory() is the host tensor
  cuda_module    torch.cuda answers as a machine with one `gpu` would: is_available, the device
                 count, name, capability and total memory, bf16 support; seeding, synchronising
                 and the cache calls do nothing
  autocast       torch.autocast("cuda") applies CUDA autocast's policy to the meta tensors
                 (shadow/autocast: ATen's op lists), and checkpointing's recomputation runs
                 again under it (shadow/autocast.recomputed)
  device_choices optimizers default to their foreach kernels and allow fused ones,
                 clip_grad_norm_ takes its foreach path, SDPA runs the kernel CUDA picks and
                 dropout CUDA's fused kernel (shadow/cuda.device_kernels)
The tracker runs its device rules (shadow/tracker._device_op: CUDA's kernel temporaries, the
cuBLAS and cuBLASLt workspaces per thread) and the history goes through the caching allocator's
model (shadow/replay) for reserved memory. Plain Python until a shadow starts.
"""

import contextlib

from . import cuda, patches
from .autocast import autocast, recomputed
from .rules.reduce import MEASURED_CORES, on_cores
from .streams import Stream


# -- the pieces on_gpu enters

def _is_cuda(d):
    """A device argument that names the GPU: "cuda", "cuda:N", torch.device("cuda", N), or an
    index N (an int names an accelerator)."""
    import torch
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    return isinstance(d, int) and not isinstance(d, bool)


def _meta(d):
    return "meta" if _is_cuda(d) else d


@contextlib.contextmanager
def devices():
    """"cuda" means "meta" in every torch call's device argument; Tensor.cuda() is .to("meta");
    torch.tensor(data, device=...) on the device is made on the host and copied, as CUDA does."""
    import torch
    from torch.overrides import TorchFunctionMode
    to_methods = (torch.Tensor.to, torch.Tensor.cuda)
    # lifted from host data: a fake CPU tensor, copied (FakeTensorMode lifts host data only)
    from_data = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.cuda:
                return args[0].to("meta", non_blocking=kwargs.get("non_blocking", False))
            if func is torch.Tensor.pin_memory:  # page-locked host memory: no device memory
                return args[0]
            if func is torch.Tensor.is_pinned:
                return True
            if "device" in kwargs and _is_cuda(kwargs["device"]) or (
                    func in from_data and str(kwargs.get("device")) == "meta"):
                if func in from_data:  # made on the host, then copied: a leaf as torch.tensor makes it
                    grad = kwargs.pop("requires_grad", False)
                    with torch.no_grad():
                        out = func(*args, **dict(kwargs, device="cpu")).to("meta")
                    return out.requires_grad_(grad)
                kwargs = dict(kwargs, device="meta")
            if func in to_methods:
                args = [args[0]] + [_meta(a) for a in args[1:]]
            return func(*args, **kwargs)
    module_to = torch.nn.Module.to
    # Module.to parses its arguments in C++ (no torch function a mode sees): an index means the GPU
    with patches.patched([(torch.nn.Module, "cuda", lambda module, device=None: module.to("meta")),
                          (torch.nn.Module, "to", lambda module, *args, **kwargs: module_to(
                              module, *[_meta(a) for a in args],
                              **{k: _meta(v) if k == "device" else v for k, v in kwargs.items()}))]), \
            _Mode() as mode:
        yield mode


@contextlib.contextmanager
def cuda_module(gpu, total_memory, capability, cores=None):
    """torch.cuda (and torch.accelerator) answering as one `gpu` would (without CUDA, torch.cuda
    says there is none and the code takes its CPU branch). What is left real: streams, events,
    generators on "cuda", and memory_allocated() and the like (0 here: the prediction is the
    shadow's result)."""
    import torch
    cap = tuple(capability)
    sms, threads = cores or MEASURED_CORES
    props = type("Properties", (), {"name": f"NVIDIA {gpu}", "total_memory": total_memory, "major": cap[0],
                                    "minor": cap[1], "multi_processor_count": sms,
                                    "max_threads_per_multi_processor": threads})()
    answers = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "is_bf16_supported": lambda *a, **k: True, "get_device_name": lambda *a, **k: props.name,
        "get_device_capability": lambda *a, **k: cap, "get_device_properties": lambda *a, **k: props,
        "synchronize": lambda *a, **k: None, "empty_cache": lambda: None, "manual_seed": lambda *a: None,
        "manual_seed_all": lambda *a: None, "set_device": lambda *a: None, "reset_peak_memory_stats": lambda *a: None,
        "is_initialized": lambda: True, "current_stream": lambda *a, **k: Stream(),
        "is_current_stream_capturing": lambda: False,
    }
    accelerator = {  # torch.accelerator, the device-generic way code picks its device
        "is_available": lambda *a, **k: True, "current_accelerator": lambda *a, **k: torch.device("cuda"),
        "device_count": lambda: 1, "current_device_index": lambda: 0, "synchronize": lambda *a, **k: None,
        "current_stream": lambda *a, **k: Stream(),  # the optimizers ask whether a graph is being captured
    }
    owners = [(torch.cuda, answers)] + ([(torch.accelerator, accelerator)] if hasattr(torch, "accelerator") else [])
    with patches.patched([(owner, name, fn) for owner, table in owners for name, fn in table.items() if hasattr(owner, name)]):
        yield


@contextlib.contextmanager
def optimizer_defaults():
    """torch.optim's optimizers default to their foreach kernels on the meta tensors, as on CUDA
    ones: their type check takes a fake parameter for a subclass, and meta is no foreach device."""
    from torch.optim import optimizer
    from torch._subclasses.fake_tensor import FakeTensor
    devices_of = optimizer._get_foreach_kernels_supported_devices
    optimizer._foreach_supported_types.append(FakeTensor)  # a list torch.distributed.tensor appends to at its import
    try:
        with patches.patched([(optimizer, "_get_foreach_kernels_supported_devices", lambda: devices_of() + ["meta"])]):
            yield
    finally:
        optimizer._foreach_supported_types.remove(FakeTensor)  # what was added meanwhile (DTensor) stays


@contextlib.contextmanager
def on_gpu(device, note=None):
    """Every piece above for `device` (ledger/config.device_facts' dict); `note` is told each rule a
    call takes that no GPU trace has measured."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_module(device["gpu"], device["total_memory"], device["capability"], device.get("cores")))
        stack.enter_context(on_cores(device.get("cores", MEASURED_CORES)))
        stack.enter_context(patches.meta())
        stack.enter_context(optimizer_defaults())
        kernels = stack.enter_context(cuda.device_kernels(device["sdpa_backend"], note))
        stack.enter_context(autocast())
        on_device = stack.enter_context(devices())
        stack.enter_context(recomputed((kernels, on_device)))
        yield
