"""The physical passes hand each other values (docs/architecture.md, "The life of a
call"): overlay builds the exchange IR's preambles, synthesize returns a new exchange IR
with a body for each of those exchanges (placed again where the optimized schedule moves an
eqn, Section 5.1) and leaves overlay's untouched."""
import os
from dataclasses import FrozenInstanceError, replace
from types import SimpleNamespace

import numpy as np
import pytest

import eins
from eins.errors import LoweringError
from eins.ir.exchange import ExchangeIR, reuse_key
from eins.ir.plan import Compilation, Options, Tuning
from eins.models import llama
from eins.passes import PIPELINE, lower, overlay, synthesize, verify
from eins.ir.joinagg import FunctionSpec, JoinAggSpec
from eins.ir.types import Box
from eins.passes.overlay import (all_exchanges, build_exchange, eqn_exchanges, moves_nothing,
                                 output_exchanges, output_moves_nothing, placed)
from eins.passes.verify import verify_exchanges
from helpers import assert_close

S = eins.ShapeDtype
CFG = llama.TINY


def _llama_args():
    return (S((8, CFG.d_model), "float32"), llama.weight_shapes(CFG, "float32"),
            S((8, CFG.head_dim), "float32"), S((8, CFG.head_dim), "float32"))


def _chain_fn(a, b, c):
    return (a @ b) @ c


_CHAIN_ARGS = (S((16, 32), "float32"), S((32, 16), "float32"), S((16, 32), "float32"))


def _llama():
    return eins.make_ir(llama.block_fn(CFG))(*_llama_args())


def _chain():
    return eins.make_ir(_chain_fn)(*_CHAIN_ARGS)


# (program, devices, cost): under "optimized" each of these moves some eqn off the identity
# placement (asserted below), so the placing again is exercised, not only the naive path
CASES = {"llama4": (_llama, 4, "time"), "chain8": (_chain, 8, "proxy")}


def _through_overlay(case, schedule):
    make, p, cost = CASES[case]
    state = Compilation(make(), tuple(range(p)),
                        Options(schedule=schedule, synthesis_steps=40, cost=cost,
                                # a plan on every device: one this small runs on fewer
                                tuning=Tuning(device_subsets=False)))
    for pss in PIPELINE:
        state = pss(state)
        if pss is overlay:
            return state
    raise AssertionError("overlay is not in PIPELINE")


def _snapshot(xir):
    """Everything an exchange IR holds, as plain values (mappings copied out)."""
    return (dict(xir.placement), xir.schedule, xir.topology,
            [(x.eqn, x.input, x.var_name, x.producer, x.out_pos, x.op, x.itemsize, x.grid,
              x.cells, x.copies, dict(x.atoms), x.needs, x.preamble, x.program,
              dict(x.membership), x.predicted_s, x.naive_s) for x in xir.exchanges])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("schedule", ["naive", "optimized"])
def test_synthesize_leaves_overlays_exchange_ir_as_it_was(case, schedule):
    state = _through_overlay(case, schedule)
    before = _snapshot(state.exchange)
    assert all(x.program is None and not x.membership for x in state.exchange.exchanges)
    after = synthesize(state)
    assert after.exchange is not state.exchange
    assert _snapshot(state.exchange) == before
    assert all(x.program is not None for x in after.exchange.exchanges)
    moved = dict(after.placement) != dict(state.placement)
    assert moved == (schedule == "optimized")
    # the rest of the pipeline runs on synthesize's value and changes nothing either
    synth = _snapshot(after.exchange)
    verify(lower(after))
    assert _snapshot(after.exchange) == synth and _snapshot(state.exchange) == before


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("schedule", ["naive", "optimized"])
def test_synthesize_gives_overlays_exchanges_their_bodies(case, schedule):
    state = _through_overlay(case, schedule)
    ov = state.exchange
    out = synthesize(state).exchange
    final = out.placement
    # an input whose blocks an earlier eqn's exchange delivers to the same devices is
    # served by that exchange (its serves) and has none of its own
    served = {(i, ks): b for b in out.exchanges for i, ks in b.serves}
    for a in ov.exchanges:
        b = served.get((a.eqn, a.inputs))
        if b is not None:
            assert b.eqn < a.eqn and reuse_key(b) == reuse_key(a)
            assert b.delivered_sites() == tuple(final[a.eqn])
    kept = [a for a in ov.exchanges if (a.eqn, a.inputs) not in served]
    assert len(out.exchanges) == len(kept) > 0
    for a, b in zip(kept, out.exchanges):
        # what does not depend on the placement is overlay's, in overlay's order
        assert (b.eqn, b.input, b.var_name, b.producer, b.out_pos, b.op, b.itemsize) == \
            (a.eqn, a.input, a.var_name, a.producer, a.out_pos, a.op, a.itemsize)
        assert (b.grid, b.cells, b.atoms, b.needs) == (a.grid, a.cells, a.atoms, a.needs)
        assert b.preamble.outputs == a.preamble.outputs
        assert [(d.name, d.size) for d in b.preamble.inputs] == \
            [(d.name, d.size) for d in a.preamble.inputs]
        # the body is for this exchange's preamble
        assert b.program.inputs == b.preamble.inputs and b.program.outputs == a.preamble.outputs
        # the copies sit where the final placement runs their producer
        assert [c.device for c in b.copies] == [final[b.producer][c.fspec] for c in b.copies]
        assert [d.site for d in b.preamble.inputs] == \
            [b.copies[b.atoms[d.name][1]].device for d in b.preamble.inputs]
        if b.eqn >= 0:
            assert [b.membership[p] for p, _ in b.needs] == [(d,) for d in final[b.eqn]]
        if schedule == "naive":
            assert b.preamble == a.preamble and b.copies == a.copies
    if schedule == "optimized":
        # one input per eqn with inputs (its largest) was synthesized with free partitions,
        # unless an earlier eqn's exchange already delivered it (then it placed the eqn)
        free = [b for b in out.exchanges if b.preamble.partitions[0].members is None]
        assert len(free) == len({b.eqn for b in free})
        assert {b.eqn for b in free} | {i for i, _ in served} >= \
            {b.eqn for b in out.exchanges if b.eqn >= 0}


def test_exchanges_are_frozen():
    state = synthesize(_through_overlay("chain8", "naive"))
    xir = state.exchange
    x = xir.exchanges[0]
    with pytest.raises(FrozenInstanceError):
        x.program = None
    with pytest.raises(FrozenInstanceError):
        xir.placement = {}
    with pytest.raises(TypeError):
        x.membership["S0"] = (7,)
    with pytest.raises(TypeError):
        x.atoms["A0_0"] = (0, 0)
    with pytest.raises(TypeError):
        xir.placement[0] = (7,)
    assert isinstance(xir.exchanges, tuple) and isinstance(xir.for_eqn(x.eqn), tuple)
    # a membership handed in as a dict is copied: changing that dict changes no exchange
    m = dict(x.membership)
    y = replace(x, membership=m)
    m["S0"] = (7,)
    assert y.membership == x.membership


def _perm_placement(plan, seed):
    rng = np.random.default_rng(seed)
    return {i: tuple(int(d) for d in rng.permutation(plan.devices)[:len(ep.spec.fspecs)])
            for i, ep in enumerate(plan.eqn_plans)}


@pytest.mark.parametrize("case", list(CASES))
def test_placed_equals_the_overlay_built_under_that_placement(case):
    """placed() is overlay's own rule: an exchange placed again is the exchange the overlay
    builds under the new placement, fixed or free."""
    state = _through_overlay(case, "naive")
    plan, ov = state.plan, state.exchange
    other = _perm_placement(plan, 3)
    assert other != dict(ov.placement)
    rebuilt = all_exchanges(plan, other)
    assert [placed(x, other) for x in ov.exchanges] == rebuilt
    names, producers = plan.program.var_names(), plan.program.producers()
    for i in range(len(plan.program.eqns)):
        assert [placed(x, other, free=True) for x in ov.for_eqn(i)] == \
            eqn_exchanges(plan, other, names, producers, i, fixed=None)
    # nothing moves: the same object
    assert all(placed(x, ov.placement) is x for x in ov.exchanges)


def test_placed_refuses_an_exchange_with_a_body():
    x = synthesize(_through_overlay("chain8", "naive")).exchange.exchanges[0]
    with pytest.raises(LoweringError, match=f"exchange of {x.var_name} .* already has a body"):
        placed(x, {i: (0,) * 8 for i in range(3)})


def _replace_exchange(xir, n, x):
    xs = list(xir.exchanges)
    xs[n] = x
    return ExchangeIR(xir.plan, xir.placement, xs, xir.schedule, xir.topology)


def test_verify_catches_copies_off_their_producers_device():
    xir = synthesize(_through_overlay("chain8", "naive")).exchange
    verify_exchanges(xir)
    n, x = next((n, x) for n, x in enumerate(xir.exchanges) if len(x.copies) > 1)
    cp = x.copies[0]
    wrong = (cp.device + 1) % 8
    bad = replace(x, copies=(replace(cp, device=wrong),) + x.copies[1:])
    with pytest.raises(LoweringError, match=f"copy of block .* is on device {wrong} but eqn "
                                            f"{x.producer}'s function specification "
                                            f"{cp.fspec} runs on {cp.device}"):
        verify_exchanges(_replace_exchange(xir, n, bad))
    a = x.program.inputs[0]
    moved = replace(x.program, inputs=(replace(a, site=(a.site + 1) % 8),)
                    + x.program.inputs[1:])
    with pytest.raises(LoweringError, match=f"atom {a.name} declared at {(a.site + 1) % 8} "
                                            f"but its copy is on device {a.site}"):
        verify_exchanges(_replace_exchange(xir, n, replace(x, program=moved)))



FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "exchange")
# name: (fn, args, devices, schedule); the byte proxy plans them (the time cost's plans follow
# the kernel time model, which is not this golden file's subject). Both optimized cases move
# some eqn off the identity placement.
GOLDEN = {
    "chain_p4_naive": (_chain_fn, _CHAIN_ARGS, 4, "naive"),
    "chain_p8_optimized": (_chain_fn, _CHAIN_ARGS, 8, "optimized"),
    "llama_tiny_p4_optimized": (llama.block_fn(CFG), _llama_args(), 4, "optimized"),
}


@pytest.mark.parametrize("name", list(GOLDEN))
def test_exchange_and_device_text_match_golden(name):
    """The exchange and device stages' text (every preamble, body, membership, predicted
    time and instruction), written before the passes stopped changing values in place."""
    fn, args, p, schedule = GOLDEN[name]
    # under the paper's model (no per-transfer latency), where these small blocks' bodies
    # relay and forward, as the files show
    from eins.hardware.net import resolve_topology
    low = eins.distribute(fn, devices=p, schedule=schedule, synthesis_steps=40,
                          cost="proxy",
                          topology=resolve_topology(None, tuple(range(p))).without_latency()
                          ).lower(*args)
    text = low.as_text("exchange") + "\n\n" + low.as_text("device") + "\n"
    path = os.path.join(FIXTURES, name + ".txt")
    if os.environ.get("EINS_REGEN_EXCHANGE"):
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert text == f.read(), f"{name} differs from {path} (EINS_REGEN_EXCHANGE=1 regenerates)"


def test_optimized_keeps_the_naive_placement_when_the_moves_cost_more():
    """The optimized walk places each eqn for its own largest input; on the paper's chain E
    on dgx-v100-paper that makes the later exchanges dearer than the naive schedule's. The
    exchanges synthesized at the naive placement are then kept, so the optimized schedule is
    never predicted slower than the naive one (here it is 1.54x faster)."""
    from eins.hardware.net import resolve_topology
    from eins.models import chains
    from eins.passes.overlay import exchange_ir
    from eins.passes.place import naive_placement
    from eins.passes.synthesize import schedule as sched

    ch = chains.chain("E")
    kw = dict(devices=8, topology="dgx-v100-paper", synthesis_steps=4)
    naive = eins.distribute(ch.fn, schedule="naive", **kw).lower(*ch.shape_args())
    # the optimized schedule of the same plan: dp's plan for the naive schedule (for the
    # optimized one dp costs relayed routes and picks another plan)
    same = {i: ep.splits for i, ep in enumerate(naive.plan.eqn_plans)}
    opt = eins.distribute(ch.fn, schedule="optimized", plan=same, **kw).lower(*ch.shape_args())
    plan = opt.plan
    assert [ep.spec for ep in plan.eqn_plans] == [ep.spec for ep in naive.plan.eqn_plans]
    xir = exchange_ir(plan, naive_placement(plan), "optimized",
                      resolve_topology("dgx-v100-paper", plan.devices))
    synth = dict(budget_s=0.5, seed=0, steps=4)
    moves = sched.walk_exchanges(xir, synth, moves=True)
    stay = sched.walk_exchanges(xir, synth, moves=False)
    naive_s = sum(x.predicted_s for x in naive.exchanges)
    # the greedy moves lose to the naive schedule; staying put wins
    assert sched.total_exchange_s(moves) > naive_s > sched.total_exchange_s(stay)
    assert sum(x.predicted_s for x in opt.exchanges) == sched.total_exchange_s(stay)
    assert dict(opt.physical.placement) == dict(naive_placement(plan))
    got, want = opt.predicted_time(), naive.predicted_time()
    assert got["compute_ms"] == want["compute_ms"]
    assert want["exchange_ms"] / got["exchange_ms"] == pytest.approx(1.54, abs=0.01)


def test_optimized_keeps_the_moves_where_they_win():
    """On the LLaMA block 1x8K the walk's moves beat the naive placement (1.49 against 1.56
    ms of exchanges), and they are kept. (On 1x1K they do not: 0.28 against 0.19 ms.)"""
    wl = llama.WORKLOADS["1x8K"]
    low = eins.distribute(wl.function(llama.PAPER), devices=8, topology="dgx-v100-paper",
                          schedule="optimized", synthesis_steps=64).lower(*wl(llama.PAPER))
    naive = eins.distribute(wl.function(llama.PAPER), devices=8, topology="dgx-v100-paper"
                            ).lower(*wl(llama.PAPER))
    from eins.passes.place import naive_placement
    assert dict(low.physical.placement) != dict(naive_placement(low.plan))
    assert low.predicted_time()["exchange_ms"] < naive.predicted_time()["exchange_ms"]


# --------------------------------------------------- a tensor read twice is delivered once
def _square_twice(x, w):
    y = x @ w
    return y * y, y, y


# matmul split along its contraction (4 partial copies of the one 64x64 block), the product
# by rows: both of the product's inputs need the same row blocks of y
_TWICE_PLAN = {0: {"r0": 4}, 1: {"d0": 4}}


def test_a_tensor_an_eqn_reads_twice_is_exchanged_once():
    """``y * y`` needs the same blocks twice: one exchange delivers both inputs, and ``return
    y, y`` gathers y once. Hand-computed bytes (f32, 64x64 = 16 KiB, 4 partial copies on 4
    devices): into the product, each device receives the other three copies of its 4 KiB
    row block, 4 x 3 x 4 KiB = 48 KiB; the gather of y sums the three other copies of the
    whole block at the first copy's device, 3 x 16 KiB = 48 KiB; the product's output is
    already where its rows are. 96 KiB in all (it was twice that: 192 KiB)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    want = eins.jit(_square_twice)(x, w)
    f = eins.distribute(_square_twice, devices=4, plan=_TWICE_PLAN)
    got = f(x, w)
    assert f.stats()["total_bytes"] == 96 * 1024
    low = f.lower(x, w)
    heads = [line for line in low.as_text("exchange").splitlines() if line.startswith("## ")]
    assert [h.split(":")[0] for h in heads] == ["## eqn 1 (mul) inputs 0 and 1", "## output 0",
                                                "## outputs 1 and 2"]
    assert [x.inputs for x in low.exchanges] == [(0, 1), (0,), (1, 2)]
    outs = [got, low.compile("interpret")(x, w), low.compile("interpret", graphs=False)(x, w)]
    for out in outs:
        for a, b in zip(out, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)
        out[1][0, 0] += 1.0   # two outputs of one tensor are two arrays
        assert out[2][0, 0] != out[1][0, 0]


def test_a_tensor_read_twice_is_exchanged_once_in_the_generated_numpy_code():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    low = eins.distribute(_square_twice, devices=4, plan=_TWICE_PLAN).lower(x, w)
    got = low.generate("numpy").run([x, w])
    for a, b in zip(got, eins.jit(_square_twice)(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)
    got[1][0, 0] += 1.0
    assert got[2][0, 0] != got[1][0, 0]


def test_the_time_cost_charges_a_tensor_read_twice_once():
    """The plan's predicted seconds are what predict() reports for the exchanges that run:
    one exchange into ``y * y``, one gather of y however often it is returned."""
    S = eins.ShapeDtype
    args = (S((64, 256), "float16"), S((256, 64), "float16"))
    low = eins.distribute(_square_twice, devices=4, topology="dgx-v100-paper",
                          plan=_TWICE_PLAN).lower(*args)
    pt = low.predicted_time()
    assert low.plan.cost_s * 1e3 == pytest.approx(pt["total_ms"], rel=1e-12)
    one = next(x for x in low.exchanges if x.eqn == 1).predicted_s
    gather = next(x for x in low.exchanges if x.also == (2,)).predicted_s
    assert one > 0 and gather > 0
    assert pt["exchange_ms"] == pytest.approx((one + gather) * 1e3, rel=1e-12)


# --------------------------------------- a tensor several eqns read alike is delivered once
def _three_projections(x, wq, wk, wv):
    m = x * 2.0
    return m @ wq, m @ wk, m @ wv


# m by rows (4 row blocks, one per device); each projection by its output columns, so every
# device needs the whole m: the same all-gather three times, unless the first serves all
_TP_PLAN = {0: {"d0": 4}, 1: {"d1": 4}, 2: {"d1": 4}, 3: {"d1": 4}}


def _projection_args(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((64, 32)).astype(dtype),
            *(rng.standard_normal((32, 48)).astype(dtype) for _ in range(3)))


@pytest.mark.parametrize("schedule", ["naive", "optimized"])
def test_a_tensor_several_eqns_read_in_the_same_blocks_is_exchanged_once(schedule):
    """Megatron-style: three projections of one activation each need all of it on every
    device. One all-gather serves the three (Megatron's own sequence parallelism gathers
    once too). Hand-computed bytes (f32, m 64x32 = 8 KiB in four 2 KiB row blocks): each
    device sends its block to the three others, 4 x 3 x 2 KiB = 24 KiB; each output's
    column blocks are stored from the devices that computed them, moving nothing. 24 KiB in
    all (it was 24 KiB more for each further projection: 72 KiB)."""
    args = _projection_args()
    want = eins.jit(_three_projections)(*args)
    f = eins.distribute(_three_projections, devices=4, plan=_TP_PLAN, schedule=schedule,
                        synthesis_steps=16)
    got = f(*args)
    assert f.stats()["total_bytes"] == 24 * 1024
    low = f.lower(*args)
    into = [x for x in low.exchanges if x.eqn >= 0]
    assert [(x.eqn, x.inputs, x.serves) for x in into] == [(1, (0,), ((2, (0,)), (3, (0,))))]
    head = next(h for h in low.as_text("exchange").splitlines() if h.startswith("## eqn"))
    assert head.startswith("## eqn 1 (matmul) input 0, also eqn 2 input 0 and eqn 3 input 0: e:")
    outs = [got, low.compile("interpret")(*args), low.compile("interpret", graphs=False)(*args),
            low.generate("numpy").run(list(args))]
    for out in outs:
        for a, b in zip(out, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_time_cost_charges_a_gather_several_eqns_share_once():
    """Megatron TP on the paper block (1 x 8K tokens, float16, dgx-a100:8): the normalized
    activations are gathered once for the query, key and value projections and once for the
    two FFN input projections. Each such all-gather, by hand: every GPU sends its 1/8 of the
    8192 x 4096 x 2 B = 64 MiB to the 7 others through its 300 GB/s NVSwitch egress after
    the NVSwitch latency, 3.4 us + 7 x 8 MiB / 300 GB/s = 0.1991 ms; the plan's cost and
    predict() charge each once."""
    from eins.models import strategies
    wl = llama.WORKLOADS["1x8K"]
    fn, args = wl.function(llama.PAPER), wl(llama.PAPER)
    plan = strategies.megatron(eins.make_ir(fn)(*args), 8)
    low = eins.distribute(fn, devices=8, topology="dgx-a100:8", plan=plan).lower(*args)
    shared = [x for x in low.exchanges if x.serves and x.predicted_s > 0]
    assert [(x.var_name, [i for i, _ in x.serves]) for x in shared] == \
        [("m", [5, 9]), ("ad", [20])]
    gather = 3.4e-6 + 7 * 8 * 2 ** 20 / 300e9
    for x in shared:
        assert x.predicted_s == pytest.approx(gather, rel=1e-9)
    pt = low.predicted_time()
    assert pt["exchange_ms"] == pytest.approx(sum(x.predicted_s for x in low.exchanges) * 1e3,
                                              rel=1e-12)
    assert low.plan.cost_s * 1e3 == pytest.approx(pt["total_ms"], rel=1e-12)


def test_verify_names_a_consumer_an_exchange_cannot_serve():
    low = eins.distribute(_three_projections, devices=4, plan=_TP_PLAN).lower(
        *_projection_args())
    xir = low.physical.exchange
    n, x = next((n, x) for n, x in enumerate(xir.exchanges) if x.serves)
    bad = replace(x, serves=x.serves + ((4, (0,)),))
    with pytest.raises(LoweringError, match="serves eqn 4, which is not a later eqn"):
        verify_exchanges(_replace_exchange(xir, n, bad))
    moved = dict(xir.placement)
    moved[2] = tuple(reversed(moved[2]))
    with pytest.raises(LoweringError, match=r"delivers to devices \[0, 1, 2, 3\] but eqn 2, "
                                            r"which it serves, runs on \[3, 2, 1, 0\]"):
        verify_exchanges(replace(xir, placement=moved))


def test_bytes_moved_counts_every_hop_of_relayed_transfers():
    """On dgx-v100-paper (hybrid cube mesh: not every pair of GPUs is linked) the optimized
    programs relay atoms through other GPUs. Exchange.bytes_moved counts every destination
    of every hop, which is what the device program's sends carry when it runs."""
    from eins.runtime.numpy_backend import execute
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    fn = lambda a, b: eins.relu(a @ b) @ b   # noqa: E731
    low = eins.distribute(fn, devices=8, topology="dgx-v100-paper", schedule="optimized",
                          synthesis_steps=300, plan={0: {"d0": 8}, 1: {"d1": 8}},
                          cost="proxy").lower(x, w)
    xs = low.physical.exchange.exchanges
    assert any(len(a.hops) > 1 for e in xs if e.program for a in e.program.actions)
    got, stats = execute(low.physical.device, [x, w])
    assert sum(e.bytes_moved() for e in xs) == stats.total_bytes > 0
    assert_close(got[0], eins.jit(fn)(x, w), n=64, depth=2)


def _layout(producer, consumer, devices=(0, 1, 2, 3)):
    """A two-eqn plan: eqn 0 writes ``producer`` (one block per function specification),
    eqn 1 reads ``consumer``, both on ``devices`` in order."""
    def spec(boxes, out):
        fs = [FunctionSpec((), (b,)) if out else FunctionSpec((b,), ()) for b in boxes]
        return SimpleNamespace(spec=JoinAggSpec(tuple(fs), (None,) if out else ()))
    plan = SimpleNamespace(devices=devices, eqn_plans=[spec(producer, True),
                                                       spec(consumer, False)])
    placement = {0: devices[:len(producer)], 1: devices[:len(consumer)]}
    return plan, placement


def _rows(*cuts, cols=(0, 8)):
    return [Box((a, cols[0]), (b, cols[1])) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("producer, consumer, want", [
    (_rows(0, 3, 8, 16), _rows(0, 3, 8, 16), True),                  # cut alike
    (_rows(0, 3, 8, 16), _rows(0, 4, 8, 16), False),                 # cut elsewhere
    ([Box((0, 0), (16, 8))], [Box((0, 0), (16, 8))], True),          # one whole block
    (_rows(0, 8) * 2, _rows(0, 8) * 2, False),                       # one block twice
    (_rows(0, 8) + _rows(4, 16), _rows(0, 8) + _rows(4, 16), False),  # overlapping
    (_rows(0, 0, 16), _rows(0, 0, 16), False),                       # an empty block
    (_rows(0, 8, 16) + _rows(0, 8, 16, cols=(8, 16)),                # cut two ways: local,
     _rows(0, 8, 16) + _rows(0, 8, 16, cols=(8, 16)), None),         # its overlay tells
], ids=["alike", "elsewhere", "whole", "twice", "overlapping", "empty", "two-dims"])
def test_moves_nothing_tells_a_local_exchange_from_the_blocks(producer, consumer, want):
    """``moves_nothing`` says what ``Exchange.local`` says of the exchange the overlay
    builds, without building it; a cut along two dimensions is left to the overlay (False,
    though local); a consumer on other devices moves its blocks."""
    plan, placement = _layout(producer, consumer)
    var = SimpleNamespace(dtype=np.dtype("float32"))
    x = build_exchange(plan, placement, {id(var): "v"}, 1, 0, var, (0, 0),
                       [f.inputs[0] for f in plan.eqn_plans[1].spec.fspecs], placement[1])
    local = x.local(placement[1])
    assert local == (want is not False)
    assert moves_nothing(plan, placement, 1, 0, (0, 0)) == bool(want)
    if want:
        moved = {**placement, 1: tuple(d + 1 for d in placement[1])}
        assert not moves_nothing(plan, moved, 1, 0, (0, 0))


@pytest.mark.parametrize("producer, want", [
    (_rows(0, 3, 8, 16), True),                                    # cut along rows
    ([Box((0, 0), (16, 8))], True),                                # one whole block
    (_rows(0, 8) * 2, False),                                      # one block twice
    (_rows(0, 8) + _rows(4, 16), False),                           # overlapping
    (_rows(0, 0, 16), False),                                      # an empty block
    (_rows(0, 8, 16) + _rows(0, 8, 16, cols=(8, 16)), None),       # local, overlay tells
], ids=["rows", "whole", "twice", "overlapping", "empty", "two-dims"])
def test_output_moves_nothing_tells_a_local_gather_from_the_blocks(producer, want):
    """``output_moves_nothing`` says what ``Exchange.local`` says of the gather the overlay
    builds for a program output (each block at its first copy's device), without building
    it; a cut along two dimensions is left to the overlay, as moves_nothing's."""
    plan, placement = _layout(producer, producer)
    var = SimpleNamespace(dtype=np.dtype("float32"))
    plan.program = SimpleNamespace(outputs=(var,))
    x, = output_exchanges(plan, placement, {id(var): "v"}, {id(var): (0, 0)})
    assert x.local_members({p.name: p.members for p in x.preamble.partitions}) == \
        (want is not False)
    assert output_moves_nothing(plan, (0, 0)) == bool(want)
    assert output_exchanges(plan, placement, {id(var): "v"}, {id(var): (0, 0)}, skip={0}) == []
