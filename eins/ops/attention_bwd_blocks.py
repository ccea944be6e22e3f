"""Attention's backward on blocks of the sequence, in numpy (the reference kernels of
eins/ops/attention_bwd.py): which query rows a block of keys needs, the block kernel of
FlashAttention-2's backward (scores recomputed from q, k and the saved log-sum-exp), and the
cut positions at which a split's gradients need no ⊕.

Positions are global, as in eins/ops/attention_blocks.py: a block holds query rows
``[qa, qa + Lq)`` and key rows ``[ka, ka + Lk)`` of the sequence ``[0, S)``; ``segments``
are packed-sequence END positions (None: one segment). Token i sees token j iff both lie in
one segment and, when causal, ``j <= i``.
"""
from __future__ import annotations

import numpy as np

from eins.ops import attention_blocks as blk

__all__ = ["needed_queries", "at_segment_ends", "bwd_block"]


def needed_queries(ka: int, kb: int, causal: bool, segments, s: int) -> tuple[int, int]:
    """The query rows ``[lo, hi)`` that see some key of ``[ka, kb)``: from ka (causal) or
    the start of ka's segment (non-causal) to the end of the segment of key kb - 1."""
    lo = ka if causal else blk.segment_of(ka, segments, s)[0]
    return lo, blk.segment_of(kb - 1, segments, s)[1]


def at_segment_ends(intervals, segments, s: int) -> bool:
    """Whether every interval of one sequence index starts and ends at a segment end (or 0):
    blocks of whole segments, whose tokens see no other block's."""
    ends = {0, *(segments or (s,))}
    return all(a in ends and b in ends for a, b in intervals)


def bwd_block(q, k, v, o, lse, do, qa: int, ka: int, causal: bool, segments, s: int, scale):
    """Gradients of one block, in compute dtype. q, o, dO ``[..., Hkv, G, Lq, D]`` hold
    query rows ``[qa, qa + Lq)`` with their log-sum-exp ``lse`` ``[..., Hkv, G, Lq]`` (the
    whole attention's, saved by the forward); k, v ``[..., Hkv, Lk, D]`` key rows
    ``[ka, ka + Lk)``. Returns (dQ, dK, dV) of the block's visible (query, key) pairs alone:
    dQ sums over the block's keys, dK and dV over its query rows and the query heads of each
    key/value head's group. Per segment, as FlashAttention-2's backward: P = exp(S - lse)
    from the recomputed scores S, dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO o O)),
    dQ = scale dS K, dK = scale dS^T Q. A row that sees no key (lse = -inf) adds nothing."""
    lq, lk = q.shape[-2], k.shape[-2]
    qb, kb = qa + lq, ka + lk
    dq = np.zeros(q.shape, q.dtype)
    dk = np.zeros(k.shape, k.dtype)
    dv = np.zeros(v.shape, v.dtype)
    delta = np.einsum("...d,...d->...", do, o)   # rowsum(dO o O) [..., Hkv, G, Lq]
    start = 0
    for end in tuple(segments) if segments else (s,):
        a, b = max(qa, start), min(qb, end)
        c, e = max(ka, start), min(kb, end)
        if causal:
            e = min(e, b)   # keys after the block's last query are never seen
        start = end
        if b <= a or e <= c:
            continue
        rq, rk = slice(a - qa, b - qa), slice(c - ka, e - ka)
        qs, dos = q[..., rq, :], do[..., rq, :]
        ks, vs = k[..., rk, :], v[..., rk, :]
        sc = np.einsum("...hgld,...hmd->...hglm", qs, ks) * scale
        seen = np.isfinite(lse[..., rq])[..., None]             # [..., Hkv, G, L, 1]
        if causal:
            seen = seen & (np.arange(c, e)[None, :] <= np.arange(a, b)[:, None])
        lrow = np.where(np.isfinite(lse[..., rq]), lse[..., rq], 0)[..., None]
        with np.errstate(over="ignore", invalid="ignore"):
            p = np.where(seen, np.exp(sc - lrow), 0)
        dv[..., rk, :] += np.einsum("...hglm,...hgld->...hmd", p, dos)
        dp = np.einsum("...hgld,...hmd->...hglm", dos, vs)
        ds = p * (dp - delta[..., rq, None])
        dq[..., rq, :] += np.einsum("...hglm,...hmd->...hgld", ds, ks) * scale
        dk[..., rk, :] += np.einsum("...hglm,...hgld->...hmd", ds, qs) * scale
    return dq, dk, dv
