"""The training step's GPU benchmark (benchmarks/gpu_train.py, section (c) of
benchmarks/gpu_check.py), its CPU-side pieces: the smoke cases run through
backend="interpret" (the paper block's forward + backward against PyTorch autograd;
AdamW with the state kept on the devices), the case list the GPU run takes, and the
targets read off the rows."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402
import gpu_train  # noqa: E402


def cases(smoke=True):
    return gpu_check.train_section("interpret" if smoke else "cuda", smoke, 1)


def test_smoke_gradients_equal_pytorch_autograd_and_state_stays_on_the_devices():
    pytest.importorskip("triton")
    got = {cid: thunk for cid, _, thunk in cases()}
    assert list(got) == ["train/float32/1x16/p1", "train/float32/1x16/p2",
                         "adamw/float32/1x16/p2"]
    row = got["train/float32/1x16/p2"]()
    assert row["ok"] and row["grad_rel_err"] <= gpu_train.TOL["float32"]
    assert row["eins_ms"] > 0 and row["torch_eager_ms"] > 0
    assert row["h2d_bytes"] == 0          # everything placed: nothing from the host per call
    adam = got["adamw/float32/1x16/p2"]()
    assert adam["ok"] and adam["state_h2d_bytes"][0] > 0
    assert adam["state_h2d_bytes"][1:] == [0, 0]
    assert adam["loss_rel_err_vs_jit"] <= gpu_train.TOL["float32"]


def test_the_gpu_run_times_torch_compile_right_after_einss_4k_row():
    ids = [cid for cid, _, _ in cases(smoke=False)]   # listing them runs nothing
    assert ids[:3] == ["train/bfloat16/1x4096/p1", "compile/bfloat16/1x4096",
                       "train/bfloat16/1x4096/p8"]
    assert ids[-1] == "adamw/float32/1x256/p2"


def test_targets_read_off_the_rows():
    rows = [{"section": "train", "dtype": "bfloat16", "tokens": 4096, "p": 1,
             "ratio_eager": 1.15, "eins_ms": 23.0, "ok": True},
            {"section": "train", "dtype": "bfloat16", "tokens": 4096,
             "torch_compile_ms": 20.0, "ok": True},
            {"section": "train", "dtype": "float32", "tokens": 256, "p": 2,
             "state_h2d_bytes": [10, 0, 0], "ok": True}]
    assert gpu_train.train_summary(rows) == {
        "issue34_train_1x4K_p1_within_1.2x_eager": True,
        "issue34_train_1x4K_p1_vs_torch_compile": 1.15,
        "issue34_state_stays_on_device": True}
    rows[0]["ratio_eager"] = 1.3
    assert gpu_train.train_summary(rows)["issue34_train_1x4K_p1_within_1.2x_eager"] is False
    assert gpu_train.train_summary([]) == {
        "issue34_train_1x4K_p1_within_1.2x_eager": None,
        "issue34_train_1x4K_p1_vs_torch_compile": None,
        "issue34_state_stays_on_device": None}
    assert "issue34_state_stays_on_device" in gpu_check.summary(rows)
