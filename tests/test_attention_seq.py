"""Attention split along the sequence (issue 10, part 3-4): query-sequence splits whose blocks
read the keys they attend to, key-sequence splits whose (o, lse) partials combine with the
lse ⊕, end to end on the numpy executor and the generated programs, their FLOPs per block
and their cost."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import eins
from eins.errors import EinsError, PlanError
from eins.ir.joinagg import (AGG_FUNCS, Signature, aggregate, finalize, lse_pair_dtype,
                             partial_itemsize)
from eins.ir.types import Box, TensorType
from eins.ops import get_primitive
from eins.ops import attention_blocks as blk
from eins.ops.attention import attention_block_flops
from eins.cost import proxy as costmod
from eins.passes.enumerate_specs import eqn_candidates
from helpers import accumulation, assert_close

PRIM = get_primitive("attention")


def _qkv(batch=(), hq=4, hkv=2, s=16, d=4, dtype=np.float32, seed=0):
    r = np.random.default_rng(seed)
    return tuple(r.standard_normal((*batch, h, s, d)).astype(dtype) for h in (hq, hkv, hkv))


def _indexing(qs, kvs, causal=True, segments=None, dtype=np.float32):
    ins = [TensorType(s, np.dtype(dtype)) for s in (qs, kvs, kvs)]
    params = dict(causal=causal, segments=segments, scale=None)
    return PRIM.indexing(ins, PRIM.abstract(*ins, **params), **params)


def close(got, want, s, d=8):
    """Attention chains three accumulations (q.k over D, the softmax's sum and p.v over the
    keys) and a split adds one more, the ⊕ of the partials: depth 4 over max(S, D) terms."""
    assert_close(got, want, n=max(s, d), depth=4)


# ------------------------------------------------------------------------------ the lse ⊕
def _pairs(shape, rng, empty_rows=()):
    p = np.empty(shape, lse_pair_dtype(np.float32))
    p["o"] = rng.standard_normal(shape)
    p["lse"] = rng.standard_normal(shape)
    for r in empty_rows:
        p["o"][r], p["lse"][r] = 0, -np.inf
    return p


def test_lse_is_the_softmax_of_a_union_of_key_sets():
    # softmax(s) @ v over 10 keys == ⊕ of the softmaxes over keys [0,3), [3,7), [7,10)
    rng = np.random.default_rng(1)
    s, v = rng.standard_normal((5, 10)), rng.standard_normal((10, 3))
    p = np.exp(s - s.max(1, keepdims=True))
    want = (p / p.sum(1, keepdims=True)) @ v
    parts = []
    for a, b in ((0, 3), (3, 7), (7, 10)):
        part = np.empty((5, 3), lse_pair_dtype(np.float64))
        e = np.exp(s[:, a:b])
        part["o"] = (e / e.sum(1, keepdims=True)) @ v[a:b]
        part["lse"] = np.log(e.sum(1))[:, None]
        parts.append(part)
    got = finalize("lse", aggregate("lse", parts), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    assert got.dtype == np.float64


def test_lse_is_associative_commutative_with_identity():
    rng = np.random.default_rng(2)
    a, b, c = (_pairs((4, 3), rng, empty_rows=(i,)) for i in range(3))
    f = AGG_FUNCS["lse"]
    ab_c, a_bc, cba = f(f(a, b), c), f(a, f(b, c)), f(c, f(b, a))
    for x in (a_bc, cba):
        np.testing.assert_allclose(x["o"], ab_c["o"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(x["lse"], ab_c["lse"], rtol=1e-6, atol=1e-7)
    ident = _pairs((4, 3), rng, empty_rows=range(4))
    np.testing.assert_array_equal(f(a, ident), a)
    # rows nobody sees stay the identity (no NaN)
    both = f(ident, ident)
    assert np.all(both["o"] == 0) and np.all(both["lse"] == -np.inf)


def test_partials_are_pairs_and_signatures_cannot_name_lse():
    assert partial_itemsize("lse", np.float16) == partial_itemsize("lse", np.float32) == 8
    assert partial_itemsize("lse", np.float64) == 16
    assert partial_itemsize("sum", np.float16) == 2 and partial_itemsize(None, np.float32) == 4
    with pytest.raises(EinsError, match="malformed aggregation"):
        Signature.parse("ij->i | lse(j)")


def test_a_primitive_without_partial_kernel_says_so():
    with pytest.raises(EinsError, match="primitive 'matmul' has no partial kernel"):
        get_primitive("matmul").run_block(None, np.ones((2, 2)), np.ones((2, 2)), partial=True)


# ------------------------------------------------------------------------------ specs
def test_key_split_spec_and_its_partial_blocks():
    ix = _indexing((4, 12, 4), (2, 12, 4))
    spec = ix.spec({"kv_sequence": ((0, 4), (4, 12))})
    assert spec.aggs == ("lse",) and spec.multiplicity(0) == {Box.full((4, 12, 4)): 2}
    q, k, v = _qkv((), 4, 2, 12)
    parts = []
    for f in spec.fspecs:
        blocks = [a[b.relative_to(Box.full(a.shape))] for a, b in zip((q, k, v), f.inputs)]
        (r,) = PRIM.run_block(f, *blocks, partial=True, causal=True, segments=None, scale=None)
        assert r.dtype == lse_pair_dtype(np.float32) and r.shape == (4, 12, 4)
        parts.append(r)
    # causal: rows 0..3 see none of keys [4, 12)
    assert np.all(parts[1]["lse"][:, :4] == -np.inf) and np.all(parts[1]["o"][:, :4] == 0)
    got = finalize("lse", aggregate("lse", parts), np.float32)
    want = eins.attention(q, k, v)
    close(got, want, 12)
    # a key block run as if complete is refused (it would silently be a partial)
    f = spec.fspecs[1]
    blocks = [a[b.relative_to(Box.full(a.shape))] for a, b in zip((q, k, v), f.inputs)]
    with pytest.raises(EinsError, match=r"query rows \[0, 12\) attend to keys \[0, 12\), but "
                                        r"the block holds keys \[4, 12\)"):
        PRIM.run_block(f, *blocks, causal=True, segments=None, scale=None)


def test_both_sequence_indices_split_read_only_needed_keys():
    ix = _indexing((2, 8, 4), (1, 8, 4))
    spec = ix.spec({"sequence": ((0, 4), (4, 8)), "kv_sequence": ((0, 4), (4, 8))})
    rows = [(f.inputs[0].lo[1], f.inputs[0].hi[1], f.inputs[1].lo[1], f.inputs[1].hi[1])
            for f in spec.fspecs]
    # queries [0,4) need keys [0,4): inside key interval [4,8) there are none, so that block
    # reads the whole interval (and computes only the identity)
    assert rows == [(0, 4, 0, 4), (0, 4, 4, 8), (4, 8, 0, 4), (4, 8, 4, 8)]
    assert spec.aggs == ("lse",)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segments", [None, (5, 16), (2, 3, 9, 16)])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_enumerated_sequence_splits_are_work_balanced(causal, segments, p):
    ix = _indexing((2, 16, 4), (1, 16, 4), causal, segments)
    work = blk.row_work(causal, segments, 16)
    cuts = ix.balance["sequence"](p)
    assert len(cuts) == p and cuts[0][0] == 0 and cuts[-1][1] == 16
    shares = [int(work[a:b].sum()) for a, b in cuts]
    inner = (segments or (16,))[:-1]
    if all(b in inner for _, b in cuts[:-1]):   # whole segments per block: within 10%
        assert max(shares) <= 1.1 * (work.sum() / p + work.max())
    else:   # each share within one row's work of the ideal
        assert max(abs(x - work.sum() / p) for x in shares) <= work.max()
    kcuts = ix.balance["kv_sequence"](p)
    kwork = blk.key_work(causal, segments, 16)
    assert max(abs(int(kwork[a:b].sum()) - kwork.sum() / p) for a, b in kcuts) <= kwork.max()


def test_segment_end_cuts_only_when_balanced():
    # 8 packed sequences of 512: cuts at segment ends, exactly balanced
    ix = _indexing((2, 4096, 4), (1, 4096, 4), segments=tuple(range(512, 4097, 512)))
    assert ix.balance["sequence"](4) == ((0, 1024), (1024, 2048), (2048, 3072), (3072, 4096))
    # one short and one long sequence: the segment end 16 would leave one block with nearly
    # all the work, so the cut falls inside the long sequence at equal work
    ix = _indexing((2, 4096, 4), (1, 4096, 4), segments=(16, 4096))
    (a, b), (c, d) = ix.balance["sequence"](2)
    assert b == c and b not in (16,) and b > 2048
    work = blk.row_work(True, (16, 4096), 4096)
    assert abs(int(work[:b].sum()) - int(work[b:].sum())) <= work.max()


def test_enumerator_reaches_p_by_sequence_when_heads_cannot():
    q = eins.ShapeDtype((2, 64, 8), "float16")
    kv = eins.ShapeDtype((1, 64, 8), "float16")
    (e,) = eins.make_ir(eins.attention)(q, kv, kv).eqns
    cands, reached = eqn_candidates(e, 8)
    assert reached == 8
    kinds = {tuple(sorted(c.counts.items())) for c in cands}
    assert (("sequence", 8),) in kinds and (("kv_sequence", 8),) in kinds


# ------------------------------------------------------------------------------ executor
CASES = [  # (batch, hq, hkv, s, segments)
    ((), 4, 1, 16, None), ((), 8, 2, 16, (5, 16)), ((2,), 4, 2, 12, (3, 4, 12)),
    ((), 2, 2, 24, (7, 8, 20, 24))]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}q{c[2]}kv-s{c[3]}-{c[4]}")
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("split", ["sequence", "kv_sequence", "both"])
def test_distributed_equals_jit(split, p, case, causal):
    batch, hq, hkv, s, segments = case
    q, k, v = _qkv(batch, hq, hkv, s, seed=p)

    def f(q, k, v):
        return eins.attention(q, k, v, causal=causal, segments=segments) * 2.0

    plan = {"sequence": p} if split == "sequence" else {"kv_sequence": p} if (
        split == "kv_sequence") else {"sequence": 2, "kv_sequence": p // 2}
    d = eins.distribute(f, devices=p, plan={0: plan})
    got, want = d(q, k, v), eins.jit(f)(q, k, v)
    assert got.dtype == want.dtype
    close(got, want, s)
    spec = d.lower(q, k, v).physical.plan.eqn_plans[0].spec
    assert len(spec.fspecs) == p
    assert spec.aggs == (("lse",) if plan.get("kv_sequence", 1) > 1 else (None,))


def test_dp_splits_one_sequence_when_heads_are_too_few():
    # one kv head, p = 4: only a sequence split reaches 4 pieces
    q, k, v = _qkv((), 2, 1, 32, 8)
    d = eins.distribute(lambda q, k, v: eins.attention(q, k, v), devices=4)
    close(d(q, k, v), eins.attention(q, k, v), 32)
    ep = d.lower(q, k, v).physical.plan.eqn_plans[0]
    assert len(ep.spec.fspecs) == 4 and set(ep.intervals) >= {"sequence"}
    assert math.prod(len(iv) for iv in ep.intervals.values()) == 4


def test_optimized_schedule_and_bf16():
    q, k, v = _qkv((), 4, 2, 16, 8, dtype=eins.ir.types.bfloat16)
    f = lambda q, k, v: eins.attention(q, k, v)   # noqa: E731
    want = eins.jit(f)(q, k, v).astype(np.float32)
    for plan in ({"kv_sequence": 4}, {"sequence": 4}):
        d = eins.distribute(f, devices=4, plan={0: plan}, schedule="optimized",
                            synthesis_budget_s=0.05)
        got = d(q, k, v)
        assert got.dtype == q.dtype
        # bf16 output: partials combine in float32, one bf16 rounding at the end (2 ulp)
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=2 ** -7, atol=2 ** -7)


def test_forced_plan_errors_name_the_index():
    q, k, v = _qkv((), 2, 1, 8)
    with pytest.raises(PlanError, match=r"unknown index 'seq'; this eqn's indices that can be "
                                        r"split are \['heads_kv', 'kv_sequence', 'sequence'\]"):
        eins.distribute(eins.attention, devices=2, plan={0: {"seq": 2}})(q, k, v)
    with pytest.raises(PlanError, match=r"index 'kv_sequence' of extent 8 cannot be split "
                                        r"into 16 intervals"):
        eins.distribute(eins.attention, devices=16, plan={0: {"kv_sequence": 16}})(q, k, v)
    with pytest.raises(PlanError, match="index 'head_dim' is not shardable"):
        eins.distribute(eins.attention, devices=2, plan={0: {"head_dim": 2}})(q, k, v)


# ------------------------------------------------------------------------------ FLOPs
def _block_flops(spec, causal, segments):
    return [attention_block_flops(f, causal, segments) for f in spec.fspecs]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segments", [None, (1000, 4096), (300, 1900, 2000, 4096)])
@pytest.mark.parametrize("p", [2, 3, 8])
def test_block_flops_sum_to_the_whole_and_balance(causal, segments, p):
    qs, kvs = (8, 4096, 64), (2, 4096, 64)
    ix = _indexing(qs, kvs, causal, segments)
    whole = PRIM.flops([TensorType(qs, np.float16), TensorType(kvs, np.float16)] * 1 +
                       [TensorType(kvs, np.float16)], [TensorType(qs, np.float16)],
                       causal=causal, segments=segments, scale=None)
    row = 4 * 8 * 64 * int(blk.row_work(causal, segments, 4096).max())   # one row's FLOPs
    for name in ("sequence", "kv_sequence"):
        spec = ix.spec({name: ix.balance[name](p)})
        per = _block_flops(spec, causal, segments)
        assert sum(per) == whole
        inner = (segments or (4096,))[:-1]
        cuts = [f.inputs[0].hi[1] if name == "sequence" else f.inputs[1].hi[1]
                for f in spec.fspecs][:-1]
        if name == "sequence" and all(c in inner for c in cuts):
            assert max(per) <= 1.1 * (whole / p + row)   # whole segments per block
        else:   # equal shares, within one row's (or key column's) work
            assert max(per) - min(per) <= 2 * row
    mixed = ix.spec({"sequence": ix.balance["sequence"](2), "heads_kv": ((0, 1), (1, 2)),
                     "kv_sequence": ix.balance["kv_sequence"](2)})
    assert sum(_block_flops(mixed, causal, segments)) == whole


def _brute_pairs(qa, qb, ka, kb, causal, segments, s):
    ends = np.asarray(segments or (s,))
    seg = np.searchsorted(ends, np.arange(s), side="right")
    i, j = np.arange(qa, qb)[:, None], np.arange(ka, kb)[None, :]
    seen = seg[i] == seg[j]
    if causal:
        seen &= j <= i
    return int(seen.sum())


def test_pair_counts_and_work_prefixes_against_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(400):
        s = int(rng.integers(1, 30))
        cuts = sorted(set(rng.integers(1, s, size=int(rng.integers(0, 4))).tolist())) if s > 1 else []
        segments = tuple(cuts) + (s,) if rng.random() < 0.6 else None
        causal = bool(rng.random() < 0.5)
        qa, ka = int(rng.integers(0, s + 1)), int(rng.integers(0, s + 1))
        qb, kb = int(rng.integers(qa, s + 1)), int(rng.integers(ka, s + 1))
        assert blk.block_pairs(qa, qb, ka, kb, causal, segments, s) == _brute_pairs(
            qa, qb, ka, kb, causal, segments, s)
        x = int(rng.integers(0, s + 1))
        assert blk.prefix_work(causal, segments, s)(x) == _brute_pairs(
            0, x, 0, s, causal, segments, s)
        assert blk.prefix_work(causal, segments, s, keys=True)(x) == _brute_pairs(
            0, s, 0, x, causal, segments, s)


def test_pair_counts_over_many_segments_against_brute_force():
    # many short segments (a packed batch's): the segments inside both ranges are counted
    # at once from a prefix of whole segments (which the work prefixes share), the ones cut
    # by a range one by one; empty segments (repeated ends) and blocks of one or no row
    # included
    rng = np.random.default_rng(11)
    for _ in range(300):
        s = int(rng.integers(2, 80))
        cuts = np.sort(rng.integers(1, s, size=int(rng.integers(1, 30)))).tolist()
        segments = tuple(cuts) + (s,)   # sorted with repeats: empty segments
        causal = bool(rng.random() < 0.5)
        qa, ka = int(rng.integers(0, s + 1)), int(rng.integers(0, s + 1))
        qb, kb = int(rng.integers(qa, s + 1)), int(rng.integers(ka, s + 1))
        if rng.random() < 0.3:
            ka, kb = qa, qb   # a sequence split's diagonal block
        for segs in (segments, list(segments)):   # a list: no prefix kept for it
            assert blk.block_pairs(qa, qb, ka, kb, causal, segs, s) == _brute_pairs(
                qa, qb, ka, kb, causal, segments, s), (qa, qb, ka, kb, causal, segments)
            assert blk.prefix_work(causal, segs, s)(qb) == _brute_pairs(
                0, qb, 0, s, causal, segments, s)
            assert blk.prefix_work(causal, segs, s, keys=True)(kb) == _brute_pairs(
                0, s, 0, kb, causal, segments, s)
    # whole segments on both sides of a cut one: [0, 3) [3, 10) [10, 12), rows [0, 12),
    # keys [0, 11): 6 + 28 + 2 causal (rows 10 and 11 see key 10; key 11 is outside)
    assert blk.block_pairs(0, 12, 0, 11, True, (3, 10, 12), 12) == 6 + 28 + 2
    assert blk.block_pairs(0, 12, 0, 11, False, (3, 10, 12), 12) == 9 + 49 + 2


def test_whole_flops_hand_counted():
    q, kv = TensorType((2, 8, 16, 4), np.float32), TensorType((2, 2, 16, 4), np.float32)
    # segments [0,4) and [4,16), causal: 4*5/2 + 12*13/2 = 88 pairs; non-causal 16 + 144
    for causal, pairs in ((True, 88), (False, 160)):
        assert PRIM.flops([q, kv, kv], [q], causal=causal, segments=(4, 16), scale=None) == (
            4 * 2 * 8 * 4 * pairs)


def test_block_flops_count_the_blocks_own_segments():
    # the bug: a seq-split block was charged the global segment list. Block of
    # queries [4096, 8192) of 8 packed 1K sequences: 4 whole segments, half the work
    segs = tuple(range(1024, 8193, 1024))
    qb, kb = Box((0, 4096, 0), (32, 8192, 128)), Box((0, 4096, 0), (8, 8192, 128))
    from eins.ir.joinagg import FunctionSpec
    f = FunctionSpec((qb, kb, kb), (qb,))
    ins = [TensorType(b.shape, np.float16) for b in (qb, kb, kb)]
    got = PRIM.block_flops(f, ins, ins[:1], causal=True, segments=segs, scale=None)
    assert got == 4 * 32 * 128 * 4 * (1024 * 1025 // 2)
    # the time prediction uses the block's count: half the whole's compute
    from eins.hardware.topology import Topology
    from eins.cost.predict import kernel_seconds
    (e,) = eins.make_ir(lambda q, k, v: eins.attention(q, k, v, segments=segs))(
        eins.ShapeDtype((32, 8192, 128), "float16"), eins.ShapeDtype((8, 8192, 128), "float16"),
        eins.ShapeDtype((8, 8192, 128), "float16")).eqns
    # compute-bound (HBM unlimited), so the kernel time follows the block's FLOPs
    topo = Topology.build("compute-bound", range(1), hbm_bw=1e30, flops=1e12, memory=1e12)
    whole = FunctionSpec((Box.full((32, 8192, 128)),) + (Box.full((8, 8192, 128)),) * 2,
                         (Box.full((32, 8192, 128)),))
    assert kernel_seconds(e, f, topo) == pytest.approx(0.5 * kernel_seconds(e, whole, topo),
                                                       rel=0.02)


# ------------------------------------------------------------------------------ cost
def test_cost_proxy_prices_partials_as_pairs():
    q = eins.ShapeDtype((4, 64, 8), "float16")
    kv = eins.ShapeDtype((2, 64, 8), "float16")
    (e,) = eins.make_ir(eins.attention)(q, kv, kv).eqns
    ix = _indexing((4, 64, 8), (2, 64, 8), dtype=np.float16)
    spec = ix.spec({"kv_sequence": ix.balance["kv_sequence"](4)})
    local = costmod.local_cost(spec, e)
    assert local.aggregation == 3 * 4 * 64 * 8 * 8       # (m-1) pairs of 8 bytes
    qsplit = ix.spec({"sequence": ix.balance["sequence"](4)})
    kvrows = sum(f.inputs[1].shape[1] for f in qsplit.fspecs)
    # join: every block's q rows once, plus the key prefix each block reads (k and v)
    assert costmod.local_cost(qsplit, e).join == (4 * 64 * 8 + 2 * 2 * kvrows * 8) * 2
    assert costmod.local_cost(qsplit, e).aggregation == 0


# ------------------------------------------------------------------------------ codegen
def _lowered(plan, dtype=np.float32):
    q, k, v = _qkv((2,), 4, 2, 16, 8, dtype=dtype)
    f = lambda q, k, v: eins.attention(q, k, v) * 2.0   # noqa: E731
    return eins.distribute(f, devices=4, plan={0: plan}).lower(q, k, v), [q, k, v], f


@pytest.mark.parametrize("plan", [{"kv_sequence": 4}, {"sequence": 2, "kv_sequence": 2}])
def test_numpy_target_runs_the_lse_agg(plan):
    low, args, f = _lowered(plan)
    g = low.generate("numpy")
    assert "K.agg('lse', np.float32" in "".join(g.sources[d] for d in range(4))
    from eins.runtime.numpy_backend import execute
    want, _ = execute(low.physical.device, args)
    np.testing.assert_array_equal(g.run(args)[0], want[0])
    close(want[0], eins.jit(f)(*args), 16)


def test_cuda_target_runs_the_lse_agg_on_the_interpret_backend():
    # the generated GPU program (eins/runtime/gpu.py) on the CPU under Triton's interpreter:
    # float16 key-split partials, their lse ⊕ finalized to float16
    from eins.runtime.numpy_backend import execute
    low, args, f = _lowered({"kv_sequence": 4}, np.float16)
    g = low.generate("cuda")
    assert any("agg_lse_final_float16" in s for s in g.triton)
    want, _ = execute(low.physical.device, args)
    for graphs in (False, True):
        got = low.compile("interpret", graphs=graphs)(*args)
        assert got.dtype == np.float16
        close(got, want[0], 16)


_TRITON_LSE = r"""
import importlib.util, sys
import numpy as np, torch, triton
from eins.kernels.fusion import agg_source
from eins.ir.joinagg import aggregate, finalize, lse_pair_dtype
rng = np.random.default_rng(0)
blocks = []
for i in range(3):
    b = np.empty((5, 7), lse_pair_dtype(np.float32))
    b["o"], b["lse"] = rng.standard_normal((5, 7)), rng.standard_normal((5, 7))
    b["lse"][i] = -np.inf       # row i: block i sees no key
    b["lse"][4] = -np.inf       # row 4: no block does
    blocks.append(b)
want = aggregate("lse", blocks)
for final in (False, True):
    src = agg_source("agg", "lse", 3, np.float16 if final else None)
    path = sys.argv[1] + f"/agg_{final}.py"
    # the templates call the kernel helpers (build.HEADER; the interpreter's own prelude)
    from eins.kernels import build
    open(path, "w").write(build.HEADER + build.INTERPRET_PRELUDE + src)
    spec = importlib.util.spec_from_file_location(f"agg_{final}", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    ts = [torch.from_numpy(b.view(np.float32).reshape(5, 7, 2).copy()) for b in blocks]
    out = torch.empty((5, 7) if final else (5, 7, 2),
                      dtype=torch.float16 if final else torch.float32)
    m.agg[(triton.cdiv(35, 16),)](*ts, out, out.numel(), BLOCK=16)
    got = out.numpy()
    if final:
        np.testing.assert_allclose(got, finalize("lse", want, np.float16), rtol=1e-3)
    else:
        got = got.view(lse_pair_dtype(np.float32)).reshape(5, 7)
        np.testing.assert_allclose(got["o"], want["o"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["lse"], want["lse"], rtol=1e-6, atol=1e-6)
        assert np.all(got["lse"][4] == -np.inf) and np.all(got["o"][4] == 0)
print("ok")
"""


def test_triton_lse_agg_kernel_in_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _TRITON_LSE, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_spec_checker_covers_the_sequence_splits():
    from eins.validate_specs import check
    rep = check(["attention"])["attention"]
    assert not rep.wrong and not rep.missing and rep.checked >= 100


@pytest.mark.parametrize("plan", [{"kv_sequence": 4}, {"sequence": 2, "kv_sequence": 2}])
@pytest.mark.parametrize("scaled", [True, False])
def test_pairs_in_peak_memory_and_exchange_bytes(plan, scaled):
    """Partial buffers hold 8-byte pairs: the predicted peak memory and the exchange
    programs' byte counts equal what the executor measures."""
    from eins.ir.device import Kernel
    from eins.runtime.numpy_backend import execute
    from eins.cost.predict import peak_memory
    q, k, v = _qkv((2,), 4, 2, 16, 8)
    f = (lambda q, k, v: eins.attention(q, k, v) * 2.0) if scaled else eins.attention
    low = eins.distribute(f, devices=4, plan={0: plan}).lower(q, k, v)
    dprog = low.physical.device
    _, stats = execute(dprog, [q, k, v])
    assert peak_memory(dprog) == stats.peak_bytes
    assert sum(x.bytes_moved() for x in low.physical.exchange.exchanges) == stats.total_bytes
    kern = next(i for i in dprog.code[0] if isinstance(i, Kernel) and i.eqn == 0)
    assert dprog.bufs[0][kern.outs[0]].dtype == lse_pair_dtype(np.float32)
    assert dprog.bufs[0][kern.outs[0]].partial


@pytest.mark.parametrize("segments", [None, (5, 16)])
@pytest.mark.parametrize("attn_plan", [{"sequence": 4}, {"kv_sequence": 4},
                                       {"heads_kv": 2, "kv_sequence": 2}])
def test_llama_block_with_context_parallel_attention(segments, attn_plan):
    """The tiny LLaMA block with its attention forced to a sequence split (the other eqns
    planned by the DP around it) equals the single-device block."""
    from eins.models import llama
    cfg = llama.TINY
    rng = np.random.default_rng(5)
    w = llama.init_weights(cfg, rng)
    x = rng.standard_normal((16, cfg.d_model)).astype(np.float32)
    cos, sin = llama.rope_tables(16, cfg.head_dim, segments)
    fn = llama.block_fn(cfg, segments)
    prog = eins.make_ir(fn)(x, w, cos, sin)
    (i,) = [n for n, e in enumerate(prog.eqns) if e.prim == "attention"]
    d = eins.distribute(fn, devices=4, plan={i: attn_plan})
    n, depth = accumulation(prog)
    assert_close(d(x, w, cos, sin), eins.jit(fn)(x, w, cos, sin), n=n, depth=depth + 1)
    ep = d.lower(x, w, cos, sin).physical.plan.eqn_plans[i]
    assert {n: len(v) for n, v in ep.intervals.items() if len(v) > 1} == attn_plan


def test_non_causal_block_ending_at_a_segment_end_reads_only_its_segment():
    """Non-causal, packed segments (8, 16), the query rows cut at the segment end: each piece
    reads the keys of its own segment only (query rows [0, 8) end at the segment end 8, so
    they need keys [0, 8), not the next segment's), and the proxy charges
    2 pieces x (q + k + v) 2 x 8 x 4 float32 = 1,536 join bytes, no aggregation. The result
    equals the single-device attention."""
    q, k, v = _qkv((), 2, 2, 16, 4)
    fn = lambda q, k, v: eins.attention(q, k, v, causal=False, segments=(8, 16))  # noqa: E731
    f = eins.distribute(fn, devices=2, cost="proxy", plan={0: {"sequence": 2}})
    low = f.lower(q, k, v)
    fs = low.plan.eqn_plans[0].spec.fspecs
    assert [(p.inputs[1].lo[-2], p.inputs[1].hi[-2]) for p in fs] == [(0, 8), (8, 16)]
    assert [(p.inputs[0].lo[-2], p.inputs[0].hi[-2]) for p in fs] == [(0, 8), (8, 16)]
    assert low.cost_bytes == 2 * 3 * (2 * 8 * 4) * 4 == 1536
    assert blk.needed_keys(0, 8, False, (8, 16), 16) == (0, 8)
    assert blk.needed_keys(0, 9, False, (8, 16), 16) == (0, 16)
    assert_close(f(q, k, v), eins.jit(fn)(q, k, v), n=16, depth=3)
