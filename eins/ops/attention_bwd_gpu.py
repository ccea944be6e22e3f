"""The GPU side of attention's backward (eins/ops/attention_bwd.py): attention_fwd's lowering
(attention's own launchers and fallback, with the lse beside the output) and attention_bwd's
(the Triton backward of eins/kernels/attention_bwd.py at the block's global offsets, and a
torch fallback) and attention_dbias's (the Triton bias gradient of
eins/kernels/attention_dbias.py, and a torch fallback; eins/ops/attention_dbias.py).
Positions are global: a block's query and key offsets come from its
function specification, so a block masks exactly as the whole would."""
from __future__ import annotations

from eins.ir.joinagg import FunctionSpec
from eins.ir.primitive import get_primitive
from eins.ir.types import Box
from eins.kernels.attention import in_window, lse_outside_rows, same_segment
from eins.kernels.attention_bwd import attention_bwd as flash_attention_bwd
from eins.kernels.attention_dbias import attention_dbias as flash_attention_dbias
from eins.kernels.torch_rules import compute_type
from eins.ops import attention_bwd_blocks as bblk

__all__ = ["fwd_accepts", "fwd_gpu", "fwd_accepts_partial", "fwd_gpu_partial", "fwd_torch",
           "bwd_accepts", "bwd_gpu", "bwd_torch", "dbias_accepts", "dbias_gpu", "dbias_torch"]


def _att():
    return get_primitive("attention")


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


def fwd_accepts(outs, ins, params) -> bool:
    """attention's launcher takes the operands and the output, the lse is float32."""
    low = _att().lowering()
    return len(outs) == 2 and _lse_out(outs[1]) and ins[0].shape[-1] > 0 and \
        (low.accepts is None or low.accepts(outs[:1], ins, params))


def fwd_gpu(fspec, outs, ins, **params):
    """attention's (o, lse) launcher (its lowering's ``partial`` with two outputs: the
    attention over the block's keys, which are all the keys its rows see here)."""
    _att().lowering().partial(fspec, list(outs), ins, **params)


def fwd_accepts_partial(outs, ins, params) -> bool:
    low = _att().lowering()
    return len(outs) == 2 and _lse_out(outs[1]) and ins[0].shape[-1] > 0 and \
        (low.accepts_partial is None or low.accepts_partial(outs[:1], ins, params))


def fwd_gpu_partial(fspec, outs, ins, **params):
    """A key-split block: attention's (o, lse) pairs, and the lse partial read off them."""
    pairs, lse = outs
    _att().lowering().partial(fspec, [pairs], ins, **params)
    lse.copy_(pairs[..., 0, 1])


def fwd_torch(fspec, *ins, partial=False, **params):
    """attention's torch fallback as pairs: (o, lse), or (pairs, lse) for a key split."""
    (pairs,) = _att().lowering().fallback(fspec, *ins, partial=True, **params)
    lse = pairs[..., 0, 1]
    if params.get("rows"):   # the capacity form: 0, not -inf, at the rows it does not compute
        lse = lse_outside_rows(lse, ins[-1], fspec.inputs[0].lo[-2] if fspec else 0)
    return (pairs, lse) if partial else (pairs[..., 0], lse)


def bwd_accepts(outs, ins, params) -> bool:
    """The Triton backward takes float16/bfloat16/float32 q, k, v, o, dO and gradients of one
    dtype, a float32 lse (a mask is bool, a bias any of those floats)."""
    import torch  # heavy: only the GPU path
    q, k, v, o, lse, do = ins[:6]
    mask, bias = bblk.extras(ins[6:], bblk.opts(params))
    return len(outs) == 3 and _floats([q, k, v, o, do, *outs]) and _f32(lse) and \
        (mask is None or mask.dtype == torch.bool) and \
        (bias is None or _floats([bias]))


def _capacity(fspec, ins, params):
    """A capacity-form block (attention_bwd's ``rows``: its table row [lo, hi, klo, khi]
    last) as an ordinary one over every row and key, for the torch fallback (which computes
    the whole capacity block: up to p times the cut's work, as the forward's fallback; the
    Triton kernel reads the table instead, :func:`bwd_gpu`): rows outside [lo, hi) get q,
    o, dO = 0 and lse = +inf (P = 0: they add nothing), keys outside [klo, khi) k, v = 0
    (a capacity buffer's other rows may be stale: a weight 0 times a nan is nan), all on
    the device (no host sync: a captured graph replays new tables). -> (fspec, ins,
    params, the rows' and the keys' masks)."""
    import torch  # heavy: only the GPU path
    fspec, (q, k, v, o, lse, do, *extra), params, t = _table(fspec, ins, params)
    qa, ka = _offsets(fspec)
    in_r = in_window(t, qa, q.shape[-2], q.device)
    in_k = in_window(t, ka, k.shape[-2], q.device, col=2)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    q, o, do = (torch.where(in_r[:, None], x, zero.to(x.dtype)) for x in (q, o, do))
    k, v = (torch.where(in_k[:, None], x, zero.to(x.dtype)) for x in (k, v))
    lse = torch.where(in_r, lse, torch.full((), float("inf"), dtype=lse.dtype,
                                            device=lse.device))
    return fspec, (q, k, v, o, lse, do, *extra), params, in_r, in_k


def _table(fspec, ins, params):
    """A capacity-form block's (``rows``: its table row last) operands, function
    specification and params as an ordinary block's, and the table row apart (None where
    the block is an ordinary one). -> (fspec, ins, params, table)."""
    if not params.get("rows"):
        return fspec, ins, params, None
    *ins, table = ins
    if fspec is not None:
        fspec = FunctionSpec(fspec.inputs[:-1], fspec.outputs)
    return fspec, ins, dict(params, rows=False), table


def _bias_box(out, bias, kind, fspec, mask):
    """Where a block's bias gradient (of ``bias``'s shape) goes in its output box ``out``:
    an additive bias's at the block's rows and keys inside the box (the rest zeroed here),
    ALiBi slopes' the whole box (the slopes block's, maybe shaped otherwise). Without a
    function specification the box is the bias's own (a mismatch is the launcher's
    error)."""
    if tuple(out.shape) == tuple(bias.shape):
        return out
    if kind != "add":
        return out.view(bias.shape)
    if fspec is None:
        return out
    box, inbox = fspec.outputs[0], fspec.inputs[6 + (mask is not None)]
    r, c = inbox.lo[-2] - box.lo[-2], inbox.lo[-1] - box.lo[-1]
    out.zero_()
    return out[..., r:r + bias.shape[-2], c:c + bias.shape[-1]]


def bwd_gpu(fspec, outs, ins, **params):
    """The Triton backward (eins/kernels/attention_bwd.py) on the block at its global offsets
    (a query row's key position: its row plus the eqn's offset); each gradient written at
    its rows inside its output box, zeros elsewhere (a ⊕ partial). A capacity-form block
    (``rows``: its table row last) hands the kernel its table row: it computes only this
    call's rows and the keys they see, the work of the cut's block, and writes zeros at
    every other row and key (its whole blocks are its output boxes)."""
    fspec, ins, params, table = _table(fspec, ins, params)
    p = bblk.opts(params)
    q, k = ins[0], ins[1]
    qa, ka = _offsets(fspec)
    views = []
    for out, x, j in zip(outs, (q, k, k), range(3)):
        at = 0 if fspec is None else (fspec.inputs[0 if j == 0 else 1].lo[-2]
                                      - fspec.outputs[j].lo[-2])
        if out.shape[-2] != x.shape[-2]:
            out.zero_()
        views.append(out[..., at:at + x.shape[-2], :])
    mask, bias = bblk.extras(ins[6:], p)
    flash_attention_bwd(*ins[:6], *views, causal=p["causal"], segments=_segments(ins, p),
                        scale=p["scale"], q_offset=qa + p["offset"], k_offset=ka,
                        window=p["window"], softcap=p["softcap"], mask=mask,
                        mask_kind=p["mask"], bias=bias, bias_kind=p["bias"], rows=table)


def dbias_accepts(outs, ins, params) -> bool:
    """The Triton bias gradient takes what the Triton backward does (:func:`bwd_accepts`:
    q, k, v, o, dO of one float16/bfloat16/float32 dtype, a float32 lse, a bool mask, a
    bias of one of those floats) and a gradient of one of those floats."""
    import torch  # heavy: only the GPU path
    q, k, v, o, lse, do = ins[:6]
    mask, bias = bblk.extras(ins[6:], bblk.opts(params))
    return len(outs) == 1 and bias is not None and _floats([q, k, v, o, do]) and \
        _f32(lse) and _floats([bias]) and _floats(outs) and \
        (mask is None or mask.dtype == torch.bool)


def dbias_gpu(fspec, outs, ins, **params):
    """The Triton bias gradient (eins/kernels/attention_dbias.py) on the block at its global
    offsets: an additive bias's gradient written at the block's rows and keys inside its
    output box (zeros elsewhere), ALiBi slopes' in the box (the same shape). A
    capacity-form block (``rows``: its table row last) hands the kernel its table row: it
    computes only this call's rows and the keys they see, the cut block's work, an
    additive bias's gradient 0 at every other row."""
    fspec, ins, params, table = _table(fspec, ins, params)
    p = bblk.opts(params)
    qa, ka = _offsets(fspec)
    mask, bias = bblk.extras(ins[6:], p)
    view = _bias_box(outs[0], bias, p["bias"], fspec, mask)
    flash_attention_dbias(*ins[:6], bias, view, bias_kind=p["bias"], causal=p["causal"],
                          segments=_segments(ins, p), scale=p["scale"],
                          q_offset=qa + p["offset"], k_offset=ka, window=p["window"],
                          softcap=p["softcap"], mask=mask, mask_kind=p["mask"], rows=table)


def _segments(ins, p):
    """The runtime ends tensor where the eqn takes one (after the mask and the bias: the
    kernels read it on the device, so one lowered block serves every batch cut alike),
    else the static tuple."""
    at = bblk.ends_at(p, 6, len(ins))
    return p["segments"] if at is None else ins[at]


def _extras(p, mask, bias, hkv, ct, segments, qa, lq, ka, lk, device):
    """The block's grouped mask and bias (bblk.grouped_extras) in ``ct``, runtime ends
    folded into the mask (each row's and key's segment searched on the device: one span
    masked by equal segments). -> (the extras, the static segments the spans walk)."""
    ex = bblk.grouped_extras(p, mask, bias, hkv, lambda x: x.to(ct))
    if hasattr(segments, "shape"):
        same = same_segment(segments, qa, lq, ka, lk, device)
        ex["mask"] = same if "mask" not in ex else ex["mask"] & same
        segments = ()
    return ex, segments


def _grouped(fspec, p, ct, q, k, v, o, lse, do):
    """What both torch fallbacks of the backward start from: the block's global offsets
    and lengths, the span ``s`` its positions lie in, the batch dims, kv heads, group size,
    head dim and scale, and q, o, dO, lse grouped as [..., Hkv, G, L, .] in compute dtype
    ``ct`` (k and v with a group axis of 1 to broadcast)."""
    qa, ka = _offsets(fspec)
    lq, lk = q.shape[-2], k.shape[-2]
    s = max(qa + lq, ka + lk, *(bblk.static_segments(p) or (0,)))
    *batch, hq, _, d = q.shape
    hkv, dv = k.shape[-3], v.shape[-1]
    g = hq // hkv if hkv else 0
    qf = q.to(ct).reshape(*batch, hkv, g, lq, d)
    of, dof = (t.to(ct).reshape(*batch, hkv, g, lq, dv) for t in (o, do))
    lf = lse.to(ct).reshape(*batch, hkv, g, lq, 1)
    kf, vf = k.to(ct).unsqueeze(-3), v.to(ct).unsqueeze(-3)   # broadcast over the group
    return (qa, ka, lq, lk, s, batch, hkv, g, d, bblk.scale_of(p["scale"], d),
            (qf, of, dof, lf, kf, vf))

def bwd_torch(fspec, q, k, v, o, lse, do, *extra, **params):
    """The torch fallback: :func:`eins.ops.attention_bwd_blocks.bwd_block` in torch, per
    packed segment, in float32 (float64 stays), each gradient placed in its output box
    (a capacity-form block: :func:`_capacity`)."""
    import torch  # heavy: only the GPU path
    if params.get("rows"):
        fspec, ins, params, in_r, in_k = _capacity(fspec, (q, k, v, o, lse, do, *extra),
                                                   params)
        res = bwd_torch(fspec, *ins, **params)
        return tuple(torch.where(keep[:, None], g, 0) for g, keep in zip(res, (in_r, in_k,
                                                                                in_k)))
    p = bblk.opts(params)
    if fspec is None:
        fspec = FunctionSpec(tuple(Box.full(tuple(t.shape)) for t in (q, k, v, o, lse, do)),
                             tuple(Box.full(tuple(t.shape)) for t in (q, k, v)))
    off, cap = p["offset"], p["softcap"]
    segments = _segments((q, k, v, o, lse, do, *extra), p)
    ct = compute_type(q, k, v, o, do)
    qa, ka, lq, lk, s, batch, hkv, g, d, sc, (qf, of, dof, lf, kf, vf) = _grouped(
        fspec, p, ct, q, k, v, o, lse, do)
    mask, bias = bblk.extras(extra, p)
    ex, segments = _extras(p, mask, bias, hkv, ct, segments, qa, lq, ka, lk, q.device)
    dq = torch.zeros(qf.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    delta = (dof * of).sum(-1, keepdim=True)
    left, right = bblk.band(p["causal"], p["window"])
    for a, b, c, e in bblk.spans(qa, qa + lq, ka, ka + lk, segments, s, off, left,
                                right):
        rq, rk = slice(a - qa, b - qa), slice(c - ka, e - ka)
        ks, vs = kf[..., rk, :], vf[..., rk, :]
        pr, t, _ = _probs(qf[..., rq, :], ks, lf[..., rq, :], a + off, c, sc, left, right,
                          cap, ex, (a - qa, b - qa, c - ka, e - ka))
        dv[..., rk, :] += (pr.transpose(-1, -2) @ dof[..., rq, :]).sum(-3)
        ds = pr * (dof[..., rq, :] @ vs.transpose(-1, -2) - delta[..., rq, :])
        if t is not None:
            ds = ds * (1 - t * t)
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


def _probs(qs, ks, lrow, pa, c, sc, left, right, cap, ex, at):
    """:func:`eins.ops.attention_bwd_blocks.probs` in torch: P of query rows at key
    positions ``[pa, pa + L)`` (lse ``lrow`` [..., L, 1]) against keys ``[c, c + M)`` (k
    broadcast over the group), the tanh of the cap and the distances j - p; ``ex`` the
    grouped extras, ``at`` the rows and keys of this piece inside their blocks."""
    import torch  # heavy: only the GPU path
    dev = qs.device
    raw = (qs @ ks.transpose(-1, -2)) * sc
    t = None if cap is None else torch.tanh(raw / cap)
    sco = raw if cap is None else cap * t
    dist = torch.arange(c, c + ks.shape[-2], device=dev)[None, :] - \
        torch.arange(pa, pa + qs.shape[-2], device=dev)[:, None]   # j - p
    if "slopes" in ex:
        sco = sco - ex["slopes"] * dist.abs().to(sco.dtype)
    if "bias" in ex:
        sco = sco + bblk.cut(ex["bias"], *at)
    seen = torch.isfinite(lrow)
    if left is not None:
        seen = seen & (dist >= -left)
    if right is not None:
        seen = seen & (dist <= right)
    if "mask" in ex:
        seen = seen & bblk.cut(ex["mask"], *at)
    shift = torch.where(torch.isfinite(lrow), lrow, torch.zeros_like(lrow))
    return torch.where(seen, torch.exp(sco - shift), torch.zeros_like(sco)), t, dist


def dbias_torch(fspec, q, k, v, o, lse, do, *extra, **params):
    """attention_dbias's torch fallback: :func:`eins.ops.attention_bwd_blocks.dbias_block`
    in torch, tile by tile, in float32 (float64 stays); the gradient placed in its output
    box (zeros for the pairs the block does not read). Runtime ends are read as
    :func:`bwd_torch` reads them (a same-segment mask searched on the device). A
    capacity-form block (:func:`_capacity`) computes its whole capacity block with the
    rows and keys outside its cut zeroed (they add exactly 0: up to p times the cut's
    work, as :func:`bwd_torch`'s), an additive bias's gradient 0 at those rows."""
    import torch  # heavy: only the GPU path
    if params.get("rows"):
        fspec, ins, params, in_r, _ = _capacity(fspec, (q, k, v, o, lse, do, *extra),
                                                params)
        (out,) = dbias_torch(fspec, *ins, **params)
        if bblk.opts(params)["bias"] == "add":   # its rows: the block's q rows, whole
            out = torch.where(in_r[:, None], out, torch.zeros((), dtype=out.dtype,
                                                                 device=out.device))
        return (out,)
    p = bblk.opts(params)
    mask, bias = bblk.extras(extra, p)
    if fspec is None:
        ins = (q, k, v, o, lse, do, *extra)
        fspec = FunctionSpec(tuple(Box.full(tuple(t.shape)) for t in ins),
                             (Box.full(tuple(bias.shape)),))
    off, segments = p["offset"], _segments((q, k, v, o, lse, do, *extra), p)
    ct = compute_type(q, k, v, o, do, bias)
    qa, ka, lq, lk, s, batch, hkv, g, d, sc, (qf, of, dof, lf, kf, vf) = _grouped(
        fspec, p, ct, q, k, v, o, lse, do)
    ex, segments = _extras(p, mask, bias, hkv, ct, segments, qa, lq, ka, lk, q.device)
    target = ex["slopes"] if "slopes" in ex else ex["bias"]
    grad = torch.zeros(target.shape, dtype=ct, device=q.device)
    delta = (dof * of).sum(-1, keepdim=True)
    left, right = bblk.band(p["causal"], p["window"])
    for ta, tb in bblk.tiles(qa, qa + lq, bblk.DBIAS_TILE):
        for tc, te in bblk.tiles(ka, ka + lk, bblk.DBIAS_TILE):
            for a, b, c, e in bblk.spans(ta, tb, tc, te, segments, s, off, left, right):
                at = (a - qa, b - qa, c - ka, e - ka)
                rq, rk = slice(at[0], at[1]), slice(at[2], at[3])
                pr, _, dist = _probs(qf[..., rq, :], kf[..., rk, :], lf[..., rq, :], a + off,
                                     c, sc, left, right, p["softcap"], ex, at)
                ds = pr * (dof[..., rq, :] @ vf[..., rk, :].transpose(-1, -2)
                           - delta[..., rq, :])
                if "slopes" in ex:
                    grad -= _reduce_to((ds * dist.abs().to(ct)).sum((-2, -1), keepdim=True),
                                       grad.shape)
                else:
                    view = bblk.cut(grad, *at)
                    view += _reduce_to(ds, view.shape)
    out = torch.zeros(fspec.outputs[0].shape, dtype=ct, device=q.device)
    _bias_box(out, bias, p["bias"], fspec, mask).copy_(grad.reshape(bias.shape))
    return (out,)


def _reduce_to(x, shape):
    """attention_bwd_blocks.reduce_to for a torch tensor."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return x.sum(axes, keepdim=True) if axes else x
