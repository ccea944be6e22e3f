"""The per-call rebalance of a plan family (issue 36): a program whose eqns take a static
parameter as data on every call (attention's ``segments`` as an int array:
``Primitive.runtime_params``) is planned once; each call re-cuts those eqns for its own
values without re-tracing or re-running the DP.

What stays (the plan family, decided at compile time): every eqn's split, i.e. which indices
are split and into how many intervals (``EqnPlan.splits``), and every other eqn's spec.
What a call decides: the rebalanced eqns' interval positions, from the operator's own
balance rule (``Indexing.balance``) on the call's values, and so their boxes. For attention
that is the DP's rule itself: contiguous query blocks of equal causal work, cut at segment
ends when that costs at most ``SEGMENT_CUT_SLACK`` (10%) over free cuts (whole documents per
device read no key twice). Equal causal work rather than zig-zag: one box per device is what
the plan, the placement and the time model describe, and contiguous cuts at segment ends
move no keys at all; rather than whole segments only: one long document would then leave
devices idle.

Where several families are compiled (say attention split by heads, by query sequence
re-cut per call, and by query sequence at fixed cuts: ``recut(..., balance=False)`` keeps
the family's cut positions and re-derives only the boxes, the keys each block reads, from
the call's ends), ``choose`` picks one per call by an estimate of its time GPU by GPU
(eins.cost.predict.Timeline, as the rank runtime runs a program), about as cheap as the
re-cut: the family's first lowering replayed on a Timeline (its exchanges, each holding
the GPUs it names, and its kernels), its re-cut eqns' kernels priced again on the call's
boxes, and before each eqn one exchange per input whose new boxes read more than the
first lowering brought them (``moved``: what each device's blocks lack of what the
producer wrote on it, beyond the first lowering's, received at its narrowest inbound
link, each source's part sent at its narrowest outbound one, after one route latency;
the GPUs taking part held for the slowest). It is exact for a family whose boxes the call
does not move (a heads split: the kernels read the ends as data, so only their work
changes); simulating a call's exchanges instead costs about as much as lowering them.

``recut`` is cheap: the operator's balance is O(p log n) per split index (binary search on
a closed-form prefix of work), the rest is one spec producer call per rebalanced eqn. The
physical lowering of the result (place .. lower) is the caller's (eins/stages.py), cached
by the resulting boxes.
"""
from __future__ import annotations

from dataclasses import replace

from eins.cost.predict import Timeline, eqn_kernel_seconds, out_itemsizes, pieces_floor
from eins.errors import EinsError
from eins.ir.program import Program
from eins.passes.overlay import reads_as_written
from eins.ir.pieces import pair_itemsize, pieced, pipeline_operands, under_pieces
from eins.passes.pipeline import plan_pieces, worth_for

__all__ = ["runtime_operands", "recut", "recut_key", "specialize",
           "reads", "moved", "Choice", "estimates", "fastest", "choose"]


def runtime_operands(program) -> dict:
    """{eqn index: (operand index, program input index)} for each eqn whose primitive takes
    a parameter as data (``Primitive.runtime_params``) fed straight from a program input
    (one the host holds at call time). An eqn whose data is computed inside the program
    keeps its compile-time cuts."""
    where = {id(v): k for k, v in enumerate(program.inputs)}
    out = {}
    for i, e in enumerate(program.eqns):
        fn = e.primitive.runtime_params
        if fn is None:
            continue
        n = fn(e.params, [a.type for a in e.inputs], None)
        if n is not None and id(e.inputs[n]) in where:
            out[i] = (n, where[id(e.inputs[n])])
    return out


def _host(x):
    """A call's argument as a host numpy array (a torch tensor is copied to the host: the
    boundaries are a few ints)."""
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    if hasattr(x, "get"):   # CuPy
        return x.get()
    return x


def specialize(program, arrays, operands=None):
    """``program`` with its runtime-parameter eqns' params written from one call's values
    (``arrays``: its program inputs; only the runtime operands are read). Planned, it gives a
    family chosen for a representative batch rather than for the worst any batch could be
    (attention's FLOPs with unknown ends are those of one document); ``recut`` then re-cuts
    it per batch. Its own boxes fit that batch only."""
    operands = runtime_operands(program) if operands is None else operands
    eqns = list(program.eqns)
    for i, (n, k) in operands.items():
        e = eqns[i]
        eqns[i] = replace(e, params=e.primitive.runtime_params(
            e.params, [a.type for a in e.inputs], {n: _host(arrays[k])}))
    return Program(program.inputs, tuple(eqns), program.outputs, program.consts, program.name)


def recut(comp, arrays, operands=None, balance=True):
    """The planned Compilation ``comp`` with its runtime-parameter eqns re-cut for one call
    (``arrays``: the call's program inputs): each such eqn gets the call's static params
    (so its FLOPs and boxes are this batch's), the same split counts, and intervals from its
    operator's balance on them (not ``balance``: the family's intervals, fixed cuts). The
    costs recorded in the plan stay the family's."""
    if comp.plan is None:
        raise EinsError("recut needs a planned Compilation")
    operands = runtime_operands(comp.program) if operands is None else operands
    if not operands:
        return comp
    prog = comp.program
    eqns, plans = list(prog.eqns), list(comp.plan.eqn_plans)
    for i, (n, k) in operands.items():
        e = eqns[i]
        ins = [a.type for a in e.inputs]
        params = e.primitive.runtime_params(e.params, ins, {n: _host(arrays[k])})
        ix = e.primitive.indexing(ins, [v.type for v in e.outputs], **params)
        ep = plans[i]
        iv = dict(ep.intervals)
        for name, count in ep.splits.items():
            if balance and name in ix.balance:
                cuts = ix.balance[name](count)
                if cuts is None:
                    raise EinsError(f"eqn {i} ({e.prim}): {name} cannot be cut {count} ways "
                                    f"for this call")
                iv[name] = tuple(cuts)
        eqns[i] = replace(e, params=params)
        plans[i] = replace(ep, intervals=iv, spec=ix.spec(iv))
    new_prog = Program(prog.inputs, tuple(eqns), prog.outputs, prog.consts, prog.name)
    plan = replace(comp.plan, program=new_prog, eqn_plans=tuple(plans))
    return replace(comp, program=new_prog, plan=plan, placement=None, exchange=None,
                   device=None)


def recut_key(comp, operands, params=None) -> tuple:
    """What a recut Compilation's lowering depends on: the rebalanced eqns' function
    specifications (their boxes). Two calls with equal keys share one device program.
    ``params``: the eqns among them whose params a call sets (the runtime operands); the
    others' specs follow from their intervals alone (the block family's token-wise eqns),
    which stand for them (a key a few intervals long rather than every box)."""
    plans = comp.plan.eqn_plans
    return tuple((i, plans[i].spec.fspecs if params is None or i in params else
                  tuple(plans[i].intervals.items())) for i in sorted(operands))


def _kernels(comp, i) -> list:
    """Seconds of eqn ``i``'s kernel per function specification of ``comp``."""
    e, spec = comp.program.eqns[i], comp.plan.eqn_plans[i].spec
    return eqn_kernel_seconds(e, spec.fspecs, comp.topology, out_itemsizes(e, spec))


def reads(comp, placement, j, a, pj, oi) -> list:
    """Per function specification of eqn ``j``: (its device, the elements of its input
    ``a`` that eqn ``pj``'s output ``oi`` (that input's producer) does not write on that
    device, {other device: elements of it written there}) under ``comp``'s boxes and
    ``placement``: what an exchange must bring it."""
    outs = [(placement[pj][m], f.outputs[oi])
            for m, f in enumerate(comp.plan.eqn_plans[pj].spec.fspecs)]
    got = []
    for d, f in zip(placement[j], comp.plan.eqn_plans[j].spec.fspecs):
        box, own, srcs = f.inputs[a], 0, {}
        for e, ob in outs:
            common = box.intersect(ob)
            if common is None:
                continue
            if e == d:
                own += common.size
            else:
                srcs[e] = srcs.get(e, 0) + common.size
        got.append((d, max(box.size - own, 0), srcs))
    return got


def moved(choice, comp, changed) -> dict:
    """{eqn: [(GPUs, seconds, input)]}: per input of an eqn of ``changed`` (or fed by one) whose
    blocks now need more than ``choice``'s first lowering brought them, one exchange:
    each device receives what it lacks beyond the first lowering at its narrowest inbound
    link, each source sends its part at its narrowest outbound link, the slowest of them
    after the longest route's latency (module docstring)."""
    out: dict = {}
    place = choice.lowered.placement
    plans = comp.plan.eqn_plans
    seen = {}   # the same blocks read from the same layout (attention's keys and values)
    for j, a, pj, oi, size, first in choice.reads:
        if (j not in changed and pj not in changed) or \
                (first is None and reads_as_written(comp.plan, place, j, a, pj, oi)):
            continue
        key = (tuple(f.inputs[a] for f in plans[j].spec.fspecs), place[j],
               tuple(f.outputs[oi] for f in plans[pj].spec.fspecs), place[pj])
        got = seen.get(key)
        if got is None:
            got = seen[key] = reads(comp, place, j, a, pj, oi)
        inb, outb = {}, {}
        for (d, n, srcs), (_, n0, srcs0) in zip(got, first or choice.empty(j)):
            if n > n0:
                inb[d] = inb.get(d, 0) + (n - n0) * size
                for e, m in srcs.items():
                    if m > srcs0.get(e, 0):
                        outb[e] = outb.get(e, 0) + (m - srcs0.get(e, 0)) * size
        if inb:
            t = choice.latency + max([b / choice.inbound[d] for d, b in inb.items()]
                                     + [b / choice.outbound[e] for e, b in outb.items()])
            gpus = frozenset(choice.topo.gpu_of(d) for d in (*inb, *outb))
            out.setdefault(j, []).append((gpus, t, a))
    return out


class Choice:
    """One compiled family for :func:`choose`: ``planned`` (its planned Compilation),
    ``lowered`` (its first lowering, priced), ``balance`` (re-cut per call, or keep its
    cuts) and ``cutter`` (the block family's whole-block re-cut after that:
    eins.passes.blockcut.BlockCut; its ``eqns`` are then the ones a call re-cuts, else the
    runtime operands'). Its
    estimate is the first lowering timed GPU by GPU (eins.cost.predict.Timeline) with the
    re-cut eqns' kernels priced on the call's boxes and an exchange added wherever those
    boxes read more than the first lowering brought them (module docstring)."""

    def __init__(self, planned, lowered, operands, balance=True, cutter=None):
        self.planned, self.lowered, self.balance = planned, lowered, balance
        self.cutter = cutter
        self.eqns = sorted(operands if cutter is None else cutter.eqns)
        self.eqn_set = set(self.eqns)
        self.topo = topo = lowered.topology
        xir, prog = lowered.exchange, lowered.program
        line = Timeline(topo)
        n = len(prog.eqns)
        self.xs = [[(line.gpus(x), x.predicted_s, (x.inputs, bool(x.serves)))
                    for x in xir.for_eqn(i) if x.predicted_s] for i in (*range(n), -1)]
        self.kernels = [_kernels(lowered, i) for i in range(n)]
        # the block family's token-wise eqns, priced per call from their rows alone
        self.rows = cutter.row_kernels(lowered, topo) if cutter is not None else {}
        self.devices = [xir.placement[i] for i in range(n)]
        self.fspecs = [ep.spec.fspecs for ep in lowered.plan.eqn_plans]
        producers, recut_eqns = prog.producers(), self.eqn_set
        self.producers = producers
        # the re-cut eqns whose kernels run in pieces as their keys arrive (the family's
        # lowerings piece them: eins/passes/pipeline.py), priced so per call
        # (not where an exchange of its keys serves a later eqn too: the lowering keeps
        # those whole, their blocks read twice)
        self.pieced = {i for i in self.eqns if planned.options.pipeline
                       and pieced(prog.eqns[i]) is not None
                       and not any(x.serves and set(x.inputs) & set(pipeline_operands(
                           prog.eqns[i])) for x in xir.for_eqn(i))}
        self.pays = worth_for(planned.options.pipeline, topo)
        self.parts: dict = {}   # per pieced eqn, its last layout's parts (plan_pieces)
        self.reads = []   # (eqn, input, producer, its output, itemsize, first reads | None)
        for j, e in enumerate(prog.eqns):
            for a, v in enumerate(e.inputs):
                pj, oi = producers.get(id(v), (None, None))
                if pj is None or (j not in recut_eqns and pj not in recut_eqns):
                    continue
                first = None if reads_as_written(lowered.plan, xir.placement, j, a, pj, oi) else \
                    reads(lowered, xir.placement, j, a, pj, oi)
                self.reads.append((j, a, pj, oi, v.type.dtype.itemsize, first))
        devs = lowered.devices
        self.inbound = {d: min((topo.bandwidth(s, d) for s in devs if s != d),
                               default=float("inf")) for d in devs}
        self.outbound = {s: min((topo.bandwidth(s, d) for d in devs if d != s),
                                default=float("inf")) for s in devs}
        self.latency = max((topo.route_latency(s, d) for s in devs for d in devs if s != d),
                           default=0.0)
        # the GPUs' clocks before the first re-cut eqn: no call changes what precedes it
        # (an exchange a re-cut adds feeds a re-cut eqn or a later consumer)
        self.start = min(self.eqns, default=n)
        line = Timeline(topo)
        for i in range(self.start):
            self._replay(line, i, self.kernels[i], ())
        self.clock = dict(line.clock)

    def recut(self, arrays, operands, done=None):
        """This family re-cut for a call with program inputs ``arrays``; ``done``: {(id of
        a planned Compilation, balance): its re-cut for this call} shared among families
        (the block family re-cuts the equal family's)."""
        key = (id(self.planned), self.balance)
        comp = done.get(key) if done is not None else None
        if comp is None:
            comp = recut(self.planned, arrays, operands, self.balance)
            if done is not None:
                done[key] = comp
        return comp if self.cutter is None else self.cutter(comp)

    def empty(self, j) -> list:
        """Eqn ``j``'s reads in the first lowering where nothing moved."""
        return [(d, 0, {}) for d in self.devices[j]]

    def estimate(self, comp) -> float:
        """Predicted seconds, GPU by GPU, of this family re-cut as ``comp`` (module
        docstring)."""
        return self.timed(comp, self.priced(comp))

    def bound(self, comp, got=None) -> float:
        """A lower bound on :meth:`estimate` without pricing its pieces (``got``: this
        call's :meth:`priced`, where made): each pieced eqn's kernel per device at the
        least any pieces of it cost, its keys' exchanges holding nothing (:meth:`_whole`,
        :func:`estimates`). Equal to the estimate where the family pieces nothing."""
        return self.timed(comp, self.priced(comp) if got is None else got, pieces=False)

    def priced(self, comp, wholes=None) -> tuple:
        """What :meth:`timed` reads of one call, made once for both passes: (the exchanges
        ``moved`` adds, {re-cut eqn: its kernels' seconds on the call's boxes}, filled as
        the passes price them, {ids of a pieced eqn's spec and eqn: (both, its kernels
        whole)}: ``wholes``, shared by the families of one call where given, whose re-cuts
        share a spec (the equal and block families' attention))."""
        plans = comp.plan.eqn_plans
        redo = {i for i in self.eqns if plans[i].spec.fspecs != self.fspecs[i]}
        return moved(self, comp, redo), {}, {} if wholes is None else wholes

    def timed(self, comp, got, pieces=True) -> float:
        """:meth:`estimate` (``pieces``) or :meth:`bound` of ``comp`` from ``got``
        (:meth:`priced`)."""
        extra, priced, wholes = got
        plans = comp.plan.eqn_plans
        line = Timeline(self.topo)
        line.clock = dict(self.clock)
        twin = self.cutter.twin if self.cutter is not None else {}
        for i in range(self.start, len(self.kernels)):
            if i in self.pieced:
                if not pieces:
                    self._whole(line, comp, i, extra.get(i, ()), wholes)
                    continue
                pp = plan_pieces(comp.plan, self.devices, self.producers, i, self.pays,
                                 self.parts.setdefault(i, {}))
                if pp is not None:
                    self._pipelined(line, comp, i, pp, extra.get(i, ()))
                    continue
            # the re-cut eqns' work follows the call's params (a heads split's pairs) even
            # where their boxes stay; an eqn alike an earlier one, with its very spec, takes
            # its times (eins.passes.blockcut.twins)
            if i in self.eqn_set and i not in priced:
                r = twin.get(i)
                if r in priced and plans[r].spec is plans[i].spec:
                    priced[i] = priced[r]
                else:
                    rows = self.rows.get(i)
                    secs = rows.seconds(plans[i].spec) if rows is not None else None
                    priced[i] = secs if secs is not None else _kernels(comp, i)
            self._replay(line, i, priced[i] if i in self.eqn_set else self.kernels[i],
                         extra.get(i, ()))
        for gpus, t, _ in self.xs[-1]:
            line.hold(gpus, t)
        return line.end()

    def _replay(self, line, i, kernels, extra) -> None:
        """Eqn ``i`` on ``line``: the first lowering's exchanges before it, then those a
        call adds (``extra``), then its ``kernels``."""
        for gpus, t, _ in self.xs[i]:
            line.hold(gpus, t)
        for gpus, t, _ in extra:
            line.hold(gpus, t)
        line.kernels(kernels, self.devices[i])

    def _pipelined(self, line, comp, i, pp, extra) -> None:
        """Pipelined eqn ``i`` on ``line`` (its pieces ``pp``, eins.passes.pipeline
        .plan_pieces): the exchanges of its other operands held, its keys' received under
        its pieces (eins.cost.predict.Timeline.pipelined)."""
        self._others(line, comp, i, extra)
        line.pieces(comp.program.eqns[i], pp)

    def _whole(self, line, comp, i, extra, wholes) -> None:
        """Eqn ``i``, pieced in :meth:`_pipelined`, as :meth:`bound` takes it: the
        exchanges of its other operands held, then each device's kernel at no more than
        any pieces of it, or it whole, cost (eins.cost.predict.pieces_floor), its keys'
        transfers, which hold no GPU, not waited for."""
        self._others(line, comp, i, extra)
        eqn, spec = comp.program.eqns[i], comp.plan.eqn_plans[i].spec
        clock, topo = line.clock, self.topo
        got = wholes.get((id(spec), id(eqn)))
        if got is None or got[0] is not spec or got[1] is not eqn:
            size = pair_itemsize(eqn)
            got = wholes[(id(spec), id(eqn))] = (spec, eqn, [
                pieces_floor(eqn, f, topo, size) for f in spec.fspecs])
        for d, t in zip(self.devices[i], got[2]):
            g = topo.gpu_of(d)
            clock[g] = clock.get(g, 0.0) + t

    def _others(self, line, comp, i, extra) -> None:
        """The exchanges before pieced eqn ``i`` that its pieces do not take in."""
        eqn = comp.program.eqns[i]
        for gpus, t, (ins, serves) in self.xs[i]:
            if not under_pieces(eqn, ins, serves):
                line.hold(gpus, t)
        for gpus, t, a in extra:
            if not under_pieces(eqn, (a,), False):
                line.hold(gpus, t)


def estimates(choices, arrays, operands) -> list:
    """[(re-cut Compilation, estimated seconds, whether that is the estimate rather than a
    lower bound on it)] of each family among ``choices`` (:class:`Choice`) for this call
    (``arrays``): every family's :meth:`Choice.bound` first, then, from the lowest bound
    up, the estimate of each that may still be the fastest (its bound below the best
    estimate so far, or equal and earlier); the others keep their bounds. So
    :func:`fastest` picks what it would among every estimate, without pricing the pieces
    of a family that cannot win."""
    staged, done, wholes = [], {}, {}
    for c in choices:
        comp = c.recut(arrays, operands, done)
        got = c.priced(comp, wholes)
        staged.append([comp, c.bound(comp, got), not c.pieced, got])
    best = None
    for n in sorted(range(len(staged)), key=lambda n: staged[n][1]):
        comp, t, exact, got = staged[n]
        if best is not None and (t, n) > (staged[best][1], best):
            continue   # its estimate is no less than its bound: it cannot be picked
        if not exact:
            staged[n][1:3] = choices[n].timed(comp, got), True
        if best is None or (staged[n][1], n) < (staged[best][1], best):
            best = n
    return [(comp, t, exact) for comp, t, exact, _ in staged]



def fastest(ests) -> int:
    """The index of the smallest estimate among :func:`estimates`' ``ests``; the first on
    a tie."""
    return min(range(len(ests)), key=lambda n: ests[n][1])


def choose(choices, arrays, operands):
    """-> (index, re-cut Compilation, estimated seconds) of the family among ``choices``
    (:class:`Choice`) whose re-cut for this call (``arrays``) is estimated fastest; the
    first on a tie."""
    ests = estimates(choices, arrays, operands)
    n = fastest(ests)
    return (n,) + ests[n][:2]
