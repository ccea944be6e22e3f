"""benchmarks/bench_predict.py: eins's predictions for one H200 beside what the first GPU run
measured (benchmarks/results/h200-2026-12-04/)."""
import importlib.util
import os

import pytest

PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_predict.py")


def _module():
    spec = importlib.util.spec_from_file_location("bench_predict", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_predictions_sit_beside_the_h200_measurements():
    rows = _module().rows()
    assert len(rows) == 8 + 6 + 5   # 8 matmuls, 6 attentions, 5 blocks at p = 1 with graphs
    qo = rows[0]
    assert qo["what"] == "matmul q/o proj 4096x4096x4096" and qo["dtype"] == "float16"
    # the kernel model by hand: 2 * 4096**3 FLOPs plus the small-kernel floor 2**30 at the
    # H200's 989 TFLOP/s (compute bound: 3 x 32 MiB at 4.8 TB/s is 0.02 ms)
    want = (2 * 4096 ** 3 + 2 ** 30) / 989e12 * 1e3
    assert qo["predicted_ms"] == round(want, 4) == 0.1401
    assert (qo["pytorch_ms"], qo["eins_ms"]) == (0.2001, 0.2103)     # as measured
    assert qo["predicted_vs_pytorch"] == round(0.1401 / 0.2001, 3) == 0.7
    block = [r for r in rows if r["what"] == "paper block 1x4096, graphs"]
    assert [r["eins_ms"] for r in block] == [3.111, 3.112]
    assert block[0]["predicted_ms"] == pytest.approx(2.2418, abs=1e-4)
    # the model is optimistic on every measured row: datasheet peak, no kernel overheads
    assert all(r["predicted_vs_pytorch"] < 1 and r["predicted_vs_eins"] < 1 for r in rows)
