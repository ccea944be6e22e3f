"""specs(Op) enumeration (Sections 3.3, 4.2): interval counts with product p, near-equal and
balanced intervals, uneven p, fewer pieces when p is out of reach, the max_specs bound."""
import math

import numpy as np
import pytest

import eins
from eins.errors import PlanError
from eins.ir.plan import Compilation, Options, Tuning
from eins.ir.types import Box
from eins.passes import PLANNING, run_passes
from eins.passes.enumerate_specs import (balanced_intervals, eqn_candidates, factorizations,
                                         forced_intervals)

S = eins.ShapeDtype


def _eqn(fn, *shapes, dtype="float32"):
    prog = eins.make_ir(fn)(*(S(s, dtype) for s in shapes))
    return prog, prog.eqns[0]


def _ordered_factorizations(p, k):
    """Independent count: ordered k-tuples of positive ints with product p (brute force)."""
    import itertools
    return sum(1 for t in itertools.product(range(1, p + 1), repeat=k) if math.prod(t) == p)


@pytest.mark.parametrize("p,k", [(8, 3), (12, 3), (7, 2), (64, 3), (8, 6), (6, 4)])
def test_factorizations_count_and_product(p, k):
    fs = factorizations(p, [p] * k)
    assert len(fs) == _ordered_factorizations(p, k)
    assert len(set(fs)) == len(fs)
    assert all(math.prod(f) == p for f in fs)


def test_factorizations_respect_caps():
    fs = factorizations(8, [2, 8])
    assert fs == [(1, 8), (2, 4)]
    assert factorizations(7, [3, 3]) == []


@pytest.mark.parametrize("n,c", [(10, 3), (7, 7), (13, 6), (5, 5), (100, 8)])
def test_any_intervals_are_near_equal_and_tile(n, c):
    iv = balanced_intervals(n, "any", c)
    assert len(iv) == c and iv[0][0] == 0 and iv[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(iv, iv[1:]))
    lens = [h - l for l, h in iv]
    assert max(lens) - min(lens) <= 1


def test_allowed_positions_choose_best_balance():
    # segment ends of the paper's Example 3.10: 1024, 2560, 4096 (inner cuts 1024 and 2560)
    assert balanced_intervals(4096, (1024, 2560, 4096), 2) == ((0, 2560), (2560, 4096)) or \
        balanced_intervals(4096, (1024, 2560, 4096), 2) == ((0, 1024), (1024, 4096))
    # 2560/1536 (sum of squares 8.9M) beats 1024/3072 (10.5M)
    assert balanced_intervals(4096, (1024, 2560, 4096), 2) == ((0, 2560), (2560, 4096))
    assert balanced_intervals(4096, (1024, 2560, 4096), 3) == ((0, 1024), (1024, 2560),
                                                               (2560, 4096))
    assert balanced_intervals(4096, (1024, 2560, 4096), 4) is None
    # 8 equal segments into 4 pieces: exactly every other end
    ends = tuple(range(16, 129, 16))
    assert balanced_intervals(128, ends, 4) == ((0, 32), (32, 64), (64, 96), (96, 128))


def test_matmul_specs_at_p8_are_all_abc_grids():
    _, e = _eqn(lambda a, b: a @ b, (16, 16), (16, 16))
    cands, q = eqn_candidates(e, 8)
    assert q == 8
    grids = sorted(tuple(c.intervals[n].__len__() for n in "ijk") for c in cands)
    assert grids == sorted(factorizations(8, [16, 16, 16]))
    assert all(len(c.spec.fspecs) == 8 for c in cands)


@pytest.mark.parametrize("p", [3, 5, 6, 7])
def test_uneven_p_splits_uneven_extents(p):
    _, e = _eqn(lambda a, b: a @ b, (10, 9), (9, 11))
    cands, q = eqn_candidates(e, p)
    assert q == p and cands
    for c in cands:
        assert len(c.spec.fspecs) == p
        c.spec.check_tiling([(10, 11)])
        for n, iv in c.intervals.items():
            lens = [h - l for l, h in iv]
            assert max(lens) - min(lens) <= 1


def test_op_that_cannot_split_p_ways_uses_fewer_pieces():
    # a 3x5 elementwise op at p=7: 7 is prime and larger than both extents -> 6 = 3*2 pieces
    _, e = _eqn(lambda x: eins.relu(x), (3, 5))
    cands, q = eqn_candidates(e, 7)
    assert q == 6
    assert {tuple(len(iv) for iv in c.intervals.values()) for c in cands} == {(3, 2), (2, 3)}
    assert all(len(c.spec.fspecs) == 6 for c in cands)
    # at p=16 the most reachable is 15 = 3*5: every element on its own device
    cands, q = eqn_candidates(e, 16)
    assert q == 15 and len(cands) == 1 and len(cands[0].spec.fspecs) == 15


def test_unshardable_op_gets_one_whole_spec_and_compiles():
    # rms_norm over a 1-D vector: its only index is the normalized one (never split)
    def f(x, w):
        return eins.rms_norm(x, w)

    low = eins.distribute(f, devices=4).lower(S((6,)), S((6,)))
    ep = low.plan.eqn_plans[0]
    assert ep.pieces == 1 and ep.splits == {}
    assert ep.spec.fspecs[0].inputs == (Box((0,), (6,)), Box((0,), (6,)))
    assert low.cost_bytes == 2 * 6 * 4  # join reads x and w once


def test_literal_input_has_no_tiling_key():
    _, e = _eqn(lambda x: x * 2.0, (4, 4))
    cands, _ = eqn_candidates(e, 4)
    assert all(c.in_keys[1] is None for c in cands)


def test_max_specs_keeps_cheapest_local_costs():
    # matmul with three batch dims at p=64: many factorizations, bounded
    _, e = _eqn(lambda a, b: a @ b, (4, 4, 4, 8, 8), (4, 4, 4, 8, 8))
    allc, _ = eqn_candidates(e, 64, max_specs=10 ** 6)
    assert len(allc) == len(factorizations(64, [4, 4, 4, 8, 8, 8]))
    kept, _ = eqn_candidates(e, 64, max_specs=20)
    assert len(kept) == 20
    worst_kept = max(c.local.total for c in kept)
    dropped = [c for c in allc if c.intervals not in [k.intervals for k in kept]]
    assert all(c.local.total >= worst_kept for c in dropped)
    # the pruned search still finds the global local optimum
    assert min(c.local.total for c in kept) == min(c.local.total for c in allc)


def test_enumerate_specs_pass_fills_candidates():
    prog, _ = _eqn(lambda a, b: eins.relu(a @ b), (8, 8), (8, 8))
    st = run_passes(Compilation(prog, (0, 1, 2, 3)), PLANNING[:1])
    assert len(st.candidates) == 2
    # the 4-piece candidates, then (device subsets, Tuning.subset_levels=1) the 2-piece ones
    pieces = [len(c.spec.fspecs) for c in st.candidates[1]]
    assert pieces == [4] * len(factorizations(4, [8, 8])) + [2] * len(factorizations(2, [8, 8]))
    off = run_passes(Compilation(prog, (0, 1, 2, 3),
                                 Options(tuning=Tuning(device_subsets=False))), PLANNING[:1])
    assert len(off.candidates[1]) == len(factorizations(4, [8, 8]))


# ----------------------------------------------------------------------------- forced
def test_forced_counts_and_explicit_intervals():
    _, e = _eqn(lambda a, b: a @ b, (10, 8), (8, 6))
    assert forced_intervals(e, 0, {"i": 2, "k": 3}, 6) == {"i": ((0, 5), (5, 10)),
                                                          "k": ((0, 2), (2, 4), (4, 6))}
    assert forced_intervals(e, 0, {"j": ((0, 3), (3, 8)), "i": 1}, 2) == {"j": ((0, 3), (3, 8))}
    assert forced_intervals(e, 0, {"j": [[np.int64(0), 3], [3, np.int32(8)]]}, 2) == {
        "j": ((0, 3), (3, 8))}   # numpy ints and lists are fine
    assert forced_intervals(e, 0, {"j": ((0, 3.0), (3.0, 8))}, 2) == {
        "j": ((0, 3), (3, 8))}   # whole floats too
    torch = pytest.importorskip("torch")   # anything with __index__: torch int tensors
    assert forced_intervals(e, 0, {"j": torch.tensor([[0, 3], [3, 8]])}, 2) == {
        "j": ((0, 3), (3, 8))}


@pytest.mark.parametrize("given,needle", [
    ({"q": 2}, "unknown index 'q'"),
    ({"i": 11}, "extent 10 cannot be split into 11"),
    ({"i": 4, "k": 4}, "16 pieces"),
    ({"j": ((0, 3), (4, 8))}, "do not tile [0, 8)"),
    ({"j": "two"}, "expected an interval count"),
    # bounds were int()-ed: 3.7 became 3, and ((0, 3.2), (3.9, 8)) "tiled" [0, 8)
    ({"j": ((0, 3.7), (3.7, 8))}, "index 'r0': interval bounds must be ints, got 3.7 in "
                                  "((0, 3.7), (3.7, 8))"),
    ({"j": ((0, 3.2), (3.9, 8))}, "interval bounds must be ints, got 3.2"),
    ({"j": (("0", "4"), ("4", "8"))}, "interval bounds must be ints, got '0'"),
    ({"j": ((0, float("inf")), (4, 8))}, "interval bounds must be ints, got inf"),
    ({"j": ((False, 4), (4, 8))}, "interval bounds must be ints, got False"),
])
def test_forced_errors_name_the_value(given, needle):
    _, e = _eqn(lambda a, b: a @ b, (10, 8), (8, 6))
    with pytest.raises(PlanError) as ex:
        forced_intervals(e, 0, given, 8)
    assert needle in str(ex.value) and "plan[0] (matmul)" in str(ex.value)


def test_forced_unshardable_index_and_disallowed_cut(monkeypatch):
    _, e = _eqn(lambda x, w: eins.rms_norm(x, w), (8, 6), (6,))
    with pytest.raises(PlanError, match=r"index 'd1' is not shardable \(shardable: \['d0'\]\)"):
        forced_intervals(e, 0, {"z": 2}, 8)   # rms_norm's own letter for the normalized axis
    # an index shardable only at listed positions (no registered op declares one today)
    from eins.ir.joinagg import Indexing
    ix = Indexing({"s": 8}, {"s": (4,)}, lambda iv: None)
    monkeypatch.setitem(forced_intervals.__globals__, "eqn_indexing", lambda eqn: ix)
    with pytest.raises(PlanError, match=r"may only be cut at \[4\], not at \[3\]"):
        forced_intervals(e, 0, {"s": ((0, 3), (3, 8))}, 8)
    assert forced_intervals(e, 0, {"s": 2}, 8) == {"s": ((0, 4), (4, 8))}


def test_forced_plans_take_numpy_ints_as_keys_and_counts():
    """np.int64(0) was 'not an eqn index (0..0)' and np.int64(2) 'not an interval count'."""
    _, e = _eqn(lambda a, b: a @ b, (10, 8), (8, 6))
    assert forced_intervals(e, 0, {"i": np.int64(2)}, 2) == {"i": ((0, 5), (5, 10))}
    low = eins.distribute(lambda a, b: a @ b, devices=2, plan={np.int64(0): {"i": np.int32(2)}}
                          ).lower(S((4, 4)), S((4, 4)))
    assert low.plan_table()[0]["splits"] == {"d0": 2}
    with pytest.raises(PlanError, match=r"index 'd0': expected an interval count or"):
        forced_intervals(e, 0, {"i": np.True_}, 2)


def test_forced_plan_key_errors():
    f = eins.distribute(lambda a, b: a @ b, devices=4, plan={3: {"i": 2}})
    with pytest.raises(PlanError, match=r"plan key 3 is not an eqn index of this program \(0..0\)"):
        f.lower(S((4, 4)), S((4, 4)))
    with pytest.raises(PlanError, match="plan\\[0\\] must be a dict"):
        eins.distribute(lambda a, b: a @ b, devices=4, plan={0: 2}).lower(S((4, 4)), S((4, 4)))


def test_options_defaults():
    o = Options()
    assert (o.selector, o.seed, o.plan, o.schedule, o.topology) == ("dp", 0, None, "naive", None)


def test_zero_devices_is_an_error():
    _, e = _eqn(lambda a, b: a @ b, (4, 4), (4, 4))
    with pytest.raises(PlanError, match="need at least one device, got p=0"):
        eqn_candidates(e, 0)


def test_forced_intervals_on_unshardable_index():
    _, e = _eqn(lambda x, w: eins.rms_norm(x, w), (8, 6), (6,))
    with pytest.raises(PlanError, match=r"index 'd1' is not shardable \(shardable: \['d0'\]\)"):
        forced_intervals(e, 0, {"d1": ((0, 3), (3, 6))}, 8)
    # one whole interval is always allowed
    assert forced_intervals(e, 0, {"d1": ((0, 6),)}, 8) == {}


@pytest.fixture
def unsplittable_prim():
    """A primitive registered without an indexing (Primitive.indexing None: never split)."""
    import numpy as np
    from eins.ir.primitive import PRIMITIVES, Primitive, register
    name = "test_enum_unsplittable"
    if name not in PRIMITIVES:
        register(Primitive(name, lambda x: (x,), lambda x: (np.cumsum(x, axis=0),)))
    yield name
    PRIMITIVES.pop(name, None)


def test_an_operator_without_indexing_gets_one_whole_spec(unsplittable_prim):
    from eins.tracing import bind
    prog, e = _eqn(lambda x: bind(unsplittable_prim, x), (6, 4))
    cands, q = eqn_candidates(e, 4)
    assert q == 1 and len(cands) == 1
    (c,) = cands
    assert c.intervals == {} and c.spec.aggs == (None,)
    assert [(f.inputs, f.outputs) for f in c.spec.fspecs] == [
        ((Box((0, 0), (6, 4)),), (Box((0, 0), (6, 4)),))]
    assert c.local.join == 6 * 4 * 4 and c.local.aggregation == 0
    with pytest.raises(PlanError, match=r"unknown index 'a'; this eqn's indices that can be "
                                        r"split are \['\(none: never split\)'\]"):
        forced_intervals(e, 0, {"a": 2}, 4)
    assert forced_intervals(e, 0, {}, 4) == {}


def test_eqns_with_equal_types_and_params_share_one_enumeration():
    def fn(x, w, v):
        a = x @ w          # eqn 0
        b = a @ w          # eqn 1: same types as eqn 0
        c = b @ v          # eqn 2: another output shape
        d = c * 2.0        # eqn 3: a Literal operand
        return d * c       # eqn 4: two arrays, same shapes and dtypes as eqn 3
    prog = eins.make_ir(fn)(S((8, 8)), S((8, 8)), S((8, 4)))
    st = run_passes(Compilation(prog, tuple(range(4))), PLANNING)
    cands = st.candidates
    assert cands[0] is cands[1]
    assert cands[2] is not cands[0] and cands[3] is not cands[4]
    # the shared tuple is what each eqn would get on its own
    for i, e in enumerate(prog.eqns):
        own, _ = eqn_candidates(e, 4, subsets=1, subset_specs=Tuning().subset_specs)
        assert [(c.intervals, c.spec, c.local) for c in own] == \
            [(c.intervals, c.spec, c.local) for c in cands[i]]
    # which operand is a Literal is part of the key: the Literal is left out of the join
    # cost, so c * 2.0 reads the 8x4 float32 c once and d * c reads two such tensors
    assert {c.local.join for c in cands[3]} == {8 * 4 * 4}
    assert {c.local.join for c in cands[4]} == {2 * 8 * 4 * 4}
