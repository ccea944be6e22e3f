"""The communication-cost proxy Cost(J, T1..Tn) of Section 4.3, in bytes.

Three sub-costs, reported separately (:class:`eins.ir.plan.CostBreakdown`):

1. repartition: for input k, |I(T_k)| x itemsize when in_k(J) differs from the tiling the
   producer left the tensor in. Zero for program inputs and constants (materialized straight
   into the blocks J needs) and for Literals (scalars folded into the kernel).
2. join: the bytes of every function specification's input blocks (Literals excluded).
   With ``inputs_resident`` (an option, not the paper's proxy) the blocks of program inputs
   and constants are not charged: they are resident where each spec needs them, as a
   model's weights are across the steps of serving or training.
3. aggregation: for each distinct output block appearing m times, (m - 1) x its bytes, as
   partials (``lse``'s (o, lse) pairs are 8 or 16 bytes per element).
"""
from __future__ import annotations

from eins.ir.joinagg import JoinAggSpec, box_counts, partial_itemsize
from eins.ir.plan import CostBreakdown
from eins.ir.program import Eqn, Literal, Program

__all__ = ["cost", "local_cost", "join_by_input", "repartition_bytes", "plan_costs",
           "resident_inputs"]


def join_by_input(spec: JoinAggSpec, eqn: Eqn) -> tuple[int, ...]:
    """The join sub-cost split by input: bytes of input k's blocks over every function
    specification (0 for Literals)."""
    out = []
    for k, a in enumerate(eqn.inputs):
        if isinstance(a, Literal):
            out.append(0)
        else:   # each distinct box's size once, times its count (integers: any order)
            counts = box_counts([f.inputs[k] for f in spec.fspecs])
            out.append(sum(b.size * n for b, n in counts.items()) * a.dtype.itemsize)
    return tuple(out)


def resident_inputs(program: Program, eqn: Eqn) -> frozenset:
    """Positions of ``eqn``'s inputs that are program inputs or constants."""
    producers = program.producers()
    return frozenset(k for k, a in enumerate(eqn.inputs)
                     if not isinstance(a, Literal) and id(a) not in producers)


def local_cost(spec: JoinAggSpec, eqn: Eqn, free_inputs=frozenset(),
               join_in: tuple | None = None) -> CostBreakdown:
    """Join and aggregation sub-costs of ``spec`` for ``eqn`` (they do not depend on the
    producers' tilings); the join bytes of inputs in ``free_inputs`` are not charged.
    ``join_in``: :func:`join_by_input` where the caller has it already."""
    if join_in is None:
        join_in = join_by_input(spec, eqn)
    join = sum(b for k, b in enumerate(join_in) if k not in free_inputs)
    agg = 0
    for j, v in enumerate(eqn.outputs):
        isz = partial_itemsize(spec.aggs[j], v.dtype)   # partials of lse are (o, lse) pairs
        for box, m in spec.multiplicity(j).items():
            agg += (m - 1) * box.size * isz
    return CostBreakdown(0, join, agg)


def repartition_bytes(need, have, atom) -> int:
    """Sub-cost (1) for one input: ``need`` = in_k(J) and ``have`` = the producer's tiling,
    both as sets of boxes; ``have`` None means a program input or constant (free)."""
    if have is None or need is None or need == have:
        return 0
    return atom.type.nbytes


def cost(spec: JoinAggSpec, eqn: Eqn, producer_tilings, free_inputs=frozenset()) \
        -> CostBreakdown:
    """Cost(J, T1..Tn): ``producer_tilings[k]`` is the set of boxes input k was produced in,
    or None for program inputs, constants and Literals."""
    local = local_cost(spec, eqn, free_inputs)
    rep = 0
    for k, (a, have) in enumerate(zip(eqn.inputs, producer_tilings)):
        if isinstance(a, Literal) or have is None:
            continue
        rep += repartition_bytes(frozenset(spec.in_blocks(k)), frozenset(have), a)
    return CostBreakdown(rep, local.join, local.aggregation)


def plan_costs(program: Program, specs, inputs_resident: bool = False) -> list[CostBreakdown]:
    """The full proxy of every eqn for a fixed choice ``specs[i]`` of each eqn's spec."""
    producers = program.producers()
    out = []
    for e, spec in zip(program.eqns, specs):
        free = resident_inputs(program, e) if inputs_resident else frozenset()
        tilings = []
        for a in e.inputs:
            where = None if isinstance(a, Literal) else producers.get(id(a))
            if where is None:
                tilings.append(None)
            else:
                i, j = where
                tilings.append(specs[i].out_tiling(j))
        out.append(cost(spec, e, tilings, free))
    return out
