"""Static memory plan of one device's GPU program: buffers whose lifetimes do not overlap
share storage ("slots"), so a device holds about its peak live bytes instead of the sum of
every block it ever makes, while every buffer keeps a fixed address (captured CUDA graphs
replay on the same memory).

Positions follow the generated walk (``GpuWalk`` of eins/codegen/generate.py, which places
each instruction; this module reads only ``uses()``/``defs()``): Loads run first and Stores
last; a fused elementwise chain writes and reads at its launch position, as does a sum ⊕
computed as such a chain's first step (its partials live until the launch), a matmul
with the residual add fused into it and the layout changes folded into a kernel's operands
or output (at that kernel's position: an attention writes its folded output's last buffer
when it runs, so that buffer lives from there). A buffer lives from
the instruction that writes it to the last one that reads it. Two buffers share a slot only
when one's last read comes strictly before the other's write; all of it runs in order on the
device's one stream, so the reuse needs no synchronization. Never shared: Load buffers
(placed inputs must survive across calls), receive buffers (a peer writes them from its own
stream, at a time this stream does not order) and literals.
"""
from __future__ import annotations

import numpy as np

END = float("inf")   # the position of the walk's last steps (the sunk Stores)


def lifetimes(instrs, positions, allocated) -> dict:
    """{buffer: (first write, last read)} in walk positions: instruction j reads its
    ``uses()`` and writes its ``defs()`` (eins/ir/device.py) at ``positions[j]`` (default j;
    the walk's: a fused member at its chain's launch, Stores at ``END``). ``allocated``: the
    buffers that get memory at all."""
    start, end = {}, {}
    for j, ins in enumerate(instrs):
        pos = positions.get(j, j)
        for b in ins.uses():
            if b in allocated:
                end[b] = max(end.get(b, pos), pos)
        for b in ins.defs():
            if b in allocated:
                start[b] = min(start.get(b, pos), pos)
                end.setdefault(b, pos)
    return {b: (start[b], end[b]) for b in start}


def plan(instrs, bufs, positions, allocated, pinned) -> tuple[dict, dict]:
    """(slot of each buffer, bytes of each slot). Pinned buffers (``pinned``: loads,
    receives; and buffers without a write in this walk) get a slot of their own; the others
    share greedily, taking the smallest free slot that fits (best fit), in order of first
    write. ``positions`` as for :func:`lifetimes`."""
    life = lifetimes(instrs, positions, allocated)
    nbytes = {b: int(np.prod(bufs[b].box.shape, dtype=np.int64)) * np.dtype(bufs[b].dtype).itemsize
              for b in allocated}
    slot_of, size = {}, []
    for b in sorted(allocated):
        if b in pinned or b not in life:
            slot_of[b] = len(size)
            size.append(nbytes[b])
    free_at = []   # (slot, position after which it is free)
    for b in sorted((b for b in allocated if b not in slot_of), key=lambda b: (life[b], b)):
        s, e = life[b]
        fits = [k for k, (slot, until) in enumerate(free_at)
                if until < s and size[slot] >= nbytes[b]]
        if fits:
            k = min(fits, key=lambda k: size[free_at[k][0]])
            slot = free_at.pop(k)[0]
        else:
            slot = len(size)
            size.append(nbytes[b])
        slot_of[b] = slot
        free_at.append((slot, e))
    return slot_of, dict(enumerate(size))
