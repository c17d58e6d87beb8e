"""Our categorized snapshots in the real PyTorch memory viz (MemoryViz.js), headless, offline.

The page is the one `python -m memory_audit viz` writes (torch's own template). The test serves
it from localhost with ../shared's unchanged MemoryViz.js, and d3@5 from the npm registry
bundled into one ES module by esbuild (an import map points the viewer's five CDN imports at it).
Chromium loads it; a probe script reports page errors and the legend's categories.
"""

import json
import os
import re
import shutil

import pytest

import headless
from conftest import ROOT, skip_or_fail
from memory_audit.reading import viz

FOREIGN = os.path.join(ROOT, "..", "shared", "fixtures", "foreign_snapshots")

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
    why = headless.missing()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("viewer")
    why = headless.build_viewer(root)
    if why:
        skip_or_fail(why)
    server, url = headless.serve(root)
    yield root, url
    server.shutdown()


def open_in_viewer(viewer, page_html, name, shot=False):
    """Load the viz page offline in headless Chromium; returns the probe's dict."""
    root, url = viewer
    (root / f"{name}.html").write_text(headless.offline(page_html, PROBE, REPORT))
    shot_path = root / f"{name}.png" if shot else None
    dom, _, _ = headless.chromium(f"{url}/{name}.html", root / f"profile-{name}", budget_ms=20000, screenshot=shot_path)
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert m, f"no probe in the page: {dom[-500:]}"
    probe = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    if shot:
        probe["screenshot"] = str(shot_path)
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


# -- the overview page: any size, offline, predicted beside measured ---------------------------

def _page_data(path):
    text = open(path).read()
    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S)
    return text, json.loads(m.group(1))


def _offline_dom(page, profile):
    """The page's DOM after Chromium drew it from file:// with every other request failing."""
    if headless.CHROMIUM is None:
        skip_or_fail("chromium is not installed (.ci/run installs Debian's chromium)")
    dom, _, rc = headless.chromium(f"file://{page}", profile, budget_ms=5000, network=False)
    assert rc == 0 and 'data-drawn="yes"' in dom, dom[-800:]
    return dom


@pytest.mark.parametrize("run", ["cpu-tiny-fp32-manual", "cuda-tiny-fp16-manual"])
def test_overview_offline_with_the_predicted_step_beside(tmp_path, run):
    """`viz RUN` on a committed audit (CPU, CUDA) whose prediction left predicted.pickle: the
    overview page loads nothing from anywhere, draws both timelines with one legend, and its
    peaks are the audit's measured peak and the stored prediction's, to the byte."""
    from memory_audit.cli import main
    dst = tmp_path / run
    shutil.copytree(os.path.join(ROOT, "snapshots", "examples", run), dst)
    assert main(["viz", str(dst)]) == 0
    page = dst / "step2_end.overview.html"
    text, data = _page_data(page)
    # nothing to fetch, it works offline (the one URL is the SVG namespace, an identifier)
    assert set(re.findall(r"https?://[^'\"\s]+", text)) == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<script src|<link |<img |url\(", text)
    measured, predicted = data["timelines"]
    assert (measured["label"], predicted["label"]) == ("measured", "predicted")
    report = json.load(open(dst / "report.json"))
    assert measured["peak"]["bytes"] == report["totals"]["peak"]["actual"]
    assert predicted["peak"]["bytes"] == json.load(open(dst / "meta.json"))["prediction"]["totals"]["peak_allocated_bytes"]
    assert set(measured["phases"]) >= {"step2_start", "step2_before_backward"} <= set(predicted["phases"])
    dom = _offline_dom(page, tmp_path / "profile")
    legend = re.findall(r'<span class="legend-item"><span class="swatch"[^>]*></span>([^<]+)</span>', dom)
    assert legend == data["order"] and {"weights", "optimizer", "activations"} <= set(legend)
    for t in (measured, predicted):
        assert re.search(rf'id="peak-{t["label"]}"[^>]*>peak [0-9.]+ [KMG]iB<', dom), t["label"]
    assert dom.count("<polygon") >= 2 * 3  # each panel's categories stacked


@pytest.mark.parametrize("path", [os.path.join(ROOT, "snapshots", "examples", "cuda-tiny-fp16-manual", "step2_end.pickle"),
                                  os.path.join(ROOT, "snapshots", "examples", "cpu-tiny-fp32-manual", "step2_end.pickle"),
                                  os.path.join(FOREIGN, "bcrafton__assignment2-systems__memory_snapshot.pickle")],
                         ids=("cuda-audit", "cpu-audit", "foreign"))
def test_window_holds_what_was_live_at_its_start(path):
    """A window of the trace, replayed alone, has memory_allocated() at every entry equal to the
    whole trace's at the same entry: what was live at its start (made in the trace or before it,
    as a foreign snapshot's ring buffer leaves) is its first entries."""
    import numpy as np
    from memory_audit.reading.loader import load_meta, load_snapshot, normalize
    from memory_audit.reading.overview import window
    from memory_audit.reading.timeline import read_trace
    if not os.path.exists(path):
        skip_or_fail(f"{path} is not here")
    for _ in (0,):
        snap, meta = load_snapshot(path), load_meta(os.path.dirname(path))
        whole = read_trace(snap, meta)
        act, block = whole.trace.act, whole.block
        level = np.cumsum(np.where(act == 1, block, np.where(np.isin(act, (2, 4)), -block, 0)))
        baseline = sum(size for _, size, freed_at, _ in whole.pre)  # live before the trace, all of it
        for a, b in ((0, 300), (400, 900), (771, 773), (whole.trace.n - 50, whole.trace.n)):
            cut = window(snap, a, b, meta)
            win = read_trace(normalize(cut))
            wact, wblock = win.trace.act, win.block
            wlevel = np.r_[0, np.cumsum(np.where(wact == 1, wblock, np.where(np.isin(wact, (2, 4)), -wblock, 0)))]
            head = cut["memory_audit_window"]["live_at_start"]  # the allocations live at `a`, then the window's own
            assert int(wlevel[head]) == baseline + (level[a - 1] if a else 0), (a, b)
            # to the window's end, or (one that ends before the trace does) to its first allocation
            # live at the trace's end, whose block only the end table knows (window's docstring)
            kept = np.flatnonzero((act[a:b] == 1) & (whole.pair[a:b] < 0)) if b < whole.trace.n else []
            upto = b - a if not len(kept) else int(kept[0])
            assert (wlevel[head + 1:head + 1 + upto] == baseline + level[a:a + upto]).all(), (a, b)


def test_big_snapshot_gets_the_overview_and_a_window_the_real_viewer_opens(viewer, tmp_path, monkeypatch):
    """Above REAL_VIEWER_MAX_ENTRIES (lowered here to the committed example's size) `viz` writes
    the overview as the page and the span around the peak as a snapshot of its own, which
    MemoryViz opens and draws in our categories."""
    from memory_audit.cli import main
    monkeypatch.setattr(viz, "REAL_VIEWER_MAX_ENTRIES", 500)
    monkeypatch.setattr(viz, "WINDOW_ENTRIES", 300)
    dst = tmp_path / "run"
    shutil.copytree(os.path.join(ROOT, "snapshots", "examples", "cuda-tiny-fp16-manual"), dst)
    assert main(["viz", str(dst)]) == 0
    text, data = _page_data(dst / "step2_end.html")
    peak = data["timelines"][0]["peak"]["index"]
    a, b = max(0, peak - 150), max(0, peak - 150) + 300
    window_page = dst / f"step2_end.window-{a}-{b}.html"
    assert f'href="step2_end.window-{a}-{b}.html"' in text and (dst / f"step2_end.window-{a}-{b}.pickle").exists()
    _check(open_in_viewer(viewer, window_page.read_text(), "window"), ["weights", "optimizer", "workspace"])
    assert main(["viz", str(dst), "--window=10:20"]) == 0 and (dst / "step2_end.window-10-20.html").exists()
    assert main(["viz", str(dst), "--window=20:10"]) != 0  # one line, no page
    assert main(["viz", str(dst), "--window=0:501"]) != 0  # longer than the real viewer's limit
    # a window with no free (one alloc entry) still gives the viewer the 'unknown' it needs
    from memory_audit.reading.loader import load_snapshot
    trace = load_snapshot(str(dst / "step2_end.pickle"))["device_traces"][0]
    i = next(i for i in range(trace.n) if trace[i]["action"] == "alloc" and i > 100)
    assert main(["viz", str(dst), f"--window={i}:{i + 1}"]) == 0
    _check(open_in_viewer(viewer, (dst / f"step2_end.window-{i}-{i + 1}.html").read_text(), "window-alloc"), [])


def test_viz_of_the_predicted_file_and_of_another_device(tmp_path):
    """The predicted step given as a file inside its run is read as itself (not with the audit's
    meta.json); a snapshot whose trace is on device 1 (a rank's own GPU) is drawn from it."""
    import pickle
    from memory_audit.cli import main
    dst = tmp_path / "run"
    shutil.copytree(os.path.join(ROOT, "snapshots", "examples", "cpu-tiny-fp32-manual"), dst)
    assert main(["viz", str(dst / "predicted.pickle")]) == 0
    _, data = _page_data(dst / "predicted.overview.html")
    (t,) = data["timelines"]
    assert t["label"] == "predicted" and len(t["x"]) > 100 and t["peak"]["bytes"] > 0
    snap = pickle.load(open(os.path.join(ROOT, "snapshots", "examples", "cuda-tiny-fp16-manual", "step2_end.pickle"), "rb"))
    snap["device_traces"] = [[], snap["device_traces"][0]]
    for seg in snap["segments"]:
        seg["device"] = 1
    (tmp_path / "rank1.pickle").write_bytes(pickle.dumps(snap, protocol=4))
    assert main(["viz", str(tmp_path / "rank1.pickle")]) == 0
    _, data = _page_data(tmp_path / "rank1.overview.html")
    assert data["timelines"][0]["peak"]["bytes"] == 72_315_904  # the committed audit's measured peak
