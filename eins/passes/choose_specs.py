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
costed the same way by :func:`eins.passes.cost.plan_costs`.

``greedy`` is the same DP with the repartition sub-cost removed (each eqn takes its cheapest
spec); ``random`` draws every eqn's spec uniformly from its candidates with ``seed``.

Under ``Options.cost="time"`` (the default) the same recurrence minimizes predicted seconds
(:mod:`eins.passes.timecost`): see :func:`_dp_time`. Under both costs, candidates whose
per-device working set exceeds the memory cap are dropped first (:func:`fit_memory`).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from eins.errors import PlanError
from eins.ir.plan import SELECTORS, Compilation, EqnPlan, Plan
from eins.ir.program import Literal, Program
from eins.passes.cost import plan_costs, repartition_bytes
from eins.passes.cut_trees import Tree, tree_parent
from eins.passes.timecost import TimeModel, plan_seconds, working_set

__all__ = ["choose_specs", "dp_choice", "random_choice", "fit_memory"]


def dp_choice(program: Program, candidates, trees: tuple[Tree, ...],
              charge_repartition: bool = True, inputs_resident: bool = False,
              model: TimeModel | None = None):
    """Algorithm 1 per tree. Returns (choice: candidate index per eqn, tree_costs: the DP's
    optimum per tree in ``trees`` order, including the repartitioning it charges).
    ``inputs_resident``: program inputs' join bytes are not charged (Options). ``model``: a
    :class:`~eins.passes.timecost.TimeModel` to minimize predicted seconds instead of the
    byte proxy (``charge_repartition=False`` then drops the exchange times: greedy)."""
    if model is not None:
        return _dp_time(program, candidates, trees, charge_repartition, model)
    producers = program.producers()
    consumers = program.consumers()
    parent = tree_parent(program)
    fixed: dict[int, int] = {}
    tree_costs = []

    def fixed_out(P, j):
        return candidates[P][fixed[P]].out_key[j]

    for tree in trees:
        # opt[i][T] = (B, candidate index, {in-tree producer: its chosen table key})
        opt: dict[int, dict] = {}
        min_opt: dict[int, tuple] = {}   # i -> (value, key) of i's cheapest entry
        by_out: dict[int, list] = {}     # i -> per output j: {tiling: (value, key)}
        for i in tree.eqns:
            eqn = program.eqns[i]
            groups: dict[int, list] = {}   # in-tree producer -> [(k, j)]
            fixed_in = []                  # (k, producer tiling, atom)
            for k, a in enumerate(eqn.inputs):
                if isinstance(a, Literal):
                    continue
                where = producers.get(id(a))
                if where is None:
                    continue                # program input or constant: free
                P, j = where
                if parent[P] == i:
                    groups.setdefault(P, []).append((k, j))
                elif P in fixed and charge_repartition:
                    fixed_in.append((k, fixed_out(P, j), a))
                # else: produced in a tree not optimized yet -> free for now
            table: dict = {}
            free = [k for k, a in enumerate(eqn.inputs)
                    if inputs_resident and not isinstance(a, Literal)
                    and id(a) not in producers]
            for ci, c in enumerate(candidates[i]):
                B = c.local.join - sum(c.join_in[k] for k in free) + c.local.aggregation
                for k, have, a in fixed_in:
                    B += repartition_bytes(c.in_keys[k], have, a)
                chosen = {}
                for P, ks in groups.items():
                    if not charge_repartition:
                        val, key = min_opt[P]
                    elif len(ks) == 1:
                        k, j = ks[0]
                        val, key = min_opt[P]
                        val += eqn.inputs[k].type.nbytes
                        hit = by_out[P][j].get(c.in_keys[k])
                        if hit is not None and hit[0] <= val:
                            val, key = hit
                    else:   # several outputs (or one tensor twice) into this consumer
                        val, key = None, None
                        for T, (v, _, _) in opt[P].items():
                            v = v + sum(repartition_bytes(c.in_keys[k], T[j], eqn.inputs[k])
                                        for k, j in ks)
                            if val is None or v < val:
                                val, key = v, T
                    B += val
                    chosen[P] = key
                T = c.out_key
                if T not in table or B < table[T][0]:
                    table[T] = (B, ci, chosen)
            opt[i] = table
            min_opt[i] = min(((v, T) for T, (v, _, _) in table.items()), key=lambda x: x[0])
            outs = [{} for _ in eqn.outputs]
            for T, (v, _, _) in table.items():
                for j, tj in enumerate(T):
                    if tj not in outs[j] or v < outs[j][tj][0]:
                        outs[j][tj] = (v, T)
            by_out[i] = outs

        # the root pays for feeding eqns fixed in earlier trees
        feed = (lambda c, k, t, a: repartition_bytes(candidates[c][fixed[c]].in_keys[k], t, a)) \
            if charge_repartition else None
        tree_costs.append(_fix_root(opt, tree.root, program, consumers, fixed, feed, 0))
    choice = [fixed[i] for i in range(len(program.eqns))]
    return choice, tree_costs


def _fix_root(opt, r, program, consumers, fixed, feed, zero):
    """Fix tree root ``r`` (and its tree) at the key whose cost, plus ``feed(consumer, input,
    block key, var)`` for each consumer fixed in an earlier tree (None: not charged), is
    least; returns that cost. Both cost models (bytes, seconds) choose roots this way."""
    users = [(c, k, j, v) for j, v in enumerate(program.eqns[r].outputs)
             for c, k in consumers.get(id(v), ())]
    best = None
    for T, (v, _, _) in opt[r].items():
        extra = zero
        if feed is not None:
            for c, k, j, a in users:
                if c in fixed:
                    extra += feed(c, k, T[j], a)
        if best is None or v + extra < best[0]:
            best = (v + extra, T)
    _fix(opt, r, best[1], fixed)
    return best[0]


def _fix(opt, root, key, fixed):
    """Trace the chosen table entries back from a tree's root."""
    stack = [(root, key)]
    while stack:
        i, T = stack.pop()
        _, ci, chosen = opt[i][T]
        fixed[i] = ci
        stack.extend(chosen.items())


# Producer table entries a consumer candidate is tried against under the time cost: all of
# them while a producer has at most TIME_EXACT distinct output placements (every eqn at
# p = 8 on the paper's workloads: the DP is then exact within a tree), else the TIME_FANIN
# cheapest, which keeps planning at p = 72 fast.
TIME_EXACT = 64
TIME_FANIN = 16


# Rounds of re-optimizing every tree with all other trees fixed (see _dp_time).
TIME_ROUNDS = 3


def _dp_time(program: Program, candidates, trees, charge_exchanges: bool, model: TimeModel):
    """Algorithm 1 under the time cost, then up to TIME_ROUNDS rounds in which every tree is
    optimized again with all the others fixed (its inputs from them and its root's consumers
    in them are all charged), so the across-tree choices of the first round (Section 4.5:
    trees not optimized yet enter free) are revised; a round never increases the total, and
    the rounds stop when one does not decrease it."""
    # per eqn, per candidate: (local seconds, out ids, need ids)
    info: list = []
    shared: dict = {}   # eqns of equal types share candidate tuples (enumerate_specs)
    for i, e in enumerate(program.eqns):
        rows = shared.get(id(candidates[i]))
        if rows is None:
            rows = shared[id(candidates[i])] = [
                (model.compute_seconds(e, c.spec), model.out_ids(e, c.spec),
                 model.need_ids(e, c.spec)) for c in candidates[i]]
        if model.has_outputs(e):
            rows = [(t + model.output_seconds(e, c.spec), o, n)
                    for (t, o, n), c in zip(rows, candidates[i])]
        info.append(rows)
    choice, costs = _dp_time_round(program, candidates, trees, charge_exchanges, model,
                                   info, {})
    if not charge_exchanges:
        return choice, costs
    best = _total_seconds(program, candidates, choice, model)
    for _ in range(TIME_ROUNDS):
        nxt, ncosts = _dp_time_round(program, candidates, trees, True, model, info,
                                     dict(enumerate(choice)))
        t = _total_seconds(program, candidates, nxt, model)
        if not t < best * (1 - 1e-9):
            break
        choice, costs, best = nxt, ncosts, t
    return choice, costs


def _total_seconds(program, candidates, choice, model) -> float:
    specs = [candidates[i][c].spec for i, c in enumerate(choice)]
    return sum(plan_seconds(program, specs, model.devices, model.topo, model))


def _dp_time_round(program: Program, candidates, trees, charge_exchanges: bool,
                   model: TimeModel, info, fixed: dict):
    """Algorithm 1 under the time cost: B(J) = local seconds (slowest kernel + output
    gathers) + per input, min over the producer's table entries T of (Opt[P, T] + the
    exchange time from T's block copies to J's blocks). Table keys are the producer's
    block copies per function specification (which device holds which block), since an
    exchange's time depends on where every copy lives, not only on the tiling."""
    producers = program.producers()
    consumers = program.consumers()
    parent = tree_parent(program)
    tree_costs = []
    for tree in trees:
        for i in tree.eqns:
            fixed.pop(i, None)
        opt: dict[int, dict] = {}
        ranked: dict[int, list] = {}     # i -> [(value, key)] cheapest first (TIME_FANIN)
        by_out: dict[int, list] = {}     # i -> per output j: [(value, out id, key)]
        for i in tree.eqns:
            eqn = program.eqns[i]
            groups: dict[int, list] = {}
            fixed_in = []                  # (k, producer out id)
            for k, a in enumerate(eqn.inputs):
                if isinstance(a, Literal):
                    continue
                where = producers.get(id(a))
                if where is None:
                    continue
                P, j = where
                if parent[P] == i:
                    groups.setdefault(P, []).append((k, j))
                elif P in fixed and charge_exchanges:
                    fixed_in.append((k, info[P][fixed[P]][1][j]))
            table: dict = {}
            for ci in range(len(candidates[i])):
                loc, T, need = info[i][ci]
                B = loc
                for k, oid in fixed_in:
                    B += model.xseconds(oid, need[k])
                chosen = {}
                for P, ks in groups.items():
                    if not charge_exchanges:
                        val, key = ranked[P][0]
                    elif len(ks) == 1:
                        k, j = ks[0]
                        val, key = None, None
                        for v, oid, TP in by_out[P][j]:
                            v = v + model.xseconds(oid, need[k])
                            if val is None or v < val:
                                val, key = v, TP
                    else:
                        val, key = None, None
                        for v, TP in ranked[P]:
                            v = v + sum(model.xseconds(TP[j], need[k]) for k, j in ks)
                            if val is None or v < val:
                                val, key = v, TP
                    B += val
                    chosen[P] = key
                if T not in table or B < table[T][0]:
                    table[T] = (B, ci, chosen)
            opt[i] = table
            order = sorted(((v, T) for T, (v, _, _) in table.items()), key=lambda x: x[0])
            fanin = len(order) if len(order) <= TIME_EXACT else TIME_FANIN
            ranked[i] = order[:fanin]
            outs = [{} for _ in eqn.outputs]
            for v, T in order:
                for j, oid in enumerate(T):
                    if oid not in outs[j]:
                        outs[j][oid] = (v, oid, T)
            by_out[i] = [list(o.values())[:fanin] for o in outs]

        feed = (lambda c, k, t, a: model.xseconds(t, info[c][fixed[c]][2][k])) \
            if charge_exchanges else None
        tree_costs.append(_fix_root(opt, tree.root, program, consumers, fixed, feed, 0.0))
    return [fixed[i] for i in range(len(program.eqns))], tree_costs


def random_choice(candidates, seed: int):
    """One candidate per eqn, uniformly at random (``numpy.random.default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    return [int(rng.integers(len(c))) for c in candidates]


def choose_specs(state: Compilation) -> Compilation:
    """Fill ``state.plan`` with the selector named in ``state.options``, minimizing
    ``options.cost`` ("time": predicted seconds, :mod:`eins.passes.timecost`; "proxy": the
    paper's bytes) among the candidates that fit the per-device memory cap."""
    opts = state.options
    if opts.selector not in SELECTORS:
        raise PlanError(f"unknown selector {opts.selector!r}; choose one of {list(SELECTORS)}")
    prog = state.program
    topo = _topology(opts, state.devices)
    limit = opts.memory_limit if opts.memory_limit is not None else (
        topo.memory if topo is not None else None)
    model = TimeModel(prog, state.devices, topo) if topo is not None else None
    cands = fit_memory(prog, state.candidates, limit, set(opts.plan or ()),
                       model.working_set if model is not None else working_set)
    if opts.selector == "random":
        choice = random_choice(cands, opts.seed)
    else:
        choice, _ = dp_choice(prog, cands, state.trees, opts.selector == "dp",
                              opts.inputs_resident,
                              model if opts.cost == "time" else None)
    chosen = [cands[i][c] for i, c in enumerate(choice)]
    specs = [c.spec for c in chosen]
    costs = plan_costs(prog, specs, opts.inputs_resident)
    secs = plan_seconds(prog, specs, state.devices, topo, model) if model else None
    eqn_plans = tuple(EqnPlan(c.intervals, c.spec, k) for c, k in zip(chosen, costs))
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
                memory_limit=limit)
    return replace(state, plan=plan)


def _topology(opts, devices):
    """The topology the plan is costed on (``opts.topology``, or the lowering's default for
    these device ids); None only for the proxy without a topology on more devices than the
    default covers (then nothing is capped)."""
    from eins.errors import TopologyError
    from eins.hardware.net import resolve_topology
    try:
        return resolve_topology(opts.topology, devices)
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


