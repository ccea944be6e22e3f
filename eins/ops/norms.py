"""Normalizations: ``rms_norm`` and ``layer_norm``, each one primitive over the last dimension.

Everything about each primitive sits together: shape/dtype rule, numpy kernel (statistics in
at least float32, as GPU kernels do), flops, and indexing (Section 3.3): the leading dims are
shardable ``any``; the normalized (last) dim is not, since its statistics need the whole row
(splitting it would need a two-pass ⊕, which no aggregation of Section 3 expresses); the
weight and bias are indexed by the last dim only, so every block gets them whole.
"""
from __future__ import annotations

import numpy as np

from eins.errors import ShapeError
from eins.ir.joinagg import signature_indexing
from eins.ir.primitive import GpuLowering, Primitive, register
from eins.kernels.norms import rms_norm as rms_kernel
from eins.kernels.torch_rules import compute_type, one_float_dtype
from eins.ir.types import TensorType, result_dtype
from eins.ops._common import (LEAD_NAMES, composite_vjp, compute_dtype, float_result, ops,
                              static_real, user_errors)
from eins.tracing import bind

__all__ = ["rms_norm", "layer_norm"]


def _check_params(op, x: TensorType, params: tuple[tuple[str, TensorType], ...]):
    if x.ndim < 1:
        raise ShapeError(f"{op}: x must have at least one dimension, got shape {x.shape}")
    d = x.shape[-1]
    for name, t in params:
        if t.shape != (d,):
            raise ShapeError(f"{op}: {name} must have shape ({d},) (x's last dim), got "
                             f"{t.shape} with x of shape {x.shape}")


def _norm_sig(ndim: int, nparams: int) -> str:
    x = LEAD_NAMES[:ndim - 1] + "z"
    return ",".join([x] + ["z"] * nparams) + "->" + x


def _norm_indexing(ins, outs, **params):
    sig = _norm_sig(ins[0].ndim, len(ins) - 1)
    shardable = {c: "any" for c in LEAD_NAMES[:ins[0].ndim - 1]}
    return signature_indexing(sig, [t.shape for t in ins], [t.shape for t in outs], shardable)


# ----------------------------------------------------------------------------- rms_norm
def _rms_abstract(x: TensorType, weight: TensorType, *, eps):
    _check_params("rms_norm", x, (("weight", weight),))
    return (TensorType(x.shape, float_result("rms_norm", x, weight)),)


def _rms_impl(x, weight, *, eps):
    out = result_dtype(x.dtype, weight.dtype)
    if x.shape[-1] == 0:  # nothing to normalize (and no mean of an empty row)
        return (np.empty(x.shape, out),)
    ct = compute_dtype(out)
    xf = np.asarray(x).astype(ct, copy=False)
    inv = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + ct.type(eps))
    return ((np.asarray(weight).astype(ct, copy=False) * (xf * inv)).astype(out, copy=False),)


def _rms_flops(ins, outs, **params):
    return 4 * ins[0].size  # square, sum, scale by 1/rms, scale by weight


def _norm_accumulation(ins, outs, **params):
    """one reduction over the normalized (last) axis"""
    return 1, ins[0].shape[-1]


def _rms_gpu(fspec, outs, ins, *, eps):
    """GPU lowering: the Triton rms_norm kernel (eins/kernels/norms.py)."""
    rms_kernel(ins[0], ins[1], outs[0], eps=eps)


def _rms_torch(fspec, x, weight, *, eps):
    import torch  # heavy: only the GPU path
    ct = compute_type(x, weight)
    xf = x.to(ct)
    inv = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (weight.to(ct) * (xf * inv),)


# ----------------------------------------------------------------------------- backward
# Each norm's backward is two primitives: dx, whose rows need only their own row (the
# forward's indexing), and the weight's cotangent, a sum over rows (rows contracted, ⊕ =
# sum): two eqns where the same math in elementwise operators and reductions is twenty.
def _stats(x, ct, eps, centered):
    """(normalized rows, 1/rms) of ``x`` in compute dtype ``ct`` (the forward's)."""
    xf = np.asarray(x).astype(ct, copy=False)
    if centered:
        xf = xf - np.mean(xf, axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + ct.type(eps))
    return xf * r, r


def _dx_impl(centered):
    def impl(x, w, g, *, eps):
        out = result_dtype(x.dtype, w.dtype, g.dtype)
        ct = compute_dtype(out)
        if x.shape[-1] == 0:
            return (np.empty(x.shape, out),)
        xhat, r = _stats(x, ct, eps, centered)
        gw = np.asarray(g).astype(ct, copy=False) * np.asarray(w).astype(ct, copy=False)
        dx = gw - xhat * np.mean(gw * xhat, axis=-1, keepdims=True)
        if centered:
            dx = dx - np.mean(gw, axis=-1, keepdims=True)
        return ((r * dx).astype(out, copy=False),)
    return impl


def _dw_impl(centered):
    def impl(x, g, *, eps):
        out = result_dtype(x.dtype, g.dtype)
        ct = compute_dtype(out)
        xhat, _ = _stats(x, ct, eps, centered)
        lead = tuple(range(x.ndim - 1))
        return (np.sum(np.asarray(g).astype(ct, copy=False) * xhat, axis=lead)
                .astype(out, copy=False),)
    return impl


def _dx_abstract(op):
    def abstract(x: TensorType, w: TensorType, g: TensorType, *, eps):
        _check_params(op, x, (("weight", w),))
        if g.shape != x.shape:
            raise ShapeError(f"{op}: cotangent of shape {g.shape} for x of shape {x.shape}")
        return (TensorType(x.shape, result_dtype(x.dtype, w.dtype, g.dtype)),)
    return abstract


def _dw_abstract(op):
    def abstract(x: TensorType, g: TensorType, *, eps):
        if x.ndim < 1 or g.shape != x.shape:
            raise ShapeError(f"{op}: cotangent of shape {g.shape} for x of shape {x.shape}")
        return (TensorType(x.shape[-1:], result_dtype(x.dtype, g.dtype)),)
    return abstract


def _dx_indexing(ins, outs, **params):
    x = LEAD_NAMES[:ins[0].ndim - 1] + "z"
    return signature_indexing(f"{x},z,{x}->{x}", [t.shape for t in ins],
                              [t.shape for t in outs], {c: "any" for c in x[:-1]})


def _dw_indexing(ins, outs, **params):
    lead = LEAD_NAMES[:ins[0].ndim - 1]
    sig = f"{lead}z,{lead}z->z | sum({lead})" if lead else "z,z->z"
    return signature_indexing(sig, [t.shape for t in ins], [t.shape for t in outs],
                              {c: "any" for c in lead})


def _torch_stats(x, ct, eps, centered):
    import torch  # heavy: only the GPU path
    xf = x.to(ct)
    if centered:
        xf = xf - xf.mean(dim=-1, keepdim=True)
    r = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return xf * r, r


def _dx_torch(centered):
    def fallback(fspec, x, w, g, *, eps):
        ct = compute_type(x, w, g)
        xhat, r = _torch_stats(x, ct, eps, centered)
        gw = g.to(ct) * w.to(ct)
        dx = gw - xhat * (gw * xhat).mean(dim=-1, keepdim=True)
        if centered:
            dx = dx - gw.mean(dim=-1, keepdim=True)
        return (r * dx,)
    return fallback


def _dw_torch(centered):
    def fallback(fspec, x, g, *, eps):
        ct = compute_type(x, g)
        xhat, _ = _torch_stats(x, ct, eps, centered)
        return ((g.to(ct) * xhat).sum(dim=tuple(range(x.dim() - 1))),)
    return fallback


def _composite_stats(x, eps, centered):
    o = ops()
    x = o.astype(x, compute_dtype(x.dtype))
    if centered:
        x = x - o.mean(x, axis=-1, keepdims=True)
    r = o.rsqrt(o.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r, r


def _composite_dx(centered):
    """dx with the ordinary operators (what the dx primitive computes): differentiated for a
    second derivative."""
    def dx(x, w, g, *, eps):
        o = ops()
        xhat, r = _composite_stats(x, eps, centered)
        gw = g * w
        d = gw - xhat * o.mean(gw * xhat, axis=-1, keepdims=True)
        if centered:
            d = d - o.mean(gw, axis=-1, keepdims=True)
        return r * d
    return dx


def _composite_dw(centered):
    def dw(x, g, *, eps):
        xhat, _ = _composite_stats(x, eps, centered)
        return ops().sum(g * xhat, axis=tuple(range(len(x.shape) - 1)))
    return dw


for _op, _centered in (("rms_norm", False), ("layer_norm", True)):
    register(Primitive(
        f"{_op}_dx", _dx_abstract(f"{_op}_dx"), _dx_impl(_centered),
        lambda i, o, **p: 8 * i[0].size, _dx_indexing, accumulation=_norm_accumulation,
        lowerings={None: GpuLowering(fallback=_dx_torch(_centered))},
        vjp=composite_vjp(_composite_dx(_centered)),
        samples=lambda arr, op=_op: [(f"{op}_dx", lambda x, w, g: bind(
            f"{op}_dx", x, w, g, eps=1e-5), (arr(2, 6, 5), arr(5), arr(2, 6, 5)))]))
    register(Primitive(
        f"{_op}_dw", _dw_abstract(f"{_op}_dw"), _dw_impl(_centered),
        lambda i, o, **p: 6 * i[0].size, _dw_indexing, accumulation=_norm_accumulation,
        lowerings={None: GpuLowering(fallback=_dw_torch(_centered))},
        vjp=composite_vjp(_composite_dw(_centered)),
        samples=lambda arr, op=_op: [(f"{op}_dw", lambda x, g: bind(
            f"{op}_dw", x, g, eps=1e-5), (arr(8, 6, 5), arr(8, 6, 5)))]))


def _rms_vjp(cts, ins, outs, needs, *, eps):
    x, w = ins
    return (bind("rms_norm_dx", x, w, cts[0], eps=eps) if needs[0] else None,
            bind("rms_norm_dw", x, cts[0], eps=eps) if needs[1] else None)


register(Primitive(
    "rms_norm", _rms_abstract, _rms_impl, _rms_flops, _norm_indexing, kernel_class="norm",
    accumulation=_norm_accumulation, vjp=_rms_vjp,
    lowerings={None: GpuLowering(_rms_gpu, accepts=lambda o, i, p: one_float_dtype(o, i),
                                 takes="float16, bfloat16 or float32 operands of one dtype",
                                 fallback=_rms_torch, template="triton_rms_norm.py.j2")},
    samples=lambda arr: [
        ("rms_norm 3d", lambda x, w: rms_norm(x, w), (arr(2, 6, 5), arr(5))),
        ("rms_norm f16", lambda x, w: rms_norm(x, w), (arr(8, 4, dtype="float16"),
                                                       arr(4, dtype="float16")))]))


@user_errors
def rms_norm(x, weight, eps=1e-6):
    """``weight * x / sqrt(mean(x*x, -1) + eps)`` over the last dim, computed in at least
    float32; the result has x's dtype promoted with weight's."""
    return bind("rms_norm", x, weight, eps=static_real("rms_norm", "eps", eps, minimum=0))


# ----------------------------------------------------------------------------- layer_norm
def _ln_abstract(x: TensorType, weight: TensorType, bias: TensorType, *, eps):
    _check_params("layer_norm", x, (("weight", weight), ("bias", bias)))
    return (TensorType(x.shape, float_result("layer_norm", x, weight, bias)),)


def _ln_impl(x, weight, bias, *, eps):
    out = result_dtype(x.dtype, weight.dtype, bias.dtype)
    if x.shape[-1] == 0:
        return (np.empty(x.shape, out),)
    ct = compute_dtype(out)
    xf = np.asarray(x).astype(ct, copy=False)
    centered = xf - np.mean(xf, axis=-1, keepdims=True)
    var = np.mean(centered * centered, axis=-1, keepdims=True)
    y = centered / np.sqrt(var + ct.type(eps))
    w, b = (np.asarray(t).astype(ct, copy=False) for t in (weight, bias))
    return ((y * w + b).astype(out, copy=False),)


def _ln_flops(ins, outs, **params):
    return 8 * ins[0].size  # mean, center, square, sum, normalize, weight, bias


def _ln_torch(fspec, x, weight, bias, *, eps):
    import torch  # heavy: only the GPU path
    ct = compute_type(x, weight, bias)
    xf = x.to(ct)
    c = xf - xf.mean(dim=-1, keepdim=True)
    y = c * torch.rsqrt(c.square().mean(dim=-1, keepdim=True) + eps)
    return (y * weight.to(ct) + bias.to(ct),)


def _ln_vjp(cts, ins, outs, needs, *, eps):
    x, w, _ = ins
    g = cts[0]
    lead = tuple(range(len(g.shape) - 1))
    return (bind("layer_norm_dx", x, w, g, eps=eps) if needs[0] else None,
            bind("layer_norm_dw", x, g, eps=eps) if needs[1] else None,
            ops().sum(g, axis=lead) if needs[2] else None)


register(Primitive(
    "layer_norm", _ln_abstract, _ln_impl, _ln_flops, _norm_indexing, kernel_class="norm",
    accumulation=_norm_accumulation, lowerings={None: GpuLowering(fallback=_ln_torch)},
    vjp=_ln_vjp,
    samples=lambda arr: [("layer_norm", lambda x, w, b: layer_norm(x, w, b),
                          (arr(7, 6), arr(6), arr(6)))]))


@user_errors
def layer_norm(x, weight, bias, eps=1e-5):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (biased variance),
    computed in at least float32; the result has the operands' promoted dtype."""
    return bind("layer_norm", x, weight, bias,
                eps=static_real("layer_norm", "eps", eps, minimum=0))
