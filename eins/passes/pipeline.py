"""Pipelined key exchange (issue 36): a kernel whose keys arrive from other devices runs in
pieces, one per arriving block, each as soon as its block is there, instead of one kernel
after the whole exchange.

Where it applies: an eqn whose operator names operands cut along a contracted index its
kernel can run in pieces (``Primitive.pipeline``: attention's keys and values along the
key rows, whose pieces are partials of the ``lse`` ⊕, exact in any order), on a device
whose blocks of those operands are stitched (``Concat``) from parts of which at least one
is received. Context parallelism by query rows is the case: a device's queries attend to
keys that other devices produced.

The rewrite, per such kernel: the stitching goes; one kernel per device that wrote keys
it reads (its own first, then each peer's, the nearest rows first: under a causal mask
the device's own rows come just after its neighbour's), each over the function
specification with those operands cut to that device's part (``piece_fspec``), each
joining the running (o, lse) pairs of the one before it (``Kernel.acc``, eins.ir.device)
and the last writing the output block. A part the exchange delivered in several atoms
(it cuts a device's block wherever another device's needs end) is stitched, a peer's
once its atoms are here, this device's cut again from its block. Each peer's receives
move to just before the kernel of the piece before its own, so a runtime that posts a
receive where it stands and waits for its data where it is first read (eins.runtime.ranks)
holds at most two parts in flight and computes on one while the next arrives (ring
attention's double buffering, without a ring: each part comes straight from the device
that wrote it). A kernel stays whole where its keys are not parts written here or by one
peer each (a relay's, stitched or summed ones), where one buffer is two operands or is
read elsewhere too, or where a peer's receives would change order (the rank runtime
matches gloo messages by tag; under NCCL's grouped point-to-point calls, which match in
order per pair, moving receives out of the group their peer's sends were posted with is
not known to be safe: ranks over NCCL refuse pieces).

What is decided here and not in the plan: the plan keeps one function specification per
device (Definition 3.6); the pieces split its kernel, not its boxes, so the DP, the
exchanges and the bytes moved are the plan's. Every backend runs the pieces (on the GPU
the Triton attention kernel starts its online softmax from the running pairs), where the
user asks (``Options.pipeline``: ``eins.distribute(..., pipeline=True)``); the time model
prices them (eins.cost.predict.Timeline.pipelined).
"""
from __future__ import annotations

import operator

from eins.cost.predict import pieces_pay
from eins.ir.device import BufInfo, Concat, Free, Kernel, Load, Recv, Send, Slice
from eins.ir.joinagg import FunctionSpec
from eins.ir.pieces import pair_itemsize, pieced, running_dtype
from eins.ir.types import Box

__all__ = ["pays", "piece_fspec", "pipeline_code", "plan_pieces", "worth_for"]


def pays(topology):
    """``worth`` for :func:`pipeline_code` and :func:`plan_pieces` on ``topology``: the time
    model's rule (eins.cost.predict.pieces_pay)."""
    def worth(eqn, fspecs):
        return pieces_pay(eqn, fspecs, topology, pair_itemsize(eqn))
    return worth


def worth_for(option, topology):
    """The ``worth`` that ``Options.pipeline`` = ``option`` means on ``topology``: None
    (every piece the device code allows) for "always" or without a topology, else
    :func:`pays`."""
    return None if option == "always" or topology is None else pays(topology)


def piece_fspec(fspec, operands, boxes) -> FunctionSpec:
    """``fspec`` with operand ``operands[n]``'s box replaced by ``boxes[n]``."""
    ins = list(fspec.inputs)
    for a, b in zip(operands, boxes):
        ins[a] = b
    return FunctionSpec(tuple(ins), fspec.outputs)


def _interval(box: Box, axis: int) -> tuple:
    return box.lo[axis], box.hi[axis]


def _distance(part: tuple, rows: tuple) -> int:
    """How far key rows ``part`` [a, b) lie from output rows ``rows`` [qa, qb)."""
    (a, b), (qa, qb) = part, rows
    return qa - b if b <= qa else (a - qb if a >= qb else 0)


def pipeline_code(dprog, producers=None, placement=None, plan=None, worth=None) -> int:
    """Rewrite ``dprog`` in place (before its frees are placed; module docstring); with
    ``producers`` (``Program.producers()``), ``placement`` and ``plan``, a received part
    is pieced only when its peer wrote it (a relayed part keeps the kernel whole); with
    ``worth`` (``(eqn, piece fspecs) -> bool``, the time model's
    eins.cost.predict.pieces_pay), only where it says the pieces pay. -> kernels pieced."""
    prog = dprog.program
    eqns = {i: got for i, e in enumerate(prog.eqns) if (got := pieced(e)) is not None}
    if not eqns:
        return 0
    done = 0
    writers = _Writers(producers, placement, plan) if producers is not None else None
    for d, code in dprog.code.items():
        defs, uses, kernels = {}, {}, []
        # the kernels, loads and transfers by hand (Instr.defs, Instr.uses): most of the
        # instructions, read on every call's re-lowering
        for n, ins in enumerate(code):
            t = type(ins)
            if t is Kernel:
                if ins.acc is None:
                    if ins.eqn in eqns:
                        kernels.append(n)
                else:
                    uses[ins.acc] = uses.get(ins.acc, 0) + 1
                for x in ins.ins:
                    if isinstance(x, str):   # not a literal
                        uses[x] = uses.get(x, 0) + 1
                for x in ins.outs:
                    defs[x] = n
                continue
            if t is Load:
                defs[ins.dst] = n
                continue
            if t is Send and ins.window is None:   # a windowed one reads its table too
                uses[ins.src] = uses.get(ins.src, 0) + 1
                continue
            if t is Recv:
                defs[ins.dst] = n
                continue
            if t is Free:
                raise ValueError("pipeline_code runs before the frees are placed")
            for x in ins.defs():
                defs[x] = n
            for x in ins.uses():
                uses[x] = uses.get(x, 0) + 1
        if not kernels:
            continue
        bufs = dprog.bufs[d]
        gone, bodies, made = set(), {}, []
        for n in kernels:
            ins = code[n]
            got = _pieces(code, bufs, defs, uses, ins, eqns[ins.eqn], writers, prog)
            if got is None or (worth is not None and not worth(
                    prog.eqns[ins.eqn], [piece_fspec(ins.fspec, eqns[ins.eqn][0],
                                                     [_box(bufs, b) for b in bs])
                                         for _, bs, _ in got])):
                continue
            drop, body, new_bufs = _rewrite(code, bufs, ins, eqns[ins.eqn], got, defs, uses)
            gone |= drop
            bodies[n] = body
            made.append(new_bufs)
        if not bodies:
            continue
        new = []
        for n, ins in enumerate(code):
            if n in bodies:
                new += bodies[n]
            elif n not in gone:
                new.append(ins)
        if not _peer_order_kept(code, new):
            continue   # a peer's receives would change order: every kernel stays whole
        for nb in made:
            bufs.update(nb)
        code[:] = new
        done += len(bodies)
    return done


def _pieces(code, bufs, defs, uses, k, how, writers, prog):
    """[(interval, [part buffer per operand], peer or None)] of kernel ``k`` in running
    order, or None where it stays whole."""
    operands, axis = how
    if len({k.ins[a] for a in operands}) < len(operands):
        return None   # one buffer for two operands (attention(q, k, k)): read elsewhere too
    concats = []
    for a in operands:
        src = k.ins[a]
        c = code[defs[src]] if isinstance(src, str) and src in defs else None
        if type(c) is not Concat or c.windows is not None or uses.get(src) != 1:
            return None
        concats.append(c)
    parts = {}   # interval -> [buffer per operand]
    peers = {}   # interval -> {peer or None}
    for n, (a, c) in enumerate(zip(operands, concats)):
        whole = k.fspec.inputs[a]
        for s in c.srcs:
            box = bufs[s].box
            iv = _interval(box, axis)
            if (box.lo, box.hi) != _bounds_with(whole, axis, iv):
                return None   # parts cut along another axis too
            parts.setdefault(iv, [None] * len(operands))[n] = s
            r = code[defs[s]] if s in defs else None
            if type(r) is Slice:   # a local part cut from a larger block written here
                r = code[defs[r.src]] if r.src in defs else None
                if type(r) not in (Kernel, Load):
                    return None
            elif type(r) not in (Recv, Kernel, Load):
                return None   # stitched or summed here: kept whole
            elif type(r) is Recv and uses.get(s) != 1:
                return None   # relayed on too (a multicast tree): its receive stays put
            peers.setdefault(iv, set()).add(r.peer if type(r) is Recv else None)
    if len(parts) < 2 or any(None in bs for bs in parts.values()):
        return None
    if all(ps == {None} for ps in peers.values()):
        return None   # nothing received
    if any(len(ps) > 1 for ps in peers.values()):
        return None   # one part from two places
    if writers is not None:
        e = prog.eqns[k.eqn]
        for iv, bs in parts.items():
            (peer,) = peers[iv]
            if peer is not None and not all(writers.wrote(peer, e, a, bufs[b].box)
                                            for a, b in zip(operands, bs)):
                return None
    peer = {iv: next(iter(ps)) for iv, ps in peers.items()}
    count = {}   # parts per peer, in first-seen order
    for e in peer.values():
        count[e] = count.get(e, 0) + 1
    for e, n in count.items():
        if n > 1 and not _merge(code, bufs, defs, parts, peer, e, axis, len(operands)):
            return None
    return [(iv, parts[iv], peer[iv])
            for iv in _running_order(peer, _interval(k.fspec.outputs[0], axis))]


def _running_order(peer, rows) -> list:
    """The key intervals of ``peer`` {interval: the device that wrote it, None: this one}
    in the order their pieces run: this device's keys first, then each peer's, the nearest
    to output rows ``rows`` first (under a causal mask a device's rows follow its
    neighbour's). One order for the lowering and the estimate (:func:`plan_pieces`)."""
    return sorted(peer, key=lambda iv: (peer[iv] is not None, _distance(iv, rows), iv))


def _box(bufs, part) -> Box:
    """A part's box: its buffer's, or a merged part's (:func:`_merge`)."""
    return part[2] if isinstance(part, tuple) else bufs[part].box


def _merge(code, bufs, defs, parts, peer, e, axis, n) -> bool:
    """The parts from ``e`` (a peer, or None: this device's own) as one, in place: the
    exchange cuts a device's block wherever another device's needs end, so it arrives in
    several atoms, which one piece reads stitched (a peer's, ``("concat", atoms, box)``,
    after all of them, its receives in the order the peer sends them) or cut again from
    the block they were cut from (this device's, ``("slice", source, box, atoms)``). So
    the pieces are one per device that wrote keys, what :func:`plan_pieces` prices.
    False where they cannot be one (not adjacent; local cuts of different blocks)."""
    mine = sorted(iv for iv, x in peer.items() if x == e)
    if len(mine) < 2:
        return True
    if any(a[1] != b[0] for a, b in zip(mine, mine[1:])):
        return False
    whole = (mine[0][0], mine[-1][1])
    merged = []
    for x in range(n):
        atoms = tuple(parts[iv][x] for iv in mine)
        box = _with(bufs[atoms[0]].box, axis, whole)
        if e is not None:
            merged.append(("concat", atoms, box))
            continue
        defs_x = [code[defs[b]] for b in atoms]
        if any(type(r) is not Slice for r in defs_x) or len({r.src for r in defs_x}) > 1:
            return False
        merged.append(("slice", defs_x[0].src, box, atoms))
    for iv in mine:
        del parts[iv]
        del peer[iv]
    parts[whole] = merged
    peer[whole] = e
    return True


def _with(box: Box, axis: int, iv: tuple) -> Box:
    return Box(*_bounds_with(box, axis, iv))


def _bounds_with(box: Box, axis: int, iv: tuple) -> tuple:
    """(lo, hi) of ``box`` with ``axis`` cut to ``iv`` [a, b), no Box built."""
    a = axis % len(box.lo)
    return (box.lo[:a] + (iv[0],) + box.lo[a + 1:], box.hi[:a] + (iv[1],) + box.hi[a + 1:])


class _Writers:
    """Where the producers of a program's variables wrote their blocks (``producers``:
    ``Program.producers()``, ``placement``, ``plan``), gathered per producer as asked."""

    def __init__(self, producers, placement, plan):
        self.producers, self.placement, self.plan = producers, placement, plan
        self.held: dict = {}   # (producer, output) -> {device: [its blocks' boxes]}

    def wrote(self, peer, eqn, a, box) -> bool:
        """Whether device ``peer`` wrote ``box`` of operand ``a`` of ``eqn``: a block of the
        operand's producer placed there holds it."""
        pj, oi = self.producers.get(id(eqn.inputs[a]), (None, None))
        if pj is None:
            return False
        got = self.held.get((pj, oi))
        if got is None:
            got = self.held[(pj, oi)] = {}
            for dev, f in zip(self.placement[pj], self.plan.eqn_plans[pj].spec.fspecs):
                got.setdefault(dev, []).append(f.outputs[oi])
        return any(o.contains(box) for o in got.get(peer, ()))


def _rewrite(code, bufs, k, how, pieces, defs, uses):
    """-> (positions of ``code`` the pieces replace besides the kernel's own: the
    stitching, the received parts' receives; the instructions in the kernel's place; the
    running pairs' buffers)."""
    operands = how[0]
    out, = k.outs
    info = bufs[out]
    pair = BufInfo(info.var, info.box, running_dtype(info.dtype), True)
    drop = {defs[k.ins[a]] for a in operands}   # the stitching
    recvs = {}   # piece -> the receives of its parts
    for j, (_, bs, peer) in enumerate(pieces):
        if peer is not None:
            for b in bs:
                for atom in (b[1] if isinstance(b, tuple) else (b,)):
                    drop.add(defs[atom])
                    recvs.setdefault(j, []).append(code[defs[atom]])
    body, made, acc = [], {}, None
    for j, (iv, bs, _) in enumerate(pieces):
        names, stitch = [], []
        for x, b in enumerate(bs):
            if isinstance(b, tuple) and b[0] == "slice":   # this device's atoms: cut anew
                _, src, box, olds = b
                b = f"{out}_l{x}"
                made[b] = BufInfo(bufs[src].var, box, bufs[src].dtype)
                body.append(Slice(b, src, box))
                drop.update(defs[o] for o in olds if uses.get(o) == 1)
            elif isinstance(b, tuple):   # a peer's atoms, stitched once they are here
                _, atoms, box = b
                b = f"{out}_r{j}_{x}"
                made[b] = BufInfo(bufs[atoms[0]].var, box, bufs[atoms[0]].dtype)
                stitch.append(Concat(b, atoms, box))
            names.append(b)
        bs = names
        fs = piece_fspec(k.fspec, operands, [(made.get(b) or bufs[b]).box for b in bs])
        ins = list(k.ins)
        for a, b in zip(operands, bs):
            ins[a] = b
        dst = out if j == len(pieces) - 1 else f"{out}_p{j}"
        if dst != out:
            made[dst] = pair
        # each piece's receives just before the kernel of the piece before it (the first
        # piece's, and the second's, where the kernel stood)
        if j == 0:
            body += sorted(recvs.get(0, ()), key=lambda r: r.tag)
        body += sorted(recvs.get(j + 1, ()), key=lambda r: r.tag)
        body += stitch
        body.append(Kernel((dst,), tuple(ins), k.eqn, fs, acc))
        acc = dst
    return drop, body, made


def _peer_order_kept(old, new) -> bool:
    """Whether every peer's receives come in the same order in ``new`` as in ``old``."""
    def order(code):
        got = {}
        for ins in code:
            if type(ins) is Recv:
                got.setdefault(ins.peer, []).append(ins.tag)
        return got
    return order(old) == order(new)


def plan_pieces(plan, placement, producers, j, worth=None, cache=None) -> dict | None:
    """What :func:`pipeline_code` makes of eqn ``j`` under ``plan`` and ``placement``,
    from the boxes alone (a family's per-call estimate, eins.passes.rebalance): {device:
    [(piece fspec, ((peer, bytes), ...))]} in running order, each part where its
    producer wrote it; None when the eqn is not pieced on any device (it has no
    ``Primitive.pipeline``, no device reads a part written elsewhere, or its operands'
    parts are not priced so: cut apart, or overlapping); ``worth`` as
    :func:`pipeline_code`'s; ``cache``: a dict the caller keeps, holding the last layout's
    parts (a family whose boxes no call moves, a heads split, asks for the same every
    call)."""
    eqn = plan.program.eqns[j]
    how = pieced(eqn)
    if how is None:
        return None
    got = _plan_parts(plan, placement, producers, j, eqn, how, {} if cache is None else cache)
    if got is None:
        return None
    out, any_remote = {}, False
    for d, (whole, pcs) in got.items():
        if pcs is None or (worth is not None and not worth(eqn, [g for g, _ in pcs])):
            out[d] = whole
            continue
        any_remote = True
        out[d] = pcs
    return out if any_remote else None


def _plan_parts(plan, placement, producers, j, eqn, how, cache):
    """{device: (its kernel whole, after what it receives; its pieces or None)} of eqn
    ``j``, or None (:func:`plan_pieces`)."""
    operands, axis = how
    if len({id(eqn.inputs[a]) for a in operands}) < len(operands):
        return None   # one variable for two operands: the lowering keeps it whole
    fspecs = plan.eqn_plans[j].spec.fspecs
    devs = placement[j]
    prods = []
    for a in operands:
        pj, oi = producers.get(id(eqn.inputs[a]), (None, None))
        if pj is None:
            return None
        prods.append((pj, oi))
    key = (fspecs, devs, tuple((plan.eqn_plans[pj].spec.fspecs, placement[pj], oi)
                               for pj, oi in prods),
           tuple(eqn.inputs[a].type.dtype for a in operands), how)
    # the last layout alone, compared rather than hashed: a layout no call moves keeps its
    # boxes (the same objects, equal at once), a moved one fails at its first changed box
    last = cache.get("layout")
    if last is not None and last[0] == key:
        return last[1]
    got = _parts(plan, placement, eqn, how, fspecs, devs, prods)
    cache["layout"] = (key, got)
    return got


def _parts(plan, placement, eqn, how, fspecs, devs, prods):
    operands, axis = how
    ax = axis % fspecs[0].inputs[operands[0]].rank
    srcs = []
    for pj, oi in prods:
        # the producer's blocks as (device, [lo, hi) along axis, the box's other bounds)
        srcs.append([(dev, ob.lo[ax], ob.hi[ax], _drop(ob.lo, ax), _drop(ob.hi, ax))
                     for dev, ob in ((dev, f.outputs[oi]) for dev, f in
                                     zip(placement[pj], plan.eqn_plans[pj].spec.fspecs))])
    # quick refusal: every device holds all it reads (a split that does not cut the keys)
    if all(any(dev == d and lo <= f.inputs[operands[0]].lo[ax]
               and f.inputs[operands[0]].hi[ax] <= hi for dev, lo, hi, _, _ in srcs[0])
           for d, f in zip(devs, fspecs)):
        return None
    out = {}
    for d, f in zip(devs, fspecs):
        parts = None
        for a, got in zip(operands, srcs):
            box = f.inputs[a]
            klo, khi = box.lo[ax], box.hi[ax]
            blo, bhi = _drop(box.lo, ax), _drop(box.hi, ax)
            mine = {}
            for dev, lo, hi, olo, ohi in got:
                lo, hi = max(lo, klo), min(hi, khi)
                if lo >= hi:
                    continue
                if not (olo == blo and ohi == bhi) and not (
                        all(map(operator.le, olo, blo)) and all(map(operator.le, bhi, ohi))):
                    return None   # the producer's block lacks other parts of the box
                mine[(lo, hi)] = None if dev == d else mine.get((lo, hi), dev)
            if parts is None:
                parts = mine
            elif parts != mine:
                return None
        lo, hi = f.inputs[operands[0]].lo[ax], f.inputs[operands[0]].hi[ax]
        if not parts or sum(b - a for a, b in parts) != hi - lo:
            return None
        rows_size = [f.inputs[x].size // max(hi - lo, 1) * eqn.inputs[x].type.dtype.itemsize
                     for x in operands]
        # whole, after what it receives: each operand's parts in turn, as its exchanges
        # deliver them
        got = sorted(parts.items())
        whole = [(f, tuple((e, (b - a) * r) for r in rows_size for (a, b), e in got
                           if e is not None))]
        if len(parts) < 2 or all(e is None for e in parts.values()):
            out[d] = (whole, None)
            continue
        # an operand whose box is the one before's (attention's keys and values) shares
        # its pieces' boxes
        same = [n and f.inputs[a] == f.inputs[operands[n - 1]] for n, a in enumerate(operands)]
        pcs = []
        for iv in _running_order(parts, _interval(f.outputs[0], axis)):
            e = parts[iv]
            boxes = []
            for n, a in enumerate(operands):
                boxes.append(boxes[-1] if same[n] else _with(f.inputs[a], ax, iv))
            recvs = () if e is None else tuple((e, (iv[1] - iv[0]) * r) for r in rows_size)
            pcs.append((piece_fspec(f, operands, boxes), recvs))
        out[d] = (whole, pcs)
    return out


def _drop(bounds: tuple, axis: int) -> tuple:
    """``bounds`` without the one of ``axis`` (>= 0)."""
    return bounds[:axis] + bounds[axis + 1:]
