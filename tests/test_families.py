"""The plan families of a compiled program with ``families=True`` (issue 36,
eins/passes/families.py): three families planned once from the shapes, each call running
the one ``choose`` estimates fastest for its ends (recorded per call and counted in
``stats()``), every result equal to eins.jit on those ends, and nothing traced or planned
after compile."""
from dataclasses import replace

import numpy as np
import pytest

import eins
from eins.errors import EinsError
from eins.models import llama
from eins.passes import PLANNING, run_passes
from eins.passes.blockcut import BlockCut
from eins.passes.families import bucket, reference
from eins.passes.rebalance import Choice, choose, recut, runtime_operands
from eins.passes.relower import Family
from eins.tracing import ShapeDtype
from helpers import SPREAD, attention_gradient, input_arrays, packed_call

# a block whose 4 kv heads the DP splits over 4 devices, as it splits the paper block's,
# with heads wide enough that the choice goes both ways over the stream
CFG = llama.LlamaConfig(d_model=16, n_heads=4, n_kv_heads=4, head_dim=256, d_ff=24)
S, P = 512, 4
STREAM = [(512,), (51, 128, 256, 512), (64, 128, 192, 256, 320, 384, 448, 512),
          (5, 17, 412, 512), (256, 512), (3, 482, 511, 512),
          (64, 128, 192, 256, 320, 384, 448, 512)]


def expected_choices(low, p, max_segments, block=False):
    """The families the docs describe, built here from their definitions: the lowering's
    own plan, and attention (the only re-cut eqn) forced to split its query sequence p
    ways at its equal cuts (the DP's plan where that is it), first lowered for a segment
    ending at each of its cuts; with ``block`` (on numpy, ``families=True`` or ``"block"``)
    that one again with its token-wise eqns at whole-block cuts."""
    ops = runtime_operands(low.program)
    (att, (_, k)), = ops.items()
    dp = low.compilation
    forced = run_passes(replace(dp, plan=None, options=replace(
        dp.options, plan={att: {"sequence": p}})), PLANNING)
    cuts = forced.plan.eqn_plans[att].intervals["sequence"]
    arrays = [None] * len(low.program.inputs)
    arrays[k] = llama.padded_ends([b for _, b in cuts], max_segments, cuts[-1][1])
    ref = Family(recut(forced, arrays, ops, balance=False)).state
    names = ["dp", "equal"]
    choices = [Choice(dp, Family(dp).state, ops), Choice(forced, ref, ops, balance=False)]
    if block:
        names.append("block")
        choices.append(Choice(forced, ref, ops, False, BlockCut(forced, ref, ops)))
    return names, choices, ops


@pytest.mark.parametrize("ends,p,want", [
    ((12, 24, 36, 48), 4, 0),            # longest 12 = one device's share of 48
    ((6, 12, 18, 24, 30, 36, 42, 48), 4, 0),
    ((13, 24, 36, 48), 4, 1),            # 13 * 4 = 52 > 48, <= 96
    ((24, 48), 4, 1),                    # 24 * 4 = 96 = 48 * 2
    ((25, 48), 4, 2),                    # 100 > 96, <= 192
    ((48,), 4, 2),                       # one document: log2(p)
    ((48,), 8, 3),
    ((48,), 1, 0),                       # one device holds everything
])
def test_bucket_is_the_longest_documents_shares(ends, p, want):
    assert bucket(llama.padded_ends(ends, 8, 48), p) == want


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(3)
    w = llama.init_weights(CFG, rng)
    return (rng.standard_normal((S, CFG.d_model)) / 2).astype(np.float32), w


@pytest.mark.parametrize("families", [True, "block"])
def test_each_call_runs_the_family_choose_picks(weights, families):
    x, w = weights
    d = eins.distribute(llama.packed_block_fn(CFG), devices=P, topology="dgx-h100:4",
                        tuning=SPREAD, families=families)
    names = choices = ops = None
    made = None
    for n, ends in enumerate(STREAM, 1):
        args = packed_call(CFG, S, x, w, ends)
        got = d(*args)
        want = eins.jit(llama.block_fn(CFG, ends))(*args[:4])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        st = d.stats()
        if names is None:   # the families, built at compile: one trace, two plans (on
            # numpy both spellings keep the block family too, sharing the equal one's plan)
            names, choices, ops = expected_choices(d.last.lowered, P, 8, block=True)
            assert list(d.last.families) == names
            assert (st["traces"], st["plans"], st["families"]) == (1, 2, len(names))
            made = st["lowerings"]
        arrays = input_arrays(*args)
        k, _, t = choose(choices, arrays, ops)
        rec = d.last.choice
        assert (rec.call, rec.family) == (n, names[k])
        assert rec.estimated_ms == pytest.approx(t * 1e3, rel=1e-12)
        assert rec.estimates[names[k]] == rec.estimated_ms == min(rec.estimates.values())
        assert f"family {names[k]}, estimated" in str(rec)
        # no trace, no plan after the first call; one rebalance a call, a lowering per new cut
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 2, n)
        assert st["lowerings"] == made + sum(c.lowered for c in d.last.choices) - \
            d.last.choices[0].lowered
        assert sum(st["chosen"].values()) == n
    chosen = d.stats()["chosen"]
    assert chosen == {m: sum(c.family == m for c in d.last.choices) for m in names}
    # the stream runs these two (its token-wise work is too small for whole-block cuts to
    # pay: tests/test_block_family.py runs that family)
    assert chosen["dp"] >= 2 and chosen["equal"] >= 2
    # a batch seen before reuses its program
    assert not d.last.choices[6].lowered and d.last.choices[6].family == \
        d.last.choices[2].family


PAPER_S, PAPER_MAX = 32768, 64


@pytest.mark.parametrize("families", [True, "block"])
def test_paper_block_picks_heads_for_long_documents_and_equal_cuts_for_short(families):
    """The paper block at 1x32K on dgx-h100:8 (prepare: the per-call work, not run): the
    DP's heads split for a batch with long documents, the equal-token sequence split for
    one of 64 or 32 short ones; each as ``choose`` says, and the chosen cut's predicted
    time GPU by GPU within 1% of its estimate."""
    cfg = llama.PAPER
    x, w, cs, sn = llama.Workload("packed", 1, PAPER_S).args(cfg)
    shapes = (x, w, cs, sn, ShapeDtype((PAPER_MAX,), "int32"))
    low = eins.distribute(llama.packed_block_fn(cfg), devices=8,
                          topology="dgx-h100:8").lower(*shapes)
    c = low.compile(families=families)
    names, choices, ops = expected_choices(low, 8, PAPER_MAX, block=True)
    assert list(c.families) == names
    assert c.families["dp"].eqn_plans[next(iter(ops))].splits == {"heads_kv": 8}
    u = PAPER_S // 64
    batches = [(PAPER_S,), tuple(range(u, PAPER_S + 1, u)), (3 * u, 40 * u, PAPER_S),
               tuple(range(2 * u, PAPER_S + 1, 2 * u))]
    picked = []
    for ends in batches:
        e = llama.padded_ends(ends, PAPER_MAX, PAPER_S)
        rec = c.prepare(*shapes[:4], e)
        arrays = [None] * len(low.program.inputs)
        arrays[-1] = e
        k, _, t = choose(choices, arrays, ops)
        assert rec.family == names[k] and rec.estimated_ms == pytest.approx(t * 1e3)
        pt = c.predicted_time()["timeline_ms"]
        assert pt == pytest.approx(rec.estimated_ms, rel=0.01)
        picked.append(rec.family)
    assert picked == ["dp", "equal", "dp", "equal"]
    # documents ending at every equal cut read no key outside their block: one program
    assert c.choices[1].lowered and not c.choices[3].lowered
    st = c.counters()
    assert (st["traces"], st["plans"], st["rebalances"]) == (1, 2, 4)
    assert st["chosen"] == {"dp": 2, "equal": 2, "block": 0}


def test_a_list_of_families_keeps_those_alone(weights):
    """``families=["equal", "dp"]``: the two families alone (no block family on numpy), in
    the order a tie goes to; each call runs the one ``choose`` picks between those two, and
    equals eins.jit on its ends."""
    x, w = weights
    d = eins.distribute(llama.packed_block_fn(CFG), devices=P, topology="dgx-h100:4",
                        tuning=SPREAD, families=["equal", "dp"])
    names = choices = ops = None
    for n, ends in enumerate(STREAM, 1):
        args = packed_call(CFG, S, x, w, ends)
        np.testing.assert_allclose(d(*args), eins.jit(llama.block_fn(CFG, ends))(*args[:4]),
                                   rtol=1e-5, atol=1e-5)
        if names is None:
            names, choices, ops = expected_choices(d.last.lowered, P, 8)
            assert list(d.last.families) == names == ["dp", "equal"]
        k, _, t = choose(choices, input_arrays(*args), ops)
        assert (d.last.choice.family, d.last.choice.estimated_ms) == \
            (names[k], pytest.approx(t * 1e3, rel=1e-12))
        assert set(d.last.choice.estimates) == {"dp", "equal"}
    st = d.stats()
    assert st["families"] == 2 and set(st["chosen"]) == {"dp", "equal"}
    assert st["chosen"]["dp"] >= 2 and st["chosen"]["equal"] >= 2


@pytest.mark.parametrize("families, match", [
    (["dp", "heads"], r"families=\['dp', 'heads'\]: a list of families names some of "
                      r"\('dp', 'equal', 'block'\); 'heads' is none of them"),
    ((), r"families=\(\): .*none is named"),
    (("dp", "dp"), r"families=\('dp', 'dp'\): .*one is named twice"),
    (["dp", 1], r"1 is none of them")])
def test_a_bad_list_of_families_is_named(families, match):
    with pytest.raises(EinsError, match=match):
        eins.distribute(attn, devices=4, families=families)


def test_a_list_naming_block_off_numpy_or_where_it_is_left_out_is_refused():
    with pytest.raises(EinsError, match="families='block'.*numpy backend only, not on "
                                        "'interpret'"):
        eins.distribute(attn, devices=4, families=["dp", "block"], backend="interpret")
    # 3 query rows cannot be cut 4 ways: no equal family (nor block, which shares its plan)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 3, 8)) for _ in range(3))
    d = eins.distribute(attn, devices=4, families=("equal", "block"))
    with pytest.raises(EinsError, match=r"families=\('equal', 'block'\): this program has "
                                        r"none of them; its families are \['dp'\]"):
        d(q, k, v, llama.padded_ends((1, 3), 4, 3))


def test_prepare_and_predicted_time_refuse_what_they_cannot_do(weights):
    x, w = weights
    args = packed_call(CFG, S, x, w, (100, 512))
    d = eins.distribute(llama.packed_block_fn(CFG), devices=P, tuning=SPREAD)
    c = d.lower(*args).compile(families=True)
    with pytest.raises(EinsError, match="predicted_time.*none ran yet"):
        c.predicted_time()
    with pytest.raises(EinsError, match=r"argument 4 \(the runtime segment ends\) must be "
                                        r"an array, got ShapeDtype"):
        c.prepare(*args[:4], ShapeDtype((8,), "int32"))
    off = d.lower(*args).compile(rebalance=False)
    with pytest.raises(EinsError, match="prepare.*rebalance on"):
        off.prepare(*args)
    assert c.choice is None and off.choice is None


def attn(q, k, v, e):
    return eins.attention(q, k, v, segments=e)


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, 48, 8)), rng.standard_normal((4, 48, 8)),
            rng.standard_normal((4, 48, 8)))


def test_families_on_interpret_capture_once_per_family():
    """On the GPU backends each family runs one program (a capacity program, or the heads
    split's one cut): a family's first call captures its graphs, later calls none."""
    pytest.importorskip("triton")
    q, k, v = qkv()
    d = eins.distribute(attn, devices=4, backend="interpret", families=True, tuning=SPREAD)
    ref = eins.jit(attn)
    f32 = [a.astype(np.float32) for a in (q, k, v)]
    for n, ends in enumerate([(6, 12, 18, 24, 30, 36, 42, 48), (40, 48), (5, 10, 48),
                              (12, 24, 36, 48), (48,), (24, 48)], 1):
        e = llama.padded_ends(ends, 8, 48)
        np.testing.assert_allclose(d(*f32, e), ref(q, k, v, e), rtol=1e-5, atol=1e-5)
        st = d.stats()
        ran = {c.family for c in d.last.choices}
        assert (st["traces"], st["rebalances"], st["graph_captures"]) == (1, n, len(ran))
        assert st["families"] == len(d.last.families) >= 2


def test_families_need_the_rebalance_and_runtime_ends():
    q, k, v = qkv(2)
    e = llama.padded_ends((12, 48), 8, 48)
    with pytest.raises(EinsError, match="families=True.*rebalance=False"):
        eins.distribute(attn, devices=4, families=True, rebalance=False)(q, k, v, e)
    static = eins.distribute(lambda q, k, v: eins.attention(q, k, v, segments=(12, 48)),
                             devices=4, families=True)
    with pytest.raises(EinsError, match="no runtime operand"):
        static(q, k, v)
    with pytest.raises(EinsError, match="families must be True, False, 'block' or a list of "
                                        "family names .*, got 'yes'"):
        eins.distribute(attn, devices=4, families="yes")
    with pytest.raises(EinsError, match="families='block'.*numpy backend only, not on "
                                        "'interpret'"):
        eins.distribute(attn, devices=4, families="block", backend="interpret")


# the tiny block's training step: attention_fwd and attention_bwd both re-cut per call
TINY_S = 32
GRAD_STREAM = [(TINY_S,), (10, 20, TINY_S), (3, 5, 17, TINY_S), (8, 16, 24, TINY_S),
               (1, 2, 3, 4, 5, TINY_S)]


def tiny_loss(w, x, cos, sin, e):
    return eins.sum(llama.packed_block_fn(llama.TINY)(x, w, cos, sin, e) ** 2) / TINY_S


def static_tiny_loss(ends):
    block = llama.block_fn(llama.TINY, ends)
    return lambda w, x, cos, sin: eins.sum(block(x, w, cos, sin) ** 2) / TINY_S


def test_gradient_families_are_first_lowered_at_aligned_ends():
    """A training step's families (its forward attention_fwd and backward attention_bwd
    re-cut per call, both with ``aligned``): each family is first lowered for a segment
    ending at each of its query cuts, the same for the forward and the backward, so each
    call's estimates are those of Choices built on that lowering here (not on the
    shapes-only boxes, whose estimates differ); every batch's loss and gradients equal
    eins.jit on its static ends, with one trace and the families' two plans."""
    rng = np.random.default_rng(4)
    w = llama.init_weights(llama.TINY, rng)
    x = (rng.standard_normal((TINY_S, llama.TINY.d_model)) / 2).astype(np.float32)
    f = eins.value_and_grad(tiny_loss)
    d = eins.distribute(f, devices=P, tuning=SPREAD, families="block")
    choices = None
    shapes_only = []
    for n, ends in enumerate(GRAD_STREAM, 1):
        _, _, cos, sin, e = packed_call(llama.TINY, TINY_S, x, w, ends)
        args = (w, x, cos, sin, e)
        value, grads = d(*args)
        want_value, want = eins.jit(eins.value_and_grad(static_tiny_loss(ends)))(
            w, x, cos, sin)
        np.testing.assert_allclose(value, want_value, rtol=1e-4)
        for k in w:
            np.testing.assert_allclose(grads[k], want[k], rtol=1e-4, atol=1e-5,
                                       err_msg=f"{ends} {k}")
        if choices is None:
            low = d.last.lowered
            ops = runtime_operands(low.program)
            assert sorted(low.program.eqns[i].primitive.name for i in ops) == \
                ["attention_bwd", "attention_fwd"]
            dp = low.compilation
            forced = run_passes(replace(dp, plan=None, options=replace(
                dp.options, plan={i: {"sequence": P} for i in ops})), PLANNING)
            names = list(d.last.families)
            assert names == ["dp", "equal", "block"]
            choices, plain = [], []
            for name, planned in (("dp", dp), ("equal", forced)):
                assert d.last.families[name].eqn_plans[next(iter(ops))].spec.fspecs == \
                    planned.plan.eqn_plans[next(iter(ops))].spec.fspecs
                cuts = {planned.plan.eqn_plans[i].intervals["sequence"] for i in ops}
                assert len(cuts) == 1   # the forward and the backward cut alike
                (iv,) = cuts
                assert len(iv) == P
                arrays = [None] * len(low.program.inputs)
                arrays[next(iter(ops.values()))[1]] = llama.padded_ends(
                    [b for _, b in iv], 8, TINY_S)
                ref = Family(recut(planned, arrays, ops, balance=False)).state
                choices.append(Choice(planned, ref, ops, balance=name == "dp"))
                plain.append(Choice(planned, Family(planned).state, ops,
                                    balance=name == "dp"))
            # the block family: the equal one re-cut at whole-block cuts (the forward's and
            # the backward's token cuts agree, so it has one)
            for out in (choices, plain):
                block = BlockCut(forced, out[1].lowered, ops)
                assert block.pairs is not None
                out.append(Choice(forced, out[1].lowered, ops, False, block))
        arrays = input_arrays(*args)
        k, _, t = choose(choices, arrays, ops)
        rec = d.last.choice
        assert (rec.call, rec.family) == (n, names[k])
        assert rec.estimated_ms == pytest.approx(t * 1e3, rel=1e-12)
        for c, name in zip(choices, names):
            assert rec.estimates[name] == pytest.approx(
                c.estimate(c.recut(arrays, ops)) * 1e3, rel=1e-12)
        shapes_only.append(choose(plain, arrays, ops)[2])
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 2, n)
    # the shapes-only boxes (every block reading every key a batch could need) would have
    # estimated otherwise
    assert any(a != pytest.approx(c.estimated_ms / 1e3, rel=1e-9)
               for a, c in zip(shapes_only, d.last.choices))


def test_reference_is_the_one_value_aligning_every_eqn():
    """``reference`` of an attention's gradient: with the forward and the backward split
    alike, the re-cut at the ends sitting at their query cuts (each backward block then
    reads keys from its own first row on); split apart (4 and 2 query blocks), no one
    ends array aligns both, and it keeps the shapes-only boxes (the plan itself)."""
    g, (q, k, v), _, (fwd, bwd) = attention_gradient(TINY_S, 1)
    e = llama.padded_ends((TINY_S,), 6, TINY_S)
    for pieces, aligned in ((4, True), (2, False)):
        low = eins.distribute(g, devices=4, plan={fwd: {"sequence": 4},
                                                  bwd: {"sequence": pieces}}).lower(q, k, v, e)
        comp = low.compilation
        ops = runtime_operands(low.program)
        ref = reference(comp, ops)
        assert (ref is not comp) == aligned
        if aligned:
            fs = ref.plan.eqn_plans[bwd].spec.fspecs
            assert [(f.inputs[0].lo[-2], f.inputs[1].lo[-2]) for f in fs] == \
                [(0, 0), (8, 8), (16, 16), (24, 24)]
            shapes = comp.plan.eqn_plans[bwd].spec.fspecs
            assert [f.inputs[1].lo[-2] for f in shapes] == [0, 0, 0, 0]
