"""The user-facing entry points: ``jit``, ``make_ir`` (and, from the planning layer,
``distribute``)."""
from __future__ import annotations

import functools

import numpy as np

from eins.errors import EinsError, TraceError
from eins.ir.types import as_dtype
from eins.tracing import ShapeDtype, trace, tree_flatten, tree_unflatten


def _signature(args, kwargs):
    """Cache key of one call: the argument structure, each array's shape and dtype, and the
    value of each Python scalar (scalars are baked into the program as literals)."""
    leaves, tree = tree_flatten((tuple(args), dict(kwargs)))
    key = []
    for x in leaves:
        if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
            key.append(("scalar", type(x).__name__, x))
        elif isinstance(x, ShapeDtype):
            key.append((x.shape, x.dtype))
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            try:
                key.append((tuple(x.shape), as_dtype(x.dtype)))
            except EinsError as e:
                raise type(e)(f"argument {len(key)}: {e}") from None
        else:
            raise TraceError(f"argument {len(key)} of type {type(x).__name__} is not an array, "
                             f"ShapeDtype or Python scalar: {x!r:.80}")
    return tree, tuple(key), leaves


class Jitted:
    """``eins.jit(fn)``: traces ``fn`` once per input signature and runs the program on numpy."""

    def __init__(self, fn):
        self.fn = fn
        self._cache: dict = {}
        self.trace_count = 0
        functools.update_wrapper(self, fn)

    def lower(self, *args, **kwargs):
        """The traced Program for these arguments (cached)."""
        tree, key, _ = _signature(args, kwargs)
        ck = (tree, key)
        if ck not in self._cache:
            self.trace_count += 1
            self._cache[ck] = trace(self.fn, args, kwargs)
        return self._cache[ck]

    def __call__(self, *args, **kwargs):
        prog, _, out_tree = self.lower(*args, **kwargs)
        _, _, leaves = _signature(args, kwargs)
        arrays = []
        for x in leaves:
            if isinstance(x, ShapeDtype):
                raise TraceError("a ShapeDtype has no data to run on; use eins.make_ir(fn) or "
                                 ".lower() to trace without data")
            if not (isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)):
                arrays.append(np.asarray(x))
        outs = prog.evaluate(*arrays)
        return tree_unflatten(out_tree, list(outs))


def jit(fn=None):
    """Trace ``fn`` per input signature into the SSA IR and execute it on numpy.
    Usable as ``@eins.jit`` or ``eins.jit(fn)``."""
    if fn is None:
        return jit
    if not callable(fn):
        raise TraceError(f"eins.jit expects a function, got {type(fn).__name__}")
    return Jitted(fn)


def make_ir(fn):
    """``make_ir(fn)(*args)`` returns the traced ``Program`` (print it for the IR dump)."""
    if not callable(fn):
        raise TraceError(f"eins.make_ir expects a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return trace(fn, args, kwargs)[0]

    return wrapped
