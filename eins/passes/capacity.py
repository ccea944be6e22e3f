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

What capacity costs: the transfers are capacity-sized, not sized by the cut. Every device
receives the rebalanced eqn's whole inputs (attention: all of q, k and v, where a per-cut
program sends a device its query rows and the keys they attend to) and the output leaves as
p partial copies that a reduce-scatter sums (a per-cut program moves each row once). Kernel
work is the cut's, which is what the rebalance balances. Runtime byte counts (copies whose
offsets and lengths a kernel reads from the same table) would move only the cut's bytes
through the same fixed graph; they are not built.

The planned compilation stays the family: the cuts per call come from ``recut`` exactly as
for the per-cut lowering, so both agree on every block's rows (tests/test_capacity.py).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from eins.ir.program import Program, Var, eqn_indexing
from eins.ir.types import TensorType

__all__ = ["Capacity", "capacity"]


class Capacity:
    """A planned Compilation in capacity form (``comp``: one more program input per table),
    and the tables' layout: ``tables`` [(eqn index, output axis, rows)], in the order of the
    extra inputs, which follow the family's own inputs."""

    def __init__(self, comp, tables):
        self.comp = comp
        self.layout = tuple(tables)

    def tables(self, cut) -> list:
        """The tables of one call: ``cut`` is the family re-cut for it
        (:func:`eins.passes.rebalance.recut`); row j of eqn i's table is the interval its
        function specification j covers along the cut axis of its first output."""
        out = []
        for i, axis, n in self.layout:
            fspecs = cut.plan.eqn_plans[i].spec.fspecs
            t = np.empty((n, 2), np.int64)
            for j, f in enumerate(fspecs):
                box = f.outputs[0]
                t[j] = box.lo[axis], box.hi[axis]
            out.append(t)
        return out


def capacity(comp, operands) -> Capacity | None:
    """The capacity form of the planned Compilation ``comp`` whose eqns ``operands``
    (:func:`eins.passes.rebalance.runtime_operands`) are re-cut per call, or None where a
    re-cut eqn's operator has no capacity form for its cut indices. An eqn whose plan cuts
    no balanced index (a heads split: its boxes never move) stays as it is."""
    prog, plan = comp.program, comp.plan
    eqns, plans, inputs = list(prog.eqns), list(plan.eqn_plans), list(prog.inputs)
    tables = []
    for i in sorted(operands):
        e, ep = eqns[i], plans[i]
        names = [n for n in ep.splits if n in eqn_indexing(e).balance]
        if not names:
            continue
        form = (e.primitive.capacity(e.params, [a.type for a in e.inputs], names)
                if e.primitive.capacity else None)
        if form is None:
            return None
        params, axis = form
        n = len(ep.spec.fspecs)
        table = Var(TensorType((n, 2), np.dtype(np.int64)))
        inputs.append(table)
        e = replace(e, inputs=e.inputs + (table,), params=params)
        eqns[i] = e
        plans[i] = replace(ep, spec=eqn_indexing(e).spec(ep.intervals))
        tables.append((i, axis, n))
    if not tables:
        return None
    new_prog = Program(tuple(inputs), tuple(eqns), prog.outputs, prog.consts, prog.name)
    new_plan = replace(plan, program=new_prog, eqn_plans=tuple(plans))
    return Capacity(replace(comp, program=new_prog, plan=new_plan), tables)
