"""Forward and backward planned together (issue 34, part 2): the DP sees one program. The
memory cap counts the values a backward keeps from its forward; weight gradients that come
out partial are summed by ⊕ (data parallel's all-reduce), and where the plan keeps weights
sharded their gradients come out sharded the same way (FSDP/ZeRO-like), both found by the
DP."""
import numpy as np
import pytest

from helpers import SPREAD, accumulation, assert_close, assert_splits

import eins
from eins.cost.liveness import exchange_bytes, resident_bytes
from eins.cost.timecost import working_set
from eins.ir.plan import Tuning

S = eins.ShapeDtype


def estimated_peak(low) -> int:
    """What the DP's memory cap compares: per eqn, its working set + the bytes live across
    it + its exchanges' pieces, on the fullest device."""
    specs = [ep.spec for ep in low.plan.eqn_plans]
    p = len(low.devices)
    live = resident_bytes(low.program, specs, p) + exchange_bytes(low.program, specs, p)
    return max(int(r) + working_set(e, s) for r, e, s in zip(live, low.program.eqns, specs))


def device_peak(low) -> int:
    return max(low.predicted_time()["peak_bytes"].values())


def branches(ws, x):
    """Three heads on one input: relu's backward reads its input, the matmul's result, so
    each head's matmul result is saved from the forward for the backward."""
    total = 0.0
    for w in ws:
        total = total + eins.sum(eins.relu(x @ w))
    return total


BRANCH_ARGS = ([S((512, 64), "float32") for _ in range(3)], S((64, 512), "float32"))


def test_the_cap_counts_what_the_backward_keeps():
    # here the DP's estimate bounds the device program's measured peak from above (it is
    # the device program's liveness, less what aggregations receive); the per-eqn working
    # set alone (what the cap saw before) is far below it
    vg = eins.value_and_grad(branches)
    for p in (2, 4):
        low = eins.distribute(vg, devices=p, topology=f"dgx-a100:{p}",
                              tuning=SPREAD).lower(*BRANCH_ARGS)
        assert low.plan.eqn_peak_bytes < device_peak(low) <= estimated_peak(low)


def test_a_cap_below_the_saved_bytes_changes_the_plan():
    vg = eins.value_and_grad(branches)
    free = eins.distribute(vg, devices=4, topology="dgx-a100:4",
                           tuning=SPREAD).lower(*BRANCH_ARGS)
    limit = 175_000
    assert device_peak(free) > limit > free.plan.eqn_peak_bytes
    capped = eins.distribute(vg, devices=4, topology="dgx-a100:4", memory_limit=limit,
                             tuning=SPREAD)
    low = capped.lower(*BRANCH_ARGS)
    # the per-eqn working set alone would keep the plan that does not fit
    blind = eins.distribute(vg, devices=4, topology="dgx-a100:4", memory_limit=limit,
                            tuning=Tuning(memory_rounds=0, device_subsets=False)).lower(*BRANCH_ARGS)
    assert [r["splits"] for r in blind.plan_table()] == [r["splits"] for r in
                                                         free.plan_table()]
    assert not blind.predicted_time()["fits"]
    assert [r["splits"] for r in low.plan_table()] != [r["splits"] for r in blind.plan_table()]
    assert estimated_peak(low) <= limit
    assert device_peak(low) <= limit and low.predicted_time()["fits"]
    # and it computes the same gradients
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((512, 64)) / 20).astype(np.float32) for _ in range(3)]
    x = rng.standard_normal((64, 512)).astype(np.float32)
    v, g = eins.jit(vg)(ws, x)
    v2, g2 = capped(ws, x)
    n, depth = accumulation(low.program)
    assert_close(v2, v, n=n, depth=depth)
    for a, b in zip(g2, g):
        assert_close(a, b, n=n, depth=depth)


def mlp(p, x):
    return eins.sum((eins.relu(x @ p["w1"]) @ p["w2"]) ** 2)


def gradient_eqns(low):
    """{weight name: index of the eqn producing its gradient} (value_and_grad's outputs:
    the value, then the gradients in the dict's key order)."""
    prod = low.program.producers()
    return {k: prod[id(v)][0] for k, v in zip(("w1", "w2"), low.program.outputs[1:])}


def weight_reads(low, name):
    """The forward eqns reading weight ``name`` (a program input) and at which operand."""
    prog = low.program
    var = prog.inputs[("w1", "w2").index(name)]
    return [(i, k) for i, e in enumerate(prog.eqns) if e.phase == "fwd"
            for k, a in enumerate(e.inputs) if a is var]


def test_partial_weight_gradients_are_summed_and_split_weights_keep_split_gradients():
    # many tokens, small weights: the DP splits the batch where it reads w1 (data parallel:
    # w1 whole on every device), so each device holds a partial of w1's gradient, which
    # the gradient eqn's ⊕ (sum) adds up: an all-reduce. w2 it splits by columns, and w2's
    # gradient comes out in those same column blocks, never whole on a device
    params = {"w1": S((32, 32), "float32"), "w2": S((32, 32), "float32")}
    x = S((16384, 32), "float32")
    d = eins.distribute(eins.value_and_grad(mlp), devices=4, topology="dgx-a100:4",
                        tuning=SPREAD)
    low = d.lower(params, x)
    table = low.plan_table()
    whole = 32 * 32 * 4
    kinds = {}
    for name, i in gradient_eqns(low).items():
        ep = low.plan.eqn_plans[i]
        ((r, k),) = weight_reads(low, name)
        read = low.plan.eqn_plans[r].spec
        if all(f.inputs[k].size * 4 == whole for f in read.fspecs):   # replicated
            kinds[name] = "partial"
            assert table[r]["splits"] == {"d0": 4}, table[r]    # the batch is split
            assert (table[i]["phase"], table[i]["splits"], table[i]["agg"]) == \
                ("bwd", {"r0": 4}, 4)
            assert ep.spec.aggs[0] == "sum"
            assert ep.cost.aggregation == 3 * whole   # (m - 1) partial copies
        else:
            kinds[name] = "split"
            assert table[i]["agg"] == 1 and ep.cost.aggregation == 0
            assert set(ep.spec.out_tiling(0)) == set(read.in_blocks(k))
            assert sum(f.inputs[k].size for f in read.fspecs) * 4 == whole
    assert kinds == {"w1": "partial", "w2": "split"}
    rng = np.random.default_rng(1)
    p = {k: (rng.standard_normal((32, 32)) / 6).astype(np.float32) for k in params}
    xv = rng.standard_normal((16384, 32)).astype(np.float32)
    v, g = eins.jit(eins.value_and_grad(mlp))(p, xv)
    v2, g2 = d(p, xv)
    n, depth = accumulation(low.program)
    assert_close(v2, v, n=n, depth=depth)
    for k in g:
        assert_close(g2[k], g[k], n=n, depth=depth)


def test_sharded_weights_get_gradients_sharded_the_same_way():
    # few tokens, large weights: the DP keeps each weight split over the devices (Megatron's
    # column then row split); each gradient comes out in the blocks its weight is read in,
    # with no partial copies and no aggregation: no device ever holds a whole weight or a
    # whole gradient
    params = {"w1": S((512, 2048), "float32"), "w2": S((2048, 512), "float32")}
    x = S((64, 512), "float32")
    low = eins.distribute(eins.value_and_grad(mlp), devices=4,
                          topology="dgx-a100:4").lower(params, x)
    table = low.plan_table()
    whole = 512 * 2048 * 4
    for name, i in gradient_eqns(low).items():
        ep = low.plan.eqn_plans[i]
        assert table[i]["agg"] == 1 and ep.cost.aggregation == 0
        grad_blocks = set(ep.spec.out_tiling(0))
        assert len(grad_blocks) == 4 and all(b.size * 4 == whole // 4 for b in grad_blocks)
        for r, k in weight_reads(low, name):
            read = low.plan.eqn_plans[r].spec
            assert set(read.in_blocks(k)) == grad_blocks, (name, r)
            assert sum(f.inputs[k].size for f in read.fspecs) * 4 == whole   # read once


@pytest.mark.parametrize("p", [2, 4, 8])
def test_planning_forward_and_backward_validates_every_spec(p):
    # the backward's eqns are ordinary eqns: the verify pass checks each device program
    vg = eins.value_and_grad(mlp)
    rng = np.random.default_rng(2)
    params = {k: (rng.standard_normal((16, 16)) / 4).astype(np.float32) for k in ("w1", "w2")}
    x = rng.standard_normal((32, 16)).astype(np.float32)
    low = eins.distribute(vg, devices=p, tuning=SPREAD).lower(params, x)
    assert_splits(low)
    assert {e.phase for e in low.program.eqns} == {"fwd", "bwd"}
    assert low.physical.device is not None
