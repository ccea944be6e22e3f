"""Static memory plan of one device's GPU program: buffers whose lifetimes do not overlap
share storage ("slots"), so a device holds about its peak live bytes instead of the sum of
every block it ever makes, while every buffer keeps a fixed address (captured CUDA graphs
replay on the same memory).

Positions follow the generated walk (``GpuWalk`` of eins/codegen/gpu_walk.py, which places
each instruction; this module reads only ``uses()``/``defs()``): Loads run first and Stores
last; a fused elementwise chain writes and reads at its launch position, as does a sum ⊕
computed as such a chain's first step (its partials live until the launch), a matmul
with the residual add fused into it and the layout changes folded into a kernel's operands
or output (at that kernel's position: an attention writes its folded output's last buffer
when it runs, so that buffer lives from there). A buffer lives from
the instruction that writes it to the last one that reads it. Two buffers share a slot only
when one's last read comes strictly before the other's write, or when a matmul's fused
residual add writes in place over its residual (:func:`in_place_residuals`: the add's output
takes the residual's slot at the launch that last reads it); all of it runs in order on the
device's one stream, so the reuse needs no synchronization. Never shared: Load buffers
(placed inputs must survive across calls), receive buffers (a peer writes them from its own
stream, at a time this stream does not order) and literals.
"""
from __future__ import annotations

import numpy as np

from eins.ir.device import def_use

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


def in_place_residuals(instrs, bufs, residual, position, one_call) -> dict:
    """{add output r: residual c} for the fused matmul + residual adds (``residual``: launch
    position -> (matmul, add, c), eins/codegen/gpu_walk.py ``GpuWalk``) that may write in
    place, r taking c's storage: c is a plain buffer of this stream (written by a kernel, a
    slice, a concat or a ⊕, not a Load or a receive), no Store or Send reads it, every other
    reader runs (``position``) before the launch, the matmul does not read it, r has its
    shape and dtype, and the runtime computes the pair as ONE addmm/baddbmm
    (``one_call(a_shape, b_shape)``, eins/kernels/matmul.py), which reads c before
    it writes any of r: ``addmm(c, a, b, out=c)`` on CUDA is one GEMM, no copy of c."""
    producer, readers = def_use(instrs)
    out = {}
    for at, (j, a, c) in residual.items():
        mm, r = instrs[j], instrs[a].outs[0]
        if c not in producer or instrs[producer[c]].kind in ("load", "recv") \
                or c in mm.ins or bufs[c].box.shape != bufs[r].box.shape \
                or bufs[c].dtype != bufs[r].dtype \
                or not one_call(*(tuple(bufs[x].box.shape) for x in mm.ins)):
            continue
        if all(instrs[k].kind not in ("store", "send") and position(k) < at
               for k in readers[c] if k != a):
            out[r] = c
    return out


def plan(instrs, bufs, positions, allocated, pinned, alias=None) -> tuple[dict, dict]:
    """(slot of each buffer, bytes of each slot). Pinned buffers (``pinned``: loads,
    receives; and buffers without a write in this walk) get a slot of their own; the others
    share greedily, taking the smallest free slot that fits (best fit), in order of first
    write. ``positions`` as for :func:`lifetimes`. ``alias``: {r: c}, r written in place
    of c (:func:`in_place_residuals`): r takes c's slot, which lives from c's first write
    to the last read of either (chains: r2 in place of r in place of c, one slot)."""
    life = lifetimes(instrs, positions, allocated)
    alias = {r: c for r, c in (alias or {}).items() if r in allocated and c in allocated}

    def root(b):
        while b in alias:
            b = alias[b]
        return b
    for r in sorted(alias, key=lambda r: life.get(r, (0, 0))):
        c = root(r)
        if r in life and c in life:
            life[c] = (min(life[c][0], life[r][0]), max(life[c][1], life[r][1]))
    allocated = [b for b in allocated if b not in alias]
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
    for r in alias:
        slot_of[r] = slot_of[root(r)]
    return slot_of, dict(enumerate(size))
