"""Whole-block cuts (issue 36): the equal family (every re-cut eqn split p ways along its
balanced index, the DP cutting the token-wise eqns around it at the same places) with all
those token-wise eqns re-cut per batch at the positions that balance each device's whole
block, its tokens' share of the token-proportional kernels plus its rows' causal attention
work, rather than the attention alone.

Which (eqn, index) pairs follow the cuts (:func:`token_pairs`): those the plan cuts exactly
where the re-cut eqns' balanced index is (the same intervals), that may be cut anywhere
(``Indexing.shardable`` "any"), and whose index runs along the same token dimension (an
axis of a value the balanced index's axes reach through the program: an index joins the
axes of its eqn's operands it cuts). Equal intervals alone would also take an index that
only happens to have the same extent and cuts (a hidden size equal to the token count);
re-cutting it would still compute the same values (every plan's boxes are derived from its
intervals), but its work does not follow the tokens. Where the re-cut eqns are cut apart
(a gradient program whose forward and backward attention are split at different places)
there is no one token cut and no block family.

The cut positions (:class:`BlockCut`): the token-wise kernels' seconds per token and the
re-cut eqns' seconds per unit of their balanced work (``Indexing.work``: attention's
visible (query, key) pairs), both from the family's first lowering (at its equal cuts,
each device a segment of its own: ``families.reference``), then per batch the p pieces of
equal ``per_token * x + sum(per_unit * work(x))`` (a binary search on that prefix, as the
operator's own balance). The kernel model is close to linear in the rows at these sizes;
pricing each candidate cut exactly would cost a kernel estimate per eqn per probe.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from eins.cost.predict import predict
from eins.cost.rows import RowKernels
from eins.passes import per_call
from eins.ir.program import Var, eqn_indexing
from eins.ops.attention_blocks import work_cuts

__all__ = ["split_index", "cut_positions", "token_pairs", "alike", "twins", "recut_pairs",
           "BlockCut"]


def split_index(comp, i):
    """The balanced index eqn ``i`` of ``comp`` is split along (its first, as
    ``families._forced`` splits it), or None."""
    ix = eqn_indexing(comp.program.eqns[i])
    splits = comp.plan.eqn_plans[i].splits
    return next((n for n in ix.balance if splits.get(n, 1) > 1), None)


def _cut_axes(e, ix, name) -> list:
    """The (value, axis) pairs of eqn ``e``'s operands that index ``name`` cuts: those
    whose blocks differ when ``name`` alone is halved."""
    return [(id((e.outputs if io else e.inputs)[pos]), k)
            for io, pos, k in cut_positions(e, ix, name)]


def cut_positions(e, ix, name) -> list:
    """[(True for an output, operand position, axis)] of eqn ``e``'s variables' block axes
    that index ``name`` (of its indexing ``ix``) cuts (:func:`_cut_axes`)."""
    half = ix.extents[name] // 2
    if half < 1:
        return []
    f, g = ix.spec({name: ((0, half), (half, ix.extents[name]))}).fspecs[:2]
    got = []
    for io, vals, a, b in ((False, e.inputs, f.inputs, g.inputs),
                           (True, e.outputs, f.outputs, g.outputs)):
        for pos, (v, x, y) in enumerate(zip(vals, a, b)):
            if isinstance(v, Var):
                got += [(io, pos, k) for k in range(len(x.lo))
                        if (x.lo[k], x.hi[k]) != (y.lo[k], y.hi[k])]
    return got


def token_pairs(comp, eqns):
    """[(eqn, index)] of ``comp``'s plan that follow the token cuts of re-cut ``eqns``
    (module docstring), those eqns' own balanced indices first; None where one of ``eqns``
    splits no balanced index or they are cut apart."""
    names = {i: split_index(comp, i) for i in eqns}
    if any(n is None for n in names.values()):
        return None
    plans = comp.plan.eqn_plans
    want = {tuple(plans[i].intervals[n]) for i, n in names.items()}
    if len(want) != 1:
        return None
    (want,) = want
    parent: dict = {}

    def find(x):
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    candidates = []
    for j, (e, ep) in enumerate(zip(comp.program.eqns, plans)):
        ix = eqn_indexing(e)
        for n, iv in ep.intervals.items():
            if len(iv) < 2:
                continue
            axes = _cut_axes(e, ix, n)
            for x in axes[1:]:
                parent[find(x)] = find(axes[0])
            if tuple(iv) == want and ix.shardable.get(n) == "any" and axes:
                candidates.append((j, n, axes[0]))
    token = {find(a) for j, n, a in candidates if names.get(j) == n}
    pairs = [(j, n) for j, n, a in candidates if find(a) in token]
    own = [(i, n) for i, n in names.items()]
    return own + [p for p in pairs if p not in own]


_PLAIN = (int, float, str, bool, type(None))


def _plain(v) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(map(_plain, v)))


def alike(a, b) -> bool:
    """Whether eqns ``a`` and ``b`` compute alike: the same primitive on operands of the
    same types (literals of the same values), with equal params of plain values (numbers,
    strings, tuples of them), so that equal boxes give them equal specs and equal kernel
    times (the query and output projections of a block; its two norms)."""
    if a.primitive is not b.primitive or len(a.inputs) != len(b.inputs) or \
            [v.type for v in a.outputs] != [v.type for v in b.outputs]:
        return False
    for x, y in zip(a.inputs, b.inputs):
        if isinstance(x, Var) != isinstance(y, Var):
            return False
        if (x.type, getattr(x, "value", None)) != (y.type, getattr(y, "value", None)):
            return False
    pa, pb = a.params, b.params
    return pa.keys() == pb.keys() and all(_plain(pa[k]) and _plain(pb[k]) and pa[k] == pb[k]
                                          for k in pa)


def twins(comp, eqns) -> dict:
    """{eqn: an earlier one of ``eqns`` :func:`alike` it and cut alike in ``comp``'s plan}:
    re-cut at the same positions, each gets the same spec."""
    out, firsts = {}, []
    for j in sorted(eqns):
        e, iv = comp.program.eqns[j], comp.plan.eqn_plans[j].intervals
        r = next((r for r in firsts if comp.plan.eqn_plans[r].intervals == iv
                  and alike(comp.program.eqns[r], e)), None)
        if r is None:
            firsts.append(j)
        else:
            out[j] = r
    return out


def recut_pairs(comp, pairs, cuts, indexings=None, twin=None):
    """``comp`` with every (eqn, index) of ``pairs`` cut at ``cuts``; ``indexings``: {eqn:
    its Indexing} where known (the eqns whose params a batch does not change); ``twin``:
    :func:`twins` of those eqns, whose specs are taken from their twins'. Per call
    (eins.passes.per_call: the boxes of a batch's cut are its own)."""
    with per_call():
        return _recut_pairs(comp, pairs, cuts, indexings, twin)


def _recut_pairs(comp, pairs, cuts, indexings, twin):
    plans = list(comp.plan.eqn_plans)
    indexings, twin = indexings or {}, twin or {}
    for j, n in pairs:
        iv = dict(plans[j].intervals)
        iv[n] = tuple(cuts)
        r = twin.get(j)
        if r is not None and plans[r].intervals == iv:
            spec = plans[r].spec
        else:
            spec = (indexings.get(j) or eqn_indexing(comp.program.eqns[j])).spec(iv)
        plans[j] = replace(plans[j], intervals=iv, spec=spec)
    return replace(comp, plan=replace(comp.plan, eqn_plans=tuple(plans)))


class BlockCut:
    """The whole-block re-cut of ``planned`` (the equal family), weighted by its first
    lowering ``first`` (priced), for the re-cut ``eqns``; ``pairs`` is None where the plan
    has no one token cut (:func:`token_pairs`). Called on the family re-cut for a batch
    (``recut(..., balance=False)``: the batch's params), returns it cut at the batch's
    whole-block positions."""

    def __init__(self, planned, first, eqns):
        self.pairs = token_pairs(planned, sorted(eqns))
        if self.pairs is None:
            return
        self.eqns = sorted({j for j, _ in self.pairs})
        self.units = {i: split_index(planned, i) for i in eqns}
        i0 = min(eqns)
        cuts = planned.plan.eqn_plans[i0].intervals[self.units[i0]]
        self.pieces, self.extent = len(cuts), cuts[-1][1]
        rows = predict(first)["per_eqn"]
        ref = first.plan.eqn_plans
        self.per_unit = {}
        for i, n in self.units.items():
            work = eqn_indexing(first.program.eqns[i]).work.get(n, lambda x: x)
            most = max(work(b) - work(a) for a, b in ref[i].intervals[n])
            self.per_unit[i] = rows[i]["compute_ms"] / 1e3 / most if most else 0.0
        longest = max(b - a for a, b in ref[i0].intervals[self.units[i0]])
        self.per_token = sum(rows[j]["compute_ms"] for j in self.eqns
                             if j not in self.units) / 1e3 / longest
        self.indexings = {j: eqn_indexing(planned.program.eqns[j]) for j in self.eqns
                          if j not in self.units}
        self.twin = twins(planned, self.indexings)

    def row_kernels(self, comp, topology) -> dict:
        """{token-wise eqn: its kernels' seconds from its rows (eins.cost.rows.RowKernels,
        on ``comp``'s spec)} where its blocks' counts follow their rows; the others, and
        an eqn following the tokens by two indices, are priced in full per call."""
        per = Counter(j for j, _ in self.pairs)
        out = {}
        for j, n in self.pairs:
            if j in self.units or per[j] > 1:
                continue
            e = comp.program.eqns[j]
            ix = eqn_indexing(e)
            rk = RowKernels(e, comp.plan.eqn_plans[j].spec, topology,
                            cut_positions(e, ix, n), ix.extents[n])
            if rk.lines is not None:
                out[j] = rk
        return out

    def cuts(self, comp) -> tuple:
        """The whole-block cut intervals for the batch whose params ``comp`` carries."""
        works = [(self.per_unit[i], eqn_indexing(comp.program.eqns[i]).work.get(n, lambda x: x))
                 for i, n in self.units.items()]
        return work_cuts(lambda x: self.per_token * x + sum(w * f(x) for w, f in works),
                         self.extent, self.pieces)

    def __call__(self, comp):
        return recut_pairs(comp, self.pairs, self.cuts(comp), self.indexings, self.twin)
