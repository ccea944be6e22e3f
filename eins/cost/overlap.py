"""Sparse overlaps between two sets of boxes (the producer copies and the consumer blocks of
one exchange), for the time cost of :mod:`eins.cost.timecost` at cluster scale.

A dense [copies, needs] overlap matrix is p^2 numbers per exchange, and the per-dimension
factors the DP reuses were p^2 each: 2.8 GB at p = 256, out of memory at 1,024. Here a box set
is kept as its distinct boxes (replicas and partial sums share one), each a point of a grid of
distinct intervals per dimension; two sets meet where every dimension's intervals overlap, which
a join over small per-dimension neighbour lists finds without visiting the pairs that do not.
Work and memory follow the pairs that exchange bytes (p for aligned tilings, p^2 only for an
all-to-all, which sends that many transfers anyway).
"""
from __future__ import annotations

import numpy as np

__all__ = ["BoxSet", "ColumnPair", "sparse_overlap", "unique_rows"]


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + c)`` for every (s, c), vectorized."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(total)


def unique_rows(arr: np.ndarray, index: bool = False) -> tuple:
    """``np.unique(arr, axis=0, return_inverse=True)`` (with ``index``: also
    return_index) of an int64 [n, k] array with n >= 1: the same arrays, by one sort of a
    mixed-radix code per row (order-preserving) where the code fits int64, which the
    structured sort of ``axis=0`` costs several times over."""
    lo = arr.min(axis=0)
    span = arr.max(axis=0) - lo + 1
    if float(np.prod(span.astype(np.float64))) >= 2.0 ** 62:
        out = np.unique(arr, axis=0, return_index=index, return_inverse=True)
        return out[0], *(np.ravel(x) for x in out[1:])
    code = np.zeros(len(arr), dtype=np.int64)
    for d in range(arr.shape[1]):
        code = code * span[d] + (arr[:, d] - lo[d])
    _, first, inv = np.unique(code, return_index=True, return_inverse=True)
    inv = np.ravel(inv)
    return (arr[first], first, inv) if index else (arr[first], inv)


class BoxSet:
    """One set of boxes (``lo``, ``hi``: [n, rank] int64): its distinct boxes, which positions
    hold each, and per dimension the distinct intervals and each distinct box's one."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray, column_id):
        self.n = lo.shape[0]
        rank = lo.shape[1]
        if self.n:
            both = np.concatenate([lo, hi], axis=1)
            uniq, inv = unique_rows(both)
        else:
            uniq, inv = np.zeros((0, 2 * rank), dtype=np.int64), np.zeros(0, dtype=np.int64)
        self.order = np.argsort(inv, kind="stable")      # positions, grouped by distinct box
        self.counts = np.bincount(inv, minlength=len(uniq))
        self.starts = np.cumsum(self.counts) - self.counts
        self.single = bool((self.counts == 1).all())   # no box on two positions
        self.cols = []    # per dimension: (column id, [distinct box] -> its interval index)
        for d in range(rank):
            iv, idx = unique_rows(uniq[:, [d, rank + d]]) if len(uniq) else (
                np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.int64))
            self.cols.append((column_id(iv), idx))
        self._luts: dict = {}

    def lookup(self, radix) -> np.ndarray | None:
        """Per code of an interval tuple (mixed radix over ``radix``: (dimension, intervals
        the other side's column pairs with it)), the distinct box with those intervals, or
        -1; None when the table would exceed LUT_SIZE entries. Cached per radix: the boxes
        one producer's copies are joined with repeat across the DP's exchanges."""
        if radix not in self._luts:
            size = 1
            for _, k in radix:
                size *= k
            lut = None
            if size <= LUT_SIZE:
                code = np.zeros(len(self.counts), dtype=np.int64)
                for d, k in radix:
                    code = code * k + self.cols[d][1]
                lut = np.full(size, -1, dtype=np.int64)
                lut[code] = np.arange(len(self.counts))
            self._luts[radix] = lut
        return self._luts[radix]


# interval tuples up to which a box set keeps a table from each to its box (8 MB)
LUT_SIZE = 1 << 20


class ColumnPair:
    """Two dimensions' distinct intervals (``a``, ``b``: [k, 2] lo/hi): the overlap length of
    every pair and, per interval of ``a``, the intervals of ``b`` it meets (CSR)."""

    def __init__(self, a: np.ndarray, b: np.ndarray):
        ext = np.minimum(a[:, 1, None], b[None, :, 1]) - np.maximum(a[:, 0, None], b[None, :, 0])
        self.ext = np.maximum(ext, 0).astype(np.float64)
        rows, cols = np.nonzero(self.ext)
        self.ptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=len(a)))])
        self.nbr = cols


def sparse_overlap(a: BoxSet, b: BoxSet, itemsize: int, pair, ordered: bool = True) -> tuple:
    """(i, j, bytes): every position ``i`` of ``a`` and ``j`` of ``b`` whose boxes share
    elements, and ``itemsize`` times how many, sorted by (i, j) as ``np.nonzero`` of the dense
    matrix orders them. ``pair(x, y)``: the :class:`ColumnPair` of column ids ``x``, ``y``
    (cached by the caller). Every product is an integer below 2**53: exact in float64.
    ``ordered=False``: the pairs in any order (a caller summing only integer bytes, below
    2**53, gets the same floats in any order, and spares the sort)."""
    na, nb = len(a.counts), len(b.counts)
    if na * nb <= DENSE_PAIRS:
        u, v, nbytes = _distinct_dense(a, b, itemsize, pair)
    else:
        u, v, nbytes = _distinct_join(a, b, itemsize, pair)
    return _positions(a, b, u, v, nbytes, ordered)


# distinct box pairs up to which a dense [distinct a, distinct b] product is cheaper than the
# join (a few numpy calls per dimension against a dozen)
DENSE_PAIRS = 1 << 14


def _distinct_dense(a, b, itemsize, pair):
    ov = None
    scalar = float(itemsize)
    for (xa, ia), (xb, ib) in zip(a.cols, b.cols):
        ext = pair(xa, xb).ext
        if ext.shape == (1, 1):
            scalar *= ext[0, 0]
            continue
        e = ext[ia][:, ib]
        ov = e if ov is None else ov * e
    if ov is None:
        ov = np.ones((len(a.counts), len(b.counts)))
    if not scalar:   # an unsplit dimension the two sides do not share
        ov = ov[:0]
    u, v = np.nonzero(ov)
    return u, v, ov[u, v] * scalar


def _distinct_join(a, b, itemsize, pair):
    u = np.arange(len(a.counts))
    nbytes = np.full(len(u), float(itemsize))
    keys = []   # per joined dimension: the interval index of b each candidate meets
    radix = []
    for d, ((xa, ia), (xb, ib)) in enumerate(zip(a.cols, b.cols)):
        cp = pair(xa, xb)
        if cp.ext.shape == (1, 1):   # one interval each side: a factor
            nbytes = nbytes * cp.ext[0, 0]
            continue
        x = ia[u]
        cnt = cp.ptr[x + 1] - cp.ptr[x]
        sel = _ranges(cp.ptr[x], cnt)
        y = cp.nbr[sel]
        u, x = np.repeat(u, cnt), np.repeat(x, cnt)
        keys = [np.repeat(k, cnt) for k in keys] + [y]
        nbytes = np.repeat(nbytes, cnt) * cp.ext[x, y]
        radix.append((d, cp.ext.shape[1]))
    # the b box of each candidate's interval tuple, if b has one
    code = np.zeros(len(u), dtype=np.int64)
    for k, (_, size) in zip(keys, radix):
        code = code * size + k
    lut = b.lookup(tuple(radix))
    if lut is not None:   # a table of every interval tuple: one gather
        v = lut[code]
        hit = (v >= 0) & (nbytes > 0)
        return u[hit], v[hit], nbytes[hit]
    bcode = np.zeros(len(b.counts), dtype=np.int64)
    for d, size in radix:
        bcode = bcode * size + b.cols[d][1]
    order = np.argsort(bcode, kind="stable")
    at = np.searchsorted(bcode, code, sorter=order)
    at = np.minimum(at, max(len(order) - 1, 0))
    hit = (bcode[order[at]] == code) if len(order) else np.zeros(len(code), dtype=bool)
    hit &= nbytes > 0
    return u[hit], order[at[hit]], nbytes[hit]


def _positions(a, b, u, v, nbytes, ordered=True):
    """Distinct box pairs (u, v) -> every pair of positions holding them, sorted."""
    cu, cv = a.counts[u], b.counts[v]
    if a.single and b.single:   # every box on one position: one pair each
        i, j, w = a.order[u], b.order[v], nbytes
    elif b.single:   # partial sums into single blocks: no division by the counts
        i = a.order[_ranges(a.starts[u], cu)]
        j = np.repeat(b.order[b.starts[v]], cu)
        w = np.repeat(nbytes, cu)
    elif a.single:   # single blocks into replicas
        i = np.repeat(a.order[a.starts[u]], cv)
        j = b.order[_ranges(b.starts[v], cv)]
        w = np.repeat(nbytes, cv)
    else:
        per = cu * cv
        k = np.repeat(np.arange(len(u)), per)
        off = _ranges(np.zeros(len(u), dtype=np.int64), per)
        cvk = cv[k]
        i = a.order[a.starts[u][k] + off // cvk]
        j = b.order[b.starts[v][k] + off % cvk]
        w = nbytes[k]
    if not ordered:
        return i, j, w
    key = i * b.n + j
    if len(key) < 2 or (key[1:] > key[:-1]).all():   # aligned tilings come sorted already
        return i, j, w
    srt = np.argsort(key, kind="stable")
    return i[srt], j[srt], w[srt]
