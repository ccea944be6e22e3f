"""``Lowered.report("plan.html")``: one self-contained HTML page of a plan (inline CSS and
SVG, no script from anywhere, nothing fetched): the program with each eqn's split and
cost, the timeline of the predicted schedule (kernels and transfers) twice at one time
scale, eqn by eqn per device and GPU by GPU as ranks run it, the bytes each device sends
each other as a heat map, each device's live memory over time, and, given ``compare``, the
strategies' predicted times side by side.

Every figure the page draws is also in a JSON data island
(``<script type="application/json" id="eins-data">``): ``plan_table`` and
``predicted_time`` exactly as the Lowered returns them, the schedule's events and its
GPU-by-GPU ``timeline``, the link bytes, the memory series and the comparison, so tools
(and the tests) read the page's numbers back without parsing the drawing."""
from __future__ import annotations

import html
import json

from eins.errors import EinsError
from eins.ir.text import format_bytes, format_seconds
from eins.report.schedule import Schedule, predicted_schedule
from eins.report.trace import write_text

__all__ = ["report_html", "write_report", "page_data"]

WIDTH = 960          # drawing width of the timeline and the memory plot, px
LABEL = 110          # the label column, px
ROW = 18             # one timeline row, px

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:14px 0 4px}
table{border-collapse:collapse;font-size:12px}td,th{padding:2px 8px;text-align:right;
border-bottom:1px solid #eee}td.l,th.l{text-align:left}code{font-size:12px}
.note{color:#666;font-size:12px}svg text{font:11px system-ui,sans-serif;fill:#333}
"""


def _jsonable(v):
    """JSON-ready copies (tuples as lists, int dict keys as strings: json's own rules)."""
    return json.loads(json.dumps(v, default=str))


def page_data(low, compare=None, sched: Schedule | None = None) -> dict:
    """What the page shows, as JSON-ready data (the data island)."""
    sched = sched or predicted_schedule(low.physical)
    t = low.predicted_time()
    rows = _compare_rows(compare)
    if rows:   # the page's own plan first
        rows = {**_compare_rows({f"{low.plan.selector} (this plan)": low}), **rows}
    return {
        "program": low.program.name, "devices": list(low.devices),
        "topology": t.get("topology"), "selector": low.plan.selector,
        "minimized": low.plan.minimized, "cost_s": low.plan.cost_s,
        "cost_bytes": low.plan.cost_bytes,
        "plan_table": _jsonable(low.plan_table()),
        "predicted_time": _jsonable(dict(t)),
        "schedule": {"total_s": sched.total_s, "events": _events(sched.events),
                     "timeline": {"end_s": sched.timeline_s,
                                  "gpus": {str(g): ds for g, ds in sched.gpus.items()},
                                  "events": _events(sched.timeline)}},
        "link_bytes": [[s, d, b] for (s, d), b in sorted(sched.link_bytes.items())],
        "memory": {str(d): [[tt, b] for tt, b in pts] for d, pts in sched.memory.items()},
        "compare": _jsonable(rows),
    }


def _events(events) -> list:
    return [{"kind": e.kind, "name": e.name, "eqn": e.eqn, "start_s": e.start_s,
             "dur_s": e.dur_s, "devices": list(e.devices), "bytes": e.nbytes}
            for e in events]


SUMMARY_KEYS = ("total_ms", "compute_ms", "exchange_ms")


def _compare_rows(compare) -> dict:
    """{name: {total_ms, compute_ms, exchange_ms, peak_bytes} or {error}} from a dict of
    such summaries or of Lowered objects (their ``predicted_time()``)."""
    if compare is None:
        return {}
    if not isinstance(compare, dict):
        raise EinsError(f"compare must be a dict {{name: Lowered or {{total_ms, compute_ms, "
                        f"exchange_ms}}}}, got {type(compare).__name__} {compare!r:.80}")
    out = {}
    for name, v in compare.items():
        if hasattr(v, "predicted_time"):
            t = v.predicted_time()
            v = {"total_ms": t["total_ms"], "compute_ms": t["compute_ms"],
                 "exchange_ms": t["exchange_ms"], "peak_bytes": max(t["peak_bytes"].values())}
        elif not isinstance(v, dict) or not ("error" in v or all(
                isinstance(v.get(k), (int, float)) for k in SUMMARY_KEYS)):
            raise EinsError(f"compare[{name!r}] must be a Lowered or a dict with numbers "
                            f"{list(SUMMARY_KEYS)} (or an 'error'), got {v!r:.80}")
        out[str(name)] = dict(v)
    return out


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _color(eqn: int) -> str:
    return f"hsl({(eqn * 47) % 360},55%,62%)"


def _program_table(low, data) -> str:
    lines = low.program.pretty().splitlines()[1:-1]
    per = {r["eqn"]: r for r in data["predicted_time"].get("per_eqn", [])}
    rows = ["<tr><th>eqn</th><th class=l>traced IR</th><th class=l>split</th>"
            "<th>out blocks</th><th>⊕ m</th><th>planned</th><th>kernel</th>"
            "<th>exchanges</th><th>gathers</th><th>proxy</th></tr>"]
    for r, line in zip(data["plan_table"], lines):
        split = " ".join(f"{k}/{v}" for k, v in r["splits"].items()) or "whole"
        p = per.get(r["eqn"], {})
        secs = "-" if r["seconds"] is None else format_seconds(r["seconds"])
        rows.append(
            f"<tr id=eqn{r['eqn']}><td>{r['eqn']}</td><td class=l><code>{_e(line.strip())}"
            f"</code></td><td class=l>{_e(split)}</td><td>"
            f"{_e('x'.join(map(str, r['out_tiling'])) or '1')}</td><td>{r['agg']}</td>"
            f"<td>{secs}</td><td>{p.get('compute_ms', 0):.4g} ms</td>"
            f"<td>{p.get('exchange_ms', 0):.4g} ms</td><td>{p.get('gather_ms', 0):.4g} ms</td>"
            f"<td>{format_bytes(r['cost_bytes'])}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def _summary(data) -> str:
    t = data["predicted_time"]
    peaks = t.get("peak_bytes", {})
    rows = [("compute", f"{t['compute_ms']:.4f} ms"),
            ("exchanges", f"{t['exchange_ms']:.4f} ms (output gathers "
                          f"{t.get('gather_ms', 0):.4f} ms)"),
            ("total, eqn by eqn", f"{t['total_ms']:.4f} ms"),
            ("GPU by GPU", f"{t['timeline_ms']:.4f} ms (no barrier per "
                           f"eqn, as ranks run it)"),
            ("peak memory", f"{format_bytes(max(peaks.values(), default=0))} per device, "
                            f"{'fits' if t.get('fits') else 'does NOT fit'}")]
    if data["cost_s"] is not None:
        rows.append(("plan's time cost", format_seconds(data["cost_s"])))
    rows.append(("proxy", format_bytes(data["cost_bytes"])))
    return "<table>" + "".join(f"<tr><th class=l>{a}</th><td class=l>{_e(b)}</td></tr>"
                               for a, b in rows) + "</table>"


def _rows(rows, spans, total, label) -> str:
    """An SVG of timeline rows: ``rows`` [(name, hover title or None)], ``spans``
    [(row indices, start s, seconds, fill, hover title)], ``total`` seconds drawn as
    WIDTH px (the two timelines share it, so each is as long as its time)."""
    scale = WIDTH / (total or 1e-30)
    h = ROW * len(rows) + 24
    out = [f'<svg width="{LABEL + WIDTH + 10}" height="{h}" role="img" '
           f'aria-label="{_e(label)}">']
    for k, (name, title) in enumerate(rows):
        y = k * ROW
        tip = f"<title>{_e(title)}</title>" if title else ""
        out.append(f'<text x="4" y="{y + ROW - 5}">{_e(name)}{tip}</text>'
                   f'<line x1="{LABEL}" x2="{LABEL + WIDTH}" y1="{y + ROW}" y2="{y + ROW}" '
                   f'stroke="#eee"/>')
    for ks, start, dur, fill, tip in spans:
        x, w = LABEL + start * scale, max(dur * scale, 0.5)
        for k in ks:
            out.append(f'<rect x="{x:.2f}" y="{k * ROW + 2}" width="{w:.2f}" '
                       f'height="{ROW - 4}" fill="{fill}"><title>{_e(tip)}</title></rect>')
    for k in range(5):
        x = LABEL + WIDTH * k / 4
        out.append(f'<text x="{x:.1f}" y="{h - 6}" text-anchor="middle">'
                   f'{format_seconds(total * k / 4)}</text>')
    out.append("</svg>")
    return "".join(out)


def _tip(ev) -> str:
    return (f"{ev['name']}: {format_seconds(ev['dur_s'])}" +
            (f", {format_bytes(ev['bytes'])}" if ev["bytes"] else ""))


def _fill(ev) -> str:
    """Kernels one color per eqn, exchanges black, output gathers purple."""
    if ev["kind"] in ("compute", "kernel"):
        return _color(ev["eqn"])
    return "#222" if ev["kind"] == "exchange" else "#8e44ad"


def _scale_s(data) -> float:
    """The seconds both timelines draw as WIDTH: the longer one's (the eqn-by-eqn sum is
    never below the GPU-by-GPU time)."""
    s = data["schedule"]
    return max(s["total_s"], s["timeline"]["end_s"])


def _timeline(data) -> str:
    """Eqn by eqn: each eqn's slowest kernel and every exchange (the total), then each
    device's kernels and the exchanges it is in."""
    devs = data["devices"]
    row_of = {d: 2 + k for k, d in enumerate(devs)}
    rows = [("eqns", None), ("exchanges", None)] + [(f"device {d}", None) for d in devs]
    spans = []
    for ev in data["schedule"]["events"]:
        if ev["kind"] == "compute":
            ks = [0]
        elif ev["kind"] == "kernel":
            ks = [row_of[ev["devices"][0]]]
        else:
            ks = [1] + [row_of[d] for d in ev["devices"] if d in row_of]
        spans.append((ks, ev["start_s"], ev["dur_s"], _fill(ev), _tip(ev)))
    return _rows(rows, spans, _scale_s(data), "predicted schedule, eqn by eqn")


def _gpu_timeline(data) -> str:
    """GPU by GPU: one row per GPU, its kernels and the exchanges holding it."""
    line = data["schedule"]["timeline"]
    on = {int(g): ds for g, ds in line["gpus"].items()}
    gpus = sorted(set(on) | {g for ev in line["events"] for g in ev["devices"]})
    row_of = {g: k for k, g in enumerate(gpus)}
    rows = [(f"GPU {g}", "devices " + ", ".join(map(str, on[g])) if g in on else None)
            for g in gpus]
    spans = [([row_of[g] for g in ev["devices"]], ev["start_s"], ev["dur_s"], _fill(ev),
              _tip(ev)) for ev in line["events"]]
    return _rows(rows, spans, _scale_s(data), "predicted schedule, GPU by GPU")


def _ends(data) -> str:
    """The two timelines' ends, and why they differ."""
    total = data["predicted_time"]["total_ms"]
    line = data["predicted_time"]["timeline_ms"]
    why = ("the same to the microsecond: no GPU runs ahead of an eqn's slowest one by more"
           if f"{line:.3f}" == f"{total:.3f}" else
           f"{(1 - line / total) * 100:.1f}% sooner GPU by GPU: a GPU runs its next kernel "
           f"without waiting for the eqn's slowest GPU, and waits only for the exchanges it "
           f"is in")
    return (f"<p id=ends>Ends: eqn by eqn <b>{total:.3f} ms</b>, GPU by GPU "
            f"<b>{line:.3f} ms</b> ({_e(why)}).</p>")


def _heatmap(data) -> str:
    devs = data["devices"]
    n = len(devs)
    cell = max(6, min(28, 480 // max(n, 1)))
    pos = {d: k for k, d in enumerate(devs)}
    most = max((b for _, _, b in data["link_bytes"]), default=0)
    size = LABEL + cell * n + 10
    out = [f'<svg width="{size}" height="{size}" role="img" aria-label="bytes per link">',
           f'<text x="4" y="12">src \\ dst</text>']
    for d, k in pos.items():
        if n <= 32 or k % 8 == 0:
            out.append(f'<text x="{LABEL + k * cell + cell / 2}" y="{LABEL - 6}" '
                       f'text-anchor="middle">{d}</text>'
                       f'<text x="{LABEL - 6}" y="{LABEL + k * cell + cell * 0.7}" '
                       f'text-anchor="end">{d}</text>')
    sent = {(s, d): b for s, d, b in data["link_bytes"]}
    for s in devs:
        for d in devs:
            b = sent.get((s, d), 0)
            shade = 0 if not most else b / most
            fill = f"rgba(31,78,160,{shade:.3f})" if b else "#fafafa"
            out.append(f'<rect x="{LABEL + pos[d] * cell}" y="{LABEL + pos[s] * cell}" '
                       f'width="{cell - 1}" height="{cell - 1}" fill="{fill}">'
                       f'<title>{s} -&gt; {d}: {format_bytes(b)}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def _memory(data) -> str:
    mem = data["memory"]
    total = data["schedule"]["total_s"] or 1e-30
    most = max((b for pts in mem.values() for _, b in pts), default=0) or 1
    H = 200
    out = [f'<svg width="{LABEL + WIDTH + 10}" height="{H + 30}" role="img" '
           f'aria-label="memory per device">',
           f'<text x="4" y="14">{format_bytes(most)}</text>'
           f'<text x="4" y="{H}">0</text>']
    for k, (d, pts) in enumerate(mem.items()):
        path, last = [], 0
        for t, b in pts:
            x = LABEL + t / total * WIDTH
            path.append(f"{x:.1f},{H - last / most * (H - 10):.1f}")
            path.append(f"{x:.1f},{H - b / most * (H - 10):.1f}")
            last = b
        color = f"hsl({(k * 360 / max(len(mem), 1)):.0f},60%,45%)"
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                   f'points="{" ".join(path)}"><title>device {d}: peak '
                   f'{format_bytes(max(b for _, b in pts))}</title></polyline>')
    out.append(f'<text x="{LABEL}" y="{H + 20}">0</text><text x="{LABEL + WIDTH}" '
               f'y="{H + 20}" text-anchor="end">{format_seconds(total)}</text></svg>')
    return "".join(out)


def _compare(data) -> str:
    rows = data["compare"]
    if not rows:
        return ""
    ok = {k: v for k, v in rows.items() if "total_ms" in v}
    most = max((v["total_ms"] for v in ok.values()), default=0) or 1
    left = max(LABEL, 8 + 7 * max(len(k) for k in rows))   # ~7 px per character
    out = [f'<svg width="{left + WIDTH + 10}" height="{ROW * 1.5 * len(rows) + 10}" '
           f'role="img" aria-label="strategies">']
    for k, (name, v) in enumerate(rows.items()):
        y = k * ROW * 1.5
        out.append(f'<text x="4" y="{y + ROW - 4}">{_e(name)}</text>')
        if "total_ms" not in v:
            out.append(f'<text x="{left}" y="{y + ROW - 4}">{_e(v.get("error", "?"))}</text>')
            continue
        wc = v["compute_ms"] / most * (WIDTH - 120)
        wx = v["exchange_ms"] / most * (WIDTH - 120)
        out.append(f'<rect x="{left}" y="{y + 2}" width="{wc:.1f}" height="{ROW - 2}" '
                   f'fill="#5b8def"><title>compute {v["compute_ms"]:.4f} ms</title></rect>'
                   f'<rect x="{left + wc:.1f}" y="{y + 2}" width="{wx:.1f}" '
                   f'height="{ROW - 2}" fill="#222"><title>exchanges '
                   f'{v["exchange_ms"]:.4f} ms</title></rect>'
                   f'<text x="{left + wc + wx + 6:.1f}" y="{y + ROW - 4}">'
                   f'{v["total_ms"]:.4f} ms</text>')
    out.append("</svg>")
    return ("<h2>Strategies compared</h2><p class=note>predicted time of each plan: kernels "
            "(blue) and exchanges (black)</p>" + "".join(out))


def report_html(low, compare=None) -> str:
    """The page (a str)."""
    data = page_data(low, compare)
    island = json.dumps(data).replace("</", "<\\/")   # a "</script>" in a name ends nothing
    title = f"eins plan: {data['program']} on {len(data['devices'])} devices"
    head = (f"{data['selector']} minimizing {data['minimized']}" if data["minimized"]
            else data["selector"])
    return "".join([
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1><p class=note>topology {_e(data['topology'])}; plan by "
        f"{_e(head)}. Times are predicted (kernel model + simulated exchanges; eqns one "
        f"after another, and GPU by GPU), not measured.</p>",
        "<h2>Predicted</h2>", _summary(data),
        "<h2>Program and splits</h2>", _program_table(low, data),
        "<h2>Timeline</h2>", _ends(data),
        "<h3>Eqn by eqn</h3><p class=note>every eqn ends in a barrier (the paper's sum); per "
        "device: kernels (one color per eqn) and the exchanges it sends or receives in "
        "(black; output gathers purple); the top rows are each eqn's slowest kernel and every "
        "exchange, which add up to the total. Hover for names and times.</p>",
        _timeline(data),
        "<h3>GPU by GPU</h3><p class=note>the same kernels and exchanges as the ranks run "
        "them, at the same time scale: each GPU its kernels one after another, an exchange "
        "holding only the GPUs in it from when the last of them is free.</p>",
        _gpu_timeline(data),
        "<h2>Bytes per link</h2><p class=note>bytes each device (row) sends each other "
        f"(column) in one run of the program; the darkest cell is "
        f"{format_bytes(max((b for _, _, b in data['link_bytes']), default=0))}.</p>",
        _heatmap(data),
        "<h2>Memory per device</h2><p class=note>live bytes over the schedule, one line per "
        "device (devices with equal memory draw over each other); the highest point is the "
        "predicted peak.</p>", _memory(data),
        _compare(data),
        f'<script type="application/json" id="eins-data">{island}</script>',
        "</body></html>\n"])


def write_report(low, path, compare=None) -> str:
    """Write the page to ``path``; returns the path."""
    return write_text(path, report_html(low, compare), "report")
