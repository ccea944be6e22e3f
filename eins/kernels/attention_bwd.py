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

A capacity-form block (``rows``: its table row [lo, hi, klo, khi] on the device, eins/passes/
capacity.py) computes only this call's rows [lo, hi) and the keys they see [klo, khi), as
the forward's row table does: rows outside get an empty key range and keys outside an
empty row range (:func:`key_rows`), so the kernels skip their blocks and write zeros there,
and the work is that of a block holding only the cut's rows and keys.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

from eins.errors import DTypeError, ShapeError
from eins.kernels import build
from eins.kernels.attention import as_b4, is_runtime, segment_rows, triton_cdiv

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


def _source(name, dtype, causal, segments, interpret=False,
            variant=(False, False, None, None)):
    return render_source(TEMPLATE, name, dtype, causal, segments, interpret, variant)


def render_source(template, name, dtype, causal, segments, interpret, variant) -> str:
    """One specialization of a backward-family template (the backward's, the bias
    gradient's: they take the same options)."""
    fp32 = build.dtype_name(dtype) in ("float32", "float64")
    window, softcap, mask, bias = variant
    return build.render(template, name=name, reduce_prelude=build.REDUCE_PRELUDE,
                        dtype=build.dtype_name(dtype), causal=causal, segments=segments,
                        window=window, softcap=softcap, mask=mask, bias=bias,
                        tanh="_ld_tanh" if interpret else "libdevice.tanh",
                        up=build.dot_upcast(dtype, interpret),
                        dot_kw=', input_precision="ieee"' if fp32 else "")


def _kernel_name(dtype, causal, segments, variant=(False, False, None, None)):
    window, softcap, mask, bias = variant
    return (f"attn_bwd_{build.dtype_name(dtype)}{'_causal' if causal else ''}"
            f"{'_seg' if segments else ''}{'_win' if window else ''}"
            f"{'_cap' if softcap else ''}{f'_m{mask}' if mask else ''}"
            f"{f'_b{bias}' if bias else ''}")


def attention_bwd_source(dtype, *, causal=True, segments=False, window=False, softcap=False,
                         mask=None, bias=None) -> str:
    """The generated Triton source of one backward specialization (for inspection)."""
    variant = (bool(window), bool(softcap), mask, bias)
    return _source(_kernel_name(dtype, causal, segments, variant), dtype, causal,
                   bool(segments), variant=variant)


def _compiled(dtype, causal, segments, interpret, variant):
    name = _kernel_name(dtype, causal, segments, variant)
    src = _source(name, dtype, causal, segments, interpret, variant)
    return tuple(build.compile_source(src, f"{name}_{part}", interpret)
                 for part in ("delta", "dkdv", "dq"))



_KINDS = {"mask": ("keys", "full"), "bias": ("alibi", "add")}


def check_options(q, window=None, softcap=None, mask=None, mask_kind=None, bias=None,
                  bias_kind=None, name="attention_bwd"):
    """The options' values and the mask's or bias's rank for its kind (the primitive's
    shape rule checks them at trace time; this is the launcher's own guard); errors name
    the launcher ``name``."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ShapeError(f"{name}: window must be a positive int, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ShapeError(f"{name}: softcap must be > 0, got {softcap!r}")
    nb = q.dim() - 3
    for what, x, kind in (("mask", mask, mask_kind), ("bias", bias, bias_kind)):
        if (x is None) != (kind is None) or (kind is not None and kind not in _KINDS[what]):
            raise ShapeError(f"{name}: {what} and {what}_kind={kind!r} go together, "
                             f"kind one of {list(_KINDS[what])}")
        want = {"keys": nb + 1, "full": nb + 3, "alibi": nb + 1, "add": nb + 3}.get(kind)
        if x is not None and x.dim() != want:
            raise ShapeError(f"{name}: a {kind} {what} has {want} dims for q "
                             f"{tuple(q.shape)}, got {tuple(x.shape)}")


def _check(q, k, v, o, lse, do, grads, segments, q_offset, k_offset, opts):
    check_operands(q, k, v, o, lse, do, segments, q_offset, k_offset, opts)
    for name, t, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        if t.shape != like.shape:
            raise ShapeError(f"attention_bwd: {name} must have shape {tuple(like.shape)}, "
                             f"got {tuple(t.shape)}")


def check_operands(q, k, v, o, lse, do, segments, q_offset, k_offset, opts,
                   name="attention_bwd"):
    """The backward launchers' guard of their common operands: q, k, v, o, dO's shapes and
    one Triton dtype, the float32 lse, the offsets, the options (:func:`check_options`)
    and the segments; errors name the launcher ``name``."""
    import torch  # heavy: only the GPU path
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if len(qs) < 3 or ks[:-1] != vs[:-1] or qs[:-3] != ks[:-3] or qs[-1] != ks[-1] or \
            ks[-3] == 0 or qs[-3] % ks[-3]:
        raise ShapeError(f"{name}: q [..., Hq, Sq, D], k [..., Hkv, Sk, D] and v "
                         f"[..., Hkv, Sk, Dv] with Hq a multiple of Hkv, got q {qs}, k {ks}, "
                         f"v {vs}")
    if not (q.dtype == k.dtype == v.dtype == o.dtype == do.dtype):
        raise DTypeError(f"{name}: q, k, v, o, do must share one dtype, got "
                         f"{[str(t.dtype) for t in (q, k, v, o, do)]}")
    if build.dtype_name(q.dtype) not in ("float16", "bfloat16", "float32"):
        raise DTypeError(f"{name}: the Triton kernel takes float16, bfloat16 or "
                         f"float32, got {q.dtype}")
    oshape = tuple(q.shape[:-1]) + (v.shape[-1],)
    for what, t in (("o", o), ("do", do)):
        if tuple(t.shape) != oshape:
            raise ShapeError(f"{name}: {what} must have shape {oshape}, got "
                             f"{tuple(t.shape)}")
    if tuple(lse.shape) != tuple(q.shape[:-1]) or lse.dtype != torch.float32:
        raise ShapeError(f"{name}: lse must be float32 {tuple(q.shape[:-1])}, got "
                         f"{lse.dtype} {tuple(lse.shape)}")
    if k_offset < 0 or (q_offset < 0 and segments is not None):
        raise ShapeError(f"{name}: offsets must be >= 0, got q_offset={q_offset}, "
                         f"k_offset={k_offset}")
    check_options(q, **opts, name=name)
    if is_runtime(segments):   # ends as data: searched on the device (segment_rows)
        if segments.dim() != 1 or segments.numel() < 1 or segments.dtype.is_floating_point:
            raise ShapeError(f"{name}: runtime segments must be a 1-D int tensor of "
                             f"end positions, got {segments.dtype} {tuple(segments.shape)}")
    elif segments is not None:
        end = max(q_offset + q.shape[-2], k_offset + k.shape[-2])
        segs = tuple(segments)
        if not segs or segs[-1] < end:
            raise ShapeError(f"{name}: segments {segs} end before the blocks' last "
                             f"position {end}")


def key_rows(segments, k_offset, sk, device, rows=None):
    """Per key, the global [start, end) of the query rows that may see it (its segment), as
    two int32 tensors (:func:`eins.kernels.attention.segment_rows` of the keys). ``rows``:
    a capacity-form block's table row [lo, hi, klo, khi] (a device tensor: no host sync):
    each range is cut to the rows [lo, hi) this call computes, and the keys outside
    [klo, khi) get an empty one (at lo before, at hi after: both monotone, as the kernel's
    row bounds need), so their blocks visit no row and their dK, dV are 0."""
    import torch  # heavy: only the GPU path
    lo, hi = segment_rows(segments, k_offset, sk, device)
    if rows is None:
        return lo, hi
    t = rows.reshape(-1).to(device=device, dtype=torch.int64)
    pos = torch.arange(k_offset, k_offset + sk, device=device)
    lo, hi = (torch.minimum(torch.maximum(x.to(torch.int64), t[0]), t[1]) for x in (lo, hi))
    before, after = pos < t[2], pos >= t[3]
    lo, hi = (torch.where(before, t[0], torch.where(after, t[1], x)) for x in (lo, hi))
    return lo.to(torch.int32), hi.to(torch.int32)


def prelude(q4, k4, v4, o4, do4, lse, delta_k, *, causal, segments, q_offset, k_offset,
            rows, window, softcap, mask, mask_kind, bias, bias_kind, config, interpret,
            sm_scale, like):
    """What the backward's and the bias gradient's launchers share before their own
    kernels (q4..do4: the operands as [batch, heads, rows, dim] with a unit last stride;
    ``like``: the query as given, whose dtype picks the tiles and masks broadcast to): the
    tiles, the flat lse, the per-row table of each segment's keys (or the capacity row
    table's), the mask and bias as 4-d views, the scalar and stride arguments every kernel
    takes, and delta (rowsum dO o O, launched here). -> SimpleNamespace of them."""
    import torch  # heavy: only the GPU path
    bm, bn, warps, stages = config or config_for(like)
    nb, hq, sq, d = q4.shape
    hkv, sk, dv = k4.shape[1], k4.shape[2], v4.shape[-1]
    lse1 = lse.reshape(-1).contiguous()
    delta = torch.empty(nb * hq * sq, dtype=torch.float32, device=q4.device)
    if segments is not None:
        row_lo, row_hi = segment_rows(segments, q_offset, sq, q4.device, rows, bool(causal))
        key_lo, key_hi = key_rows(segments, k_offset, sk, q4.device, rows)
    else:
        row_lo = row_hi = key_lo = key_hi = q4  # never read
    m4, mst = as_b4(mask, like, mask_kind) if mask is not None else (q4, (0, 0, 0, 0))
    b4, bst = as_b4(bias, like, bias_kind) if bias is not None else (q4, (0, 0, 0, 0))
    wl = window - 1 if window is not None else 0
    launch = build.launch_options(interpret, num_warps=warps, num_stages=stages)
    dims = dict(D=d, BLOCK_D=max(16, build.next_pow2(d)), DV=dv,
                BLOCK_DV=max(16, build.next_pow2(dv)))
    delta_k[(triton_cdiv(sq, bm), nb * hq)](
        o4, do4, delta, row_lo, row_hi, o4.stride(0), o4.stride(1), o4.stride(2), do4.stride(0),
        do4.stride(1), do4.stride(2), hq, sq, DV=dv, BLOCK_DV=dims["BLOCK_DV"], BLOCK_M=bm,
        **launch)
    strides = (q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1),
               k4.stride(2), v4.stride(0), v4.stride(1), v4.stride(2), do4.stride(0),
               do4.stride(1), do4.stride(2))
    scalars = (hq, sq, sk, int(q_offset), int(k_offset), sm_scale * _LOG2E, sm_scale,
               float(softcap) if softcap is not None else 1.0, wl, wl)
    return SimpleNamespace(bm=bm, bn=bn, nb=nb, hq=hq, sq=sq, hkv=hkv, sk=sk, lse1=lse1,
                           delta=delta, ranges=(row_lo, row_hi, key_lo, key_hi, m4, b4),
                           mst=mst, bst=bst, launch=launch, dims=dims, strides=strides,
                           scalars=scalars)


def attention_bwd(q, k, v, o, lse, do, dq, dk, dv, *, causal=True, segments=None, scale=None,
                  q_offset=0, k_offset=0, window=None, softcap=None, mask=None,
                  mask_kind=None, bias=None, bias_kind=None, config=None, rows=None):
    """Write the gradients into ``dq``, ``dk``, ``dv`` (q's, k's and v's shapes, any float
    dtype, any strides). ``q_offset`` is the key position of the first query row, ``k_offset``
    of the first key; the options are the forward launcher's (eins/kernels/attention.py).
    ``rows``: a capacity-form block's table row [lo, hi, klo, khi] of global positions, a
    device tensor (segments as a tensor only): only rows [lo, hi) and keys [klo, khi) are
    computed, every other row of dq and key of dk, dv is 0 (module docstring).
    Returns ``(dq, dk, dv)``."""
    import torch  # heavy: only the GPU path
    grads = (dq, dk, dv)
    opts = dict(window=window, softcap=softcap, mask=mask, mask_kind=mask_kind, bias=bias,
                bias_kind=bias_kind)
    _check(q, k, v, o, lse, do, grads, segments, q_offset, k_offset, opts)
    if rows is not None and not is_runtime(segments):
        raise ShapeError("attention_bwd: a row table (rows=) needs the segments as a tensor")
    d = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)
    if q.numel() == 0 or k.numel() == 0:
        for t in grads:
            t.zero_()
        return grads
    interpret = build.interpret_for(q, k, v, o, lse, do, dq, dk, dv)
    variant = (window is not None, softcap is not None, mask_kind, bias_kind)
    delta_k, dkdv_k, dq_k = _compiled(q.dtype, bool(causal), segments is not None, interpret,
                                      variant)
    # the kernels read rows with a unit head-dim stride: anything else is copied once
    q4, k4, v4, o4, do4 = (build.as_bhsd(t if t.stride(-1) == 1 else t.contiguous())
                           for t in (q, k, v, o, do))
    outs = [build.as_bhsd(t) for t in grads]
    # a gradient whose batch dims do not flatten to a view is written to a copy, copied back
    direct = [g4.data_ptr() == g.data_ptr() and g4.stride(-1) == 1
              for g4, g in zip(outs, grads)]
    outs = [g4 if ok else torch.empty(g4.shape, dtype=g4.dtype, device=g4.device)
            for g4, ok in zip(outs, direct)]
    pre = prelude(q4, k4, v4, o4, do4, lse, delta_k, causal=causal, segments=segments,
                  q_offset=q_offset, k_offset=k_offset, rows=rows, config=config,
                  interpret=interpret, sm_scale=sm_scale, like=q, **opts)
    bm, bn, nb, hq, sq, hkv, sk = pre.bm, pre.bn, pre.nb, pre.hq, pre.sq, pre.hkv, pre.sk
    lse1, delta, mst, bst, scalars, dims, launch = (pre.lse1, pre.delta, pre.mst, pre.bst,
                                                    pre.scalars, pre.dims, pre.launch)
    row_lo, row_hi, key_lo, key_hi, m4, b4 = pre.ranges
    common = pre.strides
    g4q, g4k, g4v = outs
    dkdv_k[(triton_cdiv(sk, bn), nb * hkv)](
        q4, k4, v4, do4, lse1, delta, g4k, g4v, row_lo, row_hi, key_lo, key_hi, m4, b4,
        *common, g4k.stride(0), g4k.stride(1), g4k.stride(2), g4v.stride(0), g4v.stride(1),
        g4v.stride(2), *mst, *bst, *scalars, G=hq // hkv, BLOCK_M=bm, BLOCK_N=bn, **dims,
        **launch)
    dq_k[(triton_cdiv(sq, bm), nb * hq)](
        q4, k4, v4, do4, lse1, delta, g4q, row_lo, row_hi, key_lo, key_hi, m4, b4, *common,
        g4q.stride(0), g4q.stride(1), g4q.stride(2), *mst, *bst, *scalars, G=hq // hkv,
        BLOCK_M=bm, BLOCK_N=bn, **dims, **launch)
    for g, g4, ok in zip(grads, outs, direct):
        if not ok:
            g.copy_(g4.reshape(g.shape))
    LAUNCHES["attention_bwd"] += 1
    return grads
