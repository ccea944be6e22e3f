"""The block family of a compiled program with ``families=True`` on numpy (issue 36,
eins/passes/blockcut.py): the equal family with every token-wise eqn re-cut per batch at
whole-block balanced cuts, lowered incrementally, its results equal to eins.jit, and the
per-batch choice among the families made on an estimate of the time GPU by GPU that tracks
the lowered program's ``timeline_ms``."""
import numpy as np
import pytest

import eins
from eins.errors import EinsError
from eins.cost.predict import eqn_kernel_seconds, out_itemsizes, predict
from eins.cost.rows import RowKernels, row_line
from eins.ir.pytree import tree_flatten
from eins.models import llama
from eins.ir.program import eqn_indexing
from eins.passes.blockcut import BlockCut, alike, cut_positions, recut_pairs, token_pairs
from eins.passes.families import FamilySet
from eins.passes.rebalance import runtime_operands
from eins.runtime.numpy_backend import execute
from eins.tracing import ShapeDtype
from helpers import SPREAD, input_arrays, packed_call

# token-wise work large enough against the kernel model's floor that whole-block cuts pay
# on mixed batches (and runnable on numpy: ~2 s a batch)
CFG = llama.LlamaConfig(d_model=256, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=4096)
S, P = 4096, 4


def test_each_family_runs_on_its_batches_and_equals_jit():
    """A stream whose batch with one long document takes the heads split, whose 16 short
    documents take equal cuts and whose mixed batches take whole-block cuts; each equals
    eins.jit on its static ends; one trace, the families' two plans, a rebalance a call.
    The block call's cut: every token-wise eqn cut where its attention is, at the block
    cutter's positions, which are not the attention's own balance."""
    rng = np.random.default_rng(0)
    w = llama.init_weights(CFG, rng)
    x = (rng.standard_normal((S, CFG.d_model)) / 2).astype(np.float32)
    d = eins.distribute(llama.packed_block_fn(CFG), devices=P, topology="dgx-h100:4",
                        families="block")
    stream = [(3072, S), (512, 2048, S), tuple(range(256, S + 1, 256)), (1365, 2048, 3996, S)]
    block_cuts = []
    for n, ends in enumerate(stream, 1):
        args = packed_call(CFG, S, x, w, ends, 16)
        got = d(*args)
        want = eins.jit(llama.block_fn(CFG, ends))(*args[:4])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"], st["families"]) == (1, 2, n, 3)
        if d.last.choice.family == "block":
            cut = d.last.last_cut
            ops = runtime_operands(d.last.lowered.program)
            (att, _), = ops.items()
            iv = cut.plan.eqn_plans[att].intervals["sequence"]
            token = [j for j, ep in enumerate(cut.plan.eqn_plans)
                     if iv in ep.intervals.values()]
            assert len(token) > 10   # the block's token-wise eqns follow the cut
            balanced = cut.program.eqns[att].primitive.indexing(
                [a.type for a in cut.program.eqns[att].inputs],
                [v.type for v in cut.program.eqns[att].outputs],
                **cut.program.eqns[att].params).balance["sequence"](P)
            assert tuple(iv) != tuple(balanced)
            block_cuts.append(iv)
    assert [c.family for c in d.last.choices] == ["dp", "block", "equal", "block"]
    assert len(set(block_cuts)) == 2
    # a block batch seen before takes the program kept for its cut (none lowered)
    again = d.last.prepare(*packed_call(CFG, S, x, w, stream[1], 16))
    assert (again.family, again.lowered) == ("block", False)
    assert d.last.prepare(*packed_call(CFG, S, x, w, stream[3], 16)).lowered is False
    assert d.stats()["chosen"] == {"dp": 1, "equal": 1, "block": 4}


PAPER_S, PAPER_MAX = 32768, 64


@pytest.fixture(scope="module")
def paper():
    cfg = llama.PAPER
    x, w, cs, sn = llama.Workload("packed", 1, PAPER_S).args(cfg)
    shapes = (x, w, cs, sn, ShapeDtype((PAPER_MAX,), "int32"))
    low = eins.distribute(llama.packed_block_fn(cfg), devices=8,
                          topology="dgx-h100:8").lower(*shapes)
    ops = runtime_operands(low.program)
    return low, ops, FamilySet(low.compilation, ops, block=True)


def _arrays(low, ends):
    arrays = [None] * len(low.program.inputs)
    arrays[-1] = llama.padded_ends(ends, PAPER_MAX, PAPER_S)
    return arrays


def test_the_estimate_tracks_each_familys_timeline_and_picks_the_fastest(paper):
    """The paper block at 1x32K on dgx-h100:8: per batch, each family's estimate is within
    1% of its re-cut program's predicted time GPU by GPU (lowered, its exchanges
    simulated); where the fastest family's timeline beats the others' by more than 2% the
    choice picks it. One long document: the heads split; a mix of mid-sized documents:
    whole-block cuts, faster GPU by GPU than any other family, but not eqn by eqn."""
    low, ops, fs = paper
    assert fs.names == ["dp", "equal", "block"]
    u = PAPER_S // 64
    batches = [(PAPER_S,), (3 * u, 40 * u, PAPER_S), tuple(range(2 * u, PAPER_S + 1, 2 * u)),
               (5 * u, 9 * u, 20 * u, 22 * u, 30 * u, 41 * u, 47 * u, 60 * u, PAPER_S),
               (7 * u, 16 * u, 17 * u, 29 * u, 39 * u, 52 * u, 55 * u, PAPER_S)]
    picked = []
    for ends in batches:
        arrays = _arrays(low, ends)
        member, _, ests, _ = fs.choose(arrays)
        line, total = {}, {}
        for m in fs.members:
            cut = m.choice.recut(arrays, ops)
            pt = predict(m.lowered(cut))
            line[m.name], total[m.name] = pt["timeline_ms"], pt["total_ms"]
            assert ests[m.name] == pytest.approx(line[m.name], rel=0.01), (ends, m.name)
        best = sorted(line, key=line.get)
        if line[best[1]] > 1.02 * line[best[0]]:
            assert member.name == best[0], (ends, ests, line)
        picked.append(member.name)
        if member.name == "block":
            assert total["block"] > min(total.values())   # eqn by eqn it would lose
    assert picked[0] == "dp" and picked[2] == "equal" and "block" in picked[3:]


def test_block_cuts_balance_each_devices_whole_block(paper):
    """The cutter's weights are its first lowering's kernels (per token: the token-wise
    eqns' slowest device over its 4,096 tokens; per pair: the attention's over a device's
    4096 * 4097 / 2 visible pairs), and a batch's cuts leave every device's whole-block
    work within one token's (and its row's pairs) of the mean."""
    low, ops, fs = paper
    block = fs.members[-1]
    cutter = block.cutter
    (att, _), = ops.items()
    rows = predict(block.first.state)["per_eqn"]
    share = PAPER_S // 8
    assert cutter.per_token == pytest.approx(
        sum(r["compute_ms"] for r in rows if r["eqn"] != att) / 1e3 / share, rel=1e-12)
    assert cutter.per_unit[att] == pytest.approx(
        rows[att]["compute_ms"] / 1e3 / (share * (share + 1) // 2), rel=1e-12)
    ends = (1000, 2000, 20000, 20500, PAPER_S)
    cut = block.choice.recut(_arrays(low, ends), ops)
    iv = cut.plan.eqn_plans[att].intervals["sequence"]

    def pairs(a, b):   # visible (query, key) pairs of rows [a, b): each row its document's
        n = 0
        for r in range(a, b):
            n += r - max([0] + [e for e in ends if e <= r]) + 1
        return n

    work = [cutter.per_token * (b - a) + cutter.per_unit[att] * pairs(a, b) for a, b in iv]
    mean = sum(work) / len(work)
    row = cutter.per_token + cutter.per_unit[att] * PAPER_S   # one row at most
    assert all(abs(x - mean) <= row for x in work), (iv, work)
    for j, n in cutter.pairs:
        assert cut.plan.eqn_plans[j].intervals[n] == iv


def test_twins_share_their_specs_and_kernel_times(paper):
    """Eqns alike (same primitive, operand types and params) and cut alike get one spec a
    batch: on the paper block the key and value projections (5, 9) and their reshapes and
    transposes, the query and output projections (1, 15: both 4096 x 4096), the two norms
    (0, 17), the gate and up projections (18, 20) and the two residual adds (16, 23); the
    query's reshape (2, to 32 heads) is not the key's (6, to 8). The specs are those each
    eqn's own indexing gives, and the estimate prices them as without sharing."""
    low, ops, fs = paper
    block = fs.members[-1]
    cutter = block.cutter
    assert cutter.twin == {9: 5, 10: 6, 11: 7, 15: 1, 17: 0, 20: 18, 23: 16}
    eqns = block.planned.program.eqns
    assert alike(eqns[1], eqns[15]) and not alike(eqns[1], eqns[5])
    assert not alike(eqns[2], eqns[6]) and not alike(eqns[16], eqns[21])
    ends = (1000, 2000, 20000, 20500, PAPER_S)
    equal = fs.members[1].choice.recut(_arrays(low, ends), ops)
    cut = cutter(equal)
    cuts = cutter.cuts(equal)
    alone = recut_pairs(equal, cutter.pairs, cuts)   # every spec from its own indexing
    for j, r in cutter.twin.items():
        assert cut.plan.eqn_plans[j].spec is cut.plan.eqn_plans[r].spec
        assert cut.plan.eqn_plans[j].spec == alone.plan.eqn_plans[j].spec
        assert alone.plan.eqn_plans[j].spec is not alone.plan.eqn_plans[r].spec
    assert block.choice.estimate(cut) == block.choice.estimate(alone)


def test_token_wise_kernels_priced_from_their_rows_are_the_full_count(paper):
    """The block family's per-call estimate prices each token-wise eqn's kernels from its
    blocks' rows (eins.cost.rows.RowKernels: FLOPs and bytes affine in them, checked at
    compile time): every one of the paper block's 23 token-wise eqns, to the last bit of
    the full count's seconds, on batches of one document, of equal ones and of mixed ones
    (each device a different number of rows); attention is priced in full."""
    low, ops, fs = paper
    block = fs.members[-1]
    rows = block.choice.rows
    att, = ops
    assert sorted(rows) == sorted(j for j, _ in block.cutter.pairs if j != att)
    assert len(rows) == 23
    topo = low.compilation.topology
    names = dict(block.cutter.pairs)
    u = PAPER_S // 64
    lengths = []
    for ends in [(PAPER_S,), tuple(range(2 * u, PAPER_S + 1, 2 * u)),
                 (1000, 2000, 20000, 20500, PAPER_S), (7 * u, 16 * u, 17 * u, PAPER_S)]:
        cut = block.choice.recut(_arrays(low, ends), ops)
        lengths.append({b - a for a, b in cut.plan.eqn_plans[0].intervals[names[0]]})
        for j, rk in rows.items():
            e, spec = cut.program.eqns[j], cut.plan.eqn_plans[j].spec
            assert rk.seconds(spec) == eqn_kernel_seconds(e, spec.fspecs, topo,
                                                          out_itemsizes(e, spec)), (ends, j)
    assert max(map(len, lengths)) == 8   # a batch whose eight devices' rows all differ
    e, spec = low.program.eqns[att], low.compilation.plan.eqn_plans[att].spec
    axes = cut_positions(e, eqn_indexing(e), names[att])
    assert RowKernels(e, spec, topo, axes, PAPER_S).lines is None   # where its rows lie


def test_rows_lines_hold_only_where_every_count_is_on_them():
    """A block's counts are kept as a line only where every probe's integer count lies on
    it: a count off by one, a float count, a quadratic one are priced in full."""
    rows = (1, 2, 3, 5, 8, 13, 4096, 512)
    def at(f, b):
        return [(f(r), b(r)) for r in rows]
    assert row_line(at(lambda r: 6 * r, lambda r: 100 + 4 * r), rows) == (6, 6, 104, 4)
    assert row_line(at(lambda r: 0, lambda r: 8 * r), rows) == (0, 0, 8, 8)
    assert row_line(at(lambda r: r * r, lambda r: 4 * r), rows) is None
    assert row_line(at(lambda r: 6 * r + (r == 13), lambda r: 4 * r), rows) is None
    assert row_line(at(lambda r: 6.0 * r, lambda r: 4 * r), rows) is None
    assert row_line(at(lambda r: 6 * r, lambda r: 4 * r + (r == 512)), rows) is None


def test_token_pairs_take_the_token_dimension_only():
    """A weight matrix whose rows number the tokens, cut at the same equal places by the
    user's plan, does not follow the token cuts: its index reaches no token axis."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 32, 8)).astype(np.float32) for _ in range(3))
    a, b = (rng.standard_normal((32, 32)).astype(np.float32) for _ in range(2))
    e = llama.padded_ends((32,), 4, 32)

    def f(q, k, v, e, a, b):
        return eins.attention(q, k, v, segments=e) * 2.0, a @ b

    prog = eins.make_ir(f)(q, k, v, e, a, b)
    ops = runtime_operands(prog)
    (att, _), = ops.items()
    mm = next(i for i, x in enumerate(prog.eqns) if i != att and len(x.inputs) == 2
              and x.inputs[1].type.shape == (32, 32))
    low = eins.distribute(f, devices=4, tuning=SPREAD,
                          plan={att: {"sequence": 4}, mm: {"i": 4}}).lower(q, k, v, e, a, b)
    comp = low.compilation
    iv = comp.plan.eqn_plans[att].intervals["sequence"]
    assert comp.plan.eqn_plans[mm].intervals["i"] == iv   # the same cuts
    pairs = token_pairs(comp, ops)
    assert pairs[0] == (att, "sequence")
    assert all(j != mm for j, _ in pairs)
    # the attention's output scaled: the same token dimension
    assert any(j not in (att, mm) for j, _ in pairs)


# the tiny block's training step: attention_fwd and attention_bwd both re-cut per call
TINY_S = 32


def tiny_loss(w, x, cos, sin, e):
    return eins.sum(llama.packed_block_fn(llama.TINY)(x, w, cos, sin, e) ** 2) / TINY_S


def test_the_block_family_of_a_training_step_equals_jit():
    """A training step's block family (its forward and backward attention and every
    token-wise eqn of both passes re-cut at the whole-block cuts), lowered incrementally
    from the family's first lowering: the loss and every gradient equal eins.jit on each
    batch's static ends."""
    rng = np.random.default_rng(4)
    w = llama.init_weights(llama.TINY, rng)
    x = (rng.standard_normal((TINY_S, llama.TINY.d_model)) / 2).astype(np.float32)
    f = eins.value_and_grad(tiny_loss)
    args0 = packed_call(llama.TINY, TINY_S, x, w, (TINY_S,))
    args0 = (w, x) + args0[2:]
    low = eins.distribute(f, devices=8, tuning=SPREAD).lower(*args0)
    ops = runtime_operands(low.program)
    fs = FamilySet(low.compilation, ops, block=True)
    block = fs.members[-1]
    assert block.name == "block" and len(block.eqns) > 2 * len(ops)
    pairs = block.cutter.pairs
    assert {j for j, _ in pairs} >= set(ops)   # the forward's and the backward's attention
    equal = {tuple(block.planned.plan.eqn_plans[j].intervals[n]) for j, n in pairs}
    moved = 0
    for ends in [(TINY_S,), (10, 20, TINY_S), (3, 5, 17, TINY_S), (1, 2, 3, 4, 5, TINY_S)]:
        _, _, cos, sin, e = packed_call(llama.TINY, TINY_S, x, w, ends)
        args = (w, x, cos, sin, e)
        arrays = input_arrays(*args)
        cut = block.choice.recut(arrays, ops)
        # every token-wise eqn of both passes at one cut, this batch's whole-block one
        cuts = {tuple(cut.plan.eqn_plans[j].intervals[n]) for j, n in pairs}
        assert len(cuts) == 1
        moved += cuts != equal
        outs, _ = execute(block.lowered(cut).device, arrays)

        def static(w, x, cos, sin, ends=ends):
            return eins.sum(llama.block_fn(llama.TINY, ends)(x, w, cos, sin) ** 2) / TINY_S

        want = tree_flatten(eins.jit(eins.value_and_grad(static))(w, x, cos, sin))[0]
        assert len(outs) == len(want)
        for o, t in zip(outs, want):
            np.testing.assert_allclose(o, t, rtol=1e-4, atol=1e-5, err_msg=str(ends))
    assert moved >= 3   # the cuts leave the equal ones (one document's may keep them)


def test_the_block_family_is_numpys_default_and_refused_on_the_gpu_backends():
    """``families=True`` on numpy keeps the DP's family, the equal cuts and the block
    family (all three chosen among per batch: about 7 ms of host CPU a batch at 1x32K on
    the paper block, docs/measured.md), as ``"block"`` does; a GPU backend runs each family
    through one capacity program, which re-cuts only the attention (whole-block cuts would
    be a new program and graphs per batch), so ``True`` keeps the first two there and
    ``"block"`` is refused with a named error."""
    q, k, v = (np.random.default_rng(2).standard_normal((4, 48, 8)).astype(np.float32)
               for _ in range(3))

    def attn(q, k, v, e):
        return eins.attention(q, k, v, segments=e) * 2.0

    e = llama.padded_ends((12, 48), 8, 48)
    for families in (True, "block"):
        c = eins.distribute(attn, devices=4, families=families, tuning=SPREAD)
        c(q, k, v, e)
        assert list(c.last.families) == ["dp", "equal", "block"]
    low = eins.distribute(attn, devices=4, tuning=SPREAD).lower(q, k, v, e)
    assert list(low.compile("interpret", families=True).families) == ["dp", "equal"]
    with pytest.raises(EinsError, match="families='block'.*not on 'interpret'"):
        low.compile("interpret", families="block")
