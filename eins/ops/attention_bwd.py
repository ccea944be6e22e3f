"""Attention's backward: the forward that saves its log-sum-exp, the backward primitive that
recomputes the scores from it block by block (FlashAttention-2's backward), and attention's
VJP rule that joins them.

``attention_fwd(q, k, v, **params) -> (o, lse)``: eins's ``attention`` (eins/ops/attention.py;
the same parameters, shape rule, kernels and splits) that also returns each query row's
natural log-sum-exp of its scaled, masked scores, ``lse`` ``[..., Hq, Sq]`` in float32
(float64 for float64 attention); -inf for a row that sees no key. Its join-agg specs are
attention's with the lse block beside the output block: where attention's key split
aggregates (o, lse) pairs with ⊕ ``lse``, the lse output's partials (each key block's
log-sum-exp) combine with ⊕ ``logaddexp`` (eins.ir.joinagg), exactly.

``attention_bwd(q, k, v, o, lse, do, *extra, **params) -> (dq, dk, dv)``: the gradients of
attention's output with cotangent ``do``, from the forward's ``o`` and ``lse``; ``extra`` and
``params`` are the forward eqn's mask and bias operands and parameters (issue 33's options:
window, softcap, key or full mask, ALiBi or additive bias, queries aligned with the last
keys, a value head size of its own), read with the forward's defaults. Named indices
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

Segment ends as data (``segments="array"``: the forward's last operand, an int array padded
with S): attention_fwd and attention_bwd take it as their last operand too (after the mask
and the bias). Their specs are then the forward's for unknown ends (equal-token cuts, every
block reading the keys it would need were the sequence one document), their kernels read
each block's segments from the operand, and ``runtime_params`` (attention's, on the
forward's operands) lets the per-call rebalance (eins/passes/rebalance.py) re-cut both
for each call's ends. Both have capacity forms (``Primitive.capacity``,
eins/passes/capacity.py) for a query-row split, and attention_dbias one reading the
backward's table: one program for every cut on the GPU backends.

The VJP rule of ``attention`` (its ``vjp`` field) turns the forward eqn it differentiates
into ``attention_fwd`` in place, so the lse the backward needs is saved by the forward pass
rather than recomputed, and binds ``attention_bwd`` with the eqn's parameters for q, k and
v, and ``attention_dbias`` (eins/ops/attention_dbias.py) for a bias whose gradient is asked
for; a mask is bool (no cotangent).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from eins.errors import EinsError, ShapeError
from eins.ir.joinagg import FunctionSpec, Indexing, JoinAggSpec, lse_pair_dtype
from eins.ir.primitive import GpuLowering, Primitive, Strided, get_primitive, register
from eins.ir.program import Var
from eins.ir.rules import compute_dtype, float_dtype
from eins.ir.types import Box, TensorType, result_dtype
from eins.ops import attention_bwd_blocks as bblk
from eins.ops import attention_bwd_gpu as gpu
from eins.ops import attention_dbias as dbias
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
    kernel over them is the whole attention of those rows. The capacity form (``rows``: a
    table row [lo, hi) last) computes every row and keeps only [lo, hi): o and lse 0
    elsewhere (the blocks' copies are ⊕-summed)."""
    rows = None
    if params.get("rows"):
        lo, hi = (int(x) for x in np.asarray(blocks[-1]).reshape(-1)[:2])
        blocks, params = blocks[:-1], dict(params, rows=False)
        fspec = FunctionSpec(fspec.inputs[:-1], fspec.outputs)
        at = np.arange(fspec.inputs[0].lo[-2], fspec.inputs[0].hi[-2])
        rows = (at < lo) | (at >= hi)
    pairs, lse = _fwd_pairs(fspec, *blocks, **params)
    out = result_dtype(*(b.dtype for b in blocks[:3]))   # attention's output dtype
    o, lse = np.array(pairs["o"], dtype=out), np.array(lse)
    if rows is not None:
        o[..., rows, :] = 0
        lse[..., rows] = 0
    return o, lse


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
        # a key split's lse partials ⊕ by logaddexp; the capacity form's copies by sum
        return JoinAggSpec(fspecs, (agg, None if agg is None else
                                    "sum" if agg == "sum" else "logaddexp"))

    return Indexing(ix.extents, ix.shardable, producer, ix.dims, ix.balance, ix.work)


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


def attention_fwd_ends(q, k, v, ends, causal=True):
    """:func:`attention_fwd` with the segment ends as data (an int array, padded with S)."""
    return bind("attention_fwd", q, k, v, ends, causal=bool(causal), segments="array",
                scale=None)


def _params(causal, segments, scale) -> dict:
    return dict(causal=bool(causal), segments=None if segments is None else tuple(
        int(e) for e in segments), scale=None if scale is None else float(scale))


# ----------------------------------------------------------------------------- attention_bwd
def _bwd_abstract(q, k, v, o, lse, do, *extra, **params):
    (ot,) = _att().abstract(q, k, v, *extra, **params)   # attention's rule and errors
    for name, t, want in (("o", o, ot.shape), ("do", do, ot.shape),
                          ("lse", lse, ot.shape[:-1])):
        if tuple(t.shape) != tuple(want):
            raise ShapeError(f"attention_bwd: {name} must have shape {tuple(want)} (q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}), got {tuple(t.shape)}")
    return tuple(TensorType(x.shape, float_dtype(x.dtype)) for x in (q, k, v))


def _bwd_block(fspec, q, k, v, o, lse, do, *extra, **params):
    """f[F]: the gradients of the block's visible (query, key) pairs (bblk.bwd_block), each
    written at its global rows inside its output box (zeros elsewhere: a ⊕ sum partial).
    The capacity form (``rows``: its table row last) computes this call's rows and keys."""
    if params.get("rows"):
        return _capacity_block(fspec, q, k, v, o, lse, do, *extra, **params)
    p = bblk.opts(params)
    qbox, kbox = fspec.inputs[0], fspec.inputs[1]
    ct = compute_dtype(float_dtype(result_dtype(q.dtype, k.dtype, v.dtype, o.dtype,
                                                do.dtype)))
    *batch, hq, lq, d = q.shape
    hkv = k.shape[-3]
    g = hq // hkv if hkv else 0

    def grouped(x):
        return np.asarray(x).astype(ct, copy=False).reshape(*batch, hkv, g, *x.shape[-2:])

    mask, bias = bblk.extras(extra, p)
    segments, span = bblk.kernel_segments(p, fspec, (q, k, v, o, lse, do, *extra))
    dq, dk, dv = bblk.bwd_block(
        grouped(q), np.asarray(k).astype(ct, copy=False), np.asarray(v).astype(ct, copy=False),
        grouped(o), np.asarray(lse).astype(ct, copy=False).reshape(*batch, hkv, g, lq),
        grouped(do), qbox.lo[-2], kbox.lo[-2], p["causal"], segments, span,
        ct.type(bblk.scale_of(p["scale"], d)), off=p["offset"], window=p["window"],
        softcap=p["softcap"],
        **bblk.grouped_extras(p, mask, bias, hkv,
                              lambda x: np.asarray(x).astype(ct, copy=False)))
    outs = []
    for res, x, inbox, outbox in ((dq.reshape(q.shape), q, qbox, fspec.outputs[0]),
                                  (dk, k, kbox, fspec.outputs[1]),
                                  (dv, v, kbox, fspec.outputs[2])):
        out = np.zeros(outbox.shape, float_dtype(x.dtype))
        at = inbox.lo[-2] - outbox.lo[-2]
        out[..., at:at + res.shape[-2], :] = res
        outs.append(out)
    return tuple(outs)


def _capacity_block(fspec, q, k, v, o, lse, do, *extra, **params):
    """A capacity-form block: its rows outside this call's [lo, hi) and keys outside [klo,
    khi) read as zeros (bblk.capacity_inputs); the gradients zero outside them."""
    fspec = FunctionSpec(fspec.inputs[:-1], fspec.outputs)
    q, k, v, o, lse, do, out_r, out_k = bblk.capacity_inputs(fspec, q, k, v, o, lse, do,
                                                             extra[-1])
    dq, dk, dv = _bwd_block(fspec, q, k, v, o, lse, do, *extra[:-1],
                            **dict(params, rows=False))
    dq[..., out_r, :] = 0
    dk[..., out_k, :] = 0
    dv[..., out_k, :] = 0
    return dq, dk, dv


def _bwd_impl(*ins, **params):
    whole = FunctionSpec(_whole(*ins).inputs, tuple(Box.full(np.shape(x)) for x in ins[:3]))
    return _bwd_block(whole, *ins, **params)



def _bwd_indexing(ins, outs, **params):
    """The forward's named indices and balanced cuts; the specs of the module docstring."""
    ix, reads = bblk.backward_reads("attention_bwd", ins, params)
    segments = bblk.static_segments(bblk.opts(params))
    sq, sk = ins[0].shape[-2], ins[1].shape[-2]

    def producer(iv) -> JoinAggSpec:
        if params.get("rows"):
            return _capacity_spec(iv, reads, sq, ins)
        blocks = reads(iv)
        qsplit, ksplit = len(iv["sequence"]) > 1, len(iv["kv_sequence"]) > 1
        # cuts at segment ends: each block's gradients are its own rows', no ⊕ (segments
        # need Sq == Sk)
        exact_q = qsplit and not ksplit and bblk.at_segment_ends(iv["sequence"], segments,
                                                                 sq)
        exact_k = ksplit and not qsplit and bblk.at_segment_ends(iv["kv_sequence"],
                                                                 segments, sk)
        d, dv = ins[0].shape[-1], ins[2].shape[-1]
        fspecs = []
        for b in blocks:
            (ha, hb), (qa, qb) = b.heads_kv, b.heads
            # an unsplit index's interval is the whole sequence
            dqa, dqb = b.keys if exact_k else b.rows
            dka, dkb = b.rows if exact_q else b.keys
            fspecs.append(FunctionSpec(
                b.inputs,
                (Box((*b.lo, qa, dqa, 0), (*b.hi, qb, dqb, d)),
                 Box((*b.lo, ha, dka, 0), (*b.hi, hb, dkb, d)),
                 Box((*b.lo, ha, dka, 0), (*b.hi, hb, dkb, dv)))))
        q_agg = "sum" if ksplit and not exact_k else None
        k_agg = "sum" if qsplit and not exact_q else None
        return JoinAggSpec(tuple(fspecs), (q_agg, k_agg, k_agg))

    return Indexing(ix.extents, ix.shardable, producer, None, ix.balance, ix.work)


def _capacity_spec(iv, reads, sq, ins) -> JoinAggSpec:
    """The capacity form's spec (``_bwd_capacity``): block j of the query-row split reads
    every row and key, and its table row j (last); its gradients are whole copies (zeros
    outside the rows and keys it computes this call) that ⊕ sum adds."""
    d, dv, width = ins[0].shape[-1], ins[2].shape[-1], ins[-1].shape[-1]
    fspecs = []
    for w, inputs in bblk.capacity_whole("attention_bwd", iv, reads, sq, width):
        (ha, hb), (qa, qb), (ka, kb) = w.heads_kv, w.heads, (w.inputs[1].lo[-2],
                                                             w.inputs[1].hi[-2])
        fspecs.append(FunctionSpec(
            inputs,
            (Box((*w.lo, qa, 0, 0), (*w.hi, qb, sq, d)),
             Box((*w.lo, ha, ka, 0), (*w.hi, hb, kb, d)),
             Box((*w.lo, ha, ka, 0), (*w.hi, hb, kb, dv)))))
    agg = "sum" if len(iv["sequence"]) > 1 else None
    return JoinAggSpec(tuple(fspecs), (agg, agg, agg))


def _bwd_capacity(params, ins_types, names):
    """``Primitive.capacity`` of attention_bwd: a query-row split whose cuts move per call
    becomes blocks of every row and key that compute only this call's rows [lo, hi) (the
    table's pair 0) and the keys they see [klo, khi) (pair 1): q, o, dO and the lse (on its
    last axis) read by the rows, k and v by the keys; dQ written at the rows, dK and dV at
    the keys (each block's copy zero elsewhere, ⊕ sum)."""
    if set(names) != {"sequence"} or _bwd_runtime_params(params, ins_types, None) is None:
        return None
    reads = {0: 0, 1: 1, 2: 1, 3: 0, 4: (0, -1), 5: 0}
    return dict(params, segments="array", rows=True), -2, reads, {1: (-2, 1), 2: (-2, 1)}


def _bwd_flops(ins, outs, **params):
    """2.5x attention's (its FLOPs of the same operands)."""
    a, b = BWD_FLOPS_RATIO
    q, k, v, o = ins[:4]
    return _att().flops((q, k, v, *ins[6:]), (o,), **params) * a // b


def _bwd_block_flops(fspec, ins, outs, **params):
    """2.5x attention's of the block (its q and k boxes are the forward's positions)."""
    a, b = BWD_FLOPS_RATIO
    return _att().block_flops(fspec, ins, outs, **params) * a // b


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
def saved_lse(ins, o, params):
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
    return bind("attention_fwd", *ins, **params)[1]


def attention_vjp(cts, ins, outs, needs, **params):
    """attention's VJP rule (eins.autodiff calls ``vjp(cts, ins, outs, needs, **params)``):
    the cotangents of (q, k, v) (``attention_bwd``) and of the bias where it has one
    (``attention_dbias``: an additive bias's or ALiBi slopes') from the output's cotangent
    ``cts[0]`` (None: zero), with the forward's output ``outs[0]``, whose lse
    :func:`saved_lse` has the forward save. A mask is bool: no cotangent."""
    (do,) = cts
    if do is None or not any(needs):
        return (None,) * len(ins)
    p = bblk.opts(params)
    at = 3 + bool(p["mask"])   # the bias's operand (the runtime ends, if any, follow it)
    lse = saved_lse(ins, outs[0], params)
    grads = [None] * len(ins)
    if any(needs[:3]):
        # the runtime ends, where given, ride along as the backward's last operand
        grads[:3] = bind("attention_bwd", *ins[:3], outs[0], lse, do, *ins[3:], **params)
    if p["bias"] and needs[at]:   # so does the bias's, after the bias
        grads[at] = dbias.attention_dbias(*ins[:3], outs[0], lse, do, *ins[3:], **params)
    return tuple(grads)


def _attention_fwd_vjp(cts, ins, outs, needs, **params):
    """attention_fwd's VJP rule: the output's cotangent as attention's; the lse is a saved
    residual, not a result to differentiate (a cotangent for it is refused)."""
    do, dlse = cts
    if dlse is not None:
        raise EinsError("attention_fwd: the gradient through its log-sum-exp output is not "
                        "implemented (differentiate eins.attention's output instead)")
    return attention_vjp((do,), ins, outs[:1], needs, **params)


# ----------------------------------------------------------------------------- runtime ends
def _fwd_runtime_params(params, ins_types, values):
    """``Primitive.runtime_params`` of attention_fwd: attention's (the same operands)."""
    return _att().runtime_params(params, ins_types, values)


def _fwd_capacity(params, ins_types, names):
    """``Primitive.capacity`` of attention_fwd: attention's (the same operands and output
    rows), with the lse windowed by the same query rows on its last axis."""
    form = _att().capacity(params, ins_types, names)
    return None if form is None else tuple(form) + ({1: -1},)


def _fwd_aligned(params, ins_types, intervals):
    """``Primitive.aligned`` of attention_fwd: attention's (the same operands)."""
    return _att().aligned(params, ins_types, intervals)


def _bwd_runtime_params(params, ins_types, values):
    """``Primitive.runtime_params`` of the backward eqns (operands q, k, v, o, lse, dO, then
    the forward's mask, bias and runtime ends): attention's on the forward's operands, so
    a re-cut backward eqn gets the call's ends, FLOPs and balanced cuts as the forward."""
    fwd = list(ins_types[:3]) + list(ins_types[6:])
    n = _att().runtime_params(params, fwd, None)
    if n is None:
        return None
    if values is None:
        return n + 3
    return _att().runtime_params(params, fwd, {n: values[n + 3]})


def _bwd_aligned(params, ins_types, intervals):
    """``Primitive.aligned`` of the backward eqns (attention_bwd, attention_dbias): the
    runtime ends under which the forward's blocks cut at ``intervals`` read no key outside
    their rows (attention's, on the forward's operands), at the eqn's ends operand (three
    later: o, lse and dO come before the forward's extras)."""
    fwd = list(ins_types[:3]) + list(ins_types[6:])
    got = _att().aligned(params, fwd, intervals)
    return None if got is None else {n + 3: x for n, x in got.items()}


# ----------------------------------------------------------------------------- samples
def _fwd_samples(arr):
    """attention_fwd alone, its output used (the lse is what a backward reads: the spec
    checker checks both outputs all the same)."""
    def f(**kw):
        return lambda q, k, v: attention_fwd(q, k, v, **kw)[0]

    def g(q, k, v, e):   # the ends as data (the family's specs: unknown ends)
        return attention_fwd_ends(q, k, v, e)[0]

    return [
        ("attention_fwd gqa 8q/4kv", f(), (arr(8, 6, 4), arr(4, 6, 4), arr(4, 6, 4))),
        ("attention_fwd segments as data", g,
         (arr(4, 12, 4), arr(2, 12, 4), arr(2, 12, 4), np.array([3, 5, 8, 12, 12]))),
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

    def fe(q, k, v, do, e):   # the ends as data, as a packed training step runs them
        o, lse = attention_fwd_ends(q, k, v, e)
        return bind("attention_bwd", q, k, v, o, lse, do, e, causal=True, segments="array",
                    scale=None)

    return [
        ("attention_bwd gqa 8q/4kv", fb(), (arr(8, 6, 4), arr(4, 6, 4), arr(4, 6, 4),
                                            arr(8, 6, 4))),
        ("attention_bwd segments as data", fe,
         (arr(4, 12, 4), arr(2, 12, 4), arr(2, 12, 4), arr(4, 12, 4),
          np.array([2, 7, 9, 12, 12]))),
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
        gpu.fwd_gpu, accepts=gpu.fwd_accepts, takes=_ONE_FLOAT, fallback=gpu.fwd_torch,
        template="triton_attention.py.j2", partial=gpu.fwd_gpu_partial,
        accepts_partial=gpu.fwd_accepts_partial)},
    runtime_params=_fwd_runtime_params, aligned=_fwd_aligned, capacity=_fwd_capacity,
    samples=_fwd_samples, vjp=_attention_fwd_vjp))

register(Primitive(
    "attention_bwd", _bwd_abstract, _bwd_impl, _bwd_flops, _bwd_indexing, _bwd_block,
    None, _bwd_block_flops, temp_bytes_fn=_bwd_temp_bytes, flops_dtype=_bwd_flops_dtype,
    accumulation=_bwd_accumulation,
    # the launcher reads q, k, v, o and dO through their strides (a unit one in the head
    # dim), so the GPU walk hands it views of the transposes around it
    strided=Strided(operands=(0, 1, 2, 3, 5), unit_last=True),
    lowerings={None: GpuLowering(
        gpu.bwd_gpu, accepts=gpu.bwd_accepts, takes=_ONE_FLOAT, fallback=gpu.bwd_torch,
        template="triton_attention_bwd.py.j2")},
    runtime_params=_bwd_runtime_params, capacity=_bwd_capacity, aligned=_bwd_aligned,
    samples=_bwd_samples))
