"""The gradient of attention's bias on torch tensors: the Triton template
``triton_attention_dbias.py.j2`` and its launcher :func:`attention_dbias`.

Semantics are eins's ``attention_dbias`` primitive (eins/ops/attention_dbias.py): from the
backward's operands (q, k, v, the forward's output o and float32 lse, the output's cotangent
dO) and the bias, the cotangent of an additive bias ``[..., Hq|1, Sq, Sk]`` (batch dims 1
or q's) or of ALiBi slopes ``[..., Hq]``, with every option of the backward kernel
(eins/kernels/attention_bwd.py: causal, window, softcap, key or full masks, packed segments
static or as a tensor, block offsets, a capacity block's row table). dS = P (dO V^T -
delta) is recomputed tile by tile from q, k and the lse, as the backward's dQ pass does;
no S x S buffer beyond the bias's own gradient. Two kernels per call:

- ``_delta``: rowsum(dO o O) per query row, float32 (the backward's);
- ``_dbias``: for ALiBi, per block of query rows of one (batch, query head), the partial
  -sum dS |j - p| over the keys its rows see, one float32 per program, which the launcher
  then sums over the row blocks and the broadcast batch dims with torch. That second
  reduction (not atomics) keeps the result deterministic, run to run and graph replay to
  graph replay: a float sum's value depends on its order, and atomics' order is the
  scheduler's. For an additive bias, per tile of query rows and keys of one (bias batch,
  bias head), dS summed over the batches and query heads that broadcast onto it in a fixed
  order, each gradient element written by one program (no partials at all); a tile no row
  sees is written as zeros without computing.

A capacity-form block (``rows``: its table row [lo, hi, klo, khi] on the device, eins/passes/
capacity.py) computes only this call's rows [lo, hi) and the keys they see [klo, khi), as
the backward's row table does (:func:`eins.kernels.attention_bwd.key_rows`): rows outside
get an empty key range and keys outside an empty row range, both load as zeros (a capacity
buffer's other rows may be stale) and add exactly 0, and the key tiles outside are
skipped, so the work is that of a block holding only the cut's rows and keys.
"""
from __future__ import annotations

import math

from eins.errors import ShapeError
from eins.kernels import build
from eins.kernels.attention import is_runtime, triton_cdiv
from eins.kernels.attention_bwd import check_operands, prelude, render_source

TEMPLATE = "triton_attention_dbias.py.j2"

LAUNCHES = {"attention_dbias": 0}
"""Triton launches of the bias gradient (one per call: its two kernels), since import."""


def _kernel_name(dtype, causal, segments, variant):
    window, softcap, mask, bias = variant
    return (f"attn_dbias_{build.dtype_name(dtype)}{'_causal' if causal else ''}"
            f"{'_seg' if segments else ''}{'_win' if window else ''}"
            f"{'_cap' if softcap else ''}{f'_m{mask}' if mask else ''}_b{bias}")


def _source(name, dtype, causal, segments, interpret, variant):
    return render_source(TEMPLATE, name, dtype, causal, segments, interpret, variant)


def attention_dbias_source(dtype, *, bias, causal=True, segments=False, window=False,
                           softcap=False, mask=None) -> str:
    """The generated Triton source of one specialization (``bias``: "alibi" or "add")."""
    variant = (bool(window), bool(softcap), mask, bias)
    name = _kernel_name(dtype, causal, segments, variant)
    return _source(name, dtype, causal, bool(segments), False, variant)


def _compiled(dtype, causal, segments, interpret, variant):
    name = _kernel_name(dtype, causal, segments, variant)
    src = _source(name, dtype, causal, segments, interpret, variant)
    return tuple(build.compile_source(src, f"{name}_{part}", interpret)
                 for part in ("delta", "dbias"))


def _batch_index(q, bias):
    """[bias batches, batches per]: the flat q batch indices (as_bhsd's order) that
    broadcast onto each flat batch of ``bias`` (whose batch dims are 1 or q's), by device
    ops alone (a captured graph replays them)."""
    import torch  # heavy: only the GPU path
    nb = q.dim() - 3
    batch = tuple(q.shape[:nb])
    idx = torch.arange(math.prod(batch), device=q.device, dtype=torch.int32)
    if not nb:
        return idx.reshape(1, 1)
    kept = [i for i in range(nb) if bias.shape[i] == batch[i]]
    spread = [i for i in range(nb) if i not in kept]
    out = math.prod(batch[i] for i in kept)
    return idx.reshape(batch).permute(*kept, *spread).reshape(out, -1).contiguous()


def _check_bias(q, k, bias, out, bias_kind):
    nb = q.dim() - 3
    batch, hq = tuple(q.shape[:nb]), q.shape[-3]
    shape = tuple(bias.shape)
    ok = len(shape) == nb + (1 if bias_kind == "alibi" else 3) and all(
        n in (1, b) for n, b in zip(shape, batch))
    if bias_kind == "alibi":
        ok = ok and shape[-1] == hq
    else:
        ok = ok and shape[-3] in (1, hq) and shape[-2:] == (q.shape[-2], k.shape[-2])
    if not ok:
        raise ShapeError(f"attention_dbias: a {bias_kind} bias of shape {shape} does not "
                         f"broadcast to q {tuple(q.shape)} (batch dims 1 or q's)")
    if tuple(out.shape) != shape or build.dtype_name(out.dtype) not in (
            "float16", "bfloat16", "float32"):
        raise ShapeError(f"attention_dbias: the gradient must be a float16, bfloat16 or "
                         f"float32 tensor of the bias's shape {shape}, got {out.dtype} "
                         f"{tuple(out.shape)}")


def attention_dbias(q, k, v, o, lse, do, bias, out, *, bias_kind, causal=True, segments=None,
                    scale=None, q_offset=0, k_offset=0, window=None, softcap=None,
                    mask=None, mask_kind=None, config=None, rows=None):
    """Write the gradient of ``bias`` (kind ``bias_kind``: "alibi" slopes or an "add"
    bias) into ``out`` (the bias's shape, any float dtype, any strides). The other
    arguments are the backward launcher's (eins/kernels/attention_bwd.py); ``rows``: a
    capacity-form block's table row [lo, hi, klo, khi] (segments as a tensor only): only
    rows [lo, hi) and keys [klo, khi) are read, an additive bias's gradient is 0 at every
    other row. Returns ``out``."""
    import torch  # heavy: only the GPU path
    opts = dict(window=window, softcap=softcap, mask=mask, mask_kind=mask_kind, bias=bias,
                bias_kind=bias_kind)
    check_operands(q, k, v, o, lse, do, segments, q_offset, k_offset, opts,
                   name="attention_dbias")
    _check_bias(q, k, bias, out, bias_kind)
    if rows is not None and not is_runtime(segments):
        raise ShapeError("attention_dbias: a row table (rows=) needs the segments as a "
                         "tensor")
    d = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)
    if q.numel() == 0 or k.numel() == 0 or v.shape[-1] == 0:
        return out.zero_()
    interpret = build.interpret_for(q, k, v, o, lse, do, bias, out)
    variant = (window is not None, softcap is not None, mask_kind, bias_kind)
    delta_k, dbias_k = _compiled(q.dtype, bool(causal), segments is not None, interpret,
                                 variant)
    # the kernels read rows with a unit head-dim stride: anything else is copied once
    q4, k4, v4, o4, do4 = (build.as_bhsd(t if t.stride(-1) == 1 else t.contiguous())
                           for t in (q, k, v, o, do))
    pre = prelude(q4, k4, v4, o4, do4, lse, delta_k, causal=causal, segments=segments,
                  q_offset=q_offset, k_offset=k_offset, rows=rows, config=config,
                  interpret=interpret, sm_scale=sm_scale, like=q, **opts)
    bm, bn, nb, hq, sq, hkv, sk = pre.bm, pre.bn, pre.nb, pre.hq, pre.sq, pre.hkv, pre.sk
    mst, bst, scalars, strides, dims, launch = (pre.mst, pre.bst, pre.scalars, pre.strides,
                                                pre.dims, pre.launch)
    lse1, delta = pre.lse1, pre.delta
    tiles = dict(G=hq // hkv, BLOCK_M=bm, BLOCK_N=bn, **dims, **launch)
    ops = (q4, k4, v4, do4, lse1, delta)
    ranges = pre.ranges
    if bias_kind == "alibi":
        mt = triton_cdiv(sq, bm)
        part = torch.empty(nb * hq * mt, dtype=torch.float32, device=q.device)
        dbias_k[(mt, nb * hq)](*ops, part, *ranges, *strides, *mst, *bst, *scalars, **tiles)
        # the partials summed in a fixed order (rows blocks, then the broadcast batches)
        grad = part.reshape(*q.shape[:-2], mt).sum(-1)
        spread = tuple(i for i, n in enumerate(bias.shape) if n == 1 and grad.shape[i] != 1)
        out.copy_(grad.sum(spread, keepdim=True) if spread else grad)
    else:
        ho = bias.shape[-3]
        bidx = _batch_index(q, bias)
        g4 = out.reshape(-1, ho, sq, sk)
        direct = g4.data_ptr() == out.data_ptr()
        if not direct:   # batch dims that do not flatten to a view: a copy, copied back
            g4 = torch.empty(g4.shape, dtype=out.dtype, device=out.device)
        dbias_k[(triton_cdiv(sq, bm), triton_cdiv(sk, bn), bidx.shape[0] * ho)](
            *ops, g4, bidx, *ranges, *strides, g4.stride(0), g4.stride(1), g4.stride(2),
            g4.stride(3), *mst, *bst, *scalars, ho, bidx.shape[1], hq // ho, **tiles)
        if not direct:
            out.copy_(g4.reshape(out.shape))
    LAUNCHES["attention_dbias"] += 1
    return out
