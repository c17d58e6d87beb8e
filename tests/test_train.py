"""train.py: the audit observes without changing training, writes its files, refuses bad input."""

import os
import pickle

import pytest
import torch.cuda._memory_viz as memory_viz

from conftest import load_json, run_train
from memory_audit.reading.loader import load_snapshot
from memory_audit.schema import PHASES


def test_losses_bitwise_equal_with_and_without_audit(tmp_path):
    common = ["--device=cpu", "--preset=cpu-tiny", "--batch_size=2", "--max_iters=3", "--dtype=bfloat16",
              "--dropout=0.1"]  # dropout draws from the global RNG: the audit must not
    plain = run_train(*common, f"--losses_out={tmp_path}/plain.json")
    audited = run_train(*common, "--audit", f"--audit_dir={tmp_path}/snaps",
                        f"--losses_out={tmp_path}/audited.json")
    assert plain.returncode == 0 and audited.returncode == 0, audited.stderr[-2000:]
    a, b = load_json(tmp_path / "plain.json"), load_json(tmp_path / "audited.json")
    assert len(a) == 3 and a == b  # float.hex strings: equal means bit for bit


def test_audit_writes_three_snapshots_and_meta(cpu_run):
    files = set(os.listdir(cpu_run))
    assert {f"{p}.pickle" for p in PHASES} | {"meta.json", "report.json", "report.md"} <= files
    meta = load_json(os.path.join(cpu_run, "meta.json"))
    assert meta["schema_version"] == 1 and meta["device"]["type"] == "cpu"
    assert meta["config"]["n_layer"] == 2 and meta["torch_version"]
    assert meta["saved_tensors"], "the saved-tensor ledger is empty"


@pytest.mark.parametrize("phase", PHASES)
def test_snapshots_load_with_torch_memory_viz(cpu_run, phase):
    with open(os.path.join(cpu_run, f"{phase}.pickle"), "rb") as f:
        snap = pickle.load(f)  # our own file, written by this test session
    assert f"segments: {len(snap['segments'])}\n" in memory_viz.segsum(snap)
    assert memory_viz.trace(snap)
    assert "<html" in memory_viz.trace_plot(snap).lower()


@pytest.mark.parametrize("phase", PHASES)
def test_registry_addresses_are_live_allocations_in_the_trace(cpu_run, phase):
    meta = load_json(os.path.join(cpu_run, "meta.json"))
    snap = load_snapshot(os.path.join(cpu_run, f"{phase}.pickle"))
    live = {}
    for e in snap["device_traces"][0]:  # replay: an address names the allocation live now
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    registry = meta["phases"][phase]["registry"]
    assert len(registry) > 20
    for entry in registry:
        assert live.get(entry["data_ptr"]) == entry["nbytes"], entry["name"]


def test_runs_never_overwrite_each_other(tmp_path):
    args = ["--device=cpu", "--preset=cpu-tiny", "--batch_size=2", "--audit", f"--audit_dir={tmp_path}", "--run_name=same"]
    assert run_train(*args).returncode == 0
    assert run_train(*args).returncode == 0
    assert sorted(os.listdir(tmp_path)) == ["same", "same-2"]


@pytest.mark.parametrize("args, message", [
    (["--n_embd=100", "--n_head=12"], "n_embd=100 is not divisible by n_head=12"),
    (["--no_such_key=1"], "unknown config key 'no_such_key'"),
    (["--dataset=not_prepared"], "not found"),
    (["--batch_size=abc"], "--batch_size expects int"),
    (["--dtype=float8"], "dtype must be"),
    (["no_such_config.py"], "config file not found"),
    (["--max_iters=1", "--audit"], "ends before audit_step"),
    (["--device=cuda:7"] , "CUDA"),
])
def test_bad_input_is_one_line_and_no_traceback(args, message):
    p = run_train("--device=cpu", *args) if not args[0].startswith("--device") else run_train(*args)
    if args == ["--device=cuda:7"] and "cuda" in p.stdout and p.returncode == 0:
        pytest.skip("this machine has CUDA")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], p.stderr


def test_bare_audit_flag_and_config_files(tmp_path):
    cfg = tmp_path / "tiny.py"
    cfg.write_text("preset = 'cpu-tiny'\nbatch_size = 2\ndevice = 'cpu'\n")
    p = run_train(str(cfg), "--audit", f"--audit_dir={tmp_path}/s", "--run_name=r")
    assert p.returncode == 0, p.stderr
    assert "unattributed: 0 B" in p.stdout
