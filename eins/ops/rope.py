"""Rotary position embedding (the LLaMA/HF form) as one primitive:
``rope(x, cos, sin) = x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])``.

cos and sin broadcast against x (e.g. x ``[B, H, S, D]``, cos/sin ``[S, D]``). Indexing
(Section 3.3): the last dim D is not shardable, because rotate_half pairs element i with
element i ± D/2; every other dim of x is shardable ``any``. cos and sin carry the indices of
the dims they have, and ``_`` (unindexed, kept whole) where they broadcast with size 1.
"""
from __future__ import annotations

import numpy as np

from eins.errors import ShapeError
from eins.ir.joinagg import signature_indexing
from eins.ir.primitive import GpuLowering, Primitive, Strided, register
from eins.kernels.norms import rope as rope_kernel
from eins.kernels.torch_rules import compute_type, one_float_dtype
from eins.ir.types import TensorType, result_dtype
from eins.ops._common import (LEAD_NAMES, broadcast_shape, compute_dtype, float_result, ops,
                              unbroadcast, user_errors)
from eins.tracing import bind

__all__ = ["rope"]


def _rope_abstract(x: TensorType, cos: TensorType, sin: TensorType):
    if x.ndim < 1:
        raise ShapeError(f"rope: x must have at least one dimension, got shape {x.shape}")
    d = x.shape[-1]
    if d % 2:
        raise ShapeError(f"rope: the last dim of x must be even to rotate halves, got D={d} "
                         f"(x shape {x.shape})")
    for name, t in (("cos", cos), ("sin", sin)):
        if broadcast_shape(x.shape, t.shape) != tuple(x.shape):
            raise ShapeError(f"rope: {name} of shape {t.shape} does not broadcast against x of "
                             f"shape {x.shape} (the result must keep x's shape)")
    return (TensorType(x.shape, float_result("rope", x, cos, sin)),)


def _rope_impl(x, cos, sin):
    out = result_dtype(x.dtype, cos.dtype, sin.dtype)
    ct = compute_dtype(out)
    xf = np.asarray(x).astype(ct, copy=False)
    h = xf.shape[-1] // 2
    rotated = np.concatenate([-xf[..., h:], xf[..., :h]], axis=-1)
    c, s = (np.asarray(t).astype(ct, copy=False) for t in (cos, sin))
    return ((xf * c + rotated * s).astype(out, copy=False),)


def _rope_flops(ins, outs):
    return 3 * outs[0].size  # two multiplies and an add per element (the negation is free)


def _rope_sig(x_shape, cs_shape) -> str:
    n = len(x_shape)
    xs = LEAD_NAMES[:n - 1] + "z"
    off = n - len(cs_shape)
    cs = "".join(xs[off + i] if s == x_shape[off + i] else "_" for i, s in enumerate(cs_shape))
    return cs


def _rope_indexing(ins, outs):
    x, cos, sin = ins
    xs = LEAD_NAMES[:x.ndim - 1] + "z"
    sig = f"{xs},{_rope_sig(x.shape, cos.shape)},{_rope_sig(x.shape, sin.shape)}->{xs}"
    return signature_indexing(sig, [t.shape for t in ins], [t.shape for t in outs],
                              {c: "any" for c in LEAD_NAMES[:x.ndim - 1]})


def _rope_gpu(fspec, outs, ins):
    """GPU lowering: the Triton rope kernel (eins/kernels/norms.py); x and out may be
    strided views, so a q/k layout change fuses into it."""
    rope_kernel(*ins, outs[0])


def _rope_torch(fspec, x, cos, sin):
    import torch  # heavy: only the GPU path
    ct = compute_type(x, cos, sin)
    xf = x.to(ct)
    h = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
    return (xf * cos.to(ct) + rot * sin.to(ct),)


def _rotate_half(u):
    h = u.shape[-1] // 2
    return ops().concatenate([-u[..., h:], u[..., :h]], axis=-1)


def _rope_vjp(cts, ins, outs, needs):
    """rotate_half is a rotation R with R^T = -R: dx = g*cos - R(g*sin), which is one rope
    of g with ``-swap_halves(sin)`` for sin (a table the backward of every rope reading
    the same sin shares)."""
    o = ops()
    x, cos, sin = ins
    g = cts[0]
    dx = dcos = dsin = None
    if needs[0]:
        if hasattr(sin, "shape") and sin.shape and sin.shape[-1] > 1:
            h = sin.shape[-1] // 2
            back = o.concatenate([-sin[..., h:], -sin[..., :h]], axis=-1)
        else:
            back = -sin
        dx = bind("rope", g, cos, back)
    if needs[1] or needs[2]:
        ct = compute_dtype(outs[0].dtype)
        xf, gf = o.astype(x, ct), o.astype(g, ct)
        dcos = unbroadcast(gf * xf, cos.shape) if needs[1] else None
        dsin = unbroadcast(gf * _rotate_half(xf), sin.shape) if needs[2] else None
    return dx, dcos, dsin


register(Primitive(
    "rope", _rope_abstract, _rope_impl, _rope_flops, _rope_indexing, kernel_class="rope",
    vjp=_rope_vjp,
    # the Triton kernel reads any strided x (eins/kernels/norms.py)
    strided=Strided(operands=(0,), unit_last=False),
    lowerings={None: GpuLowering(_rope_gpu, accepts=lambda o, i, p: one_float_dtype(o, i),
                                 takes="float16, bfloat16 or float32 operands of one dtype",
                                 fallback=_rope_torch, template="triton_rope.py.j2")},
    samples=lambda arr: [
        ("rope bhsd/sd", lambda x, c, s: rope(x, c, s), (arr(2, 3, 8, 4), arr(8, 4),
                                                          arr(8, 4))),
        ("rope broadcast 1", lambda x, c, s: rope(x, c, s), (arr(6, 4, 8), arr(6, 1, 8),
                                                              arr(6, 1, 8)))]))


@user_errors
def rope(x, cos, sin):
    """Rotary embedding ``x * cos + rotate_half(x) * sin`` (computed in at least float32; the
    result has the operands' promoted dtype)."""
    return bind("rope", x, cos, sin)
