"""benchmarks/bench_plans.py --quick: the table's JSON and its targets on one topology."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_plans", os.path.join(ROOT, "benchmarks", "bench_plans.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_writes_the_table_and_dp_meets_its_targets(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "plans.json"
    bench.main(["--quick", "--json", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["plans"]
    assert {r["workload"] for r in rows} == {"1x1K", "chain C"}
    for r in rows:
        hand = [v for v in r["hand"].values() if isinstance(v, float)]
        assert len(hand) >= 2 and r["ok"]
        assert all(r["dp"] <= v * 1.01 for v in hand + [r["random_best"], r["greedy"]])
    # under the naive schedule the time cost is predicted_time() itself
    (corr,) = doc["spearman"]
    assert corr["workload"] == "chain C" and corr["time"] == 1.0
    assert "dp ok on 2 of 2" in capsys.readouterr().out


def test_spearman_matches_hand_ranks():
    bench = _bench()
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): 0.9486...
    assert abs(bench.spearman([1, 2, 2, 3], [1, 2, 3, 4]) - 0.9486832980505138) < 1e-12
