"""place: assign each function specification of each eqn to a device (Section 5.1).

The naive placement is the identity: function specification f of every eqn runs on
``devices[f]``. Under ``schedule="optimized"`` this is only the starting point: the synthesize
pass lets each exchange program choose its consumer's placement (partitions declared by size,
as the paper does) and records the choice here.
"""
from __future__ import annotations

from dataclasses import replace


def place(state):
    """The placement pass: ``state.placement`` = the naive (identity) placement.

    >>> import eins
    >>> from eins.ir.plan import Compilation, Options
    >>> prog = eins.make_ir(lambda x, w: (x @ w).sum(axis=0))(
    ...     eins.ShapeDtype((16, 4), "float32"), eins.ShapeDtype((4, 4), "float32"))
    >>> state = Compilation(prog, (0, 1), Options(cost="proxy"))
    >>> from eins.passes import PLANNING, run_passes
    >>> place(run_passes(state, PLANNING)).placement   # function spec f on device f
    {0: (0, 1), 1: (0, 1)}
    """
    return replace(state, placement=naive_placement(state.plan))


def naive_placement(plan) -> dict:
    """-> {eqn index: tuple of devices, one per function specification}."""
    devs = tuple(plan.devices)
    out = {}
    for i, ep in enumerate(plan.eqn_plans):
        n = len(ep.spec.fspecs)
        out[i] = tuple(devs[f % len(devs)] for f in range(n))
    return out
