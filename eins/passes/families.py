"""The plan families a compiled program keeps with ``families=True``, and how each batch
picks one (issue 36).

A program whose eqns take a parameter as data (attention's ``segments`` as an int array:
``Primitive.runtime_params``) is served by plans of different shapes, none best for every
batch: attention split by kv heads moves nothing when the ends change (its kernels read
them) but pays an all-to-all and runs every device over every document; split by query
sequence at equal tokens it moves nothing for short documents (each block reads its own
rows and the token-wise eqns around it are cut at the same places) and pays imbalance and
key transfers for long ones. The family set, planned once at compile time from the shapes
alone (no batch is needed, so the first batch plans nothing):

- ``dp``: the lowering's own plan, the DP's free choice, re-cut per batch by the operator's
  balance rule where it splits a balanced index (eins/passes/rebalance.py);
- ``equal``: every re-cut eqn forced to split its first balanced index
  (``Indexing.balance``: attention's query sequence) over all p devices, the rest planned
  by the DP around it, kept at its compile-time cuts (from shapes alone: equal tokens);
  each batch re-derives only the boxes (the keys a block reads:
  ``recut(..., balance=False)``). Left out when a re-cut eqn has no balanced index of
  extent >= p; the DP's own plan at fixed cuts where the forced plan is the DP's.
- ``block`` (on the numpy backend, with ``families=True`` or by name, ``"block"``: it
  gains about 1% predicted on the paper block's streams for about 5 ms more host time per
  batch, docs/measured.md): the equal family with every token-wise eqn (the re-cut eqns'
  balanced index and every index of the plan cut at the same places along the same token
  dimension: eins/passes/blockcut.py) re-cut per batch at the positions that balance each
  device's whole block, its tokens' share of the token-wise kernels plus its rows'
  attention work. Its eqns are unbalanced one by one (a device of few long-document rows
  idles in every matmul) and balanced over the block, so it pays only timed GPU by GPU, as
  the rank runtime runs a program (no barrier per eqn). It shares the equal family's plan
  and first lowering (no plan of its own); each of its batches re-lowers every token-wise
  eqn (eins/passes/relower.py, ``relower_device``: the exchanges that move nothing, its
  token-wise eqns cut alike, not built). Left out where the re-cut eqns are cut apart (no
  one token cut: a gradient program's forward and backward split at different places);
  not kept on the GPU backends, which refuse ``"block"`` (:func:`families_option`): their
  families run one capacity program each (eins/passes/capacity.py), re-cutting the
  attention only, and whole-block cuts would be a new program, kernel build and graph
  capture per batch.

Each family is first lowered at :func:`reference`: where its blocks read nothing outside
their cuts (``Primitive.aligned``), so that a batch's estimate charges what the batch's
boxes read beyond.

Per batch (:meth:`FamilySet.choose`): each family is re-cut for the batch and its time
estimated GPU by GPU (``eins.passes.rebalance.Choice``: its first lowering replayed on
eins.cost.predict.Timeline, the re-cut eqns' kernels priced on the batch's boxes, and an
exchange wherever those boxes read more than the first lowering brought them); the fastest
estimate runs, the first on a tie. GPU by GPU, not eqn by eqn as the DP prices plans,
because that is how a program runs and because the block family is faster only so (on
bench_packed's stream at 1x32K, eqn by eqn, whole-block cuts are slower than the heads
split on every batch; GPU by GPU they are faster on about half: docs/measured.md). The
estimate is exact where the
boxes do not move (a heads split) and within 1% of the lowered program's ``timeline_ms``
on the paper block; it costs a re-cut and the re-cut eqns' kernel estimates per family
(the block family's: every token-wise eqn's, eqns alike priced once:
``eins.passes.blockcut.twins``). That is what
``benchmarks/bench_packed.py``'s ``dynamic`` column measures, through the same call.

Not kept, as measured on that benchmark's streams (docs/measured.md):
- the query-sequence split re-cut per batch at balanced cuts, beside the DP's: its cuts
  leave the token-wise eqns around attention cut elsewhere, and the repartition costs
  more than the balance gains; its estimate (bytes at a link's rate) misses part of that,
  so a third family was chosen on 16 of 200 batches at 1x32K and was slower than the
  others on 13 of them;
- a DP family per bucket of the length distribution (the longest document against a
  device's share): a bucket's family is the DP for one batch of the bucket, re-cut for
  the others, so it cannot beat the DP planned for each batch itself, and the choice
  between these two families is faster than that over each stream and within 0.9% of it
  on every batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from eins.cost.predict import predict
from eins.errors import EinsError
from eins.ir.program import eqn_indexing
from eins.passes import PLANNING, per_call, run_passes
from eins.passes.blockcut import BlockCut
from eins.passes.rebalance import Choice, estimates, fastest, recut
from eins.passes.relower import Family, incremental, lower_whole, relower

__all__ = ["Member", "FamilySet", "BatchChoice", "reference", "bucket", "families_option",
           "NAMES"]


NAMES = ("dp", "equal", "block")   # the families, in the order a tie goes to


def families_option(v, backend=None):
    """``families=`` of ``compile`` and ``distribute``: False, True (the DP's family and the
    equal cuts, and on numpy the whole-block family), ``"block"`` (the same, asking for
    the whole-block family by name: numpy only, as the GPU backends' families each run one
    capacity program, which re-cuts the attention alone) or a list of family names, those
    alone (``("dp", "equal")``: the two cheaper to choose among per call on numpy, about
    1.4 against 6 ms a batch of the paper block: docs/measured.md) -> v (numpy's bools as
    bool, a list as a tuple in :data:`NAMES`' order); an EinsError naming anything else."""
    if isinstance(v, (list, tuple)):
        bad = [n for n in v if not isinstance(n, str) or n not in NAMES]
        if bad or not v or len(set(v)) != len(v):
            why = f"{bad[0]!r} is none of them" if bad else \
                "none is named" if not v else "one is named twice"
            raise EinsError(f"families={v!r}: a list of families names some of {NAMES}; "
                            f"{why}")
        if "block" in v:
            families_option("block", backend)
        return tuple(n for n in NAMES if n in v)
    if isinstance(v, str) and v == "block":
        if backend is not None and backend != "numpy":
            raise EinsError(f"families='block' (the whole-block family) runs on the numpy "
                            f"backend only, not on {backend!r}: each family there runs one "
                            f"capacity program, re-cutting the attention alone; use "
                            f"families=True")
        return v
    if not isinstance(v, (bool, np.bool_)):
        raise EinsError(f"families must be True, False, 'block' or a list of family names "
                        f"(of {NAMES}), got {v!r}")
    return bool(v)


def bucket(ends, pieces: int) -> int:
    """The length bucket of a batch whose padded segment ends are ``ends`` on ``pieces``
    devices: 0 when its longest document fits one device's share of the S tokens, else
    the least k with ``longest * pieces <= S * 2**k`` (so at most 1 + log2(p) buckets).
    No family is kept per bucket (module docstring); benchmarks/bench_capacity.py groups
    batches by it."""
    e = np.asarray(ends, np.int64).reshape(-1)
    s = int(e[-1])
    longest = int(np.max(np.diff(np.concatenate([[0], e])))) if e.size else 0
    if s <= 0 or longest * pieces <= s:
        return 0
    return math.ceil(math.log2(longest * pieces / s))


@dataclass
class Member:
    """One family: ``name``, its planned Compilation, whether a batch re-balances its cuts
    (else it keeps them and re-derives the boxes), its first lowering (``first``:
    eins.passes.relower.Family, which a batch's program is lowered from; None under the
    optimized schedule, whose batches are lowered whole) and its estimator (``choice``,
    which re-cuts it for a batch; for the block family with its whole-block re-cut,
    ``cutter``: eins.passes.blockcut.BlockCut). ``eqns``: the eqns a batch re-cuts."""
    name: str
    planned: object
    balance: bool
    first: Family | None
    choice: Choice

    @property
    def eqns(self) -> list:
        return self.choice.eqns

    @property
    def cutter(self):
        return self.choice.cutter

    def lowered(self, cut):
        """``cut`` (this family re-cut for a call) lowered as the call's program is, priced:
        incrementally from ``first``, or whole under the optimized schedule (per call:
        eins.passes.per_call)."""
        with per_call():
            return relower(self.first, cut, self.eqns) if self.first is not None \
                else lower_whole(cut)

    def predicted(self, cut) -> dict:
        """The predicted time (eins.cost.predict.predict) of :meth:`lowered`, per call."""
        with per_call():
            return predict(self.lowered(cut))


@dataclass
class BatchChoice:
    """What one call ran (``Compiled.choices``): ``call`` (1 for the first), the chosen
    ``family``, its ``estimated_ms``, every family's estimate (``estimates`` {name: ms}; for
    the names in ``bounded``, a lower bound on it: families that could not be the fastest,
    whose pieces were not priced, eins.passes.rebalance.estimates) and whether the call
    lowered a new program for its cut (``lowered``; False: a program of the last ones kept
    served it)."""
    call: int
    family: str
    estimated_ms: float
    estimates: dict = field(default_factory=dict)
    bounded: frozenset = frozenset()
    lowered: bool = False

    def __str__(self):
        others = ", ".join(f"{n} {'>= ' if n in self.bounded else ''}{t:.3f}"
                           for n, t in self.estimates.items())
        new = "; a new program lowered" if self.lowered else ""
        return (f"call {self.call}: family {self.family}, estimated {self.estimated_ms:.3f} "
                f"ms ({others}){new}")


def _forced(comp, operands):
    """``comp``'s program planned with every re-cut eqn split p ways along its first
    balanced index (None when one has none of extent >= p, or the user's ``plan`` forces
    it already)."""
    p = len(comp.devices)
    user = dict(comp.options.plan or {})
    force = {}
    for i in operands:
        if i in user:
            return None
        e = comp.program.eqns[i]
        ix = eqn_indexing(e)
        names = [n for n in ix.balance if n in ix.shardable and ix.extents[n] >= p]
        if not names:
            return None
        force[i] = {names[0]: p}
    opts = replace(comp.options, plan={**user, **force})
    return run_passes(replace(comp, plan=None, options=opts), PLANNING)


def reference(planned, operands):
    """What a family is first lowered at: ``planned`` re-derived, at its own cuts, for the
    runtime values under which its blocks read nothing outside their cuts
    (``Primitive.aligned``: attention with a segment ending at every query cut; a gradient
    program's forward and backward eqns, cut alike, ask for the same ends), so that a
    batch's estimate (``Choice``) charges exactly what its boxes read beyond; ``planned``
    itself (its shapes-only boxes) where an eqn's operator offers no such values, or where
    two eqns reading one input ask for different values (no one value aligns both)."""
    arrays = [None] * len(planned.program.inputs)
    for i, (_, k) in operands.items():
        e = planned.program.eqns[i]
        fn = e.primitive.aligned
        got = fn(e.params, [a.type for a in e.inputs], planned.plan.eqn_plans[i].intervals) \
            if fn is not None else None
        if got is None:
            return planned
        for n, value in got.items():
            if e.inputs[n] is planned.program.inputs[k]:
                if arrays[k] is not None and not np.array_equal(arrays[k], value):
                    return planned
                arrays[k] = value
    if any(arrays[k] is None for _, k in operands.values()):
        return planned
    return recut(planned, arrays, operands, balance=False)


def _same(a, b) -> bool:
    return all(x.spec.fspecs == y.spec.fspecs
               for x, y in zip(a.plan.eqn_plans, b.plan.eqn_plans))


class FamilySet:
    """The families of the planned Compilation ``comp`` (a lowering's: the shapes alone's
    plan) whose eqns ``operands`` (eins.passes.rebalance.runtime_operands) are re-cut per
    call (module docstring), with the block family where ``block`` (the numpy backend's);
    ``names``: ``families=`` as :func:`families_option` returns it (a tuple: those alone).
    ``plans``: planning runs made here; ``lowerings``: first lowerings built."""

    def __init__(self, comp, operands, block=False, names=True):
        self.operands = operands
        forced = _forced(comp, operands)
        self.plans = int(forced is not None)
        specs = [("dp", comp, True)]
        if forced is not None:
            specs.append(("equal", comp if _same(forced, comp) else forced, False))
            if block:
                specs.append(("block", specs[-1][1], False))
        # id(planned) -> (its first lowering, the Compilation it lowered): equal and block
        # share one
        firsts: dict = {}
        self.members = []
        for name, planned, balance in specs:
            got = firsts.get(id(planned))
            if got is None:
                ref = reference(planned, operands)
                # the optimized schedule's calls run programs synthesized whole (no
                # incremental re-lowering), so its estimates start from such a lowering
                first = Family(ref) if incremental(ref) else None
                got = firsts[id(planned)] = (first, first.state if first else lower_whole(ref))
            cutter = None
            if name == "block":
                cutter = BlockCut(planned, got[1], operands)
                if cutter.pairs is None:   # no one token cut (module docstring)
                    continue
            self.members.append(Member(name, planned, balance, got[0],
                                       Choice(planned, got[1], operands, balance, cutter)))
        self.lowerings = len(firsts)
        if isinstance(names, tuple):   # families=(names): those alone (families_option)
            kept = [m for m in self.members if m.name in names]
            if not kept:
                raise EinsError(f"families={names!r}: this program has none of them; its "
                                f"families are {[m.name for m in self.members]}")
            self.members = kept

    @property
    def names(self) -> list:
        return [m.name for m in self.members]

    def choose(self, arrays):
        """-> (the member chosen for a call with program inputs ``arrays``, its re-cut
        Compilation, {name: estimated ms} of every member, the names among them whose ms
        is a lower bound on the estimate: eins.passes.rebalance.estimates); per call
        (eins.passes.per_call)."""
        with per_call():
            ests = estimates([m.choice for m in self.members], arrays, self.operands)
        n = fastest(ests)
        return (self.members[n], ests[n][0],
                {m.name: t * 1e3 for m, (_, t, _) in zip(self.members, ests)},
                frozenset(m.name for m, (_, _, exact) in zip(self.members, ests) if not exact))
