"""The SDPA attention path (eins/kernels/sdpa.py): ``attention(..., impl="sdpa")``
runs PyTorch's scaled_dot_product_attention on CPU tensors too, so its semantics are
checked here against eins's numpy reference kernel and an independent float64 loop over
heads; where it does not apply, ``why_not`` says why and a forced impl raises; the ``auto``
choice is tested as a decision on stand-in CUDA tensors; and ``eins.distribute(...,
attention="sdpa")`` runs a whole LLaMA block through it."""
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.kernels import KernelUnavailable, attention, flash, sdpa  # noqa: E402
from eins.kernels.attention import LAUNCHES, choose_impl  # noqa: E402
from eins.errors import PlanError, ShapeError  # noqa: E402
from eins.ir.primitive import get_primitive  # noqa: E402
from helpers import accumulation, assert_close, small_workloads  # noqa: E402

reference = get_primitive("attention").impl  # the numpy reference kernel


def qkv(b, hq, hkv, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(b, h, s, d, generator=g).to(dtype)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def ref(q, k, v, causal, scale=None):
    f = lambda t: t.float().numpy()  # noqa: E731 - the inputs' values, computed in float32
    return reference(f(q), f(k), f(v), causal=causal, segments=None, scale=scale)[0]


def close(got, want, dtype, sk):
    """Three chained accumulations (q.k over D, the softmax and p.v over the Sk keys), each
    rounded to ``dtype`` at most once (tests/helpers.assert_close's rule)."""
    assert_close(got.float().numpy(), want, n=sk, depth=3,
                 dtype={torch.float16: np.float16, torch.bfloat16: eins.bfloat16,
                        torch.float32: np.float32}[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_sdpa_matches_the_reference(dtype, causal, d):
    # 4 query heads on 2 kv heads (GQA through enable_gqa), an odd length, two batches
    q, k, v = qkv(2, 4, 2, 37, d, dtype, seed=d)
    before = sdpa.LAUNCHES["sdpa"]
    triton_before = LAUNCHES["attention"]
    out = attention(q, k, v, causal=causal, impl="sdpa")
    assert sdpa.LAUNCHES["sdpa"] == before + 1 and LAUNCHES["attention"] == triton_before
    assert out.dtype == dtype and out.shape == q.shape
    close(out, ref(q, k, v, causal), dtype, 37)


def test_a_single_segment_runs_sdpa_and_equals_unsegmented_attention():
    q, k, v = qkv(1, 4, 2, 16, 32, torch.float32, seed=3)
    before = sdpa.LAUNCHES["sdpa"]
    out = attention(q, k, v, causal=True, segments=(16,), impl="sdpa")   # was refused
    assert sdpa.LAUNCHES["sdpa"] == before + 1
    close(out, ref(q, k, v, True), torch.float32, 16)


def test_gqa_maps_query_head_h_to_kv_head_h_over_g():
    """An independent float64 loop: kv head g serves query heads g*G .. (g+1)*G-1 (the other
    common mapping, h % Hkv, differs here), with an explicit scale."""
    q, k, v = qkv(1, 6, 2, 11, 16, torch.float32, seed=3)
    out = attention(q, k, v, causal=True, scale=0.3, impl="sdpa").double().numpy()
    qd, kd, vd = (t.double().numpy()[0] for t in (q, k, v))
    tril = np.tril(np.ones((11, 11), bool))
    for h in range(6):
        g = h // 3
        s = np.where(tril, qd[h] @ kd[g].T * 0.3, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ vd[g]
        np.testing.assert_allclose(out[0, h], want, rtol=0, atol=1e-5)
        wrong = h % 2
        if wrong != g:
            assert not np.allclose(out[0, h], (p / p.sum(-1, keepdims=True)) @ vd[wrong],
                                   atol=1e-3)


def test_strided_out_and_batch_dims():
    # out a [B, H, S, D] view of a [B, S, H, D] buffer (the layout the heads merge from);
    # q/k/v with two batch dims
    q, k, v = (t.reshape(2, 1, *t.shape[1:]) for t in qkv(2, 4, 4, 19, 16, torch.float16, 7))
    buf = torch.full((2, 1, 19, 4, 16), 7.0, dtype=torch.float16)
    out = buf.transpose(-2, -3)
    assert not out.is_contiguous()
    res = attention(q, k, v, out, causal=False, impl="sdpa")
    assert res is out
    close(buf.transpose(-2, -3), ref(q, k, v, False), torch.float16, 19)


def test_non_causal_query_block_at_an_offset():
    # without causal masks or segments, positions do not matter: a query block of a
    # sequence split (q_offset > 0) over all keys is those rows of the whole
    q, k, v = qkv(1, 2, 1, 30, 16, torch.float32, seed=5)
    whole = ref(q, k, v, False)
    blk = q[..., 10:20, :].contiguous()
    out = attention(blk, k, v, causal=False, q_offset=10, impl="sdpa")
    close(out, whole[..., 10:20, :], torch.float32, 30)


def _why(q, k, out=None, **kw):
    args = dict(causal=True, segments=None, lse=None, q_offset=0, k_offset=0)
    args.update(kw)
    return sdpa.why_not(q, k, out, **args)


def test_why_not_names_each_reason():
    q, k, _ = qkv(1, 2, 1, 8, 16, torch.float16)
    assert _why(q, k) is None and _why(q, k, causal=False) is None
    assert "packed segments" in _why(q, k, segments=(3, 8))
    # one segment over every position of the block masks nothing: SDPA applies
    assert _why(q, k, segments=(8,)) is None and _why(q, k, segments=(8, 12)) is None
    assert _why(q, k, causal=False, segments=(4, 12, 16), q_offset=4, k_offset=4) is None
    assert "packed segments" in _why(q, k, causal=False, segments=(4, 12), q_offset=4,
                                     k_offset=5)   # keys 5..12 cross the end at 12
    assert "log-sum-exp" in _why(q, k, lse=torch.empty(1, 2, 8))
    assert "q_offset=4, k_offset=0" in _why(q, k, q_offset=4)
    assert "Sq=8 != Sk=5" in _why(q, k[..., :5, :])
    assert _why(q, k[..., :5, :], causal=False) is None   # no mask: any Sk
    assert "out is torch.float32" in _why(q, k, out=torch.empty(q.shape))
    wide = torch.zeros(1, 1, 4, 320, dtype=torch.float16)
    assert "head dim 320 > 256" in _why(wide, wide)
    # auto also asks for CUDA 16-bit tensors (these are CPU tensors)
    assert "not on a GPU" in _why(q, k, auto=True)


def test_forcing_sdpa_where_it_does_not_apply_names_why():
    q, k, v = qkv(1, 2, 1, 8, 16, torch.float32)
    with pytest.raises(KernelUnavailable, match="SDPA does not compute this attention "
                                                "exactly: packed segments"):
        attention(q, k, v, segments=(3, 8), impl="sdpa")
    with pytest.raises(KernelUnavailable, match="log-sum-exp"):
        attention(q, k, v, lse=torch.empty(1, 2, 8), impl="sdpa")
    with pytest.raises(KernelUnavailable, match="q_offset=2"):
        attention(q[..., 2:, :].contiguous(), k, v, q_offset=2, impl="sdpa")
    with pytest.raises(ShapeError, match=r"impl must be one of \['auto', 'triton', 'sdpa', "
                                         r"'cudnn', 'flash_attn'\], got 'xformers'"):
        attention(q, k, v, impl="xformers")
    with pytest.raises(KernelUnavailable, match="cuDNN backend does not compute this "
                                                "attention exactly: tensors are not on a GPU"):
        attention(q, k, v, impl="cudnn")


class FakeCuda:
    """Just what the decision reads of a CUDA tensor: device, dtype, shape, stride."""

    def __init__(self, shape, dtype=torch.float16):
        self.shape, self.dtype = torch.Size(shape), dtype
        self.device = SimpleNamespace(type="cuda")

    def stride(self):
        return tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))


def _choose(q, k, impl="auto", **kw):
    args = dict(causal=True, segments=None, lse=None, q_offset=0, k_offset=0)
    args.update(kw)
    return choose_impl(q, k, k, q if not isinstance(q, FakeCuda) else None, impl=impl, **args)


def test_auto_choice_on_cuda_eligibility(monkeypatch):
    fused = {"why": None}   # what torch's can_use_* checks would say on the GPU
    monkeypatch.setattr(sdpa, "fused_backend_why_not", lambda q, k, v, causal: fused["why"])
    monkeypatch.setattr(flash, "flash_attn_module", lambda: None)   # not installed
    q, k = FakeCuda((1, 4, 64, 128)), FakeCuda((1, 1, 64, 128))
    assert _choose(q, k) == "sdpa"
    assert _choose(q, k, causal=False) == "sdpa"
    assert _choose(FakeCuda((1, 4, 64, 128), torch.bfloat16),
                   FakeCuda((1, 1, 64, 128), torch.bfloat16)) == "sdpa"
    # what SDPA cannot compute exactly, or auto leaves to Triton
    assert _choose(q, k, segments=(20, 64)) == "triton"
    assert _choose(q, k, lse=object()) == "triton"
    assert _choose(q, k, q_offset=32) == "triton"
    assert _choose(FakeCuda((1, 4, 64, 128), torch.float32),
                   FakeCuda((1, 1, 64, 128), torch.float32)) == "triton"
    fused["why"] = "no fused SDPA backend takes these tensors"
    assert _choose(q, k) == "triton"
    assert _choose(q, k, impl="sdpa") == "sdpa"   # forced: only the semantics are checked
    assert _choose(q, k, impl="triton") == "triton"
    # flash-attn importable: first, also for packed segments
    monkeypatch.setattr(flash, "flash_attn_module",
                        lambda: SimpleNamespace(flash_attn_varlen_func=None))
    assert _choose(q, k) == "flash_attn" and _choose(q, k, segments=(20, 64)) == "flash_attn"
    assert _choose(q, k, lse=object()) == "triton"
    # CPU tensors: auto is always the Triton kernel (the interpreter)
    qc, kc, _ = qkv(1, 4, 1, 8, 16, torch.float16)
    assert _choose(qc, kc) == "triton" and _choose(qc, kc, impl="sdpa") == "sdpa"


def test_fused_backend_probe_asks_torch_once_per_layout(monkeypatch):
    # torch's own checks run (on CPU tensors no CUDA backend takes them), once per layout
    import torch.backends.cuda as tbc
    calls = []
    real = tbc.can_use_flash_attention
    monkeypatch.setattr(tbc, "can_use_flash_attention",
                        lambda p, debug=False: calls.append(1) or real(p, debug))
    q, k, _ = qkv(1, 4, 2, 8, 24, torch.float16, seed=8)
    assert "math backend" in sdpa.fused_backend_why_not(q, k, k, True)
    assert "math backend" in sdpa.fused_backend_why_not(q, k, k, True)
    assert len(calls) == 1


# ----------------------------------------------------------------------------- whole programs
def test_distributed_llama_block_forced_to_sdpa_equals_jit():
    fn, args = small_workloads()["llama-batched"]   # causal GQA, no packed segments
    want = eins.jit(fn)(*args)
    n, depth = accumulation(eins.make_ir(fn)(*args))
    for p in (1, 2):
        before, triton_before = sdpa.LAUNCHES["sdpa"], LAUNCHES["attention"]
        got = eins.distribute(fn, devices=p, backend="interpret", attention="sdpa")(*args)
        assert_close(np.asarray(got), np.asarray(want), n=n, depth=depth)
        assert sdpa.LAUNCHES["sdpa"] > before and LAUNCHES["attention"] == triton_before
    # the default on CPU tensors: the Triton kernel
    before = sdpa.LAUNCHES["sdpa"]
    got = eins.distribute(fn, devices=2, backend="interpret")(*args)
    assert_close(np.asarray(got), np.asarray(want), n=n, depth=depth)
    assert sdpa.LAUNCHES["sdpa"] == before


def test_forced_sdpa_on_a_causal_query_split_names_the_block():
    fn, args = small_workloads()["llama-batched"]
    prog = eins.make_ir(fn)(*args)
    (i,) = [j for j, e in enumerate(prog.eqns) if e.prim == "attention"]
    d = eins.distribute(fn, devices=2, plan={i: {"sequence": 2}}, backend="interpret",
                        attention="sdpa", graphs=False)
    with pytest.raises(KernelUnavailable, match=r"causal block at q_offset=\d+"):
        d(*args)
    # at compile time, naming the device and the eqn (it was found at the first call)
    low = d.lower(*args)
    with pytest.raises(KernelUnavailable, match=rf"attention='sdpa': device 1's block of eqn "
                                                rf"{i} is one SDPA does not compute exactly: "
                                                rf"a causal block at q_offset=\d+"):
        low.compile("interpret")


def test_attention_option_is_checked_where_given():
    with pytest.raises(PlanError, match=r"unknown attention 'xformers'; choose one of "
                                        r"\['auto', 'triton', 'sdpa', 'cudnn', 'flash_attn'\]"):
        eins.distribute(lambda x: x, devices=1, attention="xformers")


def test_rank_kernel_set_runs_whole_attention_with_its_impl():
    # the torch kernel set of devices="world" ranks (interpret: CPU tensors): its
    # ``attention`` (set from Options.attention by eins.world) reaches the launcher
    from eins.ir.joinagg import FunctionSpec
    from eins.ir.types import Box
    from eins.runtime.ranks import make_kernels
    rng = np.random.default_rng(4)
    q = rng.standard_normal((4, 12, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 12, 8)).astype(np.float32) for _ in range(2))
    fn = lambda q, k, v: eins.attention(q, k, v, causal=True)  # noqa: E731
    (eqn,) = eins.make_ir(fn)(q, k, v).eqns
    f = FunctionSpec((Box((0, 0, 0), (4, 12, 8)), Box((0, 0, 0), (2, 12, 8)),
                      Box((0, 0, 0), (2, 12, 8))), (Box((0, 0, 0), (4, 12, 8)),))
    want = eins.jit(fn)(q, k, v)
    for impl, ran in (("sdpa", sdpa.LAUNCHES), ("triton", LAUNCHES)):
        tk = make_kernels("interpret")
        tk.attention = impl
        key = "sdpa" if impl == "sdpa" else "attention"
        before = ran[key]
        (t,) = tk.kernel(eqn, f, [tk.load(b, np.float32) for b in (q, k, v)], [np.float32])
        assert ran[key] == before + 1
        assert_close(tk.to_host(t), want, n=12, depth=3)


def test_a_cudnn_only_case_counts_as_fused_only_where_cudnn_comes_before_math(monkeypatch):
    """SDPA runs the FIRST backend of its priority order that takes the tensors; by default
    math comes before cuDNN (torch promotes cuDNN only on some GPUs and builds), so where
    only cuDNN would take them the S x S math backend runs, which auto must not pick."""
    import torch.backends.cuda as tbc
    monkeypatch.setattr(tbc, "can_use_flash_attention", lambda p, debug=False: False)
    monkeypatch.setattr(tbc, "can_use_efficient_attention", lambda p, debug=False: False)
    monkeypatch.setattr(tbc, "can_use_cudnn_attention", lambda p, debug=False: True)
    flash_b, eff, math_b, cudnn = 1, 2, 0, 3    # torch.nn.attention.SDPBackend values
    order = {"now": [flash_b, eff, math_b, cudnn]}   # torch's default
    monkeypatch.setattr(sdpa, "priority_order", lambda: order["now"])
    # head dims no other test probes (the answers are cached per layout)
    q, k, _ = qkv(1, 4, 2, 8, 40, torch.float16, seed=9)
    assert "math backend" in sdpa.fused_backend_why_not(q, k, k, True)
    order["now"] = [cudnn, flash_b, eff, math_b]     # cuDNN preferred
    q, k, _ = qkv(1, 4, 2, 8, 56, torch.float16, seed=9)
    assert sdpa.fused_backend_why_not(q, k, k, True) is None


@pytest.mark.parametrize("impl,message", [
    ("triton", r"attention='triton': no such kernel for operands \['torch.float64'\]"),
    # found when compiling, before the call runs anything
    ("sdpa", r"attention='sdpa': device 0's block of eqn \d+ is one SDPA does not compute "
             r"exactly: dtype torch.float64")])
def test_forced_attention_kernel_on_float64_is_refused_by_name(impl, message):
    """float64 attention has no Triton or SDPA path here: a forced impl says so instead of
    silently running the S x S torch lowering; "auto" runs that lowering and equals jit."""
    fn, args = small_workloads()["llama-batched"]
    args64 = [np.asarray(a, dtype=np.float64) if np.asarray(a).dtype.kind == "f" else a
              for a in args]
    with pytest.raises(KernelUnavailable, match=message):
        eins.distribute(fn, devices=1, backend="interpret", attention=impl,
                        graphs=False)(*args64)
    want = eins.jit(fn)(*args64)
    got = eins.distribute(fn, devices=1, backend="interpret", graphs=False)(*args64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-10)
