"""lower: the exchange IR to the device IR (docs/architecture.md; Section 5.3's decompose and
recompose kernels around each exchange program).

The instructions are emitted in one global topological order (eqns in program order; inside
an exchange, actions in dataflow firing order), so per-device lists with non-blocking sends
cannot deadlock. Each exchange is bracketed by ``slice`` (decompose each resident producer
block into its atoms) and ``concat`` (recompose the delivered, aggregated atoms into the block
the concrete operator expects).
"""
from __future__ import annotations

from dataclasses import replace
from itertools import repeat
from operator import itemgetter


from eins.errors import LoweringError
from eins.ir import exprog
from eins.ir.device import (Agg, BufInfo, Concat, DeviceProgram, Kernel, Load, Recv,
                            Send, Slice, Store)
from eins.ir.joinagg import partial_dtype
from eins.ir.program import Literal
from eins.ir.types import Box
from eins.passes.frees import insert_frees
from eins.passes.pipeline import pipeline_code, worth_for


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


class _Fired:
    """An exchange program's fired actions (:func:`fired_actions`) with what lowering one
    device's share needs: each action's first tag (relative to the exchange's), the tags
    the exchange uses in all, and per device the actions it takes part in (at their site,
    or sending or receiving in a hop). Built once per distinct program and membership, so
    the blocks of a stack share it."""

    def __init__(self, program, membership):
        self.actions = fired_actions(program, membership)
        self.first_tag, self.of_device = [], {}
        n = 0
        for i, (act, s, _) in enumerate(self.actions):
            self.first_tag.append(n)
            taking = {s}
            senders = [s]
            for hop in act.hops:
                for j, d in enumerate(hop):
                    taking.add(senders[j % len(senders)])
                    taking.add(d)
                    n += 1
                senders = list(hop)
            for d in taking:
                self.of_device.setdefault(d, []).append(i)
        self.tags = n


class _Schedule:
    """What lowering one exchange needs beyond the rank's own instructions, the same on every
    rank: its program's fired actions (:class:`_Fired`, shared by the exchanges of equal
    programs and memberships), its atoms per copy, each atom's cell, each cell's full
    aggregate, and per device the copies it holds and the needs delivered to it."""

    def __init__(self, x, fired):
        self.fired = fired
        self.atoms_of_copy, self.cell_of = {}, {}
        for a, (c, j) in x.atoms.items():
            self.atoms_of_copy.setdefault(j, []).append((a, c))
            self.cell_of[a] = c
        self.full = x.cell_aggregates()
        self.copies_of, self.needs_of = {}, {}
        for j, cp in enumerate(x.copies):
            self.copies_of.setdefault(cp.device, []).append(j)
        for f, (pname, _) in enumerate(x.needs):
            self.needs_of.setdefault(x.membership[pname][0], []).append(f)


def _program_index(xir, program) -> int:
    """A small int standing for ``program`` in ``xir`` (equal programs, equal ints): an
    ExProg's hash walks all its actions, and a stack's exchanges share few program objects,
    so each object is hashed once (kept beside its int, so that its id stays its own)."""
    ids = xir.derived.setdefault("program ids", {})
    got = ids.get(id(program))
    if got is None or got[0] is not program:
        by_value = xir.derived.setdefault("programs", {})
        got = ids[id(program)] = (program, by_value.setdefault(program, len(by_value)))
    return got[1]


def _membership_key(x) -> tuple:
    return tuple(sorted((k, tuple(v)) for k, v in x.membership.items()))


def _schedule(xir, x) -> _Schedule:
    """``x``'s :class:`_Schedule`, built once per exchange IR (``xir.derived``)."""
    got = xir.derived.get(id(x))
    if got is None:
        fkey = ("fired", _program_index(xir, x.program), _membership_key(x))
        fired = xir.derived.get(fkey)
        if fired is None:   # repeated layers repeat their exchange programs
            fired = xir.derived[fkey] = _Fired(x.program, x.membership)
        got = xir.derived[id(x)] = (x, _Schedule(x, fired))   # x kept: its id stays its own
    return got[1]


def share_schedules(old, new) -> None:
    """Give exchange IR ``new`` (a re-cut of ``old``: eins/passes/relower.py) the firing
    schedules ``old`` built: its programs and exchanges that are ``old``'s are not fired
    again (the rank tables depend on the plan, and are not shared)."""
    new.derived.update((k, v) for k, v in old.derived.items() if k != "rank tables")


def exchange_schedules(xir) -> int:
    """Build what every rank's lowering of ``xir`` reads and no rank's alone needs (each
    exchange's :class:`_Schedule`: the firing order of every distinct exchange program over
    all devices; :class:`_RankTables`): a rank process pays it once, as it pays the plan;
    how many distinct programs were fired."""
    for x in xir.exchanges:
        _schedule(xir, x)
    _rank_tables(xir, _sources(xir.plan.program))
    return sum(isinstance(v, _Fired) for v in xir.derived.values())


class _RankTables:
    """Per eqn, the function specifications each device runs, and every device's loads in
    the whole lowering's order (a rank records its peers' loads, :class:`Lowerer`): derived
    from the exchange IR alone, the same for every rank, built once per exchange IR."""

    def __init__(self, xir, sources):
        prog, plan = xir.plan.program, xir.plan
        self.fspecs_on = []
        self.loads = {}
        seen = set()

        def load(d, var, box):
            key = (d, sources[id(var)], box)
            if key not in seen:
                seen.add(key)
                self.loads.setdefault(d, []).append(key[1:])

        for i, eqn in enumerate(prog.eqns):
            devs = xir.placement[i]
            on = {}
            for fi, d in enumerate(devs):
                on.setdefault(d, []).append(fi)
            self.fspecs_on.append(on)
            delivered = {k for x in xir.for_eqn(i) for k in x.inputs}
            delivered.update(k for _, ks in xir.serving(i) for k in ks)
            for fi, fs in enumerate(plan.eqn_plans[i].spec.fspecs):
                for k, a in enumerate(eqn.inputs):
                    if not isinstance(a, Literal) and k not in delivered and id(a) in sources:
                        load(devs[fi], a, fs.inputs[k])
        outx = {o for x in xir.for_eqn(-1) for o in x.inputs}
        for o, v in enumerate(prog.outputs):
            if o not in outx and id(v) in sources:
                load(plan.devices[0], v, Box.full(v.shape))


def _sources(prog) -> dict:
    """id(value) -> ("in", k) / ("const", k) for the program's inputs and constants."""
    out = {id(v): ("in", k) for k, v in enumerate(prog.inputs)}
    out.update({id(v): ("const", k) for k, (v, _) in enumerate(prog.consts)})
    return out


def _rank_tables(xir, sources) -> _RankTables:
    got = xir.derived.get("rank tables")
    if got is None:
        got = xir.derived["rank tables"] = _RankTables(xir, sources)
    return got


class _Template:
    """One exchange's instructions with its buffers and tags as references: per device, the
    buffers it creates (by creation order there), the producer's blocks it reads (by copy)
    and its tags (from its first), replayed for another exchange of the same shape, which
    then gets the same instructions as if lowered afresh (the buffers are numbered per
    device, in the same order). A replay stamps each device's instructions in one list
    (a device's instructions do not depend on another's emission order)."""

    def __init__(self, x, recording, out, base, tags, kernel_out):
        # names are per device: a producer's blocks on two devices may share one
        srcs = {(cp.device, kernel_out[(x.producer, x.out_pos, cp.fspec)]): j
                for j, cp in enumerate(x.copies)}
        made, news, copies, ops = {}, {}, {}, {}   # per device
        for ev in recording:
            if ev[0] == "new":
                _, d, name, hint, info = ev
                mine = news.setdefault(d, [])
                made.setdefault(d, {})[name] = len(mine)
                mine.append((hint, info.box, info.partial))
                copies.setdefault(d, {})   # copy index -> its place among d's
                continue
            _, d, ins = ev
            mine, used = made.setdefault(d, {}), copies.setdefault(d, {})
            news.setdefault(d, [])

            def ref(b, mine=mine, used=used, d=d):   # ("n", k) a new buffer, ("c", k) a copy's
                k = mine.get(b)
                if k is not None:
                    return ("n", k)
                return ("c", used.setdefault(srcs[(d, b)], len(used)))

            if isinstance(ins, (Send, Recv)):
                buf = ins.src if isinstance(ins, Send) else ins.dst
                op = (type(ins), ref(buf), ins.peer, ins.tag - base)
            elif isinstance(ins, (Agg, Concat)):
                op = (type(ins), ref(ins.dst), tuple(ref(b) for b in ins.srcs),
                      ins.op if isinstance(ins, Agg) else ins.box)
            elif isinstance(ins, Slice):
                op = (Slice, ref(ins.dst), ref(ins.src), ins.box)
            else:  # pragma: no cover - an exchange emits only the kinds above
                raise LoweringError(f"exchange lowering emitted {ins.kind}")
            ops.setdefault(d, []).append(op)
        # the distinct blocks (box, partial) of the new buffers, one BufInfo each per replay
        self.blocks = list(dict.fromkeys((box, partial) for mine in news.values()
                                         for _, box, partial in mine))
        at_block = {b: k for k, b in enumerate(self.blocks)}
        self.boxes = [box for box, _ in self.blocks]
        self.partials = [partial for _, partial in self.blocks]
        # a device's table: its new buffers, then the copies' blocks it reads
        self.devices = []
        for d, mine in news.items():
            n = len(mine)

            def at(r, n=n):
                return r[1] if r[0] == "n" else n + r[1]

            code = [(cls, at(a), b, c) if cls is Send or cls is Recv else
                    (Slice, at(a), at(b), c) if cls is Slice else
                    (cls, at(a), tuple(at(r) for r in b), c)
                    for cls, a, b, c in ops.get(d, ())]
            self.devices.append((d, _Stamp([h for h, _, _ in mine],
                                           [at_block[(box, p)] for _, box, p in mine],
                                           list(copies[d]), code)))
        self.out = {}
        for f, (d, b) in out.items():
            k = made.get(d, {}).get(b)
            self.out[f] = (d, k, None if k is not None else srcs[(d, b)])
        self.tags = tags

    def replay(self, low, x) -> dict:
        dtype = low._dtype(x)
        pdtype = partial_dtype(x.op, dtype)
        var = x.var_name
        infos = list(map(BufInfo, repeat(var), self.boxes,
                         [pdtype if p else dtype for p in self.partials], self.partials))
        code_of, bufs_of = low.device_program.code, low.device_program.bufs
        chunks = low.chunks
        if chunks:
            chunk_code = low.chunk_code.setdefault(low.chunk, {})
            chunk_bufs = low.chunk_bufs.setdefault(low.chunk, {})
        counts, kernel_out = low.counts, low.kernel_out
        producer, pos, cps = x.producer, x.out_pos, x.copies
        base, low.next_tag = low.next_tag, low.next_tag + self.tags
        names_of = {}
        for d, st in self.devices:
            n0 = counts.get(d, 0)
            counts[d] = n0 + st.made
            # t: the device's new buffers' names, then the copies' blocks it reads
            names = list(map(str.__add__, st.hints, map(str, range(n0, n0 + st.made))))
            names_of[d] = names
            if names:
                made = dict(zip(names, st.blocks(infos)))
                bufs_of.setdefault(d, {}).update(made)
                if chunks:
                    chunk_bufs.setdefault(d, {}).update(made)
            t = names + [kernel_out[(producer, pos, cps[j].fspec)] for j in st.used]
            code = st.stamp(t, base)
            if code:
                code_of.setdefault(d, []).extend(code)
                if chunks:
                    chunk_code.setdefault(d, []).extend(code)
        return {f: (d, names_of[d][k] if k is not None
                    else kernel_out[(producer, pos, cps[j].fspec)])
                for f, (d, k, j) in self.out.items()}


def _take(idx):
    """A function of a sequence: its items at ``idx``, as a tuple (C-level, itemgetter)."""
    if len(idx) == 1:
        i, = idx
        return lambda t: (t[i],)
    return itemgetter(*idx) if idx else (lambda t: ())


class _Stamp:
    """One device's share of a :class:`_Template`: its new buffers (hints, blocks), the
    copies it reads, and its instructions by kind in columns (each kind built by one
    ``map`` over its operands, then put in program order by one gather), so that a replay
    runs no Python loop per instruction. ``code``: (class, a, b, c) per instruction, the
    buffers as indices into the replay's table (new buffers, then the copies' blocks)."""

    def __init__(self, hints, blocks, used, code):
        self.hints, self.made, self.used = hints, len(hints), used
        self.blocks = _take(blocks)
        cols = {Send: [], Recv: [], Slice: [], None: []}
        for k, op in enumerate(code):
            cols[op[0] if op[0] in cols else None].append((k, op))
        self.parts = []
        for cls in (Send, Recv, Slice):
            mine = cols[cls]
            if not mine:
                continue
            self.parts.append((cls, _take([op[1] for _, op in mine]),
                               _take([op[2] for _, op in mine]) if cls is Slice else
                               [op[2] for _, op in mine],
                               [op[3] for _, op in mine]))
        self.others = [op for _, op in cols[None]]
        # instruction k of the device's program is item order[k] of the columns joined
        order, at = [0] * len(code), 0
        for cls in (Send, Recv, Slice, None):
            for k, _ in cols[cls]:
                order[k] = at
                at += 1
        self.gather = _take(order)

    def stamp(self, t, base) -> tuple:
        """The instructions for buffer table ``t`` and tags from ``base``."""
        made = []
        for cls, first, second, third in self.parts:
            if cls is Slice:   # Slice(dst, src, box)
                made += map(Slice, first(t), second(t), third)
            else:              # Send(src, peer, tag) / Recv(dst, peer, tag)
                made += map(cls, first(t), second, map(base.__add__, third))
        for cls, a, b, c in self.others:   # few: aggregates and concats
            made.append(cls(t[a], tuple([t[r] for r in b]), c))
        return self.gather(made)


class Lowerer:
    """Lowers an exchange IR; with ``rank`` set, only that device's instructions (each one
    equal to the whole lowering's: buffers are numbered per device and every exchange's tags
    follow from the tags of the exchanges before it, so a rank need not build the others')."""

    # the exchanges of a shape lowered afresh before one is recorded for replay: a template
    # costs about a lowering to build and saves under half of one per replay (a stack's
    # layers replay theirs; an exchange lowered once, or twice, is better lowered afresh)
    RECORD_AFTER = 0

    def __init__(self, xir, rank=None, replay=True, chunks=False, pipeline=False):
        self.xir = xir
        self.replay = replay   # False: lower every exchange afresh (what a replay must equal)
        self.chunks = chunks   # record what each eqn emitted (a relower family's needs it)
        self.plan = xir.plan
        self.prog = xir.plan.program
        self.rank = rank
        self.pipeline = pipeline   # piece the kernels whose keys arrive (finish)
        self.device_program = DeviceProgram(tuple(self.plan.devices), program=self.prog,
                                            rank=rank, tags=0, stores={}, loads={},
                                            exchange=xir)
        self.names = self.prog.var_names()
        self.counts = {}       # device -> buffers named so far
        self.next_tag = 0
        self.kernel_out = {}   # (eqn, out pos, fspec) -> buffer name
        self.loaded = {}       # (device, source, box) -> buffer name
        self.templates = {}    # an exchange's shape -> _Template
        self.recording = None  # the new() and emit() calls of an exchange being recorded
        self.sources = _sources(self.prog)
        self.tables = None
        if rank is not None:   # the peers' loads as every rank derives them, its own built
            self.tables = _rank_tables(xir, self.sources)
            self.device_program.loads.update(
                (d, ls) for d, ls in self.tables.loads.items() if d != rank)
        # with ``chunks``, what each eqn emitted (its input exchanges and kernels;
        # len(eqns): the outputs'), so a re-cut of some eqns re-lowers only theirs
        # (eins/passes/relower.py); a plain lowering keeps no second copy of its program
        self.chunk = 0
        self.chunk_code = {}    # chunk -> {device: instructions}
        self.chunk_bufs = {}    # chunk -> {device: {buffer: BufInfo}}
        self.chunk_loads = {}   # chunk -> {(device, source, box): buffer} it loaded first
        self.got = {}           # (eqn, inputs) of an exchange -> its delivered blocks
        self.keep_names = {}    # (eqn, out pos, fspec) -> kernel output name to reuse
        # eqn -> {input: (producer eqn, its output)}: read in each function specification
        # where the producer's same one wrote it, with no exchange in the IR (relower_device);
        # -1 -> {program output: its producer}: each block stored where it was written
        self.local = {}

    def mine(self, d) -> bool:
        return self.rank is None or d == self.rank

    def new(self, d, info: BufInfo, hint="b", name=None) -> str:
        if name is None:
            n = self.counts.get(d, 0)
            self.counts[d] = n + 1
            name = f"{hint}{n}"
        self.device_program.bufs.setdefault(d, {})[name] = info
        if self.chunks:
            self.chunk_bufs.setdefault(self.chunk, {}).setdefault(d, {})[name] = info
        if self.recording is not None:
            self.recording.append(("new", d, name, hint, info))
        return name

    def emit(self, d, ins):
        self.device_program.code.setdefault(d, []).append(ins)
        if self.chunks:
            self.chunk_code.setdefault(self.chunk, {}).setdefault(d, []).append(ins)
        if self.recording is not None:
            self.recording.append(("emit", d, ins))

    def load(self, d, var, box) -> str:
        src = self.sources.get(id(var))
        if src is None:
            raise LoweringError(f"variable {self.names.get(id(var), var)} has no producer")
        key = (d, src, box)
        name = self.loaded.get(key)   # one lookup: a Box hashes in Python
        if name is None:
            if not self.mine(d):   # a rank's peers' loads: recorded already (_RankTables)
                return None
            self.device_program.loads.setdefault(d, []).append((src, box))
            name = self.new(d, BufInfo(self.names[id(var)], box, var.dtype), "in")
            self.emit(d, Load(name, src, box))
            self.loaded[key] = name
            if self.chunks:
                self.chunk_loads.setdefault(self.chunk, {})[key] = name
        return name

    def exchange(self, x) -> dict:
        """Emit one exchange; returns {consumer fspec index: (device, block buffer)} (of this
        rank's consumers only, with ``rank``). The whole lowering replays an exchange equal
        to one lowered before but for its variable's name and its producer's buffers (the
        layers of a stack): :class:`_Template`. An exchange that moves nothing
        (``Exchange.local``: each block read where its producer wrote it) emits nothing."""
        if x.program is not None and not x.program.actions and x.local_members(x.membership):
            out = self.kernel_out
            return {f: (cp.device, out[(x.producer, x.out_pos, cp.fspec)])
                    for f, cp in enumerate(x.copies) if self.mine(cp.device)}
        if self.rank is not None or not self.replay:
            return self._exchange(x)
        dtype = self._dtype(x)
        key = (_program_index(self.xir, x.program), _membership_key(x), id(x.atoms),
               id(x.cells), x.copies, x.needs, x.op, dtype)
        t = self.templates.get(key)
        if t is None or type(t) is int:   # lowered afresh that many times before
            if (t or 0) < self.RECORD_AFTER:
                self.templates[key] = (t or 0) + 1
                return self._exchange(x)
            self.recording = []
            base = self.next_tag
            out = self._exchange(x)
            # recorded; its template is built when an exchange of its shape comes again
            self.templates[key] = (x, self.recording, out, base, self.next_tag - base)
            self.recording = None
            return out
        if type(t) is tuple:
            t = self.templates[key] = _Template(*t, self.kernel_out)
        return t.replay(self, x)

    def _exchange(self, x) -> dict:
        dtype = self._dtype(x)
        # partials of a ⊕ of pairs (lse) are pairs; a full aggregate has the var's dtype
        pdtype = partial_dtype(x.op, dtype)
        infos = {}

        def var_info(box, partial=False):   # one BufInfo per block: a stack repeats them
            key = (box, partial)
            got = infos.get(key)
            if got is None:
                got = infos[key] = BufInfo(x.var_name, box, pdtype if partial else dtype,
                                           partial)
            return got

        rank = self.rank
        held = {}  # device -> {aggregate: buffer}
        sched = _schedule(self.xir, x)
        fired, atoms_of_copy, cell_of, full = sched.fired, sched.atoms_of_copy, sched.cell_of, \
            sched.full
        for j in (range(len(x.copies)) if rank is None else sched.copies_of.get(rank, ())):
            cp = x.copies[j]
            src = self.kernel_out[(x.producer, x.out_pos, cp.fspec)]
            for a, c in atoms_of_copy.get(j, ()):
                cell = x.cells[c]
                if cell == cp.box:
                    buf = src
                else:
                    buf = self.new(cp.device, var_info(cell, cp.partial), "at")
                    self.emit(cp.device, Slice(buf, src, cell))
                held.setdefault(cp.device, {})[frozenset([a])] = buf
        base, self.next_tag = self.next_tag, self.next_tag + fired.tags
        order = range(len(fired.actions)) if rank is None else fired.of_device.get(rank, ())
        for i in order:
            act, s, cover = fired.actions[i]
            tag = base + fired.first_tag[i]
            c0 = cell_of[next(iter(act.agg))]
            cell = x.cells[c0]
            partial = act.agg != full[c0]
            if rank is None or s == rank:
                here = held.setdefault(s, {})
                if act.agg not in here:
                    buf = self.new(s, var_info(cell, partial), "ag")
                    self.emit(s, Agg(buf, tuple(here[c] for c in cover), x.op or "sum"))
                    here[act.agg] = buf
            senders = [s]
            for hop in act.hops:
                for j, d in enumerate(hop):
                    # site j of a relay hop is sent by site j mod len of the previous hop
                    # (the simulator's round-robin, eins/hardware/simulate.py)
                    frm = senders[j % len(senders)]
                    if rank is None or frm == rank:
                        self.emit(frm, Send(held[frm][act.agg], d, tag))
                    if rank is None or d == rank:
                        rbuf = self.new(d, var_info(cell, partial), "rx")
                        self.emit(d, Recv(rbuf, frm, tag))
                        held.setdefault(d, {}).setdefault(act.agg, rbuf)
                    tag += 1
                senders = hop
        out = {}
        for f in (range(len(x.needs)) if rank is None else sched.needs_of.get(rank, ())):
            pname, block = x.needs[f]
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
        self.device_program.tags = self.next_tag
        self.finish()
        return self.device_program

    def finish(self):
        """The kernels whose keys arrive from other devices pieced (``pipeline``:
        eins/passes/pipeline.py), then the frees placed."""
        if self.pipeline:
            pipeline_code(self.device_program, self.prog.producers(), self.xir.placement,
                          self.plan, worth_for(self.pipeline, self.xir.topology))
        self.insert_frees()

    def eqn(self, i):
        """Emit eqn i: its input exchanges, then one kernel per function specification
        (this rank's only, with ``rank``; the others' loads recorded)."""
        eqn, xir = self.prog.eqns[i], self.xir
        spec = self.plan.eqn_plans[i].spec
        devs = xir.placement[i]
        delivered = {}
        for x in xir.for_eqn(i):
            got = self.got[(x.eqn, x.inputs)] = self.exchange(x)
            delivered.update((k, got) for k in x.inputs)
        for x, ks in xir.serving(i):   # blocks an earlier eqn's exchange delivered
            delivered.update((k, self.got[(x.eqn, x.inputs)]) for k in ks)
        for k, (pe, pos) in self.local.get(i, {}).items():   # no exchange: where written
            delivered[k] = [(d, self.kernel_out[(pe, pos, f)]) for f, d in enumerate(devs)]
        # per input: a literal's operand, a delivered block per fspec, or None (loaded)
        how = [("lit", a.value, a.dtype) if isinstance(a, Literal) else delivered.get(k)
               for k, a in enumerate(eqn.inputs)]
        # per output: its name, dtype, and (⊕ spec outputs) multiplicity and partial dtype
        outs_how = [(j, self.names[id(v)], v.dtype,
                     None if agg is None else spec.multiplicity(j),
                     None if agg is None else partial_dtype(agg, v.dtype))
                    for j, (v, agg) in enumerate(zip(eqn.outputs, spec.aggs))]
        mine = (range(len(spec.fspecs)) if self.rank is None else
                self.tables.fspecs_on[i].get(self.rank, ()))   # a rank: its own only
        new, emit, keep, kernel_out = self.new, self.emit, self.keep_names, self.kernel_out
        for fi in mine:
            fs, d = spec.fspecs[fi], devs[fi]
            args = []
            for k, h in enumerate(how):
                if h is None:
                    args.append(self.load(d, eqn.inputs[k], fs.inputs[k]))
                elif type(h) is tuple:   # a literal
                    args.append(h)
                else:
                    dd, buf = h[fi]
                    if dd != d:
                        raise LoweringError(f"eqn {i} input {k} delivered to device {dd}, "
                                            f"kernel runs on {d}")
                    args.append(buf)
            outs = []
            for j, name, dt, mult, pdt in outs_how:
                box = fs.outputs[j]
                partial = mult is not None and mult[box] > 1
                buf = new(d, BufInfo(name, box, pdt if partial else dt, partial), "k",
                          keep.get((i, j, fi)))
                kernel_out[(i, j, fi)] = buf
                outs.append(buf)
            emit(d, Kernel(tuple(outs), tuple(args), i, fs))

    def outputs(self):
        """Emit the program outputs: their exchanges, then one store per block (every
        device's recorded in ``stores``)."""
        outx = {o: x for x in self.xir.for_eqn(-1) for o in x.inputs}
        gathered = {}   # id(exchange) -> its delivered blocks (an output returned twice)
        stores = self.device_program.stores
        local = self.local.get(-1, {})
        for o, v in enumerate(self.prog.outputs):
            if o in outx:
                x = outx[o]
                if id(x) not in gathered:
                    gathered[id(x)] = self.got[(x.eqn, x.inputs)] = self.exchange(x)
                got = gathered[id(x)]
                for f, (pname, block) in enumerate(x.needs):
                    d = x.membership[pname][0]
                    stores.setdefault(d, []).append((o, block))
                    if self.mine(d):
                        self.emit(d, Store(got[f][1], o, block))
            elif o in local:   # no exchange: each block stored where it was written
                pe, pos = local[o]
                for f, (fs, d) in enumerate(zip(self.plan.eqn_plans[pe].spec.fspecs,
                                                self.xir.placement[pe])):
                    block = fs.outputs[pos]
                    stores.setdefault(d, []).append((o, block))
                    if self.mine(d):
                        self.emit(d, Store(self.kernel_out[(pe, pos, f)], o, block))
            else:  # an input or constant returned as is
                d = self.plan.devices[0]
                box = Box.full(v.shape)
                stores.setdefault(d, []).append((o, box))
                buf = self.load(d, v, box)
                if self.mine(d):
                    self.emit(d, Store(buf, o, box))

    def insert_frees(self):
        """A Free after each buffer's last use (:func:`eins.passes.frees.insert_frees`)."""
        insert_frees(self.device_program)


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
    return replace(state, device=lower_exchanges(state.exchange, pipeline=state.options.pipeline))


def lower_exchanges(xir, rank=None, pipeline=False) -> DeviceProgram:
    """The device IR of an exchange IR; with ``rank`` (a device of the plan), only that
    device's instructions and buffers (``code`` and ``bufs`` hold that device alone, each
    instruction equal to the whole lowering's), with every device's loads, stores and the
    tag count (:class:`eins.ir.device.DeviceProgram`), which the rank runtime needs of its
    peers. A rank of ``devices="world"`` lowers so."""
    if rank is not None and rank not in xir.plan.devices:
        raise LoweringError(f"rank {rank!r} is not a device of the plan "
                            f"{list(xir.plan.devices)}")
    return Lowerer(xir, rank, pipeline=pipeline).run()
