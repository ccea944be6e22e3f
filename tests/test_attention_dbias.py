"""attention_dbias (issue 34): the gradient of attention's additive bias and ALiBi slopes.
Checked against float64 central finite differences (tiles of every size), its torch
fallback against the numpy block kernel on the planner's blocks, its specs by the validator
and by hand, its FLOPs and temporaries by hand counts, and eins.grad through it distributed
against eins.jit."""
import numpy as np
import pytest

import eins
from eins import validate_specs
from eins.cost.predict import compute_dtype as predict_dtype
from eins.errors import ShapeError
from eins.ir.types import TensorType
from eins.ops import attention_bwd_blocks as bblk
from eins.ops import get_primitive
from eins.ops.attention_dbias import PAIR_FLOPS, attention_dbias
from helpers import accumulation, assert_close

ATT = get_primitive("attention")
FWD = get_primitive("attention_fwd")
DB = get_primitive("attention_dbias")


def _rng_arrays(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


def _case(name):
    """(q, k, v, do, extra, params) of a named case, float64, extras in the eqn's layout."""
    rng = np.random.default_rng(3)
    if name == "alibi gqa window softcap":
        q, k, v, do = _rng_arrays(1, (4, 10, 3), (2, 10, 3), (2, 10, 3), (4, 10, 3))
        return q, k, v, do, [rng.uniform(0.1, 1.0, 4)], dict(
            causal=True, segments=None, scale=None, window=4, softcap=2.0, bias="alibi")
    if name == "head-broadcast bias, segments, non-causal":
        q, k, v, do = _rng_arrays(2, (2, 2, 9, 3), (2, 1, 9, 3), (2, 1, 9, 3), (2, 2, 9, 3))
        return q, k, v, do, [rng.standard_normal((2, 1, 9, 9))], dict(
            causal=False, segments=(2, 5, 9), scale=0.6, bias="add")
    if name == "alibi per batch, decode, key padding":
        q, k, v, do = _rng_arrays(3, (2, 2, 3, 3), (2, 1, 8, 3), (2, 1, 8, 5), (2, 2, 3, 5))
        mask = rng.random((2, 8)) > 0.4
        mask[:, 0] = True
        return q, k, v, do, [mask, rng.uniform(0.1, 1.0, (2, 2))], dict(
            causal=True, segments=None, scale=None, mask="keys", bias="alibi", offset=5)
    # batch-broadcast bias with a full mask, cross attention
    q, k, v, do = _rng_arrays(4, (2, 2, 4, 3), (2, 2, 7, 3), (2, 2, 7, 3), (2, 2, 4, 3))
    mask = rng.random((2, 1, 4, 7)) > 0.3
    mask[..., 0] = True
    return q, k, v, do, [mask, rng.standard_normal((1, 2, 4, 7))], dict(
        causal=False, segments=None, scale=None, mask="full", bias="add", offset=3)


CASES = ["alibi gqa window softcap", "head-broadcast bias, segments, non-causal",
         "alibi per batch, decode, key padding", "batch-broadcast bias, full mask"]


def _fd_bias(q, k, v, do, extra, params, h=1e-6):
    """Central differences of sum(attention(...) * do) in the bias (the last extra)."""
    bias = extra[-1]
    g = np.zeros_like(bias)
    for i in np.ndindex(bias.shape):
        vals = []
        for step in (h, -h):
            b = bias.copy()
            b[i] += step
            (o,) = ATT.impl(q, k, v, *extra[:-1], b, **params)
            vals.append(float((o * do).sum()))
        g[i] = (vals[0] - vals[1]) / (2 * h)
    return g


@pytest.mark.parametrize("tile", [None, 1, 3])
@pytest.mark.parametrize("name", CASES)
def test_kernel_equals_finite_differences(name, tile, monkeypatch):
    if tile is not None:   # tiles smaller than the blocks: the kernel's walk over them
        monkeypatch.setattr(bblk, "DBIAS_TILE", tile)
    q, k, v, do, extra, params = _case(name)
    o, lse = FWD.impl(q, k, v, *extra, **params)
    (got,) = DB.impl(q, k, v, o, lse, do, *extra, **params)
    want = _fd_bias(q, k, v, do, extra, params)
    assert got.shape == extra[-1].shape and got.dtype == np.float64
    assert np.abs(got - want).max() <= 1e-7 * max(1.0, np.abs(want).max())


def test_output_has_the_bias_dtype():
    q, k, v, do, extra, params = _case("head-broadcast bias, segments, non-causal")
    o, lse = FWD.impl(q, k, v, *extra, **params)
    low = extra[-1].astype(np.float32)
    (got,) = DB.impl(q, k, v, o, lse, do, low, **params)
    (want,) = DB.impl(q, k, v, o, lse, do, extra[-1], **params)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ specs
def test_validate_specs_finds_nothing_wrong_or_missing():
    (r,) = validate_specs.check(["attention_dbias"]).values()
    assert r.checked > 100 and not r.wrong and not r.missing, r.line()


def _indexing(name):
    q, k, v, do, extra, params = _case(name)
    o, lse = FWD.impl(q, k, v, *extra, **params)
    ins = [TensorType(np.shape(x), np.asarray(x).dtype) for x in (q, k, v, o, lse, do, *extra)]
    return DB.indexing(ins, DB.abstract(*ins, **params), **params), params


def test_split_structure():
    ix, _ = _indexing("head-broadcast bias, segments, non-causal")   # bias [2, 1, 9, 9]
    rows_keys = ix.spec({"sequence": ((0, 5), (5, 9)), "kv_sequence": ((0, 2), (2, 9))})
    assert rows_keys.aggs == (None,)           # the blocks tile the bias
    assert sorted((f.outputs[0].lo[2:], f.outputs[0].hi[2:]) for f in rows_keys.fspecs) == [
        ((0, 0), (5, 2)), ((0, 2), (5, 9)), ((5, 0), (9, 2)), ((5, 2), (9, 9))]
    # both blocks of a batch split write their own batch's bias
    assert ix.spec({"batch": ((0, 1), (1, 2))}).aggs == (None,)
    ix, _ = _indexing("batch-broadcast bias, full mask")            # bias [1, 2, 4, 7]
    assert ix.spec({"batch": ((0, 1), (1, 2))}).aggs == ("sum",)   # one batch-1 box twice
    assert ix.spec({"heads_kv": ((0, 1), (1, 2))}).aggs == (None,)
    ix, _ = _indexing("alibi gqa window softcap")                    # slopes [4]
    for split in ({"sequence": ((0, 5), (5, 10))}, {"kv_sequence": ((0, 3), (3, 10))}):
        spec = ix.spec(split)
        assert spec.aggs == ("sum",)
        assert {f.outputs[0] for f in spec.fspecs} == {ix.spec({}).fspecs[0].outputs[0]}
    heads = ix.spec({"heads_kv": ((0, 1), (1, 2))})
    assert heads.aggs == (None,)
    assert [(f.outputs[0].lo, f.outputs[0].hi) for f in heads.fspecs] == [((0,), (2,)),
                                                                          ((2,), (4,))]


def test_flops_count_the_visible_pairs_and_blocks_sum_to_the_whole():
    b, hq, hkv, s, d = 2, 8, 2, 4096, 64
    qs, ks = (b, hq, s, d), (b, hkv, s, d)
    ins = [TensorType(x, np.dtype(np.float16)) for x in (qs, ks, ks, qs, qs[:-1], qs)]
    ins.append(TensorType((1, hq), np.dtype(np.float16)))
    for segments in (None, (1000, 4096)):
        params = dict(causal=True, segments=segments, scale=None, bias="alibi")
        whole = DB.flops(ins, None, **params)
        pairs = sum(n * (n + 1) // 2 for n in ((s,) if segments is None else (1000, 3096)))
        # the scores and dP (2 FLOPs per multiply-add over D and Dv) and PAIR_FLOPS more
        assert whole == b * hq * pairs * (2 * (d + d) + PAIR_FLOPS)
        ix = DB.indexing(ins, DB.abstract(*ins, **params), **params)
        for split in ({"sequence": ix.balance["sequence"](4)},
                      {"kv_sequence": ix.balance["kv_sequence"](4)},
                      {"sequence": ix.balance["sequence"](2),
                       "kv_sequence": ix.balance["kv_sequence"](2),
                       "heads_kv": ((0, 1), (1, 2))}):
            per = [DB.block_flops(f, None, None, **params) for f in ix.spec(split).fspecs]
            assert sum(per) == whole


def test_temporaries_are_a_tile_per_head_whatever_the_length():
    for s in (4096, 32768):
        qs, ks = (2, 8, s, 64), (2, 2, s, 64)
        ins = [TensorType(x, np.dtype(np.float16)) for x in (qs, ks, ks, qs, qs[:-1], qs)]
        ins.append(TensorType((1, 8), np.dtype(np.float16)))
        params = dict(causal=True, segments=None, scale=None, bias="alibi")
        (f,) = DB.indexing(ins, DB.abstract(*ins, **params), **params).spec({}).fspecs
        # scores, P and dP of one tile, float32, for 2 x 8 query heads
        assert DB.temp_bytes(f, **params) == 3 * 4 * 16 * bblk.DBIAS_TILE ** 2


def test_priced_at_the_float16_rate_its_kernel_computes_at():
    """float16 operands: the Triton kernel's matmuls run in float16 on the tensor cores, as
    attention_bwd's do, and the time model charges its FLOPs at about that rate (the
    compute dtype is the operands', not the float32 lse's), not at float32's, several
    times slower."""
    q = eins.ShapeDtype((1, 8, 2048, 64), "float16")
    k = eins.ShapeDtype((1, 2, 2048, 64), "float16")
    b = eins.ShapeDtype((1, 1, 2048, 2048), "float16")
    f = eins.grad(lambda q, b, k: eins.sum(eins.astype(eins.attention(q, k, k, bias=b),
                                                       "float32")), argnums=(0, 1))
    prog = eins.make_ir(f)(q, b, k)
    (e,) = [e for e in prog.eqns if e.prim == "attention_dbias"]
    assert predict_dtype(e) == np.float16
    low = eins.distribute(f, devices=1, topology="dgx-h100:1").lower(q, b, k)
    ms = {r["op"]: r["compute_ms"] for r in low.predicted_time()["per_eqn"]}
    ins = [a.type for a in e.inputs]
    flops = {n: get_primitive(n).flops(ins, None, **e.params)
             for n in ("attention_bwd", "attention_dbias")}
    # an H100's float32 FLOP costs several float16 tensor-core FLOPs; the bias gradient
    # writes its [Sq, Sk] gradient besides
    per_flop = {n: ms[n] / flops[n] for n in flops}
    assert per_flop["attention_bwd"] <= per_flop["attention_dbias"] < \
        2 * per_flop["attention_bwd"]


def test_shape_errors_name_the_offending_operand():
    q, k, v, do, extra, params = _case("alibi gqa window softcap")
    o, lse = FWD.impl(q, k, v, *extra, **params)
    with pytest.raises(ShapeError, match="no bias"):
        attention_dbias(q, k, v, o, lse, do, **dict(params, bias=None))
    with pytest.raises(ShapeError, match=r"lse must have shape \(4, 10\)"):
        attention_dbias(q, k, v, o, lse[:, :9], do, *extra, **params)
    with pytest.raises(ShapeError, match="test_attention_dbias.py"):
        eins.make_ir(lambda q: attention_dbias(q, k, v, o, lse, do, **dict(
            params, bias=None)))(q)


# ------------------------------------------------------------------------------ the GPU side
@pytest.mark.parametrize("name", CASES)
def test_torch_fallback_and_kernel_equal_the_numpy_blocks(name):
    """On the planner's blocks (query, key, both, head or batch splits) at their global
    offsets: the torch fallback (float64) and the Triton kernel under the interpreter (on
    float32 copies, its gradient written over nan in the block's output box) equal the
    numpy block kernel."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    q, k, v, do, extra, params = _case(name)
    o, lse = FWD.impl(q, k, v, *extra, **params)
    whole = (q, k, v, o, lse, do, *extra)
    ix, _ = _indexing(name)
    low = DB.lowering()

    def f32(x):
        t = torch.from_numpy(x)
        return t.float() if t.is_floating_point() else t
    splits = [{}, {"sequence": ix.balance["sequence"](2)},
              {"kv_sequence": ix.balance["kv_sequence"](3)},
              {"sequence": ix.balance["sequence"](2), "kv_sequence": ix.balance["kv_sequence"](2)},
              {"heads_kv": ((0, 1), (1, 2))} if k.shape[-3] == 2 else {"batch": ((0, 1), (1, 2))}]
    for split in splits:
        for f in ix.spec(split).fspecs:
            blocks = [np.ascontiguousarray(x[tuple(slice(a, c) for a, c in zip(b.lo, b.hi))])
                      for x, b in zip(whole, f.inputs)]
            (want,) = DB.run_block(f, *blocks, **params)
            (got,) = low.fallback(f, *(torch.from_numpy(x) for x in blocks), **params)
            assert tuple(got.shape) == want.shape, (split, f)
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
            out = torch.full(want.shape, float("nan"))
            ins = [f32(x) for x in blocks]
            assert low.accepts([out], ins, params)
            low.fn(f, [out], ins, **params)
            np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-5,
                                       err_msg=str((split, f)))
    (got,) = low.fallback(None, *(torch.from_numpy(np.asarray(x)) for x in whole), **params)
    np.testing.assert_allclose(got.numpy(), DB.impl(*whole, **params)[0], rtol=1e-12,
                               atol=1e-12)


# ------------------------------------------------------------------------------ the VJP rule
def test_grad_of_a_broadcast_bias_and_of_q_together():
    """A [Sq, Sk] bias (broadcast over the batch and the heads: the eqn's [1, 1, Sq, Sk])
    and q differentiated at once: each equals its finite differences."""
    q, k, v, w = _rng_arrays(5, (2, 2, 6, 3), (2, 1, 6, 3), (2, 1, 6, 3), (2, 2, 6, 3))
    bias = np.random.default_rng(6).standard_normal((6, 6))

    def loss(q, b):
        return eins.sum(eins.attention(q, k, v, bias=b) * w)

    gq, gb = eins.grad(loss, argnums=(0, 1))(q, bias)
    ref = eins.jit(loss)
    for x, got, j in ((q, gq, 0), (bias, gb, 1)):
        want = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            args = [q, bias]
            hi, lo = x.copy(), x.copy()
            hi[i] += 1e-6
            lo[i] -= 1e-6
            want[i] = (float(ref(*[hi if m == j else a for m, a in enumerate(args)]))
                       - float(ref(*[lo if m == j else a for m, a in enumerate(args)]))) / 2e-6
        assert np.asarray(got).shape == x.shape
        assert np.abs(np.asarray(got) - want).max() <= 1e-7 * max(1.0, np.abs(want).max())


def test_only_the_bias_asked_binds_no_attention_bwd():
    q, k, v = _rng_arrays(7, (4, 8, 3), (2, 8, 3), (2, 8, 3))
    slopes = np.linspace(0.2, 0.8, 4)
    prog = eins.make_ir(eins.grad(lambda s: eins.sum(eins.attention(q, k, v, bias=s))))(slopes)
    prims = [e.prim for e in prog.eqns]
    assert prims.count("attention_dbias") == 1 and "attention_bwd" not in prims
    assert prims.count("attention_fwd") == 1   # the forward saves the lse it reads


PLANS = [  # (p, plan) with the attention_dbias eqn's index
    (2, None), (4, None), (8, None),
    (2, lambda i: {i: {"batch": 2}}),
    (2, lambda i: {i: {"heads_kv": 2}}),
    (4, lambda i: {i: {"sequence": 4}}),
    (4, lambda i: {i: {"kv_sequence": 4}}),
    (8, lambda i: {i: {"sequence": 2, "kv_sequence": 2, "batch": 2}}),
]


@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_distributed_gradients_equal_jit(kind):
    rng = np.random.default_rng(8)
    q, k, v, w = (rng.standard_normal(s).astype(np.float32)
                  for s in ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8), (2, 4, 16, 8)))
    bias = (rng.uniform(0.1, 1.0, 4) if kind == "alibi"
            else rng.standard_normal((2, 1, 16, 16))).astype(np.float32)

    def loss(q, k, b):
        return eins.sum(eins.attention(q, k, v, bias=b, segments=(5, 11, 16)) * w)

    f = eins.grad(loss, argnums=(0, 1, 2))
    args = (q, k, bias)
    want = eins.jit(f)(*args)
    prog = eins.make_ir(f)(*args)
    (i,) = [n for n, e in enumerate(prog.eqns) if e.prim == "attention_dbias"]
    n, depth = accumulation(prog)
    for p, plan in PLANS:
        for schedule in ("naive", "optimized"):
            d = eins.distribute(f, devices=p, plan=plan and plan(i), schedule=schedule)
            got = d(*args)
            for j, (g, ww) in enumerate(zip(got, want)):
                assert_close(g, ww, n=n, depth=depth + 1, err_msg=f"p={p} output {j}")


@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_interpret_backend_runs_the_torch_fallback_on_key_split_blocks(kind):
    """The GPU runtime (on the CPU) runs the torch fallback on the blocks of a key split,
    whose partials (the slopes') or tiles (the bias's) equal eins.jit's gradient."""
    rng = np.random.default_rng(9)
    q, k, v, w = (rng.standard_normal(s).astype(np.float32)
                  for s in ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8), (2, 4, 16, 8)))
    bias = (rng.uniform(0.1, 1.0, 4) if kind == "alibi"
            else rng.standard_normal((2, 1, 16, 16))).astype(np.float32)
    f = eins.grad(lambda b: eins.sum(eins.attention(q, k, v, bias=b, window=6) * w))
    prog = eins.make_ir(f)(bias)
    (i,) = [n for n, e in enumerate(prog.eqns) if e.prim == "attention_dbias"]
    n, depth = accumulation(prog)
    got = eins.distribute(f, devices=2, backend="interpret",
                          plan={i: {"kv_sequence": 2}})(bias)
    assert_close(got, eins.jit(f)(bias), n=n, depth=depth + 1)
