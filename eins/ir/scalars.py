"""Python scalar arguments traced as runtime values (as JAX traces them): the dtype of each
one's 0-d program input, and the fold that gives such an input the dtype it is used in
(NEP 50's cast of the scalar next to arrays), so that the program is the one its literal
made, with the value an input."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from eins.errors import TraceError
from eins.ir.program import Var
from eins.ir.types import TensorType, is_python_scalar

__all__ = ["is_traced_scalar", "scalar_dtype", "fold_scalar_casts"]

_SCALAR_DTYPES = {bool: np.dtype(np.bool_), int: np.dtype(np.int64), float: np.dtype(np.float64)}


def is_traced_scalar(x) -> bool:
    """Whether ``x`` is a Python scalar a trace takes as a runtime input (bool, int, float;
    a complex stays a literal, which eins's operators refuse by name)."""
    return is_python_scalar(x) and not isinstance(x, complex)


def scalar_dtype(x, what: str) -> np.dtype:
    """The dtype of Python scalar ``x``'s program input: bool, int64, float64 (numpy's
    defaults; next to arrays the operators cast it as NEP 50 says:
    :func:`eins.tracing.weak_cast`). ``what`` names it in the error of an int past int64."""
    d = _SCALAR_DTYPES[type(x) if type(x) in _SCALAR_DTYPES else
                       bool if isinstance(x, bool) else int if isinstance(x, int) else float]
    if d.kind == "i" and not -2 ** 63 <= x < 2 ** 63:
        raise TraceError(f"{what + ': ' if what else ''}the Python int {x} does not fit "
                         f"int64, the dtype of a traced int; pass it as an array of the "
                         f"dtype it needs, or mark it static (static_argnums)")
    return d


def fold_scalar_casts(in_vars: list, eqns: list, out_vars: list, casts) -> tuple:
    """A traced scalar input read only through casts to one dtype (``x_f32 * s``: NEP 50's
    cast of ``s`` to float32) becomes an input of that dtype, its casts gone: the program is
    the one its literal made, with the value an input (converted when called). ``casts``:
    the ids of the eqns that are such casts (the tracer's :func:`eins.tracing.weak_cast`
    made them). Returns (in_vars, eqns, out_vars)."""
    scalars = {id(v): k for k, v in enumerate(in_vars) if v.shape == ()}
    readers: dict = {}
    for e in eqns:
        for a in e.inputs:
            if isinstance(a, Var) and id(a) in scalars:
                readers.setdefault(id(a), []).append(e)
    returned = {id(v) for v in out_vars}
    sub, drop = {}, set()
    for vid, es in readers.items():
        dts = {e.outputs[0].dtype if id(e) in casts else None for e in es}
        if vid in returned or len(dts) != 1 or None in dts:
            continue
        w = Var(TensorType((), dts.pop()))
        in_vars[scalars[vid]] = w
        for e in es:
            sub[id(e.outputs[0])] = w
            drop.add(id(e))
    if not drop:
        return in_vars, eqns, out_vars
    eqns = [replace(e, inputs=tuple(sub.get(id(a), a) if isinstance(a, Var) else a
                                    for a in e.inputs)) for e in eqns if id(e) not in drop]
    return in_vars, eqns, [sub.get(id(v), v) for v in out_vars]
