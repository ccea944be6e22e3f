"""Exact cover (paper Definition 5.5's enabling condition): the aggregates present at a site
that partition an aggregate ``X``, i.e. ``X = Y1 ∪ ... ∪ Ym`` with the ``Yi`` pairwise
disjoint. One implementation for the closure (does a cover exist?), the simulator and the
lowering (which cover is read: the one reading the fewest bytes, so the executed
aggregation is the simulated one)."""
from __future__ import annotations

from eins.ir.exprog.syntax import agg_text

__all__ = ["exact_cover", "has_cover", "COVER_NODES"]

# With a cost: search nodes before settling for the cheapest cover found so far (covers of
# real exchanges have a handful of pieces; this bounds hand-written pathological ones).
COVER_NODES = 5000


def exact_cover(x, present, cost=None) -> list | None:
    """Aggregates of ``present`` (frozensets) that partition ``x``, or None if none do.

    Without ``cost`` the first cover found (big pieces first); with ``cost`` (aggregate ->
    bytes read) the cheapest, searched by branch and bound within :data:`COVER_NODES` nodes
    once one is found. Branches on the uncovered atom with the fewest candidate pieces
    (Knuth's heuristic, static order)."""
    x = frozenset(x)
    if x in present:
        return [x]
    cands = [y for y in present if y <= x]
    if not cands or frozenset().union(*cands) != x:
        return None
    if all(len(y) == 1 for y in cands):
        return sorted(cands, key=agg_text)  # the common case: single atoms, the only cover
    cands.sort(key=lambda y: (-len(y), agg_text(y)))  # big pieces first: few reads
    by_atom: dict = {}
    for y in cands:
        for a in y:
            by_atom.setdefault(a, []).append(y)
    order = sorted(x, key=lambda a: (len(by_atom[a]), a))
    price = {y: cost(y) for y in cands} if cost is not None else None
    best, best_cost, nodes = None, float("inf"), 0
    failed: set = set()  # remainders without a cover (memo for the existence search)

    def go(covered, chosen, spent):
        nonlocal best, best_cost, nodes
        nodes += 1
        if spent >= best_cost or (best is not None and nodes > COVER_NODES):
            return
        if len(covered) == len(x):
            best, best_cost = list(chosen), spent
            return
        if covered in failed:
            return
        first = next(a for a in order if a not in covered)
        for y in by_atom[first]:
            if not (y & covered):
                chosen.append(y)
                go(covered | y, chosen, spent + (price[y] if price else 0))
                chosen.pop()
        if best is None:
            failed.add(covered)

    go(frozenset(), [], 0)
    return best


def has_cover(x, present) -> bool:
    """Whether aggregates of ``present`` partition ``x`` (``exact_cover(x, present) is not
    None``), for the closure, which needs no particular cover: when every atom of ``x`` is
    present alone, the atoms are one, found without ordering the candidates. (A chain of
    nested partial aggregates, ``A0+A1 @ 0``, ``A0+A1+A2 @ 0``, ..., made the ordering cubic:
    600 actions took 25 s to check.)"""
    x = frozenset(x)
    if x in present or all(frozenset((a,)) in present for a in x):
        return True
    return exact_cover(x, present) is not None
