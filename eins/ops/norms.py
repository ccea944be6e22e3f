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
from eins.ops._common import (LEAD_NAMES, compute_dtype, float_result, ops, static_real,
                              user_errors)
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


def _in_compute(outs, *ts):
    """The operands in the kernel's compute dtype (at least float32, as the forward)."""
    ct = compute_dtype(outs[0].dtype)
    return [ops().astype(t, ct) for t in ts]


def _lead_sum(t):
    """Summed over every dim but the last: a weight's cotangent from the rows'."""
    return ops().sum(t, axis=tuple(range(len(t.shape) - 1)))


def _rms_vjp(cts, ins, outs, needs, *, eps):
    o = ops()
    x, w, g = _in_compute(outs, ins[0], ins[1], cts[0])
    r = o.rsqrt(o.mean(x * x, axis=-1, keepdims=True) + eps)
    dx = dw = None
    if needs[0]:
        gw = g * w
        dx = r * gw - x * (r * r * r) * o.mean(gw * x, axis=-1, keepdims=True)
    if needs[1]:
        dw = _lead_sum(g * x * r)
    return dx, dw


register(Primitive(
    "rms_norm", _rms_abstract, _rms_impl, _rms_flops, _norm_indexing,
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
    o = ops()
    x, w, g = _in_compute(outs, ins[0], ins[1], cts[0])
    c = x - o.mean(x, axis=-1, keepdims=True)
    r = o.rsqrt(o.mean(c * c, axis=-1, keepdims=True) + eps)
    xhat = c * r
    dx = None
    if needs[0]:
        gw = g * w
        dx = r * (gw - o.mean(gw, axis=-1, keepdims=True)
                  - xhat * o.mean(gw * xhat, axis=-1, keepdims=True))
    return (dx, _lead_sum(g * xhat) if needs[1] else None,
            _lead_sum(g) if needs[2] else None)


register(Primitive(
    "layer_norm", _ln_abstract, _ln_impl, _ln_flops, _norm_indexing,
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
