"""Attention's backward (issue 34): attention_fwd saves the log-sum-exp, attention_bwd
recomputes the scores from it, attention's VJP rule joins them. Checked against float64
central finite differences, against eins.jit when distributed (every split kind forced, and
the DP free, naive and optimized schedules), by the spec validator, and by hand-counted
FLOPs and spec structures."""
import math

import numpy as np
import pytest

import eins
from eins import validate_specs
from eins.errors import EinsError, ShapeError
from eins.ir.joinagg import AGG_FUNCS
from eins.ir.types import TensorType
from eins.ops import get_primitive
from eins.ops.attention_bwd import BWD_FLOPS_RATIO, attention_bwd, attention_fwd
from helpers import accumulation, assert_close

ATT = get_primitive("attention")
FWD = get_primitive("attention_fwd")
BWD = get_primitive("attention_bwd")

CASES = [  # (q shape, k shape, params)
    ((4, 6, 3), (2, 6, 3), dict(causal=True)),                          # GQA, causal
    ((4, 6, 3), (2, 6, 3), dict(causal=False)),
    ((2, 3, 7, 3), (2, 1, 7, 3), dict(causal=True, segments=(2, 5, 7))),
    ((2, 3, 7, 3), (2, 1, 7, 3), dict(causal=False, segments=(2, 5, 7), scale=0.7)),
]


def _params(kw):
    return dict(causal=kw.get("causal", True), segments=kw.get("segments"),
                scale=kw.get("scale"))


def _numeric_grads(f, args, h=1e-6):
    """Central differences of the scalar ``f(*args)`` in each argument, element by element."""
    grads = []
    for i, x in enumerate(args):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += h
            xm[idx] -= h
            fp = f(*args[:i], xp, *args[i + 1:])
            fm = f(*args[:i], xm, *args[i + 1:])
            g[idx] = (fp - fm) / (2 * h)
        grads.append(g)
    return grads


def _rel(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


# ------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("qs,ks,kw", CASES)
def test_backward_equals_finite_differences_float64(qs, ks, kw):
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=qs), rng.normal(size=ks), rng.normal(size=ks)
    do = rng.normal(size=qs)
    p = _params(kw)
    o, lse = attention_fwd(q, k, v, **p)
    np.testing.assert_allclose(o, ATT.impl(q, k, v, **p)[0], rtol=1e-13, atol=1e-13)
    got = attention_bwd(q, k, v, o, lse, do, **p)
    want = _numeric_grads(lambda q, k, v: float((ATT.impl(q, k, v, **p)[0] * do).sum()),
                          [q, k, v])
    for g, w in zip(got, want):
        assert g.dtype == np.float64
        assert _rel(g, w) < 1e-6


def test_saved_lse_is_the_row_log_sum_exp():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(2, 3, 7, 3)), rng.normal(size=(2, 1, 7, 3)), \
        rng.normal(size=(2, 1, 7, 3))
    _, lse = attention_fwd(q, k, v, segments=(2, 5, 7))
    s = np.einsum("bhid,bjd->bhij", q, k[:, 0]) / math.sqrt(3)
    seg = np.searchsorted([2, 5, 7], np.arange(7), side="right")
    ok = (seg[:, None] == seg[None, :]) & (np.arange(7)[None, :] <= np.arange(7)[:, None])
    want = np.log(np.where(ok, np.exp(s), 0).sum(-1))
    np.testing.assert_allclose(lse, want, rtol=1e-13)
    assert lse.dtype == np.float64
    f32 = attention_fwd(*(x.astype(np.float32) for x in (q, k, v)))[1]
    assert f32.dtype == np.float32 and f32.shape == (2, 3, 7)


def test_rows_that_see_no_key_get_zero_gradient():
    # a key split's block sees none of some rows' keys; the whole kernel: lse = -inf rows
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.normal(size=(2, 5, 4)) for _ in range(4))
    o, lse = attention_fwd(q, k, v)
    lse = lse.copy()
    lse[:, 2] = -np.inf
    dq, dk, dv = attention_bwd(q, k, v, o, lse, do)
    assert np.all(np.isfinite(dq)) and np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
    assert np.all(dq[:, 2] == 0)


# ------------------------------------------------------------------------------ the VJP rule
def _vjp_program(params):
    """attention then its VJP rule, as eins.autodiff calls it, in one trace."""
    def f(q, k, v, do):
        o = eins.attention(q, k, v, **params)
        grads = ATT.vjp((do,), (q, k, v), (o,), (True, True, True), **params)
        return (o,) + tuple(grads)
    return f


@pytest.mark.parametrize("qs,ks,kw", CASES)
def test_vjp_rule_saves_the_forwards_lse(qs, ks, kw):
    rng = np.random.default_rng(3)
    args = [rng.normal(size=s) for s in (qs, ks, ks, qs)]
    p = _params(kw)
    prog = eins.make_ir(_vjp_program(p))(*args)
    # the forward eqn became attention_fwd: one forward, no recomputation of the scores
    assert [e.prim for e in prog.eqns] == ["attention_fwd", "attention_bwd"]
    assert prog.eqns[1].inputs[3] is prog.eqns[0].outputs[0]   # o
    assert prog.eqns[1].inputs[4] is prog.eqns[0].outputs[1]   # lse
    got = eins.jit(_vjp_program(p))(*args)
    np.testing.assert_allclose(got[0], ATT.impl(*args[:3], **p)[0], rtol=1e-13)
    want = _numeric_grads(lambda q, k, v: float((ATT.impl(q, k, v, **p)[0] * args[3]).sum()),
                          args[:3])
    for g, w in zip(got[1:], want):
        assert _rel(g, w) < 1e-6


def test_vjp_rule_without_the_forward_eqn_computes_the_lse():
    # the output is not an attention eqn's of this trace: the lse is computed afresh
    rng = np.random.default_rng(4)
    q, k, v, do = (rng.normal(size=(2, 5, 4)) for _ in range(4))
    o = ATT.impl(q, k, v, causal=True, segments=None, scale=None)[0]

    def f(q, k, v, o, do):
        return ATT.vjp((do,), (q, k, v), (o,), (True,) * 3, causal=True, segments=None,
                       scale=None)

    prog = eins.make_ir(f)(q, k, v, o, do)
    assert [e.prim for e in prog.eqns] == ["attention_fwd", "attention_bwd"]
    got = eins.jit(f)(q, k, v, o, do)
    want = attention_bwd(q, k, v, o, attention_fwd(q, k, v)[1], do)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_vjp_rule_with_no_cotangent_is_zero():
    assert ATT.vjp((None,), (1, 2, 3), (4,), (True,) * 3, causal=True, segments=None,
                   scale=None) == (None, None, None)


def test_lse_cotangent_is_refused():
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(2, 5, 4)) for _ in range(3))

    def f(q, k, v):
        o, lse = attention_fwd(q, k, v)
        return FWD.vjp((o, lse), (q, k, v), (o, lse), (True,) * 3, causal=True,
                       segments=None, scale=None)

    with pytest.raises(EinsError, match="log-sum-exp output"):
        eins.jit(f)(q, k, v)


# ------------------------------------------------------------------------------ errors
def test_shape_errors_name_the_offending_shapes():
    rng = np.random.default_rng(6)
    q, k, v = rng.normal(size=(4, 6, 3)), rng.normal(size=(2, 6, 3)), rng.normal(size=(2, 6, 3))
    o, lse = attention_fwd(q, k, v)
    with pytest.raises(ShapeError, match=r"lse must have shape \(4, 6\).*got \(4, 5\)"):
        attention_bwd(q, k, v, o, lse[:, :5], o)
    with pytest.raises(ShapeError, match=r"do must have shape \(4, 6, 3\).*got \(4, 6, 2\)"):
        attention_bwd(q, k, v, o, lse, o[..., :2])
    with pytest.raises(ShapeError, match="multiple of key/value heads"):
        attention_bwd(q, k[:1].repeat(3, 0), v[:1].repeat(3, 0), o, lse, o)
    with pytest.raises(ShapeError, match="segments"):
        attention_fwd(q, k, v, segments=(2, 5))


def test_shape_error_names_the_users_line_under_tracing():
    q, k = eins.ShapeDtype((4, 6, 3), "float32"), eins.ShapeDtype((2, 6, 3), "float32")
    bad = eins.ShapeDtype((4, 5), "float32")
    with pytest.raises(ShapeError, match="test_attention_bwd.py"):
        eins.make_ir(lambda q, k, lse: attention_bwd(q, k, k, q, lse, q))(q, k, bad)


# ------------------------------------------------------------------------------ specs
def test_validate_specs_finds_nothing_wrong_or_missing():
    reports = validate_specs.check(["attention_fwd", "attention_bwd", "logaddexp"])
    for r in reports.values():
        assert r.checked > 0 and not r.wrong and not r.missing and not r.untested, r.line()


def _bwd_indexing(qs, ks, causal=True, segments=None):
    ins = [TensorType(s, np.dtype(np.float32)) for s in (qs, ks, ks, qs, qs[:-1], qs)]
    params = dict(causal=causal, segments=segments, scale=None)
    return BWD.indexing(ins, BWD.abstract(*ins, **params), **params)


def test_split_structure():
    # one sequence of 16, causal, 2 query heads on 1 kv head
    ix = _bwd_indexing((2, 16, 4), (1, 16, 4))
    q = ix.spec({"sequence": ((0, 8), (8, 16))})
    assert q.aggs == (None, "sum", "sum")              # dK, dV partials of each query block
    (f0, f1) = q.fspecs
    assert (f0.inputs[1].lo[1], f0.inputs[1].hi[1]) == (0, 8)    # causal: keys up to qb
    assert (f1.inputs[1].lo[1], f1.inputs[1].hi[1]) == (0, 16)
    assert f0.outputs[1].shape == (1, 16, 4)           # whole-sequence partials
    k = ix.spec({"kv_sequence": ((0, 8), (8, 16))})
    assert k.aggs == ("sum", None, None)               # dQ partials of each key block
    (g0, g1) = k.fspecs
    assert (g0.inputs[0].lo[1], g0.inputs[0].hi[1]) == (0, 16)   # rows that see keys 0..7
    assert (g1.inputs[0].lo[1], g1.inputs[0].hi[1]) == (8, 16)
    assert g1.outputs[0].shape == (2, 16, 4)
    both = ix.spec({"sequence": ((0, 8), (8, 16)), "kv_sequence": ((0, 8), (8, 16))})
    assert both.aggs == ("sum", "sum", "sum") and len(both.fspecs) == 4
    heads = _bwd_indexing((4, 16, 4), (2, 16, 4)).spec({"heads_kv": ((0, 1), (1, 2))})
    assert heads.aggs == (None, None, None)
    assert [f.inputs[0].lo[0] for f in heads.fspecs] == [0, 2]   # q heads follow kv heads


def test_a_head_dim_cut_reaching_the_producer_is_refused_naming_the_backward():
    """The enumerator never cuts head_dim (not shardable); a producer called with such a
    cut all the same refuses it naming its eqn (attention_bwd and attention_dbias share it)."""
    ix = _bwd_indexing((2, 16, 4), (1, 16, 4))
    with pytest.raises(EinsError, match=r"attention_bwd: head_dim \(D=4\) is not shardable"):
        ix.producer(ix.full({"head_dim": ((0, 2), (2, 4))}))
    ins = [TensorType(s, np.dtype(np.float32))
           for s in ((2, 16, 4), (1, 16, 4), (1, 16, 4), (2, 16, 4), (2, 16), (2, 16, 4),
                     (2, 16, 16))]
    params = dict(causal=True, segments=None, scale=None, bias="add")
    db = get_primitive("attention_dbias")
    ix = db.indexing(ins, db.abstract(*ins, **params), **params)
    with pytest.raises(EinsError, match=r"attention_dbias: head_dim \(D=4\) is not "):
        ix.producer(ix.full({"head_dim": ((0, 2), (2, 4))}))


def test_cuts_at_segment_ends_need_no_sum():
    segs = (4, 8, 12, 16)
    ix = _bwd_indexing((2, 16, 4), (1, 16, 4), segments=segs)
    for name in ("sequence", "kv_sequence"):
        spec = ix.spec({name: ((0, 8), (8, 16))})
        assert spec.aggs == (None, None, None)
        for f in spec.fspecs:   # every block reads and writes its own segments only
            rows = {(b.lo[1], b.hi[1]) for b in f.inputs[:2] + f.outputs}
            assert len(rows) == 1
    # a cut inside a segment: partials again
    assert ix.spec({"sequence": ((0, 6), (6, 16))}).aggs == (None, "sum", "sum")
    # the balanced cuts of the forward are taken at segment ends here
    assert ix.balance["sequence"](2) == ((0, 8), (8, 16))


def test_forward_key_split_combines_the_lse_by_logaddexp():
    ins = [TensorType(s, np.dtype(np.float32)) for s in ((2, 16, 4), (1, 16, 4), (1, 16, 4))]
    params = dict(causal=True, segments=None, scale=None)
    ix = FWD.indexing(ins, FWD.abstract(*ins, **params), **params)
    assert ix.spec({"kv_sequence": ((0, 8), (8, 16))}).aggs == ("lse", "logaddexp")
    assert ix.spec({"sequence": ((0, 8), (8, 16))}).aggs == (None, None)
    f = AGG_FUNCS["logaddexp"]
    a = np.array([-np.inf, 0.0, 1.0, -np.inf])
    b = np.array([-np.inf, 0.0, -np.inf, 2.0])
    np.testing.assert_allclose(f(a, b), [-np.inf, math.log(2), 1.0, 2.0])


def test_flops_are_two_and_a_half_forwards_per_block():
    qs, ks = (2, 8, 4096, 64), (2, 2, 4096, 64)
    ins = [TensorType(s, np.dtype(np.float16)) for s in (qs, ks, ks, qs, qs[:-1], qs)]
    for segments in (None, (1000, 4096)):
        params = dict(causal=True, segments=segments, scale=None)
        whole = BWD.flops(ins, BWD.abstract(*ins, **params), **params)
        fwd = ATT.flops(ins[:3], ins[:1], **params)
        assert whole * BWD_FLOPS_RATIO[1] == fwd * BWD_FLOPS_RATIO[0]
        ix = _bwd_indexing(qs, ks, **{k: params[k] for k in ("causal", "segments")})
        for split in ({"sequence": ix.balance["sequence"](4)},
                      {"kv_sequence": ix.balance["kv_sequence"](4)},
                      {"sequence": ix.balance["sequence"](2),
                       "kv_sequence": ix.balance["kv_sequence"](2), "heads_kv": ((0, 1), (1, 2))}):
            spec = ix.spec(split)
            per = [BWD.block_flops(f, None, None, **params) for f in spec.fspecs]
            assert sum(per) == whole
    # hand count: one segment of 4096, causal: 4096*4097/2 pairs, 10 FLOPs per pair and dim
    params = dict(causal=True, segments=None, scale=None)
    assert BWD.flops(ins, None, **params) == 10 * 2 * 8 * 64 * (4096 * 4097 // 2)


def test_temporaries_are_linear_in_the_sequence():
    ix = _bwd_indexing((2, 8, 4096, 64), (2, 2, 4096, 64))
    (f,) = ix.spec({}).fspecs
    assert BWD.temp_bytes(f, causal=True, segments=None, scale=None) == 4 * 2 * 8 * 4096


# ------------------------------------------------------------------------------ distributed
def _fb(params):
    def f(q, k, v, do):
        o, lse = attention_fwd(q, k, v, **params)
        return (o, lse) + tuple(attention_bwd(q, k, v, o, lse, do, **params))
    return f


PLANS = [  # (p, plan): every split kind of attention_bwd (eqn 1) and of attention_fwd (eqn 0)
    (2, None), (4, None), (8, None),
    (2, {1: {"heads_kv": 2}}),
    (2, {1: {"batch": 2}}),
    (4, {1: {"sequence": 4}}),
    (4, {1: {"kv_sequence": 4}}),
    (4, {1: {"sequence": 2, "kv_sequence": 2}}),
    (8, {0: {"kv_sequence": 4, "batch": 2}, 1: {"heads_kv": 2, "sequence": 4}}),
    (8, {0: {"sequence": 2, "kv_sequence": 4}, 1: {"batch": 2, "kv_sequence": 4}}),
]


@pytest.mark.parametrize("segments", [None, (6, 12, 18, 24), (5, 9, 20, 24)])
@pytest.mark.parametrize("causal", [True, False])
def test_distributed_gradients_equal_jit(segments, causal):
    rng = np.random.default_rng(7)
    args = [rng.standard_normal(s).astype(np.float32)
            for s in ((2, 4, 24, 8), (2, 2, 24, 8), (2, 2, 24, 8), (2, 4, 24, 8))]
    f = _fb(dict(causal=causal, segments=segments))
    want = eins.jit(f)(*args)
    n, depth = accumulation(eins.make_ir(f)(*args))
    for p, plan in PLANS:
        for schedule in ("naive", "optimized"):
            got = eins.distribute(f, devices=p, plan=plan, schedule=schedule)(*args)
            for j, (g, w) in enumerate(zip(got, want)):
                # one more accumulation: the ⊕ of the partials
                assert_close(g, w, n=n, depth=depth + 1, err_msg=f"p={p} {plan} output {j}")


def test_the_dp_splits_the_backward_of_long_sequences():
    # one sequence, one head: only the sequence indices can reach 4 devices
    q = eins.ShapeDtype((1, 32768, 128), "float16")
    f = _fb(dict(causal=True, segments=None))
    low = eins.distribute(f, devices=4, topology="dgx-h100:4").lower(q, q, q, q)
    rows = {r["op"]: r for r in low.plan_table()}
    assert math.prod(rows["attention_bwd"]["splits"].values()) == 4
    assert set(rows["attention_bwd"]["splits"]) <= {"sequence", "kv_sequence"}
    # compute-bound at 32K tokens: the backward's kernel time is its 2.5x FLOPs at the
    # float16 tensor rate (its float32 lse operand does not make it a float32 kernel)
    ms = {r["op"]: r["compute_ms"] for r in low.predicted_time()["per_eqn"]}
    assert 2.0 < ms["attention_bwd"] / ms["attention_fwd"] < 3.0
