"""What stays live across each eqn of a planned program, per device: the planner's view of
the device program's liveness (eins/passes/lower.py frees a buffer after its last use).

A value an eqn produces is held, on each device, as that eqn's output blocks there (the
naive placement: function specification f on device f mod p; a partial of a ⊕ at its
partial's element size) from the eqn to its last reader; a program input or constant as the
blocks its readers load, each distinct block from its first reader to its last. It is an
estimate of the device program's peak (``predicted_time()["peak_bytes"]``): it leaves out
the partials an aggregation inside the program receives from other devices and an
optimized schedule's other placements, and counts an exchange's pieces at their largest;
:func:`end_bytes` is the end of the program, where the results are gathered (a weight
gradient's partial copies summed on one device). Under a
gradient (eins.autodiff) this is what the backward keeps from the forward: the saved
activations, live from their forward eqn to their backward use. :func:`resident_bytes` is
the bytes live strictly across each eqn (not read nor written by it), which the per-eqn
working set (:func:`eins.cost.timecost.working_set`) does not count, and
:func:`exchange_bytes` what an exchange into the eqn holds besides (the received and sliced
pieces of an input block while they are concatenated into it); the DP's memory cap
(eins/passes/choose_specs.py) adds the three.
"""
from __future__ import annotations

import numpy as np

from eins.ir.joinagg import atom_itemsize
from eins.ir.program import Literal

__all__ = ["held_bytes", "live_intervals", "resident_bytes", "exchange_bytes", "end_bytes"]


def held_bytes(eqn, spec, j: int, ndev: int) -> np.ndarray:
    """Per device, the bytes of output ``j``'s blocks ``spec`` leaves there."""
    per = np.zeros(ndev, dtype=np.int64)
    isz = atom_itemsize(spec, j, eqn.outputs[j].dtype)
    for f, fs in enumerate(spec.fspecs):
        per[f % ndev] += fs.outputs[j].size * isz
    return per


def live_intervals(program, specs, ndev: int) -> list:
    """[(producer eqn or None, first, last, per-device bytes, readers)]: one entry per value
    an eqn produces, per distinct block of a program input or constant a device loads, and
    per distinct block of a value a device receives in other blocks than its producer left
    there (an exchange's delivery, kept for the later eqns it serves); live over the eqns
    strictly between ``first`` and ``last`` (a program output to the end). ``readers``: the
    eqns in between that read it (their working sets count it)."""
    n = len(program.eqns)
    outputs = {id(v) for v in program.outputs}
    producers = program.producers()
    reads: dict = {}   # id(value) -> the eqns reading it, in order
    blocks: dict = {}  # (id(value), device, box) -> [bytes, readers, producer or None]
    for i, e in enumerate(program.eqns):
        for k, a in enumerate(e.inputs):
            if isinstance(a, Literal):
                continue
            r = reads.setdefault(id(a), [])
            if not r or r[-1] != i:
                r.append(i)
            isz = a.dtype.itemsize
            where = producers.get(id(a))
            for f, fs in enumerate(specs[i].fspecs):
                box = fs.inputs[k]
                hit = blocks.setdefault((id(a), f % ndev, box), [box.size * isz, [], where])
                if not hit[1] or hit[1][-1] != i:
                    hit[1].append(i)
    out = []
    held: dict = {}   # (id(value), device) -> the blocks its producer left there, as they are
    for i, e in enumerate(program.eqns):
        for j, v in enumerate(e.outputs):
            r = reads.get(id(v), [])
            last = n if id(v) in outputs else (r[-1] if r else i)
            if last > i + 1:
                out.append((i, i, last, held_bytes(e, specs[i], j, ndev),
                            [c for c in r if c < last]))
            if specs[i].aggs[j] is None:
                for f, fs in enumerate(specs[i].fspecs):
                    held.setdefault((id(v), f % ndev), set()).add(fs.outputs[j])
    for (x, d, box), (b, r, where) in blocks.items():
        if r[-1] <= r[0] + 1 or (where is not None and box in held.get((x, d), ())):
            continue   # read by one eqn only, or read where its producer left it
        per = np.zeros(ndev, dtype=np.int64)
        per[d] = b
        out.append((None, r[0], r[-1], per, r[1:-1]))
    return out


def resident_bytes(program, specs, ndev: int, intervals=None) -> np.ndarray:
    """Per eqn, the most bytes one device holds live across it and not read by it (its
    working set has those): :func:`live_intervals`."""
    n = len(program.eqns)
    diff = np.zeros((n + 1, ndev), dtype=np.int64)
    for _, first, last, per, readers in (intervals if intervals is not None
                                         else live_intervals(program, specs, ndev)):
        diff[first + 1] += per
        diff[last] -= per
        for r in readers:
            diff[r] -= per
            diff[r + 1] += per
    return np.cumsum(diff, axis=0)[:n].max(axis=1) if n else np.zeros(0, np.int64)


def exchange_bytes(program, specs, ndev: int) -> np.ndarray:
    """Per eqn, the most bytes one device holds in the pieces of one input block being
    recomposed (the block's own size) over the inputs its producer does not deliver as they
    are: a different block, or a partial of a ⊕."""
    producers = program.producers()
    out = np.zeros(len(program.eqns), dtype=np.int64)
    for i, e in enumerate(program.eqns):
        best = 0
        for k, a in enumerate(e.inputs):
            where = None if isinstance(a, Literal) else producers.get(id(a))
            if where is None:
                continue
            p, j = where
            sp = specs[p]
            have = [set() for _ in range(ndev)]
            if sp.aggs[j] is None:
                for f, fs in enumerate(sp.fspecs):
                    have[f % ndev].add(fs.outputs[j])
            per = np.zeros(ndev, dtype=np.int64)
            for f, fs in enumerate(specs[i].fspecs):
                box = fs.inputs[k]
                if box not in have[f % ndev]:
                    per[f % ndev] += box.size * a.dtype.itemsize
            best = max(best, int(per.max()))
        out[i] = best
    return out


def end_bytes(program, specs, ndev: int) -> int:
    """The most bytes one device holds at the end, while the results are gathered: every
    result's blocks, and on the device first holding each block of a result that is a
    partial of a ⊕, the other devices' copies it receives to add up."""
    producers = program.producers()
    per = np.zeros(ndev, dtype=np.int64)
    for v in {id(v): v for v in program.outputs}.values():
        where = producers.get(id(v))
        if where is None:
            continue
        i, j = where
        e, sp = program.eqns[i], specs[i]
        per += held_bytes(e, sp, j, ndev)
        if sp.aggs[j] is None:
            continue
        isz = atom_itemsize(sp, j, v.dtype)
        owner: dict = {}
        for f, fs in enumerate(sp.fspecs):
            owner.setdefault(fs.outputs[j], f % ndev)
        for box, m in sp.multiplicity(j).items():
            per[owner[box]] += (m - 1) * box.size * isz
    return int(per.max()) if ndev else 0
