"""Open snapshot files safely and bring every known generation to one shape.

This is the only module that opens snapshot pickles. A snapshot is plain data (dicts, lists,
str, int, float, bool, None), so the unpickler refuses every global: a pickle that asks for a
class or a function (os.system, say) fails before anything in it runs.

Two readers, one result: the compiled decoder (_fastcore.c, plain-data opcodes only, trace
entries stored as columns) takes the files it fully understands; any other file goes to the
restricted pickle.Unpickler, whose traces are then turned into the same columns (trace.Trace).

Normalisation (in place; each device trace becomes a trace.Trace) covers what is found in the wild:
  * 2023 files (torch 2.0): blocks carry `history` instead of `frames`, and no `address`;
    trace entries have no `time_us`
  * segments without `frames`, `is_expandable` or `segment_pool_id`
  * `active_awaiting_free` (the Python docstring's name) for `active_pending_free`
  * empty traces, several devices, expandable segments, `oom` entries
"""

import json
import os
import pickle

from ..schema import PHASES
from .trace import Trace, as_trace, fastcore


class SnapshotError(ValueError):
    """A file that is not a usable snapshot; str() is a one-line reason."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise SnapshotError(f"refused: the pickle asks for {module}.{name}; snapshots are plain data")

    def persistent_load(self, pid):
        raise SnapshotError("refused: the pickle uses persistent ids; snapshots are plain data")


def _scan(path):
    """The compiled decoder's reading of `path` with traces as columns, or None (slow road)."""
    core = fastcore()
    if core is None:
        return None
    res = core.scan(path)
    if res is None:
        return None
    root, lists, columns, _ = res
    traces = root.get("device_traces") if isinstance(root, dict) else None
    for lst, rows in lists:
        trace = Trace.from_scan(columns, rows)
        spot = next((i for i, t in enumerate(traces or ()) if t is lst), None)
        if spot is None:  # entries somewhere else (host traces, say): plain dicts there
            lst.extend(trace.entry(i, defaults=False) for i in range(trace.n))
        else:
            traces[spot] = trace
    return root


def load_pickle(path):
    """Read a pickle of plain data only. Raises SnapshotError with a one-line reason.

    The compiled decoder takes files it fully understands (trace entries become columns);
    everything else, including every hostile or broken file, goes through the restricted
    unpickler, which refuses globals and reports what is wrong.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(1)
    except IsADirectoryError:
        raise SnapshotError(f"{path}: is a directory, not a snapshot file") from None
    except OSError as e:
        raise SnapshotError(f"{path}: {e.strerror or e}") from None
    if not head:
        raise SnapshotError(f"{path}: empty file")
    if head != b"\x80":
        raise SnapshotError(f"{path}: not a pickle (no protocol header)")
    fast = _scan(path)
    if fast is not None:
        return fast
    try:
        with open(path, "rb") as f:
            return _PlainDataUnpickler(f).load()
    except SnapshotError as e:
        raise SnapshotError(f"{path}: {e}") from None
    except (EOFError, pickle.UnpicklingError) as e:
        raise SnapshotError(f"{path}: truncated or corrupt pickle ({e or 'unexpected end'})") from None
    except OSError as e:
        raise SnapshotError(f"{path}: {e.strerror or e}") from None
    except Exception as e:  # any other decoding failure is still a bad file, not a crash
        raise SnapshotError(f"{path}: corrupt pickle ({type(e).__name__}: {e})") from None


_STATE_ALIASES = {"active_awaiting_free": "active_pending_free"}


def normalize(snap, source="snapshot"):
    """Check the shape of a snapshot dict and fill in what older generations lack (in place)."""
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise SnapshotError(f"{source}: not a memory snapshot (expected a dict with a 'segments' list)")
    traces = snap.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, (list, Trace)) for t in traces):
        raise SnapshotError(f"{source}: 'device_traces' is not a list of lists")
    snap.setdefault("device_traces", traces)
    for seg in snap["segments"]:
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks"), list) \
                or not isinstance(seg.get("total_size"), int):
            raise SnapshotError(f"{source}: a segment lacks 'blocks' or 'total_size'")
        seg.setdefault("device", 0)
        seg.setdefault("frames", [])
        seg.setdefault("is_expandable", False)
        seg.setdefault("segment_type", "large" if seg["total_size"] > 2 ** 21 else "small")
        addr = seg.get("address")
        for block in seg["blocks"]:
            if not isinstance(block, dict) or not isinstance(block.get("size"), int):
                raise SnapshotError(f"{source}: a block lacks an integer 'size'")
            block["state"] = _STATE_ALIASES.get(block.get("state"), block.get("state", "inactive"))
            if "address" not in block and addr is not None:
                block["address"] = addr  # 2023 files: blocks follow each other inside the segment
            if addr is not None:
                addr = block["address"] + block["size"]
            if "frames" not in block:
                history = block.get("history") or []
                block["frames"] = history[-1].get("frames", []) if history and isinstance(history[-1], dict) else []
            block.setdefault("requested_size", block["size"] if block["state"] != "inactive" else 0)
    cpu = bool((snap.get("allocator_settings") or {}).get("cpu_profiler_timeline"))
    for d, trace in enumerate(snap["device_traces"]):
        if not isinstance(trace, Trace):
            if not all(isinstance(e, dict) and "action" in e for e in trace):
                raise SnapshotError(f"{source}: a trace entry lacks 'action'")
            trace = snap["device_traces"][d] = as_trace(trace)
        if trace.n and ("action" not in trace.columns or (trace.columns["action"][0] < 0).any()
                        or trace.columns["action"][1] is None):
            raise SnapshotError(f"{source}: a trace entry lacks 'action'")
        try:
            trace.addr, trace.size  # integers, or a clear error now rather than a wrong sum later
        except ValueError as e:
            raise SnapshotError(f"{source}: {e}") from None
        trace.cpu = cpu
    return snap


def load_snapshot(path):
    """Load and normalise one snapshot pickle."""
    return normalize(load_pickle(path), source=path)


def load_meta(run_dir):
    """meta.json of a run directory, or None when the snapshot came from elsewhere."""
    path = os.path.join(run_dir, "meta.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{path}: unreadable meta.json ({e})") from None
    if not isinstance(meta, dict) or "schema_version" not in meta:
        raise SnapshotError(f"{path}: not a memory_audit meta.json (no schema_version)")
    return meta


PREDICTED_FILE = "predicted.pickle"  # a run's predicted step as a snapshot (reconcile.store_prediction)


def is_recorded(filename):
    """Whether a file in a run directory is one of the run's own snapshots: a *.pickle that is
    not what the tools derive from them (the predicted step, a *.categorized.pickle, a
    *.window-A-B.pickle of viz)."""
    return (filename.endswith((".pickle", ".pkl")) and filename != PREDICTED_FILE
            and not filename.endswith(".categorized.pickle") and ".window-" not in filename)


def find_snapshots(path):
    """Resolve a CLI path to [(phase name, pickle path)] and the run directory.

    A pickle file stands for itself; a run directory gives its phase pickles in phase order,
    then any other *.pickle (oom, crash) that it recorded (is_recorded).
    """
    if os.path.isdir(path):
        names = sorted(f for f in os.listdir(path) if is_recorded(f))
        if not names:
            raise SnapshotError(f"{path}: directory holds no snapshot (*.pickle)")
        order = {f"{p}.pickle": i for i, p in enumerate(PHASES)}
        names.sort(key=lambda f: (order.get(f, len(order)), f))
        return [(os.path.splitext(f)[0], os.path.join(path, f)) for f in names], path
    if not os.path.exists(path):
        raise SnapshotError(f"{path}: no such file or directory")
    return [(os.path.splitext(os.path.basename(path))[0], path)], os.path.dirname(path) or "."
