"""One device's trace, stored by column.

A trace can hold millions of entries; as a list of dicts it costs about 9x its pickle. Here
each key is one int64 column: ints as they are (ABSENT where an entry lacks the key), any other
value as an index into a table of the distinct values (-1 where absent). Entries still read as
dicts (`trace[i]`, iteration) for code that wants them; the replay and attribution work on the
columns.

`act` codes the actions the allocator replay understands; every other action ('snapshot',
'oom', 'annotate', ...) is OTHER and kept by name in the `action` column.
"""

import os

import numpy as np

from .allocator_sim import replay_blocks_py

try:  # built by `pip install -e .` (setup.py); without it the pure-Python twins give the same results
    from .. import _fastcore
except ImportError:  # pragma: no cover - depends on the machine
    _fastcore = None


def fastcore():
    """The compiled core, or None when it is not built or MEMORY_AUDIT_PURE_PYTHON is set."""
    return None if os.environ.get("MEMORY_AUDIT_PURE_PYTHON") else _fastcore

ABSENT = np.iinfo(np.int64).min
ACTIONS = ("other", "alloc", "free_requested", "free_completed", "free",
           "segment_alloc", "segment_free", "segment_map", "segment_unmap")
A = {name: i for i, name in enumerate(ACTIONS)}
FREES = (A["free_requested"], A["free"])  # memory_allocated() drops here (not at free_completed)


def is_action(act, codes):
    """act (uint8 action codes) in `codes`, as a bool array: a table lookup (np.isin is 10x
    slower on ten million entries)."""
    table = np.zeros(256, dtype=bool)
    table[list(codes)] = True
    return table[act]


class Trace:
    """Columns {key: (values int64 array, table list or None)} of n entries, in key order."""

    def __init__(self, columns, n):
        self.columns = dict(columns)
        self.n = int(n)
        for key, (values, _) in self.columns.items():
            if len(values) != self.n:
                raise ValueError(f"trace column {key!r} has {len(values)} values for {self.n} entries")
        self._act = self._addr = self._size = None
        self._replayed = {}
        self.cpu = False  # a CPU profiler timeline (exact bytes, no caching allocator): set by the loader
        self.cache = {}  # results derived from the columns (live_at_end), computed once

    # ---- building
    @classmethod
    def from_dicts(cls, entries):
        """From a list of entry dicts (a snapshot torch wrote, or one built in a test)."""
        n = len(entries)
        keys = {}
        for e in entries:
            for k in e:
                keys.setdefault(k, None)
        columns = {}
        for k in keys:
            vals = [e.get(k, _MISSING) for e in entries]
            if all(v is _MISSING or (type(v) is int and ABSENT < v < 2 ** 63) for v in vals):
                columns[k] = (np.array([ABSENT if v is _MISSING else v for v in vals], dtype=np.int64), None)
            else:
                columns[k] = _encode(vals, id)  # by identity: values may be unhashable (frames lists)
        return cls(columns, n)

    @classmethod
    def from_scan(cls, columns, rows):
        """From the compiled decoder's columns [(key, kind, bytes, table, itemsize)] and this
        list's rows (int64 row numbers, or (first, count)). Kind 1: int64 values; kind 2: indexes into `table` (-1: absent), already in
        the narrowest type (_index_dtype)."""
        if isinstance(rows, tuple):  # (first, count): rows that follow each other, as torch writes them
            pick, n = slice(rows[0], rows[0] + rows[1]), rows[1]
        else:
            pick = np.frombuffer(rows, dtype=np.int64)
            n = len(pick)
        out = {}
        for key, kind, data, table, itemsize in columns:
            values = np.frombuffer(data, dtype=np.int64 if kind == 1 else np.dtype(f"i{itemsize}"))[pick]
            if len(values) and (values == (ABSENT if kind == 1 else -1)).all():
                continue  # a key only other lists' entries have
            out[key] = (values, table if kind == 2 else None)
        return cls(out, n)

    # ---- reading
    def __len__(self):
        return self.n

    def __bool__(self):
        return self.n > 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.entry(j) for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError("trace index out of range")
        return self.entry(i)

    def __iter__(self):
        for i in range(self.n):
            yield self.entry(i)

    def value(self, key, i, default=None):
        col = self.columns.get(key)
        if col is None:
            return default
        v = col[0][i]
        if col[1] is None:
            return default if v == ABSENT else int(v)
        return default if v < 0 else col[1][v]

    def entry(self, i, defaults=True):
        """Entry i as the dict torch wrote (plus, with `defaults`, what `normalize` fills in)."""
        e = {key: v for key in self.columns if (v := self.value(key, i, _MISSING)) is not _MISSING}
        if not defaults:
            return e
        e.setdefault("frames", [])
        e.setdefault("size", 0)
        e.setdefault("addr", e.get("address", 0))
        return e

    def frames(self, i):
        return self.value("frames", i) or []

    def to_list(self):
        return [self.entry(i) for i in range(self.n)]

    # ---- numeric views for the replay
    def _ints(self, key, default=0):
        col = self.columns.get(key)
        if col is None:
            return np.full(self.n, default, dtype=np.int64)
        values, table = col
        if table is None:  # the column itself when no entry lacks the key (no copy of 1M entries)
            absent = values == ABSENT
            return np.where(absent, default, values) if absent.any() else values
        bad = next((v for v in table if type(v) is not int and v is not None), _MISSING)
        if bad is not _MISSING:
            raise ValueError(f"a trace entry has a non-integer {key!r} ({type(bad).__name__})")
        big = next((v for v in table if v is not None and not -2 ** 63 <= v < 2 ** 63), None)
        if big is not None:
            raise ValueError(f"a trace entry's {key!r} ({big}) does not fit in 64 bits")
        lut = np.array([default if v is None else v for v in table] or [0], dtype=np.int64)
        return np.where(values < 0, default, lut[np.maximum(values, 0)])

    @property
    def act(self):
        if self._act is None:
            col = self.columns.get("action")
            if col is None or col[1] is None:
                self._act = np.zeros(self.n, dtype=np.uint8)
            else:
                lut = np.array([A.get(v, 0) if isinstance(v, str) else 0 for v in col[1]] or [0], dtype=np.uint8)
                self._act = np.where(col[0] < 0, 0, lut[np.maximum(col[0], 0)]).astype(np.uint8)
        return self._act

    @property
    def addr(self):
        if self._addr is None:
            self._addr = self._ints("addr") if "addr" in self.columns else self._ints("address")
        return self._addr

    @property
    def size(self):
        if self._size is None:
            self._size = self._ints("size")
        return self._size

    @property
    def stream(self):
        """Each entry's stream (0 where the entry has none)."""
        return self._ints("stream")

    def action(self, i):
        return self.value("action", i)

    def time_us(self, i):
        return self.value("time_us", i)

    def replayed(self, cpu=False):
        """(block, pair) int64 arrays: see allocator_sim.replay_blocks_py. Cached: the last one
        asked for (pairing() reads any), one array pair at a time on a million-entry trace."""
        key = bool(cpu)
        if key not in self._replayed:
            self._replayed.clear()
            act, addr, size = (np.ascontiguousarray(x) for x in (self.act, self.addr, self.size))
            core = fastcore()
            if core is not None:
                block, pair = core.replay(act, addr, size, key)
                block, pair = np.frombuffer(block, dtype=np.int64), np.frombuffer(pair, dtype=np.int64)
            else:
                block, pair = replay_blocks_py(act.tolist(), addr.tolist(), size.tolist(), key)
                block, pair = np.array(block, dtype=np.int64), np.array(pair, dtype=np.int64)
            self._replayed[key] = (block, pair)
        return self._replayed[key]

    def pairing(self):
        """The replay's pair column (it does not depend on `cpu`): from a replay already made,
        else from the replay this trace's own kind needs (the timeline asks for it next)."""
        for cpu in (False, True):
            if cpu in self._replayed:
                return self._replayed[cpu][1]
        return self.replayed(self.cpu)[1]

    def set_values(self, key, values):
        """Set `key` on every entry (a list of n hashable values), e.g. a category per entry."""
        self.columns[key] = _encode(values, lambda v: v)


class _Missing:
    __slots__ = ()


_MISSING = _Missing()


def _index_dtype(n):
    """The narrowest signed integer type that holds -1 .. n - 1."""
    return np.int8 if n < 2 ** 7 else np.int16 if n < 2 ** 15 else np.int32 if n < 2 ** 31 else np.int64


def _encode(values, ident):
    """(codes, table): each value's index in a table of the distinct ones (by `ident`); -1 for
    _MISSING."""
    table, index, codes = [], {}, np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        if v is _MISSING:
            codes[i] = -1
            continue
        j = index.get(ident(v))
        if j is None:
            j = index[ident(v)] = len(table)
            table.append(v)
        codes[i] = j
    return codes, table


def as_trace(trace):
    """A Trace from a Trace or a list of entry dicts."""
    return trace if isinstance(trace, Trace) else Trace.from_dicts(list(trace))


def plain(snap):
    """The snapshot with its traces as lists of dicts again (to pickle it for MemoryViz)."""
    out = dict(snap)
    out["device_traces"] = [t.to_list() if isinstance(t, Trace) else t for t in snap.get("device_traces", [])]
    return out
