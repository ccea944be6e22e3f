"""Synthesis at cluster scale (issue 38 item 3): the time floor counts the bytes that must
cross each node's boundary, a search is skipped exactly when its naive body is within the
min gain of that floor, and the layers of a stack lower each synthesized exchange once."""
import importlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eins
from eins.errors import PlanError
from eins.hardware.presets import get_topology
from eins.hardware.simulate import simulate
from eins.ir.exprog import AtomDecl, ExProg, Partition, Requirement
from eins.ir.plan import Tuning
from eins.passes.synthesize import caches, naive_program, synthesize_program
from eins.passes.synthesize.bound import FLOOR_SLACK, rates, time_floor
from eins.passes.synthesize.preamble import in_order_membership
from helpers import SPREAD, assert_splits

F = frozenset
KB = 1 << 10
# the module, not the pass function eins.passes re-exports under the same name
LOWER = importlib.import_module("eins.passes.lower")


def all_to_all(n, size, sized=False):
    """Site s holds x{s}_{d} for every other site d, wanted at d (or at partition P{d} of
    one site declared by size, with ``sized``)."""
    atoms, outs = [], []
    for s in range(n):
        for d in range(n):
            if s != d:
                atoms.append(AtomDecl(f"x{s}_{d}", s, size))
                outs.append(Requirement(F([f"x{s}_{d}"]), (f"P{d}" if sized else d,)))
    parts = tuple(Partition(f"P{d}", 1, None) for d in range(n)) if sized else ()
    return ExProg(tuple(range(n)), parts, tuple(atoms), tuple(outs))


def fresh(fn):
    caches.RESULTS.clear()
    try:
        return fn()
    finally:
        caches.RESULTS.clear()


def test_a_sites_rate_is_the_capacity_of_the_resources_its_routes_end_on():
    """On dgx-h100:2x4 a GPU receives over its NVSwitch port and its NIC, whatever the
    sources: 450 + 50 GB/s, not the sum of every route's narrowest link (3 x 450 + 4 x 50)."""
    topo = get_topology("dgx-h100:2x4")
    rin, rout = rates(topo)
    for g in topo.gpus:
        assert rin[g] == topo.capacity[f"ingress:{g}"] + topo.capacity[f"nic-in:{g}"]
        assert rout[g] == topo.capacity[f"egress:{g}"] + topo.capacity[f"nic-out:{g}"]
    assert rin[0] == pytest.approx(500e9)


@pytest.mark.parametrize("size", [4 * KB, 64 * KB])
def test_the_floor_counts_the_bytes_entering_a_node_over_its_nics(size):
    """All-to-all on 2 nodes of 4: each node receives 4 x 4 atoms over its 4 NICs, after the
    NIC latency at the least. Declared by size, a partition may sit in either node: in the
    other node than its own GPU's it needs only 3 atoms from outside, so the floor over every
    membership counts 8 x 3."""
    topo = get_topology("dgx-h100:2x4")
    nic, lat = topo.nic_bw, topo.class_latency("nic")
    fixed, sized = all_to_all(8, size), all_to_all(8, size, sized=True)
    assert time_floor(fixed, topo) == pytest.approx(lat + 16 * size / (4 * nic), rel=1e-12)
    assert time_floor(sized, topo) == pytest.approx(lat + 8 * 3 * size / (8 * nic), rel=1e-12)
    for prog in (fixed, sized):
        m0 = in_order_membership(prog)
        naive = simulate(naive_program(prog, m0), topo, m0).total_s
        best = fresh(lambda: synthesize_program(prog, topo, steps=30,
                                                tuning=Tuning(stop_at_floor=False)))
        assert time_floor(prog, topo) <= best.total_s * (1 + FLOOR_SLACK)
        assert best.total_s <= naive * (1 + 1e-9)


@st.composite
def cluster_preambles(draw):
    """Preambles whose requirements cross nodes: atoms on any GPU of a 2x4 or 4x2 cluster,
    aggregates wanted at GPUs or at partitions (one site or more) declared by size."""
    topo = draw(st.sampled_from(["dgx-h100:2x4", "dgx-a100:4x2"]))
    n = len(get_topology(topo).gpus)
    names, atoms = [], []
    for i in range(draw(st.integers(2, 12))):
        names.append(f"a{i}")
        atoms.append(AtomDecl(f"a{i}", draw(st.integers(0, n - 1)),
                              draw(st.sampled_from([KB, 16 * KB, 256 * KB]))))
    parts = [Partition(f"P{k}", draw(st.integers(1, 2)), None)
             for k in range(draw(st.integers(0, 3)))]
    targets = list(range(n)) + [p.name for p in parts]
    outs = []
    for _ in range(draw(st.integers(1, 8))):
        agg = draw(st.sets(st.sampled_from(names), min_size=1, max_size=3))
        tg = draw(st.lists(st.sampled_from(targets), min_size=1, max_size=3, unique=True))
        outs.append(Requirement(F(agg), tuple(tg)))
    return topo, ExProg(tuple(range(n)), tuple(parts), tuple(atoms), tuple(outs))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(cluster_preambles(), st.sampled_from([0.0, 0.05, 0.3]))
def test_a_search_is_skipped_exactly_when_naive_is_within_the_min_gain_of_the_floor(case,
                                                                                    gain):
    """The floor is below the naive body and every body the search keeps; the search runs
    unless the naive body is within ``synthesis_min_gain`` of the floor (of the preamble the
    search sees: its atoms renamed in IN order), and it never keeps a slower body."""
    topo, prog = case
    t = get_topology(topo)
    m0 = in_order_membership(prog)
    naive = simulate(naive_program(prog, m0), t, m0).total_s
    floor = time_floor(caches.canonical(prog)[0], t)
    assert time_floor(prog, t) <= naive * (1 + FLOOR_SLACK)
    assert floor <= naive * (1 + FLOOR_SLACK)
    r = fresh(lambda: synthesize_program(prog, t, steps=20,
                                         tuning=Tuning(synthesis_min_gain=gain)))
    assert r.naive_s == pytest.approx(naive, rel=1e-12)
    assert r.searched == (r.naive_s * (1 - gain) > floor * (1 + FLOOR_SLACK))
    assert floor <= r.total_s * (1 + FLOOR_SLACK)
    assert r.total_s <= r.naive_s * (1 + 1e-9)
    if not r.searched:
        assert r.evaluated == 1 and r.total_s == r.naive_s


def test_at_scale_a_search_stops_within_scale_min_gain():
    """An all-to-all of 64 KiB atoms over 4 nodes of 8 (32 sites) declared by size: the
    naive body is 3.2 % above the floor over every membership, so by default (10 % at 32
    sites and more) it is kept unsearched; without the scale gain the search runs and finds
    nothing faster. On 2 nodes of 4 (8 sites) the default searches; told that 8 sites are
    scale and 25 % is the gain there, it does not."""
    big = get_topology("dgx-h100:4x8")
    prog = all_to_all(32, 64 * KB, sized=True)
    quick = fresh(lambda: synthesize_program(prog, big, steps=30))
    full = fresh(lambda: synthesize_program(prog, big, steps=30,
                                            tuning=Tuning(scale_min_gain=0.0)))
    floor = time_floor(caches.canonical(prog)[0], big)
    assert quick.naive_s * 0.9 <= floor < quick.naive_s * 0.97
    assert not quick.searched and quick.evaluated == 1 and quick.total_s == quick.naive_s
    assert full.searched and full.evaluated > 1 and full.total_s == full.naive_s
    small = get_topology("dgx-h100:2x4")
    prog = all_to_all(8, 64 * KB, sized=True)
    assert fresh(lambda: synthesize_program(prog, small, steps=30)).searched
    lazy = fresh(lambda: synthesize_program(prog, small, steps=30, tuning=Tuning(
        scale_sites=8, scale_min_gain=0.25)))
    assert not lazy.searched and lazy.total_s == lazy.naive_s


@pytest.mark.parametrize("field,value", [("scale_min_gain", 1.5), ("scale_min_gain", "0.1"),
                                         ("scale_sites", -1), ("scale_sites", 2.5)])
def test_a_bad_scale_knob_is_named(field, value):
    with pytest.raises(PlanError, match=field):
        Tuning(**{field: value})


def stack(x, ws):
    for w1, w2 in ws:
        x = x + eins.relu(x @ w1) @ w2
    return x


def stack_np(x, ws):
    for w1, w2 in ws:
        x = x + np.maximum(x @ w1, 0) @ w2
    return x


def test_a_stack_lowers_each_synthesized_exchange_once(monkeypatch):
    """Under the optimized schedule on 2 nodes of 4 the third layer of a stack adds no
    exchange lowered afresh (its synthesized bodies equal the second layer's, and are
    replayed), and the replayed program computes what one device does. Each layer's
    second matmul is split along its contraction, so that its partial sums move (where no
    exchange moves anything, ``Exchange.local``, none is lowered at all)."""
    seen = []
    run = LOWER.Lowerer.run

    def counting(self):
        out = run(self)
        seen.append(len(self.templates))
        return out

    monkeypatch.setattr(LOWER.Lowerer, "run", counting)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    ws = [(rng.standard_normal((32, 64)).astype(np.float32) * 0.1,
           rng.standard_normal((64, 32)).astype(np.float32) * 0.1) for _ in range(3)]
    lows = []
    for n in (2, 3):
        f = eins.distribute(stack, devices=8, topology="dgx-h100:2x4", schedule="optimized",
                            tuning=SPREAD, plan={4 * layer + 2: {"j": 8} for layer in range(n)})
        low = f.lower(x, ws[:n])
        assert_splits(low)
        low.physical
        lows.append(low)
    assert len(seen) == 2 and seen[0] == seen[1] > 0
    two, three = (sum(1 for x in low.physical.exchange.exchanges if x.program is not None)
                  for low in lows)
    assert three > two   # the third layer has exchanges of its own, all replayed
    assert any(x.program.actions for x in lows[1].physical.exchange.exchanges)
    out = lows[1].compile()(x, ws)
    np.testing.assert_allclose(np.asarray(out), stack_np(x, ws), rtol=1e-4, atol=1e-4)
