"""Plans that explain themselves (eins/report): ``Lowered.explain`` re-costs every other spec
of an eqn with the planner's own time model and its figures add up to the plan's; the HTML
page's figures are ``plan_table()`` and ``predicted_time()``; the trace is trace-event JSON
whose spans add up to the prediction."""
import html
import json
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import eins
from eins.cli import main
from eins.cost.proxy import plan_costs
from eins.cost.timecost import TimeModel, plan_seconds
from eins.errors import EinsError
from eins.hardware.net import resolve_topology
from eins.hardware.presets import get_topology
from eins.ir.plan import Tuning
from eins.ir.text import format_seconds
from eins.models import llama, strategies
from eins.passes.enumerate_specs import eqn_candidates
from eins.report.html import LABEL, ROW, WIDTH

H100 = "dgx-h100:8"


@pytest.fixture(scope="module")
def paper():
    """The paper's LLaMA block at 8,192 tokens, shape-only, dp on dgx-h100:8."""
    wl = llama.WORKLOADS["1x8K"]
    fn, args = wl.function(llama.PAPER), wl(llama.PAPER)
    return fn, args, eins.distribute(fn, devices=8, topology=H100).lower(*args)


@pytest.fixture(scope="module")
def tiny():
    """The tiny LLaMA block on 4 virtual devices with data: it runs, and moves bytes."""
    cfg, rng = llama.TINY, np.random.default_rng(1)
    w = llama.init_weights(cfg, rng)
    x = rng.standard_normal((16, cfg.d_model)).astype(np.float32)
    cos, sin = llama.rope_tables(16, cfg.head_dim, None)
    # on all 4 devices: with device subsets (the default) a block this small runs on one
    f = eins.distribute(llama.block_fn(cfg, None), devices=4, backend="numpy",
                        tuning=Tuning(device_subsets=False))
    f(x, w, cos, sin)
    return f, f.lower(x, w, cos, sin)


# ----------------------------------------------------------------------------- explain
def spec_of(low, i, splits, pieces):
    """The spec of eqn ``i`` that explain calls ``splits`` on ``pieces`` devices."""
    names = low.plan.index_names()[i]
    cands = eqn_candidates(low.program.eqns[i], pieces, 256)[0]
    found = [c.spec for c in cands
             if (" ".join(f"{n}/{k}" for n, k in sorted(
                 (names.get(m, m), len(iv)) for m, iv in c.intervals.items() if len(iv) > 1))
                 or "whole") == splits]
    assert len(found) == 1, (splits, pieces)
    return found[0]


def test_explain_names_a_runner_up_for_every_eqn_and_adds_up(paper):
    _, _, low = paper
    xs = low.explain()
    table = low.plan_table()
    assert len(xs) == len(table) == len(low.program.eqns) == 24
    for x, row in zip(xs, table):
        c = x.chosen
        assert x.runner_up() is not None, x.eqn           # every eqn has a next best
        assert c.splits == (" ".join(f"{k}/{v}" for k, v in sorted(row["splits"].items()))
                            or "whole")
        assert c.compute_s + c.exchange_s == pytest.approx(row["seconds"], rel=1e-12)
        assert c.total_s == pytest.approx(low.plan.cost_s, rel=1e-12)
        assert c.proxy_bytes == low.plan.cost_bytes
        totals = [a.total_s for a in x.alternatives]
        assert totals == sorted(totals)                   # best first
        # dp's plan: no single other spec of an eqn makes the plan faster
        assert all(t >= low.plan.cost_s * (1 - 1e-9) for t in totals)
        text = str(x)
        assert text.startswith(f"eqn {x.eqn} ({row['op']})")
        assert all(f"\n        {a.reason}\n" in text + "\n" for a in x.alternatives)
    assert sum(x.chosen.seconds for x in xs) == pytest.approx(low.plan.cost_s, rel=1e-12)


def test_an_alternative_is_the_plan_with_that_spec(paper):
    """An alternative's total is the time cost of the plan with the eqn's spec swapped,
    computed here independently; its parts add up to it, and the text says by how much it
    is slower."""
    _, _, low = paper
    x = low.explain(np.int64(5))   # the q projection (a numpy index reads as its int)
    alt = x.runner_up()
    specs = [ep.spec for ep in low.plan.eqn_plans]
    specs[5] = spec_of(low, 5, alt.splits, alt.pieces)
    devs = low.devices
    secs = plan_seconds(low.program, specs, devs, resolve_topology(H100, devs),
                        TimeModel(low.program, devs, resolve_topology(H100, devs)))
    assert alt.total_s == pytest.approx(sum(secs), rel=1e-12)
    assert alt.proxy_bytes == sum(k.total for k in plan_costs(low.program, specs))
    assert alt.compute_s + alt.exchange_s == pytest.approx(secs[5], rel=1e-12)
    others = sum(secs) - secs[5] - (low.plan.cost_s - low.plan.eqn_plans[5].seconds)
    assert alt.consumers_s == pytest.approx(others, rel=1e-9, abs=1e-15)
    assert f"slower by {format_seconds(alt.total_s - low.plan.cost_s)}" in alt.reason


def test_explain_shows_idle_devices_and_memory(paper):
    fn, args, low = paper
    x = low.explain(0)     # rms_norm: one way to use 8 devices, the others idle some
    # the DP considers those on 4 devices too (device subsets), not fewer
    assert all(a.pieces < 8 and a.planned == (a.pieces == 4) for a in x.alternatives)
    assert "4 of 8 devices idle" in x.alternatives[0].reason
    # capped at the plan's largest per-eqn working set: the plan still fits, the specs
    # needing more are shown as exceeding it, ranked after every spec that fits (explain
    # ranks by working set: the cap on what stays live across eqns, which would re-plan
    # under a cap this low, is off here)
    cap = low.plan.eqn_peak_bytes
    capped = eins.distribute(fn, devices=8, topology=H100, memory_limit=cap,
                             tuning=Tuning(memory_rounds=0)).lower(*args)
    assert capped.plan.cost_s == low.plan.cost_s
    over = 0
    for y in capped.explain(top=1000):
        fits = [a.fits for a in y.alternatives]
        assert fits == sorted(fits, reverse=True)
        for a in y.alternatives:
            assert a.fits == (a.memory_bytes <= cap)
            assert ("exceeds memory" in a.reason) == (not a.fits)
            over += not a.fits
    assert over > 0


def test_a_forced_plan_says_how_much_slower_than_dp(paper):
    fn, args, low = paper
    plan = strategies.LLAMA_STRATEGIES["Megatron TP"](low.program, 8)
    forced = eins.distribute(fn, devices=8, topology=H100, plan=plan).lower(*args)
    i = min(plan)
    x = forced.explain(i)
    assert x.forced and x.dp_total_s == pytest.approx(low.plan.cost_s, rel=1e-12)
    assert x.chosen.total_s == pytest.approx(forced.plan.cost_s, rel=1e-12)
    d = forced.plan.cost_s - low.plan.cost_s
    assert d > 0
    assert f"slower than dp's plan by {format_seconds(d)}" in str(x)
    assert x.dp_choice.splits == low.explain(i).chosen.splits
    assert x.runner_up() is not None and "plan= forces this eqn" in str(x)


def test_a_proxy_plan_ranks_by_bytes(paper):
    fn, args, _ = paper
    low = eins.distribute(fn, devices=8, topology=H100, cost="proxy").lower(*args)
    x = low.explain(5, top=50)
    assert x.chosen.proxy_bytes == low.plan.cost_bytes
    b = [a.proxy_bytes for a in x.alternatives]
    for a in x.alternatives:   # each is the whole plan's proxy with eqn 5's spec swapped
        specs = [ep.spec for ep in low.plan.eqn_plans]
        specs[5] = spec_of(low, 5, a.splits, a.pieces)
        assert a.proxy_bytes == sum(k.total for k in plan_costs(low.program, specs))
    assert b == sorted(b) and all(v >= low.plan.cost_bytes for v in b)
    assert "proxy" in x.alternatives[0].reason


@pytest.mark.parametrize("bad", [24, -25, "q", 1.0, True])
def test_explain_refuses_what_is_not_an_eqn(paper, bad):
    with pytest.raises(EinsError, match=f"no eqn {re.escape(repr(bad))}"):
        paper[2].explain(bad)


def test_explain_refuses_a_bad_top(paper):
    with pytest.raises(EinsError, match="top must be a non-negative int, got -1"):
        paper[2].explain(0, top=-1)


# ----------------------------------------------------------------------------- the page
def island(text):
    m = re.search(r'<script type="application/json" id="eins-data">(.*?)</script>', text,
                  re.S)
    return json.loads(m.group(1))


def as_json(v):
    return json.loads(json.dumps(v))


def test_the_page_shows_the_plan_table_and_the_prediction(paper, tmp_path):
    fn, args, low = paper
    compare = {}
    for name in ("Megatron TP", "Ulysses"):
        compare[name] = eins.distribute(fn, devices=8, topology=H100, plan=strategies.
                                        LLAMA_STRATEGIES[name](low.program, 8)).lower(*args)
    path = low.report(tmp_path / "plan.html", compare=compare)
    text = open(path, encoding="utf-8").read()
    data = island(text)
    t = low.predicted_time()
    assert data["plan_table"] == as_json(low.plan_table())
    assert data["predicted_time"] == as_json(dict(t))
    assert data["cost_s"] == low.plan.cost_s
    ev = data["schedule"]["events"]
    kernels = sum(e["dur_s"] for e in ev if e["kind"] == "compute")
    moves = sum(e["dur_s"] for e in ev if e["kind"] in ("exchange", "gather"))
    assert kernels * 1e3 == pytest.approx(t["compute_ms"], rel=1e-12)
    assert moves * 1e3 == pytest.approx(t["exchange_ms"], rel=1e-12, abs=1e-15)
    assert data["schedule"]["total_s"] * 1e3 == pytest.approx(t["total_ms"], rel=1e-12)
    peaks = {d: max(b for _, b in pts) for d, pts in data["memory"].items()}
    assert peaks == as_json(t["peak_bytes"])
    assert list(data["compare"]) == ["dp (this plan)", "Megatron TP", "Ulysses"]
    compare["dp (this plan)"] = low
    for name, other in compare.items():   # the strategies, side by side
        assert data["compare"][name]["total_ms"] == other.predicted_time()["total_ms"]
        assert f"{data['compare'][name]['total_ms']:.4f} ms" in text
    # what a reader sees: every eqn's row, the totals, the figures
    for r in low.plan_table():
        assert f"<tr id=eqn{r['eqn']}>" in text
    assert f"{t['total_ms']:.4f} ms" in text and "Strategies compared" in text
    # self-contained: no network, and each drawing is well-formed SVG
    assert not re.search(r"(src|href)\s*=|https?://|@import|url\(", text)
    svgs = re.findall(r"<svg.*?</svg>", text, re.S)
    assert len(svgs) == 5
    for s in svgs:
        ET.fromstring(s)


def test_the_page_link_bytes_are_what_the_executor_moved(tiny, tmp_path):
    f, low = tiny
    data = island(open(low.report(tmp_path / "p.html"), encoding="utf-8").read())
    moved = f.stats()["bytes_moved"]
    assert moved   # the tiny block does exchange something
    assert {f"{s}->{d}": b for s, d, b in data["link_bytes"]} == moved
    assert {int(d): max(b for _, b in pts) for d, pts in data["memory"].items()} == \
        f.stats()["peak_bytes"]


def two_relus(x, y):
    return eins.relu(x), eins.relu(y)


@pytest.fixture(scope="module")
def uneven():
    """Two independent relus on 4 devices sharing 2 GPUs (devices 0, 2 on GPU 0; 1, 3 on
    GPU 1), cut so that GPU 0 holds 3/4 of the first's rows and 1/4 of the second's, GPU 1
    the rest: eqn by eqn each relu takes its 3/4 GPU's time, GPU by GPU each GPU runs 3/4
    of a relu and then 1/4 of the other (memory-bound: about 2/3 of the time)."""
    n, q = 1 << 16, 1 << 13
    a = eins.ShapeDtype((n, 4096), "float32")
    topo = get_topology("dgx-h100:2").logical(4)
    assert [topo.gpu_of(d) for d in range(4)] == [0, 1, 0, 1]
    cut0 = ((0, 3 * q), (3 * q, 4 * q), (4 * q, 7 * q), (7 * q, n))
    cut1 = ((0, q), (q, 4 * q), (4 * q, 5 * q), (5 * q, n))
    return eins.distribute(two_relus, devices=4, topology=topo,
                           plan={0: {"d0": cut0}, 1: {"d0": cut1}}).lower(a, a)


def timeline_svg(text, how):
    """The timeline drawn ``how`` ("eqn by eqn", "GPU by GPU"), parsed."""
    m = re.search(rf'<svg [^>]*aria-label="predicted schedule, {how}">.*?</svg>', text, re.S)
    return ET.fromstring(m.group(0))


def drawn_end(svg) -> float:
    """How far right the timeline's spans reach, px from the time axis' 0."""
    return max(float(r.get("x")) + float(r.get("width")) for r in svg.iter("rect")) - LABEL


def test_the_page_draws_the_schedule_gpu_by_gpu(uneven, tmp_path):
    t = uneven.predicted_time()
    assert t["timeline_ms"] == pytest.approx(t["total_ms"] * 2 / 3, rel=0.01)
    text = open(uneven.report(tmp_path / "p.html"), encoding="utf-8").read()
    data = island(text)
    assert data["schedule"]["timeline"]["end_s"] * 1e3 == pytest.approx(t["timeline_ms"],
                                                                        rel=1e-12)
    assert data["schedule"]["timeline"]["gpus"] == {"0": [0, 2], "1": [1, 3]}
    # both ends printed, rounded alike, and the summary's row
    assert (f"Ends: eqn by eqn <b>{round(t['total_ms'], 3):.3f} ms</b>, GPU by GPU "
            f"<b>{round(t['timeline_ms'], 3):.3f} ms</b> (33.2% sooner GPU by GPU: ") in text
    assert f"<th class=l>GPU by GPU</th><td class=l>{t['timeline_ms']:.4f} ms" in text
    assert "<h3>GPU by GPU</h3>" in text
    gpu, eqn = timeline_svg(text, "GPU by GPU"), timeline_svg(text, "eqn by eqn")
    # one row per GPU (not per device), its devices on hover
    labels = [(e.text, e.find("title").text) for e in gpu.iter("text")
              if e.find("title") is not None]
    assert labels == [("GPU 0", "devices 0, 2"), ("GPU 1", "devices 1, 3")]
    rows = {}
    for r in gpu.iter("rect"):
        rows.setdefault((int(r.get("y")) - 2) // ROW, []).append(
            (float(r.get("x")), float(r.get("width")), r.find("title").text))
    assert sorted(rows) == [0, 1]
    # each GPU: eqn 0's kernel, then eqn 1's right after it (no barrier between)
    for spans in rows.values():
        (x0, w0, tip0), (x1, _, tip1) = sorted(spans)
        assert x0 == LABEL and x1 == pytest.approx(x0 + w0, abs=0.01)
        assert tip0.startswith("eqn 0 relu: ") and tip1.startswith("eqn 1 relu: ")
    # one time scale: the eqn-by-eqn drawing fills the width, the GPU-by-GPU one is as
    # much shorter as its time
    assert drawn_end(eqn) == pytest.approx(WIDTH, abs=0.5)
    assert drawn_end(gpu) / drawn_end(eqn) == pytest.approx(
        t["timeline_ms"] / t["total_ms"], abs=1 / WIDTH)
    assert drawn_end(gpu) < 0.7 * WIDTH


def test_a_balanced_plan_ends_the_same_both_ways_on_the_page(paper, tmp_path):
    low = paper[2]
    t = low.predicted_time()
    assert t["timeline_ms"] == pytest.approx(t["total_ms"], rel=1e-12)
    text = open(low.report(tmp_path / "p.html"), encoding="utf-8").read()
    ms = f"{round(t['total_ms'], 3):.3f} ms"
    assert (f"Ends: eqn by eqn <b>{ms}</b>, GPU by GPU <b>{ms}</b> (the same to the "
            f"microsecond: no GPU runs ahead of an eqn's slowest one by more)" in html.unescape(text))
    gpu, eqn = timeline_svg(text, "GPU by GPU"), timeline_svg(text, "eqn by eqn")
    assert [e.text for e in gpu.iter("text") if e.text and e.text.startswith("GPU ")] == \
        [f"GPU {g}" for g in range(8)]
    assert drawn_end(gpu) == pytest.approx(drawn_end(eqn), abs=0.5)


@pytest.mark.parametrize("compare, msg", [
    ([1, 2], "compare must be a dict {name: Lowered or {total_ms, compute_ms, exchange_ms}}, "
             "got list [1, 2]"),
    ({"tp": 3.0}, "compare['tp'] must be a Lowered or a dict with numbers ['total_ms', "
                  "'compute_ms', 'exchange_ms'] (or an 'error'), got 3.0"),
    ({"tp": {"total_ms": 1.0}}, "compare['tp'] must be a Lowered or a dict with numbers")])
def test_report_refuses_a_bad_compare(tiny, tmp_path, compare, msg):
    with pytest.raises(EinsError, match=re.escape(msg)):
        tiny[1].report(tmp_path / "p.html", compare=compare)
    assert not (tmp_path / "p.html").exists()


def test_report_refuses_a_path_it_cannot_write(paper, tmp_path):
    bad = tmp_path / "no" / "such" / "dir" / "p.html"
    with pytest.raises(EinsError, match=re.escape(f"cannot write the report to {str(bad)!r}")):
        paper[2].report(bad)
    with pytest.raises(EinsError, match="the trace file must be a path"):
        paper[2].trace(3)


# ----------------------------------------------------------------------------- the trace
def test_the_trace_is_trace_event_json_adding_up_to_the_prediction(tiny, tmp_path):
    _, low = tiny
    path = low.trace(tmp_path / "plan.json")
    trace = json.load(open(path))
    evs = trace["traceEvents"]
    assert isinstance(evs, list) and evs
    for e in evs:
        assert e["ph"] in ("X", "M", "C") and isinstance(e["pid"], int) and e["name"]
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["tid"], int)
        if e["ph"] == "C":
            assert e["ts"] >= 0 and isinstance(e["args"]["live bytes"], int)
    t = low.predicted_time()
    spans = [e for e in evs if e["ph"] == "X"]
    compute = sum(e["dur"] for e in spans if e["cat"] == "compute")
    moves = [e for e in spans if e["cat"] in ("exchange", "gather") and e["pid"] == 0]
    assert compute / 1e3 == pytest.approx(t["compute_ms"], rel=1e-12)
    assert sum(e["dur"] for e in moves) / 1e3 == pytest.approx(t["exchange_ms"], rel=1e-12)
    assert t["exchange_ms"] > 0 and len(moves) == len(low.exchanges)
    # per device: its kernels never run past their eqn's compute phase
    phase = {e["args"]["eqn"]: e for e in spans if e["cat"] == "compute"}
    for e in spans:
        if e["cat"] == "kernel" and e["pid"] == 1:
            p = phase[e["args"]["eqn"]]
            assert e["ts"] == p["ts"] and e["dur"] <= p["dur"] * (1 + 1e-12)
    names = {e["args"]["name"] for e in evs if e["ph"] == "M"}
    assert {f"device {d}" for d in low.devices} <= names


# ----------------------------------------------------------------------------- the command
def test_eins_plan_explain_html_and_trace(tmp_path, capsys):
    page, trace = tmp_path / "p.html", tmp_path / "p.json"
    assert main(["plan", "1x1K", "--model", "tiny", "--compare", "--explain", "all",
                 "--html", str(page), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.count("chosen by dp: split") == 24 and "next best of" in out
    assert f"written to {page}" in out and f"written to {trace}" in out
    data = island(page.read_text(encoding="utf-8"))
    # every strategy the command printed is drawn beside dp's plan
    printed = {ln.split(":")[0].strip() for ln in out.splitlines() if ": predicted " in ln}
    assert len(printed) >= 3 and "dp" in printed
    assert set(data["compare"]) == printed - {"dp"} | {"dp (this plan)"}
    assert data["compare"]["dp (this plan)"]["total_ms"] == data["predicted_time"]["total_ms"]
    assert json.loads(trace.read_text())["traceEvents"]
    assert main(["plan", "1x1K", "--model", "tiny", "--explain", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [x["eqn"] for x in got["explain"]] == [3]
    assert got["explain"][0]["chosen"]["total_s"] == pytest.approx(got["dp"]["cost_s"])


@pytest.mark.parametrize("arg, msg", [("x", "expected an eqn index or 'all', got 'x'"),
                                      ("99", "explain: no eqn 99; the program has eqns "
                                             "0..23")])
def test_eins_plan_explain_refuses_a_bad_eqn(arg, msg, capsys):
    assert main(["plan", "1x1K", "--model", "tiny", "--explain", arg]) == 2
    assert msg in capsys.readouterr().err
