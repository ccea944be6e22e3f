"""The Triton attention backward under Triton's interpreter (torch CPU tensors) against the
numpy block kernel of attention_bwd (eins/ops/attention_bwd.py), its torch fallback, and
distributed training gradients on the ``interpret`` backend (the generated GPU programs).

Tolerances follow the dtype: the kernel rounds P and dS to the input dtype before their
matmuls (as every flash backward does) and each gradient once more at the end."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.errors import DTypeError, ShapeError  # noqa: E402
from eins.ir.joinagg import FunctionSpec  # noqa: E402
from eins.ir.types import Box  # noqa: E402
from eins.kernels import attention_bwd as kbwd  # noqa: E402
from eins.ops import get_primitive  # noqa: E402
from eins.ops.attention_bwd import attention_bwd, attention_fwd  # noqa: E402
from helpers import torch_eps  # noqa: E402

BWD = get_primitive("attention_bwd")


def _inputs(qs, ks, dtype, seed=0, **params):
    """q, k, v, dO rounded to ``dtype``, and o, lse from them (float32 numpy)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(s, generator=g).to(dtype) for s in (qs, ks, ks, qs))
    f = lambda t: t.float().numpy()  # noqa: E731
    o, lse = attention_fwd(f(q), f(k), f(v), **params)
    return q, k, v, torch.from_numpy(o).to(dtype), torch.from_numpy(lse), do


def _tol(dtype, ref):
    return 8 * torch_eps(dtype) * max(1.0, float(np.abs(ref).max())) + 1e-5


def _numpy_block(fspec, ins, params):
    f = lambda t: t.float().numpy()  # noqa: E731
    return BWD.run_block(fspec, *(f(t) for t in ins), **params)


def _spec(ins, qrows=None, krows=None, dqrows=None, dkrows=None):
    """The function specification of a block: q-side rows ``qrows`` and key rows ``krows`` of
    the whole tensors ``ins`` (global positions), gradients over ``dqrows``/``dkrows``."""
    def box(t, rows, drop=False):
        shape = tuple(t.shape)
        lo, hi = [0] * len(shape), list(shape)
        if rows is not None:
            ax = len(shape) - (1 if drop else 2)
            lo[ax], hi[ax] = rows
        return Box(tuple(lo), tuple(hi))
    q, k = ins[0], ins[1]
    return FunctionSpec((box(q, qrows), box(k, krows), box(k, krows), box(q, qrows),
                         box(ins[4], qrows, drop=True), box(q, qrows)),
                        (box(q, dqrows or qrows), box(k, dkrows or krows),
                         box(k, dkrows or krows)))


def _block(ins, fspec):
    out = []
    for t, b in zip(ins, fspec.inputs):
        out.append(t[tuple(slice(a, c) for a, c in zip(b.lo, b.hi))].contiguous())
    return out


CASES = [  # (q shape, k shape, params)
    ((1, 4, 40, 16), (1, 2, 40, 16), dict(causal=True, segments=None)),
    ((2, 2, 37, 8), (2, 1, 37, 8), dict(causal=False, segments=None)),
    ((2, 45, 16), (1, 45, 16), dict(causal=True, segments=(10, 13, 30, 45))),
    ((2, 45, 16), (1, 45, 16), dict(causal=False, segments=(10, 13, 30, 45))),
    ((2, 1, 2, 20, 12), (2, 1, 1, 20, 12), dict(causal=True, segments=None)),   # batch dims
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qs,ks,params", CASES)
def test_kernel_equals_the_numpy_kernel(qs, ks, params, dtype):
    ins = _inputs(qs, ks, dtype, **params)
    outs = [torch.full(t.shape, float("nan"), dtype=dtype) for t in ins[:3]]
    before = kbwd.LAUNCHES["attention_bwd"]
    kbwd.attention_bwd(*ins, *outs, scale=None, **params)
    assert kbwd.LAUNCHES["attention_bwd"] == before + 1
    want = attention_bwd(*(t.float().numpy() for t in ins), **params)
    for name, g, w in zip("qkv", outs, want):
        err = np.abs(g.float().numpy() - w).max()
        assert err <= _tol(dtype, w), (name, err)


@pytest.mark.parametrize("params", [dict(causal=True, segments=None),
                                    dict(causal=False, segments=(7, 20, 33, 48)),
                                    dict(causal=True, segments=(7, 20, 33, 48))])
def test_split_blocks_at_their_global_offsets(params):
    # the blocks of a query split, a key split and both, as the planner's specs cut them:
    # the lowering (Triton, under the interpreter) and the torch fallback equal the numpy
    # block kernel, each gradient placed in its output box (zeros outside)
    ins = _inputs((2, 48, 16), (1, 48, 16), torch.float32, seed=1, **params)
    low = BWD.lowering()
    p = dict(params, scale=None)
    for rows in ([(8, 24), (0, 24), None, (0, 48)],     # query block, the whole dK partial
                 [(16, 48), (16, 32), (0, 48), None],   # key block, the whole dQ partial
                 [(24, 40), (8, 32), None, None],       # both split
                 [(7, 20), (7, 20), None, None]):       # one whole segment
        fspec = _spec(ins, *rows)
        blocks = _block(ins, fspec)
        want = _numpy_block(fspec, blocks, p)
        outs = [torch.full(b.shape, float("nan")) for b in fspec.outputs]
        low.fn(fspec, outs, blocks, **p)
        fb = low.fallback(fspec, *blocks, **p)
        for g, f, w in zip(outs, fb, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(f.numpy(), w, rtol=1e-5, atol=1e-5)


def test_fallback_takes_float64():
    ins = _inputs((2, 12, 4), (1, 12, 4), torch.float64, segments=(5, 12))
    ins = [t.double() for t in ins]
    p = dict(causal=True, segments=(5, 12), scale=None)
    assert not BWD.lowering().accepts([t.clone() for t in ins[:3]], ins, p)
    got = BWD.lowering().fallback(None, *ins, **p)
    want = attention_bwd(*(t.numpy() for t in ins), causal=True, segments=(5, 12))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-12)


def test_launcher_errors_name_the_offending_value():
    ins = _inputs((2, 16, 8), (1, 16, 8), torch.float32)
    outs = [torch.empty(t.shape) for t in ins[:3]]
    with pytest.raises(DTypeError, match="float64"):
        kbwd.attention_bwd(*(t.double() for t in ins[:4]), ins[4], ins[5].double(),
                           *(o.double() for o in outs))
    with pytest.raises(ShapeError, match=r"lse must be float32 \(2, 16\), got torch.float64"):
        kbwd.attention_bwd(*ins[:4], ins[4].double(), ins[5], *outs)
    with pytest.raises(ShapeError, match=r"dk must have shape \(1, 16, 8\), got \(2, 16, 8\)"):
        kbwd.attention_bwd(*ins, outs[0], outs[0], outs[2])
    with pytest.raises(ShapeError, match="segments"):
        kbwd.attention_bwd(*ins, *outs, segments=(4, 8))


def test_generated_source_has_no_square_buffer():
    src = kbwd.attention_bwd_source(torch.float16, causal=True, segments=True)
    assert "_dkdv" in src and "_dq" in src and "_delta" in src
    assert "Sq * Sk" not in src and "atomic" not in src


# ------------------------------------------------------------------------------ end to end
def _fb(params):
    def f(q, k, v, do):
        o, lse = attention_fwd(q, k, v, **params)
        return (o, lse) + tuple(attention_bwd(q, k, v, o, lse, do, **params))
    return f


@pytest.mark.parametrize("p,plan", [
    (2, {0: {"sequence": 2}, 1: {"sequence": 2}}),
    (2, {0: {"kv_sequence": 2}, 1: {"kv_sequence": 2}}),
    (4, {0: {"heads_kv": 2}, 1: {"sequence": 2, "kv_sequence": 2}}),
])
def test_interpret_backend_equals_numpy(p, plan):
    rng = np.random.default_rng(2)
    args = [rng.standard_normal(s).astype(np.float32)
            for s in ((1, 4, 40, 16), (1, 2, 40, 16), (1, 2, 40, 16), (1, 4, 40, 16))]
    f = _fb(dict(causal=True, segments=(10, 25, 40)))
    want = eins.distribute(f, devices=p, plan=plan, backend="numpy")(*args)
    before = kbwd.LAUNCHES["attention_bwd"]
    got = eins.distribute(f, devices=p, plan=plan, backend="interpret")(*args)
    assert kbwd.LAUNCHES["attention_bwd"] > before    # the Triton kernel ran, not the fallback
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5)


def test_generated_gpu_program_combines_the_lse_partials_by_logaddexp():
    q = np.zeros((1, 2, 16, 8), np.float32)
    k = np.zeros((1, 1, 16, 8), np.float32)
    f = lambda q, k, v: attention_fwd(q, k, v)   # noqa: E731
    low = eins.distribute(f, devices=2, plan={0: {"kv_sequence": 2}}).lower(q, k, k)
    srcs = "\n".join(low.generate("cuda").triton)
    assert "agg_logaddexp" in srcs and "agg_lse" in srcs
    rng = np.random.default_rng(3)
    args = [rng.standard_normal(x.shape).astype(np.float32) for x in (q, k, k)]
    got = low.compile("interpret")(*args)
    want = eins.jit(f)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_benchmark_row_fills_its_graph_columns():
    """benchmarks/gpu_kernels.py's attention_bwd row (the next GPU session measures it): on
    the CPU with a stand-in for the CUDA-graph timer, every column is wired and the
    gradients agree with SDPA's backward."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_kernels.py")
    spec = importlib.util.spec_from_file_location("gpu_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    measure = mod.make_timer("cpu", 1)
    calls = []

    def graph(fn):
        calls.append(fn)
        fn()
        return 0.5 if len(calls) == 1 else 0.6
    measure.graph = graph
    (row,) = mod.attention_bwd_rows("cpu", measure, torch.float32, [40], hq=4, hkv=2, d=16)
    assert row["kernel"] == "attention_bwd" and len(calls) == 2
    assert row["sdpa_bwd_graph_ms"] == 0.5 and row["eins_graph_ms"] == 0.6
    assert row["meets_1.3x_sdpa_graphed"] is True
    assert row["rel_max_err"] < 1e-5


def test_transposes_around_the_backward_are_views():
    # heads split out of [S, H*D] projections: the GPU walk hands the backward strided views
    # (Primitive.strided) instead of copies, and the interpret backend equals eins.jit
    rng = np.random.default_rng(5)
    x = rng.standard_normal((24, 16)).astype(np.float32)
    w = [rng.standard_normal(s).astype(np.float32) / 4
         for s in ((16, 16), (16, 8), (16, 8), (24, 16))]

    def f(x, wq, wk, wv, dy):
        q = (x @ wq).reshape(24, 4, 4).transpose(1, 0, 2)
        k = (x @ wk).reshape(24, 2, 4).transpose(1, 0, 2)
        v = (x @ wv).reshape(24, 2, 4).transpose(1, 0, 2)
        do = dy.reshape(24, 4, 4).transpose(1, 0, 2)
        o, lse = attention_fwd(q, k, v, segments=(10, 24))
        dq, dk, _ = attention_bwd(q, k, v, o, lse, do, segments=(10, 24))
        return dq.transpose(1, 0, 2).reshape(24, 16) @ wq.T + \
            dk.transpose(1, 0, 2).reshape(24, 8) @ wk.T

    low = eins.distribute(f, devices=2).lower(x, *w)
    calls = [line for d in (0, 1) for line in low.generate("cuda").sources[d].splitlines()
             if line.strip().startswith("dev.op('attention_bwd'")]
    assert calls and all(".permute(" in c for c in calls)
    before = kbwd.LAUNCHES["attention_bwd"]
    got = low.compile("interpret")(x, *w)
    assert kbwd.LAUNCHES["attention_bwd"] > before
    np.testing.assert_allclose(got, eins.jit(f)(x, *w), rtol=1e-5, atol=1e-6)


def test_rank_kernel_sets_run_the_training_attention():
    # the ranks' GPU kernel set (interpret: Triton on CPU tensors) against their numpy set,
    # block by block: attention_fwd's key-split partials ((o, lse) pairs and the lse), their
    # ⊕ lse and ⊕ logaddexp, and attention_bwd's blocks with whole-sequence dQ partials
    from eins.ir.joinagg import lse_pair_dtype
    from eins.runtime.ranks import make_kernels
    rng = np.random.default_rng(6)
    q, do = (rng.standard_normal((4, 12, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 12, 8)).astype(np.float32) for _ in range(2))

    def step(q, k, v, do):
        o, lse = attention_fwd(q, k, v)
        return (o, lse) + tuple(attention_bwd(q, k, v, o, lse, do))

    prog = eins.make_ir(step)(q, k, v, do)
    fwd, bwd = prog.eqns
    want = eins.jit(step)(q, k, v, do)
    tk, nk = make_kernels("interpret"), make_kernels("numpy")
    pair = lse_pair_dtype(np.float32)
    parts = {"pairs": [], "lse": [], "dq": []}
    full_q, full_k = Box((0, 0, 0), (4, 12, 8)), Box((0, 0, 0), (2, 12, 8))
    for lo, hi in ((0, 5), (5, 12)):
        kb = Box((0, lo, 0), (2, hi, 8))
        f = FunctionSpec((full_q, kb, kb), (full_q, Box((0, 0), (4, 12))))
        blocks = [q, k[:, lo:hi], v[:, lo:hi]]
        t = tk.kernel(fwd, f, [tk.load(b, np.float32) for b in blocks], [pair, np.float32])
        n = nk.kernel(fwd, f, blocks, [pair, np.dtype(np.float32)])
        np.testing.assert_allclose(tk.to_host(t[0])[..., 0], n[0]["o"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(tk.to_host(t[1]), n[1], atol=1e-5, rtol=0)
        parts["pairs"].append(t[0])
        parts["lse"].append(t[1])
        # the backward's key block: dQ of every row (a ⊕ sum partial), dK and dV of its keys
        b = FunctionSpec((Box((0, lo, 0), (4, 12, 8)), kb, kb, Box((0, lo, 0), (4, 12, 8)),
                          Box((0, lo), (4, 12)), Box((0, lo, 0), (4, 12, 8))),
                         (full_q, kb, kb))
        bb = [q[:, lo:], k[:, lo:hi], v[:, lo:hi], want[0][:, lo:], want[1][:, lo:],
              do[:, lo:]]
        got = tk.kernel(bwd, b, [tk.load(x, x.dtype) for x in bb], [np.float32] * 3)
        ref = nk.kernel(bwd, b, bb, [np.dtype(np.float32)] * 3)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(tk.to_host(g), r, atol=1e-5, rtol=0)
        parts["dq"].append(got[0])
    o = tk.to_host(tk.aggregate("lse", parts["pairs"], np.dtype(np.float32)))
    lse = tk.to_host(tk.aggregate("logaddexp", parts["lse"], np.dtype(np.float32)))
    dq = tk.to_host(tk.aggregate("sum", parts["dq"], np.dtype(np.float32)))
    for got, w in ((o, want[0]), (lse, want[1]), (dq, want[2])):
        np.testing.assert_allclose(got, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["interpret", "numpy"])
def test_the_logaddexp_aggregate_of_rows_that_see_no_key_is_quiet(backend):
    """⊕ logaddexp of lse partials where both are -inf (a row no key block sees), equal,
    one-sided infinite and finite: np.logaddexp's values, with no RuntimeWarning from the
    generated expression (its difference of two -inf was nan under Triton's interpreter)."""
    import warnings
    from eins.runtime.ranks import make_kernels
    ks = make_kernels(backend)
    a = np.array([-np.inf, -np.inf, 2.0, 1.5, -3.0, np.inf, 40.0], dtype=np.float32)
    b = np.array([-np.inf, 0.5, -np.inf, 1.5, 7.0, 1.0, -40.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ks.to_host(ks.aggregate("logaddexp", [ks.load(a, a.dtype), ks.load(b, b.dtype)],
                                      np.dtype(np.float32)))
    np.testing.assert_allclose(got, np.logaddexp(a, b), rtol=1e-6)
