"""ATen converters for ops a training script reaches early (a loss, gathers by index,
one-hot targets, flips and rolls), each composed of eins's existing primitives. Registered
in eins/frontends/aten.py's table with the same converter signature ``conv(cx, *args)``.

Indices follow torch, not numpy: a negative index is out of range (an
``eins.IndexRangeError`` naming it, on the numpy backend), never an element from the end."""
from __future__ import annotations

import math

import numpy as np

import eins.ops as ops
from eins.frontends.node import dim_of, dims_of, wider
from eins.ops.gather import embedding_rows, gather_along


def broadcast_tensors(cx, tensors):
    """Each tensor broadcast to its recorded shape (``mse_loss`` records one first)."""
    return [t if tuple(t.shape) == tuple(s) else ops.broadcast_to(t, tuple(s))
            for t, s in zip(tensors, cx.shapes)]


def mse_loss(cx, x, y, reduction=1):
    """The squared difference: elementwise (reduction 0, "none"), its mean (1) or sum (2)."""
    if reduction not in (0, 1, 2):
        cx.fail(f"with reduction={reduction!r} (0 none, 1 mean, 2 sum)")
    d = x - y
    sq = d * d
    return sq if reduction == 0 else ops.mean(sq) if reduction == 1 else ops.sum(sq)


def gather(cx, x, dim, index, sparse_grad=False):
    """torch's ``gather``: ``out[..i..] = x[..index[..i..]..]`` along ``dim``, as eins's
    take_along_axis (x first cut to the index's extents on the other dims, which torch
    allows to be smaller); indices in [0, n)."""
    nd = len(x.shape)
    d = dim_of(dim, nd)
    if len(index.shape) != nd:
        cx.fail(f"with an index of rank {len(index.shape)} on a tensor of rank {nd}")
    hi = [x.shape[k] if k == d else index.shape[k] for k in range(nd)]
    if any(h > s for h, s in zip(hi, x.shape)):
        cx.fail(f"with an index of shape {tuple(index.shape)} larger than the tensor's "
                f"{tuple(x.shape)} off dim {d}")
    if tuple(hi) != tuple(x.shape):
        x = ops.slice(x, (0,) * nd, tuple(hi))
    return gather_along(x, index, d)


def index_select(cx, x, dim, index):
    """The slices of ``x`` at ``index`` (1-d, or a scalar) along ``dim``: eins's gather
    primitive, indices in [0, n)."""
    d = dim_of(dim, len(x.shape))
    return ops.reshape(embedding_rows(x, index, axis=d, op="index_select"), tuple(cx.shape))


def one_hot(cx, x, num_classes=-1):
    """``x[..., None] == arange(C)`` as int64. An index outside [0, C) would be a row of
    zeros: a gather of a zero column (C x 1) at ``x`` raises the IndexRangeError naming it
    (and adds nothing)."""
    if num_classes < 0:
        cx.fail("without num_classes (the number of classes would come from the data: "
                "give num_classes)")
    c = int(num_classes)
    hot = ops.astype(ops.reshape(x, tuple(x.shape) + (1,)) == np.arange(c), np.int64)
    checked = embedding_rows(np.zeros((c, 1), np.int64), x, op="one_hot")
    return hot + checked


def flip(cx, x, dims):
    """Each dim in ``dims`` reversed: a gather of constant reversed indices (exact)."""
    for d in dims_of(list(dims), len(x.shape)) or ():
        n = x.shape[d]
        if n > 1:
            x = ops.take(x, np.arange(n - 1, -1, -1), axis=d)
    return x


def _roll1(x, s, d):
    n = x.shape[d]
    s = s % n if n else 0
    if s == 0:
        return x
    lo, hi = [0] * len(x.shape), list(x.shape)
    head = list(hi)
    head[d] = n - s
    tail_lo = list(lo)
    tail_lo[d] = n - s
    return ops.concatenate([ops.slice(x, tuple(tail_lo), tuple(hi)),
                            ops.slice(x, tuple(lo), tuple(head))], axis=d)


def roll(cx, x, shifts, dims=()):
    """Elements shifted by ``shifts`` along ``dims``, wrapping around: the two slices
    concatenated in the other order. No dims: of the flattened tensor."""
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims:
        if len(shifts) != 1:
            cx.fail(f"with shifts {shifts} and no dims (one shift rolls the flattened "
                    f"tensor)")
        flat = _roll1(ops.reshape(x, (math.prod(x.shape),)), shifts[0], 0)
        return ops.reshape(flat, tuple(x.shape))
    if len(shifts) != len(dims):
        cx.fail(f"with {len(shifts)} shifts for {len(dims)} dims")
    for s, d in zip(shifts, dims):
        x = _roll1(x, int(s), dim_of(d, len(x.shape)))
    return x


def logsumexp(cx, x, dim, keepdim=False):
    """``log(sum(exp(x - m))) + m`` with ``m`` the max over ``dim`` (0 where it is
    infinite, as torch: all -inf gives -inf, an inf gives inf)."""
    x = wider(cx, x)
    axes = dims_of(dim, len(x.shape)) or tuple(range(len(x.shape)))
    m = ops.max(x, axes, keepdims=True)
    m = ops.where(ops.isinf(m), np.zeros((), m.dtype), m)
    out = ops.log(ops.sum(ops.exp(x - m), axes, keepdims=True)) + m
    return out if keepdim else ops.reshape(out, tuple(cx.shape))


# overload packet name (without "aten.") -> converter
OPS = {"broadcast_tensors": broadcast_tensors, "mse_loss": mse_loss, "gather": gather,
       "index_select": index_select, "one_hot": one_hot, "flip": flip, "roll": roll,
       "logsumexp": logsumexp}

NOTE = ("eins/frontends/aten_more.py: `mse_loss` (reductions none, mean, sum) of the "
        "`broadcast_tensors` torch records before it; `gather` as eins's "
        "`take_along_axis`, `index_select` as its gather primitive, `one_hot` (a static "
        "`num_classes`) as a comparison with `arange`: indices in [0, n) as torch's, a "
        "negative or too large one an `eins.IndexRangeError` naming it (numpy backend). "
        "`flip` is a gather of reversed constant indices, `roll` two slices concatenated, "
        "`logsumexp` the max-shifted sum (all -inf gives -inf).")
