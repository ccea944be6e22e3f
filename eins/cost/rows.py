"""Kernel seconds of a token-wise eqn's blocks from their row counts alone (issue 36: the
block family's per-call estimate, eins/passes/rebalance.py).

A batch's whole-block cut (eins/passes/blockcut.py) moves every token-wise eqn's blocks
along its token index and nothing else, so each block's kernel is the family's with a new
number of rows. For an operator whose cost follows its blocks' shapes alone (not where
they lie: ``Primitive.position_dependent``), its FLOPs and bytes are then integer
functions of that count, affine for every token-wise kernel eins has (a matmul's rows, a
norm's, an elementwise op's). :class:`RowKernels` counts them at a few row counts once, at
compile time, and keeps a block's line only where every count lies on it exactly
(integers: a function agreeing with a line at the probes, 1 to the whole extent, past a
degree the operators' shape products do not reach, is that line); a call then gets each
block's (FLOPs, bytes) from its rows by two multiplications, and its seconds by the same
arithmetic as :func:`eins.cost.predict.eqn_kernel_seconds`, to the last bit. A block
whose counts are not affine in its rows is priced in full every call.
"""
from __future__ import annotations

from eins.cost.predict import (compute_dtype, kernel_counts, kernel_entry, model_seconds,
                               out_itemsizes, scaled_work, _operands)
from eins.ir.joinagg import FunctionSpec
from eins.ir.types import Box

__all__ = ["RowKernels", "row_line"]


class RowKernels:
    """The kernel seconds of eqn ``eqn``'s function specifications under ``spec`` (a
    family's) and any re-cut of ``spec`` along one index, whose blocks' axes are ``axes``
    [(True for an output, operand position, axis)], ``extent`` long, on ``topology``."""

    PROBES = (1, 2, 3, 5, 8, 13)

    def __init__(self, eqn, spec, topology, axes, extent):
        self.eqn, self.topology, self.axes = eqn, topology, tuple(axes)
        self.itemsizes = out_itemsizes(eqn, spec)
        self.entry = kernel_entry(eqn, topology)
        self.rate = topology.flops_of(compute_dtype(eqn))
        self.lines = None
        if eqn.primitive.position_dependent or not self.axes:
            return
        operands = _operands(eqn)
        lines = []
        for f in spec.fspecs:
            # every cut axis of the block as long as the first (the rows), and the line
            # through the probes passing through the block's own counts too
            held = {(f.outputs if io else f.inputs)[pos].shape[axis]
                    for io, pos, axis in self.axes}
            if len(held) != 1:
                return
            rows = (*self.PROBES, extent, held.pop())
            line = row_line([kernel_counts(eqn, operands, _with_rows(f, self.axes, r),
                                        self.itemsizes) for r in rows[:-1]]
                         + [kernel_counts(eqn, operands, f, self.itemsizes)], rows)
            if line is None:
                return
            lines.append(line)
        self.lines = lines

    def seconds(self, spec) -> list | None:
        """Seconds of each of ``spec``'s kernels (a re-cut of the family's spec), or None
        where the lines do not serve it (a block not affine in its rows, another
        output element size)."""
        lines = self.lines
        if lines is None or len(spec.fspecs) != len(lines) or \
                out_itemsizes(self.eqn, spec) != self.itemsizes:
            return None
        io, pos, axis = self.axes[0]
        eqn, topo, rate, entry = self.eqn, self.topology, self.rate, self.entry
        out = []
        for f, (f1, df, b1, db) in zip(spec.fspecs, lines):
            box = (f.outputs if io else f.inputs)[pos]
            r = box.hi[axis] - box.lo[axis]
            w, b = scaled_work(f1 + (r - 1) * df, b1 + (r - 1) * db, eqn, topo, rate)
            out.append(model_seconds(w, b, topo.flops, topo.hbm_bw, entry))
        return out


def _with_rows(fspec, axes, rows) -> FunctionSpec:
    """``fspec`` with every block axis of ``axes`` ``rows`` long (from its low bound)."""
    ins, outs = list(fspec.inputs), list(fspec.outputs)
    for io, pos, axis in axes:
        boxes = outs if io else ins
        b = boxes[pos]
        boxes[pos] = Box(b.lo, b.hi[:axis] + (b.lo[axis] + rows,) + b.hi[axis + 1:])
    return FunctionSpec(tuple(ins), tuple(outs))


def row_line(counts, rows) -> tuple | None:
    """(FLOPs at one row, per row, bytes at one row, per row) where every count of
    ``counts`` (at ``rows``, the first two 1 and 2) is an int on that line, else None."""
    (f1, b1), (f2, b2) = counts[:2]
    df, db = f2 - f1, b2 - b1
    for (f, b), r in zip(counts, rows):
        if type(f) is not int or type(b) is not int or \
                f != f1 + (r - 1) * df or b != b1 + (r - 1) * db:
            return None
    return f1, df, b1, db
