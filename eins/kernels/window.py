"""The windowed copy of a capacity program's transfers (eins/passes/windows.py): a buffer's
rows inside a per-call window, read from an int table on the device, into the receiver's
buffer, zeros elsewhere. One launch of fixed shape (the whole buffer): the window's bounds
are loaded inside the kernel and mask the reads, so a CUDA graph captured once replays any
window, with no host sync, and reads only the window's bytes.

A window is a union of intervals (a relayed buffer: the rows its receiver needs and those
of each device it forwards to), each [max of two table entries, min of two): the kernel is
generated per interval count (a few at most, all known when the program is compiled), each
interval's four table offsets plain int arguments, so the row mask is an OR of compares and
a row inside two overlapping intervals is still read once."""
from __future__ import annotations

from eins.errors import EinsError
from eins.kernels.build import LAUNCH_OPTIONS, compile_source

__all__ = ["window_copy"]

BLOCK = 1024

SOURCE = '''
@triton.jit
def {name}(src, dst, table, {bounds}, base, rows, inner, n, dst_rows,
                row_off, FILL: tl.constexpr, BLOCK: tl.constexpr):
    """dst = src on the rows of the union over intervals i of [max(table[lo_i_a],
    table[lo_i_b]), min(table[hi_i_a], table[hi_i_b])) (global positions; src's first row
    is ``base``) of the axis of ``rows`` rows with ``inner`` elements after it; 0 elsewhere
    (FILL), or left as it is (a placement: other sources write the other rows). dst holds
    ``dst_rows`` rows along that axis, src's first at ``row_off`` (a region of a bigger
    buffer); both contiguous."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    r = (offs // inner) % rows
    keep = r < 0
{masks}    keep = inb & keep
    x = tl.load(src + offs, mask=keep, other=0)
    at = (offs // (inner * rows)) * (dst_rows * inner) + (r + row_off) * inner + offs % inner
    if FILL:
        tl.store(dst + at, x, mask=inb)
    else:
        tl.store(dst + at, x, mask=keep)
'''

MASK = '''    lo = tl.maximum(tl.load(table + lo_{i}_a), tl.load(table + lo_{i}_b)) - base
    hi = tl.minimum(tl.load(table + hi_{i}_a), tl.load(table + hi_{i}_b)) - base
    keep = keep | ((r >= lo) & (r < hi))
'''


def source(parts: int) -> str:
    """The copy kernel's source for a window of ``parts`` intervals."""
    bounds = ", ".join(f"lo_{i}_a, lo_{i}_b, hi_{i}_a, hi_{i}_b" for i in range(parts))
    return SOURCE.format(name=f"window_copy_{parts}", bounds=bounds,
                         masks="".join(MASK.format(i=i) for i in range(parts)))


def window_copy(src, dst, table, window, box, interpret: bool, fill: bool = True,
                dst_box=None) -> None:
    """Launch the windowed copy of torch tensor ``src`` (block ``box`` of its variable) into
    ``dst`` (block ``dst_box``, by default ``box``: it may be bigger along the window's axis
    alone) for an eins.ir.device.Window over ``table`` (the device's copy of the call's int
    table, a torch tensor); ``fill``: zeros outside the window, else only the window's
    rows are written."""
    import triton  # heavy: only the GPU path
    parts = window.parts()
    for los, his in parts:   # the kernel reads a side's first and last cell only
        if len(los) > 2 or len(his) > 2:
            raise EinsError(f"window_copy: a window side of {len(los)} and {len(his)} table "
                            f"cells (at most 2): {window}")
    kern = compile_source(source(len(parts)), f"window_copy_{len(parts)}", interpret)
    shape = tuple(box.shape)
    axis = window.axis % len(shape)
    dst_box = box if dst_box is None else dst_box
    inner = 1
    for s in shape[axis + 1:]:
        inner *= s
    cols = table.shape[-1]
    bounds = []
    for los, his in parts:   # one or two cells a side: the first repeated
        lo = [r * cols + c for r, c in los]
        hi = [r * cols + c for r, c in his]
        bounds += [lo[0], lo[-1], hi[0], hi[-1]]
    n = src.numel()
    if n:
        kern[(triton.cdiv(n, BLOCK),)](src, dst, table, *bounds,
                                       box.lo[axis], shape[axis], inner, n,
                                       dst_box.shape[axis], box.lo[axis] - dst_box.lo[axis],
                                       FILL=fill, BLOCK=BLOCK, **LAUNCH_OPTIONS)
