"""The cost proxy of Section 4.3 in bytes, checked against hand formulas (Section 4.4's
(a + c)N^2 join and (b - 1)N^2 aggregation, repartitioning, Literals, constants)."""
import numpy as np
import pytest

import eins
from eins.ir.plan import CostBreakdown
from eins.cost.proxy import cost, local_cost, plan_costs
from eins.passes.enumerate_specs import eqn_candidates

S = eins.ShapeDtype


def _low(fn, *args, devices=4, **kw):
    return eins.distribute(fn, devices=devices, **{"cost": "proxy", **kw}).lower(*args)


@pytest.mark.parametrize("p", [8, 64])
def test_every_matmul_spec_costs_a_plus_c_join_and_b_minus_1_aggregation(p):
    n, isz = 16, 2
    prog = eins.make_ir(lambda a, b: a @ b)(S((n, n), "f16"), S((n, n), "f16"))
    e = prog.eqns[0]
    cands, _ = eqn_candidates(e, p)
    assert cands
    for c in cands:
        a, b, k = (len(c.intervals[x]) for x in "ijk")
        assert a * b * k == p
        got = cost(c.spec, e, [None, None])
        assert got == CostBreakdown(0, (a + k) * n * n * isz, (b - 1) * n * n * isz), (a, b, k)


def test_uneven_blocks_cost_their_true_sizes():
    # 5x7 @ 7x3 split j into 3 intervals (3, 2, 2): join = |A| + |B|, agg = 2 * |C|
    prog = eins.make_ir(lambda a, b: a @ b)(S((5, 7)), S((7, 3)))
    low = _low(lambda a, b: a @ b, S((5, 7)), S((7, 3)), devices=3, plan={0: {"j": 3}})
    ep = low.plan.eqn_plans[0]
    assert ep.intervals["j"] == ((0, 3), (3, 5), (5, 7))
    assert ep.cost == CostBreakdown(0, (35 + 21) * 4, 2 * 15 * 4)
    assert prog.eqns[0].prim == "matmul"


def test_mixed_dtypes_use_each_tensors_itemsize():
    # f16 @ f32 -> f32, split j in 2: join = |A|*2 + |B|*4 bytes, agg = 1 * |C| * 4
    low = _low(lambda a, b: a @ b, S((4, 6), "f16"), S((6, 8), "f32"), devices=2,
               plan={0: {"j": 2}})
    assert low.plan.eqn_plans[0].cost == CostBreakdown(0, 24 * 2 + 48 * 4, 32 * 4)


def test_literals_cost_nothing():
    low = _low(lambda x: x * 2.0, S((8, 8)), devices=4)
    assert low.plan.eqn_plans[0].cost == CostBreakdown(0, 64 * 4, 0)


def test_program_inputs_and_constants_are_free_to_repartition():
    w = np.ones((8, 8), np.float32)
    low = _low(lambda x: eins.relu(x @ w), S((8, 8)), devices=4, plan={0: {"k": 4}})
    assert len(low.program.consts) == 1
    assert low.plan.eqn_plans[0].cost.repartition == 0


def test_repartition_charged_when_consumer_needs_other_blocks():
    t, d, f = 8, 4, 6

    def ffn(x, w1):
        return eins.relu(x @ w1)

    args = (S((t, d), "f16"), S((d, f), "f16"))
    # matmul by rows, relu by columns: relu must repartition the whole t x f tensor
    bad = _low(ffn, *args, devices=2, plan={0: {"i": 2}, 1: {"b": 2}})
    assert bad.plan.eqn_plans[1].cost == CostBreakdown(t * f * 2, t * f * 2, 0)
    good = _low(ffn, *args, devices=2, plan={0: {"i": 2}, 1: {"a": 2}})
    assert good.plan.eqn_plans[1].cost == CostBreakdown(0, t * f * 2, 0)
    assert bad.cost_bytes - good.cost_bytes == t * f * 2


def test_megatron_and_data_parallel_ffn_match_hand_formulas():
    t, d, f, p, isz = 16, 8, 24, 4, 4

    def ffn(x, w1, w2):
        return eins.relu(x @ w1) @ w2

    args = (S((t, d)), S((d, f)), S((f, d)))
    tp = _low(ffn, *args, devices=p, plan={0: {"k": p}, 1: {"b": p}, 2: {"j": p}})
    assert tp.cost_bytes == isz * (p * t * d + d * f + 2 * t * f + f * d + (p - 1) * t * d)
    assert tp.plan.eqn_plans[2].cost.aggregation == isz * (p - 1) * t * d
    dp_ = _low(ffn, *args, devices=p, plan={0: {"i": p}, 1: {"a": p}, 2: {"i": p}})
    assert dp_.cost_bytes == isz * (t * d + 2 * p * d * f + 2 * t * f)
    assert dp_.plan.cost.repartition == 0 and dp_.plan.cost.aggregation == 0


def test_plan_costs_sum_to_plan_total_and_local_cost_excludes_repartition():
    low = _low(lambda a, b, c: (a @ b) @ c, S((8, 6)), S((6, 10)), S((10, 4)), devices=4,
               plan={0: {"i": 4}, 1: {"k": 4}})
    specs = [ep.spec for ep in low.plan.eqn_plans]
    costs = plan_costs(low.program, specs)
    assert sum(c.total for c in costs) == low.cost_bytes == low.plan.cost.total
    # eqn 1, split by k, needs a@b whole, but eqn 0 left it in 4 row blocks
    assert costs[1].repartition == 8 * 10 * 4
    lc = local_cost(specs[1], low.program.eqns[1])
    assert lc.repartition == 0 and lc.join == costs[1].join


def test_inputs_resident_stops_charging_program_inputs_join_bytes():
    """One matmul of two program inputs: under the paper's proxy the 3D grid wins (Section
    4.4); with resident inputs only aggregation costs anything, so the contraction is never
    split and the plan is free."""
    n = 16
    args = (S((n, n)), S((n, n)))
    paper = _low(lambda a, b: a @ b, *args, devices=8)
    assert paper.plan.eqn_plans[0].splits == {"i": 2, "j": 2, "k": 2}
    res = eins.distribute(lambda a, b: a @ b, devices=8, inputs_resident=True, cost="proxy").lower(*args)
    ep = res.plan.eqn_plans[0]
    assert "j" not in ep.splits and ep.pieces == 8
    assert res.cost_bytes == 0 and ep.cost.join == 0
    # a produced operand is still charged: (a @ b) @ c joins a@b's blocks
    res2 = eins.distribute(lambda a, b, c: (a @ b) @ c, devices=4,
                           inputs_resident=True, cost="proxy").lower(S((n, n)), S((n, n)), S((n, n)))
    assert res2.plan.eqn_plans[1].cost.join > 0


def test_inputs_resident_plans_the_paper_block_by_tokens_at_8k():
    from eins.models import llama
    wl = llama.WORKLOADS["1x8K"]
    low = eins.distribute(wl.function(llama.PAPER), devices=8,
                          inputs_resident=True, cost="proxy").lower(*wl(llama.PAPER))
    for e, ep in zip(low.program.eqns, low.plan.eqn_plans):
        if e.prim == "matmul":
            assert ep.splits == {"i": 8}, ep.splits   # weights replicated, tokens split
        if e.prim == "attention":
            assert ep.splits == {"heads_kv": 8}
