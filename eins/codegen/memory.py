"""Static memory plan of one device's GPU program: buffers whose lifetimes do not overlap
share storage ("slots"), so a device holds about its peak live bytes instead of the sum of
every block it ever makes, while every buffer keeps a fixed address (captured CUDA graphs
replay on the same memory).

Positions follow the generated walk (eins/codegen/generate.py): Loads run first and Stores
last; a fused elementwise chain writes and reads at its launch position. A buffer lives from
the instruction that writes it to the last one that reads it. Two buffers share a slot only
when one's last read comes strictly before the other's write; all of it runs in order on the
device's one stream, so the reuse needs no synchronization. Never shared: Load buffers
(placed inputs must survive across calls), receive buffers (a peer writes them from its own
stream, at a time this stream does not order) and literals.
"""
from __future__ import annotations

import numpy as np

from eins.ir.device import Agg, Concat, Kernel, Load, Recv, Send, Slice, Store

_END = float("inf")


def lifetimes(instrs, launch_pos, allocated) -> dict:
    """{buffer: (first write, last read)} in walk positions; ``launch_pos[j]`` is where
    instruction j runs (a fused member at its chain's launch), ``allocated`` the buffers that
    get memory at all."""
    start, end = {}, {}

    def write(b, pos):
        if b in allocated:
            start[b] = min(start.get(b, pos), pos)
            end.setdefault(b, pos)

    def read(b, pos):
        if b in allocated:
            end[b] = max(end.get(b, pos), pos)

    for j, ins in enumerate(instrs):
        pos = launch_pos.get(j, j)
        if isinstance(ins, Kernel):
            for a in ins.ins:
                if isinstance(a, str):
                    read(a, pos)
            for o in ins.outs:
                write(o, pos)
        elif isinstance(ins, Slice):
            read(ins.src, pos)
            write(ins.dst, pos)
        elif isinstance(ins, (Concat, Agg)):
            for s in ins.srcs:
                read(s, pos)
            write(ins.dst, pos)
        elif isinstance(ins, Send):
            read(ins.src, pos)
        elif isinstance(ins, Store):
            read(ins.src, _END)
    return {b: (start[b], end[b]) for b in start}


def plan(instrs, bufs, launch_pos, allocated) -> tuple[dict, dict]:
    """(slot of each buffer, bytes of each slot). Pinned buffers (loads, receives, buffers
    without a write in this walk) get a slot of their own; the others share greedily,
    taking the smallest free slot that fits (best fit), in order of first write."""
    pinned = {i.dst for i in instrs if isinstance(i, (Load, Recv))}
    life = lifetimes(instrs, launch_pos, allocated)
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
