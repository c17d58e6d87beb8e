"""The PyTorch memory viz for a run, and an overview page for snapshots of any size.

`python -m memory_audit viz RUN` writes, beside the snapshot of `--phase` (default step2_end):
  * below REAL_VIEWER_MAX_ENTRIES trace entries, RUN/<phase>.html: the page torch's _memory_viz
    writes (a module script that loads MemoryViz.js from the internet and hands it the pickle as
    base64), built here without torch, with our categories as the legend and colours;
  * RUN/<phase>.overview.html (above the limit: RUN/<phase>.html itself): overview_page's
    self-contained page, drawn offline at any size: bytes per category over the whole trace,
    memory_allocated and reserved, the peak and its largest allocations. For an audit whose
    prediction left RUN/predicted.pickle, the predicted step is drawn on the same axes;
  * above the limit, the span around the peak as RUN/<phase>.window-A-B.pickle and its MemoryViz
    page; `--window=A:B` writes any other span.
The test suite opens these pages in headless Chromium, offline (tests/test_memory_viz.py).
"""

import base64
import json
import os
import pickle

from . import overview_page
from ..schema import PHASES_KEY
from .loader import PREDICTED_FILE, find_snapshots, load_meta, load_snapshot
from .overview import overview, peak_window, window
from .event_names import categorize_trace
from .timeline import read_trace
from .trace import plain

VIEWS = ("Active Memory Timeline", "Allocator State History", "Active Cached Segment Timeline")
VIEWER_URL = "https://cdn.jsdelivr.net/gh/pytorch/pytorch@main/torch/utils/viz/MemoryViz.js"


def categorized(path, meta=None, detail=False):
    """A snapshot file as MemoryViz reads it (plain lists of dicts), every trace entry with our
    `category` (top level unless `detail`: the viewer cycles through ten colours)."""
    snap = categorize_trace(load_snapshot(path), meta, detail)
    return plain(snap)


# The viewer's entry point: add_local_files([{name, base64}], view) decodes each file as a pickle
# and opens it in `view`.
PAGE = """<!DOCTYPE html>
<html>
<head>
</head>
<body>
<script type="module">
import {add_local_files} from "%(url)s"
add_local_files(%(files)s, %(view)s)
</script>
</body>
"""


def html(snap, view=VIEWS[0]):
    """The viewer page for `snap` (a plain snapshot dict), as torch's _memory_viz writes it."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; one of {', '.join(VIEWS)}")
    data = pickle.dumps(snap, protocol=4)
    data += b"\x00" * (3 - len(data) % 3)  # the viewer's base64 decoder expects whole 3-byte groups
    files = json.dumps([{"name": "snapshot.pickle", "base64": base64.b64encode(data).decode("ascii")}])
    return PAGE % {"url": VIEWER_URL, "files": files, "view": json.dumps(view)}


# Above this many trace entries the real viewer is not written for the whole trace: where it
# takes more than ~5 s to draw. benchmarks/bench_viz.py, Chromium 156 headless, 2 cores
# (2026-11-27), the page's time to drawn: 10,355 entries 0.96 s, 30,299 2.48 s, 100,103 4.27 s,
# 300,374 10.30 s, 1,000,076 45.49 s (a 111 MB page); the overview page 0.19-0.32 s at each.
REAL_VIEWER_MAX_ENTRIES = 100_000
WINDOW_ENTRIES = 20_000  # the span around the peak written for MemoryViz above the limit


def write_viz(path, phase="step2_end", view=VIEWS[0], out=None, detail=False, window=None):
    """Write the pages of one phase of a run (or of one snapshot file): [(path, what it is)]."""
    pairs, run_dir = find_snapshots(path)
    files = dict(pairs)
    if phase not in files:
        if len(files) != 1:
            raise ValueError(f"{path}: no {phase} snapshot; phases here: {', '.join(files) or 'none'}")
        phase = next(iter(files))
    meta, src = load_meta(run_dir), files[phase]
    if out and (os.path.isdir(out) or out.endswith(os.sep)):
        out = os.path.join(out, phase + ".html")
    base = os.path.splitext(out or src)[0]  # every page beside --out when given, else beside the snapshot
    snap = load_snapshot(src)
    if PHASES_KEY in snap:  # a predicted step (predict --trace, RUN/predicted.pickle): not the audit's trace
        meta = None
    traces = snap.get("device_traces") or []
    device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)  # a rank's own GPU
    n = len(traces[device]) if traces else 0
    if window is not None:
        if window[1] - window[0] > REAL_VIEWER_MAX_ENTRIES:
            raise ValueError(f"--window={window[0]}:{window[1]}: {window[1] - window[0]:,} entries; MemoryViz takes "
                             f"more than ~5 s above {REAL_VIEWER_MAX_ENTRIES:,} (the overview page draws any size)")
        return [_write_window(snap, meta, window, base, view, device=device)]
    written = []
    if n <= REAL_VIEWER_MAX_ENTRIES:
        page = html(plain(categorize_trace(snap, meta, detail)), view)
        written.append((_write(base + ".html", page), "PyTorch's MemoryViz (loads its code from the internet)"))
    reading = read_trace(snap, meta, device)
    view_ = overview(snap, meta, device, reading=reading)
    view_.update(label="predicted" if PHASES_KEY in snap else "measured", file=src)  # predict --trace's file
    timelines = [view_]
    predicted = os.path.join(run_dir, PREDICTED_FILE) if os.path.isdir(path) else None
    if predicted and os.path.exists(predicted) and phase == "step2_end":  # the predicted step is the whole step
        pred = overview(load_snapshot(predicted))
        pred.update(label="predicted", file=predicted)
        timelines.append(pred)
    windows = []
    if n > REAL_VIEWER_MAX_ENTRIES and view_["peak"].get("index") is not None:
        a, b = peak_window(view_, WINDOW_ENTRIES)
        written.append(_write_window(snap, meta, (a, b), base, view, reading, device))
        windows.append((f"entries {a:,} to {b:,}, around the peak", os.path.basename(written[-1][0])))
    dest = base + (".html" if n > REAL_VIEWER_MAX_ENTRIES else ".overview.html")
    title = f"{os.path.basename(os.path.abspath(run_dir)) if os.path.isdir(path) else os.path.basename(src)}: {phase}"
    subtitle = f"{n:,} trace entries" + (", with the predicted step (predicted.pickle)" if len(timelines) > 1 else "")
    written.append((_write(dest, overview_page.page(timelines, title, subtitle, windows)),
                    "overview (works offline, any size)"))
    return written


def _write_window(snap, meta, span, base, view, reading=None, device=0):
    a, b = span
    win = window(snap, a, b, meta, device, reading=reading)
    pickle_path = f"{base}.window-{a}-{b}.pickle"
    with open(pickle_path, "wb") as f:
        pickle.dump(win, f, protocol=4)
    return _write(f"{base}.window-{a}-{b}.html", html(win, view)), f"entries {a:,} to {b:,} in MemoryViz ({pickle_path} beside it)"


def _write(dest, text):
    with open(dest, "w") as f:
        f.write(text)
    return dest
