"""A deep CUDA step's shadow from the runs of 3 and 4 blocks (memory_audit/prediction/shadow/repeat.py),
and the totals predict, fit and plan take from the shadow's replay (prediction/predict.py's prediction())."""

import json
import os
import random
import subprocess
import sys

import pytest

from conftest import ROOT
from memory_audit.prediction.predict import DEFAULTS, device_facts

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from repeat_check import first_difference  # noqa: E402

KW = dict(sdpa_backend="cudnn", workspace_bytes=8519680)


def test_repeated_blocks_are_the_full_shadow_run_on_random_configs():
    """On random configs over every knob (seed printed; SHADOW_SEED replays it), 8 to 14 blocks
    (and one with 8-10 micro-steps), the step built from 3 and 4 blocks (micro-steps) is the
    shadow run of all of them event by event (action, key, bytes, which allocation), phase by
    phase, start and peak; never refused when every block is alike."""
    from memory_audit.prediction.shadow import step as shadow, repeat as shadow_repeat
    from memory_audit.comparison.sweep import random_config
    seed = int(os.environ["SHADOW_SEED"])  # conftest draws it once per run
    rng = random.Random(seed)
    for i, dtype in enumerate(("float16", "bfloat16", "float32", "float16")):
        cfg = dict(DEFAULTS, **dict(random_config(rng), dtype=dtype, n_layer=rng.randint(8, 14), ac_every=1))
        if i == 3:  # many micro-steps, repeated too, and few blocks
            cfg.update(n_layer=rng.randint(2, 9), gradient_accumulation_steps=rng.randint(8, 10))
        print(f"repeat seed {seed} (replay: SHADOW_SEED={seed}), config {i}: {cfg}")
        assert shadow_repeat.repeatable(cfg) or shadow_repeat.micro_repeatable(cfg)
        rep = shadow.repeated(cfg, **KW)
        assert rep is not None, f"seed {seed} config {i}: refused"
        assert first_difference(rep, shadow.run(cfg, "cuda", **KW)) is None, f"seed {seed} config {i}"


def test_a_wrong_repeat_is_refused_not_returned():
    """The 4-block run checks the rule: a 3-block run whose middle block's events were changed
    (one allocation 512 B larger) no longer expands to the 4-block run, and expand returns None
    (the caller then runs every block)."""
    from memory_audit.prediction.shadow import step as shadow, repeat as shadow_repeat
    cfg = dict(DEFAULTS, n_layer=10, n_head=2, n_embd=64, block_size=32, vocab_size=97, batch_size=2)
    r3, r4 = (shadow.run(dict(cfg, n_layer=n), "cuda", blocks=True, **KW) for n in (3, 4))
    assert shadow_repeat.expand(r3, r4, 10) is not None
    i = next(i for i, e in enumerate(r3["events"]) if e[0] == "alloc" and r3["blocks"]["allocs"][e[3]] == 1)
    aid = r3["events"][i][3]
    bumped = [(a, k, n + 512 if x == aid else n, x) for a, k, n, x in r3["events"]]
    assert shadow_repeat.expand(dict(r3, events=bumped), r4, 10) is None


def test_every_other_block_checkpointed_is_not_repeated():
    from memory_audit.prediction.shadow import repeat as shadow_repeat
    assert not shadow_repeat.repeatable(dict(DEFAULTS, n_layer=12, activation_checkpointing="full", ac_every=2))
    assert shadow_repeat.repeatable(dict(DEFAULTS, n_layer=12, activation_checkpointing="full", ac_every=1))
    assert not shadow_repeat.repeatable(dict(DEFAULTS, n_layer=7))
    assert shadow_repeat.micro_repeatable(dict(DEFAULTS, gradient_accumulation_steps=8))
    assert not shadow_repeat.micro_repeatable(dict(DEFAULTS, gradient_accumulation_steps=7))


def test_predict_takes_the_peak_and_reserved_from_the_shadow_replay():
    """prediction()'s totals are the shadow replay's, to the byte: a deep step's from its
    repeated blocks, a torchrun rank's (on a GPU or a CPU) from the shadow run of that rank."""
    from memory_audit.prediction.shadow import step as shadow
    from memory_audit.prediction.predict import prediction
    dev = device_facts()
    cfg = dict(DEFAULTS, n_layer=9, n_head=4, n_embd=128, block_size=128, vocab_size=512, batch_size=3,
               dtype="bfloat16", attention="manual")
    r = shadow.replayed(cfg, dev, repeat=False)
    t = prediction(cfg, dev)["totals"]
    assert t["from"] == "shadow run (blocks repeated)"
    assert (t["peak_allocated_bytes"], t["reserved_peak_bytes"], t["before_backward_allocated"], t["end_allocated"]) \
        == (r["peak"], r["reserved"], r["before_backward"], r["end"])
    assert "ledger" not in t
    ddp = prediction(dict(cfg, parallel="ddp", world_size=2), dev)["totals"]
    assert ddp["from"] == "shadow run"  # a rank's strategy is run whole
    rank = dict(cfg, n_layer=2, parallel="ddp", world_size=2, rank=1)
    cpu = prediction(rank, device_facts("cpu"))["totals"]
    assert cpu["from"] == "shadow run" and cpu["peak_allocated_bytes"] == shadow.run(rank)["peak"]


def test_predict_cli_names_the_source_of_its_totals():
    """`predict` prints where its peak came from and the event it peaks at, --json the same."""
    args = ["predict", "--preset=gpt2", "--batch_size=2", "--block_size=128"]
    cmd = [sys.executable, "-m", "memory_audit"] + args
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "peak, phases and reserved from: shadow run (blocks repeated)" in out.stdout
    assert "peak at: event " in out.stdout
    js = json.loads(subprocess.run(cmd + ["--json"], cwd=ROOT, capture_output=True, text=True, timeout=300).stdout)
    assert js["totals"]["from"] == "shadow run (blocks repeated)" and js["backward"]["peak_at"].startswith("event ")
    assert "ledger" not in js["totals"]


@pytest.mark.parametrize("args", [["--ledger"], ["--gaps=1024"]])
def test_one_prediction_has_no_second_model_to_ask_for(args):
    """--ledger and --gaps asked for other totals than the trace's: gone, refused in one line."""
    p = subprocess.run([sys.executable, "-m", "memory_audit", "predict", "--preset=gpt2"] + args, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and args[0].split("=")[0].lstrip("-") in p.stderr, p.stderr
