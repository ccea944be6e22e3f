"""ExProg (paper Section 5.2) parser/printer and the semantics of Definition 5.5."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eins.errors import ExProgError, ExProgSyntaxError
from eins.ir import exprog as E
from eins.ir.exprog import GB, Action, AtomDecl, ExProg, Partition, Requirement

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "exprog"
EXAMPLES = ROOT / "examples" / "exprog"


def fs(text: str) -> frozenset:
    return frozenset(text.split("+"))


def example(name: str) -> ExProg:
    return E.parse((EXAMPLES / f"{name}.exprog").read_text())


# ---------------------------------------------------------------------------- golden pairs

GOLDEN = sorted(p.name[: -len(".input.exprog")] for p in FIXTURES.glob("*.input.exprog"))


def test_golden_fixtures_exist():
    assert {"multiline_sections", "relays_multicast", "same_line_sections", "sizes",
            "wide"} <= set(GOLDEN)


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_print(name):
    prog = E.parse((FIXTURES / f"{name}.input.exprog").read_text())
    expected = (FIXTURES / f"{name}.expected.exprog").read_text()
    assert E.to_text(prog) == expected
    assert str(prog) == expected
    assert E.parse(expected) == prog  # the printed form means the same program


def test_multiline_sections_ast():
    prog = E.parse((FIXTURES / "multiline_sections.input.exprog").read_text())
    assert prog.gpus == tuple(range(8))
    assert prog.partitions == (Partition("G1", 2), Partition("G2", 2, (2, 3)))
    assert prog.inputs == tuple(AtomDecl(a, s) for a, s in zip("ABCD", range(4)))
    assert prog.outputs == (Requirement(fs("A+B"), ("G1",)), Requirement(fs("C+D"), ("G2",)),
                            Requirement(fs("A+B+C+D"), (7,)))
    assert len(prog.actions) == 9
    assert prog.actions[0] == Action(fs("A"), 0, ((1,),))
    assert prog.actions[4] == Action(fs("A+B"), "G1")


def test_relay_multicast_ast():
    prog = E.parse((FIXTURES / "relays_multicast.input.exprog").read_text())
    assert prog.actions[:2] == (Action(fs("A"), 0, ((1, 2), (3,))),
                                Action(fs("B"), 1, ((2,), (3,), (0,))))
    # 'A @ 0, 1 -> 2' is two actions, one per source
    assert prog.actions[4:6] == (Action(fs("A"), 0, ((2,),)), Action(fs("A"), 1, ((2,),)))
    assert prog.outputs[0].targets == ("P", 3)


def test_sizes_exact():
    assert E.atom_sizes(E.parse("IN: A @ 0 (size: 9007199254740992 B)\nOUT: A @ 0")) == {
        "A": 2**53}   # the largest size
    assert E.atom_sizes(E.parse("IN: A @ 0 (size: 1e0003 B)\nOUT: A @ 0")) == {
        "A": 1000}   # leading zeros of an exponent are no digits of it
    prog = E.parse((FIXTURES / "sizes.input.exprog").read_text())
    assert E.atom_sizes(prog) == {"A": 5 * 10**8, "B": 15 * 10**8, "C": 2000, "D": 7,
                                  "E": 10**9, "F": 10**9, "G": 1, "H": 1234567,
                                  "I": 12 * 10**9}
    assert E.agg_size(prog, fs("B+C")) == 15 * 10**8


@pytest.mark.parametrize("text, says", [
    # int() of 4,301+ digits raised a bare ValueError (the CLI printed a traceback, status 1)
    ("IN: A @ " + "9" * 5000 + "\nOUT: A @ 0", r"line 1, column 9: a number of 5,000 "
                                              r"characters; .* at most 40"),
    ("IN: A @ 0 (size: 0." + "0" * 5000 + "1 GB)\nOUT: A @ 0", r"a number of 5,003"),
    ("GPUS: 0, " + "1" * 50 + "\nIN: A @ 0\nOUT: A @ 0", r"a number of 50 characters"),
    # a fractional byte count was rounded half to even (2.5 B -> 2, 3.5 B -> 4), while
    # validate() refuses such sizes in an AST
    ("IN: A @ 0 (size: 2.5 B)\nOUT: A @ 0", r"size 2.5 B, 2.5 bytes; sizes are whole numbers"),
    ("IN: A @ 0 (size: 0.0000000025 GB)\nOUT: A @ 0", r"2.5 bytes; sizes are whole"),
    # the separator a continued section's line break makes was named as "found ''"
    ("IN: A @ 0\nOUT: A\n  @ 0", r"line 2, column 7: expected '\+' or '@' after 'A' in OUT, "
                                r"found end of line"),
])
def test_malformed_numbers_and_line_breaks_are_positioned_syntax_errors(text, says):
    with pytest.raises(ExProgSyntaxError, match=says):
        E.parse(text)


def test_a_fractional_size_that_is_whole_bytes_is_taken():
    assert E.atom_sizes(E.parse("IN: A @ 0 (size: 1.5 KB); B @ 0 (size: 2.5 GB)\n"
                                "OUT: A @ 0")) == {"A": 1500, "B": 2_500_000_000}


@pytest.mark.parametrize("nbytes,text", [(10**9, "1.0 GB"), (5 * 10**8, "0.5 GB"),
                                         (1500, "1.5 KB"), (7, "7 B"), (2 * 10**6, "2.0 MB"),
                                         (1_000_000_001, "1000000001 B")])
def test_format_size(nbytes, text):
    assert E.format_size(nbytes) == text
    prog = E.parse(f"IN: A @ 0 (size: {text})\nOUT: A @ 0")
    assert prog.inputs[0].size == nbytes


def test_agg_text_sorted():
    assert E.agg_text(frozenset({"B", "A", "C"})) == "A+B+C"
    assert E.agg_text(frozenset({"X10", "X2"})) == "X10+X2"


def test_gpus_inferred_from_sites_used():
    prog = E.parse("IN: A @ 3; B @ 1\nOUT: A+B @ 5\nA @ 3 -> 5 -> 9")
    assert prog.gpus == (1, 3, 5, 9)


# ---------------------------------------------------------------------------- paper examples


def test_example_5_1_closure_by_hand():
    prog = example("example_5_1")
    assert prog.gpus == (0, 1)
    assert E.closure(prog) == {(fs("A"), 0), (fs("B"), 1), (fs("A"), 1), (fs("B"), 0),
                               (fs("A+B"), 0), (fs("A+B"), 1)}
    assert E.check(prog) == {}
    assert E.is_valid(prog, {})


def test_example_5_2_closure_by_hand():
    prog = example("example_5_2")
    want = {(fs(a), s) for a, s in [("A", 0), ("B", 1), ("C", 2), ("D", 3), ("A", 1),
                                    ("B", 0), ("C", 3), ("D", 2)]}
    want |= {(fs("A+B"), s) for s in (0, 1, 2, 3)} | {(fs("C+D"), s) for s in (0, 1, 2, 3)}
    want |= {(fs("A+B+C+D"), s) for s in (0, 1, 2, 3)}
    assert E.closure(prog) == want
    assert E.check(prog) == {}
    # firing order: replaying it from S_IN, each action is enabled when its turn comes
    order = E.firing_order(prog)
    assert sorted(i for i, _ in order) == list(range(len(prog.actions)))
    state = {(fs(d.name), d.site) for d in prog.inputs}
    for i, s in order:
        a = prog.actions[i]
        assert brute_cover(a.agg, [y for y, t in state if t == s]), E.format_action(a)
        state |= {(a.agg, s)} | {(a.agg, d) for d in E.destinations(a)}
    assert state == want
    # A+B @ 0 -> 2 needs only B's arrival at 0, not the whole first round
    assert [i for i, _ in order].index(4) > [i for i, _ in order].index(1)


def test_example_5_3_membership_search():
    prog = example("example_5_3")
    assert E.check(prog) == {"G1": (0, 1, 4, 5), "G2": (2, 3, 6, 7)}
    assert E.is_valid(prog, {"G1": (0, 1, 4, 5), "G2": (2, 3, 6, 7)})
    assert not E.is_valid(prog, {"G1": (2, 3, 6, 7), "G2": (0, 1, 4, 5)})
    assert not E.is_valid(prog, {"G1": (0, 1, 2, 3), "G2": (4, 5, 6, 7)})
    assert not E.is_valid(prog)  # membership unknown: the partition actions cannot fire
    # Exhaustively: {0,1,4,5} is the only group of four that works.
    valid = [g for g in itertools.combinations(range(8), 4)
             if E.is_valid(prog, {"G1": g, "G2": tuple(x for x in range(8) if x not in g)})]
    assert valid == [(0, 1, 4, 5)]


def test_example_5_3_wrong_fixed_membership_names_requirement():
    prog = example("example_5_3")
    with pytest.raises(ExProgError, match=r"action 'A\+B\+E\+F @ G1' at site 2 is never "
                                          r"enabled: atoms A, B, E, F of A\+B\+E\+F never "
                                          r"reach site 2"):
        E.check(prog, {"G1": (2, 3, 6, 7), "G2": (0, 1, 4, 5)})


def test_example_5_3_preamble():
    pre = example("example_5_3_preamble")
    full = example("example_5_3")
    assert pre == ExProg(full.gpus, full.partitions, full.inputs, full.outputs, ())
    assert pre.partitions == (Partition("G1", 4), Partition("G2", 4))
    with pytest.raises(ExProgError, match=r"no membership makes this program valid: OUT "
                                          r"requirement 'A\+B\+E\+F @ G1' is not met: A\+B\+E\+F "
                                          r"can be materialized at no site, but partition 'G1' "
                                          r"needs 4 sites"):
        E.check(pre)


def test_example_5_4_preamble():
    prog = example("example_5_4")
    assert prog.gpus == (0, 1, 2, 3)
    assert prog.partitions == tuple(Partition(f"S{i}", 1) for i in range(1, 5))
    assert [(d.name, d.site) for d in prog.inputs] == [
        ("X1", 0), ("X2", 0), ("Y1", 1), ("Y2", 1), ("X3", 2), ("X4", 2), ("Y3", 3), ("Y4", 3)]
    assert all(d.size == GB for d in prog.inputs)
    assert prog.outputs == tuple(Requirement(fs(f"X{j}+Y{j}"), (f"S{j}",)) for j in range(1, 5))
    assert prog.actions == ()


def test_example_5_4_with_body_finds_forced_membership():
    body = ("Y1 @ 1 -> 0; X1+Y1 @ 0; X2 @ 0 -> 1; X2+Y2 @ 1\n"
            "Y3 @ 3 -> 2; X3+Y3 @ 2; X4 @ 2 -> 3; X4+Y4 @ 3\n")
    prog = E.parse((EXAMPLES / "example_5_4.exprog").read_text() + body)
    assert E.check(prog) == {"S1": (0,), "S2": (1,), "S3": (2,), "S4": (3,)}


# ---------------------------------------------------------------------------- semantics


def test_relay_materializes_at_every_hop():
    prog = E.parse("IN: A @ 0\nOUT: A @ 3\nA @ 0 -> 1, 2 -> 3")
    assert E.closure(prog) == {(fs("A"), s) for s in (0, 1, 2, 3)}


def test_partition_source_acts_at_every_member():
    prog = E.parse("PARTITIONS: P {0, 1}\nIN: A @ 0; B @ 1\nOUT: A+B @ P\n"
                   "A @ 0 -> 1; B @ 1 -> 0; A+B @ P")
    assert (fs("A+B"), 0) in E.closure(prog) and (fs("A+B"), 1) in E.closure(prog)
    assert E.check(prog) == {"P": (0, 1)}


def test_overlapping_aggregates_do_not_enable():
    text = ("IN: A @ 0; B @ 0; C @ 0\nOUT: A+B+C @ 1\n"
            "A+B @ 0 -> 1; B+C @ 0 -> 1; A+B+C @ 1\n")
    prog = E.parse(text)
    assert (fs("A+B+C"), 1) not in E.closure(prog)
    with pytest.raises(ExProgError, match=r"action 'A\+B\+C @ 1' is never enabled: the "
                                          r"aggregates at site 1 inside A\+B\+C \(A\+B, B\+C\) "
                                          r"overlap and never partition it"):
        E.check(prog)
    fixed = E.parse(text + "C @ 0 -> 1\n")  # now A+B and C partition A+B+C at site 1
    assert (fs("A+B+C"), 1) in E.closure(fixed)
    assert E.check(fixed) == {}


def test_never_enabled_names_missing_atoms():
    prog = E.parse("IN: A @ 0; B @ 1\nOUT: A+B @ 0\nA+B @ 0")
    with pytest.raises(ExProgError, match=r"action 'A\+B @ 0' is never enabled: atom B of "
                                          r"A\+B never reaches site 0"):
        E.check(prog)
    assert E.problems(prog) == [
        "action 'A+B @ 0' is never enabled: atom B of A+B never reaches site 0",
        "OUT requirement 'A+B @ 0' is not met: A+B is never materialized at site 0"]


def test_unmet_out_at_site():
    prog = E.parse("IN: A @ 0; B @ 1\nOUT: A+B @ 0, 1\nB @ 1 -> 0; A+B @ 0")
    with pytest.raises(ExProgError, match=r"OUT requirement 'A\+B @ 0, 1' is not met: A\+B "
                                          r"is never materialized at site 1"):
        E.check(prog)
    assert not E.is_valid(prog)


def test_present_but_not_materialized_is_not_enough():
    # Definition 5.5 asks for (X, s) in the closure, not for atoms that could form X.
    prog = E.parse("IN: A @ 0; B @ 1\nOUT: A+B @ 0\nB @ 1 -> 0")
    assert not E.is_valid(prog)


def test_unmet_out_at_declared_partition_member():
    prog = E.parse("PARTITIONS: P {0, 1}\nIN: A @ 0; B @ 1\nOUT: A+B @ P\n"
                   "B @ 1 -> 0; A+B @ 0")
    with pytest.raises(ExProgError, match=r"OUT requirement 'A\+B @ P' is not met: A\+B is "
                                          r"never materialized at site 1 of partition P = "
                                          r"\{0, 1\}"):
        E.check(prog)


def test_no_disjoint_membership():
    # Each size-1 partition can only be site 0; they cannot share it.
    prog = E.parse("GPUS: 0, 1\nPARTITIONS: P {size 1}; Q {size 1}\nIN: A @ 0; B @ 1\n"
                   "OUT: A @ P; A @ Q")
    with pytest.raises(ExProgError, match=r"^no membership makes this program valid \("
                                          r"'A @ P' can be met only at \{0\}; "):
        E.check(prog)


def test_membership_depends_on_partition_actions():
    # The actions at G and H only fire where A / B already are, so G = {3}, H = {2} is the
    # one valid membership. With every free site in G and H (the search's over-approximation)
    # G could also be 0 or 1 and H 1: the search must reject those with the real closure.
    prog = E.parse("GPUS: 0, 1, 2, 3\nPARTITIONS: G {size 1}; H {size 1}\n"
                   "IN: A @ 3; B @ 2\nOUT: A @ G; B @ H; A+B @ 1\n"
                   "A @ G -> 0, 1; B @ H -> 1; A+B @ 1\n")
    assert E.check(prog) == {"G": (3,), "H": (2,)}
    valid = [(g, h) for g in range(4) for h in range(4)
             if g != h and E.is_valid(prog, {"G": (g,), "H": (h,)})]
    assert valid == [(3, 2)]
    # Partition actions that can never fire at enough sites are reported.
    bad = E.parse("GPUS: 0, 1, 2, 3\nPARTITIONS: G {size 3}\nIN: A @ 0\nOUT: A @ 3\n"
                  "A @ G -> 3")
    with pytest.raises(ExProgError, match=r"partition 'G' needs 3 sites but its actions can "
                                          r"be enabled only at \{0, 3\}"):
        E.check(bad)


def test_check_cover_when_sizes_fill_gpus():
    # P needs A (only at 0 and 2 after the multicast); Q takes the rest: sizes add up to
    # the GPU count, so the groups must cover the GPUs.
    prog = E.parse("GPUS: 0, 1, 2\nPARTITIONS: P {size 1}; Q {size 2}\nIN: A @ 0; B @ 1\n"
                   "OUT: A @ P; B @ Q\nA @ 0 -> 2; B @ 1 -> 2")
    got = E.check(prog)
    assert got == {"P": (0,), "Q": (1, 2)}
    assert E.is_valid(prog, got)


def test_unreferenced_partition_gets_leftover_sites():
    prog = E.parse("GPUS: 0, 1, 2\nPARTITIONS: P {size 1}; Z {size 2}\nIN: A @ 2\n"
                   "OUT: A @ P")
    assert E.check(prog) == {"P": (2,), "Z": (0, 1)}


@pytest.mark.parametrize("membership,msg", [
    ({"Q": (0,)}, r"membership names unknown partition 'Q'"),
    ({"P": (0, 1)}, r"membership gives partition 'P' 2 sites \(0, 1\); it has size 1"),
    ({"P": (7,)}, r"membership of partition 'P' \(7,\) is not within GPUS"),
    ({"D": (1,)}, r"partition 'D' is declared as \{0\} but membership gives \(1,\)"),
    ({"P": (0,)}, r"partitions overlap in membership"),
])
def test_check_membership_argument_errors(membership, msg):
    prog = E.parse("GPUS: 0, 1\nPARTITIONS: P {size 1}; D {0}\nIN: A @ 0\nOUT: A @ D")
    with pytest.raises(ExProgError, match=msg):
        E.check(prog, membership)


def test_check_site_requirement_impossible_for_every_membership():
    prog = E.parse("GPUS: 0, 1\nPARTITIONS: P {size 1}\nIN: A @ 0\nOUT: A @ P; A @ 1")
    with pytest.raises(ExProgError, match=r"OUT requirement 'A @ 1' is not met: A is never "
                                          r"materialized at site 1"):
        E.check(prog)


# ---------------------------------------------------------------------------- exact cover


def brute_cover(x: frozenset, family) -> bool:
    fam = [y for y in family if y <= x]
    for r in range(1, len(fam) + 1):
        for combo in itertools.combinations(fam, r):
            if sum(len(y) for y in combo) == len(x) and frozenset().union(*combo) == x:
                return True
    return False


ATOMS = "ABCDEF"
subsets = st.frozensets(st.sampled_from(ATOMS), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.sets(subsets, max_size=9), subsets)
def test_covers_matches_brute_force(family, x):
    assert (E.exact_cover(x, set(family)) is not None) == brute_cover(x, family)
    # the closure's existence test (no cover chosen) agrees
    from eins.ir.exprog.cover import has_cover
    assert has_cover(x, set(family)) == brute_cover(x, family)


def test_covers_needs_backtracking():
    # The first candidate for A (A+B) leads nowhere; A+C, B+D does.
    fam = {fs("A+B"), fs("A+C"), fs("B+D"), fs("C+E")}
    assert E.exact_cover(fs("A+B+C+D"), fam) is not None
    assert E.exact_cover(fs("A+B+C+D+E"), fam) is None


@settings(max_examples=200, deadline=None)
@given(st.sets(subsets, max_size=9), subsets)
def test_cheapest_cover_matches_brute_force(family, x):
    # every piece costs its own size plus a read: the fewest, then the smallest, pieces
    cost = {y: 1.0 + len(y) / 10 for y in family}
    fam = [y for y in family if y <= x]
    costs = [sum(cost[y] for y in combo) for r in range(1, len(fam) + 1)
             for combo in itertools.combinations(fam, r)
             if sum(len(y) for y in combo) == len(x) and frozenset().union(*combo) == x]
    got = E.exact_cover(x, set(family), cost=cost.__getitem__)
    if not costs:
        assert got is None
    else:
        assert frozenset().union(*got) == x and sum(len(y) for y in got) == len(x)
        assert sum(cost[y] for y in got) == pytest.approx(min(costs))


# ---------------------------------------------------------------------------- random programs


def naive_closure(prog: ExProg, members: dict) -> set:
    """Definition 5.5 read literally: fire every enabled action until nothing changes."""
    state = {(frozenset((d.name,)), d.site) for d in prog.inputs}
    while True:
        new = set(state)
        for a in prog.actions:
            srcs = members[a.source] if isinstance(a.source, str) else (a.source,)
            for s in srcs:
                if brute_cover(a.agg, [y for y, t in state if t == s]):
                    new.add((a.agg, s))
                    new |= {(a.agg, d) for hop in a.hops for d in hop}
        if new == state:
            return state
        state = new


@st.composite
def programs(draw, max_gpus=5, sized=True):
    n = draw(st.integers(1, max_gpus))
    gpus = tuple(sorted(draw(st.sets(st.integers(0, 9), min_size=n, max_size=n))))
    sites = st.sampled_from(gpus)
    parts = []
    left = list(gpus)
    for k in range(draw(st.integers(0, 2))):
        if not left:
            break
        size = draw(st.integers(1, len(left)))
        if sized and draw(st.booleans()):
            parts.append(Partition(f"G{k}", size))
        else:
            members = tuple(draw(st.permutations(left))[:size])
            left = [g for g in left if g not in members]
            parts.append(Partition(f"G{k}", size, members))
        if sum(p.size for p in parts) > len(gpus):
            parts.pop()
    names = [f"A{i}" for i in range(draw(st.integers(1, 5)))]
    sizes = {a: draw(st.sampled_from([GB, GB // 2, 7, 1500, 3 * GB])) for a in names}
    inputs = [AtomDecl(a, draw(sites), sizes[a]) for a in names]
    inputs += [AtomDecl(a, s, sizes[a]) for a in names[:1] for s in
               draw(st.sets(sites, max_size=2)) if s != inputs[0].site]
    aggs = st.frozensets(st.sampled_from(names), min_size=1, max_size=3)
    targets = st.one_of(sites, st.sampled_from([p.name for p in parts] or [gpus[0]]))
    outputs = tuple(Requirement(draw(aggs), tuple(draw(st.lists(targets, min_size=1,
                                                                max_size=3))))
                    for _ in range(draw(st.integers(1, 3))))
    actions = (Action(draw(aggs), draw(targets),
                      tuple(tuple(draw(st.lists(sites, min_size=1, max_size=2, unique=True)))
                            for _ in range(draw(st.integers(0, 2)))))
               for _ in range(draw(st.integers(0, 8))))
    # a body is a set of actions (one per set of transfers: E.action_key), none sending an
    # aggregate to where it already is
    actions = tuple({E.action_key(a): a for a in actions if E.hop_fault(a) is None}.values())
    return ExProg(gpus, tuple(parts), tuple(inputs), outputs, actions)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_round_trip_random(prog):
    E.validate(prog)
    text = E.to_text(prog)
    assert E.parse(text) == prog
    assert E.to_text(E.parse(text)) == text


def all_memberships(prog: ExProg):
    """Every assignment of disjoint groups to the size-declared partitions (covering the
    GPUs when the sizes add up to the GPU count)."""
    fixed = {p.name: p.members for p in prog.partitions if p.members is not None}
    free = [g for g in prog.gpus if all(g not in m for m in fixed.values())]
    todo = [p for p in prog.partitions if p.members is None]
    cover = sum(p.size for p in prog.partitions) == len(prog.gpus)

    def rec(k, left, acc):
        if k == len(todo):
            if not (cover and left):
                yield dict(acc)
            return
        for g in itertools.combinations(left, todo[k].size):
            yield from rec(k + 1, [x for x in left if x not in g], {**acc, todo[k].name: g})

    for m in rec(0, free, {}):
        yield {**fixed, **m}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(max_gpus=4))
def test_semantics_match_literal_definition(prog):
    mems = list(all_memberships(prog))
    for m in mems[:4]:
        assert E.closure(prog, m) == naive_closure(prog, m)
    valid = [m for m in mems if E.is_valid(prog, m)]
    for m in valid[:2]:  # is_valid agrees with Definition 5.5 read literally
        state = naive_closure(prog, m)
        assert all(brute_cover(a.agg, [y for y, t in state if t == s])
                   for a in prog.actions
                   for s in (m[a.source] if isinstance(a.source, str) else (a.source,)))
    if valid:
        got = E.check(prog)
        assert E.is_valid(prog, got)
        assert all(len(got[p.name]) == p.size for p in prog.partitions)
    else:
        with pytest.raises(ExProgError):
            E.check(prog)


def test_fast_enough_on_a_large_program():
    # 64 GPUs, 256 atoms, an all-gather by a ring of relays: hundreds of actions.
    n = 64
    atoms = [f"X{i}" for i in range(4 * n)]
    lines = ["GPUS: " + ", ".join(map(str, range(n))),
             "IN: " + "; ".join(f"{a} @ {i % n}" for i, a in enumerate(atoms)),
             "OUT: " + "; ".join(f"{a} @ {(i + n // 2) % n}" for i, a in enumerate(atoms))]
    lines += [f"{a} @ {i % n} -> " + " -> ".join(str((i + k) % n) for k in range(1, n // 2 + 1))
              for i, a in enumerate(atoms)]
    prog = E.parse("\n".join(lines))
    import time
    t = time.perf_counter()
    assert E.is_valid(prog, {})
    assert time.perf_counter() - t < 2.0
