"""Torch lowerings of the non-elementwise primitives for the GPU runtime, and dtype/array
conversions between numpy, torch and CuPy.

Each lowering takes ``(fspec, *blocks, **params)`` like ``Primitive.run_block`` and returns
a tuple of tensors; the runtime copies them into the preallocated output buffers (casting to
the eqn's dtype). Every op here is a torch library call, so it is capturable in
``torch.cuda.graph`` (cuBLAS matmuls and SDPA included). Matmuls and einsums run in the
operands' own dtype: float16/bfloat16 go to tensor cores with float32 accumulation, with no
upcast copies. Norms, rope and softmax compute in float32 as the reference kernels do
(rms_norm and rope have fused Triton kernels, registered in their op files, which the
runtime prefers where they apply).

A primitive with a registered GPU lowering (eins.ir.primitive.gpu_lowering, the
GPU-kernels issue's launchers next to each reference kernel) uses that where it applies
(:func:`launcher`); the table below is the fallback. Key-split attention blocks (outputs
held as (o, lse) pairs) go to the lowering's ``partial`` launcher, the Triton kernel, for
float16/bfloat16/float32; only float64 attention (no Triton kernel) takes
``lower_attention(..., partial=True)``.
"""
from __future__ import annotations

import math

import numpy as np

from eins.errors import DTypeError, GpuError


def torch_dtype(dt):
    """The torch dtype of a numpy dtype: the kernels' name-based map
    (``eins.kernels.build.torch_dtype``), so the runtime and the Triton launchers
    cannot disagree."""
    from eins.kernels.build import torch_dtype as by_name
    try:
        return by_name(np.dtype(dt))
    except DTypeError as e:
        raise GpuError(f"dtype {np.dtype(dt)} has no torch equivalent on the GPU runtime") from e


def numpy_dtype(tdt):
    """The numpy dtype of a torch dtype (the kernels' map; bfloat16 is ml_dtypes'). A dtype
    eins does not compute in (torch.int16, uint8, complex64, float8, ...) is the DTypeError
    a numpy array of it gets, naming the supported dtypes (it said "torch dtype torch.int16
    has no numpy equivalent", which int16 has, and named none)."""
    from eins.kernels.build import numpy_dtype as by_name
    from eins.ir.types import SUPPORTED_NAMES
    try:
        return by_name(tdt)
    except DTypeError:
        raise DTypeError(f"unsupported torch dtype {tdt}; supported: "
                         f"{SUPPORTED_NAMES}: cast it first, e.g. "
                         f"x.to(torch.float32)") from None


def from_numpy(a):
    """A numpy array as a CPU tensor, sharing memory (bfloat16 through an int16 view)."""
    import torch
    a = np.asarray(a)
    if a.dtype == np.dtype(_bf16()):
        # np.ascontiguousarray makes a 0-d array 1-d: keep the shape
        bits = np.ascontiguousarray(a).view(np.int16).reshape(a.shape)
        return torch.from_numpy(bits).view(torch.bfloat16)
    if not a.flags.writeable:  # torch warns on read-only memory; we never write inputs
        a = a.copy()
    return torch.from_numpy(a)


def to_numpy(t):
    from eins.ir.types import torch_to_numpy
    return torch_to_numpy(t)


def triton_acc_dtype(tdt):
    """The Triton dtype ⊕ accumulates in over blocks of torch dtype ``tdt``: the kernel
    library's one rule (:func:`eins.kernels.build.acc_dtype_name`)."""
    import triton.language as tl
    from eins.kernels.build import acc_dtype_name, dtype_name, tl_dtype
    return getattr(tl, tl_dtype(acc_dtype_name(dtype_name(tdt)))[len("tl."):])


def _bf16():
    from eins.ir.types import bfloat16
    return bfloat16


# ----------------------------------------------------------------------------- lowerings
def _ct(*xs):
    """The dtype a lowering computes in: eins's rule for the eqn's float result (the
    operands' promoted dtype, a float function's result of it, float16 and bfloat16 computed
    in float32; eins.ops._common). Ints promote to float64, as numpy's softmax of int32 is
    float64: float32 here rounded 100000001 to 1e8."""
    from eins.ir.types import result_dtype
    from eins.ir.rules import compute_dtype, float_dtype
    return torch_dtype(compute_dtype(float_dtype(result_dtype(
        *(numpy_dtype(x.dtype) for x in xs)))))


def _common(*xs):
    """The operands in their common dtype by eins's rule (numpy's, eins.ir.types.result_dtype),
    the eqn's dtype: torch.promote_types differs (int32 with float16 is float16 there, float64
    in numpy), which computed a float64 result in float16."""
    from eins.ir.types import result_dtype
    dt = torch_dtype(result_dtype(*(numpy_dtype(x.dtype) for x in xs)))
    return [x if x.dtype == dt else x.to(dt) for x in xs]


def lower_matmul(fspec, a, b, c=None):
    """``a @ b``; ``c``: a residual the generated walk fused in (eins/codegen/gpu_walk.py),
    added after the product is rounded to its dtype, as the two eqns do unfused."""
    import torch
    a, b = _common(a, b)
    if a.dtype == torch.bool:
        from eins.ops._common import bool_contraction
        r = bool_contraction(torch.matmul, a, b)
    elif not a.dtype.is_floating_point:   # no integer GEMM on CUDA: exact float64 limbs
        from eins.ops.linalg import int_contraction
        r = int_contraction(torch.matmul, a, b, terms=a.shape[-1]).to(a.dtype)
    else:
        r = a.matmul(b)   # cuBLAS on the GPU: fp16/bf16 on tensor cores, fp32 accumulation
    return (r,) if c is None else (r + c.to(r.dtype),)


def lower_einsum(fspec, *xs, subscripts):
    """``torch.einsum`` in the operands' common dtype: the fallback the runtime takes with
    its kernel launchers off (eins/runtime/gpu.py ``Runtime.kernels``); einsum's registered
    lowering (eins/ops/linalg.py) is used otherwise."""
    import torch
    xs = _common(*xs)
    from eins.ops._common import bool_contraction
    from eins.ops.linalg import einsum_operands, int_einsum
    if xs[0].dtype == torch.bool:
        return (bool_contraction(lambda *ts: torch.einsum(subscripts, *ts), *xs),)
    if not xs[0].dtype.is_floating_point:
        return (int_einsum(subscripts, *xs).to(xs[0].dtype),)
    dt = xs[0].dtype
    return (torch.einsum(subscripts, *einsum_operands(subscripts, xs, dt)).to(dt),)


def lower_reshape(fspec, x, *, shape):
    return (x.reshape(fspec.outputs[0].shape),)  # the block's shape, not the whole's


def lower_transpose(fspec, x, *, axes):
    return (x.permute(tuple(axes)),)  # axes=() for a 0-d value: permute(*()) raises


def lower_slice(fspec, x, *, start, limit):
    ib, ob = fspec.inputs[0], fspec.outputs[0]
    return (x[tuple(slice(lo + s - il, hi + s - il)
                    for lo, hi, s, il in zip(ob.lo, ob.hi, start, ib.lo))],)


def lower_concatenate(fspec, *xs, axis):
    import torch
    return (torch.cat(_common(*xs), dim=axis),)


def lower_rms_norm(fspec, x, weight, *, eps):
    import torch
    ct = _ct(x, weight)
    xf = x.to(ct)
    inv = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (weight.to(ct) * (xf * inv),)


def lower_layer_norm(fspec, x, weight, bias, *, eps):
    import torch
    ct = _ct(x, weight, bias)
    xf = x.to(ct)
    c = xf - xf.mean(dim=-1, keepdim=True)
    y = c * torch.rsqrt(c.square().mean(dim=-1, keepdim=True) + eps)
    return (y * weight.to(ct) + bias.to(ct),)


def lower_rope(fspec, x, cos, sin):
    import torch
    ct = _ct(x, cos, sin)
    xf = x.to(ct)
    h = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
    return (xf * cos.to(ct) + rot * sin.to(ct),)


def lower_softmax(fspec, x, *, axis):
    return (x.to(_ct(x)).softmax(dim=axis),)


def _reduce(name, x, axis, keepdims, count=None):
    import torch
    # mean's result (eins.mean, numpy's): float64 for ints and bools, else the float's
    mt = _ct(x) if x.is_floating_point() else torch.float64
    if not axis:   # torch reads dim=() as "every dim"; numpy as "none"
        return (x.to(mt) / count if name == "mean" else x,)
    if name in ("sum", "mean"):
        ct = _ct(x) if x.is_floating_point() else torch.int64
        s = x.to(ct).sum(dim=axis, keepdim=keepdims)
        # int64 / count would be torch's default float32
        return (s.to(mt) / count if name == "mean" else s,)
    f = torch.amax if name == "max" else torch.amin
    return (f(x, dim=axis, keepdim=keepdims),)


def lower_sum(fspec, x, *, axis, keepdims, count=None):
    return _reduce("sum", x, axis, keepdims)


def lower_mean(fspec, x, *, axis, keepdims, count=None):
    return _reduce("mean", x, axis, keepdims, count)


def lower_max(fspec, x, *, axis, keepdims, count=None):
    return _reduce("max", x, axis, keepdims)


def lower_min(fspec, x, *, axis, keepdims, count=None):
    return _reduce("min", x, axis, keepdims)


def lower_attention(fspec, q, k, v, *, causal, segments, scale, partial=False):
    """A block of query rows ``[qa, qb)`` with key rows ``[ka, kb)`` (global positions from
    ``fspec``; eins/ops/attention_blocks.attend_block in torch): grouped-query attention per
    packed segment, in float32 (float64 stays), rows that see no key giving o = 0 and
    lse = -inf. ``partial``: a key-split block, returned as (o, lse) pairs along a trailing
    axis of 2 (the lse ⊕'s layout), lse repeated over the head dim as the reference does."""
    import torch
    qa, ka = fspec.inputs[0].lo[-2], fspec.inputs[1].lo[-2]
    lq, lk = q.shape[-2], k.shape[-2]
    s = segments[-1] if segments else max(qa + lq, ka + lk)
    d = q.shape[-1]
    ct = _ct(q, k, v)
    sc = 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)
    *batch, hq, _, _ = q.shape
    hkv = k.shape[-3]
    g = hq // hkv if hkv else 0
    qf = q.to(ct).reshape(*batch, hkv, g, lq, d)
    kf, vf = k.to(ct).unsqueeze(-3), v.to(ct).unsqueeze(-3)   # broadcast over the group
    out = torch.zeros(qf.shape, dtype=ct, device=q.device)
    lse = torch.full(qf.shape[:-1], float("-inf"), dtype=ct, device=q.device)
    start = 0
    for end in (tuple(segments) if segments else (s,)):
        a, b, c, e = max(qa, start), min(qa + lq, end), max(ka, start), min(ka + lk, end)
        if causal:
            e = min(e, b)   # keys after the block's last query are never seen
        start = end
        if b <= a or e <= c:
            continue
        scores = (qf[..., a - qa:b - qa, :] @ kf[..., c - ka:e - ka, :].transpose(-1, -2)) * sc
        if causal:
            seen = torch.arange(c, e, device=q.device)[None, :] <= \
                torch.arange(a, b, device=q.device)[:, None]
            scores = scores.masked_fill(~seen, float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m)
        den = p.sum(dim=-1, keepdim=True)
        safe = torch.where(den > 0, den, torch.ones_like(den))
        # den == 0: the row sees no key, 0 even where a value is inf (0 * inf = nan)
        out[..., a - qa:b - qa, :] = torch.where(den == 0, torch.zeros_like(den),
                                                 (p / safe) @ vf[..., c - ka:e - ka, :])
        # den == 0: no visible key; a nan den (nan scores) keeps a nan lse
        lse[..., a - qa:b - qa] = torch.where(den == 0, torch.full_like(m, float("-inf")),
                                              m + torch.log(den))[..., 0]
    o = out.reshape(q.shape)
    if not partial:
        return (o,)
    return (torch.stack([o, lse.reshape(q.shape[:-1]).unsqueeze(-1).expand(q.shape)], -1),)


_CHECKED = ("matmul", "attention", "rms_norm", "rope")


def launcher(prim, fspec, outs, args, params, attention="auto"):
    """A thunk running the primitive's registered GPU lowering (eins/ops/*: the GPU-kernels
    issue's launchers, registered next to each reference kernel) that writes straight into
    the eqn's output buffers (no temporary, no copy), or None where it does not apply; the
    torch lowering above is used then. For the launchers this runtime knows (matmul via
    ``torch.matmul(out=)``, cuBLAS, capturable; attention, rms_norm, rope in Triton) only
    float16/bfloat16/float32 operands of one dtype go to them.

    ``params["partial"]``: a key-split block whose output is a buffer of (o, lse) pairs (a
    trailing axis of 2, float32): the lowering's ``partial`` launcher (attention: the Triton
    kernel writing the pairs with the block's global offsets) for float16/bfloat16/float32
    operands of one dtype; float64 attention has no Triton kernel, partial or whole, and
    keeps the torch lowering. ``attention``: the whole-attention kernel's ``impl``
    (eins.ir.plan.Options.attention; eins/kernels/attention.py choose_impl)."""
    import torch
    from eins.ir.primitive import gpu_lowering
    low = gpu_lowering(prim)
    if low is None:
        return None
    params = dict(params)
    partial = params.pop("partial", False)
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if partial:
        fn = low.partial
        ts = list(args)
        if fn is None or len(outs) != 1 or outs[0].dtype != torch.float32 or \
                outs[0].dim() == 0 or outs[0].shape[-1] != 2 or \
                any(getattr(t, "dtype", None) not in floats for t in ts) or \
                any(t.dtype != ts[0].dtype for t in ts):
            return None
        return lambda: fn(fspec, outs, args, **params)
    if prim in _CHECKED:
        ts = list(args) + list(outs)
        if len(outs) != 1 or any(getattr(t, "dtype", None) not in floats for t in ts) or \
                any(t.dtype != outs[0].dtype for t in ts):
            if prim == "attention" and attention != "auto":
                # a forced kernel is a promise: never swap in the S x S torch lowering
                from eins.kernels.build import KernelUnavailable
                got = sorted({str(getattr(t, "dtype", type(t).__name__)) for t in ts})
                raise KernelUnavailable(
                    f"attention={attention!r}: no such kernel for operands {got} (it takes "
                    f"float16, bfloat16 or float32 operands of one dtype); "
                    f"attention='auto' runs the torch lowering there")
            return None
        if prim == "matmul" and min(a.dim() for a in args) < 2:
            return None
    if prim == "attention":
        params["impl"] = attention
    fn = low.fn
    return lambda: fn(fspec, outs, args, **params)


LOWERINGS = {name[6:]: fn for name, fn in list(globals().items()) if name.startswith("lower_")}


def lowering(prim: str):
    """The torch lowering of primitive ``prim`` (the fallback of :func:`launcher`); a
    GpuError naming the primitive when there is none."""
    if prim not in LOWERINGS:
        raise GpuError(f"the GPU runtime has no lowering of primitive {prim!r} yet; add "
                       f"lower_{prim} to eins/runtime/gpu_ops.py")
    return LOWERINGS[prim]
