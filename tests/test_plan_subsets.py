"""Device subsets (issue 38): a spec may use fewer pieces than devices, and the plan on p
devices is never predicted slower than the plan on the first p' < p of them."""
import numpy as np
import pytest

import eins
from eins.errors import PlanError
from eins.ir.plan import Compilation, Options, Tuning
from eins.models import llama
from eins.passes import PLANNING, run_passes
from eins.passes.enumerate_specs import eqn_candidates, piece_targets

S = eins.ShapeDtype
TINY_64 = llama.Workload("1x64", 1, 64)
OFF = Tuning(device_subsets=False)


def _tiny(p, topology="dgx-a100:8", **kw):
    fn = TINY_64.function(llama.TINY)
    return eins.distribute(fn, devices=p, topology=topology, **kw).lower(*TINY_64(llama.TINY))


def test_piece_targets_are_p_and_the_powers_of_two_below():
    assert piece_targets(1) == (1,)
    assert piece_targets(8) == (8, 4, 2, 1)
    assert piece_targets(6) == (6, 4, 2, 1)
    assert piece_targets(72) == (72, 64, 32, 16, 8, 4, 2, 1)
    # the targets of p' < p are those of p below p' (what planning on p' devices sees)
    for p in range(1, 40):
        for q in piece_targets(p)[1:]:
            assert piece_targets(q) == tuple(t for t in piece_targets(p) if t <= q)


def test_tiny_block_is_never_slower_on_more_gpus():
    """The TINY block (1 x 64 tokens) on dgx-a100: 65.9 / 72.7 / 79.5 / 79.5 us at
    p = 1 / 2 / 4 / 8 without device subsets (eight GPUs 1.21x slower than one); with them
    every p gets the one-GPU plan: every exchange's 3.4 us NVSwitch latency costs more
    than splitting kernels this small saves."""
    off = [_tiny(p, tuning=OFF).plan.cost_s for p in (1, 2, 4, 8)]
    assert off[0] < off[1] < off[2]
    assert off[3] > off[0] * 1.2
    on = [_tiny(p) for p in (1, 2, 4, 8)]
    costs = [low.plan.cost_s for low in on]
    assert costs == pytest.approx([off[0]] * 4, rel=1e-12)
    assert costs[0] * 1e6 == pytest.approx(65.870, abs=1e-3)
    for low in on[1:]:
        assert all(len(ep.spec.fspecs) == 1 for ep in low.plan.eqn_plans)
        assert low.predicted_time()["total_ms"] == pytest.approx(low.plan.cost_s * 1e3,
                                                                 rel=1e-9)
    # the plan text says which devices idle
    assert "7 of 8 devices idle" in on[3].as_text("planned")


@pytest.mark.parametrize("topo,p", [("dgx-a100:8", 8), ("dgx-v100-paper", 8),
                                    ("dgx-h100:2x4", 8), ("dgx-h100:2x2", 4)])
def test_more_gpus_never_predicted_slower_on_the_same_topology(topo, p):
    """For the TINY block at 1x64 and 1x1K and the SMALL one at 1x1K: dp on p devices is
    no slower than dp on any power of two p' < p of the same topology's first devices,
    under the cost it minimizes and, lowered with the optimized schedule, as predicted."""
    for cfg, wl in ((llama.TINY, TINY_64), (llama.TINY, llama.WORKLOADS["1x1K"]),
                    (llama.SMALL, llama.WORKLOADS["1x1K"])):
        prog = eins.make_ir(wl.function(cfg))(*wl(cfg))
        costs = {q: run_passes(Compilation(prog, tuple(range(q)), Options(topology=topo)),
                               PLANNING).plan.cost_s for q in piece_targets(p)}
        for q in piece_targets(p)[1:]:
            assert costs[p] <= costs[q] * (1 + 1e-9), (cfg, wl.name, q, costs)


def test_optimized_schedule_more_gpus_never_slower_tiny():
    preds = [_tiny(p, schedule="optimized", synthesis_steps=8).predicted_time()["total_ms"]
             for p in (1, 2, 4, 8)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(preds, preds[1:]))


def test_mixed_piece_counts_in_one_plan():
    """The paper block at 1 x 1,024 tokens on two 4-GPU H100 nodes: some eqns on all 8
    GPUs, others on the first node's 4 (their exchanges then stay off the network): 0.1774
    ms against 0.1975 on all eight. The mixed plan lowers, verifies, and is predicted at
    its cost."""
    wl = llama.WORKLOADS["1x1K"]
    fn, args = wl.function(llama.PAPER), wl(llama.PAPER)
    on = eins.distribute(fn, devices=8, topology="dgx-h100:2x4").lower(*args)
    off = eins.distribute(fn, devices=8, topology="dgx-h100:2x4", tuning=OFF).lower(*args)
    pieces = {len(ep.spec.fspecs) for ep in on.plan.eqn_plans}
    assert pieces == {4, 8}
    assert on.plan.cost_s * 1e3 == pytest.approx(0.1774, abs=1e-4)
    assert off.plan.cost_s * 1e3 == pytest.approx(0.1975, abs=1e-4)
    assert on.predicted_time()["total_ms"] == pytest.approx(on.plan.cost_s * 1e3, rel=5e-3)


def test_mixed_plan_runs_equal_to_one_device():
    """A plan with eqns on fewer devices than others computes what eins.jit does."""
    def fn(x, w, v):
        y = eins.relu(x @ w)
        return eins.sum(y, axis=0, keepdims=True) @ v
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8, 8), (8, 4))]
    f = eins.distribute(fn, devices=4, plan={0: {"d0": 4}, 1: {"d0": 4}, 3: {"d1": 2}})
    low = f.lower(*args)
    pieces = [len(ep.spec.fspecs) for ep in low.plan.eqn_plans]
    assert pieces[:2] == [4, 4] and pieces[3] == 2
    np.testing.assert_allclose(f(*args), eins.jit(fn)(*args), rtol=1e-5, atol=1e-5)


def test_subset_candidates_follow_the_p_ones_largest_first():
    prog = eins.make_ir(lambda a, b: a @ b)(S((64, 64)), S((64, 64)))
    e = prog.eqns[0]
    full, q = eqn_candidates(e, 8)
    cands, q2 = eqn_candidates(e, 8, subsets=2, subset_specs=3)
    assert q == q2 == 8
    pieces = [len(c.spec.fspecs) for c in cands]
    assert pieces[:len(full)] == [8] * len(full)
    assert pieces[len(full):] == [4] * 3 + [2] * 3
    # each smaller group keeps those with the least join + aggregation bytes
    all4, _ = eqn_candidates(e, 4)
    kept = cands[len(full):len(full) + 3]
    worst = max(c.local.total for c in kept)
    assert all(c.local.total >= worst for c in all4 if c.intervals not in
               [k.intervals for k in kept])


def test_the_proxy_gets_no_subsets():
    """Under the byte proxy fewer pieces only save bytes (a slower kernel costs nothing),
    so every eqn would go to one device: the proxy keeps p pieces."""
    prog = eins.make_ir(lambda a, b: eins.relu(a @ b))(S((64, 64)), S((64, 64)))
    st = run_passes(Compilation(prog, tuple(range(4)), Options(cost="proxy")), PLANNING)
    assert all(len(c.spec.fspecs) == 4 for cs in st.candidates for c in cs)
    assert all(len(ep.spec.fspecs) == 4 for ep in st.plan.eqn_plans)


@pytest.mark.parametrize("field,value", [("subset_specs", -1), ("subset_levels", 1.5),
                                         ("device_subsets", "yes")])
def test_bad_subset_tuning_is_named(field, value):
    with pytest.raises(PlanError, match=field):
        Tuning(**{field: value})
