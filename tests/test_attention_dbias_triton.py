"""The Triton kernel of attention_dbias (issue 36: the gradient of an additive bias or of
ALiBi slopes) under Triton's interpreter: against the numpy block kernel
(attention_bwd_blocks.dbias_block) on every option the backward kernel takes, in float32,
float16 and bfloat16; a capacity block (stale rows outside its table row) against the
per-cut block, with the work counted in the interpreter's multiplies; its errors; and which
eqns its capacity form masks (``Primitive.capacity_masks``)."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from eins.errors import ShapeError  # noqa: E402
from eins.ir.types import TensorType  # noqa: E402
from eins.kernels import attention_dbias as kdb  # noqa: E402
from eins.kernels.attention_dbias import attention_dbias  # noqa: E402
from eins.models import llama  # noqa: E402
from eins.ops import get_primitive  # noqa: E402
from helpers import torch_eps  # noqa: E402
from test_attention_bwd_rows import D, H, S, Dots, inputs, key_window, stale  # noqa: E402

DB = get_primitive("attention_dbias")
FWD = get_primitive("attention_fwd")

# name: (q shape, k shape, v's head dim, the bias's shape (ALiBi: its last dim Hq), the
# mask's shape or None, eqn params beyond causal/scale)
CASES = {
    "alibi gqa causal": ((4, 24, 8), (2, 24, 8), 8, (4,), None,
                         dict(bias="alibi")),
    "alibi batch-broadcast window softcap non-causal": (
        (2, 4, 20, 8), (2, 2, 20, 8), 8, (1, 4), None,
        dict(causal=False, window=5, softcap=2.0, bias="alibi")),
    "alibi key mask decode Dv != D": ((2, 2, 3, 8), (2, 1, 21, 8), 12, (2, 2), (2, 21),
                                      dict(bias="alibi", mask="keys", offset=18)),
    "alibi static segments full mask": ((4, 36, 8), (2, 36, 8), 8, (4,), (1, 36, 36),
                                        dict(bias="alibi", mask="full",
                                             segments=(5, 17, 30, 36))),
    "alibi runtime segments": ((4, 36, 8), (1, 36, 8), 8, (4,), None,
                               dict(bias="alibi", segments="array")),
    "add per head gqa causal": ((2, 4, 24, 8), (2, 2, 24, 8), 8, (2, 4, 24, 24), None,
                                dict(bias="add")),
    "add batch- and head-broadcast window": ((2, 4, 24, 8), (2, 2, 24, 8), 8,
                                             (1, 1, 24, 24), None,
                                             dict(bias="add", window=6)),
    "add one of two batch dims broadcast, softcap": (
        (2, 3, 2, 18, 8), (2, 3, 1, 18, 8), 8, (1, 3, 2, 18, 18), None,
        dict(bias="add", softcap=1.5, causal=False)),
    "add cross, full mask, offset, Dv != D": ((2, 2, 12, 8), (2, 1, 30, 8), 4,
                                              (2, 1, 12, 30), (2, 2, 12, 30),
                                              dict(bias="add", mask="full", offset=18,
                                                   causal=False)),
    "add static segments non-causal": ((2, 36, 8), (2, 36, 8), 8, (2, 36, 36), None,
                                       dict(bias="add", causal=False,
                                            segments=(10, 13, 30, 36))),
    "add runtime segments window key mask": ((4, 36, 8), (2, 36, 8), 8, (1, 36, 36), (36,),
                                             dict(bias="add", segments="array", window=9,
                                                  mask="keys")),
}


def _case(name, dtype, seed=0):
    """The eqn's operands (float32 numpy: q, k, v, dO rounded to ``dtype``, o and lse from
    the forward on them, o rounded too) and params."""
    qs, ks, dv, bs, ms, extra = CASES[name]
    rng = np.random.default_rng(seed)
    params = dict(dict(causal=True, segments=None, scale=None), **extra)
    q, k = (rng.standard_normal(s).astype(np.float32) for s in (qs, ks))
    v = rng.standard_normal(ks[:-1] + (dv,)).astype(np.float32)
    do = rng.standard_normal(qs[:-1] + (dv,)).astype(np.float32)
    tdt = getattr(torch, dtype)
    q, k, v, do = (torch.from_numpy(x).to(tdt).float().numpy() for x in (q, k, v, do))
    ops = []
    if ms is not None:
        m = rng.random(ms) > 0.3
        m[..., 0] = True
        ops.append(m)
    bias = (rng.uniform(0.1, 1.0, bs) if params["bias"] == "alibi" else
            rng.standard_normal(bs)).astype(np.float32)
    ops.append(torch.from_numpy(bias).to(tdt).float().numpy())
    if params["segments"] == "array":
        ops.append(llama.padded_ends((5, 17, 30, qs[-2]), 6, qs[-2]))
    o, lse = FWD.impl(q, k, v, *ops, **params)
    o = torch.from_numpy(o).to(tdt).float().numpy()
    return (q, k, v, o, lse.astype(np.float32), do, *ops), params


def _torch(ins, dtype):
    """The eqn's operands as torch tensors: q, k, v, o, dO and the bias in ``dtype``, the
    lse float32, the mask bool, the ends int."""
    tdt = getattr(torch, dtype)
    out = []
    for i, x in enumerate(ins):
        t = torch.from_numpy(np.ascontiguousarray(x))
        out.append(t.to(tdt) if t.dtype == torch.float32 and i != 4 else t)
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_the_numpy_block(name, dtype):
    """The kernel's gradient (written over nan) equals the numpy kernel's on the same
    (rounded) operands: float32 to float32 accumulation order, 16-bit to the rounding of
    the result to its dtype."""
    ins, params = _case(name, dtype)
    (want,) = DB.impl(*ins, **params)
    tins = _torch(ins, dtype)
    bias = tins[6 + bool(params.get("mask"))]
    out = torch.full(bias.shape, float("nan"), dtype=bias.dtype)
    low = DB.lowering()
    assert low.accepts([out], tins, params)
    before = kdb.LAUNCHES["attention_dbias"]
    low.fn(None, [out], tins, **params)
    assert kdb.LAUNCHES["attention_dbias"] == before + 1
    scale = max(1.0, float(np.abs(want).max()))
    tol = (2e-5 if dtype == "float32" else 2 * torch_eps(getattr(torch, dtype))) * scale
    assert np.abs(out.float().numpy() - want).max() <= tol, name
    assert np.abs(want).max() > 0.1   # a gradient that cannot be 0 by accident


def test_the_fallback_takes_what_the_kernel_does_not():
    """float64 operands, mixed dtypes or a float64 gradient: accepts refuses (the torch
    fallback runs), and the eqn's capacity form masks exactly there."""
    ins, params = _case("alibi gqa causal", "float32")
    tins = _torch(ins, "float32")
    out = torch.zeros(tins[6].shape)
    low = DB.lowering()
    assert low.accepts([out], tins, params)
    wide = [t.double() if t.is_floating_point() and i != 4 else t for i, t in enumerate(tins)]
    assert not low.accepts([out.double()], wide, params)
    mixed = list(tins)
    mixed[2] = mixed[2].half()
    assert not low.accepts([out], mixed, params)
    assert not low.accepts([out.double()], tins, params)
    types = [TensorType(tuple(t.shape), np.dtype(str(t.dtype).replace("torch.", "")))
             for t in tins]
    assert not DB.masks_capacity(params, types)
    for dt in ("float16", "bfloat16"):
        assert not DB.masks_capacity(params, [TensorType(t.shape, np.dtype(dt) if i != 4
                                                         else t.dtype)
                                              for i, t in enumerate(types)])
    assert DB.masks_capacity(params, [TensorType(t.shape, np.float64) for t in types])
    assert DB.masks_capacity(params, types[:2] + [TensorType(types[2].shape, np.float16)]
                             + types[3:])


def test_launcher_errors_name_the_value():
    ins, params = _case("add per head gqa causal", "float32")
    q, k, v, o, lse, do, bias = _torch(ins, "float32")
    with pytest.raises(ShapeError, match=r"attention_dbias: the gradient must be .* \(2, 4, "
                                         r"24, 24\), got torch.float32 \(2, 4, 24\)"):
        attention_dbias(q, k, v, o, lse, do, bias, torch.zeros(2, 4, 24), bias_kind="add")
    with pytest.raises(ShapeError, match=r"a add bias of shape \(3, 4, 24, 24\) does not "
                                         r"broadcast"):
        b3 = torch.zeros(3, 4, 24, 24)
        attention_dbias(q, k, v, o, lse, do, b3, b3.clone(), bias_kind="add")
    with pytest.raises(ShapeError, match="attention_dbias: window must be a positive int, "
                                         "got 0"):
        attention_dbias(q, k, v, o, lse, do, bias, bias.clone(), bias_kind="add", window=0)
    with pytest.raises(ShapeError, match="attention_dbias: a row table"):
        attention_dbias(q, k, v, o, lse, do, bias, bias.clone(), bias_kind="add",
                        segments=(24,), rows=torch.tensor([[0, 24, 0, 24]]))


# ------------------------------------------------------------------- the capacity form
def _bias(kind, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(H, generator=g) * 0.9 + 0.1 if kind == "alibi"
            else torch.randn(H, S, S, generator=g))


def _per_cut(ins, bias, kind, e, lo, hi, klo, khi, **kw):
    q, k, v, o, lse, do = ins
    r, c = slice(lo, hi), slice(klo, khi)
    b = bias if kind == "alibi" else bias[:, r, c].contiguous()
    out = torch.empty_like(b)
    attention_dbias(q[:, r], k[:, c], v[:, c], o[:, r], lse[:, r].contiguous(), do[:, r], b,
                    out, bias_kind=kind, segments=e, q_offset=lo, k_offset=klo, **kw)
    return out


ROWS = [((10, 40, 64), (16, 48), {}), ((10, 40, 64), (13, 45), {}),
        ((3, 5, 17, 64), (0, 16), {}), ((20, 64), (30, 50), {"window": 5, "causal": False}),
        ((33, 64), (16, 40), {"softcap": 2.0}), ((10, 40, 64), (21, 21), {})]


@pytest.mark.parametrize("kind", ["alibi", "add"])
@pytest.mark.parametrize("ends,rows,kw", ROWS)
def test_capacity_block_is_the_per_cut_block(monkeypatch, kind, ends, rows, kw):
    """A capacity block (every row and key; nan, inf and 3e38 outside its table row's rows
    and keys, in the operands and an additive bias) with its table row [lo, hi, klo, khi]:
    ALiBi's gradient equals the per-cut block's (rows [lo, hi), keys [klo, khi) at their
    offsets), an additive bias's equals it at those rows and keys and is exactly 0
    elsewhere; no RuntimeWarning; the interpreter multiplies as much as for the per-cut
    block (equal where the cut is tile-aligned, at most a tile per row or column of tiles
    more where not)."""
    lo, hi = rows
    causal = kw.get("causal", True)
    klo, khi = key_window(ends, lo, hi, causal, kw.get("window"))
    e = torch.tensor(llama.padded_ends(ends, 6, S))
    ins = inputs(3, ends, causal, kw.get("window"))
    bias = _bias(kind, 4)
    ins = with_bias(ins, bias, kind, ends, causal, kw)
    dots = Dots(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = []
        cut_work = dots.during(lambda: ref.append(_per_cut(ins, bias, kind, e, lo, hi, klo,
                                                           khi, **kw)))
        cap = stale(ins, lo, hi, klo, khi)
        cbias = bias.clone()
        if kind == "add":
            cbias[:, :lo], cbias[:, hi:], cbias[:, :, :klo] = float("nan"), float("inf"), 3e38
            cbias[:, :, khi:] = float("nan")
        out = torch.full_like(bias, 7.0)
        table = torch.tensor([[lo, hi, klo, khi]])
        cap_work = dots.during(lambda: attention_dbias(*cap, cbias, out, bias_kind=kind,
                                                       segments=e, rows=table, **kw))
    if kind == "alibi":
        torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out[:, lo:hi, klo:khi], ref[0], rtol=1e-5, atol=1e-5)
        inside = torch.zeros(S, S, dtype=torch.bool)
        inside[lo:hi, klo:khi] = True
        assert not out[:, ~inside].any()
    if lo % 16 == 0 and klo % 16 == 0:
        assert cap_work == cut_work
    else:   # a 16 x 16 tile is 2 dots over D (the scores, dP) per head
        assert cap_work <= cut_work + 2 * H * 16 * 16 * D * 2 * (S // 16)
    if hi > lo:
        assert cut_work > 0 and float(ref[0].abs().max()) > 0


def with_bias(ins, bias, kind, ends, causal, kw):
    """``ins`` with o and lse of the forward with ``bias`` (the options ``kw``)."""
    q, k, v, _, _, do = ins
    params = dict(kw, causal=causal, segments=tuple(ends), scale=None, bias=kind)
    o, lse = FWD.impl(q.numpy(), k.numpy(), v.numpy(), bias.numpy(), **params)
    return q, k, v, torch.from_numpy(o), torch.from_numpy(lse), do


@pytest.mark.parametrize("kind", ["alibi", "add"])
def test_capacity_work_is_the_cuts_not_the_capacity(monkeypatch, kind):
    """Four devices' table rows over one long document and short ones: the four capacity
    blocks together multiply exactly as much as the four per-cut blocks (all tile-aligned),
    well under four whole-block gradients (what the masked torch fallback computes), and
    their gradients sum to the whole block's."""
    ends = (40, 48, 56, 64)
    ins = inputs(5, ends, True)
    bias = _bias(kind, 6)
    ins = with_bias(ins, bias, kind, ends, True, {})
    e = torch.tensor(llama.padded_ends(ends, 6, S))
    dots = Dots(monkeypatch)
    cut = cap = 0
    total = torch.zeros_like(bias)
    for lo, hi in [(0, 32), (32, 48), (48, 56), (56, 64)]:
        klo, khi = key_window(ends, lo, hi, True)
        cut += dots.during(lambda: _per_cut(ins, bias, kind, e, lo, hi, klo, khi))
        out = torch.empty_like(bias)
        table = torch.tensor([[lo, hi, klo, khi]])
        cap += dots.during(lambda: attention_dbias(*ins, bias, out, bias_kind=kind,
                                                   segments=e, rows=table))
        total += out
    whole = torch.empty_like(bias)
    once = dots.during(lambda: attention_dbias(*ins, bias, whole, bias_kind=kind, segments=e))
    assert cap == cut and cap < 1.5 * once
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["alibi", "add"])
def test_lowering_without_a_function_spec(kind):
    """The GPU lowerings called with fspec=None (the whole eqn, as the kernel tests call
    them) in the capacity form (the runtime ends, then the table row last) equal the numpy
    kernels on the same operands: attention_dbias's gradient written over nan, its torch
    fallback's, and attention_bwd's, whose table is taken off the same way; an additive
    bias's gradient of another shape is the launcher's named error."""
    ends, (lo, hi) = (10, 40, 64), (16, 48)
    klo, khi = key_window(ends, lo, hi, True)
    bias = _bias(kind, 2)
    ins = with_bias(inputs(1, ends, True), bias, kind, ends, True, {})
    tins = [*ins, bias, torch.tensor(llama.padded_ends(ends, 6, S)),
            torch.tensor([[lo, hi, klo, khi]])]
    params = dict(causal=True, segments="array", scale=None, bias=kind, rows=True)
    (want,) = DB.impl(*(t.numpy() for t in tins), **params)
    out = torch.full_like(bias, float("nan"))
    low = DB.lowering()
    assert low.accepts([out], tins, params)
    low.fn(None, [out], tins, **params)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 0.1 and (kind == "alibi" or not want[:, :lo].any())
    (got,) = low.fallback(None, *tins, **params)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    bwd = get_primitive("attention_bwd")
    wants = bwd.impl(*(t.numpy() for t in tins), **params)
    grads = [torch.full(w.shape, float("nan")) for w in wants]
    bwd.lowering().fn(None, grads, tins, **params)
    for g, w in zip(grads, wants):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)
    if kind == "add":
        with pytest.raises(ShapeError, match=r"attention_dbias: the gradient must be .* "
                                             r"\(4, 64, 64\), got torch.float32 \(4, 64, 32\)"):
            low.fn(None, [torch.zeros(H, S, S // 2)], tins, **params)
