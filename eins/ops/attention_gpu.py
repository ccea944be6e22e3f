"""The GPU side of the attention primitive (eins/ops/attention.py): its lowering onto the
flash-attention launchers of eins/kernels/attention.py (whole blocks and key-split (o, lse)
pairs), the torch fallback where no launcher applies, and the check of a forced kernel
choice. The eqn's parameters are read through ``attention.Opts``'s defaults here too
(``_opts``), and positions are global: a block's query and key offsets come from its
function specification, so a block masks exactly as the whole would."""
from __future__ import annotations

import math

from eins.errors import GpuError
from eins.kernels import build, sdpa
from eins.kernels.attention import attention as flash_attention
from eins.kernels.attention import (attention_pairs, in_window, lse_outside_rows,
                                    options_why_not, same_segment)
from eins.kernels.torch_rules import compute_type
from eins.ops import attention_blocks as blk

__all__ = ["attention_gpu", "attention_gpu_partial", "attention_torch", "check_plan",
           "lse_join", "accepts", "accepts_partial", "TAKES"]

TAKES = ("float16, bfloat16 or float32 q, k, v of one dtype (a bool mask, a float bias), "
         "one output of that dtype")

_DEFAULTS = dict(causal=True, segments=None, scale=None, window=None, softcap=None,
                 mask=None, bias=None, offset=0, rows=False)


def _opts(params):
    return {n: params.get(n, v) for n, v in _DEFAULTS.items()}


def _extras(ins, p):
    rest = list(ins[3:])
    mask = rest.pop(0) if p["mask"] else None
    bias = rest.pop(0) if p["bias"] else None
    return mask, bias


def _segments(ins, p):
    """The runtime ends tensor where the eqn takes one (the operand after the mask and the
    bias; the launcher reads it on the device, so a captured graph replays new ends), else
    the static tuple."""
    n = 3 + bool(p["mask"]) + bool(p["bias"])
    return ins[n] if len(ins) > n else p["segments"]


def _rows(ins, p):
    """The capacity form's row table block (global query rows [lo, hi) this block computes
    this call: eins/ops/attention.py ``capacity_form``), a device tensor, or None."""
    return ins[4 + bool(p["mask"]) + bool(p["bias"])] if p["rows"] else None


def _floats():
    import torch  # heavy: only the GPU path
    return (torch.float16, torch.bfloat16, torch.float32)


def _qkv_ok(ins, params) -> bool:
    p = _opts(params)
    q, k, v = ins[:3]
    mask, bias = _extras(ins, p)
    import torch  # heavy: only the GPU path
    return (all(getattr(t, "dtype", None) in _floats() for t in (q, k, v))
            and q.dtype == k.dtype == v.dtype
            and (mask is None or mask.dtype == torch.bool)
            and (bias is None or bias.dtype in _floats()))


def accepts(outs, ins, params) -> bool:
    """The launcher takes float16/bfloat16/float32 q, k, v of one dtype and an output of it
    (a mask is bool, a bias any of those floats)."""
    return len(outs) == 1 and _qkv_ok(ins, params) and outs[0].dtype == ins[0].dtype


def accepts_partial(outs, ins, params) -> bool:
    """A key-split block's (o, lse) pairs: one float32 output with a trailing axis of 2."""
    import torch  # heavy: only the GPU path
    return len(outs) == 1 and outs[0].dtype == torch.float32 and outs[0].dim() > 0 and \
        outs[0].shape[-1] == 2 and _qkv_ok(ins, params)


def _kw(fspec, ins, params):
    p = _opts(params)
    mask, bias = _extras(ins, p)
    q_off = fspec.inputs[0].lo[-2] if fspec is not None else 0
    k_off = fspec.inputs[1].lo[-2] if fspec is not None else 0
    return dict(causal=p["causal"], segments=_segments(ins, p), scale=p["scale"],
                q_offset=q_off + p["offset"], k_offset=k_off, window=p["window"],
                softcap=p["softcap"], mask=mask, mask_kind=p["mask"], bias=bias,
                bias_kind=p["bias"], rows=_rows(ins, p))


def attention_gpu(fspec, outs, ins, impl="auto", measured=None, **params):
    """GPU lowering: the flash-attention launcher (eins/kernels/attention.py: the Triton
    kernel, or a library kernel where ``impl`` picks one that computes this block exactly,
    the fastest by the ``measured`` table where one is given) on the block. The launcher's
    ``q_offset`` is the query rows' key position (the block's first row plus the eqn's
    ``offset``). ``running``: a pipelined piece's running (o, lse) pairs, which the Triton
    kernel starts from (as a key-split block, whatever ``impl`` says: no library kernel
    takes them)."""
    running = params.get("running")
    flash_attention(*ins[:3], outs[0], impl="triton" if running is not None else impl,
                    measured=measured, running=running, **_kw(fspec, ins, params))


def attention_gpu_partial(fspec, outs, ins, **params):
    """GPU lowering of a key-split block (⊕ = lse), the Triton flash-attention kernel with the
    block's global query/key offsets. ``outs`` is either the device IR's pair buffer alone,
    ``[pairs]`` float32 ``[..., Hq, Sq, Dv, 2]`` (eins.ir.joinagg.lse_pair_dtype as a
    trailing axis: what the GPU runtime and the rank kernel sets hold; the generated lse ⊕
    kernel combines them), or ``(o, lse)``: o of the output's shape in q's dtype or float32,
    lse float32 ``[..., Hq, Sq]``, which ``eins.kernels.combine_lse`` combines.
    ``running``: a pipelined piece's running pairs, joined into ``[pairs]``."""
    kw = _kw(fspec, ins, params)
    rows = kw.pop("rows")
    if params.get("running") is not None and (rows is not None or len(outs) != 1):
        raise GpuError("attention: running pairs join into a pair buffer alone (a pipelined "
                       "piece), not into (o, lse) outputs nor with a row table")
    if rows is not None and len(outs) == 2:   # attention_fwd's capacity form: (o, lse)
        flash_attention(*ins[:3], outs[0], lse=outs[1], impl="triton", rows=rows, **kw)
        outs[1].copy_(lse_outside_rows(outs[1], rows, fspec.inputs[0].lo[-2] if fspec else 0))
        return
    if rows is not None:
        raise GpuError("attention: the capacity form (rows=True) has no key-split partial")
    if len(outs) == 1:
        attention_pairs(*ins[:3], outs[0], running=params.get("running"), **kw)
        return
    o, lse = outs
    flash_attention(*ins[:3], o, lse=lse, impl="triton", **kw)


def _heads(x, hkv):
    """A full mask or bias block [..., h, Lq, Lk] against grouped scores [..., Hkv, G, Lq,
    Lk] (h = 1 broadcasts)."""
    h = x.shape[-3]
    return x.reshape(*x.shape[:-3], *((hkv, h // hkv) if h > 1 else (1, 1)), *x.shape[-2:])



def attention_torch(fspec, *ins, partial=False, running=None, **params):
    """The torch fallback: a block of query rows ``[qa, qb)`` with key rows ``[ka, kb)``
    (global positions from ``fspec``; eins/ops/attention_blocks.attend_block in torch):
    grouped-query attention per packed segment, in float32 (float64 stays), rows that see no
    key giving o = 0 and lse = -inf. ``partial``: a key-split block, returned as (o, lse)
    pairs along a trailing axis of 2 (the lse ⊕'s layout), lse repeated over the value head
    dim as the reference does. ``running``: a pipelined piece's running pairs (that layout),
    joined with the block's partial before it is returned or finalized."""
    import torch  # heavy: only the GPU path
    p = _opts(params)
    q, k, v = ins[:3]
    mask, bias = _extras(ins, p)
    qa, ka = fspec.inputs[0].lo[-2], fspec.inputs[1].lo[-2]
    lq, lk = q.shape[-2], k.shape[-2]
    segments, off = _segments(ins, p), p["offset"]
    same = None
    if hasattr(segments, "shape"):
        # runtime ends: each row's and each key's segment found on the device (no host
        # sync, so a captured CUDA graph replays new ends), one span masked by equal segments
        same = same_segment(segments, qa, lq, ka, lk, q.device)
        segments = ()
        rows = _rows(ins, p)
        if rows is not None:   # the capacity form: rows outside [lo, hi) see no key (0)
            same = same & in_window(rows, qa, lq, q.device)[:, None]
    s = segments[-1] if segments else max(qa + lq, ka + lk)
    d, dv = q.shape[-1], v.shape[-1]
    ct = compute_type(q, k, v)
    sc = 1.0 / math.sqrt(max(d, 1)) if p["scale"] is None else float(p["scale"])
    *batch, hq, _, _ = q.shape
    hkv = k.shape[-3]
    g = hq // hkv if hkv else 0
    qf = q.to(ct).reshape(*batch, hkv, g, lq, d)
    kf, vf = k.to(ct).unsqueeze(-3), v.to(ct).unsqueeze(-3)   # broadcast over the group
    left, right = blk.band(p["causal"], p["window"])
    if p["rows"]:   # keys no computed row sees may be stale (capacity buffers): zeros, as
        # a weight 0 times a nan is nan; a key of a row's segment past its causal or window
        # band is not seen either
        seen = same
        dist = torch.arange(ka, ka + lk, device=q.device)[None, :] - \
            torch.arange(qa + off, qa + lq + off, device=q.device)[:, None]
        if left is not None:
            seen = seen & (dist >= -left)
        if right is not None:
            seen = seen & (dist <= right)
        seen = seen.any(0)[:, None]
        kf, vf = torch.where(seen, kf, 0), torch.where(seen, vf, 0)
    m_all = b_all = slopes = None
    if p["mask"] == "keys":
        m_all = mask[..., None, None, None, :]
    elif p["mask"] == "full":
        m_all = _heads(mask, hkv)
    if p["bias"] == "alibi":
        slopes = bias.to(ct).reshape(*bias.shape[:-1], hkv, bias.shape[-1] // hkv, 1, 1)
    elif p["bias"] == "add":
        b_all = _heads(bias.to(ct), hkv)
    out = torch.zeros((*qf.shape[:-1], dv), dtype=ct, device=q.device)
    lse = torch.full(qf.shape[:-1], float("-inf"), dtype=ct, device=q.device)
    for a, b, c, e in blk.spans(qa, qa + lq, ka, ka + lk, segments, s, off, left,
                                right):
        scores = (qf[..., a - qa:b - qa, :] @ kf[..., c - ka:e - ka, :].transpose(-1, -2)) * sc
        if p["softcap"] is not None:
            scores = p["softcap"] * torch.tanh(scores / p["softcap"])
        dist = torch.arange(c, e, device=q.device)[None, :] - \
            torch.arange(a + off, b + off, device=q.device)[:, None]   # j - p
        if slopes is not None:
            scores = scores - slopes * dist.abs().to(ct)
        if b_all is not None:
            scores = scores + blk.cut(b_all, a - qa, b - qa, c - ka, e - ka)
        seen = torch.ones(dist.shape, dtype=torch.bool, device=q.device)
        if left is not None:
            seen = seen & (dist >= -left)
        if right is not None:
            seen = seen & (dist <= right)
        if m_all is not None:
            seen = seen & blk.cut(m_all, a - qa, b - qa, c - ka, e - ka)
        if same is not None:
            seen = seen & same[a - qa:b - qa, c - ka:e - ka]
        scores = scores.masked_fill(~seen, float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        pr = torch.exp(scores - m)
        den = pr.sum(dim=-1, keepdim=True)
        safe = torch.where(den > 0, den, torch.ones_like(den))
        # den == 0: the row sees no key, 0 even where a value is inf (0 * inf = nan)
        out[..., a - qa:b - qa, :] = torch.where(den == 0, torch.zeros_like(den),
                                                 (pr / safe) @ vf[..., c - ka:e - ka, :])
        # den == 0: no visible key; a nan den (nan scores) keeps a nan lse
        lse[..., a - qa:b - qa] = torch.where(den == 0, torch.full_like(m, float("-inf")),
                                              m + torch.log(den))[..., 0]
    shape = (*q.shape[:-1], dv)
    o, lse = out.reshape(shape), lse.reshape(shape[:-1])
    if running is not None:
        o, lse = lse_join(o, lse, running[..., 0].to(ct), running[..., 0, 1].to(ct))
    if not partial:
        return (o,)
    return (torch.stack([o, lse.unsqueeze(-1).expand(shape)], -1),)


def lse_join(o1, l1, o2, l2):
    """(o1, l1) ⊕ (o2, l2), the lse ⊕ of two partials over disjoint keys, in torch as
    eins.ir.joinagg's reference computes it: rows neither saw stay (0, -inf), a nan lse
    stays nan."""
    import torch  # heavy: only the GPU path
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    w = w1 + w2
    none = w == 0
    safe = torch.where(none, torch.ones_like(w), w)
    o = (o1 * (w1 / safe)[..., None] + o2 * (w2 / safe)[..., None])
    return (torch.where(none[..., None], torch.zeros_like(o), o),
            torch.where(none, torch.full_like(m, float("-inf")), m + torch.log(safe)))


def check_plan(fspec, in_dtypes, out_dtypes, params, choice):
    """With ``choice="sdpa"`` or ``"cudnn"``, a whole block must be one SDPA computes exactly
    (eins/kernels/sdpa.py ``why_not``, whose checks read shapes, dtypes and offsets only;
    eins/kernels/attention.py ``options_why_not`` for the options SDPA does not take):
    checked when the program is loaded. Key-split partials always run Triton, and
    flash-attn's checks need the tensors' device, so they stay at call time."""
    if choice not in ("sdpa", "cudnn"):
        return None
    import torch  # heavy: only the GPU path
    p = _opts(params)
    q, k, v = (torch.empty(b.shape, dtype=build.torch_dtype(dt), device="meta")
               for b, dt in zip(fspec.inputs[:3], in_dtypes[:3]))
    out = torch.empty(fspec.outputs[0].shape, device="meta",
                      dtype=build.torch_dtype(out_dtypes[0]))
    why = options_why_not(q, v, window=p["window"], softcap=p["softcap"],
                          mask_kind=p["mask"], bias_kind=p["bias"])
    if why is None:
        if p["segments"] == "array":
            return ("one SDPA does not compute exactly: segments as data (the Triton kernel "
                    "reads them)")
        why = sdpa.why_not(q, k, out, causal=p["causal"], segments=p["segments"], lse=None,
                           q_offset=fspec.inputs[0].lo[-2] + p["offset"],
                           k_offset=fspec.inputs[1].lo[-2])
    return None if why is None else f"one SDPA does not compute exactly: {why}"
