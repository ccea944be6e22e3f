"""Sharded arrays on the ranks (``devices="world"`` with ``outputs="devices"``): each rank
holds its own device's blocks of an output, in its kernel set's memory (numpy, or its GPU),
and every rank knows the whole layout (every rank has the whole device program).

Passed back as an input, a Sharded array is re-laid-out before the program runs
(:func:`relayout`): for every Load of it on every device, the parts held by another rank
are sent there point to point (each rank computes the same list of pieces from the layout
and the device program, so the sends and receives pair up without asking anyone); the
parts a rank holds itself are read in place. Nothing goes through the host. A Sharded
array's :meth:`~eins.runtime.sharded.Sharded.gather` is collective: every rank calls it
(:func:`gather_sharded`)."""
from __future__ import annotations

import numpy as np

from eins.runtime.ranks import Resident, _dist, _failure, _td, store_layout
from eins.runtime.sharded import Sharded, cover

__all__ = ["relayout", "resident_source", "kept_outputs", "gather_sharded"]

# the tag of gather_sharded's messages: it runs between programs, so it only has to differ
# from the re-layout's and the programs' tags of calls a slower peer may still be in
GATHER_TAG = 1 << 24


def _transfers(dprog, sharded: dict) -> list:
    """Every piece of the Sharded inputs that a device loads from another device's block,
    in one order every rank computes alike: (holder, device, input, piece)."""
    out, seen = [], set()
    loads = dprog.load_layout()   # every device's, also in a program lowered for one rank
    for k, s in sorted(sharded.items()):
        for d in dprog.devices:
            for source, box in loads[d]:
                if source != ("in", k):
                    continue
                for p in cover(s.layout, box):
                    key = (p.holder, d, k, p.index, p.box)
                    if p.holder != d and key not in seen:
                        seen.add(key)
                        out.append((p.holder, d, k, p))
    return out


def relayout(dprog, rank: int, sharded: dict, kern, timeout_s: float) -> tuple[dict, int]:
    """Send this rank's pieces of the Sharded inputs ``sharded`` {input: Sharded} that other
    ranks load, receive the ones it loads from others. Returns ({(input, layout index, piece
    box): block}, bytes received)."""
    moves = _transfers(dprog, sharded)
    if not moves:
        return {}, 0
    dist = _dist()
    base = dprog.tag_count() + 1          # above the program's and its gather's tags
    ops, recvs, wires = [], [], []
    for n, (holder, d, k, p) in enumerate(moves):
        s = sharded[k]
        if holder == rank:
            block = s.blocks()[p.index]
            wire = kern.to_wire(kern.slice(block, p.box.relative_to(p.block)))
            wires.append(wire)
            ops.append(dist.P2POp(dist.isend, wire, d, tag=base + n))
        elif d == rank:
            wire = kern.wire_buffer(p.box.size * s.dtype.itemsize)
            ops.append(dist.P2POp(dist.irecv, wire, holder, tag=base + n))
            recvs.append((len(ops) - 1, k, p, wire))
    if not ops:
        return {}, 0
    try:
        works = dist.batch_isend_irecv(ops)
    except Exception as e:
        raise _failure(e, rank, "a rank", "posting the re-layout of Sharded inputs",
                       timeout_s) from None
    for w in works:
        try:
            w.wait(timeout=_td(timeout_s))
        except Exception as e:
            raise _failure(e, rank, "a peer rank", "re-laying out Sharded inputs (their "
                           "pieces held by other ranks)", timeout_s) from None
    got, nbytes = {}, 0
    for _, k, p, wire in recvs:
        got[(k, p.index, p.box)] = kern.from_wire(wire, p.box.shape, sharded[k].dtype)
        nbytes += wire.numel() * wire.element_size()
    return got, nbytes


def resident_source(s: Sharded, k: int, box, received: dict, kern, rank: int, stats):
    """Block ``box`` of Sharded input ``k`` on this rank, as a :class:`Resident`: its own
    blocks' parts in place, the others from ``received`` (:func:`relayout`)."""
    held = s.blocks()
    parts = []
    for p in cover(s.layout, box):
        if p.holder == rank:
            part = kern.slice(held[p.index], p.box.relative_to(p.block))
            stats.resident_bytes += kern.nbytes(part)
        else:
            part = received[(k, p.index, p.box)]
        parts.append((p.box.relative_to(box), part))
    if len(parts) == 1:   # the piece is the whole box
        return Resident(parts[0][1])
    return Resident(kern.concat(box, s.dtype, parts))


def kept_outputs(dprog, stored, rank: int, kern, timeout_s: float) -> list:
    """The outputs of a call run with ``keep`` as Sharded arrays: the layout of every rank's
    Stores, this rank's blocks held."""
    layout = store_layout(dprog)
    outs = []
    for o, v in enumerate(dprog.program.outputs):
        blocks = [(d, box) for d in dprog.devices for oo, box in layout.get(d, []) if oo == o]
        mine = {box: a for oo, box, a in stored if oo == o}
        held = {i: mine[box] for i, (d, box) in enumerate(blocks) if d == rank}
        outs.append(Sharded(v.shape, v.dtype, blocks, held, "world", kern.to_host,
                            gather=lambda s, kern=kern: gather_sharded(s, rank, kern,
                                                                      timeout_s)))
    return outs


def gather_sharded(s: Sharded, rank: int, kern, timeout_s: float) -> np.ndarray:
    """The whole of ``s`` on this rank: every rank sends the blocks it holds to every other
    rank (point to point, each wait bounded by ``timeout_s``). Collective: every rank calls
    it for the same arrays in the same order."""
    import torch  # heavy: only the rank runtime (torch.distributed)
    dist = _dist()
    size = dist.get_world_size()
    out = np.empty(s.shape, s.dtype)
    held = s.blocks()
    raws = {}
    for i, (d, box) in enumerate(s.layout):
        if d == rank:
            out[tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))] = kern.to_host(held[i])
    mine = np.concatenate([np.ascontiguousarray(kern.to_host(held[i])).reshape(-1).view(np.uint8)
                           for i, (d, _) in enumerate(s.layout) if d == rank] or
                          [np.empty(0, np.uint8)])
    works = []
    try:
        for r in range(size):
            if r == rank:
                continue
            if mine.size:
                works.append((r, dist.isend(torch.from_numpy(mine), r, tag=GATHER_TAG)))
            n = sum(box.size for d, box in s.layout if d == r) * s.dtype.itemsize
            if n:
                raws[r] = torch.empty(n, dtype=torch.uint8)
                works.append((r, dist.irecv(raws[r], r, tag=GATHER_TAG)))
    except Exception as e:
        raise _failure(e, rank, "a rank", "posting the gather of a Sharded array",
                       timeout_s) from None
    for r, w in works:
        try:
            w.wait(timeout=_td(timeout_s))
        except Exception as e:
            raise _failure(e, rank, r, "gathering a Sharded array (every rank must call "
                           "np.asarray / gather on it together)", timeout_s) from None
    for r, raw in raws.items():
        raw, pos = raw.numpy(), 0
        for d, box in s.layout:
            if d != r:
                continue
            nb = box.size * s.dtype.itemsize
            out[tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))] = \
                raw[pos:pos + nb].view(s.dtype).reshape(box.shape)
            pos += nb
    return out
