"""Physical lowering (Sections 5.1, 5.3): overlay preambles, device IR, verification and the
virtual-device executor, checked against the single-device result and hand-computed bytes."""
import numpy as np
import pytest

import eins
from eins.errors import LoweringError
from eins.hardware.presets import get_topology
from eins.ir.device import Recv
from eins.ir.plan import EqnPlan, Plan
from eins.ir.types import TensorType
from eins.ir.primitive import get_primitive
from eins.passes.lower import lower_exchanges as lower
from eins.passes.overlay import build_exchange
from eins.passes.place import naive_placement
from eins.passes.synthesize import schedule_exchanges
from eins.passes.verify import verify_device, verify_exchanges, verify_plan
from eins.runtime.numpy_backend import execute
from helpers import SPREAD, assert_close, assert_splits


def run_all(fn, args, p, selector="dp", schedule="naive", seed=0, plan=None, cost="time"):
    """distribute -> plan -> exchange IR -> device IR, verified after every stage; returns
    (outputs, stats, exchange IR)."""
    low = eins.distribute(fn, devices=p, selector=selector, seed=seed, plan=plan,
                          cost=cost).lower(*args)
    verify_plan(low.plan)
    xir = schedule_exchanges(low.plan, naive_placement(low.plan), get_topology(f"dgx-a100:{p}"),
                             schedule, budget_s=0.02)
    verify_exchanges(xir)
    dprog = lower(xir)
    verify_device(dprog)
    outs, stats = execute(dprog, [np.asarray(a) for a in args])
    return outs, stats, xir


def ffn(x, w1, w2):
    return eins.relu(x @ w1) @ w2


RNG = np.random.default_rng(7)
FFN_ARGS = [RNG.standard_normal(s).astype(np.float32) for s in [(12, 8), (8, 20), (20, 8)]]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("selector", ["dp", "greedy", "random"])
@pytest.mark.parametrize("schedule", ["naive", "optimized"])
def test_ffn_equals_single_device(p, selector, schedule):
    (y,), stats, xir = run_all(ffn, FFN_ARGS, p, selector, schedule)
    assert_close(y, eins.jit(ffn)(*FFN_ARGS), n=20, depth=2)  # contractions over 8 then 20
    # the executor moves exactly what the exchange programs say
    assert stats.total_bytes == sum(x.bytes_moved() for x in xir.exchanges)


def test_example_5_4_preamble():
    """The producer is Example 3.8's four-spec matmul on GPUs 0..3, the consumer a row-wise
    softmax in four 64-row blocks: the preamble is exactly the paper's (up to naming)."""
    i, j, k = 256, 512, 256

    def f(a, b):
        return eins.softmax(a @ b, axis=-1)

    prog = eins.make_ir(f)(eins.ShapeDtype((i, j)), eins.ShapeDtype((j, k)))
    mm, sm = prog.eqns
    ix = get_primitive("matmul").indexing([v.type for v in mm.inputs],
                                          [v.type for v in mm.outputs])
    mm_iv = {"i": ((0, 128), (128, 256)), "j": ((0, 256), (256, 512))}
    sm_ix = get_primitive(sm.prim).indexing([v.type for v in sm.inputs],
                                            [v.type for v in sm.outputs], **sm.params)
    rows = next(n for n, e in sm_ix.extents.items() if e == i)
    sm_iv = {rows: ((0, 64), (64, 128), (128, 192), (192, 256))}
    plan = Plan(prog, (0, 1, 2, 3), (EqnPlan(mm_iv, ix.spec(mm_iv)),
                                     EqnPlan(sm_iv, sm_ix.spec(sm_iv))), "forced", 0)
    placement = {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}
    x = build_exchange(plan, placement, prog.var_names(), 1, 0, sm.inputs[0], (0, 0),
                       [fs.inputs[0] for fs in plan.eqn_plans[1].spec.fspecs])
    pre = x.preamble
    assert pre.gpus == (0, 1, 2, 3)
    assert [(q.size, q.members) for q in pre.partitions] == [(1, None)] * 4
    # eight atoms: two row-blocks of 64 per copy; copies on GPUs 0, 1 (rows 0-128), 2, 3
    assert len(pre.inputs) == 8
    assert all(a.size == 64 * k * 4 for a in pre.inputs)
    by_site = {}
    for a in pre.inputs:
        by_site.setdefault(a.site, []).append(x.cells[x.atoms[a.name][0]])
    assert {s: sorted(c.lo[0] for c in cs) for s, cs in by_site.items()} == \
        {0: [0, 64], 1: [0, 64], 2: [128, 192], 3: [128, 192]}
    # OUT: X_j + Y_j at S_j, the two copies of row block j
    assert len(pre.outputs) == 4
    for f, r in enumerate(pre.outputs):
        assert r.targets == (f"S{f}",)
        assert {x.cells[x.atoms[a][0]].lo[0] for a in r.agg} == {64 * f}
        assert {a.site for a in pre.inputs if a.name in r.agg} == \
            ({0, 1} if f < 2 else {2, 3})


def test_elementwise_chain_moves_nothing():
    def chain(x):
        return eins.exp(eins.relu(x) * 2.0 + 1.0)

    x = RNG.standard_normal((16, 8)).astype(np.float32)
    (y,), stats, _ = run_all(chain, [x], 4)
    assert_close(y, eins.jit(chain)(x))  # elementwise: nothing reordered (libm ulps at most)
    assert stats.total_bytes == 0 and stats.transfers == 0


def test_3d_matmul_moves_the_predicted_bytes():
    """N x N x N matmul on 8 devices: the 2x2x2 grid (Section 4.4). Inputs are loaded in
    place; the only traffic is aggregating the b = 2 partial copies of each output block:
    (b - 1) N^2 elements, the plan's aggregation sub-cost."""
    n = 8

    def mm(a, b):
        return a @ b

    a, b = (RNG.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    (y,), stats, xir = run_all(mm, [a, b], 8, cost="proxy")
    assert_close(y, a @ b, n=n)
    assert xir.plan.eqn_plans[0].splits == {"i": 2, "j": 2, "k": 2}
    assert stats.total_bytes == n * n * 4 == xir.plan.eqn_plans[0].cost.aggregation
    assert stats.transfers == 4


def test_peak_memory_is_recorded_per_device():
    (_,), stats, _ = run_all(ffn, FFN_ARGS, 4)
    assert set(stats.peak_bytes) == {0, 1, 2, 3}
    # never more than a whole copy of every tensor at once, never nothing
    total = sum(a.nbytes for a in FFN_ARGS) + 12 * 20 * 4 * 2 + 12 * 8 * 4
    assert all(0 < b < total for b in stats.peak_bytes.values())


def test_verify_catches_a_missing_receive():
    # the proxy's plan moves data (the time cost's replicates the small weights instead)
    low = eins.distribute(ffn, devices=4, cost="proxy").lower(*FFN_ARGS)
    dprog = lower(schedule_exchanges(low.plan, naive_placement(low.plan),
                                     get_topology("dgx-a100:8")))
    d, n = next((d, n) for d, code in dprog.code.items() for n, ins in enumerate(code)
                if isinstance(ins, Recv))
    del dprog.code[d][n]
    with pytest.raises(LoweringError):
        verify_device(dprog)


def test_executor_reports_deadlock_instead_of_hanging():
    low = eins.distribute(ffn, devices=2, cost="proxy").lower(*FFN_ARGS)
    dprog = lower(schedule_exchanges(low.plan, naive_placement(low.plan),
                                     get_topology("dgx-a100:8")))
    d, n = next((d, n) for d, code in dprog.code.items() for n, ins in enumerate(code)
                if isinstance(ins, Recv))
    ins = dprog.code[d][n]
    dprog.code[d][n] = Recv(ins.dst, ins.peer, ins.tag + 1000)
    with pytest.raises(LoweringError, match="deadlock"):
        execute(dprog, FFN_ARGS)


@pytest.mark.parametrize("schedule", ["naive", "optimized"])
def test_verify_holds_after_every_pass(schedule):
    """Each stage's invariants hold after each pass of PIPELINE (docs/architecture.md)."""
    from eins.ir.plan import Compilation, Options
    from eins.passes import PIPELINE, verify
    from eins.models import llama

    cfg = llama.TINY
    prog = eins.make_ir(llama.block_fn(cfg, (4, 16)))(
        eins.ShapeDtype((16, cfg.d_model)), llama.weight_shapes(cfg, "float32"),
        eins.ShapeDtype((16, cfg.head_dim)), eins.ShapeDtype((16, cfg.head_dim)))
    state = Compilation(prog, tuple(range(4)), Options(schedule=schedule,
                                                        synthesis_budget_s=0.02, tuning=SPREAD))
    seen = []
    for p in PIPELINE:
        state = verify(p(state))
        seen.append(p.__name__)
    assert seen == ["enumerate_specs", "cut_trees", "choose_specs", "place", "overlay",
                    "synthesize", "lower", "verify"]
    assert state.device is not None and state.device.num_instructions() > 0
    assert_splits(state)   # the passes had exchanges to make


def test_a_relay_hop_is_sent_round_robin_as_the_simulator_charges_it():
    """``A @ 0 -> 1, 2 -> 3, 4``: 1 relays to 3 and 2 to 4 (eins/hardware/simulate.py and
    the ExProg docs), not every site from the hop's first sender (1 -> 3 and 1 -> 4), which
    would use other links than the ones simulated."""
    from dataclasses import replace

    from eins.ir.device import Send
    from eins.ir.exprog import check, parse, to_text
    from eins.passes.lower import lower_exchanges
    from eins.runtime.numpy_backend import execute
    rng = np.random.default_rng(0)
    x, w, v = (rng.random(s).astype(np.float32) for s in [(8, 4), (4, 8), (8, 10)])
    f = lambda x, w, v: (x @ w) @ v   # noqa: E731
    # x @ w whole on device 0; the second matmul by columns of v on 5 devices: each needs
    # all of x @ w, broadcast from 0
    xir = eins.distribute(f, devices=5, plan={0: {"d0": 1}, 1: {"d1": 5}}
                          ).lower(x, w, v).physical.exchange
    x0 = xir.exchanges[0]
    text = to_text(x0.program)
    assert "A0_0 @ 0 -> 1, 2, 3, 4" in text
    relay = parse(text.replace("A0_0 @ 0 -> 1, 2, 3, 4", "A0_0 @ 0 -> 1, 2 -> 3, 4"))
    check(relay, dict(x0.membership))
    dprog = lower_exchanges(replace(xir, exchanges=(replace(x0, program=relay),)
                                 + xir.exchanges[1:]))
    sends = sorted((d, ins.peer) for d, code in dprog.code.items() for ins in code
                   if isinstance(ins, Send))
    assert sends == [(0, 1), (0, 2), (1, 3), (2, 4)]
    outs, _ = execute(dprog, [x, w, v])
    np.testing.assert_allclose(outs[0], f(x, w, v), rtol=1e-5)
