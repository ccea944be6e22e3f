"""Compiler passes, one per file, each exporting the one function it is named after.

``PIPELINE`` is the ordered tuple of passes; each takes and returns an
:class:`eins.ir.plan.Compilation`. Logical optimization (Section 4): ``enumerate_specs``,
``cut_trees``, ``choose_specs`` produce the planned IR (``Compilation.plan``). The physical
passes (place, overlay, synthesize, lower, verify; Section 5) follow them.
"""
from __future__ import annotations

import contextlib
import gc

from eins.ir.memo import call_scope
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
    with collection_paused(promote=True):
        for p in passes:
            with step(getattr(p, "__name__", "pass")):
                state = p(state)
    return state


# survivors of a pause that many or more are moved to the oldest generation unscanned
PROMOTE_AT = 200_000
_promoted = [0]   # objects so moved since the last full collection this module ran


@contextlib.contextmanager
def collection_paused(promote=False):
    """No cyclic garbage collection while the passes run. They allocate millions of
    objects that form no cycles (a 32-block program's instructions, buffers and boxes),
    which reference counting frees, and every collection of the oldest generation walks
    all of them again: on 32 blocks on dgx-h100:8x8 that was 3 of the lower pass's 4.7 CPU
    s. The collector runs again after (and as before where it was off).

    ``promote``: where the pause left ``PROMOTE_AT`` or more new objects (a big program's),
    they move to the oldest generation without a scan (``gc.freeze``, ``gc.unfreeze``);
    the first young collection after the pause would otherwise walk them all (0.4 CPU s of
    the 32-block 8x8 row) only to find them alive, and the middle one again. Cyclic garbage
    among them waits for a full collection, which this runs itself once the objects so
    moved since its last one outnumber all the objects alive, so that a loop of big
    compilations cannot pile it up. Not where objects were frozen before (unfreezing would
    thaw them too)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if promote and was:
            _promote()
        if was:
            gc.enable()


@contextlib.contextmanager
def per_call():
    """What a compiled program does on each call beyond running it (its family choice, its
    re-cut's relowering: eins/rebalanced.py, eins/passes/families.py) runs so: without
    cyclic collection (:func:`collection_paused`: what it allocates is acyclic, freed by
    reference counting as the call ends (tests/test_memo.py), and no collection scans it or
    promotes it to an older generation meanwhile), its memo entries (a call's cut's boxes,
    overlays and simulations: eins.ir.memo) kept for the call alone."""
    with collection_paused(), call_scope():
        yield


def _promote() -> None:
    young = gc.get_count()[0]
    if young < PROMOTE_AT or gc.get_freeze_count():
        return
    gc.freeze()
    alive = gc.get_freeze_count()
    gc.unfreeze()
    _promoted[0] += young
    if _promoted[0] > alive:
        _promoted[0] = 0
        gc.collect()
