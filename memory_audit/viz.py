"""The PyTorch memory viz for a run: its categorized snapshot in the HTML torch writes.

`python -m memory_audit viz RUN` writes RUN/<phase>.html from the step's categorized snapshot:
torch.cuda._memory_viz's own page (it loads MemoryViz.js from the internet), with our
categories as the legend and colours. The test suite opens the same HTML in headless Chromium
against ../shared's copy of MemoryViz.js and d3 from npm (tests/test_memory_viz.py).
"""

import os

from .loader import find_snapshots, load_meta, load_snapshot
from .timeline import categorize_trace
from .trace import plain

VIEWS = ("Active Memory Timeline", "Allocator State History", "Active Cached Segment Timeline")
VIEWER_URL = "https://cdn.jsdelivr.net/gh/pytorch/pytorch@main/torch/utils/viz/MemoryViz.js"


def categorized(path, meta=None, detail=False):
    """A snapshot file as MemoryViz reads it (plain lists of dicts), every trace entry with our
    `category` (top level unless `detail`: the viewer cycles through ten colours)."""
    snap = categorize_trace(load_snapshot(path), meta, detail)
    return plain(snap)


def html(snap, view=VIEWS[0]):
    """The page torch's _memory_viz makes for `snap` (its viewer URL is VIEWER_URL)."""
    from torch.cuda import _memory_viz
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; one of {', '.join(VIEWS)}")
    return _memory_viz._format_viz(snap, view, None)


def write_viz(path, phase="step2_end", view=VIEWS[0], out=None, detail=False):
    """Write the viz page of one phase of a run (or of one snapshot file); returns its path."""
    pairs, run_dir = find_snapshots(path)
    files = dict(pairs)
    if phase not in files:
        if len(files) != 1:
            raise ValueError(f"{path}: no {phase} snapshot; phases here: {', '.join(files) or 'none'}")
        phase = next(iter(files))
    page = html(categorized(files[phase], load_meta(run_dir), detail), view)
    out = out or os.path.splitext(files[phase])[0] + ".html"
    with open(out, "w") as f:
        f.write(page)
    return out
