"""Attention's backward: the forward that saves its log-sum-exp, the backward primitive that
recomputes the scores from it block by block (FlashAttention-2's backward), and attention's
VJP rule that joins them.

``attention_fwd(q, k, v, **params) -> (o, lse)``: eins's ``attention`` (eins/ops/attention.py;
the same parameters, shape rule, kernels and splits) that also returns each query row's
natural log-sum-exp of its scaled, masked scores, ``lse`` ``[..., Hq, S]`` in float32
(float64 for float64 attention); -inf for a row that sees no key. Its join-agg specs are
attention's with the lse block beside the output block: where attention's key split
aggregates (o, lse) pairs with ⊕ ``lse``, the lse output's partials (each key block's
log-sum-exp) combine with ⊕ ``logaddexp`` (eins.ir.joinagg), exactly.

``attention_bwd(q, k, v, o, lse, do, **params) -> (dq, dk, dv)``: the gradients of
attention's output with cotangent ``do``, from the forward's ``o`` and ``lse``. Named indices
are the forward's (batch..., heads_kv, sequence, kv_sequence, head_dim), with their
work-balanced cuts (causal: equal work, packed segments: segment ends where that is
balanced), and the splits mean:

- batch, ``heads_kv``: independent blocks. An interval of kv heads takes their query heads;
  dK and dV of a kv head sum over its query-head group inside the kernel (no ⊕).
- ``sequence`` (query rows): a block computes dQ of its rows exactly (it reads every key
  they see) and dK, dV partials over the keys they see, written as whole-sequence blocks
  (zeros elsewhere) that a ⊕ ``sum`` adds. Cut at segment ends, a block holds whole
  segments whose keys no other block's rows see: its dK and dV rows are its own query rows
  and exact, no ⊕.
- ``kv_sequence`` (key rows): the mirror image. A block computes dK and dV of its keys
  exactly (it reads every query row that sees them: from the block's first key, or its
  segment's start when not causal, to the end of its last key's segment) and dQ partials
  summed by ⊕ ``sum``; exact, no ⊕, when cut at segment ends.
- both: block (rows [qa, qb), keys [c, e)) reads the rows and keys of its intervals that see
  each other and writes dQ of [qa, qb) and dK, dV of [c, e), both partials summed by ⊕.
- ``head_dim``: never (the scores contract it).

FLOPs are 2.5x the forward's per block (the scores recomputed, dV, dP, dQ, dK: five
matmuls of the forward's two); the GPU kernel's temporaries are one float32 per query row
and head (rowsum(dO o O)), O(S): the scores are never materialized.

The VJP rule of ``attention`` (its ``vjp`` field) turns the forward eqn it differentiates
into ``attention_fwd`` in place, so the lse the backward needs is saved by the forward pass
rather than recomputed, and binds ``attention_bwd`` with the eqn's parameters.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from eins.errors import EinsError, ShapeError
from eins.ir.joinagg import FunctionSpec, Indexing, JoinAggSpec, lse_pair_dtype
from eins.ir.primitive import GpuLowering, Primitive, get_primitive, register
from eins.ir.program import Var
from eins.ir.rules import compute_dtype, float_dtype
from eins.ir.types import Box, TensorType, result_dtype
from eins.kernels.attention_bwd import attention_bwd as flash_attention_bwd
from eins.kernels.torch_rules import compute_type
from eins.ops import attention_blocks as blk
from eins.ops import attention_bwd_blocks as bblk
from eins.tracing import Tracer, bind

__all__ = ["attention_fwd", "attention_bwd", "attention_vjp"]

# the backward's FLOPs per forward FLOP: five matmuls per (query, key) pair against two
BWD_FLOPS_RATIO = (5, 2)


def _att() -> Primitive:
    return get_primitive("attention")


def lse_dtype(out_dtype) -> np.dtype:
    """The dtype of the saved log-sum-exp: the lse ⊕'s compute dtype (float32, float64 for
    float64 attention)."""
    return lse_pair_dtype(out_dtype)["o"]


def _whole(*xs) -> FunctionSpec:
    return FunctionSpec(tuple(Box.full(tuple(np.shape(x))) for x in xs), ())


def _scale(scale, d):
    return 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)


# ----------------------------------------------------------------------------- attention_fwd
def _fwd_abstract(*ins, **params):
    (o,) = _att().abstract(*ins, **params)   # attention's rule and errors
    return (o, TensorType(o.shape[:-1], lse_dtype(o.dtype)))


def _fwd_pairs(fspec, *blocks, **params):
    """attention's partial kernel on the block: (o, lse) pairs over the block's keys. A head
    dim of 0 has no pair to carry the lse: the scores are all 0 then, as with one zero
    column, which is what it runs on."""
    q = blocks[0]
    if q.shape[-1] == 0:
        padded = [np.concatenate([b, np.zeros(b.shape[:-1] + (1,), b.dtype)], -1)
                  for b in blocks[:3]]
        (pairs,) = _att().partial_impl(fspec, *padded, *blocks[3:], **params)
        return pairs[..., :0], pairs["lse"][..., 0]
    (pairs,) = _att().partial_impl(fspec, *blocks, **params)
    return pairs, pairs["lse"][..., 0]


def _fwd_block(fspec, *blocks, **params):
    """f[F] of a spec without ⊕: the block holds every key its rows see, so the partial
    kernel over them is the whole attention of those rows."""
    pairs, lse = _fwd_pairs(fspec, *blocks, **params)
    out = result_dtype(*(b.dtype for b in blocks[:3]))   # attention's output dtype
    return np.ascontiguousarray(pairs["o"], dtype=out), np.ascontiguousarray(lse)


def _fwd_impl(*ins, **params):
    return _fwd_block(_whole(*ins), *ins, **params)


def _fwd_partial(fspec, *blocks, **params):
    """f[F] of a key-split spec: o as (o, lse) pairs (⊕ lse), lse as itself (⊕ logaddexp)."""
    pairs, lse = _fwd_pairs(fspec, *blocks, **params)
    return pairs, np.ascontiguousarray(lse)


def _fwd_indexing(ins, outs, **params):
    """attention's indexing with the lse box (the output box less its head dim) beside the
    output's; ⊕ logaddexp for it where attention's key split has ⊕ lse."""
    ix = _att().indexing(ins, tuple(outs)[:1], **params)

    def producer(iv) -> JoinAggSpec:
        spec = ix.producer(iv)
        fspecs = tuple(FunctionSpec(f.inputs, (f.outputs[0], _drop_last(f.outputs[0])))
                       for f in spec.fspecs)
        agg = spec.aggs[0]
        return JoinAggSpec(fspecs, (agg, None if agg is None else "logaddexp"))

    return Indexing(ix.extents, ix.shardable, producer, ix.dims, ix.balance)


def _drop_last(b: Box) -> Box:
    return Box(b.lo[:-1], b.hi[:-1])


def _fwd_flops(ins, outs, **params):
    return _att().flops(ins, outs[:1], **params)


def _fwd_block_flops(fspec, ins, outs, **params):
    return _att().block_flops(fspec, ins, outs[:1], **params)


def _fwd_temp_bytes(fspec, **params):
    return _att().temp_bytes(fspec, **params)


def _fwd_accumulation(ins, outs, **params):
    return _att().accumulation(ins, outs[:1], **params)


def attention_fwd(q, k, v, causal=True, segments=None, scale=None):
    """``(o, lse)``: :func:`eins.attention`'s output and each query row's log-sum-exp (see the
    module docstring). Called by attention's VJP rule; public for tests and hand-written
    backward passes."""
    return bind("attention_fwd", q, k, v, **_params(causal, segments, scale))


def _params(causal, segments, scale) -> dict:
    return dict(causal=bool(causal), segments=None if segments is None else tuple(
        int(e) for e in segments), scale=None if scale is None else float(scale))


# ----------------------------------------------------------------------------- attention_bwd
def _bwd_abstract(q, k, v, o, lse, do, **params):
    (ot,) = _att().abstract(q, k, v, **params)   # attention's rule and errors
    for name, t, want in (("o", o, ot.shape), ("do", do, ot.shape),
                          ("lse", lse, ot.shape[:-1])):
        if tuple(t.shape) != tuple(want):
            raise ShapeError(f"attention_bwd: {name} must have shape {tuple(want)} (q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}), got {tuple(t.shape)}")
    return tuple(TensorType(x.shape, float_dtype(x.dtype)) for x in (q, k, v))


def _bwd_block(fspec, q, k, v, o, lse, do, *, causal, segments, scale):
    """f[F]: the gradients of the block's visible (query, key) pairs (bblk.bwd_block), each
    written at its global rows inside its output box (zeros elsewhere: a ⊕ sum partial)."""
    qbox, kbox = fspec.inputs[0], fspec.inputs[1]
    qa, ka = qbox.lo[-2], kbox.lo[-2]
    s = max(qbox.hi[-2], kbox.hi[-2], *(segments or (0,)))
    ct = compute_dtype(float_dtype(result_dtype(q.dtype, k.dtype, v.dtype, o.dtype,
                                                do.dtype)))
    *batch, hq, lq, d = q.shape
    hkv = k.shape[-3]
    g = hq // hkv if hkv else 0

    def grouped(x):
        return np.asarray(x).astype(ct, copy=False).reshape(*batch, hkv, g, *x.shape[-2:])

    dq, dk, dv = bblk.bwd_block(
        grouped(q), np.asarray(k).astype(ct, copy=False), np.asarray(v).astype(ct, copy=False),
        grouped(o), np.asarray(lse).astype(ct, copy=False).reshape(*batch, hkv, g, lq),
        grouped(do), qa, ka, causal, segments, s, ct.type(_scale(scale, d)))
    outs = []
    for res, x, inbox, outbox in ((dq.reshape(q.shape), q, qbox, fspec.outputs[0]),
                                  (dk, k, kbox, fspec.outputs[1]),
                                  (dv, v, kbox, fspec.outputs[2])):
        out = np.zeros(outbox.shape, float_dtype(x.dtype))
        at = inbox.lo[-2] - outbox.lo[-2]
        out[..., at:at + res.shape[-2], :] = res
        outs.append(out)
    return tuple(outs)


def _bwd_impl(q, k, v, o, lse, do, **params):
    whole = FunctionSpec(_whole(q, k, v, o, lse, do).inputs,
                         tuple(Box.full(np.shape(x)) for x in (q, k, v)))
    return _bwd_block(whole, q, k, v, o, lse, do, **params)


def _bwd_indexing(ins, outs, *, causal, segments, scale):
    """The forward's named indices and balanced cuts; the specs of the module docstring."""
    q, k, v, o = ins[:4]
    ix = _att().indexing((q, k, v), (o,), causal=causal, segments=segments, scale=scale)
    names = list(ix.extents)
    nb = q.ndim - 3
    batch = names[:nb]
    hkv, s, d = k.shape[-3:]
    g = q.shape[-3] // hkv

    def producer(iv) -> JoinAggSpec:
        if iv["head_dim"] != ((0, d),):
            raise EinsError(f"attention_bwd: head_dim (D={d}) is not shardable, got "
                            f"intervals {iv['head_dim']}")
        qsplit, ksplit = len(iv["sequence"]) > 1, len(iv["kv_sequence"]) > 1
        # cuts at segment ends: each block's gradients are its own rows', no ⊕
        exact_q = qsplit and not ksplit and bblk.at_segment_ends(iv["sequence"], segments, s)
        exact_k = ksplit and not qsplit and bblk.at_segment_ends(iv["kv_sequence"], segments,
                                                                 s)
        fspecs = []
        for combo in itertools.product(*(iv[n] for n in names)):
            ch = dict(zip(names, combo))
            lo = [ch[n][0] for n in batch]
            hi = [ch[n][1] for n in batch]
            (ha, hb), (qa, qb), (c, e) = ch["heads_kv"], ch["sequence"], ch["kv_sequence"]
            ra, rb, ka, kb = _read_rows(qa, qb, c, e, qsplit, ksplit, causal, segments, s)
            # an unsplit index's interval is the whole sequence
            dqa, dqb = (c, e) if exact_k else (qa, qb)
            dka, dkb = (qa, qb) if exact_q else (c, e)
            qbox = Box((*lo, ha * g, ra, 0), (*hi, hb * g, rb, d))
            kbox = Box((*lo, ha, ka, 0), (*hi, hb, kb, d))
            lsebox = _drop_last(qbox)
            dq = Box((*lo, ha * g, dqa, 0), (*hi, hb * g, dqb, d))
            dk = Box((*lo, ha, dka, 0), (*hi, hb, dkb, d))
            fspecs.append(FunctionSpec((qbox, kbox, kbox, qbox, lsebox, qbox), (dq, dk, dk)))
        q_agg = "sum" if ksplit and not exact_k else None
        k_agg = "sum" if qsplit and not exact_q else None
        return JoinAggSpec(tuple(fspecs), (q_agg, k_agg, k_agg))

    return Indexing(ix.extents, ix.shardable, producer, None, ix.balance)


def _read_rows(qa, qb, c, e, qsplit, ksplit, causal, segments, s):
    """The query rows ``[ra, rb)`` and key rows ``[ka, kb)`` a block of query interval
    ``[qa, qb)`` and key interval ``[c, e)`` reads: the keys its rows see (query split),
    the rows that see its keys (key split), or, both split, those of each interval that see
    the other's (all of the interval if none do)."""
    if not ksplit:
        ka, kb = blk.needed_keys(qa, qb, causal, segments, s)
        return qa, qb, ka, kb
    ra, rb = bblk.needed_queries(c, e, causal, segments, s)
    if not qsplit:
        return ra, rb, c, e
    ka, kb = blk.needed_keys(qa, qb, causal, segments, s)
    ka, kb = (max(ka, c), min(kb, e)) if max(ka, c) < min(kb, e) else (c, e)
    ra, rb = (max(ra, qa), min(rb, qb)) if max(ra, qa) < min(rb, qb) else (qa, qb)
    return ra, rb, ka, kb


def _bwd_flops(ins, outs, **params):
    a, b = BWD_FLOPS_RATIO
    return _att().flops(ins[:3], ins[3:4], **params) * a // b


def _bwd_block_flops(fspec, ins, outs, *, causal, segments, scale):
    a, b = BWD_FLOPS_RATIO
    return blk.attention_block_flops(fspec, causal, segments) * a // b


def _bwd_temp_bytes(fspec, **params) -> int:
    """The GPU kernel's rowsum(dO o O), one float32 per query row and head: O(S)."""
    q = fspec.inputs[0]
    return 4 * q.size // max(q.shape[-1], 1)


def _bwd_accumulation(ins, outs, **params):
    """three chained accumulations (the scores over the head dim, dP over the head dim, the
    gradients over the keys or the query rows of a head group): dK sums G*S terms"""
    q, k = ins[0], ins[1]
    g = q.shape[-3] // max(k.shape[-3], 1)
    return 3, max(g * q.shape[-2], k.shape[-2], q.shape[-1])


def _bwd_flops_dtype(in_dtypes):
    """The matmuls take q, k, v, o and dO (their promoted dtype); the lse is float32."""
    return result_dtype(*(d for i, d in enumerate(in_dtypes) if i != 4))


def attention_bwd(q, k, v, o, lse, do, causal=True, segments=None, scale=None):
    """``(dq, dk, dv)``: the gradients of ``attention(q, k, v, ...)`` whose output ``o`` and
    log-sum-exp ``lse`` (:func:`attention_fwd`) the forward saved, for the output cotangent
    ``do``."""
    return bind("attention_bwd", q, k, v, o, lse, do, **_params(causal, segments, scale))


# ----------------------------------------------------------------------------- the VJP rule
def saved_lse(q, k, v, o, params):
    """The log-sum-exp of the attention that made ``o``: where ``o`` is the output of an
    ``attention`` eqn of the trace in progress (the forward pass being differentiated), that
    eqn becomes ``attention_fwd`` in place (same inputs, same output variable, plus the
    lse; its other fields, such as its phase, kept), so the forward pass saves it at no
    extra cost; an ``attention_fwd`` eqn already gives it. Otherwise (no such eqn) it is
    computed afresh."""
    if isinstance(o, Tracer):
        ctx, var = o._ctx, o._var
        for i in range(len(ctx.eqns) - 1, -1, -1):
            e = ctx.eqns[i]
            if not e.outputs or e.outputs[0] is not var:
                continue
            if e.primitive is get_primitive("attention_fwd") and e.params == params:
                return Tracer(e.outputs[1], ctx)
            if e.primitive is _att() and e.params == params:
                lse = Var(TensorType(var.shape[:-1], lse_dtype(var.dtype)))
                new = dataclasses.replace(e, primitive=get_primitive("attention_fwd"),
                                          outputs=(var, lse))
                ctx.eqns[i] = new
                remat = getattr(ctx, "remat", None)   # a checkpoint region's eqn stays in it
                if remat is not None and id(e) in remat:
                    remat[id(new)] = remat[id(e)]
                return Tracer(lse, ctx)
            break
    return bind("attention_fwd", q, k, v, **params)[1]


def attention_vjp(cts, ins, outs, needs, **params):
    """attention's VJP rule (eins.autodiff calls ``vjp(cts, ins, outs, needs, **params)``):
    the cotangents of (q, k, v) from the output's cotangent ``cts[0]`` (None: zero), with
    the forward's output ``outs[0]``, whose lse :func:`saved_lse` has the forward save."""
    (do,) = cts
    if do is None or not any(needs):
        return (None,) * len(ins)
    q, k, v = ins
    lse = saved_lse(q, k, v, outs[0], params)
    return bind("attention_bwd", q, k, v, outs[0], lse, do, **params)


def _attention_fwd_vjp(cts, ins, outs, needs, **params):
    """attention_fwd's VJP rule: the output's cotangent as attention's; the lse is a saved
    residual, not a result to differentiate (a cotangent for it is refused)."""
    do, dlse = cts
    if dlse is not None:
        raise EinsError("attention_fwd: the gradient through its log-sum-exp output is not "
                        "implemented (differentiate eins.attention's output instead)")
    if do is None or not any(needs):
        return (None,) * len(ins)
    return bind("attention_bwd", *ins, *outs, do, **params)


# ----------------------------------------------------------------------------- GPU
def _offsets(fspec):
    if fspec is None:
        return 0, 0
    return fspec.inputs[0].lo[-2], fspec.inputs[1].lo[-2]


def _floats(ts) -> bool:
    """float16/bfloat16/float32 tensors of one dtype (what the Triton kernels take)."""
    import torch  # heavy: only the GPU path
    floats = (torch.float16, torch.bfloat16, torch.float32)
    ts = list(ts)
    return all(getattr(t, "dtype", None) in floats for t in ts) and \
        all(t.dtype == ts[0].dtype for t in ts)


def _f32(t) -> bool:
    import torch  # heavy: only the GPU path
    return getattr(t, "dtype", None) == torch.float32


def _lse_out(t) -> bool:
    import torch  # heavy: only the GPU path
    return getattr(t, "dtype", None) == torch.float32 and t.is_contiguous()


def _fwd_accepts(outs, ins, params) -> bool:
    """attention's launcher takes the operands and the output, the lse is float32."""
    low = _att().lowering()
    return len(outs) == 2 and _lse_out(outs[1]) and ins[0].shape[-1] > 0 and \
        (low.accepts is None or low.accepts(outs[:1], ins, params))


def _fwd_gpu(fspec, outs, ins, **params):
    """attention's (o, lse) launcher (its lowering's ``partial`` with two outputs: the
    attention over the block's keys, which are all the keys its rows see here)."""
    _att().lowering().partial(fspec, list(outs), ins, **params)


def _fwd_accepts_partial(outs, ins, params) -> bool:
    low = _att().lowering()
    return len(outs) == 2 and _lse_out(outs[1]) and ins[0].shape[-1] > 0 and \
        (low.accepts_partial is None or low.accepts_partial(outs[:1], ins, params))


def _fwd_gpu_partial(fspec, outs, ins, **params):
    """A key-split block: attention's (o, lse) pairs, and the lse partial read off them."""
    pairs, lse = outs
    _att().lowering().partial(fspec, [pairs], ins, **params)
    lse.copy_(pairs[..., 0, 1])


def _fwd_torch(fspec, *ins, partial=False, **params):
    """attention's torch fallback as pairs: (o, lse), or (pairs, lse) for a key split."""
    (pairs,) = _att().lowering().fallback(fspec, *ins, partial=True, **params)
    lse = pairs[..., 0, 1]
    return (pairs, lse) if partial else (pairs[..., 0], lse)


def _bwd_accepts(outs, ins, params) -> bool:
    q, k, v, o, lse, do = ins
    return len(outs) == 3 and _floats([q, k, v, o, do, *outs]) and _f32(lse)


def _bwd_gpu(fspec, outs, ins, **params):
    """The Triton backward (eins/kernels/attention_bwd.py) on the block at its global offsets;
    each gradient written at its rows inside its output box, zeros elsewhere (a ⊕ partial)."""
    q, k = ins[0], ins[1]
    qa, ka = _offsets(fspec)
    views = []
    for out, x, j in zip(outs, (q, k, k), range(3)):
        at = 0 if fspec is None else (fspec.inputs[0 if j == 0 else 1].lo[-2]
                                      - fspec.outputs[j].lo[-2])
        if out.shape[-2] != x.shape[-2]:
            out.zero_()
        views.append(out[..., at:at + x.shape[-2], :])
    flash_attention_bwd(*ins, *views, q_offset=qa, k_offset=ka, **params)


def _bwd_torch(fspec, q, k, v, o, lse, do, *, causal, segments, scale):
    """The torch fallback: :func:`eins.ops.attention_bwd_blocks.bwd_block` in torch, per
    packed segment, in float32 (float64 stays), each gradient placed in its output box."""
    import torch  # heavy: only the GPU path
    if fspec is None:
        fspec = FunctionSpec(tuple(Box.full(tuple(t.shape)) for t in (q, k, v, o, lse, do)),
                             tuple(Box.full(tuple(t.shape)) for t in (q, k, v)))
    qa, ka = _offsets(fspec)
    lq, lk = q.shape[-2], k.shape[-2]
    s = max(qa + lq, ka + lk, *(segments or (0,)))
    ct = compute_type(q, k, v, o, do)
    *batch, hq, _, d = q.shape
    hkv = k.shape[-3]
    g = hq // hkv if hkv else 0
    sc = _scale(scale, d)
    qf, of, dof = (t.to(ct).reshape(*batch, hkv, g, lq, d) for t in (q, o, do))
    lf = lse.to(ct).reshape(*batch, hkv, g, lq, 1)
    kf, vf = k.to(ct).unsqueeze(-3), v.to(ct).unsqueeze(-3)   # broadcast over the group
    dq = torch.zeros(qf.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    delta = (dof * of).sum(-1, keepdim=True)
    start = 0
    for end in (tuple(segments) if segments else (s,)):
        a, b, c, e = max(qa, start), min(qa + lq, end), max(ka, start), min(ka + lk, end)
        if causal:
            e = min(e, b)
        start = end
        if b <= a or e <= c:
            continue
        rq, rk = slice(a - qa, b - qa), slice(c - ka, e - ka)
        ks, vs = kf[..., rk, :], vf[..., rk, :]
        sco = (qf[..., rq, :] @ ks.transpose(-1, -2)) * sc
        lrow = lf[..., rq, :]
        seen = torch.isfinite(lrow)
        if causal:
            seen = seen & (torch.arange(c, e, device=q.device)[None, :]
                           <= torch.arange(a, b, device=q.device)[:, None])
        p = torch.where(seen, torch.exp(sco - torch.where(torch.isfinite(lrow), lrow,
                                                          torch.zeros_like(lrow))),
                        torch.zeros_like(sco))
        dv[..., rk, :] += (p.transpose(-1, -2) @ dof[..., rq, :]).sum(-3)
        ds = p * (dof[..., rq, :] @ vs.transpose(-1, -2) - delta[..., rq, :])
        dq[..., rq, :] += (ds @ ks) * sc
        dk[..., rk, :] += (ds.transpose(-1, -2) @ qf[..., rq, :]).sum(-3) * sc
    res = []
    for grad, x, j in ((dq.reshape(q.shape), q, 0), (dk, k, 1), (dv, v, 2)):
        box, inbox = fspec.outputs[j], fspec.inputs[0 if j == 0 else 1]
        out = torch.zeros(box.shape, dtype=ct, device=q.device)
        at = inbox.lo[-2] - box.lo[-2]
        out[..., at:at + x.shape[-2], :] = grad
        res.append(out)
    return tuple(res)


# ----------------------------------------------------------------------------- samples
def _fwd_samples(arr):
    """attention_fwd alone, its output used (the lse is what a backward reads: the spec
    checker checks both outputs all the same)."""
    def f(**kw):
        return lambda q, k, v: attention_fwd(q, k, v, **kw)[0]

    return [
        ("attention_fwd gqa 8q/4kv", f(), (arr(8, 6, 4), arr(4, 6, 4), arr(4, 6, 4))),
        ("attention_fwd segments non-causal", f(causal=False, segments=(3, 5, 8, 12)),
         (arr(4, 12, 4), arr(2, 12, 4), arr(2, 12, 4))),
        ("attention_fwd one sequence causal f32", f(),
         (arr(2, 12, 4, dtype="float32"), arr(1, 12, 4, dtype="float32"),
          arr(1, 12, 4, dtype="float32")))]


def _bwd_samples(arr):
    """The forward and the backward of attention, as a training step runs them."""
    def fb(**kw):
        def f(q, k, v, do):
            o, lse = attention_fwd(q, k, v, **kw)
            return attention_bwd(q, k, v, o, lse, do, **kw)
        return f

    return [
        ("attention_bwd gqa 8q/4kv", fb(), (arr(8, 6, 4), arr(4, 6, 4), arr(4, 6, 4),
                                            arr(8, 6, 4))),
        ("attention_bwd segments", fb(segments=(3, 5, 8, 12)),
         (arr(4, 12, 4), arr(2, 12, 4), arr(2, 12, 4), arr(4, 12, 4))),
        ("attention_bwd batch non-causal", fb(causal=False),
         (arr(6, 2, 5, 4), arr(6, 1, 5, 4), arr(6, 1, 5, 4), arr(6, 2, 5, 4))),
        ("attention_bwd one sequence causal", fb(),
         (arr(2, 12, 4), arr(1, 12, 4), arr(1, 12, 4), arr(2, 12, 4))),
        ("attention_bwd one sequence non-causal f32", fb(causal=False),
         (arr(2, 9, 4, dtype="float32"), arr(1, 9, 4, dtype="float32"),
          arr(1, 9, 4, dtype="float32"), arr(2, 9, 4, dtype="float32"))),
        ("attention_bwd segments one kv head non-causal",
         fb(causal=False, segments=(2, 7, 9, 16)),
         (arr(3, 16, 4), arr(1, 16, 4), arr(1, 16, 4), arr(3, 16, 4))),
        ("attention_bwd segments one kv head", fb(segments=(4, 8, 12, 16)),
         (arr(2, 16, 4), arr(1, 16, 4), arr(1, 16, 4), arr(2, 16, 4)))]


_ONE_FLOAT = "float16, bfloat16 or float32 operands of one dtype, a float32 lse"

register(Primitive(
    "attention_fwd", _fwd_abstract, _fwd_impl, _fwd_flops, _fwd_indexing, _fwd_block,
    _fwd_partial, _fwd_block_flops, temp_bytes_fn=_fwd_temp_bytes,
    accumulation=_fwd_accumulation,
    lowerings={None: GpuLowering(
        _fwd_gpu, accepts=_fwd_accepts, takes=_ONE_FLOAT, fallback=_fwd_torch,
        template="triton_attention.py.j2", partial=_fwd_gpu_partial,
        accepts_partial=_fwd_accepts_partial)},
    samples=_fwd_samples, vjp=_attention_fwd_vjp))

register(Primitive(
    "attention_bwd", _bwd_abstract, _bwd_impl, _bwd_flops, _bwd_indexing, _bwd_block,
    None, _bwd_block_flops, temp_bytes_fn=_bwd_temp_bytes, flops_dtype=_bwd_flops_dtype,
    accumulation=_bwd_accumulation,
    lowerings={None: GpuLowering(
        _bwd_gpu, accepts=_bwd_accepts, takes=_ONE_FLOAT, fallback=_bwd_torch,
        template="triton_attention_bwd.py.j2")},
    samples=_bwd_samples))
