"""The live side of the audit: the allocator's history on CUDA, the profiler on CPU, the files.

train.py opens an AuditRecording before it builds the model and calls `phase()` at three
moments of the audited step; everything after that reads the files written here:

  snapshots/<run>/step2_start.pickle            steady state
  snapshots/<run>/step2_before_backward.pickle  activations live
  snapshots/<run>/step2_end.pickle              whole step, so the peak is in the trace
  snapshots/<run>/meta.json                     config, device, stats, address registry,
                                                saved-tensor ledger

On CUDA the pickles are torch.cuda.memory._snapshot() as torch writes them. On CPU the
profiler's memory timeline is turned into the same schema (one segment per live allocation,
since CPU memory has no caching allocator).
"""

import json
import os
import platform
import pickle
import time
import traceback
from contextlib import contextmanager, nullcontext

import torch

from .. import nodynamo
from ..naming.saved import saved_tensor_ledger
from ..naming.tensors import build_registry, tensor_entry
from ..schema import MARKER_PREFIX, META_SCHEMA_VERSION, PHASES

MEMORY_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG",
                   "CUBLASLT_WORKSPACE_SIZE", "PYTORCH_NO_CUDA_MEMORY_CACHING")
# CPU: the roads from the profile to a trace (cpu_timeline.timeline_events), as meta.json names
# the one taken; None takes the raw road
CPU_TIMELINES = (None, "memory_profile", "raw allocations")


class AuditError(RuntimeError):
    """A problem the user can fix; train.py prints it as one line."""


def _write_pickle(obj, path):
    try:
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=4)
    except OSError as e:  # a full disk, a read-only folder: say which file and why
        raise AuditError(f"could not write {path}: {e.strerror or e}") from None


def distributed_info(model):
    """{backend, world_size, rank, mesh} of this process's torch.distributed run (None without
    one). mesh: the DeviceMesh the model's DTensor parameters live on (FSDP2, tensor
    parallelism; the one with most dimensions), None for DDP or plain parameters."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    meshes = [p.device_mesh for p in model.parameters() if getattr(p, "device_mesh", None) is not None]
    mesh = max(meshes, key=lambda m: m.ndim, default=None)
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "rank": dist.get_rank(),
            "mesh": None if mesh is None else {
                "shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or ()),
                "coordinate": mesh.get_coordinate(), "ranks": mesh.mesh.tolist()}}


def _world_size():
    """Ranks in this process's torch.distributed run (1 without one)."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# ---------------------------------------------------------------------------------------------
# recording

def indexed_device(device):
    """torch.device("cuda") as the device it means, cuda:<current>: the index a tensor's device
    names (the saved tensors are kept by comparing the two; without the index none was)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


class AuditRecording:
    """Record allocator history from before the model exists to the end of the audited step.

    Use as a context manager; history recording is always turned off on exit, and a crash or
    an out-of-memory error still leaves a snapshot on disk.
    """

    def __init__(self, run_dir, device, config, max_entries=1_000_000, defer_cpu=False, cpu_timeline=None):
        if cpu_timeline not in CPU_TIMELINES:
            raise AuditError(f"cpu_timeline must be one of {', '.join(map(repr, CPU_TIMELINES))}, got {cpu_timeline!r}")
        self.run_dir = run_dir
        self.defer_cpu = defer_cpu
        self.cpu_road = cpu_timeline  # CPU: the road asked for (None: the raw road)
        self.device = indexed_device(device)
        self.cuda = self.device.type == "cuda"
        self.config = config
        self.max_entries = max_entries
        self.phases = {}
        self.saved_tensors = []
        self.compiled_wrappers = None  # compiled runs: the wrappers inductor loaded (compiled.capture)
        self.cpu_timeline = None
        self.distributed = None  # torch.distributed runs: distributed_info()
        self.markers = {}  # CPU: phase -> marker name in the profile
        self.markers_seen = []
        self.error = None
        self.files = []
        self.prof = None
        self._stand_in = False  # whether the profiler's start put nodynamo's stand-in in place
        self.active = False

    # -- lifecycle
    def __enter__(self):
        if os.path.isdir(self.run_dir) and os.listdir(self.run_dir):
            raise AuditError(f"{self.run_dir} already exists and is not empty: an audit never replaces one")
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as e:
            raise AuditError(f"could not create {self.run_dir}: {e.strerror or e}") from None
        if self.cuda:
            torch.cuda.init()  # before the OOM observer: attaching it earlier has crashed
            torch.cuda.reset_peak_memory_stats(self.device)
            # Stacks on allocations only (context "alloc"): with stacks gathered on frees too, a
            # checkpoint's recomputation that stops early inside an op saving its output (dropout's
            # mask) loses the stopping exception as the op's outputs are freed, and backward dies
            # with "SystemError: ... returned NULL without setting an exception" (torch 2.11,
            # H200; scripts/gpu_probe.py part 4 shows it without any audit). Frees are named by
            # the allocation they free.
            torch.cuda.memory._record_memory_history(
                enabled="all", context="alloc", stacks="python", max_entries=self.max_entries)
            torch._C._cuda_attach_out_of_memory_observer(self._on_oom)
        elif not self.defer_cpu:
            self._start_profiler()
        self.active = True
        self.t0 = time.time()
        return self

    def _start_profiler(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                           profile_memory=True, record_shapes=True, with_stack=True)
        # On one process torch._dynamo stays unimported while the profiler records. Under
        # torchrun DDP, FSDP2 and DTensor import it mid-step anyway, and an import inside the
        # profile costs far more than before it: there the profiler's start imports it, as torch does.
        alone = _world_size() == 1
        self._stand_in = nodynamo.enter() if alone else False
        with (nodynamo.inductor_not_offered() if alone else nullcontext()):
            self.prof.__enter__()

    def show_cpu(self, tensors):
        """CPU, profiling: an alias of each of `tensors` (no memory, no effect on training), so
        the profiler reports the ones older than itself that no op of the step uses (a buffer
        only read when the sequence grows: transformers' rotary original_inv_freq)."""
        if not self.cuda and self.prof is not None and self.active:
            for t in tensors:
                torch.ops.aten.alias.default(t)

    def begin_cpu(self, tensors=lambda: ()):
        """CPU, deferred: start the profiler now (a compiled run's audited step: profiling
        inductor's compilation with stacks would take more memory than the machine has). The
        profiler reports a tensor older than itself only once an op uses it, and compiled code
        uses them outside aten: an alias of each of `tensors` (a view: no memory, no effect on
        training) shows it the ones that exist now. `tensors` is called only then."""
        if not self.cuda and self.prof is None and self.active:
            self._start_profiler()
            for t in tensors():
                torch.ops.aten.alias.default(t)

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and self.error is None:
            oom = isinstance(exc, torch.OutOfMemoryError) if hasattr(torch, "OutOfMemoryError") else False
            self.error = {"type": exc_type.__name__, "message": str(exc).splitlines()[0][:500] if str(exc) else "",
                          "oom": oom, "where": traceback.format_exception(exc_type, exc, tb)[-2:-1]}
            if self.active:
                self._dump_crash("oom" if oom else "crash")
        self.stop()
        self.write_meta()
        return False

    def stop(self):
        """Turn recording off (idempotent); on CPU this is when the pickles are written."""
        if not self.active:
            return
        self.active = False
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
        elif self.prof is not None:
            try:
                self.prof.__exit__(None, None, None)
            finally:
                if self._stand_in:
                    nodynamo.leave()
            self._write_cpu_snapshots()

    # -- phases
    def phase(self, name, model, optimizer=None, scaler=None, tensors=None, dump=True, held=None, made=None):
        """Register every named tensor by address and dump a snapshot now.

        dump=False records the registry and the position in the trace only (used after
        backward, so that gradients that die at zero_grad still get their names). held: {name:
        tensor} the loop holds, named only where nothing else (registry, saved tensors) names it.
        made: registry entries of what the code made (loop_calls.LoopCalls), named last.
        """
        registry = build_registry(model, optimizer, scaler, tensors)
        info = {"file": f"{name}.pickle" if dump else None, "registry": registry,
                "held": [tensor_entry(k, t) for k, t in (held or {}).items() if torch.is_tensor(t)]}
        if made:
            info["made"] = made
        if self.cuda:
            torch.cuda.synchronize(self.device)
            info.update(self._cuda_stats())
            snap = torch.cuda.memory._snapshot()
            info.update(self._trace_counts(snap))
            self.allocator_settings = snap.get("allocator_settings")
            if dump:
                _write_pickle(snap, os.path.join(self.run_dir, info["file"]))
                self._wrote(info["file"])
            if name == "step2_start":  # the step's own peak, from here to step2_end
                info["max_memory_allocated_before_reset"] = info["max_memory_allocated"]
                torch.cuda.reset_peak_memory_stats(self.device)
        else:  # a phase may come again (a micro-step's before_backward): the last one counts
            marker = f"{MARKER_PREFIX}{name}@{len(self.markers_seen)}"
            with torch.profiler.record_function(marker):
                pass
            self.markers[name] = marker
            self.markers_seen.append(marker)
            info.update({"memory_allocated": None, "memory_reserved": None, "max_memory_allocated": None})
        info["wall_time_s"] = round(time.time() - self.t0, 3)
        self.phases[name] = info

    @contextmanager
    def audited_forward(self, model):
        """Around the audited forward: yields `label(loss)` to call once the loss exists."""
        device = str(next(model.parameters()).device)
        with saved_tensor_ledger(model, self.saved_tensors, device) as label:
            yield label

    # -- CUDA helpers
    def _cuda_stats(self):
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return {"memory_allocated": torch.cuda.memory_allocated(self.device), "memory_reserved": reserved,
                "max_memory_allocated": torch.cuda.max_memory_allocated(self.device),
                # what the card holds that PyTorch's allocator did not reserve: the CUDA context,
                # cuBLAS/cuDNN handles, kernels (and any other process on this GPU)
                "outside_pytorch": total - free - reserved, "device_free": free}

    def _trace_counts(self, snap):
        idx = self.device.index or 0
        traces = snap.get("device_traces", [])
        n = len(traces[idx]) if idx < len(traces) else 0
        return {"trace_entries": n, "ring_buffer_full": n >= self.max_entries}

    def _on_oom(self, device, alloc, device_alloc, device_free):
        self._dump_crash("oom")

    def _dump_crash(self, kind):
        path = os.path.join(self.run_dir, f"{kind}.pickle")
        if os.path.exists(path):
            return
        try:
            if self.cuda:
                _write_pickle(torch.cuda.memory._snapshot(), path)
                self._wrote(f"{kind}.pickle")
            else:
                marker = f"{MARKER_PREFIX}{kind}"
                with torch.profiler.record_function(marker):
                    pass
                self.markers[kind] = marker
                self.phases.setdefault(kind, {"file": f"{kind}.pickle", "registry": []})
        except Exception as e:  # the crash itself is what the user must see: keep going
            self.error = dict(self.error or {}, dump_failed=str(e))

    def _wrote(self, file):
        if file not in self.files:
            self.files.append(file)

    def named_addresses(self):
        """{storage address: its bytes} of every storage a phase named (registry, saved tensors):
        the first phase's (CPU reuses an address freed in the step for another tensor)."""
        named = {}
        for r in [r for info in self.phases.values() for r in info.get("registry", []) + info.get("held", [])] \
                + list(self.saved_tensors):
            named.setdefault(r["data_ptr"], r.get("nbytes") or 0)
        return named

    # -- CPU: profiler timeline -> snapshot schema
    def _write_cpu_snapshots(self):
        from ..reading.cpu_snapshot import snapshot_at
        from .cpu_timeline import timeline_events
        road = {}
        end = self.phases.get(PHASES[-1], {})
        alive = {r["data_ptr"] for r in end.get("registry", []) + end.get("held", [])}
        named_at = {self.markers[name]: {r["data_ptr"] for r in info.get("registry", []) + info.get("held", [])}
                    for name, info in self.phases.items() if name in self.markers}
        events, marker_times = timeline_events(self.prof, set(self.markers.values()), self.named_addresses(), road,
                                               alive, keyed=self._keyed(), named_at=named_at)
        self.cpu_timeline = road.get("source")
        if self.compiled_wrappers:
            from .cpu_timeline import name_compiled
            events = name_compiled(events, self.compiled_wrappers)
        for name, marker in self.markers.items():
            t = marker_times.get(marker)
            if t is None:
                continue
            snap = snapshot_at(events, t)
            info = self.phases[name]
            info["time_us"] = t // 1000
            info["trace_entries"] = len(snap["device_traces"][0])
            info["ring_buffer_full"] = False
            if info["file"]:
                _write_pickle(snap, os.path.join(self.run_dir, info["file"]))
                self._wrote(info["file"])

    def _keyed(self):
        """Whether to try the memory profile: only where asked for (else the raw road:
        cpu_timeline.timeline_events)."""
        return self.cpu_road == "memory_profile"

    # -- meta.json
    def write_meta(self):
        meta = {
            "schema_version": META_SCHEMA_VERSION,
            "torch_version": torch.__version__,
            "device": self.device_info(),
            "config": self.config,
            "env": {k: os.environ[k] for k in MEMORY_ENV_VARS if k in os.environ},
            "max_entries": self.max_entries,
            "phases": self.phases,
            "saved_tensors": self.saved_tensors,
            "compiled_wrappers": self.compiled_wrappers,
            "distributed": self.distributed,
            "cpu_timeline": self.cpu_timeline,  # CPU: how the profile became a trace
            "error": self.error,
            "files": self.files,
        }
        if getattr(self, "predicted", None) is not None:  # Audit(predicted=predict_loop(...))
            meta["predicted"] = self.predicted
        path = os.path.join(self.run_dir, "meta.json")
        try:
            with open(path, "w") as f:
                json.dump(meta, f, indent=1)
        except OSError as e:
            raise AuditError(f"could not write {path}: {e.strerror or e}") from None

    def device_info(self):
        if not self.cuda:
            return {"type": "cpu", "name": "cpu", "capability": None, "total_memory": None,
                    "allocator_settings": None, "cpu": cpu_info()}
        props = torch.cuda.get_device_properties(self.device)
        return {"type": "cuda", "name": props.name, "capability": list(torch.cuda.get_device_capability(self.device)),
                "total_memory": props.total_memory, "cuda_version": torch.version.cuda,
                "allocator_settings": getattr(self, "allocator_settings", None)}


def cpu_info():
    """Which CPU measured a CPU audit, and what of it changes what its kernels allocate: its model
    name, torch's thread count (per-thread kernel buffers), whether its bf16 (fp16) matmuls run
    through oneDNN (scratch buffers after their outputs: prediction/shadow/probe) and whether it
    has AMX's bf16 tiles (oneDNN and CPU flash attention then take AMX kernels, whose scratch
    buffers are not avx512_bf16's: a bf16 audit on an AMD EPYC and on a Xeon with AMX differ)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), model)
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    except OSError:
        pass
    return {"model": model, "threads": torch.get_num_threads(),
            "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "onednn_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()), "amx_bf16": "amx_bf16" in flags}
