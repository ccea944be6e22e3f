"""The windowed copy of a capacity program's transfers (eins/passes/windows.py): a buffer's
rows inside a per-call window, read from an int table on the device, into the receiver's
buffer, zeros elsewhere. One launch of fixed shape (the whole buffer): the window's bounds
are loaded inside the kernel and mask the reads, so a CUDA graph captured once replays any
window, with no host sync, and reads only the window's bytes."""
from __future__ import annotations

from eins.kernels.build import LAUNCH_OPTIONS, compile_source

__all__ = ["window_copy"]

BLOCK = 1024

SOURCE = '''
@triton.jit
def window_copy(src, dst, table, lo_a, lo_b, hi_a, hi_b, base, rows, inner, n, dst_rows,
                row_off, FILL: tl.constexpr, BLOCK: tl.constexpr):
    """dst = src on rows [max(table[lo_a], table[lo_b]), min(table[hi_a], table[hi_b]))
    (global positions; src's first row is ``base``) of the axis of ``rows`` rows with
    ``inner`` elements after it; 0 elsewhere (FILL), or left as it is (a placement: other
    sources write the other rows). dst holds ``dst_rows`` rows along that axis, src's first
    at ``row_off`` (a region of a bigger buffer); both contiguous."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    lo = tl.maximum(tl.load(table + lo_a), tl.load(table + lo_b)) - base
    hi = tl.minimum(tl.load(table + hi_a), tl.load(table + hi_b)) - base
    r = (offs // inner) % rows
    keep = inb & (r >= lo) & (r < hi)
    x = tl.load(src + offs, mask=keep, other=0)
    at = (offs // (inner * rows)) * (dst_rows * inner) + (r + row_off) * inner + offs % inner
    if FILL:
        tl.store(dst + at, x, mask=inb)
    else:
        tl.store(dst + at, x, mask=keep)
'''


def window_copy(src, dst, table, window, box, interpret: bool, fill: bool = True,
                dst_box=None) -> None:
    """Launch the windowed copy of torch tensor ``src`` (block ``box`` of its variable) into
    ``dst`` (block ``dst_box``, by default ``box``: it may be bigger along the window's axis
    alone) for an eins.ir.device.Window over ``table`` (the device's copy of the call's int
    table, a torch tensor); ``fill``: zeros outside the window, else only the window's
    rows are written."""
    import triton  # heavy: only the GPU path
    kern = compile_source(SOURCE, "window_copy", interpret)
    shape = tuple(box.shape)
    axis = window.axis % len(shape)
    dst_box = box if dst_box is None else dst_box
    inner = 1
    for s in shape[axis + 1:]:
        inner *= s
    cols = table.shape[-1]
    los = [r * cols + c for r, c in window.los]
    his = [r * cols + c for r, c in window.his]
    n = src.numel()
    if n:
        kern[(triton.cdiv(n, BLOCK),)](src, dst, table, los[0], los[-1], his[0], his[-1],
                                       box.lo[axis], shape[axis], inner, n,
                                       dst_box.shape[axis], box.lo[axis] - dst_box.lo[axis],
                                       FILL=fill, BLOCK=BLOCK, **LAUNCH_OPTIONS)
