"""The device IR (DESIGN.md): per device, an ordered list of instructions. Every backend
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
- ``Send(src, peer, tag)`` / ``Recv(dst, peer, tag)``: a transfer; sends never block.
- ``Kernel(outs, ins, eqn, fspec)``: the concrete operator f[F] of eqn ``eqn`` on blocks.
- ``Store(src, output, box)``: a finished block of program output ``output`` to the host.
- ``Free(buf)``: the buffer's last use has passed.

The instruction lists come from one global topological order, so a device that runs its list
in order, with non-blocking sends, cannot deadlock (the earliest unfinished instruction of
the global order is always at the head of its device's list and ready).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eins.ir.types import Box


@dataclass(frozen=True, slots=True)
class BufInfo:
    var: str          # the traced variable's printed name
    box: Box
    dtype: np.dtype
    partial: bool = False


@dataclass(frozen=True, slots=True)
class Load:
    dst: str
    source: tuple  # ("in", k) or ("const", k)
    box: Box


@dataclass(frozen=True, slots=True)
class Slice:
    dst: str
    src: str
    box: Box


@dataclass(frozen=True, slots=True)
class Concat:
    dst: str
    srcs: tuple
    box: Box


@dataclass(frozen=True, slots=True)
class Agg:
    dst: str
    srcs: tuple
    op: str


@dataclass(frozen=True, slots=True)
class Send:
    src: str
    peer: int
    tag: int


@dataclass(frozen=True, slots=True)
class Recv:
    dst: str
    peer: int
    tag: int


@dataclass(frozen=True, slots=True)
class Kernel:
    outs: tuple
    ins: tuple       # buffer names, or ("lit", value, dtype) for literals
    eqn: int
    fspec: object


@dataclass(frozen=True, slots=True)
class Store:
    src: str
    output: int
    box: Box


@dataclass(frozen=True, slots=True)
class Free:
    buf: str


@dataclass
class DeviceProgram:
    """The device IR of one program: ``code[d]`` is device d's instruction list;
    ``bufs[d][name]`` describes each buffer."""

    devices: tuple
    code: dict = field(default_factory=dict)
    bufs: dict = field(default_factory=dict)
    program: object = None
    out_boxes: tuple = ()     # per program output: the boxes stored (they tile it)

    def emit(self, d, instr, info: BufInfo | None = None, name: str | None = None):
        self.code.setdefault(d, []).append(instr)
        if info is not None:
            self.bufs.setdefault(d, {})[name] = info

    def num_instructions(self) -> int:
        return sum(len(c) for c in self.code.values())

    def as_text(self) -> str:
        lines = []
        for d in self.devices:
            lines.append(f"device {d}:")
            for ins in self.code.get(d, []):
                lines.append("  " + format_instr(ins, self.bufs.get(d, {})))
        return "\n".join(lines)


def _b(name, bufs):
    info = bufs.get(name)
    if info is None:
        return name
    return f"{name}{'~' if info.partial else ''}"


def format_instr(ins, bufs) -> str:
    if isinstance(ins, Load):
        return f"{ins.dst} = load {ins.source[0]}{ins.source[1]}{ins.box!r}"
    if isinstance(ins, Slice):
        return f"{ins.dst} = slice {ins.src}{ins.box!r}"
    if isinstance(ins, Concat):
        return f"{ins.dst} = concat{ins.box!r} " + " ".join(ins.srcs)
    if isinstance(ins, Agg):
        return f"{ins.dst} = agg[{ins.op}] " + " ".join(ins.srcs)
    if isinstance(ins, Send):
        return f"send {ins.src} -> dev{ins.peer} #{ins.tag}"
    if isinstance(ins, Recv):
        return f"{ins.dst} = recv dev{ins.peer} #{ins.tag}"
    if isinstance(ins, Kernel):
        args = " ".join(a if isinstance(a, str) else repr(a[1]) for a in ins.ins)
        outs = " ".join(_b(o, bufs) for o in ins.outs)
        return f"{outs} = kernel eqn{ins.eqn} {args}    # {ins.fspec!r}"
    if isinstance(ins, Store):
        return f"store {ins.src} -> out{ins.output}{ins.box!r}"
    if isinstance(ins, Free):
        return f"free {ins.buf}"
    return repr(ins)
