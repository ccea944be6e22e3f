"""The paper's LLaMA-style transformer block (Section 6, "Two workload families") as a pure eins
function over a dict of weights, the paper's five token workloads, and a decode step (below).

    h   = x + wo · attention(rope(rms_norm(x) wq), rope(rms_norm(x) wk), rms_norm(x) wv)
    out = h + w2 · (silu(rms_norm(h) w1) * (rms_norm(h) w3))

Attention is causal grouped-query attention (Example 3.10): query heads ``g*G .. (g+1)*G-1``
(``G = n_heads / n_kv_heads``) use key/value head ``g``. Packed sequences (several sequences
end to end along one token axis) pass their end positions as the static ``segments``; RoPE
positions restart at each segment start (:func:`rope_tables`).
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import numpy as np

import eins
from eins.errors import EinsError, ShapeError
from eins.ir.types import as_dtype
from eins.tracing import ShapeDtype

__all__ = ["LlamaConfig", "PAPER", "SMALL", "TINY", "WORKLOADS", "Workload", "block", "block_fn",
           "reference_block", "init_weights", "rope_tables", "weight_shapes", "segment_ends",
           "packed_block_fn", "padded_ends"]


def _positive_int(v, where: str, error=EinsError) -> int:
    """``v`` as a Python int when it is a positive integer of any kind (np.int64 too), else
    ``error`` naming it."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < 1:
        raise error(f"{where} must be a positive int, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of one block. The paper's: d_model 4,096, 32 query heads, 8 key/value heads of
    head dim 128, FFN 14,336."""

    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    d_ff: int = 14336
    eps: float = 1e-5
    rope_base: float = 10000.0

    def __post_init__(self):
        for f in ("d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
            object.__setattr__(self, f, _positive_int(getattr(self, f), f"LlamaConfig.{f}"))
        for f in ("eps", "rope_base"):   # rope_base 0 gave NaN outputs, with no error
            v = getattr(self, f)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or \
                    not 0 < v < math.inf:
                raise EinsError(f"LlamaConfig.{f} must be a positive finite number, got {v!r}")
            object.__setattr__(self, f, float(v))
        if self.n_heads % self.n_kv_heads:
            raise EinsError(f"LlamaConfig: n_heads={self.n_heads} must be a multiple of "
                            f"n_kv_heads={self.n_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise EinsError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")


PAPER = LlamaConfig()
SMALL = LlamaConfig(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96)
TINY = LlamaConfig(d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24)


def _config(cfg, where: str) -> LlamaConfig:
    if not isinstance(cfg, LlamaConfig):
        raise EinsError(f"{where}: expected a LlamaConfig (llama.TINY, llama.SMALL, "
                        f"llama.PAPER or LlamaConfig(...)), got {cfg!r}")
    return cfg


def _segments(segments, where: str):
    """Static packed-sequence ends as a tuple of ints (None stays None); a clear error for
    anything else (a bare int, a string)."""
    if segments is None:
        return None

    def whole(e):   # an int of any kind, or a whole float (np.array([4., 8.]) as before)
        if isinstance(e, numbers.Real) and not isinstance(e, numbers.Integral) and \
                float(e).is_integer():
            return int(e)
        return operator.index(e)
    try:
        return tuple(whole(e) for e in segments)
    except TypeError:
        raise ShapeError(f"{where}: segments must be a sequence of int end positions (or "
                         f"None), got {segments!r}") from None


def weight_shapes(cfg: LlamaConfig, dtype="float16") -> dict:
    """The block's weights as ``ShapeDtype``s (``x @ w`` convention: ``w`` is [in, out])."""
    cfg = _config(cfg, "llama.weight_shapes")
    d, hq, hkv, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {
        "attn_norm": (d,),
        "wq": (d, hq * dh),
        "wk": (d, hkv * dh),
        "wv": (d, hkv * dh),
        "wo": (hq * dh, d),
        "ffn_norm": (d,),
        "w1": (d, f),
        "w3": (d, f),
        "w2": (f, d),
    }
    return {k: ShapeDtype(s, dtype) for k, s in shapes.items()}


def init_weights(cfg: LlamaConfig, rng=None, dtype="float32") -> dict:
    """Random weights: norm weights near 1, projections ~ N(0, 1/fan_in) so activations stay
    O(1) (useful for comparing in low precision)."""
    rng = np.random.default_rng(0) if rng is None else rng
    dt = as_dtype(dtype)
    out = {}
    for name, sd in weight_shapes(cfg, dt).items():
        if len(sd.shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(sd.shape)
        else:
            w = rng.standard_normal(sd.shape) / np.sqrt(sd.shape[0])
        out[name] = w.astype(dt)
    return out


def segment_ends(n_seqs: int, seq_len: int) -> tuple[int, ...]:
    """End positions of ``n_seqs`` packed sequences of ``seq_len`` tokens each."""
    return tuple(seq_len * (i + 1) for i in range(n_seqs))


def padded_ends(ends, n: int, seq: int) -> np.ndarray:
    """One batch's segment ends as the int32 array of ``n`` entries that a packed program
    takes (``packed_block_fn``): the ends, then ``seq`` repeated (flash-attn's cu_seqlens
    padded to a maximum count). A ShapeError if there are more than ``n``."""
    ends = tuple(_segments(ends, "padded_ends") or (seq,))
    if len(ends) > n:
        raise ShapeError(f"padded_ends: {len(ends)} segments, more than the program's "
                         f"maximum of {n}")
    out = np.full(n, seq, np.int32)
    out[:len(ends)] = ends
    return out


def _array_ends(segments, seq: int):
    """A padded int array of ends (:func:`padded_ends`) as the static tuple: nondecreasing,
    last equal to ``seq``, repeats dropped."""
    e = np.asarray(segments).reshape(-1)
    if e.size == 0 or np.any(np.diff(e) < 0) or e[0] < 0 or e[-1] != seq:
        raise ShapeError(f"rope_tables: segments {e.tolist()} must be nondecreasing end "
                         f"positions ending at seq={seq} (padded with {seq})")
    return tuple(int(v) for v in np.unique(e[e > 0]))


def _positions(seq: int, segments) -> np.ndarray:
    if isinstance(segments, np.ndarray) and segments.dtype.kind in "iu":
        segments = _array_ends(segments, seq)   # the array a packed program takes
    segments = _segments(segments, "rope_tables")
    if segments is None:
        return np.arange(seq)
    if not segments or segments[-1] != seq or any(
            a >= b for a, b in zip((0,) + segments, segments)):
        raise ShapeError(f"rope_tables: segments must be increasing end positions ending at "
                         f"seq={seq}, got {segments}")
    pos = np.empty(seq, np.int64)
    start = 0
    for end in segments:
        pos[start:end] = np.arange(end - start)
        start = end
    return pos


def rope_tables(seq: int, head_dim: int, segments=None, base: float = 10000.0,
                dtype="float32"):
    """``(cos, sin)``, each ``[seq, head_dim]``, in the HF/LLaMA layout: angle
    ``pos * base**(-2i/head_dim)`` for ``i < head_dim/2``, repeated for the second half (the
    layout ``rotate_half`` expects). With ``segments``, positions restart at 0 at each packed
    sequence's start; they may be the padded int array a packed program takes
    (:func:`padded_ends`), so each batch's tables come from the same array as its
    attention's boundaries (tables are inputs: new ones re-trace nothing)."""
    for name, v in (("seq", seq), ("head_dim", head_dim)):
        _positive_int(v, f"rope_tables: {name}", ShapeError)
    if head_dim % 2:
        raise ShapeError(f"rope_tables: head_dim must be even, got {head_dim}")
    pos = _positions(seq, segments).astype(np.float64)
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.outer(pos, inv_freq)
    ang = np.concatenate([ang, ang], axis=-1)
    dt = as_dtype(dtype)
    return np.cos(ang).astype(dt), np.sin(ang).astype(dt)


def _heads(t, n, dh):
    """[..., S, n*dh] -> [..., n, S, dh]."""
    lead = tuple(t.shape[:-1])
    t = t.reshape(lead + (n, dh))
    nd = len(lead) + 2
    axes = tuple(range(nd - 3)) + (nd - 2, nd - 3, nd - 1)
    return t.transpose(axes)


def _merge_heads(t):
    """[..., n, S, dh] -> [..., S, n*dh]."""
    nd = len(t.shape)
    axes = tuple(range(nd - 3)) + (nd - 2, nd - 3, nd - 1)
    t = t.transpose(axes)
    lead = tuple(t.shape[:-2])
    return t.reshape(lead + (t.shape[-2] * t.shape[-1],))


_WEIGHT_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w3", "w2")


def block(x, weights, cos, sin, cfg: LlamaConfig, segments=None):
    """One LLaMA block on ``x`` of shape ``[S, d_model]`` or ``[B, S, d_model]``; ``cos``/``sin``
    ``[S, head_dim]`` (from :func:`rope_tables`); ``segments``: static packed-sequence end
    positions (Example 3.10), applied to every batch row, or an int array of them (padded
    with S, :func:`padded_ends`) that the program takes as data."""
    cfg = _config(cfg, "llama.block")
    missing = [k for k in _WEIGHT_NAMES if k not in weights]
    if missing:
        raise EinsError(f"llama.block: weights lack {missing}; expected keys {list(_WEIGHT_NAMES)}")
    if len(x.shape) not in (2, 3) or x.shape[-1] != cfg.d_model:
        raise ShapeError(f"llama.block: x must be [S, {cfg.d_model}] or [B, S, {cfg.d_model}], "
                         f"got shape {tuple(x.shape)}")
    w = weights
    hq, hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if not (hasattr(segments, "shape") and hasattr(segments, "dtype")):
        segments = _segments(segments, "llama.block")   # else data: an int array of ends

    xn = eins.rms_norm(x, w["attn_norm"], eps=cfg.eps)
    q = eins.rope(_heads(xn @ w["wq"], hq, dh), cos, sin)
    k = eins.rope(_heads(xn @ w["wk"], hkv, dh), cos, sin)
    v = _heads(xn @ w["wv"], hkv, dh)
    a = eins.attention(q, k, v, causal=True, segments=segments)
    h = x + _merge_heads(a) @ w["wo"]

    hn = eins.rms_norm(h, w["ffn_norm"], eps=cfg.eps)
    ff = (eins.silu(hn @ w["w1"]) * (hn @ w["w3"])) @ w["w2"]
    return h + ff


def block_fn(cfg: LlamaConfig, segments=None):
    """``fn(x, weights, cos, sin)``: :func:`block` with the static ``cfg`` and ``segments``
    bound (what ``eins.jit`` / ``eins.make_ir`` take)."""
    cfg = _config(cfg, "llama.block_fn")
    segments = _segments(segments, "llama.block_fn")

    def llama_block(x, weights, cos, sin):
        return block(x, weights, cos, sin, cfg, segments)

    return llama_block


def packed_block_fn(cfg: LlamaConfig):
    """``fn(x, weights, cos, sin, ends)``: :func:`block` on packed sequences whose ends are
    data: ``ends`` is the int array of :func:`padded_ends`, ``cos``/``sin`` come from
    ``rope_tables(S, head_dim, ends)``. One trace and one plan serve every batch of that
    shape, whatever its boundaries (issue 36)."""
    cfg = _config(cfg, "llama.packed_block_fn")

    def llama_packed_block(x, weights, cos, sin, ends):
        return block(x, weights, cos, sin, cfg, ends)

    return llama_packed_block


def reference_block(x, weights, cos, sin, cfg: LlamaConfig, segments=None) -> np.ndarray:
    """The same block written directly in numpy (float64), for checking a run (the demo);
    the tests check both against their own independent implementation."""
    f = np.float64
    x = np.asarray(x, f)
    w = {k: np.asarray(v, f) for k, v in weights.items()}
    cos, sin = np.asarray(cos, f), np.asarray(sin, f)
    hq, hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def rms(t, g):
        return g * t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + cfg.eps)

    def heads(t, n):  # [..., S, n*dh] -> [..., n, S, dh]
        return np.swapaxes(t.reshape(t.shape[:-1] + (n, dh)), -2, -3)

    def rot(t):
        return t * cos + np.concatenate([-t[..., dh // 2:], t[..., :dh // 2]], -1) * sin

    s = x.shape[-2]
    xn = rms(x, w["attn_norm"])
    q, k, v = rot(heads(xn @ w["wq"], hq)), rot(heads(xn @ w["wk"], hkv)), heads(xn @ w["wv"], hkv)
    k, v = (np.repeat(t, hq // hkv, axis=-3) for t in (k, v))  # kv head g serves its group
    seg = np.searchsorted(np.asarray(segments or (s,)), np.arange(s), side="right")
    allowed = (np.arange(s)[None, :] <= np.arange(s)[:, None]) & (seg[None, :] == seg[:, None])
    scores = np.where(allowed, q @ np.swapaxes(k, -1, -2) / np.sqrt(dh), -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    a = (p / p.sum(-1, keepdims=True)) @ v
    a = np.swapaxes(a, -2, -3).reshape(x.shape[:-1] + (hq * dh,))
    h = x + a @ w["wo"]
    hn = rms(h, w["ffn_norm"])
    g = hn @ w["w1"]
    return h + (g / (1.0 + np.exp(-g)) * (hn @ w["w3"])) @ w["w2"]


# ----------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """One of the paper's token workloads: ``n_seqs`` sequences of ``seq_len`` tokens.

    ``packed=True`` lays them end to end on one token axis (``x [n_seqs*seq_len, d]`` with
    ``segments``); ``packed=False`` gives them a leading batch dimension (``x [n_seqs,
    seq_len, d]``). A single sequence is the same either way (it is given without a batch
    dimension)."""

    name: str
    n_seqs: int
    seq_len: int
    packed: bool = True

    def __post_init__(self):
        for f in ("n_seqs", "seq_len"):
            object.__setattr__(self, f, _positive_int(getattr(self, f),
                                                      f"Workload {self.name!r}: {f}"))
        if not isinstance(self.packed, (bool, np.bool_)):
            raise EinsError(f"Workload {self.name!r}: packed must be True or False, got "
                            f"{self.packed!r}")
        object.__setattr__(self, "packed", bool(self.packed))

    @property
    def tokens(self) -> int:
        return self.n_seqs * self.seq_len

    @property
    def segments(self):
        """Packed-sequence ends (None for one sequence or a batch dimension)."""
        if self.n_seqs == 1 or not self.packed:
            return None
        return segment_ends(self.n_seqs, self.seq_len)

    def x_shape(self, cfg: LlamaConfig) -> tuple:
        cfg = _config(cfg, f"Workload {self.name!r}")
        if self.packed or self.n_seqs == 1:
            return (self.tokens, cfg.d_model)
        return (self.n_seqs, self.seq_len, cfg.d_model)

    def args(self, cfg: LlamaConfig = PAPER, dtype="float16"):
        """ShapeDtype arguments ``(x, weights, cos, sin)`` of :meth:`function`."""
        x = ShapeDtype(self.x_shape(cfg), dtype)
        cs = ShapeDtype((x.shape[-2], cfg.head_dim), dtype)  # one row per position of x
        return (x, weight_shapes(cfg, dtype), cs, cs)

    __call__ = args  # a workload is a function of the config returning its arguments

    def function(self, cfg: LlamaConfig = PAPER):
        """The block with this workload's static config and segments bound:
        ``eins.make_ir(w.function(cfg))(*w.args(cfg))``."""
        return block_fn(cfg, self.segments)


# The paper's five workloads (Section 6): single sequences of 1K, 8K and 128K tokens; batches of
# 8 and 128 sequences of 1K tokens, each both packed (with segments) and batched.
WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (
        Workload("1x1K", 1, 1024),
        Workload("1x8K", 1, 8192),
        Workload("1x128K", 1, 131072),
        Workload("8x1K", 8, 1024),
        Workload("128x1K", 128, 1024),
        Workload("8x1K-batch", 8, 1024, packed=False),
        Workload("128x1K-batch", 128, 1024, packed=False),
    )
}


# ----------------------------------------------------------------------------- decode
def _rotate_half(t):
    h = t.shape[-1] // 2
    return eins.concatenate([-t[..., h:], t[..., :h]], -1)


def decode_step(x, weights, cache_k, cache_v, cos, sin, lengths, cfg: LlamaConfig):
    """One decode step of the block, written as a model author writes it: ``x [B, 1, d]`` is
    one new token per sequence, ``cache_k``/``cache_v [B, L, Hkv, dh]`` a KV cache of ``L``
    slots (the token-major layout of JAX decoders) of which sequence b holds ``lengths[b]``
    (traced ints), ``cos``/``sin [B, dh]`` the RoPE rows of each new token's position
    (``lengths[b]``). The new token's key and value go to slot ``lengths[b]``
    (``cache.at[rows, lengths].set(k)``, JAX's functional update: a new cache), and it
    attends to the slots ``<= lengths[b]`` (a key-padding mask built from ``lengths``).
    Returns ``(out [B, 1, d], cache_k, cache_v)``."""
    cfg = _config(cfg, "llama.decode_step")
    if len(x.shape) != 3 or x.shape[1] != 1 or x.shape[2] != cfg.d_model:
        raise ShapeError(f"llama.decode_step: x must be [B, 1, {cfg.d_model}] (one new token "
                         f"per sequence), got shape {tuple(x.shape)}")
    w = weights
    hq, hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    b, slots = x.shape[0], cache_k.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]                # [B, 1, dh]: over the heads

    xn = eins.rms_norm(x, w["attn_norm"], eps=cfg.eps)[:, 0]   # [B, d]
    q = (xn @ w["wq"]).reshape(b, hq, dh)
    k = (xn @ w["wk"]).reshape(b, hkv, dh)
    v = (xn @ w["wv"]).reshape(b, hkv, dh)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    rows = np.arange(b)
    cache_k = cache_k.at[rows, lengths].set(k)
    cache_v = cache_v.at[rows, lengths].set(v)
    seen = np.arange(slots)[None, :] <= lengths[:, None]   # [B, L]: the filled slots
    a = eins.attention(q[:, :, None, :], cache_k.transpose(0, 2, 1, 3),
                       cache_v.transpose(0, 2, 1, 3), causal=False, mask=seen)
    h = x + a.reshape(b, 1, hq * dh) @ w["wo"]

    hn = eins.rms_norm(h, w["ffn_norm"], eps=cfg.eps)
    ff = (eins.silu(hn @ w["w1"]) * (hn @ w["w3"])) @ w["w2"]
    return h + ff, cache_k, cache_v


def decode_fn(cfg: LlamaConfig):
    """``fn(x, weights, cache_k, cache_v, cos, sin, lengths)``: :func:`decode_step` with the
    static ``cfg`` bound."""
    cfg = _config(cfg, "llama.decode_fn")

    def llama_decode(x, weights, cache_k, cache_v, cos, sin, lengths):
        return decode_step(x, weights, cache_k, cache_v, cos, sin, lengths, cfg)

    return llama_decode


@dataclass(frozen=True)
class DecodeWorkload:
    """A decode step: ``batch`` sequences of one new token each against a KV cache of
    ``cache_len`` slots per sequence (``decode-8x32K``: batch 8, cache 32K)."""

    name: str
    batch: int
    cache_len: int

    def __post_init__(self):
        for f in ("batch", "cache_len"):
            object.__setattr__(self, f, _positive_int(getattr(self, f),
                                                      f"DecodeWorkload {self.name!r}: {f}"))

    def args(self, cfg: LlamaConfig = PAPER, dtype="float16"):
        """ShapeDtype arguments ``(x, weights, cache_k, cache_v, cos, sin, lengths)``."""
        cfg = _config(cfg, f"DecodeWorkload {self.name!r}")
        b, hkv, dh = self.batch, cfg.n_kv_heads, cfg.head_dim
        cache = ShapeDtype((b, self.cache_len, hkv, dh), dtype)
        cs = ShapeDtype((b, dh), dtype)
        return (ShapeDtype((b, 1, cfg.d_model), dtype), weight_shapes(cfg, dtype), cache,
                cache, cs, cs, ShapeDtype((b,), "int64"))

    __call__ = args

    def function(self, cfg: LlamaConfig = PAPER):
        return decode_fn(cfg)


__all__ += ["decode_step", "decode_fn", "DecodeWorkload", "DECODE_WORKLOADS"]

DECODE_WORKLOADS: dict[str, DecodeWorkload] = {
    w.name: w for w in (
        DecodeWorkload("decode-1x8K", 1, 8192),
        DecodeWorkload("decode-8x32K", 8, 32768),
        DecodeWorkload("decode-64x4K", 64, 4096),
        DecodeWorkload("decode-8x128K", 8, 131072),
    )
}
"""``eins plan decode-8x32K``: a decode step of the block (:func:`decode_step`)."""
