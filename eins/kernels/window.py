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
def window_copy(src, dst, table, lo_a, lo_b, hi_a, hi_b, base, rows, inner, n,
                BLOCK: tl.constexpr):
    """dst = src on rows [max(table[lo_a], table[lo_b]), min(table[hi_a], table[hi_b]))
    (global positions; the buffer's first row is ``base``) of the axis of ``rows`` rows
    with ``inner`` elements after it; 0 elsewhere. Flat offsets into contiguous buffers."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    lo = tl.maximum(tl.load(table + lo_a), tl.load(table + lo_b)) - base
    hi = tl.minimum(tl.load(table + hi_a), tl.load(table + hi_b)) - base
    r = (offs // inner) % rows
    keep = inb & (r >= lo) & (r < hi)
    x = tl.load(src + offs, mask=keep, other=0)
    tl.store(dst + offs, x, mask=inb)
'''


def window_copy(src, dst, table, window, box, interpret: bool) -> None:
    """Launch the windowed copy of torch tensor ``src`` (block ``box`` of its variable) into
    ``dst`` (same shape) for an eins.ir.device.Window over ``table`` (the device's copy of
    the call's int table, a torch tensor)."""
    import triton  # heavy: only the GPU path
    kern = compile_source(SOURCE, "window_copy", interpret)
    shape = tuple(box.shape)
    axis = window.axis % len(shape)
    inner = 1
    for s in shape[axis + 1:]:
        inner *= s
    cols = table.shape[-1]
    los = [r * cols + c for r, c in window.los]
    his = [r * cols + c for r, c in window.his]
    n = src.numel()
    if n:
        kern[(triton.cdiv(n, BLOCK),)](src, dst, table, los[0], los[-1], his[0], his[-1],
                                       box.lo[axis], shape[axis], inner, n, BLOCK=BLOCK,
                                       **LAUNCH_OPTIONS)
