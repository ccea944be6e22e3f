"""Attention's backward on blocks of the sequence, in numpy (the reference kernels of
eins/ops/attention_bwd.py and eins/ops/attention_dbias.py): which query rows a block of keys
needs, the block kernels of FlashAttention-2's backward (scores recomputed from q, k and the
saved log-sum-exp) and of the bias's gradient, and the cut positions at which a split's
gradients need no ⊕.

Positions are global, as in eins/ops/attention_blocks.py: a block holds query rows
``[qa, qa + Lq)`` and key rows ``[ka, ka + Lk)`` of the sequence ``[0, S)``; ``segments``
are packed-sequence END positions (None: one segment). Token i sees token j iff both lie in
one segment and, when causal, ``j <= i``.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from eins.errors import EinsError
from eins.ir.primitive import get_primitive
from eins.ir.types import Box
from eins.ops import attention_blocks as blk

__all__ = ["DEFAULTS", "opts", "static_segments", "ends_at", "kernel_segments", "extras",
           "grouped_extras", "scale_of", "band", "needed_queries", "read_rows",
           "at_segment_ends", "Reads", "backward_reads", "capacity_whole", "capacity_inputs",
           "cut", "spans", "bwd_block", "probs", "reduce_to", "tiles", "DBIAS_TILE",
           "dbias_block"]


# attention's parameters and their defaults (an eqn carries an option only where given)
DEFAULTS = blk.DEFAULTS


def opts(params) -> dict:
    return {n: params.get(n, v) for n, v in DEFAULTS.items()}


def static_segments(p):
    """The segment ends the plan may use: the static tuple, None when they are data
    (``segments="array"``: the ends are an operand, read per call)."""
    return None if isinstance(p["segments"], str) else p["segments"]


def ends_at(p, first: int, n: int):
    """The operand index of the runtime ends in an eqn of ``n`` operands whose mask and bias
    start at ``first`` (attention: 3, its backward eqns: 6), or None without one (the ends
    follow the mask and the bias)."""
    at = first + bool(p["mask"]) + bool(p["bias"])
    return at if n > at else None


def kernel_segments(p, fspec, ins, first=6):
    """(segments, span) a backward block kernel masks with: the ends read from the runtime
    operand where there is one (so one lowered block serves every batch whose cut gives it
    the same boxes: the params hold the ends of the batch it was cut for), else the static
    tuple; the span is the last segment's end, or past every position of the block without
    segments. ``first``: where the eqn's mask and bias start among ``ins``."""
    qbox, kbox = fspec.inputs[0], fspec.inputs[1]
    last = max(qbox.hi[-2], kbox.hi[-2])
    at = ends_at(p, first, len(ins))
    segs = p["segments"] if at is None else blk.runtime_ends(ins[at], last)
    return segs, (segs[-1] if segs else last)


def extras(extra, p):
    """(mask, bias) among attention's operands beyond q, k, v (None where not given)."""
    rest = list(extra)
    mask = rest.pop(0) if p["mask"] else None
    bias = rest.pop(0) if p["bias"] else None
    return mask, bias


def grouped_extras(p, mask, bias, hkv, cast):
    """The mask, bias and ALiBi slopes blocks (numpy arrays or torch tensors) broadcast
    against the grouped scores [..., Hkv, G, Lq, Lk] (attention_bwd_blocks.bwd_block's
    keywords, as attend_block's); ``cast`` takes the bias to the compute dtype."""
    def heads(x):   # [..., h, Lq, Lk] -> [..., Hkv, G, Lq, Lk] (h = 1 broadcasts)
        h = x.shape[-3]
        return x.reshape(*x.shape[:-3], *((hkv, h // hkv) if h > 1 else (1, 1)),
                         *x.shape[-2:])
    out = {}
    if p["mask"] == "keys":
        out["mask"] = mask[..., None, None, None, :]
    elif p["mask"] == "full":
        out["mask"] = heads(mask)
    if p["bias"] == "alibi":
        x = cast(bias)
        out["slopes"] = x.reshape(*x.shape[:-1], hkv, x.shape[-1] // hkv, 1, 1)
    elif p["bias"] == "add":
        out["bias"] = heads(cast(bias))
    return out


def scale_of(scale, d):
    return 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)


band = blk.band


def needed_queries(ka: int, kb: int, causal: bool, segments, s: int, *, off: int = 0,
                   window=None, sq: int | None = None) -> tuple[int, int]:
    """The query rows ``[lo, hi)`` that see some key of ``[ka, kb)``: the key positions
    whose band reaches into ``[ka, kb)`` (from ka when causal), in the segments of its keys
    (from the start of ka's to the end of kb - 1's), as rows (position - ``off``) of the
    ``sq`` query rows (default ``s``)."""
    left, right = band(causal, window)
    lo = blk.segment_of(ka, segments, s)[0]
    hi = blk.segment_of(kb - 1, segments, s)[1]
    if right is not None:
        lo = max(lo, ka - right)
    if left is not None:
        hi = min(hi, kb - 1 + left + 1)
    lo, hi = max(lo - off, 0), min(hi - off, s if sq is None else sq)
    return (lo, hi) if hi > lo else (lo, lo)


def at_segment_ends(intervals, segments, s: int) -> bool:
    """Whether every interval of one sequence index starts and ends at a segment end (or 0):
    blocks of whole segments, whose tokens see no other block's."""
    ends = {0, *(segments or (s,))}
    return all(a in ends and b in ends for a, b in intervals)


def read_rows(qa, qb, c, e, qsplit, ksplit, *, causal, segments, s, off, window, sq, sk):
    """The query rows ``[ra, rb)`` and key rows ``[ka, kb)`` a block of query interval
    ``[qa, qb)`` and key interval ``[c, e)`` reads: the keys its rows see (query split),
    the rows that see its keys (key split), or, both split, those of each interval that see
    the other's (all of the interval if none do)."""
    # the forward's rule of which keys a block of rows sees, with the offset and window
    # where the eqn has them
    pos = {n: x for n, x in (("off", off), ("window", window)) if x not in (0, None)}
    ka, kb = blk.needed_keys(qa, qb, causal, segments, s, **pos) if qb > qa else (qa, qb)
    ka, kb = min(ka, sk), min(kb, sk)
    if not ksplit:
        return qa, qb, ka, kb
    ra, rb = needed_queries(c, e, causal, segments, s, sq=sq, off=off, window=window)
    if not qsplit:
        return ra, rb, c, e
    ka, kb = (max(ka, c), min(kb, e)) if max(ka, c) < min(kb, e) else (c, e)
    ra, rb = (max(ra, qa), min(rb, qb)) if max(ra, qa) < min(rb, qb) else (qa, qb)
    return ra, rb, ka, kb


@dataclass(frozen=True, slots=True)
class Reads:
    """One block of a backward eqn (attention_bwd, attention_dbias): its batch ranges
    ``[lo, hi)``, kv heads ``heads_kv`` (query heads ``heads``, ``g`` per kv head), the
    cut's query and key intervals ``rows`` and ``keys``, and the boxes it reads of its
    operands (q, k, v, o, lse, dO, then the mask and bias where given, then the runtime
    ends where the segments are data)."""
    lo: tuple
    hi: tuple
    heads_kv: tuple
    g: int
    rows: tuple
    keys: tuple
    inputs: tuple

    @property
    def heads(self) -> tuple:
        return self.heads_kv[0] * self.g, self.heads_kv[1] * self.g


def backward_reads(name, ins, params):
    """``(ix, reads)`` for a backward eqn ``name`` of operands (q, k, v, o, lse, dO, *mask
    and bias): ``ix`` attention's Indexing of the forward's (named indices, balanced cuts),
    and ``reads(iv)`` the :class:`Reads` of every block for the intervals ``iv`` of those
    indices. The head dim is not shardable: an ``iv`` that cuts it is refused naming
    ``name``."""
    p = opts(params)
    q, k, v, o = ins[:4]
    ix = get_primitive("attention").indexing((q, k, v, *ins[6:]), (o,), **params)
    extra = [(kind, t.shape) for kind, t in zip([x for x in (p["mask"], p["bias"]) if x],
                                                 ins[6:])]
    names = list(ix.extents)
    batch = names[:len(q.shape) - 3]
    hkv, sk, d = k.shape[-3:]
    sq, dv = q.shape[-2], v.shape[-1]
    g = q.shape[-3] // hkv
    pos = dict(causal=p["causal"], segments=static_segments(p), s=max(sq, sk),
               off=p["offset"], window=p["window"], sq=sq, sk=sk)
    ends = ends_at(p, 6, len(ins))

    def reads(iv) -> list:
        if iv["head_dim"] != ((0, d),):
            raise EinsError(f"{name}: head_dim (D={d}) is not shardable, got "
                            f"intervals {iv['head_dim']}")
        qsplit, ksplit = len(iv["sequence"]) > 1, len(iv["kv_sequence"]) > 1
        out = []
        for combo in itertools.product(*(iv[n] for n in names)):
            ch = dict(zip(names, combo))
            lo = tuple(ch[n][0] for n in batch)
            hi = tuple(ch[n][1] for n in batch)
            (ha, hb), rows, keys = ch["heads_kv"], ch["sequence"], ch["kv_sequence"]
            ra, rb, ka, kb = read_rows(*rows, *keys, qsplit, ksplit, **pos)
            qbox = Box((*lo, ha * g, ra, 0), (*hi, hb * g, rb, d))
            obox = Box((*lo, ha * g, ra, 0), (*hi, hb * g, rb, dv))
            kbox = Box((*lo, ha, ka, 0), (*hi, hb, kb, d))
            vbox = Box((*lo, ha, ka, 0), (*hi, hb, kb, dv))
            boxes = [blk.extra_box(kind, lo, hi, (ha * g, hb * g), (ra, rb), (ka, kb), shape)
                     for kind, shape in extra]
            if ends is not None:   # every block reads all the runtime ends
                boxes.append(Box((0,), tuple(ins[ends].shape)))
            lse = Box(qbox.lo[:-1], qbox.hi[:-1])
            out.append(Reads(lo, hi, (ha, hb), g, rows, keys,
                             (qbox, kbox, vbox, obox, lse, obox, *boxes)))
        return out

    return ix, reads


def capacity_whole(name, iv, reads, sq, width):
    """The blocks of a backward eqn's capacity form (``rows``: its table last) for the
    intervals ``iv``: block j of the query-row split reads every row and key (the
    :class:`Reads` of the whole sequence for its batch and heads), and row j of the table
    (``width`` columns). -> [(the whole block's Reads, its inputs with the table row's
    box)], in the order of ``reads(iv)``, the per-cut spec's (table row j is its block j's
    cut). A key split is refused, naming ``name``: its partials are not the table's."""
    if len(iv["kv_sequence"]) > 1:
        raise EinsError(f"{name}: the capacity form (rows=True) cannot split kv_sequence")
    whole = {(b.lo, b.hi, b.heads_kv): b for b in reads(dict(iv, sequence=((0, sq),)))}
    out = []
    for j, b in enumerate(reads(iv)):
        w = whole[(b.lo, b.hi, b.heads_kv)]
        out.append((w, w.inputs + (Box((j, 0), (j + 1, width)),)))
    return out


def capacity_inputs(fspec, q, k, v, o, lse, do, table):
    """A capacity-form block's operands as an ordinary block's, in numpy: every row outside
    the table row's [lo, hi) gets q, o, dO = 0 and lse = +inf (P = 0: it adds nothing),
    every key outside [klo, khi) k, v = 0 (a capacity buffer's other rows may be stale: a
    weight 0 times a nan is nan). -> (q, k, v, o, lse, dO, the rows outside, the keys
    outside) (``fspec`` without the table's box)."""
    lo, hi, klo, khi = (int(x) for x in np.asarray(table).reshape(-1)[:4])
    qa, ka = fspec.inputs[0].lo[-2], fspec.inputs[1].lo[-2]
    rows = np.arange(qa, qa + q.shape[-2])
    out_r, out_k = (rows < lo) | (rows >= hi), np.arange(ka, ka + k.shape[-2])
    out_k = (out_k < klo) | (out_k >= khi)
    q, o, do = (np.where(out_r[:, None], 0, x).astype(x.dtype) for x in (q, o, do))
    lse = np.where(out_r, np.inf, lse).astype(lse.dtype)
    k, v = (np.where(out_k[:, None], 0, x).astype(x.dtype) for x in (k, v))
    return q, k, v, o, lse, do, out_r, out_k


cut, spans = blk.cut, blk.spans   # the forward's, for attention_bwd_gpu too


def bwd_block(q, k, v, o, lse, do, qa: int, ka: int, causal: bool, segments, s: int, scale,
              *, off=0, window=None, softcap=None, mask=None, bias=None, slopes=None):
    """Gradients of one block, in compute dtype. q, o, dO ``[..., Hkv, G, Lq, D or Dv]`` hold
    query rows ``[qa, qa + Lq)`` with their log-sum-exp ``lse`` ``[..., Hkv, G, Lq]`` (the
    whole attention's, saved by the forward); k ``[..., Hkv, Lk, D]``, v ``[..., Hkv, Lk,
    Dv]`` key rows ``[ka, ka + Lk)``; the options as attention_blocks.attend_block takes
    them (query row i at key position i + off; window, softcap, mask, bias, ALiBi slopes).
    Returns (dQ, dK, dV) of the block's visible (query, key) pairs alone: dQ sums over the
    block's keys, dK and dV over its query rows and the query heads of each key/value head's
    group. Per segment, as FlashAttention-2's backward: P = exp(S - lse) from the recomputed
    scores S, dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO o O)), through the score cap
    (d cap tanh(x / cap) = 1 - tanh^2), dQ = scale dS K, dK = scale dS^T Q. A row that sees
    no key (lse = -inf) adds nothing."""
    lq, lk = q.shape[-2], k.shape[-2]
    left, right = band(causal, window)
    dq = np.zeros(q.shape, q.dtype)
    dk = np.zeros(k.shape, k.dtype)
    dv = np.zeros(v.shape, v.dtype)
    delta = np.einsum("...d,...d->...", do, o)   # rowsum(dO o O) [..., Hkv, G, Lq]
    for a, b, c, e in blk.spans(qa, qa + lq, ka, ka + lk, segments, s, off, left, right):
        rq, rk = slice(a - qa, b - qa), slice(c - ka, e - ka)
        qs, dos, ks = q[..., rq, :], do[..., rq, :], k[..., rk, :]
        p, t, _ = probs(qs, ks, lse[..., rq], a + off, c, scale, left, right, softcap=softcap,
                        slopes=slopes, bias=cut(bias, a - qa, b - qa, c - ka, e - ka),
                        mask=cut(mask, a - qa, b - qa, c - ka, e - ka))
        dv[..., rk, :] += np.einsum("...hglm,...hgld->...hmd", p, dos)
        ds = p * (np.einsum("...hgld,...hmd->...hglm", dos, v[..., rk, :])
                  - delta[..., rq, None])
        if t is not None:
            ds = ds * (1 - t * t)
        dq[..., rq, :] += np.einsum("...hglm,...hmd->...hgld", ds, ks) * scale
        dk[..., rk, :] += np.einsum("...hglm,...hgld->...hmd", ds, qs) * scale
    return dq, dk, dv


def probs(qs, ks, lse, pa, c, scale, left, right, *, softcap=None, slopes=None, bias=None,
          mask=None):
    """The softmax weights P = exp(S - lse) [..., Hkv, G, L, M] of query rows at key
    positions ``[pa, pa + L)`` (``qs`` [..., Hkv, G, L, D], their saved ``lse`` [..., Hkv,
    G, L]) against keys ``[c, c + M)`` (``ks`` [..., Hkv, M, D]), with the forward's
    scores S (attention_blocks.attend_block: scaled, capped, ALiBi, bias) and 0 where a pair
    is not seen (band, ``mask``; a row of lse -inf sees none). ``bias``/``mask``: the
    blocks of these pairs. Also returns tanh(raw / softcap) (None without a cap) and the
    distances j - p [L, M]."""
    raw = np.einsum("...hgld,...hmd->...hglm", qs, ks) * scale
    t = None if softcap is None else np.tanh(raw / softcap)
    sc = raw if softcap is None else softcap * t
    dist = np.arange(c, c + ks.shape[-2])[None, :] - np.arange(pa, pa + qs.shape[-2])[:, None]
    if slopes is not None:
        sc = sc - slopes * np.abs(dist).astype(sc.dtype)
    if bias is not None:
        sc = sc + bias
    seen = np.isfinite(lse)[..., None]             # [..., Hkv, G, L, 1]
    if left is not None:
        seen = seen & (dist >= -left)
    if right is not None:
        seen = seen & (dist <= right)
    if mask is not None:
        seen = seen & mask
    lrow = np.where(np.isfinite(lse), lse, 0)[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(seen, np.exp(sc - lrow), 0), t, dist


def reduce_to(x, shape):
    """``x`` summed over the axes along which an operand of ``shape`` (as many dims)
    broadcasts against it (its 1s), kept as 1s."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def tiles(a: int, b: int, size: int):
    """``[a, b)`` in consecutive pieces of at most ``size``."""
    return ((x, min(x + size, b)) for x in range(a, b, size))


# rows and keys per tile of the bias-gradient kernels: their temporaries are a few of these
# tiles' scores per head, never a whole segment's S x S
DBIAS_TILE = 128


def dbias_block(q, k, v, o, lse, do, qa: int, ka: int, causal: bool, segments, s: int,
                scale, *, off=0, window=None, softcap=None, mask=None, bias=None,
                slopes=None):
    """The gradient of the block's visible (query, key) pairs with respect to the bias, in
    compute dtype and the grouped layout of ``bias`` or ``slopes`` (whichever is given;
    operands as :func:`bwd_block`'s). dS = P (dP - rowsum(dO o O)) is the loss's
    derivative by the final score (the bias is added after the cap): d(bias) is dS summed
    over the dims the bias broadcasts along, d(slope) = -sum over the pairs of dS |j - p|.
    Computed tile by tile (``DBIAS_TILE`` rows and keys), so the temporaries stay
    O(tile^2) per head whatever the block's length."""
    lq, lk = q.shape[-2], k.shape[-2]
    left, right = band(causal, window)
    target = slopes if slopes is not None else bias
    out = np.zeros(target.shape, q.dtype)
    delta = np.einsum("...d,...d->...", do, o)
    for ta, tb in tiles(qa, qa + lq, DBIAS_TILE):
        for tc, te in tiles(ka, ka + lk, DBIAS_TILE):
            for a, b, c, e in blk.spans(ta, tb, tc, te, segments, s, off, left, right):
                rq, rk = slice(a - qa, b - qa), slice(c - ka, e - ka)
                bias_blk = cut(bias, a - qa, b - qa, c - ka, e - ka)
                p, _, dist = probs(q[..., rq, :], k[..., rk, :], lse[..., rq], a + off, c,
                                   scale, left, right, softcap=softcap, slopes=slopes,
                                   bias=bias_blk, mask=cut(mask, a - qa, b - qa, c - ka,
                                                           e - ka))
                ds = p * (np.einsum("...hgld,...hmd->...hglm", do[..., rq, :],
                                    v[..., rk, :]) - delta[..., rq, None])
                if slopes is not None:
                    out -= reduce_to((ds * np.abs(dist)).sum(axis=(-2, -1), keepdims=True),
                                     out.shape)
                else:   # a view of the gradient's block (a basic slice)
                    view = cut(out, a - qa, b - qa, c - ka, e - ka)
                    view += reduce_to(ds, view.shape)
    return out
