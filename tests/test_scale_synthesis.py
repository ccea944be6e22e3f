"""Synthesis that knows when to stop (issue 38 item 3): ``Tuning.synthesis_min_gain``."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eins.errors import PlanError
from eins.hardware.presets import get_topology
from eins.ir.exprog import AtomDecl, ExProg, Requirement
from eins.ir.plan import Tuning
from eins.passes.synthesize import caches, synthesize_program
from eins.passes.synthesize.bound import FLOOR_SLACK, time_floor

F = frozenset
KB = 1 << 10


def _all_to_all(n, size=64 * KB):
    """Every site holds one atom per other site, each wanted there: a transpose."""
    atoms, outs = [], []
    for s in range(n):
        for d in range(n):
            if s != d:
                atoms.append(AtomDecl(f"x{s}_{d}", s, size))
                outs.append(Requirement(F([f"x{s}_{d}"]), (d,)))
    return ExProg(tuple(range(n)), (), tuple(atoms), tuple(outs))


@st.composite
def preambles(draw):
    n = 8
    names, atoms = [], []
    for i in range(draw(st.integers(2, 8))):
        names.append(f"a{i}")
        atoms.append(AtomDecl(f"a{i}", draw(st.integers(0, n - 1)),
                              draw(st.sampled_from([KB, 64 * KB, 1024 * KB]))))
    outs = []
    for _ in range(draw(st.integers(1, 4))):
        agg = draw(st.sets(st.sampled_from(names), min_size=1, max_size=3))
        tg = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4, unique=True))
        outs.append(Requirement(F(agg), tuple(tg)))
    return ExProg(tuple(range(n)), (), tuple(atoms), tuple(outs))


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(preambles(), st.sampled_from([0.01, 0.05, 0.3]))
def test_a_search_stops_within_its_min_gain_of_the_floor(prog, gain):
    """With ``synthesis_min_gain=g`` the search ends at its first body within g of the time
    floor, so the body it keeps is within g of the best any search could find (no body
    beats the floor); without, it searches on. Step budgets: no clock, exact compares."""
    topo = get_topology("dgx-v100-paper")
    floor = time_floor(prog, topo)
    try:
        caches.RESULTS.clear()
        full = synthesize_program(prog, topo, steps=40)
        caches.RESULTS.clear()
        quick = synthesize_program(prog, topo, steps=40,
                                   tuning=Tuning(synthesis_min_gain=gain))
    finally:
        caches.RESULTS.clear()
    assert quick.evaluated <= full.evaluated
    assert quick.total_s <= quick.naive_s * (1 + 1e-9)
    if quick.evaluated < full.evaluated:   # it stopped early: within g of the floor
        assert quick.total_s * (1 - gain) <= floor * (1 + FLOOR_SLACK)
        assert quick.total_s * (1 - gain) <= full.total_s * (1 + 1e-9)
    else:
        assert quick.total_s == pytest.approx(full.total_s, rel=1e-9)


def test_naive_within_the_min_gain_is_not_searched():
    """An all-to-all on an NVSwitch server: the naive body is the floor's, so a search with
    any min_gain simulates it alone; on dgx-v100-paper (the naive body crosses the PCIe
    bridge) a 1 % min gain still searches, a 99 % one does not."""
    try:
        caches.RESULTS.clear()
        r = synthesize_program(_all_to_all(8), "dgx-a100:8", steps=50,
                               tuning=Tuning(synthesis_min_gain=0.01))
        assert r.evaluated == 1 and r.total_s == r.naive_s
        caches.RESULTS.clear()
        slow = synthesize_program(_all_to_all(8), "dgx-v100-paper", steps=50,
                                  tuning=Tuning(synthesis_min_gain=0.01))
        caches.RESULTS.clear()
        lazy = synthesize_program(_all_to_all(8), "dgx-v100-paper", steps=50,
                                  tuning=Tuning(synthesis_min_gain=0.99))
    finally:
        caches.RESULTS.clear()
    assert slow.evaluated > 1 and slow.total_s < slow.naive_s
    assert lazy.evaluated == 1 and lazy.total_s == lazy.naive_s


@pytest.mark.parametrize("value", [1.5, -0.1, "0.01", True])
def test_a_bad_min_gain_is_named(value):
    with pytest.raises(PlanError, match="synthesis_min_gain"):
        Tuning(synthesis_min_gain=value)
