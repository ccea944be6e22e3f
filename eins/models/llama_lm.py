"""A whole LLaMA language model in eins for training: token embedding, ``n_layers`` blocks
(eins/models/llama.py's, one dict of weights each), a final RMSNorm, the output head and the
mean cross-entropy of the next tokens. ``lm_loss`` is what ``eins.value_and_grad`` takes.

Attention is the ``attention`` primitive (``attention="primitive"``: its backward is
attention_bwd, flash-style from the saved log-sum-exp), or the same causal grouped-query
attention composed of einsum, where and softmax (``attention="composed"``: it keeps the
S x S probabilities; a second, independent formulation the tests compare gradients with).
``"auto"`` picks the primitive when it can be differentiated (it can).
"""
from __future__ import annotations

import math

import numpy as np

import eins
from eins.errors import EinsError, ShapeError
from eins.ir.primitive import get_primitive
from eins.ir.types import as_dtype
from eins.models import llama
from eins.tracing import ShapeDtype

__all__ = ["lm_weight_shapes", "init_lm", "lm_loss", "lm_loss_fn", "composed_attention", "block"]


def lm_weight_shapes(cfg: llama.LlamaConfig, vocab: int, n_layers: int,
                     dtype="float32") -> dict:
    """{"embed": [vocab, d], "layers": [block weights, ...], "norm": [d], "head": [d, vocab]}
    as ShapeDtypes."""
    for name, v in (("vocab", vocab), ("n_layers", n_layers)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise EinsError(f"llama_lm: {name} must be a positive int, got {v!r}")
    d = cfg.d_model
    return {"embed": ShapeDtype((vocab, d), dtype),
            "layers": [llama.weight_shapes(cfg, dtype) for _ in range(n_layers)],
            "norm": ShapeDtype((d,), dtype),
            "head": ShapeDtype((d, vocab), dtype)}


def init_lm(cfg: llama.LlamaConfig, vocab: int, n_layers: int, rng=None,
            dtype="float32") -> dict:
    """Random weights of :func:`lm_weight_shapes` (llama.init_weights per block)."""
    rng = np.random.default_rng(0) if rng is None else rng
    dt = as_dtype(dtype)
    shapes = lm_weight_shapes(cfg, vocab, n_layers, dt)
    return {"embed": rng.standard_normal(shapes["embed"].shape).astype(dt),
            "layers": [llama.init_weights(cfg, rng, dt) for _ in range(n_layers)],
            "norm": (1.0 + 0.1 * rng.standard_normal(cfg.d_model)).astype(dt),
            "head": (rng.standard_normal(shapes["head"].shape) / math.sqrt(cfg.d_model)
                     ).astype(dt)}


def composed_attention(q, k, v, causal=True, segments=None):
    """eins.attention(q, k, v, causal) for q ``[hq, S, dh]``, k/v ``[hkv, S, dh]`` from
    einsum, where and softmax (GQA: query head ``g*G + i`` reads key/value head g)."""
    if segments is not None:
        raise EinsError("composed_attention: packed segments are not supported; use the "
                        "attention primitive")
    hq, s, dh = q.shape
    hkv = k.shape[0]
    qg = q.reshape((hkv, hq // hkv, s, dh))
    scores = eins.einsum("hgsd,htd->hgst", qg, k) * (1.0 / math.sqrt(dh))
    if causal:
        allowed = np.tril(np.ones((s, s), dtype=bool))
        scores = eins.where(allowed, scores, -np.inf)
    p = eins.softmax(scores, axis=-1)
    return eins.einsum("hgst,htd->hgsd", p, v).reshape((hq, s, dh))


def _attention_fn(kind: str):
    if kind == "auto":
        kind = "primitive" if get_primitive("attention").vjp is not None else "composed"
    if kind == "primitive":
        return eins.attention
    if kind == "composed":
        return composed_attention
    raise EinsError(f"llama_lm: attention must be 'auto', 'primitive' or 'composed', got "
                    f"{kind!r}")


def block(x, w, cos, sin, cfg: llama.LlamaConfig, attention="auto"):
    """llama.block on one sequence ``x [S, d_model]`` with the attention of ``attention``
    (above)."""
    return _block(x, w, cos, sin, cfg, _attention_fn(attention))


def _block(x, w, cos, sin, cfg, attend):
    hq, hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    s = x.shape[0]

    def heads(t, n):
        return t.reshape((s, n, dh)).transpose((1, 0, 2))

    xn = eins.rms_norm(x, w["attn_norm"], eps=cfg.eps)
    q = eins.rope(heads(xn @ w["wq"], hq), cos, sin)
    k = eins.rope(heads(xn @ w["wk"], hkv), cos, sin)
    v = heads(xn @ w["wv"], hkv)
    a = attend(q, k, v, causal=True)
    h = x + a.transpose((1, 0, 2)).reshape((s, hq * dh)) @ w["wo"]
    hn = eins.rms_norm(h, w["ffn_norm"], eps=cfg.eps)
    return h + (eins.silu(hn @ w["w1"]) * (hn @ w["w3"])) @ w["w2"]


def lm_loss(params, tokens, labels, cos, sin, cfg: llama.LlamaConfig, attention="auto",
            remat=False):
    """The mean next-token cross-entropy of one sequence: ``tokens`` and ``labels`` int
    ``[S]``, ``cos``/``sin`` ``[S, head_dim]`` (llama.rope_tables). ``remat``: each block
    under :func:`eins.checkpoint`."""
    if len(tokens.shape) != 1 or tuple(labels.shape) != tuple(tokens.shape):
        raise ShapeError(f"llama_lm: tokens and labels must be [S] of one length, got "
                         f"{tuple(tokens.shape)} and {tuple(labels.shape)}")
    attend = _attention_fn(attention)
    block = eins.checkpoint(_block) if remat else _block
    x = params["embed"][tokens]
    for w in params["layers"]:
        x = block(x, w, cos, sin, cfg, attend)
    logits = eins.rms_norm(x, params["norm"], eps=cfg.eps) @ params["head"]
    logits = eins.astype(logits, "float32")
    m = eins.max(logits, axis=-1, keepdims=True)
    lse = m + eins.log(eins.sum(eins.exp(logits - m), axis=-1, keepdims=True))
    picked = eins.take_along_axis(logits - lse, labels.reshape((-1, 1)), axis=-1)
    return -eins.mean(picked)


def lm_loss_fn(cfg: llama.LlamaConfig, attention="auto", remat=False):
    """``loss(params, tokens, labels, cos, sin)`` with the static config bound."""
    def loss(params, tokens, labels, cos, sin):
        return lm_loss(params, tokens, labels, cos, sin, cfg, attention, remat)
    return loss
