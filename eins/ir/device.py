"""The device IR (docs/architecture.md): per device, an ordered list of instructions. Every backend
executes this one IR. Buffers are named per device; each holds one block (a ``Box`` of one
traced variable), possibly a partial copy that ⊕ has still to combine.

Instructions:
- ``Load(dst, source, box)``: a block of a program input or constant (``source`` = its
  position in ``Program.inputs`` as ``("in", k)`` or ``("const", k)``) from the host.
- ``Slice(dst, src, box)``: decompose: cut the block ``box`` out of buffer ``src``.
- ``Concat(dst, srcs, box)``: recompose: stitch buffers that tile ``box``.
- ``Agg(dst, srcs, op)``: ⊕ of equally shaped buffers (``op`` a key of ``AGG_FUNCS``). For
  ``lse`` the sources are (o, lse) pairs (their BufInfo dtype is
  ``joinagg.lse_pair_dtype``); a destination with the variable's own dtype is the full
  aggregate, finalized to it (``joinagg.finalize``). A Kernel whose outputs are such pairs
  runs the operator's partial kernel (``Primitive.run_block(..., partial=True)``).
- ``Send(src, peer, tag, window)`` / ``Recv(dst, peer, tag)``: a transfer; sends never
  block. A ``window`` (:class:`Window`, the capacity program's: eins/passes/windows.py)
  moves only the rows of ``src`` inside intervals read per call from an int table on the
  sending device: the receiver gets zeros elsewhere (rows no reader of the buffer needs,
  or rows the source holds as zeros), so a backend that ignores the window (a full copy)
  computes the same result, moving more bytes.
- ``Kernel(outs, ins, eqn, fspec, acc)``: the concrete operator f[F] of eqn ``eqn`` on blocks.
  With ``acc`` (a pipelined piece, eins/passes/pipeline.py): the buffer of the running
  (o, lse) pairs of the same output block, which this block's partial joins by the spec's
  ⊕ (``lse``); the result is pairs again, or finalized when the output buffer has the
  variable's own dtype (the last piece).
- ``Store(src, output, box)``: a finished block of program output ``output`` to the host.
- ``Free(buf)``: the buffer's last use has passed.

Each instruction class names its ``kind``, the buffers it reads, writes and ends and its text; a
backend (the numpy executor, the verifier, codegen) is an :class:`InstrVisitor` with one
``visit_<kind>`` method per instruction.

The instruction lists come from one global topological order, so a device that runs its list
in order, with non-blocking sends, cannot deadlock (the earliest unfinished instruction of
the global order is always at the head of its device's list and ready).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from eins.ir.slots import fast_init
from eins.ir.types import Box


@fast_init
@dataclass(frozen=True, slots=True)
class BufInfo:
    var: str          # the traced variable's printed name
    box: Box
    dtype: np.dtype
    partial: bool = False


class Instr:
    """Base of the instructions. Each names its ``kind`` (the method a backend's
    :class:`InstrVisitor` defines for it, ``visit_<kind>``), the buffers it reads
    (:meth:`uses`) and writes (:meth:`defs`), and its one-line text (:meth:`text`)."""

    __slots__ = ()
    kind: ClassVar[str] = ""

    def uses(self) -> tuple:
        return ()

    def defs(self) -> tuple:
        return ()

    def ends(self) -> tuple:
        """The buffers whose life this instruction ends (a Free's)."""
        return ()

    def text(self, bufs=None, comment=None) -> str:
        raise NotImplementedError


@fast_init
@dataclass(frozen=True, slots=True)
class Load(Instr):
    dst: str
    source: tuple  # ("in", k) or ("const", k)
    box: Box
    kind: ClassVar[str] = "load"

    def defs(self):
        return (self.dst,)

    def text(self, bufs=None, comment=None):
        return f"{self.dst} = load {self.source[0]}{self.source[1]}{self.box!r}"


@fast_init
@dataclass(frozen=True, slots=True)
class Slice(Instr):
    dst: str
    src: str
    box: Box
    kind: ClassVar[str] = "slice"

    def uses(self):
        return (self.src,)

    def defs(self):
        return (self.dst,)

    def text(self, bufs=None, comment=None):
        return f"{self.dst} = slice {self.src}{self.box!r}"


@fast_init
@dataclass(frozen=True, slots=True)
class Concat(Instr):
    dst: str
    srcs: tuple
    box: Box
    # a placement (the capacity program's inputs, eins/passes/windows.py): per source a
    # Window (only its rows are copied in; its readers need no others) or None (all of it);
    # the rest of dst is unspecified
    windows: tuple = None
    kind: ClassVar[str] = "concat"

    def uses(self):
        tables = tuple({w.table for w in self.windows or () if w is not None})
        return tuple(self.srcs) + tables

    def defs(self):
        return (self.dst,)

    def text(self, bufs=None, comment=None):
        how = "" if self.windows is None else " placed"
        return f"{self.dst} = concat{self.box!r}{how} " + " ".join(self.srcs)


@fast_init
@dataclass(frozen=True, slots=True)
class Agg(Instr):
    dst: str
    srcs: tuple
    op: str
    # a placement (the capacity program's output copies, eins/passes/windows.py): a Window
    # per source, tiling the block every call; each source is zero outside its own, so the
    # ⊕-sum is each source's window of rows put in place
    windows: tuple = None
    kind: ClassVar[str] = "agg"

    def uses(self):
        if self.windows is None:
            return tuple(self.srcs)
        return tuple(self.srcs) + (self.windows[0].table,)

    def defs(self):
        return (self.dst,)

    def text(self, bufs=None, comment=None):
        how = self.op if self.windows is None else f"{self.op}: placed by {self.windows[0].table}"
        return f"{self.dst} = agg[{how}] " + " ".join(self.srcs)


@dataclass(frozen=True, slots=True)
class Window:
    """A runtime set of rows along axis ``axis`` (negative: from the last) of the global
    tensor: the interval [max of the table entries ``los``, min of those ``his``), each
    entry a (row, column) of the int table held in buffer ``table`` on the device that
    reads the window, united with one more such interval per (los, his) pair of ``more``
    (a relayed buffer: the rows its receiver and the devices it forwards to need). Any
    interval may be empty, and they may overlap; intersected with a buffer's box, they say
    which rows a windowed Send moves (:meth:`spans`)."""

    axis: int
    table: str
    los: tuple
    his: tuple
    more: tuple = ()

    def parts(self) -> tuple:
        """Every interval's (los, his), the first one's first."""
        return ((self.los, self.his),) + tuple(self.more)

    def intervals(self, table) -> list:
        """The rows for one call's table values (a 2-D int array): sorted, disjoint,
        non-empty [lo, hi) intervals, overlapping or touching ones merged."""
        out = []
        for los, his in sorted((max(int(table[r][c]) for r, c in ls),
                                min(int(table[r][c]) for r, c in hs)) for ls, hs in self.parts()):
            if los >= his:
                continue
            if out and los <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], his))
            else:
                out.append((los, his))
        return out

    def spans(self, box, table) -> list:
        """The window's rows within ``box``, relative to its start: sorted, disjoint,
        non-empty [a, b) intervals."""
        base, top = box.lo[self.axis], box.hi[self.axis]
        out = []
        for lo, hi in self.intervals(table):
            a, b = max(lo, base) - base, min(hi, top) - base
            if a < b:
                out.append((a, b))
        return out

    def text(self) -> str:
        def ref(cells):
            return ",".join(f"{self.table}[{r},{c}]" for r, c in cells)
        return f"axis {self.axis} in " + " | ".join(
            f"[max({ref(los)}), min({ref(his)}))" for los, his in self.parts())


@fast_init
@dataclass(frozen=True, slots=True)
class Send(Instr):
    src: str
    peer: int
    tag: int
    window: object = None    # a Window: only its rows move (module docstring)
    kind: ClassVar[str] = "send"

    def uses(self):
        return (self.src,) if self.window is None else (self.src, self.window.table)

    def text(self, bufs=None, comment=None):
        w = "" if self.window is None else f"  window {self.window.text()}"
        return f"send {self.src} -> dev{self.peer} #{self.tag}{w}"


@fast_init
@dataclass(frozen=True, slots=True)
class Recv(Instr):
    dst: str
    peer: int
    tag: int
    kind: ClassVar[str] = "recv"

    def defs(self):
        return (self.dst,)

    def text(self, bufs=None, comment=None):
        return f"{self.dst} = recv dev{self.peer} #{self.tag}"


@fast_init
@dataclass(frozen=True, slots=True)
class Kernel(Instr):
    outs: tuple
    ins: tuple       # buffer names, or ("lit", value, dtype) for literals
    eqn: int
    fspec: object
    acc: str | None = None   # a pipelined piece's running pairs (module docstring)
    kind: ClassVar[str] = "kernel"

    def uses(self):
        got = tuple([a for a in self.ins if isinstance(a, str)])   # a list: no generator
        return got if self.acc is None else got + (self.acc,)

    def defs(self):
        return tuple(self.outs)

    def text(self, bufs=None, comment=None):
        """``comment`` replaces the function specification after ``#`` (codegen puts the
        eqn's text there)."""
        args = " ".join(a if isinstance(a, str) else repr(a[1]) for a in self.ins)
        outs = " ".join(_b(o, bufs or {}) for o in self.outs)
        note = repr(self.fspec) if comment is None else comment
        acc = "" if self.acc is None else f" acc {self.acc}"
        return f"{outs} = kernel eqn{self.eqn} {args}{acc}    # {note}"


@fast_init
@dataclass(frozen=True, slots=True)
class Store(Instr):
    src: str
    output: int
    box: Box
    kind: ClassVar[str] = "store"

    def uses(self):
        return (self.src,)

    def text(self, bufs=None, comment=None):
        return f"store {self.src} -> out{self.output}{self.box!r}"


@fast_init
@dataclass(frozen=True, slots=True)
class Free(Instr):
    buf: str
    kind: ClassVar[str] = "free"

    def ends(self):
        return (self.buf,)

    def text(self, bufs=None, comment=None):
        return f"free {self.buf}"


INSTRUCTIONS = (Load, Slice, Concat, Agg, Send, Recv, Kernel, Store, Free)


class InstrVisitor:
    """One dispatch for the device IR: a backend subclasses this with one ``visit_<kind>``
    method per instruction class in :data:`INSTRUCTIONS` (checked when the subclass is
    defined, so a new instruction without its method fails at import, naming both), and
    calls :meth:`visit`, which returns what the method returns. Adding an instruction is its
    class here plus one method per backend."""

    abstract_visitor = False  # a partial base a concrete backend subclasses

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.__dict__.get("abstract_visitor", False):
            return
        missing = [c.kind for c in INSTRUCTIONS if not callable(getattr(cls, "visit_" + c.kind,
                                                                        None))]
        if missing:
            raise TypeError(f"{cls.__name__} has no method for instruction"
                            f"{'s' if len(missing) > 1 else ''} "
                            + ", ".join(f"visit_{k}" for k in missing))

    def visit(self, ins, *args):
        return getattr(self, "visit_" + ins.kind)(ins, *args)


@dataclass
class DeviceProgram:
    """The device IR of one program: ``code[d]`` is device d's instruction list;
    ``bufs[d][name]`` describes each buffer."""

    devices: tuple
    code: dict = field(default_factory=dict)
    bufs: dict = field(default_factory=dict)
    program: object = None
    # set by the lower pass: the device lowered alone (None: every device), the number of
    # transfer tags (0 .. tags - 1), and per device its stored (output, box) and loaded
    # (source, box) blocks in program order, which a rank lowered alone knows of its peers
    rank: object = None
    tags: object = None
    stores: object = None
    loads: object = None
    # the exchange IR it was lowered from (the plan a rank's digest is taken of)
    exchange: object = field(default=None, compare=False, repr=False)

    def store_layout(self) -> dict:
        """device -> [(output, box)] in the order that device stores them."""
        if self.stores is not None:
            return {d: list(self.stores.get(d, ())) for d in self.devices}
        return {d: [(i.output, i.box) for i in self.code.get(d, []) if i.kind == "store"]
                for d in self.devices}

    def load_layout(self) -> dict:
        """device -> [(source, box)] of the blocks of program inputs and constants it loads."""
        if self.loads is not None:
            return {d: list(self.loads.get(d, ())) for d in self.devices}
        return {d: [(i.source, i.box) for i in self.code.get(d, []) if i.kind == "load"]
                for d in self.devices}

    def tag_count(self) -> int:
        """One more than the largest transfer tag (the gather's tags start there)."""
        if self.tags is not None:
            return self.tags
        return 1 + max((i.tag for c in self.code.values() for i in c if i.kind == "send"),
                       default=-1)

    def num_instructions(self) -> int:
        return sum(len(c) for c in self.code.values())

    def as_text(self) -> str:
        lines = []
        for d in self.devices:
            lines.append(f"device {d}:")
            for ins in self.code.get(d, []):
                lines.append("  " + format_instr(ins, self.bufs.get(d, {})))
        return "\n".join(lines)


def def_use(instrs) -> tuple[dict, dict]:
    """(producer, readers) of one device's instruction list: {buffer: index of the
    instruction writing it} and {buffer: indices of the instructions reading it, in order,
    once per operand that names it}."""
    producer, readers = {}, {}
    for j, ins in enumerate(instrs):
        for b in ins.uses():
            readers.setdefault(b, []).append(j)
        for b in ins.defs():
            producer[b] = j
    return producer, readers


def placed_receives(dprog) -> dict:
    """{(sender, receiver, tag): the placement's destination buffer} for each send into a
    placement (an Agg or a Concat with windows): a backend may write it straight into the
    destination (a Concat's: at its box), only its window, with no zeros elsewhere."""
    out = {}
    for d, code in dprog.code.items():
        recv = {i.dst: (i.peer, d, i.tag) for i in code if i.kind == "recv"}
        for ins in code:
            if ins.kind in ("agg", "concat") and ins.windows is not None:
                for s in ins.srcs:
                    if s in recv:
                        out[recv[s]] = ins.dst
    return out


def _b(name, bufs):
    info = bufs.get(name)
    if info is None:
        return name
    return f"{name}{'~' if info.partial else ''}"


def format_instr(ins, bufs, comment=None) -> str:
    """The instruction's one-line text (:meth:`Instr.text`)."""
    return ins.text(bufs, comment)
