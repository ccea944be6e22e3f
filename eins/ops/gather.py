"""Gather and scatter: integer-array indexing (``x[ids]``, ``x[:, ids]``,
``logp[np.arange(B), y]``), ``take``, ``take_along_axis`` and the functional update
``x.at[idx].set(v)`` / ``.add(v)`` (JAX's), everything about the three primitives here.

- ``gather(x, i_0, ..., i_{k-1}; axis, n)``: numpy's ``x[:, ..., i_0, ..., i_{k-1}, ...]``
  with the k index arrays on the adjacent axes ``axis .. axis+k-1`` (extents ``n``),
  broadcast together to ``B``: shape ``x.shape[:axis] + B + x.shape[axis+k:]``.
- ``take_along(x, i; axis, n)``: numpy's ``take_along_axis`` (x and i share their other
  dims, broadcast).
- ``scatter(x, i_0, ..., v; axis, n, mode)``: ``x`` with ``x[.., i_0, .., ..]`` set to, or
  (``mode="add"``) incremented by, ``v`` (broadcast to the gather's shape, cast to x's
  dtype); repeated indices add up, or the last one wins for ``set`` (numpy's order; on
  the GPU one of them, unspecified, as in JAX).

Join-agg specs (Section 3.3): the index arrays' dims (tokens) and x's other dims (features)
are shared with the output and shardable. x's indexed axes (the table's rows: vocabulary)
appear in no output of a gather: contracted, ⊕ = sum. A block holding rows [lo, hi) writes
the rows its indices pick inside them and ``-0.0`` (0, False) elsewhere, the identity of +
for every value (``-0.0 + -0.0`` stays ``-0.0``), so the sum recomposes exactly: Megatron's
vocab-parallel embedding, found by the DP. A scatter's output keeps x's dims (each block
updates the rows it holds); with ``mode="add"`` the updates' dims are contracted too (⊕ =
sum: the block holding the first updates starts from x, the others from zeros).

Out-of-range indices follow numpy: an :class:`~eins.errors.IndexRangeError` for constants
at trace time and, on the numpy backend, at run time (each block checks against the global
extent ``n``); negative indices count from the end. A gather with ``wrap=False`` (torch's
``embedding``: :func:`embedding_rows`) takes indices in [0, n) only: a negative one is out
of range too. The GPU lowerings cannot check without a device sync: there an index outside
[-n, n) (with ``wrap=False``, [0, n)) reads zeros (gather) or is dropped (scatter).
"""
from __future__ import annotations

import math
import operator

import numpy as np

from eins.errors import DTypeError, IndexRangeError, ShapeError, TraceError
from eins.ir.joinagg import affine_indexing
from eins.ir.primitive import Primitive, register, register_gpu_lowering
from eins.ir.program import Literal
from eins.ir.types import TensorType, is_float, is_python_scalar
from eins.ops._common import (along_transpose, broadcast_shape, compute_dtype, filled,
                              index_name, unbroadcast, user_errors)
from eins.ops import gather_gpu as gpu
from eins.ops.gather_gpu import block_rows, holds_first
from eins.tracing import Tracer, bind, not_an_array

__all__ = ["take", "take_along_axis", "at"]


def _zero(dtype):
    """The fill of rows a block does not hold: the identity of the sum ⊕ (-0.0 for floats)."""
    dtype = np.dtype(dtype)
    return np.array(-0.0 if is_float(dtype) else 0, dtype)


def _index_dtype(op: str, t):
    """A DTypeError unless ``t`` (anything with a shape and a dtype) holds integers."""
    dt = np.dtype(t.dtype)
    if dt.kind not in "iu":
        raise DTypeError(f"{op}: indices must be integers, got dtype {dt.name} (shape "
                         f"{tuple(t.shape)})" + (
                             "; a boolean mask selects a data-dependent number of elements: "
                             "use np.where(mask, x, 0) instead" if dt == np.bool_ else ""))


def check_range(op: str, ids, n: int, axis: int, wrap: bool = True) -> np.ndarray:
    """``ids`` (integers) with negatives counted from the end, as int64; an IndexRangeError
    naming the first offending value when one lies outside [-n, n) (numpy's rule), or
    outside [0, n) when not ``wrap`` (torch's embedding: no negative ids)."""
    ids = np.asarray(ids)
    if ids.size:
        lo, hi, least = int(ids.min()), int(ids.max()), -n if wrap else 0
        if lo < least or hi >= n:
            bad = lo if lo < least else hi
            raise IndexRangeError(f"{op}: index {bad} is out of bounds for axis {axis} with "
                                  f"size {n}" + ("" if wrap else f" (indices lie in [0, {n})"
                                                                 f": no negatives)"))
    ids = ids.astype(np.int64, copy=False)
    return np.where(ids < 0, ids + n, ids)


# ----------------------------------------------------------------------------- gather
def _gather_shape(op, x: TensorType, ids, axis, n):
    k = len(ids)
    if not 0 <= axis <= x.ndim - k:
        raise ShapeError(f"{op}: {k} index arrays from axis {axis} do not fit shape {x.shape}")
    if tuple(n) != tuple(x.shape[axis:axis + k]):
        raise ShapeError(f"{op}: extents {tuple(n)} are not those of axes {axis}.. of "
                         f"shape {x.shape}")
    for t in ids:
        _index_dtype(op, t)
    b = broadcast_shape(*(t.shape for t in ids))
    if b is None:
        raise ShapeError(f"{op}: index arrays of shapes {[t.shape for t in ids]} do not "
                         f"broadcast together")
    return tuple(x.shape[:axis]) + b + tuple(x.shape[axis + k:]), b


def _gather_abstract(x: TensorType, *ids: TensorType, axis, n, wrap=True):
    if not ids:
        raise ShapeError("gather: needs at least one index array")
    shape, _ = _gather_shape("gather", x, ids, axis, n)
    return (TensorType(shape, x.dtype),)


def _gather_block(fspec, x, *ids, axis, n, wrap=True):
    lo, hi = block_rows(fspec, 0, axis, n)
    g = np.broadcast_arrays(*(check_range("gather", i, nj, axis + j, wrap)
                              for j, (i, nj) in enumerate(zip(ids, n))))
    lead = (slice(None),) * axis
    if lo == [0] * len(n) and hi == list(n):
        return (np.array(x[lead + tuple(g)]),)
    inside = np.logical_and.reduce([(gj >= l) & (gj < h) for gj, l, h in zip(g, lo, hi)])
    local = tuple(np.clip(gj - l, 0, max(h - l - 1, 0)) for gj, l, h in zip(g, lo, hi))
    vals = x[lead + local]
    trail = x.ndim - axis - len(n)
    mask = inside.reshape((1,) * axis + inside.shape + (1,) * trail)
    return (np.where(mask, vals, _zero(x.dtype)),)


def _gather_impl(x, *ids, axis, n, wrap=True):
    return _gather_block(None, x, *ids, axis=axis, n=n, wrap=wrap)


def _out_names(out_shape):
    """Each output dim's index name (None for a dim of an empty output: one whole block)."""
    empty = 0 in out_shape
    return [None if empty else index_name(d) for d in range(len(out_shape))]


def _aligned(shape, names, full):
    """Maps of an operand of ``shape`` right-aligned against dims ``names`` of extents
    ``full``: a dim broadcast from 1 (or unnamed) is kept whole."""
    off = len(full) - len(shape)
    return [None if names[off + e] is None or s != full[off + e] else (names[off + e], 1, 0)
            for e, s in enumerate(shape)]


def _gather_indexing(ins, outs, *, axis, n, wrap=True):
    x, ids, out = ins[0], ins[1:], outs[0]
    k, nb = len(ids), outs[0].ndim - ins[0].ndim + len(ids)
    names = _out_names(out.shape)
    extents = {c: e for c, e in zip(names, out.shape) if c is not None}
    rows = [index_name(out.ndim + j) if nj > 0 else None for j, nj in enumerate(n)]
    extents.update((r, nj) for r, nj in zip(rows, n) if r is not None)
    x_map = ([(names[d], 1, 0) if names[d] else None for d in range(axis)]
             + [(r, 1, 0) if r else None for r in rows]
             + [(names[d], 1, 0) if names[d] else None for d in range(axis + nb, out.ndim)])
    b_names = names[axis:axis + nb]
    in_maps = [x_map] + [_aligned(t.shape, b_names, out.shape[axis:axis + nb]) for t in ids]
    out_map = [(c, 1, 0) if c else None for c in names]
    return affine_indexing(extents, {c: "any" for c in extents}, in_maps, [out_map],
                           [t.shape for t in ins], [out.shape])


def _gather_bytes(ins, outs, **params):
    """The indices, the rows read (at most the table) and the output written."""
    x, out = ins[0], outs[0]
    return sum(t.nbytes for t in ins[1:]) + min(out.nbytes, x.nbytes) + out.nbytes


# the gather family's kernels touch only the rows their indices pick: their bytes
# (Primitive.bytes_fn) are those rows, not the whole table
def _gather_vjp(cts, ins, outs, needs, *, axis, n, wrap=True):
    """The rows read get the cotangent added back (repeated indices add up): a scatter-add
    into zeros. The indices are integers: no cotangent. (``wrap=False``: the forward
    refused a negative index.)"""
    zeros = filled(ins[0].shape, 0, ins[0].dtype)
    return (bind("scatter", zeros, *ins[1:], cts[0], axis=axis, n=n, mode="add"),) + \
        (None,) * (len(ins) - 1)


register(Primitive("gather", _gather_abstract, _gather_impl,
                   lambda i, o, **p: o[0].size, _gather_indexing, _gather_block,
                   bytes_fn=_gather_bytes, kernel_class="gather", vjp=_gather_vjp,
                   # the family's programs (take_along and scatter's too)
                   samples=lambda arr: spec_samples(arr)))


# ----------------------------------------------------------------------------- take_along
def _along_abstract(x: TensorType, ids: TensorType, *, axis, n, wrap=True):
    _index_dtype("take_along_axis", ids)
    if x.ndim != ids.ndim:
        raise ShapeError(f"take_along_axis: indices of shape {ids.shape} and array of shape "
                         f"{x.shape} must have the same number of dimensions")
    if not 0 <= axis < x.ndim or n != x.shape[axis]:
        raise ShapeError(f"take_along_axis: axis {axis} (extent {n}) does not fit shape "
                         f"{x.shape}")
    rest = broadcast_shape(x.shape[:axis] + x.shape[axis + 1:],
                           ids.shape[:axis] + ids.shape[axis + 1:])
    if rest is None:
        raise ShapeError(f"take_along_axis: indices of shape {ids.shape} do not broadcast "
                         f"against the array of shape {x.shape} outside axis {axis}")
    return (TensorType(rest[:axis] + (ids.shape[axis],) + rest[axis:], x.dtype),)


def _along_block(fspec, x, ids, *, axis, n, wrap=True):
    (lo,), (hi,) = block_rows(fspec, 0, axis, (n,))
    g = check_range("take_along_axis", ids, n, axis, wrap)
    if lo == 0 and hi == n:
        return (np.take_along_axis(x, g, axis),)
    inside = (g >= lo) & (g < hi)
    vals = np.take_along_axis(x, np.clip(g - lo, 0, max(hi - lo - 1, 0)), axis)
    return (np.where(inside, vals, _zero(x.dtype)),)


def _along_indexing(ins, outs, *, axis, n, wrap=True):
    x, ids, out = ins[0], ins[1], outs[0]
    names = _out_names(out.shape)
    extents = {c: e for c, e in zip(names, out.shape) if c is not None}
    row = index_name(out.ndim) if n > 0 and names[axis] else None
    if row:
        extents[row] = n

    def maps(t, at_axis):
        return [at_axis if d == axis else
                (names[d], 1, 0) if names[d] and s == out.shape[d] else None
                for d, s in enumerate(t.shape)]
    x_map = maps(x, (row, 1, 0) if row else None)
    i_map = maps(ids, (names[axis], 1, 0) if names[axis] else None)
    out_map = [(c, 1, 0) if c else None for c in names]
    return affine_indexing(extents, {c: "any" for c in extents}, [x_map, i_map], [out_map],
                           [x.shape, ids.shape], [out.shape])


register(Primitive("take_along", _along_abstract,
                   lambda x, ids, **p: _along_block(None, x, ids, **p),
                   lambda i, o, **p: o[0].size, _along_indexing, _along_block,
                   bytes_fn=_gather_bytes, kernel_class="gather",
                   vjp=lambda cts, ins, outs, needs, *, axis, n, wrap=True: (
                       along_transpose(cts[0], ins[1], ins[0].shape, axis, ins[0].dtype),
                       None)))


# ----------------------------------------------------------------------------- scatter
def _scatter_abstract(x: TensorType, *rest: TensorType, axis, n, mode):
    if mode not in ("set", "add"):
        raise ShapeError(f"scatter: mode must be 'set' or 'add', got {mode!r}")
    if len(rest) < 2:
        raise ShapeError("scatter: needs index arrays and the values")
    ids, v = rest[:-1], rest[-1]
    g, _ = _gather_shape("scatter", x, ids, axis, n)
    if broadcast_shape(v.shape, g) != g:
        raise ShapeError(f"at[...].{mode}: values of shape {v.shape} do not broadcast to the "
                         f"indexed shape {g} of the array of shape {x.shape}")
    return (TensorType(x.shape, x.dtype),)


def _scatter_block(fspec, x, *rest, axis, n, mode):
    ids, v = rest[:-1], np.asarray(rest[-1])
    k = len(ids)
    lo, hi = block_rows(fspec, 0, axis, n)
    out = np.array(x) if holds_first(fspec, range(1, k + 1)) else np.full(x.shape, _zero(x.dtype))
    g = np.broadcast_arrays(*(check_range("scatter", i, nj, axis + j)
                              for j, (i, nj) in enumerate(zip(ids, n))))
    b = g[0].shape
    trail = x.shape[axis + k:]
    vals = np.broadcast_to(v, x.shape[:axis] + b + trail)
    if not b:   # one element: as a 1-long axis (np.nonzero takes no 0-d array)
        g = [gj.reshape(1) for gj in g]
        vals = vals.reshape(x.shape[:axis] + (1,) + trail)
    inside = np.logical_and.reduce([(gj >= l) & (gj < h) for gj, l, h in zip(g, lo, hi)])
    sel = np.nonzero(inside)
    lead = (slice(None),) * axis
    where = lead + tuple(gj[sel] - l for gj, l in zip(g, lo))
    picked = vals[lead + sel]
    if mode == "set":
        out[where] = picked
        return (out,)
    ct = compute_dtype(out.dtype)
    acc = out.astype(ct, copy=False)
    np.add.at(acc, where, picked.astype(ct))
    return (acc.astype(x.dtype, copy=False),)


def _scatter_indexing(ins, outs, *, axis, n, mode):
    x, ids, v = ins[0], ins[1:-1], ins[-1]
    k = len(ids)
    names = _out_names(x.shape)
    extents = {c: e for c, e in zip(names, x.shape) if c is not None}
    _, b = _gather_shape("scatter", x, ids, axis, n)
    b_names = [None if 0 in b else index_name(x.ndim + j) for j in range(len(b))]
    extents.update((c, e) for c, e in zip(b_names, b) if c is not None)
    g_names = names[:axis] + b_names + names[axis + k:]
    g_shape = x.shape[:axis] + b + x.shape[axis + k:]
    x_map = [(c, 1, 0) if c else None for c in names]
    in_maps = ([x_map] + [_aligned(t.shape, b_names, b) for t in ids]
               + [_aligned(v.shape, g_names, g_shape)])
    # a set's updates are never split: the last write to a row must stay the last
    shardable = {c: "any" for c in extents if mode == "add" or c not in b_names}
    return affine_indexing(extents, shardable, in_maps, [x_map],
                           [t.shape for t in ins], [x.shape])


def _scatter_bytes(ins, outs, **params):
    """x copied to the output, the indices and values read, the updated rows written (at
    the values' size: the bytes' lower bound where they broadcast)."""
    return 2 * ins[0].nbytes + sum(t.nbytes for t in ins[1:]) + ins[-1].size * \
        ins[0].dtype.itemsize


def _scatter_vjp(cts, ins, outs, needs, *, axis, n, mode):
    """add: x's cotangent as it is, the values' the rows they went to (gathered). set: x's
    cotangent with the overwritten rows zeroed, and the values' gathered where a value is
    the one that was written (of repeated indices, the last on numpy), zero elsewhere: the
    writer is found by scattering each update's position the same way."""
    g = cts[0]
    x, ids, v = ins[0], ins[1:-1], ins[-1]
    dx = dv = None
    if needs[0]:
        dx = g if mode == "add" else bind("scatter", g, *ids, filled((), 0, g.dtype),
                                          axis=axis, n=n, mode="set")
    if needs[-1]:
        got = bind("gather", g, *ids, axis=axis, n=n)
        if mode == "set":
            b = broadcast_shape(*(t.shape for t in ids))
            trail = len(x.shape) - axis - len(ids)
            pos = np.arange(math.prod(b), dtype=np.int64).reshape(
                (1,) * axis + tuple(b) + (1,) * trail)
            writer = bind("scatter", filled(x.shape, -1, np.int64), *ids, pos, axis=axis,
                          n=n, mode="set")
            won = bind("equal", bind("gather", writer, *ids, axis=axis, n=n), pos)
            got = bind("where", won, got, Literal(0, g.dtype))
        dv = unbroadcast(got, v.shape)
    return (dx,) + (None,) * len(ids) + (dv,)


register(Primitive("scatter", _scatter_abstract,
                   lambda x, *r, **p: _scatter_block(None, x, *r, **p),
                   lambda i, o, *, mode, **p: i[-1].size if mode == "add" else 0,
                   _scatter_indexing, _scatter_block, bytes_fn=_scatter_bytes,
                   kernel_class="gather", vjp=_scatter_vjp))

register_gpu_lowering("gather", gpu.gather_gpu)   # eins/ops/gather_gpu.py
register_gpu_lowering("take_along", gpu.along_gpu)
register_gpu_lowering("scatter", gpu.scatter_gpu)


# ----------------------------------------------------------------------------- front ends
def _is_array_index(it) -> bool:
    return isinstance(it, (Tracer, list, np.ndarray))


def _static_int(op, it):
    if isinstance(it, (bool, np.bool_)):
        raise TraceError(f"{op}: a bool index ({it!r}) selects a data-dependent number of "
                         f"elements; use np.where(mask, x, 0) instead")
    try:
        return operator.index(it)
    except TypeError:
        raise TraceError(f"{op}: index {it!r:.60} of type {type(it).__name__} is not an "
                         f"int, a slice, ... or an integer array") from None


def _index_operand(op, it, n: int, axis: int):
    """An integer-array index as an operand: a traced integer array as it is, anything else
    (an int, a list, a numpy array) a constant whose range is checked now."""
    if isinstance(it, Tracer):
        _index_dtype(op, it)
        return it
    if isinstance(it, (int, np.integer, bool, np.bool_)):
        it = _static_int(op, it)
    elif isinstance(it, list) and any(isinstance(e, Tracer) for e in it):
        raise TraceError(f"{op}: a list holding traced arrays is not an index; stack them "
                         f"into one integer array first")
    arr = np.asarray(it)
    if arr.size == 0 and arr.dtype.kind == "f":   # x[[]]: numpy's empty integer index
        arr = arr.astype(np.int64)
    _index_dtype(op, arr)
    check_range(op, arr, n, axis)
    return arr.astype(np.int64)


def _expand(op, items, nd):
    """The index with ``...`` expanded and every dimension named (``None`` refused)."""
    if any(it is None for it in items):
        raise TraceError(f"{op}: None (np.newaxis) together with an integer-array index is "
                         f"not supported; index first, then add the axis with reshape")
    if sum(1 for it in items if it is Ellipsis) > 1:
        raise ShapeError(f"{op}: an index can only have one ellipsis")
    real = sum(1 for it in items if it is not Ellipsis)
    if real > nd:
        raise IndexRangeError(f"{op}: too many indices ({real}) for an array of rank {nd}")
    if Ellipsis in [it for it in items if not _is_array_index(it)]:
        k = next(i for i, it in enumerate(items) if it is Ellipsis)
        return items[:k] + (slice(None),) * (nd - real) + items[k + 1:]
    return items + (slice(None),) * (nd - real)


def _arange_of(it, n) -> bool:
    return (isinstance(it, np.ndarray) and it.shape == (n,) and it.dtype.kind in "iu"
            and bool(np.array_equal(it, np.arange(n))))


def _gather_along(x, adv, ops):
    """``x[.., arange(m), ids, ..]`` (or ids then arange) on adjacent axes as
    take_along_axis: x's and ids' row dim stay one index, so a split by rows needs no
    other device's rows (a gather of both would read them from every device)."""
    p = adv[0]
    nd = len(x.shape)
    rows = 0 if _arange_of(ops[0], x.shape[p]) else 1
    ids, along = ops[1 - rows], p + 1 - rows
    shape = [1] * nd
    shape[p + rows] = x.shape[p + rows]
    ids = bind("reshape", ids, shape=tuple(shape))
    out = bind("take_along", x, ids, axis=along, n=x.shape[along])
    return bind("reshape", out, shape=tuple(s for d, s in enumerate(out.shape) if d != along))


@user_errors
def getitem(x, idx, basic):
    """``x[idx]``: ``basic(x, idx)`` (static slicing, eins.ops.shape) unless an integer
    array (traced, numpy or a list) is among the indices; then numpy's advanced indexing:
    the slices first, then one gather of the arrays and ints, which broadcast together;
    their dims replace the indexed ones in place when those are adjacent, else go first."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if not any(map(_is_array_index, items)):
        return basic(x, idx)
    nd = len(x.shape)
    items = _expand("getitem", items, nd)
    adv = [d for d, it in enumerate(items) if not isinstance(it, slice)]
    cut = tuple(slice(None) if d in adv else it for d, it in enumerate(items))
    y = x if all(c == slice(None) for c in cut) else basic(x, cut)
    ops = [_index_operand("getitem", items[d], y.shape[d], d) for d in adv]
    if len(adv) == 2 and adv[1] == adv[0] + 1 and all(
            len(o.shape) == 1 and o.shape == ops[0].shape for o in ops) and any(
            isinstance(o, Tracer) for o in ops) and any(
            _arange_of(o, y.shape[d]) for o, d in zip(ops, adv)):
        return _gather_along(y, adv, ops)
    if adv != list(range(adv[0], adv[-1] + 1)):
        y = bind("transpose", y, axes=tuple(adv + [d for d in range(nd) if d not in adv]))
        adv = list(range(len(adv)))
    return bind("gather", y, *ops, axis=adv[0], n=tuple(y.shape[d] for d in adv))


def _axis(op, axis, nd) -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise ShapeError(f"{op}: axis must be an int or None, got {axis!r}")
    if not -nd <= axis < nd:
        raise ShapeError(f"{op}: axis {axis} is out of range for an array of rank {nd}")
    return int(axis) % nd


def _array(op, x):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise not_an_array(op, x)
    return x


def _flat(x):
    return bind("reshape", x, shape=(math.prod(x.shape),))


@user_errors
def take(a, indices, axis=None):
    """numpy's take: the elements of ``a`` at integer ``indices`` along ``axis`` (None: of
    the flattened array); ``indices`` traced, a numpy array, a list or an int."""
    x = _array("take", a)
    if axis is None:
        x, axis = _flat(x), 0
    axis = _axis("take", axis, len(x.shape))
    ids = _index_operand("take", indices, x.shape[axis], axis)
    return bind("gather", x, ids, axis=axis, n=(x.shape[axis],))


def _no_negatives(op, ids, n, axis):
    """A constant integer index checked against [0, n) (torch's rule: the IndexRangeError
    names a negative index as it is, not as numpy's range [-n, n) would)."""
    arr = np.asarray(ids)
    if arr.dtype.kind in "iu":
        check_range(op, arr, n, axis, wrap=False)


@user_errors
def embedding_rows(table, ids, axis=0, op="embedding"):
    """``table[ids]`` with ``ids`` in [0, len(table)): torch's ``embedding``, where a
    negative id is out of range (an IndexRangeError naming it), not a row from the end;
    along ``axis``, torch's ``index_select`` (``op`` names it in errors)."""
    x = _array(op, table)
    if not x.shape:
        raise ShapeError(f"{op}: the table must have at least one dimension, got a 0-d "
                         f"array")
    axis = _axis(op, axis, len(x.shape))
    n = x.shape[axis]
    if not isinstance(ids, Tracer):
        _no_negatives(op, ids, n, axis)
        ids = _index_operand(op, ids, n, axis)
    _index_dtype(op, ids)
    return bind("gather", x, ids, axis=axis, n=(n,), wrap=False)


@user_errors
def take_along_axis(arr, indices, axis=-1):
    """numpy's take_along_axis: ``out[.., i, ..] = arr[.., indices[.., i, ..], ..]`` along
    ``axis`` (None: of the flattened array, with 1-d ``indices``); the other dims of ``arr``
    and ``indices`` broadcast."""
    x = _array("take_along_axis", arr)
    if axis is None:
        x, axis = _flat(x), 0
    nd = len(x.shape)
    axis = _axis("take_along_axis", axis, nd)
    if len(getattr(indices, "shape", ())) != nd:
        raise ShapeError(f"take_along_axis: indices of shape "
                         f"{tuple(getattr(indices, 'shape', ()))} and array of shape "
                         f"{tuple(x.shape)} must have the same number of dimensions")
    ids = _index_operand("take_along_axis", indices, x.shape[axis], axis)
    return bind("take_along", x, ids, axis=axis, n=x.shape[axis])


@user_errors
def gather_along(arr, indices, axis):
    """torch's ``gather``: :func:`take_along_axis` with ``indices`` in [0, n), a negative
    one out of range (an IndexRangeError naming it), not counted from the end."""
    x = _array("gather", arr)
    axis = _axis("gather", axis, len(x.shape))
    if len(getattr(indices, "shape", ())) != len(x.shape):
        raise ShapeError(f"gather: indices of shape {tuple(getattr(indices, 'shape', ()))} "
                         f"and array of shape {tuple(x.shape)} must have the same number "
                         f"of dimensions")
    n = x.shape[axis]
    if not isinstance(indices, Tracer):
        _no_negatives("gather", indices, n, axis)
    ids = _index_operand("gather", indices, n, axis)
    return bind("take_along", x, ids, axis=axis, n=n, wrap=False)


# ----------------------------------------------------------------------------- .at[...]
def _full(it, n) -> bool:
    return isinstance(it, slice) and it.indices(n) == (0, n, 1)


def _update_operands(op, items, shape):
    """(indexed axes, index operands) of an update's index: integer arrays and ints (with
    full slices elsewhere), or static ints and step-1 slices, which become constant index
    arrays of an open mesh (numpy's outer indexing) over the span they cover."""
    nd = len(shape)
    if any(map(_is_array_index, items)):
        adv = [d for d, it in enumerate(items) if not isinstance(it, slice)]
        part = [d for d in range(nd) if d not in adv and not _full(items[d], shape[d])]
        if part:
            raise TraceError(f"{op}: the slice {items[part[0]]!r} together with an integer-"
                             f"array index is not supported; index the other dimensions "
                             f"with full slices (:) or with arrays")
        return adv, [_index_operand(op, items[d], shape[d], d) for d in adv]
    span = [d for d, it in enumerate(items) if not _full(it, shape[d])] or [0]
    adv = list(range(span[0], span[-1] + 1))
    sl = [d for d in adv if isinstance(items[d], slice)]
    ops = []
    for d in adv:
        it = items[d]
        if not isinstance(it, slice):
            ops.append(_index_operand(op, it, shape[d], d))
            continue
        if it.step not in (None, 1):
            raise ShapeError(f"{op}: only step-1 slices are supported, got {it!r}")
        a, b, _ = it.indices(shape[d])
        j = sl.index(d)
        ops.append(np.arange(a, max(a, b)).reshape(
            (1,) * j + (max(b - a, 0),) + (1,) * (len(sl) - 1 - j)))
    return adv, ops


@user_errors
def _update(x, idx, v, mode):
    op = f"at[...].{mode}"
    shape = tuple(_array(op, x).shape)
    if not shape:
        raise ShapeError(f"{op}: a 0-d array has no element to index; use the new value "
                         f"itself")
    items = _expand(op, idx if isinstance(idx, tuple) else (idx,), len(shape))
    adv, ops = _update_operands(op, items, shape)
    if is_python_scalar(v):
        v = np.asarray(v, dtype=x.dtype)
    _array(op, v)
    n = tuple(shape[d] for d in adv)
    if adv == list(range(adv[0], adv[-1] + 1)):
        return bind("scatter", x, *ops, v, axis=adv[0], n=n, mode=mode)
    perm = tuple(adv + [d for d in range(len(shape)) if d not in adv])
    out = bind("scatter", bind("transpose", x, axes=perm), *ops, v, axis=0, n=n, mode=mode)
    return bind("transpose", out, axes=tuple(int(a) for a in np.argsort(perm)))


class _AtIndex:
    __slots__ = ("_x", "_idx")

    def __init__(self, x, idx):
        self._x, self._idx = x, idx

    def set(self, values):
        """A new array: ``x`` with ``x[idx]`` replaced by ``values`` (broadcast, cast to
        x's dtype; of repeated indices the last one wins)."""
        return _update(self._x, self._idx, values, "set")

    def add(self, values):
        """A new array: ``x`` with ``values`` added at ``idx``; repeated indices add up."""
        return _update(self._x, self._idx, values, "add")

    def get(self):
        """``x[idx]``."""
        return self._x[self._idx]


class _At:
    __slots__ = ("_x",)

    def __init__(self, x):
        self._x = x

    def __getitem__(self, idx):
        return _AtIndex(self._x, idx)


def at(x):
    """JAX's functional update, ``eins.at(x)[idx].set(v)`` / ``.add(v)`` (``x.at[idx]`` on
    a traced array): a new array, x unchanged. ``idx``: integer arrays (traced or constant)
    and ints with full slices elsewhere, or static ints and step-1 slices."""
    return _At(_array("at", x))


# ----------------------------------------------------------------------------- spec samples
def spec_samples(arr):
    """Small programs for eins.validate_specs (``arr(*shape, dtype=...)`` makes operands):
    negative and repeated indices, broadcast index arrays, every dtype family."""
    rng = np.random.default_rng(33)

    def ids(n, *shape):
        return rng.integers(-n, n, size=shape)

    return [
        ("gather rows (embedding)", lambda t, i: take(t, i, axis=0), (arr(12, 6), ids(12, 8))),
        ("embedding rows, no wrap", embedding_rows, (arr(12, 6), ids(12, 2, 8) % 12)),
        ("gather 2-d ids axis 1 f32", lambda t, i: t[:, i],
         (arr(4, 12, 6, dtype="float32"), ids(12, 2, 6))),
        ("gather two broadcast arrays", lambda t, i, j: t[i[:, None], j],
         (arr(8, 6, 4), ids(8, 4), ids(6, 6))),
        ("gather bool table", lambda t, i: t[i], (arr(12, 4, dtype="bool"), ids(12, 6))),
        ("gather int32 0-d index", lambda t, i: take(t, i, axis=1),
         (arr(6, 8, dtype="int32"), np.array(-3))),
        ("take_along_axis", lambda t, i: take_along_axis(t, i, axis=1),
         (arr(6, 12), ids(12, 6, 3))),
        ("take_along_axis broadcast", lambda t, i: take_along_axis(t, i, axis=1),
         (arr(6, 12, 1, dtype="float32"), ids(12, 6, 3, 4))),
        ("logp[arange, y]", lambda t, y: t[np.arange(8), y], (arr(8, 12), ids(12, 8))),
        ("scatter set, repeated rows", lambda t, i, v: at(t)[i].set(v),
         (arr(12, 6), ids(12, 8), arr(8, 6))),
        ("scatter add, repeated rows", lambda t, i, v: at(t)[i].add(v),
         (arr(12, 6), ids(12, 8), arr(8, 6))),
        ("scatter add broadcast values f32", lambda t, i, v: at(t)[:, i].add(v),
         (arr(6, 12, dtype="float32"), ids(12, 2, 4), arr(4, dtype="float32"))),
        ("scatter add int64", lambda t, i, v: at(t)[i].add(v),
         (arr(12, 4, dtype="int64"), ids(12, 6), arr(6, 4, dtype="int64"))),
        ("scatter set slices", lambda t, v: at(t)[1:7, 2:5].set(v), (arr(8, 6), arr(6, 3))),
        ("scatter add two arrays", lambda t, i, j, v: at(t)[i[:, None], j].add(v),
         (arr(8, 6, 4), ids(8, 4), ids(6, 6), arr(4, 6, 4))),
    ]

