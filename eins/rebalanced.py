"""What a compiled program with a per-call rebalance runs (issue 36): its plan families and,
for each, the device programs a call's cut needs (docs/stages.md, "Packed batches").

A :class:`FamilyRun` is one plan family (a planned Compilation whose runtime-parameter eqns
are re-cut per call: eins/passes/rebalance.py) with its programs:

- on the GPU backends, where every re-cut eqn has a capacity form, ONE capacity program
  (eins/passes/capacity.py): each call passes the tables of its cut as extra inputs, so no
  cut generates code or captures a graph;
- otherwise (numpy; a GPU family without a capacity form) a device program per distinct
  cut, lowered incrementally from the family's first lowering (eins/passes/relower.py;
  under the optimized schedule lowered whole, relower.lower_whole) and kept for the last
  ``RECUT_CACHE`` cuts. numpy keeps this path: it has no graph to keep
  valid, and a per-cut program moves the cut's blocks without the capacity program's
  masked copies (eins/passes/windows.py), its transfer counts (``stats()``) the plan's.

A Compiled with ``families=True`` keeps one FamilyRun per family of its family set
(eins/passes/families.py: the DP's plan, attention split by query sequence at equal
cuts, and on numpy that family re-cut at whole-block cuts), all planned and first lowered
at compile time; each call runs the one its estimate picks.

A :class:`RankRun` is the same per-cut path for one rank of ``devices="world"``
(eins/world.py): every rank re-cuts alike (the cut is a function of the plan and the call's
ends, which every rank passes) and re-lowers its own instructions only.
"""
from __future__ import annotations

import hashlib

import numpy as np

from eins.passes import PHYSICAL, per_call, run_passes
from eins.passes.lower import lower_exchanges
from eins.passes.rebalance import recut, recut_key
from eins.passes.relower import Family, incremental, lower_whole, relower, relower_device
from eins.passes.windows import windows

__all__ = ["FamilyRun", "RankRun"]


class FamilyRun:
    """One plan family ``comp`` of a compiled program, re-cut per call for ``operands``
    (eins.passes.rebalance.runtime_operands). ``executable(dprog)`` makes a GPU backend's
    executable of a device program (None on numpy); ``counts`` is the Compiled's counters
    (``lowerings`` and ``rebalances`` are added to); ``form`` its capacity form
    (eins.passes.capacity.capacity), run instead of a program per cut. ``physical``: the
    family's own lowering where one is built already (the Lowered's); ``first``: its first
    lowering (eins.passes.relower.Family) where one is built already; ``balance``: False
    keeps the family's cut positions per call (eins.passes.rebalance.recut); ``rank``: lower
    only that rank's instructions (:class:`RankRun`); ``block``: the whole-block re-cut of
    the block family (eins.passes.blockcut.BlockCut), applied after ``recut``, whose eqns
    are then the ones a call re-cuts."""

    RECUT_CACHE = 16   # per-cut device programs kept (a batch with a cut seen before)

    def __init__(self, comp, operands, executable, counts, form=None, physical=None,
                 first=None, balance=True, rank=None, block=None):
        self.comp, self.operands, self.counts = comp, operands, counts
        self.block = block
        self.eqns = block.eqns if block is not None else sorted(operands)
        self.rank = rank
        self.balance = balance
        self.executable = executable
        self.capacity = form   # eins.passes.capacity.Capacity, or None: a program per cut
        self.recuts: dict = {}   # recut_key -> device program (numpy) or executable
        self.evicted_captures = 0   # graphs captured by executables no longer kept
        self.family = first      # eins.passes.relower.Family, at the first re-cut
        self.gpu = None
        self.device_program = physical
        if self.capacity is not None:
            # its sends windowed: each call moves only its cut's rows (runtime byte counts)
            self.device_program = windows(run_passes(self.capacity.comp, PHYSICAL).device,
                                          self.capacity)
            counts["lowerings"] += 1
        self.placed = None   # the arrays place() made resident, for each per-cut executable
        # the one executable of every call: a per-cut family never runs its compile-time cuts
        if executable is not None and self.capacity is not None:
            self.gpu = executable(self.device_program)

    def extra_inputs(self) -> list:
        """Placeholders for the capacity program's per-call tables (zeros)."""
        return self.capacity.placeholders() if self.capacity is not None else []

    def place(self, arrays) -> dict:
        """Make ``arrays`` (a call's program inputs) resident in what runs this family's
        calls (eins.runtime.gpu_exec.GpuExecutable.place): its capacity executable; or the
        executable of their own cut (lowered if new), every other one kept, and each one
        built later (a per-cut program loads its own boxes of them). Returns the byte counts
        of the placement into their own cut's."""
        if self.capacity is not None:
            return self.gpu.place(list(arrays) + self.extra_inputs())
        _, own = self.program(arrays, count=False)
        self.placed = list(arrays)
        got = {}
        for exe in self.recuts.values():
            placed = exe.place(self.placed)
            got = placed if exe is own else got
        return got

    def program(self, arrays, cut=None, count=True):
        """(arrays, what runs them) for one call: the capacity executable with the call's
        tables appended, or the call's per-cut device program (numpy) or executable.
        ``cut``: the family re-cut for this call where the caller has it already; not
        ``count``: no call (place()), so no rebalance counted. Per call
        (eins.passes.per_call)."""
        with per_call():
            return self._program(arrays, cut, count)

    def _program(self, arrays, cut, count):
        self.counts["rebalances"] += count
        if cut is None:
            cut = recut(self.comp, arrays, self.operands, self.balance)
            cut = cut if self.block is None else self.block(cut)
        if self.capacity is not None:
            return list(arrays) + self.capacity.tables(cut), self.gpu
        key = recut_key(cut, self.eqns, self.operands)
        hit = self.recuts.pop(key, None)
        if hit is None:
            self.counts["lowerings"] += 1
            # the family's lowering, recorded eqn by eqn; the optimized schedule lowers
            # every cut whole, so it has none
            if self.family is None and incremental(self.comp):
                self.family = Family(self.comp, self.rank)
                if self.device_program is None:   # a family of its own: its first lowering
                    self.counts["lowerings"] += 1
            if self.family is not None:   # a rank's through the exchange IR its digest reads
                dprog = relower_device(self.family, cut, self.eqns) if self.rank is None \
                    else relower(self.family, cut, self.eqns, priced=False).device
            elif self.rank is not None:   # the optimized schedule: this rank's, from scratch
                dprog = lower_exchanges(run_passes(cut, PHYSICAL[:3]).exchange, self.rank,
                                        cut.options.pipeline)
            else:
                dprog = lower_whole(cut).device
            hit = dprog if self.executable is None else self.executable(dprog)
            if self.placed is not None:   # the weights place() made resident, in it too
                hit.place(self.placed)
            while len(self.recuts) >= self.RECUT_CACHE:
                gone = self.recuts.pop(next(iter(self.recuts)))
                if self.executable is not None:   # its graphs still count as recorded
                    self.evicted_captures += gone.captures()
        self.recuts[key] = hit   # most recent last
        return arrays, hit

    def captures(self) -> int:
        """Graphs captured by this family's executables, those evicted since included."""
        if self.executable is None:
            return 0
        return (self.gpu.captures() if self.gpu is not None else 0) + self.evicted_captures \
            + sum(g.captures() for g in self.recuts.values())


class RankRun(FamilyRun):
    """One rank's per-call rebalance under ``devices="world"``: the planned Compilation
    ``comp`` re-cut for each call's ``operands`` (eins.passes.rebalance.runtime_operands)
    and this ``rank``'s instructions of its device program for that cut, re-lowered
    incrementally from the family's first lowering of this rank (eins/passes/relower.py)
    and kept for the last ``RECUT_CACHE`` cuts. A per-cut program rather than the GPU
    backends' capacity program: a rank runs its instructions eagerly (no graph to keep
    valid), and a per-cut program moves the cut's blocks without capacity-sized buffers or
    masked copies. ``counts``: ``rebalances`` and ``lowerings`` are added to."""

    def __init__(self, comp, operands, rank, counts):
        super().__init__(comp, operands, None, counts, rank=rank)

    def program(self, arrays):
        """This rank's device program for the call's cut (``arrays``: its program inputs)."""
        return super().program(arrays)[1]

    def digest(self, arrays) -> str:
        """What the call's program depends on beyond the plan: its runtime operands' values
        (ranks passed different ends would run different cuts and wait on each other)."""
        h = hashlib.sha256()
        for _, k in sorted(self.operands.values()):
            a = np.ascontiguousarray(arrays[k])   # a rank's arrays are on the host
            h.update(repr((k, a.shape, a.dtype.str)).encode())
            h.update(a.reshape(-1).view(np.uint8).data)
        return h.hexdigest()[:16]
