"""The synthesize pass (paper Sections 5.1, 5.4): every exchange of the plan gets its body."""
from __future__ import annotations

from dataclasses import replace

from eins.hardware.net import resolve_topology
from eins.ir.plan import schedule_name
from eins.passes.synthesize.preamble import in_order_membership, naive_program
from eins.passes.synthesize.program import synthesize_program

__all__ = ["synthesize", "schedule_exchanges"]


def synthesize(state):
    """The synthesize pass (Sections 5.1, 5.4): every exchange of ``state.exchange`` gets its
    body, and ``state.placement`` its final value.

    ``schedule="naive"`` keeps the identity placement and gives each exchange the naive body.
    ``"optimized"`` (the paper's ``"ai"``) walks the eqns in program order, so every
    producer's placement is final when its consumers are reached: the largest input exchange
    of an eqn declares its partitions by size and its synthesized membership places the eqn's
    function specifications; the eqn's other inputs are then synthesized for that placement.
    """
    o = state.options
    topology = resolve_topology(o.topology, state.devices)
    xir = schedule_exchanges(state.plan, state.placement, topology, o.schedule,
                             o.synthesis_budget_s, o.seed, o.synthesis_steps)
    return replace(state, exchange=xir, placement=xir.placement)


def schedule_exchanges(plan, placement, topology, schedule="naive", budget_s=0.5, seed=0,
                       steps=None):
    """The exchange IR of ``plan`` with every body synthesized (see :func:`synthesize`);
    ``steps`` bounds each synthesis by simulated candidates instead of ``budget_s``."""
    from eins.hardware.simulate import simulate
    from eins.ir.exchange import ExchangeIR
    from eins.passes.overlay import eqn_exchanges, output_exchanges

    schedule = schedule_name(schedule)
    placement = dict(placement)
    names = plan.program.var_names()
    producers = plan.program.producers()
    exchanges = []

    def body(x):
        fixed = {p.name: p.members for p in x.preamble.partitions if p.members is not None}
        if schedule == "naive":
            x.program = naive_program(x.preamble, fixed)
            x.membership = {**in_order_membership(x.preamble), **fixed}
            x.predicted_s = x.naive_s = simulate(x.program, topology, x.membership).total_s
        else:
            r = synthesize_program(x.preamble, topology, budget_s=budget_s, seed=seed,
                                   steps=steps)
            x.program, x.membership = r.program, dict(r.membership)
            x.predicted_s, x.naive_s = r.total_s, r.naive_s
        return x

    for i in range(len(plan.program.eqns)):
        if schedule == "optimized":
            free = eqn_exchanges(plan, placement, names, producers, i, fixed=None)
            if free:
                lead = body(max(free, key=lambda x: sum(a.size for a in x.preamble.inputs)))
                placement[i] = tuple(lead.membership[p][0] for p, _ in lead.needs)
                for x in eqn_exchanges(plan, placement, names, producers, i, placement[i]):
                    exchanges.append(lead if x.input == lead.input else body(x))
                continue
        exchanges += [body(x) for x in
                      eqn_exchanges(plan, placement, names, producers, i, placement[i])]
    exchanges += [body(x) for x in output_exchanges(plan, placement, names, producers)]
    return ExchangeIR(plan, placement, exchanges, schedule, topology)
