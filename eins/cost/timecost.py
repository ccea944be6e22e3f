"""The time cost (``Options.cost="time"``, the default): predicted seconds per eqn, the
quantity :func:`eins.cost.predict.predict` reports, in a form the DP of Section 4.5 can
minimize (the paper's byte proxy of Section 4.3, :mod:`eins.cost.proxy`, is
``cost="proxy"``).

Per eqn, with function specification ``d`` on ``devices[d]`` (the naive placement):

- **compute**: the slowest function specification's kernel,
  :func:`eins.cost.predict.kernel_seconds` (roofline with an efficiency curve). Idle
  devices (fewer pieces than devices) and uneven pieces cost what their slowest piece costs.
- **exchange**, for every input produced by another eqn: :func:`exchange_seconds` of the
  producer's block copies (one per producing function specification, several per block
  while ⊕ is pending) and the blocks the consumer's function specifications need. Program
  inputs and constants cost nothing: the device IR loads them straight into the blocks each
  function specification needs, and ``predict`` charges them nothing either. An eqn
  reading one tensor twice in the same blocks (``y * y``) pays one exchange, as it runs.
- **program outputs**: the exchange gathering each output block at its first copy's device
  (what ``predict`` charges as ``for_eqn(-1)``), charged to the eqn producing the output;
  once per tensor, however often it is returned.

:func:`exchange_seconds` is an analytic model of the naive exchange program (every atom sent
to every site needing it, then each cell ⊕-aggregated where needed) on the topology's
resources: every byte is charged to each resource on its route, the transfers finish when the
most loaded resource has carried its bytes (``max_r load_r / capacity_r``; with per-transfer
latencies, each resource from the latency of the pairs crossing it, :meth:`_Links.seconds`;
a lone transfer is exact, and contention on NVSwitch ports, NVLink directions and the shared
PCIe bridge is what the simulator's max-min sharing charges), then the busiest GPU aggregates its cells
(``(m + 1) x cell bytes`` of HBM traffic per cell with ``m`` copies). Under
``schedule="optimized"`` (``TimeModel(relays=True)``) a pair whose direct route a relay
beats is charged over the relay's hops, as the synthesized programs send it (an exchange
costs the cheaper of that and its direct routes, as the synthesizer keeps). Optimized exchange
programs are never predicted slower than the naive ones (Section 5.4). The simulated naive
programs can take a little more or less than this model (docs/costs.md: within 0.3 % on
the paper's servers, up to 7.4 % with uneven pieces; the transfers alone never more); the
optimized schedule was predicted at most 0.03 % above the naive cost (docs/costs.md).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from eins.ir.joinagg import atom_itemsize
from eins.ir.program import Literal, Program
from eins.cost.predict import kernel_seconds, out_itemsizes
from eins.hardware.net import Net
from eins.cost.overlap import BoxSet, ColumnPair, sparse_overlap, unique_rows
from eins.cost.rails import RailLinks, from_level, is_rail_cluster, latest

__all__ = ["TimeModel", "exchange_seconds", "plan_seconds", "plan_deliveries",
           "block_array", "working_set", "temp_bytes"]


def block_array(boxes) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) int64 arrays of shape [n, rank] for a sequence of Boxes."""
    lo = np.array([b.lo for b in boxes], dtype=np.int64).reshape(len(boxes), -1)
    hi = np.array([b.hi for b in boxes], dtype=np.int64).reshape(len(boxes), -1)
    return lo, hi


def _const_dims(arr) -> np.ndarray:
    """Per dimension: whether every box spans the same interval."""
    lo, hi = arr
    if not len(lo):
        return np.ones(lo.shape[1], dtype=bool)
    return (lo == lo[0]).all(axis=0) & (hi == hi[0]).all(axis=0)


def overlap_elements(a, b, a_const=None, b_const=None) -> np.ndarray:
    """[len(a), len(b)] elements shared by every pair of boxes (``a``, ``b`` from
    :func:`block_array`). Dimensions where every box of both sides spans the same interval
    contribute one factor (specs split few dimensions)."""
    alo, ahi = a
    blo, bhi = b
    a_const = _const_dims(a) if a_const is None else a_const
    b_const = _const_dims(b) if b_const is None else b_const
    ov = np.ones((alo.shape[0], blo.shape[0]), dtype=np.int64)
    scalar = 1
    for d in range(alo.shape[1]):
        if a_const[d] and b_const[d]:
            scalar *= max(min(ahi[0, d], bhi[0, d]) - max(alo[0, d], blo[0, d]), 0)
            continue
        ext = np.minimum(ahi[:, d, None], bhi[None, :, d])
        ext -= np.maximum(alo[:, d, None], blo[None, :, d])
        np.maximum(ext, 0, out=ext)
        ov *= ext
    return ov * scalar if scalar != 1 else ov


def temp_bytes(eqn, fspec) -> int:
    """Kernel temporaries of one function specification beyond its input and output blocks:
    the primitive's own rule (``Primitive.temp_bytes``; attention's running max and sum of a
    GPU flash-attention kernel), 0 for a kernel that streams its operands."""
    return eqn.primitive.temp_bytes(fspec, **eqn.params)


def working_set(eqn, spec) -> int:
    """Bytes one device needs while running ``eqn``: the largest function specification's
    input blocks (Literals excluded) + output blocks (at the partial's element size where
    they aggregate: :func:`~eins.ir.joinagg.atom_itemsize`) + kernel temporaries. The DP's
    per-eqn memory bound: a plan is refused when one eqn does not fit; what else stays live
    across eqns (weights loaded for later eqns, activations kept for later consumers) is
    not included, so the device program's peak (``predicted_time()["peak_bytes"]``) can be
    larger."""
    best = 0
    seen = set()
    for f in spec.fspecs:
        shapes = (tuple(b.shape for b in f.inputs), tuple(b.shape for b in f.outputs))
        if shapes in seen:   # the bytes depend on the block shapes only
            continue
        seen.add(shapes)
        b = sum(box.size * a.dtype.itemsize for a, box in zip(eqn.inputs, f.inputs)
                if not isinstance(a, Literal))
        b += sum(box.size * atom_itemsize(spec, j, v.dtype)
                 for j, (v, box) in enumerate(zip(eqn.outputs, f.outputs)))
        best = max(best, b + temp_bytes(eqn, f))
    return best


class _Links:
    """The topology's resources as a sparse matrix M (pair ``src * n + dst`` x resource,
    one entry per resource on the pair's route): load (per resource) = bytes(src, dst) @ M.
    Sparse: a dense M is n^2 x resources (32 GiB at 1,024 GPUs of a cluster, and a matrix
    product per exchange estimate); the entries are n^2 x the route length.

    ``relays``: a pair whose direct route a bounce through another device beats by
    :data:`~eins.hardware.net.RELAY_MIN_GAIN` (effective bandwidths, as the synthesizer
    decides) is routed over both hops instead, its bytes split evenly among the equally
    good relays: what the optimized schedule's exchange programs do (on dgx-v100-paper the
    pairs without NVLink bounce over one that has it instead of crossing the PCIe bridge).
    An exchange then costs the cheaper of its relayed and its direct routes: the synthesizer
    tries each body with and without relays and keeps the faster, so where the relays' links
    are busy with direct traffic (a ring of fast links beside a fast shared bus) it sends
    direct, and the optimized schedule is never costed above the naive one."""

    def __init__(self, topo, devices, relays: bool = False, closed_form: bool = True):
        self.topo = topo
        self.devices = tuple(devices)
        n = len(self.devices)
        names = sorted(topo.capacity)
        col = {r: c for c, r in enumerate(names)}
        self.cap = np.array([topo.capacity[r] for r in names], dtype=np.float64)
        self.switch = topo.kind == "switch"
        self.direct = None
        self.rail = None
        if closed_form and is_rail_cluster(topo):   # no relay beats its routes (_relays)
            self.rail = RailLinks(topo, self.devices)
            self.lat = self.rail.lat
            return
        if self.switch:   # every route is egress:s, ingress:d: row and column sums suffice
            self.out_cap = np.array([topo.capacity[f"egress:{d}"] for d in self.devices])
            self.in_cap = np.array([topo.capacity[f"ingress:{d}"] for d in self.devices])
            lat = topo.latency
            self.lat = (np.array([lat.get(f"egress:{d}", 0.0) for d in self.devices])[:, None]
                        + np.array([lat.get(f"ingress:{d}", 0.0) for d in self.devices]))
            np.fill_diagonal(self.lat, 0.0)
            self.has_lat = bool(self.lat.any())
            # a pair's bytes cross its source's egress and its destination's ingress
            self.pair_inv = 1.0 / np.minimum(self.out_cap[:, None], self.in_cap[None, :])
            # with one latency level the per-pair bound never exceeds its resources' (no
            # relays)
            self.levels = np.unique(self.lat[~np.eye(n, dtype=bool)]) if n > 1 else \
                np.zeros(1)
            self.pair_level = np.searchsorted(self.levels, self.lat)   # per pair
            self.pair_bound = len(self.levels) > 1
            return
        via, net = _relays(topo, self.devices) if relays else ({}, None)
        rows, cols, share, starts = [], [], [], []   # starts: when an entry's bytes can flow
        floor_pairs, floor_inv = [], []
        self.lat = np.zeros((n, n))
        for a, s in enumerate(self.devices):
            for b, d in enumerate(self.devices):
                if s == d:
                    continue
                rs = via.get((a, b))
                if rs:
                    # store and forward: the relay sends on once the whole block is in, so
                    # one pair's bytes take 1/bw(s, r) + 1/bw(r, d) per byte at least, and
                    # both hops' latencies
                    floor_pairs.append(a * n + b)
                    floor_inv.append(min(1 / net.bw(s, self.devices[r]) +
                                         1 / net.bw(self.devices[r], d) for r in rs))
                    self.lat[a, b] = min(topo.route_latency(s, self.devices[r]) +
                                         topo.route_latency(self.devices[r], d) for r in rs)
                else:
                    self.lat[a, b] = topo.route_latency(s, d)
                # (resource, when its bytes of this pair can start): a relay's second hop
                # after both hops' latencies, its first after the first hop's alone
                paths = [[(r, self.lat[a, b]) for r in topo.route(s, d)]] if not rs else [
                    [(x, topo.route_latency(s, self.devices[r]))
                     for x in topo.route(s, self.devices[r])] +
                    [(x, topo.route_latency(s, self.devices[r]) +
                      topo.route_latency(self.devices[r], d))
                     for x in topo.route(self.devices[r], d)] for r in rs]
                for path in paths:
                    for r, start in path:
                        rows.append(a * n + b)
                        cols.append(col[r])
                        share.append(1.0 / len(paths))
                        starts.append(start)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.cols = np.asarray(cols, dtype=np.int64)
        # the route entries of pair x are ptr[x]:ptr[x + 1] (appended in pair order)
        self.ptr = np.searchsorted(self.rows, np.arange(n * n + 1))
        self.share = np.asarray(share, dtype=np.float64) if via else None
        self.nres = len(names)
        self.has_lat = bool(self.lat.any())
        # per pair: the store-and-forward floor of a relayed pair's bytes (0: none)
        self.floor_inv = np.zeros(n * n)
        self.floor_inv[np.asarray(floor_pairs, dtype=np.int64)] = floor_inv
        self.has_floor = bool(floor_pairs)
        if self.has_lat:
            # per route entry when its pair's bytes can start crossing it; per pair the
            # least time a byte of it takes alone (its route's narrowest resource; a
            # relayed pair's store and forward floor)
            self.entry_lat = np.asarray(starts, dtype=np.float64)
            inv = np.zeros(n * n)
            np.maximum.at(inv, self.rows, 1.0 / self.cap[self.cols])
            inv[self.floor_inv > 0] = self.floor_inv[self.floor_inv > 0]
            self.pair_inv = inv.reshape(n, n)
            self.levels = np.unique(self.entry_lat)
            self.pair_bound = len(self.levels) > 1 or self.has_floor
        else:
            self.levels = np.zeros(1)
        # per route entry: its latency level and resource as one index into [levels, nres]
        self.entry_key = (np.searchsorted(self.levels, self.entry_lat) * self.nres + self.cols
                          if self.has_lat else self.cols)
        self.direct = _Links(topo, self.devices) if via else None

    def seconds(self, traffic: np.ndarray) -> float:
        """Transfer phase of ``traffic[src position, dst position]`` bytes (every transfer
        of the naive program starts at once, its bytes flowing once its route's latency has
        passed, as in the simulator): the later of (i) per resource and latency L of a pair
        crossing it, L plus the bytes of its pairs with a latency of L or more over its
        capacity (it carries none of them earlier, nor faster) and (ii) per pair, its
        latency plus its bytes at its route's narrowest resource (a relayed pair: both
        hops' latencies and the store-and-forward floor).
        Without latencies: the most loaded resource's bytes over its capacity."""
        traffic = np.array(traffic, dtype=np.float64)
        np.fill_diagonal(traffic, 0.0)
        src, dst = np.nonzero(traffic)
        return self.pair_seconds(src, dst, traffic[src, dst])

    def pair_seconds(self, src, dst, nbytes) -> float:
        """:meth:`seconds` of the transfers ``src[x] -> dst[x]`` (positions, distinct
        pairs, ``src != dst``) of ``nbytes[x] > 0`` bytes. Only the sending pairs are
        visited (an exchange between tilings moves between few pairs of a cluster's n^2),
        and only the latency levels they have: a level no pair has adds nothing, its
        resources carrying the bytes of the next level up, from later."""
        if not len(nbytes):
            return 0.0
        if self.rail is not None:
            return self.rail.pair_seconds(src, dst, nbytes)
        n = len(self.devices)
        t = 0.0
        if self.switch:
            if self.has_lat and self.pair_bound:
                t = float((self.lat[src, dst] + nbytes * self.pair_inv[src, dst]).max())
            nlev = len(self.levels)
            lev = self.pair_level[src, dst] * n if nlev > 1 else 0
            peak = np.maximum(from_level(np.bincount(lev + src, nbytes, nlev * n), nlev)
                              / self.out_cap,
                              from_level(np.bincount(lev + dst, nbytes, nlev * n), nlev)
                              / self.in_cap).max(axis=1)
            return latest(t, self.levels, peak)
        pair = src * n + dst
        lo = self.ptr[pair]
        lens = self.ptr[pair + 1] - lo
        idx = np.repeat(lo - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
        w = np.repeat(nbytes, lens)
        if self.share is not None:
            w = w * self.share[idx]
        if self.has_lat and self.pair_bound:
            t = float((self.lat[src, dst] + nbytes * self.pair_inv[src, dst]).max())
        elif self.has_floor:
            t = float((nbytes * self.floor_inv[pair]).max())
        nlev = len(self.levels)
        load = from_level(np.bincount(self.entry_key[idx], w, nlev * self.nres), nlev)
        t = latest(t, self.levels, (load / self.cap).max(axis=1))
        return t if self.direct is None else min(t, self.direct.pair_seconds(src, dst, nbytes))


def _relays(topo, devices) -> dict:
    """{(src position, dst position): positions of the best relays} for the pairs a bounce
    beats by RELAY_MIN_GAIN: the synthesizer's rule (eins.hardware.net, Net.relays, of which
    Net.relay_for picks one by load)."""
    if len(devices) < 3 or (topo.kind == "multinode" and topo.node.kind == "switch"):
        # clusters of NVSwitch servers: routes between nodes already take the rail-aligned
        # GPU's NIC, and no bounce beats them (none on dgx-h100:16x8 or :64x8, where the
        # search took 3.7 s at 512 GPUs)
        return {}, None
    net = Net(topo, devices)
    pos = {d: i for i, d in enumerate(devices)}
    return {(a, pos[d]): tuple(pos[r] for r in rs)
            for a, s in enumerate(devices) for d, rs in net.relays(s).items()}, net


def exchange_seconds(copies, copy_sites, needs, need_sites, itemsize, topo, devices=None,
                     links=None, relays: bool = False) -> float:
    """Analytic time of the naive exchange moving producer block ``copies[e]`` (Boxes, on
    device position ``copy_sites[e]``) into consumer blocks ``needs[f]`` (on position
    ``need_sites[f]``); positions index ``devices`` (default: the topology's GPUs). See the
    module docstring. ``relays``: over the optimized schedule's routes (:class:`_Links`)."""
    devices = tuple(topo.gpus) if devices is None else tuple(devices)
    links = links or _Links(topo, devices, relays)
    ca, na = block_array(copies), block_array(needs)
    return _exchange(ca, np.asarray(copy_sites), na, np.asarray(need_sites), itemsize, links,
                     topo.hbm_bw, len(devices))


def _agg_factor(boxes) -> np.ndarray | None:
    """Per copy: (m + 1) / m where its box has m >= 2 copies (0 otherwise); None if no box
    has two copies. Summed over a box's copies this charges (m + 1) x the needed bytes."""
    counts = Counter(boxes)
    if max(counts.values(), default=1) < 2:
        return None
    return np.array([(counts[b] + 1.0) / counts[b] if counts[b] > 1 else 0.0 for b in boxes])


def _set_factor(bs: BoxSet) -> np.ndarray | None:
    """:func:`_agg_factor` of the boxes of ``bs`` (per position, from the distinct boxes'
    counts: the same floats, without hashing every Box)."""
    if bs.single:
        return None
    c = np.empty(bs.n, dtype=np.int64)
    c[bs.order] = np.repeat(bs.counts, bs.counts)
    return np.where(c > 1, (c + 1.0) / c, 0.0)


def _exchange(ca, csites, na, nsites, itemsize, links, hbm_bw, n, factor="auto",
              consts=(None, None), ov_bytes=None) -> float:
    if ov_bytes is None:   # [copies, needs] bytes
        ov = overlap_elements(ca, na, *consts).astype(np.float64) * itemsize
    else:
        ov = ov_bytes
    if not ov.any():
        return 0.0
    if csites is None:   # copy c on position c, need f on position f
        src, dst = np.nonzero(ov)
        nbytes = ov[src, dst]
        off = src != dst
        if not off.all():
            src, dst, nbytes = src[off], dst[off], nbytes[off]
    else:
        c, f = np.nonzero(ov)
        s, d = csites[c], nsites[f]
        off = s != d
        pair, w = s[off] * n + d[off], ov[c[off], f[off]]
        uniq, inv = np.unique(pair, return_inverse=True)   # several blocks per device pair
        src, dst, nbytes = uniq // n, uniq % n, np.bincount(inv, w, len(uniq))
    t = links.pair_seconds(src, dst, nbytes)
    # ⊕: each needed cell with m >= 2 copies is read m times and written once at its site
    if isinstance(factor, str):
        factor = _agg_factor(list(zip(map(tuple, ca[0]), map(tuple, ca[1]))))
    if factor is not None:
        agg = factor @ ov                                       # per need
        if csites is None:   # need f sits on position f: its own site, no sum needed
            busiest = max(float(agg.max(initial=0.0)), 0.0)
        else:
            per_site = np.zeros(n)
            np.add.at(per_site, nsites, agg)
            busiest = float(per_site.max())
        t += busiest / hbm_bw
    return t


def _pairs_exchange(i, j, w, links, hbm_bw, factor, m) -> float:
    """:func:`_exchange` of copy ``i[x]`` (on position ``i[x]``) sharing ``w[x] > 0`` bytes
    with need ``j[x]`` (on position ``j[x]``; ``m`` needs), the pairs sorted as
    ``np.nonzero`` of the dense matrix: what a dense [copies, needs] matrix gave, visiting
    only the pairs that share bytes."""
    if not len(w):
        return 0.0
    off = i != j
    t = links.pair_seconds(i[off], j[off], w[off]) if off.any() else 0.0
    if factor is not None:   # ⊕ as in _exchange: need f sits on position f
        agg = np.bincount(j, factor[i] * w, m)
        t += max(float(agg.max(initial=0.0)), 0.0) / hbm_bw
    return t


def _eqn_key(eqn):
    """What an eqn's kernels depend on besides the blocks: operator, types and params."""
    return (eqn.prim, tuple(a.type for a in eqn.inputs), tuple(v.type for v in eqn.outputs),
            _params_key(eqn))


def _params_key(eqn):
    try:
        key = tuple(sorted(eqn.params.items()))
        hash(key)
        return key
    except TypeError:
        return id(eqn)


class TimeModel:
    """The time cost of one program on ``devices`` of ``topo``; exchange times are cached by
    (producer copies, consumer needs), both interned to small ints per value. ``relays``:
    the optimized schedule's routes, over relays where they beat a slow direct route
    (:class:`_Links`); else the naive schedule's direct routes. ``closed_form``: a
    rail-optimized cluster's routes computed from the GPU ids (:mod:`eins.cost.rails`, the
    same seconds), else from its route table."""

    def __init__(self, program: Program, devices, topo, relays: bool = False,
                 closed_form: bool = True):
        self.program = program
        self.devices = tuple(devices)
        self.topo = topo
        self.links = _Links(topo, self.devices, relays, closed_form)
        self._ids: dict = {}
        self._arrays: list = []
        self._factors: list = []
        self._boxes: dict = {}
        self._tuples: list = []   # per interned boxes: the Boxes themselves
        self._sets: list = []     # per interned boxes: its BoxSet (distinct boxes, columns)
        self._col_ids: dict = {}  # distinct intervals of one dimension -> a small int
        self._ivs: list = []      # per column id: its intervals
        self._col_pairs: dict = {}   # (column id, column id) -> ColumnPair
        self._bidx: list = []
        self._isz: list = []
        self._spec_ids: dict = {}
        self._compute: dict = {}
        self._xcache: dict = {}
        self._outputs = {}
        for o, v in enumerate(program.outputs):
            self._outputs.setdefault(id(v), []).append(o)

    def intern(self, boxes, itemsize: int = 0) -> int:
        """A small int for a tuple of Boxes (per function specification, in order) and,
        for producer copies, the bytes per element their atoms carry."""
        boxes = tuple(boxes)
        b = self._boxes.get(boxes)
        if b is None:
            b = self._boxes[boxes] = len(self._arrays)
            self._tuples.append(boxes)
            arr = block_array(boxes)
            self._arrays.append(arr)
            bs = BoxSet(*arr, self._column_id)
            self._sets.append(bs)
            self._factors.append(_set_factor(bs))
        i = self._ids.get((b, itemsize))
        if i is None:
            i = self._ids[(b, itemsize)] = len(self._bidx)
            self._bidx.append(b)
            self._isz.append(itemsize)
        return i

    def xseconds(self, copies_id: int, needs_id: int) -> float:
        """:func:`exchange_seconds` of producer copies ``copies_id`` (from :meth:`out_ids`)
        into consumer blocks ``needs_id`` (from :meth:`need_ids`), cached."""
        cb, nb = self._bidx[copies_id], self._bidx[needs_id]
        if cb == nb and self._factors[cb] is None:
            return 0.0   # every block already where it is needed, no ⊕ pending
        key = (copies_id, needs_id)
        t = self._xcache.get(key)
        if t is None:
            if self.links.rail is not None:
                pending = self._factors[cb] is not None   # partial sums: ⊕ at the needs
                t = self.links.rail.dense_seconds(self._sets[cb], self._sets[nb],
                                                  self._isz[copies_id], self._column_pair,
                                                  self.topo.hbm_bw if pending else None)
                if t is not None:
                    self._xcache[key] = t
                    return t
            # the rail path sums integer bytes per resource (exact in any order); a pending
            # ⊕ sums fractional shares per need, in the sorted order it always had
            ordered = self.links.rail is None or self._factors[cb] is not None
            i, j, w = sparse_overlap(self._sets[cb], self._sets[nb], self._isz[copies_id],
                                     self._column_pair, ordered)
            t = self._xcache[key] = _pairs_exchange(i, j, w, self.links, self.topo.hbm_bw,
                                                    self._factors[cb], len(self._sets[nb].order))
        return t

    def _column_id(self, intervals: np.ndarray) -> int:
        """A small int per distinct [k, 2] intervals of one dimension (``_ivs[id]``)."""
        x = self._col_ids.setdefault(intervals.tobytes(), len(self._ivs))
        if x == len(self._ivs):
            self._ivs.append(intervals)
        return x

    def _column_pair(self, x: int, y: int) -> ColumnPair:
        cp = self._col_pairs.get((x, y))
        if cp is None:
            cp = self._col_pairs[(x, y)] = ColumnPair(self._ivs[x], self._ivs[y])
        return cp

    def _overlap(self, cb: int, nb: int, itemsize: int) -> tuple:
        """:func:`eins.cost.overlap.sparse_overlap` of interned boxes ``cb`` and ``nb``."""
        return sparse_overlap(self._sets[cb], self._sets[nb], itemsize, self._column_pair)

    def boxes(self, interned: int) -> tuple:
        """(the Boxes per function specification, the bytes per element) of an id from
        :meth:`intern` (:meth:`out_ids`, :meth:`need_ids`)."""
        return self._tuples[self._bidx[interned]], self._isz[interned]

    def overlap_bytes(self, copies_id: int, needs_id: int, itemsize: int | None = None):
        """The [copies, needs] overlap bytes of interned ids ``copies_id`` and ``needs_id``
        (from :meth:`intern`) at ``itemsize`` bytes per element (default: the copies'
        interned itemsize): :func:`overlap_elements` times the itemsize, from the cache
        :meth:`xseconds` uses."""
        if itemsize is None:
            itemsize = self._isz[copies_id]
        return self._overlap_bytes(self._bidx[copies_id], self._bidx[needs_id], itemsize)

    def _overlap_bytes(self, cb: int, nb: int, itemsize: int) -> np.ndarray:
        """The dense [copies, needs] matrix of :meth:`_overlap` (for callers that want one;
        the DP itself only visits the sparse pairs)."""
        out = np.zeros((self._sets[cb].n, self._sets[nb].n))
        i, j, w = self._overlap(cb, nb, itemsize)
        out[i, j] = w
        return out

    def _shape_arrays(self, eqn, spec):
        """Per non-Literal input, then per output: the [pieces, rank] block shapes."""
        ids = [i for i in self.need_ids(eqn, spec) if i is not None]
        ids += list(self.out_ids(eqn, spec))
        out = []
        for i in ids:
            lo, hi = self._arrays[self._bidx[i]]
            out.append(hi - lo)
        return out

    def compute_seconds(self, eqn, spec) -> float:
        """The slowest function specification's kernel (on logical devices sharing GPUs, the
        busiest GPU's kernels together: Topology.busy_seconds). Kernels of equal block shapes cost
        the same (except a position-dependent primitive's, such as attention, whose FLOPs
        depend on where its blocks lie), so each distinct shape is costed once."""
        key = ("compute", id(spec), _eqn_key(eqn))
        hit = self._spec_ids.get(key)
        if hit is not None:
            return hit[1]
        n = len(spec.fspecs)
        if eqn.primitive.position_dependent or n == 1:
            reps, inv = range(n), np.arange(n)
        else:
            shapes = np.concatenate(self._shape_arrays(eqn, spec), axis=1)
            reps, inv = (unique_rows(shapes, index=True)[1:]
                         if shapes.shape[1] else ([0], np.zeros(n, dtype=np.int64)))
        sizes = out_itemsizes(eqn, spec)
        times = [kernel_seconds(eqn, spec.fspecs[int(r)], self.topo, sizes) for r in reps]
        if self.topo.physical:   # logical devices sharing a GPU: their kernels add up
            best = self.topo.busy_seconds([times[int(k)] for k in np.ravel(inv)],
                                          self.devices)
        else:
            best = max(times)
        self._spec_ids[key] = (spec, best)   # the spec kept alive: its id stays its own
        return best

    def working_set(self, eqn, spec) -> int:
        """:func:`working_set`, vectorized over the function specifications."""
        key = ("memory", id(spec), _eqn_key(eqn))
        hit = self._spec_ids.get(key)
        if hit is not None:
            return hit[1]
        items = [a.dtype.itemsize for a in eqn.inputs if not isinstance(a, Literal)]
        # outputs as their blocks are written: a partial's element where they aggregate
        # (attention's float32 (o, lse) pairs: 8 bytes, not the float16 output's 2)
        items += [atom_itemsize(spec, j, v.dtype) for j, v in enumerate(eqn.outputs)]
        per = np.zeros(len(spec.fspecs), dtype=np.int64)
        for isz, shape in zip(items, self._shape_arrays(eqn, spec)):
            per += shape.prod(axis=1) * isz
        if eqn.primitive.temp_bytes_fn is not None:
            per += np.array([temp_bytes(eqn, f) for f in spec.fspecs], dtype=np.int64)
        best = int(per.max())
        self._spec_ids[key] = (spec, best)
        return best

    def has_outputs(self, eqn) -> bool:
        """Whether ``eqn`` produces a program output (then it pays its gather)."""
        return any(id(v) in self._outputs for v in eqn.outputs)

    def output_seconds(self, eqn, spec) -> float:
        """The program-output gathers of ``eqn``'s outputs (predict's ``for_eqn(-1)``)."""
        if not self.has_outputs(eqn):
            return 0.0
        key = ("gather", id(spec), id(eqn))
        hit = self._spec_ids.get(key)
        if hit is None:   # spec and eqn kept alive with the value: their ids stay theirs
            hit = self._spec_ids[key] = (spec, eqn, self._gather_seconds(eqn, spec))
        return hit[2]

    def _gather_seconds(self, eqn, spec) -> float:
        t = 0.0
        for j, v in enumerate(eqn.outputs):
            if id(v) in self._outputs:   # returned twice: gathered once (overlay pass)
                boxes = [f.outputs[j] for f in spec.fspecs]
                owners = {}
                for d, b in enumerate(boxes):
                    owners.setdefault(b, d)
                ca, na = block_array(boxes), block_array(list(owners))
                t += _exchange(ca, np.arange(len(boxes)), na, np.array(list(owners.values())),
                               atom_itemsize(spec, j, v.dtype), self.links, self.topo.hbm_bw,
                               len(self.devices))
        return t

    def local_seconds(self, eqn, spec) -> float:
        """Everything of an eqn's time that depends on its own spec only."""
        return self.compute_seconds(eqn, spec) + self.output_seconds(eqn, spec)

    def eqn_terms(self, eqn, spec) -> tuple:
        """(:meth:`local_seconds`, :meth:`need_ids`) of this eqn object and spec, cached by
        both: :func:`plan_seconds` costs whole plans again and again (the DP's seeds and
        revision rounds), and keying by types and parameters each time was most of it."""
        key = ("terms", id(eqn), id(spec))
        hit = self._spec_ids.get(key)
        if hit is None:   # eqn and spec kept alive with the value: their ids stay theirs
            hit = self._spec_ids[key] = (eqn, spec, self.local_seconds(eqn, spec),
                                         self.need_ids(eqn, spec))
        return hit[2], hit[3]

    def out_ids(self, eqn, spec) -> tuple[int, ...]:
        """Per output: the id of its block copies (one per function specification)."""
        key = ("out", id(spec), tuple(v.dtype for v in eqn.outputs))
        hit = self._spec_ids.get(key)
        if hit is None:   # the spec is kept alive with its ids, so its id is not reused
            hit = self._spec_ids[key] = (spec, tuple(
                self.intern((f.outputs[j] for f in spec.fspecs), atom_itemsize(spec, j, v.dtype))
                for j, v in enumerate(eqn.outputs)))
        return hit[1]

    def need_ids(self, eqn, spec) -> tuple:
        """Per input: the id of the blocks its function specifications need (None for a
        Literal)."""
        key = ("need", id(spec), tuple(isinstance(a, Literal) for a in eqn.inputs))
        hit = self._spec_ids.get(key)
        if hit is None:
            hit = self._spec_ids[key] = (spec, tuple(
                None if isinstance(a, Literal) else self.intern(f.inputs[k] for f in spec.fspecs)
                for k, a in enumerate(eqn.inputs)))
        return hit[1]


def plan_seconds(program: Program, specs, devices, topo, model: TimeModel | None = None
                 ) -> list[float]:
    """The time cost of every eqn for a fixed choice ``specs[i]`` (naive placement):
    its local seconds plus the exchanges feeding it. A tensor read again in blocks it was
    already delivered in is not charged again: twice by one eqn (``y * y``: one exchange
    delivers both, the overlay pass) or by a later eqn (the query, key and value projections
    of one activation: the first one's exchange serves the others, the synthesize pass;
    under the naive placement equal blocks per function specification are on equal
    devices)."""
    model = model or TimeModel(program, devices, topo)
    terms = [model.eqn_terms(e, spec) for e, spec in zip(program.eqns, specs)]
    out = [t for t, _ in terms]
    for n, copies, needs in plan_deliveries(program, specs, model, [nd for _, nd in terms]):
        out[n] += model.xseconds(copies, needs)
    return out


def plan_deliveries(program: Program, specs, model: TimeModel, needs=None):
    """(eqn index, copies id, needs id) of every exchange the plan ``specs`` makes, in
    program order: a tensor once per distinct blocks its readers want (:func:`plan_seconds`
    says why). ``needs``: each eqn's need ids where the caller has them already."""
    producers = program.producers()
    seen = set()   # (tensor, blocks per function specification) delivered so far
    for n, (e, spec) in enumerate(zip(program.eqns, specs)):
        nd = model.need_ids(e, spec) if needs is None else needs[n]
        for k, a in enumerate(e.inputs):
            where = None if isinstance(a, Literal) else producers.get(id(a))
            if where is None or (id(a), nd[k]) in seen:
                continue
            seen.add((id(a), nd[k]))
            i, j = where
            yield n, model.out_ids(program.eqns[i], specs[i])[j], nd[k]
