"""Pass 1 of logical optimization: specs(Op) for every eqn (Sections 3.3 and 4.2).

For ``p`` devices an operator's candidate specs are requested once per way of decomposing its
shardable indices into interval counts whose product is ``p``. Intervals are near-equal
(:func:`eins.ir.types.split_even`, so uneven counts such as p = 3, 5, 6, 7 work); an index
with a list of allowed cut positions takes the cut points that balance the pieces best (least
sum of squared lengths); an index the operator balances itself (``Indexing.balance``, e.g.
causal attention's sequence, whose rows carry unequal work) takes the operator's cuts.

Decisions where the paper is silent:

- **Cannot split p ways** (no shardable index, extents too small, too few allowed cut
  positions, or ``p`` prime and larger than every extent): the operator gets the specs of the
  largest piece count ``q < p`` it *can* reach (``q = 1``: one whole function specification).
  Function specification ``d`` runs on device ``d``; devices ``q..p-1`` idle for that eqn.
  Replicating the computation instead would only be sound for idempotent ⊕ (max/min) and
  would add join traffic without saving any, so it is never chosen.
- **Device subsets** (``cost="time"``, ``Tuning.device_subsets``): besides the ``p``-piece
  candidates, the ``Tuning.subset_specs`` of every power of two below ``p`` with the least
  join + aggregation sub-costs (function specification ``d`` on
  device ``d``, the rest idle for that eqn), since on few tokens or small operators the
  exchanges that more pieces need cost more than the kernel time they save (the TINY block
  on dgx-a100 was predicted 1.21x slower at p = 8 than at p = 1). The data stays where it
  is; idle devices wait. Not under the byte proxy, which charges nothing for a slower kernel
  and would put every eqn on one device.
- **Too many specs** (many indices at large ``p``, e.g. a matmul with three batch dims at
  p = 64): at most ``Options.max_specs`` are kept per eqn and piece count, those with the smallest
  join + aggregation sub-costs (the part of Cost that does not depend on the producers).
- **Forced decompositions** (``Options.plan``): the eqn's only candidate is the given one.
"""
from __future__ import annotations

import functools
import math
import operator
import weakref
from dataclasses import dataclass, replace

import numpy as np

from eins.errors import PlanError
from eins.ir.joinagg import Indexing, JoinAggSpec
from eins.ir.plan import Compilation, Intervals, Options
from eins.ir.program import Eqn, Literal, eqn_indexing
from eins.ir.text import index_names, resolve_index, sort_key
from eins.ir.types import split_even
from eins.cost import proxy as costmod

__all__ = ["enumerate_specs", "Candidate", "eqn_candidates", "eqn_indexing", "factorizations",
           "balanced_intervals", "index_caps", "piece_targets",
           "plan_candidates", "forced_intervals", "split_index"]


@dataclass(frozen=True)
class Candidate:
    """One entry of specs(Op): the decomposition, the spec the operator returned for it, the
    tiling keys the DP compares (in_k(J) per input, out(J) per output) and its join and
    aggregation sub-costs, which do not depend on the producers."""

    intervals: Intervals
    spec: JoinAggSpec
    in_keys: tuple            # per input: frozenset of boxes, or None for a Literal
    out_key: tuple            # per output: frozenset of boxes
    local: object             # CostBreakdown(0, join, aggregation)
    join_in: tuple = ()       # the join sub-cost split by input (cost.join_by_input)

    @property
    def counts(self) -> dict[str, int]:
        return {n: len(iv) for n, iv in self.intervals.items() if len(iv) > 1}


def index_caps(ix: Indexing) -> dict[str, int]:
    """Most intervals each shardable index can be split into (only indices with cap >= 2)."""
    caps = {}
    for name, how in ix.shardable.items():
        n = ix.extents.get(name, 1)
        cap = n if how == "any" else len(_inner(how, n)) + 1
        if cap >= 2:
            caps[name] = cap
    return caps


def _inner(positions, extent) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in positions if 0 < int(x) < extent}))


def factorizations(p: int, caps: list[int]) -> list[tuple[int, ...]]:
    """Every ordered tuple of counts ``c`` with ``prod(c) == p`` and ``c[i] <= caps[i]``."""
    out: list[tuple[int, ...]] = []

    def rec(i, rest, acc):
        if i == len(caps):
            if rest == 1:
                out.append(tuple(acc))
            return
        for d in range(1, min(rest, caps[i]) + 1):
            if rest % d == 0:
                acc.append(d)
                rec(i + 1, rest // d, acc)
                acc.pop()

    rec(0, p, [])
    return out


@functools.lru_cache(maxsize=4096)
def balanced_intervals(extent: int, positions, count: int):
    """``count`` intervals of [0, extent) cut only at allowed ``positions`` ("any" for every
    position), as equal as possible: least sum of squared lengths (exact DP). None if there
    are too few allowed positions."""
    if count == 1:
        return ((0, extent),)
    if positions == "any":
        return split_even(extent, count) if count <= extent else None
    pts = _inner(positions, extent)
    if count - 1 > len(pts):
        return None
    nodes = (0,) + pts + (extent,)
    m = len(nodes)
    inf = float("inf")
    # best[c][i]: least cost of covering [0, nodes[i]) with c pieces; arg for traceback
    best = [[inf] * m for _ in range(count + 1)]
    arg = [[-1] * m for _ in range(count + 1)]
    best[0][0] = 0
    for c in range(1, count + 1):
        for i in range(1, m):
            for h in range(i):
                if best[c - 1][h] == inf:
                    continue
                v = best[c - 1][h] + (nodes[i] - nodes[h]) ** 2
                if v < best[c][i]:
                    best[c][i], arg[c][i] = v, h
    cuts, i = [], m - 1
    for c in range(count, 0, -1):
        h = arg[c][i]
        cuts.append((nodes[h], nodes[i]))
        i = h
    return tuple(reversed(cuts))


def split_index(ix: Indexing, name: str, count: int):
    """``count`` intervals of shardable index ``name``: the operator's own balance when it
    declares one (``Indexing.balance``), else near-equal lengths; None if impossible."""
    if count == 1:
        return ((0, ix.extents[name]),)
    if name in ix.balance:
        return ix.balance[name](count)
    return balanced_intervals(ix.extents[name], _hashable(ix.shardable[name]), count)


def _hashable(how):
    return how if how == "any" else tuple(how)


def _candidate(eqn: Eqn, ix: Indexing, intervals: Intervals) -> Candidate:
    spec = ix.spec(intervals)
    full = ix.full(intervals)
    in_keys = tuple(None if isinstance(a, Literal) else frozenset(spec.in_blocks(k))
                    for k, a in enumerate(eqn.inputs))
    out_key = tuple(frozenset(spec.out_tiling(j)) for j in range(len(eqn.outputs)))
    join_in = costmod.join_by_input(spec, eqn)
    return Candidate(full, spec, in_keys, out_key, costmod.local_cost(spec, eqn,
                                                                     join_in=join_in), join_in)


def piece_targets(p: int) -> tuple[int, ...]:
    """The piece counts an eqn's candidates aim at on ``p`` devices with device subsets:
    ``p`` and every power of two below it, largest first. Powers of two keep the DP small
    (log2(p) + 1 groups) and make the targets of ``p' < p`` in this set exactly the
    targets of ``p'`` itself, so planning at ``p`` sees every plan planning at ``p'`` sees
    (:func:`eins.passes.choose_specs.dp_choice`'s subset plans rely on it)."""
    return (p,) + tuple(1 << k for k in range((p - 1).bit_length() - 1, -1, -1)
                        if 1 << k < p)


def eqn_candidates(eqn: Eqn, p: int, max_specs: int = 256, subsets: int = 0,
                   subset_specs: int | None = None, memo: dict | None = None
                   ) -> tuple[tuple[Candidate, ...], int]:
    """specs(Op) for ``p`` devices: (candidates, q) where q is the piece count reached
    (``q == p`` unless the operator cannot be split ``p`` ways; see the module doc).
    ``subsets``: also the candidates of the ``subsets`` largest powers of two below ``p``
    (those reaching fewer pieces, leaving devices idle), after the ``p`` ones, largest first,
    each group cut on its own: the first to ``max_specs``, the others to ``subset_specs``
    (default ``max_specs``). ``memo``: groups already built, shared by calls for the same
    program (planning on fewer devices reuses the groups, hence the costs, of planning on
    more)."""
    if p < 1:
        raise PlanError(f"need at least one device, got p={p}")
    ix = eqn_indexing(eqn)
    caps = index_caps(ix)
    names = list(caps)
    cands, reached, done = [], None, set()
    ekey = _eqn_key(eqn) if memo is not None else None
    for target in piece_targets(p)[:1 + subsets]:
        for q in range(target, 0, -1):
            facts = factorizations(q, [caps[n] for n in names])
            if facts:
                break
        most = max_specs if reached is None or subset_specs is None else min(max_specs,
                                                                             subset_specs)
        if reached is None:
            reached = q
        if q in done:
            continue
        done.add(q)
        gkey = None if ekey is None else (ekey, q, most)
        group = memo.get(gkey) if gkey is not None else None
        if group is None:
            # every candidate of q pieces, built once: the groups cut to different sizes
            # (q as the target, or as a subset level of a larger one) share its objects,
            # and with them the costs the time model caches per spec
            akey = None if ekey is None else (ekey, q)
            every = memo.get(akey) if akey is not None else None
            if every is None:
                every = []
                for counts in facts:
                    intervals = {}
                    for n, c in zip(names, counts):
                        if c > 1:
                            intervals[n] = split_index(ix, n, c)
                    every.append(_candidate(eqn, ix, intervals))
                if akey is not None:
                    memo[akey] = every
            group = every
            if len(group) > most:
                order = sorted(range(len(group)), key=lambda i: (group[i].local.total, i))
                group = [group[i] for i in sorted(order[:most])]
            if gkey is not None:
                memo[gkey] = group
        cands += group
    return tuple(cands), reached


def forced_intervals(eqn: Eqn, index: int, given: dict, p: int) -> Intervals:
    """Validate a user's forced decomposition {name: count | ((lo, hi), ...)} of eqn
    ``index`` and return its intervals. Names are the printed ones (``d0``, ``r0``,
    ``heads_kv``: :mod:`eins.ir.text`) or the operator's own letters."""
    ix = eqn_indexing(eqn)
    if not isinstance(given, dict):
        raise PlanError(f"plan[{index}] must be a dict {{index name: count or intervals}}, "
                        f"got {given!r}")
    extents, shardable = ix.extents, ix.shardable
    names = index_names(ix)
    where = f"plan[{index}] ({eqn.prim})"
    out: Intervals = {}
    seen: dict[str, str] = {}

    def need_shardable(name):
        if name not in shardable:
            raise PlanError(f"{where}: index {names[name]!r} is not shardable (shardable: "
                            f"{sorted((names[n] for n in shardable), key=sort_key)})")

    for key, val in given.items():
        name = resolve_index(key, names, shardable, where)
        if name in seen:
            raise PlanError(f"{where}: index {names[name]!r} is given twice ({seen[name]!r} "
                            f"and {key!r})")
        seen[name] = key
        shown = names[name]
        n = extents[name]
        if isinstance(val, (int, np.integer)) and not isinstance(val, (bool, np.bool_)):
            val = int(val)
            if val == 1:
                continue
            need_shardable(name)
            iv = split_index(ix, name, val) if val >= 1 else None
            if iv is None:
                raise PlanError(f"{where}: index {shown!r} of extent {n} cannot be split into "
                                f"{val} intervals")
        else:
            try:
                iv = tuple((lo, hi) for lo, hi in val)
            except (TypeError, ValueError):
                raise PlanError(f"{where}: index {shown!r}: expected an interval count or "
                                f"((lo, hi), ...), got {val!r}") from None
            def bound(b):
                # int() would truncate 3.7 to 3 and read "4": a plan not asked for; an int
                # (numpy's, a torch int tensor: anything with __index__) or a whole float
                if not isinstance(b, (bool, np.bool_)):
                    try:
                        return operator.index(b)
                    except TypeError:
                        if isinstance(b, float) and b.is_integer():
                            return int(b)
                raise PlanError(f"{where}: index {shown!r}: interval bounds must be ints, "
                                f"got {b!r} in {val!r}")
            iv = tuple((bound(lo), bound(hi)) for lo, hi in iv)
            ok = bool(iv) and iv[0][0] == 0 and iv[-1][1] == n and all(
                lo < hi for lo, hi in iv) and all(a[1] == b[0] for a, b in zip(iv, iv[1:]))
            if not ok:
                raise PlanError(f"{where}: intervals {val!r} of index {shown!r} do not tile "
                                f"[0, {n})")
            if len(iv) == 1:
                continue
            need_shardable(name)
            how = shardable[name]
            if how != "any":
                cuts = _inner(how, n)
                bad = [hi for _, hi in iv[:-1] if hi not in cuts]
                if bad:
                    raise PlanError(f"{where}: index {shown!r} may only be cut at "
                                    f"{list(cuts)}, not at {bad}")
        out[name] = iv
    pieces = math.prod(len(v) for v in out.values())
    if pieces > p:
        counts = {names[k]: len(v) for k, v in out.items()}
        raise PlanError(f"{where}: {pieces} pieces ({counts}) exceed the {p} devices")
    return out


# Bytes of the largest tensor eins plans: exchange programs move blocks of at most this many
# bytes (eins.ir.exprog.MAX_ATOM_BYTES, where the simulator's float arithmetic is exact).
MAX_TENSOR_BYTES = 2**53


def _check_sizes(program) -> None:
    """A tensor over MAX_TENSOR_BYTES is refused naming it (it failed in the exchange stage
    as "atom 'A0_0' has size 2417851639229258349412352")."""
    named = [(f"input {k}", v) for k, v in enumerate(program.inputs)]
    named += [(f"eqn {i} ({e.prim}) output {j}", v) for i, e in enumerate(program.eqns)
              for j, v in enumerate(e.outputs)]
    for what, v in named:
        nbytes = v.type.size * v.dtype.itemsize
        if nbytes > MAX_TENSOR_BYTES:
            raise PlanError(f"{what} {v.type!r} holds {nbytes:.3g} bytes; eins plans tensors "
                            f"of at most 2**53 bytes (9 PB), where its exchange simulator's "
                            f"arithmetic is exact")


def enumerate_specs(state: Compilation) -> Compilation:
    """Fill ``state.candidates``: per eqn, the tuple of its candidate specs.

    >>> import eins
    >>> from eins.ir.plan import Compilation, Options
    >>> prog = eins.make_ir(lambda x, w: (x @ w).sum(axis=0))(
    ...     eins.ShapeDtype((16, 4), "float32"), eins.ShapeDtype((4, 4), "float32"))
    >>> state = Compilation(prog, (0, 1), Options(cost="proxy"))
    >>> state = enumerate_specs(state)
    >>> [c.spec.aggs for c in state.candidates[1]]   # the sum: split its columns, or its rows (partial sums)
    [(None,), ('sum',)]
    """
    _check_sizes(state.program)
    return replace(state, candidates=plan_candidates(state.program, len(state.devices),
                                                     state.options))


# program -> {group key: candidates}: see plan_candidates
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_candidates(program, p: int, opts: Options) -> tuple:
    """Per eqn of ``program``, its candidates on ``p`` devices under ``opts`` (what
    :func:`enumerate_specs` fills in). Groups of candidates are kept with the program while
    it lives: planning it on fewer devices (the subset plans of
    :func:`eins.passes.choose_specs.subset_plans`) reuses them, and with them the costs the
    time model caches per spec."""
    neqns = len(program.eqns)
    forced = {}
    for i, v in dict(opts.plan or {}).items():
        if (not isinstance(i, (int, np.integer)) or isinstance(i, (bool, np.bool_))
                or not 0 <= i < neqns):
            raise PlanError(f"plan key {i!r} is not an eqn index of this program "
                            f"(0..{neqns - 1})")
        forced[int(i)] = v   # a numpy int key as the Python int it equals
    # fewer pieces than devices where that is faster: the time cost sees idle devices' cost
    # (none) and the exchanges it saves; the byte proxy would put everything on one device
    subsets = opts.tuning.subset_levels if (opts.cost == "time" and
                                            opts.tuning.device_subsets) else 0
    memo = _GROUPS.setdefault(program, {})
    out = []
    # specs(Op) depends only on _eqn_key: eqns that agree on it (the same layer repeated in
    # a stack of blocks) share one enumeration
    for i, eqn in enumerate(program.eqns):
        if i in forced:
            ix = eqn_indexing(eqn)
            out.append((_candidate(eqn, ix, forced_intervals(eqn, i, forced[i], p)),))
            continue
        key = _eqn_key(eqn)
        ckey = None if key is None else ("eqn", key, p, subsets, opts.max_specs,
                                         opts.tuning.subset_specs)
        cands = memo.get(ckey) if ckey is not None else None
        if cands is None:
            cands = eqn_candidates(eqn, p, opts.max_specs, subsets, opts.tuning.subset_specs,
                                   memo)[0]
            if ckey is not None:
                memo[ckey] = cands
        out.append(cands)
    return tuple(out)


def _eqn_key(eqn: Eqn):
    """Everything an eqn's candidates depend on: the operator, its operands' types (and which
    are Literals, which the costs leave out), its outputs' types and its params. None when a
    param is unhashable (the eqn is then enumerated on its own)."""
    key = (eqn.prim, tuple((isinstance(a, Literal), a.type) for a in eqn.inputs),
           tuple(v.type for v in eqn.outputs), tuple(sorted(eqn.params.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key
