"""``aten.scaled_dot_product_attention`` as one ``eins.attention``: a constant mask
classified (causal, full, a causal sliding window: eins.attention's flags, no mask
operand; any other pattern a constant mask operand), a mask computed from the inputs (a
padding mask) passed as eins.attention's ``mask`` (boolean) or ``bias`` (additive), and
transformers' ``repeat_kv`` recognized so the kv heads are read once (GQA)."""
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


def _keep(mask):
    """The boolean form of a constant mask (True: attend), or None for an additive mask
    with values other than 0 and -inf (or the dtype's lowest: what transformers fills in):
    a real bias."""
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        return m
    lowest = _lowest(m.dtype) if is_float(m.dtype) else None
    m = m.astype(np.float64)
    low = np.isneginf(m) | (m <= lowest) if lowest is not None else False
    if not np.all((m == 0) | low):
        return None
    return m == 0


def mask_kind(mask, sq: int, sk: int):
    """A constant attention mask as eins.attention's flags: "causal" (key j visible to
    query i exactly when j <= i), "full" (every key visible), ``("window", W)`` (causal, and
    i - j < W: Mistral's sliding window), or None (any other pattern)."""
    keep = _keep(mask)
    if keep is None:
        return None
    keep = np.broadcast_to(keep, keep.shape[:-2] + (sq, sk))
    if np.all(keep):
        return "full"
    if sq != sk:
        return None
    band = np.arange(sq)[:, None] - np.arange(sk)[None, :]      # i - j
    causal = band >= 0
    if np.array_equal(keep, np.broadcast_to(causal, keep.shape)):
        return "causal"
    widths = np.where(keep, band, -1).max(axis=-1) + 1          # keys seen per row, by reach
    w = int(widths.max()) if widths.size else 0
    if 0 < w and np.array_equal(keep, np.broadcast_to(causal & (band < w), keep.shape)):
        return ("window", w)
    return None


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


def fit_mask(x, q, sk: int, boolean: bool):
    """torch's ``attn_mask`` ``x`` in the layout eins.attention reads it in. torch
    broadcasts it to (*batch, Hq, Sq, Sk), its last dims always (Sq, Sk) (a 2-d mask is per
    query, whatever the batch); eins.attention takes a key-padding mask (*batch, Sk) or a
    mask or bias of q's rank ending in (Sq, Sk). So: a boolean mask seen alike by every head
    and query of each sequence (a key-padding mask as (B, 1, 1, Sk)) becomes the key mask,
    with no Sq x Sk copy; any other gets leading 1s and its query or key dim broadcast."""
    nb, shape, sq = len(q.shape) - 3, tuple(x.shape), q.shape[-2]
    if len(shape) > nb + 3:
        return x   # more dims than q: eins.attention's ShapeError says so
    traced = is_traced(x)
    reshape, broadcast = ((ops.reshape, ops.broadcast_to) if traced
                          else (np.reshape, np.broadcast_to))
    padded = (1,) * (nb + 3 - len(shape)) + shape
    batch = tuple(q.shape[:nb])
    if boolean and padded[nb:] == (1, 1, sk) and padded[:nb] == batch:
        return reshape(x, batch + (sk,))
    x = x if padded == shape else reshape(x, padded)
    if padded[-2:] != (sq, sk):
        x = broadcast(x, padded[:-2] + (sq, sk))
    return x if traced else np.ascontiguousarray(x)


def sdpa(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    if dropout_p:
        cx.fail(f"with dropout_p={dropout_p} (attention dropout in training mode)")
    sq, sk = q.shape[-2], k.shape[-2]
    kw = {"causal": bool(is_causal), "scale": scale}
    if is_causal and sq != sk:
        # torch aligns is_causal at the first key (query i sees keys j <= i); eins.attention
        # at the last (decode): a constant mask says torch's
        kw["causal"] = False
        kw["mask"] = fit_mask(np.tri(sq, sk, dtype=bool), q, sk, True)
    if attn_mask is not None:
        kw["causal"] = False
        if is_traced(attn_mask):   # a padding mask from the inputs: data
            boolean = np.dtype(attn_mask.dtype) == np.bool_
            kw["mask" if boolean else "bias"] = fit_mask(attn_mask, q, sk, boolean)
        else:
            key = ("mask", id(attn_mask), sq, sk)   # one mask serves every layer: look once
            kind = cx.memo[key] if key in cx.memo else cx.memo.setdefault(
                key, mask_kind(attn_mask, sq, sk))
            if kind == "causal":
                kw["causal"] = True
            elif isinstance(kind, tuple):
                kw.update(causal=True, window=kind[1])
            elif kind is None:
                keep = _keep(attn_mask)
                if keep is None:
                    kw["bias"] = fit_mask(np.asarray(attn_mask), q, sk, False)
                else:
                    kw["mask"] = fit_mask(keep, q, sk, True)
    rk, rv = repeated_heads(cx, k), repeated_heads(cx, v)
    if rk is not None and rv is not None and rk[1] == rv[1]:
        k, v = rk[0], rv[0]
    return ops.attention(q, k, v, **kw)
