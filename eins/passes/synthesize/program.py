"""Synthesizing the body of one preamble (paper Section 5.4): :func:`synthesize_program`.

It seeds the search (:mod:`eins.passes.synthesize.search`) with every pattern family under
two memberships (by affinity, in order), climbs from the best, kicks the best membership a
few times (iterated local search), polishes the winner with the action-level rewrites, then
re-checks the best candidates against Definition 5.5; the naive body is the floor. On a
multi-node cluster the hierarchical candidate (:mod:`eins.passes.synthesize.hierarchy`) is
added after the search, so it can only make the result faster. A search
ends as soon as a candidate reaches :func:`eins.passes.synthesize.bound.time_floor` (no body
is faster; ``Tuning.stop_at_floor``), so a preamble whose naive or first seeded body is already
optimal costs a few simulations, not the whole budget.

Decisions where the paper is silent: the search is seeded-random (``seed``) and bounded by
``budget_s`` seconds of *modeled* simulator time: each distinct candidate is charged its
simulation's CPU cost on the reference machine as :func:`eins.hardware.simulate.
simulation_work_s` estimates it from the program and the simulator's event counts, not as a
clock measures it, and the search's own building (group actions, bodies assembled, groups
formed) is charged likewise (:mod:`eins.passes.synthesize.search`'s ``WORK_*``). So the search reads no clock and the result depends only on (preamble,
topology, seed, budget), on any machine and under any load (the ranks of ``devices="world"``
agree on it; a busy CI machine finds the programs a quiet one does), while a large preamble
(72 GPUs: a candidate costs 5-300x an 8-GPU one) still gets fewer candidates than a small one.
The search stops at ``Tuning.search_share`` of the budget. A step budget (``steps``:
distinct simulated candidates) bounds it by count instead. Up to ``Tuning.rechecked`` best
candidates are re-checked before falling back to the naive program (the switches:
:class:`eins.ir.plan.Tuning`).
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, replace

from eins.errors import ExProgError
from eins.hardware.presets import get_topology
from eins.ir.exprog import Action, ExProg, is_valid
from eins.ir.plan import Tuning
from eins.passes.synthesize.caches import (
    cached_floor, cached_named, cached_result, canonical, named_key, prog_key, rename_prog,
    store_named, store_result, topo_key)
from eins.passes.synthesize.estimate import analytic_seconds, beyond_simulation
from eins.passes.synthesize.hierarchy import hierarchical_body
from eins.passes.synthesize.patterns import FAMILIES, action_order
from eins.passes.synthesize.preamble import (
    check_preamble, in_order_membership, naive_actions, sent_bytes, tie_key, with_members)
from eins.passes.synthesize.replicas import merge_replicated, reduced_preambles, replicated
from eins.passes.synthesize.search import Search

__all__ = ["SynthResult", "synthesize_program", "check_steps", "DEFAULT_BUDGET_S"]

# The kicks of the iterated local search and the winners re-checked are ``tuning``
# (eins.ir.plan.Tuning), never globals here.
# A candidate may exceed the naive time by this relative float noise and still count as
# "never slower".
NAIVE_SLACK = 1e-9
# The default budget, seconds of modeled simulation per preamble: where more budget stopped
# finding faster programs on the paper's workloads (docs/measured.md, "Behind the code's
# constants").
DEFAULT_BUDGET_S = 0.2


@dataclass(frozen=True)
class SynthResult:
    """The outcome of :func:`synthesize_program`: ``program`` (partitions' members filled in),
    its simulated ``total_s``, the naive program's ``naive_s``, the ``membership`` chosen,
    ``evaluated`` (distinct candidates simulated), ``work_s`` (their modeled simulation
    time and the search's own building, what the budget counts), ``elapsed_s`` (the
    wall-clock time it took here) and ``searched``: False when the naive body was within the
    search's min gain of the time floor (:func:`eins.passes.synthesize.search.min_gain`),
    so no other body was tried."""

    program: ExProg
    total_s: float
    naive_s: float
    membership: dict
    evaluated: int = 0
    elapsed_s: float = 0.0
    work_s: float = 0.0
    searched: bool = True

    @property
    def speedup(self) -> float:
        return self.naive_s / self.total_s if self.total_s > 0 else 1.0


def synthesize_program(prog: ExProg, topology, budget_s: float = DEFAULT_BUDGET_S,
                       seed: int = 0, families=None, steps: int | None = None,
                       tuning: Tuning = Tuning()) -> SynthResult:
    """Synthesize the body of preamble ``prog`` for ``topology`` (a Topology or preset name),
    searching for the least simulated time (paper Section 5.4) within ``budget_s`` seconds of
    modeled simulation (module docstring: the candidates' simulations charged their CPU cost
    on the reference machine as the simulator's counts predict it, so the result is the same
    on every machine). The result is valid (Definition 5.5) and never slower than
    :func:`naive_program`; its program's partitions have their members filled in.

    ``families`` (a subset of ``("gather", "reduce", "double", "ring", "hier")``) forces every
    group to those pattern families where they apply (others reduce, binomially, then
    multicast) and skips the action-level rewrites, so a test can check one algorithm's
    transfer pattern. Default: all, and the rewrites.

    ``steps`` (a positive int) bounds the search by distinct simulated candidates instead of
    modeled seconds (``budget_s`` is then ignored). ``tuning``: the search's switches
    (:class:`~eins.ir.plan.Tuning`), part of the results cache's key."""
    start = time.perf_counter()
    if not isinstance(prog, ExProg):
        check_preamble(prog)   # names what it got
    if isinstance(budget_s, bool) or not (isinstance(budget_s, (int, float)) and budget_s >= 0):
        raise ExProgError(f"budget_s must be a non-negative number of seconds, got {budget_s!r}")
    if steps is not None:
        steps = check_steps(steps, ExProgError)
    if not isinstance(tuning, Tuning):
        raise ExProgError(f"tuning must be an eins.ir.plan.Tuning, got {type(tuning).__name__} "
                          f"{tuning!r:.80}")
    if families is not None:
        if isinstance(families, str):
            families = [families]
        elif not isinstance(families, (list, tuple, set, frozenset)):
            raise ExProgError(f"families must be a family name or a list of them (from "
                              f"{list(FAMILIES)}), got {families!r}")
        families = tuple(sorted(set(families), key=str))
        bad = [f for f in families if f not in FAMILIES]
        if bad or not families:
            raise ExProgError(f"unknown pattern family {bad[0] if bad else families!r}; "
                              f"choose from {list(FAMILIES)}")
    topo = get_topology(topology)
    # the layers of a stack ask for equal preambles (the same atom names and sites): their
    # result is kept as it is, without renaming atoms to the shape's and back, and without
    # checking the preamble again (only a checked one is stored)
    try:
        nkey = named_key((topo_key(topo), prog_key(prog), None if steps else float(budget_s), seed,
                          families, steps, tuning))
    except TypeError:   # an unhashable field: check_preamble names it
        check_preamble(prog)
        nkey = None
    got = None if nkey is None else cached_named(nkey)
    if got is not None:
        return replace(got, membership=dict(got.membership),
                       elapsed_s=time.perf_counter() - start)
    check_preamble(prog)
    missing = [g for g in prog.gpus if g not in topo.gpus]
    if missing:
        raise ExProgError(f"the preamble uses GPU {missing[0]} but topology {topo.name!r} has "
                          f"GPUs {list(topo.gpus)}")
    got = _synthesize(prog, topo, budget_s, seed, families, steps, tuning, start)
    if nkey is not None:
        store_named(nkey, got)
    return got


def _synthesize(prog, topo, budget_s, seed, families, steps, tuning, start) -> SynthResult:
    if replicated(prog):
        # every reduced preamble gets an equal share of the budget (of steps: at least one)
        options = reduced_preambles(prog)
        share = None if steps is None else max(1, steps // len(options))
        return merge_replicated(prog, [synthesize_program(p, topo, budget_s / len(options), seed,
                                                          families, share, tuning)
                                       for p in options],
                                topo)
    canon, ren = canonical(prog)
    # a step-bounded result does not depend on budget_s; the switches change the search
    # (stopping at the floor may pick another body of the same time)
    ckey = (topo_key(topo), canon, None if steps else float(budget_s), seed, families, steps,
            tuning)
    hit = cached_result(ckey)
    if hit is None:
        hit = _search(canon, topo, budget_s, seed, families, steps, tuning, prog)
        store_result(ckey, hit)
    back = {v: k for k, v in ren.items()}
    return SynthResult(rename_prog(hit.program, back), hit.total_s, hit.naive_s,
                       dict(hit.membership), hit.evaluated, time.perf_counter() - start,
                       hit.work_s, hit.searched)


def check_steps(steps, error):
    """``steps`` as an int if it is a positive whole number of candidates, else ``error``
    (an EinsError subclass) naming the value."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise error(f"synthesis steps must be a positive int (simulated candidates), got "
                    f"{type(steps).__name__} {steps!r}")
    return int(steps)


def _search(prog: ExProg, topo, budget_s, seed, families, steps, tuning,
            named=None) -> SynthResult:
    start = time.perf_counter()  # elapsed_s only: no clock steers the search
    m0 = in_order_membership(prog)
    naive_acts = tuple(naive_actions(prog, m0))
    naive = with_members(prog, m0, naive_acts)
    if beyond_simulation(naive, topo):
        # one simulation of this body costs minutes (estimate.py), so no candidate fits any
        # budget: the naive body, timed as the naive schedule times it
        t = analytic_seconds(naive, topo, m0)
        return SynthResult(naive, t, t, m0, 0, time.perf_counter() - start, 0.0, False)
    s = Search(prog, topo, budget_s, seed, families, steps, tuning, named)
    naive_s = s.cost(m0, naive_acts)
    # the naive body within min_gain of the floor (search.min_gain): nothing is searched
    searched = not s.proven
    sized = [p.name for p in prog.partitions if p.members is None]
    states = []
    for m in dict.fromkeys(map(lambda d: tuple(sorted(d.items())),
                               (s.affinity_membership(), m0))):
        if s.proven or (states and s.out_of_time()):
            break
        st = s.seed(dict(m))
        if st is not None:
            states.append(st)
    if states:
        best = min(states, key=lambda x: x.time)
        # patterns and membership first, then the paper's action-level rewrites
        best = s.improve(best, sized)
        # iterated local search: good placements can sit among bad neighbours (Example 5.3's
        # is one), so kick the best membership with a few swaps and climb again
        fruitless = 0
        s.patience //= 2  # shorter climbs after a kick
        for _ in range(tuning.restarts if sized else 0):
            if s.out_of_time() or fruitless >= tuning.fruitless_kicks:
                break
            m = best.membership
            for _ in range(s.rng.randint(*tuning.kick_swaps)):
                m = s.swap(m, sized) or m
            st = s.seed(m)
            fruitless += 1
            if st is not None:
                st = s.improve(st, sized)
                if st.time < best.time:
                    best, fruitless = st, 0
        if families is None:  # the rewrites leave the forced families
            s.polish(best.membership, s.build(best.groups, best.keys, best.relay), best.time)
            # the gate reads the floor whether or not the search stops at it, so that
            # stopping at the floor only ever ends a search early
            floor = s.floor if tuning.stop_at_floor else cached_floor(prog, topo, named)
            if (tuning.hierarchical and not s.proven
                    and floor < (1 - tuning.hierarchical_gap) * min(s.cache.values())):
                _offer_hierarchical(s, dict(best.membership), budget_s, seed, steps)
    # candidates best first, each re-checked; naive is the floor
    # (times within a picosecond are ties, broken by the fewer bytes sent, then the shorter
    # program: an extra copy that costs no time still loads the fabric)
    ranked = sorted(((t, k) for k, t in s.cache.items() if t <= naive_s),
                    key=lambda x: (tie_key(x[0]), sent_bytes(prog, x[1][1], dict(x[1][0])),
                                   len(x[1][1])))
    for t, (mkey, acts) in ranked[:tuning.rechecked]:
        m = dict(mkey)
        acts = tuple(sorted(acts, key=action_order))
        pretty = partition_sources(prog, m, acts)
        for body in ((pretty, acts) if pretty != acts else (acts,)):
            cand = with_members(prog, m, body)
            try:  # the simulator is deterministic: re-run only a rewritten body
                tt = s.simulate(cand, topo, m).total_s if body is pretty else t
            except ExProgError:
                continue  # the cosmetic rewrite broke the body: keep the plain one
            if tt <= naive_s * (1 + NAIVE_SLACK) and is_valid(cand, m):
                return SynthResult(cand, tt, naive_s, m, len(s.cache),
                                   time.perf_counter() - start, s.spent_s, searched)
    return SynthResult(naive, naive_s, naive_s, m0, len(s.cache), time.perf_counter() - start,
                       s.spent_s, searched)


def _offer_hierarchical(s: Search, membership: dict, budget_s, seed, steps) -> None:
    """Add the hierarchical candidate (:mod:`eins.passes.synthesize.hierarchy`) under
    ``membership`` to the candidates of search ``s``, simulated once. Its sub-searches and
    its simulation are not charged to ``s``'s budget, which is spent by then: the search
    finds what it finds without it, and this body is kept only where it is faster."""
    hb = hierarchical_body(s.prog, s.topo, membership,
                           lambda p, t, tu, fams: synthesize_program(p, t, budget_s, seed,
                                                                     fams, steps, tu),
                           s.tuning)
    if hb is None:
        return
    key = (tuple(sorted(membership.items())), frozenset(hb.actions))
    if key not in s.cache:
        try:
            s.cache[key] = s.simulate(with_members(s.prog, membership, hb.actions), s.topo,
                                      membership).total_s
        except ExProgError:   # not valid after all: the union's guard is the simulation
            s.cache[key] = float("inf")


def partition_sources(prog: ExProg, membership: dict, acts):
    """Cosmetics: the local aggregations ``X @ s`` for every site of a partition ``G`` that
    requires ``X`` become the paper's ``X @ G``."""
    acts = list(acts)
    for r in prog.outputs:
        x = frozenset(r.agg)
        for t in r.targets:
            if not isinstance(t, str):
                continue
            locals_ = [Action(x, s) for s in membership[t]]
            if len(membership[t]) > 1 and all(a in acts for a in locals_):
                acts = [a for a in acts if a not in locals_]
                acts.append(Action(x, t))
    return tuple(acts)
