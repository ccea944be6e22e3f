"""The synthesize pass (paper Sections 5.1, 5.4): every exchange of the plan gets its body."""
from __future__ import annotations

from dataclasses import replace

from eins.hardware.net import resolve_topology
from eins.ir.exchange import Exchange, ExchangeIR, reuse_key
from eins.passes.overlay import exchange_ir, placed
from eins.ir.memo import Memo
from eins.ir.plan import Tuning
from eins.passes.synthesize.bound import FLOOR_SLACK
from eins.passes.synthesize.caches import cached_floor
from eins.passes.synthesize.estimate import naive_seconds
from eins.passes.synthesize.preamble import in_order_membership, naive_program, with_members
from eins.passes.synthesize.program import DEFAULT_BUDGET_S, synthesize_program
from eins.progress import tick

__all__ = ["synthesize", "synthesize_exchanges", "schedule_exchanges", "walk_exchanges",
           "total_exchange_s"]


def synthesize(state):
    """The synthesize pass (Sections 5.1, 5.4): a new ``state.exchange``, overlay's with
    every exchange given its body, and ``state.placement`` its final value.

    ``schedule="naive"`` keeps the identity placement and gives each exchange the naive body.
    ``"optimized"`` (the paper's ``"ai"``) walks the eqns in program order, so every
    producer's placement is final when its consumers are reached: the largest input exchange
    of an eqn declares its partitions by size and its synthesized membership places the eqn's
    function specifications; the eqn's other inputs are then synthesized for that placement.
    The exchanges are also synthesized at the naive placement, and the cheaper of the two
    is kept (:func:`synthesize_exchanges`).

    An input whose blocks an earlier eqn's exchange already delivers to the devices the eqn
    runs on gets no exchange of its own: that exchange serves it (``Exchange.serves``,
    :func:`eins.ir.exchange.reuse_key`); under the optimized schedule an eqn whose largest
    input an earlier exchange delivers is placed where it delivers it.

    >>> import eins
    >>> from eins.ir.plan import Compilation, Options
    >>> prog = eins.make_ir(lambda x, w: (x @ w).sum(axis=0))(
    ...     eins.ShapeDtype((16, 4), "float32"), eins.ShapeDtype((4, 4), "float32"))
    >>> state = Compilation(prog, (0, 1), Options(cost="proxy"))
    >>> from eins.passes import PLANNING, overlay, place, run_passes
    >>> state = synthesize(run_passes(state, PLANNING + (place, overlay)))
    >>> print(state.exchange.exchanges[-1].program, end="")   # the body: a copy, then the sum
    GPUS: 0, 1
    PARTITIONS: S0 {0}
    IN: A0_0 @ 0 (size: 16 B); A0_1 @ 1 (size: 16 B)
    OUT: A0_0+A0_1 @ S0
    A0_1 @ 1 -> 0
    A0_0+A0_1 @ S0
    """
    o = state.options
    xir = synthesize_exchanges(state.exchange, o.synthesis_budget_s, o.seed,
                               o.synthesis_steps, o.tuning)
    return replace(state, exchange=xir, placement=xir.placement)


def synthesize_exchanges(xir: ExchangeIR, budget_s=DEFAULT_BUDGET_S, seed=0,
                         steps=None, tuning: Tuning = Tuning()) -> ExchangeIR:
    """A new ExchangeIR: the exchanges of ``xir`` (the overlay pass's preambles, in its
    order) each with its body for ``xir.schedule`` on ``xir.topology``, placed again where
    the optimized schedule moves a producer or a consumer (see :func:`synthesize`); ``xir``
    is left as it is. ``steps`` bounds each synthesis by simulated candidates instead of
    ``budget_s``; ``tuning`` holds the search's switches (:class:`eins.ir.plan.Tuning`).

    Under the optimized schedule the exchanges are synthesized twice: by the walk that
    moves each eqn to where its largest input is cheapest to deliver (see
    :func:`synthesize`), and at the naive placement; the walk with the smaller total
    exchange time is kept (the first on a tie). The walk's moves are greedy: an eqn is placed
    for its own largest input, not for its consumers, so the exchanges after a move may cost
    more than at the naive placement (chains D and E do; the LLaMA block gains: docs/
    measured.md, "Behind the code's constants"). Each synthesized body is at most its naive body for its placement, so the optimized schedule
    is never predicted slower than the naive one."""
    if xir.schedule == "naive":
        return walk_exchanges(xir, None, moves=False)
    synth = dict(budget_s=budget_s, seed=seed, steps=steps, tuning=tuning)
    walk = walk_exchanges(xir, synth, moves=True)
    # the naive placement's exchanges cannot beat the walk (by more than
    # tuning.synthesis_min_gain) when their time floors (eins.passes.synthesize.bound) add
    # up to its total already: not synthesized then
    if tuning.stop_at_floor and (total_exchange_s(walk_exchanges(xir, "floor", moves=False))
                                 * (1 - FLOOR_SLACK) >= total_exchange_s(walk)
                                 * (1 - tuning.synthesis_min_gain)):
        return walk
    kept = walk_exchanges(xir, synth, moves=False)
    return walk if total_exchange_s(walk) <= total_exchange_s(kept) else kept


def total_exchange_s(xir: ExchangeIR) -> float:
    """The predicted seconds of every exchange of ``xir`` (each with its body), added."""
    return sum(x.predicted_s for x in xir.exchanges)


def walk_exchanges(xir: ExchangeIR, synth, moves: bool, bodies=None,
                   priced: bool = True) -> ExchangeIR:
    """Every exchange of ``xir`` with its body: the naive one (``synth`` None) or one
    synthesized with ``synth``'s keyword arguments, under ``xir.schedule``'s name. With
    ``moves``, each eqn's largest input exchange places it (its partitions by size); else
    the placement stays the overlay's. ``synth="floor"`` (without ``moves``) writes no body:
    each exchange's ``predicted_s`` is its preamble's time floor, which no body beats.
    ``bodies`` ({id(preamble exchange): (it, with its body)}, without ``moves``): bodies
    written before, reused for the same exchange objects and added to for new ones (a
    re-cut re-lowers only its own eqns' exchanges: eins/passes/relower.py). Not ``priced``
    (naive bodies only): the new bodies are not simulated, their ``predicted_s`` is None
    (a program only run, not predicted, skips the simulator's cost)."""
    topology = xir.topology
    if synth == "floor" and moves:
        raise ValueError("time floors need a fixed placement (moves=False)")
    out = _Walked(dict(xir.placement))
    placement = out.placement
    for i in range(len(xir.plan.program.eqns)):
        tick()   # one eqn's exchanges (eins.progress)
        xs = xir.for_eqn(i)
        lead = None
        if moves and xs:
            # the largest input (bytes of its atoms) places the eqn: where an earlier eqn's
            # exchange already delivers it, there (it then moves nothing); else its
            # partitions are declared by size and synthesis chooses their devices
            lead = max(xs, key=lambda x: sum(a.size for a in x.preamble.inputs))
            there = out.delivering(lead)
            if there is not None:
                placement[i], lead = there, None
            else:
                done = _with_body(placed(lead, placement, free=True), topology, synth)
                placement[i] = done.delivered_sites()
        for x in xs:
            if x is lead:
                out.add(done)
            else:
                x = placed(x, placement)
                if not out.serve(x, i):
                    out.add(_memo_body(x, topology, synth, bodies, priced))
    exchanges = out.exchanges + [_memo_body(placed(x, placement), topology, synth, bodies,
                                            priced)
                                 for x in xir.for_eqn(-1)]
    return ExchangeIR(xir.plan, placement, exchanges, xir.schedule, topology)


def _memo_body(x: Exchange, topology, synth, bodies, priced=True) -> Exchange:
    """:func:`_with_body`, from ``bodies`` when it holds this very exchange object."""
    if bodies is None:
        return _with_body(x, topology, synth, priced)
    hit = bodies.get(id(x))
    if hit is None or hit[0] is not x:
        hit = bodies[id(x)] = (x, _with_body(x, topology, synth, priced))
    return hit[1]


def _with_body(x: Exchange, topology, synth, priced=True) -> Exchange:
    """``x`` with its body and predicted time (:func:`walk_exchanges`'s ``synth``)."""
    if synth == "floor":
        t = cached_floor(x.preamble, topology)
        return replace(x, membership={p.name: p.members for p in x.preamble.partitions},
                       predicted_s=t, naive_s=t)
    if synth is None:
        parts = x.preamble.partitions
        fixed = {p.name: p.members for p in parts if p.members is not None}
        if x.local_members(fixed):
            # nothing moves (Exchange.local): the naive body has no action; the preamble is
            # the overlay's own, not checked again
            program, membership = with_members(x.preamble, fixed), fixed
        else:
            program, membership = _naive_body(x.preamble, fixed)
        t = naive_seconds(program, topology, membership) if priced else None
        return replace(x, program=program, membership=membership, predicted_s=t, naive_s=t)
    r = synthesize_program(x.preamble, topology, **synth)
    return replace(x, program=r.program, membership=r.membership, predicted_s=r.total_s,
                   naive_s=r.naive_s)


def _naive_body(pre, fixed: dict) -> tuple:
    """(the naive program, its membership) of preamble ``pre`` with the partitions
    ``fixed`` declares. The exchanges of one overlay (eins.passes.overlay.build_exchange:
    attention's keys and values, a stack's layers) share its preamble object, so each
    object's body is built once (per call in a call: eins.ir.memo)."""
    key = (id(pre), tuple(fixed.items()))
    hit = _NAIVE.get(key)
    if hit is None or hit[0] is not pre:   # the object kept with it: its id stays its own
        hit = _NAIVE.put(key, (pre, naive_program(pre, fixed),
                               {**in_order_membership(pre), **fixed}))
    return hit[1], dict(hit[2])


_NAIVE = Memo("naive bodies", 256)


class _Walked:
    """The exchanges :func:`walk_exchanges` has written, in order, and where each delivers
    its blocks (by :func:`~eins.ir.exchange.reuse_key`), so that a later eqn reading the
    same blocks on the same devices is served by the earlier exchange."""

    def __init__(self, placement: dict):
        self.placement = placement
        self.exchanges = []
        self.delivered = {}   # reuse_key -> {sites per consumer block: index in exchanges}

    def add(self, x: Exchange) -> None:
        self.delivered.setdefault(reuse_key(x), {}).setdefault(x.delivered_sites(),
                                                               len(self.exchanges))
        self.exchanges.append(x)

    def delivering(self, x: Exchange):
        """The sites of the first exchange written that delivers ``x``'s blocks, or None."""
        return next(iter(self.delivered.get(reuse_key(x), ())), None)

    def serve(self, x: Exchange, i: int) -> bool:
        """Input(s) ``x`` of eqn i read blocks an earlier eqn's exchange already delivers
        to the same devices: that exchange serves them too (its ``serves``)."""
        n = self.delivered.get(reuse_key(x), {}).get(tuple(self.placement[i]))
        if n is None:
            return False
        self.exchanges[n] = replace(self.exchanges[n],
                                    serves=self.exchanges[n].serves + ((i, x.inputs),))
        return True


def schedule_exchanges(plan, placement, topology, schedule="naive",
                       budget_s=DEFAULT_BUDGET_S, seed=0, steps=None) -> ExchangeIR:
    """The overlay and synthesize passes outside the pipeline: the exchange IR of ``plan``
    under ``placement`` with every body synthesized for ``schedule`` on ``topology``."""
    topology = resolve_topology(topology, tuple(plan.devices))
    return synthesize_exchanges(exchange_ir(plan, placement, schedule, topology), budget_s,
                                seed, steps)
