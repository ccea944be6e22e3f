"""benchmarks/gpu_kernels.py's interpreter smoke run: every per-kernel row runs on CPU tensors
and agrees with PyTorch (the GPU rows themselves need a GPU)."""
import importlib.util
import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_kernels.py")


def test_interpret_smoke_run_writes_every_row(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_kernels", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "rows.json"
    rows = mod.main(["--interpret", "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    kinds = [r["kernel"] for r in rows]
    assert kinds.count("matmul") == kinds.count("attention") == 2  # float32 and float16
    assert {"rms_norm", "rope (+layout)", "fused silu*mul"} <= set(kinds)
    # issue 33's masked, windowed and softcapped rows, in both dtypes, against SDPA's mask
    masked = [r for r in rows if r["kernel"] == "attention_masked"]
    assert sorted(r["variant"] for r in masked) == sorted(
        ["keys mask", "full mask", "window=8", "softcap=50"] * 2)
    assert all("sdpa_max_err" in r for r in masked if not r["variant"].startswith("softcap"))
    for r in rows:
        tol = 1e-5 if r["dtype"] == "float32" else 4e-3  # a float16 rounding of O(1) values
        errs = [v for k, v in r.items() if k.endswith("max_err")]
        assert errs and max(errs) <= tol, r
    assert "sdpa_ms" in capsys.readouterr().out
    # CPU tensors: auto takes the Triton kernel; eins's SDPA path is timed beside it
    att = [r for r in rows if r["kernel"] == "attention"]
    assert all(r["auto_picks"] == "triton" and r["auto_ms"] == r["eins_ms"] and
               "eins_sdpa_ms" in r for r in att), att
    # the paper's projection shapes, as documented
    assert [s[1:] for s in mod.matmul_shapes(4096)] == [(4096, 4096, 4096), (4096, 4096, 1024),
                                                        (4096, 4096, 14336),
                                                        (4096, 14336, 4096)]


def test_graph_replayed_times_fill_their_columns(monkeypatch):
    """On a GPU every row also gets ``*_graph_ms`` (the call replayed from a CUDA graph: the
    GPU's own time, without the host's launch overhead that made small kernels look slow on
    the first H200 run) or ``*_graph_error``. Here ``measure.graph`` is a stand-in that runs
    the call once and reports 0.5 ms, or fails for PyTorch's matmul, so the wiring of every
    column is checked on the CPU."""
    import torch
    spec = importlib.util.spec_from_file_location("gpu_kernels", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    measure = mod.make_timer("cpu", 1)
    calls = []

    def graph(fn):
        calls.append(fn)
        fn()
        return "RuntimeError: not capturable" if len(calls) == 1 else 0.5
    measure.graph = graph
    (mm,) = mod.matmul_rows("cpu", measure, torch.float32, [("tiny", 33, 40, 24)])
    assert mm["torch_graph_error"] == "RuntimeError: not capturable"
    assert mm["eins_torch_graph_ms"] == mm["eins_triton_graph_ms"] == 0.5
    assert "torch_vs_torch_graphed" not in mm    # no reference time: no ratio
    (att,) = mod.attention_rows("cpu", measure, torch.float32, [40], hq=2, hkv=1, d=16)
    assert att["sdpa_graph_ms"] == att["eins_graph_ms"] == att["eins_sdpa_graph_ms"] == 0.5
    assert att["meets_1.3x_sdpa_graphed"] is True
    masked = mod.masked_attention_rows("cpu", measure, torch.float32, [40], hq=2, hkv=1,
                                       d=16, window=8)
    for r in masked:   # no flash-attn on the CPU: SDPA is the anchor
        assert r["eins_graph_ms"] == r["sdpa_graph_ms"] == 0.5, r
        assert r["eins_vs_anchor_graphed"] == 1.0 and r["meets_1.3x_graphed"] is True
    for r in mod.pointwise_rows("cpu", measure, torch.float32, 24, 32):
        assert r["eins_graph_ms"] == r["torch_graph_ms"] == 0.5
        moved = (3 if r["kernel"] == "fused silu*mul" else 2) * 24 * 32 * 4   # bytes
        assert r["eins_graph_GBps"] == round(moved / 0.5 / 1e6, 1)
    assert len(calls) == 3 + 3 + 4 * 2 + 6


def test_tune_smoke_run_times_every_config_and_names_the_fastest(tmp_path):
    """benchmarks/gpu_tune.py under the interpreter: every config of its tiny grid runs and
    is checked against the reference; the summary names the fastest correct one per shape
    with its time against the reference and against today's config."""
    spec = importlib.util.spec_from_file_location("gpu_tune", os.path.join(
        os.path.dirname(PATH), "gpu_tune.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "tune.json"
    rows, summary = mod.main(["--interpret", "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    assert [r["job"] for r in rows] == [
        "attention/float16/sdpa", "attention/float16/32x32x1x1", "attention/float16/16x32x1x1",
        "matmul/float16/torch", "matmul/float16/32x32x32x4x1x1",
        "matmul/float16/16x32x16x4x1x1"]
    assert all(r["ok"] for r in rows), rows
    assert [r["current"] for r in rows if "current" in r] == [True, False, True, False]
    assert [(s["kernel"], s["configs_timed"], s["reference"]) for s in summary] == [
        ("attention", 2, "sdpa"), ("matmul", 2, "torch.matmul")]
    for s in summary:
        tried = [r for r in rows if r["kernel"] == s["kernel"] and "current" in r]
        assert s["best_ms"] == min(r["ms"] for r in tried)
        assert s["best_vs_current"] == round(
            s["best_ms"] / next(r["ms"] for r in tried if r["current"]), 3)
    # a config whose result is off is never the fastest
    off = [dict(r, ok=False, ms=0.0) if r["job"].endswith("16x32x1x1") else r for r in rows]
    (att,) = [s for s in mod.best(off) if s["kernel"] == "attention"]
    assert att["best_config"] == [32, 32, 1, 1] and att["configs_timed"] == 1
