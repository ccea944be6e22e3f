"""Grouped-query attention (FlashAttention-style, one primitive) with causal masking and
packed sequences.

``attention(q, k, v, causal=True, segments=None, scale=None)``: q ``[..., Hq, S, D]``, k and v
``[..., Hkv, S, D]`` with ``Hq % Hkv == 0``; query heads ``g*G .. (g+1)*G - 1`` (``G =
Hq/Hkv``) use key/value head g. ``segments`` is a static tuple of packed-sequence END
positions (the last one is S); a token attends only to tokens of its own segment (and only to
earlier ones when ``causal``). The softmax runs in float32 (float64 for float64 inputs).

Join-agg specs (Section 3.3, Example 3.10) come from a custom producer, not a Signature,
because q's head interval is derived from heads_kv's:
- leading batch dims: shardable ``any``;
- ``heads_kv``: shardable ``any``; an interval [a, b) of kv heads takes query heads
  [a*G, b*G) of q and of the output (heads_q is not an index of its own);
- ``sequence``: shardable only at the interior segment ends (no positions without segments);
  a block [lo, hi) then holds whole segments and needs no other tokens, so the block kernel
  just re-bases the segment ends to the block (``_attention_block``);
- ``head_dim``: never (the scores contract it inside the kernel).
No spec aggregates.

Later (needs a compute-aware cost; the producer and block kernel are written to take them):
query-sequence splits whose blocks read the key/value prefix [segment start, hi) they attend
to, and key-sequence splits whose partial outputs combine with a log-sum-exp ⊕ (each block
returning its output together with its row max and row sum).
"""
from __future__ import annotations

import math

import numpy as np

from eins.errors import EinsError, ShapeError
from eins.ir.joinagg import FunctionSpec, Indexing, JoinAggSpec, affine_indexing
from eins.ir.types import TensorType, result_dtype
from eins.ops.norms import compute_dtype, float_result
from eins.ops.registry import Primitive, register, register_gpu_lowering
from eins.tracing import bind

__all__ = ["attention"]


def _check_segments(segments, s: int) -> None:
    if segments is None:
        return
    ok = (len(segments) > 0 and all(isinstance(e, int) for e in segments)
          and all(a < b for a, b in zip((0,) + tuple(segments), segments))
          and segments[-1] == s)
    if not ok:
        raise ShapeError(f"attention: segments must be strictly increasing positive end "
                         f"positions ending at the sequence length S={s}, got {segments}")


def _attention_abstract(q: TensorType, k: TensorType, v: TensorType, *, causal, segments,
                        scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim < 3:
            raise ShapeError(f"attention: {name} must be [..., heads, S, D], got shape {t.shape}")
    if k.shape != v.shape:
        raise ShapeError(f"attention: k and v shapes differ: {k.shape} vs {v.shape}")
    if q.shape[:-3] != k.shape[:-3]:
        raise ShapeError(f"attention: batch dims of q {q.shape[:-3]} and k/v {k.shape[:-3]} "
                         f"differ (q {q.shape}, k {k.shape})")
    if q.shape[-2] != k.shape[-2]:
        raise ShapeError(f"attention: sequence lengths differ: q has S={q.shape[-2]}, k/v have "
                         f"S={k.shape[-2]} (q {q.shape}, k {k.shape})")
    if q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"attention: head dims differ: q has D={q.shape[-1]}, k/v have "
                         f"D={k.shape[-1]} (q {q.shape}, k {k.shape})")
    hq, hkv = q.shape[-3], k.shape[-3]
    if hkv == 0 or hq % hkv:
        raise ShapeError(f"attention: query heads Hq={hq} must be a multiple of key/value "
                         f"heads Hkv={hkv} (q {q.shape}, k {k.shape})")
    _check_segments(segments, q.shape[-2])
    return (TensorType(q.shape, float_result("attention", q, k, v)),)


def _attend(q, k, v, causal, scale):
    """One segment, whole: q [..., Hkv, G, L, D], k/v [..., Hkv, L, D], in compute dtype."""
    s = np.einsum("...hgld,...hmd->...hglm", q, k) * scale
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))  # the diagonal is always allowed: no NaN
    p = s / s.sum(axis=-1, keepdims=True)
    return np.einsum("...hglm,...hmd->...hgld", p, v)


def _attention_impl(q, k, v, *, causal, segments, scale):
    out_dtype = result_dtype(q.dtype, k.dtype, v.dtype)
    ct = compute_dtype(out_dtype)
    *batch, hq, s, d = q.shape
    hkv = k.shape[-3]
    g = hq // hkv
    sc = ct.type(1.0 / math.sqrt(max(d, 1)) if scale is None else scale)  # D=0: no scores
    # group query heads under their kv head: [..., Hkv, G, S, D] against [..., Hkv, S, D]
    qf = np.asarray(q).astype(ct, copy=False).reshape(*batch, hkv, g, s, d)
    kf = np.asarray(k).astype(ct, copy=False)
    vf = np.asarray(v).astype(ct, copy=False)
    out = np.empty(qf.shape, ct)
    start = 0
    for end in (segments or (s,)):
        if end == start:  # S == 0
            continue
        out[..., start:end, :] = _attend(qf[..., start:end, :], kf[..., start:end, :],
                                         vf[..., start:end, :], causal, sc)
        start = end
    return (out.reshape(q.shape).astype(out_dtype, copy=False),)


def _attention_block(fspec: FunctionSpec, q, k, v, *, causal, segments, scale):
    """f[F] for one function specification: the q block covers sequence [lo, hi), which must
    start and end at segment boundaries; the segment ends are re-based to the block."""
    lo, hi = fspec.inputs[0].lo[-2], fspec.inputs[0].hi[-2]
    # without segments the sequence is never split, so the block is the whole sequence
    ends = segments if segments is not None else (hi,)
    if lo not in (0,) + tuple(ends) or hi not in ends:
        raise EinsError(f"attention: block sequence [{lo}, {hi}) does not start and end at "
                        f"segment ends {ends}")
    local = tuple(e - lo for e in ends if lo < e <= hi)
    return _attention_impl(q, k, v, causal=causal, segments=local, scale=scale)


def _attention_flops(ins, outs, *, causal, segments, scale):
    q = ins[0]
    *batch, hq, s, d = q.shape
    starts = (0,) + tuple(segments or ())[:-1]
    pairs = sum((e - b) ** 2 for b, e in zip(starts, segments or (s,)))  # within segments
    f = 4 * math.prod(batch) * hq * pairs * d  # QK^T and PV, 2 flops per multiply-add
    return f // 2 if causal else f


def _attention_indexing(ins, outs, *, causal, segments, scale):
    """Example 3.10: named indices batch..., heads_kv, sequence, head_dim."""
    q, k, _ = ins
    nb = q.ndim - 3
    batch = ["batch"] if nb == 1 else [f"batch{i}" for i in range(nb)]
    hkv, s, d = k.shape[-3:]
    g = q.shape[-3] // hkv
    extents = dict(zip(batch, q.shape[:nb]))
    extents.update(heads_kv=hkv, sequence=s, head_dim=d)
    shardable: dict[str, object] = {n: "any" for n in batch}
    shardable["heads_kv"] = "any"
    cuts = tuple(segments[:-1]) if segments is not None else ()
    if cuts:
        shardable["sequence"] = cuts
    allowed = {0, s, *cuts}

    # Later splits slot in here: a query-sequence interval whose k/v boxes are the prefix
    # [segment start, hi) it attends to, and a kv-sequence index aggregated with a
    # log-sum-exp ⊕ (aggs would then name it); neither is offered yet.
    lead = [(n, 1, 0) for n in batch]
    qmap = lead + [("heads_kv", g, 0), ("sequence", 1, 0), None]
    kvmap = lead + [("heads_kv", 1, 0), ("sequence", 1, 0), None]
    boxes = affine_indexing(extents, shardable, [qmap, kvmap, kvmap], [qmap],
                            [q.shape, k.shape, k.shape], [q.shape])

    def producer(iv) -> JoinAggSpec:
        for a, b in iv["sequence"]:
            if a not in allowed or b not in allowed:
                raise EinsError(f"attention: sequence interval [{a}, {b}) does not start and "
                                f"end at allowed positions {sorted(allowed)}")
        if iv["head_dim"] != ((0, d),):
            raise EinsError(f"attention: head_dim (D={d}) is not shardable, got intervals "
                            f"{iv['head_dim']}")
        return boxes.producer(iv)

    return Indexing(extents, shardable, producer)


register(Primitive("attention", _attention_abstract, _attention_impl, _attention_flops,
                   _attention_indexing, _attention_block))


def attention(q, k, v, causal=True, segments=None, scale=None):
    """Grouped-query scaled dot-product attention (see the module docstring); ``scale``
    defaults to ``1/sqrt(D)``; the output has q's shape."""
    if segments is not None:
        try:
            segments = tuple(int(e) if isinstance(e, (int, np.integer)) else e
                             for e in segments)
        except TypeError:
            raise ShapeError(f"attention: segments must be a tuple of end positions, got "
                             f"{segments!r}") from None
    return bind("attention", q, k, v, causal=bool(causal), segments=segments,
                scale=None if scale is None else float(scale))


def _attention_gpu(fspec, outs, ins, *, causal, segments, scale):
    """GPU lowering: the Triton flash-attention kernel (eins/codegen/kernels/attention.py) on
    the block; the eqn's segments are global, and the block's global query/key positions
    come from its function spec, so a block masks exactly as the whole would."""
    from eins.codegen.kernels import attention as flash
    q_off = fspec.inputs[0].lo[-2] if fspec is not None else 0
    k_off = fspec.inputs[1].lo[-2] if fspec is not None else 0
    flash(*ins, outs[0], causal=causal, segments=segments, scale=scale, q_offset=q_off,
          k_offset=k_off)


register_gpu_lowering("attention", _attention_gpu, "triton_attention.py.j2")
