"""The PyTorch memory viz for a run: its categorized snapshot in the HTML torch writes.

`python -m memory_audit viz RUN` writes RUN/<phase>.html from the step's categorized snapshot:
the page torch.cuda._memory_viz writes (a module script that loads MemoryViz.js from the internet
and hands it the pickle as base64), built here without importing torch, with our categories as
the legend and colours. The test suite opens the same HTML in headless Chromium
against ../shared's copy of MemoryViz.js and d3 from npm (tests/test_memory_viz.py).
"""

import base64
import json
import os
import pickle

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
