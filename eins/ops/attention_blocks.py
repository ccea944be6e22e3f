"""Attention on blocks of the sequence (the pieces of eins/ops/attention.py that know global
positions): which keys a block of query rows needs, the (query, key) pairs a block computes
and its FLOPs, work-balanced cut positions, and the block kernel returning each row's
log-sum-exp for the ``lse`` ⊕ (eins.ir.joinagg).

Positions are global: a block holds query rows ``[qa, qb)`` and key rows ``[ka, kb)``;
``segments`` are the packed-sequence END positions (None: one segment ``[0, s)``, ``s`` at
least both lengths). Query row i sits at key position ``p = i + off`` (``off = Sk - Sq``:
decode and chunked prefill against a KV cache align the queries with the last keys, as
flash-attn does; 0 with segments). Token i sees key j iff both lie in one segment, ``j <= p``
when causal, and ``p - j < window`` (and, not causal, ``j - p < window``) with a window:
the keys ``[p - L, p + R]`` with ``L``/``R`` from :func:`band`. A data mask and a bias
(eins/ops/attention.py) act on top of that inside the kernels; the counts here are the
positions' only (a mask hides pairs the cost cannot know).
"""
from __future__ import annotations

import bisect

import numpy as np

from eins.errors import EinsError
from eins.ir.types import Box

__all__ = ["segment_of", "needed_keys", "block_pairs", "attention_block_flops", "work_cuts",
           "prefix_work", "row_work", "key_work", "weighted_values", "softmax_values",
           "attend_block", "DEFAULTS", "band", "extra_box", "cut", "spans", "softcapped", "runtime_ends"]


# attention's parameters and their defaults (an eqn carries an option only where it is
# given): the one list the forward (eins/ops/attention.py) and the backward read
DEFAULTS = dict(causal=True, segments=None, scale=None, window=None, softcap=None,
                mask=None, bias=None, offset=0)

def _ends(segments, s: int) -> tuple:
    return tuple(segments) if segments else (s,)


def runtime_ends(x, s: int) -> tuple:
    """The segment ends of one call from the ``segments`` array ``x``, as the static tuple
    ending at ``s``: nondecreasing end positions from 0 whose last is at least ``s`` (the
    sequence length: padding repeats it; repeated or zero ends are empty segments). A block
    kernel passes its last position as ``s``. Anything else is an EinsError naming the
    values: a wrong boundary would give wrong attention, not an error, later."""
    e = np.asarray(x).reshape(-1)
    if e.size == 0 or np.any(np.diff(e) < 0) or e[0] < 0 or e[-1] < s:
        shown = e.tolist() if e.size <= 16 else e[:16].tolist() + ["..."]
        raise EinsError(f"attention: segments {shown} must be nondecreasing end positions "
                        f"from 0 whose last is the sequence length (pad with it), and cover "
                        f"position {s - 1}")
    e = np.minimum(e, s)
    return tuple(int(v) for v in np.unique(e[e > 0]))


def band(causal, window):
    """``(L, R)``: key position p sees the keys ``[p - L, p + R]``; None is unbounded."""
    left = None if window is None else window - 1
    right = 0 if causal else (None if window is None else window - 1)
    return left, right


def segment_of(pos: int, segments, s: int) -> tuple[int, int]:
    """The segment ``[start, end)`` holding position ``pos``."""
    ends = _ends(segments, s)
    i = bisect.bisect_right(ends, pos)
    return (ends[i - 1] if i else 0), ends[min(i, len(ends) - 1)]


def needed_keys(qa: int, qb: int, causal: bool, segments, s: int, *, off: int = 0,
                window=None) -> tuple[int, int]:
    """The key rows ``[lo, hi)`` that query rows ``[qa, qb)`` attend to: from the start of
    qa's segment (or qa's window) to qb's band end (causal: qb + off) or to the end of the
    segment of row qb - 1 (non-causal), clipped to ``[0, s)``."""
    left, right = band(causal, window)
    lo = segment_of(qa, segments, s)[0]
    hi = segment_of(qb - 1, segments, s)[1]
    if left is not None:
        lo = max(lo, qa + off - left)
    if right is not None:
        hi = min(hi, qb - 1 + off + right + 1)
    lo, hi = max(lo, 0), min(hi, s)
    return (lo, hi) if hi > lo else (lo, lo)


def _series(x: int, y: int, alpha: int, beta: int) -> int:
    """sum over integers p in [x, y) of alpha + beta * p (beta in -1, 0, 1)."""
    n = y - x
    return n * alpha + beta * (x + y - 1) * n // 2 if n > 0 else 0


def _band_count(pa: int, pb: int, c: int, e: int, left, right) -> int:
    """sum over key positions p in [pa, pb) of |[c, e) ∩ [p - left, p + right]|: piecewise
    linear in p with kinks where the band's ends cross c and e, summed piece by piece."""
    if pb <= pa or e <= c:
        return 0
    kinks = sorted({k for k in (None if right is None else e - right - 1,
                                None if left is None else c + left) if k is not None
                    and pa < k < pb})
    total = 0
    for u, v in zip([pa, *kinks], [*kinks, pb]):
        # the band's ends on this piece: hi = e or p + right + 1, lo = c or p - left
        hi_a, hi_b = (e, 0) if right is None or u >= e - right - 1 else (right + 1, 1)
        lo_a, lo_b = (c, 0) if left is None or u < c + left else (-left, 1)
        alpha, beta = hi_a - lo_a, hi_b - lo_b     # f(p) = alpha + beta * p, before max(0, .)
        if beta == 0:
            total += (v - u) * max(alpha, 0)
        elif beta > 0:
            total += _series(max(u, 1 - alpha), v, alpha, 1)
        else:
            total += _series(u, min(v, alpha), alpha, -1)
    return total


def block_pairs(qa, qb, ka, kb, causal, segments, s, *, off=0, window=None) -> int:
    """How many (query, key) pairs of the block ``[qa, qb) x [ka, kb)`` are visible."""
    left, right = band(causal, window)
    if not segments:
        return _band_count(qa + off, qb + off, ka, kb, left, right)
    ends = _ends(segments, s)
    # a whole segment inside both ranges, without a window or an offset: all its pairs
    whole = left is None and not off and right in (0, None)
    # there a segment outside either range holds none (causal or not)
    lo, hi = max(qa, ka), min(qb, kb) if not causal or whole else qb
    # only segments meeting both ranges can hold pairs: those from lo's to hi - 1's
    first = bisect.bisect_right(ends, lo)
    last = min(bisect.bisect_right(ends, hi - 1) if hi > 0 else 0, len(ends) - 1)
    total = 0
    run = range(0)
    if whole:   # the segments inside both ranges, a run counted from a prefix at once
        run = range(max(first, bisect.bisect_left(ends, lo) + 1 if lo > 0 else 0),
                    min(last, bisect.bisect_right(ends, hi) - 1) + 1)
        if run:
            before = _whole_before(ends, right == 0)
            total = before[run.stop] - before[run.start]
    for i in _outside(first, last, run):
        start, end = (ends[i - 1] if i else 0), ends[i]
        a, b, c, e = max(qa, start), min(qb, end), max(ka, start), min(kb, end)
        if whole and a == c == start and b == e == end:
            n = end - start
            total += n * (n + 1) // 2 if right == 0 else n * n
        else:
            total += _band_count(a + off, b + off, c, e, left, right)
    return total


def _outside(first: int, last: int, run: range):
    """The indices ``first .. last`` not in ``run`` (a run of them, or empty)."""
    if not run:
        return range(first, last + 1)
    return (*range(first, run.start), *range(run.stop, last + 1))


# the whole segments' pairs before each segment of the last few segment lists (a batch's
# ends, priced on every block of every family per call): keyed by the tuple's identity,
# which it holds
_WHOLE: dict = {}
_WHOLE_KEPT = 8


def _whole_before(ends: tuple, causal: bool) -> list:
    """``[pairs of segments 0 .. i - 1, each whole, for i in 0 .. len(ends)]``: a segment of
    n positions n (n + 1) / 2 causal, n * n not."""
    key = (id(ends), causal)
    got = _WHOLE.get(key)
    if got is not None and got[0] is ends:
        return got[1]
    before, at, start = [0], 0, 0
    for end in ends:
        n = end - start
        at += n * (n + 1) // 2 if causal else n * n
        before.append(at)
        start = end
    if len(_WHOLE) >= _WHOLE_KEPT:
        _WHOLE.clear()
    _WHOLE[key] = (ends, before)
    return before


def prefix_work(causal, segments, s, keys=False, *, off=0, window=None, sq=None):
    """``f(x)``: the work of query rows ``[0, x)`` (their visible keys; ``keys``: of key
    columns ``[0, x)``, the queries that see them). Without a window or offset, in
    O(log segments) per call, so cut positions are found by binary search without
    per-position arrays; with them, by :func:`block_pairs`. ``sq``: the query length
    (default ``s``)."""
    sq = s if sq is None else sq
    if window is not None or off:
        if keys:
            return lambda x: block_pairs(0, sq, 0, x, causal, segments, s, off=off,
                                         window=window)
        return lambda x: block_pairs(0, x, 0, s, causal, segments, s, off=off, window=window)
    ends = _ends(segments, s)
    starts = (0,) + ends[:-1]
    before = _whole_before(ends, causal)

    def f(x):
        i = bisect.bisect_right(ends, x)
        if i >= len(ends):
            return before[-1]
        t, n = x - starts[i], ends[i] - starts[i]
        if not causal:
            inside = t * n
        elif keys:   # key j of the segment is seen by the queries j..end-1
            inside = t * n - t * (t - 1) // 2
        else:        # query i of the segment sees keys start..i
            inside = t * (t + 1) // 2
        return before[i] + inside

    return f


def attention_block_flops(fspec, causal=True, segments=None, *, off=0, window=None) -> int:
    """FLOPs of one attention function specification from its global boxes (q box
    ``fspec.inputs[0]`` = [..., heads, S-rows, D], k box ``fspec.inputs[1]``, v box
    ``fspec.inputs[2]``): its visible (query, key) pairs times ``2 * batch * query heads *
    (D + Dv)`` (QK^T and PV, two FLOPs per multiply-add). Any split of one attention sums to
    the whole's count, so a seq-split block is charged for its own rows and keys, not the
    whole segment list; a window's or the causal mask's hidden pairs cost nothing."""
    qbox, kbox, vbox = fspec.inputs[0], fspec.inputs[1], fspec.inputs[2]
    # max(segments), not max(*segments): a batch's few hundred ends, priced per block
    s = max(kbox.hi[-2], qbox.hi[-2], max(segments) if segments else 0)
    pairs = block_pairs(qbox.lo[-2], qbox.hi[-2], kbox.lo[-2], kbox.hi[-2], causal, segments,
                        s, off=off, window=window)
    shape = qbox.shape
    lead = 1
    for n in shape[:-2]:
        lead *= n
    return 2 * lead * pairs * (shape[-1] + vbox.hi[-1] - vbox.lo[-1])


def _positions(segments, s):
    """Per position: the position, its segment's start and its segment's end."""
    pos = np.arange(s)
    ends = np.asarray(_ends(segments, s))
    seg = np.searchsorted(ends, pos, side="right")
    return pos, np.concatenate(([0], ends[:-1]))[seg], ends[seg]


def row_work(causal, segments, s) -> np.ndarray:
    """Visible keys per query row (the work of each row)."""
    pos, starts, ends = _positions(segments, s)
    return pos - starts + 1 if causal else ends - starts


def key_work(causal, segments, s) -> np.ndarray:
    """Query rows that see each key (the work of each key column)."""
    pos, starts, ends = _positions(segments, s)
    return ends - pos if causal else ends - starts


def work_cuts(prefix, n: int, count: int, allowed=None):
    """``count`` contiguous intervals of ``[0, n)`` of near-equal work, where ``prefix(x)``
    is the (nondecreasing) work of positions ``[0, x)``: each cut is the position whose
    prefix is nearest to k/count of the whole, so a piece is off by at most one position's
    work. ``allowed``: the only positions a cut may take (segment ends). None if there are
    too few positions. Binary search on ``prefix``: no per-position arrays (1M tokens)."""
    pts = range(1, n) if allowed is None else sorted(int(x) for x in allowed
                                                           if 0 < int(x) < n)
    if count < 1 or count - 1 > len(pts):
        return None
    total = prefix(n)
    cuts, prev = [], -1
    for k in range(1, count):
        target = total * k / count
        lo, hi = 0, len(pts)          # first index with prefix >= target
        while lo < hi:
            mid = (lo + hi) // 2
            if prefix(pts[mid]) < target:
                lo = mid + 1
            else:
                hi = mid
        i = lo
        if i > 0 and (i == len(pts) or target - prefix(pts[i - 1]) <= prefix(pts[i]) - target):
            i -= 1
        # strictly increasing, leaving a position for each later cut
        i = min(max(i, prev + 1), len(pts) - (count - k))
        cuts.append(pts[i])
        prev = i
    b = (0, *cuts, n)
    return tuple(zip(b[:-1], b[1:]))


def weighted_values(p, v, scores=None):
    """``p @ v`` over the grouped layout (p [..., Hkv, G, L, M], v [..., Hkv, M, D]) where a
    key a row does not see adds nothing, even when its value is inf or nan. A key is not
    seen where its score in ``scores`` (broadcastable to p) is -inf: masked (causal) or a
    -inf score. Its weight is exactly 0 and 0 * inf is nan, so a plain product makes a row
    nan through a value it never attends to, in one block and not in another (the result
    would depend on the plan's cuts, and a row that sees no key would be nan, not 0). The product is only taken apart
    for the keys with a non-finite value, so finite data costs one check."""
    out = np.einsum("...hglm,...hmd->...hgld", p, v)
    if scores is None:
        return out
    fin = np.isfinite(v)
    if fin.all():
        return out
    bad = np.flatnonzero(~fin.all(axis=tuple(a for a in range(v.ndim) if a != v.ndim - 2)))
    seen = scores[..., bad] != -np.inf                             # [..., L, b]
    out = np.einsum("...hglm,...hmd->...hgld", p, np.where(fin, v, 0))
    vb = np.where(fin, 0, v)[..., bad, :]                          # [..., Hkv, b, D]
    with np.errstate(invalid="ignore"):   # 0 * inf where a row does not see the key
        prod = p[..., bad][..., None] * vb[..., None, None, :, :]  # [..., Hkv, G, L, b, D]
        return out + np.where(seen[..., None], prod, 0).sum(axis=-2)


def softmax_values(sc, v):
    """The softmax of scores ``sc`` [..., Hkv, G, L, M] over their keys, times ``v`` [...,
    Hkv, M, D] (:func:`weighted_values`; a -inf score is a key not seen). Returns (out, the
    row's shift m, the row's sum of weights den), both [..., L, 1]: a row whose scores are
    all -inf sees no key, so its shift is 0, den 0 and out 0 (the ``lse`` ⊕'s identity),
    the same in the whole kernel and in every block's."""
    m = sc.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)    # rows with no visible key: all -inf
    p = np.exp(sc - m)
    den = p.sum(axis=-1, keepdims=True)
    return weighted_values(p / np.where(den > 0, den, 1), v, sc), m, den


def softcapped(sc, softcap):
    """Gemma 2's score cap: ``softcap * tanh(sc / softcap)`` (None: the scores as they are)."""
    return sc if softcap is None else softcap * np.tanh(sc / softcap)


def spans(qa: int, qb: int, ka: int, kb: int, segments, s: int, off: int, left, right):
    """The (query rows [a, b), key rows [c, e)) pairs of one segment each that a block of
    query rows [qa, qb) and key rows [ka, kb) computes (global positions): within the
    segment, and within the band [p - left, p + right] of its rows' key positions p = i +
    off (None: unbounded); empty ones are left out."""
    start = 0
    for end in _ends(segments, s):
        a, b, c, e = max(qa, start), min(qb, end), max(ka, start), min(kb, end)
        if right is not None:
            e = min(e, b - 1 + off + right + 1)   # keys past the last row's band: never seen
        if left is not None:
            c = max(c, a + off - left)
        start = end
        if b > a and e > c:
            yield a, b, c, e

def cut(x, a, b, c, e):
    """Rows ``[a, b)`` and columns ``[c, e)`` of a mask or bias block (block-relative), where
    its last two axes are not broadcast (size 1)."""
    if x is None:
        return None
    rows = slice(a, b) if x.shape[-2] > 1 else slice(None)
    cols = slice(c, e) if x.shape[-1] > 1 else slice(None)
    return x[..., rows, cols]


def attend_block(q, k, v, qa, ka, causal, segments, s, scale, lse=False, *, off=0,
                 window=None, softcap=None, mask=None, bias=None, slopes=None):
    """The block kernel in compute dtype: q [..., Hkv, G, Lq, D] holds query rows
    ``[qa, qa + Lq)``, k [..., Hkv, Lk, D] and v [..., Hkv, Lk, Dv] key rows
    ``[ka, ka + Lk)``. ``mask`` (bool) and ``bias`` broadcast to the scores [..., Hkv, G,
    Lq, Lk] of the block; ``slopes`` [..., Hkv, G, 1, 1] are ALiBi's, adding
    ``-slope * |p - j|``. Scores are ``scale * q.k``, capped (``softcap``), biased, then
    masked (positions, ``mask``). Returns the output [..., Hkv, G, Lq, Dv] normalized over
    the block's visible keys, and (``lse``) each row's log-sum-exp [..., Hkv, G, Lq]; a row
    that sees no key of the block gets o = 0, lse = -inf (the identity of the ``lse`` ⊕)."""
    lq, lk = q.shape[-2], k.shape[-2]
    qb, kb = qa + lq, ka + lk
    left, right = band(causal, window)
    out = np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
    lses = np.full(q.shape[:-1], -np.inf, q.dtype) if lse else None
    for a, b, c, e in spans(qa, qb, ka, kb, segments, s, off, left, right):
        sc = np.einsum("...hgld,...hmd->...hglm", q[..., a - qa:b - qa, :],
                       k[..., c - ka:e - ka, :]) * scale
        sc = softcapped(sc, softcap)
        dist = np.arange(c, e)[None, :] - np.arange(a + off, b + off)[:, None]  # j - p
        if slopes is not None:
            sc = sc - slopes * np.abs(dist).astype(sc.dtype)
        if bias is not None:
            sc = sc + cut(bias, a - qa, b - qa, c - ka, e - ka)
        seen = np.ones(dist.shape, bool)
        if left is not None:
            seen &= dist >= -left
        if right is not None:
            seen &= dist <= right
        if mask is not None:
            seen = seen & cut(mask, a - qa, b - qa, c - ka, e - ka)
        sc = np.where(seen, sc, -np.inf)
        out[..., a - qa:b - qa, :], m, den = softmax_values(sc, v[..., c - ka:e - ka, :])
        if lse:   # a nan den (a nan or inf score) gives a nan lse, not the ⊕'s identity
            with np.errstate(divide="ignore", invalid="ignore"):
                lses[..., a - qa:b - qa] = np.where(den == 0, -np.inf, m + np.log(den))[..., 0]
    return out, lses


def extra_box(kind, lo, hi, heads, rows, keys, shape):
    """The box of attention's mask or bias block for batch [lo, hi), query heads ``heads``,
    query rows ``rows`` and key rows ``keys`` (the forward's and the backward's specs); a
    dim of 1 (broadcast) is kept whole."""
    def pick(n, iv):
        return (0, 1) if n == 1 else iv
    nb = len(lo)
    dims = [pick(n, (a, b)) for n, a, b in zip(shape[:nb], lo, hi)]
    if kind == "keys":
        dims.append(keys)
    elif kind == "alibi":
        dims.append(pick(shape[nb], heads))
    else:
        dims += [pick(shape[nb], heads), rows, keys]
    return Box(tuple(a for a, _ in dims), tuple(b for _, b in dims))
