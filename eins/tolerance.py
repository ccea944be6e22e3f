"""How far apart two correct floating-point results may be: the tolerance rule shared by the
tests (tests/helpers.py ``assert_close``), the demo and the examples.

Distributed and single-device runs (and BLAS kernels of different CPUs) add the same terms
in different orders, so their results differ by rounding, not by a fixed amount: the bound
follows the dtype's machine epsilon, how many terms each result accumulates (``n``) and how
many accumulations are chained (``depth``), and applies relative to the magnitude of the
result (:func:`magnitude`), since a sum's error scales with its terms, not with a value
that cancelled to near zero.
"""
from __future__ import annotations

import math

import numpy as np

from eins.ir.program import eqn_indexing
from eins.ir.rules import compute_dtype


def eps(dtype) -> float:
    """Machine epsilon of a float dtype (bfloat16 included); integer and bool dtypes: 0."""
    d = np.dtype(dtype)
    if d.kind in "biu":
        return 0.0
    if d.kind == "f":
        return float(np.finfo(d).eps)
    import ml_dtypes  # an extra (eins[bf16]): only its own bfloat16 arrays get here
    return float(ml_dtypes.finfo(d).eps)


def tolerance(dtype, n=1, depth=1) -> float:
    """Relative error bound of a result of ``dtype`` made of ``depth`` chained steps, each
    accumulating ``n`` terms (BLAS, reductions, partial sums of split indices).

    Two correct results computed in different orders differ by at most twice the bound of
    one, ``2 * n * eps`` per accumulation (recursive summation, Higham Thm. 3.1; blocked and
    pairwise BLAS kernels do better), in the dtype the sum is accumulated in; each step's
    result is rounded to ``dtype`` once more (``eps`` of ``dtype`` per step), which dominates
    for float16/bfloat16. Applied relative to the magnitude of the result (:func:`close`),
    not per element, because a sum's error scales with its terms, not with a value that
    cancelled to near zero."""
    out = eps(dtype)
    acc = eps(compute_dtype(dtype)) if out else 0.0
    n, depth = max(int(n), 1), max(int(depth), 1)
    return depth * out + 2.0 * n * depth * acc


def accumulation(program) -> tuple[int, int]:
    """(n, depth) of a traced program for :func:`tolerance`: the longest accumulation of any
    eqn and how many accumulations the program chains (at most). An eqn's accumulation is
    its join work per output element (a matmul's contracted extent, a reduction's reduced
    extent), unless its primitive says otherwise (``Primitive.accumulation``: a norm or
    softmax reduces its last or given axis; attention chains three)."""
    n, depth = 1, 0
    for e in program.eqns:
        rule = e.primitive.accumulation
        if rule is not None:
            steps, longest = rule([a.type for a in e.inputs], [v.type for v in e.outputs],
                                  **e.params)
        else:
            ix = eqn_indexing(e)
            out = max(v.type.size for v in e.outputs) if e.outputs else 1
            steps, longest = 1, math.prod(ix.extents.values()) // max(out, 1)
        if longest > 1:
            n, depth = max(n, longest), depth + steps
    return n, max(depth, 1)


def magnitude(a) -> float:
    """The largest finite |value| of ``a`` (1.0 when there is none or it is 0): the scale
    the absolute tolerance is taken relative to."""
    a = np.asarray(a, np.float64)
    return float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0)) or 1.0


def close(got, want, n=1, depth=1, dtype=None) -> bool:
    """Whether ``got`` is within :func:`tolerance` of ``want`` (relative to its magnitude);
    ``dtype`` defaults to the narrower of the two."""
    got, want = np.asarray(got), np.asarray(want)
    if dtype is None:
        dtype = min((got.dtype, want.dtype), key=lambda d: (eps(d) == 0, -eps(d)))
    rel = tolerance(dtype, n, depth)
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rel,
                            atol=rel * magnitude(want)))
