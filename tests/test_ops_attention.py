"""attention: the kernel against an independent per-head numpy formula (GQA, causal, packed
segments, batch dims, dtypes; eager and under eins.jit), errors, flops, and its join-agg specs
(paper Example 3.10: heads_kv carries the query-head groups, sequence splits at segment ends)."""
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eins
from eins.errors import DTypeError, EinsError, ShapeError
from eins.ir.types import Box, TensorType, bfloat16
from eins.ops import get_primitive
from helpers import all_decompositions, assert_close, check_specs


def _ref_attention(q, k, v, causal=True, segments=None, scale=None):
    """Per (batch, query head): masked softmax(q k^T * scale) v in float64; query head h
    reads kv head h // (Hq/Hkv); token i may see token j iff both lie in the same segment
    (and j <= i when causal)."""
    *batch, hq, s, d = q.shape
    hkv = k.shape[-3]
    scale = 1 / np.sqrt(d) if scale is None else scale
    ends = np.array(segments or (s,))
    seg = np.searchsorted(ends, np.arange(s), side="right")
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= np.arange(s)[None, :] <= np.arange(s)[:, None]
    qb = q.astype(np.float64).reshape(-1, hq, s, d)
    kb = k.astype(np.float64).reshape(-1, hkv, s, d)
    vb = v.astype(np.float64).reshape(-1, hkv, s, d)
    out = np.empty_like(qb)
    for b in range(qb.shape[0]):
        for h in range(hq):
            kv = h // (hq // hkv)
            sc = np.where(allowed, qb[b, h] @ kb[b, kv].T * scale, -np.inf)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[b, h] = (p / p.sum(-1, keepdims=True)) @ vb[b, kv]
    return out.reshape(q.shape)


def _qkv(batch=(), hq=8, hkv=2, s=8, d=4, dtype=np.float32, seed=0):
    r = np.random.default_rng(seed)
    return (r.standard_normal((*batch, hq, s, d)).astype(dtype),
            r.standard_normal((*batch, hkv, s, d)).astype(dtype),
            r.standard_normal((*batch, hkv, s, d)).astype(dtype))


def close(got, want, k, dtype=None):
    """Attention chains three accumulations (q.k over head_dim, the softmax's sum and p.v over
    the keys): the tolerance follows the longest, max(keys, head_dim), of ``k``'s shape."""
    assert_close(got, want, n=max(k.shape[-2:]), depth=3, dtype=dtype)


def spec_tol(k):
    return {"n": max(k.shape[-2:]), "depth": 3}


@pytest.mark.parametrize("batch", [(), (2,)])
@pytest.mark.parametrize("segments", [None, (3, 4, 8)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (2, 2)])
def test_attention_matches_formula(hq, hkv, causal, segments, batch):
    q, k, v = _qkv(batch, hq, hkv)
    want = _ref_attention(q, k, v, causal, segments)
    got = eins.attention(q, k, v, causal=causal, segments=segments)
    assert got.shape == q.shape and got.dtype == np.float32
    close(got, want, k)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16, np.float64])
def test_attention_dtypes_eager_and_jit(dtype):
    q, k, v = _qkv((2,), 4, 1, s=6, d=8, dtype=dtype)
    want = _ref_attention(q, k, v, True, (2, 6))
    f = eins.jit(lambda q, k, v: eins.attention(q, k, v, segments=(2, 6)))
    for got in (eins.attention(q, k, v, segments=[2, 6]), f(q, k, v)):
        assert got.dtype == np.dtype(dtype) and got.shape == q.shape
        close(got, want, k)


def test_explicit_scale_and_two_batch_dims():
    q, k, v = _qkv((2, 3), 4, 2, s=5, d=4)
    close(eins.attention(q, k, v, causal=False, scale=0.3),
          _ref_attention(q, k, v, False, None, 0.3), k)


def test_query_head_groups_read_their_kv_head():
    # kv head g's values are all g, so every query head h of group h // 4 outputs exactly g
    q, k, _ = _qkv((), 8, 2, s=5, d=4)
    v = np.broadcast_to(np.arange(2, dtype=np.float32)[:, None, None], (2, 5, 4)).copy()
    out = eins.attention(q, k, v, causal=False)
    np.testing.assert_array_equal(out[:4], np.zeros((4, 5, 4)))
    close(out[4:], np.ones((4, 5, 4)), k, dtype=v.dtype)


def test_segments_and_causality_isolate_tokens():
    q, k, v = _qkv((), 4, 4, s=8, d=4)
    base = eins.attention(q, k, v, causal=True, segments=(3, 8))
    k2, v2 = k.copy(), v.copy()
    k2[:, 5:], v2[:, 5:] = 7.0, -3.0  # the future of token 4 in the second segment
    out = eins.attention(q, k2, v2, causal=True, segments=(3, 8))
    np.testing.assert_array_equal(out[:, :5], base[:, :5])
    assert not np.allclose(out[:, 5:], base[:, 5:])
    k3, v3 = k.copy(), v.copy()
    k3[:, 3:], v3[:, 3:] = 7.0, -3.0  # all of the second segment: the first is unchanged
    out = eins.attention(q, k3, v3, causal=False, segments=(3, 8))
    np.testing.assert_allclose(out[:, :3], eins.attention(q, k, v, causal=False, segments=(3, 8))[:, :3],
                               rtol=0, atol=0)
    # the first token of a causal segment sees only itself
    close(base[:, 3], v[:, 3], k)


def test_float16_scores_are_computed_in_float32():
    # q.k = 64 * 40 * 40 = 102400 overflows float16; a float16 kernel would give NaN
    q = np.full((1, 3, 64), 40.0, np.float16)
    k = np.full((1, 3, 64), 40.0, np.float16)
    v = np.arange(3 * 64, dtype=np.float16).reshape(1, 3, 64) / 64
    got = eins.attention(q, k, v, causal=True, scale=1.0)
    assert np.isfinite(got.astype(np.float32)).all()
    close(got, _ref_attention(q, k, v, True, None, 1.0), k)


def test_ir_dump_shows_params():
    p = eins.make_ir(lambda q, k, v: eins.attention(q, k, v, causal=False, segments=[4, 8], scale=0.5))(
        eins.ShapeDtype((2, 8, 8, 16), "bf16"), eins.ShapeDtype((2, 2, 8, 16), "bf16"),
        eins.ShapeDtype((2, 2, 8, 16), "bf16"))
    assert ("d:bf16[2,8,8,16] = attention[causal=False scale=0.5 segments=(4,8)] a b c"
            in str(p))


def test_exports_and_flops():
    assert eins.attention is eins.ops.attention and "attention" in eins.ops.__all__
    prim = get_primitive("attention")
    f32 = np.dtype(np.float32)
    q, kv = TensorType((2, 8, 16, 4), f32), TensorType((2, 2, 16, 4), f32)
    full = 4 * 2 * 8 * 16 * 16 * 4
    assert prim.flops([q, kv, kv], [q], causal=False, segments=None, scale=None) == full
    # causal: row i sees i + 1 keys, L(L+1)/2 pairs (the diagonal counts)
    assert prim.flops([q, kv, kv], [q], causal=True, segments=None, scale=None) == (
        4 * 2 * 8 * 4 * (16 * 17 // 2))
    # packed segments attend only within themselves: 4*B*Hq*D*sum(L^2)
    assert prim.flops([q, kv, kv], [q], causal=False, segments=(4, 16), scale=None) == (
        4 * 2 * 8 * 4 * (4 * 4 + 12 * 12))


# --------------------------------------------------------------------------- errors
def _sd(*shape):
    return eins.ShapeDtype(shape, "float32")


def test_head_count_error_names_counts_and_line():
    def f(q, k, v):
        return eins.attention(q, k, v)

    with pytest.raises(ShapeError) as e:
        eins.make_ir(f)(_sd(6, 8, 4), _sd(4, 8, 4), _sd(4, 8, 4))
    msg = str(e.value)
    assert "Hq=6" in msg and "Hkv=4" in msg and "(6, 8, 4)" in msg and "test_ops_attention.py:" in msg


@pytest.mark.parametrize("shapes,pattern", [
    (((8, 4), (2, 8, 4), (2, 8, 4)), r"q must be \[\.\.\., heads, S, D\], got shape \(8, 4\)"),
    # the value head size may differ (v [..., Hkv, Sk, Dv]); the key length may not
    (((4, 8, 4), (2, 8, 4), (2, 7, 4)), r"k and v shapes differ: \(2, 8, 4\) vs \(2, 7, 4\)"),
    (((2, 4, 8, 4), (3, 2, 8, 4), (3, 2, 8, 4)), r"batch dims of q \(2,\) and k/v \(3,\) differ"),
    (((4, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)), r"batch dims of q \(\) and k/v \(2,\) differ"),
    (((4, 8, 4), (2, 8, 3), (2, 8, 3)), r"head dims differ: q has D=4, k/v have D=3"),
    (((4, 8, 4), (3, 8, 4), (3, 8, 4)), r"query heads Hq=4 must be a multiple of key/value heads Hkv=3"),
])
def test_shape_errors(shapes, pattern):
    with pytest.raises(ShapeError, match="attention: " + pattern):
        eins.make_ir(eins.attention)(*(_sd(*s) for s in shapes))


@pytest.mark.parametrize("segments", [(4, 3, 8), (3, 3, 8), (3, 6), (0, 8), (), (2.5, 8), (3, 9)])
def test_bad_segments(segments):
    q, k, v = _qkv((), 4, 2, s=8)
    with pytest.raises(ShapeError, match=r"segments must be strictly increasing positive end "
                                         r"positions ending at the sequence length S=8, got "
                                         + re.escape(str(tuple(segments)))):
        eins.attention(q, k, v, segments=segments)


def test_segments_that_are_not_a_sequence():
    q, k, v = _qkv((), 4, 2, s=8)
    with pytest.raises(ShapeError, match="segments must be a tuple of end positions or an "
                                         "int array of them, got 8"):
        eins.attention(q, k, v, segments=8)


def test_integer_operands_are_an_error():
    with pytest.raises(DTypeError, match=r"attention: needs floating-point.*int32"):
        eins.make_ir(eins.attention)(*(eins.ShapeDtype((2, 4, 4), "int32") for _ in range(3)))


# --------------------------------------------------------------------------- join-agg specs
def _indexing(qs, kvs, causal=True, segments=None):
    prim = get_primitive("attention")
    ins = [TensorType(s, np.dtype(np.float16)) for s in (qs, kvs, kvs)]
    params = dict(causal=causal, segments=segments, scale=None)
    return prim.indexing(ins, prim.abstract(*ins, **params), **params)


def test_example_3_10_heads_kv_carries_query_head_groups():
    ix = _indexing((32, 4096, 128), (8, 4096, 128), segments=(1024, 2560, 4096))
    assert ix.extents == {"heads_kv": 8, "sequence": 4096, "kv_sequence": 4096, "head_dim": 128}
    assert ix.shardable == {"heads_kv": "any", "sequence": "any", "kv_sequence": "any"}
    spec = ix.spec({"heads_kv": tuple((m, m + 1) for m in range(8))})
    assert len(spec) == 8 and spec.aggs == (None,)
    for m, f in enumerate(spec.fspecs):
        qbox = Box((4 * m, 0, 0), (4 * m + 4, 4096, 128))
        kvbox = Box((m, 0, 0), (m + 1, 4096, 128))
        assert f.inputs == (qbox, kvbox, kvbox) and f.outputs == (qbox,)
    spec = ix.spec({"heads_kv": ((0, 3), (3, 8)), "sequence": ((0, 1024), (1024, 4096))})
    assert [f.outputs[0] for f in spec.fspecs] == [
        Box((0, 0, 0), (12, 1024, 128)), Box((0, 1024, 0), (12, 4096, 128)),
        Box((12, 0, 0), (32, 1024, 128)), Box((12, 1024, 0), (32, 4096, 128))]
    assert spec.fspecs[3].inputs[1] == Box((3, 1024, 0), (8, 4096, 128))


def test_indexing_batch_dims_and_sequence_splits():
    ix = _indexing((2, 32, 1024, 128), (2, 8, 1024, 128))
    assert ix.extents == {"batch": 2, "heads_kv": 8, "sequence": 1024, "kv_sequence": 1024,
                          "head_dim": 128}
    assert ix.shardable == {"batch": "any", "heads_kv": "any", "sequence": "any",
                            "kv_sequence": "any"}
    # causal query split: the second block reads the key prefix [0, 1024)
    spec = ix.spec({"sequence": ((0, 512), (512, 1024))})
    assert spec.aggs == (None,)
    assert spec.fspecs[1].inputs[0] == Box((0, 0, 512, 0), (2, 32, 1024, 128))
    assert spec.fspecs[1].inputs[1] == Box((0, 0, 0, 0), (2, 8, 1024, 128))
    assert spec.fspecs[0].inputs[1] == Box((0, 0, 0, 0), (2, 8, 512, 128))
    # key split: every block has all query rows, its own keys, and ⊕ = lse
    spec = ix.spec({"kv_sequence": ((0, 512), (512, 1024))})
    assert spec.aggs == ("lse",)
    assert [f.inputs[1] for f in spec.fspecs] == [Box((0, 0, 0, 0), (2, 8, 512, 128)),
                                                  Box((0, 0, 512, 0), (2, 8, 1024, 128))]
    assert {f.outputs[0] for f in spec.fspecs} == {Box.full((2, 32, 1024, 128))}
    with pytest.raises(EinsError, match="'head_dim' is not shardable"):
        ix.spec({"head_dim": ((0, 64), (64, 128))})
    f = ix.spec({"batch": ((0, 1), (1, 2))}).fspecs[1]
    assert f.inputs[0] == Box((1, 0, 0, 0), (2, 32, 1024, 128))
    ix2 = _indexing((2, 3, 4, 8, 4), (2, 3, 2, 8, 4), segments=(8,))
    assert set(ix2.shardable) == {"batch0", "batch1", "heads_kv", "sequence", "kv_sequence"}


def test_query_blocks_read_the_keys_of_their_segments():
    # segments [0,3) [3,4) [4,8): a cut inside [4,8) at 6
    ix = _indexing((8, 8, 4), (2, 8, 4), segments=(3, 4, 8))
    spec = ix.spec({"sequence": ((0, 6), (6, 8))})
    assert [f.inputs[1].lo[1:2] + f.inputs[1].hi[1:2] for f in spec.fspecs] == [(0, 6), (4, 8)]
    ix = _indexing((8, 8, 4), (2, 8, 4), causal=False, segments=(3, 4, 8))
    spec = ix.spec({"sequence": ((0, 2), (2, 6), (6, 8))})
    # non-causal: a block reads its segments whole
    assert [f.inputs[1].lo[1:2] + f.inputs[1].hi[1:2] for f in spec.fspecs] == [
        (0, 3), (0, 8), (4, 8)]


def test_block_kernel_rebases_segments_and_rejects_missing_keys():
    prim = get_primitive("attention")
    q, k, v = _qkv((2,), 4, 2, s=8)
    params = dict(causal=True, segments=(3, 4, 8), scale=None)
    whole = prim.impl(q, k, v, **params)[0]
    qb, kvb = Box((0, 0, 3, 0), (2, 4, 8, 4)), Box((0, 0, 3, 0), (2, 2, 8, 4))
    from eins.ir.joinagg import FunctionSpec
    got = prim.run_block(FunctionSpec((qb, kvb, kvb), (qb,)), q[:, :, 3:], k[:, :, 3:],
                         v[:, :, 3:], **params)[0]
    close(got, whole[:, :, 3:], k)
    # rows [5, 8) attend to keys [4, 8): a block holding keys [5, 8) would be a partial
    qb, kvb = Box((0, 0, 5, 0), (2, 4, 8, 4)), Box((0, 0, 5, 0), (2, 2, 8, 4))
    with pytest.raises(EinsError, match=r"query rows \[5, 8\) attend to keys \[4, 8\), but the "
                                        r"block holds keys \[5, 8\)"):
        prim.run_block(FunctionSpec((qb, kvb, kvb), (qb,)), q[:, :, 5:], k[:, :, 5:],
                       v[:, :, 5:], **params)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("batch,hq,hkv,segments", [
    ((2,), 8, 2, (3, 4, 8)), ((), 4, 4, (2, 5, 8)), ((2,), 4, 1, None), ((3,), 6, 3, (1, 8))])
def test_every_spec_recomposes_to_the_whole_result(batch, hq, hkv, segments, causal):
    q, k, v = _qkv(batch, hq, hkv, s=8)
    n = check_specs("attention", [q, k, v], dict(causal=causal, segments=segments, scale=None),
                    decomps=all_decompositions, **spec_tol(k)).decomps
    # batch, heads_kv, sequence and kv_sequence each split 1..3 ways
    assert n == math.prod(min(b, 3) for b in batch) * min(hkv, 3) * 3 * 3


@pytest.mark.parametrize("qs,kvs", [((2, 0, 4), (1, 0, 4)), ((0, 2, 3, 4), (0, 1, 3, 4)),
                                    ((2, 3, 0), (1, 3, 0))])
def test_empty_shapes(qs, kvs):
    q, k = np.ones(qs, np.float32), np.ones(kvs, np.float32)
    assert eins.attention(q, k, k).shape == qs


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_configurations_match_formula_and_specs(data):
    hkv = data.draw(st.integers(1, 2))
    g = data.draw(st.sampled_from([1, 2, 4]))
    s = data.draw(st.integers(1, 9))
    cuts = data.draw(st.sets(st.integers(1, s - 1), max_size=3)) if s > 1 else set()
    segments = tuple(sorted(cuts)) + (s,) if data.draw(st.booleans()) else None
    causal = data.draw(st.booleans())
    batch = data.draw(st.sampled_from([(), (1,), (2,)]))
    q, k, v = _qkv(batch, hkv * g, hkv, s=s, d=2, seed=s)
    got = eins.attention(q, k, v, causal=causal, segments=segments)
    close(got, _ref_attention(q, k, v, causal, segments), k)
    check_specs("attention", [q, k, v], dict(causal=causal, segments=segments, scale=None),
                decomps=all_decompositions, **spec_tol(k))


@pytest.mark.parametrize("plan", [None, {0: {"sequence": 2}}, {0: {"kv_sequence": 4}},
                                  {0: {"sequence": 2, "kv_sequence": 2}}])
def test_a_masked_non_finite_value_changes_no_row_that_does_not_see_it(plan):
    """Under causal masking a row's weight for a later key is exactly 0, and 0 * inf is nan:
    an inf in v[6] made every row of the whole kernel (eins.jit) nan, and only the rows of
    the same block in a split plan, so the result depended on the plan."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 8, 4)).astype(np.float32) for _ in range(3))
    v[0, :, 6] = np.inf
    v[0, 1, 3, 1] = np.nan
    f = lambda q, k, v: eins.attention(q, k, v, causal=True)  # noqa: E731
    want = np.empty(q.shape)   # the formula over the keys each row sees, and only those
    for h in range(2):
        for i in range(8):
            sc = q[0, h, i].astype(np.float64) @ k[0, h, :i + 1].T.astype(np.float64) / 2
            w = np.exp(sc - sc.max())
            want[0, h, i] = (w / w.sum()) @ v[0, h, :i + 1]
    got = eins.jit(f)(q, k, v) if plan is None else \
        eins.distribute(f, devices=4 if len(plan[0]) == 2 or "kv_sequence" in plan[0] else 2,
                        plan=plan)(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)   # nan and inf where they are
    assert np.isfinite(got[0, :, :6][:, :, [0, 2, 3]]).all()
    assert np.isfinite(got[0, 0, :6]).all() and np.isnan(got[0, 1, 3:, 1]).all()


# inf scores make nan rows on purpose (inf - inf); numpy warns of it in the reference
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["numpy", "interpret"])
@pytest.mark.parametrize("bad", ["q-nan", "q-inf", "k-nan", "k-inf"])
def test_a_non_finite_score_stays_nan_when_the_keys_are_split(bad, backend):
    """A nan or inf query or key makes the scores it meets non-finite and eins.jit's rows nan.
    Split by keys (kv_sequence, ⊕ = lse), those rows came out 0: the partials' nan lse read
    as -inf (the ⊕'s identity, "no visible key") in the block kernel, the numpy ⊕ and the
    Triton ⊕ kernel, so the result depended on the plan."""
    if backend == "interpret":
        pytest.importorskip("torch")
    q, k, v = (np.ones((1, 4, 2), np.float32) for _ in range(3))
    x = q if bad[0] == "q" else k
    x[0, 1, 0] = np.nan if bad.endswith("nan") else np.inf
    f = lambda q, k, v: eins.attention(q, k, v, causal=False)  # noqa: E731
    want = eins.jit(f)(q, k, v)
    assert np.isnan(want[0, 1]).all()
    got = eins.distribute(f, devices=2, plan={0: {"kv_sequence": 2}}, backend=backend)(q, k, v)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-6)


# a -inf in k meets zeros of q in the interpreter's q @ k tile: inf * 0, which numpy warns of
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["numpy", "interpret"])
@pytest.mark.parametrize("plan", [None, {0: {"sequence": 2}}, {0: {"kv_sequence": 2}}])
def test_a_row_whose_scores_are_all_minus_inf_is_zero_in_every_plan(plan, backend):
    """A -inf in k makes every score of a row -inf. The whole numpy kernel (eins.jit)
    subtracted the row's max, -inf, and wrote nan (-inf - -inf), while every block kernel
    and the Triton kernel treat the row as one that sees no key, the lse ⊕'s identity, and
    write 0: the result depended on the plan and the backend. Rows that see a finite score
    are unaffected (the -inf key gets weight 0)."""
    if backend == "interpret":
        pytest.importorskip("torch")
    q, k, v = (np.ones((1, 4, 2), np.float32) for _ in range(3))
    k[0, :2, 1] = -np.inf              # segment 0's keys
    q[0, 1] = [1.0, 0.0]               # row 1 meets 0 * -inf = nan: nan everywhere
    v[0, 2:] = [[2.0, 3.0], [4.0, 5.0]]
    f = lambda q, k, v: eins.attention(q, k, v, causal=False, segments=(2, 4))  # noqa: E731
    want = eins.jit(f)(q, k, v)
    np.testing.assert_array_equal(want[0, 0], [0, 0])
    assert np.isnan(want[0, 1]).all() and np.isfinite(want[0, 2:]).all()
    got = eins.distribute(f, devices=1 if plan is None else 2, plan=plan,
                          backend=backend)(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# the interpreter's tiles multiply a masked key's weight 0 by its inf value (docs/gpu.md)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", ["numpy", "interpret"])
@pytest.mark.parametrize("plan", [None, {0: {"sequence": 2}}, {0: {"kv_sequence": 2}}])
def test_a_key_with_a_minus_inf_score_adds_nothing_even_with_an_inf_value(plan, backend,
                                                                          dtype):
    """Key 1's score is -inf for every row (a -inf in k) and its value is inf. Row 1 sees
    only key 1: the all -inf row is 0, but the whole numpy kernel (eins.jit) and every
    kernel on the GPU path wrote weight 0 * inf = nan into it, while a key split dropped the
    block (lse -inf) and gave 0: the result depended on the plan. Rows 2 and 3 also see
    finite keys: in the numpy kernels the -inf-score key adds nothing there, as a masked
    key does (it was nan in some plans and not in others, by where the cut fell)."""
    if backend == "interpret":
        pytest.importorskip("torch")
    q, k, v = (np.ones((1, 4, 2), dtype) for _ in range(3))
    k[0, 1, 1] = -np.inf
    v[0, 1, 1] = np.inf
    v[0, 0, 0] = 2.0
    f = lambda q, k, v: eins.attention(q, k, v, causal=True, segments=(1, 4))  # noqa: E731
    want = eins.jit(f)(q, k, v)
    np.testing.assert_array_equal(want[0], [[2, 1], [0, 0], [1, 1], [1, 1]])
    got = eins.distribute(f, devices=1 if plan is None else 2, plan=plan,
                          backend=backend)(q, k, v)
    np.testing.assert_array_equal(got[0, 1], [0, 0])
    if backend == "numpy":
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_float64_key_split_partials_keep_a_nan_row_on_the_gpu_path():
    """float64 key-split partials run the torch lowering (no Triton kernel): its lse tested
    den > 0 as the block kernel did, so a nan query row came out 0 there (float32: nan)."""
    pytest.importorskip("torch")
    q, k, v = (np.ones((1, 4, 2), np.float64) for _ in range(3))
    q[0, 1, 0] = np.nan
    f = lambda q, k, v: eins.attention(q, k, v, causal=False)  # noqa: E731
    want = eins.jit(f)(q, k, v)
    got = eins.distribute(f, devices=2, plan={0: {"kv_sequence": 2}}, backend="interpret")(
        q, k, v)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 1]).all()
