"""Communication patterns for one required aggregate (paper Section 5.4).

After a membership is fixed, every ``OUT`` requirement resolves to a :class:`Group`: one
aggregate ``X`` and the sites that need it. A *pattern key* (a small frozen dataclass below)
names one way to deliver it: gather, reduce at an owner then multicast or tree-broadcast,
binomial/chain reductions, recursive doubling, rings along fast links, hierarchical (inside a
fast-link clique first, then across), or any of them reusing required sub-aggregates. Each
key's :meth:`actions` writes the group's sub-program. Because the closure is monotone in the
program (proof of Theorem 5.6), the union of valid sub-programs per group is valid for the
whole preamble. :func:`relayed` and :func:`normalise` rewrite whole bodies.
"""
from __future__ import annotations

from dataclasses import dataclass

from eins.hardware.net import Net
from eins.ir.exprog import Action, agg_text
from eins.passes.synthesize.preamble import required

__all__ = ["Group", "groups", "Gather", "Reduce", "Double", "Ring", "Hier", "Rail", "Reuse",
           "FAMILIES", "rail_entries",
           "double_order", "pair_order", "relayed", "normalise", "action_order"]

# Block matchings for recursive doubling are exhaustive up to this many blocks (105 perfect
# matchings of 8), greedy by score beyond.
EXACT_MATCHING_MAX = 8

# The pattern families a caller may force (see synthesize_program's ``families``).
FAMILIES = ("gather", "reduce", "double", "ring", "hier")


# -- groups ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One required aggregate ``x``, the sites that need it, and its contributors: per home
    site, the atoms of ``x`` stored there (aggregated locally before they travel)."""

    x: frozenset
    targets: tuple
    contrib: tuple  # ((home, frozenset), ...) in home order
    nbytes: float
    reused: tuple = ()  # contributors when required sub-aggregates are reused (see groups)

    @property
    def homes(self):
        return tuple(h for h, _ in self.contrib)

    def reusing(self) -> "Group":
        """The twin whose contributors are ``reused`` (required sub-aggregates included)."""
        return Group(self.x, self.targets, self.reused, self.nbytes)


def groups(prog, membership, sizes, home, net=None) -> list:
    """The groups of the preamble under ``membership``. With ``net``, each group also gets a
    ``reused`` twin whose contributors include other required aggregates ``Y`` strictly
    inside ``X`` where they are required (``Y`` is materialised there by Y's own group, so
    the closure holds it), as Example 5.2's second round reuses ``A+B``."""
    req = required(prog, membership)
    # (only aggregates of two or more atoms can be reused, inside larger ones)
    multi = [y for y in req if len(y) > 1]
    out = []
    for x, sites in req.items():
        by = {}
        for a in sorted(x):
            by.setdefault(home[a], set()).add(a)
        contrib = tuple((h, frozenset(v)) for h, v in sorted(by.items()))
        g = Group(x, tuple(sites), contrib, max(sizes[a] for a in x))
        out.append(g)
        if net is None or len(x) < 3:
            continue
        left, parts = set(x), {}
        for y in sorted((y for y in multi if y < x), key=lambda y: (-len(y), agg_text(y))):
            if y <= left:
                r = max(req[y], key=lambda r: (min(net.bw(r, t) for t in sites), -r))
                parts.setdefault(r, set()).update(y)
                left -= y
        if parts:
            for a in left:
                parts.setdefault(home[a], set()).add(a)
            out[-1] = Group(x, g.targets, g.contrib, g.nbytes,
                            tuple((h, frozenset(v)) for h, v in sorted(parts.items())))
    return out


# -- pattern keys ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gather:
    """Every contributor's local partial multicast to every target, aggregated there."""

    family = "gather"

    def actions(self, g: Group, net: Net) -> list:
        acts = []
        for h, p in g.contrib:
            dests = tuple(t for t in g.targets if t != h)
            if dests:
                acts.append(Action(p, h, (dests,)))
        whole = len(g.contrib) == 1
        for t in g.targets:
            if not (whole and g.contrib[0][0] != t):
                acts.extend(_local(g.x, t))
        return acts


@dataclass(frozen=True)
class Reduce:
    """Reduce to ``root`` along a ``tree`` (``flat``, ``chain`` or ``binom``) over ``order``
    (default: :func:`by_bw`), then deliver with ``bcast`` (``mcast``, ``tree``, ``chain``)."""

    tree: str
    bcast: str
    root: int
    order: tuple | None = None
    family = "reduce"

    def actions(self, g: Group, net: Net) -> list:
        order = self.order if self.order is not None else by_bw(g.homes, self.root, net)
        return (tree_reduce(g, self.root, order, self.tree)
                + broadcast(g, self.root, self.bcast, net))


@dataclass(frozen=True)
class Double:
    """Recursive doubling over ``main`` with ``folds`` (see :func:`doubling`); ``reverse``
    runs the rounds from the highest bit down."""

    main: tuple
    folds: tuple
    reverse: bool = False
    family = "double"

    def actions(self, g: Group, net: Net) -> list:
        return doubling(g, self.main, self.folds, self.reverse)


@dataclass(frozen=True)
class Ring:
    """Chain reduction along the ring ending at ``root``, then a relay chain onward."""

    root: int
    family = "ring"

    def actions(self, g: Group, net: Net) -> list:
        return ring_pattern(g, self.root, net)


@dataclass(frozen=True)
class Hier:
    """Hierarchical over the fast-link cliques; ``mode`` is ``exchange`` or ``reduce``."""

    mode: str
    family = "hier"

    def actions(self, g: Group, net: Net) -> list:
        return hier(g, net, self.mode)


@dataclass(frozen=True)
class Rail:
    """Rail-aware hierarchical, on a multi-node rail cluster: reduce inside each node to
    its leader (its entry where the node needs ``x``), send each node's partial once to
    every other needing node's ``entries`` site, which multicasts ``x`` inside its node.
    ``entries`` pairs (node, site) per needing node, chosen across groups so the NICs the
    cross-node sends leave and enter by carry even loads (:func:`rail_entries`); None:
    each needing node's entry is its target on the rail of the largest contributor."""

    entries: tuple | None = None
    family = "hier"

    def actions(self, g: Group, net: Net) -> list:
        return rail_pattern(g, net, dict(self.entries) if self.entries is not None else None)


@dataclass(frozen=True)
class Reuse:
    """``inner`` applied to the group's twin that reuses required sub-aggregates."""

    inner: object

    @property
    def family(self) -> str:
        return self.inner.family

    def actions(self, g: Group, net: Net) -> list:
        return self.inner.actions(g.reusing(), net)


# -- the generators ----------------------------------------------------------------------------


def _local(x, s):
    return [Action(x, s)] if len(x) > 1 else []


def tree_reduce(g: Group, root, order, shape):
    """Reduce the contributors of ``g`` to ``root`` along a tree over ``[root] + order``:
    ``flat`` (everyone sends to the root), ``chain`` (each to the previous) or ``binom``
    (node i sends to i with its lowest set bit cleared). Each node forwards its own atoms
    and what its children sent, aggregated (aggregation pushdown)."""
    contrib = dict(g.contrib)
    nodes = [root] + [h for h in order if h != root and h in contrib]
    acc = [set(contrib.get(s, ())) for s in nodes]
    acts = []
    for i in range(len(nodes) - 1, 0, -1):
        p = 0 if shape == "flat" else (i - 1 if shape == "chain" else i & (i - 1))
        if acc[i]:
            acts.append(Action(frozenset(acc[i]), nodes[i], ((nodes[p],),)))
            acc[p] |= acc[i]
    return acts


def broadcast(g: Group, root, shape, net: Net):
    """Deliver ``g.x`` from ``root`` to its other targets: one ``mcast``, a fan-out-2
    ``tree`` (fastest receivers first, each forwarding), or a relay ``chain``."""
    rest = [t for t in g.targets if t != root]
    if not rest:
        return _local(g.x, root)
    if shape == "mcast":
        return [Action(g.x, root, (tuple(rest),))]
    if shape == "chain":
        return [Action(g.x, root, tuple((t,) for t in rest))]
    rest.sort(key=lambda t: -net.bw(root, t))
    nodes = [root] + rest
    acts = []
    for k, s in enumerate(nodes):
        kids = tuple(nodes[c] for c in (2 * k + 1, 2 * k + 2) if c < len(nodes))
        if kids:
            acts.append(Action(g.x, s, (kids,)))
    return acts


def by_bw(sites, root, net):
    """Sites ordered cluster of ``root`` first, then by bandwidth to ``root``."""
    c = net.cluster_of.get(root)
    return sorted(sites, key=lambda s: (net.cluster_of.get(s) != c, -net.bw(s, root), s))


def doubling(g: Group, main, folds=(), reverse_bits=False):
    """Recursive doubling over ``main`` (a power of two of sites): position i exchanges its
    partial aggregate with position i xor 2^b in round b. ``folds`` are ``(site, k)``: sites
    past the power of two fold their atoms into ``main[k]`` first and receive the total at
    the end (Example 5.2's shape, generalised)."""
    contrib = dict(g.contrib)
    n2 = len(main)
    acc = [set(contrib.get(s, ())) for s in main]
    acts = []
    for e, k in folds:
        if contrib.get(e):
            acts.append(Action(contrib[e], e, ((main[k],),)))
            acc[k] |= contrib[e]
    bits = list(range(n2.bit_length() - 1))
    if reverse_bits:
        bits.reverse()
    for b in bits:
        new = [set(a) for a in acc]
        for i in range(n2):
            if acc[i]:
                acts.append(Action(frozenset(acc[i]), main[i], ((main[i ^ (1 << b)],),)))
                new[i ^ (1 << b)] |= acc[i]
        acc = new
    tset = set(g.targets)
    for k, s in enumerate(main):
        dests = tuple(e for e, j in folds if j == k and e in tset)
        if dests:
            acts.append(Action(g.x, s, (dests,)))
        elif s in tset:
            acts.extend(_local(g.x, s))
    return acts


def ring_pattern(g: Group, root, net: Net):
    """Along the ring: a chain reduction that ends at ``root``, then a relay chain forward
    from it through the other targets (ring all-reduce when roots rotate over groups)."""
    ring = net.ring
    k = ring.index(root)
    walk = ring[k + 1:] + ring[:k]  # data flows forward: successor of root first
    part = set(g.homes) | set(g.targets)
    contrib = dict(g.contrib)
    acts, acc = [], set()
    for s in walk:
        if s not in part:
            continue
        acc |= contrib.get(s, set())
        nxt = next((t for t in walk[walk.index(s) + 1:] if t in part), root)
        if acc:
            acts.append(Action(frozenset(acc), s, ((nxt,),)))
    rest = [t for t in walk if t in g.targets]
    if rest:
        acts.append(Action(g.x, root, tuple((t,) for t in rest)))
    elif root in g.targets:
        acts.extend(_local(g.x, root))
    return acts


def hier(g: Group, net: Net, mode):
    """Hierarchical: reduce inside each fast-link clique to a leader (a target there if any),
    then across leaders (``exchange``: every leader sends its clique's partial to every
    target leader; ``reduce``: to one root leader, which sends the total back), then each
    target leader multicasts inside its clique."""
    contrib = dict(g.contrib)
    leaders = []
    for c in net.clusters:
        homes = [h for h in c if h in contrib]
        tg = [t for t in g.targets if t in c]
        if not homes and not tg:
            continue
        if tg:
            lead = max(tg, key=lambda s: (len(contrib.get(s, ())), -s))
        else:  # the clique's door to the nearest target
            lead = max(homes, key=lambda s: (max(net.bw(s, t) for t in g.targets),
                                             len(contrib[s]), -s))
        acts_c = tree_reduce(g, lead, by_bw(homes, lead, net), "binom")
        leaders.append((lead, tg, acts_c, frozenset(a for h in homes for a in contrib[h])))
    acts = [a for _, _, ac, _ in leaders for a in ac]
    tleaders = [lead for lead, tg, _, _ in leaders if tg]
    if mode == "exchange" or len(tleaders) <= 1:
        for lead, tg, _, p in leaders:
            others = tuple(t for t in tleaders if t != lead)
            if p and others:
                acts.append(Action(p, lead, (others,)))
        for lead, tg, _, _ in leaders:
            if tg:
                rest = tuple(t for t in tg if t != lead)
                acts.append(Action(g.x, lead, (rest,)) if rest else Action(g.x, lead))
    else:
        root = max(leaders, key=lambda L: (len(L[1]), len(L[3])))[0]
        for lead, tg, _, p in leaders:
            if lead != root and p:
                acts.append(Action(p, lead, ((root,),)))
        first = tuple([t for t in tleaders if t != root] +
                      [t for t in g.targets if net.cluster_of[t] == net.cluster_of[root]
                       and t != root])
        acts.append(Action(g.x, root, (first,)) if first else Action(g.x, root))
        for lead, tg, _, _ in leaders:
            rest = tuple(t for t in tg if t != lead)
            if lead != root and rest:
                acts.append(Action(g.x, lead, (rest,)))
    return [a for a in acts if len(a.agg) > 1 or a.hops]


def _by_node(sites, topo) -> dict:
    out = {}
    for s in sites:
        out.setdefault(topo.node_of(s), []).append(s)
    return out


def rail_pattern(g: Group, net: Net, entries) -> list:
    """The actions of :class:`Rail` (``entries``: node -> entry site, or None)."""
    topo = net.topo
    per = topo.gpus_per_node
    contrib = dict(g.contrib)
    homes = _by_node(g.homes, topo)
    needs = _by_node(g.targets, topo)
    if entries is None:
        big = max(g.contrib, key=lambda c: (len(c[1]), -c[0]))[0]
        entries = {m: min(ts, key=lambda t: (t % per != big % per, t))
                   for m, ts in needs.items()}
    acts = []
    leaders = {}
    for n, hs in homes.items():
        lead = entries[n] if n in needs else max(hs, key=lambda h: (len(contrib[h]), -h))
        leaders[n] = lead
        acts += tree_reduce(g, lead, by_bw(hs, lead, net), "binom")
        part = frozenset(a for h in hs for a in contrib[h])
        others = tuple(e for m, e in entries.items() if m != n)
        if others:
            acts.append(Action(part, lead, (others,)))
    for m, ts in needs.items():
        e = entries[m]
        rest = tuple(t for t in ts if t != e)
        acts.append(Action(g.x, e, (rest,)) if rest else Action(g.x, e))
    return [a for a in acts if len(a.agg) > 1 or a.hops]


def rail_entries(groups, net: Net) -> tuple:
    """One :class:`Rail` key per group of ``groups``, largest first, each needing node's
    entry the target whose rail the fewest bytes have used so far: a cross-node send to
    site e leaves its node through the NIC on e's rail (the cluster's PXN routing) and
    enters through e's, so the entry with the least loaded pair of them is taken."""
    topo = net.topo
    per = topo.gpus_per_node
    out_load, in_load = {}, {}
    keys = [None] * len(groups)
    for i in sorted(range(len(groups)), key=lambda i: -groups[i].nbytes):
        g = groups[i]
        srcs = set(_by_node(g.homes, topo))
        ent = []
        for m, ts in sorted(_by_node(g.targets, topo).items()):
            senders = [n for n in srcs if n != m]
            in_m = [h for h in g.homes if topo.node_of(h) == m and h in ts]
            if in_m or not senders:   # a needing node that contributes enters at its own
                e = in_m[0] if in_m else ts[0]
            else:
                e = min(ts, key=lambda t: (max([in_load.get(t, 0.0)] + [
                    out_load.get(n * per + t % per, 0.0) for n in senders]), t))
            for n in senders:
                out_load[n * per + e % per] = out_load.get(n * per + e % per, 0.0) + g.nbytes
            in_load[e] = in_load.get(e, 0.0) + g.nbytes * len(senders)
            ent.append((m, e))
        keys[i] = Rail(tuple(ent))
    return tuple(keys)


# -- recursive-doubling orders -----------------------------------------------------------------


def double_order(g: Group, net: Net, rng=None) -> Double:
    """The :class:`Double` key (not reversed) for ``g``: targets first (then the largest
    contributors) make the power-of-two core, ordered by :func:`pair_order`; every other
    participant folds into the core site it reaches fastest."""
    contrib = dict(g.contrib)
    part = list(g.targets) + sorted((h for h in g.homes if h not in g.targets),
                                    key=lambda h: (-len(contrib[h]), h))
    n2 = 1 << (len(part).bit_length() - 1)
    main = pair_order(part[:n2], net, rng)
    load = {}
    folds = []
    for e in part[n2:]:
        k = max(range(n2), key=lambda k: (net.bw(e, main[k]), -load.get(k, 0), -k))
        load[k] = load.get(k, 0) + 1
        folds.append((e, k))
    return Double(main, tuple(folds))


def pair_order(sites, net: Net, rng=None):
    """An ordering of ``sites`` (a power of two of them) for recursive doubling: round one
    pairs positions differing in bit 0, round two in bit 1, ...; each level is the maximum
    bandwidth matching of the blocks of the level below, so the fastest links carry a round
    (on a DGX-1 socket quads pair along the 50 GB/s pillars, then inside the socket)."""
    blocks = [(s,) for s in sites]
    if rng is not None:
        rng.shuffle(blocks)
    if net.uniform:
        # every pairing scores alike: each level keeps the first, blocks 0+1, 2+3, ...,
        # each unpermuted (the matchings below would take O(n!!) to find the same order)
        return tuple(s for b in blocks for s in b)
    while len(blocks) > 1:
        blocks = _match_blocks(blocks, net)
    return blocks[0]


def _block_score(a, b, net):
    best = None
    n = len(a)
    for m in range(n):
        bb = tuple(b[k ^ m] for k in range(n))
        bws = [net.bw(a[k], bb[k]) for k in range(n)]
        key = (min(bws), sum(bws))
        if best is None or key > best[0]:
            best = (key, bb)
    return best


def _match_blocks(blocks, net):
    n = len(blocks)
    score = {}
    for i in range(n):
        for j in range(i + 1, n):
            score[(i, j)] = _block_score(blocks[i], blocks[j], net)
    if n <= EXACT_MATCHING_MAX:
        best = [None, None]

        def go(left, chosen, key):
            if not left:
                k = (min(x[0] for x in key), sum(x[1] for x in key))
                if best[0] is None or k > best[0]:
                    best[0], best[1] = k, list(chosen)
                return
            i = left[0]
            for j in left[1:]:
                chosen.append((i, j))
                go([x for x in left if x not in (i, j)], chosen, key + [score[(i, j)][0]])
                chosen.pop()

        go(list(range(n)), [], [])
        pairs = best[1]
    else:
        pairs, used = [], set()
        for (i, j), _ in sorted(score.items(), key=lambda kv: kv[1][0], reverse=True):
            if i not in used and j not in used:
                pairs.append((i, j))
                used.update((i, j))
    return [blocks[i] + score[(i, j)][1] for i, j in pairs]


# -- rewrites on whole bodies ------------------------------------------------------------------


def relayed(acts, net: Net):
    """Relay introduction: every single-hop transfer whose route is slower than some bounce
    ``s -> r -> d`` is split off its multicast. Where one of the best relays is itself a
    direct destination of that multicast, it forwards what it receives (``X @ r -> d``: the
    ``s -> r`` transfer is already paid); otherwise ``X`` bounces through the least loaded
    best relay, one bounce per relay carrying all its destinations (``X @ s -> r -> d1,
    d2``), so no ``s -> r`` transfer is sent twice."""
    load, out = {}, []
    for a in acts:
        if len(a.hops) != 1:
            out.append(a)
            continue
        s, slow = a.source, net.relays(a.source)
        keep = [d for d in a.hops[0] if d not in slow]
        forward, bounce = {}, {}
        for d in a.hops[0]:
            if d in slow:
                r = net.relay_for(s, d, load, prefer=keep)
                (forward if r in keep else bounce).setdefault(r, []).append(d)
                load[r] = load.get(r, 0) + 1
        if keep:  # (a relay action aggregates X at its source too)
            out.append(Action(a.agg, s, (tuple(keep),)))
        out.extend(Action(a.agg, r, (tuple(ds),)) for r, ds in forward.items())
        out.extend(Action(a.agg, s, ((r,), tuple(ds))) for r, ds in bounce.items())
    return out


def normalise(acts):
    """Set semantics plus multicast fusion: single-hop actions with the same aggregate and
    source become one multicast; a local ``X @ s`` beside ``X @ s -> D`` is dropped. Both
    leave the closure unchanged (Section 5.4)."""
    fused, relays = {}, {}   # (agg, source) -> {destination: None}, in first-seen order
    for a in acts:
        k = (a.agg, a.source)
        if len(a.hops) <= 1:
            dests = fused.setdefault(k, {})
            if a.hops:
                for d in a.hops[0]:
                    if d != a.source:
                        dests[d] = None
        else:
            relays.setdefault(a, None)
    relayed_from = {(r.agg, r.source) for r in relays}
    out = []
    for k, dests in fused.items():
        if dests:
            out.append(Action(k[0], k[1], (tuple(sorted(dests)),)))
        elif k not in relayed_from:
            out.append(Action(k[0], k[1]))
    relays = list(relays)
    out.extend(relays)
    out.sort(key=action_order)
    return tuple(out)


def action_order(a: Action):
    """The canonical order of a body: small aggregates first, then by text."""
    return len(a.agg), agg_text(a.agg), str(a.source), a.hops
