"""The compiled core against its pure-Python twins: same snapshots, same replay, same answers.

_fastcore is built by `pip install -e .` (requirements.txt). Where it could not be built these
tests skip, unless MEMORY_AUDIT_REQUIRE_FASTCORE is set (CI sets it), where they fail.
"""

import glob
import os
import pickle
import random

import numpy as np
import pytest

from conftest import EXAMPLES, FOREIGN
from memory_audit.reading import trace as trace_mod
from memory_audit.reading.allocator_sim import replay_blocks_py
from memory_audit.reading.attribute import attribute
from memory_audit.reading.loader import SnapshotError, load_snapshot
from memory_audit.reading.timeline import replay
from memory_audit.reading.trace import Trace, plain

core = trace_mod._fastcore
if core is None:
    if os.environ.get("MEMORY_AUDIT_REQUIRE_FASTCORE"):
        raise RuntimeError("memory_audit._fastcore is not built (pip install -e .)")
    pytest.skip("memory_audit._fastcore is not built on this machine", allow_module_level=True)

SNAPSHOTS = sorted(glob.glob(os.path.join(FOREIGN, "*.pickle"))) + \
    sorted(glob.glob(os.path.join(EXAMPLES, "*", "*.pickle")))
TINY = os.path.join(EXAMPLES, "cuda-tiny-fp16-manual", "step2_end.pickle")


def _pure(monkeypatch):
    monkeypatch.setenv("MEMORY_AUDIT_PURE_PYTHON", "1")


def _restricted(path):
    from memory_audit.reading.loader import _PlainDataUnpickler
    with open(path, "rb") as f:
        return _PlainDataUnpickler(f).load()


def _as_read(res):
    """The compiled decoder's result with its row lists turned back into lists of dicts."""
    root, lists, columns, _ = res
    for lst, rows in lists:
        t = Trace.from_scan(columns, rows)
        lst.extend(_raw(t, i) for i in range(t.n))
    return root


def _row_count(rows):
    """How many rows a list holds: (first, count) for a run, else a buffer of int64 row numbers."""
    return rows[1] if isinstance(rows, tuple) else len(np.frombuffer(rows, np.int64))


def _raw(t, i):
    """Entry i exactly as stored (no normalisation defaults)."""
    return t.entry(i, defaults=False)


@pytest.mark.parametrize("path", SNAPSHOTS, ids=os.path.basename)
def test_decoder_reads_what_pickle_reads(path):
    res = core.scan(path)
    assert res is not None, "a snapshot torch wrote must take the compiled road"
    root, lists, _, nrows = res
    assert sum(_row_count(r) for _, r in lists) == nrows
    assert _as_read(res) == _restricted(path)


@pytest.mark.parametrize("path", SNAPSHOTS, ids=os.path.basename)
def test_same_attribution_and_replay_either_road(path, monkeypatch):
    fast = load_snapshot(path)
    assert all(isinstance(t, Trace) for t in fast["device_traces"])
    got = (attribute(fast), [replay(fast, device=d, max_points=300) for d in range(len(fast["device_traces"]))])
    _pure(monkeypatch)
    slow = load_snapshot(path)
    assert plain(slow) == plain(fast)
    want = (attribute(slow), [replay(slow, device=d, max_points=300) for d in range(len(slow["device_traces"]))])
    assert got == want


@pytest.mark.parametrize("path", SNAPSHOTS, ids=os.path.basename)
def test_compiled_replay_equals_reference(path):
    for t in load_snapshot(path)["device_traces"]:
        for cpu in (False, True):
            block, pair = core.replay(t.act, t.addr, t.size, cpu)
            ref_block, ref_pair = replay_blocks_py(t.act.tolist(), t.addr.tolist(), t.size.tolist(), cpu)
            assert np.frombuffer(block, np.int64).tolist() == ref_block
            assert np.frombuffer(pair, np.int64).tolist() == ref_pair


def test_replay_block_rules_by_hand():
    """One 2 MiB segment: a 4-byte request gets 512 B; a 1.5 MiB request leaves 0.5 MiB, which is
    not split off in the large pool (<= 1 MiB would remain), so its block is the whole rest."""
    act = np.array([5, 1, 1, 2, 3, 1], dtype=np.uint8)  # seg_alloc, alloc, alloc, free_req, free_done, alloc
    mib = 2 ** 20
    addr = np.array([0, 0, 512, 512, 512, 512], dtype=np.int64)
    size = np.array([2 * mib, 4, 3 * mib // 2, 3 * mib // 2, 3 * mib // 2, 100], dtype=np.int64)
    block, pair = (np.frombuffer(x, np.int64).tolist() for x in core.replay(act, addr, size, False))
    assert block == [0, 512, 2 * mib - 512, 2 * mib - 512, 0, 512]
    assert pair == [-1, -1, 3, 2, -1, -1]
    assert (block, pair) == replay_blocks_py(act.tolist(), addr.tolist(), size.tolist(), False)


def test_hostile_pickle_never_takes_the_compiled_road(tmp_path):
    marker = tmp_path / "pwned"

    class Creates:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "x": Creates()}]]}))
    assert core.scan(str(bad)) is None
    with pytest.raises(SnapshotError, match="refused"):
        load_snapshot(str(bad))
    assert not marker.exists()


def test_mutated_files_are_read_alike_or_left_to_the_unpickler(tmp_path):
    """500 corrupted copies of a real snapshot (flipped bytes, cuts, splices): the compiled
    decoder either declines (None) or returns exactly what the restricted unpickler returns.
    It never crashes and never accepts what the unpickler rejects."""
    data = open(TINY, "rb").read()
    rng = random.Random(1234)
    path = tmp_path / "m.pickle"
    taken = 0
    for k in range(500):
        b = bytearray(data)
        kind = k % 3
        if kind == 0:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == 1:
            b = b[:rng.randrange(1, len(b))]
        else:
            i, j = sorted(rng.randrange(len(b)) for _ in range(2))
            b = b[:i] + b[j:]
        path.write_bytes(bytes(b))
        res = core.scan(str(path))
        try:
            want = _restricted(str(path))
        except Exception:
            assert res is None, f"mutation {k}: compiled decoder accepted a file the unpickler rejects"
            continue
        if res is not None:
            taken += 1
            assert _as_read(res) == want, f"mutation {k}"
    assert taken > 0  # some single-byte changes leave a valid pickle; those must read alike


def test_trace_columns_round_trip():
    entries = [{"action": "alloc", "addr": 2 ** 40, "size": 512, "frames": [{"name": "f"}]},
               {"action": "free_requested", "addr": 2 ** 40, "size": 512, "time_us": 7, "note": None},
               {"action": "oom", "device_free": 0}]
    t = Trace.from_dicts(entries)
    assert t.columns["addr"][1] is None and t.columns["note"][1] is not None  # ints vs objects
    assert [_raw(t, i) for i in range(3)] == entries
    assert t[2] == {"action": "oom", "device_free": 0, "frames": [], "size": 0, "addr": 0}
    assert t.act.tolist() == [1, 2, 0] and t.time_us(0) is None and t.time_us(1) == 7
    t.set_values("category", ["a", "b", "a"])
    assert [e["category"] for e in t] == ["a", "b", "a"]


def test_equal_frames_are_one_object(tmp_path):
    """A writer that makes fresh frame dicts for every entry (torch shares them) still gets one
    frames list per distinct stack, so a long trace does not keep a dict per frame per entry."""
    files = ["a.py", "b.py"]  # shared strings, as a pickle memoizes them
    entries = [{"action": "alloc", "addr": 512 * i, "size": 512,
                "frames": [{"name": "f", "filename": files[i % 2], "line": 10 + i % 2},
                           {"name": "main", "filename": files[0], "line": 1}]} for i in range(200)]
    path = tmp_path / "fresh.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries]}, protocol=4))
    res = core.scan(str(path))
    frames_table = next(table for name, _, _, table, _ in res[2] if name == "frames")
    assert len(frames_table) == 2
    assert frames_table[0][1] is frames_table[1][1]  # the shared `main` frame
    assert _as_read(res) == _restricted(str(path))


def test_ints_of_every_width_and_rows_out_of_order(tmp_path):
    """Ints are kept out of Python objects inside entries (up to 61 bits) and boxed everywhere
    else: every width and sign, as entry values, dict keys, list, tuple and set items, reads as
    pickle reads it. An entry holding a list of entries makes the outer list's rows skip (0, 3,
    6, ...), which the decoder returns as row numbers instead of a run."""
    widths = [0, 1, -1, 255, 256, -129, 2 ** 31 - 1, -2 ** 31, 2 ** 40 + 7, 2 ** 61 - 1, -2 ** 61,
              2 ** 61, -2 ** 61 - 1, 2 ** 63 - 1, -2 ** 63 + 1]
    huge = [2 ** 64 + 3, -2 ** 70]  # beyond int64: fine outside entries
    inner = lambda i: [{"action": "alloc", "addr": w, "size": i} for w in widths[i % 3:i % 3 + 2]]
    entries = [{"action": "alloc", "addr": w, "size": -w, "time_us": i, "children": inner(i)}
               for i, w in enumerate(widths)]
    ints = widths + huge
    snap = {"segments": [], "device_traces": [entries],
            "other": {"ints": list(ints), "tuple": tuple(ints), "set": set(ints), 7: huge[0], huge[1]: -1}}
    path = tmp_path / "ints.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    res = core.scan(str(path))
    assert res is not None
    runs = [rows for lst, rows in res[1]]
    assert any(not isinstance(r, tuple) for r in runs) and any(isinstance(r, tuple) for r in runs)
    assert _as_read(res) == pickle.loads(path.read_bytes())
    entries[3]["size"] = 2 ** 64  # an entry's int that no int64 column holds: the slow road, one line
    path.write_bytes(pickle.dumps(snap, protocol=4))
    assert core.scan(str(path)) is None
    with pytest.raises(SnapshotError, match="'size' .* does not fit in 64 bits"):
        load_snapshot(str(path))


@pytest.mark.parametrize("distinct, itemsize", [(127, 1), (128, 2), (32767, 2), (32768, 4), (40000, 4)])
def test_index_columns_widen_as_their_tables_grow(tmp_path, distinct, itemsize):
    """An object column starts one byte wide and is rewritten wider when its table of distinct
    values outgrows the type (trace._index_dtype's widths); every entry still reads as pickle
    reads it."""
    notes = [f"note {i}" for i in range(distinct)]
    entries = [{"action": "alloc", "addr": 512 * i, "size": 512, "note": notes[(i * 7) % distinct]}
               for i in range(distinct + 50)]
    path = tmp_path / "wide.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries]}, protocol=4))
    res = core.scan(str(path))
    assert next(size for name, _, _, _, size in res[2] if name == "note") == itemsize
    assert _as_read(res) == _restricted(str(path))


def test_pairs_a_mark_drops_are_dropped(tmp_path):
    """An entry whose first MARK is closed by POP_MARK, not SETITEMS: pickle drops those pairs
    (the entry is {'action': 'alloc', 'addr': 6}); the compiled road must not keep them."""
    data = (b"\x80\x04}\x94(\x8c\x08segments\x94]\x94\x8c\rdevice_traces\x94]\x94]\x94(}\x94(\x8c\x06action"
            b"\x94\x8c\x05alloc\x94\x8c\x04addr\x94K\x05\x8c\x04size\x94M\x00\x02u}\x94(h\x07h\x08h\tK\x06h\n"
            b"M\x00@1(h\x07h\x08h\tK\x06ueau.")
    path = tmp_path / "popmark.pickle"
    path.write_bytes(data)
    res = core.scan(str(path))
    assert res is None or _as_read(res) == pickle.loads(data)
    assert pickle.loads(data)["device_traces"][0][1] == {"action": "alloc", "addr": 6}


@pytest.mark.parametrize("data", [
    # a trace-entry-shaped dict inside a tuple: not where torch puts entries
    pickle.dumps({"segments": [], "x": ({"action": "alloc", "addr": 1},)}, protocol=4),
    # the same entry dict appended twice (through the memo)
    pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1}] * 2]}, protocol=4),
], ids=["entry-in-tuple", "entry-twice"])
def test_odd_but_valid_pickles_take_the_slow_road(tmp_path, data):
    path = tmp_path / "odd.pickle"
    path.write_bytes(data)
    assert core.scan(str(path)) is None
    assert _restricted(str(path)) == pickle.loads(data)


def test_memo_bomb_is_declined_and_reported(tmp_path):
    """A memo index two billion slots away: the decoder declines it rather than allocate 16 GB;
    the unpickler then fails on it (MemoryError here) or reads an empty dict, which is no
    snapshot: either way the user gets one line."""
    path = tmp_path / "bomb.pickle"
    path.write_bytes(b"\x80\x04}r\x00\x00\x00\x80.")
    assert core.scan(str(path)) is None
    with pytest.raises(SnapshotError, match="corrupt pickle|not a memory snapshot"):
        load_snapshot(str(path))


def test_entries_outside_device_traces_stay_dicts(tmp_path):
    """torch 2.14 writes host_traces too: entries there are read back as plain dicts."""
    entry = {"action": "alloc", "addr": 4096, "size": 8, "stream": 0}
    snap = {"segments": [], "device_traces": [[dict(entry)]], "host_traces": [[dict(entry), dict(entry)]]}
    path = tmp_path / "host.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    assert core.scan(str(path)) is not None
    got = load_snapshot(str(path))
    assert isinstance(got["device_traces"][0], Trace) and got["host_traces"] == snap["host_traces"]


def _requests(rng, n):
    """A random sequence of requests and frees, as the shadow's events: sizes from bytes to
    tens of MiB (both pools, every segment rule), each free of a live allocation."""
    events, live = [], []
    for i in range(n):
        if live and rng.random() < 0.45:
            aid = live.pop(rng.randrange(len(live)))
            events.append(("free", "k", 0, aid))
        else:
            size = rng.choice([rng.randrange(1, 4096), rng.randrange(4096, 1 << 20),
                               rng.randrange(1 << 20, 12 << 20), rng.randrange(12 << 20, 64 << 20)])
            events.append(("alloc", "k", size, i))
            live.append(i)
    return {"history": events[: n // 3], "events": events[n // 3:], "phases": {"step2_start": 0}}


@pytest.mark.parametrize("expandable", [False, True])
def test_compiled_allocator_model_equals_reference(expandable, monkeypatch):
    from memory_audit.prediction.shadow.replay import placed
    seed = random.randrange(10 ** 6)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for n in (1, 50, 3000, 3000):
        result = _requests(rng, n)
        fast = [list(c) for c in placed(result, expandable)]
        with monkeypatch.context() as m:
            _pure(m)
            slow = [list(c) for c in placed(result, expandable)]
        assert fast == slow, f"seed {seed}, {n} events"
        assert sum(fast[4]) > 0 and max(fast[3]) > 0  # segments made


def test_compiled_allocator_model_refuses_a_free_of_nothing():
    with pytest.raises(ValueError, match="not live"):
        core.model(bytes([1, 0, 0]), np.array([512, 512, 512], dtype=np.int64).tobytes(),
                   np.array([7, 7, 7], dtype=np.int64).tobytes(), False)


def test_per_category_equals_the_numpy_road(monkeypatch):
    """The compiled running sums per category at sampled entries (samples in any order, repeated,
    at the first and last entry) equal timeline._per_category's numpy road, category for category."""
    from memory_audit.reading import timeline
    from memory_audit.schema import CATEGORIES
    rng = np.random.default_rng(20261127)
    for n in (1, 7, 5000):
        delta = rng.integers(-2 ** 40, 2 ** 40, n) * (rng.random(n) < 0.6)
        cat = rng.integers(0, len(CATEGORIES) - 3, n).astype(np.int8)
        sample = np.r_[rng.integers(0, n, 40), 0, n - 1, n - 1]
        fast = timeline._per_category(delta, cat, sample)
        monkeypatch.setenv("MEMORY_AUDIT_PURE_PYTHON", "1")
        slow = timeline._per_category(delta, cat, sample)
        monkeypatch.delenv("MEMORY_AUDIT_PURE_PYTHON")
        assert fast.keys() == slow.keys() and all((fast[c] == slow[c]).all() for c in fast), n
    with pytest.raises(ValueError, match="out of range"):
        core.per_category(np.ones(3, np.int64), np.array([0, 99, 1], np.int8), np.array([2], np.int64), len(CATEGORIES))
