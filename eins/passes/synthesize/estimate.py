"""The predicted time of a naive exchange body: simulated, or, for the bodies of very many
transfers on a rail cluster, the analytic model the DP prices exchanges by.

The event simulator (:mod:`eins.hardware.simulate`) recomputes every flow's max-min fair rate
at every start and end, and on an exchange whose uneven pieces break the cluster's symmetry
the distinct bottleneck levels are many: one block's attention exchange on 512 GPUs (189,478
transfers) has 7,826 events of about 215 rounds each and takes 150 CPU s, and at 1,024 GPUs
four times the transfers. Above :data:`SIMULATED_TRANSFERS` transfers on a rail cluster the
body is timed instead by :class:`eins.cost.rails.RailLinks` (the transfer phase of
:mod:`eins.cost.timecost`: per resource and latency level, the level plus the bytes it
carries from then on over its capacity, and per transfer its latency plus its bytes at its
narrowest resource: bounds no schedule of those transfers beats), then the busiest GPU's
aggregations at its HBM bandwidth, as the DP charges them. That model is below the
simulation by the time its max-min sharing leaves a bottleneck idle (0.47 % on that 512-GPU
exchange; docs/measured.md); every smaller body, and every body elsewhere, is simulated.
"""
from __future__ import annotations

import weakref

import numpy as np

from eins.cost.rails import RailLinks, is_rail_cluster
from eins.hardware.simulate import simulate_built

__all__ = ["SIMULATED_TRANSFERS", "naive_seconds", "analytic_seconds", "beyond_simulation"]

# above this many transfers a naive body on a rail cluster is timed analytically; the bench
# rows up to 128 GPUs have at most 8,128 (simulated in 0.1 CPU s)
SIMULATED_TRANSFERS = 50_000

_LINKS = weakref.WeakKeyDictionary()   # topology -> its RailLinks over all its GPUs


def naive_seconds(program, topo, membership) -> float:
    """Predicted seconds of naive body ``program`` (:func:`eins.passes.synthesize.
    naive_program`) on ``topo`` under ``membership``: its simulated ``total_s``, or
    :func:`analytic_seconds` where it has more than :data:`SIMULATED_TRANSFERS` transfers
    on a rail cluster."""
    if beyond_simulation(program, topo):
        return analytic_seconds(program, topo, membership)
    return simulate_built(program, topo, membership).total_s


def beyond_simulation(program, topo) -> bool:
    """Whether body ``program`` is timed analytically on ``topo``: more than
    :data:`SIMULATED_TRANSFERS` transfers on a rail cluster (the optimized schedule's search
    then keeps the naive body: no candidate's simulation would fit its budget)."""
    return is_rail_cluster(topo) and _transfers(program) > SIMULATED_TRANSFERS


def _transfers(program) -> int:
    return sum(len(a.hops[0]) for a in program.actions if a.hops)


def analytic_seconds(program, topo, membership) -> float:
    """The analytic time of naive body ``program`` on rail cluster ``topo``: the transfer
    phase of its transfers (every atom copy sent straight to each destination, all from the
    start, as the naive body sends them; :meth:`RailLinks.pair_seconds`), then the busiest
    GPU's aggregations (the bytes each reads and writes) at its HBM bandwidth."""
    sizes = {a.name: a.size for a in program.inputs}
    links = _LINKS.get(topo)
    if links is None:
        links = _LINKS[topo] = RailLinks(topo, topo.gpus)
    n = len(topo.gpus)
    pos = topo.gpu_index
    src, dst, nbytes = [], [], []
    hbm = np.zeros(n)
    for a in program.actions:
        if a.hops:
            (hop,) = a.hops   # naive bodies send one hop
            (atom,) = a.agg
            src.extend([pos[a.source]] * len(hop))
            dst.extend(pos[d] for d in hop)
            nbytes.extend([sizes[atom]] * len(hop))
            continue
        moved = sum(sizes[x] for x in a.agg) + max(sizes[x] for x in a.agg)
        sites = membership[a.source] if isinstance(a.source, str) else (a.source,)
        for s in sites:
            hbm[pos[s]] += moved
    t = 0.0
    if src:
        pair = np.asarray(src, np.int64) * n + np.asarray(dst, np.int64)
        pairs, inverse = np.unique(pair, return_inverse=True)
        load = np.bincount(inverse, np.asarray(nbytes, np.float64))
        t = links.pair_seconds(pairs // n, pairs % n, load)
    return t + float(hbm.max()) / topo.hbm_bw
