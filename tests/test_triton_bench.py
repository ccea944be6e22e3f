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
