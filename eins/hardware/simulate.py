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
from dataclasses import dataclass, field

import numpy as np

from eins.errors import ExProgError
from eins.hardware.fair_share import RouteTable, route_rates, table_rates
from eins.hardware.presets import get_topology
from eins.ir.exprog import (ExProg, agg_text, complete_membership, exact_cover, format_action,
                            validate)
from eins.ir.memo import Memo


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
    """One flow in progress: an aggregation (``hop`` None: ``task``'s aggregate at ``src``)
    or a transfer of hop ``hop`` of ``task`` from ``src`` to ``dst``, the ``place``-th site of
    its hop (which the next hop's round-robin reads). Its end is :meth:`Simulation.finish`."""

    __slots__ = ("resources", "rids", "bytes", "start", "task", "src", "dst", "hop", "place")

    def __init__(self, resources, nbytes, start, rids, task, src, dst, hop, place):
        self.resources = resources
        self.rids = rids          # the route's index in the simulation's route table
        self.bytes = float(nbytes)
        self.start = start
        self.task, self.src, self.dst, self.hop, self.place = task, src, dst, hop, place


def _size(agg, sizes) -> float:
    # eins.ir.exprog.agg_size: ⊕ keeps the shape, so the largest atom's size. `sizes` also
    # memoizes aggregates (frozenset keys next to the atom-name keys).
    v = sizes.get(agg)
    if v is None:
        v = sizes[agg] = max(sizes[a] for a in agg)
    return v


class _Task:
    """One action at one source site; ``state`` "waiting" until its aggregate is there."""

    __slots__ = ("index", "action", "agg", "site", "hops", "state")

    def __init__(self, index, action, site, hops):
        self.index, self.action, self.agg, self.site, self.hops = (
            index, action, frozenset(action.agg), site, hops)
        self.state = "waiting"


# Results of simulate() by (topology, program, membership): the simulator is deterministic,
# and a model's repeated layers produce equal exchange programs (equal atoms, sites and
# actions), so lowering a stack of blocks simulates each distinct program once. Bounded LRU
# (a result holds its timeline); a call's pricing of its re-cut keeps its own for the call
# (eins.ir.memo).
_RESULTS = Memo("simulations", 512)
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
        return Simulation(prog, topo, membership).run()
    hit = _RESULTS.get(key)
    if hit is not None:
        return hit
    if check is not None:
        check(prog)
    return _RESULTS.put(key, Simulation(prog, topo, membership).run())


def cache_clear() -> None:
    """Forget every cached simulation (for timing the simulator itself)."""
    _RESULTS.clear()


class Simulation:
    """One run of the simulator: ``prog`` on ``topo`` under ``membership``. It holds what
    the run changes (the aggregates present at each site, the tasks waiting there, the
    aggregations under way, the flows started and delayed, the timeline) and :meth:`run`
    plays the events to the end. Flows end in :meth:`finish`, which makes their aggregate
    present and starts what that enables (:meth:`settle`)."""

    def __init__(self, prog, topo, membership):
        self.prog, self.topo = prog, topo
        self.members = members = complete_membership(prog, membership)
        used = [*prog.gpus, *(d.site for d in prog.inputs),
                *(s for a in prog.actions if not isinstance(a.source, str) for s in [a.source]),
                *(s for a in prog.actions for hop in a.hops for s in hop
                  if not isinstance(s, str)),
                *(s for ms in members.values() for s in ms)]
        for g in used:
            if g not in topo.gpus:
                raise ExProgError(f"the program uses GPU {g} but topology {topo.name!r} has "
                                  f"GPUs {list(topo.gpus)}")
        self.sizes = {a.name: float(a.size) for a in prog.inputs}
        capacity = dict(topo.capacity)
        for g in topo.gpus:
            capacity[f"hbm:{g}"] = topo.hbm_bw
        self.res_index = {r: i for i, r in enumerate(capacity)}
        self.cap = np.array(list(capacity.values()), dtype=np.float64)
        self.route_ids = {}   # route (resource names) -> its index in route_res
        self.route_res = []   # route index -> its resources' indices in `cap`
        self.route_lat = []   # route index -> its latency, seconds (Topology.route_latency)
        tasks = self._tasks()
        self.present = {g: set() for g in topo.gpus}
        for at in prog.inputs:
            self.present[at.site].add(frozenset([at.name]))
        self.waiting = {g: [] for g in topo.gpus}
        for t in tasks:
            self.waiting[t.site].append(t)
        self.agg_jobs = {}  # (X, site) -> list of tasks waiting for that aggregation
        self.pending = []   # flows started since the last step
        self.delayed = []   # heap of (time its bytes start to flow, tie-break, flow): in latency
        self.order = itertools.count()
        self.timeline = []
        self.resource_bytes = {}
        self.now = 0.0
        self.dirty = set(topo.gpus)  # sites whose presence changed since their tasks were checked

    def sites_of(self, target) -> tuple:
        """The sites of a target: a site, or a partition's members."""
        if isinstance(target, str):
            if target not in self.members:
                raise ExProgError(f"unknown partition {target!r}")
            return self.members[target]
        return (target,)

    def _tasks(self) -> list:
        tasks, sizes = [], self.sizes
        for i, a in enumerate(self.prog.actions):
            missing = sorted(x for x in a.agg if x not in sizes)
            if missing:
                raise ExProgError(f"action `{format_action(a)}` names atom {missing[0]!r} that "
                                  f"IN does not declare")
            hops = tuple(tuple(s for t in hop for s in self.sites_of(t)) for hop in a.hops)
            for s in self.sites_of(a.source):
                tasks.append(_Task(i, a, s, hops))
        return tasks

    def add_present(self, x, s) -> None:
        if x not in self.present[s]:
            self.present[s].add(x)
            self.dirty.add(s)
            # X arrived while being aggregated here: its waiters need not wait for that
            waiters = self.agg_jobs.get((x, s))
            if waiters:
                self.agg_jobs[(x, s)] = []
                for t in waiters:
                    self.ready(t)

    def start_flow(self, resources, nbytes, task, src, dst=None, hop=None, place=0) -> None:
        """Start a flow of ``nbytes`` over ``resources`` (:class:`_Flow` for the rest); its
        bytes flow once its route's latency has passed."""
        ri = self.route_ids.get(resources)
        if ri is None and resources:
            ri = self.route_ids[resources] = len(self.route_res)
            self.route_res.append([self.res_index[r] for r in resources])
            self.route_lat.append(sum(self.topo.latency.get(r, 0.0) for r in resources))
        f = _Flow(resources, nbytes, self.now, ri, task, src, dst, hop, place)
        for r in resources:
            self.resource_bytes[r] = self.resource_bytes.get(r, 0.0) + f.bytes
        if f.bytes <= 0 or not resources:
            self.finish(f)
        elif self.route_lat[ri] > 0:
            heapq.heappush(self.delayed, (self.now + self.route_lat[ri], next(self.order), f))
        else:
            self.pending.append(f)

    def finish(self, f) -> None:
        """Flow ``f`` has ended: its entry on the timeline, its aggregate present where it
        went, and what waited for it begins (the tasks of an aggregation, the next hop)."""
        task = f.task
        if f.hop is None:
            self.timeline.append(TimelineEntry(task.action, task.index, (f.src,), "aggregate",
                                               f.start, self.now, f.bytes))
            key = (task.agg, f.src)
            self.add_present(*key)
            for t in self.agg_jobs.pop(key):
                self.ready(t)
            return
        self.timeline.append(TimelineEntry(task.action, task.index, (f.src, f.dst), "transfer",
                                           f.start, self.now, f.bytes))
        self.add_present(task.agg, f.dst)
        if f.hop + 1 < len(task.hops):
            self.send(task, f.dst, f.hop + 1, f.place)

    def send(self, task, src, level, k=0) -> None:
        """Transfers of hop ``level`` from ``src``, the ``k``-th site of the previous hop."""
        hop = task.hops[level]
        if level:  # relays of the previous hop share this hop's sites out round-robin
            hop = hop[k::len(task.hops[level - 1])]
        for j, d in enumerate(hop):
            j = k + j * len(task.hops[level - 1]) if level else j  # d's place in its hop
            self.start_flow(self.topo.route(src, d), _size(task.agg, self.sizes), task, src, d,
                            level, j)

    def ready(self, task) -> None:
        """X is at the task's site: its transfers begin."""
        task.state = "done"
        if task.hops:
            self.send(task, task.site, 0)

    def check_site(self, s) -> None:
        """Start what the aggregates present at ``s`` enable: a task whose X is there, or
        an aggregation of X from the cheapest cover of it (shared by the tasks needing X)."""
        present, sizes, agg_jobs = self.present[s], self.sizes, self.agg_jobs
        waiting = self.waiting[s]
        for task in list(waiting):
            x = task.agg
            if x in present:
                waiting.remove(task)
                self.ready(task)
                continue
            key = (x, s)
            if key in agg_jobs:
                waiting.remove(task)
                agg_jobs[key].append(task)
                continue
            cover = exact_cover(x, present, lambda y: _size(y, sizes))
            if cover is None:
                continue
            waiting.remove(task)
            agg_jobs[key] = [task]
            nbytes = sum(_size(y, sizes) for y in cover) + _size(x, sizes)
            self.start_flow((f"hbm:{s}",), nbytes, task, s)

    def settle(self) -> None:
        while self.dirty:
            self.check_site(self.dirty.pop())

    def run(self) -> SimResult:
        """Play the events to the end: at each, the flows' max-min fair rates per distinct
        route (:class:`_Rates`), then on to the first flow to end or delayed flow to start."""
        self.settle()
        pending, delayed = self.pending, self.delayed
        # the flows in progress, with their routes, bytes left and sizes as arrays
        flows = np.empty(0, object)
        routes = np.empty(0, np.int64)
        remaining, nbytes = np.empty(0), np.empty(0)
        rates_of = _Rates(self)
        events = rated = 0   # the work count: simulation_work_s
        while len(flows) or pending or delayed:
            if not len(flows) and not pending:   # nothing flows: on to the next flow's start
                self.now = max(self.now, delayed[0][0])
            while delayed and delayed[0][0] <= self.now:
                pending.append(heapq.heappop(delayed)[2])
            if pending:
                n = len(pending)
                new = np.fromiter((f.rids for f in pending), np.int64, n)
                size = np.fromiter((f.bytes for f in pending), np.float64, n)
                flows = np.concatenate((flows, np.fromiter(pending, object, n)))
                routes = np.concatenate((routes, new))
                remaining = np.concatenate((remaining, size))
                nbytes = np.concatenate((nbytes, size))
                rates_of.start(new)
                pending.clear()
            events += 1
            rates, used = rates_of(routes)
            rated += used + len(flows)
            dt = float((remaining / rates).min())
            if delayed and self.now + dt > delayed[0][0]:   # a flow starts first: rates change
                dt = delayed[0][0] - self.now
                self.now = delayed[0][0]
            else:
                self.now += dt
            remaining -= rates * dt
            done = remaining <= 1e-9 * nbytes
            if done.any():
                keep = ~done
                finished = flows[done]
                rates_of.end(routes[done])
                flows, routes, remaining, nbytes = (flows[keep], routes[keep], remaining[keep],
                                                    nbytes[keep])
                for f in finished:
                    self.finish(f)
            self.settle()
        return self.result(events, rated)

    def result(self, events, rated) -> SimResult:
        """The run's :class:`SimResult`, or an ExProgError for an action never enabled or
        an ``OUT`` requirement not met."""
        prog, present = self.prog, self.present
        stuck = [t for g in self.topo.gpus for t in self.waiting[g]]
        if stuck:
            t = min(stuck, key=lambda t: t.index)
            have = sorted((agg_text(y) for y in present[t.site] if y <= t.agg))
            raise ExProgError(f"action `{format_action(t.action)}` is never enabled at site "
                              f"{t.site}: the aggregates there never partition "
                              f"{agg_text(t.agg)} (present: {', '.join(have) or 'none'})")
        for req in prog.outputs:
            x = frozenset(req.agg)
            for target in req.targets:
                for s in self.sites_of(target):
                    if x not in present[s]:
                        raise ExProgError(f"OUT requirement {agg_text(x)} @ {target} is not "
                                          f"met at site {s}")
        timeline = self.timeline
        timeline.sort(key=lambda e: (e.start_s, e.end_s, e.index))
        return SimResult(total_s=self.now, transfer_s=_union_length(
            [(e.start_s, e.end_s) for e in timeline if e.kind == "transfer"]),
            timeline=tuple(timeline), resource_bytes=self.resource_bytes,
            membership=self.members,
            state=frozenset((x, g) for g, xs in present.items() for x in xs),
            work_s=simulation_work_s(len(prog.actions), events, rated))


# The simulator's CPU cost on the project's 2-core CI machine: per simulation, per action,
# per event (a start or finish, after which the rates are recomputed) and per (route, flow)
# that an event rates; fitted by least squares on relative error (the fit and its accuracy:
# docs/measured.md, "Behind the code's constants").
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


class _Rates:
    """The max-min fair rate of every flow in progress, from its route: per distinct route
    by :func:`route_rates` while the simulation knows few routes, by :func:`table_rates`
    from :data:`TABLE_ROUTES` on (the same floats; there the flows per route and per
    resource are kept as flows start and end, not recounted at every event)."""

    def __init__(self, sim):
        self.sim = sim
        self.table = None    # a RouteTable over sim.route_res, once there are many routes
        self.weights = self.count = None

    def start(self, routes) -> None:
        if self.table is not None:
            self._fit()
            self.weights += np.bincount(routes, minlength=self.table.n)
            self.count += self.table.loads(routes)

    def end(self, routes) -> None:
        if self.table is not None:
            self.weights -= np.bincount(routes, minlength=self.table.n)
            self.count -= self.table.loads(routes)

    def __call__(self, routes) -> tuple:
        """(each flow's rate, the number of distinct routes in use) for flows on ``routes``."""
        sim = self.sim
        if self.table is None and len(sim.route_res) >= TABLE_ROUTES:
            self.table = RouteTable(sim.route_res, len(sim.cap))
            self.weights = np.bincount(routes, minlength=self.table.n).astype(np.float64)
            self.count = self.table.loads(routes)
        if self.table is None:
            weights = np.bincount(routes)
            used = weights.nonzero()[0]
            by_route = np.empty(len(weights))
            by_route[used] = route_rates([sim.route_res[i] for i in used.tolist()],
                                         weights[used].tolist(), sim.cap)
            return by_route[routes], len(used)
        self._fit()
        by_route = table_rates(self.table, self.weights, self.count, sim.cap)
        return by_route[routes], int(np.count_nonzero(self.weights))

    def _fit(self) -> None:
        """Routes the simulation met since the table was built: a new table over all."""
        if self.table.n < len(self.sim.route_res):
            self.table = RouteTable(self.sim.route_res, len(self.sim.cap))
            self.weights = np.concatenate(
                (self.weights, np.zeros(self.table.n - len(self.weights))))


# from this many distinct routes on, a simulation rates its flows by table_rates
TABLE_ROUTES = 256


def _union_length(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
