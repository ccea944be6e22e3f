"""Incremental lowering of a re-cut plan family (issue 36): a call whose runtime parameters
re-cut some eqns (eins/passes/rebalance.py) re-lowers only what the re-cut can change and
takes everything else from the family's first lowering.

What a re-cut changes: the re-cut eqns' boxes, so the exchanges into them and out of them
(an exchange is built from its producer's and its consumer's specs), the kernels of the
re-cut eqns, and the device code that lowers those exchanges and kernels. The placement
(one device per function specification, the naive schedule's identity) is unchanged: a
re-cut keeps every split count. So, per call:

- overlay: the exchanges of the re-cut eqns and of their consumers are built again; every
  other eqn keeps the family's exchange objects;
- synthesize: each exchange object the family already gave a body keeps it (the walk itself
  is re-run: which exchange serves which later input depends on the new ones);
- lower: the device code is the family's, eqn by eqn (each eqn's input exchanges and
  kernels, :class:`eins.passes.lower.Lowerer`'s chunks), except for the eqns whose
  exchanges changed, or that read blocks an exchange of such an eqn delivered: those are
  lowered again, with fresh names for their new buffers and the family's names for their
  kernels' outputs and their loads (so the family's code after them reads what it read);
  then the frees are placed again over the whole program.

Only the naive schedule is incremental: the optimized one moves eqns by their exchanges'
synthesis, so the caller lowers from scratch there (``Family.incremental`` is False).
"""
from __future__ import annotations

from dataclasses import replace

from eins.ir.device import Load
from eins.ir.exchange import ExchangeIR
from eins.ir.program import Var
from eins.passes import PHYSICAL, per_call, run_passes
from eins.passes.lower import Lowerer, share_schedules
from eins.passes.overlay import (eqn_exchanges, moves_nothing, output_exchanges,
                                 output_moves_nothing, overlay)
from eins.passes.place import place
from eins.passes.synthesize.schedule import walk_exchanges
from eins.passes.verify import verify

__all__ = ["Family", "incremental", "lower_whole", "relower", "relower_device"]


def incremental(comp) -> bool:
    """Whether :func:`relower` serves ``comp``'s re-cuts: the naive schedule only (module
    docstring); the optimized one's are lowered whole (:func:`lower_whole`)."""
    return comp.options.schedule == "naive"


def lower_whole(comp):
    """``comp`` (a re-cut plan) placed, synthesized and lowered from scratch, its
    schedule's own way: the program an optimized-schedule call runs and is predicted by.
    No verify pass: the family's lowering ran it."""
    return run_passes(comp, tuple(p for p in PHYSICAL if p is not verify))


class Family:
    """The first lowering of a planned Compilation (``comp``, the family's compile-time
    cuts), with what :func:`relower` reuses: its overlay's exchanges, their bodies, and
    its device code per eqn. ``state`` is the lowered Compilation (no verify pass).
    ``rank``: one device's instructions alone (a rank of ``devices="world"``, as
    :func:`eins.passes.lower.lower_exchanges` lowers it), and so its re-cuts too."""

    def __init__(self, comp, rank=None):
        self.incremental = incremental(comp)
        self.rank = rank
        pre = overlay(place(comp))
        self.overlay = pre.exchange
        self.bodies: dict = {}
        xir = walk_exchanges(self.overlay, None, moves=False, bodies=self.bodies)
        # its chunks are what relower reuses
        self.lowerer = Lowerer(xir, rank, chunks=True, pipeline=comp.options.pipeline)
        device = self.lowerer.run()
        self.counts = dict(self.lowerer.counts)   # buffers named per device
        self.next_tag = self.lowerer.next_tag
        self.state = replace(pre, exchange=xir, placement=xir.placement, device=device)
        low = self.lowerer
        # per chunk, the family's loads it made first, as a re-lowering that redoes the
        # chunk emits them again: (block, device, buffer, its BufInfo, the Load)
        made = {(d, ins.dst): ins for got in low.chunk_code.values()
                for d, code in got.items() for ins in code if type(ins) is Load}
        self.reloads = {c: [(key, key[0], name, low.chunk_bufs[c][key[0]][name],
                             made[(key[0], name)]) for key, name in got.items()]
                        for c, got in low.chunk_loads.items()}
        # per chunk, the (device, buffer) of the family's loads its code reads: a re-lowering
        # that keeps the chunk keeps those loads (_drop_dead_loads)
        self.load_reads = {c: {(d, b) for d, code in got.items() for ins in code
                               for b in ins.uses() if (d, b) in made}
                           for c, got in low.chunk_code.items()}


class _Relowerer(Lowerer):
    """A re-lowering's :class:`Lowerer`: it records the (device, buffer) of every block its
    loads hand out, which is every block of a program input or constant that the code it
    emits reads (exchanges move eqn outputs, which are never loads). It lowers a few
    exchanges, rarely more than two of a shape (attention's keys and values), so it records
    the second of a shape for replay, not the first."""

    RECORD_AFTER = 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set = set()

    def load(self, d, var, box) -> str:
        name = Lowerer.load(self, d, var, box)
        self.read.add((d, name))
        return name


def _fed_by(prog, producers, eqns, i) -> bool:
    """Eqn ``i`` (``len(eqns)``: the program outputs) reads an output of one of ``eqns``."""
    vs = prog.eqns[i].inputs if i < len(prog.eqns) else prog.outputs
    return any(isinstance(a, Var) and producers.get(id(a), (None,))[0] in eqns for a in vs)


def _serving(xir, i) -> tuple:
    return tuple((x.eqn, x.inputs, ks) for x, ks in xir.serving(i))


def _drop_dead_loads(dp, reloaded: dict, read) -> None:
    """Remove the family's loads that a redone chunk emitted again but nothing reads: the
    family's first cut's blocks (its equal cuts, say) that the re-cut eqn no longer loads.
    Kept, each call would still copy them from the host, and a rank would load blocks of a
    Sharded input that its peers' load tables (the re-cut's) never send it. ``read``: the
    (device, buffer) of the loaded blocks some instruction of ``dp`` reads (the redone
    chunks' loads, :class:`_Relowerer`, and the kept chunks', ``Family.load_reads``): buffer
    names are unique per device, so no other instruction reads a load's buffer."""
    for d, names in reloaded.items():
        dead = {b for b in names if (d, b) not in read}
        if dead:
            code = dp.code.get(d, [])
            dp.code[d] = [ins for ins in code if not (type(ins) is Load and ins.dst in dead)]
            for b in dead:
                dp.bufs[d].pop(b, None)


def relower(family: Family, comp, eqns, priced: bool = True) -> object:
    """``comp`` (the family's plan re-cut at ``eqns``: :func:`eins.passes.rebalance.recut`)
    placed, synthesized and lowered, reusing ``family`` for everything the re-cut cannot
    change (module docstring). Equal to the physical passes run on ``comp`` (verify aside)
    up to buffer names and transfer tags; with the family's ``rank``, that device's
    instructions alone, each equal to the whole re-lowering's. Not ``priced``: the new
    exchanges are not simulated (their ``predicted_s`` is None), for a program only run."""
    xir, dp = _relower(family, comp, eqns, priced, bare=False)
    return replace(comp, placement=xir.placement, exchange=xir, device=dp,
                   topology=family.state.topology)


def relower_device(family: Family, comp, eqns):
    """The device program of ``relower(family, comp, eqns, priced=False)``, equal to its
    ``device``: all a call that runs it needs. A re-cut input whose exchange would move
    nothing (``eins.passes.overlay.moves_nothing``: the block family's token-wise eqns, cut
    alike) gets no exchange object, each kernel reading its producer's block where it was
    written (``Lowerer.local``), and so does a program output whose gather would move
    nothing (``output_moves_nothing``: each block stored where it was written), so the
    program has no exchange IR (``exchange`` None). Not
    for a family with a ``rank`` (a rank's digest and its peers' loads read that IR):
    :func:`relower` there."""
    if family.rank is not None:
        raise ValueError(f"relower_device lowers every device; rank {family.rank}'s family "
                         f"re-lowers through relower")
    dp = _relower(family, comp, eqns, priced=False, bare=True)[1]
    dp.exchange = None
    return dp


def _relower(family: Family, comp, eqns, priced: bool, bare: bool) -> tuple:
    """(exchange IR, device program) of :func:`relower` (``bare``: of
    :func:`relower_device`, whose exchange IR lacks the exchanges that move nothing); per
    call (eins.passes.per_call: a re-cut's overlays and simulations are its own)."""
    with per_call():
        return _relowered(family, comp, eqns, priced, bare)


def _relowered(family: Family, comp, eqns, priced: bool, bare: bool) -> tuple:
    prog, plan = comp.program, comp.plan
    n = len(prog.eqns)
    # a re-cut eqn whose boxes are the family's (a heads split: its ends are data the
    # kernel reads) changes no exchange and no instruction
    base_plans = family.state.plan.eqn_plans
    recut = {i for i in eqns if plan.eqn_plans[i].spec.fspecs != base_plans[i].spec.fspecs}
    producers = prog.producers()
    names = prog.var_names()
    placement = family.state.placement
    touched = {i for i in range(n + 1) if i in recut or _fed_by(prog, producers, recut, i)}
    xs = []
    local = {}   # eqn -> {input: its producer} read where written (bare)
    for i in range(n):
        if i not in touched:
            xs += family.overlay.for_eqn(i)
            continue
        if bare:
            got = {k: producers[id(a)] for k, a in enumerate(prog.eqns[i].inputs)
                   if isinstance(a, Var) and id(a) in producers}
            local[i] = {k: pk for k, pk in got.items()
                        if moves_nothing(plan, placement, i, k, pk)}
        xs += eqn_exchanges(plan, placement, names, producers, i, fixed=placement[i],
                            skip=local.get(i, ()))
    if n not in touched:
        xs += family.overlay.for_eqn(-1)
    else:
        if bare:
            local[-1] = {o: producers[id(v)] for o, v in enumerate(prog.outputs)
                         if id(v) in producers and output_moves_nothing(plan, producers[id(v)])}
        xs += output_exchanges(plan, placement, names, producers, skip=local.get(-1, ()))
    pre = ExchangeIR(plan, placement, xs, family.overlay.schedule, family.overlay.topology)
    xir = walk_exchanges(pre, None, moves=False, bodies=dict(family.bodies),
                         priced=priced)

    base, old = family.lowerer, family.state.exchange
    low = _Relowerer(xir, family.rank, pipeline=comp.options.pipeline)
    low.counts = dict(family.counts)   # fresh names after the family's, per device
    low.next_tag = family.next_tag
    share_schedules(old, xir)   # the family's fired programs, not fired again
    low.kernel_out = dict(base.kernel_out)
    low.keep_names = base.kernel_out
    low.local = local
    code, bufs = low.device_program.code, low.device_program.bufs
    redone = set()
    reloaded: dict = {}   # device -> the family's loads emitted again in redone chunks
    read = low.read       # (device, loaded block) read, the kept chunks' added
    for c in range(n + 1):
        x_keys = [(x.eqn, x.inputs) for x in xir.for_eqn(-1 if c == n else c)]
        same = (c not in touched and _serving(xir, c) == _serving(old, c)
                and x_keys == [(x.eqn, x.inputs) for x in old.for_eqn(-1 if c == n else c)]
                and not any(x.eqn in redone for x, _ in xir.serving(c)))
        low.chunk = c
        if same:
            read |= family.load_reads.get(c, set())
            for d, ins in base.chunk_code.get(c, {}).items():
                code.setdefault(d, []).extend(ins)
            for d, b in base.chunk_bufs.get(c, {}).items():
                bufs.setdefault(d, {}).update(b)
            for key, name in base.chunk_loads.get(c, {}).items():
                low.loaded.setdefault(key, name)
            for k in x_keys:
                low.got[k] = base.got[k]
            continue
        redone.add(c)
        # the family's loads of this eqn, under their names: the family's code after it
        # may read them
        for key, d, name, info, load in family.reloads.get(c, ()):
            low.new(d, info, name=name)
            low.emit(d, load)
            low.loaded.setdefault(key, name)
            reloaded.setdefault(d, set()).add(name)
        if c < n:
            low.eqn(c)
        else:
            low.outputs()
    _drop_dead_loads(low.device_program, reloaded, read)
    low.finish()
    dp = low.device_program
    if family.rank is None:
        # the layouts and tag count the lowerer records cover the re-lowered eqns only: the
        # device program's own instructions say them (DeviceProgram.store_layout and the rest)
        dp.stores = dp.loads = dp.tags = None
    else:
        # a rank holds its own instructions only, so its peers' layouts (the gather's, the
        # re-layout's) are what every rank derives alike: the loads from the re-cut exchange
        # IR, the stores the outputs' (the family's unless re-lowered), the tags all issued
        dp.tags = low.next_tag
        dp.loads = {d: list(ls) for d, ls in low.tables.loads.items()}
        if n not in redone:
            dp.stores = family.state.device.stores
    return xir, dp
