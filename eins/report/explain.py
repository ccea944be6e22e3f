"""Why each eqn got its spec: ``Lowered.explain(eqn)`` and ``eins plan --explain EQN``.

The DP is not asked again. Every other candidate spec of the eqn (the ones
:mod:`eins.passes.enumerate_specs` produced, before the memory cap) is costed with the same
time model the DP minimized (:func:`eins.cost.timecost.plan_seconds`), with every other eqn
kept as planned: its kernel, the exchanges feeding it (and its output gathers), the change it
causes in its consumers' exchanges, its per-device working set, and the plan's total had
the eqn taken it. The chosen spec's row adds up to the plan's own figures: its kernel plus
its exchanges is the eqn's ``seconds`` in ``plan_table()``, and its total is
``Plan.cost_s``. A plan minimizing the proxy (``cost="proxy"``) ranks by the proxy's bytes
instead (:func:`eins.cost.proxy.plan_costs`), the times shown beside them.

For a forced plan (``plan=``, or the greedy and random selectors) the explanation also plans
the program with ``dp`` and says what dp chose for the eqn and how much slower the whole
plan is than dp's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from eins.cost.proxy import cost as proxy_cost
from eins.cost.proxy import plan_costs, resident_inputs
from eins.cost.timecost import TimeModel, plan_seconds
from eins.cost.timecost import working_set as plain_working_set
from eins.errors import EinsError
from eins.ir.plan import Compilation, schedule_name
from eins.ir.program import Literal
from eins.ir.text import format_bytes, format_seconds, sort_key
from eins.passes import PLANNING, run_passes
from eins.passes.enumerate_specs import eqn_candidates

__all__ = ["Alternative", "Explanation", "Explanations", "explain", "Context"]

# below this fraction of the plan's total two costs are a tie (float sums in another order)
TIE = 1e-9


@dataclass(frozen=True)
class Alternative:
    """One candidate spec of an eqn, costed with every other eqn as planned. Seconds are
    None without a topology (a proxy plan beyond the default's devices)."""

    splits: str                 # "d0/4 r0/2", "whole"
    pieces: int                 # function specifications (busy devices)
    compute_s: float | None     # its slowest kernel
    exchange_s: float | None    # the exchanges feeding it and its output gathers
    consumers_s: float | None   # how much its consumers' exchanges change against the plan
    total_s: float | None       # the plan's total had the eqn taken this spec
    memory_bytes: int           # its per-device working set
    proxy_bytes: int            # the plan's proxy bytes had the eqn taken this spec
    fits: bool                  # working set within the plan's memory limit
    chosen: bool = False
    reason: str = ""            # why it lost ("" for the chosen one)
    # among the planner's candidates; False: a spec on fewer devices (some idle), which the
    # planner does not consider when the operator can use them all (enumerate_specs)
    planned: bool = True

    @property
    def seconds(self) -> float | None:
        """The eqn's own share (kernel + exchanges): ``plan_table()[i]["seconds"]`` for the
        chosen spec."""
        if self.compute_s is None:
            return None
        return self.compute_s + self.exchange_s


@dataclass(frozen=True)
class Explanation:
    """One eqn's chosen spec, its ``top`` best alternatives and why each lost."""

    eqn: int
    op: str
    line: str                   # the eqn as the traced IR prints it
    source: str | None
    devices: int
    topology: str | None
    minimized: str | None       # "time", "bytes" or None (random)
    plan_total_s: float | None  # Plan.cost_s
    plan_bytes: int             # Plan.cost_bytes
    memory_limit: float | None
    chosen: Alternative
    alternatives: tuple         # the next best, best first
    candidates: int             # how many specs were costed
    forced: bool                # the eqn's spec was given by plan=
    selector: str
    dp_choice: Alternative | None = None   # dp's spec for this eqn (forced plans only)
    dp_total_s: float | None = None
    dp_bytes: int | None = None

    def runner_up(self) -> Alternative | None:
        return self.alternatives[0] if self.alternatives else None

    def __str__(self) -> str:
        return render(self)

    __repr__ = __str__


class Explanations(tuple):
    """Every eqn's :class:`Explanation`, in program order; prints them one after another."""

    def __str__(self):
        return "\n\n".join(render(x) for x in self)

    __repr__ = __str__


class Context:
    """What the explanations of one plan share: its time model, each eqn's seconds and
    proxy bytes as planned, and (forced plans) dp's plan."""

    def __init__(self, comp: Compilation):
        if comp.plan is None or comp.candidates is None:
            raise EinsError("explain needs a planned compilation (Lowered.compilation)")
        self.comp = comp
        self.plan = comp.plan
        self.program = comp.program
        self.devices = tuple(comp.devices)
        opts = comp.options
        self.topo = comp.topology   # resolved once by distribute and carried (None: a proxy
                                    # plan beyond the default topology's devices)
        relays = schedule_name(opts.schedule) == "optimized"
        self.model = (TimeModel(self.program, self.devices, self.topo, relays)
                      if self.topo is not None else None)
        self.specs = [ep.spec for ep in self.plan.eqn_plans]
        self.resident = opts.inputs_resident
        self.base_s = self._seconds(self.specs)
        self.base_bytes = [k.total for k in plan_costs(self.program, self.specs,
                                                       self.resident)]
        self.producers = self.program.producers()
        consumers = self.program.consumers()
        # per eqn: the eqns whose proxy its spec enters (itself and its outputs' readers)
        self.proxy_deps = [sorted({i} | {c for v in e.outputs
                                         for c, _ in consumers.get(id(v), ())})
                           for i, e in enumerate(self.program.eqns)]
        self.by_bytes = self.plan.minimized == "bytes" or self.model is None
        self.forced = set(opts.plan or ())
        self.names = self.plan.index_names()
        self._dp = None

    def _seconds(self, specs):
        if self.model is None:
            return None
        return plan_seconds(self.program, specs, self.devices, self.topo, self.model)

    def working_set(self, eqn, spec) -> int:
        if self.model is not None:
            return self.model.working_set(eqn, spec)
        return plain_working_set(eqn, spec)

    @property
    def dp(self) -> Compilation | None:
        """The same program planned by dp without forced specs (None when this plan is
        dp's own)."""
        opts = self.comp.options
        if opts.selector == "dp" and not opts.plan:
            return None
        if self._dp is None:
            self._dp = run_passes(Compilation(self.program, self.devices,
                                              replace(opts, plan=None, selector="dp")),
                                  PLANNING)
        return self._dp

    def splits_text(self, i: int, intervals) -> str:
        counts = sorted(((self.names[i].get(n, n), len(iv)) for n, iv in intervals.items()
                         if len(iv) > 1), key=lambda nc: sort_key(nc[0]))
        return " ".join(f"{n}/{c}" for n, c in counts) or "whole"

    def cost(self, i: int, intervals, spec, chosen=False) -> Alternative:
        """Eqn ``i`` with ``spec``, every other eqn as planned."""
        e = self.program.eqns[i]
        specs = list(self.specs)
        specs[i] = spec
        secs = self.base_s if chosen else self._seconds(specs)
        nbytes = self.plan.cost_bytes if chosen else self._proxy(i, specs)
        mem = self.working_set(e, spec)
        limit = self.plan.memory_limit
        if secs is None:
            compute = exchange = consumers = total = None
        else:
            compute = self.model.compute_seconds(e, spec)
            exchange = secs[i] - compute
            total = sum(secs)
            consumers = (total - secs[i]) - (sum(self.base_s) - self.base_s[i])
        return Alternative(self.splits_text(i, intervals), len(spec.fspecs), compute,
                           exchange, consumers, total, mem, nbytes,
                           limit is None or mem <= limit, chosen)

    def _proxy(self, i: int, specs) -> int:
        """The plan's proxy bytes with ``specs`` (differing from the plan's at eqn ``i``
        only): an eqn's proxy depends on its spec and its producers' (eins.cost.proxy
        plan_costs), so only eqn ``i`` and its readers are costed again."""
        total = self.plan.cost_bytes
        for k in self.proxy_deps[i]:
            e = self.program.eqns[k]
            tilings = []
            for a in e.inputs:
                where = None if isinstance(a, Literal) else self.producers.get(id(a))
                tilings.append(None if where is None else specs[where[0]].out_tiling(where[1]))
            free = resident_inputs(self.program, e) if self.resident else frozenset()
            total += proxy_cost(specs[k], e, tilings, free).total - self.base_bytes[k]
        return total

    def candidates(self, i: int) -> list:
        """[(candidate, planned)] of eqn ``i``: the planned compilation's candidates (for a
        forced eqn, whose only candidate is the given one, those dp chose among), then
        those on fewer devices (p/2, p/4, ..., 1 pieces: some devices idle), which the
        planner does not consider (``planned`` False)."""
        if i in self.forced and self.dp is not None:
            own = self.dp.candidates[i]
        else:
            own = self.comp.candidates[i]
        out = [(c, True) for c in own]
        p = len(self.devices)
        most = max((len(c.spec.fspecs) for c in own), default=p)
        e = self.program.eqns[i]
        opts = self.comp.options
        for q in sorted((q for q in range(1, most) if p % q == 0), reverse=True):
            cands, reached = eqn_candidates(e, q, opts.max_specs)
            if reached == q:
                out += [(c, False) for c in cands]
        return out

    def explain(self, i: int, top: int = 3) -> Explanation:
        n = len(self.program.eqns)
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) \
                or not -n <= i < n:
            raise EinsError(f"explain: no eqn {i!r}; the program has eqns 0..{n - 1}")
        i = int(i) % n
        ep = self.plan.eqn_plans[i]
        chosen = self.cost(i, ep.intervals, ep.spec, chosen=True)
        alts, seen = [], {chosen.splits}
        cands = self.candidates(i)
        for c, planned in cands:
            splits = self.splits_text(i, c.intervals)
            if splits in seen:
                continue
            seen.add(splits)
            alts.append(replace(self.cost(i, c.intervals, c.spec), planned=planned))
        alts.sort(key=self._rank)
        alts = tuple(replace(a, reason=self.reason(a, chosen)) for a in alts[:max(top, 0)])
        e = self.program.eqns[i]
        dp_choice = dp_total = dp_bytes = None
        if self.dp is not None:
            dep = self.dp.plan.eqn_plans[i]
            dp_choice = self.cost(i, dep.intervals, dep.spec)
            dp_total, dp_bytes = self.dp.plan.cost_s, self.dp.plan.cost_bytes
        line = self.program.pretty().splitlines()[i + 1].strip()
        return Explanation(i, e.prim, line, e.source, len(self.devices),
                           self.plan.topology, self.plan.minimized, self.plan.cost_s,
                           self.plan.cost_bytes, self.plan.memory_limit, chosen, alts,
                           len(cands), i in self.forced, self.plan.selector, dp_choice,
                           dp_total, dp_bytes)

    def _rank(self, a: Alternative):
        value = a.proxy_bytes if self.by_bytes else a.total_s
        return (not a.fits, value, a.splits)

    def reason(self, a: Alternative, chosen: Alternative) -> str:
        """Why ``a`` lost to ``chosen``."""
        parts = []
        if not a.fits:
            parts.append(f"exceeds memory: {format_bytes(a.memory_bytes)} per device, the "
                         f"limit is {format_bytes(self.plan.memory_limit)}")
        elif self.by_bytes:
            d = a.proxy_bytes - chosen.proxy_bytes
            parts.append(f"moves {format_bytes(d)} more (proxy)" if d > 0 else
                         f"moves {format_bytes(-d)} less (proxy) with the other eqns as "
                         f"planned" if d < 0 else "ties on the proxy")
        else:
            d = a.total_s - chosen.total_s
            if abs(d) <= TIE * max(chosen.total_s, 1e-30):
                parts.append("ties with the chosen spec")
            elif d > 0:
                why = [f"{name} {sign(x)}" for name, x in (
                    ("kernel", a.compute_s - chosen.compute_s),
                    ("its exchanges", a.exchange_s - chosen.exchange_s),
                    ("consumers' exchanges", a.consumers_s - chosen.consumers_s))
                    if abs(x) > TIE * chosen.total_s]
                parts.append(f"slower by {format_seconds(d)}" +
                             (f" ({', '.join(why)})" if why else ""))
            else:
                parts.append(f"faster by {format_seconds(-d)} with the other eqns as planned")
        if a.pieces < len(self.devices):
            parts.append(f"{len(self.devices) - a.pieces} of {len(self.devices)} devices "
                         f"idle" + ("" if a.planned else
                                    " (the planner uses every device it can)"))
        return "; ".join(parts)


def sign(t: float) -> str:
    return ("+" if t >= 0 else "-") + format_seconds(abs(t))


def explain(comp: Compilation, eqn=None, top: int = 3):
    """The :class:`Explanation` of eqn ``eqn`` (an index; negative counts from the end), or
    with ``eqn=None`` every eqn's (:class:`Explanations`)."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise EinsError(f"explain: top must be a non-negative int, got {top!r}")
    ctx = Context(comp)
    if eqn is None:
        return Explanations(ctx.explain(i, top) for i in range(len(comp.program.eqns)))
    return ctx.explain(eqn, top)


def _ms(t) -> str:
    return "-" if t is None else format_seconds(t)


def _columns(x: Explanation, by_bytes: bool) -> list:
    """(title, width, cell(Alternative)) of the table's columns."""
    rows = (x.chosen,) + tuple(x.alternatives)
    cols = [("split", max(len(a.splits) for a in rows), lambda a: a.splits)]
    if x.plan_total_s is not None:
        cols += [("kernel", 9, lambda a: _ms(a.compute_s)),
                 ("exchanges", 9, lambda a: _ms(a.exchange_s)),
                 ("consumers", 10, lambda a: "-" if a.chosen else sign(a.consumers_s))]
    cols.append(("memory", 9, lambda a: format_bytes(a.memory_bytes)))
    if x.plan_total_s is not None:
        cols.append(("plan", 9, lambda a: _ms(a.total_s)))
    if by_bytes:
        cols.append(("proxy", 9, lambda a: format_bytes(a.proxy_bytes)))
    return cols


def _row(a: Alternative, cols, mark: str = " ") -> str:
    first, *rest = cols
    cells = [f"{first[2](a):<{first[1]}}"] + [f"{c(a):>{w}}" for _, w, c in rest]
    return f"  {mark} " + "  ".join(cells)


def render(x: Explanation) -> str:
    by_bytes = x.minimized == "bytes" or x.plan_total_s is None
    where = f" at {x.source}" if x.source else ""
    lines = [f"eqn {x.eqn} ({x.op}){where}: {x.line}"]
    c = x.chosen
    how = "forced by plan=" if x.forced else f"chosen by {x.selector}"
    share = (f"{format_seconds(c.seconds)} of the plan's {format_seconds(x.plan_total_s)}"
             if c.seconds is not None else f"proxy {format_bytes(x.plan_bytes)}")
    lines.append(f"  {how}: split {c.splits} ({c.pieces} of {x.devices} devices busy), "
                 f"{share}")
    what = "proxy bytes" if by_bytes else "predicted time"
    if x.alternatives:
        lines.append(f"  next best of {x.candidates} specs, by the plan's {what} had this eqn "
                     f"taken it")
    else:
        lines.append(f"  no other spec ({x.candidates} costed)")
    cols = _columns(x, by_bytes)
    first, *rest = cols
    lines.append("    " + "  ".join([f"{first[0]:<{first[1]}}"] +
                                    [f"{t:>{w}}" for t, w, _ in rest]))
    lines.append(_row(c, cols, ">") + "  (chosen)")
    tag = "not taken, plan= forces this eqn: " if x.forced else ""
    for a in x.alternatives:
        lines.append(_row(a, cols))
        lines.append(f"        {tag}{a.reason}")
    if x.dp_choice is not None:
        if x.dp_total_s is not None and x.plan_total_s is not None:
            d = x.plan_total_s - x.dp_total_s
            cmp = (f"slower than dp's plan by {format_seconds(d)} "
                   f"({100 * d / x.dp_total_s:.1f} %)" if d > 0 else
                   "as fast as dp's plan" if d == 0 else
                   f"faster than dp's plan by {format_seconds(-d)}")
            lines.append(f"  this plan ({x.selector}) takes {format_seconds(x.plan_total_s)}: "
                         f"{cmp}, which takes {format_seconds(x.dp_total_s)}")
        else:
            lines.append(f"  this plan ({x.selector}): proxy {format_bytes(x.plan_bytes)}, "
                         f"dp's {format_bytes(x.dp_bytes)}")
        lines.append(f"  dp chose split {x.dp_choice.splits} for this eqn")
    return "\n".join(lines)
