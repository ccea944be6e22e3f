"""The exchange-program simulator (paper Section 5.2, "Cost" and "Actions").

Flow-level and event-driven. Every transfer is a flow drawing on each resource of its route
(:meth:`Topology.route`); concurrent flows share every resource max-min fairly (progressive
filling), and the rates are recomputed at every start and finish event. So two transfers on
one link each get half of it, and a multicast to k destinations divides the source's egress
by k, as the paper says, when nothing else contends: a branch held back at a congested
destination leaves its share of the egress to the others (max-min), which then run faster
than egress / k. The paper's rule is the uncontended case of this one. A transfer's bytes
start to flow once its route's latency has passed (:meth:`Topology.route_latency`; the
paper's model has none, nor has its ``dgx-v100-paper`` preset), and it draws on nothing
before then; its timeline entry spans both.

An action ``X @ s -> D`` is the paper's two-stage pipeline: a local aggregation at ``s``
(a flow on the resource ``hbm:s`` that reads every operand and writes ``X``, at the GPU's HBM
bandwidth; concurrent aggregations on one GPU share it), then one transfer per destination.
The aggregation is free when ``X`` is already present at ``s`` (a single atom, a received
copy, or an earlier materialization). Two actions that need the same ``X`` at the same site
share one aggregation. A relay ``s -> r -> d`` transfers to ``r``, then ``r`` forwards to
``d``. A relay hop with several sites ``s -> r1, r2 -> d1, d2, d3`` has ``r1`` forward to
``d1, d3`` and ``r2`` to ``d2`` (round-robin). An action without an arrow is the aggregation
alone, at its site or at every site of its partition. Actions fire as soon as their operands
are present at their source (dataflow, not program order): the operands are aggregates
present at ``s`` that partition ``X`` (Definition 5.5), chosen to read the fewest bytes. If
``X`` arrives at ``s`` while ``s`` is still aggregating it, the actions waiting for it go on
at once.

Decisions where the paper is silent: the size of an aggregate is the largest size of its
atoms (``⊕`` combines blocks of one shape); transfers do not draw on HBM; free aggregations
leave no timeline entry; an aggregate entry's ``bytes`` counts HBM traffic (reads + write).
"""
from __future__ import annotations

import heapq
import itertools
import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from eins.errors import ExProgError
from eins.hardware.presets import get_topology
from eins.ir.exprog import (ExProg, agg_text, complete_membership, exact_cover, format_action,
                            validate)


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """One part of one action: its local aggregation or one hop of one transfer."""

    action: object  # the eins.ir.exprog.Action
    index: int  # position of the action in prog.actions
    sites: tuple  # (site,) for 'aggregate'; (src, dst) for 'transfer'
    kind: str  # 'aggregate' | 'transfer'
    start_s: float
    end_s: float
    bytes: float  # transferred bytes, or HBM bytes read + written

    @property
    def text(self) -> str:
        return format_action(self.action)

    def to_dict(self) -> dict:
        return {"action": self.text, "index": self.index, "sites": list(self.sites),
                "kind": self.kind, "start_ms": self.start_s * 1e3, "end_ms": self.end_s * 1e3,
                "bytes": self.bytes}


@dataclass(frozen=True)
class SimResult:
    """``total_s``: completion time of the last action; ``transfer_s``: time during which any
    transfer is active; ``timeline``: entries in start order; ``resource_bytes``: bytes each
    resource carried (``hbm:g`` for aggregations); ``membership``: the partitions used;
    ``state``: every (aggregate, site) present at the end."""

    total_s: float
    transfer_s: float
    timeline: tuple
    resource_bytes: dict = field(default_factory=dict)
    membership: dict = field(default_factory=dict)
    state: frozenset = frozenset()  # the final (aggregate, site) pairs: Definition 5.5's S*
    work_s: float = 0.0   # this simulation's modeled CPU cost: :func:`simulation_work_s`

    @property
    def total_ms(self) -> float:
        return self.total_s * 1e3

    def to_dict(self) -> dict:
        return {"total_ms": self.total_s * 1e3, "transfer_ms": self.transfer_s * 1e3,
                "partitions": {k: list(v) for k, v in self.membership.items()},
                "timeline": [e.to_dict() for e in self.timeline],
                "resource_bytes": dict(self.resource_bytes)}

    def to_chrome_trace(self, path) -> None:
        """Write the timeline as Chrome trace JSON (open in https://ui.perfetto.dev): one
        complete ("X") event per entry, plus name metadata. Each source GPU is a process; its
        aggregations are thread 0 and its transfers to GPU d are thread d + 1, so slices on
        one row rarely overlap."""
        events = []
        rows = {}
        for e in self.timeline:
            tid = 0 if e.kind == "aggregate" else e.sites[1] + 1
            rows.setdefault(e.sites[0], {})[tid] = (
                "aggregate" if e.kind == "aggregate" else f"send -> GPU {e.sites[1]}")
        for pid in sorted(rows):
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                           "args": {"name": f"GPU {pid}"}})
            for tid, label in sorted(rows[pid].items()):
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                               "args": {"name": label}})
        for e in self.timeline:
            events.append({"name": e.text, "cat": e.kind, "ph": "X", "pid": e.sites[0],
                           "tid": 0 if e.kind == "aggregate" else e.sites[1] + 1,
                           "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
                           "args": {"bytes": e.bytes, "sites": list(e.sites)}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, indent=1)


class _Flow:
    __slots__ = ("resources", "rids", "bytes", "remaining", "rate", "start", "on_done")

    def __init__(self, resources, nbytes, start, on_done, rids=None):
        self.resources = resources
        self.rids = rids          # the route's index in the simulation's route table
        self.bytes = float(nbytes)
        self.remaining = float(nbytes)
        self.rate = 0.0
        self.start = start
        self.on_done = on_done


def max_min_rates(flows, capacity) -> None:
    """Set each flow's ``rate`` to its max-min fair share (progressive filling): raise all
    unfrozen rates together; when a resource saturates, freeze the flows through it.
    ``capacity``: resource name -> bytes/s (flows name their ``resources``)."""
    names = {}
    rids = [np.fromiter((names.setdefault(r, len(names)) for r in f.resources), np.int64)
            for f in flows]
    cap = np.array([capacity[r] for r in names], dtype=np.float64)
    for f, rate in zip(flows, _fair_rates(rids, cap)):
        f.rate = float(rate)


def _fair_rates(rids, cap) -> np.ndarray:
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
    """:func:`_fair_rates` over distinct routes: ``routes[i]`` lists the resources (indices
    into ``cap``; one resource may repeat) of route ``i`` and ``weights[i]`` counts the flows
    taking it (positive integers). Returns each route's rate, equal bit for bit to what
    :func:`_fair_rates` gives each of those flows: a flow's rate depends only on its route
    and the multiset of routes, and this runs the same progressive filling on the same
    numbers (the per-resource flow counts are integers, exact in float64 in any order), with
    fewer numpy calls per round (the simulator's hot loop: tens of rounds per event,
    thousands of events per large program)."""
    return np.array(_route_rates([list(map(int, r)) for r in routes],
                                 [int(w) for w in weights], np.asarray(cap, np.float64)))


def _route_rates(routes, weights, cap) -> list:
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
    left = cap.astype(np.float64)   # a copy
    left[count == 0] = np.inf
    frozen = bytearray(n)
    level = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        while True:
            share = left / count
            inc = float(share.min())
            if inc == np.inf:
                break
            level += inc
            left -= inc * count
            sat = (share <= inc * (1 + 1e-9)).nonzero()[0].tolist()
            for s in sat:
                for i in by_res[ptr[s]:ptr[s + 1]]:
                    if not frozen[i]:
                        frozen[i] = 1
                        rate[i] = level
                        w = weights[i]
                        for r in routes[i]:
                            count[r] -= w
            left[sat] = np.inf
    return rate

def _size(agg, sizes) -> float:
    # eins.ir.exprog.agg_size: ⊕ keeps the shape, so the largest atom's size. `sizes` also
    # memoizes aggregates (frozenset keys next to the atom-name keys).
    v = sizes.get(agg)
    if v is None:
        v = sizes[agg] = max(sizes[a] for a in agg)
    return v


class _Task:
    """One action at one source site."""

    __slots__ = ("index", "action", "agg", "site", "hops", "state")

    def __init__(self, index, action, site, hops):
        self.index, self.action, self.agg, self.site, self.hops = (
            index, action, frozenset(action.agg), site, hops)
        self.state = "waiting"


# Results of simulate() by (topology, program, membership): the simulator is deterministic,
# and a model's repeated layers produce equal exchange programs (equal atoms, sites and
# actions), so lowering a stack of blocks simulates each distinct program once. Bounded LRU
# (a result holds its timeline).
_RESULTS: OrderedDict = OrderedDict()
_RESULTS_MAX = 512
_TOPO_KEYS = weakref.WeakKeyDictionary()


def topology_key(topo) -> tuple:
    """What a simulation depends on of a Topology (which compares by identity): its GPUs,
    HBM bandwidth, resources, routes and latencies."""
    k = _TOPO_KEYS.get(topo)
    if k is None:
        k = _TOPO_KEYS[topo] = (topo.gpus, topo.hbm_bw, tuple(sorted(topo.capacity.items())),
                                tuple(sorted(topo.routes.items())),
                                tuple(sorted(topo.latency.items())))
    return k


def simulate(prog, topology, membership=None) -> SimResult:
    """Simulate exchange program ``prog`` on ``topology`` (a Topology or a preset name).
    Partitions resolve through ``membership`` (name -> sites, checked as
    :func:`eins.ir.exprog.check` checks it); if None, :func:`eins.ir.exprog.check` finds one.
    ``prog`` is checked first by :func:`eins.ir.exprog.validate` (an AST built in code may
    break the declaration rules the parser enforces: sizes, sites, partitions). Raises
    ExProgError naming an action that never becomes enabled or an ``OUT`` requirement the
    run does not meet. Results are cached by (topology, program, membership); a hit costs
    one hash of the program."""
    if not isinstance(prog, ExProg):
        raise ExProgError(f"simulate takes an ExProg (eins.ir.exprog.parse reads one from "
                          f"text), got {type(prog).__name__}")
    return _cached(prog, topology, membership, validate)


def simulate_built(prog, topology, membership=None) -> SimResult:
    """:func:`simulate` without :func:`eins.ir.exprog.validate`, for the programs the
    synthesizer builds from a preamble it validated (validate costs about a quarter of a
    simulation, and synthesis simulates thousands of candidates)."""
    return _cached(prog, topology, membership, None)


def _cached(prog, topology, membership, check) -> SimResult:
    topo = get_topology(topology)
    try:
        key = (topology_key(topo), prog,
               None if membership is None else
               tuple(sorted((k, tuple(v)) for k, v in membership.items())))
        hash(key)
    except (TypeError, AttributeError):   # not a dict of sequences: no caching
        if check is not None:
            check(prog)
        return _simulate(prog, topo, membership)
    hit = _RESULTS.get(key)
    if hit is not None:
        _RESULTS.move_to_end(key)
        return hit
    if check is not None:
        check(prog)
    res = _RESULTS[key] = _simulate(prog, topo, membership)
    while len(_RESULTS) > _RESULTS_MAX:
        _RESULTS.popitem(last=False)
    return res


def cache_clear() -> None:
    """Forget every cached simulation (for timing the simulator itself)."""
    _RESULTS.clear()


def _simulate(prog, topo, membership) -> SimResult:
    members = complete_membership(prog, membership)
    used = [*prog.gpus, *(d.site for d in prog.inputs),
            *(s for a in prog.actions if not isinstance(a.source, str) for s in [a.source]),
            *(s for a in prog.actions for hop in a.hops for s in hop if not isinstance(s, str)),
            *(s for ms in members.values() for s in ms)]
    for g in used:
        if g not in topo.gpus:
            raise ExProgError(f"the program uses GPU {g} but topology {topo.name!r} has GPUs "
                              f"{list(topo.gpus)}")
    sizes = {a.name: float(a.size) for a in prog.inputs}
    capacity = dict(topo.capacity)
    for g in topo.gpus:
        capacity[f"hbm:{g}"] = topo.hbm_bw
    res_index = {r: i for i, r in enumerate(capacity)}
    cap = np.array(list(capacity.values()), dtype=np.float64)
    route_ids = {}   # route (resource names) -> its index in `occurrences`
    route_res = []   # route index -> its resources' indices in `cap`
    route_lat = []   # route index -> its latency, seconds (Topology.route_latency)
    latency = topo.latency

    def sites_of(t):
        if isinstance(t, str):
            if t not in members:
                raise ExProgError(f"unknown partition {t!r}")
            return members[t]
        return (t,)

    tasks = []
    for i, a in enumerate(prog.actions):
        missing = sorted(set(a.agg) - set(sizes))
        if missing:
            raise ExProgError(f"action `{format_action(a)}` names atom {missing[0]!r} that IN "
                              f"does not declare")
        hops = tuple(tuple(s for t in hop for s in sites_of(t)) for hop in a.hops)
        for s in sites_of(a.source):
            tasks.append(_Task(i, a, s, hops))

    present = {g: set() for g in topo.gpus}
    for at in prog.inputs:
        present[at.site].add(frozenset([at.name]))
    waiting = {g: [] for g in topo.gpus}
    for t in tasks:
        waiting[t.site].append(t)
    agg_jobs = {}  # (X, site) -> list of tasks waiting for that aggregation
    pending = []   # flows started since the last step
    delayed = []   # heap of (time its bytes start to flow, tie-break, flow): in latency
    order = itertools.count()
    timeline = []
    resource_bytes = {}
    now = 0.0
    dirty = set(topo.gpus)  # sites whose presence changed since their tasks were checked

    def add_present(x, s):
        if x not in present[s]:
            present[s].add(x)
            dirty.add(s)
            # X arrived while being aggregated here: its waiters need not wait for that
            waiters = agg_jobs.get((x, s))
            if waiters:
                agg_jobs[(x, s)] = []
                for t in waiters:
                    ready(t)

    def start_flow(resources, nbytes, on_done):
        ri = route_ids.get(resources)
        if ri is None and resources:
            ri = route_ids[resources] = len(route_res)
            route_res.append([res_index[r] for r in resources])
            route_lat.append(sum(latency.get(r, 0.0) for r in resources))
        f = _Flow(resources, nbytes, now, on_done, ri)
        for r in resources:
            resource_bytes[r] = resource_bytes.get(r, 0.0) + f.bytes
        if f.bytes <= 0 or not resources:
            on_done(f)
        elif route_lat[ri] > 0:   # its bytes flow once the route's latency has passed
            heapq.heappush(delayed, (now + route_lat[ri], next(order), f))
        else:
            pending.append(f)

    def send(task, src, level, k=0):
        """Transfers of hop ``level`` from ``src``, the ``k``-th site of the previous hop."""
        x = task.agg
        hop = task.hops[level]
        if level:  # relays of the previous hop share this hop's sites out round-robin
            hop = hop[k::len(task.hops[level - 1])]
        for j, d in enumerate(hop):
            j = k + j * len(task.hops[level - 1]) if level else j  # d's place in its hop

            def done(f, d=d, j=j):
                timeline.append(TimelineEntry(task.action, task.index, (src, d), "transfer",
                                              f.start, now, f.bytes))
                add_present(x, d)
                if level + 1 < len(task.hops):
                    send(task, d, level + 1, j)
            start_flow(topo.route(src, d), _size(x, sizes), done)

    def ready(task):  # X is at the task's site: its transfers begin
        task.state = "done"
        if task.hops:
            send(task, task.site, 0)

    def check_site(s):
        for task in list(waiting[s]):
            x = task.agg
            if x in present[s]:
                waiting[s].remove(task)
                ready(task)
                continue
            key = (x, s)
            if key in agg_jobs:
                waiting[s].remove(task)
                agg_jobs[key].append(task)
                continue
            cover = exact_cover(x, present[s], lambda y: _size(y, sizes))
            if cover is None:
                continue
            waiting[s].remove(task)
            agg_jobs[key] = [task]
            nbytes = sum(_size(y, sizes) for y in cover) + _size(x, sizes)

            def done(f, key=key, task=task):
                timeline.append(TimelineEntry(task.action, task.index, (key[1],), "aggregate",
                                              f.start, now, f.bytes))
                add_present(*key)
                for t in agg_jobs.pop(key):
                    ready(t)
            start_flow((f"hbm:{s}",), nbytes, done)

    def settle():
        while dirty:
            check_site(dirty.pop())

    settle()
    # the flows in progress, with their bytes left, sizes and routes as arrays
    flows = []
    routes = np.empty(0, np.int64)
    remaining, nbytes = np.empty(0), np.empty(0)
    events = rated = 0   # the work count: simulation_work_s
    while flows or pending or delayed:
        if not flows and not pending:   # nothing flows: on to the next flow's start
            now = max(now, delayed[0][0])
        while delayed and delayed[0][0] <= now:
            pending.append(heapq.heappop(delayed)[2])
        if pending:
            flows += pending
            routes = np.concatenate((routes, [f.rids for f in pending]))
            remaining = np.concatenate((remaining, [f.bytes for f in pending]))
            nbytes = np.concatenate((nbytes, [f.bytes for f in pending]))
            pending.clear()
        # rates per distinct route (flows on one route share one rate), then per flow
        weights = np.bincount(routes)
        used = weights.nonzero()[0]
        events += 1
        rated += len(used) + len(flows)
        by_route = np.empty(len(weights))
        by_route[used] = _route_rates([route_res[i] for i in used.tolist()],
                                      weights[used].tolist(), cap)
        rates = by_route[routes]
        dt = float((remaining / rates).min())
        if delayed and now + dt > delayed[0][0]:   # a flow starts first: rates change then
            dt = delayed[0][0] - now
            now = delayed[0][0]
        else:
            now += dt
        remaining -= rates * dt
        done = remaining <= 1e-9 * nbytes
        keep = (~done).tolist()
        finished = [flows[i] for i in np.flatnonzero(done)]
        flows = list(itertools.compress(flows, keep))
        routes, remaining, nbytes = routes[~done], remaining[~done], nbytes[~done]
        for f in finished:
            f.on_done(f)
        settle()

    stuck = [t for g in topo.gpus for t in waiting[g]]
    if stuck:
        t = min(stuck, key=lambda t: t.index)
        have = sorted((agg_text(y) for y in present[t.site] if y <= t.agg))
        raise ExProgError(f"action `{format_action(t.action)}` is never enabled at site "
                          f"{t.site}: the aggregates there never partition "
                          f"{agg_text(t.agg)} (present: {', '.join(have) or 'none'})")
    for req in prog.outputs:
        x = frozenset(req.agg)
        for target in req.targets:
            for s in sites_of(target):
                if x not in present[s]:
                    raise ExProgError(f"OUT requirement {agg_text(x)} @ {target} is not met "
                                      f"at site {s}")
    timeline.sort(key=lambda e: (e.start_s, e.end_s, e.index))
    return SimResult(total_s=now, transfer_s=_union_length(
        [(e.start_s, e.end_s) for e in timeline if e.kind == "transfer"]),
        timeline=tuple(timeline), resource_bytes=resource_bytes, membership=members,
        state=frozenset((x, g) for g, xs in present.items() for x in xs),
        work_s=simulation_work_s(len(prog.actions), events, rated))


# The simulator's CPU cost, fitted (least squares on relative error) to 1,669 simulations on
# the project's 2-core CI machine: the exchange programs that synthesis tried for the 12
# paper workloads at 8 GPUs on dgx-a100:8 and dgx-v100-paper, and for one paper block at
# 72 GPUs on gb200-nvl72 (0.3 ms to 0.97 s each). Per simulation, per action, per event
# (a start or finish, after which the rates are recomputed) and per (route, flow) that an
# event rates. The estimate is within 0.65-1.2x of the measured time for 80 % of the
# 8-GPU simulations and 0.3-1.1x at 72 GPUs.
WORK_BASE_S = 89e-6
WORK_ACTION_S = 12.7e-6
WORK_EVENT_S = 61e-6
WORK_RATED_S = 0.52e-6


def simulation_work_s(actions: int, events: int, rated: int) -> float:
    """A simulation's modeled CPU cost in seconds on the reference machine (the 2-core CI
    CPU): a deterministic function of the program's ``actions``, the simulator's ``events``
    and the (route, flow) pairs those events rated (``rated``). It is what
    :class:`SimResult`'s ``work_s`` holds and what a synthesis budget counts, so the search
    stops at the same candidate on any machine, whatever its speed or load."""
    return (WORK_BASE_S + WORK_ACTION_S * actions + WORK_EVENT_S * events
            + WORK_RATED_S * rated)


def _union_length(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
