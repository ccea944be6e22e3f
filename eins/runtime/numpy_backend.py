"""Virtual devices on the CPU: the numpy executor of the device IR.

Each device has its own buffers; a transfer is a real copy through a mailbox; kernels are the
reference kernels on blocks (``Primitive.run_block``). Devices run their instruction lists in
order, round-robin, each until it waits on a receive; sends never block, so (the lists coming
from one global topological order) execution always progresses. Records bytes per (source,
destination), the number of transfers and each device's peak live bytes.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from eins.errors import EinsError, LoweringError
from eins.ir.device import Agg, Concat, Free, Kernel, Load, Recv, Send, Slice, Store
from eins.ir.joinagg import aggregate, finalize, is_lse_pair
from eins.ops.registry import get_primitive


@dataclass
class Stats:
    """What one execution did."""

    bytes_moved: dict = field(default_factory=dict)     # (src, dst) -> bytes
    transfers: int = 0
    peak_bytes: dict = field(default_factory=dict)      # device -> peak live bytes
    kernels: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_moved.values())

    def as_dict(self) -> dict:
        return {"bytes_moved": {f"{s}->{d}": b for (s, d), b in sorted(self.bytes_moved.items())},
                "total_bytes": self.total_bytes, "transfers": self.transfers,
                "peak_bytes": dict(sorted(self.peak_bytes.items())), "kernels": self.kernels}


def execute(dp, inputs, consts=None):
    """Run device program ``dp`` on numpy ``inputs`` (one per program input). Returns
    (outputs tuple, Stats)."""
    prog = dp.program
    consts = [c for _, c in prog.consts] if consts is None else consts
    for k, (v, a) in enumerate(zip(prog.inputs, inputs)):
        if tuple(a.shape) != tuple(v.shape):
            raise EinsError(f"input {k}: expected shape {v.shape}, got {tuple(a.shape)}")
    stats = Stats()
    mem = {d: {} for d in dp.devices}
    live = defaultdict(int)
    mailbox = {}
    pcs = {d: 0 for d in dp.devices}
    results = [np.zeros(v.shape, v.dtype) for v in prog.outputs]

    def put(d, name, arr):
        mem[d][name] = arr
        live[d] += arr.nbytes
        stats.peak_bytes[d] = max(stats.peak_bytes.get(d, 0), live[d])

    def step(d, ins) -> bool:
        m = mem[d]
        info = dp.bufs.get(d, {})
        if isinstance(ins, Load):
            kind, k = ins.source
            src = inputs[k] if kind == "in" else consts[k]
            put(d, ins.dst, np.array(src[tuple(slice(l, h) for l, h in zip(ins.box.lo, ins.box.hi))]))
        elif isinstance(ins, Slice):
            outer = info[ins.src].box
            put(d, ins.dst, np.array(m[ins.src][ins.box.relative_to(outer)]))
        elif isinstance(ins, Concat):
            out = np.empty(ins.box.shape, info[ins.dst].dtype)
            for s in ins.srcs:
                out[info[s].box.relative_to(ins.box)] = m[s]
            put(d, ins.dst, out)
        elif isinstance(ins, Agg):
            # the full aggregate of a ⊕ of pairs (lse) is finalized to its buffer's dtype
            put(d, ins.dst, finalize(ins.op, aggregate(ins.op, [m[s] for s in ins.srcs]),
                                     info[ins.dst].dtype))
        elif isinstance(ins, Send):
            arr = m[ins.src]
            mailbox[(d, ins.peer, ins.tag)] = np.array(arr)
            stats.bytes_moved[(d, ins.peer)] = stats.bytes_moved.get((d, ins.peer), 0) + arr.nbytes
            stats.transfers += 1
        elif isinstance(ins, Recv):
            key = (ins.peer, d, ins.tag)
            if key not in mailbox:
                return False
            put(d, ins.dst, mailbox.pop(key))
        elif isinstance(ins, Kernel):
            eqn = prog.eqns[ins.eqn]
            args = [np.asarray(a[1], a[2]) if isinstance(a, tuple) else m[a] for a in ins.ins]
            # outputs held as pairs (partials of the lse ⊕) come from the partial kernel
            partial = any(is_lse_pair(info[name].dtype) for name in ins.outs)
            outs = get_primitive(eqn.prim).run_block(ins.fspec, *args, partial=partial,
                                                     **eqn.params)
            for name, o in zip(ins.outs, outs):
                put(d, name, np.asarray(o, dtype=info[name].dtype))
            stats.kernels += 1
        elif isinstance(ins, Store):
            results[ins.output][tuple(slice(l, h) for l, h in zip(ins.box.lo, ins.box.hi))] = m[ins.src]
        elif isinstance(ins, Free):
            live[d] -= m.pop(ins.buf).nbytes
        else:  # pragma: no cover
            raise LoweringError(f"unknown instruction {ins!r}")
        return True

    remaining = sum(len(c) for c in dp.code.values())
    while remaining:
        progressed = False
        for d in dp.devices:
            code = dp.code.get(d, [])
            while pcs[d] < len(code) and step(d, code[pcs[d]]):
                pcs[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {d: code[pcs[d]] for d, code in dp.code.items() if pcs[d] < len(code)}
            raise LoweringError(f"device program deadlocked at {stuck}")
    if mailbox:
        raise LoweringError(f"{len(mailbox)} messages were sent but never received")
    return tuple(results), stats
