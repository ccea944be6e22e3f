"""The predicted schedule of a lowered program, as :func:`eins.cost.predict.predict` models
it: eqns run one after another; each first waits for the exchanges feeding it, one after
another (each its simulated ``predicted_s``), then every device runs its kernel (the
eqn takes its busiest GPU's kernels, :func:`eins.cost.predict.kernel_seconds`, devices
sharing a GPU adding up); the
program outputs' gathers come last. So the exchange events add up to
``predicted_time()["exchange_ms"]``, the eqns' compute phases to ``["compute_ms"]`` and the
whole schedule to ``["total_ms"]``.

Beside the timeline: the bytes every device sends every other (the device program's Sends,
what the numpy executor's ``stats()["bytes_moved"]`` counts when it runs it) and each
device's live bytes over time (every buffer from its definition to its Free, as
:func:`eins.cost.predict.peak_memory` counts them: the series' maximum is the predicted
peak)."""
from __future__ import annotations

from dataclasses import dataclass, field

from eins.cost.predict import Timeline, eqn_kernel_seconds, out_itemsizes
from eins.ir.device import Kernel, Send

__all__ = ["Event", "Schedule", "predicted_schedule"]


@dataclass(frozen=True)
class Event:
    """One span of the predicted schedule: a kernel on a device, an exchange (on the
    devices that send or receive in it), or an eqn's whole compute phase. In
    ``Schedule.timeline`` (GPU by GPU) ``devices`` are GPUs: a GPU's kernels of one eqn as
    one span, an exchange on the GPUs it holds."""

    kind: str            # "kernel", "exchange", "gather" (a program output's), "compute"
    name: str
    eqn: int             # the eqn it belongs to (-1: program outputs)
    start_s: float
    dur_s: float
    devices: tuple       # the devices it occupies
    nbytes: int = 0      # exchanges: bytes their programs move


@dataclass
class Schedule:
    """``events`` in time order; ``phases``: per eqn (start, exchanges end, end) seconds;
    ``link_bytes[(src, dst)]``; ``memory[d]``: [(time s, live bytes)] steps."""

    devices: tuple
    topology: str
    events: list = field(default_factory=list)
    phases: list = field(default_factory=list)
    link_bytes: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    total_s: float = 0.0
    # the same kernels and exchanges GPU by GPU (eins.cost.predict.Timeline, what
    # ``predicted_time()["timeline_ms"]`` times): Events whose ``devices`` are GPUs, ending
    # at ``timeline_s``; ``gpus``: {GPU: the devices on it}
    timeline: list = field(default_factory=list)
    timeline_s: float = 0.0
    gpus: dict = field(default_factory=dict)

    def seconds(self, *kinds) -> float:
        """The summed duration of the events of ``kinds``."""
        return sum(e.dur_s for e in self.events if e.kind in kinds)


def predicted_schedule(state) -> Schedule:
    """The schedule of a Compilation after the physical passes (``Lowered.physical``)."""
    xir, dprog = state.exchange, state.device
    prog, plan, topo = state.program, state.plan, xir.topology
    sched = Schedule(tuple(dprog.devices), topo.name)
    line = Timeline(topo, record=True)
    for d in dprog.devices:
        sched.gpus.setdefault(topo.gpu_of(d), []).append(d)
    t = 0.0
    for i, (e, ep) in enumerate(zip(prog.eqns, plan.eqn_plans)):
        start = t
        for x in xir.for_eqn(i):
            d = x.predicted_s or 0.0
            name = f"eqn {i} {x.inputs_text()}: {x.var_name}"
            sched.events.append(Event("exchange", name, i, t, d, x.sites(), x.bytes_moved()))
            _timed(sched, line, i, x, line.exchange, x, name)
            t += d
        mid = t
        sizes = out_itemsizes(e, ep.spec)
        where = xir.placement.get(i, plan.devices)   # the device of each fspec
        ks = eqn_kernel_seconds(e, ep.spec.fspecs, topo, sizes)
        for f, k in enumerate(ks):
            sched.events.append(Event("kernel", f"eqn {i} {e.prim}", i, t, k, (where[f],)))
        # the compute phase as predict charges it: the busiest GPU (devices sharing one add
        # up)
        slowest = topo.busy_seconds(ks, where)
        _timed(sched, line, i, None, line.kernels, ks, where, f"eqn {i} {e.prim}")
        sched.events.append(Event("compute", f"eqn {i} {e.prim}", i, t, slowest,
                                  tuple(plan.devices)))
        t += slowest
        sched.phases.append((start, mid, t))
    for x in xir.for_eqn(-1):
        d = x.predicted_s or 0.0
        name = f"{x.inputs_text()}: {x.var_name}"
        sched.events.append(Event("gather", name, -1, t, d, x.sites(), x.bytes_moved()))
        _timed(sched, line, -1, x, line.exchange, x, name)
        t += d
    sched.total_s = t
    sched.timeline_s = line.end()
    sched.link_bytes = _link_bytes(dprog)
    sched.memory = _memory(dprog, sched.phases, t)
    return sched


def _timed(sched, line, eqn, x, step, *args) -> None:
    """Run ``step(*args)`` on the timeline and keep the spans it records as Events of ``eqn``
    (exchange ``x``'s: its bytes; the program outputs' gathers of kind "gather")."""
    n = len(line.spans)
    step(*args)
    for kind, name, start, dur, gpus in line.spans[n:]:
        if kind == "exchange" and eqn < 0:
            kind = "gather"
        sched.timeline.append(Event(kind, name, eqn, start, dur, gpus,
                                    x.bytes_moved() if x is not None else 0))


def _link_bytes(dprog) -> dict:
    out: dict = {}
    for d in dprog.devices:
        info = dprog.bufs.get(d, {})
        for ins in dprog.code.get(d, []):
            if isinstance(ins, Send):
                b = info[ins.src]
                out[(d, ins.peer)] = out.get((d, ins.peer), 0) + b.box.size * b.dtype.itemsize
    return out


def _memory(dprog, phases, end) -> dict:
    """Per device, [(time, live bytes)]: the most bytes live during each step of the
    schedule the device's instructions fall in (an instruction before eqn i's kernel during
    eqn i's exchanges, the kernel during its compute phase), one point per step."""
    out = {}
    for d in dprog.devices:
        info = dprog.bufs.get(d, {})
        code = dprog.code.get(d, [])
        # the eqn of the next kernel at or after each instruction: its step
        step, nxt = [None] * len(code), None
        for k in range(len(code) - 1, -1, -1):
            if isinstance(code[k], Kernel):
                nxt = code[k].eqn
            step[k] = nxt
        points: dict = {}
        live = 0
        for k, ins in enumerate(code):
            for name in ins.ends():
                b = info[name]
                live -= b.box.size * b.dtype.itemsize
            for name in ins.defs():
                b = info[name]
                live += b.box.size * b.dtype.itemsize
            i = step[k]
            if i is None:
                at = end   # after the last kernel: the outputs' gathers
            elif isinstance(ins, Kernel):
                at = phases[i][1]
            else:
                at = phases[i][0]
            points[at] = max(points.get(at, 0), live)
        out[d] = sorted(points.items()) or [(0.0, 0)]
    return out
