"""Issue 39's GPU targets as the device session reports them: gpu_check's summary of the
torch.compile anchors and the p=8 rows, gpu_check's rates, and summary.txt's check of the
shipped profile against a session's own measurements (benchmarks/)."""
import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402
from block_ref import COMPILE_MODES, block_flops, rate  # noqa: E402
from eins.cli import main as cli  # noqa: E402
from eins.models import llama  # noqa: E402
from session_summary import summary_lines  # noqa: E402


def _speed(dtype, s, p, ms):
    return {"section": "speed", "dtype": dtype, "tokens": s, "p": p, "graphs": True,
            "eins_ms": ms, "ratio": 0.9, "ok": True}


def test_issue39_targets_from_rows():
    rows = [_speed("float16", 4096, 1, 2.5), _speed("float16", 4096, 8, 2.9),
            _speed("float16", 32768, 1, 40.0), _speed("float16", 32768, 8, 41.0),
            _speed("bfloat16", 8192, 1, 6.0),
            {"section": "anchors", "dtype": "float16", "tokens": 4096, "mode": "max-autotune",
             "compile_ms": 2.6},
            {"section": "anchors", "dtype": "bfloat16", "tokens": 8192,
             "mode": "max-autotune-no-cudagraphs", "compile_ms": 5.0}]
    got = gpu_check.summary(rows)
    assert got["issue39_1x4K_float16_vs_max_autotune"] == round(2.5 / 2.6, 3)
    assert got["issue39_1x8K_bfloat16_vs_max_autotune"] is None   # no max-autotune row
    assert got["issue39_1x4K_fp16_at_most_2.6ms"] is True
    assert got["issue39_p8_vs_p1_1x4K"] == 1.16 and got["issue39_p8_1x4K_within_1.1x"] is False
    assert got["issue39_p8_vs_p1_1x32K"] == 1.025
    assert got["issue39_p8_1x32K_within_1.03x"] is True


def test_rates_use_the_blocks_flop_count():
    # 1.92 TFLOP at 1x4K (issue 39), in 3.2 ms on a 989 TFLOP/s GPU
    flops = block_flops(llama.PAPER, 4096)
    assert flops == 1924761911296
    row = {"eins_ms": 3.2}
    rate(row, "eins", flops, 989e12)
    assert row["eins_tflops"] == round(flops / 3.2e-3 / 1e12, 1) == 601.5
    assert row["eins_pct_peak"] == round(100 * flops / 3.2e-3 / 989e12, 1) == 60.8


def test_summary_checks_the_shipped_profile_on_a_sessions_measurements(tmp_path, capsys):
    run = os.path.join(ROOT, "benchmarks", "results", "h200-2026-12-04-d")
    for name in ("gpu_check.json", "gpu_kernels.json"):
        shutil.copy(os.path.join(run, name), tmp_path / name)
    assert cli(["calibrate", "--from", run, "--rows", str(tmp_path / "calibrate_rows.json"),
                "--out", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    text = "\n".join(summary_lines(str(tmp_path)))
    assert "calibrate: 20 rows on NVIDIA H200" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("  kernel ")]
    # q/o, k/v, gate/up and down (one shape); 3 attentions; rms_norm, rope, silu*mul
    assert len(lines) == 9 and sum(ln.startswith("  kernel matmul") for ln in lines) == 3
    for ln in lines:
        assert abs(float(ln.rsplit("x", 1)[1]) - 1) <= 0.15, ln
    blocks = [ln for ln in text.splitlines() if ln.startswith("  block ")]
    assert len(blocks) == 9 and all("target: within 10 %" in ln for ln in blocks)
    doc = json.loads((tmp_path / "calibrate_rows.json").read_text())
    assert doc["gpu"] == "NVIDIA H200" and "sdpa" in doc["attention"]


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_anchor_cases_cover_both_compile_modes(mode):
    cases = gpu_check.anchor_cases("cuda", False, 1)
    ids = [c for c, _, _ in cases]
    assert f"compile/float16/1x4096/{mode}" in ids and f"compile/bfloat16/1x8192/{mode}" in ids
    assert ids[0] == "compile/float16/1x4096/max-autotune-no-cudagraphs"


def test_a_sessions_rows_refit_the_profile(tmp_path, capsys):
    """bench_predict's fit reads a session's calibrate_rows.json beside its gpu_kernels.json:
    how the next device session's measurements refit the shipped profile."""
    import bench_predict
    run = os.path.join(ROOT, "benchmarks", "results", "h200-2026-12-04-d")
    shutil.copy(os.path.join(run, "gpu_check.json"), tmp_path / "gpu_check.json")
    assert cli(["calibrate", "--from", run, "--rows", str(tmp_path / "calibrate_rows.json"),
                "--out", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    rows = bench_predict.kernel_rows([str(tmp_path)])
    assert len(rows) == 20 and {r["source"] for r in rows} == {tmp_path.name}
    prof = bench_predict.fit_profile([str(tmp_path)])
    assert prof.shared_overhead_s > 0 and "sdpa" in prof.attention


def test_issue33_masked_attention_target_from_kernel_rows(tmp_path):
    from session_summary import masked_attention_target
    rows = [{"kernel": "attention", "eins_ms": 1.0},
            {"kernel": "attention_masked", "variant": "keys mask", "eins_ms": 1.0}]
    assert masked_attention_target(rows) is None          # nothing graph-replayed (CPU)
    rows += [{"kernel": "attention_masked", "variant": "window=4096", "dtype": "float16",
              "shape": "S=8192", "eins_ms": 1.0, "eins_graph_ms": 1.2, "sdpa_graph_ms": 1.0,
              "eins_vs_anchor_graphed": 1.2, "meets_1.3x_graphed": True},
             {"kernel": "attention_masked", "variant": "softcap=50", "dtype": "float16",
              "shape": "S=8192", "eins_ms": 1.0, "eins_graph_ms": 1.4,
              "flash_attn_graph_ms": 1.0, "eins_vs_anchor_graphed": 1.4,
              "meets_1.3x_graphed": False}]
    assert masked_attention_target(rows) == {"met": False, "worst": 1.4, "rows": 2}
    (tmp_path / "gpu_kernels.json").write_text(json.dumps(rows))
    text = "\n".join(summary_lines(str(tmp_path)))
    assert "issue33 masked/windowed/softcapped attention within 1.3x of its anchor " \
           "(graph-replayed): {'met': False, 'worst': 1.4, 'rows': 2}" in text
    assert "attention float16 S=8192: eins 1.4 ms, sdpa None ms, flash-attn 1.0 ms " \
           "(graph-replayed): x1.4" in text
