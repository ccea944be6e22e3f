"""Per-batch choice among compiled plan families (eins/passes/rebalance.py: Choice,
choose; the re-cut kernels' model) and the lower bound on any plan's predicted time
(eins.cost.predict.lower_bound), issue 36."""
from dataclasses import replace

import numpy as np
import pytest

import eins
from eins.cost.predict import Timeline, eqn_kernel_seconds, kernel_seconds, lower_bound, \
    model_seconds, out_itemsizes, predict
from eins.models import llama
from eins.passes import PHYSICAL, PLANNING, run_passes
from eins.passes.rebalance import Choice, choose, moved, recut, runtime_operands, \
    specialize
from eins.passes.relower import Family, relower
from eins.passes.verify import verify
from eins.runtime.numpy_backend import execute
from helpers import SPREAD, input_arrays, packed_call

CFG = llama.TINY
S, P = 64, 8
STREAM = [(64,), (10, 30, 64), (3, 5, 40, 41, 64), (8, 16, 24, 32, 40, 48, 64)]
LOWER = tuple(p for p in PHYSICAL if p is not verify)


def call(x, w, ends):
    return packed_call(CFG, S, x, w, ends)


EQUAL = tuple(range(8, S + 1, 8))   # 8 documents of 8 rows: balanced cuts are equal cuts


@pytest.fixture(scope="module")
def families():
    """The TINY packed block on 8 devices planned three times: for STREAM[1], attention
    split by its 2 kv heads and by query sequence over 8 devices; for EQUAL, by query
    sequence (the equal-token family: every token-wise eqn cut where the attention is)."""
    rng = np.random.default_rng(0)
    w = llama.init_weights(CFG, rng)
    x = rng.standard_normal((S, CFG.d_model)).astype(np.float32)
    low = eins.distribute(llama.packed_block_fn(CFG), devices=P,
                          tuning=SPREAD).lower(*call(x, w, STREAM[1]))
    ops = runtime_operands(low.program)
    (att, _), = ops.items()
    out = []
    for ends, split in ((STREAM[1], {"heads_kv": 2}), (STREAM[1], {"sequence": P}),
                        (EQUAL, {"sequence": P})):
        spec = specialize(low.program, input_arrays(*call(x, w, ends)), ops)
        comp = replace(low.compilation, program=spec, plan=None)
        comp = replace(comp, options=replace(comp.options, plan={att: split}))
        out.append(run_passes(comp, PLANNING))
    return out, ops, att, (x, w)


def test_a_recut_heads_split_is_priced_by_the_kernel_model_on_its_pairs(families):
    (heads, _, _), ops, att, (x, w) = families
    topo = heads.topology
    for ends in STREAM:
        comp = recut(heads, input_arrays(*call(x, w, ends)), ops)
        # each of the 2 busy devices: one kv head, its G = 2 query heads, every row; a
        # segment of L rows has L(L+1)/2 visible pairs, 2 FLOPs a multiply-add, QK^T and
        # PV of head dim 4 each, in float32 (F / flops_of(float32) tensor FLOPs each)
        lengths = np.diff((0,) + ends)
        pairs = int(sum(n * (n + 1) // 2 for n in lengths))
        work = 2 * 2 * pairs * (4 + 4) * topo.flops / topo.flops_of(np.float32)
        # q, o: 2 heads x 64 rows x 4; k, v: 1 head; the 8 padded ends: float32, int32
        nbytes = 4 * (2 * 2 * S * 4 + 2 * S * 4) + 4 * 8
        prof = topo.profile
        entry = prof.entry("attention") if prof is not None else None
        want = model_seconds(work, nbytes, topo.flops, topo.hbm_bw, entry)
        e, spec = comp.program.eqns[att], comp.plan.eqn_plans[att].spec
        got = topo.busy_seconds(eqn_kernel_seconds(e, spec.fspecs, topo,
                                                   out_itemsizes(e, spec)), comp.devices)
        assert got == pytest.approx(want, rel=1e-12)


def test_choose_takes_the_faster_estimate_exact_for_a_family_whose_boxes_stay(families):
    fams, ops, att, (x, w) = families
    lowered = [Family(f) for f in fams]
    choices = [Choice(f, lw.state, ops, balance=n < 2)
               for n, (f, lw) in enumerate(zip(fams, lowered))]
    for ends in STREAM:
        args = call(x, w, ends)
        arrays = input_arrays(*args)
        n, comp, t = choose(choices, arrays, ops)
        ests = [c.estimate(recut(c.planned, arrays, ops, c.balance)) for c in choices]
        assert t == min(ests) and n == ests.index(t)
        # the heads family's boxes are the same for every batch: its estimate is the
        # predicted time, GPU by GPU, of its lowering for this batch
        hcomp = recut(fams[0], arrays, ops)
        got = predict(relower(lowered[0], hcomp, ops))["timeline_ms"] / 1e3
        assert ests[0] == pytest.approx(got, rel=1e-9)
        # whichever family it picks runs to the single-device result (the fixed cuts too)
        want = eins.jit(llama.block_fn(CFG, ends))(*args[:4])
        for c, lw in zip(choices, lowered):
            low = relower(lw, recut(c.planned, arrays, ops, c.balance), ops)
            verify(low)
            outs, _ = execute(low.device, arrays)
            np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)
    # a family that is slower by a second is never chosen
    slow = Choice(fams[0], lowered[0].state, ops)
    slow.timed = lambda comp, got, pieces=True: choices[0].timed(comp, got, pieces) + 1.0
    assert slow.estimate(recut(fams[0], input_arrays(*call(x, w, STREAM[0])), ops)) > 1.0
    assert choose([slow, choices[0]], input_arrays(*call(x, w, STREAM[0])), ops)[0] == 1


def test_fixed_cuts_keep_their_positions_and_price_the_keys_they_now_read(families):
    (_, _, equal), ops, att, (x, w) = families
    cuts = tuple((k, k + 8) for k in range(0, S, 8))
    assert equal.plan.eqn_plans[att].intervals["sequence"] == cuts
    first = Family(equal).state
    ends = STREAM[1]   # documents [0, 10), [10, 30), [30, 64)
    comp = recut(equal, input_arrays(*call(x, w, ends)), ops, balance=False)
    assert comp.plan.eqn_plans[att].intervals["sequence"] == cuts
    # rows [8d, 8d+8) read keys from their first row's document start: devices 1..7 now
    # read 8, 6, 14, 2, 10, 18, 26 rows before their own; a key row of k (and of v) is 2
    # kv heads x head dim 4 x 4 bytes. The slowest receiver: device 7's 26 rows; the
    # busiest sender sends fewer (device 4: its 8 rows to devices 5, 6 and 7, 24 rows);
    # after one transfer's latency.
    # Each of k and v is one exchange, among all 8 devices (device 0 sends, 1-7 receive).
    for d, (f, (qa, _)) in enumerate(zip(comp.plan.eqn_plans[att].spec.fspecs, cuts)):
        start = max([0] + [e for e in ends if e <= qa])
        assert f.inputs[1].lo[-2] == start
    choice = Choice(equal, first, ops, balance=False)
    inbound = min(first.topology.bandwidth(s, first.placement[att][7])
                  for s in first.devices if s != first.placement[att][7])
    latency = max(first.topology.route_latency(s, d) for s in first.devices
                  for d in first.devices if s != d)
    want = latency + 26 * (2 * 4 * 4) / inbound
    assert choice.outbound == choice.inbound   # a uniform topology
    got = moved(choice, comp, {att})
    gpus = frozenset(first.topology.gpu_of(d) for d in first.devices)
    # one per input: the keys (1) and the values (2)
    assert list(got) == [att] and got[att] == [(gpus, pytest.approx(want, rel=1e-12), a)
                                               for a in (1, 2)]
    # the estimate: the first lowering timed GPU by GPU, with these two exchanges before
    # the attention and its kernels on the new boxes
    line = Timeline(first.topology)
    for i, e in enumerate(comp.program.eqns):
        for x in first.exchange.for_eqn(i):
            line.exchange(x)
        src = comp if i == att else first
        fspecs = src.plan.eqn_plans[i].spec.fspecs
        sizes = out_itemsizes(src.program.eqns[i], src.plan.eqn_plans[i].spec)
        if i == att:
            line.hold(gpus, want)
            line.hold(gpus, want)
        line.kernels([kernel_seconds(src.program.eqns[i], f, first.topology, sizes)
                      for f in fspecs], first.placement[i])
    for x in first.exchange.for_eqn(-1):
        line.exchange(x)
    assert choice.estimate(comp) == pytest.approx(line.end(), rel=1e-12)
    # and within 2% of the re-cut program's own time GPU by GPU
    real = predict(relower(Family(equal), comp, ops))["timeline_ms"] / 1e3
    assert choice.estimate(comp) == pytest.approx(real, rel=0.02)
    # re-balanced instead, the cuts move to this batch's
    assert recut(equal, input_arrays(*call(x, w, ends)), ops).plan.eqn_plans[att].intervals[
        "sequence"] != cuts


def test_lower_bound_is_the_work_split_evenly_and_below_every_plan(families):
    # one matmul: W = 2 m k n FLOPs in float32, B = its three float32 arrays
    m, k, n = 512, 256, 128
    a = np.ones((m, k), np.float32)
    b = np.ones((k, n), np.float32)
    low = eins.distribute(lambda a, b: a @ b, devices=4, topology="dgx-h100:4").lower(a, b)
    topo = low.compilation.topology
    prof = topo.profile
    entry = prof.entry("matmul") if prof is not None else None
    work = 2 * m * k * n * topo.flops / topo.flops_of(np.float32)
    nbytes = 4 * (m * k + k * n + m * n)
    want = model_seconds(work / 4, nbytes / 4, topo.flops, topo.hbm_bw, entry) * 1e3
    assert lower_bound(low.compilation) == pytest.approx(want, rel=1e-12)
    assert lower_bound(low.compilation) <= low.predicted_time()["total_ms"]
    # the packed block: each family's plan, re-cut for each batch, is no faster
    fams, ops, _, (x, w) = families
    for ends in STREAM:
        arrays = input_arrays(*call(x, w, ends))
        for f in fams:
            comp = recut(f, arrays, ops)
            assert lower_bound(comp) <= predict(run_passes(comp, LOWER))["total_ms"]
