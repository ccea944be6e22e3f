"""The capacity program of a plan family (issue 36): one device program that stays valid for
every per-call cut (eins/passes/rebalance.py), so that the GPU backends generate code once
and capture their graphs once, then replay them for every batch.

A re-cut changes the boxes of the rebalanced eqns, and with them the exchanges into and out
of them and the shapes of their buffers: a per-cut device program (eins/passes/relower.py)
is new code and a new graph. The capacity program instead sizes everything by capacity:

- each rebalanced eqn takes its operator's capacity form (``Primitive.capacity``): its
  blocks span the whole extent of the indices cut per call (attention: every query row,
  and so every key), the largest piece any cut can give a block, so every buffer, every
  transfer and every kernel launch is the same for every cut;
- which part of its capacity block a block computes this call comes from a small int
  table, a program input of the capacity program written per call from the call's cut
  points (:meth:`Capacity.tables`) and loaded like the runtime ends: a host step before
  the graphs replay, so the graphs read the new values. Row j of an eqn's table is
  [lo, hi) of function specification j along the cut output axis;
- a block computes only its rows (the attention kernel makes every other row see no key:
  it skips their key blocks and writes zeros), and the blocks' copies of the output are
  ⊕-summed by the consumers' exchanges (``sum``: exact, every other copy is zero there).

What capacity costs, and how the transfers avoid most of it: the blocks' buffers are
capacity-sized, the whole extent of the cut indices (attention: every query row and key).
That is the bound because the rebalance's cuts can give one device nearly every row (one
long document's equal-work pieces leave the last device all the short documents after it),
so no smaller bound holds for every batch without constraining the rebalance. The
transfers, though, are sized per call: an operator whose capacity form names its operands'
windows (``reads``) gets a table row of 2 columns per window pair, [lo, hi) of the block's
rows and of each operand's rows in the per-cut plan (attention: its query rows, then the
keys they attend to), and :func:`eins.passes.windows.windows` makes every send into a
block move only its window of rows, and every send of a block's output (zeros outside its
rows) only those rows: the bytes the per-cut program moves, through one fixed program. The
receiver's capacity buffer gets zeros elsewhere (a masked copy over the capacity, one launch
of fixed shape reading the window from the table on the device: capturable). The ⊕-sum of
the output copies then only places each row (every other copy is zero there).
Without ``reads`` every device receives the whole inputs and the output leaves as p full
copies (the form the cost model priced 1.13-1.52x slower than a per-cut program).

The planned compilation stays the family: the cuts per call come from ``recut`` exactly as
for the per-cut lowering, so both agree on every block's rows (tests/test_capacity.py).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from eins.errors import EinsError
from eins.ir.program import Program, Var, eqn_indexing
from eins.ir.types import TensorType

__all__ = ["Capacity", "capacity"]


class Capacity:
    """A planned Compilation in capacity form (``comp``: one more program input per table),
    and the tables' layout: ``layout`` [(eqn index, output axis, rows)] (axis None: no
    output is cut by the rows, pair 0 is its first reader's), in the order of the
    extra inputs, which follow the family's own inputs; ``reads`` {eqn index: {operand:
    (window pair, axis)}} (empty: rows only), ``outs`` {eqn index: {output: (axis, window
    pair)}} of the outputs past the first that are windowed (attention_fwd's lse: the rows
    on its last axis; attention_bwd's dK and dV: the keys), and ``inputs`` {eqn index: the
    table's program input}: eqns whose cuts are one function of one call (attention_fwd and
    attention_bwd of one attention: the same operands, parameters, ends and splits) share
    one table, so a buffer both read is windowed once (eins/passes/windows.py)."""

    def __init__(self, comp, tables, reads=None, outs=None, shared=None, masks=False):
        self.comp = comp
        # a re-cut eqn's kernel computes its whole capacity block (Primitive.capacity_masks)
        self.masks = masks
        self.layout = tuple(tables)
        self.reads = dict(reads or {})
        self.outs = dict(outs or {})
        # {eqn index: the eqn whose table it reads}, in layout order (itself where first)
        own = {i: (shared or {}).get(i, i) for i, _, _ in self.layout}
        self.owners = [i for i, _, _ in self.layout if own[i] == i]
        first = len(comp.program.inputs) - len(self.owners)
        at = {i: first + t for t, i in enumerate(self.owners)}
        self.inputs = {i: at[own[i]] for i in own}
        self._own = own

    def width(self, i) -> int:
        """Columns of eqn ``i``'s table: 2 per window pair (pair 0, its rows, at least)."""
        return 2 * (1 + max((p for p, _ in self.reads.get(i, {}).values()), default=0))

    def placeholders(self) -> list:
        """Tables of zeros, one per table input (a placement before any call)."""
        return [np.zeros((n, self.width(i)), np.int64) for i, _, n in self.layout
                if i in self.owners]

    def tables(self, cut) -> list:
        """The tables of one call: ``cut`` is the family re-cut for it
        (:func:`eins.passes.rebalance.recut`); row j of eqn i's table is the interval its
        function specification j covers along the cut axis of its first output (no such
        axis: that of the first operand reading pair 0), then per further window pair that
        of the first operand reading it. A row outside the axis's
        extent (a cut no capacity buffer holds), or eqns sharing a table cut apart, is an
        EinsError naming it."""
        out = {}
        for i, axis, n in self.layout:
            fspecs = cut.plan.eqn_plans[i].spec.fspecs
            pairs = {}
            for k, (pair, ax) in sorted(self.reads.get(i, {}).items()):
                pairs.setdefault(pair, (k, ax))
            t = np.empty((n, self.width(i)), np.int64)
            e = self.comp.program.eqns[i]
            # no output axis: pair 0 is the rows of its first operand reading it
            extent = e.outputs[0].shape[axis] if axis is not None else \
                e.inputs[pairs[0][0]].shape[pairs[0][1]]
            for j, f in enumerate(fspecs):
                if axis is not None:
                    box = f.outputs[0]
                    t[j, :2] = box.lo[axis], box.hi[axis]
                for pair, (k, ax) in pairs.items():
                    if pair or axis is None:
                        t[j, 2 * pair:2 * pair + 2] = f.inputs[k].lo[ax], f.inputs[k].hi[ax]
                if t[j].min() < 0 or t[j].max() > extent or (t[j, 0::2] > t[j, 1::2]).any():
                    raise EinsError(f"eqn {i}: block {j}'s cut {t[j].tolist()} is not within "
                                    f"the capacity [0, {extent}) along axis {axis}")
            own = self._own[i]
            if own in out and not np.array_equal(out[own], t):
                raise EinsError(f"eqn {i}: its cut {t.tolist()} differs from that of eqn "
                                f"{own}, whose table it shares ({out[own].tolist()})")
            out.setdefault(own, t)
        return [out[i] for i in self.owners]


def capacity(comp, operands) -> Capacity | None:
    """The capacity form of the planned Compilation ``comp`` whose eqns ``operands``
    (:func:`eins.passes.rebalance.runtime_operands`) are re-cut per call, or None where a
    re-cut eqn's operator has no capacity form for its cut indices. An eqn whose plan cuts
    no balanced index (a heads split: its boxes never move) stays as it is."""
    prog, plan = comp.program, comp.plan
    eqns, plans, inputs = list(prog.eqns), list(plan.eqn_plans), list(prog.inputs)
    tables, reads, outs, shared, first = [], {}, {}, {}, {}
    masks = False
    for i in sorted(operands):
        e, ep = eqns[i], plans[i]
        names = [n for n in ep.splits if n in eqn_indexing(e).balance]
        if not names:
            continue
        form = (e.primitive.capacity(e.params, [a.type for a in e.inputs], names)
                if e.primitive.capacity else None)
        if form is None:
            return None
        params, axis = form[:2]
        masks = masks or e.primitive.masks_capacity(e.params, [a.type for a in e.inputs])
        # a window pair alone reads along the eqn's axis; an output's axis alone, pair 0
        reads[i] = {k: (w, axis) if isinstance(w, int) else tuple(w)
                    for k, w in (form[2] if len(form) > 2 else {}).items()}
        # no output axis (an output no row cut tiles: ALiBi slopes' gradient): pair 0 comes
        # from the first operand reading it, along that operand's axis
        rows_axis = axis if axis is not None else next(
            (ax for _, (w, ax) in sorted(reads[i].items()) if w == 0), None)
        if rows_axis is None:
            raise EinsError(f"eqn {i}: {e.primitive.name}'s capacity form names no output "
                            f"axis and no operand reading the table's rows (pair 0)")
        outs[i] = {k: (w, 0) if isinstance(w, int) else tuple(w)
                   for k, w in (form[3] if len(form) > 3 else {}).items()}
        n = len(ep.spec.fspecs)
        width = 2 * (1 + max((p for p, _ in reads[i].values()), default=0))
        # one table for eqns cut alike every call (the same operator parameters, q and k,
        # runtime ends, splits and table shape)
        key = (repr(sorted(params.items())), id(e.inputs[0]), id(e.inputs[1]),
               id(e.inputs[operands[i][0]]), tuple(sorted(ep.splits.items())), rows_axis, n,
               width)
        if key in first:
            shared[i], table = first[key]
        else:
            table = Var(TensorType((n, width), np.dtype(np.int64)))
            first[key] = (i, table)
            inputs.append(table)
        e = replace(e, inputs=e.inputs + (table,), params=params)
        eqns[i] = e
        plans[i] = replace(ep, spec=eqn_indexing(e).spec(ep.intervals))
        tables.append((i, axis, n))
    if not tables:
        return None
    new_prog = Program(tuple(inputs), tuple(eqns), prog.outputs, prog.consts, prog.name)
    new_plan = replace(plan, program=new_prog, eqn_plans=tuple(plans))
    return Capacity(replace(comp, program=new_prog, plan=new_plan), tables, reads, outs,
                    shared, masks)
