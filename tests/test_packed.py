"""Packed batches whose boundaries change every call (issue 36): attention's ``segments`` as
an int array argument, one trace and one plan for every batch, the per-call rebalance, and
the counters that show a new batch built nothing expensive."""
import numpy as np
import pytest

import eins
from eins.errors import EinsError, ShapeError
from eins.ir.joinagg import FunctionSpec
from eins.ir.types import Box
from eins.models import llama
from eins.ops.attention_gpu import attention_torch
from eins.passes.rebalance import recut, runtime_operands
from helpers import SPREAD, assert_splits

S = 48
BATCHES = [(5, 11, 48), (48,), (1, 2, 3, 20, 48), (30, 40, 48), (12, 24, 36, 48),
           (47, 48)]


def padded(ends, n=6, s=S):
    return llama.padded_ends(ends, n, s)


def qkv(rng, s=S, dtype=np.float64):
    return (rng.standard_normal((4, s, 8)).astype(dtype),
            rng.standard_normal((2, s, 8)).astype(dtype),
            rng.standard_normal((2, s, 8)).astype(dtype))


def static_attention(**kw):
    return eins.jit(lambda q, k, v, segs: eins.attention(q, k, v, segments=segs, **kw),
                    static_argnames=("segs",))


@pytest.mark.parametrize("kw", [{}, {"causal": False}, {"window": 5}, {"softcap": 3.0}])
def test_jit_runtime_ends_equal_static(kw):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng)
    f = eins.jit(lambda q, k, v, e: eins.attention(q, k, v, segments=e, **kw))
    ref = static_attention(**kw)
    for ends in BATCHES:
        np.testing.assert_allclose(f(q, k, v, padded(ends)), ref(q, k, v, segs=ends),
                                   rtol=1e-12, atol=1e-12)
    assert f.trace_count == 1


def test_traced_program_takes_ends_as_data():
    rng = np.random.default_rng(1)
    text = eins.jit(lambda q, k, v, e: eins.attention(q, k, v, segments=e)).lower(
        *qkv(rng), padded(BATCHES[0])).as_text()
    assert "segments=array] a b c d" in text


@pytest.mark.parametrize("plan", [None, {0: {"sequence": 4}}, {0: {"kv_sequence": 4}},
                                  {0: {"heads_kv": 2, "sequence": 2}}])
def test_distributed_batches_equal_jit_without_retrace(plan):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng)
    d = eins.distribute(lambda q, k, v, e: eins.attention(q, k, v, segments=e), devices=4,
                        plan=plan, backend="numpy")
    ref = static_attention()
    for n, ends in enumerate(BATCHES, 1):
        np.testing.assert_allclose(d(q, k, v, padded(ends)), ref(q, k, v, segs=ends),
                                   rtol=1e-12, atol=1e-12)
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 1, n)
        assert_splits(d.last.lowered)
        assert st["kernel_compiles"] == 0 and st["graph_captures"] == 0


def test_rebalance_cuts_are_the_static_plans_cuts():
    """The per-call cuts are those the DP's own balance gives the same ends as a static
    tuple: equal causal work, at segment ends where that is within 10%."""
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng)
    dyn = eins.distribute(lambda q, k, v, e: eins.attention(q, k, v, segments=e),
                          devices=4, plan={0: {"sequence": 4}})
    low = dyn.lower(q, k, v, padded(BATCHES[0]))
    seen = set()
    for ends in BATCHES:
        static = eins.distribute(
            lambda q, k, v: eins.attention(q, k, v, segments=ends), devices=4,
            plan={0: {"sequence": 4}}).lower(q, k, v)
        cut = recut(low.compilation, [q, k, v, padded(ends)])
        got = cut.plan.eqn_plans[0].intervals["sequence"]
        assert got == static.plan.eqn_plans[0].intervals["sequence"]
        assert cut.program.eqns[0].params["segments"] == ends
        seen.add(got)
    assert len(seen) > 3   # the cuts follow the batch


def test_rebalance_off_keeps_one_program():
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng)
    d = eins.distribute(lambda q, k, v, e: eins.attention(q, k, v, segments=e), devices=4,
                        plan={0: {"sequence": 4}}, rebalance=False)
    ref = static_attention()
    for ends in BATCHES:
        np.testing.assert_allclose(d(q, k, v, padded(ends)), ref(q, k, v, segs=ends),
                                   rtol=1e-12, atol=1e-12)
    st = d.stats()
    assert (st["rebalances"], st["lowerings"], st["traces"]) == (0, 1, 1)
    # the compile-time cuts: equal tokens, keys from 0 (valid for any ends)
    assert d.lower(q, k, v, padded(BATCHES[0])).plan.eqn_plans[0].intervals["sequence"] == \
        ((0, 12), (12, 24), (24, 36), (36, 48))


def test_llama_packed_block_stream():
    cfg = llama.TINY
    s, p = 64, 8
    rng = np.random.default_rng(5)
    w = llama.init_weights(cfg, rng)
    x = rng.standard_normal((s, cfg.d_model)).astype(np.float32)
    d = eins.distribute(llama.packed_block_fn(cfg), devices=p, backend="numpy", tuning=SPREAD)
    stream = [(64,), (10, 30, 64), (3, 5, 40, 41, 64), (50, 64), (8, 16, 24, 32, 40, 48, 64)]
    for n, ends in enumerate(stream, 1):
        e = llama.padded_ends(ends, 8, s)
        cos, sin = llama.rope_tables(s, cfg.head_dim, e)
        got = d(x, w, cos, sin, e)
        want = eins.jit(llama.block_fn(cfg, ends))(x, w, cos, sin)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            got, llama.reference_block(x, w, cos, sin, cfg, ends), rtol=1e-4, atol=1e-4)
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 1, n)
        assert_splits(d.last.lowered)


def test_rope_tables_from_the_padded_array():
    e = llama.padded_ends((3, 7), 4, 10)
    assert e.tolist() == [3, 7, 10, 10]
    cos, sin = llama.rope_tables(10, 4, e)
    cs, sn = llama.rope_tables(10, 4, (3, 7, 10))
    np.testing.assert_array_equal(cos, cs)
    np.testing.assert_array_equal(sin, sn)


def test_runtime_operands_found():
    rng = np.random.default_rng(6)
    low = eins.distribute(lambda q, k, v, e: eins.attention(q, k, v, segments=e),
                          devices=2).lower(*qkv(rng), padded(BATCHES[0]))
    assert runtime_operands(low.program) == {0: (3, 3)}


# ----------------------------------------------------------------------------- errors
def test_float_ends_refused_at_trace_time():
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng)
    with pytest.raises(ShapeError, match="1-D int array of end positions"):
        eins.jit(lambda q, k, v, e: eins.attention(q, k, v, segments=e))(
            q, k, v, np.array([5.0, 48.0]))
    with pytest.raises(ShapeError, match="1-D int array"):
        eins.jit(lambda q, k, v, e: eins.attention(q, k, v, segments=e))(
            q, k, v, np.array([[5, 48]]))


@pytest.mark.parametrize("bad", [[5, 3, 48], [5, 40, 40], [-1, 48]])
def test_bad_runtime_ends_named(bad):
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng)
    f = eins.jit(lambda q, k, v, e: eins.attention(q, k, v, segments=e))
    with pytest.raises(EinsError, match=r"segments \[") as err:
        f(q, k, v, np.array(bad, np.int32))
    assert str(bad[0]) in str(err.value)
    d = eins.distribute(lambda q, k, v, e: eins.attention(q, k, v, segments=e), devices=4,
                        plan={0: {"sequence": 4}})
    with pytest.raises(EinsError, match=r"segments \["):
        d(q, k, v, np.array(bad, np.int32))


def test_padded_ends_too_many():
    with pytest.raises(ShapeError, match="more than the program's maximum of 2"):
        llama.padded_ends((1, 2, 3), 2, 3)
    with pytest.raises(ShapeError, match="ending at seq=10"):
        llama.rope_tables(10, 4, np.array([3, 7, 9], np.int32))


def test_segments_array_needs_one_sequence():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 4, 8))
    k = v = rng.standard_normal((1, 8, 8))
    with pytest.raises(ShapeError, match="one sequence for queries and keys"):
        eins.jit(lambda q, k, v, e: eins.attention(q, k, v, segments=e))(
            q, k, v, np.array([8], np.int32))


@pytest.mark.parametrize("kw", [{}, {"causal": False}, {"window": 5}])
@pytest.mark.parametrize("block", [((0, S), (0, S)), ((16, 32), (0, 32)),
                                   ((24, 48), (8, 48))])
def test_torch_fallback_reads_ends_on_the_device(monkeypatch, kw, block):
    """The GPU backends' torch fallback with the ends as a tensor finds each row's segment
    on the tensor's device: equal to the static ends, with no copy of the ends to the host
    (which would break a CUDA graph's capture)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng)
    (qa, qb), (ka, kb) = block
    whole = FunctionSpec((Box((0, qa, 0), (4, qb, 8)), Box((0, ka, 0), (2, kb, 8)),
                          Box((0, ka, 0), (2, kb, 8))), ())
    tq, tk, tv = (torch.from_numpy(x) for x in (q[:, qa:qb], k[:, ka:kb], v[:, ka:kb]))
    for ends in BATCHES:
        e = padded(ends)
        (dyn,) = eins.make_ir(lambda q, k, v, e: eins.attention(q, k, v, segments=e, **kw))(
            q, k, v, e).eqns
        (stat,) = eins.make_ir(lambda q, k, v: eins.attention(q, k, v, segments=ends, **kw))(
            q, k, v).eqns
        want = attention_torch(whole, tq, tk, tv, **stat.params)[0]
        with monkeypatch.context() as m:
            for name in ("cpu", "numpy", "tolist", "item", "__int__", "__index__"):
                m.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(
                    f"host sync: Tensor.{_n}"))
            got = attention_torch(whole, tq, tk, tv, torch.from_numpy(e), **dyn.params)[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert got.abs().sum() > 0


def random_ends(rng, s=S, most=6):
    """A batch's ends: 1..most documents of random lengths packed to ``s``."""
    n = int(rng.integers(1, most + 1))
    cuts = np.sort(rng.choice(np.arange(1, s), size=n - 1, replace=False))
    return tuple(int(c) for c in cuts) + (s,)


@pytest.mark.parametrize("plan", [{0: {"sequence": 4}}, {0: {"heads_kv": 2, "sequence": 2}}])
def test_stream_of_random_batches(plan):
    """200 random padded-end batches through one compiled program: one trace and one plan,
    no kernel built and no graph captured, a rebalance per call, a lowering per new cut
    only, and every result equal to eins.jit on the same ends."""
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng)
    f = lambda q, k, v, e: eins.attention(q, k, v, segments=e)  # noqa: E731
    d = eins.distribute(f, devices=4, plan=plan, backend="numpy")
    ref = eins.jit(f)
    static = static_attention()
    cuts, ends = set(), None
    for n in range(1, 201):
        again = n % 10 == 0   # the previous batch's ends again: its program is reused
        ends = ends if again else random_ends(rng)
        e = padded(ends)
        before = d.stats()["lowerings"] if n > 1 else None
        got = d(q, k, v, e)
        np.testing.assert_allclose(got, ref(q, k, v, e), rtol=1e-12, atol=1e-12)
        if n % 40 == 1:   # the static tuple's trace too, now and then (a trace each)
            np.testing.assert_allclose(got, static(q, k, v, segs=ends), rtol=1e-12,
                                       atol=1e-12)
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 1, n)
        assert st["kernel_compiles"] == 0 and st["graph_captures"] == 0
        if again:
            assert st["lowerings"] == before
        cuts.add(ends)
    assert ref.trace_count == 1
    assert len(cuts) > 120 and st["lowerings"] > 20   # the cuts really moved
