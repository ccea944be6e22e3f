"""Packed batches on the GPU program under Triton's interpreter (issue 36): one compiled
program with graphs on serves every batch's boundaries; after the first call no kernel is
built and no graph captured, and each result equals eins.jit on that batch's ends."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.kernels import attention as flash_attention  # noqa: E402
from eins.kernels import KernelUnavailable  # noqa: E402
from eins.errors import ShapeError  # noqa: E402
from eins.ir.joinagg import FunctionSpec  # noqa: E402
from eins.ir.types import Box  # noqa: E402
from eins.kernels.attention import LAUNCHES, segment_rows  # noqa: E402
from eins.ops.attention_gpu import attention_torch  # noqa: E402
from eins.models import llama  # noqa: E402
from eins.passes.rebalance import recut  # noqa: E402
from helpers import SPREAD, assert_splits, stream_stats  # noqa: E402

S = 32
STREAM = [(5, 11, 32), (32,), (1, 2, 3, 20, 32), (16, 32)]


@pytest.mark.parametrize("rebalance", [None, True, False])
def test_interpret_stream_no_compiles_no_captures(rebalance):
    """With a rebalance (the default where, as here, a capacity form exists: the capacity
    program) and without (the compile-time cuts): one capture, no kernel built after the
    first call."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, S, 16)).astype(np.float32)
    k = rng.standard_normal((2, S, 16)).astype(np.float32)
    v = rng.standard_normal((2, S, 16)).astype(np.float32)
    d = eins.distribute(lambda q, k, v, e: eins.attention(q, k, v, segments=e), devices=4,
                        plan={0: {"sequence": 4}}, backend="interpret", graphs=True,
                        rebalance=rebalance)
    ref = eins.jit(lambda q, k, v, segs: eins.attention(q, k, v, segments=segs),
                   static_argnames=("segs",))
    first = None
    for n, ends in enumerate(STREAM, 1):
        got = d(q, k, v, llama.padded_ends(ends, 6, S))
        np.testing.assert_allclose(got, ref(q, k, v, segs=ends), rtol=2e-5, atol=2e-5)
        st = d.stats()
        if first is None:
            first = st
            assert st["graph_captures"] == 1   # the first call captures
        assert st["traces"] == 1 and st["plans"] == 1 and st["lowerings"] == 1
        assert st["rebalances"] == (0 if rebalance is False else n)
        assert st["kernel_compiles"] == first["kernel_compiles"]
        assert st["graph_captures"] == 1
        assert st["graph_replays"] >= 1


def test_launcher_reads_ends_tensor():
    """The kernel's segments as a device tensor of padded ends equal the static tuple."""
    rng = np.random.default_rng(1)
    q, k, v = (torch.tensor(rng.standard_normal((1, 2, S, 16)), dtype=torch.float32)
               for _ in range(3))
    for ends in STREAM:
        e = torch.tensor(llama.padded_ends(ends, 6, S))
        got = flash_attention(q, k, v, segments=e, impl="triton")
        want = flash_attention(q, k, v, segments=ends, impl="triton")
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [(0, 32), (7, 19), (20, 32), (0, 1), (13, 13)])
def test_row_table_computes_only_its_rows(rows):
    """A capacity-form block's row table [lo, hi): the Triton launcher and the torch
    fallback compute those rows as without a table and give 0 elsewhere."""
    rng = np.random.default_rng(4)
    q = torch.tensor(rng.standard_normal((2, S, 16)), dtype=torch.float32)
    k, v = (torch.tensor(rng.standard_normal((1, S, 16)), dtype=torch.float32)
            for _ in range(2))
    lo, hi = rows
    r = torch.tensor([[lo, hi]])
    whole = FunctionSpec((Box((0, 0, 0), (2, S, 16)), Box((0, 0, 0), (1, S, 16)),
                          Box((0, 0, 0), (1, S, 16))), ())
    for ends in STREAM:
        e = torch.tensor(llama.padded_ends(ends, 6, S))
        want = flash_attention(q, k, v, segments=e, impl="triton")
        got = flash_attention(q, k, v, segments=e, rows=r, impl="triton")
        (fb,) = attention_torch(whole, q, k, v, e, r, segments="array", rows=True)
        for x in (got, fb):
            torch.testing.assert_close(x[:, lo:hi], want[:, lo:hi], rtol=1e-6, atol=1e-6)
            assert not x[:, :lo].any() and not x[:, hi:].any()


@pytest.mark.parametrize("kw", [{"window": 5}, {"causal": False}, {"softcap": 2.0}])
def test_row_table_with_attention_options(kw):
    rng = np.random.default_rng(6)
    q = torch.tensor(rng.standard_normal((2, S, 16)), dtype=torch.float32)
    k, v = (torch.tensor(rng.standard_normal((1, S, 16)), dtype=torch.float32)
            for _ in range(2))
    e = torch.tensor(llama.padded_ends((5, 11, 32), 6, S))
    want = flash_attention(q, k, v, segments=e, impl="triton", **kw)
    got = flash_attention(q, k, v, segments=e, rows=torch.tensor([[7, 19]]), impl="triton",
                          **kw)
    torch.testing.assert_close(got[:, 7:19], want[:, 7:19], rtol=1e-6, atol=1e-6)
    assert not got[:, :7].any() and not got[:, 19:].any()


@pytest.mark.parametrize("causal", [True, False])
def test_row_table_keeps_a_sliding_window_inside_its_keys(causal):
    """With a sliding window a block's rows see fewer keys than their segments: the table
    row's key window [klo, khi) (the per-cut block's keys) bounds every key block the
    capacity block visits, so keys outside it, another call's nan and inf in a capacity
    buffer, are never multiplied (no nan in the rows, no RuntimeWarning)."""
    rng = np.random.default_rng(9)
    s = 64
    q = torch.tensor(rng.standard_normal((2, s, 16)), dtype=torch.float32)
    k, v = (torch.tensor(rng.standard_normal((1, s, 16)), dtype=torch.float32)
            for _ in range(2))
    e = torch.tensor(llama.padded_ends((20, 64), 6, s))
    lo, hi, klo = 30, 50, 26   # rows 30..49 see keys from 30 - 4, in the segment [20, 64)
    khi = hi if causal else hi + 4
    want = flash_attention(q, k, v, segments=e, impl="triton", window=5, causal=causal)
    for x, bad in ((k, float("nan")), (v, float("inf"))):
        x[:, :klo] = bad
        x[:, khi:] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = flash_attention(q, k, v, segments=e, rows=torch.tensor([[lo, hi, klo, khi]]),
                              impl="triton", window=5, causal=causal)
    torch.testing.assert_close(got[:, lo:hi], want[:, lo:hi], rtol=1e-6, atol=1e-6)
    assert not got[:, :lo].any() and not got[:, hi:].any()


def test_row_table_reads_no_host_value(monkeypatch):
    """The row table and the ends stay on the device: no copy to the host (which a CUDA
    graph's capture would refuse) while the per-row ranges are built."""
    e = torch.tensor(llama.padded_ends((5, 11, 32), 6, S))
    r = torch.tensor([[7, 19]])
    want = [x.clone() for x in segment_rows(e, 0, S, e.device)]
    with monkeypatch.context() as m:
        for name in ("cpu", "numpy", "tolist", "item", "__int__", "__index__", "__bool__"):
            m.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(
                f"host sync: Tensor.{_n}"))
        lo, hi = segment_rows(e, 0, S, e.device, r)
    pos = torch.arange(S)
    inside = (pos >= 7) & (pos < 19)
    assert torch.equal(lo[inside], want[0][inside]) and torch.equal(hi[inside], want[1][inside])
    assert torch.equal(lo[~inside], hi[~inside])   # every other row: an empty key range
    assert torch.all(lo[1:] >= lo[:-1]) and torch.all(hi[1:] >= hi[:-1])   # monotone


def test_row_table_needs_the_ends_tensor():
    q = torch.zeros((1, 2, S, 16))
    with pytest.raises(ShapeError, match="row table"):
        flash_attention(q, q, q, segments=(S,), rows=torch.tensor([[0, S]]), impl="triton")


def test_library_kernel_refuses_ends_tensor():
    q = torch.zeros((1, 2, S, 16))
    with pytest.raises(KernelUnavailable, match="segments as data"):
        flash_attention(q, q, q, segments=torch.tensor([S]), impl="sdpa")


def random_ends(rng, s=S, most=6):
    n = int(rng.integers(1, most + 1))
    cuts = np.sort(rng.choice(np.arange(1, s), size=n - 1, replace=False))
    return tuple(int(c) for c in cuts) + (s,)


def test_interpret_capacity_stream_of_200_batches():
    """Issue 36's target on the GPU program: with rebalance on, 200 new batches after the
    first build no trace, no kernel and no graph; each call is re-cut (the capacity
    program's row table moves with the batch) and equals eins.jit."""
    s = 16
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, s, 8)).astype(np.float32)
    k = rng.standard_normal((1, s, 8)).astype(np.float32)
    v = rng.standard_normal((1, s, 8)).astype(np.float32)
    f = lambda q, k, v, e: eins.attention(q, k, v, segments=e)  # noqa: E731
    d = eins.distribute(f, devices=4, plan={0: {"sequence": 4}}, backend="interpret",
                        rebalance=True)
    assert d.lower(q, k, v, llama.padded_ends((s,), 6, s)).plan.eqn_plans[0].splits == \
        {"sequence": 4}
    ref = eins.jit(f)
    first, cuts = None, set()
    launches = LAUNCHES["attention"]
    for n in range(1, 202):
        e = llama.padded_ends(random_ends(rng, s), 6, s)
        np.testing.assert_allclose(d(q, k, v, e), ref(q, k, v, e), rtol=2e-5, atol=2e-5)
        st, first = stream_stats(d, first, n)
        assert st["graph_captures"] == 1 and st["lowerings"] == 1
        cuts.add(tuple(map(tuple, d.last.capacity.tables(recut(
            d.last.lowered.compilation, [q, k, v, e]))[0])))
    assert len(cuts) > 50   # the cuts really moved
    # the Triton kernel computed every block (one per device and call, and the first
    # call's eager warm-up before its capture), not the torch fallback
    assert LAUNCHES["attention"] - launches == 4 * 202


def test_interpret_rebalanced_llama_block():
    """The TINY LLaMA block on packed segments at p=4, attention split by query sequence:
    20 batches through one capacity program, one graph capture in all, each equal to
    eins.jit on that batch's ends."""
    cfg, s, p = llama.TINY, 32, 4
    rng = np.random.default_rng(5)
    w = llama.init_weights(cfg, rng)
    x = rng.standard_normal((s, cfg.d_model)).astype(np.float32)
    d = eins.distribute(llama.packed_block_fn(cfg), devices=p, backend="interpret",
                        tuning=SPREAD, rebalance=True)
    first = None
    for n in range(1, 21):
        ends = random_ends(rng, s) if n > 1 else (s,)
        e = llama.padded_ends(ends, 8, s)
        cos, sin = llama.rope_tables(s, cfg.head_dim, e)
        got = d(x, w, cos, sin, e)
        want = eins.jit(llama.block_fn(cfg, ends))(x, w, cos, sin)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        st, first = stream_stats(d, first, n)
        assert st["graph_captures"] == 1 and st["lowerings"] == 1
    low = d.last.lowered
    assert_splits(low)
    att = [r for r in low.plan_table() if r["op"] == "attention"]
    assert att[0]["splits"] == {"sequence": 4}   # the plan really re-cuts per batch


def test_interpret_rebalanced_stream_without_capacity_form():
    """A key-sequence split has no capacity form (its partials are lse pairs, not sums):
    rebalance=True then lowers each new cut again and captures it once; a cut seen before
    replays its graph. No kernel is built after the first call, one trace and one plan
    serve every batch, and each result equals eins.jit on that batch's ends."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, S, 16)).astype(np.float32)
    k = rng.standard_normal((2, S, 16)).astype(np.float32)
    v = rng.standard_normal((2, S, 16)).astype(np.float32)
    f = lambda q, k, v, e: eins.attention(q, k, v, segments=e)  # noqa: E731
    plan = {0: {"kv_sequence": 4}}
    d = eins.distribute(f, devices=4, plan=plan, backend="interpret", graphs=True,
                        rebalance=True)
    ref = eins.jit(f)
    first = None
    stream = STREAM + [STREAM[0], (9, 32), STREAM[2]]
    for n, ends in enumerate(stream, 1):
        e = llama.padded_ends(ends, 6, S)
        np.testing.assert_allclose(d(q, k, v, e), ref(q, k, v, e), rtol=2e-5, atol=2e-5)
        st, first = stream_stats(d, first, n)
        distinct = len(set(stream[:n]))
        assert st["lowerings"] == 1 + distinct
        assert st["graph_captures"] == distinct
    # without a capacity form the default keeps the compile-time cuts (one program)
    dflt = eins.distribute(f, devices=4, plan=plan, backend="interpret")
    dflt(q, k, v, llama.padded_ends(STREAM[0], 6, S))
    assert dflt.stats()["rebalances"] == 0


def test_interpret_forward_stream_multiplies_no_stale_row():
    """The forward's capacity program (the default on interpret), each finite batch after
    one with nan and inf in q and v: a call writes only its windows, so the capacity
    buffers keep those values outside them, and the kernel must never multiply them (it
    loads the rows with an empty key range and the keys before the first any row sees as
    zeros). Each finite batch equals eins.jit with no RuntimeWarning (numpy's, under the
    interpreter, on inf * 0 or an overflow), through one lowering and one capture."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((4, S, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, S, 16)).astype(np.float32) for _ in range(2))

    def f(q, k, v, e):
        return eins.attention(q * 2.0, k * 2.0, v * 2.0, segments=e) * 2.0

    plan = {0: {"d1": 4}, 1: {"d1": 4}, 2: {"d1": 4}, 3: {"sequence": 4}, 4: {"d1": 4}}
    d = eins.distribute(f, devices=4, plan=plan, backend="interpret")
    ref = eins.jit(f)
    bad_q, bad_v = q.copy(), v.copy()
    for x in (bad_q, bad_v):
        x[:, 3:9] = np.nan
        x[:, 15] = np.inf
        x[:, 20] = 3e38
    for ends in [(9, 32), (2, 5, 32), (20, 32), (12, 16, 32), (30, 32)]:
        with warnings.catch_warnings():   # the call's own nan and inf: numpy warns
            warnings.simplefilter("ignore", RuntimeWarning)
            d(bad_q, k, bad_v, llama.padded_ends((S,), 6, S))
        e = llama.padded_ends(ends, 6, S)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = d(q, k, v, e)
        np.testing.assert_allclose(got, ref(q, k, v, e), rtol=2e-5, atol=2e-5)
    st = d.stats()
    assert (st["lowerings"], st["graph_captures"], st["rebalances"]) == (1, 1, 10)
    assert d.last.capacity is not None
