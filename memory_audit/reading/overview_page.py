"""The overview page: one self-contained HTML file, drawn by its own script (no network, no
library), from overview()'s timelines: measured alone, or measured and predicted on the same axes.

With two timelines the x axis is the step, not the entry: each timeline's phases (step 2's
start, before backward, its end) sit at the same x, and the entries between two phases are
spread evenly, since a measured trace and a predicted one count different entries for the same
step. Both share the y axis and the colours.
"""

import html
import json

from ..schema import CATEGORIES

# one colour per category, in CATEGORIES' order (the page's own palette, shared by every panel)
PALETTE = ("#4e79a7", "#a0cbe8", "#f28e2b", "#ffbe7d", "#59a14f", "#e15759", "#ff9d9a", "#b07aa1",
           "#d4a6c8", "#9c755f", "#bab0ac", "#d7b5a6", "#8cd17d", "#f1ce63", "#79706e")
COLORS = dict(zip(CATEGORIES, PALETTE))

STYLE = """
body { font: 13px system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 18px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 18px 0 6px; }
.sub { color: #555; margin-bottom: 10px; }
#legend { display: flex; flex-wrap: wrap; gap: 4px 14px; margin: 8px 0; }
.legend-item { display: flex; align-items: center; gap: 5px; }
.swatch { width: 12px; height: 12px; display: inline-block; border: 1px solid #0003; }
svg { display: block; background: #fff; user-select: none; }
.panel-title { font-weight: 600; margin-top: 10px; }
#selection, #hover { min-height: 18px; color: #333; font-family: ui-monospace, monospace; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: left; }
td.num { text-align: right; font-family: ui-monospace, monospace; } td.stack { color: #555; font-size: 12px; }
"""

SCRIPT = r"""
const D = JSON.parse(document.getElementById('data').textContent);
const W = 1100, H = 280, L = 70, R = 20, T = 12, B = 26, NS = 'http://www.w3.org/2000/svg';
function fmt(b) { const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB']; let i = 0, v = Math.abs(b);
  while (v >= 1024 && i < 4) { v /= 1024; i++; } return (b < 0 ? '-' : '') + (i ? v.toFixed(2) : v) + ' ' + u[i]; }
function el(name, attrs, parent) { const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]); if (parent) parent.appendChild(e); return e; }
// x: each timeline's knots (its first point, the phases both have, its last) at shared fractions
const tls = D.timelines, first = tls[0];
const shared = ['step2_before_backward'].filter(p => tls.every(t => p in t.phases));
function knots(t) { return [t.x[0], ...shared.map(p => t.phases[p]), t.x[t.x.length - 1]]; }
const k0 = knots(first), span0 = (k0[k0.length - 1] - k0[0]) || 1;
const fr = k0.map(k => (k - k0[0]) / span0);
function toU(t, x) { const k = knots(t);
  for (let j = 1; j < k.length; j++) if (x <= k[j] || j === k.length - 1) {
    const a = k[j - 1], b = k[j]; return fr[j - 1] + (fr[j] - fr[j - 1]) * (b > a ? (x - a) / (b - a) : 0); } }
function fromU(t, u) { const k = knots(t);
  for (let j = 1; j < fr.length; j++) if (u <= fr[j] || j === fr.length - 1) {
    const a = fr[j - 1], b = fr[j]; return Math.round(k[j - 1] + (k[j] - k[j - 1]) * (b > a ? (u - a) / (b - a) : 0)); } }
const ymax = Math.max(1, ...tls.map(t => Math.max(0, ...t.reserved, ...t.allocated)));
const px = u => L + u * (W - L - R), py = v => H - B - (v / ymax) * (H - T - B);
function panel(t, other) {
  const box = document.createElement('div'); document.getElementById('panels').appendChild(box);
  const title = document.createElement('div'); title.className = 'panel-title';
  title.textContent = `${t.label}: peak ${fmt(t.peak.bytes)} at entry ${t.peak.index} of ${t.entries.toLocaleString()}`;
  box.appendChild(title);
  const svg = el('svg', {width: W, height: H, 'data-label': t.label}, box);
  for (let g = 0; g <= 4; g++) { const v = ymax * g / 4, y = py(v);
    el('line', {x1: L, x2: W - R, y1: y, y2: y, stroke: '#eee'}, svg);
    el('text', {x: L - 6, y: y + 4, 'text-anchor': 'end', 'font-size': 11}, svg).textContent = fmt(v); }
  const us = t.x.map(x => toU(t, x)), below = new Array(t.x.length).fill(0);
  for (const c of D.order) { const v = t.categories[c]; if (!v) continue;
    const top = below.map((b, i) => b + v[i]);
    const pts = us.map((u, i) => `${px(u).toFixed(1)},${py(top[i]).toFixed(1)}`)
      .concat(us.map((u, i) => `${px(u).toFixed(1)},${py(below[i]).toFixed(1)}`).reverse());
    el('polygon', {points: pts.join(' '), fill: D.colors[c], stroke: 'none', 'data-category': c}, svg);
    top.forEach((x, i) => below[i] = x); }
  const line = (ts, ys, attrs) => el('polyline', Object.assign({fill: 'none', points:
    ts.x.map((x, i) => `${px(toU(ts, x)).toFixed(1)},${py(ys[i]).toFixed(1)}`).join(' ')}, attrs), svg);
  if (t.reserved.length) line(t, t.reserved, {stroke: '#555', 'stroke-dasharray': '4 3', 'stroke-width': 1});
  line(t, t.allocated, {stroke: '#000', 'stroke-width': 1});
  if (other) line(other, other.allocated, {stroke: '#c00', 'stroke-dasharray': '6 3', 'stroke-width': 1.5});
  for (const p in t.phases) { const x = px(toU(t, t.phases[p]));
    el('line', {x1: x, x2: x, y1: T, y2: H - B, stroke: '#888', 'stroke-dasharray': '2 2'}, svg);
    const right = x > W - R - 120;  // a label near the right edge ends at its line
    el('text', {x: right ? x - 3 : x + 3, y: H - 8, 'font-size': 11, fill: '#555', 'text-anchor': right ? 'end' : 'start'},
       svg).textContent = p; }
  if (t.peak.index !== null) { const x = px(toU(t, t.peak.index)), y = py(t.peak.bytes);
    el('circle', {cx: x, cy: y, r: 4, fill: '#c00'}, svg);
    el('text', {x: x + 6, y: Math.max(y - 6, T + 10), 'font-size': 12, fill: '#c00', id: 'peak-' + t.label},
       svg).textContent = 'peak ' + fmt(t.peak.bytes); }
  const sel = el('rect', {y: T, height: H - T - B, fill: '#1f77b433', visibility: 'hidden'}, svg);
  let down = null; const uAt = ev => Math.min(1, Math.max(0, (ev.offsetX - L) / (W - L - R)));
  svg.addEventListener('mousedown', ev => { down = uAt(ev); });
  svg.addEventListener('mousemove', ev => { const u = uAt(ev), x = fromU(t, u);
    let i = 0; while (i < t.x.length - 1 && t.x[i + 1] <= x) i++;
    const cats = D.order.filter(c => t.categories[c] && t.categories[c][i]).map(c => `${c} ${fmt(t.categories[c][i])}`);
    document.getElementById('hover').textContent = `${t.label} entry ${t.x[i]}: allocated ${fmt(t.allocated[i])}` +
      (t.reserved.length ? `, reserved ${fmt(t.reserved[i])}` : '') + '; ' + cats.join(', ');
    if (down !== null) { const a = Math.min(down, u), b = Math.max(down, u);
      sel.setAttribute('x', px(a)); sel.setAttribute('width', px(b) - px(a)); sel.setAttribute('visibility', 'visible'); } });
  svg.addEventListener('mouseup', ev => { if (down === null) return; const u = uAt(ev);
    const a = fromU(t, Math.min(down, u)), b = Math.min(t.entries, Math.max(fromU(t, Math.max(down, u)) + 1, a + 1));
    down = null;  // [a, b): the last entry included when the drag reaches the end
    document.getElementById('selection').textContent = t.file ? `entries ${a} to ${b} (${b - a} entries) in MemoryViz: ` +
      `python -m memory_audit viz ${t.file} --window=${a}:${b}` : `entries ${a} to ${b} of the predicted step`; });
}
tls.forEach((t, i) => panel(t, tls.length > 1 ? tls[1 - i] : null));
const legend = document.getElementById('legend');
for (const c of D.order) { const it = document.createElement('span'); it.className = 'legend-item';
  it.innerHTML = `<span class="swatch" style="background:${D.colors[c]}"></span>`;
  it.appendChild(document.createTextNode(c)); legend.appendChild(it); }
const body = document.querySelector('#largest tbody');
for (const a of first.peak.largest || []) { const tr = document.createElement('tr');
  tr.innerHTML = `<td></td><td class="num">${a.bytes.toLocaleString()}</td><td class="num">${(a.bytes / 1048576).toFixed(2)}</td><td class="stack"></td>`;
  tr.children[0].textContent = a.name; tr.children[3].textContent = a.frames.slice(0, 4).join(' \u2190 ');
  tr.children[3].title = a.frames.join('\n'); body.appendChild(tr); }
document.body.setAttribute('data-drawn', 'yes');
"""

PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>%(title)s</title><style>%(style)s</style></head>
<body>
<h1>%(title)s</h1>
<div class="sub">%(subtitle)s</div>
<div id="legend"></div>
<div class="sub">Bytes live per category (stacked), memory_allocated (black), reserved (grey, dashed)%(other)s.
Drag across a plot to choose entries to open in PyTorch's MemoryViz.</div>
<div id="panels"></div>
<div id="hover"></div>
<div id="selection"></div>
%(windows)s
<h2>Largest allocations live at the %(first)s peak</h2>
<table id="largest"><thead><tr><th>name</th><th>bytes</th><th>MiB</th><th>stack (innermost first)</th></tr></thead>
<tbody></tbody></table>
<script type="application/json" id="data">%(data)s</script>
<script>%(script)s</script>
</body></html>
"""


def page(timelines, title, subtitle="", windows=()):
    """The page for overview() dicts, each with its `label` (and `file`: the snapshot a window
    command reads); windows: [(label, href)] already written."""
    order = [c for c in CATEGORIES if any(c in t["categories"] for t in timelines)]
    data = {"timelines": timelines, "order": order, "colors": {c: COLORS[c] for c in order}}
    links = "".join(f'<li><a href="{html.escape(href)}">{html.escape(label)}</a></li>' for label, href in windows)
    return PAGE % {
        "title": html.escape(title), "subtitle": html.escape(subtitle), "style": STYLE, "script": SCRIPT,
        "other": "; each panel also draws the other's memory_allocated (red, dashed)" if len(timelines) > 1 else "",
        "windows": f"<h2>Opened in MemoryViz</h2><ul>{links}</ul>" if links else "",
        "first": html.escape(timelines[0]["label"]),
        # </script> cannot end the data early: '<' is escaped inside the JSON
        "data": json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")}
