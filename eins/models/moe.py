"""A Mixtral-style sparse mixture-of-experts FFN as a pure eins function, with its dense form
and a plain-numpy reference (issue 33, routing).

    x      = rms_norm(h)
    gates, experts = softmax(top_k(x wg, k))          per token: k experts and their weights
    out    = h + sum_j gates_j * expert_{experts_j}(x),  expert_e(x) = w2_e (silu(x w1_e) * x w3_e)

The sparse form groups the tokens per expert with a static capacity
``C = ceil(capacity_factor * T * k / E)`` (at most T): the T*k (token, expert) assignments are
sorted by expert (a stable ``argsort``, so each expert takes its tokens in token order), slot
``c`` of expert ``e`` holds the ``c``-th of them, and a token beyond an expert's capacity is
dropped from that expert (Switch Transformer's rule). Each expert then runs one matmul per
weight over its own ``C`` tokens (``einsum('ecd,edf->ecf')``: E*C rows in all, ``k/E`` times
the capacity factor of the dense form's E*T), and the results are added back to their tokens
with ``.at[].add``. The dense form runs every expert on every token and weighs the results
(zero weight for the experts a token did not pick).

Split by experts (the ``e`` index of the expert einsums), each device holds its experts'
weights and the tokens travel to them by the exchange: expert parallelism, which the DP
finds on its own (``examples/moe.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import eins
from eins.errors import EinsError

__all__ = ["MoEConfig", "MIXTRAL", "TINY", "capacity", "weight_shapes", "init_weights",
           "block_fn", "reference_block"]


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of one MoE FFN; the defaults are Mixtral-8x7B's (d_model 4,096, FFN 14,336,
    8 experts, top 2) with the Switch Transformer's capacity factor 1.25."""

    d_model: int = 4096
    d_ff: int = 14336
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    eps: float = 1e-5

    def __post_init__(self):
        for f in ("d_model", "d_ff", "n_experts", "top_k"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise EinsError(f"MoEConfig.{f} must be a positive int, got {v!r}")
        if self.top_k > self.n_experts:
            raise EinsError(f"MoEConfig: top_k={self.top_k} exceeds n_experts="
                            f"{self.n_experts}")
        if not 0 < self.capacity_factor < math.inf:
            raise EinsError(f"MoEConfig.capacity_factor must be positive, got "
                            f"{self.capacity_factor!r}")


# Mixtral itself drops no token; a static capacity is what makes the shapes static, and at
# 1.0 the experts run exactly k/E of the dense FLOPs (examples/moe.py prints 1.25 too)
MIXTRAL = MoEConfig(capacity_factor=1.0)
TINY = MoEConfig(d_model=16, d_ff=24, n_experts=4, top_k=2)


def capacity(cfg: MoEConfig, tokens: int) -> int:
    """Slots per expert: ``ceil(capacity_factor * T * k / E)``, at most T (a token picks an
    expert once)."""
    return min(tokens, math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts))


def weight_shapes(cfg: MoEConfig) -> dict:
    d, f, e = cfg.d_model, cfg.d_ff, cfg.n_experts
    return {"norm": (d,), "wg": (d, e), "w1": (e, d, f), "w3": (e, d, f), "w2": (e, f, d)}


def init_weights(cfg: MoEConfig, rng, dtype="float32") -> dict:
    out = {}
    for k, s in weight_shapes(cfg).items():
        scale = 1.0 if k == "norm" else 1.0 / math.sqrt(s[-2])
        w = rng.standard_normal(s) * scale + (1.0 if k == "norm" else 0.0)
        out[k] = w.astype(dtype)
    return out


def _route(cfg, x, wg):
    vals, experts = eins.top_k(x @ wg, cfg.top_k)     # [T, k], ties: lowest expert first
    return eins.softmax(vals, axis=-1), experts       # Mixtral: softmax over the top k


def sparse_moe(cfg: MoEConfig, x, w):
    t, d = x.shape
    e, k = cfg.n_experts, cfg.top_k
    c = capacity(cfg, t)
    gates, experts = _route(cfg, x, w["wg"])
    flat = experts.reshape(t * k)                     # assignment t*k + j -> its expert
    order = np.argsort(flat)                          # grouped by expert, in token order
    ids = np.arange(e)[:, None]
    start = np.sum(flat[None, :] < ids, axis=1)       # [E]: where each expert's run begins
    count = np.sum(flat[None, :] == ids, axis=1)      # [E]: its assignments
    slot = np.arange(c)[None, :]
    valid = slot < count[:, None]                     # [E, C]: the slot holds a token
    a = order[np.minimum(start[:, None] + slot, t * k - 1)]   # [E, C]: its assignment
    tok = eins.take(np.repeat(np.arange(t), k), a)    # [E, C]: its token
    gate = np.where(valid, gates.reshape(t * k)[a], 0.0)
    xe = x[tok]                                       # [E, C, D]: each expert's tokens
    hid = eins.silu(np.einsum("ecd,edf->ecf", xe, w["w1"])) * \
        np.einsum("ecd,edf->ecf", xe, w["w3"])
    ye = np.einsum("ecf,efd->ecd", hid, w["w2"]) * gate[:, :, None]
    return eins.at(np.zeros((t, d), x.dtype))[tok].add(ye)


def dense_moe(cfg: MoEConfig, x, w):
    gates, experts = _route(cfg, x, w["wg"])
    picked = (experts[:, :, None] == np.arange(cfg.n_experts)).astype(x.dtype)
    weight = np.einsum("tk,tke->te", gates, picked)   # [T, E], zero where not picked
    hid = eins.silu(np.einsum("td,edf->etf", x, w["w1"])) * \
        np.einsum("td,edf->etf", x, w["w3"])
    y = np.einsum("etf,efd->etd", hid, w["w2"])
    return np.einsum("etd,te->td", y, weight)


def block_fn(cfg: MoEConfig, sparse: bool = True):
    """``fn(h, w) -> h + moe(rms_norm(h))`` over tokens ``h`` [T, d_model] and the weights
    dict of :func:`weight_shapes`: the sparse (grouped per expert) or the dense form."""
    moe = sparse_moe if sparse else dense_moe

    def fn(h, w):
        return h + moe(cfg, eins.rms_norm(h, w["norm"], eps=cfg.eps), w)

    fn.__name__ = "moe_sparse" if sparse else "moe_dense"
    return fn


def reference_block(cfg: MoEConfig, h, w):
    """The sparse block in plain numpy (float64), expert by expert: each takes its first
    ``capacity`` assignments in token order; the others are dropped."""
    h = np.asarray(h, np.float64)
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    x = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + cfg.eps) * w["norm"]
    logits = x @ w["wg"]
    t = x.shape[0]
    out = h.copy()
    queues = {e: [] for e in range(cfg.n_experts)}
    for i in range(t):
        top = sorted(range(cfg.n_experts), key=lambda e: (-logits[i, e], e))[:cfg.top_k]
        p = np.exp(logits[i, top] - logits[i, top].max())
        for e, g in zip(top, p / p.sum()):
            queues[e].append((i, g))
    for e, q in queues.items():
        for i, g in q[:capacity(cfg, t)]:
            a = x[i] @ w["w1"][e]
            hid = a / (1 + np.exp(-a)) * (x[i] @ w["w3"][e])
            out[i] += g * (hid @ w["w2"][e])
    return out
