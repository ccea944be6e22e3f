"""Routing: ``top_k``, ``argmax``/``argmin``, ``argsort`` and ``sort`` along one axis, with
static shapes; everything about the five primitives here.

Orders are numpy's: NaN sorts last (largest), and equal values keep their index order (a
stable sort: ``np.argsort(kind="stable")``, whatever ``kind`` says, so every backend and
plan agrees). ``top_k(x, k)`` returns (values, indices) of the k largest along the last
axis, largest first, ties broken as ``jax.lax.top_k`` does (lowest index first); NaN counts
as the largest. ``argmax``/``argmin`` return the first occurrence (a NaN first, as numpy).
Indices are int64.

Join-agg specs: every dimension but the sorted or reduced one is an index shared by input
and outputs, shardable ``any``; the sorted (reduced) axis is kept whole (a split of it would
need a merge of sorted runs, or a ⊕ over (value, index) pairs).
"""
from __future__ import annotations

import math
import operator

import numpy as np

from eins.errors import ShapeError, TraceError
from eins.ir.joinagg import affine_indexing
from eins.ir.primitive import Primitive, register, register_gpu_lowering
from eins.ir.types import TensorType
from eins.ops._common import (along_transpose, array_operand, index_name, static_flag,
                              user_errors)
from eins.tracing import bind

__all__ = ["top_k", "argmax", "argmin", "argsort", "sort"]

_I64 = np.dtype(np.int64)


def _axis(op, axis, nd) -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise ShapeError(f"{op}: axis must be an int or None, got {axis!r}")
    if not -nd <= axis < nd:
        raise ShapeError(f"{op}: axis {axis} is out of range for an array of rank {nd}")
    return int(axis) % nd


def _check_axis(op, x: TensorType, axis):
    if not 0 <= axis < x.ndim:
        raise ShapeError(f"{op}: axis {axis} is out of range for shape {x.shape}")


def _indexing_without(axis, ins, outs):
    """Every dim but ``axis`` one shardable index, shared by the input and the outputs (an
    output without the axis, keepdims=False, skips it); ``axis`` kept whole."""
    x = ins[0]
    names = {d: index_name(d) for d in range(x.ndim) if d != axis and 0 not in x.shape}
    extents = {names[d]: x.shape[d] for d in names}

    def maps(t):
        dims = list(range(x.ndim)) if t.ndim == x.ndim else [d for d in range(x.ndim)
                                                             if d != axis]
        return [(names[d], 1, 0) if d in names else None for d in dims]
    return affine_indexing(extents, {n: "any" for n in extents}, [maps(x)],
                           [maps(t) for t in outs], [x.shape], [t.shape for t in outs])


def _sort_flops(ins, outs, *, axis=-1, **params):
    x = ins[0]
    n = x.shape[axis] if x.ndim else 1
    return x.size * max(1, math.ceil(math.log2(max(n, 2))))


def descending(x, axis):
    """The indices that order ``x`` along ``axis`` largest first, ties lowest index first
    (NaN first): the stable ascending order of the reversed array, reversed."""
    n = x.shape[axis]
    o = np.argsort(np.flip(x, axis), axis=axis, kind="stable")
    return (n - 1 - np.flip(o, axis)).astype(_I64)


# ----------------------------------------------------------------------------- top_k
def _top_k_abstract(x: TensorType, *, k):
    if x.ndim == 0:
        raise ShapeError("top_k: operand must have at least one dimension, got shape ()")
    if not 0 <= k <= x.shape[-1]:
        raise ShapeError(f"top_k: k={k} is not between 0 and the last axis's length "
                         f"{x.shape[-1]} (shape {x.shape})")
    shape = x.shape[:-1] + (k,)
    return (TensorType(shape, x.dtype), TensorType(shape, _I64))


def _top_k_impl(x, *, k):
    idx = descending(np.asarray(x), -1)[..., :k]
    return (np.take_along_axis(x, idx, -1), idx)


def _top_k_gpu(fspec, outs, ins, *, k):
    """A stable descending ``torch.sort`` (ties lowest index first; torch.topk does not
    promise an order among ties), its first k."""
    import torch  # heavy: only the GPU path
    vals, idx = torch.sort(ins[0], dim=-1, descending=True, stable=True)
    outs[0].copy_(vals[..., :k])
    outs[1].copy_(idx[..., :k])


# The values are differentiable (their cotangents go back to the elements they came from),
# the indices are not (integers: no cotangent).
register(Primitive("top_k", _top_k_abstract, _top_k_impl,
                   lambda i, o, **p: _sort_flops(i, o),
                   lambda i, o, *, k: _indexing_without(i[0].ndim - 1, i, o), kernel_class="sort",
                   vjp=lambda cts, ins, outs, needs, *, k: (
                       along_transpose(cts[0], outs[1], ins[0].shape, len(ins[0].shape) - 1,
                                       ins[0].dtype),),
                   # the family's programs (argmax, argmin, argsort and sort's too)
                   samples=lambda arr: spec_samples(arr)))
register_gpu_lowering("top_k", _top_k_gpu)


@user_errors
def top_k(x, k):
    """(values, indices) of the ``k`` largest elements along the last axis, largest first;
    ties lowest index first (``jax.lax.top_k``); indices int64."""
    x = array_operand("top_k", x)
    if isinstance(k, (bool, np.bool_)):
        raise ShapeError(f"top_k: k must be an int, got {k!r}")
    try:
        k = operator.index(k)
    except TypeError:
        raise ShapeError(f"top_k: k must be an int, got {k!r:.60}") from None
    return bind("top_k", x, k=k)


# ----------------------------------------------------------------------------- argmax / argmin
def _make_arg(name, np_fn):
    def abstract(x: TensorType, *, axis, keepdims):
        _check_axis(name, x, axis)
        if x.shape[axis] == 0:
            raise ShapeError(f"{name}: attempt to get {name} of an empty sequence (axis "
                             f"{axis} of shape {x.shape})")
        shape = tuple(1 if d == axis else n for d, n in enumerate(x.shape) if keepdims
                      or d != axis)
        return (TensorType(shape, _I64),)

    def impl(x, *, axis, keepdims):
        return (np.asarray(np_fn(x, axis=axis, keepdims=keepdims)).astype(_I64),)

    def gpu(fspec, outs, ins, *, axis, keepdims):
        import torch  # heavy: only the GPU path
        x = ins[0]
        if x.dtype == torch.bool:   # torch's argmax takes no bool
            x = x.to(torch.uint8)
        outs[0].copy_(getattr(torch, name)(x, dim=axis, keepdim=keepdims))

    register(Primitive(name, abstract, impl, lambda i, o, **p: i[0].size,
                       lambda i, o, *, axis, keepdims: _indexing_without(axis, i, o),
                       kernel_class="sort"))
    register_gpu_lowering(name, gpu)

    @user_errors
    def fn(x, axis=None, keepdims=False):
        x = array_operand(name, x)
        keep = static_flag(name, "keepdims", keepdims)
        if axis is None:   # over the flattened array
            nd = len(x.shape)
            r = bind(name, bind("reshape", x, shape=(math.prod(x.shape),)), axis=0,
                     keepdims=False)
            return bind("reshape", r, shape=(1,) * nd) if keep else r
        return bind(name, x, axis=_axis(name, axis, len(x.shape)), keepdims=keep)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"numpy's {name}: the index (int64) of the first "
                  f"{'largest' if name == 'argmax' else 'smallest'} element along ``axis`` "
                  f"(None: of the flattened array), NaN first; ``keepdims``.")
    return fn


argmax = _make_arg("argmax", np.argmax)
argmin = _make_arg("argmin", np.argmin)


# ----------------------------------------------------------------------------- sort / argsort
def _sort_abstract(x: TensorType, *, axis, indices):
    _check_axis("argsort" if indices else "sort", x, axis)
    return (TensorType(x.shape, _I64 if indices else x.dtype),)


def _sort_impl(x, *, axis, indices):
    o = np.argsort(x, axis=axis, kind="stable")
    return (o.astype(_I64),) if indices else (np.take_along_axis(x, o, axis),)


def _sort_gpu(fspec, outs, ins, *, axis, indices):
    import torch  # heavy: only the GPU path
    vals, idx = torch.sort(ins[0], dim=axis, stable=True)
    outs[0].copy_(idx if indices else vals)


def _sort_vjp(cts, ins, outs, needs, *, axis, indices):
    """The sorted values' cotangents back to where they came from: the order recomputed
    (an argsort of the same operand) and scattered through. argsort's result is integers
    and gets none."""
    order = bind("sort", ins[0], axis=axis, indices=True)
    return (along_transpose(cts[0], order, ins[0].shape, axis, ins[0].dtype),)


register(Primitive("sort", _sort_abstract, _sort_impl, _sort_flops,
                   lambda i, o, *, axis, indices: _indexing_without(axis, i, o),
                   kernel_class="sort",
                   vjp=_sort_vjp,
                   attr_hints={"sort": "ndarray.sort sorts in place; use np.sort(x, axis)"}))
register_gpu_lowering("sort", _sort_gpu)


def _sort_front(op, x, axis, kind, order, stable):
    x = array_operand(op, x)
    if order is not None:
        raise TraceError(f"{op}: order={order!r} sorts structured arrays, which eins does not "
                         f"have")
    if kind not in (None, "quicksort", "mergesort", "heapsort", "stable"):
        raise TraceError(f"{op}: unknown kind {kind!r} (numpy's: 'quicksort', 'mergesort', "
                         f"'heapsort', 'stable'; eins's sort is always stable)")
    if stable not in (None, True, False):
        raise TraceError(f"{op}: stable must be True, False or None, got {stable!r}")
    if axis is None:
        return bind("reshape", x, shape=(math.prod(x.shape),)), 0
    if len(x.shape) == 0:
        raise ShapeError(f"{op}: a 0-d array has no axis {axis} to sort along")
    return x, _axis(op, axis, len(x.shape))


@user_errors
def sort(x, axis=-1, kind=None, order=None, *, stable=None):
    """numpy's sort along ``axis`` (None: the flattened array); NaN last; always stable."""
    x, axis = _sort_front("sort", x, axis, kind, order, stable)
    return bind("sort", x, axis=axis, indices=False)


@user_errors
def argsort(x, axis=-1, kind=None, order=None, *, stable=None):
    """numpy's argsort (int64) along ``axis`` (None: the flattened array); NaN last;
    always stable (equal elements keep their order, ``kind="stable"``)."""
    x, axis = _sort_front("argsort", x, axis, kind, order, stable)
    return bind("sort", x, axis=axis, indices=True)


def spec_samples(arr):
    """Small programs for eins.validate_specs; values rounded so that ties occur."""
    def tied(*shape):
        return np.round(arr(*shape) * 2) / 2

    return [
        ("top_k ties", lambda x: top_k(x, 3), (tied(6, 8),)),
        ("top_k f32 3-d", lambda x: top_k(x, 4), (tied(4, 6, 8).astype(np.float32),)),
        ("argmax axis 1", lambda x: argmax(x, axis=1), (tied(6, 8),)),
        ("argmin axis 0 keepdims", lambda x: argmin(x, axis=0, keepdims=True), (tied(8, 6),)),
        ("argmax int32 all", lambda x: argmax(x), (arr(6, 4, dtype="int32"),)),
        ("argsort axis 0", lambda x: argsort(x, axis=0), (tied(8, 6),)),
        ("sort axis 1", lambda x: sort(x, axis=1), (tied(6, 8),)),
    ]
