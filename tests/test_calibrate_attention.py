"""attention="auto" from a measured table (issue 39): the fastest exact kernel at the
nearest measured length, the table reaching the kernel only where it was measured on the
GPU that runs, and cuDNN's SDPA backend as a kernel of its own."""
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import eins  # noqa: E402
from eins.hardware.profile import Profile  # noqa: E402
from eins.kernels import flash, sdpa  # noqa: E402
from eins.kernels.attention import LAUNCHES, choose_impl, fastest_measured  # noqa: E402
from eins.runtime.gpu_exec import measured_table  # noqa: E402

KEY = "float16 S={} Hq=4 Hkv=1 D=128 causal"
TABLE = {"triton": {KEY.format(8192): 0.21, KEY.format(32768): 2.0, KEY.format(131072): 30.0},
         "sdpa": {KEY.format(8192): 0.18, KEY.format(32768): 2.1, KEY.format(131072): 32.0},
         "cudnn": {KEY.format(8192): 0.19, KEY.format(131072): 29.0}}


def test_the_fastest_at_the_nearest_length_every_candidate_was_timed_at():
    # 8K: SDPA; 32K is not in cuDNN's rows, so triton and sdpa and cudnn compare at 8K or
    # 128K, whichever is nearer (in log) to the block's length
    assert fastest_measured(TABLE, ["triton", "sdpa"], "float16", 8000, 128, True) == "sdpa"
    assert fastest_measured(TABLE, ["triton", "sdpa"], "float16", 30000, 128, True) == "triton"
    assert fastest_measured(TABLE, ["triton", "sdpa", "cudnn"], "float16", 100000, 128,
                            True) == "cudnn"
    assert fastest_measured(TABLE, ["triton", "sdpa", "cudnn"], "float16", 20000, 128,
                            True) == "sdpa"          # nearer 8K than 128K
    # nothing measured for this dtype, head dim or mask, or one candidate: the rule decides
    assert fastest_measured(TABLE, ["triton", "sdpa"], "bfloat16", 8192, 128, True) is None
    assert fastest_measured(TABLE, ["triton", "sdpa"], "float16", 8192, 64, True) is None
    assert fastest_measured(TABLE, ["triton", "sdpa"], "float16", 8192, 128, False) is None
    assert fastest_measured(TABLE, ["triton", "flash_attn"], "float16", 8192, 128,
                            True) is None


def test_auto_takes_the_measured_choice_among_exact_kernels(monkeypatch):
    q = torch.zeros(4, 8192, 128, dtype=torch.float16)
    k = torch.zeros(1, 8192, 128, dtype=torch.float16)
    where = dict(causal=True, segments=None, lse=None, q_offset=0, k_offset=0)
    # every library kernel applies (as on an H200): the table decides
    monkeypatch.setattr(sdpa, "why_not", lambda *a, **kw: None)
    monkeypatch.setattr(sdpa, "cudnn_why_not", lambda *a, **kw: None)
    monkeypatch.setattr(flash, "why_not", lambda *a, **kw: "flash-attn is not installed")
    assert choose_impl(q, k, k, q, measured=TABLE, **where) == "sdpa"
    long = torch.zeros(4, 131072, 128, dtype=torch.float16).expand(4, 131072, 128)
    assert choose_impl(long, k, k, long, measured=TABLE, **where) == "cudnn"
    # without a table, today's rule: SDPA where it applies
    assert choose_impl(long, k, k, long, **where) == "sdpa"
    # a kernel that does not compute this block exactly is never picked, however fast
    monkeypatch.setattr(sdpa, "cudnn_why_not", lambda *a, **kw: "not on this GPU")
    assert choose_impl(long, k, k, long, measured=TABLE, **where) == "triton"


def test_the_table_reaches_kernels_only_on_the_gpu_it_was_measured_on():
    prof = Profile("h200", gpu_model="H200", attention={"sdpa": {KEY.format(8192): 0.18}})

    def fake(name):
        return SimpleNamespace(cuda=SimpleNamespace(get_device_name=lambda i: name))
    assert measured_table(prof, "cuda", fake("NVIDIA H200")) == prof.attention
    assert measured_table(prof, "cuda", fake("NVIDIA A100-SXM4-80GB")) is None
    assert measured_table(prof, "interpret", fake("NVIDIA H200")) is None
    assert measured_table(None, "cuda", fake("NVIDIA H200")) is None


def test_auto_with_a_profile_stays_exact_under_the_interpreter():
    pytest.importorskip("triton")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 32, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 32, 16)).astype(np.float32) for _ in range(2))
    fn = lambda q, k, v: eins.attention(q, k, v, causal=True)  # noqa: E731
    want = eins.jit(fn)(q, k, v)
    before = LAUNCHES["attention"]
    got = eins.distribute(fn, devices=2, topology="hgx-h200:2").lower(q, k, v).compile(
        "interpret")(q, k, v)
    assert LAUNCHES["attention"] > before   # the Triton kernel ran (no table on the CPU)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cudnn_forced_on_a_block_sdpa_cannot_compute_fails_at_load():
    q = eins.ShapeDtype((4, 32, 16), "float16")
    k = eins.ShapeDtype((2, 32, 16), "float16")
    low = eins.distribute(lambda q, k, v: eins.attention(q, k, v, segments=(8, 32)),
                          devices=1, attention="cudnn").lower(q, k, k)
    with pytest.raises(eins.EinsError, match="attention='cudnn'.*packed segments"):
        low.compile("interpret")
