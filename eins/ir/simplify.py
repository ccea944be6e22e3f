"""Common-subexpression and dead-code elimination on the traced IR, as XLA and every compiler
do: the program the tracer hands the planner computes each distinct value once, and only
what its outputs depend on.

- **CSE**: two eqns of the same primitive, reading the same variables and literals, with
  equal parameters (and so equal output types), compute the same values: every primitive is
  a pure function of its inputs and parameters. The later one is dropped and its readers
  read the first one's outputs (``x - mu`` written twice is planned and run once).
- **DCE**: an eqn none of whose outputs the program's outputs depend on is dropped, and so
  is a constant nothing reads (``unused = x @ w`` left in the function).

"Equal" is exact: literals and float parameters are compared by their bits (``float.hex``),
so ``x * 0.0`` and ``x * -0.0`` (different signs of zero) stay two eqns, while ``x * nan``
twice is one; a parameter that cannot be compared exactly (an array, an unhashable object)
keeps its eqn distinct.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from eins.ir.program import Var

__all__ = ["simplify", "eliminate_common", "eliminate_dead"]


class _Distinct:
    """A key part equal only to itself: what cannot be compared exactly is never merged."""

    __slots__ = ()


def _value_key(v):
    """An exactly comparing, hashable key of a literal's value or a parameter."""
    if isinstance(v, (bool, np.bool_)):
        return ("bool", bool(v))
    if isinstance(v, (float, np.floating)):
        return ("float", type(v).__name__, float(v).hex())
    if isinstance(v, (complex, np.complexfloating)):
        return ("complex", type(v).__name__, complex(v).real.hex(), complex(v).imag.hex())
    if isinstance(v, (int, np.integer)):
        return ("int", type(v).__name__, int(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__,) + tuple(_value_key(x) for x in v)
    if isinstance(v, dict):
        return ("dict",) + tuple(sorted((repr(k), _value_key(x)) for k, x in v.items()))
    if v is None or isinstance(v, (str, np.dtype)) or (
            isinstance(v, type) and issubclass(v, np.generic)):
        return (type(v).__name__, v)
    try:
        hash(v)
    except TypeError:
        return _Distinct()
    if isinstance(v, np.ndarray):   # hashable only when read-only; still not compared
        return _Distinct()
    return (type(v).__qualname__, v)


def _eqn_key(e, inputs) -> tuple:
    args = tuple(("var", id(a)) if isinstance(a, Var)
                 else ("lit", _value_key(a.value), np.dtype(a.dtype).str) for a in inputs)
    params = tuple(sorted((k, _value_key(v)) for k, v in e.params.items()))
    # the phase too: a checkpointed region's recomputation in the backward pass
    # (eins.checkpoint) must not merge into the forward eqns it recomputes
    return (e.prim, id(e.primitive), args, params, tuple(v.type for v in e.outputs), e.phase)


def eliminate_common(eqns, outputs) -> tuple[tuple, tuple]:
    """(eqns, outputs) with every eqn equal to an earlier one (same primitive, inputs after
    substitution, parameters) removed and its outputs replaced by the earlier one's."""
    subst: dict = {}   # id(dropped output) -> the kept eqn's output
    seen: dict = {}
    kept = []
    for e in eqns:
        inputs = tuple(subst.get(id(a), a) if isinstance(a, Var) else a for a in e.inputs)
        key = _eqn_key(e, inputs)
        hit = seen.get(key) if not _distinct(key) else None
        if hit is not None:
            for v, w in zip(e.outputs, hit.outputs):
                subst[id(v)] = w
            continue
        if any(a is not b for a, b in zip(inputs, e.inputs)):
            e = replace(e, inputs=inputs)
        seen[key] = e
        kept.append(e)
    outs = tuple(subst.get(id(v), v) for v in outputs)
    return tuple(kept), outs


def _distinct(key) -> bool:
    """Whether a key holds a part that compares only to itself (never merged)."""
    if isinstance(key, _Distinct):
        return True
    return isinstance(key, tuple) and any(_distinct(k) for k in key)


def eliminate_dead(eqns, consts, outputs) -> tuple[tuple, tuple]:
    """The eqns (and constants) the outputs depend on: a traced program is pure, so an eqn
    whose results are never used would only be planned, charged and run for nothing."""
    live = {id(v) for v in outputs}
    kept = []
    for e in reversed(eqns):
        if any(id(v) in live for v in e.outputs):
            kept.append(e)
            live.update(id(a) for a in e.inputs if isinstance(a, Var))
    return tuple(reversed(kept)), tuple((v, c) for v, c in consts if id(v) in live)


def simplify(eqns, consts, outputs) -> tuple[tuple, tuple, tuple]:
    """CSE then DCE (the eqns a merge leaves unread go too): (eqns, consts, outputs)."""
    eqns, outputs = eliminate_common(tuple(eqns), tuple(outputs))
    eqns, consts = eliminate_dead(eqns, consts, outputs)
    return eqns, consts, outputs
