"""The shadow run of a CUDA step, checked on CPU against what GPUs measured (issue #26): the two
committed tiny CUDA audits event by event from the process's start, and the H100 rows on their
steady state, peak and reserved memory. The CUDA rules (memory_audit/prediction/shadow/cuda.py) were read
from the tiny audits, random tiny H200 audits and 11 GPT-2-sized H200 runs (IN_SAMPLE below: 11 of
the 28 H100 rows share those runs' configs; the other 17 are out of every rule's sample)."""

import json
import os

import pytest

from conftest import EXAMPLES, ROOT
from memory_audit.prediction.predict import DEFAULTS, resolved

TINY = ("cuda-tiny-fp16-manual", "cuda-tiny-bf16-sdpa")


def _device(name="NVIDIA H100 80GB HBM3"):  # the tiny audits' GPU
    from memory_audit.comparison.reconcile import device_from_meta
    return device_from_meta({"device": {"type": "cuda", "name": name}})


def _trace_from_start(run):
    """[(action, "", bytes, entry)] of every alloc and free the audit's trace holds."""
    from memory_audit.reading.loader import find_snapshots, load_snapshot
    from memory_audit.reading.trace import A
    t = load_snapshot(dict(find_snapshots(run)[0])["step2_end"])["device_traces"][0]
    acts = {A["alloc"]: "alloc", A["free_requested"]: "free", A["free"]: "free"}
    return [(acts[int(t.act[i])], "", int(t.size[i]), i) for i in range(t.n) if int(t.act[i]) in acts]


@pytest.mark.parametrize("name", TINY)
def test_tiny_cuda_audit_is_the_shadow_run_event_by_event(name):
    """Every allocation and free of the audited process, from model.to(device) to the end of step
    2 (827 and 675 events), in order with the bytes asked for; replayed through the allocator's
    model, the steady state, peak and reserved memory of step 2 to the byte; every tensor
    live at step 2's start by the name and bytes the audit's registry gives it; and every line of
    every phase of its report as the shadow names it itself (shadow.lines: the saved tensors by
    the module and op that saved them, the cuBLAS workspaces, ...)."""
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.reading.loader import load_meta
    from memory_audit.comparison.reconcile import first_divergence, shadow_lines_off
    run = os.path.join(EXAMPLES, name)
    meta = load_meta(run)
    cfg = resolved(meta["config"])
    r = shadow.replayed(cfg, _device(), names=True)
    predicted = r["result"]["history"] + r["result"]["events"]
    measured = _trace_from_start(run)
    assert len(predicted) == len(measured) and first_divergence(measured, predicted) is None
    start, end = meta["phases"]["step2_start"], meta["phases"]["step2_end"]
    assert r["steady_state"] == start["memory_allocated"] and r["end"] == end["memory_allocated"]
    assert r["peak"] == end["max_memory_allocated"] and r["reserved"] == end["memory_reserved"]
    named = {e["name"]: e["nbytes"] for e in start["registry"]}
    live = {key: n for _, key, n in r["result"]["pre"] if key in named}
    assert live == named
    with open(os.path.join(run, "report.json")) as f:
        assert shadow_lines_off(json.load(f)["rows"], r["result"]) == []


def _h100_rows():
    from memory_audit.comparison.sweep import row_config
    out = []
    for f in ("h100.jsonl", "h100-variants.jsonl", "h100-dropout.jsonl"):
        for line in open(os.path.join(ROOT, "snapshots", "results", f)):
            row = json.loads(line)
            cfg, device = row_config(row)
            out.append((resolved(cfg), device, row))
    return out


# The H200 runs (reserved-traces/totals.json) that the embedding sort's rule and the allocator's
# new-segments-go-down rule were read from share their config with these 11 of the 28 H100 rows;
# the other 17 are out of those rules' sample (none of the 28 is where the tiny CUDA rules came from).
IN_SAMPLE = 11


@pytest.mark.parametrize("part", range(4))
def test_h100_rows_from_the_shadow_run(part):
    """The 28 committed H100 rows (a quarter per test, for xdist): the shadow run replayed through
    the allocator's model gives the measured steady state and peak of every row, and the
    reserved memory of the 23 that recorded it, to the byte. What the rows cannot tell apart is
    in scripts/GPU_RUNS.md."""
    from memory_audit.prediction.shadow import step as shadow
    rows = _h100_rows()
    assert len(rows) == 28 and sum(r.get("reserved_actual") is not None for _, _, r in rows) == 23
    traces = json.load(open(os.path.join(ROOT, "snapshots", "results", "reserved-traces", "totals.json")))
    assert len(traces) == IN_SAMPLE
    for cfg, device, row in rows[part::4]:
        r = shadow.replayed(cfg, device)
        t = row["totals"]
        assert r["steady_state"] == t["steady_state"]["actual"], (row["config"], r["steady_state"] - t["steady_state"]["actual"])
        assert r["peak"] == t["peak"]["actual"], (row["config"], r["peak"] - t["peak"]["actual"])
        if row.get("reserved_actual") is not None:
            assert r["reserved"] == row["reserved_actual"], (row["config"], r["reserved"] - row["reserved_actual"])


def test_predicted_cuda_trace_reads_like_the_audit(tmp_path):
    """`predict --gpu=H100 --trace` at the tiny fp16 audit's config writes the predicted process
    as a CUDA snapshot; `attribute` replays it with the measurement's code: its peak, the bytes
    of every category at that peak and the reserved memory equal the audit's own."""
    from conftest import run_cli
    from memory_audit.reading.loader import load_meta
    run = os.path.join(EXAMPLES, TINY[0])
    c = load_meta(run)["config"]
    keys = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "batch_size", "dtype", "attention", "bias",
            "dropout", "optimizer_impl", "grad_clip", "set_to_none", "keep_logits", "activation")
    out = tmp_path / "predicted.pickle"
    p = run_cli("predict", "--gpu=H100", f"--trace={out}", "--json", *[f"--{k}={c[k]}" for k in keys])
    assert p.returncode == 0, p.stderr[-2000:]
    measured = json.loads(run_cli("attribute", run, "--json").stdout)["step2_end"]["devices"]["0"]
    predicted = next(iter(json.loads(run_cli("attribute", str(out), "--json").stdout).values()))["devices"]["0"]
    assert predicted["unattributed_bytes"] == 0
    assert predicted["peak_in_trace"]["bytes"] == measured["peak_in_trace"]["bytes"] == 72315904
    assert predicted["peak_in_trace"]["categories"] == measured["peak_in_trace"]["categories"]
    assert predicted["reserved_bytes"] == measured["reserved_bytes"] == json.loads(p.stdout)["shadow"]["reserved"]


@pytest.mark.parametrize("name", TINY)
def test_report_trace_on_a_cuda_audit(tmp_path, name):
    """`report RUN --trace` on a committed CUDA audit: step 2 against the shadow's, event by
    event, with no divergence, and the peaks equal (the shadow's through the allocator's model)."""
    import shutil

    from conftest import run_cli
    run = tmp_path / name
    shutil.copytree(os.path.join(EXAMPLES, name), run)
    p = run_cli("report", str(run), "--trace")
    assert p.returncode == 0, p.stderr[-2000:]
    tr = json.load(open(run / "report.json"))["trace"]
    assert tr["first_divergence"] is None and tr["measured_events"] == tr["predicted_events"] > 300
    assert tr["measured_peak"] == tr["predicted_peak"]
    assert "They agree event by event" in p.stdout


def test_meta_kernel_cache_changes_no_event():
    """shadow/metacache answers a meta kernel's repeated question from the first answer: on
    random configs (seed printed; SHADOW_SEED replays it) every event, id and phase of the CUDA
    shadow is the same with and without it, fp16, bf16 and fp32 (cuDNN and efficient attention)."""
    import random

    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.comparison.sweep import random_config
    seed = int(os.environ["SHADOW_SEED"])  # conftest draws it once per run
    rng = random.Random(seed)
    for i, dtype in enumerate(("float16", "bfloat16", "float32")):
        cfg = dict(DEFAULTS, **dict(random_config(rng), dtype=dtype))
        print(f"meta cache seed {seed} (replay: SHADOW_SEED={seed}), config {i}: {cfg}")
        kw = dict(sdpa_backend="cudnn", workspace_bytes=8519680)
        assert shadow.run(cfg, "cuda", cache=False, **kw) == shadow.run(cfg, "cuda", **kw), f"seed {seed} config {i}"


# Random tiny configs audited on an H200 (torch 2.11, 2026-11-26, 9330377: scripts/shadow_check.py
# --device=cuda, seeds 119610, 262229, 630383, 810458), chosen to cover every pair of settings
# the 91 audits held; out of the tiny audits' sample. Trimmed to what the check reads.
H200 = sorted(n for n in os.listdir(os.path.join(EXAMPLES, "shadow-cuda")) if n.startswith("h200-"))
# Random tiny configs audited on an H100 (torch 2.11, 2026-11-27: scripts/gpu_batch.sh, shadow_check
# seeds in snapshots/results/random/h100-shadow-cuda-*.jsonl), out of every CUDA rule's sample:
# every SAC run and one per (dtype, attention, checkpointing) the other runs held. The allocator
# model fed the measured requests reserves one 2 MiB segment more than the H100 did in h100-01
# (3 of the 51 rows: RESERVED_MISSES), and the shadow with it.
H100 = sorted(n for n in os.listdir(os.path.join(EXAMPLES, "shadow-cuda")) if n.startswith("h100-"))
RESERVED_MISSES = {"h100-01-bf16-manual-none-foreach": 2 * 1024 * 1024}


@pytest.mark.parametrize("name", H200 + H100)
def test_random_h200_audit_is_the_shadow_run(name):
    """Steady state, peak and reserved memory of step 2 to the byte (the allocator model fed the
    measured requests gives the same reserved), and every allocation and
    free of step 2 in order: the cuBLASLt workspace of a Linear with a bias, the fused dropout's
    mask before its output, the softmax backward's buffer in fp32, AdamW's host-side step counts
    and lifted scalars, efficient attention's backward temporaries (fp32 SDPA)."""
    from memory_audit.comparison.reconcile import device_from_meta, first_divergence, step_events
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.reading.allocator_model import replay_requests
    from memory_audit.reading.loader import load_meta, load_snapshot
    run = os.path.join(EXAMPLES, "shadow-cuda", name)
    meta = load_meta(run)
    with open(os.path.join(run, "report.json")) as f:
        totals = json.load(f)["totals"]
    r = shadow.replayed(resolved(meta["config"]), device_from_meta(meta))
    assert (r["steady_state"], r["peak"]) == (totals["steady_state"]["actual"], totals["peak"]["actual"])
    t = load_snapshot(os.path.join(run, "step2_end.pickle"))["device_traces"][0]
    assert r["reserved"] == replay_requests(t.act, t.addr, t.size)["reserved"] \
        == totals["reserved"]["actual"] + RESERVED_MISSES.get(name, 0)
    assert first_divergence(step_events(run), r["result"]["events"]) is None


@pytest.mark.parametrize("name", H100)
def test_predicted_cuda_trace_is_categorized_as_the_audit(name):
    """`predict --trace` (and an audit's predicted.pickle) on a GPU: step 2's allocations, counted
    by (category, bytes), are the audit's as `viz` categorizes it (gradients as grads,
    checkpointing's recomputation as recomputed, what a forward lets go as temporary)."""
    import collections

    from memory_audit.comparison.reconcile import device_from_meta
    from memory_audit.prediction.predict import predicted_snapshot, traced
    from memory_audit.reading.loader import load_meta
    from memory_audit.reading.viz import categorized
    from memory_audit.schema import PHASES_KEY

    def step(snap, start):
        return collections.Counter((e["category"], e["size"]) for e in snap["device_traces"][0][start:]
                                   if e["action"] == "alloc")
    run = os.path.join(EXAMPLES, "shadow-cuda", name)
    meta = load_meta(run)
    dev = device_from_meta(meta)
    ours = predicted_snapshot(traced(meta["config"], dev, names=True)[1], dev)
    theirs = categorized(os.path.join(run, "step2_end.pickle"), meta)
    assert step(ours, ours[PHASES_KEY]["step2_start"]) == step(theirs, meta["phases"]["step2_start"]["trace_entries"])


@pytest.mark.parametrize("name", H100)
def test_h100_audit_names_every_byte(name):
    """Every byte of step 2's end named, the cuBLAS workspaces too where selective checkpointing's
    policy mode stands between the Linear and the GEMM (torch 2.11 on an H100: its frames are
    _ops.py under checkpoint.py's __torch_dispatch__, 32 MiB was unattributed before)."""
    from memory_audit.reading.attribute import attribute
    from memory_audit.reading.loader import load_meta, load_snapshot
    run = os.path.join(EXAMPLES, "shadow-cuda", name)
    meta = load_meta(run)
    measured = attribute(load_snapshot(os.path.join(run, "step2_end.pickle")), meta, "step2_end")[0]
    assert measured["categories"]["unattributed"] == 0
    assert measured["lines"]["workspace/cublas"] == 2 * 32 * 1024 * 1024  # forward's thread and autograd's


def test_the_cublaslt_workspace_is_named_where_measured_and_predicted():
    """A Linear with a bias runs cuBLASLt's addmm, whose first call on each thread makes a 1 MiB
    workspace (H200, torch 2.11): the audit names it from the trace (live at the end, made in a
    GEMM, in a trace with a cuBLAS workspace) and the ledger predicts one per thread that runs an
    addmm (autograd's too when full checkpointing recomputes a Linear in backward)."""
    from memory_audit.comparison.reconcile import device_from_meta
    from memory_audit.prediction.predict import predict
    from memory_audit.reading.attribute import attribute
    from memory_audit.reading.loader import load_meta, load_snapshot
    for name, threads in (("h200-02-bf16-sdpa-none-for", 1), ("h200-09-fp16-manual-full-for", 2),
                          ("h200-01-fp32-manual-none-fused", 0)):
        run = os.path.join(EXAMPLES, "shadow-cuda", name)
        meta = load_meta(run)
        measured = attribute(load_snapshot(os.path.join(run, "step2_end.pickle")), meta, "step2_end")[0]
        assert measured["lines"].get("workspace/cublaslt", 0) == threads * 1024 * 1024, name
        assert measured["categories"]["unattributed"] == 0
        ledger = predict(meta["config"], device_from_meta(meta))["ledger"]
        assert sum(ln["bytes"] for ln in ledger if ln["key"] == "workspace/cublaslt" and "step2_end" in ln["phases"]) \
            == threads * 1024 * 1024, name


RESERVED_TRACES = os.path.join(ROOT, "snapshots", "results", "reserved-traces")


@pytest.mark.parametrize("name", sorted(n[:-len(".json.gz")] for n in os.listdir(RESERVED_TRACES)
                                        if n.endswith(".json.gz")))
def test_gpt2_sized_h200_process_is_the_shadow_run_event_by_event(name):
    """GPT-2 small to xl audited on an H200 (torch 2.11; compact traces): every allocation and
    free of the process, from model.to(device) to the end of step 2 (3,249-15,259 events), is
    the shadow run's, CUDA's sorting embedding backward included; played through the allocator
    model (new segments below the last, as cudaMalloc's addresses go), the steady state, peak and
    reserved memory of step 2 are the measured ones to the byte."""
    import gzip
    from memory_audit.comparison.reconcile import device_from_meta, first_divergence
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.reading.allocator_model import replay_requests
    from memory_audit.reading.trace import A
    with gzip.open(os.path.join(RESERVED_TRACES, name + ".json.gz"), "rt") as f:
        d = json.load(f)
    acts = {A["alloc"]: "alloc", A["free_requested"]: "free", A["free"]: "free"}
    measured = [(acts[a], "", s, i) for i, (a, s) in enumerate(zip(d["act"], d["size"])) if a in acts]
    device = device_from_meta({"device": {"type": "cuda", "name": "NVIDIA H200", "capability": [9, 0]}})
    r = shadow.replayed(resolved(d["config"]), device, names=True)  # names: the whole step, unrepeated
    assert first_divergence(measured, r["result"]["history"] + r["result"]["events"]) is None
    assert r["reserved"] == replay_requests(d["act"], d["addr"], d["size"])["reserved"]
    with open(os.path.join(RESERVED_TRACES, "totals.json")) as f:
        totals = json.load(f)[name]  # the run's report: steady state, peak, memory_reserved()
    assert (r["steady_state"], r["peak"], r["reserved"]) == (totals["steady_state"], totals["peak"], totals["reserved"])


def test_rules_outside_their_measured_shapes_are_named():
    """shadow/rules/cuda.py's SAMPLES: every committed CUDA trace (the 2 tiny H100 audits, the 15 kept H200
    runs, the 11 GPT-2-sized H200 runs) is inside the samples of the rules it applies, so its
    shadow names none; GPT-2 at batch 6 in fp32 SDPA applies efficient attention's backward at
    head size 64 and the embedding sort at N 6,144, neither measured, and `predict` says so."""
    import gzip

    from conftest import run_cli
    from memory_audit.comparison.reconcile import device_from_meta
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.reading.loader import load_meta
    traces = os.path.join(ROOT, "snapshots", "results", "reserved-traces")
    runs = [load_meta(os.path.join(EXAMPLES, n)) for n in TINY] + \
        [load_meta(os.path.join(EXAMPLES, "shadow-cuda", n)) for n in H200]
    configs = [(m["config"], device_from_meta(m)) for m in runs] + \
        [(json.load(gzip.open(os.path.join(traces, f)))["config"], _device("NVIDIA H200"))
         for f in sorted(os.listdir(traces)) if f.endswith(".json.gz")]
    assert len(configs) == 2 + 15 + 11
    for cfg, device in configs:
        assert shadow.replayed(resolved(cfg), device)["result"]["unmeasured"] == [], cfg
    p = run_cli("predict", "--gpu=H100", "--preset=gpt2", "--batch_size=6", "--dtype=float32", "--attention=sdpa",
                "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["totals"]["unmeasured_on_gpu"] == [
        "efficient attention's backward temporaries at head size 64, T 1024 (measured: head size 16 or 32, T up to "
        "256 (fp32 SDPA, H200), or 64 at T 196 (the encoder ViTs))",
        "the embedding backward's sort storage at N 6144 over 50304 rows (measured: N = B x T of 4,096, 8,192, "
        "10,240 or 12,288 over 50,304 rows (H200))"]


COMPILED = os.path.join(EXAMPLES, "cuda-compiled")


@pytest.mark.parametrize("name", sorted(os.listdir(COMPILED)))
def test_compiled_h100_audit_names_every_byte(name):
    """tests/test_cuda.py's compiled audits as an H100 ran them (torch 2.11, 2026-11-27): the
    cuBLAS workspaces of the compiled forward (made under AOT autograd's runtime wrapper's
    __torch_dispatch__, below inductor's generated `call`) and backward (inductor's backward
    wrapper on autograd's thread) named, nothing unattributed (64 MiB was before)."""
    from memory_audit.reading.attribute import attribute
    from memory_audit.reading.loader import load_meta, load_snapshot
    run = os.path.join(COMPILED, name)
    meta = load_meta(run)
    assert meta["config"]["compile"] is True and meta["compiled_wrappers"]
    measured = attribute(load_snapshot(os.path.join(run, "step2_end.pickle")), meta, "step2_end")[0]
    assert measured["categories"]["unattributed"] == 0
    assert measured["lines"]["workspace/cublas"] == 2 * 32 * 1024 * 1024


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_nccl_rank_names_every_byte(strategy):
    """train.py under torchrun at world size 1 with NCCL on an H100 (torch 2.11, 2026-11-27): every
    byte of step 2's end named; DDP's rebuilt bucket is made by the Reducer's C++ _rebuild_buckets
    straight from DDP's _pre_forward (541,952 B unattributed before), as large as the gradients."""
    from memory_audit.reading.attribute import attribute
    from memory_audit.reading.loader import load_meta, load_snapshot
    run = os.path.join(EXAMPLES, "nccl-ws1", strategy)
    meta = load_meta(run)
    assert meta["config"]["parallel"] == strategy and meta["distributed"]["backend"] == "nccl"
    measured = attribute(load_snapshot(os.path.join(run, "step2_end.pickle")), meta, "step2_end")[0]
    assert measured["categories"]["unattributed"] == 0
    if strategy == "ddp":
        assert measured["lines"]["grads/ddp_buckets"] == sum(v for k, v in measured["lines"].items()
                                                             if k.startswith("weights/"))
