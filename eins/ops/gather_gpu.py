"""The GPU side of gather, take_along and scatter (eins/ops/gather.py): their lowerings
onto torch indexing on a block's rows. The GPU cannot check indices without a device sync:
an index out of range reads -0.0 / 0 (gather, take_along) or is dropped (scatter), and
nothing is synchronized, so every lowering can be captured in a CUDA graph. The block
geometry (which rows a block holds) is here, read by the numpy blocks too."""
from __future__ import annotations

import functools


def block_rows(fspec, k_in: int, axis: int, n) -> tuple[list, list]:
    """The global [lo, hi) of x's indexed axes in this block (input ``k_in`` of ``fspec``)."""
    if fspec is None:
        return [0] * len(n), list(n)
    b = fspec.inputs[k_in]
    return ([b.lo[axis + j] for j in range(len(n))], [b.hi[axis + j] for j in range(len(n))])


def holds_first(fspec, ks) -> bool:
    """Whether this block holds the first of the updates (every index box starts at 0)."""
    return fspec is None or all(lo == 0 for k in ks for lo in fspec.inputs[k].lo)


def _torch_rows(ids, n, lo, hi, wrap=True):
    """The indices (negatives from the end, or out of range when not ``wrap``), broadcast;
    whether each lies in the block's rows; and its row within the block, clamped (no device
    sync: out of range is masked)."""
    import torch  # heavy: only the GPU path
    g = torch.broadcast_tensors(*((torch.where(i < 0, i + nj, i) if wrap else i)
                                  .to(torch.int64) for i, nj in zip(ids, n)))
    inside = functools.reduce(torch.logical_and, [(gj >= l) & (gj < h)
                                                  for gj, l, h in zip(g, lo, hi)])
    local = [(gj - l).clamp(0, max(h - l - 1, 0)) for gj, l, h in zip(g, lo, hi)]
    return inside, local


def _torch_zero(t, dtype=None):
    """-0.0 (0, False) on ``t``'s device: a fill kernel, no host copy (graph capture)."""
    import torch  # heavy: only the GPU path
    dtype = dtype or t.dtype
    return torch.full((), -0.0 if dtype.is_floating_point else 0, dtype=dtype, device=t.device)


def gather_gpu(fspec, outs, ins, *, axis, n, wrap=True):
    """torch advanced indexing on the block's rows; rows elsewhere (and indices out of
    range, which the GPU does not check) read -0.0 / 0."""
    import torch  # heavy: only the GPU path
    x, ids = ins[0], ins[1:]
    lo, hi = block_rows(fspec, 0, axis, n)
    inside, local = _torch_rows(ids, n, lo, hi, wrap)
    vals = x[(slice(None),) * axis + tuple(local)]
    mask = inside.reshape((1,) * axis + tuple(inside.shape) + (1,) * (x.dim() - axis - len(n)))
    outs[0].copy_(torch.where(mask, vals, _torch_zero(x)))


def along_gpu(fspec, outs, ins, *, axis, n, wrap=True):
    """``torch.take_along_dim`` (it broadcasts as numpy's take_along_axis does)."""
    import torch  # heavy: only the GPU path
    x, ids = ins
    (lo,), (hi,) = block_rows(fspec, 0, axis, (n,))
    inside, (local,) = _torch_rows([ids], (n,), [lo], [hi], wrap)
    vals = torch.take_along_dim(x, local, dim=axis)
    outs[0].copy_(torch.where(inside, vals, _torch_zero(x)))


def scatter_gpu(fspec, outs, ins, *, axis, n, mode):
    """``index_put_`` (accumulating for ``add``, in float32 for 16-bit floats) on a copy of
    the block; indices outside the block's rows add -0.0 (``add``) or write a scratch row
    cut off after (``set``): no device sync, so it can be captured in a CUDA graph."""
    import torch  # heavy: only the GPU path
    x, ids, v = ins[0], ins[1:-1], ins[-1]   # (the front end passes values as arrays)
    k = len(ids)
    lo, hi = block_rows(fspec, 0, axis, n)
    first = holds_first(fspec, range(1, k + 1))
    inside, local = _torch_rows(ids, n, lo, hi)
    b = tuple(inside.shape)
    lead, trail = tuple(x.shape[:axis]), tuple(x.shape[axis + k:])
    vals = v.to(x.dtype).broadcast_to(lead + b + trail)
    if not b:   # one element: as a 1-long axis
        inside, local, b = inside.reshape(1), [t.reshape(1) for t in local], (1,)
        vals = vals.reshape(lead + b + trail)
    ar = [torch.arange(s, device=x.device).reshape((1,) * d + (s,) + (1,) * (axis - d - 1)
                                                   + (1,) * len(b)) for d, s in enumerate(lead)]
    loc = [t.reshape((1,) * axis + b) for t in local]
    # 16-bit floats add in float32; bools as ints (copied back: nonzero is True, an or)
    ct = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
          torch.bool: torch.int32}.get(x.dtype, x.dtype) if mode == "add" else x.dtype
    base = (x.to(ct, copy=True) if first else torch.full(tuple(x.shape), -0.0 if ct.is_floating_point
                                              else 0, dtype=ct, device=x.device))
    mask = inside.reshape((1,) * axis + b + (1,) * len(trail))
    if mode == "add":
        base.index_put_(tuple(ar + loc), torch.where(mask, vals.to(ct), _torch_zero(x, ct)),
                        accumulate=True)
        outs[0].copy_(base)
        return
    rows = hi[0] - lo[0]
    pad = torch.cat([base, base.narrow(axis, 0, 1)], dim=axis) if x.shape[axis] else base
    loc[0] = torch.where(inside.reshape(loc[0].shape), loc[0], torch.full_like(loc[0], rows))
    pad.index_put_(tuple(ar + loc), vals)
    outs[0].copy_(pad.narrow(axis, 0, rows))
