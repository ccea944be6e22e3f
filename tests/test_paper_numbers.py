"""The paper's worked numbers and checkable definitions that no other test pinned.

Each test names the paper's section or example it reproduces. Numbers are the paper's; where
eins deliberately differs (its attention exports more specs than Example 3.10's), the test
says why and pins eins's value with the relation to the paper's.
"""
import functools

import numpy as np
import pytest

import eins
from eins.ir.plan import CostBreakdown
from eins.ir.types import Box

S = eins.ShapeDtype


# ----------------------------------------------------------------- Section 3.1, Definition 3.1
def test_definition_3_1_named_indices_num_rows_256_num_cols_512():
    """[num_rows, num_cols] with num_rows = 256 and num_cols = 512 is the tensor type with
    T_r = 2, T_l = <0, 0>, T_u = <256, 512>; I(T) has lower bounds inclusive, upper bounds
    exclusive, so |I(T)| = 256 * 512."""
    t = Box.full((256, 512))
    assert (len(t.lo), t.lo, t.hi) == (2, (0, 0), (256, 512))
    assert t.size == 256 * 512 == 131072
    assert t.contains(Box((0, 0), (1, 1)))            # the cell <0, 0> (lower bound) is in
    assert t.contains(Box((255, 511), (256, 512)))    # <255, 511> is in
    assert not t.contains(Box((256, 0), (257, 1)))    # <256, 0> (upper bound) is not



def test_definitions_3_2_and_3_6_tiling_covers_and_is_pairwise_disjoint():
    """Example 3.8's C_1 = [0, 128) x [0, 256) and C_2 = [128, 256) x [0, 256) tile the
    256 x 256 output. Rows [0, 128) and [64, 192) do not: their sizes add up to the whole,
    but they overlap (Definition 3.2 (b)) and leave rows [192, 256) uncovered ((a))."""
    from eins.errors import EinsError
    from eins.ir.joinagg import FunctionSpec, JoinAggSpec
    a, b = Box((0, 0), (256, 512)), Box((0, 0), (512, 256))

    def spec(*outs):
        return JoinAggSpec(tuple(FunctionSpec((a, b), (o,)) for o in outs), (None,))

    spec(Box((0, 0), (128, 256)), Box((128, 0), (256, 256))).check_tiling([(256, 256)])
    with pytest.raises(EinsError, match="overlap"):
        spec(Box((0, 0), (128, 256)), Box((64, 0), (192, 256))).check_tiling([(256, 256)])
    with pytest.raises(EinsError, match="do not tile"):
        spec(Box((0, 0), (128, 256))).check_tiling([(256, 256)])

# ------------------------------------------------------------- Examples 3.8 and 3.9 (Def. 3.7)
def _matmul_args(i=256, j=512, k=256, seed=0):
    rng = np.random.default_rng(seed)
    # small integers: every partial sum is exact in float64, so ⊕ recovers A @ B exactly
    return (rng.integers(-3, 4, (i, j)).astype(np.float64),
            rng.integers(-3, 4, (j, k)).astype(np.float64))


def test_example_3_8_inputs_are_the_halves_of_j_and_the_sum_recovers_the_product():
    """J = {F1, F2}: F1 = A x B -> C, F2 = A' x B' -> C with A, A' the column halves
    [0, 256), [256, 512) of the first input and B, B' the row halves of the second; C is the
    whole [i, k] output, so the tiling condition holds trivially, and step (2) sums the two."""
    a, b = _matmul_args()
    mm = lambda x, y: x @ y  # noqa: E731
    low = eins.distribute(mm, devices=2, plan={0: {"j": 2}}, cost="proxy").lower(a, b)
    f1, f2 = low.plan.eqn_plans[0].spec.fspecs
    assert f1.inputs == (Box((0, 0), (256, 256)), Box((0, 0), (256, 256)))    # A, B
    assert f2.inputs == (Box((0, 256), (256, 512)), Box((256, 0), (512, 256)))  # A', B'
    assert f1.outputs == f2.outputs == (Box((0, 0), (256, 256)),)            # C, whole
    assert low.plan.eqn_plans[0].spec.aggs == ("sum",)
    np.testing.assert_array_equal(low.compile("interpret")(a, b), a @ b)
    # Section 4.3 on this spec: join = |A| + |B| + |A'| + |B'|, aggregation (m - 1)|C|, m = 2
    isz = 8
    assert low.plan.eqn_plans[0].cost == CostBreakdown(
        0, 2 * (256 * 256 + 256 * 256) * isz, (2 - 1) * 256 * 256 * isz)


def test_example_3_9_four_specs_recompose_and_cost_by_section_4_3():
    """i into [0,128), [128,256); j into halves; k whole: 2 * 2 * 1 = 4 function specs F_mn.
    Step (2) sums F_m1 and F_m2 into C_m, step (3) stitches C_1, C_2. Cost (Section 4.3): the
    join counts each F_mn's two input blocks (128 x 256 and 256 x 256), the aggregation
    (2 - 1)|C_m| for each of the two distinct output types; inputs repartition for free."""
    a, b = _matmul_args(seed=1)
    mm = lambda x, y: x @ y  # noqa: E731
    low = eins.distribute(mm, devices=4, plan={0: {"i": 2, "j": 2}}, cost="proxy").lower(a, b)
    ep = low.plan.eqn_plans[0]
    assert len(ep.spec.fspecs) == 2 * 2 * 1
    assert ep.spec.out_tiling() == (Box((0, 0), (128, 256)), Box((128, 0), (256, 256)))
    np.testing.assert_array_equal(low.compile("interpret")(a, b), a @ b)
    isz = 8
    assert ep.cost == CostBreakdown(0, 4 * (128 * 256 + 256 * 256) * isz,
                                    2 * (2 - 1) * 128 * 256 * isz)


# ----------------------------------------------------------------------------- Section 4.4
def test_section_4_4_3d_grid_at_p_27_costs_3q_minus_1_n_squared():
    """p = q^3 = 27, N divisible by q: the optimizer picks the 3 x 3 x 3 grid at
    (3q - 1) N^2 = 8 N^2 (the tests of p = 8 and 64 are in test_plan_dp.py); every other
    grid a x b x c costs (a + b + c - 1) N^2, more by the AM-GM inequality."""
    from eins.cost.proxy import local_cost
    from eins.passes.enumerate_specs import eqn_candidates
    n, q, isz = 36, 3, 2
    mm = lambda a, b: a @ b  # noqa: E731
    low = eins.distribute(mm, devices=27, cost="proxy").lower(S((n, n), "f16"), S((n, n), "f16"))
    assert low.plan.eqn_plans[0].splits == {"i": q, "j": q, "k": q}
    assert low.cost_bytes == (3 * q - 1) * n * n * isz == 8 * n * n * isz
    e = low.program.eqns[0]
    cands, _ = eqn_candidates(e, 27, max_specs=10_000)
    for c in cands:
        a, b, k = (len(c.intervals.get(x, ((0, n),))) for x in "ijk")
        assert local_cost(c.spec, e).total == (a + b + k - 1) * n * n * isz
        assert (a, b, k) == (q, q, q) or a + b + k - 1 > 3 * q - 1


# ------------------------------------------------------------ Example 3.10 and Section 6.2
def test_single_sequence_has_one_eight_way_attention_spec_under_example_3_10s_rule():
    """Section 6.2: "A single sequence offers exactly one eight-way decomposition of the
    attention operator. Shard heads_kv". That follows from Example 3.10's rule that sequence
    splits only at sequence ends (a single sequence has none inside). eins's attention also
    exports query splits inside a segment (each block reads its key prefix) and key splits
    (⊕ = lse), a documented extension (eins/ops/attention.py), so it has more 8-way specs;
    those that keep both sequence indices whole are exactly the paper's one: heads_kv = 8,
    kv head m with query heads [4m, 4m + 4) on processor m. (The plan still picks it:
    test_plan_api.py::test_paper_block_128k_tokens_is_planned_ulysses_like.)"""
    from eins.models import llama
    from eins.passes.enumerate_specs import eqn_candidates
    wl = llama.WORKLOADS["1x128K"]
    args = wl(llama.PAPER)
    x = args[0]
    # "131,072 x 4,096, about 1 GB in FP16"
    assert x.shape == (131072, 4096) and x.dtype == np.float16
    assert x.shape[0] * x.shape[1] * 2 == 2 ** 30
    prog = eins.make_ir(wl.function(llama.PAPER))(*args)
    (att,) = [e for e in prog.eqns if e.prim == "attention"]
    cands, q = eqn_candidates(att, 8, max_specs=10_000)
    assert q == 8
    papers = [c for c in cands
              if all(len(c.intervals.get(n, ((0, 0),))) == 1 for n in ("sequence", "kv_sequence"))]
    assert len(papers) == 1 < len(cands)
    (c,) = papers
    assert {n: len(v) for n, v in c.intervals.items() if len(v) > 1} == {"heads_kv": 8}
    for m, f in enumerate(c.spec.fspecs):
        assert (f.inputs[0].lo[0], f.inputs[0].hi[0]) == (4 * m, 4 * m + 4)   # query heads
        assert (f.inputs[1].lo[0], f.inputs[1].hi[0]) == (m, m + 1)           # kv head m


# ------------------------------------------------------------------ Experiment 3, selector (b)
@pytest.mark.parametrize("name", ["B", "C"])
def test_greedy_is_the_dp_without_the_repartition_sub_cost(name):
    """Experiment 3 (b): greedy is "the same dynamic program with the repartition sub-cost
    removed ... each operator independently chooses its cheapest join-agg spec": under the
    proxy, every eqn of the greedy plan has the least join + aggregation of its candidates,
    and the dp plan (which pays repartitions) is never dearer in total."""
    from eins.models import chains
    from eins.cost.proxy import local_cost
    from eins.passes.enumerate_specs import eqn_candidates
    ch = chains.chain(name)
    args = ch.shape_args()
    greedy = eins.distribute(ch.fn, devices=8, selector="greedy", cost="proxy").lower(*args)
    dp = eins.distribute(ch.fn, devices=8, cost="proxy").lower(*args)
    for e, ep in zip(greedy.program.eqns, greedy.plan.eqn_plans):
        cands, _ = eqn_candidates(e, 8, max_specs=10_000)
        best = min(local_cost(c.spec, e).total for c in cands)
        assert local_cost(ep.spec, e).total == best
        assert ep.cost.join + ep.cost.aggregation == best
    assert dp.cost_bytes <= greedy.cost_bytes


# ----------------------------------------------------------------------- Section 5.2, 5.4
def _example(name):
    import pathlib
    from eins.ir.exprog import parse
    return parse((pathlib.Path(__file__).parent.parent / "examples" / "exprog"
                  / f"{name}.exprog").read_text())


def _body(prog, actions):
    from eins.ir.exprog import ExProg
    return ExProg(prog.gpus, prog.partitions, prog.inputs, prog.outputs, tuple(actions))


def _sent(r):
    """Bytes that crossed the network in a simulation on a switch (each transfer leaves one
    egress port)."""
    return sum(b for res, b in r.resource_bytes.items() if res.startswith("egress:"))


def test_example_5_2_partial_aggregates_halve_the_second_rounds_traffic():
    """Example 5.2: "Partial aggregates cross the network in the second round, halving the
    traffic relative to gathering all four atoms everywhere." With 1 GB atoms the second
    round sends A+B and C+D, 4 GB, where sending the remote pair's atoms (C and D to 0 and 1,
    A and B to 2 and 3) would send 8 GB. Over both rounds doubling sends 8 GB; the naive
    gather (each atom multicast to the other three) sends 12 GB, and is slower: 6.2 ms
    against 3 GB / 450 GB/s + 5 GB / 3,350 GB/s = 8.16 ms on a DGX-H100."""
    from eins.hardware.simulate import simulate
    from eins.passes.synthesize import naive_program
    gb = 1e9
    from eins.hardware.presets import get_topology
    h100 = get_topology("dgx-h100").without_latency()   # the paper's model
    prog = _example("example_5_2")
    r = simulate(prog, h100)
    assert _sent(r) == 8 * gb
    second = [e for e in r.timeline if e.kind == "transfer" and len(e.action.agg) == 2]
    assert sum(e.bytes for e in second) == 4 * gb == 8 * gb / 2
    naive = simulate(naive_program(_body(prog, ())), h100)
    assert _sent(naive) == 12 * gb
    assert naive.total_s == pytest.approx(3 * gb / (450 * gb) + 5 * gb / (3350 * gb))
    assert r.total_s * 1e3 == pytest.approx(6.2, rel=0.02) and r.total_s < naive.total_s


@pytest.mark.parametrize("name,membership", [
    ("example_5_2", None), ("example_5_3", {"G1": (0, 1, 4, 5), "G2": (2, 3, 6, 7)})])
def test_theorem_5_6_insertions_then_deletions_keep_every_program_valid(name, membership):
    """Theorem 5.6's proof, run: from the naive program P to the paper's program Q by
    inserting Q \\ P in a firing order of Q, then deleting P \\ Q latest-firing first (in a
    firing order of P u Q); every intermediate program is valid (Definition 5.5)."""
    from eins.ir.exprog import firing_order, is_valid
    from eins.passes.synthesize import naive_program
    q_text = _example(name)
    p_prog = naive_program(_body(q_text, ()), membership)  # partitions' members filled in
    P, Q = set(p_prog.actions), list(q_text.actions)
    assert P - set(Q) and set(Q) - P   # both phases have work to do
    cur = list(p_prog.actions)
    assert is_valid(_body(p_prog, cur)) and is_valid(_body(p_prog, Q))
    order_q = []
    for i, _ in firing_order(_body(p_prog, Q)):
        if Q[i] not in order_q:
            order_q.append(Q[i])
    assert set(order_q) == set(Q)   # every action of Q fires
    inserted = 0
    for a in order_q:
        if a not in P:
            cur.append(a)
            inserted += 1
            assert is_valid(_body(p_prog, cur)), a
    assert inserted == len(set(Q) - P)
    union = _body(p_prog, cur)
    latest = []
    for i, _ in reversed(firing_order(union)):
        if cur[i] not in latest:
            latest.append(cur[i])
    deleted = 0
    for a in latest:
        if a in P and a not in set(Q):
            cur.remove(a)
            deleted += 1
            assert is_valid(_body(p_prog, cur)), a
    assert deleted == len(P - set(Q))
    assert set(cur) == set(Q)


def test_section_5_4_rewrites_change_the_closure_as_stated():
    """Section 5.4's rules, on closures (Definition 5.5): multicast fission/fusion leaves the
    closure unchanged (and, in eins's simulator, the time: a multicast's transfers start
    together); relay introduction X @ s -> d => X @ s -> r -> d only adds (X, r);
    aggregation pushdown X @ r -> s, Y @ r -> s => X+Y @ r -> s drops the separate (X, s)
    and (Y, s) and adds (X+Y, r), (X+Y, s)."""
    from eins.hardware.simulate import simulate
    from eins.ir.exprog import closure, parse
    F = frozenset
    fused = parse("IN: A @ 0\nOUT: A @ 1, 2, 3\nA @ 0 -> 1, 2, 3")
    fissioned = parse("IN: A @ 0\nOUT: A @ 1, 2, 3\nA @ 0 -> 1; A @ 0 -> 2, 3")
    assert closure(fused) == closure(fissioned)
    assert simulate(fused, "dgx-h100:4").total_s == pytest.approx(
        simulate(fissioned, "dgx-h100:4").total_s)
    direct = parse("IN: A @ 0\nOUT: A @ 5\nA @ 0 -> 5")
    relayed = parse("IN: A @ 0\nOUT: A @ 5\nA @ 0 -> 4 -> 5")
    assert closure(relayed) == closure(direct) | {(F("A"), 4)}
    # on dgx-v100-paper 0 and 5 are unlinked: the bounce over the pillar beats the bridge
    assert simulate(relayed, "dgx-v100-paper").total_s < simulate(direct,
                                                                  "dgx-v100-paper").total_s
    pre = "IN: X @ 0; Y @ 0\nOUT: X+Y @ 1\n"
    pulled = parse(pre + "X @ 0 -> 1; Y @ 0 -> 1; X+Y @ 1")
    pushed = parse(pre + "X+Y @ 0 -> 1")
    assert closure(pushed) == (closure(pulled) - {(F("X"), 1), (F("Y"), 1)}) | {(F("XY"), 0)}
    assert (F("XY"), 1) in closure(pushed)


# ------------------------------------------------------------------- Section 6, workloads
def _matrix_chain_dp(d):
    """The classical matrix-chain DP: (fewest scalar multiplies, an optimal tree)."""
    @functools.lru_cache(None)
    def m(i, j):
        if i == j:
            return 0, i + 1
        # ties go to the first split point k (a key, so trees are never compared)
        k = min(range(i, j), key=lambda k: m(i, k)[0] + m(k + 1, j)[0]
                + d[i] * d[k + 1] * d[j + 1])
        return (m(i, k)[0] + m(k + 1, j)[0] + d[i] * d[k + 1] * d[j + 1],
                (m(i, k)[1], m(k + 1, j)[1]))
    return m(0, len(d) - 2)


def _leaf_products(tree):
    if isinstance(tree, int):
        return 0
    a, b = tree
    return 1 if isinstance(a, int) and isinstance(b, int) else _leaf_products(a) + _leaf_products(b)


@pytest.mark.parametrize("name,extra_leaf_products", [("A", 3), ("B", 1), ("C", 0), ("D", 0),
                                                      ("E", 0)])
def test_section_6_chains_are_optimally_parenthesized_at_about_8192_cubed(
        name, extra_leaf_products):
    """"each multiply averages roughly 8192^3 scalar multiplies" (96.8 % to 99.6 % of it);
    the fixed parenthesizations are optimal by the classical matrix-chain DP (A, B and C are
    claimed so; D and E are too). A and B are bushy with "three and one independent
    sub-products": products of two input matrices beyond the first, 4 - 1 in A's
    (M1 M2), (M3 M4), (M5 M6), (M7 M8) and 2 - 1 in B's. C's optimum is right-associated,
    the opposite of left-deep order, which costs far more."""
    from eins.models import chains
    c = chains.chain(name)
    multiplies = c.matmul_flops() // 2
    assert 0.96 < multiplies / (c.n - 1) / 8192 ** 3 < 1.0
    best, tree = _matrix_chain_dp(c.dims)
    assert multiplies == best
    assert _leaf_products(c.tree) - 1 == extra_leaf_products
    if name == "C":
        d = c.dims
        assert c.tree == tree == (1, (2, 3))
        left = d[0] * d[1] * d[2] + d[0] * d[2] * d[3]
        assert left > 3 * best


def test_section_6_servers():
    """"an NVIDIA DGX A100 with eight 40 GB A100 GPUs connected by a fully non-blocking
    NVSwitch" and "an NVIDIA DGX V100 with eight 32 GB V100 GPUs, whose hybrid cube-mesh
    topology (Section 5.2)": the presets dgx-a100 and dgx-v100-paper."""
    from eins.hardware.presets import get_topology
    a100, v100 = get_topology("dgx-a100"), get_topology("dgx-v100-paper")
    assert (len(a100.gpus), a100.memory, a100.kind) == (8, 40e9, "switch")
    assert (len(v100.gpus), v100.memory, v100.kind) == (8, 32e9, "mesh")
    assert a100.gpu_model == "A100" and v100.gpu_model == "V100"


def test_section_2_compile_graph_defaults_to_the_naive_schedule():
    """Section 2: "The default, schedule_mode="naive", uses a naive exchange program"."""
    import eins as es
    g = es.createGraph()
    x = g.insertTensor(es.tensorDesc([8, 4]))
    g.save(g.unary(x, "relu", 0.0))
    assert es.compileGraph(g, device=[0, 1]).schedule_mode == "naive"


# ------------------------------------------------------------------------- Experiment 4
@pytest.mark.parametrize("name", ["A", "B"])
def test_experiment_4_optimized_programs_win_on_the_v100_for_chains_a_and_b(name):
    """Figure 6: on the DGX V100, optimized exchange programs are 1.41x (A: 25.1 against
    17.8 ms) and 1.32x (B: 10.1 against 7.67 ms) faster than naive ones, measured; on the
    NVSwitch A100 the two are close. Not the paper's numbers: those are measured runtimes of
    the paper's plans. What eins reproduces by simulation, for the paper's logical optimizer
    (cost="proxy", whose plans ignore the topology) and a deterministic synthesis budget:
    predicted totals naive / optimized of 30.0 / 19.1 ms (1.58x) for A and 27.2 / 9.3 ms
    (2.91x) for B on dgx-v100-paper, where the naive programs cross the PCIe bridge, and
    1.07x and 1.08x on dgx-a100. (With eins's default cost="time" the DP plans around the
    bridge and the naive schedule is already as fast.) Pinned: the V100 gain exceeds the
    paper's measured 1.3x and the A100's."""
    from eins.models import chains
    ch = chains.chain(name)
    args = ch.shape_args()

    def ratio(topo):
        kw = dict(devices=8, topology=topo, cost="proxy")
        naive = eins.distribute(ch.fn, **kw).lower(*args).predicted_time()["total_ms"]
        opt = eins.distribute(ch.fn, schedule="optimized", synthesis_steps=16,
                              **kw).lower(*args).predicted_time()["total_ms"]
        assert opt <= naive
        return naive / opt

    v100, a100 = ratio("dgx-v100-paper"), ratio("dgx-a100")
    assert v100 > 1.3 and v100 > a100 >= 1.0
