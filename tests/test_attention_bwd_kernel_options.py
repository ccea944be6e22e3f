"""The backward kernels with attention's options (issue 33: window, softcap, key and full
masks, ALiBi slopes and additive biases, query rows aligned with the last keys, Dv != D),
checked kernel by kernel against a dense pair-by-pair formula written here: the numpy block
kernel of attention_bwd against float64 central finite differences of that formula, the
blocks of a split summing to the whole, and the Triton backward (under the interpreter) and
the torch fallback against the numpy kernel."""
import numpy as np
import pytest

from eins.ir.joinagg import FunctionSpec
from eins.ir.types import Box
from eins.ops import get_primitive

BWD = get_primitive("attention_bwd")


def _dense(q, k, v, mask=None, bias=None, *, causal, window, softcap, offset, kinds):
    """o and lse of the options' attention, pair by pair (the semantics of
    eins/ops/attention.py): scores scale q.k, capped, biased (ALiBi: -slope |p - j|),
    hidden outside causal/window/mask; query row i at key position i + offset."""
    g = q.shape[-3] // k.shape[-3]
    kr, vr = np.repeat(k, g, -3), np.repeat(v, g, -3)
    s = np.einsum("...hid,...hjd->...hij", q, kr) / np.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    dist = np.arange(k.shape[-2])[None, :] - (np.arange(q.shape[-2]) + offset)[:, None]
    if kinds[1] == "alibi":
        s = s - bias[..., None, None] * np.abs(dist)
    elif kinds[1] == "add":
        s = s + bias
    seen = np.ones(dist.shape, bool)
    if causal:
        seen &= dist <= 0
    if window is not None:
        seen &= dist >= -(window - 1)
        if not causal:
            seen &= dist <= window - 1
    if kinds[0] == "keys":
        seen = seen & mask[..., None, None, :]
    elif kinds[0] == "full":
        seen = seen & mask
    s = np.where(seen, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    den = e.sum(-1, keepdims=True)
    o = np.where(den > 0, e / np.where(den > 0, den, 1), 0) @ vr
    with np.errstate(divide="ignore"):
        lse = np.where(den > 0, m + np.log(den), -np.inf)[..., 0]
    return o, lse


CASES = {  # name: (q, k, v shapes, causal, window, softcap, mask kind+shape, bias kind+shape)
    "window causal": (((4, 10, 4), (2, 10, 4), (2, 10, 4)), True, 3, None, None, None),
    "window non-causal softcap": (((4, 9, 4), (2, 9, 4), (2, 9, 4)), False, 4, 1.5, None,
                                  None),
    "key mask": (((2, 4, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)), False, None, None,
                 ("keys", (2, 8)), None),
    "full mask causal": (((2, 4, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)), True, None, None,
                         ("full", (2, 1, 8, 8)), None),
    "alibi window": (((4, 10, 4), (2, 10, 4), (2, 10, 4)), True, 4, None, None,
                     ("alibi", (4,))),
    "additive bias": (((2, 4, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)), False, 5, None, None,
                      ("add", (1, 4, 8, 8))),
    "chunked prefill Dv != D": (((4, 3, 4), (2, 9, 4), (2, 9, 6)), True, None, None, None,
                                None),
    "decode window": (((4, 1, 4), (2, 12, 4), (2, 12, 4)), True, 5, None, None, None),
    # 16x16 interpreter tiles: keys 16..31 padded away for every row, whole tiles skipped
    "padded keys": (((2, 2, 40, 4), (2, 1, 40, 4), (2, 1, 40, 4)), False, None, None,
                    ("keys", (2, 40)), None),
    "everything": (((2, 4, 12, 4), (2, 2, 12, 4), (2, 2, 12, 6)), True, 6, 2.0,
                   ("keys", (2, 12)), ("add", (2, 1, 12, 12))),
}


def _case(name, dtype=np.float64, seed=0):
    """(q, k, v, dO), the extra operands, the eqn parameters and the dense formula's
    keywords."""
    shapes, causal, window, softcap, mspec, bspec = CASES[name]
    rng = np.random.default_rng(seed)
    q, k, v = (rng.uniform(-2, 2, s).astype(dtype) for s in shapes)
    do = rng.uniform(-2, 2, q.shape[:-1] + v.shape[-1:]).astype(dtype)
    mask = rng.uniform(-2, 2, mspec[1]) > -1.5 if mspec else None
    if name == "padded keys":
        mask[..., 16:32] = False
    bias = None
    if bspec:
        bias = (rng.uniform(0.1, 0.6, bspec[1]) if bspec[0] == "alibi"
                else rng.uniform(-1, 1, bspec[1])).astype(dtype)
    kinds = (mspec[0] if mspec else None, bspec[0] if bspec else None)
    params = dict(causal=causal, segments=None, scale=None, window=window, softcap=softcap,
                  mask=kinds[0], bias=kinds[1], offset=k.shape[-2] - q.shape[-2])
    extra = tuple(x for x in (mask, bias) if x is not None)
    dense = dict(causal=causal, window=window, softcap=softcap, offset=params["offset"],
                 kinds=kinds, mask=mask, bias=bias)
    return (q, k, v, do), extra, params, dense


def _whole(ins):
    return FunctionSpec(tuple(Box.full(np.shape(x)) for x in ins),
                        tuple(Box.full(np.shape(x)) for x in ins[:3]))


def _central(f, args, i, h=1e-6):
    x = args[i]
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (f(*args[:i], xp, *args[i + 1:]) - f(*args[:i], xm, *args[i + 1:])) / (2 * h)
    return g


@pytest.mark.parametrize("name", list(CASES))
def test_numpy_kernel_equals_finite_differences_float64(name):
    (q, k, v, do), extra, params, dense = _case(name)
    o, lse = _dense(q, k, v, **dense)
    ins = (q, k, v, o, lse, do, *extra)
    got = BWD.run_block(_whole(ins), *ins, **params)

    def loss(q, k, v):
        return float((_dense(q, k, v, **dense)[0] * do).sum())
    for i, g in enumerate(got):
        fd = _central(loss, [q, k, v], i)
        assert g.shape == fd.shape and g.dtype == np.float64
        assert np.abs(g - fd).max() / np.abs(fd).max() < 1e-6, (name, "qkv"[i])


def _block_spec(ins, rows, keys, extra_kinds):
    """The function specification of query rows ``rows`` and key rows ``keys`` (global), the
    gradients written over the whole sequences (partials)."""
    q, k, v, o, lse, do = ins[:6]

    def rowbox(x, r, drop=0):
        lo, hi = [0] * x.ndim, list(x.shape)
        lo[x.ndim - 2 + drop], hi[x.ndim - 2 + drop] = r
        return Box(tuple(lo), tuple(hi))
    boxes = [rowbox(q, rows), rowbox(k, keys), rowbox(v, keys), rowbox(o, rows),
             rowbox(lse, rows, 1), rowbox(do, rows)]
    for x, kind in zip(ins[6:], extra_kinds):
        lo, hi = [0] * x.ndim, list(x.shape)
        if kind in ("keys", "full", "add"):
            lo[-1], hi[-1] = keys if x.shape[-1] > 1 else (0, 1)
        if kind in ("full", "add") and x.shape[-2] > 1:
            lo[-2], hi[-2] = rows
        boxes.append(Box(tuple(lo), tuple(hi)))
    return FunctionSpec(tuple(boxes), tuple(Box.full(x.shape) for x in ins[:3]))


@pytest.mark.parametrize("name", ["window causal", "key mask", "alibi window",
                                  "additive bias", "everything"])
def test_blocks_at_global_offsets_sum_to_the_whole(name):
    (q, k, v, do), extra, params, dense = _case(name, seed=1)
    o, lse = _dense(q, k, v, **dense)
    ins = (q, k, v, o, lse, do, *extra)
    want = BWD.run_block(_whole(ins), *ins, **params)
    kinds = [x for x in (params["mask"], params["bias"]) if x]
    sq, sk = q.shape[-2], k.shape[-2]
    total = [np.zeros_like(w) for w in want]
    for rows in ((0, sq // 2), (sq // 2, sq)):
        for keys in ((0, sk // 3), (sk // 3, sk)):
            f = _block_spec(ins, rows, keys, kinds)
            blocks = [x[b.relative_to(Box.full(x.shape))] for x, b in zip(ins, f.inputs)]
            for t, g in zip(total, BWD.run_block(f, *blocks, **params)):
                t += g
    for t, w in zip(total, want):
        np.testing.assert_allclose(t, w, rtol=1e-12, atol=1e-12)


torch = pytest.importorskip("torch")
pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_and_fallback_equal_the_numpy_kernel(name, dtype):
    from eins.kernels import attention_bwd as kbwd
    (q, k, v, do), extra, params, dense = _case(name, np.float32, seed=2)
    if dtype == "float16":   # the kernel's inputs, exactly
        q, k, v, do = (x.astype(np.float16).astype(np.float32) for x in (q, k, v, do))
    o, lse = _dense(q, k, v, **dense)
    o, lse = o.astype(dtype).astype(np.float32), lse.astype(np.float32)
    ins = (q, k, v, o, lse, do, *extra)
    want = BWD.run_block(_whole(ins), *ins, **params)
    tdt = getattr(torch, dtype)
    tins = [torch.from_numpy(np.ascontiguousarray(x)) for x in ins]
    tins = [t.to(tdt) if i in (0, 1, 2, 3, 5) else t for i, t in enumerate(tins)]
    low = BWD.lowering()
    outs = [torch.full(x.shape, float("nan"), dtype=tdt) for x in ins[:3]]
    assert low.accepts(outs, tins, params)
    before = kbwd.LAUNCHES["attention_bwd"]
    low.fn(None, outs, tins, **params)
    assert kbwd.LAUNCHES["attention_bwd"] == before + 1
    fallback = low.fallback(None, *tins, **params)
    # float16: P and dS rounded to float16 before their matmuls, the gradients once more
    tol = 2e-5 if dtype == "float32" else 8 * 2 ** -10
    for g, f, w in zip(outs, fallback, want):
        scale = max(1.0, float(np.abs(w).max()))
        assert np.abs(g.float().numpy() - w).max() <= tol * scale, name
        assert np.abs(f.float().numpy() - w).max() <= 2e-5 * scale, name
