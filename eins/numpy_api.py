"""numpy functions on traced arrays (NEP 18, ``__array_function__``).

``np.sum(x)``, ``np.mean(x, axis=1, keepdims=True)``, ``np.transpose(x)``, ``np.reshape(x,
s)``, ``np.swapaxes(x, i, j)``, ``np.einsum(...)``, ``np.where(c, x, y)``,
``np.concatenate([...])``, ``np.var``/``np.std`` (composed of mean, sub, mul and sum),
``np.take``/``np.take_along_axis``, ``np.argmax``/``np.argmin``/``np.argsort``/``np.sort`` and
the other functions of :data:`HANDLERS` run the eins
operator of the same meaning inside a trace, and so do the ``Tracer`` methods ``x.sum(...)``,
``x.reshape(...)``, ``x.swapaxes(...)`` etc. numpy's keywords are followed: ``out`` may
only be None (a traced program is pure: use the returned value), ``dtype`` casts first (numpy
accumulates in ``dtype``), ``keepdims`` and ``axis`` as numpy; ``initial``, ``where`` and
``order`` other than ``'C'`` are refused by name. Any other numpy function is a TraceError
that names it and lists the supported ones (numpy's protocol would otherwise raise a bare
TypeError from deep inside numpy).
"""
from __future__ import annotations

import math
import re
import sys

import numpy as np

import eins.ops as ops
from eins.errors import EinsError, ShapeError, TraceError
from eins.tracing import install_operators, user_frame

# numpy's "argument not given" sentinel (np._NoValue); a default of None stands for it too
_NO = getattr(np, "_NoValue", None)


def _given(v) -> bool:
    return v is not None and v is not _NO


def _shown(value) -> str:
    """``value`` as an error names it: an array by its dtype and shape, not its elements."""
    if isinstance(value, np.ndarray):
        return f"<ndarray {value.dtype.name} {value.shape}>"
    return f"{value!r:.80}"


def _refuse(fn, name, value, why):
    raise TraceError(f"numpy.{fn}: {name}={_shown(value)} is not supported on traced arrays "
                     f"({why}) (at {user_frame()})")


def _ops():
    return ops


def _reduction(op):
    """numpy's ``sum``/``mean``/``max``/``min`` keywords on eins's reduction ``op``."""
    def handler(a, axis=None, dtype=None, out=None, keepdims=_NO, initial=_NO, where=_NO):
        if _given(out):
            _refuse(op, "out", out, "a traced program is pure: use the returned value")
        if _given(initial):
            _refuse(op, "initial", initial, "apply eins.maximum/eins.add to the result")
        if where is not _NO and where is not True:
            _refuse(op, "where", where, "mask the operand with eins.where first")
        keep = False if keepdims is _NO else bool(keepdims)
        if not _given(dtype):
            return getattr(_ops(), op)(a, axis, keepdims=keep)
        if op in ("max", "min"):
            _refuse(op, "dtype", dtype, "numpy's max/min take no dtype")
        # numpy accumulates in dtype and returns dtype: cast before and after
        out = getattr(_ops(), op)(_ops().astype(a, dtype), axis, keepdims=keep)
        return _ops().astype(out, dtype)
    handler.__name__ = op
    return handler


def _moment(op):
    """numpy's ``var``/``std``: the mean of squared deviations from the mean, over
    ``n - ddof`` (numpy's two-pass formula: ``x - mean`` first, not ``E[x²] - E[x]²``,
    which cancels catastrophically). Integer and bool operands are computed in float64, as
    numpy does."""
    def handler(a, axis=None, dtype=None, out=None, ddof=0, keepdims=_NO, *, where=_NO,
                mean=_NO, correction=_NO):
        if _given(out):
            _refuse(op, "out", out, "a traced program is pure: use the returned value")
        if where is not _NO and where is not True:
            _refuse(op, "where", where, "mask the operand with eins.where first")
        if _given(mean):
            _refuse(op, "mean", mean, "eins computes the mean itself")
        if _given(correction):
            if ddof != 0:
                raise TraceError(f"numpy.{op}: ddof={ddof!r} and correction={correction!r} "
                                 f"both given; numpy takes one (at {user_frame()})")
            ddof = correction
        if isinstance(ddof, bool) or not isinstance(ddof, (int, float, np.integer,
                                                           np.floating)):
            raise TraceError(f"numpy.{op}: ddof must be a number, got {ddof!r} "
                             f"(at {user_frame()})")
        ops = _ops()
        x = a
        if _given(dtype):
            x = ops.astype(x, dtype)
        elif np.dtype(x.dtype).kind in "biu":
            x = ops.astype(x, np.float64)
        m = ops.mean(x, axis, keepdims=True)    # checks the axes as every reduction does
        n = math.prod(x.shape) // max(math.prod(m.shape), 1)   # elements per mean
        keep = False if keepdims is _NO else bool(keepdims)
        d = x - m
        v = ops.sum(d * d, axis, keepdims=keep) / float(max(n - ddof, 0))
        return ops.sqrt(v) if op == "std" else v
    handler.__name__ = op
    return handler


def _reshape(a, shape=None, order="C", *, newshape=None, copy=None):
    if shape is None:
        shape = newshape  # numpy < 2.1 called it newshape
    if shape is None:
        raise TraceError(f"numpy.reshape: the new shape is missing (at {user_frame()})")
    if order != "C":
        _refuse("reshape", "order", order, "only row-major ('C') reshapes are traced")
    return _ops().reshape(a, shape)


def _transpose(a, axes=None):
    return _ops().transpose(a, axes)


def _swapaxes(a, axis1, axis2):
    nd = len(a.shape)
    ax = []
    for v in (axis1, axis2):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not -nd <= v < nd:
            raise ShapeError(f"swapaxes: axis {v!r} is not an axis of shape {tuple(a.shape)} "
                             f"(at {user_frame()})")
        ax.append(int(v) % nd)
    perm = list(range(nd))
    perm[ax[0]], perm[ax[1]] = perm[ax[1]], perm[ax[0]]
    return _ops().transpose(a, tuple(perm))


def _where(condition, x=_NO, y=_NO):
    if x is _NO or y is _NO:
        raise TraceError(f"numpy.where(condition) without x and y returns indices, which a "
                         f"traced program cannot compute; use numpy.where(condition, x, y) "
                         f"(at {user_frame()})")
    return _ops().where(condition, x, y)


def _concatenate(arrays, axis=0, out=None, dtype=None, casting="same_kind"):
    if _given(out):
        _refuse("concatenate", "out", out, "a traced program is pure: use the returned value")
    arrays = list(arrays)
    if _given(dtype):
        arrays = [_ops().astype(a, dtype) for a in arrays]
    return _ops().concatenate(arrays, axis)


def _einsum(subscripts, *operands, out=None, optimize=False, **kw):
    if _given(out):
        _refuse("einsum", "out", out, "a traced program is pure: use the returned value")
    if kw:
        _refuse("einsum", next(iter(kw)), kw[next(iter(kw))], "eins.einsum takes no options")
    return _ops().einsum(subscripts, *operands)


def _matmul_like(name):
    def handler(a, b, out=None):
        if _given(out):
            _refuse(name, "out", out, "a traced program is pure: use the returned value")
        nd = (len(getattr(a, "shape", ())), len(getattr(b, "shape", ())))
        if name == "dot" and max(nd) > 2:
            raise TraceError(f"numpy.dot of {nd[0]}-d and {nd[1]}-d traced arrays: numpy's "
                             f"n-d dot is not matmul; use eins.einsum or the @ operator "
                             f"(at {user_frame()})")
        return _ops().matmul(a, b)
    handler.__name__ = name
    return handler


def _astype(x, dtype, /, *, copy=True, device=None):
    return _ops().astype(x, dtype)


def _take(a, indices, axis=None, out=None, mode="raise"):
    if _given(out):
        _refuse("take", "out", out, "a traced program is pure: use the returned value")
    if mode != "raise":
        _refuse("take", "mode", mode, "out-of-range indices are an error, as numpy's 'raise'")
    return _ops().take(a, indices, axis)


def _take_along_axis(arr, indices, axis=-1):
    return _ops().take_along_axis(arr, indices, axis)


def _arg(op):
    def handler(a, axis=None, out=None, *, keepdims=_NO):
        if _given(out):
            _refuse(op, "out", out, "a traced program is pure: use the returned value")
        return getattr(_ops(), op)(a, axis, keepdims=False if keepdims is _NO else keepdims)
    handler.__name__ = op
    return handler


def _sorter(op):
    def handler(a, axis=-1, kind=None, order=None, *, stable=None):
        return getattr(_ops(), op)(a, axis, kind, order, stable=stable)
    handler.__name__ = op
    return handler


HANDLERS = {
    "sum": _reduction("sum"), "mean": _reduction("mean"),
    "max": _reduction("max"), "amax": _reduction("max"),
    "min": _reduction("min"), "amin": _reduction("min"),
    "var": _moment("var"), "std": _moment("std"),
    "reshape": _reshape, "transpose": _transpose, "swapaxes": _swapaxes, "where": _where,
    "concatenate": _concatenate, "einsum": _einsum, "dot": _matmul_like("dot"),
    "astype": _astype, "take": _take, "take_along_axis": _take_along_axis,
    "argmax": _arg("argmax"), "argmin": _arg("argmin"), "argsort": _sorter("argsort"),
    "sort": _sorter("sort"),
    "shape": lambda a: tuple(a.shape), "ndim": lambda a: len(a.shape),
    "size": lambda a, axis=None: a.size if axis is None else a.shape[axis],
}


def array_function(func, args, kwargs):
    """``Tracer.__array_function__``: run ``func``'s eins equivalent or name what to use."""
    name = func.__name__
    handler = HANDLERS.get(name)
    if handler is None or getattr(func, "__module__", "").startswith(("numpy.linalg",
                                                                       "numpy.fft")):
        raise TraceError(f"numpy.{name} cannot run on a traced array; numpy functions eins "
                         f"traces: {sorted(HANDLERS)}, and the ufuncs (np.exp, np.add, ...); "
                         f"otherwise use the eins operators (at {user_frame()})")
    return call(name, args, kwargs)


def call(name, args, kwargs):
    """``HANDLERS[name](*args, **kwargs)`` (``np.sum(x)``, ``x.sum(...)``); a call its
    signature does not take (a keyword numpy knows but eins does not, one too many
    arguments) is a TraceError naming numpy's function and the user's line."""
    try:
        return HANDLERS[name](*args, **kwargs)
    except TypeError as e:
        if isinstance(e, EinsError) or "argument" not in str(e):
            raise
        why = re.sub(r"^[\w.<>]+\(\) ", "", str(e))   # not the handler's own name
        raise TraceError(f"numpy.{name} on a traced array: {why} (at {user_frame()})") from None


install_operators(sys.modules[__name__], "numpy")  # np.sum(x), x.sum(...) on traced arrays
