"""overlay: the atoms and the ExProg preamble of every consumer input (Section 5.3).

For input k of an eqn, produced by an eqn whose join-agg spec left one block copy per
producing function specification on its device, the atoms are the cells of the overlay of the
producer's output tiling and the consumer's required blocks ``in_k(J)``. The preamble has
``IN``: one atom per (cell, copy) at the copy's device with its size in bytes;
``PARTITIONS``: one of size one per consumer function specification; ``OUT``: the
⊕-aggregate of each cell's copies at every partition whose block contains the cell.
Program inputs, constants and literals need no exchange: they are loaded straight into the
blocks each function specification needs (the paper's materialization "in any tiling").
Program outputs get one more exchange each: every output block ⊕-aggregated at the device of
its first copy, from where the host reads it.

The pass builds every preamble under the naive placement. Only the sites depend on the
placement (atoms' in IN, partitions' members): when the optimized schedule moves an eqn, the
synthesize pass takes these exchanges and :func:`placed` moves their sites, by this module's
rules, rather than building them again from the plan.
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from itertools import chain
from dataclasses import replace
from types import MappingProxyType

from eins.errors import LoweringError
from eins.hardware.net import resolve_topology
from eins.ir.exchange import Copy, Exchange, ExchangeIR
from eins.ir.joinagg import partial_itemsize
from eins.ir.memo import Memo
from eins.ir.exprog import AtomDecl, ExProg, Partition, Requirement
from eins.ir.plan import schedule_name
from eins.ir.program import Var
from eins.ir.types import Grid


def producer_copies(plan, placement, prod_eqn: int, out_pos: int) -> tuple:
    spec = plan.eqn_plans[prod_eqn].spec
    mult = spec.multiplicity(out_pos)
    partial = spec.aggs[out_pos] is not None
    return tuple(Copy(f.outputs[out_pos], placement[prod_eqn][fi], fi,
                      partial and mult[f.outputs[out_pos]] > 1)
                 for fi, f in enumerate(spec.fspecs))


def build_exchange(plan, placement, names, eqn: int, k: int, var, prod, needs_blocks,
                   fixed_members=None) -> Exchange:
    """The exchange moving ``var`` (output ``prod[1]`` of eqn ``prod[0]``) to the blocks
    ``needs_blocks`` (one per consumer function specification). ``fixed_members``: devices
    of the consumer function specifications when already decided (partitions declared by
    members); otherwise partitions are declared by size and synthesis places them."""
    pe, pos = prod
    pspec = plan.eqn_plans[pe].spec
    copies = producer_copies(plan, placement, pe, pos)
    # atoms of partial copies under a ⊕ of pairs (lse) are pairs: their bytes are what moves
    itemsize = partial_itemsize(pspec.aggs[pos] if any(cp.partial for cp in copies) else None,
                                var.dtype)
    # the overlay depends on these alone; a stack of equal layers repeats them, so each
    # distinct overlay is built once (the key hashes in time linear in the blocks)
    key = (copies, tuple(needs_blocks), itemsize,
           None if fixed_members is None else tuple(fixed_members), tuple(plan.devices))
    hit = _OVERLAYS.get(key)
    if hit is None:
        hit = _OVERLAYS.put(key, _overlay(tuple(plan.devices), copies, needs_blocks, itemsize,
                                          fixed_members))
    grid, cells, atoms, needs, pre = hit
    op = pspec.aggs[pos] if any(cp.partial for cp in copies) else None
    return Exchange(eqn, k, names[id(var)], pe, pos, op, itemsize, grid, cells, copies, atoms,
                    needs, pre)


# within a call that re-cuts a plan, kept for that call (eins.ir.memo)
_OVERLAYS = Memo("overlays", 1024)


def exchange_preamble(devices, copies, needs_blocks, itemsize) -> ExProg:
    """The preamble (no body) of the exchange moving producer block ``copies[j]`` (a Box on
    device position ``j``) into consumer blocks ``needs_blocks[f]`` (on position ``f``),
    ``itemsize`` bytes per element, under the naive placement of ``devices``: what
    :func:`build_exchange` builds for such a producer and consumer (the DP prices exchanges
    so, before any plan exists)."""
    cps = tuple(Copy(b, devices[j], j, False) for j, b in enumerate(copies))
    return _overlay(tuple(devices), cps, tuple(needs_blocks), itemsize,
                    [devices[f] for f in range(len(needs_blocks))])[4]


def _overlay(devices, copies, needs_blocks, itemsize, fixed_members):
    grid = Grid.of_boxes([c.box for c in copies] + list(needs_blocks))
    cells = tuple(grid.boxes())
    at = {b: c for c, b in enumerate(cells)}

    def within(box):   # a block that is one cell (copies and needs cut alike): no search
        c = at.get(box)
        return (c,) if c is not None else grid.cells_within(box)

    atoms, ins = {}, []
    for j, cp in enumerate(copies):
        for c in within(cp.box):
            name = f"A{c}_{j}"
            atoms[name] = (c, j)
            ins.append(AtomDecl(name, cp.device, cells[c].size * itemsize))
    by_cell = {}
    for a, (c, _) in atoms.items():
        by_cell.setdefault(c, set()).add(a)
    parts, needs, outs = [], [], []
    for f, block in enumerate(needs_blocks):
        pname = f"S{f}"
        if fixed_members is None:
            parts.append(Partition(pname, 1))
        else:
            parts.append(Partition(pname, 1, (fixed_members[f],)))
        needs.append((pname, block))
        for c in within(block):
            outs.append(Requirement(frozenset(by_cell[c]), (pname,)))
    pre = ExProg(devices, tuple(parts), tuple(ins), tuple(outs), ())
    # read-only: the cache hands this one mapping to every exchange with this overlay
    return grid, cells, MappingProxyType(atoms), tuple(needs), pre


def reads_as_written(plan, placement, i: int, k: int, pe: int, pos: int) -> bool:
    """Whether every block of eqn ``i``'s input ``k`` is exactly what its producer (output
    ``pos`` of eqn ``pe``) wrote, function specification by function specification, on
    the same device (the common case: both cut alike)."""
    if tuple(placement[i]) != tuple(placement[pe]):
        return False
    return [f.inputs[k] for f in plan.eqn_plans[i].spec.fspecs] == \
        [f.outputs[pos] for f in plan.eqn_plans[pe].spec.fspecs]


def moves_nothing(plan, placement, i: int, k: int, prod) -> bool:
    """Whether the exchange :func:`build_exchange` builds for input ``k`` of eqn ``i``
    (output ``prod[1]`` of eqn ``prod[0]``) with the consumer at ``placement[i]`` moves
    nothing (``Exchange.local``), told from the blocks without building it: function
    specification f of the consumer reads exactly the block f of the producer wrote, on the
    same device, and those blocks are apart (:func:`written_apart`). False for some local
    exchanges cut along more dimensions (their overlay tells)."""
    pe, pos = prod
    return reads_as_written(plan, placement, i, k, pe, pos) and written_apart(plan, prod)


def output_moves_nothing(plan, prod) -> bool:
    """Whether the exchange :func:`output_exchanges` builds for a program output written as
    output ``prod[1]`` of eqn ``prod[0]`` moves nothing (``Exchange.local``): its blocks are
    apart (:func:`written_apart`), so each is gathered where it was written, by the one
    function specification that wrote it. False for some such exchanges cut along more
    dimensions, as :func:`moves_nothing`."""
    return written_apart(plan, prod)


def written_apart(plan, prod) -> bool:
    """Whether the blocks of output ``prod[1]`` of eqn ``prod[0]``, one per function
    specification, are non-empty, disjoint and cut along one dimension at most: each is one
    cell of their overlay with any blocks cut alike, written by that function specification
    alone (no ⊕ of partial copies)."""
    pe, pos = prod
    los = [f.outputs[pos].lo for f in plan.eqn_plans[pe].spec.fspecs]
    his = [f.outputs[pos].hi for f in plan.eqn_plans[pe].spec.fspecs]
    # per dimension, every block's bounds along it (C-level: each re-cut asks, per input)
    along = list(zip(zip(*los), zip(*his)))
    cut = [d for d, (ls, hs) in enumerate(along)
           if ls.count(ls[0]) != len(ls) or hs.count(hs[0]) != len(hs)]
    if len(cut) > 1 or any(map(operator.ge, chain.from_iterable(los),
                               chain.from_iterable(his))):
        return False
    if not cut:
        return len(los) == 1
    spans = sorted(zip(*along[cut[0]]))
    return all(map(operator.le, [hi for _, hi in spans[:-1]], [lo for lo, _ in spans[1:]]))


def eqn_exchanges(plan, placement, names, producers, i: int, fixed=None, skip=()) -> list:
    """The exchanges feeding eqn i: one per input produced by another eqn (but the inputs
    in ``skip``), except that an input reading the same variable in the same blocks as an
    earlier input of the eqn (``y * y``) is delivered by that input's exchange (its
    ``also``)."""
    eqn = plan.program.eqns[i]
    spec = plan.eqn_plans[i].spec
    out, first = [], {}   # (var, needed blocks) -> index in out
    for k, a in enumerate(eqn.inputs):
        if not isinstance(a, Var) or id(a) not in producers or k in skip:
            continue
        needs = tuple(f.inputs[k] for f in spec.fspecs)
        n = first.get((id(a), needs))
        if n is not None:
            out[n] = replace(out[n], also=out[n].also + (k,))
            continue
        first[(id(a), needs)] = len(out)
        out.append(build_exchange(plan, placement, names, i, k, a, producers[id(a)], needs,
                                  fixed))
    return out


def output_exchanges(plan, placement, names, producers, skip=()) -> list:
    """Program outputs (but the outputs in ``skip``): each output block ⊕-aggregated at the
    device of its first copy; a variable returned again (``return y, y``) is gathered once
    (its exchange's ``also``)."""
    out, first = [], {}   # var -> index in out
    for o, v in enumerate(plan.program.outputs):
        if id(v) not in producers or o in skip:
            continue
        n = first.get(id(v))
        if n is not None:
            out[n] = replace(out[n], also=out[n].also + (o,))
            continue
        first[id(v)] = len(out)
        pe, pos = producers[id(v)]
        owners = _owners(producer_copies(plan, placement, pe, pos))
        out.append(build_exchange(plan, placement, names, -1, o, v, (pe, pos), list(owners),
                                  list(owners.values())))
    return out


def _owners(copies) -> dict:
    """{block: the device of its first copy}, in the copies' order: where a program output's
    block is ⊕-aggregated for the host to read."""
    owners = {}
    for cp in copies:
        owners.setdefault(cp.box, cp.device)
    return owners


def overlay(state):
    """The overlay pass: ``state.exchange`` = an ExchangeIR holding every exchange's
    preamble under ``state.placement`` (no bodies yet), with the schedule and the resolved
    topology the synthesize pass reads (``state.topology``, resolved here only where
    planning went without one: the proxy beyond the default topology's devices).

    >>> import eins
    >>> from eins.ir.plan import Compilation, Options
    >>> prog = eins.make_ir(lambda x, w: (x @ w).sum(axis=0))(
    ...     eins.ShapeDtype((16, 4), "float32"), eins.ShapeDtype((4, 4), "float32"))
    >>> state = Compilation(prog, (0, 1), Options(cost="proxy"))
    >>> from eins.passes import PLANNING, place, run_passes
    >>> state = overlay(place(run_passes(state, PLANNING)))
    >>> print(state.exchange.exchanges[-1].preamble, end="")   # the output: 2 partial sums
    GPUS: 0, 1
    PARTITIONS: S0 {0}
    IN: A0_0 @ 0 (size: 16 B); A0_1 @ 1 (size: 16 B)
    OUT: A0_0+A0_1 @ S0
    """
    o = state.options
    topo = state.topology
    if topo is None:
        topo = resolve_topology(o.topology, state.devices, o.profile)
    return replace(state, topology=topo,
                   exchange=exchange_ir(state.plan, state.placement, o.schedule, topo))


def exchange_ir(plan, placement, schedule, topology) -> ExchangeIR:
    """The ExchangeIR of ``plan`` under ``placement``: every exchange's preamble, in program
    order (each eqn's inputs in order, then the program outputs)."""
    return ExchangeIR(plan, dict(placement), all_exchanges(plan, placement),
                      schedule_name(schedule), topology)


def all_exchanges(plan, placement) -> list:
    """Every exchange of the program under a fixed placement."""
    names = plan.program.var_names()
    producers = plan.program.producers()
    out = []
    for i in range(len(plan.program.eqns)):
        out += eqn_exchanges(plan, placement, names, producers, i,
                             fixed=placement[i])
    return out + output_exchanges(plan, placement, names, producers)


def placed(x: Exchange, placement, free: bool = False) -> Exchange:
    """Exchange ``x`` (a preamble this pass built) under another ``placement``: the
    producer's copies on ``placement[x.producer]``; the consumer's partitions declared by
    members at ``placement[x.eqn]`` (a program output's at the device of each block's first
    copy, as :func:`output_exchanges` puts them), or by size when ``free`` (synthesis then
    chooses them, Section 5.1). The grid, cells, atoms, needs and OUT do not depend on the
    placement and are kept; ``x`` itself is returned when nothing moves."""
    if x.program is not None:
        raise LoweringError(f"exchange of {x.var_name} into eqn {x.eqn} input {x.input} "
                            f"already has a body: only a preamble can be placed again")
    devs = placement[x.producer]
    copies = tuple(cp if cp.device == devs[cp.fspec] else replace(cp, device=devs[cp.fspec])
                   for cp in x.copies)
    if free:
        members = [None] * len(x.needs)
    elif x.eqn < 0:
        owners = _owners(copies)
        members = [(owners[block],) for _, block in x.needs]
    else:
        members = [(placement[x.eqn][f],) for f in range(len(x.needs))]
    pre = x.preamble
    parts = tuple(Partition(pname, 1, m) for (pname, _), m in zip(x.needs, members))
    if copies == x.copies and parts == pre.partitions:
        return x
    # the layers of a stack share one preamble object (build_exchange) and are mostly moved
    # alike: each such move builds its preamble once, and synthesis then meets the same
    # object again (eins.passes.synthesize.caches.prog_key)
    key = (id(pre), id(x.atoms), tuple(cp.fspec for cp in x.copies), devs, parts)
    hit = _PLACED.get(key)
    if hit is None or hit[0] is not pre or hit[1] is not x.atoms:
        ins = tuple(AtomDecl(a.name, copies[x.atoms[a.name][1]].device, a.size)
                    for a in pre.inputs)
        hit = _PLACED[key] = (pre, x.atoms, replace(pre, partitions=parts, inputs=ins))
        while len(_PLACED) > _PLACED_MAX:
            _PLACED.popitem(last=False)
    return replace(x, copies=copies, preamble=hit[2])


# (id(preamble), id(atoms), copies' fspecs, producer devices, partitions) -> (preamble,
# atoms, the placed preamble): the ids' objects are held, so their ids are not reused
_PLACED: OrderedDict = OrderedDict()
_PLACED_MAX = 256
