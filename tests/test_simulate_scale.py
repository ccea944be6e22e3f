"""The simulator on programs of many flows (issue 38): its fast paths give the plain
simulation's results, bit for bit.

- :func:`eins.hardware.fair_share.table_rates` (routes as index arrays, the saturated
  resources' routes frozen with numpy) against :func:`route_fair_rates` (a Python walk).
- A whole simulation rating its flows by the table from the first route on
  (``TABLE_ROUTES = 0``) against one rating them by the walk (the default below
  ``TABLE_ROUTES`` routes): the same total, timeline and work count, on naive exchange
  programs of random uneven preambles on small rail clusters and one NVSwitch server.
- The analytic time of naive bodies above ``SIMULATED_TRANSFERS`` transfers
  (:mod:`eins.passes.synthesize.estimate`) against the simulation: a lower bound, exact on
  a lone all-to-all, close on uneven exchanges.
"""
import numpy as np
import pytest

from eins.hardware import simulate as sim
from eins.hardware.fair_share import RouteTable, route_fair_rates, table_rates
from eins.hardware.presets import get_topology
from eins.ir.exprog import AtomDecl, ExProg, Partition, Requirement
from eins.hardware.simulate import simulate
from eins.passes.synthesize import estimate, naive_program
from eins.passes.synthesize.estimate import analytic_seconds, naive_seconds


def test_table_rates_equal_route_fair_rates():
    # random contention patterns (repeated routes, a resource twice on one route, unused
    # routes, near-equal capacities), the flow counts per resource kept as the simulator
    # keeps them (RouteTable.loads)
    rng = np.random.default_rng(11)
    for _ in range(300):
        nres = int(rng.integers(1, 12))
        cap = rng.choice([1.0, 3.0, 7.5, 1.0 + 1e-12, 2.0 / 3.0], nres) * \
            rng.choice([1.0, 1e9, 1e11], nres)
        routes = sorted({tuple(int(r) for r in rng.integers(0, nres, int(rng.integers(1, 4))))
                         for _ in range(int(rng.integers(1, 10)))})
        weights = rng.integers(0, 5, len(routes)).astype(np.float64)
        table = RouteTable([list(r) for r in routes], nres)
        count = table.loads(np.arange(len(routes)), weights)
        got = table_rates(table, weights, count, cap)
        used = weights.nonzero()[0]
        if not len(used):
            assert np.isinf(got).all()
            continue
        want = route_fair_rates([routes[i] for i in used], weights[used].astype(int), cap)
        assert got[used].tolist() == want.tolist()
        assert np.isinf(got[weights == 0]).all()


def _preamble(rng, gpus, atoms, outs):
    """A random exchange: ``atoms`` atoms of uneven sizes at random GPUs, ``outs``
    requirements of one to three atoms each at one to three GPUs (or a partition)."""
    inputs = tuple(AtomDecl(f"A{i}", int(rng.choice(gpus)),
                            int(rng.choice([4096, 4096, 2048, 1280, 65536])))
                   for i in range(atoms))
    parts = tuple(Partition(f"S{g}", 1, (g,)) for g in gpus)
    reqs = []
    for _ in range(outs):
        agg = frozenset(f"A{i}" for i in rng.choice(atoms, int(rng.integers(1, 4)),
                                                    replace=False))
        if rng.random() < 0.3:
            targets = (f"S{int(rng.choice(gpus))}",)
        else:
            targets = tuple(sorted({int(g) for g in rng.choice(gpus, int(rng.integers(1, 4)))}))
        reqs.append(Requirement(agg, targets))
    return ExProg(tuple(gpus), parts, inputs, tuple(reqs))


@pytest.mark.parametrize("topo,atoms,outs", [
    ("dgx-h100:2x4", 24, 60), ("dgx-h100:2x8", 64, 200), ("dgx-h100:4x4", 80, 300),
    ("dgx-h100:8", 40, 120), ("dgx-h100:4x2", 30, 90)])
def test_table_simulation_equals_the_walk(topo, atoms, outs, monkeypatch):
    t = get_topology(topo)
    rng = np.random.default_rng(len(t.gpus) + atoms)
    for _ in range(4):
        prog = naive_program(_preamble(rng, t.gpus, atoms, outs))
        runs = []
        for routes in (10**9, 0):
            monkeypatch.setattr(sim, "TABLE_ROUTES", routes)
            sim.cache_clear()
            runs.append(simulate(prog, t))
        walk, table = runs
        assert walk.total_s > 0
        assert table.total_s == walk.total_s
        assert table.timeline == walk.timeline
        assert table.work_s == walk.work_s
        assert table.resource_bytes == walk.resource_bytes


@pytest.mark.parametrize("topo", ["dgx-h100:2x4", "dgx-h100:2x8", "dgx-h100:4x4"])
def test_analytic_naive_time_bounds_the_simulation(topo):
    # the analytic time that replaces the simulation of naive bodies above
    # SIMULATED_TRANSFERS transfers: on transfer-only bodies a lower bound of the
    # simulation (each resource carries its bytes no faster than its capacity, from its
    # first transfer's latency on), equal to it where one resource bottlenecks throughout
    # (a lone all-to-all of equal pieces), and within 25 % on random uneven exchanges (the
    # bench's exchanges: 0 to 2.7 %, docs/measured.md)
    t = get_topology(topo)
    n = len(t.gpus)
    gpus = t.gpus
    uniform = ExProg(gpus, tuple(Partition(f"S{g}", 1, (g,)) for g in gpus),
                     tuple(AtomDecl(f"A{s}_{d}", s, 65536) for s in gpus for d in gpus),
                     tuple(Requirement(frozenset([f"A{s}_{d}"]), (d,)) for s in gpus
                           for d in gpus))
    prog = naive_program(uniform)
    # equal up to rounding (the simulator sums its steps, the model divides once)
    assert analytic_seconds(prog, t, {}) == pytest.approx(simulate(prog, t).total_s, rel=1e-12)
    rng = np.random.default_rng(n)
    for _ in range(6):
        pre = _preamble(rng, gpus, 3 * n, 8 * n)
        pre = ExProg(pre.gpus, pre.partitions, pre.inputs,
                     tuple(Requirement(frozenset([min(r.agg)]), r.targets) for r in pre.outputs))
        prog = naive_program(pre)
        members = {p.name: p.members for p in prog.partitions}
        sim_s = simulate(prog, t).total_s
        est = analytic_seconds(prog, t, members)
        assert est <= sim_s * (1 + 1e-12)
        assert est >= sim_s * 0.75


def test_naive_seconds_simulates_up_to_the_limit(monkeypatch):
    # below the limit the naive body's time is its simulation's, bit for bit; above it (on a
    # rail cluster) the analytic time
    t = get_topology("dgx-h100:2x4")
    rng = np.random.default_rng(3)
    pre = _preamble(rng, t.gpus, 24, 60)
    prog = naive_program(pre)
    members = {p.name: p.members for p in prog.partitions}
    assert naive_seconds(prog, t, members) == simulate(prog, t).total_s
    monkeypatch.setattr(estimate, "SIMULATED_TRANSFERS", 0)
    assert naive_seconds(prog, t, members) == analytic_seconds(prog, t, members)


def test_search_keeps_the_naive_body_beyond_simulation(monkeypatch):
    # the optimized schedule's search over a body beyond the limit: no candidate simulated,
    # the naive body kept at its analytic time; under the limit the same preamble is searched
    # and simulated (the search's result never slower than naive, and differently timed)
    from eins.passes.synthesize import synthesize_program

    t = get_topology("dgx-h100:2x4")
    pre = _preamble(np.random.default_rng(5), t.gpus, 24, 60)
    searched = synthesize_program(pre, t, steps=4)
    assert searched.evaluated > 0 and searched.naive_s == simulate(naive_program(pre), t).total_s
    monkeypatch.setattr(estimate, "SIMULATED_TRANSFERS", 0)
    kept = synthesize_program(pre, t, steps=4, seed=1)   # another seed: not the cached result
    members = dict(kept.membership)
    assert (kept.evaluated, kept.searched) == (0, False)
    assert kept.total_s == kept.naive_s == analytic_seconds(kept.program, t, members)
    assert kept.program.actions == naive_program(pre, {p.name: p.members for p in
                                                       kept.program.partitions}).actions
