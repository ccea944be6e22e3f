"""``aten.scaled_dot_product_attention`` as one ``eins.attention``: its mask classified
(causal, full, or refused until eins.attention takes a mask), transformers' ``repeat_kv``
recognized so the kv heads are read once (GQA)."""
from __future__ import annotations

import numpy as np

import eins.ops as ops
from eins.frontends.node import is_traced, noted
from eins.ir.types import is_float


def _lowest(dtype) -> float:
    if np.dtype(dtype).kind == "f":
        return float(np.finfo(dtype).min)
    import ml_dtypes  # optional (eins[bf16]): only a bfloat16 mask reaches here, which needs it
    return float(ml_dtypes.finfo(dtype).min)


def mask_kind(mask, sq: int, sk: int):
    """A constant attention mask as eins.attention's flag: "causal" (key j visible to
    query i exactly when j <= i), "full" (every key visible), or None (any other pattern:
    a sliding window, padding). Boolean masks keep True; additive masks keep 0 and drop
    -inf or the dtype's lowest value (what transformers fills in)."""
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        keep = m
    else:
        lowest = _lowest(m.dtype) if is_float(m.dtype) else None
        m = m.astype(np.float64)
        low = np.isneginf(m) | (m <= lowest) if lowest is not None else False
        if not np.all((m == 0) | low):
            return None
        keep = m == 0
    keep = np.broadcast_to(keep, keep.shape[:-2] + (sq, sk))
    if sq == sk and np.array_equal(keep, np.broadcast_to(np.tri(sq, dtype=bool), keep.shape)):
        return "causal"
    return "full" if np.all(keep) else None


def repeated_heads(cx, x):
    """``(kv, g)`` when ``x`` is transformers' ``repeat_kv(kv, g)`` (unsqueeze, expand,
    reshape of [..., Hkv, S, D] to [..., Hkv*g, S, D]), else None: eins.attention takes
    GQA's kv heads directly, so the repeated copy is never computed."""
    origin = noted(cx, "reshaped", x)
    if origin is None:
        return None
    grown = noted(cx, "expanded", origin)
    if grown is None:
        return None
    src, shape = grown
    nd = len(x.shape)
    if (len(src.shape) != nd + 1 or src.shape[-3] != 1 or len(shape) != nd + 1
            or any(s != 1 for k, s in enumerate(shape) if k != nd - 2)):
        return None
    g = shape[nd - 2]
    heads = tuple(src.shape[:-4]) + (src.shape[-4],) + tuple(src.shape[-2:])
    if tuple(x.shape) != heads[:-3] + (heads[-3] * g,) + heads[-2:]:
        return None
    kv = noted(cx, "reshaped", src)   # the unsqueeze's input: no new eqn
    if kv is None or tuple(kv.shape) != heads:
        kv = ops.reshape(src, heads)
    return kv, g


def sdpa(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    if dropout_p:
        cx.fail(f"with dropout_p={dropout_p} (attention dropout in training mode)")
    sq, sk = q.shape[-2], k.shape[-2]
    if sq != sk:
        cx.fail(f"with {sq} queries and {sk} keys (eins.attention takes equal lengths)")
    causal = bool(is_causal)
    if attn_mask is not None:
        if is_traced(attn_mask):
            cx.fail("with a mask computed from the inputs (a padding mask): eins.attention "
                    "takes causal or full attention until its mask option (issue 33)")
        key = ("mask", id(attn_mask), sq, sk)   # one mask serves every layer: look once
        kind = cx.memo[key] if key in cx.memo else cx.memo.setdefault(
            key, mask_kind(attn_mask, sq, sk))
        if kind is None:
            cx.fail("with a mask that is neither causal nor full (a sliding window, a "
                    "padding pattern): eins.attention takes those once its mask option "
                    "lands (issue 33)")
        causal = kind == "causal"
    rk, rv = repeated_heads(cx, k), repeated_heads(cx, v)
    if rk is not None and rv is not None and rk[1] == rv[1]:
        k, v = rk[0], rv[0]
    return ops.attention(q, k, v, causal=causal, scale=scale)
