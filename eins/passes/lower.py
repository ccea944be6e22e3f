"""lower: the exchange IR to the device IR (docs/architecture.md; Section 5.3's decompose and
recompose kernels around each exchange program).

The instructions are emitted in one global topological order (eqns in program order; inside
an exchange, actions in dataflow firing order), so per-device lists with non-blocking sends
cannot deadlock. Each exchange is bracketed by ``slice`` (decompose each resident producer
block into its atoms) and ``concat`` (recompose the delivered, aggregated atoms into the block
the concrete operator expects).
"""
from __future__ import annotations

import itertools
from dataclasses import replace


from eins.errors import LoweringError
from eins.ir import exprog
from eins.ir.device import (Agg, BufInfo, Concat, DeviceProgram, Free, Kernel, Load, Recv,
                            Send, Slice, Store)
from eins.ir.joinagg import partial_dtype
from eins.ir.program import Literal
from eins.ir.types import Box


def fired_actions(program, membership):
    """Actions of an ExProg in dataflow order (``eins.ir.exprog.firing_order``), each as
    (action, site, operands): the aggregates present at the site that partition it, the
    cover reading the fewest bytes (the one the simulator charges)."""
    sizes = exprog.atom_sizes(program)
    present = {}
    for a in program.inputs:
        present.setdefault(a.site, set()).add(frozenset([a.name]))
    out = []
    for i, s in exprog.firing_order(program, membership):
        act = program.actions[i]
        cover = exprog.exact_cover(act.agg, present.get(s, set()),
                                   lambda y: exprog.agg_size(sizes, y))
        if cover is None:  # pragma: no cover - firing_order only lists enabled actions
            raise LoweringError(f"exchange action {act} at site {s} is not enabled")
        out.append((act, s, cover))
        present.setdefault(s, set()).add(act.agg)
        for hop in act.hops:
            for d in hop:
                present.setdefault(d, set()).add(act.agg)
    return out


class Lowerer:
    def __init__(self, xir):
        self.xir = xir
        self.plan = xir.plan
        self.prog = xir.plan.program
        self.device_program = DeviceProgram(tuple(self.plan.devices), program=self.prog)
        self.names = self.prog.var_names()
        self.counter = itertools.count()
        self.tags = itertools.count()
        self.kernel_out = {}   # (eqn, out pos, fspec) -> buffer name
        self.loaded = {}       # (device, source, box) -> buffer name
        self.fired = {}        # (exchange program, membership) -> fired_actions
        self.sources = {id(v): ("in", k) for k, v in enumerate(self.prog.inputs)}
        self.sources.update({id(v): ("const", k) for k, (v, _) in enumerate(self.prog.consts)})
        # what each eqn emitted (its input exchanges and kernels; len(eqns): the outputs'),
        # so a re-cut of some eqns re-lowers only theirs (eins/passes/relower.py)
        self.chunk = 0
        self.chunk_code = {}    # chunk -> {device: instructions}
        self.chunk_bufs = {}    # chunk -> {device: {buffer: BufInfo}}
        self.chunk_loads = {}   # chunk -> {(device, source, box): buffer} it loaded first
        self.got = {}           # (eqn, inputs) of an exchange -> its delivered blocks
        self.keep_names = {}    # (eqn, out pos, fspec) -> kernel output name to reuse

    def new(self, d, info: BufInfo, hint="b", name=None) -> str:
        name = name or f"{hint}{next(self.counter)}"
        self.device_program.bufs.setdefault(d, {})[name] = info
        self.chunk_bufs.setdefault(self.chunk, {}).setdefault(d, {})[name] = info
        return name

    def emit(self, d, ins):
        self.device_program.code.setdefault(d, []).append(ins)
        self.chunk_code.setdefault(self.chunk, {}).setdefault(d, []).append(ins)

    def load(self, d, var, box) -> str:
        src = self.sources.get(id(var))
        if src is None:
            raise LoweringError(f"variable {self.names.get(id(var), var)} has no producer")
        key = (d, src, box)
        if key not in self.loaded:
            name = self.new(d, BufInfo(self.names[id(var)], box, var.dtype), "in")
            self.emit(d, Load(name, src, box))
            self.loaded[key] = name
            self.chunk_loads.setdefault(self.chunk, {})[key] = name
        return self.loaded[key]

    def exchange(self, x) -> dict:
        """Emit one exchange; returns {consumer fspec index: (device, block buffer)}."""
        dtype = self._dtype(x)
        # partials of a ⊕ of pairs (lse) are pairs; a full aggregate has the var's dtype
        pdtype = partial_dtype(x.op, dtype)
        var_info = lambda box, partial=False: BufInfo(x.var_name, box,
                                                      pdtype if partial else dtype, partial)
        held = {}  # device -> {aggregate: buffer}
        atoms_of_copy = {}
        for a, (c, j) in x.atoms.items():
            atoms_of_copy.setdefault(j, []).append((a, c))
        for j, cp in enumerate(x.copies):
            src = self.kernel_out[(x.producer, x.out_pos, cp.fspec)]
            for a, c in atoms_of_copy.get(j, ()):
                cell = x.cells[c]
                if cell == cp.box:
                    buf = src
                else:
                    buf = self.new(cp.device, var_info(cell, cp.partial), "at")
                    self.emit(cp.device, Slice(buf, src, cell))
                held.setdefault(cp.device, {})[frozenset([a])] = buf
        cell_of = {a: c for a, (c, _) in x.atoms.items()}
        full = x.cell_aggregates()
        fkey = (x.program, tuple(sorted((k, tuple(v)) for k, v in x.membership.items())))
        fired = self.fired.get(fkey)
        if fired is None:   # repeated layers repeat their exchange programs
            fired = self.fired[fkey] = fired_actions(x.program, x.membership)
        for act, s, cover in fired:
            here = held.setdefault(s, {})
            cell = x.cells[cell_of[next(iter(act.agg))]]
            partial = act.agg != full[cell_of[next(iter(act.agg))]]
            if act.agg in here:
                buf = here[act.agg]
            else:
                buf = self.new(s, var_info(cell, partial), "ag")
                self.emit(s, Agg(buf, tuple(here[c] for c in cover), x.op or "sum"))
                here[act.agg] = buf
            senders = [s]
            for hop in act.hops:
                for j, d in enumerate(hop):
                    # site j of a relay hop is sent by site j mod len of the previous hop
                    # (the simulator's round-robin, eins/hardware/simulate.py)
                    frm = senders[j % len(senders)]
                    tag = next(self.tags)
                    self.emit(frm, Send(held[frm][act.agg], d, tag))
                    rbuf = self.new(d, var_info(cell, partial), "rx")
                    self.emit(d, Recv(rbuf, frm, tag))
                    held.setdefault(d, {}).setdefault(act.agg, rbuf)
                senders = list(hop)
        out = {}
        for f, (pname, block) in enumerate(x.needs):
            d = x.membership[pname][0]
            have = held.get(d, {})
            parts = []
            for c in x.grid.cells_within(block):
                if full[c] not in have:
                    raise LoweringError(
                        f"exchange for {x.var_name}: {'+'.join(sorted(full[c]))} missing "
                        f"at device {d}")
                parts.append((x.cells[c], have[full[c]]))
            if len(parts) == 1 and parts[0][0] == block:
                out[f] = (d, parts[0][1])
            else:
                buf = self.new(d, var_info(block), "blk")
                self.emit(d, Concat(buf, tuple(p[1] for p in parts), block))
                out[f] = (d, buf)
        return out

    def _dtype(self, x):
        e = self.prog.eqns[x.producer]
        return e.outputs[x.out_pos].dtype

    def run(self):
        for i in range(len(self.prog.eqns)):
            self.chunk = i
            self.eqn(i)
        self.chunk = len(self.prog.eqns)
        self.outputs()
        self.insert_frees()
        return self.device_program

    def eqn(self, i):
        """Emit eqn i: its input exchanges, then one kernel per function specification."""
        eqn, xir = self.prog.eqns[i], self.xir
        spec = self.plan.eqn_plans[i].spec
        devs = xir.placement[i]
        delivered = {}
        for x in xir.for_eqn(i):
            got = self.got[(x.eqn, x.inputs)] = self.exchange(x)
            delivered.update((k, got) for k in x.inputs)
        for x, ks in xir.serving(i):   # blocks an earlier eqn's exchange delivered
            delivered.update((k, self.got[(x.eqn, x.inputs)]) for k in ks)
        mult = [spec.multiplicity(j) if spec.aggs[j] is not None else None
                for j in range(len(eqn.outputs))]
        for fi, fs in enumerate(spec.fspecs):
            d = devs[fi]
            args = []
            for k, a in enumerate(eqn.inputs):
                if isinstance(a, Literal):
                    args.append(("lit", a.value, a.dtype))
                elif k in delivered:
                    dd, buf = delivered[k][fi]
                    if dd != d:
                        raise LoweringError(f"eqn {i} input {k} delivered to device {dd}, "
                                            f"kernel runs on {d}")
                    args.append(buf)
                else:
                    args.append(self.load(d, a, fs.inputs[k]))
            outs = []
            for j, v in enumerate(eqn.outputs):
                partial = mult[j] is not None and mult[j][fs.outputs[j]] > 1
                dt = partial_dtype(spec.aggs[j], v.dtype) if partial else v.dtype
                buf = self.new(d, BufInfo(self.names[id(v)], fs.outputs[j], dt, partial), "k",
                               self.keep_names.get((i, j, fi)))
                self.kernel_out[(i, j, fi)] = buf
                outs.append(buf)
            self.emit(d, Kernel(tuple(outs), tuple(args), i, fs))

    def outputs(self):
        """Emit the program outputs: their exchanges, then one store per block."""
        outx = {o: x for x in self.xir.for_eqn(-1) for o in x.inputs}
        gathered = {}   # id(exchange) -> its delivered blocks (an output returned twice)
        for o, v in enumerate(self.prog.outputs):
            if o in outx:
                x = outx[o]
                if id(x) not in gathered:
                    gathered[id(x)] = self.got[(x.eqn, x.inputs)] = self.exchange(x)
                got = gathered[id(x)]
                for f, (pname, block) in enumerate(x.needs):
                    d, buf = got[f]
                    self.emit(d, Store(buf, o, block))
            else:  # an input or constant returned as is
                d = self.plan.devices[0]
                box = Box.full(v.shape)
                self.emit(d, Store(self.load(d, v, box), o, box))

    def insert_frees(self):
        """A Free after each buffer's last use (its definition when never read)."""
        for d, code in self.device_program.code.items():
            last = {}
            for n, ins in enumerate(code):
                for b in ins.uses():
                    last[b] = n
                for b in ins.defs():
                    if b not in last:
                        last[b] = n
            after = {}
            for b, n in last.items():
                after.setdefault(n, []).append(b)
            new = []
            for n, ins in enumerate(code):
                new.append(ins)
                bs = after.get(n)
                if bs:
                    new.extend(Free(b) for b in sorted(bs))
            self.device_program.code[d] = new


def lower(state):
    """The lower pass: ``state.device`` = the device IR of ``state.exchange``.

    >>> import eins
    >>> from eins.ir.plan import Compilation, Options
    >>> prog = eins.make_ir(lambda x, w: (x @ w).sum(axis=0))(
    ...     eins.ShapeDtype((16, 4), "float32"), eins.ShapeDtype((4, 4), "float32"))
    >>> state = Compilation(prog, (0, 1), Options(cost="proxy"))
    >>> from eins.passes import PLANNING, overlay, place, run_passes, synthesize
    >>> state = lower(run_passes(state, PLANNING + (place, overlay, synthesize)))
    >>> [ins.kind for ins in state.device.code[1]]   # device 1 sends its partial sum
    ['load', 'load', 'kernel', 'free', 'free', 'kernel', 'free', 'send', 'free']
    """
    return replace(state, device=lower_exchanges(state.exchange))


def lower_exchanges(xir) -> DeviceProgram:
    """The device IR of an exchange IR."""
    return Lowerer(xir).run()
