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
from eins import numpy_hints
from eins.errors import EinsError, ShapeError, TraceError
from eins.ir.primitive import PRIMITIVES
from eins.ops.ufuncs import COMPOSITE_UFUNCS
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


def _no_out(fn, out):
    if _given(out):
        _refuse(fn, "out", out, "a traced program is pure: use the returned value")


def _axis_of(fn, axis, nd) -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)) or \
            not -nd <= axis < nd:
        raise ShapeError(f"numpy.{fn}: axis {axis!r} is out of range for an array of rank "
                         f"{nd} (at {user_frame()})")
    return int(axis) % nd


def _cut(a, axis, lo, hi):
    return a[(slice(None),) * axis + (slice(lo, hi),)]


def _clip(a, a_min=_NO, a_max=_NO, out=None, *, min=_NO, max=_NO, **kw):  # noqa: A002
    _no_out("clip", out)
    lo = min if a_min is _NO else a_min
    hi = max if a_max is _NO else a_max
    y = a
    if _given(lo):
        y = _ops().maximum(y, lo)
    if _given(hi):
        y = _ops().minimum(y, hi)
    return y


def _round(a, decimals=0, out=None):
    _no_out("round", out)
    if np.dtype(a.dtype).kind in "biu":
        return a
    if decimals == 0:
        return _ops().rint(a)
    f = 10.0 ** decimals   # numpy's own: rint(a * 10**d) / 10**d
    return _ops().rint(a * f) / f


def _sections(fn, n, sections, equal):
    """The [lo, hi) pieces of an axis of ``n`` by numpy's split rule."""
    if isinstance(sections, (int, np.integer)) and not isinstance(sections, bool):
        k = int(sections)
        if k <= 0:
            raise ShapeError(f"numpy.{fn}: number of sections must be larger than 0, got {k} "
                             f"(at {user_frame()})")
        if equal and n % k:
            raise ShapeError(f"numpy.{fn}: an axis of {n} does not split into {k} equal "
                             f"sections; use numpy.array_split for unequal ones "
                             f"(at {user_frame()})")
        size, extra = divmod(n, k)
        cuts = np.cumsum([0] + [size + 1] * extra + [size] * (k - extra)).tolist()
    else:
        cuts = [0] + [builtins_min(builtins_max(int(c) + (n if c < 0 else 0), 0), n)
                      for c in sections] + [n]
    return list(zip(cuts[:-1], cuts[1:]))


builtins_min, builtins_max = min, max


def _splitter(fn, equal):
    def handler(ary, indices_or_sections, axis=0):
        ax = _axis_of(fn, axis, len(ary.shape))
        return [_cut(ary, ax, lo, builtins_max(lo, hi))
                for lo, hi in _sections(fn, ary.shape[ax], indices_or_sections, equal)]
    handler.__name__ = fn
    return handler


def _expand_dims(a, axis):
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    nd = len(a.shape) + len(axes)
    norm = sorted(_axis_of("expand_dims", ax, nd) for ax in axes)
    shape, it = [], iter(a.shape)
    for d in range(nd):
        shape.append(1 if d in norm else next(it))
    return _ops().reshape(a, tuple(shape))


def _squeeze(a, axis=None):
    nd = len(a.shape)
    if axis is None:
        axes = [d for d, n in enumerate(a.shape) if n == 1]
    else:
        axes = [_axis_of("squeeze", ax, nd) for ax in ((axis,) if isinstance(
            axis, (int, np.integer)) else axis)]
        bad = [d for d in axes if a.shape[d] != 1]
        if bad:
            raise ShapeError(f"numpy.squeeze: cannot select an axis to squeeze out which has "
                             f"size not equal to one: axis {bad[0]} of shape "
                             f"{tuple(a.shape)} (at {user_frame()})")
    return _ops().reshape(a, tuple(n for d, n in enumerate(a.shape) if d not in axes))


def _ravel(a, order="C"):
    if order not in ("C", "K", "A"):
        _refuse("ravel", "order", order, "only row-major ('C') order is traced")
    return _ops().reshape(a, (math.prod(a.shape),))


def _stack(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    _no_out("stack", out)
    arrays = list(arrays)
    if not arrays:
        raise ShapeError(f"numpy.stack: need at least one array (at {user_frame()})")
    shapes = {tuple(a.shape) for a in arrays}
    if len(shapes) > 1:
        raise ShapeError(f"numpy.stack: all input arrays must have the same shape, got "
                         f"{sorted(shapes)} (at {user_frame()})")
    nd = len(arrays[0].shape) + 1
    ax = _axis_of("stack", axis, nd)
    parts = [_expand_dims(_ops().astype(a, dtype) if _given(dtype) else a, ax)
             for a in arrays]
    return _ops().concatenate(parts, ax)


def _hstack(tup, *, dtype=None, casting="same_kind"):
    tup = list(tup)
    return _concatenate(tup, 0 if len(tup[0].shape) == 1 else 1, dtype=dtype)


def _vstack(tup, *, dtype=None, casting="same_kind"):
    tup = [a if len(a.shape) >= 2 else _ops().reshape(a, (1,) * (2 - len(a.shape)) +
                                                       tuple(a.shape)) for a in tup]
    return _concatenate(tup, 0, dtype=dtype)


def _broadcast_to(array, shape, subok=False):
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
    have = tuple(array.shape)
    if len(have) > len(shape) or any(
            h not in (1, w) for h, w in zip(have[::-1], shape[::-1])):
        raise ShapeError(f"numpy.broadcast_to: shape {have} cannot broadcast to {shape} "
                         f"(at {user_frame()})")
    pad = (1,) * (len(shape) - len(have)) + have
    # adding the identity -0.0 (0, False) over the broadcast dims only: the constant holds
    # the new dims' elements, not the whole result's
    fill = np.full(tuple(w if h != w else 1 for h, w in zip(pad, shape)),
                   -0.0 if np.dtype(array.dtype).kind == "f" else 0, dtype=array.dtype)
    return _ops().add(array, fill)


def _repeat(a, repeats, axis=None):
    if axis is None:
        a, axis = _ravel(a), 0
    ax = _axis_of("repeat", axis, len(a.shape))
    n = a.shape[ax]
    if isinstance(repeats, (int, np.integer)) and not isinstance(repeats, bool):
        r = int(repeats)
        wide = a.shape[:ax + 1] + (r,) + a.shape[ax + 1:]
        y = _broadcast_to(_ops().reshape(a, a.shape[:ax + 1] + (1,) + a.shape[ax + 1:]), wide)
        return _ops().reshape(y, a.shape[:ax] + (n * r,) + a.shape[ax + 1:])
    ids = np.repeat(np.arange(n), np.asarray(repeats))   # numpy checks the counts
    return _ops().take(a, ids, ax)


def _tile(A, reps):
    reps = (int(reps),) if isinstance(reps, (int, np.integer)) else tuple(int(r) for r in reps)
    shape = tuple(A.shape)
    nd = builtins_max(len(shape), len(reps))
    shape = (1,) * (nd - len(shape)) + shape
    reps = (1,) * (nd - len(reps)) + reps
    inter = tuple(x for n in shape for x in (1, n))
    wide = tuple(x for r, n in zip(reps, shape) for x in (r, n))
    y = _broadcast_to(_ops().reshape(A, inter), wide)
    return _ops().reshape(y, tuple(r * n for r, n in zip(reps, shape)))


def _pad(array, pad_width, mode="constant", **kwargs):
    if mode != "constant":
        _refuse("pad", "mode", mode, "only constant padding is traced")
    value = kwargs.pop("constant_values", 0)
    if kwargs:
        _refuse("pad", next(iter(kwargs)), kwargs[next(iter(kwargs))], "constant mode only")
    nd = len(array.shape)
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64), (nd, 2))
    values = np.broadcast_to(np.asarray(value), (nd, 2))
    y = array
    for d in range(nd):
        parts = []
        for side, w in enumerate(widths[d]):
            if w < 0:
                raise ShapeError(f"numpy.pad: negative pad width {int(w)} (at {user_frame()})")
            block = np.full(tuple(y.shape[:d]) + (int(w),) + tuple(y.shape[d + 1:]),
                            values[d, side], dtype=array.dtype)
            parts.append(block)
        if widths[d].any():
            y = _ops().concatenate([parts[0], y, parts[1]], d)
    return y


def _flip(m, axis=None):
    nd = len(m.shape)
    axes = range(nd) if axis is None else [_axis_of("flip", ax, nd) for ax in (
        (axis,) if isinstance(axis, (int, np.integer)) else axis)]
    idx = tuple(slice(None, None, -1) if d in axes else slice(None) for d in range(nd))
    return m[idx]


def _roll(a, shift, axis=None):
    if axis is None:
        return _ops().reshape(_roll(_ravel(a), shift, 0), tuple(a.shape))
    shifts = np.broadcast_to(np.asarray(shift), np.shape(axis)).tolist()
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    shifts = shifts if isinstance(shifts, list) else [shifts]
    y = a
    for s_, ax in zip(shifts, axes):
        d = _axis_of("roll", ax, len(a.shape))
        n = a.shape[d]
        k = int(s_) % n if n else 0
        if k:
            y = _ops().concatenate([_cut(y, d, n - k, n), _cut(y, d, 0, n - k)], d)
    return y


def _scan(op):
    def handler(a, axis=None, dtype=None, out=None):
        _no_out(op, out)
        if _given(dtype):
            a = _ops().astype(a, dtype)
        return getattr(_ops(), op)(a, axis)
    handler.__name__ = op
    return handler


def _prod(a, axis=None, dtype=None, out=None, keepdims=_NO, initial=_NO, where=_NO):
    _no_out("prod", out)
    if _given(initial):
        _refuse("prod", "initial", initial, "multiply the result by it")
    if where is not _NO and where is not True:
        _refuse("prod", "where", where, "use np.where(mask, x, 1) first")
    if _given(dtype):
        a = _ops().astype(a, dtype)
    return _ops().prod(a, axis, keepdims=False if keepdims is _NO else bool(keepdims))


def _truth(op):
    """numpy's any/all: a max/min of ``x != 0`` (as int8: the reductions of every backend
    take it), compared back to bool."""
    def handler(a, axis=None, out=None, keepdims=_NO, *, where=_NO):
        _no_out(op, out)
        if where is not _NO and where is not True:
            _refuse(op, "where", where, "mask the operand with np.where first")
        ops = _ops()
        nz = ops.astype(a if np.dtype(a.dtype) == np.bool_ else ops.not_equal(a, 0), np.int8)
        red = ops.max if op == "any" else ops.min
        return ops.not_equal(red(nz, axis, keepdims=False if keepdims is _NO else
                                 bool(keepdims)), 0)
    handler.__name__ = op
    return handler


def _norm(x, ord=None, axis=None, keepdims=False):  # noqa: A002
    ops = _ops()
    if np.dtype(x.dtype).kind in "biu":
        x = ops.astype(x, np.float64)
    nd = len(x.shape)
    if axis is None:
        axes = tuple(range(nd))
        if ord is not None and nd not in (1, 2):
            raise ShapeError(f"numpy.linalg.norm: ord={ord!r} needs a 1-d or 2-d array or "
                             f"an axis, got shape {tuple(x.shape)} (at {user_frame()})")
    else:
        axes = tuple(_axis_of("linalg.norm", a, nd) for a in (
            (axis,) if isinstance(axis, (int, np.integer)) else axis))
    ax = axes if ord is None or len(axes) > 1 else axes[0]
    a = ops.abs(x)
    if ord is None or ord == "fro" or (ord == 2 and len(axes) == 1):
        return ops.sqrt(ops.sum(x * x, ax, keepdims=keepdims))
    if len(axes) == 1:
        if ord == np.inf:
            return ops.max(a, ax, keepdims=keepdims)
        if ord == -np.inf:
            return ops.min(a, ax, keepdims=keepdims)
        if ord == 0:
            return ops.astype(ops.sum(ops.not_equal(x, 0), ax, keepdims=keepdims), x.dtype)
        if ord == 1:
            return ops.sum(a, ax, keepdims=keepdims)
        return ops.sum(a ** float(ord), ax, keepdims=keepdims) ** (1.0 / float(ord))
    r, c = axes
    if ord in (1, -1, np.inf, -np.inf):
        inner, outer = (r, c) if ord in (1, -1) else (c, r)
        s = ops.sum(a, inner, keepdims=True)
        red = ops.max if ord in (1, np.inf) else ops.min
        y = red(s, outer, keepdims=True)
        return y if keepdims else ops.reshape(y, tuple(
            n for d, n in enumerate(x.shape) if d not in axes))
    _refuse("linalg.norm", "ord", ord, "the 2-norm and nuclear norm need an SVD; use ord=None "
            "('fro'), 1, -1, inf or -inf")


def _band(op):
    def handler(m, k=0):
        n, c = m.shape[-2], m.shape[-1]
        ops = _ops()
        diff = ops.sub(np.arange(c, dtype=np.int64)[None, :],
                       np.arange(n, dtype=np.int64)[:, None])   # column - row, built traced
        keep = ops.greater_equal(diff, int(k)) if op == "triu" else ops.less_equal(diff, int(k))
        zero = False if np.dtype(m.dtype) == np.bool_ else 0
        return ops.where(keep, m, zero)
    handler.__name__ = op
    return handler


def _like(value):
    def handler(a, dtype=None, order="K", subok=True, shape=None, *, device=None,
                fill_value=_NO):
        v = fill_value if value is None else value
        if shape is not None:
            _refuse("full_like", "shape", shape, "a new shape: use np.full(shape, v)")
        y = _ops().where(True, v, a)
        return _ops().astype(y, dtype if _given(dtype) else a.dtype)
    return handler


def _full_like(a, fill_value, dtype=None, order="K", subok=True, shape=None, *, device=None):
    return _like(None)(a, dtype, order, subok, shape, fill_value=fill_value)


def _outer(a, b, out=None):
    _no_out("outer", out)
    return _ops().einsum("i,j->ij", _ravel(a), _ravel(b))


_DATA_DEPENDENT = ("its result's shape depends on the values, which a traced program (static "
                   "shapes) cannot have")


def _data_dependent(name, instead):
    def handler(*args, **kwargs):
        raise TraceError(f"numpy.{name} on a traced array: {_DATA_DEPENDENT}; {instead} "
                         f"(at {user_frame()})")
    handler.__name__ = name
    return handler


_MASKED = "keep the shape and mask instead: np.where(cond, x, 0)"
REFUSED = {
    "nonzero": _data_dependent("nonzero", _MASKED + ", or take a fixed number with "
                               "eins.top_k(cond.astype(int), k)"),
    "argwhere": _data_dependent("argwhere", _MASKED),
    "flatnonzero": _data_dependent("flatnonzero", _MASKED),
    "unique": _data_dependent("unique", "sort instead (np.sort keeps the shape), or count "
                              "with comparisons against the known values"),
    "compress": _data_dependent("compress", _MASKED),
    "extract": _data_dependent("extract", _MASKED),
}


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
    "clip": _clip, "round": _round, "around": _round,
    "split": _splitter("split", True), "array_split": _splitter("array_split", False),
    "stack": _stack, "hstack": _hstack, "vstack": _vstack,
    "expand_dims": _expand_dims, "squeeze": _squeeze, "ravel": _ravel,
    "broadcast_to": _broadcast_to, "repeat": _repeat, "tile": _tile, "pad": _pad,
    "flip": _flip, "fliplr": lambda m: _flip(m, 1), "flipud": lambda m: _flip(m, 0),
    "roll": _roll, "cumsum": _scan("cumsum"), "cumprod": _scan("cumprod"), "prod": _prod,
    "any": _truth("any"), "all": _truth("all"), "triu": _band("triu"), "tril": _band("tril"),
    "zeros_like": _like(0), "ones_like": _like(1), "empty_like": _like(0),
    "full_like": _full_like, "outer": _outer, "copy": lambda a, order="K", subok=False: a,
    **REFUSED,
    "shape": lambda a: tuple(a.shape), "ndim": lambda a: len(a.shape),
    "size": lambda a, axis=None: a.size if axis is None else a.shape[axis],
}


LINALG = {"norm": _norm}
"""numpy.linalg functions on traced arrays, by name (``np.linalg.norm``)."""

def traced_names() -> list:
    """Every numpy function and ufunc name that traces on an eins array (for the docs and
    their test: derived from the handlers and the registry, so it cannot drift)."""
    ufuncs = {u for p in PRIMITIVES.values() for u in p.ufuncs} | set(COMPOSITE_UFUNCS)
    return sorted(set(n for n in HANDLERS if n not in REFUSED) |
                  {f"linalg.{n}" for n in LINALG} | ufuncs)


def refusal(name: str) -> str:
    """Why numpy function ``name`` (``linalg.inv`` for submodules) does not trace, and the
    closest eins way to write it."""
    hint = numpy_hints.HINTS.get(name)
    if hint is not None:
        return f"numpy.{name} cannot run on a traced array; {numpy_hints.write(hint)}"
    near = numpy_hints.closest(name, traced_names())
    return (f"numpy.{name} cannot run on a traced array; {near}numpy functions eins "
            f"traces: {traced_names()}")


def ufunc_refusal(ufunc, method, kwargs, prim) -> str:
    """Why ``ufunc.method(..., **kwargs)`` does not trace (Tracer.__array_ufunc__), and the
    closest eins way to write it."""
    name = ufunc.__name__
    if method != "__call__":
        way = numpy_hints.REDUCE_HINTS.get((name, method))
        if way is None and method == "outer":
            way = f"broadcasting: np.{name}(a[:, None], b[None, :])"
        return (f"numpy.{name}.{method} cannot run on a traced array; write "
                f"{way or f'np.{name} on slices, or the reduction of the same meaning'}")
    if prim is None:
        hint = numpy_hints.UFUNC_HINTS.get(name)
        if hint is not None:
            return f"numpy.{name} cannot run on a traced array; {numpy_hints.write(hint)}"
        return (f"numpy.{name} cannot run on a traced array; "
                f"{numpy_hints.closest(name, traced_names())}the ufuncs eins traces: "
                f"{sorted({u for p in PRIMITIVES.values() for u in p.ufuncs})}")
    key = next(iter(kwargs))
    why = ("a traced program is pure: use the returned value" if key == "out" else
           "cast first: x.astype(dtype)" if key == "dtype" else
           "mask with np.where(cond, f(x), x)" if key == "where" else "eins takes no options")
    return (f"numpy.{name}: {key}={_shown(kwargs[key])} is not supported on traced arrays "
            f"({why})")


def array_function(func, args, kwargs):
    """``Tracer.__array_function__``: run ``func``'s eins equivalent or name what to use."""
    name = func.__name__
    module = getattr(func, "__module__", "") or ""
    if module.startswith("numpy.linalg"):
        handler, name = LINALG.get(name), f"linalg.{name}"
    elif module.startswith("numpy.fft"):
        handler, name = None, f"fft.{name}"
    else:
        handler = HANDLERS.get(name)
    if handler is None:
        raise TraceError(f"{refusal(name)} (at {user_frame()})")
    return _call(name, handler, args, kwargs)


def call(name, args, kwargs):
    """``HANDLERS[name](*args, **kwargs)`` (``np.sum(x)``, ``x.sum(...)``); a call its
    signature does not take (a keyword numpy knows but eins does not, one too many
    arguments) is a TraceError naming numpy's function and the user's line."""
    return _call(name, HANDLERS[name], args, kwargs)


def _call(name, handler, args, kwargs):
    try:
        return handler(*args, **kwargs)
    except TypeError as e:
        if isinstance(e, EinsError) or "argument" not in str(e):
            raise
        why = re.sub(r"^[\w.<>]+\(\) ", "", str(e))   # not the handler's own name
        raise TraceError(f"numpy.{name} on a traced array: {why} (at {user_frame()})") from None


install_operators(sys.modules[__name__], "numpy")  # np.sum(x), x.sum(...) on traced arrays
