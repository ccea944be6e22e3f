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

import math

import numpy as np

__all__ = ["RailLinks", "is_rail_cluster", "symmetric_rails", "factored_sums", "from_level",
           "latest"]

_KINDS = ("egress", "ingress", "nic-out", "nic-in")


def from_level(flat, nlev):
    """[levels, k] bytes per latency level (``flat``, level-major) -> the bytes of level L
    or later, per L: what a resource carries from L on."""
    m = flat.reshape(nlev, -1)
    if nlev == 1:
        return m
    # level by level from the top: the sums cumsum of the reversed rows gives, in its order,
    # without its strided walk down the level axis (150 us per call at 1,024 GPUs)
    out = np.empty_like(m)
    out[-1] = m[-1]
    for lev in range(nlev - 2, -1, -1):
        np.add(out[lev + 1], m[lev], out=out[lev])
    return out


def latest(t, levels, peaks) -> float:
    """``t`` or the latest level L plus its peak, over the levels whose peak is positive (a
    level no pair has adds nothing: its bytes are the next level's, from later)."""
    # a few levels: Python floats, the same sums, without numpy's per-call overhead
    for lev, peak in zip(levels.tolist(), peaks.tolist()):
        if peak > 0 and lev + peak > t:
            t = lev + peak
    return t


def is_rail_cluster(topo) -> bool:
    """Whether ``topo`` is a cluster of NVSwitch servers, whose routes :class:`RailLinks`
    computes."""
    return topo.kind == "multinode" and topo.node is not None and topo.node.kind == "switch"


def symmetric_rails(topo) -> bool:
    """Whether every renumbering of ``topo``'s nodes and of its rails (GPU k of node n to GPU
    k' of node n', the same k -> k' in every node) maps its routes onto its routes,
    resource kind for kind, with the same capacities and latencies: a rail cluster
    (:func:`is_rail_cluster`) whose node routes are its switch's ``egress:s, ingress:d``
    alone, every resource of a kind of one capacity and one latency. Then anything
    computed from the routes through their resources' kinds, capacities and latencies is
    the same at two GPUs (or two nodes holding the same rails) such a renumbering
    exchanges. Also the capacities are whole bytes/s adding up below 2**53, so any sum of
    them is the same float in any order (a cut's sum over a set of resources)."""
    if not is_rail_cluster(topo):
        return False
    node = topo.node
    if set(node.capacity) != {f"{k}:{x}" for k in ("egress", "ingress") for x in node.gpus}:
        return False
    if any(r != (f"egress:{a}", f"ingress:{b}") for (a, b), r in node.routes.items()):
        return False
    caps, lats = {}, {}
    for r, c in topo.capacity.items():
        kind = r.partition(":")[0]
        if kind not in _KINDS:
            return False
        caps.setdefault(kind, set()).add(c)
        lats.setdefault(kind, set()).add(topo.latency.get(r, 0.0))
    if any(len(v) != 1 for v in (*caps.values(), *lats.values())):
        return False
    return all(float(c).is_integer() for c in topo.capacity.values()) and \
        sum(topo.capacity.values()) < 2.0**53


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
        # dense_seconds' preconditions: positions are the GPU ids from 0 and every resource
        # of a kind has the same latency and capacity, so a pair's route class (inside a
        # node, on its rail, across rails) fixes its latency level and resources' speeds
        self.regular = bool(np.array_equal(self.gpu, np.arange(n)) and all(
            (x == x[0]).all() for x in (*lat, *cap)))
        if self.regular:
            intra = le[0] + li[0]
            cls = (intra, lo[0] + ln[0], intra + lo[0] + ln[0])   # route_latency's sums
            self.cls_level = [min(int(np.searchsorted(self.levels, x)), len(self.levels) - 1)
                              if self.has_lat else 0 for x in cls]
            self.lat_max = float(self.lat.max())
            self.inv_max = float(self.pair_inv.max())

    def pair_seconds(self, src, dst, nbytes) -> float:
        """:meth:`~eins.cost.timecost._Links.pair_seconds` of the transfers ``src[x] ->
        dst[x]`` (positions) of ``nbytes[x]`` bytes."""
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

    def dense_seconds(self, a, b, itemsize, pair, hbm_bw=None):
        """:meth:`pair_seconds` of the exchange from box set ``a`` (positions 0 .. a.n - 1)
        into ``b`` (:class:`eins.cost.overlap.BoxSet`; ``pair``: the ColumnPair of two
        column ids; a pending ⊕: ``hbm_bw`` below), from sums over the distinct boxes
        instead of the position pairs: the way to price an all-to-all, whose pairs are up to
        n^2. None where it does not apply (not :attr:`regular`, few pairs, too many
        distinct box pairs where the sums cannot be contracted per dimension) or cannot
        tell the per-pair bound from the resources' (then the caller lists the pairs).

        Each resource's load per latency level is a sum of the bytes W[s, d] of the pairs
        of one route class crossing it, and each such sum is one of: a row or column of W
        summed over the other side's rail (contracted per dimension from counts per rail
        and interval tuple, :func:`factored_sums`, or where that does not apply through the
        distinct boxes' [distinct, distinct] bytes), the pairs inside a node (their bytes
        listed, n x GPUs per node), and differences of the two. Every byte count and
        sum is an integer below 2**53, so the loads are the pairs' own, bit for bit, and so
        are the seconds; the per-pair bound (a pair's latency plus its bytes at its
        narrowest resource) is bounded by the largest latency plus the largest pair's bytes
        at the slowest resource, and where that exceeds the resources' time (one pair per
        resource) the pairs decide.

        ``hbm_bw``: ``a``'s repeated boxes are partial sums still to be ⊕-combined at each
        need (:func:`eins.cost.timecost._pairs_exchange`): the busiest need's HBM traffic
        over ``hbm_bw`` is added, where every share of it is exact (each box on a power of
        two of positions, so (m + 1) / m x bytes is a dyadic fraction and the per-need sums
        in any order are the sorted pairs' own); None otherwise."""
        na, nb = len(a.counts), len(b.counts)
        if not self.regular or not na or not nb or a.n * b.n < MIN_PAIRS:
            return None   # (the estimate below is at most a.n * b.n)
        cps = [pair(xa, xb) for (xa, _), (xb, _) in zip(a.cols, b.cols)]
        dense = 1.0
        for cp in cps:
            dense *= len(cp.nbr) / cp.ext.size
        pairs = dense * a.n * b.n   # about: the share of box pairs that meet
        if pairs < MIN_PAIRS:
            return None   # aligned tilings: few pairs, listing them is cheaper
        g = self.g
        ua, ub = _box_of(a), _box_of(b)
        sa, sb = np.arange(a.n), np.arange(b.n)
        weights = None
        if hbm_bw is not None:   # per distinct copy: its positions' shares of the ⊕, m + 1
            c = a.counts
            if ((c >= 2) & ((c & (c - 1)) != 0)).any():
                return None
            weights = np.where(c >= 2, c + 1, 0)
        got = factored_sums(a, b, cps, itemsize, ua, ub, g, weights)
        if got is None:
            if weights is not None or na * nb > DENSE_LIMIT:
                return None
            f, fmax = _pair_bytes(a, b, cps, itemsize), None
            rows, cols, inside, inside_t = _sums(f, ua, ub, g)
        else:
            f, (rows, cols, inside, inside_t, fmax, agg) = None, got
        total = self.total
        out_a, out_b = rows - inside, cols - inside_t     # the pairs across nodes
        other_a = np.arange(g)[None, :] != (sa % g)[:, None]
        other_b = np.arange(g)[:, None] != (sb % g)[None, :]
        # relays: source node's GPU on the destination's rail, [node, source rail, rail]
        nodes = -(-a.n // g)
        relay = np.zeros((nodes * g, g))
        relay[:a.n] = out_a
        relay = relay.reshape(nodes, g, g)
        via = relay.sum(axis=1) - np.einsum("kjj->kj", relay)   # from the node's other rails
        via = via.ravel()
        lev = self.cls_level
        load = np.zeros((len(self.levels), 4, total))
        load[lev[0], 0, :a.n] += (inside * other_a).sum(axis=1)     # egress inside
        load[lev[2], 0, :a.n] += (out_a * other_a).sum(axis=1)      # egress to relays
        load[lev[0], 1, :b.n] += (inside_t * other_b).sum(axis=0)   # ingress inside
        load[lev[2], 1, :len(via)] += via                           # ingress at relays
        load[lev[1], 2, :a.n] += out_a[sa, sa % g]                  # nic-out on own rail
        load[lev[2], 2, :len(via)] += via                           # nic-out at relays
        own = out_b[sb % g, sb]
        load[lev[1], 3, :b.n] += own                                # nic-in on own rail
        load[lev[2], 3, :b.n] += out_b.sum(axis=0) - own            # nic-in across rails
        load = from_level(load.reshape(-1), len(self.levels))
        t = latest(0.0, self.levels, (load / self.cap).max(axis=1))
        if self.has_lat and self.pair_bound:
            if fmax is not None and self.lat_max + fmax[0] * self.inv_max > t and \
                    not fmax[1]:   # a bound only: the largest pair's own bytes decide
                f = _pair_bytes(a, b, cps, itemsize)
            if f is not None:
                fmax = (float(f.max()), True)
            if self.lat_max + fmax[0] * self.inv_max > t:
                return None
        if weights is not None:   # as _pairs_exchange: the busiest need's ⊕
            t += max(float(agg.max(initial=0.0)), 0.0) / hbm_bw
        return t


# distinct box pairs up to which dense_seconds forms their [distinct, distinct] bytes (8 MB)
# where it cannot contract per dimension
DENSE_LIMIT = 1 << 20
# from how many position pairs (estimated) it does: below, listing the pairs is cheaper
# (the contraction costs about what 2,000 to 4,000 listed pairs do, however sparse)
MIN_PAIRS = 4096


def _pair_bytes(a, b, cps, itemsize) -> np.ndarray:
    """[distinct a, distinct b] bytes the boxes share: the per-dimension overlap lengths'
    product times ``itemsize``."""
    f, scalar = None, float(itemsize)
    for cp, (_, ia), (_, ib) in zip(cps, a.cols, b.cols):
        if cp.ext.shape == (1, 1):
            scalar *= cp.ext[0, 0]
            continue
        e = cp.ext[ia][:, ib]
        f = e if f is None else f * e
    return np.full((len(a.counts), len(b.counts)), scalar) if f is None else f * scalar


def _sums(f, ua, ub, g) -> tuple:
    """(rows [a positions, rail], cols [rail, b positions], inside [a positions, g],
    inside_t [g, b positions]) of the position pairs' bytes ``f[ua[s], ub[d]]``: per
    source its bytes to each rail's positions, per destination from each rail's, and the
    bytes to (from) each GPU of its own node, 0 past the other side's last position."""
    na, nb = len(ua), len(ub)
    sa, sb = np.arange(na), np.arange(nb)
    rows = _rail_sums(f.T, ub, g).T[ua]
    cols = _rail_sums(f, ua, g)[:, ub]
    near = (sa // g * g)[:, None] + np.arange(g)
    inside = np.where(near < nb, f[ua[:, None], ub[np.minimum(near, nb - 1)]], 0.0)
    near = (sb // g * g)[None, :] + np.arange(g)[:, None]
    inside_t = np.where(near < na, f[ua[np.minimum(near, na - 1)], ub[None, :]], 0.0)
    return rows, cols, inside, inside_t


def factored_sums(a, b, cps, itemsize, ua, ub, g, weights=None):
    """:func:`_sums` without the [distinct a, distinct b] bytes, and (a bound on the
    largest pair's bytes, whether it is that largest itself), or None where it does not
    apply. A pair's bytes are ``itemsize`` times a product over dimensions of the overlap
    of its two intervals, so a rail's sum over one side's positions is a count per (rail,
    interval tuple) of that side contracted with each dimension's overlap lengths in turn:
    work of the interval tuples' count, not of the box pairs' (an all-to-all at 1,024 GPUs
    has a million). All in int64 where every count, product and sum stays below 2**53, so
    the floats are the pair sums' own, bit for bit; else None. ``weights`` (int, per
    distinct box of ``a``): also per position of ``b`` the bytes it shares with each
    distinct box of ``a`` times that box's weight, summed (the last item; else None)."""
    # dimensions of one interval each side are a factor; the others are contracted, in
    # the order that keeps every intermediate at most rails x the larger side's tuples
    scalar = itemsize
    dims = []
    for k, cp in enumerate(cps):
        if cp.ext.shape == (1, 1):
            scalar *= int(cp.ext[0, 0])
        else:
            dims.append(k)
    ka = [cps[k].ext.shape[0] for k in dims]
    kb = [cps[k].ext.shape[1] for k in dims]
    ta, tb = math.prod(ka), math.prod(kb)
    if g * max(ta, tb) > FACTORED_LIMIT:
        return None
    ext = [cps[k].ext.astype(np.int64) for k in dims]
    top = [int(e.max()) for e in ext]
    most = math.prod(max(1, x) for x in top) * max(scalar, 1)   # bytes of any pair
    if max(a.n, b.n) * most >= 2**53:
        return None
    if weights is not None and (int(weights.sum()) * most * int(a.counts.max()) >= 2**53):
        return None   # the ⊕ shares' sums (multiples of 1 / m) past float64's integers
    ja = [a.cols[k][1][ua] for k in dims]   # per position: its interval of each dimension
    jb = [b.cols[k][1][ub] for k in dims]
    code_a = np.ravel_multi_index(ja, ka) if ja else np.zeros(a.n, dtype=np.int64)
    code_b = np.ravel_multi_index(jb, kb) if jb else np.zeros(b.n, dtype=np.int64)
    count_a = np.bincount(np.arange(a.n) % g * ta + code_a, minlength=g * ta)
    count_b = np.bincount(np.arange(b.n) % g * tb + code_b, minlength=g * tb)
    # [rail, a's tuples]: b's positions on the rail against each; [rail, b's tuples] alike
    to = _contract(count_b, [g, *kb], [None, *ext],
                   [1 + k for k in sorted(range(len(dims)), key=lambda k: ka[k] / kb[k])])
    frm = _contract(count_a, [g, *ka], [None, *(e.T for e in ext)],
                    [1 + k for k in sorted(range(len(dims)), key=lambda k: kb[k] / ka[k])])
    rows = (to.reshape(g, ta)[:, code_a].T * scalar).astype(np.float64)
    cols = (frm.reshape(g, tb)[:, code_b] * scalar).astype(np.float64)
    # the pairs inside a node, each a product of its intervals' overlaps: per node the
    # [source rail, destination rail] bytes, inside one way and inside_t the other
    nodes = -(-max(a.n, b.n) // g)
    at = np.arange(nodes * g)
    pa, pb = np.minimum(at, a.n - 1).reshape(nodes, g), np.minimum(at, b.n - 1).reshape(nodes, g)
    block = np.full((nodes, g, g), scalar, dtype=np.int64)
    for e, x, y in zip(ext, ja, jb):
        block *= e[x[pa][:, :, None], y[pb][:, None, :]]
    block *= (at < a.n).reshape(nodes, g, 1)
    block *= (at < b.n).reshape(nodes, 1, g)
    inside = block.reshape(nodes * g, g)[:a.n].astype(np.float64)
    inside_t = block.transpose(1, 0, 2).reshape(g, nodes * g)[:, :b.n].astype(np.float64)
    agg = None
    if weights is not None:   # [b's tuples]: each distinct copy's weight times its bytes
        per = np.zeros(ta, dtype=np.int64)
        per[code_a[a.order[a.starts]]] = weights
        per = _contract(per, ka, [e.T for e in ext],
                        sorted(range(len(dims)), key=lambda k: kb[k] / ka[k]))
        agg = (per[code_b] * scalar).astype(np.float64)
    # every interval tuple of both sides a box of it (grid tilings): the product of the
    # per-dimension largest overlaps is a pair's
    exact = len(a.counts) == ta and len(b.counts) == tb
    return rows, cols, inside, inside_t, (float(math.prod(top) * scalar), exact), agg


def _contract(t, shape, mats, order) -> np.ndarray:
    """``t`` (axes of sizes ``shape``) with each axis ``k`` in ``order`` replaced by its
    product with ``mats[k]`` ([new size, old size]), flat: one matrix product per axis
    (int64: numpy's own loop, exact, no BLAS threads)."""
    shape = list(shape)
    for k in order:
        t = np.matmul(mats[k], t.reshape(math.prod(shape[:k]), shape[k], -1))
        shape[k] = mats[k].shape[0]
    return t.reshape(-1)


# interval tuples times rails up to which factored_sums contracts (and past which it leaves
# the exchange to the distinct boxes' products)
FACTORED_LIMIT = 1 << 16


def _box_of(s) -> np.ndarray:
    """Per position of box set ``s``: its distinct box."""
    out = np.empty(s.n, dtype=np.int64)
    out[s.order] = np.repeat(np.arange(len(s.counts)), s.counts)
    return out


def _rail_sums(f, box, g) -> np.ndarray:
    """[rail, distinct column of f]: the rows ``f[box[s]]`` summed over the positions ``s``
    on each rail (``s % g``)."""
    rail = np.arange(len(box)) % g
    order = np.argsort(rail, kind="stable")
    starts = np.searchsorted(rail[order], np.arange(g))
    out = np.zeros((g, f.shape[1]))
    have = np.bincount(rail, minlength=g)[:g] > 0
    out[have] = np.add.reduceat(f[box[order]], starts[have], axis=0)
    return out
