"""What a new user meets first: GPU names, help, JSON everywhere, files never clobbered."""

import json
import os
import shutil

import pytest

from conftest import EXAMPLES, run_cli, run_train

EXAMPLE = os.path.join(EXAMPLES, "cuda-tiny-fp16-manual")


def test_gpu_names_in_any_case_are_one_table():
    upper = run_cli("predict", "--preset=gpt2", "--gpu=H100", "--json")
    lower = run_cli("predict", "--preset=gpt2", "--gpu=h100", "--json")
    assert upper.returncode == lower.returncode == 0
    assert json.loads(upper.stdout)["totals"] == json.loads(lower.stdout)["totals"]
    assert json.loads(lower.stdout)["device"]["capability"] == [9, 0]


@pytest.mark.parametrize("cmd", ["predict", "fit"])
def test_unknown_gpu_is_one_line_unless_described(cmd):
    p = run_cli(cmd, "--gpu=NoSuchGPU", "--preset=gpt2")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and "unknown GPU 'NoSuchGPU'" in p.stderr and "--capability" in p.stderr
    ok = run_cli(cmd, "--gpu=NoSuchGPU", "--memory=25000000000", "--capability=8.9", "--preset=gpt2", "--json")
    assert ok.returncode == 0, ok.stderr
    bad = run_cli(cmd, "--gpu=H100", "--memory=0", "--preset=gpt2")
    assert bad.returncode == 2 and "positive" in bad.stderr


def test_fit_json_is_json():
    p = run_cli("fit", "--gpu=H100", "--preset=gpt2-large", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    # GPT-2 large at batch 10 ran on the H100 (h100-variants.jsonl: 80.14 GB reserved of 85.0 GB)
    assert r["fits"] is True and r["largest_batch_size"] == 10 and r["next_batch_need"] > r["budget"] >= r["its_need"]


def test_help_lists_config_keys_and_grids():
    p = run_cli("predict", "--help")
    assert p.returncode == 0
    for text in ("--activation_checkpointing=none", "none | full | selective | sac", "--dtype=float16",
                 "--preset=NAME", "cpu-tiny"):
        assert text in p.stdout, text
    s = run_cli("sweep", "--help")
    assert s.returncode == 0 and "cpu-ac" in s.stdout and "gpt2-sizes" in s.stdout
    t = run_train("--help")
    assert t.returncode == 0 and "Traceback" not in t.stderr
    assert "activation_checkpointing = \"none\"" in t.stdout and "max_iters = 600000" in t.stdout


def test_attribute_never_overwrites_a_file_it_did_not_write(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(EXAMPLE, run)
    victim = run / "step2_end.pickle"
    before = victim.read_bytes()
    p = run_cli("attribute", str(run), "--out", str(victim))
    assert p.returncode == 2 and "refusing to overwrite" in p.stderr and "Traceback" not in p.stderr
    assert victim.read_bytes() == before
    out = tmp_path / "a.json"
    assert run_cli("attribute", str(run), "--out", str(out)).returncode == 0
    assert run_cli("attribute", str(run), "--out", str(out)).returncode == 0  # its own output: fine
    forced = run_cli("attribute", str(run), "--out", str(victim), "--force")
    assert forced.returncode == 0 and json.loads(victim.read_text())


def test_json_flag_does_not_swallow_the_path():
    """`attribute --json FILE.pickle` reads FILE.pickle (--json takes no file name)."""
    p = run_cli("attribute", "--json", os.path.join(EXAMPLE, "step2_start.pickle"))
    assert p.returncode == 0, p.stderr
    assert set(json.loads(p.stdout)) == {"step2_start"}
    q = run_cli("attribute", EXAMPLE, "--json", "-")
    assert q.returncode == 0 and len(json.loads(q.stdout)) == 3


def test_temporaries_say_what_made_them(cpu_run):
    """No bare "temporary" at the peak or in the categorized trace: each names its maker."""
    from memory_audit.reading.loader import load_meta, load_snapshot
    from memory_audit.reading.event_names import categorize_trace
    from memory_audit.reading.timeline import replay
    meta = load_meta(cpu_run)
    snap = load_snapshot(os.path.join(cpu_run, "step2_end.pickle"))
    lines = replay(snap, meta)["peak"]["lines"]
    temps = {k: v for k, v in lines.items() if k.split("/")[0] == "temporary"}
    assert "temporary" not in temps and temps["temporary/backward/grad_seed"] == 4
    assert temps["temporary/backward/aten::nll_loss_backward"] == 4 * 2 * 64 * 512  # fp32 B*T*V
    cats = {e.get("category") for e in categorize_trace(snap, meta)["device_traces"][0]}
    assert "temporary" not in cats and {"temporary/backward", "temporary/optimizer"} <= cats


def test_plan_names_what_fits_and_what_it_costs():
    p = run_cli("plan", "--gpu=A100-40GB", "--preset=gpt2-medium", "--batch_size=12", "--attention=manual", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["baseline"]["fits"] is False and r["baseline"]["need"] > r["budget"]
    fitting = [o for o in r["options"] if o["fits"]]
    names = [o["option"] for o in fitting]
    assert "attention=sdpa" in names and "activation_checkpointing=full" in names, names
    for o in r["options"]:  # need = predicted reserved + outside PyTorch, judged against the budget
        assert o["need"] == o["reserved_peak"] + o["outside_pytorch"] and o["fits"] == (o["need"] <= r["budget"])
        assert o["reserved_peak"] >= o["allocated_peak"]
    costs = [o["cost"] for o in fitting]
    assert costs == sorted(costs)  # cheapest first
    full = next(o for o in fitting if o["option"] == "activation_checkpointing=full")
    assert full["extra_flops_fraction"] > 0 and full["recompute_flops"] > 0
    text = run_cli("plan", "--gpu=A100-40GB", "--preset=gpt2-medium", "--batch_size=12", "--attention=manual")
    assert "baseline does not fit" in text.stdout and "attention=sdpa" in text.stdout
    # every row from the shadow run; an A100's bf16/fp16 SDPA is flash attention, which no
    # committed trace measured: the rows that take it say so
    rows = {line.split(" | ")[0][2:]: line.rstrip(" |").rsplit(" | ", 1)[1] for line in text.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| option", "| ---"))}
    assert set(rows.values()) == {"shadow run"}, rows
    flash = next(line for line in text.stdout.splitlines() if "SDPA through flash attention" in line)
    assert flash.startswith("not measured on a GPU (") and "attention=sdpa" in flash and "baseline" not in flash
    assert text.stdout.splitlines()[1].endswith("; from the shadow run")


def test_plan_on_forked_workers_is_the_plan_of_one_process():
    from memory_audit.comparison.plan import plan
    from memory_audit.prediction.predict import DEFAULTS, device_facts
    cfg = dict(DEFAULTS, n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512, batch_size=4,
               attention="manual")
    dev = device_facts(gpu="H100")
    one, two = plan(cfg, dev, 0.02, jobs=1), plan(cfg, dev, 0.02, jobs=2)
    assert one == two and len(one["options"]) == 12 and {o["from"] for o in one["options"]} == {"shadow run"}
    assert len({o["allocated_peak"] for o in one["options"]}) > 6  # the options' own runs, not one answer repeated


def test_an_error_in_a_plan_worker_is_raised_in_the_caller():
    from memory_audit.comparison.workers import mapped
    with pytest.raises(ValueError, match="item 3"):
        mapped(_refuse_three, range(5), jobs=2)
    assert mapped(abs, [-2, 3, -4], jobs=2) == [2, 3, 4]
    with pytest.raises(ValueError, match="worker process died"):  # killed: an error, not a hang
        mapped(_die_at_two, range(4), jobs=2)


def _refuse_three(i):
    if i == 3:
        raise ValueError("item 3 refused")
    return i


def _die_at_two(i):
    if i == 2:
        os._exit(9)
    return i


def test_plan_when_nothing_fits_is_one_line():
    p = run_cli("plan", "--gpu=L4", "--preset=gpt2-xl", "--batch_size=1", "--block_size=1024")
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1
    assert p.stderr.startswith("error: nothing fits") and "too many" in p.stderr
    bad = run_cli("plan", "--gpu=H100", "--memory=-5", "--preset=gpt2")
    assert bad.returncode == 2 and "positive" in bad.stderr


def test_reserved_is_predicted_and_expandable_segments_change_it():
    import os
    import subprocess
    import sys
    from conftest import ROOT
    plain = json.loads(run_cli("predict", "--preset=gpt2", "--gpu=H100", "--json").stdout)["totals"]
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    p = subprocess.run([sys.executable, "-m", "memory_audit", "predict", "--preset=gpt2", "--gpu=H100", "--json"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    expandable = json.loads(p.stdout)["totals"]
    assert plain["reserved_peak_bytes"] > plain["peak_allocated_bytes"]
    assert plain["peak_allocated_bytes"] <= expandable["reserved_peak_bytes"] < plain["reserved_peak_bytes"]
    assert expandable["reserved_peak_bytes"] % (2 * 2 ** 20) == 0  # whole pages


def test_attribute_names_the_peak_as_well_as_the_end():
    """`attribute RUN` prints, after the last phase, the step's peak replayed from its trace: the
    bytes the report measured as the peak (72,315,904 B on the committed tiny fp16 audit), where
    in the trace, and by category."""
    run = os.path.join(EXAMPLES, "cuda-tiny-fp16-manual")
    with open(os.path.join(run, "report.json")) as f:
        peak = json.load(f)["totals"]["peak"]["actual"]
    p = run_cli("attribute", run)
    assert p.returncode == 0, p.stderr
    line = [l for l in p.stdout.splitlines() if l.startswith("peak since step2_start")]
    assert len(line) == 1 and f"({peak:,} B) at trace entry " in line[0] and "activations" in line[0], line
