"""Benchmark: how big a snapshot the real MemoryViz draws in headless Chromium, beside our overview page.

    python benchmarks/bench_viz.py [--sizes=10000,30000,100000,300000,1000000] [--timeout=180]

For each size, builds a snapshot of that many trace entries from the committed CUDA example
(bench_attribute.build), writes the page `viz` writes below its limit (torch's template, the
pickle inside as base64) and our overview page, and loads each in headless Chromium, offline
(MemoryViz.js from ../shared, d3 from npm: tests/headless.py). Prints the page's size, the
time from navigation to the end of the page's scripts (performance.now() in a script that runs
right after them), the page's time (Chromium's wall time until it dumped the page, less a blank
page's: parsing, scripts, layout) and whether it drew at all (an SVG of more than 50 elements
and no error). viz.REAL_VIEWER_MAX_ENTRIES comes from this table. Not a test: the
numbers depend on the machine.
"""

import argparse
import json
import os
import pickle
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import headless  # noqa: E402
from bench_attribute import build  # noqa: E402
from memory_audit.reading import overview_page, viz  # noqa: E402
from memory_audit.reading.loader import load_snapshot  # noqa: E402
from memory_audit.reading.overview import overview  # noqa: E402

SOURCE = os.path.join(ROOT, "snapshots", "examples", "cuda-tiny-fp16-manual", "step2_end.pickle")
HEAD = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e)));
window.addEventListener('unhandledrejection', e => window.__errors.push('rejection: ' + String(e.reason)));
</script>"""
# runs after the page's own scripts (module scripts run in order; a classic one at the end of
# the body runs before them, so the overview's probe is a module too)
TAIL = """<script type="module">
const pre = document.createElement('pre'); pre.id = 'probe';
pre.textContent = JSON.stringify({ms: performance.now(), drawn: document.querySelectorAll('svg *').length,
                                  errors: window.__errors});
document.body.appendChild(pre);
</script>"""


def load(url, profile, timeout):
    """(drawn ms or None, svg elements, errors, Chromium's wall s) of one page."""
    try:
        dom, wall, _ = headless.chromium(url, profile, timeout=timeout)
    except Exception as e:  # a page Chromium cannot finish within the timeout counts as not drawn
        return None, 0, [f"{type(e).__name__}"], float(timeout)
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    if not m:
        return None, 0, ["no probe: the page did not finish"], wall
    probe = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    return probe["ms"], probe["drawn"], probe.get("errors") or [], wall


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="10000,30000,100000,300000,1000000")
    p.add_argument("--timeout", type=int, default=180)
    args = p.parse_args()
    why = headless.missing()
    if why:
        raise SystemExit(f"error: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        why = headless.build_viewer(root)
        if why:
            raise SystemExit(f"error: {why}")
        server, url = headless.serve(root)
        (root / "blank.html").write_text("<!DOCTYPE html><html><body>" + TAIL + "</body></html>")
        blank = min(load(f"{url}/blank.html", root / f"profile-blank-{k}", args.timeout)[3] for k in range(3))
        print(f"Chromium on a blank page: {blank:.2f} s wall (subtracted below: the page's own time)")
        print(f"{'entries':>9} | {'page':>9} | {'script done':>11} | {'page time':>9} | drew | "
              f"{'overview page':>13} | {'script done':>11} | {'page time':>9}")
        for n in (int(x) for x in args.sizes.split(",")):
            path = root / f"snap-{n}.pickle"
            with open(path, "wb") as f:
                pickle.dump(build(SOURCE, n), f, protocol=4)
            entries = len(load_snapshot(str(path))["device_traces"][0])
            page = viz.html(viz.categorized(str(path)))
            (root / f"real-{n}.html").write_text(headless.offline(page, HEAD, TAIL))
            ms, drawn, errors, wall = load(f"{url}/real-{n}.html", root / f"profile-real-{n}", args.timeout)
            view = overview(load_snapshot(str(path)))
            view.update(label="measured", file=str(path))
            ov = overview_page.page([view], "bench").replace("</body>", TAIL + "</body>").replace(
                "<head>", "<head>" + HEAD, 1)
            (root / f"ov-{n}.html").write_text(ov)
            oms, odrawn, oerrors, owall = load(f"{url}/ov-{n}.html", root / f"profile-ov-{n}", args.timeout)
            ok = ms is not None and drawn > 50 and not errors
            print(f"{entries:>9,} | {len(page) / 2**20:>7.1f} MB | "
                  f"{(f'{ms / 1000:.2f} s' if ms is not None else 'no'):>11} | {wall - blank:>7.2f} s | {'yes' if ok else 'NO '} | "
                  f"{len(ov) / 2**20:>10.2f} MB | {(f'{oms / 1000:.2f} s' if oms is not None and not oerrors else 'no'):>11} | "
                  f"{owall - blank:>7.2f} s" + (f"  ({'; '.join(errors)[:120]})" if errors else ""), flush=True)
            path.unlink()
        server.shutdown()
    print(f"Chromium {headless.version()}; {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
