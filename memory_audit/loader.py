"""Open snapshot files safely and bring every known generation to one shape.

This is the only module that opens snapshot pickles. A snapshot is plain data (dicts, lists,
str, int, float, bool, None), so the unpickler refuses every global: a pickle that asks for a
class or a function (os.system, say) fails before anything in it runs.

Normalisation (in place, on the dict torch wrote) covers what is found in the wild:
  * 2023 files (torch 2.0): blocks carry `history` instead of `frames`, and no `address`;
    trace entries have no `time_us`
  * segments without `frames`, `is_expandable` or `segment_pool_id`
  * `active_awaiting_free` (the Python docstring's name) for `active_pending_free`
  * empty traces, several devices, expandable segments, `oom` entries
"""

import io
import json
import os
import pickle

from .schema import PHASES


class SnapshotError(ValueError):
    """A file that is not a usable snapshot; str() is a one-line reason."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise SnapshotError(f"refused: the pickle asks for {module}.{name}; snapshots are plain data")

    def persistent_load(self, pid):
        raise SnapshotError("refused: the pickle uses persistent ids; snapshots are plain data")


def load_pickle(path):
    """Read a pickle of plain data only. Raises SnapshotError with a one-line reason."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except IsADirectoryError:
        raise SnapshotError(f"{path}: is a directory, not a snapshot file") from None
    except OSError as e:
        raise SnapshotError(f"{path}: {e.strerror or e}") from None
    if not data:
        raise SnapshotError(f"{path}: empty file")
    if data[:1] != b"\x80":
        raise SnapshotError(f"{path}: not a pickle (no protocol header)")
    try:
        return _PlainDataUnpickler(io.BytesIO(data)).load()
    except SnapshotError as e:
        raise SnapshotError(f"{path}: {e}") from None
    except (EOFError, pickle.UnpicklingError) as e:
        raise SnapshotError(f"{path}: truncated or corrupt pickle ({e or 'unexpected end'})") from None
    except Exception as e:  # any other decoding failure is still a bad file, not a crash
        raise SnapshotError(f"{path}: corrupt pickle ({type(e).__name__}: {e})") from None


_STATE_ALIASES = {"active_awaiting_free": "active_pending_free"}


def normalize(snap, source="snapshot"):
    """Check the shape of a snapshot dict and fill in what older generations lack (in place)."""
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise SnapshotError(f"{source}: not a memory snapshot (expected a dict with a 'segments' list)")
    traces = snap.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
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
    for trace in snap["device_traces"]:
        for entry in trace:
            if not isinstance(entry, dict) or "action" not in entry:
                raise SnapshotError(f"{source}: a trace entry lacks 'action'")
            entry.setdefault("frames", [])
            entry.setdefault("size", 0)
            entry.setdefault("addr", entry.get("address", 0))
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


def find_snapshots(path):
    """Resolve a CLI path to [(phase name, pickle path)] and the run directory.

    A pickle file stands for itself; a run directory gives its phase pickles in phase order,
    then any other *.pickle (oom, crash) that is not a derived *.categorized.pickle.
    """
    if os.path.isdir(path):
        names = sorted(f for f in os.listdir(path) if f.endswith((".pickle", ".pkl"))
                       and not f.endswith(".categorized.pickle"))
        if not names:
            raise SnapshotError(f"{path}: directory holds no snapshot (*.pickle)")
        order = {f"{p}.pickle": i for i, p in enumerate(PHASES)}
        names.sort(key=lambda f: (order.get(f, len(order)), f))
        return [(os.path.splitext(f)[0], os.path.join(path, f)) for f in names], path
    if not os.path.exists(path):
        raise SnapshotError(f"{path}: no such file or directory")
    return [(os.path.splitext(os.path.basename(path))[0], path)], os.path.dirname(path) or "."
