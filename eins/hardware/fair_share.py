"""Max-min fair sharing of resources among flows (progressive filling), the rule by which
the simulator (:mod:`eins.hardware.simulate`) divides every link, port and bridge among the
transfers that use it at once."""
from __future__ import annotations

import itertools

import numpy as np


def max_min_rates(flows, capacity) -> None:
    """Set each flow's ``rate`` to its max-min fair share (progressive filling): raise all
    unfrozen rates together; when a resource saturates, freeze the flows through it.
    ``capacity``: resource name -> bytes/s (flows name their ``resources``)."""
    names = {}
    rids = [np.fromiter((names.setdefault(r, len(names)) for r in f.resources), np.int64)
            for f in flows]
    cap = np.array([capacity[r] for r in names], dtype=np.float64)
    for f, rate in zip(flows, fair_rates(rids, cap)):
        f.rate = float(rate)


def fair_rates(rids, cap) -> np.ndarray:
    """Max-min fair rates of flows through resources ``rids[i]`` (index arrays into ``cap``):
    progressive filling, vectorized over resources. Each round raises every unfrozen flow by
    the least ``left / unfrozen flows`` over the resources; the resources reaching it
    saturate and freeze their flows, whose other resources lose them. A flow through no
    resource gets inf."""
    n = len(rids)
    lens = np.fromiter(map(len, rids), np.int64, n)
    rate = np.full(n, np.inf)
    if not lens.any():
        return rate
    res = np.concatenate(rids)
    flow = np.repeat(np.arange(n), lens)
    start = np.cumsum(lens) - lens                             # flow i's pairs begin here
    order = np.argsort(res, kind="stable")                     # pairs grouped by resource
    count = np.bincount(res, minlength=len(cap)).astype(np.float64)   # unfrozen flows
    ptr = np.concatenate(([0], np.cumsum(count).astype(np.int64)))
    left = cap.astype(np.float64).copy()
    frozen = lens == 0
    level = 0.0
    while True:
        live = np.flatnonzero(count > 0)
        if not len(live):
            break
        share = left[live] / count[live]
        inc = share.min()
        level += inc
        left[live] -= inc * count[live]
        sat = live[share <= inc * (1 + 1e-9)]
        # the unfrozen flows through a saturated resource
        through = order[ptr[sat[0]]:ptr[sat[0] + 1]] if len(sat) == 1 else \
            np.concatenate([order[ptr[r]:ptr[r + 1]] for r in sat])
        fs = flow[through]
        fs = np.unique(fs[~frozen[fs]])    # O(flows through sat), not O(all flows)
        frozen[fs] = True
        rate[fs] = level
        # their pairs: start[f] .. start[f] + lens[f]
        k = lens[fs]
        idx = np.repeat(start[fs] - (np.cumsum(k) - k), k) + np.arange(k.sum())
        count -= np.bincount(res[idx], minlength=len(cap))
    return rate


def route_fair_rates(routes, weights, cap) -> np.ndarray:
    """:func:`fair_rates` over distinct routes: ``routes[i]`` lists the resources (indices
    into ``cap``; one resource may repeat) of route ``i`` and ``weights[i]`` counts the flows
    taking it (positive integers). Returns each route's rate, equal bit for bit to what
    :func:`fair_rates` gives each of those flows: a flow's rate depends only on its route
    and the multiset of routes, and this runs the same progressive filling on the same
    numbers (the per-resource flow counts are integers, exact in float64 in any order), with
    fewer numpy calls per round (the simulator's hot loop: tens of rounds per event,
    thousands of events per large program)."""
    return np.array(route_rates([list(map(int, r)) for r in routes],
                                 [int(w) for w in weights], np.asarray(cap, np.float64)))


def route_rates(routes, weights, cap) -> list:
    """:func:`route_fair_rates` on lists of ints, returning a list. Each round: one
    vectorized share / min / update over the resources (saturated or unused ones hold
    ``left = inf``, so they never bound a share), then a Python walk over the routes through
    the resources that saturated (few), updating the flow counts they held."""
    n = len(routes)
    rate = [np.inf] * n
    if not n:
        return rate
    lens = list(map(len, routes))
    res = np.fromiter(itertools.chain.from_iterable(routes), np.int64)
    nres = len(cap)
    count = np.bincount(res, weights=np.repeat(np.asarray(weights, np.float64), lens),
                        minlength=nres)                       # unfrozen flows per resource
    by_res = np.repeat(np.arange(n), lens)[np.argsort(res, kind="stable")].tolist()
    ptr = [0, *np.cumsum(np.bincount(res, minlength=nres)).tolist()]  # by_res[ptr[r]:ptr[r+1]]
    frozen = bytearray(n)
    for level, sat in _filling(cap, count):
        for s in sat.tolist():
            for i in by_res[ptr[s]:ptr[s + 1]]:
                if not frozen[i]:
                    frozen[i] = 1
                    rate[i] = level
                    w = weights[i]
                    for r in routes[i]:
                        count[r] -= w
    return rate


def _filling(cap, count):
    """The rounds of progressive filling over resources of capacity ``cap`` crossed by
    ``count`` unfrozen flows each (a float array): per round, every unfrozen flow rises by
    the least ``left / count`` (saturated or unused resources hold ``left = inf``, so they
    never bound it); yields ``(level, saturated resource indices)``, and the caller freezes
    the flows through those resources and takes them off ``count`` in place before the next
    round. Shared by :func:`route_rates` and :func:`table_rates`, which freeze flows apart
    (a Python walk, numpy on a :class:`RouteTable`) on the same numbers."""
    left = cap.astype(np.float64)   # a copy
    left[count == 0] = np.inf
    level = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        while True:
            share = left / count
            inc = float(share.min())
            if inc == np.inf:
                return
            level += inc
            left -= inc * count
            sat = (share <= inc * (1 + 1e-9)).nonzero()[0]
            yield level, sat
            left[sat] = np.inf


class RouteTable:
    """Routes as index arrays for :func:`table_rates`: ``routes[i]`` (resource indices, one
    may repeat) in one flat array with offsets, and the inverse, every resource's routes
    (the simulator's hot loop on programs of many thousands of routes, where walking the
    routes in Python at every event is what costs)."""

    def __init__(self, routes, nres: int):
        self.n, self.nres = len(routes), nres
        self.lens = np.fromiter(map(len, routes), np.int64, len(routes))
        self.res = np.fromiter(itertools.chain.from_iterable(routes), np.int64,
                               int(self.lens.sum()))
        self.ptr = np.concatenate(([0], np.cumsum(self.lens)))
        # each (resource, route) once, though a route may list a resource twice
        pairs = np.unique(self.res * max(self.n, 1) + np.repeat(np.arange(self.n), self.lens))
        self.by_res = pairs % max(self.n, 1)
        self.res_ptr = np.concatenate(([0], np.cumsum(np.bincount(pairs // max(self.n, 1),
                                                                  minlength=nres))))

    def loads(self, routes, weights=None) -> np.ndarray:
        """Per resource: the routes ``routes`` (with repeats) through it, each counted
        ``weights[k]`` times (once if None) and once per time it lists the resource."""
        k = self.lens[routes]
        w = None if weights is None else np.repeat(weights, k)
        return np.bincount(self.res[_ranges(self.ptr[routes], k)], weights=w,
                           minlength=self.nres)

    def through(self, res) -> np.ndarray:
        """The routes through any of resources ``res`` (a route through two of them twice)."""
        lo = self.res_ptr[res]
        return self.by_res[_ranges(lo, self.res_ptr[res + 1] - lo)]


def _ranges(starts, lens) -> np.ndarray:
    """``starts[i] .. starts[i] + lens[i]`` for every i, concatenated."""
    if len(lens) == 1:
        return np.arange(starts[0], starts[0] + lens[0])
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))


def table_rates(table: RouteTable, weights, count, cap) -> np.ndarray:
    """:func:`route_rates` on a :class:`RouteTable`: ``weights[i]`` flows take route ``i``
    (0: unused), ``count`` is ``table.loads(all routes, weights)`` (the flows through each
    resource, kept by the caller as flows start and end). Returns every route's rate (inf
    for unused ones), bit for bit :func:`route_rates`'s: the same rounds on the same numbers
    (the flow counts are integers, exact in float64 in any order), the routes through the
    saturated resources frozen with numpy instead of a Python walk."""
    rate = np.full(table.n, np.inf)
    frozen = weights == 0
    count = count.astype(np.float64)   # a copy: the rounds take frozen flows off it
    for level, sat in _filling(cap, count):
        rs = table.through(sat)
        rs = rs[~frozen[rs]]
        if len(sat) > 1:
            rs = np.unique(rs)
        frozen[rs] = True
        rate[rs] = level
        count -= table.loads(rs, weights[rs])
    return rate
