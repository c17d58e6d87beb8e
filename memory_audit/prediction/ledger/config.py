"""The configs and machines a prediction takes: train.py's keys (DEFAULTS, PARALLEL, resolved,
validate), model.py's presets read without importing torch, and the GPUs (GPUS, device_facts).
Pure Python, no torch."""

from ...reading.attribute import workspace_size_from_env
from ...schema import check_model_config
from . import tensor_parallel as tp

# name -> (compute capability, total memory in bytes as torch reports it)
GPUS = {
    "A100": ((8, 0), 85_899_345_920),  # A100-SXM4-80GB
    "A100-40GB": ((8, 0), 42_505_273_344),
    "H100": ((9, 0), 85_017_493_504),  # measured: NVIDIA H100 80GB HBM3
    "H200": ((9, 0), 150_110_011_392),
    "L4": ((8, 9), 23_580_639_232),
    "A10G": ((8, 6), 23_836_033_024),
    "V100": ((7, 0), 34_089_730_048),
    "RTX4090": ((8, 9), 25_386_352_640),
}
# name -> (SMs, threads per SM): how CUDA's reductions split (shadow/rules/reduce.py); the H200's
# measured (scripts/gpu_reduce.py), the others NVIDIA's published figures for the same boards
CORES = {"A100": (108, 2048), "A100-40GB": (108, 2048), "H100": (132, 2048), "H200": (132, 2048),
         "L4": (58, 1536), "A10G": (80, 1536), "V100": (80, 2048), "RTX4090": (128, 1536)}

DEFAULTS = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False,
                dropout=0.0, batch_size=12, gradient_accumulation_steps=1, dtype="float16",
                attention="manual", activation="gelu", optimizer_impl="fused", set_to_none=True,
                keep_logits=True, grad_clip=1.0, activation_checkpointing="none", ac_every=1,
                sac_save_ops="", parallel="none", world_size=1, tp_size=0, ddp_bucket_view=False, rank=0)


def gpu_name(name):
    """The GPU table's name for `name`, any case ("h100" -> "H100"), or None."""
    return next((g for g in GPUS if g.lower() == str(name).lower()), None)


# Memory a CUDA process holds outside PyTorch's allocator (context, cuBLAS/cuDNN handles and
# kernels): an estimate until a GPU run measures it (meta.json's outside_pytorch: the card's
# used bytes from mem_get_info() minus memory_reserved()); `--outside=BYTES` overrides it.
OUTSIDE_PYTORCH_DEFAULT = 768 * 2 ** 20


def expandable_from_env(env):
    """Whether PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) turns expandable_segments on."""
    conf = (env or {}).get("PYTORCH_CUDA_ALLOC_CONF") or (env or {}).get("PYTORCH_ALLOC_CONF") or ""
    opts = dict(o.split(":", 1) for o in conf.replace(" ", "").split(",") if ":" in o)
    return opts.get("expandable_segments", "False").lower() == "true"


def device_facts(device="cuda", gpu="H100", capability=None, torch_version="2.11",
                 env=None, sdpa_backend=None, total_memory=None, outside_pytorch=OUTSIDE_PYTORCH_DEFAULT, cpu=None):
    """What the predictor needs to know about the machine, as a plain dict. cpu: the CPU an audit
    ran on (recorder.cpu_info: threads, whether bf16 matmuls go through oneDNN), None for this one."""
    env = env or {}
    if device == "cpu":
        return {"type": "cpu", "gpu": None, "capability": None, "workspace_bytes": 0,
                "workspaces": 0, "sdpa_backend": "flash_cpu", "total_memory": total_memory,
                "torch_version": torch_version, "cpu": cpu}
    cap, mem = GPUS.get(gpu_name(gpu), (capability or (8, 0), total_memory))
    cap = tuple(capability or cap)
    # CUBLAS_WORKSPACE_CONFIG wins; else sm90 uses 4096 KiB x 8 = 33,554,432 B (measured on an
    # H100, torch 2.11) and older GPUs ":4096:2:16:8" = 8,519,680 B
    ws = workspace_size_from_env(env) or (4096 * 1024 * 8 if cap >= (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8)
    if sdpa_backend is None:  # fp16/bf16 SDPA's kernel: flash attention needs sm80, cuDNN's is Hopper's here
        sdpa_backend = "cudnn" if cap >= (9, 0) else "flash" if cap >= (8, 0) else "efficient"
    return {"type": "cuda", "gpu": gpu, "capability": list(cap), "workspace_bytes": ws, "workspaces": 2,
            "sdpa_backend": sdpa_backend, "total_memory": total_memory or mem, "torch_version": torch_version,
            "expandable_segments": expandable_from_env(env), "outside_pytorch": outside_pytorch,
            "cores": CORES.get(gpu_name(gpu))}


def presets():
    """model.py's PRESETS, read from its source (importing model.py imports torch, which the
    ledger's commands do not need): {name: {key: value}}."""
    import ast
    import importlib.util
    spec = importlib.util.find_spec("model")
    if spec is None or spec.origin is None:
        raise ValueError("model.py not found: run from the repository (or install it with pip install -e .)")
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["PRESETS"]:
            return {ast.literal_eval(k): {kw.arg: ast.literal_eval(kw.value) for kw in v.keywords}
                    for k, v in zip(node.value.keys, node.value.values)}
    raise ValueError(f"no PRESETS in {spec.origin}")


PARALLEL = ("none", "ddp", "fsdp", "tp", "tp-sp", "fsdp+tp", "fsdp+tp-sp")


def resolved(config):
    """train.py's keys of `config` over DEFAULTS, as a run resolves them; other keys (a
    report's run name, a sweep's nproc) are dropped."""
    return dict(DEFAULTS, **{k: v for k, v in config.items() if k in DEFAULTS})


def validate(cfg):
    """The model rules model.py applies, plus the run's own keys."""
    check_model_config(cfg)
    for k in ("batch_size", "gradient_accumulation_steps"):
        if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1:
            raise ValueError(f"{k} must be a positive integer, got {cfg[k]!r}")
    if cfg["dtype"] not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {cfg['dtype']!r}")
    if cfg["parallel"] not in PARALLEL:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {cfg['parallel']!r}")
    if not isinstance(cfg["world_size"], int) or isinstance(cfg["world_size"], bool) or cfg["world_size"] < 1:
        raise ValueError(f"world_size must be a positive integer, got {cfg['world_size']!r}")
    if not isinstance(cfg["rank"], int) or isinstance(cfg["rank"], bool) or not 0 <= cfg["rank"] < cfg["world_size"]:
        raise ValueError(f"rank must be an integer from 0 to world_size - 1 = {cfg['world_size'] - 1}, got {cfg['rank']!r}")
    tp.check(cfg)
