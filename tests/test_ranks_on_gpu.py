"""A torchrun rank's CUDA step from the shadow run, never a second model: FSDP2 on streams of
its own (a caching-allocator pool each), DDP's reducer reading the host values its meta tensors
stand for, DTensor's collectives; each assumption about NCCL named as not measured on a GPU
(memory_audit/prediction/shadow/distributed.py, shadow/replay.py). Measured: the three H100 audits at
world size 1 on NCCL (snapshots/examples/nccl-ws1); over several ranks the shadow is held to itself
and to the CPU shadow."""

import os

import pytest

from conftest import EXAMPLES, run_cli
from memory_audit.prediction.predict import device_facts, prediction, resolved

TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512, batch_size=2, dtype="bfloat16",
            world_size=2, rank=1)
H100 = device_facts("cuda", gpu="H100")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "tp", "tp-sp", "fsdp+tp"])
def test_a_rank_on_a_gpu_is_its_shadow_run_with_the_nccl_assumptions_named(parallel):
    """Over two ranks (four for fsdp+tp): the totals every command reads are the shadow run's
    replay (no other model answers), and each strategy in the config names once what it assumes
    of NCCL."""
    from memory_audit.prediction.shadow import step as shadow
    cfg = resolved(dict(TINY, parallel=parallel, **({"world_size": 4, "tp_size": 2} if "+" in parallel else {})))
    t = prediction(cfg, H100)["totals"]
    r = shadow.replayed(cfg, H100, repeat=False)
    assert t["from"] == "shadow run"
    assert (t["peak_allocated_bytes"], t["reserved_peak_bytes"], t["steady_state_allocated"]) == \
        (r["peak"], r["reserved"], r["steady_state"])
    named = [rule for rule in t["unmeasured_on_gpu"] if rule.startswith(f"parallel={parallel} on NCCL over ")]
    assert len(named) == parallel.count("+") + 1, t["unmeasured_on_gpu"]  # one line per strategy in it


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_the_nccl_audits_at_world_size_one_are_predicted_to_the_byte(strategy):
    """train.py under torchrun at world size 1 on NCCL, an H100 (fp16, cpu-tiny, batch 12): step 2's
    memory_allocated() at its start, before backward and at its end, its peak and memory_reserved()
    are the shadow run's, to the byte; nothing is said to be unmeasured. FSDP2's reduce-scatter
    stream: its trace entries are the prediction's (19, action and size, in order), and its 2 MiB
    segment is why reserved is exact (one pool for every stream: 2 MiB under)."""
    import pickle
    from memory_audit.comparison.reconcile import device_from_meta
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.prediction.shadow.replay import replay, snapshot
    from memory_audit.reading.loader import load_meta
    run = os.path.join(EXAMPLES, "nccl-ws1", strategy)
    meta = load_meta(run)
    ph = meta["phases"]
    t = prediction(meta["config"], device_from_meta(meta))["totals"]
    assert (t["steady_state_allocated"], t["before_backward_allocated"], t["end_allocated"], t["peak_allocated_bytes"],
            t["reserved_peak_bytes"]) == (ph["step2_start"]["memory_allocated"], ph["step2_before_backward"]["memory_allocated"],
                                          ph["step2_end"]["memory_allocated"], ph["step2_end"]["max_memory_allocated"],
                                          ph["step2_end"]["memory_reserved"])
    assert t["from"] == "shadow run" and t["unmeasured_on_gpu"] == []
    if strategy == "fsdp":
        dev = device_from_meta(meta)
        r = shadow.run(resolved(meta["config"]), "cuda", sdpa_backend=dev["sdpa_backend"], workspace_bytes=dev["workspace_bytes"])
        side = [(e["action"], e["size"]) for e in snapshot(r)["device_traces"][0] if e["stream"]]
        with open(os.path.join(run, "step2_end.pickle"), "rb") as f:
            measured = [(e["action"], e["size"]) for e in pickle.load(f)["device_traces"][0] if e.get("stream")]
        assert side == measured and len(side) == 19
        one_pool = replay(dict(r, streams={}))["reserved"]
        assert t["reserved_peak_bytes"] - one_pool == 2 << 20

def test_fsdp2s_collective_buffers_live_in_their_own_streams_segments():
    """The all-gather's copy-in and the reduce-scatter's buffers are made on FSDP2's own streams,
    and the allocator's model serves each stream from segments of its own, as the caching
    allocator does: no block of a segment holds another stream's allocation."""
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.prediction.shadow.replay import snapshot
    r = shadow.run(resolved(dict(TINY, parallel="fsdp")), "cuda", workspace_bytes=H100["workspace_bytes"])
    made = {r["streams"][aid] for action, _, _, aid in r["events"] if action == "alloc" and aid in r["streams"]}
    assert len(made) == 2  # the all-gather copy-in stream and the reduce-scatter stream
    trace = snapshot(r)["device_traces"][0]
    segments = [(e["addr"], e["size"], e["stream"]) for e in trace if e["action"] == "segment_alloc"]
    assert {s for _, _, s in segments} == made | {0}
    for e in trace:
        if e["action"] == "alloc":
            (stream,) = [s for at, size, s in segments if at <= e["addr"] < at + size]
            assert stream == e["stream"], e


def test_a_block_freed_on_one_stream_serves_no_other():
    """1,000 B made and freed on a side stream, then 1,000 B on the compute stream: a second 2 MiB
    segment, where one stream reuses the first."""
    from memory_audit.prediction.shadow.replay import replay
    events = [("alloc", "a", 1000, 0), ("free", "a", 1000, 0), ("alloc", "b", 1000, 1)]
    step = {"history": [], "events": events, "phases": {"step2_start": 0, "step2_end": 3}}
    assert replay(step)["reserved"] == 2 << 20
    assert replay(dict(step, streams={0: 1}))["reserved"] == 4 << 20


def test_ddps_buckets_on_a_gpu_are_the_buckets_of_the_cpu_shadow():
    """DDP's reducer on meta tensors reads its bucket sizes and indices from host twins: the
    buckets it keeps are those the CPU shadow (real integer tensors) keeps, byte for byte."""
    from memory_audit.prediction.shadow import step as shadow
    cfg = resolved(dict(TINY, parallel="ddp", n_layer=3, dtype="float32"))

    def buckets(r):
        return sorted(n for _, key, n in r["pre"] if key == "grads/ddp_buckets")
    gpu, cpu = buckets(shadow.run(cfg, "cuda")), buckets(shadow.run(cfg))
    assert gpu and gpu == cpu


def test_flash_attention_on_an_a100_is_shadow_run_and_named_unmeasured():
    t = prediction(resolved(dict(TINY, attention="sdpa", world_size=1, rank=0)), device_facts("cuda", gpu="A100"))["totals"]
    assert t["from"].startswith("shadow run")
    assert any(rule.startswith("SDPA through flash attention (bfloat16)") for rule in t["unmeasured_on_gpu"])


def test_plan_names_the_rows_each_unmeasured_rule_is_in():
    out = run_cli("plan", "--gpu=H100", "--world_size=2", "--n_layer=2", "--n_head=2", "--n_embd=64",
                  "--block_size=64", "--vocab_size=512", "--batch_size=2", "--dtype=bfloat16")
    assert out.returncode == 0, out.stderr
    assert "not measured on a GPU (fsdp over 2 ranks): parallel=fsdp on NCCL over 2 ranks: FSDP2's" in out.stdout
    assert "ledger" not in out.stdout


def test_random_ranks_on_random_gpus_run_and_keep_the_cpu_shadows_buckets():
    """Random configs (seed printed; SHADOW_SEED replays it) under a random strategy, world size
    and GPU: the rank's CUDA step runs from the shadow (a config no rank can train is one
    ValueError line), the NCCL notes appear over several ranks only, and DDP's buckets on the GPU
    are the CPU shadow's."""
    import random
    from memory_audit.comparison.sweep import random_config
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.prediction.predict import DEFAULTS, validate
    seed = int(os.environ["SHADOW_SEED"])
    rng, ran = random.Random(seed), 0
    while ran < 5:
        par = rng.choice(["ddp", "fsdp", "tp", "tp-sp", "fsdp+tp"])
        cfg = dict(DEFAULTS, **random_config(rng))
        cfg.update(parallel=par, rank=0, n_head=2 * rng.randint(1, 2), world_size=4 if "+" in par else rng.choice([1, 2]),
                   tp_size=2 if "+" in par else 0)
        cfg.update(n_embd=16 * cfg["n_head"], dropout=0.0 if "tp" in par else cfg["dropout"])
        try:
            validate(cfg)
        except ValueError:
            continue
        gpu = rng.choice(["H100", "A100", "H200"])
        print(f"ranks seed {seed} (replay: SHADOW_SEED={seed}): {gpu} {cfg}")
        t = prediction(cfg, device_facts("cuda", gpu=gpu))["totals"]
        assert t["from"] == "shadow run"
        notes = [rule for rule in t["unmeasured_on_gpu"] if " on NCCL over " in rule]
        assert len(notes) == (par.count("+") + 1 if cfg["world_size"] > 1 else 0), t["unmeasured_on_gpu"]
        if par == "ddp":
            c = resolved(cfg)
            gpu_buckets, cpu_buckets = ([n for _, key, n in shadow.run(c, d)["pre"] if key == "grads/ddp_buckets"]
                                        for d in ("cuda", "cpu"))
            assert sorted(gpu_buckets) == sorted(cpu_buckets) and gpu_buckets
        ran += 1
