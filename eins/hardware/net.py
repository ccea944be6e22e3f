"""A topology as the exchange-program synthesizer sees it (paper Section 5.4), and the
resolution of the ``topology=`` argument of the API.

:class:`Net` summarises a :class:`~eins.hardware.topology.Topology` over a set of sites: an
*effective* bandwidth per ordered pair (a shared resource's capacity divided among the GPUs
whose routes use it, so the 15.75 GB/s PCIe bridge of a DGX-1 counts as slow), its fast-link
cliques, a ring through the fast links, and the relay that beats a slow direct route.
"""
from __future__ import annotations

import itertools

import numpy as np

from eins.errors import TopologyError
from eins.hardware.presets import get_topology
from eins.hardware.specs import MAX_CLUSTER_GPUS
from eins.hardware.topology import Topology

__all__ = ["Net", "resolve_topology", "FAST_LINK_RATIO", "EXACT_CLIQUE_MAX", "EXACT_RING_MAX",
           "RELAY_MIN_GAIN"]

INF = float("inf")

# A link is *fast* when its effective bandwidth is within this factor of the best one: NVLink
# generations differ by less than 4x, NVLink vs PCIe or a shared bridge by more.
FAST_LINK_RATIO = 4
# Cliques are found exhaustively up to this many sites (2^12 subsets), greedily beyond.
EXACT_CLIQUE_MAX = 12
# The ring is the best Hamiltonian cycle up to this many sites (7! = 5040 cycles), else in order.
EXACT_RING_MAX = 8
# A bounce through a relay must beat the direct route by this factor: a hop costs a launch,
# so a relay for a 1% gain is not worth it.
RELAY_MIN_GAIN = 1.01


class Net:
    """What the pattern generators need to know of ``topo`` over ``sites``: ``eff`` (effective
    bandwidth per ordered pair), ``uniform`` (every pair alike), ``fast`` (pairs within
    :data:`FAST_LINK_RATIO` of the best), ``clusters`` (fast-link cliques covering the sites),
    ``cluster_of`` and ``ring``."""

    def __init__(self, topo, sites):
        self.topo = topo
        self.sites = tuple(sites)
        users = {}
        for (s, d), route in topo.routes.items():
            for r in route:
                users.setdefault(r, set()).add(s)
        self.eff = {}
        for s in self.sites:
            for d in self.sites:
                if s != d:
                    route = topo.route(s, d)
                    self.eff[(s, d)] = min(topo.capacity[r] / max(1, len(users[r]))
                                           for r in route) if route else INF
        vals = set(self.eff.values())
        self.uniform = len(vals) <= 1
        hi = max(vals) if vals else 1.0
        self.fast = {k for k, v in self.eff.items() if v >= hi / FAST_LINK_RATIO}
        self.clusters = self._cliques()
        self.cluster_of = {s: i for i, c in enumerate(self.clusters) for s in c}
        self.ring = self._ring()
        self._relays, self._eff_matrix = {}, None   # relays(s), lazily

    def bw(self, s, d):
        """Effective bandwidth ``s -> d`` (infinite from a site to itself)."""
        return INF if s == d else self.eff[(s, d)]

    def _linked(self, a, b):
        return (a, b) in self.fast and (b, a) in self.fast

    def _cliques(self):
        left = list(self.sites)
        out = []
        if self.uniform:
            return [tuple(left)]
        while left:
            best = (left[0],)
            if len(left) <= EXACT_CLIQUE_MAX:
                for k in range(len(left), 1, -1):
                    for c in itertools.combinations(left, k):
                        if all(self._linked(a, b) for a, b in itertools.combinations(c, 2)):
                            best = c
                            break
                    if len(best) > 1:
                        break
            else:  # greedy growth on big machines
                c = [left[0]]
                for s in left[1:]:
                    if all(self._linked(s, t) for t in c):
                        c.append(s)
                best = tuple(c)
            out.append(tuple(best))
            left = [s for s in left if s not in best]
        return out

    def _ring(self):
        """A Hamiltonian cycle maximising its slowest then its total effective bandwidth
        (exhaustive up to :data:`EXACT_RING_MAX` sites; in order beyond)."""
        n = len(self.sites)
        if n <= 2 or self.uniform or n > EXACT_RING_MAX:
            return tuple(self.sites)
        first, rest = self.sites[0], self.sites[1:]
        best, best_key = None, None
        for perm in itertools.permutations(rest):
            cyc = (first,) + perm
            bws = [self.eff[(cyc[i], cyc[(i + 1) % n])] for i in range(n)]
            key = (min(bws), sum(bws))
            if best_key is None or key > best_key:
                best, best_key = cyc, key
        return best

    def relays(self, s) -> dict:
        """``{d: relays}`` for the destinations ``d`` of source ``s`` where a bounce
        ``s -> r -> d`` (its bandwidth min(bw(s, r), bw(r, d))) beats the direct route by
        :data:`RELAY_MIN_GAIN`: the relays whose bounce is the best, in site order. The one
        rule of both the synthesizer's relays (:meth:`relay_for`) and the optimized
        schedule's time cost (eins.cost.timecost); computed once per source."""
        if s not in self._relays:
            if self._eff_matrix is None:
                self._eff_matrix = np.array([[self.bw(a, b) for b in self.sites]
                                             for a in self.sites])
            eff, n, a = self._eff_matrix, len(self.sites), self.sites.index(s)
            bounce = np.minimum(eff[a][:, None], eff)    # [relay, dst]
            bounce[a, :] = 0.0                           # relay == source
            bounce[np.arange(n), np.arange(n)] = 0.0     # relay == destination
            best = bounce.max(axis=0, initial=0.0)
            # d == s never qualifies: bw(s, s) is infinite
            self._relays[s] = {
                self.sites[b]: tuple(self.sites[r] for r in np.nonzero(bounce[:, b] == best[b])[0])
                for b in np.nonzero(best > eff[a] * RELAY_MIN_GAIN)[0]}
        return self._relays[s]

    def relay_for(self, s, d, load, prefer=()):
        """The best relay r for ``s -> d`` (:meth:`relays`) when bouncing beats the direct
        route, else None; one of the best in ``prefer`` if any is (sites that receive the
        data anyway), ties to the least loaded relay (``load``), then site order."""
        rs = self.relays(s).get(d)
        if not rs:
            return None
        near = [r for r in rs if r in prefer]
        return min(near or rs, key=lambda r: load.get(r, 0))


DEFAULT_MAX_NODES = 16  # the default topology's largest cluster: 16 DGX A100s, 128 GPUs


def resolve_topology(topology, devices, profile=None):
    """A Topology from a Topology, a preset name, a JSON path or None: the paper's machine,
    ``dgx-a100``, sized to the device ids; beyond its 8 GPUs, a cluster of as many such
    servers as the ids need (``dgx-a100:2x8`` for 9..16), joined by one NIC per GPU, up to
    DEFAULT_MAX_NODES of them (a cluster's routes grow with the square of its GPUs).
    ``profile``: the machine profile replacing the topology's (get_topology)."""
    if topology is None:
        n = max(devices) + 1
        if n > 8 * DEFAULT_MAX_NODES:
            hint = (f"a cluster model holds at most {MAX_CLUSTER_GPUS} (it keeps a route for "
                    f"every pair of GPUs)" if n > MAX_CLUSTER_GPUS else
                    f"the default covers {8 * DEFAULT_MAX_NODES} (dgx-a100:{DEFAULT_MAX_NODES}"
                    f"x8): pass topology= (a preset such as 'dgx-h100:{-(-n // 8)}x8', a JSON "
                    f"file or a Topology)")
            raise TopologyError(f"device ids up to {n - 1} need a topology with {n} GPUs; "
                                f"{hint}")
        topology = f"dgx-a100:{n}" if n <= 8 else f"dgx-a100:{-(-n // 8)}x8"
    topo = topology if isinstance(topology, Topology) and profile is None else \
        get_topology(topology, profile)
    missing = [d for d in devices if d not in topo.gpus]
    if missing:
        raise TopologyError(f"devices {missing} are not GPUs of topology {topo.name!r} "
                            f"(GPUs {list(topo.gpus)})")
    return topo
