"""The transfer phase of :class:`eins.cost.timecost._Links` on a rail-optimized cluster of
NVSwitch servers (``Topology.multi_node`` of a ``switch`` node: dgx-h100:KxG), in closed
form from the GPU ids instead of from a table of route entries.

Every route there is one of three shapes (``Topology.multi_node``): inside a node
``egress:s, ingress:d``; across nodes on the destination's rail ``nic-out:s, nic-in:d``;
across nodes and rails ``egress:s, ingress:r, nic-out:r, nic-in:d`` with ``r`` the source
node's GPU on the destination's rail. So a pair's resources are arithmetic in ``s`` and
``d``, and the route table the general path builds (n^2 pairs x the route length: four
million entries at 1,024 GPUs, a Python loop over every pair to build it, and a gather of
them per exchange) is not needed. The loads, latency levels and per-pair bounds are the
general path's, term for term: each resource sums its pairs' bytes in the same (pair)
order, so the seconds are the same floats.
"""
from __future__ import annotations

import numpy as np

__all__ = ["RailLinks", "is_rail_cluster"]

_KINDS = ("egress", "ingress", "nic-out", "nic-in")


def is_rail_cluster(topo) -> bool:
    """Whether ``topo`` is a cluster of NVSwitch servers, whose routes :class:`RailLinks`
    computes."""
    return topo.kind == "multinode" and topo.node is not None and topo.node.kind == "switch"


class RailLinks:
    """Per-pair latency, narrowest-resource bound and latency level of ``devices`` (GPU ids
    of ``topo``) and :meth:`pair_seconds`, as :class:`~eins.cost.timecost._Links` defines
    them. Resources are indexed ``kind * N + gpu`` (kinds: egress, ingress, nic-out,
    nic-in; N the cluster's GPUs), since a relay GPU need not be one of ``devices``."""

    def __init__(self, topo, devices):
        self.g = topo.gpus_per_node
        total = len(topo.gpus)
        self.total = total
        self.gpu = np.asarray(devices, dtype=np.int64)
        lat = [np.array([topo.latency.get(f"{k}:{x}", 0.0) for x in range(total)])
               for k in _KINDS]
        cap = [np.array([topo.capacity[f"{k}:{x}"] for x in range(total)], dtype=np.float64)
               for k in _KINDS]
        self.cap = np.concatenate(cap)
        s, d = self.gpu[:, None], self.gpu[None, :]
        inter = (s // self.g) != (d // self.g)
        relay = np.where(inter, (s // self.g) * self.g + d % self.g, d)
        hop = relay != s   # crosses the source node's switch (to d, or to the relay)
        le, li, lo, ln = lat
        # route_latency's sum, in route order (0 + x is x: the same floats)
        node_lat = le[s] + li[relay]
        self.lat = np.where(inter, np.where(hop, node_lat + lo[relay] + ln[d],
                                            lo[relay] + ln[d]), node_lat)
        np.fill_diagonal(self.lat, 0.0)
        inv = [1.0 / c for c in cap]
        node_inv = np.maximum(inv[0][s], inv[1][relay])
        nic_inv = np.maximum(inv[2][relay], inv[3][d])
        self.pair_inv = np.where(inter, np.where(hop, np.maximum(node_inv, nic_inv), nic_inv),
                                 node_inv)
        np.fill_diagonal(self.pair_inv, 0.0)
        n = len(self.gpu)
        self.has_lat = bool(self.lat.any())
        if self.has_lat:
            self.levels = np.unique(self.lat[~np.eye(n, dtype=bool)])
            level = np.searchsorted(self.levels, self.lat)
            self.pair_bound = len(self.levels) > 1
        else:
            self.levels = np.zeros(1)
            level = np.zeros((n, n), dtype=np.int64)
            self.pair_bound = False
        # per pair its four resources' bins (level * 4N + resource), or the spare last bin
        # where its route lacks one: a pair's bytes are binned by one gather per kind
        size = 4 * total
        spare = len(self.levels) * size
        base = level * size
        diag = np.eye(n, dtype=bool)
        keys = np.stack([np.where(hop, base + s, spare),
                         np.where(hop, base + total + relay, spare),
                         np.where(inter, base + 2 * total + relay, spare),
                         np.where(inter, base + 3 * total + d, spare)], axis=-1)
        keys[diag] = spare
        kind = np.int32 if spare < 2**31 else np.int64
        self.keys = [np.ascontiguousarray(keys[..., c].ravel(), dtype=kind) for c in range(4)]
        self.size = spare + 1
        self.flat_lat = self.lat.ravel()
        self.flat_inv = self.pair_inv.ravel()
        self.n = n

    def pair_seconds(self, src, dst, nbytes, from_level, latest) -> float:
        """:meth:`~eins.cost.timecost._Links.pair_seconds` of the transfers ``src[x] ->
        dst[x]`` (positions) of ``nbytes[x]`` bytes; ``from_level``, ``latest``: its
        helpers."""
        pair = src * self.n + dst
        t = 0.0
        if self.has_lat and self.pair_bound:
            t = float((self.flat_lat[pair] + nbytes * self.flat_inv[pair]).max())
        nlev = len(self.levels)
        # per resource its pairs' bytes in pair order: a resource is one kind, one column
        load = np.bincount(self.keys[0][pair], nbytes, self.size)
        for keys in self.keys[1:]:
            load += np.bincount(keys[pair], nbytes, self.size)
        load = load[:-1]
        load = from_level(load, nlev)
        return latest(t, self.levels, (load / self.cap).max(axis=1))
