"""A tiny LLaMA language model and its training step, written with eins ops: token embedding,
``layers`` blocks of :func:`eins.models.llama.block`, a final RMSNorm, the output head and
the mean cross-entropy of the next token; AdamW (PyTorch's ``torch.optim.AdamW`` update,
decoupled weight decay on every parameter) as eins elementwise ops. ``step`` is one whole
training step, forward, backward (``eins.value_and_grad``) and optimizer, as one program
that ``eins.distribute`` plans at once.

:func:`torch_losses` trains the same model with ``torch.autograd`` and
``torch.optim.AdamW`` from the same initial weights on the same batches: the reference that
examples/train_llama.py and tests/test_train_llama.py compare the loss curve with.

>>> cfg = LMConfig(vocab=32, layers=1, block=llama.TINY)
>>> sorted(init_params(cfg))
['blocks', 'embed', 'head', 'norm']
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np

import eins
from eins.errors import EinsError
from eins.models import llama

__all__ = ["LMConfig", "AdamW", "init_params", "zeros_like", "loss", "step_fn", "schedule",
           "batches", "torch_losses"]


@dataclass(frozen=True)
class LMConfig:
    """The language model's sizes: ``vocab`` tokens, ``layers`` blocks of ``block``."""

    vocab: int = 64
    layers: int = 2
    block: llama.LlamaConfig = field(default_factory=lambda: llama.TINY)

    def __post_init__(self):
        for f in ("vocab", "layers"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise EinsError(f"LMConfig.{f} must be a positive int, got {v!r}")
        if not isinstance(self.block, llama.LlamaConfig):
            raise EinsError(f"LMConfig.block must be a LlamaConfig, got {self.block!r}")


@dataclass(frozen=True)
class AdamW:
    """``torch.optim.AdamW``'s hyperparameters (its defaults but the learning rate)."""

    lr: float = 1e-2
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


def init_params(cfg: LMConfig, rng=None, dtype="float32") -> dict:
    """Random weights: {"embed": [vocab, d], "blocks": [block weights...], "norm": [d],
    "head": [d, vocab]} (``x @ w`` convention)."""
    rng = np.random.default_rng(0) if rng is None else rng
    d = cfg.block.d_model
    return {"embed": (0.5 * rng.standard_normal((cfg.vocab, d))).astype(dtype),
            "blocks": [llama.init_weights(cfg.block, rng, dtype) for _ in range(cfg.layers)],
            "norm": np.ones(d, dtype),
            "head": (rng.standard_normal((d, cfg.vocab)) / np.sqrt(d)).astype(dtype)}


def zeros_like(tree):
    """A pytree of zeros shaped as ``tree`` (AdamW's first and second moments at step 0)."""
    leaves, treedef = eins.tree_flatten(tree)
    return eins.tree_unflatten(treedef, [np.zeros(np.shape(a), a.dtype) for a in leaves])


def loss(params, ids, targets, cos, sin, cfg: LMConfig, remat: bool = False):
    """Mean cross-entropy of ``targets`` [B, S] given ``ids`` [B, S] (int). ``remat``: each
    block under :func:`eins.checkpoint` (its activations recomputed in the backward instead
    of saved, as activation checkpointing does)."""
    block = eins.checkpoint(llama.block) if remat else llama.block
    x = params["embed"][ids]
    for w in params["blocks"]:
        x = block(x, w, cos, sin, cfg.block)
    x = eins.rms_norm(x, params["norm"], eps=cfg.block.eps)
    logits = x @ params["head"]
    top = np.max(logits, axis=-1, keepdims=True)
    lse = np.log(np.sum(np.exp(logits - top), axis=-1, keepdims=True)) + top
    picked = np.take_along_axis(logits - lse, targets[..., None], axis=-1)
    return -np.mean(picked)


def _adamw(p, g, m, v, sched, opt: AdamW):
    """One AdamW update of one parameter, as torch.optim.AdamW computes it (``sched``: the
    step's [lr, lr / (1 - b1^t), 1 / sqrt(1 - b2^t)] from :func:`schedule`)."""
    m = opt.b1 * m + (1 - opt.b1) * g
    v = opt.b2 * v + (1 - opt.b2) * (g * g)
    p = p * (1 - sched[0] * opt.weight_decay)
    p = p - sched[1] * m / (np.sqrt(v) * sched[2] + opt.eps)
    return p, m, v


def step_fn(cfg: LMConfig, opt: AdamW = AdamW(), remat: bool = False):
    """``step(params, m, v, ids, targets, cos, sin, sched) -> (loss, params, m, v)``: one
    training step (``sched`` from :func:`schedule`, an array so that every step runs the
    same program); ``remat``: activation checkpointing per block (:func:`loss`)."""

    def train_step(params, m, v, ids, targets, cos, sin, sched):
        value, grads = eins.value_and_grad(loss)(params, ids, targets, cos, sin, cfg, remat)
        ps, tree = eins.tree_flatten(params)
        new = [_adamw(p, g, a, b, sched, opt) for p, g, a, b in
               zip(ps, eins.tree_flatten(grads)[0], eins.tree_flatten(m)[0],
                   eins.tree_flatten(v)[0])]
        return (value,) + tuple(eins.tree_unflatten(tree, [n[i] for n in new])
                                for i in range(3))

    return train_step


def schedule(t: int, opt: AdamW = AdamW()) -> np.ndarray:
    """Step ``t``'s (from 1) AdamW factors [lr, lr / (1 - b1^t), 1 / sqrt(1 - b2^t)], in
    float64 rounded to float32 once, as torch computes them in Python floats."""
    return np.array([opt.lr, opt.lr / (1 - opt.b1 ** t), 1 / np.sqrt(1 - opt.b2 ** t)],
                    np.float32)


def batches(cfg: LMConfig, n: int, batch: int, seq: int, seed: int = 0) -> list:
    """``n`` batches of (ids, targets), each [batch, seq] int32: sequences of a fixed random
    affine recurrence mod ``vocab`` (learnable, so the loss falls), targets the next
    token."""
    rng = np.random.default_rng(seed)
    a, c = 5, 3
    out = []
    for _ in range(n):
        tok = np.empty((batch, seq + 1), np.int64)
        tok[:, 0] = rng.integers(0, cfg.vocab, batch)
        for i in range(seq):
            tok[:, i + 1] = (a * tok[:, i] + c) % cfg.vocab
        out.append((tok[:, :-1].astype(np.int32), tok[:, 1:].astype(np.int32)))
    return out


def torch_losses(params, data, cos, sin, cfg: LMConfig, opt: AdamW = AdamW()) -> list:
    """The loss of each step of the same model trained by PyTorch (``torch.autograd``,
    ``torch.optim.AdamW``) from ``params`` on ``data`` [(ids, targets)], float32 on the
    CPU."""
    import torch  # heavy: only the reference
    b = cfg.block
    leaves, tree = eins.tree_flatten(params)
    ws = [torch.tensor(np.asarray(a), requires_grad=True) for a in leaves]
    p = eins.tree_unflatten(tree, ws)
    cos_t, sin_t = torch.tensor(cos), torch.tensor(sin)
    half = b.head_dim // 2

    def rms(x, g):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + b.eps) * g

    def rope(x):
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos_t + rot * sin_t

    def heads(x, n):   # [B, S, n*dh] -> [B, n, S, dh]
        return x.reshape(x.shape[:-1] + (n, b.head_dim)).transpose(-2, -3)

    def block(x, w):
        s = x.shape[-2]
        xn = rms(x, w["attn_norm"])
        q, k = rope(heads(xn @ w["wq"], b.n_heads)), rope(heads(xn @ w["wk"], b.n_kv_heads))
        v = heads(xn @ w["wv"], b.n_kv_heads)
        g = b.n_heads // b.n_kv_heads
        k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
        scores = q @ k.transpose(-1, -2) / np.sqrt(b.head_dim)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
        h = x + att.transpose(-2, -3).reshape(x.shape[:-1] + (-1,)) @ w["wo"]
        hn = rms(h, w["ffn_norm"])
        return h + (torch.nn.functional.silu(hn @ w["w1"]) * (hn @ w["w3"])) @ w["w2"]

    optim = torch.optim.AdamW(ws, lr=opt.lr, betas=(opt.b1, opt.b2), eps=opt.eps,
                              weight_decay=opt.weight_decay)
    out = []
    for ids, targets in data:
        x = p["embed"][torch.tensor(ids, dtype=torch.long)]
        for w in p["blocks"]:
            x = block(x, w)
        logits = rms(x, p["norm"]) @ p["head"]
        value = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab),
                                                  torch.tensor(targets, dtype=torch.long)
                                                  .reshape(-1))
        optim.zero_grad()
        value.backward()
        optim.step()
        out.append(float(value.detach()))
    return out
