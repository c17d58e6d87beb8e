"""Headless Chromium for the viz pages, offline: what tests/test_memory_viz.py and
benchmarks/bench_viz.py share.

build_viewer(root) puts ../shared's unchanged MemoryViz.js in `root` with d3@5 from the npm
registry bundled into one ES module by esbuild; offline() rewrites a page torch's template wrote
so that its CDN imports point there (an import map); serve(root) serves the folder on
localhost; chromium() loads a page and returns what it dumped of the DOM and its wall time.
"""

import functools
import http.server
import json
import os
import shutil
import subprocess
import threading
import time

from memory_audit.reading.viz import VIEWER_URL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENDOR = os.path.join(ROOT, "..", "shared", "vendor", "pytorch_memory_viz")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CDN = ("https://cdn.skypack.dev/d3@5", "https://cdn.skypack.dev/d3-axis@1", "https://cdn.skypack.dev/d3-scale@1",
       "https://cdn.skypack.dev/d3-zoom@1", "https://cdn.skypack.dev/d3-brush@1")


def missing():
    """Why the real viewer cannot be served here (None: it can)."""
    if not CHROMIUM:
        return "chromium is not installed (.ci/run installs Debian's chromium)"
    if not os.path.exists(os.path.join(VENDOR, "MemoryViz.js")):
        return "../shared/vendor/pytorch_memory_viz is not here"
    if not shutil.which("npm"):
        return "npm is not installed: d3 comes from the npm registry"
    return None


def build_viewer(root):
    """MemoryViz.js and d3.bundle.js in `root` (a pathlib.Path). Returns None, or why not."""
    build = root / "build"
    build.mkdir(exist_ok=True)
    (build / "package.json").write_text('{"private": true}')
    (build / "entry.js").write_text('export * from "d3";\n')
    p = subprocess.run([shutil.which("npm"), "install", "--silent", "--no-audit", "--no-fund", "d3@5", "esbuild@0.24"],
                       cwd=build, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return f"npm could not install d3@5 and esbuild: {p.stderr.strip()[-300:]}"
    subprocess.run([str(build / "node_modules" / ".bin" / "esbuild"), "entry.js", "--bundle", "--format=esm",
                    f"--outfile={root / 'd3.bundle.js'}"], cwd=build, check=True, capture_output=True, timeout=120)
    shutil.copy(os.path.join(VENDOR, "MemoryViz.js"), root / "MemoryViz.js")
    return None


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(root):
    """(server, url) of a localhost server for `root`; call server.shutdown() when done."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def offline(page_html, head="", tail=""):
    """A page torch's template wrote, with MemoryViz.js and d3 taken from the served folder;
    `head` goes first in <head>, `tail` last in <body>."""
    assert VIEWER_URL in page_html  # torch's template, as `viz` writes it
    imports = {u: "/d3.bundle.js" for u in CDN}
    head = f'<script type="importmap">{json.dumps({"imports": imports})}</script>' + head
    page = page_html.replace(VIEWER_URL, "/MemoryViz.js").replace("<head>", "<head>" + head, 1)
    return page.replace("</body>", tail + "</body>", 1)


def chromium(url, profile, timeout=180, budget_ms=None, screenshot=None, network=True):
    """(DOM as dumped after the page loaded, wall seconds, exit status) of headless Chromium on
    `url`. budget_ms: virtual time to let timers run; network=False: every request but
    localhost and file:// fails (a page that works offline loads nothing else)."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--window-size=1400,900"]
    if budget_ms:
        args.append(f"--virtual-time-budget={budget_ms}")
    if not network:  # no proxy can be reached: any request off this machine fails
        args += ["--proxy-server=127.0.0.1:9"]  # (loopback bypasses a proxy)
    t0 = time.perf_counter()
    p = subprocess.run(args + ["--dump-dom", url], capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if screenshot:
        subprocess.run(args + [f"--screenshot={screenshot}", url], capture_output=True, timeout=timeout)
    return p.stdout, wall, p.returncode


def version():
    """Chromium's version line ('Chromium 131.0.6778.85 ...')."""
    return subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
