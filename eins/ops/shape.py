"""Shape operators: reshape, transpose, concatenate, static slice (and ``getitem``, which is
traced as slice + reshape).

Each primitive maps intervals between its input and output coordinates (Section 3.3):

- ``transpose`` permutes the indices (an einsum-like signature such as ``"abc->cab"``).
- ``reshape`` groups input and output dimensions into the smallest runs whose sizes multiply
  to the same number. A one-to-one group is one shardable index. A group of several input
  dims that merge into one output dim (or one input dim that splits into several output
  dims) is one index over its *leading* dim of the finer side: an interval ``[a, b)`` of the
  leading dim maps to ``[a*T, b*T)`` of the merged dim (``T`` the product of the trailing
  dims, which stay whole). Many-to-many groups (e.g. ``(6, 4) -> (4, 6)``) and size-1 dims
  are not indexed (kept whole).
- ``concatenate``: the concat axis is not shardable; every other axis is.
- ``slice``: every output dim is shardable; an output interval ``[a, b)`` reads the input
  interval ``[a + start, b + start)``, and the block kernel (``block_impl``) uses the global
  boxes of its function specification to cut its block, so the offset is handled.
"""
from __future__ import annotations

import builtins
import math
import operator

import numpy as np

from eins.errors import ShapeError, TraceError
from eins.ir.joinagg import affine_indexing, signature_indexing
from eins.ir.types import TensorType, result_dtype
from eins.ir.primitive import GpuLowering, Layout, Primitive, register
from eins.kernels.torch_rules import common
from eins.ops._common import index_name, is_static_sequence, user_errors
from eins.tracing import Tracer, bind, not_an_array

__all__ = ["reshape", "transpose", "concatenate", "slice", "getitem"]

def _static_ints(xs, what, op):
    if isinstance(xs, Tracer):
        raise TraceError(f"{op}: {what} must be static Python ints, got a traced array "
                         f"({xs._var.type!r})")
    if not is_static_sequence(xs):
        raise ShapeError(f"{op}: {what} must be a tuple of ints, got {xs!r}")
    out = []
    for x in xs:
        if isinstance(x, Tracer):
            raise TraceError(f"{op}: {what} must be static Python ints, got a traced array "
                             f"({x._var.type!r}) in {what} {tuple(xs)!r}")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise ShapeError(f"{op}: {what} must be ints, got {x!r}") from None
    return tuple(out)


def _array(x, op):
    """``x`` if it is an array (traced or concrete), else the error every other op gives."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise not_an_array(op, x)
    return x


# ----------------------------------------------------------------------------- reshape
def _resolve_shape(in_shape, shape):
    shape = tuple(shape)
    size = math.prod(in_shape)
    if builtins.sum(1 for s in shape if s == -1) > 1:
        raise ShapeError(f"reshape: at most one -1 allowed in new shape {shape}")
    if any(s < -1 for s in shape):
        raise ShapeError(f"reshape: negative dimension in new shape {shape}")
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        if rest == 0 or size % rest:
            raise ShapeError(f"reshape: cannot reshape {tuple(in_shape)} (size {size}) into "
                             f"{shape}")
        shape = tuple(size // rest if s == -1 else s for s in shape)
    if math.prod(shape) != size:
        raise ShapeError(f"reshape: cannot reshape {tuple(in_shape)} (size {size}) into {shape}")
    return shape


def _reshape_abstract(x: TensorType, *, shape):
    return (TensorType(_resolve_shape(x.shape, shape), x.dtype),)


def _reshape_impl(x, *, shape):
    return (np.reshape(x, shape),)


def _reshape_groups(a, b):
    """Pair runs of non-1 dims of shapes ``a`` and ``b`` with equal products:
    [(in_dims, out_dims), ...]. Size-1 dims belong to no group."""
    ia = [d for d, n in enumerate(a) if n != 1]
    ib = [d for d, n in enumerate(b) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(ia) and j < len(ib):
        gi, gj = [ia[i]], [ib[j]]
        pa, pb = a[ia[i]], b[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(ia[i])
                pa *= a[ia[i]]
                i += 1
            else:
                gj.append(ib[j])
                pb *= b[ib[j]]
                j += 1
        groups.append((gi, gj))
    return groups


def _reshape_indexing(ins, outs, *, shape):
    a, b = ins[0].shape, outs[0].shape
    in_map = [None] * len(a)
    out_map = [None] * len(b)
    extents = {}
    if 0 not in a:  # an empty tensor is never split
        for g, (gi, gj) in enumerate(_reshape_groups(a, b)):
            name = index_name(g)
            if len(gi) == 1 and len(gj) == 1:
                extents[name] = a[gi[0]]
                in_map[gi[0]] = (name, 1, 0)
                out_map[gj[0]] = (name, 1, 0)
            elif len(gj) == 1:  # merge: shard the leading input dim, trailing ones whole
                extents[name] = a[gi[0]]
                in_map[gi[0]] = (name, 1, 0)
                out_map[gj[0]] = (name, math.prod(a[d] for d in gi[1:]), 0)
            elif len(gi) == 1:  # split: shard the leading output dim
                extents[name] = b[gj[0]]
                out_map[gj[0]] = (name, 1, 0)
                in_map[gi[0]] = (name, math.prod(b[d] for d in gj[1:]), 0)
            # many-to-many: kept whole
    return affine_indexing(extents, {n: "any" for n in extents}, [in_map], [out_map], [a], [b])


def _reshape_block(fspec, x, *, shape):
    return (np.reshape(x, fspec.outputs[0].shape),)


def _shape_src(shape) -> str:
    return repr(tuple(int(n) for n in shape))


register(Primitive(
    "reshape", _reshape_abstract, _reshape_impl, lambda i, o, **p: 0, _reshape_indexing,
    _reshape_block,
    # a torch view of its block (the same as its fallback computes)
    layout=Layout(view=lambda fspec, params: f".reshape({_shape_src(fspec.outputs[0].shape)})",
                  inverse=lambda in_shape, params: ({}, f".view({_shape_src(in_shape)})"),
                  perm=lambda params: None),
    # the block's shape, not the whole's
    lowerings={None: GpuLowering(fallback=lambda fspec, x, *, shape: (
        x.reshape(fspec.outputs[0].shape),))},
    attr_hints=dict.fromkeys(["flatten", "ravel", "squeeze", "unsqueeze", "view", "expand_dims",
                              "contiguous"], "use x.reshape(new_shape)"),
    samples=lambda arr: [
        ("reshape merge", lambda x: reshape(x, (24, 5)), (arr(8, 3, 5),)),
        ("reshape split", lambda x: reshape(x, (4, 2, 6)), (arr(8, 6),)),
        ("reshape heads", lambda x: reshape(x, (6, 4, 2)), (arr(6, 8),))]))


@user_errors
def reshape(x, shape):
    """numpy's reshape (one ``-1`` allowed)."""
    _array(x, "reshape")
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    shape = _static_ints(shape, "shape", "reshape")
    shape = _resolve_shape(tuple(x.shape), shape)
    if shape == tuple(x.shape) and isinstance(x, Tracer):
        return x
    return bind("reshape", x, shape=shape)


# ----------------------------------------------------------------------------- transpose
def _check_perm(ndim, axes):
    if sorted(axes) != list(range(ndim)):
        raise ShapeError(f"transpose: axes {tuple(axes)} are not a permutation of the "
                         f"{ndim} dimensions of the operand")


def _transpose_abstract(x: TensorType, *, axes):
    _check_perm(x.ndim, axes)
    return (TensorType(tuple(x.shape[a] for a in axes), x.dtype),)


def _transpose_impl(x, *, axes):
    return (np.transpose(x, axes),)


def _transpose_indexing(ins, outs, *, axes):
    subs = "".join(index_name(d) for d in range(ins[0].ndim))
    sig = f"{subs}->{''.join(subs[a] for a in axes)}"
    return signature_indexing(sig, [ins[0].shape], [outs[0].shape])


def _transpose_inverse(in_shape, params):
    axes = tuple(int(a) for a in np.argsort(params["axes"]))
    return {"axes": axes}, f".permute{_shape_src(axes)}"


register(Primitive(
    "transpose", _transpose_abstract, _transpose_impl, lambda i, o, **p: 0, _transpose_indexing,
    layout=Layout(view=lambda fspec, params: f".permute{_shape_src(params['axes'])}",
                  inverse=_transpose_inverse, perm=lambda params: tuple(params["axes"])),
    # axes=() for a 0-d value: permute(*()) raises
    lowerings={None: GpuLowering(fallback=lambda fspec, x, *, axes: (
        x.permute(tuple(axes)),))},
    attr_hints={"permute": "use x.transpose(axes)", "t": "use x.T"},
    samples=lambda arr: [("transpose 3d", lambda x: transpose(x, (2, 0, 1)),
                          (arr(4, 6, 3),))]))


@user_errors
def transpose(x, axes=None):
    """numpy's transpose; ``axes=None`` reverses the dimensions."""
    nd = len(_array(x, "transpose").shape)
    if axes is None:
        axes = tuple(range(nd))[::-1]
    axes = _static_ints(axes, "axes", "transpose")
    axes = tuple(a + nd if -nd <= a < 0 else a for a in axes)
    _check_perm(nd, axes)
    return bind("transpose", x, axes=axes)


# ----------------------------------------------------------------------------- concatenate
def _concat_abstract(*xs: TensorType, axis):
    if not xs:
        raise ShapeError("concatenate: needs at least one operand")
    shapes = [x.shape for x in xs]
    nd = xs[0].ndim
    if nd == 0:
        raise ShapeError("concatenate: zero-dimensional operands cannot be concatenated")
    if any(x.ndim != nd for x in xs):
        raise ShapeError(f"concatenate: operands have different ranks: shapes {shapes}")
    if not 0 <= axis < nd:
        raise ShapeError(f"concatenate: axis {axis} out of range for shapes {shapes}")
    for x in xs:
        if any(x.shape[d] != xs[0].shape[d] for d in range(nd) if d != axis):
            raise ShapeError(f"concatenate: shapes {shapes} differ outside axis {axis}")
    out = list(xs[0].shape)
    out[axis] = builtins.sum(x.shape[axis] for x in xs)
    return (TensorType(tuple(out), _promote(*[x.dtype for x in xs])),)


def _promote(*dtypes):
    return result_dtype(*dtypes, op="concatenate")


def _concat_impl(*xs, axis):
    dt = _promote(*[np.asarray(x).dtype for x in xs])
    return (np.concatenate([np.asarray(x, dt) for x in xs], axis=axis),)


def _concat_indexing(ins, outs, *, axis):
    subs = "".join("_" if d == axis else index_name(d) for d in range(outs[0].ndim))
    sig = ",".join([subs] * len(ins)) + "->" + subs
    return signature_indexing(sig, [t.shape for t in ins], [outs[0].shape])


def _concat_torch(fspec, *xs, axis):
    import torch  # heavy: only the GPU path
    return (torch.cat(common(*xs), dim=axis),)


register(Primitive(
    "concatenate", _concat_abstract, _concat_impl, lambda i, o, **p: 0, _concat_indexing,
    lowerings={None: GpuLowering(fallback=_concat_torch)},
    samples=lambda arr: [("concatenate axis 1", lambda a, b: concatenate([a, b], axis=1),
                          (arr(6, 3), arr(6, 5)))]))


@user_errors
def concatenate(xs, axis=0):
    """numpy's concatenate along ``axis`` (the concat axis is never split)."""
    if not isinstance(xs, (tuple, list)):
        raise ShapeError(f"concatenate: operands must be a tuple or list of arrays, got "
                         f"{type(xs).__name__}")
    xs = tuple(_array(x, "concatenate") for x in xs)
    if not xs:
        raise ShapeError("concatenate: needs at least one operand")
    (axis,) = _static_ints((axis,), "axis", "concatenate")
    nd = len(xs[0].shape)
    if -nd <= axis < 0:
        axis += nd
    return bind("concatenate", *xs, axis=axis)


# ----------------------------------------------------------------------------- slice
def _slice_abstract(x: TensorType, *, start, limit):
    if len(start) != x.ndim or len(limit) != x.ndim:
        raise ShapeError(f"slice: start {start} and limit {limit} must have one entry per "
                         f"dimension of shape {x.shape}")
    for s, l, n in zip(start, limit, x.shape):
        if not 0 <= s <= l <= n:
            raise ShapeError(f"slice: start {start} / limit {limit} out of bounds for shape "
                             f"{x.shape}")
    return (TensorType(tuple(l - s for s, l in zip(start, limit)), x.dtype),)


def _slice_impl(x, *, start, limit):
    return (x[tuple(builtins.slice(s, l) for s, l in zip(start, limit))],)


def _slice_indexing(ins, outs, *, start, limit):
    out = outs[0].shape
    names = [index_name(d) for d in range(len(out))]
    extents = {}
    in_map, out_map = [], []
    for d, n in enumerate(out):
        extents[names[d]] = n
        in_map.append((names[d], 1, start[d]))
        out_map.append((names[d], 1, 0))
    if 0 in out:  # an empty output: one whole block
        extents = {}
        in_map = [None] * len(out)
        out_map = [None] * len(out)
    return affine_indexing(extents, {n: "any" for n in extents}, [in_map], [out_map],
                           [ins[0].shape], [out])


def _slice_block(fspec, x, *, start, limit):
    """Cut the output box, shifted by ``start``, out of the input block (global coords)."""
    ib, ob = fspec.inputs[0], fspec.outputs[0]
    idx = tuple(builtins.slice(lo + s - il, hi + s - il)
                for lo, hi, s, il in zip(ob.lo, ob.hi, start, ib.lo))
    return (x[idx],)


def _slice_torch(fspec, x, *, start, limit):
    ib, ob = fspec.inputs[0], fspec.outputs[0]
    return (x[tuple(builtins.slice(lo + s - il, hi + s - il)
                    for lo, hi, s, il in zip(ob.lo, ob.hi, start, ib.lo))],)


register(Primitive(
    "slice", _slice_abstract, _slice_impl, lambda i, o, **p: 0, _slice_indexing, _slice_block,
    lowerings={None: GpuLowering(fallback=_slice_torch)},
    samples=lambda arr: [
        ("slice", lambda x: slice(x, (1, 2), (7, 10)), (arr(8, 12),)),
        ("getitem", lambda x: getitem(x, (builtins.slice(1, 7), 3)), (arr(8, 6),))]))


@user_errors
def _slice(x, start, limit):
    """Static slice ``x[start[0]:limit[0], start[1]:limit[1], ...]`` (step 1)."""
    _array(x, "slice")
    start = _static_ints(start, "start", "slice")
    limit = _static_ints(limit, "limit", "slice")
    return bind("slice", x, start=start, limit=limit)


# ----------------------------------------------------------------------------- getitem
@user_errors
def getitem(x, idx):
    """Basic static indexing: ints, step-1 slices (negative bounds clip as numpy does),
    ``None`` and ``Ellipsis``. Traced as ``slice`` (when anything is cut) then ``reshape``
    (when ints drop dims or None adds them)."""
    _array(x, "getitem")
    start, limit, out_shape = _getitem_plan(tuple(x.shape), idx)
    y = x
    if tuple(start) != (0,) * len(x.shape) or tuple(limit) != tuple(x.shape):
        y = bind("slice", x, start=tuple(start), limit=tuple(limit))
    if tuple(out_shape) != tuple(y.shape):
        y = bind("reshape", y, shape=tuple(out_shape))
    return y


def _getitem_plan(shape, idx):
    """(start, limit, result shape) of a basic static index."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    for it in idx:
        if isinstance(it, (Tracer, np.ndarray, list, bool, np.bool_)) or (
                not isinstance(it, (builtins.slice, type(None), type(Ellipsis)))
                and not isinstance(it, (int, np.integer))):
            raise TraceError(f"getitem: only static ints, slices, None and ... are supported "
                             f"as indices, got {type(it).__name__} in {idx!r:.80}")
    n_ell = builtins.sum(1 for it in idx if it is Ellipsis)
    if n_ell > 1:
        raise ShapeError(f"getitem: an index can only have one ellipsis, got {idx!r}")
    n_real = builtins.sum(1 for it in idx if it is not None and it is not Ellipsis)
    if n_real > len(shape):
        raise ShapeError(f"getitem: too many indices {idx!r} for shape {shape}")
    if n_ell:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (builtins.slice(None),) * (len(shape) - n_real) + idx[k + 1:]
    else:
        idx = idx + (builtins.slice(None),) * (len(shape) - n_real)
    start, limit, out_shape = [], [], []
    d = 0
    for it in idx:
        if it is None:
            out_shape.append(1)
            continue
        n = shape[d]
        if isinstance(it, builtins.slice):
            if it.step not in (None, 1):
                raise ShapeError(f"getitem: only step-1 slices are supported, got {it!r}")
            s, l, _ = it.indices(n)
            l = max(l, s)
            start.append(s)
            limit.append(l)
            out_shape.append(l - s)
        else:
            i = int(it)
            if not -n <= i < n:
                raise ShapeError(f"getitem: index {i} is out of bounds for dimension {d} of "
                                 f"shape {shape}")
            i %= n
            start.append(i)
            limit.append(i + 1)
        d += 1
    return start, limit, out_shape


slice = _slice  # noqa: A001 - the public name shadows the builtin only as eins.ops.slice
slice.__name__ = slice.__qualname__ = "slice"   # as its errors and repr name it
