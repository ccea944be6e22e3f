"""ExProg (paper Section 5.2) from the API side: the parser's positioned syntax errors,
validate() on a built AST, actions as transfers, and the membership search's messages."""
from __future__ import annotations

from pathlib import Path

import pytest

from eins.errors import ExProgError, ExProgSyntaxError
from eins.ir import exprog as E
from eins.ir.exprog import Action, AtomDecl, ExProg, Partition, Requirement

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "exprog"


def fs(text: str) -> frozenset:
    return frozenset(text.split("+"))


def example(name: str) -> ExProg:
    return E.parse((EXAMPLES / f"{name}.exprog").read_text())


# ---------------------------------------------------------------------------- parse errors

PARSE_ERRORS = [
    ("IN: A @ 0 $", 1, 11, "unexpected character '$'"),
    # ASCII digits only: '\u0663' (Arabic-Indic three) was read as site 3 and as 3 GB
    ("IN: A @ 0 (size: \u0663 GB)\nOUT: A @ 0", 1, 18, "unexpected character '\u0663'"),
    ("IN: A @ 0\nOUT: A @ 0\nA @ 0 -> \u0661", 3, 10, "unexpected character '\u0661'"),
    ("IN:\n", 1, 4, "expected entries after 'IN:', found end of input"),
    ("IN: A @ 0\nIN: B @ 1\nOUT: A @ 0", 2, 1, "section 'IN:' is declared twice"),
    ("OUT: A @ 0", 1, 11, "expected an 'IN:' section before end of input"),
    ("IN: A @ 0\nA @ 0", 2, 1, "expected an 'OUT:' section before name 'A'"),
    ("IN: A+B @ 0\nOUT: A @ 0", 1, 6, "expected '@' after atom 'A' in IN (an IN entry places "
                                     "one atom at one site), found '+'"),
    ("IN: A @ x\nOUT: A @ 0", 1, 9, "expected a site for atom 'A' (a GPU number), "
                                   "found name 'x'"),
    ("IN: A @ 1.5\nOUT: A @ 0", 1, 9, "expected a site for atom 'A' (a GPU number), "
                                     "found number 1.5"),
    ("IN: A @ 0 (sz: 1 GB)\nOUT: A @ 0", 1, 12, "expected 'size' after '(' for atom 'A', "
                                               "found name 'sz'"),
    ("IN: A @ 0 (size 1 GB)\nOUT: A @ 0", 1, 17, "expected ':' after 'size', found number 1"),
    ("IN: A @ 0 (size: GB)\nOUT: A @ 0", 1, 18, "expected a number for the size of atom 'A', "
                                               "found name 'GB'"),
    ("IN: A @ 0 (size: 1 TB)\nOUT: A @ 0", 1, 20, "expected a unit (GB, MB, KB or B) after 1, "
                                                 "found name 'TB'"),
    ("IN: A @ 0 (size: 1)\nOUT: A @ 0", 1, 19, "expected a unit (GB, MB, KB or B) after 1, "
                                              "found ')'"),
    ("IN: A @ 0 (size: 0 GB)\nOUT: A @ 0", 1, 18, "atom 'A' has size 0 GB; sizes must be at "
                                                 "least one byte"),
    # past 2**53 bytes float(size) loses bytes, past ~1e308 it overflowed in the simulator
    ("IN: A @ 0 (size: 1e400 B)\nOUT: A @ 0", 1, 18, "atom 'A' has size 1e400 B; sizes must "
                                                    "be at most 2**53 bytes (9 PB), where the "
                                                    "simulator's float arithmetic is exact"),
    ("IN: A @ 0 (size: 9007199254740993 B)\nOUT: A @ 0", 1, 18,
     "atom 'A' has size 9007199254740993 B; sizes must be at most 2**53 bytes (9 PB), where "
     "the simulator's float arithmetic is exact"),
    # an exponent this long would take Fraction minutes to expand
    ("IN: A @ 0 (size: 1e-999999999 GB)\nOUT: A @ 0", 1, 18,
     "atom 'A' has size 1e-999999999 GB, an exponent of more than three digits; sizes must be "
     "from one byte to 2**53 bytes (9 PB)"),
    ("IN: A @ 0 (size: 1 GB\nOUT: A @ 0", 1, 22, "expected ')' after the size, "
                                                "found end of line"),
    ("IN: A @ 0, 1\nOUT: A @ 0", 1, 10, "expected ';', '(size: ...)' or end of line after IN "
                                       "entry 'A @ 0', found ','"),
    ("GPUS: 0 1\nIN: A @ 0\nOUT: A @ 0", 1, 9, "expected ',' or end of line in GPUS, "
                                              "found number 1"),
    ("GPUS: 0, 0\nIN: A @ 0\nOUT: A @ 0", 1, 1, "site 0 is listed twice in GPUS"),
    ("GPUS: 0, 1\nIN: A @ 2\nOUT: A @ 0", 2, 9, "site 2 is not in GPUS (0, 1)"),
    ("GPUS: 0, 1\nIN: A @ 0\nOUT: A @ 0\nA @ 0 -> 3", 4, 10, "site 3 is not in GPUS (0, 1)"),
    ("PARTITIONS: 5 {size 1}\nIN: A @ 0\nOUT: A @ 0", 1, 13, "expected a partition name, "
                                                           "found number 5"),
    ("PARTITIONS: G1 size 1\nIN: A @ 0\nOUT: A @ 0", 1, 16, "expected '{' after partition "
                                                          "name 'G1', found name 'size'"),
    ("PARTITIONS: G1 {size 0}\nIN: A @ 0\nOUT: A @ 0", 1, 22, "expected a positive whole "
                                                            "partition size after 'size', "
                                                            "found number 0"),
    ("PARTITIONS: G1 {0, 0}\nIN: A @ 0\nOUT: A @ 0", 1, 17, "site 0 is listed twice in "
                                                          "partition 'G1'"),
    ("PARTITIONS: G1 {0 1}\nIN: A @ 0; B @ 1\nOUT: A @ 0", 1, 19, "expected ',' or '}' in "
                                                                "partition 'G1', found number 1"),
    ("PARTITIONS: G1 {0}; G1 {1}\nIN: A @ 0; B @ 1\nOUT: A @ 0", 1, 21,
     "partition 'G1' is declared twice"),
    ("PARTITIONS: G1 {0, 1}; G2 {1}\nIN: A @ 0; B @ 1\nOUT: A @ 0", 1, 24,
     "site 1 is in both partition 'G1' and partition 'G2' (partitions must be disjoint)"),
    ("GPUS: 0, 1\nPARTITIONS: G1 {size 2}; G2 {size 1}\nIN: A @ 0\nOUT: A @ 0", 2, 1,
     "partition sizes add up to 3 but there are only 2 GPUs"),
    ("IN: A @ 0\nOUT: A @ G9", 2, 10, "unknown partition 'G9' (declare it under PARTITIONS:)"),
    ("IN: A @ 0\nOUT: A @ 0\nA @ G9", 3, 5, "unknown partition 'G9' (declare it under "
                                           "PARTITIONS:)"),
    ("IN: A @ 0\nOUT: A @", 2, 9, "expected a site or partition after '@' (a GPU number or a "
                                 "partition name), found end of input"),
    ("IN: A @ 0\nOUT: A 0", 2, 8, "expected '+' or '@' after 'A' in OUT, found number 0"),
    ("IN: A @ 0\nOUT: A+ @ 0", 2, 9, "expected an atom name after '+', found '@'"),
    ("IN: A @ 0\nOUT: @ 0", 2, 6, "expected an atom name in OUT, found '@'"),
    ("IN: A @ 0\nOUT: A+A @ 0", 2, 8, "atom 'A' appears twice in one aggregate (an "
                                          "aggregate is a set of atoms)"),
    ("IN: A @ 0\nOUT: A @ 0;\nA @ 0 -> 1", 3, 7, "expected ';', ',' or end of line after OUT "
                                                "requirement 'A @ 0', found '->' (OUT lists "
                                                "requirements; start the body on a new, "
                                                "unindented line)"),
    ("IN: A @ 0\nOUT: A @ 0\n-> 1", 3, 1, "expected an atom name to start an action, "
                                         "found '->'"),
    ("IN: A @ 0\nOUT: A @ 0\nA @ 0 -> G1", 3, 10, "expected a destination site after '->', "
                                                 "found name 'G1' (destinations are GPU "
                                                 "numbers, not partitions)"),
    ("IN: A @ 0\nOUT: A @ 0\nA @ 0 ->", 3, 9, "expected a destination site after '->' "
                                             "(a GPU number), found end of input"),
    ("IN: A @ 0\nOUT: A @ 0\nA @ 0 1", 3, 7, "expected ';', '->' or end of line after action "
                                            "'A @ 0', found number 1"),
    ("IN: A @ 0\nOUT: A @ 0\nA @ 0\nGPUS: 0", 4, 1, "section 'GPUS:' must come before the "
                                                   "actions of the body"),
    ("IN: A @ 0\nOUT: B @ 0", 2, 6, "unknown atom 'B' (every atom must be declared in IN)"),
    # a destination list is a set (two sends to 1 would be charged two transfers) ...
    ("IN: A @ 0\nOUT: A @ 1\nA @ 0 -> 1, 1", 3, 13, "in action 'A @ 0 -> 1, 1': site 1 "
                                                  "appears twice in one destination list (a "
                                                  "destination list is a set of sites)"),
    # ... and nothing is sent to the site it is at: from the source, or from a relay
    ("IN: A @ 0\nOUT: A @ 0\nA @ 0 -> 0", 3, 10, "in action 'A @ 0 -> 0': 'A' would be sent "
                                               "from site 0 to itself (it is already there)"),
    ("IN: A @ 0\nOUT: A @ 1\nA @ 0 -> 1 -> 1", 3, 15, "in action 'A @ 0 -> 1 -> 1': 'A' "
                                                    "would be sent from site 1 to itself (it "
                                                    "is already there)"),
    ("IN: A @ 0\nOUT: A @ 3\nA @ 0 -> 1, 2 -> 3, 2", 3, 21,
     "in action 'A @ 0 -> 1, 2 -> 3, 2': 'A' would be sent from site 2 to itself (it is "
     "already there)"),   # 2 relays to the second site of the next hop: itself
    ("IN: A @ 0; B @ 1\nOUT: A+B @ 1\nA+B @ 0, 1 -> 1", 3, 15,
     "in action 'A+B @ 1 -> 1': 'A+B' would be sent from site 1 to itself (it is already "
     "there)"),
    # a body is a set of actions: writing one twice is a mistake, not a second transfer
    ("IN: A @ 0\nOUT: A @ 1\nA @ 0 -> 1\nA @ 0 -> 1", 4, 1, "action 'A @ 0 -> 1' is "
                                                           "written twice (a program is a set "
                                                           "of actions)"),
    ("IN: A @ 0\nOUT: A @ 1\nA @ 0, 0 -> 1", 3, 1, "action 'A @ 0 -> 1' is written twice (a "
                                                "program is a set of actions)"),
    # a destination list is a set: the same sites in another order are the same action
    ("IN: A @ 0\nOUT: A @ 1; A @ 2\nA @ 0 -> 1, 2\nA @ 0 -> 2, 1", 4, 1,
     "action 'A @ 0 -> 2, 1' is written twice (a program is a set of actions)"),
    ("IN: A @ 0; A @ 0\nOUT: A @ 0", 1, 12, "atom 'A' is declared twice at site 0"),
    ("IN: A @ 0; A @ 1 (size: 2 GB)\nOUT: A @ 0", 1, 12, "atom 'A' is declared with two sizes "
                                                        "(1.0 GB and 2.0 GB)"),
]


@pytest.mark.parametrize("text,line,col,msg", PARSE_ERRORS)
def test_parse_error(text, line, col, msg):
    with pytest.raises(ExProgSyntaxError) as info:
        E.parse(text)
    err = info.value
    assert (err.line, err.col) == (line, col), str(err)
    assert str(err) == f"line {line}, column {col}: {msg}"
    assert isinstance(err, ExProgError)


def test_relay_back_allowed():
    # a bounce back to the source is a real (if slow) route, not a self-send
    prog = E.parse("IN: A @ 0\nOUT: A @ 1\nA @ 0 -> 1 -> 0 -> 1")
    assert prog.actions == (Action(fs("A"), 0, ((1,), (0,), (1,))),)
    # a partition source is not checked against its destinations: its members are unknown
    assert E.parse("PARTITIONS: P {size 1}\nIN: A @ 0\nOUT: A @ 0\nA @ P -> 0").actions


def test_replicated_atom_allowed():
    prog = E.parse("IN: A @ 0; A @ 1\nOUT: A @ 0, 1")
    assert E.check(prog) == {}


# ---------------------------------------------------------------------------- validate(AST)

GOOD = ExProg((0, 1), (Partition("P", 1),), (AtomDecl("A", 0),),
              (Requirement(fs("A"), (0,)),), (Action(fs("A"), 0, ((1,),)),))


@pytest.mark.parametrize("change,msg", [
    (dict(gpus=(0, 0)), r"GPUS lists a site twice"),
    (dict(partitions=(Partition("P", 1), Partition("P", 1))), r"partition 'P' is declared twice"),
    (dict(partitions=(Partition("P", 0),)), r"partition 'P' has size 0"),
    (dict(partitions=(Partition("P", 2, (0,)),)), r"partition 'P' has size 2 but members"),
    (dict(partitions=(Partition("P", 1, (5,)),)), r"site 5 of partition 'P' is not in GPUS"),
    (dict(partitions=(Partition("P", 1, (0,)), Partition("Q", 1, (0,)))),
     r"site 0 is in both partition 'P' and partition 'Q'"),
    (dict(partitions=(Partition("P", 3),)), r"partition sizes add up to 3"),
    (dict(inputs=(AtomDecl("A", 4),)), r"atom 'A' is placed at site 4, not in GPUS"),
    (dict(inputs=(AtomDecl("A", 0), AtomDecl("A", 1, 5))), r"atom 'A' is declared with two"),
    (dict(inputs=(AtomDecl("A", 0), AtomDecl("A", 0))), r"atom 'A' is declared twice at site 0"),
    (dict(inputs=(AtomDecl("A", 0, 0),)), r"atom 'A' has size 0"),
    (dict(outputs=(Requirement(fs("B"), (0,)),)), r"unknown atom 'B' in OUT requirement"),
    (dict(outputs=(Requirement(fs("A"), ("Q",)),)), r"unknown partition 'Q' in OUT"),
    (dict(outputs=(Requirement(fs("A"), (3,)),)), r"site 3 in OUT requirement 'A @ 3' is not"),
    (dict(outputs=(Requirement(frozenset(), (0,)),)), r"empty aggregate in OUT"),
    (dict(actions=(Action(fs("A"), 0, ((9,),)),)), r"destination 9 in action 'A @ 0 -> 9'"),
    (dict(actions=(Action(fs("A"), "Q"),)), r"unknown partition 'Q' in action 'A @ Q'"),
    (dict(actions=(Action(fs("A"), 0, ((1, 1),)),)),
     r"action 'A @ 0 -> 1, 1': site 1 appears twice in one destination list"),
    (dict(actions=(Action(fs("A"), 0, ((1,), (1,))),)),
     r"action 'A @ 0 -> 1 -> 1': 'A' would be sent from site 1 to itself"),
    (dict(actions=(Action(fs("A"), 0, ((1,),)),) * 2),
     r"action 'A @ 0 -> 1' is written twice \(a program is a set of actions\)"),
    (dict(gpus=(0, 1, 2), actions=(Action(fs("A"), 0, ((1, 2),)),
                                   Action(fs("A"), 0, ((2, 1),)))),
     r"action 'A @ 0 -> 2, 1' is written twice"),
    (dict(actions=(Action(fs("A"), 0, ((),)),)), r"action 'A @ 0 -> ' has an empty destination"),
])
def test_validate_errors(change, msg):
    E.validate(GOOD)
    fields = dict(gpus=GOOD.gpus, partitions=GOOD.partitions, inputs=GOOD.inputs,
                  outputs=GOOD.outputs, actions=GOOD.actions)
    fields.update(change)
    with pytest.raises(ExProgError, match=msg):
        E.validate(ExProg(**fields))
    with pytest.raises(ExProgError, match=msg):
        E.check(ExProg(**fields))


def test_validate_takes_lists_and_numpy_numbers_in_an_ast():
    # the duplicate-action check hashed the Action (a list hop raised TypeError), and sizes
    # had to be int or float: np.float32(2**20) and Fraction(10**6) are whole numbers too
    from fractions import Fraction

    import numpy as np
    for size in (np.float32(2 ** 20), np.float16(1024), Fraction(10 ** 6), np.int64(7), 2.5e8):
        prog = ExProg((0, 1, 2), (), (AtomDecl("A", 0, size),),
                      (Requirement(fs("A"), (1, 2)),), (Action(fs("A"), 0, ([1, 2],)),))
        E.validate(prog)
    twice = ExProg((0, 1), (), (AtomDecl("A", 0),), (Requirement(fs("A"), (1,)),),
                   (Action(fs("A"), 0, ([1],)), Action(fs("A"), 0, ((1,),))))
    with pytest.raises(ExProgError, match=r"action 'A @ 0 -> 1' is written twice"):
        E.validate(twice)


def test_an_action_is_the_transfers_it_makes():
    """Two actions are the same when they make the same transfers (hop, sender,
    destination), whatever order lists them in: a relay hop's site j is sent by site
    j mod len(previous hop) of the previous hop."""
    head = "GPUS: 0, 1, 2, 3, 4, 5, 6\nIN: A @ 0\nOUT: A @ 3; A @ 4; A @ 5; A @ 6\n"
    # 1 -> 3, 2 -> 4 against 1 -> 4, 2 -> 3: two actions
    prog = E.parse(head + "A @ 0 -> 1, 2 -> 3, 4\nA @ 0 -> 1, 2 -> 4, 3")
    assert [a.hops for a in prog.actions] == [((1, 2), (3, 4)), ((1, 2), (4, 3))]
    E.validate(prog)
    for other in ("A @ 0 -> 2, 1 -> 4, 3",                 # 2 -> 4, 1 -> 3: the same
                  ):
        with pytest.raises(ExProgSyntaxError, match="is written twice"):
            E.parse(head + "A @ 0 -> 1, 2 -> 3, 4\n" + other)
    # 1 sends to {3, 5} and 2 to {4, 6} in each of these
    for other in ("A @ 0 -> 2, 1 -> 4, 3, 6, 5", "A @ 0 -> 1, 2 -> 5, 4, 3, 6"):
        with pytest.raises(ExProgSyntaxError, match="is written twice"):
            E.parse(head + "A @ 0 -> 1, 2 -> 3, 4, 5, 6\n" + other)
        with pytest.raises(ExProgError, match="is written twice"):
            base = E.parse(head + "A @ 0 -> 1, 2 -> 3, 4, 5, 6")
            E.validate(ExProg(base.gpus, base.partitions, base.inputs, base.outputs,
                              base.actions + E.parse(head + other).actions))
    # after a one-site hop, the last list is one site's: a set
    with pytest.raises(ExProgSyntaxError, match="is written twice"):
        E.parse(head + "A @ 0 -> 1 -> 2, 3\nA @ 0 -> 1 -> 3, 2")


def test_module_docstring_example():
    import textwrap

    text = textwrap.dedent(E.__doc__.split("::\n\n")[1].split("\n\nLayout")[0])
    prog = E.parse(text)
    assert prog.partitions == (Partition("G1", 4), Partition("G2", 4, (2, 3, 6, 7)))
    assert prog.actions[-1] == Action(fs("A"), 0, ((2,), (3,)))
    # A reaches 0..3 only, and G2 holds 2 and 3: G1 cannot get four sites holding A.
    with pytest.raises(ExProgError, match=r"OUT requirement 'A @ G1' is not met: A can be "
                                          r"materialized only at \{0, 1\} of the free sites "
                                          r"\(sites 2, 3, 6, 7 belong to declared "
                                          r"partitions\), but partition 'G1' needs 4 sites"):
        E.check(prog)


def test_fill_membership():
    prog = example("example_5_3")
    filled = E.fill_membership(prog, E.check(prog))
    assert filled.partitions == (Partition("G1", 4, (0, 1, 4, 5)),
                                 Partition("G2", 4, (2, 3, 6, 7)))
    assert "PARTITIONS: G1 {0, 1, 4, 5}; G2 {2, 3, 6, 7}\n" in E.to_text(filled)
    assert E.check(filled) == {"G1": (0, 1, 4, 5), "G2": (2, 3, 6, 7)}


def test_membership_error_says_which_sites_it_considered():
    """Sites a declared partition holds are not candidates for the others. The error says
    so, rather than listing the free sites as if they were every site where A can be."""
    prog = E.parse("GPUS: 0, 1, 2, 3\nPARTITIONS: D {0, 1}; G {size 1}\nIN: A @ 0\nOUT: A @ G")
    with pytest.raises(ExProgError, match=r"A can be materialized at no free site \(sites 0, 1 "
                                          r"belong to declared partitions\), but partition "
                                          r"'G' needs 1 site"):
        E.check(prog)
    prog = E.parse("GPUS: 0, 1, 2\nPARTITIONS: D {0}; G {size 2}\nIN: A @ 1\nOUT: A @ G")
    with pytest.raises(ExProgError, match=r"A can be materialized only at \{1\} of the free "
                                          r"sites \(site 0 belongs to declared partitions\)"):
        E.check(prog)


def test_membership_search_prunes_on_requirements_at_fixed_sites():
    """9 one-site partitions, each aggregating a pair that OUT needs at one fixed site:
    valid with P_i = {8 - i}, but the search only found a starved requirement at its leaves
    and gave up after 200,000 candidates (26 s); pruning on the fixed sites' requirements
    finds the membership at once."""
    n = 9
    text = "\n".join([
        f"GPUS: {', '.join(map(str, range(n)))}",
        "PARTITIONS: " + "; ".join(f"P{i} {{size 1}}" for i in range(n)),
        "IN: " + "; ".join(f"A{i} @ {s}; B{i} @ {s}" for i in range(n) for s in range(n)),
        "OUT: " + "; ".join(f"A{i}+B{i} @ {n - 1 - i}" for i in range(n)),
        *[f"A{i}+B{i} @ P{i}" for i in range(n)]])
    assert E.check(E.parse(text)) == {f"P{i}": (n - 1 - i,) for i in range(n)}
