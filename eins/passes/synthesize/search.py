"""The search over bodies for one preamble (paper Section 5.4).

A candidate is a :class:`State`: a membership for the partitions declared by size, one
pattern key per group (:mod:`eins.passes.synthesize.patterns`) and whether slow transfers
are relayed. :meth:`Search.seed` tries every pattern family on every group; :meth:`Search.
improve` climbs by changing one group's pattern (which realises aggregation pushdown/pullup,
multicast fission/fusion and source substitution between the shapes), toggling relays, and
swapping sites between partitions declared by size; :meth:`Search.polish` applies the
paper's action-level rewrites to the best body. Every candidate's simulated time is cached.
"""
from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from eins.errors import ExProgError
from eins.hardware.simulate import simulate_built, simulation_work_s
from eins.ir.exprog import Action, ExProg
from eins.ir.plan import Tuning
from eins.passes.synthesize.bound import FLOOR_SLACK
from eins.passes.synthesize.caches import cached_floor, net_for
from eins.passes.synthesize.patterns import (
    Gather, Group, Hier, Reduce, Reuse, Ring, double_order, groups, normalise, relayed)
from eins.passes.synthesize.preamble import with_members

__all__ = ["State", "Search", "min_gain"]

INF = float("inf")

# How hard the search looks (its share of the budget, patience, move odds, roots tried,
# stopping at the time floor) is ``tuning`` (eins.ir.plan.Tuning), never a global here.
# The family a group keeps when a forced family does not apply to it (one target: no doubling).
FALLBACK_FAMILY = "reduce-binom-mcast"
# The search's own work besides the simulations, charged to its budget as the simulations
# are (modeled seconds on the reference machine, no clock): per action a pattern key writes
# for one group, per action of a body assembled (relayed, normalised), and per requirement
# when the groups of a membership are formed (docs/measured.md, "Behind the code's
# constants"). Without them a search over a 4,096-atom preamble spent seconds building
# bodies its budget never saw.
WORK_PATTERN_S = 5e-6
WORK_BODY_S = 3e-6
WORK_RELAYED_S = 9e-6
WORK_GROUP_S = 5e-6


@dataclass(frozen=True)
class State:
    """A candidate of the climb: its simulated ``time``, the ``membership``, the ``groups``
    under it, one pattern key per group (``keys``), whether slow transfers are ``relay``ed,
    and the seed ``family`` it came from."""

    time: float
    membership: Mapping[str, tuple[int, ...]]   # read-only: :meth:`Search.swap` makes new ones
    groups: tuple
    keys: tuple
    relay: bool
    family: str

    def __post_init__(self):
        if not isinstance(self.membership, MappingProxyType):
            object.__setattr__(self, "membership", MappingProxyType(dict(self.membership)))


def min_gain(prog: ExProg, tuning: Tuning) -> float:
    """The fraction of its time floor within which a search of ``prog`` stops (its naive
    body within it: no search): ``tuning.synthesis_min_gain``, and at least
    ``tuning.scale_min_gain`` over ``tuning.scale_sites`` sites or more."""
    if len(prog.gpus) >= tuning.scale_sites:
        return max(tuning.synthesis_min_gain, tuning.scale_min_gain)
    return tuning.synthesis_min_gain


def family_of(seed_name: str) -> str:
    """The pattern family of a seed family name (``reuse-double-rev`` -> ``double``)."""
    return seed_name.removeprefix("reuse-").split("-")[0]


class Search:
    """Search state for one canonical preamble ``prog`` on ``topo`` within ``budget_s``
    seconds of modeled simulation (each distinct candidate charged its ``SimResult.work_s``),
    seeded by ``seed``. ``families`` (a set of pattern families, or None for all) restricts
    every group to those patterns where they apply; ``tuning`` holds the search's switches
    (:class:`~eins.ir.plan.Tuning`).

    With ``steps`` (a positive int) the search stops after that many distinct simulated
    candidates instead, and ``budget_s`` is ignored. Either way no clock is read, so the
    result depends only on (preamble, topology, seed, budget), not on the machine's speed or
    load."""

    def __init__(self, prog: ExProg, topo, budget_s: float, seed: int, families=None,
                 steps: int | None = None, tuning: Tuning = Tuning(), named=None):
        self.simulate = simulate_built
        self.tuning = tuning
        self.prog = prog
        self.topo = topo
        self.rng = random.Random(seed)
        self.net = net_for(topo, prog.gpus)
        # the budget is the candidates' simulations, each charged its modeled CPU cost
        # (SimResult.work_s, a function of the program alone), or their count (``steps``):
        # no clock is read, so every machine stops at the same candidate
        self.steps = steps
        self.budget_s = tuning.search_share * budget_s
        self.spent_s = 0.0
        self.sizes = {a.name: float(a.size) for a in prog.inputs}
        self.home = {a.name: a.site for a in prog.inputs}
        self.families = None if families is None else frozenset(families)
        self.cache = {}
        self.built = {}   # (membership, pattern keys, relay) -> simulated time
        # one group's actions per (group, key), interned: keys that write the same actions
        # (every pattern of a one-atom, one-target group) share one tuple, so two bodies
        # made of the same group actions are known equal by their parts' ids (``bodies``)
        # without being assembled again
        self.parts = {}
        self.interned = {}
        self.bodies = {}   # (membership, ids of the parts, relay) -> simulated time
        self.patience = tuning.patience
        # no body beats this (a bound over every membership of the partitions declared by
        # size): a candidate that reaches it ends the search (``proven``)
        # (``named``: the preamble ``prog`` is the canonical form of, whose floor may be known)
        self.floor = cached_floor(prog, topo, named) if tuning.stop_at_floor else -INF
        # ... or comes within tuning.synthesis_min_gain of it (scale_min_gain at scale):
        # what is left to gain is less
        self.keep = 1.0 - min_gain(prog, tuning)
        self.proven = False

    def out_of_time(self):
        """Whether the search is over: a candidate reached the floor (``proven``), else
        the budget is spent: ``steps`` distinct candidates simulated (the cache holds
        exactly those), else their modeled simulation time (``spent_s``) reached the
        search's share of ``budget_s``."""
        if self.proven:
            return True
        if self.steps is not None:
            return len(self.cache) >= self.steps
        return self.spent_s >= self.budget_s

    def cost(self, membership, acts):
        """The simulated time of body ``acts`` under ``membership`` (cached). A generated
        body must be valid: the simulator's ExProgError propagates."""
        key = (tuple(sorted(membership.items())), frozenset(acts))
        if key not in self.cache:
            try:
                res = self.simulate(with_members(self.prog, membership, acts), self.topo,
                                    membership)
            except ExProgError:   # an invalid body still cost a simulation's setup
                self.spent_s += simulation_work_s(len(acts), 0, 0)
                raise
            self.spent_s += res.work_s
            t = self.cache[key] = res.total_s
            if t * self.keep <= self.floor * (1 + FLOOR_SLACK):
                self.proven = True
        return self.cache[key]

    def rewrite_cost(self, membership, acts):
        """:meth:`cost` of a body from an action-level rewrite, whose guard (Section 5.4) is
        the simulation itself: a rewrite that breaks validity costs infinity."""
        try:
            return self.cost(membership, acts)
        except ExProgError:
            self.cache[(tuple(sorted(membership.items())), frozenset(acts))] = INF
            return INF

    def groups(self, membership):
        self.spent_s += WORK_GROUP_S * len(self.prog.outputs)
        return tuple(groups(self.prog, membership, self.sizes, self.home, self.net))

    # membership candidates ----------------------------------------------------------------

    def affinity_membership(self):
        """Partitions declared by size take the sites that already hold the most bytes of the
        aggregates they require (a global greedy over (partition, site) pairs), then fill up
        with the free sites fastest to reach from their members."""
        prog = self.prog
        fixed = {p.name: tuple(p.members) for p in prog.partitions if p.members is not None}
        taken = {m for v in fixed.values() for m in v}
        free = [g for g in prog.gpus if g not in taken]
        sized = [p for p in prog.partitions if p.members is None]
        score = {}
        for r in prog.outputs:
            for t in r.targets:
                if isinstance(t, str) and t not in fixed:
                    for a in r.agg:
                        k = (t, self.home[a])
                        score[k] = score.get(k, 0.0) + self.sizes[a]
        order = {p.name: i for i, p in enumerate(sized)}
        want = {p.name: p.size for p in sized}
        got = {p.name: [] for p in sized}
        for (pn, s), v in sorted(score.items(), key=lambda kv: (-kv[1], order[kv[0][0]],
                                                                kv[0][1])):
            if s in free and len(got[pn]) < want[pn]:
                got[pn].append(s)
                free.remove(s)
        for p in sized:
            while len(got[p.name]) < p.size:
                m = got[p.name]
                s = max(free, key=lambda s: (min((self.net.bw(s, t) for t in m), default=0),
                                             -s))
                m.append(s)
                free.remove(s)
        out = dict(fixed)
        for p in sized:
            out[p.name] = tuple(sorted(got[p.name]))
        return {p.name: out[p.name] for p in prog.partitions}

    def swap(self, membership, sized_names):
        """Membership swap: exchange a site of one size-declared partition with a site of
        another one, or with a site in no partition."""
        used = {s for v in membership.values() for s in v}
        free = [g for g in self.prog.gpus if g not in used]
        a = self.rng.choice(sized_names)
        others = [n for n in sized_names if n != a]
        options = [(n, s) for n in others for s in membership[n]] + [(None, s) for s in free]
        if not options or not membership[a]:
            return None
        x = self.rng.choice(membership[a])
        n, y = self.rng.choice(options)
        m2 = dict(membership)
        m2[a] = tuple(sorted(y if s == x else s for s in membership[a]))
        if n is not None:
            m2[n] = tuple(sorted(x if s == y else s for s in membership[n]))
        return m2

    # pattern keys --------------------------------------------------------------------------

    def seed_keys(self, groups):
        """Per seed family, one pattern key per group; owners spread by load. With forced
        ``families``, only theirs."""
        fams = self._all_seed_keys(groups)
        if self.families is None:
            return fams
        return {name: keys for name, keys in fams.items()
                if family_of(name) in self.families}

    def _all_seed_keys(self, groups):
        net = self.net
        fams = {}

        def balanced(tree, bcast):
            load = {}
            keys = []
            for g in groups:
                cands = list(g.targets)
                root = min(cands, key=lambda s: (load.get(s, 0.0),
                                                 -len(dict(g.contrib).get(s, ())), s))
                load[root] = load.get(root, 0.0) + g.nbytes
                keys.append(Reduce(tree, bcast, root))
            return tuple(keys)

        fams["gather"] = tuple(Gather() for _ in groups)
        fams["reduce-flat-mcast"] = balanced("flat", "mcast")
        fams["reduce-binom-mcast"] = balanced("binom", "mcast")
        fams["reduce-binom-tree"] = balanced("binom", "tree")
        fams["reduce-flat-tree"] = balanced("flat", "tree")
        if any(len(g.targets) > 1 for g in groups):
            for rev in (False, True):
                fams[f"double{'-rev' if rev else ''}"] = tuple(
                    replace(double_order(g, net), reverse=rev) if len(g.targets) > 1 else k
                    for g, k in zip(groups, fams[FALLBACK_FAMILY]))
        if not net.uniform:
            fams["ring"] = tuple(Ring(k.root) for k in fams["reduce-flat-mcast"])
            if len(net.clusters) > 1:
                fams["hier-exchange"] = tuple(Hier("exchange") for _ in groups)
                fams["hier-reduce"] = tuple(Hier("reduce") for _ in groups)
        if any(g.reused for g in groups):
            twins = [g.reusing() if g.reused else g for g in groups]
            for name, keys in list(self._all_seed_keys(twins).items()):
                fams["reuse-" + name] = tuple(Reuse(k) if g.reused else k
                                              for g, k in zip(groups, keys))
        return fams

    def alternatives(self, g: Group):
        """Every pattern key for group ``g`` the local search may move to (of the forced
        ``families`` where one applies, else of the fallback reduce family)."""
        keys = self._all_alternatives(g)
        if self.families is None:
            return keys
        return ([k for k in keys if k.family in self.families]
                or [k for k in keys if k.family == family_of(FALLBACK_FAMILY)])

    def _all_alternatives(self, g: Group):
        if g.reused:
            return self._all_alternatives(replace(g, reused=())) + [
                Reuse(k) for k in self._all_alternatives(g.reusing())]
        keys = [Gather()]
        roots = list(g.targets) + [h for h, _ in sorted(g.contrib, key=lambda c: -len(c[1]))
                                   if h not in g.targets][:self.tuning.extra_roots]
        for root in roots:
            for tree in ("flat", "binom", "chain"):
                for bcast in ("mcast", "tree", "chain"):
                    keys.append(Reduce(tree, bcast, root))
        # trees in random orders (the search mutates shapes)
        for root in roots[:self.tuning.shuffled_roots]:
            order = list(g.homes)
            self.rng.shuffle(order)
            keys.append(Reduce("binom", "mcast", root, tuple(order)))
        if len(g.targets) > 1:
            keys.append(double_order(g, self.net))
            keys.append(replace(double_order(g, self.net), reverse=True))
            keys.append(double_order(g, self.net, self.rng))
        if not self.net.uniform:
            keys += [Ring(r) for r in g.targets]
            if len(self.net.clusters) > 1:
                keys += [Hier("exchange"), Hier("reduce")]
        return keys

    # candidates ----------------------------------------------------------------------------

    def part(self, g: Group, k) -> tuple:
        """The actions pattern key ``k`` writes for group ``g`` (interned, charged once)."""
        hit = self.parts.get((g, k))
        if hit is None:
            acts = tuple(k.actions(g, self.net))
            self.spent_s += WORK_PATTERN_S * len(acts)
            hit = self.parts[(g, k)] = self.interned.setdefault(acts, acts)
        return hit

    def assemble(self, parts, relay):
        """The normalised body of the group actions ``parts``, relayed if ``relay``."""
        acts = [a for p in parts for a in p]
        self.spent_s += (WORK_RELAYED_S if relay else WORK_BODY_S) * len(acts)
        if relay:
            acts = relayed(normalise(acts), self.net)
        return normalise(acts)

    def build(self, groups, keys, relay):
        """The normalised body of one pattern key per group, relayed if ``relay``."""
        return self.assemble([self.part(g, k) for g, k in zip(groups, keys)], relay)

    def evaluate(self, membership, groups, keys, relay):
        """:meth:`cost` of the body :meth:`build` makes; ``groups`` are ``membership``'s, so
        (membership, keys, relay) fixes the body: a climb that tries a pattern again (most
        of its moves) takes its time from ``self.built`` instead of building it again, the
        same value the simulation cache would give; keys that write the same actions as
        keys tried before (``bodies``) take theirs, unassembled."""
        mkey = tuple(sorted(membership.items()))
        key = (mkey, keys, relay)
        t = self.built.get(key)
        if t is None:
            parts = [self.part(g, k) for g, k in zip(groups, keys)]
            sig = (mkey, tuple(map(id, parts)), relay)
            t = self.bodies.get(sig)
            if t is None:
                t = self.bodies[sig] = self.cost(membership, self.assemble(parts, relay))
            self.built[key] = t
        return t

    def seed(self, membership) -> State | None:
        """Evaluate every seed family under ``membership``; returns the best state. The
        first family is evaluated both direct and relayed, whatever the budget: relayed, it
        sends what the time cost of the optimized schedule charges (every atom straight to
        its sites, over relays where they beat the direct route: cost/timecost.py _Links),
        so the plan the DP picked for that schedule is not lowered to a body that crosses the
        slow routes the cost bounced around (a search stopped after one candidate would
        otherwise keep the direct body: chain A on dgx-v100-paper, docs/measured.md)."""
        gs = self.groups(membership)
        best = None
        relays = (False,) if self.net.uniform else (False, True)
        for n, (name, keys) in enumerate(self.seed_keys(gs).items()):
            for relay in relays:
                if n and self.out_of_time() and best is not None:
                    return best
                t = self.evaluate(membership, gs, keys, relay)
                if best is None or t < best.time:
                    best = State(t, membership, gs, keys, relay, name)
        return best

    def improve(self, state: State, sized_names) -> State:
        """Hill climbing from ``state`` until the deadline: change one group's pattern,
        toggle relays, or swap two sites between partitions declared by size (re-seeding the
        pattern family that won)."""
        t, membership, gs, keys, relay, fam = (state.time, state.membership, state.groups,
                                               state.keys, state.relay, state.family)
        alts = [None] * len(gs)
        stall = 0
        while not self.out_of_time() and stall < self.patience:
            stall += 1
            move = self.rng.random()
            if move < self.tuning.relay_move and not self.net.uniform:
                nt = self.evaluate(membership, gs, keys, not relay)
                if nt < t:
                    t, relay, stall = nt, not relay, 0
            elif move < self.tuning.swap_move and sized_names:
                m2 = self.swap(membership, sized_names)
                if m2 is None:
                    continue
                g2 = self.groups(m2)
                fams = self.seed_keys(g2)
                # the winning family first, then the shapes that depend most on placement
                tries = [f for f in dict.fromkeys((fam, "double", "double-rev",
                                                   "hier-exchange")) if f in fams]
                for f in tries or [f for f in (FALLBACK_FAMILY,) if f in fams] or [fam]:
                    nt = self.evaluate(m2, g2, fams[f], relay)
                    # sideways moves let placement drift across plateaus
                    if nt <= t:
                        if nt < t:
                            stall = 0
                        t, membership, gs, keys, fam = nt, m2, g2, fams[f], f
                        alts = [None] * len(gs)
                        break
            elif gs:
                i = self.rng.randrange(len(gs))
                if alts[i] is None:
                    alts[i] = self.alternatives(gs[i])
                k = self.rng.choice(alts[i])
                if k == keys[i]:
                    continue
                trial = keys[:i] + (k,) + keys[i + 1:]
                nt = self.evaluate(membership, gs, trial, relay)
                if nt < t:
                    t, keys, stall = nt, trial, 0
        return State(t, membership, gs, keys, relay, fam)

    # action-level rewrites -----------------------------------------------------------------

    def polish(self, membership, acts, t):
        """Action-level hill climbing with the paper's rewrites (Section 5.4) on the best
        program: relay introduction and elimination, aggregation pushdown (``X @ r -> s`` and
        ``Y @ r -> s`` become ``X+Y @ r -> s``) and source substitution. The guards are
        checked by simulating: a rewrite that breaks validity costs infinity and is dropped.
        (Multicast fission and fusion do not change a simulated time: the simulator starts
        the transfers of ``X @ s -> D1`` and ``X @ s -> D2`` together, as a multicast.)"""
        rewrites = (self.relay_in, self.relay_out, self.pushdown, self.substitute)
        stall = 0
        acts = tuple(acts)
        while not self.out_of_time() and stall < self.patience // 2:
            stall += 1
            new = self.rng.choice(rewrites)(acts)
            if new is None:
                continue
            new = normalise(new)
            nt = self.rewrite_cost(membership, new)
            if nt < t:
                t, acts, stall = nt, new, 0
        return t, acts

    def _transfers(self, acts):
        return [(i, d) for i, a in enumerate(acts) if len(a.hops) == 1 for d in a.hops[0]]

    def _without(self, acts, i, d):
        a = acts[i]
        rest = tuple(x for x in a.hops[0] if x != d)
        out = list(acts[:i]) + list(acts[i + 1:])
        out.append(Action(a.agg, a.source, (rest,)) if rest else Action(a.agg, a.source))
        return out

    def relay_in(self, acts):
        """Relay introduction: one transfer ``s -> d`` becomes ``s -> r -> d``."""
        tr = self._transfers(acts)
        if not tr:
            return None
        i, d = self.rng.choice(tr)
        s = acts[i].source
        relays = [r for r in self.prog.gpus if r not in (s, d)]
        if not relays:
            return None
        r = self.rng.choice(relays)
        return self._without(acts, i, d) + [Action(acts[i].agg, s, ((r,), (d,)))]

    def relay_out(self, acts):
        """Relay elimination: ``s -> r -> d`` becomes ``s -> d``."""
        rel = [i for i, a in enumerate(acts) if len(a.hops) == 2]
        if not rel:
            return None
        i = self.rng.choice(rel)
        a = acts[i]
        return list(acts[:i]) + list(acts[i + 1:]) + [Action(a.agg, a.source, (a.hops[1],))]

    def pushdown(self, acts):
        """Aggregation pushdown: ``X @ r -> d`` and ``Y @ r -> d`` become ``X+Y @ r -> d``."""
        by = {}
        for i, d in self._transfers(acts):
            by.setdefault((acts[i].source, d), []).append(i)
        pairs = [(k, v) for k, v in by.items() if len(v) > 1]
        if not pairs:
            return None
        (r, d), idx = self.rng.choice(pairs)
        i, j = self.rng.sample(idx, 2)
        x, y = acts[i].agg, acts[j].agg
        if x & y:
            return None
        out = self._without(acts, i, d)
        k = next(n for n, a in enumerate(out) if a == acts[j])
        return self._without(out, k, d) + [Action(x | y, r, ((d,),))]

    def substitute(self, acts):
        """Source substitution: a transfer of ``X`` draws from another site holding ``X``."""
        tr = self._transfers(acts)
        if not tr:
            return None
        i, d = self.rng.choice(tr)
        x = acts[i].agg
        holders = {a.source for a in acts if a.agg == x and isinstance(a.source, int)}
        holders |= {h for a in acts if a.agg == x for hop in a.hops for h in hop}
        if len(x) == 1:
            holders.add(self.home[next(iter(x))])
        holders -= {acts[i].source, d}
        if not holders:
            return None
        s2 = self.rng.choice(sorted(holders))
        return self._without(acts, i, d) + [Action(x, s2, ((d,),))]
