"""ATen converters for what transformers' default mixture-of-experts layer records
(``grouped_mm_experts_forward``: tokens sorted by expert, counted with ``histc``, offsets by
``cumsum``, the experts' matmuls as one ``_grouped_mm``, the order restored through an
``index_put``), written with eins's static-shaped primitives. Registered in
eins/frontends/aten.py's table with the same converter signature ``conv(cx, *args)``."""
from __future__ import annotations

import math

import numpy as np

import eins.ops as ops
from eins.frontends.node import dim_of


def histc(cx, x, bins=100, min=0, max=0):
    """torch's histc: ``bins`` equal bins over [min, max] (max itself in the last one),
    values outside or nan not counted; one comparison per (value, bin), summed."""
    lo, hi = float(min), float(max)
    if lo == hi:
        cx.fail(f"with min == max == {lo:g} (the range then comes from the data: give "
                f"min and max)")
    flat = ops.reshape(x, (math.prod(x.shape),))
    # torch's bin: ((x - min) / (max - min)) * bins, truncated; max goes to the last bin
    pos = ops.floor((flat - lo) / (hi - lo) * bins)
    pos = ops.where(flat == hi, bins - 1, pos)
    counted = (flat >= lo) & (flat <= hi)
    hits = (ops.reshape(pos, (flat.shape[0], 1)) == np.arange(bins)) & \
        ops.reshape(counted, (flat.shape[0], 1))
    return ops.astype(ops.sum(hits, 0), x.dtype)


def cumsum(cx, x, dim, dtype=None):
    # the interpreter casts to the recorded dtype (``dtype=``) afterwards
    return ops.cumsum(x, axis=dim_of(dim, len(x.shape)))


def index_put(cx, x, indices, values, accumulate=False):
    """``x[indices] = values`` (``index_put_``, functionalized) as eins's functional update
    ``at(x)[indices].set(values)``, ``.add`` with ``accumulate=True`` (repeated indices add
    up; of repeated indices without it, the last one wins, where torch leaves it
    undefined)."""
    idx = tuple(slice(None) if t is None else t for t in indices)
    if any(not isinstance(t, slice) and np.dtype(t.dtype) == np.bool_ for t in idx):
        cx.fail("with a boolean mask index (write torch.where(mask, values, x) instead)")
    target = ops.at(x)[idx]
    return target.add(values) if accumulate else target.set(values)


def grouped_mm(cx, x, w, offs=None, bias=None, out_dtype=None):
    """``_grouped_mm`` of rows ``x`` [S, K] sorted by group with the groups' weights ``w``
    [E, K, N]: row r uses ``w[g]`` where g is the number of offsets (cumulative group ends)
    at or below r; rows past the last offset are 0. One einsum over a one-hot of the
    groups: every group's matmul on every row (E times the grouped FLOPs), static shapes."""
    if offs is None or bias is not None or len(x.shape) != 2 or len(w.shape) != 3:
        cx.fail("other than rows [S, K] with weights [E, K, N], offsets and no bias")
    s, e = x.shape[0], w.shape[0]
    group = ops.sum(ops.reshape(offs, (1, e)) <= np.arange(s).reshape(s, 1), 1)
    onehot = ops.astype(ops.reshape(group, (s, 1)) == np.arange(e), x.dtype)
    return ops.einsum("se,sk,ekn->sn", onehot, x, w)
