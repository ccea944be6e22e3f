"""The device IR's one dispatch: every instruction names its kind, reads and writes, and every
backend is an InstrVisitor with one method per instruction (checked at class definition)."""
import dataclasses
import inspect

import numpy as np
import pytest

from eins.ir.device import (INSTRUCTIONS, Agg, BufInfo, Concat, Free, InstrVisitor, Kernel,
                            Load, Recv, Send, Slice, Store, format_instr)
from eins.ir.exchange import Copy
from eins.ir.exprog.syntax import Action, AtomDecl, ExProg, Partition, Requirement
from eins.ir.joinagg import FunctionSpec
from eins.ir.slots import fast_init
from eins.ir.types import Box

B = Box((0,), (4,))


def test_every_instruction_has_its_own_kind_and_every_backend_its_methods():
    import eins.passes.verify  # noqa: F401  (the backends: defining them ran the check)
    import eins.runtime.numpy_backend  # noqa: F401

    kinds = [c.kind for c in INSTRUCTIONS]
    assert len(set(kinds)) == len(kinds) and all(kinds)
    backends = {c.__module__ for c in InstrVisitor.__subclasses__()}
    assert {"eins.passes.verify", "eins.runtime.numpy_backend"} <= backends


def test_reads_and_writes():
    cases = [
        (Load("a", ("in", 0), B), (), ("a",)),
        (Slice("b", "a", B), ("a",), ("b",)),
        (Concat("c", ("a", "b"), B), ("a", "b"), ("c",)),
        (Agg("d", ("a", "b"), "sum"), ("a", "b"), ("d",)),
        (Send("a", 1, 7), ("a",), ()),
        (Recv("e", 1, 7), (), ("e",)),
        (Kernel(("k",), ("a", ("lit", 2.0, np.float32)), 0, None), ("a",), ("k",)),
        (Store("k", 0, B), ("k",), ()),
        (Free("a"), (), ()),
    ]
    assert {type(i) for i, _, _ in cases} == set(INSTRUCTIONS)
    for ins, reads, writes in cases:
        assert (ins.uses(), ins.defs()) == (reads, writes), ins


def test_a_backend_missing_an_instruction_fails_when_defined():
    methods = {f"visit_{c.kind}": (lambda self, ins: c.kind) for c in INSTRUCTIONS}
    del methods["visit_recv"]
    with pytest.raises(TypeError, match="Partial has no method for instruction visit_recv"):
        type("Partial", (InstrVisitor,), methods)
    methods["visit_recv"] = lambda self, ins: "got recv"
    full = type("Full", (InstrVisitor,), methods)()
    assert full.visit(Recv("e", 1, 7)) == "got recv"


def test_text_and_codegen_comment():
    k = Kernel(("k",), ("a",), 3, "F")
    assert format_instr(k, {}) == "k = kernel eqn3 a    # 'F'"
    assert format_instr(k, {}, comment="c = matmul a b") == "k = kernel eqn3 a    # c = matmul a b"
    assert format_instr(Send("a", 1, 7), {}) == "send a -> dev1 #7"


@pytest.mark.parametrize("cls,args,first", [
    (Send, ("a", 1, 7), "z"), (Send, ("a", 1, 7, "w"), "z"), (Recv, ("e", 2, 9), "z"),
    (Slice, ("b", "a", B), "z"), (Free, ("a",), "z"), (BufInfo, ("x", B, np.dtype("f4")), "z"),
    (BufInfo, ("x", B, np.dtype("f4"), True), "z"), (Load, ("a", ("in", 0), B), "z"),
    (Kernel, ("o", ("a", ("lit", 1.0, "f4")), 3, "fs"), "z"),
    (Kernel, (("o",), ("a",), 3, "fs", "p"), "z"), (Concat, ("c", ("a", "b"), B), "z"),
    (Agg, ("c", ("a", "b"), "sum"), "z"), (Store, ("a", 0, B), "z"),
    (Box, ((0, 1), (2, 3)), (1, 2)), (FunctionSpec, ((B,), (B,)), ()),
    (Copy, (B, 3, 1, False), Box((1,), (2,))), (AtomDecl, ("A0", 1), "A1"),
    (AtomDecl, ("A0", 1, 64), "A1"), (Partition, ("S0", 1), "S1"),
    (Partition, ("S0", 1, (3,)), "S1"), (Requirement, (frozenset({"A0"}), ("S0",)), frozenset()),
    (Action, (frozenset({"A0"}), 0, ((1,),)), frozenset()),
    (ExProg, ((0, 1), (), (), ()), (2,))])
def test_the_fast_constructors_build_what_the_dataclass_would(cls, args, first):
    """The instructions, BufInfo, Box, FunctionSpec, Copy and the ExProg syntax write their
    slots directly (eins.ir.slots.fast_init: a big program's bulk, a re-cut's boxes and
    exchanges): the same fields and defaults, positional or by keyword
    (dataclasses.replace), ``__post_init__`` run, still frozen, equal and hashing as one
    built field by field."""
    names = [f.name for f in dataclasses.fields(cls)]
    assert {f"_set_{n}" for n in names} <= set(cls.__init__.__code__.co_names)   # fast_init's
    params = inspect.signature(cls).parameters
    assert list(params) == names
    assert [p.default for p in params.values()] == [
        inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        for f in dataclasses.fields(cls)]
    made = cls(*args)
    slow = cls.__new__(cls)
    values = dict(zip(names, args))
    for f in dataclasses.fields(cls):
        object.__setattr__(slow, f.name, values.get(f.name, f.default))
    assert made == slow and hash(made) == hash(slow) and repr(made) == repr(slow)
    assert cls(**values) == made
    assert dataclasses.replace(made, **{names[0]: first}) == cls(first, *args[1:])
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, names[0], first)


def test_fast_init_runs_post_init_and_refuses_what_it_cannot_build():
    """Box's check still runs (its __post_init__); a class that is not frozen and slotted,
    or has a default factory, is refused naming it."""
    with pytest.raises(ValueError, match="malformed box"):
        Box((2,), (1,))

    @dataclasses.dataclass(frozen=True)
    class Loose:
        a: int

    with pytest.raises(TypeError, match="frozen dataclass with slots, got Loose"):
        fast_init(Loose)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Listy:
        a: list = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match=r"Listy\.a has a default factory"):
        fast_init(Listy)
