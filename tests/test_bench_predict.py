"""benchmarks/bench_predict.py: eins's predictions for one H200 before and after calibration
beside what the device sessions measured (benchmarks/results/h200-2026-12-04*/). Issue 39's
predictor targets, checked on the committed files: each kernel class within 15 % of
measured, the paper block at 1x4K, 1x8K and 1x128K (p=1) and p=8 mapped onto one GPU
within 10 %."""
import importlib.util
import os
import statistics

import pytest

from eins.cost import calibrate as cal
from eins.hardware.profile import load_profile

PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_predict.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_predict", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_shipped_h200_profile_is_the_fit_of_the_committed_files(bench):
    fitted = bench.fit_profile()
    assert fitted.to_dict() == load_profile("h200").to_dict()
    # the q/o projection by hand: the median of six graph-replayed runs (3 runs x 2 dtypes)
    times = [0.1941, 0.1759, 0.1867, 0.1776, 0.1806, 0.1754]   # -b, -c, -d: fp16, bf16
    eff = (2 * 4096 ** 3 + 2 ** 30) / 989e12 / (statistics.median(times) / 1e3)
    assert dict(fitted.entry("matmul").flops)[2 * 4096 ** 3] == round(eff, 6)


def test_every_kernel_class_within_15_percent_of_every_run(bench):
    prof = load_profile("h200")
    rows = bench.kernel_rows()
    assert len(rows) == 60 and len({r["source"] for r in rows}) == 3   # run 1 has no graphs
    for r in rows:
        got = cal.predicted_seconds(prof, r, 989e12, 4800e9)
        assert abs(got / r["seconds"] - 1) <= 0.15, (r["what"], r["source"], r["dtype"])
    classes = bench.class_table(bench.kernel_table(prof))
    assert {c["class"] for c in classes} == {"matmul", "attention", "norm", "rope",
                                              "elementwise"}
    for c in classes:
        assert abs(c["after_vs_measured"] - 1) <= 0.15
        assert c["before_vs_measured"] < 0.85   # the data sheet's roofline was optimistic


def test_paper_blocks_within_10_percent(bench):
    blocks = bench.block_table(load_profile("h200"))
    seen = {(b["what"], b["dtype"]) for b in blocks}
    for want in ("paper block 1x4096, p=1", "paper block 1x8192, p=1",
                 "paper block 1x131072, p=1", "paper block 1x4096, p=8 on one GPU",
                 "paper block 1x8192, p=8 on one GPU"):
        assert (want, "float16") in seen
    for b in blocks:
        assert abs(b["after_vs_measured"] - 1) <= 0.10, b
        assert b["before_ms"] / b["measured_ms"] < 0.75, b   # before: 1.4-2x optimistic
    # the p=8 blocks at 8K are predictions the shared-GPU overhead was not fitted to
    assert any(not b["fitted"] and "p=8" in b["what"] for b in blocks)
    # the p=1 block at 4K before calibration, by hand from its per-eqn roofline (issue 39:
    # 2.24 ms predicted against 3.1-3.4 ms measured)
    p1 = next(b for b in blocks if b["what"] == "paper block 1x4096, p=1"
              and b["dtype"] == "float16")
    assert p1["before_ms"] == pytest.approx(2.2418, abs=1e-4)
    assert p1["measured_ms"] == statistics.median([3.111, 3.303, 3.198])


def test_a_profile_fitted_to_two_runs_predicts_the_third(bench):
    """Out of sample: fitted to runs -b and -c alone, the profile prices run -d's kernels
    within 15 % and its p=1 blocks within 10 % (the p=8 blocks of one run vary by 12 %
    between runs, more than the rows the shared-GPU overhead is fitted to: not asserted)."""
    fit_on = [d for d in bench.DEFAULT_RESULTS if d.endswith(("-b", "-c"))]
    held = [d for d in bench.DEFAULT_RESULTS if d.endswith("-d")]
    assert len(fit_on) == 2 and len(held) == 1
    prof = bench.fit_profile(fit_on)
    rows = bench.kernel_rows(held)
    assert len(rows) == 20
    for r in rows:
        got = cal.predicted_seconds(prof, r, 989e12, 4800e9)
        assert abs(got / r["seconds"] - 1) <= 0.15, (r["what"], r["dtype"])
    p1 = [b for b in bench.block_table(prof, held) if b["what"].endswith("p=1")]
    assert len(p1) == 5
    for b in p1:
        assert abs(b["after_vs_measured"] - 1) <= 0.10, b
