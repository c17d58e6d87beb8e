"""The recorder leaves a snapshot behind on a crash and explains a full disk in one line."""

import os

import pytest
import torch

from conftest import gpt_steps, load_json, run_train, tiny_gpt
from memory_audit.reading.loader import load_snapshot
from memory_audit.recording.recorder import AuditError, AuditRecording, _write_pickle
from model import GPT, GPTConfig, PRESETS


def test_crash_still_writes_a_snapshot(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom"):
        with AuditRecording(str(run), "cpu", {"preset": "cpu-tiny"}) as rec:
            model = GPT(GPTConfig(**PRESETS["cpu-tiny"]))
            rec.phase("step2_start", model)
            activations = torch.ones(1000, 100)  # 400,000 B live at the crash
            raise RuntimeError("boom")
    assert (run / "crash.pickle").exists() and (run / "step2_start.pickle").exists()
    meta = load_json(run / "meta.json")
    assert meta["error"]["type"] == "RuntimeError" and meta["error"]["message"] == "boom"
    snap = load_snapshot(str(run / "crash.pickle"))
    sizes = [b["size"] for s in snap["segments"] for b in s["blocks"]]
    assert 400_000 in sizes  # what was live when it crashed is in the file
    del activations


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_full_disk_is_one_clear_error():
    with pytest.raises(AuditError, match="could not write /dev/full: No space left on device"):
        _write_pickle({"segments": [], "device_traces": [[{"action": "alloc"}] * 10000]}, "/dev/full")


def test_unwritable_audit_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    p = run_train("--device=cpu", "--preset=cpu-tiny", "--batch_size=2", "--audit", f"--audit_dir={blocker}")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.startswith("error: could not create") and p.stderr.count("\n") == 1


def test_recording_turns_history_off_on_exit(tmp_path):
    rec = AuditRecording(str(tmp_path / "r"), "cpu", {})
    with rec:
        assert rec.active
    assert not rec.active
    rec.stop()  # idempotent


def _tiny_audit(out_dir, road=None, before=False):
    """A tiny GPT's audited step 2 on CPU through `road` (Audit's cpu_timeline); before: the model
    and optimizer made before the Audit (its weights older than the profile)."""
    from memory_audit import Audit
    if not before:
        audit = Audit(out_dir=str(out_dir), device="cpu", step=1, cpu_timeline=road)
    model, cfg = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters())
    if before:
        audit = Audit(model, opt, out_dir=str(out_dir), step=1, cpu_timeline=road)
    else:
        audit.watch(model, opt)
    x = torch.randint(cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    gpt_steps(model, opt, [(x, x)] * 2, audit)
    audit.close()


def _books(runs):
    """[{phase: (lines, unattributed bytes)}] of each run directory."""
    from memory_audit.reading.attribute import attribute
    from memory_audit.reading.loader import load_meta
    out = []
    for run in map(str, runs):
        books = {}
        for phase in ("step2_start", "step2_before_backward", "step2_end"):
            res = attribute(load_snapshot(os.path.join(run, f"{phase}.pickle")), load_meta(run), phase)
            books[phase] = (res[min(res)]["lines"], res[min(res)]["unattributed_bytes"])
        out.append(books)
    return out


@pytest.mark.parametrize("before", (False, True), ids=("model-after-audit", "model-before-audit"))
def test_both_roads_give_the_same_books(tmp_path, before):
    """The raw road (every allocation paired with its free by address; the default) and the
    profiler's memory profile give the same lines in every phase, none unattributed, whether the
    model was built inside the Audit's profile or before it (its weights then older than the
    profile: the raw road takes them from the storages the phases named)."""
    from memory_audit.reading.loader import load_meta
    _tiny_audit(tmp_path / "keyed", "memory_profile", before)
    _tiny_audit(tmp_path / "raw", None, before)
    keyed, raw = _books([tmp_path / "keyed", tmp_path / "raw"])
    assert keyed == raw and all(u == 0 for _, u in raw.values())
    assert sum(raw["step2_start"][0].values()) > 0
    assert [load_meta(str(tmp_path / r))["cpu_timeline"] for r in ("keyed", "raw")] == ["memory_profile", "raw allocations"]


def test_raw_allocations_give_the_same_books_when_the_memory_profiler_fails(tmp_path, monkeypatch):
    """Under torchrun, gloo's threads make the memory profiler's data-flow checks fail
    (AssertionError: duplicate outputs); where it was asked for, the CPU timeline then pairs
    every allocation by address. On a single-process audit both give the same lines in every phase."""
    from memory_audit.reading.loader import load_meta
    _tiny_audit(tmp_path / "keyed", "memory_profile")

    def fail(self):
        raise AssertionError("duplicate outputs (forced)")
    monkeypatch.setattr(torch.profiler.profile, "_memory_profile", fail)
    _tiny_audit(tmp_path / "raw", "memory_profile")
    keyed, raw = _books([tmp_path / "keyed", tmp_path / "raw"])
    assert keyed == raw and all(u == 0 for _, u in raw.values())
    assert [load_meta(str(tmp_path / r))["cpu_timeline"] for r in ("keyed", "raw")] == ["memory_profile", "raw allocations"]


def test_the_raw_road_tells_storages_older_than_the_profile_by_when_a_phase_named_them():
    """cpu_timeline._unseen_events on the raw road: a storage a phase named before any
    allocation at its address is older than the profile ("pre", its storage's bytes), let go when
    its address is allocated again; one allocated before the phase named it is the profile's own;
    an empty storage (0 B) is none; a free carries its allocation's frames."""
    from memory_audit.recording.cpu_timeline import _unseen_events
    f = [{"filename": "loop.py", "line": 3, "name": "step"}]
    unseen = [(10, 0xA, 128, f), (2, 0xB, 32, f), (20, 0xB, -32, []), (30, 0xA, -128, [])]
    keep = {0xA: 64, 0xB: 32, 0xC: 0, 0xD: 16}
    named = {0xA: 5, 0xB: 5, 0xC: 5, 0xD: 5}
    events = _unseen_events(unseen, [], keep, named)
    assert sorted(events, key=lambda e: (e[0], e[1] != "free")) == [
        (-1, "pre", 0xA, 64, [], None, ""), (-1, "pre", 0xD, 16, [], None, ""),
        (2, "alloc", 0xB, 32, f, "unknown", ""),
        (10, "free", 0xA, 64, [], None, ""), (10, "alloc", 0xA, 128, f, "unknown", ""),
        (20, "free", 0xB, 32, f, None, ""), (30, "free", 0xA, 128, f, None, "")]


def test_ddps_bucket_replaced_by_its_rebuild_is_let_go_where_the_rebuild_returns():
    """cpu_timeline: a DDP bucket made before the Reducer's rebuild whose free this thread never
    recorded (gloo's thread let go of step 1's all-reduce last) is freed at the rebuild's end;
    one whose free was recorded keeps it."""
    from memory_audit.recording.cpu_timeline import _free_staged, _superseded_buckets
    bucket = [{"filename": "torch/nn/parallel/distributed.py", "line": 1, "name": "_ddp_init_helper"}]
    rebuild = [{"filename": "torch/nn/parallel/distributed.py", "line": 2, "name": "_rebuild_buckets"}]
    events = [(1, "alloc", 0xA, 64, bucket, "unknown", ""), (2, "alloc", 0xB, 64, bucket, "unknown", ""),
              (3, "free", 0xB, 64, bucket, None, ""), (10, "alloc", 0xC, 64, rebuild, "unknown", "")]
    staged = _superseded_buckets(events, {(0xC, 10): 12})
    assert staged == {(0xA, 1): 12, (0xB, 2): 12}
    assert _free_staged(events, staged)[len(events):] == [(12, "free", 0xA, 64, [], None, "")]
