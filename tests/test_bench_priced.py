"""benchmarks/bench_priced.py on the smallest cases: under schedule="optimized" dp's plan,
synthesized and predicted, is within 1 % of the best of every plan (exhaustive)."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_priced", os.path.join(ROOT, "benchmarks", "bench_priced.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()


@pytest.mark.parametrize("name,topo,p", BENCH.QUICK)
def test_dp_is_within_one_percent_of_every_plan_once_synthesized(name, topo, p):
    r = BENCH.compare(name, topo, p)
    assert r["mode"] == "exhaustive" and r["plans"] >= 16 and r["lowered"] >= 1
    # the plans lowered are the least priced; a prediction never exceeds the price
    assert r["best_ms"] <= r["dp_ms"] and r["best_ms"] <= r["least_price_ms"] * (1 + 1e-9)
    assert r["dp_ms"] <= r["dp_price_ms"] * (1 + 1e-9)
    assert r["dp_ms"] <= r["best_ms"] * 1.01 and r["ok"]


def test_the_quick_run_prints_every_case_and_the_worst_gap(capsys):
    rows = BENCH.main(["--quick"])
    out = capsys.readouterr().out
    assert len(rows) == len(BENCH.QUICK) and "worst gap" in out
    assert out.count(" ok ") == sum(r["ok"] for r in rows)
