"""Flash attention's backward on torch tensors: the Triton template
``triton_attention_bwd.py.j2`` (FlashAttention-2's backward) and its launcher
:func:`attention_bwd`.

Semantics are eins's ``attention_bwd`` primitive (eins/ops/attention_bwd.py): from q
``[..., Hq, Sq, D]``, k/v ``[..., Hkv, Sk, D]``, the forward's output o and float32 row
log-sum-exp lse ``[..., Hq, Sq]`` and the output's cotangent dO, the gradients dQ, dK, dV,
with the forward's causal mask and packed segments (global END positions) and the block
offsets of a split attention (``q_offset``/``k_offset``: global positions of the blocks'
first query and key rows). Three kernels, no S x S buffer and no atomics:

- ``_delta``: rowsum(dO o O) per query row, float32 (the one temporary, O(S));
- ``_dkdv``: per block of keys of one key/value head, its dK and dV, summed over the query
  heads of its group and the query blocks that see it;
- ``_dq``: per block of query rows of one query head, its dQ over the keys it sees.
"""
from __future__ import annotations

import math

from eins.errors import DTypeError, ShapeError
from eins.ir.rules import attention_shapes
from eins.kernels import build
from eins.kernels.attention import segment_rows, triton_cdiv

TEMPLATE = "triton_attention_bwd.py.j2"
_LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages), one config for the three kernels, chosen ahead
# of time (never autotuned in the hot path). Not yet timed on a GPU: the starting points of
# Triton's fused-attention tutorial backward scaled to one tile shape for both passes;
# benchmarks/gpu_kernels.py (row attention_bwd) times them against SDPA's backward.
CONFIGS = {64: (64, 64, 4, 2), 128: (64, 64, 8, 2)}
CONFIGS_FP32 = {64: (32, 32, 4, 1), 128: (32, 32, 4, 1)}
INTERPRET_CONFIG = (16, 16, 1, 1)  # small tiles: the interpreter runs each one in numpy

LAUNCHES = {"attention_bwd": 0}
"""Triton launches of the backward (one per call: its three kernels), since import."""


def config_for(q) -> tuple:
    major, _ = build.cuda_capability(q)
    if major == 0:
        return INTERPRET_CONFIG
    d = 64 if q.shape[-1] <= 64 else 128
    return (CONFIGS_FP32 if q.element_size() >= 4 else CONFIGS)[d]


def _source(name, dtype, causal, segments, interpret=False):
    fp32 = build.dtype_name(dtype) in ("float32", "float64")
    return build.render(TEMPLATE, name=name, reduce_prelude=build.REDUCE_PRELUDE,
                        dtype=build.dtype_name(dtype), causal=causal, segments=segments,
                        up=build.dot_upcast(dtype, interpret),
                        dot_kw=', input_precision="ieee"' if fp32 else "")


def _kernel_name(dtype, causal, segments):
    return (f"attn_bwd_{build.dtype_name(dtype)}{'_causal' if causal else ''}"
            f"{'_seg' if segments else ''}")


def attention_bwd_source(dtype, *, causal=True, segments=False) -> str:
    """The generated Triton source of one backward specialization (for inspection)."""
    return _source(_kernel_name(dtype, causal, segments), dtype, causal, bool(segments))


def _compiled(dtype, causal, segments, interpret):
    name = _kernel_name(dtype, causal, segments)
    src = _source(name, dtype, causal, segments, interpret)
    return tuple(build.compile_source(src, f"{name}_{part}", interpret)
                 for part in ("delta", "dkdv", "dq"))


def _check(q, k, v, o, lse, do, grads, segments, q_offset, k_offset):
    import torch  # heavy: only the GPU path
    attention_shapes(q.shape, k.shape, v.shape, same_length=False)   # the primitive's rule
    if not (q.dtype == k.dtype == v.dtype == o.dtype == do.dtype):
        raise DTypeError(f"attention_bwd: q, k, v, o, do must share one dtype, got "
                         f"{[str(t.dtype) for t in (q, k, v, o, do)]}")
    if build.dtype_name(q.dtype) not in ("float16", "bfloat16", "float32"):
        raise DTypeError(f"attention_bwd: the Triton kernel takes float16, bfloat16 or "
                         f"float32, got {q.dtype}")
    for name, t, want in (("o", o, q.shape), ("do", do, q.shape)):
        if t.shape != want:
            raise ShapeError(f"attention_bwd: {name} must have q's shape {tuple(want)}, got "
                             f"{tuple(t.shape)}")
    if tuple(lse.shape) != tuple(q.shape[:-1]) or lse.dtype != torch.float32:
        raise ShapeError(f"attention_bwd: lse must be float32 {tuple(q.shape[:-1])}, got "
                         f"{lse.dtype} {tuple(lse.shape)}")
    for name, t, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        if t.shape != like.shape:
            raise ShapeError(f"attention_bwd: {name} must have shape {tuple(like.shape)}, "
                             f"got {tuple(t.shape)}")
    if q_offset < 0 or k_offset < 0:
        raise ShapeError(f"attention_bwd: offsets must be >= 0, got q_offset={q_offset}, "
                         f"k_offset={k_offset}")
    if segments is not None:
        end = max(q_offset + q.shape[-2], k_offset + k.shape[-2])
        segs = tuple(segments)
        if not segs or segs[-1] < end:
            raise ShapeError(f"attention_bwd: segments {segs} end before the blocks' last "
                             f"position {end}")


def attention_bwd(q, k, v, o, lse, do, dq, dk, dv, *, causal=True, segments=None, scale=None,
                  q_offset=0, k_offset=0, config=None):
    """Write the gradients into ``dq``, ``dk``, ``dv`` (q's, k's and v's shapes, any float
    dtype, any strides). Returns ``(dq, dk, dv)``."""
    import torch  # heavy: only the GPU path
    grads = (dq, dk, dv)
    _check(q, k, v, o, lse, do, grads, segments, q_offset, k_offset)
    d = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)
    if q.numel() == 0 or k.numel() == 0:
        for t in grads:
            t.zero_()
        return grads
    interpret = build.interpret_for(q, k, v, o, lse, do, dq, dk, dv)
    delta_k, dkdv_k, dq_k = _compiled(q.dtype, bool(causal), segments is not None, interpret)
    # the kernels read rows with a unit head-dim stride: anything else is copied once
    q4, k4, v4, o4, do4 = (build.as_bhsd(t if t.stride(-1) == 1 else t.contiguous())
                           for t in (q, k, v, o, do))
    outs = [build.as_bhsd(t) for t in grads]
    # a gradient whose batch dims do not flatten to a view is written to a copy, copied back
    direct = [g4.data_ptr() == g.data_ptr() and g4.stride(-1) == 1
              for g4, g in zip(outs, grads)]
    outs = [g4 if ok else torch.empty(g4.shape, dtype=g4.dtype, device=g4.device)
            for g4, ok in zip(outs, direct)]
    bm, bn, warps, stages = config or config_for(q)
    nb, hq, sq, _ = q4.shape
    hkv, sk = k4.shape[1], k4.shape[2]
    lse1 = lse.reshape(-1).contiguous()
    delta = torch.empty(nb * hq * sq, dtype=torch.float32, device=q.device)
    if segments is not None:
        row_lo, row_hi = segment_rows(segments, q_offset, sq, q.device)
        key_lo, key_hi = segment_rows(segments, k_offset, sk, q.device)
    else:
        row_lo = row_hi = key_lo = key_hi = q4  # never read
    launch = build.launch_options(interpret, num_warps=warps, num_stages=stages)
    blk = dict(D=d, BLOCK_D=max(16, build.next_pow2(d)))
    delta_k[(triton_cdiv(sq, bm), nb * hq)](
        o4, do4, delta, o4.stride(0), o4.stride(1), o4.stride(2), do4.stride(0),
        do4.stride(1), do4.stride(2), hq, sq, BLOCK_M=bm, **blk, **launch)
    common = (q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1),
              k4.stride(2), v4.stride(0), v4.stride(1), v4.stride(2), do4.stride(0),
              do4.stride(1), do4.stride(2))
    scalars = (hq, sq, sk, int(q_offset), int(k_offset), sm_scale * _LOG2E, sm_scale)
    g4q, g4k, g4v = outs
    dkdv_k[(triton_cdiv(sk, bn), nb * hkv)](
        q4, k4, v4, do4, lse1, delta, g4k, g4v, row_lo, row_hi, key_lo, key_hi, *common,
        g4k.stride(0), g4k.stride(1), g4k.stride(2), g4v.stride(0), g4v.stride(1),
        g4v.stride(2), *scalars, G=hq // hkv, BLOCK_M=bm, BLOCK_N=bn, **blk, **launch)
    dq_k[(triton_cdiv(sq, bm), nb * hq)](
        q4, k4, v4, do4, lse1, delta, g4q, row_lo, row_hi, *common, g4q.stride(0),
        g4q.stride(1), g4q.stride(2), *scalars, G=hq // hkv, BLOCK_M=bm, BLOCK_N=bn,
        **blk, **launch)
    for g, g4, ok in zip(grads, outs, direct):
        if not ok:
            g.copy_(g4.reshape(g.shape))
    LAUNCHES["attention_bwd"] += 1
    return grads
