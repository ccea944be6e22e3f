"""The synthesis time floor at cluster scale (issue 38) is the floor of the plain algorithm,
float for float: the per-node bound indexed once instead of rebuilt per node, the greedy picks
of disjoint aggregates added per aggregate, and the rates, latencies and node cuts of a
symmetric rail cluster computed at one GPU (node) per class. The plain algorithm is kept
here as the reference (``ref_*``); a changed value would change which bodies the search
stops at."""
import dataclasses
import random
from types import MappingProxyType

import pytest

from eins.cost.rails import symmetric_rails
from eins.hardware.presets import get_topology
from eins.hardware.topology import Topology
from eins.ir.exprog import AtomDecl, ExProg, Partition, Requirement
from eins.passes.synthesize import caches
from eins.passes.synthesize.bound import cut_rate, latencies, names_free, node_cuts, rates, \
    time_floor

F = frozenset
KB = 1 << 10


# -- the reference: every quantity from every route, every node's bound from every site -----

def ref_rates(topo):
    gpus = tuple(topo.gpus)
    return ({g: cut_rate(topo, [topo.route(s, g) for s in gpus if s != g]) for g in gpus},
            {g: cut_rate(topo, [topo.route(g, d) for d in gpus if d != g]) for g in gpus})


def ref_latencies(topo):
    gpus = tuple(topo.gpus)
    if not any(topo.latency.values()) or len(gpus) < 2:
        return {g: 0.0 for g in gpus}, {g: 0.0 for g in gpus}
    return ({g: min(topo.route_latency(s, g) for s in gpus if s != g) for g in gpus},
            {g: min(topo.route_latency(g, d) for d in gpus if d != g) for g in gpus})


def ref_node_cuts(topo, sites):
    key, out, nodes = tuple(sites), [], {}
    if topo.kind != "multinode":
        return out
    for s in key:
        nodes.setdefault(topo.node_of(s), []).append(s)
    for members in nodes.values() if len(nodes) > 1 else ():
        inside = set(members)
        outside = [s for s in key if s not in inside]
        ins = [(s, d) for s in outside for d in members]
        outs = [(d, s) for s in outside for d in members]
        out.append((tuple(members),
                    cut_rate(topo, [topo.route(a, b) for a, b in ins]),
                    cut_rate(topo, [topo.route(a, b) for a, b in outs]),
                    min(topo.route_latency(a, b) for a, b in ins),
                    min(topo.route_latency(a, b) for a, b in outs)))
    return out


def ref_apart(atoms, within, size):
    blocked, total = set(), 0.0
    for a in sorted(atoms, key=lambda a: (-size[a], a)):
        mine = within.get(a, ())
        if blocked.isdisjoint(mine):
            blocked.update(mine)
            total += size[a]
    return total


def ref_within(xs):
    out = {}
    for i, x in enumerate(xs):
        for a in x:
            out.setdefault(a, set()).add(i)
    return out


def ref_seconds(nbytes, rate, latency=0.0):
    if nbytes <= 0:
        return 0.0
    return latency + nbytes / rate if rate > 0 else float("inf")


def ref_time_floor(prog, topo, membership=None):
    membership = dict(membership or {})
    rin, rout = ref_rates(topo)
    lin, lout = ref_latencies(topo)
    size = {a.name: float(a.size) for a in prog.inputs}
    held = {}
    for a in prog.inputs:
        held.setdefault(a.name, set()).add(a.site)
    fixed = {p.name: tuple(membership.get(p.name, p.members)) for p in prog.partitions
             if membership.get(p.name, p.members) is not None}
    taken = {s for v in fixed.values() for s in v}
    free_sites = [g for g in prog.gpus if g not in taken]
    at, free = {}, {}
    for r in prog.outputs:
        x = frozenset(r.agg)
        for t in r.targets:
            if isinstance(t, str) and t not in fixed:
                free.setdefault(t, []).append(x)
                continue
            for s in (fixed[t] if isinstance(t, str) else (t,)):
                if x not in at.setdefault(s, []):
                    at[s].append(x)

    def into(d, xs):
        atoms = {a for x in xs for a in x if d not in held[a]}
        return ref_seconds(ref_apart(atoms, ref_within(xs), size), rin[d], lin[d])

    floor = max((into(d, xs) for d, xs in at.items()), default=0.0)
    for xs in free.values():
        holders = {s for x in xs for a in x for s in held[a]}
        cands = [c for c in free_sites if c in holders]
        others = [c for c in free_sites if c not in holders]
        if len({lin[c] for c in others}) > 1:
            cands += others
        else:
            cands += sorted(others, key=lambda c: -rin[c])[:1]
        if cands:
            floor = max(floor, min(into(c, xs) for c in cands))
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
    for s, atoms in sends.items():
        ids = {i for a in atoms for i in within[a]}
        options = [None] + (sorted({pairs[i][0] for i in ids if pairs[i][0] in single})
                            if s in free_sites else [])
        least = float("inf")
        for q in options:
            mine = {a: {i for i in within[a] if pairs[i][0] not in (s, q)} for a in atoms}
            least = min(least, ref_apart([a for a in atoms if mine[a]], mine, size))
        floor = max(floor, ref_seconds(least, rout[s], lout[s]))
    cuts = ref_node_cuts(topo, prog.gpus)
    if not cuts:
        return floor
    total, cap, lat = 0.0, 0.0, float("inf")
    for members, cin, cout, cl_in, cl_out in cuts:
        inside = set(members)
        xs = list(dict.fromkeys(x for d in members for x in at.get(d, ())))
        enter = ref_apart({a for x in xs for a in x if held[a].isdisjoint(inside)},
                          ref_within(xs), size)
        away = list(dict.fromkeys(x for d, ys in at.items() if d not in inside for x in ys))
        leave = ref_apart({a for x in away for a in x if held[a] <= inside}, ref_within(away),
                          size)
        floor = max(floor, ref_seconds(enter, cin, cl_in), ref_seconds(leave, cout, cl_out))
        total, cap, lat = total + enter, cap + cin, min(lat, cl_in)
    shared = {}
    for r in prog.outputs:
        for a in r.agg:
            shared.setdefault(a, set()).update(r.targets)
    sizes = {p.name: p.size for p in prog.partitions}
    for pn, xs in free.items():
        atoms = {a for x in xs for a in x}
        if sizes[pn] != 1 or any(shared[a] != {pn} for a in atoms):
            continue
        w = ref_within(xs)
        total += min((ref_apart({a for a in atoms if held[a].isdisjoint(members)}, w, size)
                      for members, *_ in cuts if set(free_sites).intersection(members)),
                     default=0.0)
    return max(floor, ref_seconds(total, cap, lat))


# -- preambles ---------------------------------------------------------------------------

def random_preamble(rng, sites, atoms=24, reqs=30, overlap=True, replicas=True, groups=False):
    """Atoms of a few tied sizes on ``sites`` (some held at two), partitions of fixed and
    free members (of one site and of two), and requirements of one atom or (``overlap``) of
    several atoms shared between aggregates, or (``groups``) of disjoint groups of one to
    three atoms, at sites and partitions."""
    sites = list(sites)
    decls = []
    for i in range(atoms):
        size = rng.choice([KB, 2 * KB, 2 * KB, 4 * KB, 3 * KB + 7])
        homes = rng.sample(sites, 2 if replicas and rng.random() < 0.15 else 1)
        decls += [AtomDecl(f"a{i}", s, size) for s in homes]
    names = [f"a{i}" for i in range(atoms)]
    parts = []
    for k in range(rng.randint(0, 4)):
        n = rng.choice([1, 1, 2])
        members = tuple(rng.sample(sites, n)) if rng.random() < 0.4 else None
        parts.append(Partition(f"P{k}", n, members))
    outs, cut = [], sorted(rng.sample(range(1, atoms), atoms // 2))
    blocks = [F(names[i:j]) for i, j in zip([0, *cut], [*cut, atoms]) if j - i <= 3]
    for _ in range(reqs):
        agg = rng.choice(blocks) if groups else \
            F(rng.sample(names, rng.choice([1, 1, 2, 3]) if overlap else 1))
        targets = set()
        for _ in range(rng.choice([1, 1, 2])):
            if parts and rng.random() < 0.35:
                targets.add(rng.choice(parts).name)
            else:
                targets.add(rng.choice(sites))
        outs.append(Requirement(agg, tuple(sorted(targets, key=str))))
    return ExProg(tuple(sites), tuple(parts), tuple(decls), tuple(outs))


def all_to_all(sites, size, sized=False):
    """Site s holds x{s}_{d} for every other site d, wanted at d (or at partition P{d} of
    one site declared by size, with ``sized``)."""
    atoms, outs = [], []
    for s in sites:
        for d in sites:
            if s != d:
                atoms.append(AtomDecl(f"x{s}_{d}", s, size))
                outs.append(Requirement(F([f"x{s}_{d}"]), (f"P{d}" if sized else d,)))
    parts = tuple(Partition(f"P{d}", 1, None) for d in sites) if sized else ()
    return ExProg(tuple(sites), parts, tuple(atoms), tuple(outs))


def rail_subset(topo, rails, extra=()):
    """The GPUs of ``rails`` in every node, and ``extra``: nodes alike but for those."""
    g = topo.gpus_per_node
    return sorted({x for x in topo.gpus if x % g in rails} | set(extra))


def odd_cluster():
    """A cluster of dgx-h100:4 nodes whose NICs are not whole bytes/s: not symmetric (a
    sum of its capacities depends on their order), so every quantity is computed plainly."""
    return Topology.multi_node(get_topology("dgx-h100:4"), 3, 50e9 / 3)


def uneven_cluster():
    """dgx-h100:2x4 with one NIC slower than the others: no renumbering symmetry."""
    topo = get_topology("dgx-h100:2x4")
    cap = dict(topo.capacity)
    cap["nic-in:5"] = cap["nic-in:5"] / 2
    return dataclasses.replace(topo, capacity=MappingProxyType(cap))


TOPOLOGIES = ["dgx-h100:2x4", "dgx-h100:4x8", "dgx-h100:3x4", "dgx-a100:2x8",
              "dgx-v100:2x8", "dgx-h100:8"]


def topology(name):
    return {"odd": odd_cluster, "uneven": uneven_cluster}.get(name, lambda: get_topology(name))()


# -- tests -------------------------------------------------------------------------------

def test_which_clusters_are_symmetric():
    """The rail presets are; a mesh-node cluster, one server, a cluster with a slower NIC
    and one with fractional capacities are not (they take the plain path)."""
    for name in ("dgx-h100:2x4", "dgx-h100:4x8", "dgx-h100:3x4", "dgx-a100:2x8"):
        assert symmetric_rails(get_topology(name)), name
    for name in ("dgx-v100:2x8", "dgx-h100:8", "uneven", "odd"):
        assert not symmetric_rails(topology(name)), name


@pytest.mark.parametrize("name", TOPOLOGIES + ["odd", "uneven"])
def test_rates_and_latencies_are_every_routes_own(name):
    topo = topology(name)
    assert rates(topo) == ref_rates(topo)
    assert latencies(topo) == ref_latencies(topo)


@pytest.mark.parametrize("name,sites", [
    ("dgx-h100:2x4", None), ("dgx-h100:4x8", None), ("dgx-h100:3x4", None),
    ("dgx-h100:4x8", "rails"), ("dgx-h100:4x8", "rails+extra"), ("dgx-h100:3x4", "random"),
    ("dgx-h100:4x8", "random"), ("dgx-v100:2x8", "random"), ("odd", None), ("uneven", None)])
def test_node_cuts_are_every_routes_own(name, sites):
    """Whole clusters, every node's GPUs of a few rails (nodes alike), those and a few more
    (some nodes differ), and random subsets."""
    topo = topology(name)
    rng = random.Random(7)
    for trial in range(3):
        if sites is None:
            chosen = list(topo.gpus)
        elif sites == "rails":
            chosen = rail_subset(topo, rng.sample(range(topo.gpus_per_node), 3))
        elif sites == "rails+extra":
            chosen = rail_subset(topo, {1, 6}, rng.sample(list(topo.gpus), 3))
        else:
            chosen = sorted(rng.sample(list(topo.gpus), rng.randint(2, len(topo.gpus))))
        assert node_cuts(topo, chosen) == ref_node_cuts(topo, chosen), (trial, chosen)


def subset(rng, topo, kind):
    if kind == "all":
        return list(topo.gpus)
    if kind == "rails":
        return rail_subset(topo, rng.sample(range(topo.gpus_per_node), 2), [topo.gpus[-1]])
    return sorted(rng.sample(list(topo.gpus), min(len(topo.gpus), rng.randint(3, 12))))


@pytest.mark.parametrize("name", ["dgx-h100:2x4", "dgx-h100:4x8", "dgx-h100:3x4",
                                  "dgx-v100:2x8", "dgx-h100:8", "uneven"])
@pytest.mark.parametrize("kind", ["all", "rails", "random"])
def test_random_preambles_have_the_reference_floor(name, kind):
    """Random preambles (overlapping aggregates, replicated atoms, partitions fixed, free and
    given a membership), one-atom ones (the disjoint fast paths), float for float."""
    topo = topology(name)
    rng = random.Random(f"{name}/{kind}")
    for trial in range(12):
        sites = subset(rng, topo, kind)
        prog = random_preamble(rng, sites, overlap=trial % 3 != 0, replicas=trial % 2 == 0)
        member = {}
        for p in prog.partitions:
            if p.members is None and rng.random() < 0.3:
                member[p.name] = tuple(rng.sample(sites, p.size))
        for m in (None, member):
            assert time_floor(prog, topo, m) == ref_time_floor(prog, topo, m), (trial, m)


@pytest.mark.parametrize("name,size", [("dgx-h100:2x4", 4 * KB), ("dgx-h100:4x8", 64 * KB),
                                       ("dgx-h100:3x4", 3 * KB + 1)])
@pytest.mark.parametrize("sized", [False, True])
def test_all_to_all_has_the_reference_floor(name, size, sized):
    """The exchanges that dominate a block at scale: every site sends to every other, to a
    site or to a one-site partition declared by size; over the whole cluster and a rail
    subset."""
    topo = get_topology(name)
    for sites in (list(topo.gpus), rail_subset(topo, {0, 2})):
        prog = all_to_all(sites, size, sized)
        got = time_floor(prog, topo)
        assert got == ref_time_floor(prog, topo) and got > 0


def test_sizes_past_float_integers_keep_the_greedy_order():
    """Sizes adding up past 2**53 round differently in another order (64 one-byte atoms
    before a 2**53-byte one add up to 2**53 + 64, after it to 2**53): the plain greedy
    order is kept, and the floor is still the reference's."""
    topo = get_topology("dgx-h100:2x4")
    small = [AtomDecl(f"c{i}", i % 4, 1) for i in range(64)]
    prog = ExProg(tuple(topo.gpus), (), (*small, AtomDecl("a", 4, 2**53)),
                  tuple(Requirement(F([x.name]), (5,)) for x in (*small, AtomDecl("a", 4))))
    rin, lin = rates(topo)[0][5], latencies(topo)[0][5]
    assert time_floor(prog, topo) == ref_time_floor(prog, topo) == lin + 2.0**53 / rin


def test_a_free_partition_whose_atoms_sit_at_taken_sites_is_bounded_at_a_free_site():
    """P (free) wants an atom held only at the sites of the fixed partition T: it receives
    it at the quickest free site, which holds none of it."""
    topo = get_topology("dgx-h100:2x4")
    prog = ExProg(tuple(topo.gpus), (Partition("T", 2, (0, 1)), Partition("P", 1, None)),
                  (AtomDecl("a", 0, 64 * KB), AtomDecl("a", 1, 64 * KB)),
                  (Requirement(F(["a"]), ("P",)),))
    rin, lin = rates(topo)[0][2], latencies(topo)[0][2]
    assert time_floor(prog, topo) == ref_time_floor(prog, topo) == lin + 64 * KB / rin


def test_a_one_site_partition_at_the_sender_spares_only_what_it_alone_wants():
    """Site 0 holds a1, a2, a3: a1 and a2 are wanted at the free one-site partition Q and at
    sites 1 and 2, a3 at site 3. Q sitting at 0 spares none of them (each is wanted elsewhere
    too): all three leave site 0."""
    topo = get_topology("dgx-h100:2x4")
    size = 64 * KB
    prog = ExProg(tuple(topo.gpus), (Partition("Q", 1, None),),
                  tuple(AtomDecl(f"a{i}", 0, size) for i in (1, 2, 3)),
                  (Requirement(F(["a1"]), ("Q", 1)), Requirement(F(["a2"]), ("Q", 2)),
                   Requirement(F(["a3"]), (3,))))
    rout, lout = rates(topo)[1][0], latencies(topo)[1][0]
    assert time_floor(prog, topo) == ref_time_floor(prog, topo) == lout + 3 * size / rout


def test_the_node_holding_none_of_a_partitions_atoms_can_be_its_cheapest():
    """On dgx-h100:3x4 the free one-site partition P wants X = {a, b}, Y = {a, c}, Z = {e, f}
    and W = {e, h}; node 0 holds a, f and h, node 1 holds e, b and c. At node 0 the atoms
    from outside travel apart as e, b, c (10 KB), at node 1 as a, f, h (10 KB), at node 2
    as a and e (8 KB), each blocking two aggregates: the bytes entering the nodes are 8 KB,
    after the NIC's latency, over the three nodes' NICs."""
    topo = get_topology("dgx-h100:3x4")
    atoms = [("a", 0, 4), ("f", 1, 3), ("h", 2, 3), ("e", 4, 4), ("b", 5, 3), ("c", 6, 3)]
    prog = ExProg(tuple(topo.gpus), (Partition("P", 1, None),),
                  tuple(AtomDecl(n, s, k * KB) for n, s, k in atoms),
                  tuple(Requirement(F(x), ("P",)) for x in ("ab", "ac", "ef", "eh")))
    got = time_floor(prog, topo)
    assert got == ref_time_floor(prog, topo)
    assert got == topo.class_latency("nic") + 8 * KB / (12 * topo.nic_bw)


def renamed(prog, rng):
    """``prog`` with its atoms renamed at random (another order of names)."""
    names = sorted({a.name for a in prog.inputs})
    ren = dict(zip(names, rng.sample([f"z{i:03d}" for i in range(len(names))], len(names))))
    return caches.rename_prog(prog, ren)


@pytest.mark.parametrize("name", ["dgx-h100:2x4", "dgx-h100:3x4", "dgx-v100:2x8"])
def test_a_names_free_floor_is_the_same_under_any_renaming(name):
    """One-atom and disjoint aggregates: the floor of a preamble is its canonical form's and
    any renaming's (so the search of the canonical form may take it)."""
    topo = get_topology(name)
    rng = random.Random(name)
    for trial in range(16):
        sites = subset(rng, topo, "random" if trial % 2 else "all")
        prog = random_preamble(rng, sites, overlap=False, groups=trial % 4 < 2)
        assert names_free(prog)
        floor = time_floor(prog, topo)
        assert floor == time_floor(caches.canonical(prog)[0], topo)
        assert floor == time_floor(renamed(prog, rng), topo) == ref_time_floor(prog, topo)


def test_overlapping_aggregates_make_a_floor_depend_on_names():
    """X = {p, q} and Y = {q, r} at site 3, all of one size: largest first, ties by name, p
    is picked (blocking X), then r (Y): two atoms apart; named so that q comes first, q
    blocks both: one. Such a preamble is not names_free."""
    topo = get_topology("dgx-h100:4")

    def prog(p, q, r):
        return ExProg(tuple(topo.gpus), (),
                      tuple(AtomDecl(n, s, 4 * KB) for n, s in ((p, 0), (q, 1), (r, 2))),
                      (Requirement(F([p, q]), (3,)), Requirement(F([q, r]), (3,))))

    rin, lin = rates(topo)[0][3], latencies(topo)[0][3]
    assert not names_free(prog("p", "q", "r"))
    assert time_floor(prog("p", "q", "r"), topo) == lin + 8 * KB / rin
    assert time_floor(prog("b", "a", "c"), topo) == lin + 4 * KB / rin


def test_a_canonical_preamble_takes_its_named_floor_where_names_free(monkeypatch):
    """cached_floor of a canonical form given the named preamble: one time_floor for both
    where the floor is names_free (in either order), one each where it is not."""
    topo = get_topology("dgx-h100:2x4")
    calls = []

    def counted(prog, t):
        calls.append(prog)
        return time_floor(prog, t)

    monkeypatch.setattr(caches, "time_floor", counted)
    rng = random.Random(3)
    free = random_preamble(rng, list(topo.gpus), overlap=False)
    tied = ExProg(tuple(topo.gpus), (), tuple(AtomDecl(n, s, KB) for n, s in (("p", 0),
                                                                               ("q", 1))),
                  (Requirement(F("pq"), (5,)), Requirement(F("q"), (6,))))
    for prog, expect in ((free, 1), (tied, 2)):
        for first_named in (True, False):
            caches.RESULTS.clear()
            calls.clear()
            canon = caches.canonical(prog)[0]
            if first_named:
                a = caches.cached_floor(prog, topo)
                b = caches.cached_floor(canon, topo, prog)
            else:
                b = caches.cached_floor(canon, topo, prog)
                a = caches.cached_floor(prog, topo)
            assert (a, b) == (time_floor(prog, topo), time_floor(canon, topo))
            assert len(calls) == expect, (prog, first_named)
    caches.RESULTS.clear()


def test_an_empty_aggregate_beside_a_pair_is_not_one_atom_each():
    """{} and {p, q} hold two atoms in two aggregates, yet p and q travel together."""
    topo = get_topology("dgx-h100:4")
    prog = ExProg(tuple(topo.gpus), (), (AtomDecl("p", 0, KB), AtomDecl("q", 1, KB)),
                  (Requirement(F(), (3,)), Requirement(F("pq"), (3,))))
    rin, lin = rates(topo)[0][3], latencies(topo)[0][3]
    assert time_floor(prog, topo) == ref_time_floor(prog, topo) == lin + KB / rin
