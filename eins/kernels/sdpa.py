"""PyTorch's ``scaled_dot_product_attention`` (SDPA) as an attention path: a library call
(FlashAttention-2 or cuDNN kernels on CUDA), capturable in a CUDA graph, used only where its
semantics equal eins's ``attention`` exactly (eins/kernels/attention.py):

- no packed segments (SDPA masks them only through a dense S x S mask; a block whose query
  and key positions all lie in one segment, as with ``segments=(S,)``, has none) and no
  log-sum-exp output (SDPA's public function returns none);
- causal only for a whole square attention: SDPA's ``is_causal`` keeps key j for query i
  when j <= i counted from each block's own first row (top-left aligned), ours when
  k_offset + j <= q_offset + i in global positions. They agree at q_offset == k_offset == 0;
  at Sq != Sk they would still agree, but PyTorch's flash backend declines non-square causal
  masks and falls back, so only Sq == Sk is taken (the primitive's whole attention always is).
  Non-causal attention without segments does not depend on positions at all, so a query
  block of a sequence split (q_offset > 0) applies;
- grouped-query attention through ``enable_gqa=True`` (torch >= 2.5), which maps query head h
  to key/value head h // G as ours does, without repeating k/v;
- the scale passed explicitly; head dim <= 256; ``out`` in q's dtype (SDPA rounds to it, so
  a float32 partial ``out`` of 16-bit inputs would lose the unrounded result).

SDPA returns a new tensor, copied into ``out`` (which may be a strided view). Inside a torch
CUDA graph capture that allocation comes from the graph's private pool (eins/runtime/gpu.py
captures with one), and nothing here synchronizes with the host.

Which backend SDPA runs is torch's choice at call time. For ``impl="auto"``
(:func:`why_not` with ``auto=True``) SDPA is taken only for CUDA float16/bfloat16 tensors
where torch's own checks (``torch.backends.cuda.can_use_flash_attention`` /
``can_use_cudnn_attention`` / ``can_use_efficient_attention``), read in SDPA's priority
order, say a fused O(S)-memory backend will run before the math one (cuDNN comes after
math unless torch prefers it on this GPU): GQA goes to the flash or cuDNN backend only
(the memory-efficient one rejects Hq != Hkv, torch 2.5 to 2.11), and a fallback to SDPA's
math backend (an S x S score matrix per head: 137 GB in float16 for 4 heads at 128K
tokens) is never chosen silently; float32 stays on our Triton kernel (its exact IEEE
dots, tested; SDPA's fused backends take no float32 GQA). ``impl="sdpa"`` forces it on
any device where the semantics agree, CPU included (how the CPU tests check it).
"""
from __future__ import annotations

import contextlib
import functools

from eins.kernels import build

MAX_HEAD_DIM = 256
AUTO_DTYPES = ("float16", "bfloat16")
DTYPES = ("float16", "bfloat16", "float32")


@functools.lru_cache(maxsize=None)
def has_enable_gqa() -> bool:
    """torch >= 2.5: SDPA's ``enable_gqa`` keyword."""
    import torch  # heavy: only the GPU path
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 5)


def why_not(q, k, out, *, causal, segments, lse, q_offset, k_offset, auto=False,
            v=None) -> str | None:
    """None when SDPA computes exactly our attention for these arguments, else why not.
    ``auto=True`` adds what ``impl="auto"`` also asks: CUDA 16-bit tensors on a fused
    backend (see the module docstring; ``v``, when given, is probed with q and k)."""
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if segments is not None and not one_segment(segments, q_offset, sq, k_offset, sk):
        return "packed segments (SDPA would need a dense S x S mask)"
    if lse is not None:
        return "a log-sum-exp output was asked for (SDPA returns none)"
    if causal and (q_offset or k_offset):
        return (f"a causal block at q_offset={q_offset}, k_offset={k_offset} (SDPA's is_causal "
                f"masks from the block's own first row)")
    if causal and sq != sk:
        return f"causal with Sq={sq} != Sk={sk} (only square causal masks agree)"
    name = build.dtype_name(q.dtype)
    if name not in DTYPES:
        return f"dtype {q.dtype}"
    if out is not None and out.dtype != q.dtype:
        return f"out is {out.dtype} for {q.dtype} inputs (SDPA rounds to the inputs' dtype)"
    if d > MAX_HEAD_DIM:
        return f"head dim {d} > {MAX_HEAD_DIM}"
    if q.shape[-3] != k.shape[-3] and not has_enable_gqa():
        return "grouped-query attention needs torch >= 2.5 (enable_gqa)"
    if not auto:
        return None
    if q.device.type != "cuda":
        return "tensors are not on a GPU (impl='auto' runs the Triton kernel there)"
    if name not in AUTO_DTYPES:
        return f"dtype {q.dtype} (impl='auto' takes SDPA for float16/bfloat16 only)"
    return fused_backend_why_not(q, k, k if v is None else v, causal)


def one_segment(segments, q_offset, sq, k_offset, sk) -> bool:
    """Whether every query and key position of the block lies in one segment (no segment
    ends strictly inside the span of their positions): the segments then mask nothing, as
    ``segments=(S,)`` never does, and the block is unsegmented attention."""
    lo, hi = min(q_offset, k_offset), max(q_offset + sq, k_offset + sk)
    return not any(lo < e < hi for e in segments)


_FUSED: dict = {}


def fused_backend_why_not(q, k, v, causal) -> str | None:
    """None when torch says one of SDPA's fused backends (flash, cuDNN, memory-efficient)
    takes these tensors, else why not; cached per shape/stride/dtype/device (a host-only
    check, so it is also safe inside a graph capture)."""
    key = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), q.dtype,
           str(q.device), bool(causal))
    hit = _FUSED.get(key)
    if hit is None:
        hit = _FUSED[key] = _probe(q, k, v, causal) or ""
    return hit or None


def _probe(q, k, v, causal) -> str | None:
    import torch  # heavy: only the GPU path
    try:
        from torch.backends.cuda import (  # heavy: only the GPU path
            SDPAParams, can_use_efficient_attention, can_use_flash_attention)
        gqa = q.shape[-3] != k.shape[-3]
        p = SDPAParams(build.as_bhsd(q), build.as_bhsd(k), build.as_bhsd(v), None, 0.0,
                       bool(causal), gqa)
    except (ImportError, TypeError, RuntimeError) as e:
        return f"torch {torch.__version__} cannot say which SDPA backend would run ({e})"
    checks = {_FLASH: can_use_flash_attention, _EFFICIENT: can_use_efficient_attention}
    try:
        from torch.backends.cuda import can_use_cudnn_attention  # heavy: newer torch only
        checks[_CUDNN] = can_use_cudnn_attention
    except ImportError:
        pass
    # SDPA runs the first backend of its priority order that takes the tensors, and math
    # takes all: a fused backend counts only ahead of math (cuDNN is behind it by default)
    for b in priority_order():
        if b == _MATH and torch.backends.cuda.math_sdp_enabled():
            break
        if b in checks and checks[b](p, False):
            return None
    return "no fused SDPA backend takes these tensors (it would run the S x S math backend)"


# torch.nn.attention.SDPBackend's values
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3


def priority_order() -> list:
    """SDPA's backend priority order (SDPBackend values): torch's own where it says it
    (torch >= 2.6), else flash, efficient, math, the order of the versions before it."""
    import torch  # heavy: only the GPU path
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    return [int(b) for b in get()] if get is not None else [_FLASH, _EFFICIENT, _MATH]


def applicable(q, k, out, *, causal, segments, lse, q_offset, k_offset, auto=False,
               v=None) -> bool:
    return why_not(q, k, out, causal=causal, segments=segments, lse=lse, q_offset=q_offset,
                   k_offset=k_offset, auto=auto, v=v) is None


def _backend(name):
    """A context running SDPA on backend ``name`` ("cudnn") alone; None: torch's choice."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel  # heavy: only the GPU path
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


LAUNCHES = {"sdpa": 0}
"""SDPA calls through this path since import (tests read it to see which path ran)."""


def cudnn_why_not(q, k, v, causal) -> str | None:
    """None when SDPA's cuDNN backend takes these tensors (torch's own check, on CUDA),
    else why not."""
    if q.device.type != "cuda":
        return "tensors are not on a GPU (cuDNN runs on CUDA)"
    try:
        from torch.backends.cuda import (  # heavy: only the GPU path
            SDPAParams, can_use_cudnn_attention)
        p = SDPAParams(build.as_bhsd(q), build.as_bhsd(k), build.as_bhsd(v), None, 0.0,
                       bool(causal), q.shape[-3] != k.shape[-3])
    except (ImportError, TypeError, RuntimeError) as e:
        return f"this torch cannot run SDPA's cuDNN backend ({e})"
    return None if can_use_cudnn_attention(p, False) else \
        "SDPA's cuDNN backend does not take these tensors on this GPU"


def sdpa(q, k, v, out, *, causal, scale, backend=None):
    """``out`` <- SDPA(q, k, v) (q ``[..., Hq, S, D]``, k/v ``[..., Hkv, Sk, D]``); the
    caller has checked :func:`why_not` (and, for ``backend="cudnn"``, SDPA on its cuDNN
    backend alone, :func:`cudnn_why_not`). Returns ``out``."""
    import torch.nn.functional as F  # heavy: only the GPU path
    q4, k4, v4 = build.as_bhsd(q), build.as_bhsd(k), build.as_bhsd(v)
    kw = {"enable_gqa": True} if q4.shape[1] != k4.shape[1] else {}
    with _backend(backend):
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=bool(causal),
                                           scale=float(scale), **kw)
    out.copy_(o.reshape(out.shape))
    LAUNCHES["sdpa"] += 1
    return out
