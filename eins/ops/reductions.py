"""Reductions: ``sum``, ``max``, ``min``, ``mean`` over axes (``keepdims``), ``prod``, the
scans ``cumsum`` and ``cumprod``, and ``softmax``.

Join-agg specs (Section 3.3): the input's dims are indices ``a, b, c, ...``; kept dims are
output indices, reduced dims appear in no output and are aggregated with ⊕ when split —
``sum`` for sum and mean, ``max`` for max, ``min`` for min (e.g. ``"abc->ac | sum(b)"``; with
``keepdims`` a reduced dim is ``_`` in the output). Every index is shardable ``any``.

``mean`` carries ``count``, the global number of reduced elements, as a parameter: its
kernel on a block divides the block's sum by the *global* count, so the partial means of a
split reduced index add up (⊕ = sum) to the whole mean. A block cannot know the global
count from its own boxes, which is why it is a parameter (``eins.mean`` fills it in).

``softmax(x, axis)`` is numerically stable (max subtracted before ``exp``); its axis is
named but not shardable, every other index is shardable ``any``. So are ``prod``'s reduced
axes (a product ⊕ would round differently from numpy's pairwise order, and nothing needs
it split) and the scan axis of ``cumsum``/``cumprod``.
"""
from __future__ import annotations

import math

import numpy as np

from eins.errors import DTypeError, ShapeError
from eins.ir.joinagg import signature_indexing
from eins.ir.types import TensorType
from eins.ir.primitive import GpuLowering, Primitive, register
from eins.kernels.torch_rules import compute_type
from eins.ops._common import (array_operand, compute_dtype, float_dtype, index_name, ops,
                              static_flag, user_errors)
from eins.tracing import bind

__all__ = ["sum", "max", "min", "mean", "softmax", "prod", "cumsum", "cumprod"]

_BOOL = np.dtype(np.bool_)
_I64 = np.dtype(np.int64)


def normalize_axes(op, shape, axis) -> tuple[int, ...]:
    """``axis`` (int, tuple of ints or None) as a sorted tuple of non-negative dims."""
    nd = len(shape)
    if axis is None:
        return tuple(range(nd))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else axis
    if not isinstance(axes, (tuple, list)):
        raise ShapeError(f"{op}: axis must be an int, a tuple of ints or None, got {axis!r}")
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise ShapeError(f"{op}: axis must be an int, a tuple of ints or None, got {axis!r}")
        if not -nd <= a < nd:
            raise ShapeError(f"{op}: axis {a} is out of range for shape {tuple(shape)}")
        out.append(int(a) % nd)
    if len(set(out)) != len(out):
        raise ShapeError(f"{op}: repeated axis in {axis!r} for shape {tuple(shape)}")
    return tuple(sorted(out))


def _out_shape(shape, axis, keepdims):
    if keepdims:
        return tuple(1 if d in axis else n for d, n in enumerate(shape))
    return tuple(n for d, n in enumerate(shape) if d not in axis)


def _reduce_dtype(name, d):
    if name == "sum":  # numpy: bool and small ints accumulate in the default int
        return _I64 if d == _BOOL or d.kind == "i" else d
    if name == "mean":
        return float_dtype(d) if d != _BOOL else np.dtype(np.float64)
    return d


def _make_reduction(name, np_fn, agg):
    def abstract(x: TensorType, *, axis, keepdims, count=None):
        axis = normalize_axes(name, x.shape, axis)
        if name in ("max", "min") and any(x.shape[d] == 0 for d in axis):
            raise ShapeError(f"{name}: zero-size reduction over axis {axis} of shape {x.shape}")
        if name == "mean":
            n = math.prod(x.shape[d] for d in axis)
            if count != n:
                raise ShapeError(f"mean: count {count} is not the number of reduced elements "
                                 f"({n}) over axis {axis} of shape {x.shape}")
            if n == 0:
                raise ShapeError(f"mean: empty reduction over axis {axis} of shape {x.shape}")
        return (TensorType(_out_shape(x.shape, axis, keepdims), _reduce_dtype(name, x.dtype)),)

    def impl(x, *, axis, keepdims, count=None):
        x = np.asarray(x)
        out = _reduce_dtype(name, x.dtype)
        if name == "mean":
            s = np.sum(x.astype(compute_dtype(out), copy=False), axis=axis, keepdims=keepdims)
            return (np.asarray(s / count).astype(out, copy=False),)
        if name == "sum":
            s = np.sum(x.astype(compute_dtype(out), copy=False), axis=axis, keepdims=keepdims)
            return (np.asarray(s).astype(out, copy=False),)
        return (np.asarray(np_fn(x, axis=axis, keepdims=keepdims)),)

    def indexing(ins, outs, *, axis, keepdims, count=None):
        nd = ins[0].ndim
        subs = "".join(index_name(d) for d in range(nd))
        out = "".join(("_" if keepdims else "") if d in axis else subs[d] for d in range(nd))
        red = "".join(subs[d] for d in axis)
        sig = f"{subs}->{out} | {agg}({red})"
        return signature_indexing(sig, [ins[0].shape], [outs[0].shape])

    def flops(ins, outs, **params):
        return ins[0].size + (outs[0].size if name == "mean" else 0)

    @user_errors
    def fn(x, axis=None, keepdims=False):
        axes = normalize_axes(name, array_operand(name, x).shape, axis)
        params = {"axis": axes, "keepdims": static_flag(name, "keepdims", keepdims)}
        if name == "mean":
            params["count"] = math.prod(x.shape[d] for d in axes)
        return bind(name, x, **params)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"numpy's {name} over ``axis`` (int, tuple or None = all) with ``keepdims``; "
                  f"split reduced indices aggregate with ⊕ = {agg}.")

    def torch_fallback(fspec, x, *, axis, keepdims, count=None):
        return _torch_reduce(name, x, axis, keepdims, count)

    def samples(arr):
        return [(f"{name} axis 1", lambda x: fn(x, axis=1), (arr(6, 8),)),
                (f"{name} axis 0 keepdims", lambda x: fn(x, axis=0, keepdims=True),
                 (arr(8, 6),)),
                (f"{name} all", lambda x: fn(x), (arr(4, 6),)),
                (f"{name} int64 axis 0", lambda x: fn(x, axis=0), (arr(8, 3, dtype="int64"),))]

    register(Primitive(name, abstract, impl, flops, indexing, kernel_class="reduction",
                       lowerings={None: GpuLowering(fallback=torch_fallback)},
                       samples=samples,
                       transpose=_sum_transpose if name in ("sum", "mean") else None,
                       vjp=_extremum_vjp if name in ("max", "min") else None))
    return fn


def _spread(g, shape, axis, keepdims):
    """``g`` (a reduction's cotangent) broadcast back over the reduced ``axis`` of
    ``shape``."""
    o = ops()
    kept = tuple(1 if d in axis else n for d, n in enumerate(shape))
    if g.shape and tuple(g.shape) != kept:   # a scalar broadcasts as it is
        g = o.reshape(g, kept)
    return o.broadcast_to(g, tuple(shape))


def _sum_transpose(cts, ins, needs, *, axis, keepdims, count=None):
    """sum and mean are linear: the cotangent spread over the reduced axes (/ count)."""
    g = cts[0] if count is None else cts[0] / count
    return (_spread(g, ins[0].shape, axis, keepdims),)


def _extremum_vjp(cts, ins, outs, needs, *, axis, keepdims):
    """To the elements equal to the max (min), shared equally among ties."""
    o = ops()
    x = ins[0]
    hit = o.equal(x, _spread(outs[0], x.shape, axis, keepdims))
    n = o.sum(o.astype(hit, cts[0].dtype), axis=axis, keepdims=True)
    return (o.where(hit, _spread(cts[0], x.shape, axis, keepdims) / n, 0.0),)


def _torch_reduce(name, x, axis, keepdims, count=None):
    """The torch lowering of reduction ``name`` (its results as the numpy kernel's)."""
    import torch  # heavy: only the GPU path
    # mean's result (eins.mean, numpy's): float64 for ints and bools, else the float's
    mt = compute_type(x) if x.is_floating_point() else torch.float64
    if not axis:   # torch reads dim=() as "every dim"; numpy as "none"
        return (x.to(mt) / count if name == "mean" else x,)
    if name in ("sum", "mean"):
        ct = compute_type(x) if x.is_floating_point() else torch.int64
        s = x.to(ct).sum(dim=axis, keepdim=keepdims)
        # int64 / count would be torch's default float32
        return (s.to(mt) / count if name == "mean" else s,)
    f = torch.amax if name == "max" else torch.amin
    return (f(x, dim=axis, keepdim=keepdims),)


sum = _make_reduction("sum", np.sum, "sum")  # noqa: A001 - eins.sum, like numpy's
max = _make_reduction("max", np.max, "max")  # noqa: A001
min = _make_reduction("min", np.min, "min")  # noqa: A001
mean = _make_reduction("mean", None, "sum")


# ----------------------------------------------------------------------------- softmax
def _softmax_abstract(x: TensorType, *, axis):
    if x.ndim == 0:
        raise ShapeError("softmax: operand must have at least one dimension, got shape ()")
    if not 0 <= axis < x.ndim:
        raise ShapeError(f"softmax: axis {axis} is out of range for shape {x.shape}")
    if x.dtype == _BOOL:
        raise DTypeError(f"softmax: not defined for dtype bool (shape {x.shape})")
    return (TensorType(x.shape, float_dtype(x.dtype)),)


def _softmax_impl(x, *, axis):
    x = np.asarray(x)
    out = float_dtype(x.dtype)
    if x.size == 0:  # nothing to normalize (np.max of an empty axis has no identity)
        return (np.empty(x.shape, out),)
    xc = x.astype(compute_dtype(out), copy=False)
    with np.errstate(invalid="ignore"):  # an all -inf row gives nan, as in numpy/JAX
        e = np.exp(xc - np.max(xc, axis=axis, keepdims=True))
        return ((e / np.sum(e, axis=axis, keepdims=True)).astype(out, copy=False),)


def _softmax_indexing(ins, outs, *, axis):
    subs = "".join(index_name(d) for d in range(ins[0].ndim))
    shardable = {c: "any" for d, c in enumerate(subs) if d != axis}
    return signature_indexing(f"{subs}->{subs}", [ins[0].shape], [outs[0].shape], shardable)


def _softmax_torch(fspec, x, *, axis):
    return (x.to(compute_type(x)).softmax(dim=axis),)


def _softmax_accumulation(ins, outs, *, axis):
    """one reduction along the softmax axis"""
    return 1, ins[0].shape[axis]


register(Primitive("softmax", _softmax_abstract, _softmax_impl,
                   lambda i, o, **p: 5 * i[0].size, _softmax_indexing,
                   accumulation=_softmax_accumulation, kernel_class="norm",
                   vjp=lambda cts, ins, outs, needs, *, axis: (
                       outs[0] * (cts[0] - ops().sum(cts[0] * outs[0], axis=axis,
                                                     keepdims=True)),),
                   lowerings={None: GpuLowering(fallback=_softmax_torch)},
                   attr_hints={"softmax": "use eins.softmax(x, axis)"},
                   samples=lambda arr: [("softmax", lambda x: softmax(x, axis=-1),
                                         (arr(8, 6),))]))


@user_errors
def softmax(x, axis=-1):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis`` (never split)."""
    nd = len(array_operand("softmax", x).shape)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise ShapeError(f"softmax: axis must be an int, got {axis!r}")
    if nd and -nd <= axis < 0:
        axis += nd
    return bind("softmax", x, axis=int(axis))



# ----------------------------------------------------------------------------- prod, scans
def _prod_abstract(x: TensorType, *, axis, keepdims):
    axis = normalize_axes("prod", x.shape, axis)
    return (TensorType(_out_shape(x.shape, axis, keepdims), _reduce_dtype("sum", x.dtype)),)


def _prod_impl(x, *, axis, keepdims):
    x = np.asarray(x)
    out = _reduce_dtype("sum", x.dtype)
    with np.errstate(all="ignore"):   # overflow wraps or gives inf, as numpy's
        p = np.prod(x.astype(compute_dtype(out), copy=False), axis=axis, keepdims=keepdims)
    return (np.asarray(p).astype(out, copy=False),)


def _prod_indexing(ins, outs, *, axis, keepdims):
    nd = ins[0].ndim
    subs = "".join(index_name(d) for d in range(nd))
    out = "".join(("_" if keepdims else "") if d in axis else subs[d] for d in range(nd))
    shardable = {c: "any" for d, c in enumerate(subs) if d not in axis}
    return signature_indexing(f"{subs}->{out}", [ins[0].shape], [outs[0].shape], shardable)


def _prod_torch(fspec, x, *, axis, keepdims):
    import torch  # heavy: only the GPU path
    ct = compute_type(x) if x.is_floating_point() else torch.int64
    y = x.to(ct)
    for d in sorted(axis, reverse=True):
        y = y.prod(dim=d, keepdim=keepdims)
    return (y,)


def _prod_vjp(cts, ins, outs, needs, *, axis, keepdims):
    """d prod / d x_i is the product of the others, exact where x holds zeros: with no zero
    in x_i's group it is prod / x_i; with one zero, the others' product at the zero and 0
    elsewhere; with two or more, 0."""
    o = ops()
    x = ins[0]
    zero = x == 0
    nz = o.where(zero, 1.0, x)
    others = _spread(o.prod(nz, axis=axis, keepdims=keepdims), x.shape, axis, keepdims)
    zeros = _spread(o.sum(o.astype(zero, cts[0].dtype), axis=axis, keepdims=keepdims),
                    x.shape, axis, keepdims)
    d = o.where(zeros == 0, others / nz, o.where((zeros == 1) & zero, others, 0.0))
    return (_spread(cts[0], x.shape, axis, keepdims) * d,)


register(Primitive("prod", _prod_abstract, _prod_impl, lambda i, o, **p: i[0].size,
                   _prod_indexing, lowerings={None: GpuLowering(fallback=_prod_torch)},
                   kernel_class="reduction", vjp=_prod_vjp,
                   attr_hints={"prod": "use np.prod(x, axis)"},
                   samples=lambda arr: [("prod axis 1", lambda x: prod(x, axis=1),
                                         (arr(6, 8, lo=0.5, hi=1.5),)),
                                        ("prod all keepdims",
                                         lambda x: prod(x, keepdims=True), (arr(4, 3),))]))


@user_errors
def prod(x, axis=None, keepdims=False):
    """numpy's prod over ``axis`` (int, tuple or None = all) with ``keepdims``; the reduced
    axes are never split."""
    axes = normalize_axes("prod", array_operand("prod", x).shape, axis)
    return bind("prod", x, axis=axes, keepdims=static_flag("prod", "keepdims", keepdims))


def _reverse_cumsum(h, axis):
    """sum_{j >= i} h_j along ``axis``: the total less the inclusive scan before i."""
    o = ops()
    return o.sum(h, axis=axis, keepdims=True) - o.cumsum(h, axis=axis) + h


def _cumsum_vjp(cts, ins, outs, needs, *, axis):
    return (_reverse_cumsum(cts[0], axis),)


def _cumprod_vjp(cts, ins, outs, needs, *, axis):
    """d/dx_i of sum_j g_j y_j is sum_{j >= i} g_j y_j / x_i where x_i != 0 (exact: y_j
    holds x_i once); at the first zero of a row, sum_{j >= i} g_j y'_j with y' the scan of
    x with that zero set to 1; at a later zero, 0 (every product through it holds the first)."""
    o = ops()
    x, y, g = ins[0], outs[0], cts[0]
    zero = x == 0
    first = zero & (o.cumsum(o.astype(zero, "int32"), axis=axis) == 1)
    safe = o.where(zero, 1.0, x)
    y1 = o.cumprod(o.where(first, 1.0, x), axis=axis)
    return (o.where(zero, o.where(first, _reverse_cumsum(g * y1, axis), 0.0),
                    _reverse_cumsum(g * y, axis) / safe),)


_SCAN_VJPS = {"cumsum": _cumsum_vjp, "cumprod": _cumprod_vjp}


def _register_scan(name, np_fn):
    def abstract(x: TensorType, *, axis):
        if not 0 <= axis < x.ndim:
            raise ShapeError(f"{name}: axis {axis} is out of range for shape {x.shape}")
        return (TensorType(x.shape, _reduce_dtype("sum", x.dtype)),)

    def impl(x, *, axis):
        x = np.asarray(x)
        out = _reduce_dtype("sum", x.dtype)
        with np.errstate(all="ignore"):
            return (np_fn(x.astype(compute_dtype(out), copy=False), axis=axis).astype(
                out, copy=False),)

    def indexing(ins, outs, *, axis):
        subs = "".join(index_name(d) for d in range(ins[0].ndim))
        shardable = {c: "any" for d, c in enumerate(subs) if d != axis}
        return signature_indexing(f"{subs}->{subs}", [ins[0].shape], [outs[0].shape],
                                  shardable)

    def torch_fallback(fspec, x, *, axis):
        import torch  # heavy: only the GPU path
        ct = compute_type(x) if x.is_floating_point() else torch.int64
        return (getattr(torch, name)(x.to(ct), dim=axis),)

    @user_errors
    def fn(x, axis=None):
        x = array_operand(name, x)
        if axis is None:   # numpy: the flattened array
            x = bind("reshape", x, shape=(int(np.prod(x.shape)),))
            axis = 0
        (axis,) = normalize_axes(name, x.shape, axis) if x.shape else (0,)
        return bind(name, x, axis=axis)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"numpy's {name} along ``axis`` (None: of the flattened array); the scanned "
                  f"axis is never split.")
    register(Primitive(name, abstract, impl, lambda i, o, **p: i[0].size, indexing,
                       accumulation=lambda i, o, *, axis: (1, i[0].shape[axis]),
                       kernel_class="reduction", vjp=_SCAN_VJPS[name],
                       lowerings={None: GpuLowering(fallback=torch_fallback)},
                       attr_hints={name: f"use np.{name}(x, axis)"},
                       samples=lambda arr: [(f"{name} axis 1", lambda x: fn(x, axis=1),
                                             (arr(6, 8, lo=0.5, hi=1.5),)),
                                            (f"{name} axis 0 ints", lambda x: fn(x, axis=0),
                                             (arr(6, 4, dtype="int32"),))]))
    return fn


cumsum = _register_scan("cumsum", np.cumsum)
cumprod = _register_scan("cumprod", np.cumprod)
