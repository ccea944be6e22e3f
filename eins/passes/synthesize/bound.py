"""A lower bound on the simulated time of every valid body of a preamble (the search's floor).

A body's time is at least the time its sites need to receive and to send the bytes that any
valid body must move, after the least latency of a transfer into (out of) the site: in the
simulator (:mod:`eins.hardware.simulate`) no byte flows before its transfer's latency has
passed, and every transfer starts at 0 or later. So when
a candidate's simulated time reaches this floor no body is faster, and the search
(:mod:`eins.passes.synthesize.search`) stops there instead of spending the rest of its budget
(on a 72-GPU switch most preambles of a LLaMA block reach it with their first or second
candidate: the naive body, or the seed under the affinity membership).

Why it is a lower bound (Definition 5.5; the size of an aggregate is its largest atom's):

- *into a site d*: every atom of an aggregate ``X`` required at ``d`` and not held at ``d``
  arrives inside some received aggregate ``Z`` with ``Z ⊆ X`` (aggregation only adds, and the
  aggregates present at ``d`` that partition ``X`` are made of received ones and of atoms
  held there). Atoms no required aggregate at ``d`` holds together arrive in distinct
  aggregates, each at least that atom's size: the received bytes are at least the sizes of
  any such set of atoms (:func:`_apart`, a greedy pick, largest first);
- *out of a site s*: likewise for the atoms held only at ``s`` that an aggregate required at
  another site contains (a partition declared by size may sit at ``s``, one of them at most);
- bytes flow into ``d`` at most at :func:`rates`' ``in`` rate: the least total capacity of
  a set of resources every route into ``d`` crosses (:func:`cut_rate`: its routes' last
  resources, say a GPU's switch port and its NIC, or their narrowest ones, or one they all
  share); out of ``s`` alike;
- and none before the least latency of a route into ``d`` (:func:`latencies`; a relayed
  byte's last hop is such a route), none out of ``s`` before the least of a route out of it.

Across nodes (a multi-node cluster, :func:`node_cuts`): an atom required at a site of node
``N`` and held at no site of ``N`` enters ``N`` over a route from outside it, and atoms no
aggregate required in ``N`` holds together enter apart; so the bytes entering ``N`` over the
rate of the routes into ``N`` (on a rail-optimized cluster its NICs' sum), after their least
latency, bound every body; leaving ``N`` alike. And since ``T >= L + B_N / R_N`` for every
node, ``T >= L_min + sum(B_N) / sum(R_N)``, where a free partition of one site whose atoms
no other requirement wants adds its bytes from outside the node where they are fewest: the
bound over every membership of an all-to-all declared by size.

With partitions declared by size and no membership, a partition's requirements are bounded at
the one of its free sites where they are cheapest, and out of a site as if the one partition
of one site that lowers its bound most sat there: a bound over every membership.
"""
from __future__ import annotations

import weakref

from eins.cost.rails import symmetric_rails

__all__ = ["time_floor", "names_free", "rates", "latencies", "cut_rate", "node_cuts",
           "FLOOR_SLACK"]

# A simulated time within this relative float noise of the floor has reached it.
FLOOR_SLACK = 1e-9

_RATES = weakref.WeakKeyDictionary()
_LATENCIES = weakref.WeakKeyDictionary()
_CUTS = weakref.WeakKeyDictionary()


def rates(topo) -> tuple[dict, dict]:
    """``(in, out)``: per GPU of ``topo``, the most bytes/s it can receive and send (see the
    module docstring); computed once per topology object."""
    hit = _RATES.get(topo)
    if hit is not None:
        return hit
    gpus = tuple(topo.gpus)

    def pair(g):
        return (cut_rate(topo, [topo.route(s, g) for s in gpus if s != g]),
                cut_rate(topo, [topo.route(g, d) for d in gpus if d != g]))

    each = _per_gpu(topo, gpus, pair)
    hit = _RATES[topo] = ({g: r[0] for g, r in each.items()},
                          {g: r[1] for g, r in each.items()})
    return hit


def _per_gpu(topo, gpus, f) -> dict:
    """{g: f(g)} over ``gpus``; on a symmetric rail cluster every GPU is the first's image
    under a renumbering of nodes and rails, and so are its routes: f of the first is f of
    every GPU."""
    if symmetric_rails(topo):
        return dict.fromkeys(gpus, f(gpus[0]))
    return {g: f(g) for g in gpus}


def cut_rate(topo, routes) -> float:
    """The most bytes/s that can flow over ``routes`` together: the least total capacity of
    a set of resources every route crosses (a cover), over a few covers: each route's
    first resource, its last, its narrowest (ties to the resource most routes share), and
    one resource all routes cross. Every byte on a route crosses each of its resources, so
    no cover carries more than its capacities' sum. 0 for no routes; infinite where a route
    crosses nothing."""
    if not routes:
        return 0.0
    if any(not r for r in routes):
        return float("inf")
    cap = topo.capacity
    count = {}
    for route in routes:
        for r in set(route):
            count[r] = count.get(r, 0) + 1
    covers = [{r[0] for r in routes}, {r[-1] for r in routes},
              {min(r, key=lambda x: (cap[x], -count[x], x)) for r in routes}]
    best = min(sum(cap[x] for x in c) for c in covers)
    common = [x for x, n in count.items() if n == len(routes)]
    return min([best] + [cap[x] for x in common])


def latencies(topo) -> tuple[dict, dict]:
    """``(in, out)``: per GPU of ``topo``, the least latency of a transfer into and out of it
    (:meth:`~eins.hardware.topology.Topology.route_latency`); computed once per topology
    object."""
    hit = _LATENCIES.get(topo)
    if hit is not None:
        return hit
    gpus = tuple(topo.gpus)
    lin, lout = {g: 0.0 for g in gpus}, {g: 0.0 for g in gpus}
    if any(topo.latency.values()) and len(gpus) > 1:
        def least(g):
            return (min(topo.route_latency(s, g) for s in gpus if s != g),
                    min(topo.route_latency(g, d) for d in gpus if d != g))

        each = _per_gpu(topo, gpus, least)
        lin = {g: x[0] for g, x in each.items()}
        lout = {g: x[1] for g, x in each.items()}
    _LATENCIES[topo] = (lin, lout)
    return lin, lout


def node_cuts(topo, sites) -> list:
    """Per node of a multi-node ``topo`` holding some of ``sites`` (and not all of them):
    ``(members, in rate, out rate, in latency, out latency)``: the node's sites, the most
    bytes/s that can enter (leave) it from (to) the other sites (:func:`cut_rate` over the
    routes that cross its boundary), and the least latency of such a route. Empty for one
    node. Computed once per topology object and sites."""
    per = _CUTS.setdefault(topo, {})
    key = tuple(sites)
    if key in per:
        return per[key]
    out = []
    if getattr(topo, "kind", None) == "multinode":
        nodes = {}
        for s in key:
            nodes.setdefault(topo.node_of(s), []).append(s)
        # on a symmetric rail cluster, exchanging two nodes that hold the sites of the same
        # rails maps the sites and routes onto themselves: their cuts are the same numbers
        g = topo.gpus_per_node
        same = {} if symmetric_rails(topo) else None
        for members in nodes.values() if len(nodes) > 1 else ():
            shape = None if same is None else tuple(s % g for s in members)
            cut = None if shape is None else same.get(shape)
            if cut is None:
                cut = _cut(topo, key, members)
                if shape is not None:
                    same[shape] = cut
            out.append((tuple(members), *cut))
    per[key] = out
    return out


def _cut(topo, sites, members) -> tuple:
    """:func:`node_cuts`' rates and latencies of the node holding ``members``."""
    inside = set(members)
    outside = [s for s in sites if s not in inside]
    ins = [(s, d) for s in outside for d in members]
    outs = [(d, s) for s in outside for d in members]
    return (cut_rate(topo, [topo.route(a, b) for a, b in ins]),
            cut_rate(topo, [topo.route(a, b) for a, b in outs]),
            min(topo.route_latency(a, b) for a, b in ins),
            min(topo.route_latency(a, b) for a, b in outs))


def _apart(atoms, within, size) -> float:
    """Bytes of a set of ``atoms`` no two of which lie in one aggregate (``within``: atom ->
    ids of the aggregates holding it), greedy, largest first: each travels in an aggregate
    of its own."""
    return _greedy(_largest_first(atoms, size), within, size)


def _largest_first(atoms, size) -> list:
    return sorted(atoms, key=lambda a: (-size[a], a))


def _greedy(order, within, size) -> float:
    """:func:`_apart` of atoms given in its order (largest first)."""
    blocked, total = set(), 0.0
    for a in order:
        mine = within.get(a, ())
        if blocked.isdisjoint(mine):
            blocked.update(mine)
            total += size[a]
    return total


def _within(xs) -> dict:
    out = {}
    for i, x in enumerate(xs):
        for a in x:
            out.setdefault(a, set()).add(i)
    return out


def _disjoint(xs):
    """Whether no atom lies in two of the aggregates ``xs``: ``"single"`` where each holds
    one atom (of its own: the aggregates are distinct), else a bool."""
    lengths = set(map(len, xs))
    if lengths <= {1}:
        return "single"
    return sum(map(len, xs)) == len(frozenset().union(*xs))


def _received(xs, keep, size, disjoint, within=None, order=None) -> float:
    """:func:`_apart` of the atoms of the distinct aggregates ``xs`` that ``keep`` (atom ->
    bool) accepts, ``within`` ``xs``'s. Where ``xs`` are ``disjoint`` (and the sizes whole,
    added exactly in any order) the greedy pick is each aggregate's largest such atom."""
    if disjoint:
        if disjoint == "single":   # one atom each: every kept atom travels apart
            return sum((size[a] for x in xs for a in x if keep(a)), 0.0)
        return sum((max((size[a] for a in x if keep(a)), default=0.0) for x in xs), 0.0)
    if order is None:
        order = _largest_first({a for x in xs for a in x}, size)
    return _greedy((a for a in order if keep(a)), within or _within(xs), size)


def _exact(size) -> bool:
    """Whether the sizes (atom -> float) are whole bytes adding up below 2**53: every sum of
    them is exact in any order."""
    return all(v.is_integer() for v in size.values()) and sum(size.values()) < 2.0**53


def names_free(prog) -> bool:
    """Whether :func:`time_floor` of ``prog`` is the same under every renaming of its atoms
    (a preamble and its canonical form, :func:`eins.passes.synthesize.caches.canonical`):
    where the sizes are :func:`_exact` and the required aggregates pairwise disjoint, every
    greedy pick is an aggregate's largest atom (or one of a size), whichever name breaks a
    tie between equal sizes."""
    return _exact({a.name: float(a.size) for a in prog.inputs}) and \
        bool(_disjoint({frozenset(r.agg) for r in prog.outputs}))


def _seconds(nbytes, rate, latency=0.0) -> float:
    if nbytes <= 0:
        return 0.0
    return latency + nbytes / rate if rate > 0 else float("inf")


def time_floor(prog, topo, membership=None) -> float:
    """Seconds no valid body of preamble ``prog`` (its body ignored) can beat on ``topo``
    under ``membership`` (partition name -> sites; partitions it leaves out keep their
    declared members, and those declared by size are free: the bound holds for every
    membership of them). See the module docstring."""
    membership = dict(membership or {})
    rin, rout = rates(topo)
    lin, lout = latencies(topo)
    size = {a.name: float(a.size) for a in prog.inputs}
    # whole bytes adding up below 2**53: every sum of sizes is exact in any order, so the
    # greedy picks may be added (and taken apart) in another order than theirs
    exact = _exact(size)
    held = {}
    for a in prog.inputs:
        held.setdefault(a.name, set()).add(a.site)
    fixed = {p.name: tuple(membership.get(p.name, p.members)) for p in prog.partitions
             if membership.get(p.name, p.members) is not None}
    taken = {s for v in fixed.values() for s in v}
    free_sites = [g for g in prog.gpus if g not in taken]
    free_set = set(free_sites)
    # site -> its required aggregates; free partition -> its aggregates (distinct, in order:
    # an aggregate required twice holds the same atoms together, so it blocks the same)
    at, free = {}, {}
    for r in prog.outputs:
        x = frozenset(r.agg)
        for t in r.targets:
            if isinstance(t, str) and t not in fixed:
                free.setdefault(t, {})[x] = None
                continue
            for s in (fixed[t] if isinstance(t, str) else (t,)):
                at.setdefault(s, {})[x] = None

    def into(d, xs, disjoint, within=None, order=None):
        got = _received(xs, lambda a: d not in held[a], size, disjoint, within, order)
        return _seconds(got, rin[d], lin[d])

    floor = max((into(d, xs, exact and _disjoint(xs)) for d, xs in at.items()), default=0.0)
    lins = {lin[c] for c in free_sites}
    by_rate = sorted(free_sites, key=lambda c: -rin[c])
    for xs in free.values():
        # a free site holding none of the atoms needs all of them, the same bytes at each:
        # only the quickest to receive them counts (the fastest, where latencies are equal)
        holders = {s for x in xs for a in x for s in held[a]}
        cands = [c for c in holders if c in free_set]
        if len(lins) > 1:
            others = [c for c in free_sites if c not in holders]
            if len({lin[c] for c in others}) > 1:
                cands += others
            else:
                cands += sorted(others, key=lambda c: -rin[c])[:1]
        else:
            cands += next(([c] for c in by_rate if c not in holders), [])
        disjoint = exact and _disjoint(xs)
        within, order = (None, None) if disjoint else \
            (_within(xs), _largest_first({a for x in xs for a in x}, size))
        if cands:
            floor = max(floor, min(into(c, xs, disjoint, within, order) for c in cands))
    floor = max(floor, _out_floor(prog, at, free, held, size, free_set, rout, lout, exact))
    cuts = node_cuts(topo, prog.gpus)
    if cuts:
        floor = max(floor, _cut_floor(prog, cuts, at, free, held, size, free_set, exact))
    return floor


def _out_floor(prog, at, free, held, size, free_set, rout, lout, exact) -> float:
    """Out of each site s: the atoms held only at s that an aggregate required at another
    site holds. A free partition of one site may sit at s (then its aggregates need not
    leave s), but at most one of them can: the bound is the least over which one does, if
    any."""
    single = {p.name for p in prog.partitions if p.name in free and p.size == 1}
    pairs = [(d, x) for d, xs in at.items() for x in xs]
    pairs += [(pn, x) for pn, xs in free.items() for x in xs]
    within = {}
    for i, (d, x) in enumerate(pairs):
        for a in x:
            if len(held[a]) == 1 and d not in held[a]:
                within.setdefault(a, []).append(i)
    sends = {}
    for a in within:
        sends.setdefault(next(iter(held[a])), []).append(a)
    floor = 0.0
    for s, atoms in sends.items():
        ids = [i for a in atoms for i in within[a]]
        if exact and len(ids) == len(set(ids)):
            # no two of s's atoms meet in a requirement, so each leaves apart; a partition
            # sitting at s spares the atoms it alone requires
            spared = {}
            for a in atoms if s in free_set else ():
                dests = {pairs[i][0] for i in within[a]}
                q = next(iter(dests))
                if len(dests) == 1 and q in single:
                    spared[q] = spared.get(q, 0.0) + size[a]
            least = sum((size[a] for a in atoms), 0.0) - max(spared.values(), default=0.0)
        else:
            options = [None] + (sorted({pairs[i][0] for i in ids if pairs[i][0] in single})
                                if s in free_set else [])
            least = float("inf")
            for q in options:
                # (two of s's atoms travel together only inside an aggregate required
                # elsewhere)
                mine = {a: {i for i in within[a] if pairs[i][0] not in (s, q)} for a in atoms}
                least = min(least, _apart([a for a in atoms if mine[a]], mine, size))
        floor = max(floor, _seconds(least, rout[s], lout[s]))
    return floor


def _cut_floor(prog, cuts, at, free, held, size, free_sites, exact) -> float:
    """The bound across the nodes' boundaries (module docstring, "Across nodes"), in one
    pass over the requirements: per node, the atoms entering it are those of its own
    requirements, and those leaving it are its atoms alone that an aggregate required at a
    site of another node holds (an aggregate with none of them never blocks one)."""
    where = {m: k for k, (members, *_) in enumerate(cuts) for m in members}
    homes = {a: {where.get(s, -1) for s in hs} for a, hs in held.items()}   # -1: no node's
    mine = [{} for _ in cuts]   # per node, its sites' aggregates (distinct)
    nodes_of = {}               # aggregate -> the nodes requiring it
    for d, xs in at.items():
        k = where.get(d, -1)
        for x in xs:
            if k >= 0:
                mine[k][x] = None
            nodes_of.setdefault(x, set()).add(k)
    # per node, its lone atoms largest first, each with the aggregates holding it
    lone = [[] for _ in cuts]
    holding = {}
    for x in nodes_of:
        for a in x:
            if len(homes[a]) == 1 and -1 not in homes[a]:
                holding.setdefault(a, []).append(x)
    for a in _largest_first(holding, size):
        lone[next(iter(homes[a]))].append(a)
    floor, total, cap, lat = 0.0, 0.0, 0.0, float("inf")
    for k, (members, rin, rout, lin, lout) in enumerate(cuts):
        xs = mine[k]
        enter = _received(xs, lambda a: k not in homes[a], size, exact and _disjoint(xs))
        blocked, leave = set(), 0.0
        for a in lone[k]:
            away = [x for x in holding[a] if nodes_of[x] != {k}]
            if away and blocked.isdisjoint(away):
                blocked.update(away)
                leave += size[a]
        floor = max(floor, _seconds(enter, rin, lin), _seconds(leave, rout, lout))
        total, cap, lat = total + enter, cap + rin, min(lat, lin)
    # a free partition of one site whose aggregates no other requirement shares sits in one
    # node, and its atoms from elsewhere enter that node, apart from every other's: added
    # at its cheapest node, the bytes entering all nodes over their rates added
    sizes = {p.name: p.size for p in prog.partitions}
    shared = {}
    for r in prog.outputs if any(sizes[pn] == 1 for pn in free) else ():
        for a in r.agg:
            shared.setdefault(a, set()).update(r.targets)
    with_free = {k for k, (members, *_) in enumerate(cuts) if free_sites.intersection(members)}
    for pn, xs in free.items():
        atoms = {a for x in xs for a in x}
        if sizes[pn] != 1 or any(shared[a] != {pn} for a in atoms):
            continue
        w, order = _within(xs), _largest_first(atoms, size)
        # a node holding none of the atoms receives them all: the most
        touched = {k for a in atoms for k in homes[a]} & with_free
        least = [_greedy((a for a in order if k not in homes[a]), w, size) for k in touched]
        if len(touched) < len(with_free):
            least.append(_greedy(order, w, size))
        total += min(least, default=0.0)
    return max(floor, _seconds(total, cap, lat))
