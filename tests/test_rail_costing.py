"""Planning at cluster scale (issue 38): the fast paths the DP takes on rail-optimized
clusters of NVSwitch servers give the same costs, hence the same plans, as the general ones.

- The closed-form routes (:mod:`eins.cost.rails`) against the route table of
  :class:`eins.cost.timecost.TimeModel` (``closed_form=False``): equal seconds, exactly (each
  resource sums its pairs' bytes in the same order), for every exchange between the
  candidates of a program, and the same DP plan.
- The affine operators' specs, whose boxes are now built once per distinct box: the boxes
  the definition gives (one function specification per combination of intervals, in
  ``itertools.product`` order).
"""
import itertools

import numpy as np
import pytest

import eins
from eins.hardware.presets import get_topology
from eins.ir.joinagg import signature_indexing
from eins.ir.plan import Compilation, Options
from eins.ir.types import Box
from eins.models import llama
from eins.passes import cut_trees, enumerate_specs
from eins.passes.choose_specs import dp_choice
from eins.cost.timecost import TimeModel
from tests.helpers import ffn

S = eins.ShapeDtype
TINY_64 = llama.Workload("1x64", 1, 64)


def _programs():
    yield "ffn", eins.make_ir(ffn)(S((64, 32), "float32"), S((32, 64), "float32"),
                                   S((64,), "float32"), S((64, 32), "float32"))
    yield "tiny", eins.make_ir(TINY_64.function(llama.TINY))(*TINY_64(llama.TINY))


def _planned(prog, devices, topo):
    state = Compilation(prog, tuple(devices), Options(topology=topo))
    return cut_trees(enumerate_specs(state))


@pytest.mark.parametrize("topo,devices", [
    ("dgx-h100:2x4", range(8)), ("dgx-h100:2x8", range(16)), ("dgx-h100:2x8", range(4)),
    ("dgx-h100:4x8", (0, 9, 18, 27, 4, 13, 22, 31)), ("dgx-h100:4x2", range(8))])
def test_closed_form_routes_price_every_exchange_as_the_route_table(topo, devices):
    """Every (producer candidate's copies, consumer candidate's needs) pair of the FFN and
    the TINY block: the same seconds from both route models, under both schedules, on
    whole clusters, their first devices and devices scattered over nodes and rails."""
    t = get_topology(topo)
    for name, prog in _programs():
        state = _planned(prog, devices, topo)
        producers = prog.producers()
        for relays in (False, True):
            fast = TimeModel(prog, state.devices, t, relays)
            slow = TimeModel(prog, state.devices, t, relays, closed_form=False)
            assert fast.links.lat.tolist() == slow.links.lat.tolist()
            seen, moving = 0, 0
            for e, cands in zip(prog.eqns, state.candidates):
                for k, a in enumerate(e.inputs):
                    where = producers.get(id(a))
                    if where is None:
                        continue
                    P, j = where
                    for pc in state.candidates[P]:
                        for c in cands:
                            got = [m.xseconds(m.out_ids(prog.eqns[P], pc.spec)[j],
                                              m.need_ids(e, c.spec)[k]) for m in (fast, slow)]
                            assert got[0] == got[1], (name, e.prim, got)
                            seen += 1
                            moving += got[0] > 0
            assert seen > 100 and moving > seen // 4   # real exchanges, not only free ones


def assert_same_dp_plan(topo, p):
    """The DP picks the same candidates at the same (nonzero) cost under the closed-form
    routes as under the route table, for every program of :func:`_programs` on ``p``
    devices of ``topo``."""
    t = get_topology(topo)
    for name, prog in _programs():
        state = _planned(prog, range(p), topo)
        got = []
        for closed in (True, False):
            model = TimeModel(prog, state.devices, t, False, closed_form=closed)
            choice, costs = dp_choice(prog, state.candidates, state.trees, model=model)
            got.append((choice, sum(costs)))
        assert got[0] == got[1], name
        assert got[0][1] > 0


@pytest.mark.parametrize("topo,p", [("dgx-h100:2x4", 8), ("dgx-h100:4x8", 32),
                                    ("dgx-h100:2x8", 16)])
def test_closed_form_routes_give_the_same_plan(topo, p):
    """The DP under both route models picks the same candidates at the same cost."""
    assert_same_dp_plan(topo, p)


@pytest.mark.parametrize("sig,shapes,counts", [
    ("ij,jk->ik", ((12, 8), (8, 6), (12, 6)), {"i": 3, "j": 2, "k": 2}),
    ("ij,jk->ik", ((12, 8), (8, 6), (12, 6)), {"j": 4}),
    ("bij,bj->bi", ((4, 6, 8), (4, 8), (4, 6)), {"b": 2, "i": 3, "j": 2}),
    ("ij->j", ((10, 5), (5,)), {"i": 5, "j": 1}),
    ("i,i->i", ((9,), (9,), (9,)), {"i": 3}),
    # more than 16 combinations per operand: the bounds computed per dimension at once
    ("ij,jk->ik", ((48, 32), (32, 24), (48, 24)), {"i": 8, "j": 4, "k": 3}),
    ("bij,bj->bi", ((8, 12, 10), (8, 10), (8, 12)), {"b": 4, "i": 6, "j": 5}),
])
def test_affine_specs_are_one_box_per_combination_of_intervals(sig, shapes, counts):
    """Each function specification's boxes are the ones its combination of intervals
    spans (the definition, written out here), in ``itertools.product`` order, and the boxes
    an operand repeats across function specifications are one object."""
    ins, out = shapes[:-1], shapes[-1]
    ix = signature_indexing(sig, ins, [out])
    lhs, rhs = sig.split("->")
    subs = lhs.split(",") + [rhs]
    names = list(ix.extents)
    intervals = {n: tuple((ix.extents[n] * a // counts.get(n, 1),
                           ix.extents[n] * (a + 1) // counts.get(n, 1))
                          for a in range(counts.get(n, 1))) for n in names}
    spec = ix.spec(intervals)
    combos = list(itertools.product(*(intervals[n] for n in names)))
    assert len(spec.fspecs) == len(combos) == int(np.prod([counts.get(n, 1) for n in names]))
    for f, combo in zip(spec.fspecs, combos):
        pick = dict(zip(names, combo))
        want = [Box(tuple(pick[c][0] for c in s), tuple(pick[c][1] for c in s)) for s in subs]
        assert list(f.inputs) + list(f.outputs) == want
    for k in range(len(ins)):
        boxes = [f.inputs[k] for f in spec.fspecs]
        assert len({id(b) for b in boxes}) == len(set(boxes))


@pytest.mark.parametrize("lut", [0, 1 << 20])
def test_joined_overlaps_with_and_without_the_interval_table(lut, monkeypatch):
    """The join of eins.cost.overlap finds each candidate's box of the other side by a
    table of interval tuples (``LUT_SIZE``) or, past it, by a sorted search: both give
    overlap_elements x itemsize, with replicas on either side or both and whole dimensions
    between split ones."""
    from eins.cost import overlap
    from eins.cost.timecost import block_array, overlap_elements
    from eins.ir.program import Program

    monkeypatch.setattr(overlap, "DENSE_PAIRS", 0)   # always the join
    monkeypatch.setattr(overlap, "LUT_SIZE", lut)
    devs = tuple(range(16))
    model = TimeModel(Program((), (), ()), devs, get_topology("dgx-h100:2x8"))
    rng = np.random.default_rng(2)
    shape = (48, 5, 40, 32)

    def boxes():
        cuts = [sorted(set(rng.choice(np.arange(1, n), rng.integers(0, 7)))) if d != 1 else []
                for d, n in enumerate(shape)]
        grid = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, shape)]
        every = [Box(tuple(i[0] for i in g), tuple(i[1] for i in g))
                 for g in itertools.product(*grid)]
        return [every[rng.integers(len(every))] for _ in range(48)]

    shared = 0
    for n in range(30):
        a, b = boxes(), boxes()
        # every third pair: one side's boxes each on one position (partial sums into
        # single blocks, single blocks into replicas)
        if n % 3 == 1:
            a = list(dict.fromkeys(a))
        elif n % 3 == 2:
            b = list(dict.fromkeys(b))
        got = model.overlap_bytes(model.intern(a, 4), model.intern(b), 4)
        want = overlap_elements(block_array(a), block_array(b)) * 4
        assert np.array_equal(got, want)
        shared += int((want > 0).sum())
    assert shared > 30 * 48


def test_unique_rows_is_numpys_unique_along_rows():
    """The time cost's distinct boxes and block shapes (eins.cost.overlap.unique_rows):
    the arrays ``np.unique(axis=0)`` returns (rows, first index, inverse), negative bounds,
    one column, and columns too wide for one int64 code (numpy's own path) included."""
    from eins.cost.overlap import unique_rows

    rng = np.random.default_rng(3)
    cases = [rng.integers(-5, 6, size=(200, 4)), rng.integers(0, 3, size=(50, 1)),
             rng.integers(0, 2**40, size=(30, 3)) * rng.integers(0, 2, size=(30, 1)),
             np.repeat(rng.integers(0, 9, size=(7, 6)), 5, axis=0)[rng.permutation(35)]]
    for arr in cases:
        arr = arr.astype(np.int64)
        want = np.unique(arr, axis=0, return_index=True, return_inverse=True)
        got = unique_rows(arr, index=True)
        for w, g in zip(want, got):
            assert np.array_equal(np.ravel(w), np.ravel(g))
        assert np.array_equal(unique_rows(arr)[1], np.ravel(want[2]))
        assert len(want[0]) < len(arr)


def _grid(shape, counts, reps, rng):
    """The boxes of a regular grid tiling of ``shape`` (``counts`` pieces per dimension,
    uneven where they do not divide), each on ``reps`` positions, the positions in the
    product order of the dimensions and the replication axis shuffled (a spec's index
    names come in any order)."""
    axes = [("dim", d, c) for d, c in enumerate(counts)] + [("rep", None, reps)]
    rng.shuffle(axes)
    out = []
    for coords in itertools.product(*(range(c) for _, _, c in axes)):
        at = {d: x for (kind, d, _), x in zip(axes, coords) if kind == "dim"}
        lo = tuple(n * at[d] // c for d, (n, c) in enumerate(zip(shape, counts)))
        hi = tuple(n * (at[d] + 1) // c for d, (n, c) in enumerate(zip(shape, counts)))
        out.append(Box(lo, hi))
    return out


def _grid_pair(shape, p, rng, reps=1):
    """Two random grid tilings of ``shape`` (3 dims) for ``p`` positions, as (their piece
    counts, their boxes): the first with each box on ``reps`` positions, the second
    replicated a random number of times that fits."""
    counts = [c for c in itertools.product(range(1, 9), repeat=3) if np.prod(c) * reps <= p]
    ca = counts[rng.integers(len(counts))]
    cb = counts[rng.integers(len(counts))]
    a = _grid(shape, ca, reps, rng)
    b = _grid(shape, cb, max(1, int(rng.integers(1, p // np.prod(cb) + 1))), rng)
    return ca, cb, a, b


def _dense_and_table(topo, p, monkeypatch, partials=False):
    """Time models of ``topo``'s first ``p`` devices: the closed form with the dense pricing
    forced onto every exchange it applies to, and the route table's; and the list each
    dense pricing call appends whether it priced to (only the calls for partial sums still
    to be ⊕-combined where ``partials``)."""
    from eins.cost import rails
    from eins.ir.program import Program

    monkeypatch.setattr(rails, "MIN_PAIRS", 0)
    dense, used = rails.RailLinks.dense_seconds, []

    def counted(self, *args):
        t = dense(self, *args)
        if not partials or (len(args) > 4 and args[4] is not None):   # hbm_bw
            used.append(t is not None)
        return t
    monkeypatch.setattr(rails.RailLinks, "dense_seconds", counted)
    t = get_topology(topo)
    devs = tuple(range(p))
    return (TimeModel(Program((), (), ()), devs, t),
            TimeModel(Program((), (), ()), devs, t, closed_form=False), used)


@pytest.mark.parametrize("topo,p", [("dgx-h100:2x4", 8), ("dgx-h100:2x8", 16),
                                    ("dgx-h100:4x8", 32), ("dgx-h100:2x8", 12),
                                    ("dgx-h100:4x2", 8), ("dgx-h100:4x8", 6)])
def test_dense_rail_pricing_is_the_pairs_own(topo, p, monkeypatch):
    """An exchange between two grid tilings priced from the distinct boxes' sums per rail
    (eins.cost.rails.RailLinks.dense_seconds, forced here onto every exchange it applies to)
    gives the seconds of the route table's pairs, bit for bit: whole clusters and their
    first devices (part of a node included), even and uneven pieces, replicas of the
    needed blocks, fewer pieces than devices, and the tilings one dimension apart or
    split alike."""
    fast, slow, used = _dense_and_table(topo, p, monkeypatch)
    rng = np.random.default_rng(p)
    shape = (24, 20, 12)
    moving = 0
    for n in range(60):
        ca, cb, a, b = _grid_pair(shape, p, rng)
        isz = int(rng.choice([2, 4]))
        got = [m.xseconds(m.intern(a, isz), m.intern(b)) for m in (fast, slow)]
        assert got[0] == got[1], (ca, cb, got)
        moving += got[0] > 0
    assert moving > 40 and sum(used) > 30   # real exchanges, most priced the dense way


@pytest.mark.parametrize("topo,p", [("dgx-h100:2x8", 16), ("dgx-h100:4x8", 32),
                                    ("dgx-h100:4x8", 12)])
def test_dense_rail_pricing_gives_the_same_plan(topo, p, monkeypatch):
    """The DP with every exchange it can priced the dense way picks what it picks over
    the route table's pairs, at the same cost."""
    from eins.cost import rails

    monkeypatch.setattr(rails, "MIN_PAIRS", 0)
    assert_same_dp_plan(topo, p)


@pytest.mark.parametrize("topo,p", [("dgx-h100:2x8", 16), ("dgx-h100:4x8", 32),
                                    ("dgx-h100:4x8", 20)])
def test_factored_rail_sums_are_the_box_products_own(topo, p, monkeypatch):
    """The dense pricing's rail sums contracted per dimension from interval counts
    (eins.cost.rails.factored_sums) against the same sums over the [distinct, distinct] bytes
    (its limit set to 0) and against the route table's pairs: equal seconds, bit for bit,
    for grid tilings (even and uneven, replicated) and for sets of boxes that are no grid
    (some interval tuples missing: the largest pair's bytes are then found, not bounded)."""
    from eins.cost import rails
    from eins.ir.program import Program

    monkeypatch.setattr(rails, "MIN_PAIRS", 0)
    factored, used, full = rails.factored_sums, [], rails.FACTORED_LIMIT

    def counted(*args):
        got = factored(*args)
        used.append(None if got is None else got[4][1])
        return got
    monkeypatch.setattr(rails, "factored_sums", counted)
    t = get_topology(topo)
    devs = tuple(range(p))
    models = [TimeModel(Program((), (), ()), devs, t) for _ in range(2)]
    slow = TimeModel(Program((), (), ()), devs, t, closed_form=False)
    rng = np.random.default_rng(p + 1)
    shape = (24, 20, 12)
    moving = 0
    for n in range(80):
        ca, cb, a, b = _grid_pair(shape, p, rng)
        if n % 2:   # no grid: some boxes dropped, others on more positions
            keep = max(1, len(a) - int(rng.integers(0, len(a))))
            a = [a[i] for i in sorted(rng.choice(len(a), keep, replace=False))]
            b = [b[i] for i in rng.integers(0, len(b), len(b))]
        isz = int(rng.choice([2, 4]))
        got = []
        for m, limit in zip((*models, slow), (full, 0, 0)):
            monkeypatch.setattr(rails, "FACTORED_LIMIT", limit)
            got.append(m.xseconds(m.intern(a, isz), m.intern(b)))
        assert got[0] == got[1] == got[2], (ca, cb, got)
        moving += got[0] > 0
    assert moving > 50
    assert used.count(True) > 10 and used.count(False) > 10   # grids and not


@pytest.mark.parametrize("topo,p", [("dgx-h100:2x8", 16), ("dgx-h100:4x8", 32),
                                    ("dgx-h100:4x8", 24)])
def test_dense_rail_pricing_of_partial_sums_is_the_sorted_pairs_own(topo, p, monkeypatch):
    """Partial sums still to be ⊕-combined (each copy's box on 2, 3 or 4 positions) priced
    the dense way where each box is on a power of two of positions (their (m + 1) / m
    shares exact), and by the sorted pairs elsewhere: the route table's seconds, bit for
    bit, transfers and the busiest need's ⊕ both."""
    fast, slow, used = _dense_and_table(topo, p, monkeypatch, partials=True)
    rng = np.random.default_rng(p + 2)
    shape = (24, 20, 12)
    moving = 0
    for n in range(60):
        reps = (2, 4, 3)[n % 3]
        ca, cb, a, b = _grid_pair(shape, p, rng, reps)
        isz = int(rng.choice([2, 4, 8]))
        got = [m.xseconds(m.intern(a, isz), m.intern(b)) for m in (fast, slow)]
        assert got[0] == got[1], (ca, cb, reps, got)
        moving += got[0] > 0
    assert moving > 40
    assert used.count(True) > 20 and used.count(False) > 10   # dense, and 3 copies not


@pytest.mark.parametrize("topo,p", [("dgx-a100:8", 8), ("dgx-h100:2x4", 8)])
def test_partial_sums_per_position_factor_as_exchange_seconds(topo, p):
    """The time model's ⊕ shares of partial sums (each copy's box on 1 to 4 positions, in
    any order) are the standalone exchange's (``exchange_seconds``, counting equal Boxes):
    the same transfers and the same busiest need's aggregation."""
    from eins.cost.timecost import exchange_seconds
    from eins.ir.program import Program

    t = get_topology(topo)
    devs = tuple(range(p))
    model = TimeModel(Program((), (), ()), devs, t)
    rng = np.random.default_rng(7)
    shape = (16, 12)
    pending = 0
    for n in range(40):
        pool = _grid(shape, (int(rng.integers(1, 5)), int(rng.integers(1, 3))), 1, rng)
        a = [pool[i] for i in rng.integers(0, len(pool), p)]   # repeats: partial sums
        b = _grid(shape, (int(rng.integers(1, 3)), int(rng.integers(1, 5))), 1, rng)[:p]
        b += b[:p - len(b)] * p
        b = b[:p]
        got = model.xseconds(model.intern(a, 4), model.intern(b))
        want = exchange_seconds(a, range(p), b, range(p), 4, t, devs)
        assert got == pytest.approx(want, rel=1e-12, abs=0), (a, b)
        pending += len(set(a)) < len(a) and got > 0
    assert pending > 20


def test_affine_boxes_of_many_combinations_scale_and_shift_their_intervals():
    """An affine operand (a reshape-like dimension ``[a * 3 + 2, b * 3 + 2)`` beside a
    plain one) split into more than 16 combinations: each function specification's box is
    the definition's, and equal boxes are one object."""
    from eins.ir.joinagg import affine_indexing

    extents = {"i": 12, "j": 10}
    ix = affine_indexing(extents, {"i": "any", "j": "any"},
                         [[("i", 3, 2), ("j", 1, 0)]], [[("i", 1, 0)]],
                         [(38, 10)], [(12,)])
    intervals = {"i": tuple((a, a + 2) for a in range(0, 12, 2)),
                 "j": ((0, 3), (3, 5), (5, 8), (8, 10))}
    spec = ix.spec(intervals)
    combos = list(itertools.product(intervals["i"], intervals["j"]))
    assert len(spec.fspecs) == 24
    for f, (i, j) in zip(spec.fspecs, combos):
        assert f.inputs[0] == Box((i[0] * 3 + 2, j[0]), (i[1] * 3 + 2, j[1]))
        assert f.outputs[0] == Box((i[0],), (i[1],))
    outs = [f.outputs[0] for f in spec.fspecs]
    assert len({id(b) for b in outs}) == len(set(outs)) == 6
