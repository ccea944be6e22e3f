"""flash-attn's varlen kernel as an optional attention path (flash-attn publishes no wheels,
so it is never required: the guarded import below falls back to the Triton kernel).

It applies to CUDA float16/bfloat16 tensors of a whole sequence (no q/k offsets, Sq == Sk)
without a log-sum-exp output (flash-attn's lse layout differs between its versions). Packed
segments become ``cu_seqlens`` over the flattened (batch, sequence) tokens.
"""
from __future__ import annotations

import functools

import numpy as np

from eins.kernels import build


@functools.lru_cache(maxsize=None)
def flash_attn_module():
    """flash_attn, or None; looked up once (a failed import is otherwise retried on every
    call, scanning sys.path)."""
    try:
        import flash_attn  # optional: its own extra, built against the local CUDA
    except ImportError:
        return None
    return flash_attn if hasattr(flash_attn, "flash_attn_varlen_func") else None


def why_not(q, k, lse, q_offset, k_offset) -> str | None:
    """None when flash-attn applies, else the reason it does not."""
    if q.device.type != "cuda":
        return "tensors are not on a GPU"
    if build.dtype_name(q.dtype) not in ("float16", "bfloat16"):
        return f"dtype {q.dtype} (flash-attn takes float16/bfloat16)"
    if lse is not None:
        return "a log-sum-exp output was asked for"
    if q_offset or k_offset or q.shape[-2] != k.shape[-2]:
        return "a sequence block (offsets or Sq != Sk)"
    if q.shape[-1] > 256 or q.shape[-1] % 8:
        return f"head dim {q.shape[-1]}"
    if flash_attn_module() is None:
        return "flash_attn is not importable"
    return None


def applicable(q, k, lse, q_offset, k_offset) -> bool:
    return why_not(q, k, lse, q_offset, k_offset) is None


_CU: dict = {}


def cu_seqlens(segments, batch, s, device):
    """int32 [n+1] cumulative segment boundaries over ``batch`` sequences of length ``s``."""
    key = (tuple(segments) if segments else None, batch, s, str(device))
    hit = _CU.get(key)
    if hit is None:
        import torch  # heavy: only the GPU path
        ends = np.asarray(segments if segments else (s,), np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        per = np.concatenate([[0], (ends - starts)])
        lens = np.tile(per[1:], batch)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        hit = (torch.as_tensor(cu, device=device), int((ends - starts).max()))
        _CU[key] = hit
    return hit


def varlen(q, k, v, out, *, causal, segments, scale):
    fa = flash_attn_module()
    *batch, hq, s, d = q.shape
    hkv = k.shape[-3]
    nb = int(np.prod(batch)) if batch else 1
    cu, max_len = cu_seqlens(segments, nb, s, q.device)

    def tokens(t, h):  # [..., H, S, D] -> [B*S, H, D]
        return t.reshape(nb, h, s, d).transpose(1, 2).reshape(nb * s, h, d)

    o = fa.flash_attn_varlen_func(tokens(q, hq), tokens(k, hkv), tokens(v, hkv), cu, cu,
                                  max_len, max_len, 0.0, softmax_scale=scale, causal=causal)
    out.reshape(nb, hq, s, d).copy_(o.reshape(nb, s, hq, d).transpose(1, 2))
    return out
