"""Pass 3 of logical optimization: choose one join-agg spec per eqn (Algorithm 1, Section 4.5).

``dp`` runs Algorithm 1 on each tree of :mod:`eins.passes.cut_trees`, in their order. Per
candidate spec J it computes B(J) = join + aggregation + the sum over its inputs of
min over the producer's table entries (Opt[producer, T] + repartition(J, T)). Because the
repartition term is a sum over inputs, each input (more exactly: each producer, which may
deliver several outputs or one tensor twice) is minimized on its own; the t^n product of
input tilings is never enumerated. For one input the minimum is
min(Opt[producer, in_k(J)], min_T Opt[producer, T] + |input|), an O(1) lookup.

Across trees (Section 4.5): a tensor produced in an already-optimized tree enters like a
program input whose repartitioning *is* charged; a tensor from a tree not yet optimized enters
free (its cost is charged when that tree is optimized: a root whose outputs feed eqns fixed
earlier pays their repartitioning when it picks its table entry). The plan is optimal within
each tree given the trees fixed before it, and every plan, whatever its selector, is finally
costed the same way by :func:`eins.cost.proxy.plan_costs`.

``greedy`` is the same DP with the repartition sub-cost removed (each eqn takes its cheapest
spec); ``random`` draws every eqn's spec uniformly from its candidates with ``seed``.

Under ``Options.cost="time"`` (the default) the same recurrence minimizes predicted seconds
(:mod:`eins.cost.timecost`). Under both costs, rounds that revise the across-tree choices
follow the first pass over the trees and the best seeded starts: see :func:`_revise` and
:func:`_seeds`. Both costs run one implementation of the recurrence,
:class:`eins.passes.tree_dp.TreeDP` (input grouping, table per output key, root choice and
walk-back), given a cost model: :class:`~eins.passes.tree_dp.Bytes` or
:class:`~eins.passes.tree_dp.Seconds`. Under both costs, candidates whose per-device working
set exceeds the memory cap are dropped first (:func:`fit_memory`), and then, where the values
live across an eqn (:mod:`eins.cost.liveness`: a backward's saved activations, from their
forward eqn to their backward use) push it over the cap, the producers of those values are
held to their most sharded candidates and the DP runs again (:func:`fit_live`). How hard the search
looks (rounds, seeds, the sweep, the time cost's fan-in) is ``Options.tuning``
(:class:`eins.ir.plan.Tuning`).
"""
from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np

from eins.cost.liveness import (end_bytes, exchange_bytes, held_bytes, live_intervals,
                                resident_bytes)
from eins.cost.proxy import plan_costs
from eins.cost.timecost import TimeModel, plan_seconds, working_set
from eins.errors import PlanError, TopologyError
from eins.hardware.net import resolve_topology
from eins.ir.plan import SELECTORS, Compilation, EqnPlan, Plan, Tuning, schedule_name
from eins.ir.program import Literal, Program
from eins.passes.cut_trees import Tree
from eins.passes.enumerate_specs import piece_targets, plan_candidates
from eins.passes.priced import Synthesized, priced_choice
from eins.passes.tree_dp import Bytes, Seconds, tree_dp

__all__ = ["choose_specs", "dp_choice", "random_choice", "fit_memory", "fit_live",
           "subset_plans"]


def dp_choice(program: Program, candidates, trees: tuple[Tree, ...],
              charge_repartition: bool = True, inputs_resident: bool = False,
              model: TimeModel | None = None, tuning: Tuning = Tuning()):
    """Algorithm 1 per tree. Returns (choice: candidate index per eqn, tree_costs: per tree
    in ``trees`` order, what one pass of the DP charges the chosen plan, including the
    repartitioning: they add up to the plan's total, ``cost_s`` under the time cost or the
    proxy's bytes; greedy: the first pass's optima without exchanges).
    ``inputs_resident``: program inputs' join bytes are not charged (Options). ``model``: a
    :class:`~eins.cost.timecost.TimeModel` to minimize predicted seconds instead of the
    byte proxy (``charge_repartition=False`` then drops the exchange times: greedy).
    ``tuning``: the search's switches (:class:`~eins.ir.plan.Tuning`)."""
    if model is not None:
        cm = Seconds(program, candidates, model, tuning)

        def total(choice):
            return _total_seconds(program, candidates, choice, model)
    else:
        cm = Bytes(program, candidates, inputs_resident)

        def total(choice):
            specs = [candidates[i][c].spec for i, c in enumerate(choice)]
            return sum(k.total for k in plan_costs(program, specs, inputs_resident))
    choice, costs = tree_dp(program, trees, cm, charge_repartition, {})
    if not charge_repartition:   # greedy: no exchanges, nothing across trees to revise
        return choice, costs
    rounds = tuning.revision_rounds
    choice, costs = _revise(program, trees, cm, choice, costs, total, rounds)
    if len(trees) < 2:
        return choice, costs
    if tuning.seeds_revised < 1:
        return choice, _costs_of(program, trees, cm, choice)
    best = total(choice)
    seeds = _seeds(program, candidates, cm, choice, tuning.seeds_costed)
    ranked = sorted(((total(s), n, s) for n, s in enumerate(seeds)),
                    key=lambda x: (x[0], x[1]))
    for t0, _, seed in ranked[:tuning.seeds_revised]:
        got, gcosts = _revise(program, trees, cm, seed, None, total, rounds, start=t0)
        t = total(got)
        if t < best * (1 - 1e-9):
            choice, costs, best = got, gcosts, t
    if cm.once and tuning.producer_sweep:
        choice, costs = _sweep(program, trees, cm, choice, costs, total, tuning)
    # a revision round charges every tree for its inputs and for feeding its root's
    # consumers, so its optima count each edge between trees twice: report what one pass
    # charges the chosen plan instead, which adds up to the plan's total
    return choice, _costs_of(program, trees, cm, choice)


def _sweep(program: Program, trees, cm, choice, costs, total, tuning: Tuning):
    """Moves of a shared producer together with its readers, which the rounds cannot make:
    they optimize one tree at a time, and a tree reading a tensor that several eqns read
    takes its producer's blocks as fixed, while the producer's tree takes its readers' as
    fixed, so a plan where the producer and its readers change together can stay unseen
    (``relu(x) @ a + relu(x) @ b`` over two 4-GPU H100 nodes). So
    per tree whose root's outputs several eqns read, per other candidate of the root: that
    tree (its root held to the candidate) and every tree holding a reader are optimized
    again, everything else as chosen; the result is kept, then revised, only when the
    plan's total falls (checked first on the part of the total those eqns change, then on
    the whole). A producer tree of one eqn (a norm or an elementwise op) is re-optimized
    without designated deliveries, which the revision then tries, for every candidate of
    its root. A larger one (a residual add roots the attention's tree) only for the
    candidates of its root that deliver some reader the blocks it now wants with no
    exchange, and with designated deliveries: the Megatron plan of small token counts, whose
    residual add takes the output projection's partial sums by rows, which the rms_norm
    reading it wants (without the designations the re-optimized attention tree pays the
    q/k/v projections' shared read three times and looks worse; figures in
    docs/measured.md). Under the time cost only (``cm.once``); a producer tree
    counts as small up to ``tuning.sweep_tree`` eqns."""
    producers = program.producers()
    consumers = program.consumers()
    best = total(choice)
    tree_of = {i: n for n, u in enumerate(trees) for i in u.eqns}
    for n_t, t in enumerate(trees):
        r = t.root
        outs = program.eqns[r].outputs
        readers = {c for v in outs for c, _ in consumers.get(id(v), ())}
        if len(readers) < 2 or len(cm.rows[r]) < 2:
            continue
        small = len(t.eqns) <= tuning.sweep_tree
        # t and the trees holding a reader, in the trees' order (a scan of every tree per
        # shared producer made the sweep quadratic on long programs)
        sub = [trees[n] for n in sorted({n_t} | {tree_of[c] for c in readers})]
        eqns = [i for u in sub for i in u.eqns]
        before = _part_seconds(program, cm, choice, eqns, producers, consumers)
        for c in range(len(cm.rows[r])):
            if c == choice[r]:
                continue
            if not small and not any(
                    cm.xseconds(cm.rows[r][c][1][j], cm.rows[d][choice[d]][2][k]) == 0
                    for j, v in enumerate(outs) for d, k in consumers.get(id(v), ())):
                continue
            one = copy.copy(cm)
            one.rows = list(cm.rows)
            one.rows[r] = [cm.rows[r][c]]
            one.memo = {}
            one.designate = cm.designate and not small
            fixed = dict(enumerate(choice))
            fixed[r] = 0   # one's only candidate of r
            got, _ = tree_dp(program, sub, one, True, fixed)
            got[r] = c
            if not (_part_seconds(program, cm, got, eqns, producers, consumers)
                    < before * (1 - 1e-9)):
                continue
            t0 = total(got)
            if t0 < best * (1 - 1e-9):
                got, gcosts = _revise(program, trees, cm, got, None, total,
                                      tuning.revision_rounds, start=t0)
                choice, costs, best = got, gcosts, total(got)
                before = _part_seconds(program, cm, choice, eqns, producers, consumers)
    return choice, costs


def _part_seconds(program: Program, cm, choice, eqns, producers, consumers) -> float:
    """The part of the plan's predicted seconds (:func:`plan_seconds`) that the choices of
    ``eqns`` enter: their local seconds and the exchanges of every tensor they produce or
    read, each once per distinct blocks its consumers want (as ``plan_seconds`` charges)."""
    rows = cm.rows
    t = 0.0
    tensors: dict = {}
    for i in eqns:
        t += rows[i][choice[i]][0]
        e = program.eqns[i]
        for v in e.outputs:
            tensors[id(v)] = None
        for a in e.inputs:
            if not isinstance(a, Literal) and id(a) in producers:
                tensors[id(a)] = None
    for x in tensors:
        P, j = producers[x]
        have = rows[P][choice[P]][1][j]
        for w in {rows[c][choice[c]][2][k] for c, k in consumers.get(x, ())}:
            t += cm.xseconds(have, w)
    return t


def _seeds(program: Program, candidates, cm, base, most: int) -> list:
    """Starting plans for the revision rounds besides the DP's: per program input x and
    axis a, the plan that splits x along a and then lets every eqn keep its producers'
    blocks (the candidate reading the most input bytes exactly as they were produced, or as
    the seed splits x; ties: the most pieces of x, then the least local cost); an eqn
    matching nothing keeps ``base``'s choice. Before those, per group of program inputs of
    one type (a training step's tokens and targets; a weight and its optimizer moments), the
    seed splitting them all along one axis, which follows only the blocks that the split
    reaches: an eqn it does not reach keeps ``base``'s choice, but its blocks are not kept
    by its readers, and a candidate whose outputs are partial sums is charged their bytes
    (the sum moves them): a training step's cross-entropy backward starts from a broadcast
    scalar, which the split does not reach, and where base split that by tokens, the
    tokens' batch split would follow it and be no data parallel plan. Distinct
    seeds only, the first ``most`` (groups first, then inputs in order). An eqn's pick
    depends only on its producers' keys and on which of its inputs are split (and a):
    picks are memoized on that, so eqns that do not see the split are not scored again for
    every seed (on a stack of blocks, whose inputs grow with its eqns, the seeds would be
    quadratic in depth)."""
    producers = program.producers()
    rows = cm.rows
    ins = [[(k, a, producers.get(id(a))) for k, a in enumerate(e.inputs)
            if not isinstance(a, Literal)] for e in program.eqns]
    memo: dict = {}
    out: list = []
    for xs, axis, strict in _seed_splits(program):
        choice: list = []
        told: list = []   # strict seeds: whether the seed's split reached each eqn's pick
        for i in range(len(program.eqns)):
            haves = tuple((rows[w[0]][choice[w[0]]][1][w[1]]
                           if not strict or told[w[0]] else None) if w is not None
                          else id(a) in xs for _, a, w in ins[i])
            key = (i, haves, strict, axis if any(haves[n] is True for n, (_, _, w) in
                                                 enumerate(ins[i]) if w is None) else -1)
            hit = memo.get(key)
            if hit is None:
                outs = [v.type.nbytes for v in program.eqns[i].outputs] if strict else None
                hit = memo[key] = _seed_pick(candidates[i], rows[i], ins[i], haves,
                                             cm.move, axis, base[i], outs)
            choice.append(hit[0])
            told.append(hit[1])
        if choice != list(base) and choice not in out:
            out.append(choice)
            if len(out) == most:
                return out
    return out


def _seed_splits(program: Program):
    """(ids of the inputs a seed splits, axis) per seed of :func:`_seeds`: first every group
    of two or more inputs of one type (shape and dtype) split along one axis together, then
    each input alone. The third item: whether the seed follows only the split's blocks
    (groups; see :func:`_seeds`)."""
    groups: dict = {}
    for x in program.inputs:
        groups.setdefault(x.type, []).append(id(x))
    for t, xs in groups.items():
        if len(xs) > 1:
            for axis in range(len(t.shape)):
                yield frozenset(xs), axis, True
    for x in program.inputs:
        for axis in range(len(x.type.shape)):
            yield frozenset((id(x),)), axis, False


def _seed_pick(cands, rows, ins, haves, move, axis, default, outs=None
               ) -> tuple[int, bool]:
    """(one eqn's candidate in a seed (:func:`_seeds`), whether any input decided it):
    ``haves`` per non-literal input is the producer's key (None: not one to keep), or for a
    program input whether it is one the seed splits."""
    best, arg = None, default
    for ci, c in enumerate(cands):
        local, _, want = rows[ci]
        score, pieces = 0, 0
        for (k, a, w), have in zip(ins, haves):
            if w is not None:
                if have is not None and not move(have, want[k], a):
                    score += a.type.nbytes
            elif have and _split_along(c.in_keys[k], axis):
                score += a.type.nbytes
                pieces = len(c.in_keys[k])
        if score and outs is not None:   # partial outputs: their sum moves them all
            score -= sum(b for b, g in zip(outs, c.spec.aggs) if g is not None)
        if score > 0 and (best is None or (score, pieces, -local) > best):
            best, arg = (score, pieces, -local), ci
    return arg, best is not None


def _costs_of(program: Program, trees, cm, choice) -> list:
    """Per tree, the cost a first pass of :class:`~eins.passes.tree_dp.TreeDP` charges the
    fixed plan ``choice``: the DP run with each eqn's chosen candidate as its only one."""
    one = copy.copy(cm)
    one.rows = [[r[c]] for r, c in zip(cm.rows, choice)]
    one.memo = {}
    return tree_dp(program, trees, one, True, {})[1]


def _split_along(boxes, axis: int) -> bool:
    """``boxes`` (one input's blocks) cut along ``axis`` only, into at least two."""
    if len(boxes) < 2:
        return False
    first = next(iter(boxes))
    return all(b.lo[d] == first.lo[d] and b.hi[d] == first.hi[d]
               for b in boxes for d in range(len(first.lo)) if d != axis)


def _revise(program: Program, trees, cm, choice, costs, total, rounds: int, start=None):
    """After Algorithm 1's pass over the trees, up to ``rounds`` rounds in which every
    tree is optimized again with all the others fixed (its inputs from them and its root's
    consumers in them are all charged), so the across-tree choices of the first pass
    (Section 4.5: trees not optimized yet enter free) are revised. A round is kept only when
    it decreases ``total(choice)`` (the plan's whole cost under the model: predicted seconds,
    or the proxy's bytes); the rounds stop at the first that does not. On a program that is
    one tree there is nothing to revise: the first pass is already optimal."""
    if len(trees) < 2:
        return choice, costs
    best = total(choice) if start is None else start
    for _ in range(rounds):
        nxt, ncosts = tree_dp(program, trees, cm, True, dict(enumerate(choice)))
        t = total(nxt)
        if not t < best * (1 - 1e-9):
            break
        choice, costs, best = nxt, ncosts, t
    return choice, costs


def _total_seconds(program, candidates, choice, model) -> float:
    specs = [candidates[i][c].spec for i, c in enumerate(choice)]
    return sum(plan_seconds(program, specs, model.devices, model.topo, model))


def subset_plans(program: Program, candidates, trees, model: TimeModel, opts, limit,
                 choice) -> tuple:
    """(candidates, choice): ``candidates`` and the DP's ``choice`` among them or, where
    faster, the plan that planning on the first ``t`` devices makes, for every power of two
    ``t`` below the device count: the DP over what :func:`plan_candidates` enumerates on
    ``t`` devices (its costs are these: the idle devices carry nothing). So the plan on
    ``p`` devices is never predicted slower than the plan on ``t`` of them, recursively
    the best of every such ``t`` (the targets of ``t`` are those of ``p`` below ``t``:
    :func:`~eins.passes.enumerate_specs.piece_targets`). The DP over all the candidates
    mixes piece counts per eqn, but one tree at a time it may miss moving the whole program
    onto fewer devices (the TINY block 1x64 on dgx-a100: 65.9 us at p = 1, 79.5 at
    p = 8)."""
    best = _total_seconds(program, candidates, choice, model)
    forced = set(opts.plan or ())
    for t in piece_targets(len(model.devices))[1:]:
        try:
            sub = fit_memory(program, plan_candidates(program, t, opts), limit, forced,
                             model.working_set)
        except PlanError:   # a forced eqn or the memory cap needs more pieces
            continue
        sub = prune_subsets(program, sub, model)
        # every plan on t devices costs at least its eqns' fastest local seconds: where
        # that is no better (big kernels, which fewer pieces slow down), no DP is run
        floor = sum(min(model.local_seconds(e, c.spec) for c in cs)
                    for e, cs in zip(program.eqns, sub))
        if not floor < best * (1 - 1e-9):
            continue
        got, _ = dp_choice(program, sub, trees, True, False, model, opts.tuning)
        v = _total_seconds(program, sub, got, model)
        if v < best * (1 - 1e-9):
            candidates, choice, best = sub, got, v
    return candidates, choice


def prune_subsets(program: Program, candidates, model: TimeModel) -> tuple:
    """Per eqn, its candidates without those on fewer pieces than its most whose kernel is
    slower than its fastest candidate's by more than twice the longest latency between two
    of the devices: fewer pieces pay where the exchanges they save are latency-bound (few
    tokens, small operators), and a kernel that much slower is unlikely to pay for them,
    while every such candidate multiplies the DP's work (its table entries are tried
    against every consumer's candidates). The plans on fewer devices stay in reach whole
    (:func:`subset_plans`), so more devices are never predicted slower either way."""
    slack = 2 * float(model.links.lat.max(initial=0.0))
    out, memo = [], {}
    for e, cs in zip(program.eqns, candidates):
        hit = memo.get(id(cs))
        if hit is None:
            most = max(len(c.spec.fspecs) for c in cs)
            secs = [model.compute_seconds(e, c.spec) for c in cs]
            fast = min(secs)
            keep = tuple(c for c, v in zip(cs, secs)
                         if len(c.spec.fspecs) == most or v <= fast + slack)
            hit = memo[id(cs)] = (cs, keep if len(keep) < len(cs) else cs)
        out.append(hit[1])
    return tuple(out)


def random_choice(candidates, seed: int):
    """One candidate per eqn, uniformly at random (``numpy.random.default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    return [int(rng.integers(len(c))) for c in candidates]


def choose_specs(state: Compilation) -> Compilation:
    """Fill ``state.plan`` with the selector named in ``state.options``, minimizing
    ``options.cost`` ("time": predicted seconds, :mod:`eins.cost.timecost`; "proxy": the
    paper's bytes) among the candidates that fit the per-device memory cap.

    >>> import eins
    >>> from eins.ir.plan import Compilation, Options
    >>> prog = eins.make_ir(lambda x, w: (x @ w).sum(axis=0))(
    ...     eins.ShapeDtype((16, 4), "float32"), eins.ShapeDtype((4, 4), "float32"))
    >>> state = Compilation(prog, (0, 1), Options(cost="proxy"))
    >>> from eins.passes import cut_trees, enumerate_specs
    >>> state = choose_specs(cut_trees(enumerate_specs(state)))
    >>> [p.spec.aggs for p in state.plan.eqn_plans]   # rows split: two partial sums to add
    [(None,), ('sum',)]
    >>> state.plan.cost_bytes
    656
    """
    opts = state.options
    if opts.selector not in SELECTORS:
        raise PlanError(f"unknown selector {opts.selector!r}; choose one of {list(SELECTORS)}")
    prog = state.program
    topo = state.topology if state.topology is not None else _topology(opts, state.devices)
    limit = opts.memory_limit if opts.memory_limit is not None else (
        topo.memory if topo is not None else None)
    # the optimized schedule bounces over relays where they beat a slow direct route: so
    # does its cost (cost/timecost.py _Links), and the DP picks plans for that schedule
    relays = schedule_name(opts.schedule) == "optimized"
    model = TimeModel(prog, state.devices, topo, relays) if topo is not None else None
    size = model.working_set if model is not None else working_set
    forced = set(opts.plan or ())
    cands = fit_memory(prog, state.candidates, limit, forced, size)
    if model is not None and opts.cost == "time":
        cands = prune_subsets(prog, cands, model)
    if opts.selector == "random":
        choice = random_choice(cands, opts.seed)
    else:
        choice, _ = dp_choice(prog, cands, state.trees, opts.selector == "dp",
                              opts.inputs_resident,
                              model if opts.cost == "time" else None, opts.tuning)
        timed = opts.selector == "dp" and opts.cost == "time" and model is not None
        everything = cands

        def choose(m, choice=None):
            if choice is None:
                choice, _ = dp_choice(prog, everything, state.trees, True, False, m,
                                      opts.tuning)
            if opts.tuning.device_subsets:
                return subset_plans(prog, everything, state.trees, m, opts, limit, choice)
            return everything, choice

        if timed:
            cands, choice = choose(model, choice)
        if timed and relays and 0 < len(state.devices) <= opts.tuning.priced_max_p:
            # the optimized schedule: the plans picked are priced by their synthesized
            # bodies (eins/passes/priced.py), and cost_s is that price
            model = Synthesized(model, topo, opts)
            cands, choice = priced_choice(prog, choose, cands, choice, model,
                                          opts.tuning.priced_rounds)
        if limit is not None and opts.tuning.memory_rounds > 0:
            # the values live across each eqn (a backward's saved activations) counted too
            def run(cs):
                return dp_choice(prog, cs, state.trees, opts.selector == "dp",
                                 opts.inputs_resident, model if opts.cost == "time" else None,
                                 opts.tuning)[0]
            choice, cands = fit_live(prog, cands, choice, limit, size, len(state.devices),
                                     forced, opts.tuning.memory_rounds, run)
    chosen = [cands[i][c] for i, c in enumerate(choice)]
    specs = [c.spec for c in chosen]
    costs = plan_costs(prog, specs, opts.inputs_resident)
    secs = plan_seconds(prog, specs, state.devices, topo, model) if model else None
    eqn_plans = tuple(EqnPlan(c.intervals, c.spec, k, t) for c, k, t in
                      zip(chosen, costs, secs if secs is not None else [None] * len(costs)))
    label = opts.selector + ("+forced" if opts.plan else "")
    if model is not None:
        peak = max((model.working_set(e, sp) for e, sp in zip(prog.eqns, specs)), default=0)
    else:
        sizes: dict = {}   # one working set per distinct (spec, types): layers share specs
        for e, sp in zip(prog.eqns, specs):
            key = (id(sp), tuple(a.type for a in e.inputs), tuple(v.type for v in e.outputs))
            if key not in sizes:
                sizes[key] = working_set(e, sp)
        peak = max(sizes.values(), default=0)
    plan = Plan(prog, tuple(state.devices), eqn_plans, label, sum(k.total for k in costs),
                cost_s=sum(secs) if secs is not None else None, eqn_peak_bytes=peak,
                memory_limit=limit, topology=topo.name if topo is not None else None,
                minimized=None if opts.selector == "random" else
                ("time" if opts.cost == "time" and model is not None else "bytes"))
    return replace(state, plan=plan, topology=topo)


def _topology(opts, devices):
    """The topology the plan is costed on (``opts.topology``, or the lowering's default for
    these device ids); None only for the proxy without a topology on more devices than the
    default covers (then nothing is capped)."""
    try:
        return resolve_topology(opts.topology, devices, opts.profile)
    except TopologyError:
        if opts.cost == "proxy" and opts.topology is None:
            return None
        raise


def fit_memory(program: Program, candidates, limit, forced=frozenset(), size=working_set):
    """Per eqn, the candidates whose working set (:func:`working_set`) fits ``limit`` bytes
    per device (all of them when ``limit`` is None; forced eqns are kept as given). Raises
    PlanError naming the eqn, the smallest working set found and the limit when none fits."""
    if limit is None:
        return candidates
    out = []
    memo: dict = {}   # eqns with equal types share their candidate tuple
    for i, (e, cs) in enumerate(zip(program.eqns, candidates)):
        if i in forced:
            out.append(cs)
            continue
        hit = memo.get(id(cs))
        if hit is not None:
            out.append(hit)
            continue
        sizes = [size(e, c.spec) for c in cs]
        keep = tuple(c for c, b in zip(cs, sizes) if b <= limit)
        if not keep:
            raise PlanError(f"no plan fits the memory limit: eqn {i} ({e.prim}) needs at "
                            f"least {min(sizes):,} bytes on one device (smallest peak among "
                            f"its {len(cs)} specs, kernel temporaries included), the limit is "
                            f"{int(limit):,} bytes")
        if len(keep) == len(cs):
            keep = cs
        memo[id(cs)] = keep
        out.append(keep)
    return tuple(out)




def fit_live(program: Program, cands, choice, limit, size, ndev: int, forced, rounds: int,
             run):
    """The plan ``choice`` (``run(cands)`` re-plans) made to fit ``limit`` with the values
    live across each eqn counted (:mod:`eins.cost.liveness`), for up to ``rounds``
    re-plans: where an eqn's working set plus the bytes live across it (and its exchanges'
    pieces) exceed the cap, the producers of those values keep only their candidates leaving
    the fewest bytes on a device (the most sharded: no full-size partials kept for a
    backward), and the eqn only candidates that fit beside them. A re-plan is kept only
    when it lowers the peak. Returns (choice, candidates); the plan may still exceed the cap
    when nothing is left to shard (``predicted_time()["fits"]`` then says so)."""
    n = len(program.eqns)
    if not n:
        return choice, cands

    def peaks(choice):
        """(intervals, bytes live across each eqn, peak per eqn and, last, at the end)."""
        specs = [cands[i][c].spec for i, c in enumerate(choice)]
        ivs = live_intervals(program, specs, ndev)
        res = resident_bytes(program, specs, ndev, ivs) + exchange_bytes(program, specs, ndev)
        ws = np.array([size(e, sp) for e, sp in zip(program.eqns, specs)], dtype=np.int64)
        return ivs, res, np.append(ws + res, end_bytes(program, specs, ndev))

    ivs, res, peak = peaks(choice)
    for _ in range(rounds):
        if peak.max() <= limit:
            break
        over = peak > limit   # the last entry: the end, where the results are gathered
        seen = np.concatenate([[0], np.cumsum(over)])   # over positions before each one
        culprits = {p for p, first, last, _, _ in ivs
                    if p is not None and seen[last] > seen[first + 1]}
        if over[n]:   # results gathered over the cap: their producers
            prod = program.producers()
            culprits |= {prod[id(v)][0] for v in program.outputs if id(v) in prod}
        new = list(cands)
        for i in sorted(culprits - forced):
            e = program.eqns[i]
            held = [sum(held_bytes(e, c.spec, j, ndev) for j in range(len(e.outputs))).max()
                    for c in cands[i]]
            keep = tuple(c for c, h in zip(cands[i], held) if h == min(held))
            if len(keep) < len(cands[i]):
                new[i] = keep
        for i in np.flatnonzero(over[:n]):
            if i in forced:
                continue
            keep = tuple(c for c in new[i] if size(program.eqns[i], c.spec) + res[i] <= limit)
            if keep and len(keep) < len(new[i]):
                new[i] = keep
        if all(a is b for a, b in zip(new, cands)):
            break   # nothing left to shard
        old = cands
        cands = tuple(new)
        got = run(cands)
        got_ivs, got_res, got_peak = peaks(got)
        if not got_peak.max() < peak.max():
            cands = old
            break
        choice, ivs, res, peak = got, got_ivs, got_res, got_peak
    return choice, cands
