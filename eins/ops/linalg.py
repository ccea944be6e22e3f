"""Linear algebra: matmul (numpy semantics with batch broadcasting) and einsum.

Everything about each primitive sits together: shape rule, numpy kernel, flops, indexing.
"""
from __future__ import annotations

import numpy as np

from eins.errors import ShapeError
from eins.ir.joinagg import signature_indexing
from eins.ir.types import TensorType, result_dtype
from eins.ops.registry import Primitive, register
from eins.tracing import bind

__all__ = ["matmul"]

_LETTERS = "abcdefgh"  # batch index names; i, j, k are the matrix indices


def _matmul_sig(a_shape, b_shape):
    """Signature of a >=2-D matmul: batch dims broadcast numpy-style; a size-1 batch dim
    against a larger one is '_' (not indexed)."""
    nb = max(len(a_shape), len(b_shape)) - 2
    a_b = (1,) * (nb - (len(a_shape) - 2)) + tuple(a_shape[:-2])
    b_b = (1,) * (nb - (len(b_shape) - 2)) + tuple(b_shape[:-2])
    a_sub, b_sub, o_sub, o_batch = "", "", "", []
    for d, (x, y) in enumerate(zip(a_b, b_b)):
        c = _LETTERS[d]
        n = max(x, y)
        o_sub += c
        o_batch.append(n)
        if d >= nb - (len(a_shape) - 2):
            a_sub += c if x == n else "_"
        if d >= nb - (len(b_shape) - 2):
            b_sub += c if y == n else "_"
    return f"{a_sub}ij,{b_sub}jk->{o_sub}ik | sum(j)", tuple(o_batch)


def _matmul_abstract(a: TensorType, b: TensorType):
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError(f"matmul: operands must be at least 2-D after promotion, got shapes "
                         f"{a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: contracted dimensions differ: {a.shape} @ {b.shape} "
                         f"({a.shape[-1]} != {b.shape[-2]})")
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ShapeError(f"matmul: batch dimensions of {a.shape} and {b.shape} do not "
                         f"broadcast") from None
    return (TensorType(tuple(batch) + (a.shape[-2], b.shape[-1]), result_dtype(a.dtype, b.dtype)),)


def _matmul_impl(a, b):
    out_dtype = result_dtype(a.dtype, b.dtype)
    if out_dtype.itemsize < 4:  # accumulate low precision in float32, as GPU kernels do
        return (np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(out_dtype),)
    return (np.matmul(a, b),)


def _matmul_flops(ins, outs):
    return 2 * outs[0].size * ins[0].shape[-1]


def _matmul_indexing(ins, outs):
    sig, _ = _matmul_sig(ins[0].shape, ins[1].shape)
    return signature_indexing(sig, [t.shape for t in ins], [t.shape for t in outs])


register(Primitive("matmul", _matmul_abstract, _matmul_impl, _matmul_flops, _matmul_indexing))


def matmul(a, b):
    """numpy's matmul: 1-D operands are promoted to matrices and the added axis removed."""
    from eins import ops
    a_vec = len(a.shape) == 1
    b_vec = len(b.shape) == 1
    if a_vec:
        a = ops.reshape(a, (1,) + tuple(a.shape))
    if b_vec:
        b = ops.reshape(b, tuple(b.shape) + (1,))
    out = bind("matmul", a, b)
    if a_vec and b_vec:
        return ops.reshape(out, tuple(out.shape[:-2]))
    if a_vec:
        return ops.reshape(out, tuple(out.shape[:-2]) + (out.shape[-1],))
    if b_vec:
        return ops.reshape(out, tuple(out.shape[:-1]))
    return out
