"""Pricing what runs (issue 38 item 2): under ``schedule="optimized"`` the DP's analytic
relay cost (:mod:`eins.cost.timecost`) errs by a few percent either way against the bodies
the synthesizer writes, so the DP could pick a plan whose synthesized exchanges are slower
than another plan's. :func:`priced_choice` prices the exchanges of the plans the DP picks
by synthesizing them (:func:`~eins.passes.synthesize.synthesize_program` on the preamble
the overlay pass will build for them, at the naive placement), and runs the DP again with
those prices, until the plan it picks is priced entirely by synthesized bodies or
``Tuning.priced_rounds`` rounds are spent; the plan with the least synthesized total is
kept. The synthesized bodies stay in the synthesizer's cache, so the lowering of the plan
kept finds most of its exchanges already synthesized.

An exchange the DP has not seen in a picked plan keeps its analytic price: a plan whose
exchanges synthesize faster than the analytic cost says can still be missed (the rounds
correct the prices of the plans picked, not of all plans).
"""
from __future__ import annotations

from eins.cost.timecost import TimeModel, plan_deliveries, plan_seconds
from eins.errors import ExProgError
from eins.ir.program import Program
from eins.passes.overlay import exchange_preamble
from eins.passes.synthesize import synthesize_program

__all__ = ["Synthesized", "plan_exchanges", "priced_choice"]


class Synthesized:
    """A :class:`~eins.cost.timecost.TimeModel` whose exchange prices are the synthesized
    bodies' simulated times where :meth:`price` has synthesized them, its own elsewhere
    (every other method is the model's)."""

    def __init__(self, model: TimeModel, topo, opts):
        self.model, self.topo, self.opts = model, topo, opts
        self.exact: dict = {}   # (copies id, needs id) -> synthesized seconds

    def __getattr__(self, name):
        return getattr(self.model, name)

    def xseconds(self, copies_id: int, needs_id: int) -> float:
        t = self.exact.get((copies_id, needs_id))
        return self.model.xseconds(copies_id, needs_id) if t is None else t

    def price(self, copies_id: int, needs_id: int) -> bool:
        """Synthesize the exchange of ``copies_id`` into ``needs_id`` once; whether it was
        new."""
        key = (copies_id, needs_id)
        if key in self.exact:
            return False
        if self.model.xseconds(copies_id, needs_id) == 0:
            self.exact[key] = 0.0   # every block where it is needed, nothing pending
            return True
        copies, isz = self.model.boxes(copies_id)
        needs, _ = self.model.boxes(needs_id)
        pre = exchange_preamble(self.model.devices, copies, needs, isz)
        o = self.opts
        try:
            r = synthesize_program(pre, self.topo, o.synthesis_budget_s, o.seed,
                                   steps=o.synthesis_steps, tuning=o.tuning)
        except ExProgError:   # not a preamble the synthesizer takes: the analytic price
            self.exact[key] = self.model.xseconds(copies_id, needs_id)
            return True
        self.exact[key] = r.total_s
        return True


def plan_exchanges(program: Program, specs, model) -> list:
    """The (copies id, needs id) of every exchange :func:`plan_seconds` charges the plan
    ``specs`` (a tensor once per distinct blocks its readers want)."""
    return [(copies, needs) for _, copies, needs in plan_deliveries(program, specs, model)]


def priced_choice(program: Program, choose, candidates, choice, priced: Synthesized,
                  rounds: int):
    """(candidates, choice) of the least synthesized total among the plan ``choice`` and
    those ``choose(priced)`` (the DP under the prices so far: (candidates, choice)) picks
    in up to ``rounds`` rounds, each round pricing the exchanges of its plan."""
    def total(cands, ch):
        specs = [cands[i][c].spec for i, c in enumerate(ch)]
        for c, n in plan_exchanges(program, specs, priced):
            priced.price(c, n)
        return sum(plan_seconds(program, specs, priced.devices, priced.topo, priced))

    best = (total(candidates, choice), candidates, choice)
    for _ in range(rounds):
        before = len(priced.exact)
        cands, ch = choose(priced)
        t = total(cands, ch)
        if t < best[0] * (1 - 1e-9):
            best = (t, cands, ch)
        if len(priced.exact) == before:   # the DP's plan was priced entirely already
            break
    return best[1], best[2]
