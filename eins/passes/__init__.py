"""Compiler passes, one per file, each exporting the one function it is named after.

``PIPELINE`` is the ordered tuple of passes; each takes and returns an
:class:`eins.ir.plan.Compilation`. Logical optimization (Section 4): ``enumerate_specs``,
``cut_trees``, ``choose_specs`` produce the planned IR (``Compilation.plan``). The physical
passes (place, overlay, synthesize, lower, verify; Section 5) follow them.
"""
from __future__ import annotations

from eins.passes.enumerate_specs import enumerate_specs
from eins.passes.cut_trees import cut_trees
from eins.passes.choose_specs import choose_specs
from eins.passes.place import place
from eins.passes.overlay import overlay
from eins.passes.synthesize import synthesize
from eins.passes.lower import lower
from eins.passes.verify import verify
from eins.progress import step

PLANNING = (enumerate_specs, cut_trees, choose_specs)

# the first three build the exchange programs, the last two the device IR from them
PHYSICAL = (place, overlay, synthesize, lower, verify)

PIPELINE = PLANNING + PHYSICAL


def run_passes(state, passes=PIPELINE):
    """Apply ``passes`` in order to a Compilation (each a logged step: eins.progress).

    >>> import eins
    >>> from eins.ir.plan import Compilation
    >>> prog = eins.make_ir(lambda x: x * 2)(eins.ShapeDtype((4,), "float32"))
    >>> state = run_passes(Compilation(prog, (0, 1)))
    >>> state.device.devices   # every stage filled, down to the device IR
    (0, 1)
    """
    for p in passes:
        with step(getattr(p, "__name__", "pass")):
            state = p(state)
    return state
