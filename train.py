"""
Train a nanoGPT-style GPT-2 and, with --audit, record where every byte of memory goes.

    python train.py --audit                         # GPT-2 small on CUDA, a small preset on CPU
    python train.py --preset=gpt2-medium --dtype=bfloat16 --attention=sdpa --audit
    python train.py config/audit_reference.py --batch_size=8

The audit dumps snapshots/<run>/step2_start.pickle (steady state),
step2_before_backward.pickle (activations live) and step2_end.pickle (the whole step with its
peak), plus meta.json that names every tensor by address. The audit only observes: the same
seed gives the same losses with and without it.
"""

import os
import sys


def error_line(message):
    """`error: message` in one write, newline included: under torchrun every rank shares one
    stderr, and print's two writes (text, then newline) from two ranks once interleaved."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun stops the other ranks when one fails:
    import signal                                         # one that is still starting says so in one line

    def _stopped_early(signum, frame):
        error_line("torchrun stopped this rank (SIGTERM) while it started: another rank failed; see its error")
        os._exit(2)
    signal.signal(signal.SIGTERM, _stopped_early)
import json
import math
import time
from contextlib import nullcontext
from datetime import datetime

import numpy as np
import torch

from configurator import apply_overrides, ConfigError
from model import GPT, GPTConfig, PRESETS
from train_step import Watch, run_step

# -----------------------------------------------------------------------------
# default config values: GPT-2 small (124M) at the reference batch of the memory article
# data
dataset = "synthetic"  # "synthetic" = random tokens (memory does not depend on their values), else data/<dataset>/train.bin
gradient_accumulation_steps = 1
batch_size = 12  # micro-batch size
block_size = 1024
# model
preset = "auto"  # auto = gpt2 on CUDA, cpu-mini on CPU; see model.PRESETS
n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50304
dropout = 0.0
bias = False
attention = "manual"  # manual | sdpa
activation = "gelu"  # gelu | relu
activation_checkpointing = "none"  # none | full | selective (attention core) | sac (selective activation checkpointing)
ac_every = 1  # checkpoint every ac_every-th block (0, ac_every, ...)
sac_save_ops = ""  # sac: comma-separated aten ops whose outputs are kept; "" = mm, addmm, bmm and the SDPA kernels
# adamw optimizer
learning_rate = 6e-4
max_iters = 600000  # nanoGPT's full run; --audit stops after the audited step (audit_step + 1 steps)
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip gradients at this value, or disable if == 0.0
optimizer_impl = "fused"  # fused | foreach | for
set_to_none = True  # optimizer.zero_grad(set_to_none=...): False keeps grads allocated all step
keep_logits = True  # hold the fp16 logits through backward as nanoGPT's loop does (2*B*T*V bytes); False drops them after the forward
# learning rate decay settings
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
# system
device = "auto"  # auto | cpu | cuda | cuda:1 ...
dtype = "auto"  # auto = float16 on CUDA, float32 on CPU; float32 | bfloat16 | float16 (GradScaler)
compile = False
activation_memory_budget = 1.0  # compile: the partitioner's memory budget (0..1); 1.0 = its default behaviour
seed = 1337
# distributed (torchrun --standalone --nproc_per_node=N train.py ...)
parallel = "auto"  # auto = ddp under torchrun, none otherwise | none | ddp | fsdp (FSDP2, fully_shard) | tp | tp-sp (tensor parallel, + sequence parallel) | fsdp+tp | fsdp+tp-sp (2-D mesh)
tp_size = 0  # fsdp+tp, fsdp+tp-sp: ranks per tensor-parallel group (divides the world size; FSDP2 shards over the rest); tp, tp-sp: 0 or the world size
ddp_bucket_view = False  # ddp: gradient_as_bucket_view (the gradients are views into DDP's buckets)
dist_timeout_s = 120  # a rank waiting longer than this on another ends with one line instead of hanging
log_interval = 1
losses_out = ""  # write the per-step losses (exact, as float.hex) to this JSON file
# memory audit
audit = False
audit_step = 2  # the audited step (1-based): step 2 is the first with Adam state allocated
audit_dir = "snapshots"
audit_max_entries = 1000000  # allocator trace ring buffer
audit_continue = False  # keep training after the audited step instead of stopping one step later
run_name = ""  # snapshots/<run_name>; default names the config and the time
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]


def fail(message):
    error_line(message)
    sys.exit(2)


if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:  # the config section of this file, as written
    _src = open(__file__).read().split("# " + "-" * 77 + "\n")[1]
    print(__doc__.strip() + "\n\nConfig keys (override with --key=value or a config/*.py file), defaults as below:\n\n"
          + _src.split("config_keys = ")[0].rstrip())
    sys.exit(0)
try:
    _given = apply_overrides(globals(), sys.argv[1:])
except ConfigError as e:
    fail(str(e))

# resolve "auto" settings -------------------------------------------------------
if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "cpu"
device_type = "cuda" if device.startswith("cuda") else "cpu"
if device_type == "cuda" and not torch.cuda.is_available():
    fail(f"device={device} but this machine has no CUDA")
if preset == "auto":
    preset = "gpt2" if device_type == "cuda" else "cpu-mini"
    if device_type == "cpu" and "batch_size" not in _given:
        batch_size = 8
    print(f"preset auto -> {preset} (device {device})")
if preset not in PRESETS:
    fail(f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")
for _k, _v in PRESETS[preset].items():
    if _k not in _given:
        globals()[_k] = _v
if dtype == "auto":
    dtype = "float16" if device_type == "cuda" else "float32"
if dtype not in ("float32", "bfloat16", "float16"):
    fail(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
if dtype == "bfloat16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
    fail("dtype=bfloat16 but this GPU does not support bfloat16")
for _k in ("batch_size", "gradient_accumulation_steps", "max_iters", "audit_step"):
    if globals()[_k] < 1:
        fail(f"{_k} must be at least 1, got {globals()[_k]}")
if audit and audit_step < 2:
    fail("audit_step must be at least 2: step 1 has no optimizer state yet")
if audit and max_iters < audit_step:
    fail(f"max_iters={max_iters} ends before audit_step={audit_step}")
if audit and compile and device_type == "cpu":
    # the CPU profiler starts one step before the audited one, and step 1 compiles
    if "audit_step" not in _given:
        audit_step = 3
    elif audit_step < 3:
        fail(f"a compiled CPU audit needs audit_step >= 3 (got {audit_step}): step 1 compiles, and the step "
             "before the audited one is profiled too")
if not 0.0 <= activation_memory_budget <= 1.0:
    fail(f"activation_memory_budget must be between 0 and 1, got {activation_memory_budget}")
if compile and device_type == "cpu":
    import shutil
    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        fail("compile=True on CPU needs a C++ compiler (g++ or clang++) for inductor; none was found")
if compile:
    import torch._functorch.config
    torch._functorch.config.activation_memory_budget = activation_memory_budget
# torchrun: one process per rank; DDP averages the gradients (gloo on CPU, nccl on CUDA)
_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
if parallel == "auto":
    parallel = "ddp" if _torchrun else "none"
from memory_audit import nodynamo
from memory_audit.prediction.predict import PARALLEL  # the strategies the predictor knows are the ones train.py runs
if parallel not in PARALLEL:
    fail(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
if parallel != "none" and not _torchrun:
    fail(f"parallel={parallel} runs under torchrun: torchrun --standalone --nproc_per_node=N train.py ...")
if parallel == "none" and _torchrun and int(os.environ["WORLD_SIZE"]) > 1:
    fail("under torchrun with more than one rank, parallel must be ddp, fsdp, tp or tp-sp")
if "tp" in parallel:
    from memory_audit.prediction.ledger.tensor_parallel import check as _tp_check
    try:
        _tp_check({"parallel": parallel, "world_size": int(os.environ["WORLD_SIZE"]), "tp_size": tp_size,
                   "n_head": n_head, "dropout": dropout, "set_to_none": set_to_none})
    except ValueError as e:
        fail(str(e))
    if compile:
        fail(f"parallel={parallel} with compile=True is not built yet")
elif tp_size not in (0, 1):
    fail(f"tp_size={tp_size} is for parallel=tp, tp-sp, fsdp+tp or fsdp+tp-sp (got parallel={parallel})")
if parallel.startswith("fsdp") and compile:
    fail(f"parallel={parallel} with compile=True is not built yet")
rank, world_size = 0, 1
dp_size = 1  # ranks that see different data: all of them with ddp, one replica with tensor parallelism
if parallel != "none":
    import torch.distributed as dist
    from datetime import timedelta
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "tp" in parallel and not tp_size:
        tp_size = world_size
    dp_size = world_size // max(tp_size, 1)  # tp, tp-sp: 1; ddp, fsdp: every rank
    if "gradient_accumulation_steps" not in _given:  # the default: one micro-step on each rank
        gradient_accumulation_steps = dp_size
        if rank == 0:
            print(f"gradient_accumulation_steps not given: {dp_size} in all, one micro-step per data-parallel rank")
    if gradient_accumulation_steps % dp_size:
        fail(f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the world size {world_size}")
    gradient_accumulation_steps //= dp_size  # each data-parallel rank does its share, as nanoGPT does
    if device_type == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timedelta(seconds=dist_timeout_s))
master = rank == 0
config = {k: globals()[k] for k in config_keys}
config.update(world_size=world_size, rank=rank)
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=vocab_size, dropout=dropout, attention=attention, activation=activation,
                  activation_checkpointing=activation_checkpointing, ac_every=ac_every, sac_save_ops=sac_save_ops)
try:
    GPTConfig(**model_args).validate()
except ValueError as e:
    fail(str(e))
tokens_per_iter = gradient_accumulation_steps * dp_size * batch_size * block_size
print(f"tokens per iteration will be: {tokens_per_iter:,}")
if not audit:
    print(f"training for max_iters={max_iters:,} steps (--max_iters=N for fewer; --audit stops after step {audit_step + 1})")

torch.manual_seed(seed)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=ptdtype)

# data ---------------------------------------------------------------------------
data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", dataset)
if dataset != "synthetic":
    for _split in ("train",):
        if not os.path.isfile(os.path.join(data_dir, f"{_split}.bin")):
            fail(f"data file {os.path.join(data_dir, _split + '.bin')} not found; run data/prepare.py or use dataset=synthetic")
    if vocab_size < 50257:
        fail(f"vocab_size={vocab_size} is too small for GPT-2 tokens (ids up to 50256); use 50304")
    print(f"data: {data_dir}/train.bin (GPT-2 tokens)")
else:
    print("data: synthetic random tokens (memory does not depend on token values)")
_data_gen = torch.Generator().manual_seed(seed + rank // max(tp_size, 1) * (dp_size > 1))  # a stream per data-parallel rank


def get_batch(split):
    if dataset == "synthetic":
        buf = torch.randint(vocab_size, (batch_size, block_size + 1), generator=_data_gen)
        # clone, not contiguous(): at batch 1 the slices already count as contiguous and would
        # stay views of one (B, T+1) buffer, where nanoGPT's batch is two tensors of B*T
        x, y = buf[:, :-1].clone(memory_format=torch.contiguous_format), buf[:, 1:].clone(memory_format=torch.contiguous_format)
    else:
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        if len(data) <= block_size:
            fail(f"{data_dir}/{split}.bin has {len(data)} tokens, fewer than block_size+1")
        ix = torch.randint(len(data) - block_size, (batch_size,), generator=_data_gen)
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == "cuda":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


# an eager run on one process never needs torch._dynamo (its import: 1.8 s of a 5 s cpu-tiny
# audit; inside a CPU audit's profile, far more): stood in for from here on, for the rest of the
# process (memory_audit/nodynamo.py), which changes how long the run takes, never what it
# computes; torch.compile gets the real one. Not under torchrun: DDP, FSDP2 and DTensor ask
# torch._dynamo more, so the real one came in mid-step, inside the profile (the torchrun tests
# took 1.6x longer). Not on CUDA: there it saves only the import, and every CUDA audit with full
# checkpointing and dropout crashed with "SystemError: ... returned NULL without setting an
# exception" (torch 2.11, H200, the stand-in in place; the cause is not settled: scripts/GPU_RUNS.md)
if not compile and parallel == "none" and device_type == "cpu":
    nodynamo.enter()

# the audit starts before the model exists, so the weights' allocations are in the trace ------
audit_obj = None
if audit:
    from memory_audit import Audit, AuditError
    if not run_name:
        _ac = "" if activation_checkpointing == "none" else f"-ac{activation_checkpointing}{ac_every if ac_every > 1 else ''}"
        run_name = f"{preset}-{dtype}-{attention}-{activation}{_ac}-b{batch_size}-t{block_size}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = os.path.join(audit_dir, run_name)
    _n = 1
    while os.path.exists(run_dir):  # never overwrite an earlier run
        _n += 1
        run_dir = os.path.join(audit_dir, f"{run_name}-{_n}")
    if world_size > 1:  # rank 0 names the run; each rank records into its own rank<r>/
        _names = [run_dir]
        dist.broadcast_object_list(_names, src=0)
        run_dir = os.path.join(_names[0], f"rank{rank}")
    try:  # step indexes count from 0 (iter_num); audit_step counts from 1
        audit_obj = Audit(out_dir=run_dir, device=device, step=audit_step - 1, config=config,
                          max_entries=audit_max_entries, compiled=compile)
    except AuditError as e:
        fail(str(e))
    print(f"audit: recording allocator history into {run_dir}")


if parallel != "none":  # torchrun ends the other ranks with SIGTERM when one fails: say so in one line
    import signal

    class RankTerminated(RuntimeError):
        pass

    def _terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the crash snapshot is written undisturbed
        if sys.exc_info()[0] is None:  # else this rank is already reporting its own error
            raise RankTerminated("torchrun stopped this rank (SIGTERM): another rank failed; see its error")
    signal.signal(signal.SIGTERM, _terminated)

_crash = tuple(int(v) - (i == 1) for i, v in enumerate(os.environ["MEMORY_AUDIT_CRASH"].split(":"))) \
    if os.environ.get("MEMORY_AUDIT_CRASH") else None  # (rank, 0-based step)


class _LoopWatch(Watch):
    """What train.py sees of its step: the audit's before-backward snapshot (activations live:
    what autograd saved, plus the logits the loop holds) and MEMORY_AUDIT_CRASH's rehearsal."""

    def __init__(self, iter_num):
        self.iter_num = iter_num

    def forward_done(self, micro):
        if _crash == (rank, self.iter_num):  # MEMORY_AUDIT_CRASH=rank:step rehearses a failing rank
            raise RuntimeError(f"MEMORY_AUDIT_CRASH: rank {rank} fails at step {self.iter_num + 1}")

    def before_backward(self, micro, loss, logits):
        if audit_obj is not None:
            audit_obj.before_backward(loss, held={"lm_head": logits} if keep_logits else None)


def train():
    # model and optimizer ----------------------------------------------------------
    model = GPT(GPTConfig(**model_args))
    model.to(device)
    print(f"number of parameters: {model.get_num_params():,}")
    if parallel != "none":  # before the optimizer: Adam's state is made from the sharded parameters
        from parallelize import parallelize
        parallelize(model, parallel, device_type, world_size, tp_size)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), optimizer_impl)
    train_model = torch.compile(model) if compile else model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        train_model = DistributedDataParallel(train_model, device_ids=[torch.device(device).index] if device_type == "cuda" else None,
                                              gradient_as_bucket_view=ddp_bucket_view)
    if audit_obj is not None:
        audit_obj.watch(model, optimizer, scaler, compiled=compile)

    def get_lr(it):
        if it < warmup_iters:  # linear warmup
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    # training loop ----------------------------------------------------------------
    losses = []
    last_iter = max_iters if (not audit or audit_continue) else min(max_iters, audit_step + 1)
    state = {"loss": None}  # the loop's live tensors; the step (train_step.py) replaces them in place
    state["X"], state["Y"] = get_batch("train")  # first batch
    step_cfg = dict(gradient_accumulation_steps=gradient_accumulation_steps, parallel=parallel,
                    keep_logits=keep_logits, grad_clip=grad_clip, set_to_none=set_to_none)
    for iter_num in range(last_iter):
        step = iter_num + 1
        t0 = time.time()
        lr = get_lr(iter_num) if decay_lr else learning_rate
        for group in optimizer.param_groups:
            group["lr"] = lr
        # the audited step: weights, grads if kept, Adam state, workspaces, the batch, by name
        with (audit_obj.step(iter_num, tensors=lambda: {"inputs/x": state["X"], "inputs/y": state["Y"],
                                                        "temporary/loss": state["loss"]})
              if audit_obj is not None else nullcontext()):
            run_step(state, step_cfg, model, train_model, optimizer, scaler, lambda: get_batch("train"), ctx,
                           _LoopWatch(iter_num))
        lossf = state["loss"].item() * gradient_accumulation_steps  # no second reference: it lives as the loop's
        losses.append(lossf)
        dt = time.time() - t0
        if iter_num % log_interval == 0 and master:
            mem = ""
            if device_type == "cuda":
                mem = (f", mem {torch.cuda.memory_allocated() / 2**20:.1f} MiB"
                       f" (peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB)")
            print(f"iter {iter_num} (step {step}): loss {lossf:.4f}, time {dt * 1000:.2f}ms{mem}")
    return losses


def _predict_in_child(run_dir):
    """store_prediction(run_dir) in a child process without this rank's process group (torchrun's
    rendezvous variables left out; its thread count kept: CPU kernels' buffers depend on it)."""
    import subprocess
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                        "MASTER_ADDR", "MASTER_PORT") and not k.startswith("TORCHELASTIC")}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from memory_audit.comparison.reconcile import store_prediction; store_prediction(sys.argv[2])")
    try:  # within the process group's timeout: the other ranks wait at the barrier after it
        p = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), run_dir],
                           env=env, capture_output=True, text=True, timeout=max(dist_timeout_s - 30, 10))
    except subprocess.TimeoutExpired:
        raise ValueError(f"the prediction took longer than {max(dist_timeout_s - 30, 10)} s "
                         f"(`python -m memory_audit report {run_dir}` makes it after the run)") from None
    if p.returncode:
        raise ValueError((p.stderr.strip().splitlines() or ["the prediction's process failed"])[-1])


try:
    _losses = train()
except KeyboardInterrupt:
    raise
except Exception as e:
    if os.environ.get("MEMORY_AUDIT_DEBUG"):
        raise
    if audit_obj is not None:
        also = ""
        try:  # leaves oom.pickle / crash.pickle and meta.json behind where the disk allows
            audit_obj.close(error=e)
        except Exception as e2:  # the first error is the one to report; this one rides along
            also = f" (and the crash snapshot could not be written: {e2})"
        if isinstance(e, AuditError):
            fail(str(e) + also)
        dumped = [f for f in audit_obj.files if f in ("oom.pickle", "crash.pickle")]
        where = f"; snapshot written to {os.path.join(audit_obj.run_dir, dumped[0])}" if dumped else ""
        fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}{also}")
    if isinstance(e, torch.OutOfMemoryError):
        fail(f"out of memory: {str(e).splitlines()[0]} (run with --audit to keep a snapshot of it)")
    raise
if audit_obj is not None:
    try:
        audit_obj.close()
    except AuditError as e:
        fail(str(e))
    print(f"audit: wrote {', '.join(audit_obj.files)} and meta.json to {audit_obj.run_dir}")
    from memory_audit.comparison.reconcile import store_prediction
    from memory_audit.comparison.report import summarize_run
    try:  # the step predicted now, after it ran: nothing the prediction runs is in the measured process
        if parallel == "none":
            store_prediction(audit_obj.run_dir)
        else:  # a rank's shadow run fakes its own process group: it runs in a child process
            _predict_in_child(audit_obj.run_dir)
        print(summarize_run(audit_obj.run_dir))
    except Exception as e:  # the audit's files are written; say why the report is missing
        print(f"warning: no report for {audit_obj.run_dir}: {type(e).__name__}: {e}", file=sys.stderr)
if parallel != "none":
    dist.barrier()  # every rank has written its report (and no collective is in flight at teardown)
    if audit_obj is not None and world_size > 1:
        if master:
            from memory_audit.comparison.report import ranks_report
            try:
                print(ranks_report(os.path.dirname(audit_obj.run_dir)))
            except (OSError, KeyError, ValueError) as e:
                print(f"warning: no per-rank report: {e}", file=sys.stderr)
    dist.destroy_process_group()
if losses_out and master:
    with open(losses_out, "w") as f:
        json.dump([float(x).hex() for x in _losses], f)
