"""Our categorized snapshots in the real PyTorch memory viz (MemoryViz.js), headless, offline.

The page is the one `python -m memory_audit viz` writes (torch's own template). The test serves
it from localhost with ../shared's unchanged MemoryViz.js, and d3@5 from the npm registry
bundled into one ES module by esbuild (an import map points the viewer's five CDN imports at it).
Chromium loads it; a probe script reports page errors and the legend's categories.
"""

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import threading

import pytest

from conftest import ROOT, skip_or_fail
from memory_audit.reading import viz

VENDOR = os.path.join(ROOT, "..", "shared", "vendor", "pytorch_memory_viz")
FOREIGN = os.path.join(ROOT, "..", "shared", "fixtures", "foreign_snapshots")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CDN = ("https://cdn.skypack.dev/d3@5", "https://cdn.skypack.dev/d3-axis@1", "https://cdn.skypack.dev/d3-scale@1",
       "https://cdn.skypack.dev/d3-zoom@1", "https://cdn.skypack.dev/d3-brush@1")

PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e)));
window.addEventListener('unhandledrejection', e => window.__errors.push('rejection: ' + String(e.reason)));
const __ce = console.error; console.error = (...a) => { window.__errors.push(a.join(' ')); __ce(...a); };
</script>"""
REPORT = """<script type="module">
setTimeout(() => {
  const pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify({errors: window.__errors,
    texts: Array.from(document.querySelectorAll('svg text')).map(t => t.textContent),
    drawn: document.querySelectorAll('svg *').length});
  document.body.appendChild(pre);
}, 3000);
</script>"""


@pytest.fixture(scope="module")
def viewer(tmp_path_factory):
    """A folder served on localhost with MemoryViz.js and d3.bundle.js; yields (folder, url)."""
    if not CHROMIUM:
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    if not os.path.exists(os.path.join(VENDOR, "MemoryViz.js")):
        pytest.skip("../shared/vendor/pytorch_memory_viz is not here")
    npm = shutil.which("npm")
    if not npm:
        pytest.skip("npm is not installed: d3 comes from the npm registry")
    root = tmp_path_factory.mktemp("viewer")
    build = root / "build"
    build.mkdir()
    (build / "package.json").write_text('{"private": true}')
    (build / "entry.js").write_text('export * from "d3";\n')
    p = subprocess.run([npm, "install", "--silent", "--no-audit", "--no-fund", "d3@5", "esbuild@0.24"],
                       cwd=build, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        skip_or_fail(f"npm could not install d3@5 and esbuild: {p.stderr.strip()[-300:]}")
    subprocess.run([str(build / "node_modules" / ".bin" / "esbuild"), "entry.js", "--bundle", "--format=esm",
                    f"--outfile={root / 'd3.bundle.js'}"], cwd=build, check=True, capture_output=True, timeout=120)
    shutil.copy(os.path.join(VENDOR, "MemoryViz.js"), root / "MemoryViz.js")
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def open_in_viewer(viewer, page_html, name, shot=False):
    """Load the viz page offline in headless Chromium; returns the probe's dict."""
    root, url = viewer
    assert viz.VIEWER_URL in page_html  # torch's template, as `viz` writes it
    imports = {u: "/d3.bundle.js" for u in CDN}
    head = f'<script type="importmap">{json.dumps({"imports": imports})}</script>' + PROBE
    page = page_html.replace(viz.VIEWER_URL, "/MemoryViz.js").replace("<head>", "<head>" + head, 1)
    page = page.replace("</body>", REPORT + "</body>", 1)
    (root / f"{name}.html").write_text(page)
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              f"--user-data-dir={root}/profile-{name}", "--virtual-time-budget=20000", "--window-size=1400,900"]
    p = subprocess.run(common + ["--dump-dom", f"{url}/{name}.html"], capture_output=True, text=True, timeout=180)
    m = re.search(r'<pre id="probe">(.*?)</pre>', p.stdout, re.S)
    assert m, f"no probe in the page: {p.stdout[-500:]} {p.stderr[-500:]}"
    probe = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    if shot:
        subprocess.run(common + [f"--screenshot={root / name}.png", f"{url}/{name}.html"], capture_output=True,
                       timeout=180)
        probe["screenshot"] = str(root / f"{name}.png")
    return probe


def _check(probe, categories):
    assert probe["errors"] == [], probe["errors"]
    assert probe["drawn"] > 50  # the plot, its axes and legend were drawn
    counts = {c: probe["texts"].count(c) for c in categories}
    assert all(n == 1 for n in counts.values()), (counts, sorted(set(probe["texts"]))[:40])  # one legend entry each


def test_fresh_cpu_audit_in_the_real_viewer(viewer, cpu_run):
    page = viz.html(viz.categorized(os.path.join(cpu_run, "step2_end.pickle"),
                                    json.load(open(os.path.join(cpu_run, "meta.json")))))
    probe = open_in_viewer(viewer, page, "cpu", shot=True)
    _check(probe, ["weights", "optimizer", "activations", "inputs", "temporary", "grads"])
    assert os.path.getsize(probe["screenshot"]) > 20000
    shutil.copy(probe["screenshot"], os.path.join(cpu_run, "memory_viz.png"))  # to look at


def test_committed_cuda_example_in_the_real_viewer(viewer, tmp_path):
    from memory_audit.cli import main
    run = os.path.join(ROOT, "snapshots", "examples", "cuda-tiny-fp16-manual")
    out = tmp_path / "cuda.html"
    assert main(["viz", run, "--out", str(out)]) == 0  # the command users run, its HTML as written
    _check(open_in_viewer(viewer, out.read_text(), "cuda"), ["weights", "grads", "optimizer", "activations",
                                                              "workspace"])


def test_foreign_snapshot_in_the_real_viewer(viewer):
    path = os.path.join(FOREIGN, "bcrafton__assignment2-systems__memory_snapshot.pickle")
    if not os.path.exists(path):
        pytest.skip("../shared/fixtures/foreign_snapshots is not here")
    # named from its stacks (the optimizer's state made in step) and its trace (temporaries); the
    # blocks older than the recording the viewer draws as 'unknown' (it reads no category on them)
    _check(open_in_viewer(viewer, viz.html(viz.categorized(path)), "foreign"), ["optimizer", "temporary"])


@pytest.mark.parametrize("gpu, dtype", [("cpu", "float32"), ("H100", "float16")])
def test_predicted_step_in_the_real_viewer(viewer, tmp_path, gpu, dtype):
    """predict --trace's snapshot (the shadow run's step; on a GPU the whole process through the
    allocator's model, segments included) opens in MemoryViz like a measured one."""
    from memory_audit.cli import main
    out = tmp_path / "predicted.pickle"
    assert main(["predict", f"--gpu={gpu}", "--preset=cpu-tiny", "--batch_size=2", f"--dtype={dtype}",
                 f"--trace={out}"]) == 0
    assert main(["viz", str(out), "--out", str(tmp_path / "predicted.html")]) == 0
    _check(open_in_viewer(viewer, (tmp_path / "predicted.html").read_text(), f"predicted-{gpu}"),
           ["weights", "optimizer", "activations", "inputs", "temporary"] + (["workspace"] if gpu != "cpu" else []))


@pytest.mark.parametrize("gpu, dtype", [("cpu", "float32"), ("H100", "float16")])
def test_predicted_pickle_opens_in_the_real_viewer_as_a_file(viewer, tmp_path, gpu, dtype):
    """The file predict --trace writes, dropped into MemoryViz as it is (no `viz` in between):
    the viewer loads it without an error and draws its categories."""
    import pickle

    from memory_audit.cli import main
    out = tmp_path / "predicted.pickle"
    assert main(["predict", f"--gpu={gpu}", "--preset=cpu-tiny", "--batch_size=2", f"--dtype={dtype}",
                 f"--trace={out}"]) == 0
    with open(out, "rb") as f:
        snap = pickle.load(f)
    _check(open_in_viewer(viewer, viz.html(snap), f"predicted-file-{gpu}"),
           ["weights", "optimizer", "activations", "inputs", "temporary"])
