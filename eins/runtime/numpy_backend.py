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

from eins.errors import DTypeError, EinsError, IndexRangeError, LoweringError
from eins.ir.device import InstrVisitor
from eins.ir.joinagg import aggregate, finalize, is_lse_pair
from eins.ir.pieces import OP
from eins.ir.rules import negative_power_error
from eins.runtime.sharded import Sharded, box_index, cover


@dataclass
class Stats:
    """What one execution did."""

    bytes_moved: dict = field(default_factory=dict)     # (src, dst) -> bytes
    transfers: int = 0
    peak_bytes: dict = field(default_factory=dict)      # device -> peak live bytes
    kernels: int = 0
    h2d_inputs: dict = field(default_factory=dict)      # input -> bytes loaded from the host
    resident_bytes: int = 0     # read from a Sharded input's block on the loading device
    relayout_bytes: int = 0     # a Sharded input's pieces copied from another device

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_moved.values())

    def as_dict(self) -> dict:
        return {"bytes_moved": {f"{s}->{d}": b for (s, d), b in sorted(self.bytes_moved.items())},
                "total_bytes": self.total_bytes, "transfers": self.transfers,
                "peak_bytes": dict(sorted(self.peak_bytes.items())), "kernels": self.kernels,
                "h2d_bytes": sum(self.h2d_inputs.values()),
                "h2d_inputs": dict(sorted(self.h2d_inputs.items())),
                "resident_bytes": self.resident_bytes, "relayout_bytes": self.relayout_bytes}


def run_block(eqn, fspec, args, out_dtypes, acc=None) -> list:
    """The numpy block executor of the virtual devices and the ranks alike: eqn's block on
    numpy ``args`` (a literal operand as ``("lit", value, dtype)``), each output as an array
    of its buffer's dtype. Outputs held as pairs (partials of the lse ⊕) come from the
    primitive's partial kernel. ``acc``: a pipelined piece's running pairs (the Kernel's
    ``acc``, eins.ir.device): the block's partial ⊕ ``acc`` (the pieces' ⊕,
    eins.ir.pieces.OP), finalized to an output dtype that is not pairs."""
    args = [np.asarray(a[1], a[2]) if isinstance(a, tuple) else a for a in args]
    if acc is not None:
        part, = eqn.primitive.run_block(fspec, *args, partial=True, **eqn.params)
        return [finalize(OP, aggregate(OP, [acc, np.asarray(part, dtype=acc.dtype)]),
                         out_dtypes[0])]
    partial = any(is_lse_pair(dt) for dt in out_dtypes)
    outs = eqn.primitive.run_block(fspec, *args, partial=partial, **eqn.params)
    return [np.asarray(o, dtype=dt) for o, dt in zip(outs, out_dtypes)]


class _Devices(InstrVisitor):
    """The virtual devices' state and one method per instruction (``visit_<kind>``, see
    :class:`eins.ir.device.InstrVisitor`); each runs ``ins`` on device ``d`` and returns
    False when it must wait (a receive whose message has not arrived)."""

    def __init__(self, dprog, inputs, consts, keep=False):
        self.dprog, self.prog, self.inputs, self.consts = dprog, dprog.program, inputs, consts
        self.keep = keep
        self.kept = [{} for _ in self.prog.outputs]   # keep: output -> {(device, box): block}
        self.stats = Stats(peak_bytes={d: 0 for d in dprog.devices})  # idle devices: 0
        self.mem = {d: {} for d in dprog.devices}
        self.live = defaultdict(int)
        self.mailbox = {}
        self.results = [np.zeros(v.shape, v.dtype) for v in self.prog.outputs]
        self.refused = {}   # eqn -> the most negative integer exponent its blocks refused

    def put(self, d, name, arr):
        self.mem[d][name] = arr
        self.live[d] += arr.nbytes
        self.stats.peak_bytes[d] = max(self.stats.peak_bytes.get(d, 0), self.live[d])

    def info(self, d):
        return self.dprog.bufs.get(d, {})

    def visit_load(self, ins, d):
        kind, k = ins.source
        src = self.inputs[k] if kind == "in" else self.consts[k]
        if isinstance(src, Sharded):
            self.put(d, ins.dst, self.resident(src, d, ins.box))
            return True
        block = np.array(src[box_index(ins.box)])
        if kind == "in":
            self.stats.h2d_inputs[k] = self.stats.h2d_inputs.get(k, 0) + block.nbytes
        self.put(d, ins.dst, block)
        return True

    def resident(self, src, d, box):
        """Block ``box`` of a Sharded input on device ``d``: its pieces on ``d`` read in
        place, the others copied from the devices holding them (bytes moved, a re-layout);
        nothing from the host."""
        held = src.blocks()
        out = np.empty(box.shape, src.dtype)
        for p in cover(src.layout, box):
            part = held[p.index][p.box.relative_to(p.block)]
            out[p.box.relative_to(box)] = part
            if p.holder == d:
                self.stats.resident_bytes += part.nbytes
            else:
                moved = self.stats.bytes_moved
                moved[(p.holder, d)] = moved.get((p.holder, d), 0) + part.nbytes
                self.stats.transfers += 1
                self.stats.relayout_bytes += part.nbytes
        return out

    def visit_slice(self, ins, d):
        outer = self.info(d)[ins.src].box
        self.put(d, ins.dst, np.array(self.mem[d][ins.src][ins.box.relative_to(outer)]))
        return True

    def visit_concat(self, ins, d):
        info, m = self.info(d), self.mem[d]
        if ins.windows is not None:   # a placement: only each source's window (zeros else)
            out = np.zeros(ins.box.shape, info[ins.dst].dtype)
            for s, w in zip(ins.srcs, ins.windows):
                region = out[info[s].box.relative_to(ins.box)]
                if w is None:
                    region[...] = m[s]
                    continue
                region, src = np.moveaxis(region, w.axis, 0), np.moveaxis(m[s], w.axis, 0)
                for a, b in w.spans(info[s].box, m[w.table]):
                    region[a:b] = src[a:b]
            self.put(d, ins.dst, out)
            return True
        out = np.empty(ins.box.shape, info[ins.dst].dtype)
        for s in ins.srcs:
            out[info[s].box.relative_to(ins.box)] = m[s]
        self.put(d, ins.dst, out)
        return True

    def visit_agg(self, ins, d):
        if ins.windows is not None:   # a placement: each source's window of rows in place
            info = self.info(d)
            out = np.zeros(info[ins.dst].box.shape, info[ins.dst].dtype)
            for s, w in zip(ins.srcs, ins.windows):
                for a, b in w.spans(info[s].box, self.mem[d][w.table]):
                    np.moveaxis(out, w.axis, 0)[a:b] = \
                        np.moveaxis(self.mem[d][s], w.axis, 0)[a:b]
            self.put(d, ins.dst, out)
            return True
        # the full aggregate of a ⊕ of pairs (lse) is finalized to its buffer's dtype
        whole = aggregate(ins.op, [self.mem[d][s] for s in ins.srcs])
        self.put(d, ins.dst, finalize(ins.op, whole, self.info(d)[ins.dst].dtype))
        return True

    def visit_send(self, ins, d):
        arr = self.mem[d][ins.src]
        msg, nbytes = np.array(arr), arr.nbytes
        if ins.window is not None:   # only the window's rows move; zeros elsewhere
            w = ins.window
            msg, nbytes = np.zeros_like(arr), 0
            for a, b in w.spans(self.info(d)[ins.src].box, self.mem[d][w.table]):
                part = np.moveaxis(arr, w.axis, 0)[a:b]
                np.moveaxis(msg, w.axis, 0)[a:b] = part
                nbytes += part.nbytes
        self.mailbox[(d, ins.peer, ins.tag)] = msg
        moved = self.stats.bytes_moved
        moved[(d, ins.peer)] = moved.get((d, ins.peer), 0) + nbytes
        self.stats.transfers += 1
        return True

    def visit_recv(self, ins, d):
        key = (ins.peer, d, ins.tag)
        if key not in self.mailbox:
            return False
        self.put(d, ins.dst, self.mailbox.pop(key))
        return True

    def visit_kernel(self, ins, d):
        m = self.mem[d]
        eqn = self.prog.eqns[ins.eqn]
        info = self.info(d)
        args = [a if isinstance(a, tuple) else m[a] for a in ins.ins]
        try:
            outs = run_block(eqn, ins.fspec, args, [info[name].dtype for name in ins.outs],
                             None if ins.acc is None else m[ins.acc])
        except (DTypeError, IndexRangeError) as err:   # a value the kernel refuses
            power = getattr(err, "power", None)
            if power is None:
                raise self.prog.eqn_error(ins.eqn, err) from None
            # the run goes on (zeros in place of the block) so that every block of the eqn
            # is seen: execute() then reports the first such eqn with its most negative
            # exponent over all blocks, as jit (the whole array) and the GPU kernels do
            self.refused[ins.eqn] = min(power, self.refused.get(ins.eqn, power))
            outs = [np.zeros(info[name].box.shape, info[name].dtype) for name in ins.outs]
        for name, o in zip(ins.outs, outs):
            self.put(d, name, o)
        self.stats.kernels += 1
        return True

    def visit_store(self, ins, d):
        if self.keep:   # the block stays on its device (the buffer is never written again)
            self.kept[ins.output][(d, ins.box)] = self.mem[d][ins.src]
            return True
        self.results[ins.output][box_index(ins.box)] = self.mem[d][ins.src]
        return True

    def visit_free(self, ins, d):
        self.live[d] -= self.mem[d].pop(ins.buf).nbytes
        return True


def execute(dprog, inputs, consts=None, keep=False):
    """Run device program ``dprog`` on ``inputs`` (one per program input: numpy arrays, or
    :class:`eins.runtime.sharded.Sharded` arrays of the virtual devices, read where their
    blocks are). Returns (outputs tuple, Stats): whole numpy arrays, or with ``keep`` each
    output as a Sharded array of the blocks its Stores left on the devices."""
    prog = dprog.program
    consts = [c for _, c in prog.consts] if consts is None else consts
    for k, (v, a) in enumerate(zip(prog.inputs, inputs)):
        if tuple(a.shape) != tuple(v.shape):
            raise EinsError(f"input {k}: expected shape {v.shape}, got {tuple(a.shape)}")
    run = _Devices(dprog, inputs, consts, keep)
    pcs = {d: 0 for d in dprog.devices}
    remaining = sum(len(c) for c in dprog.code.values())
    while remaining:
        progressed = False
        for d in dprog.devices:
            code = dprog.code.get(d, [])
            while pcs[d] < len(code) and run.visit(code[pcs[d]], d):
                pcs[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {d: code[pcs[d]] for d, code in dprog.code.items() if pcs[d] < len(code)}
            raise LoweringError(f"device program deadlocked at {stuck}")
    if run.refused:
        i = min(run.refused)
        raise prog.eqn_error(i, negative_power_error(run.refused[i]))
    if run.mailbox:
        raise LoweringError(f"{len(run.mailbox)} messages were sent but never received")
    if keep:
        return tuple(Sharded(v.shape, v.dtype, list(blocks), dict(enumerate(blocks.values())),
                             "numpy", np.asarray)
                     for v, blocks in zip(prog.outputs, run.kept)), run.stats
    return tuple(run.results), run.stats
