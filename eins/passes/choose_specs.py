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
:func:`_seeds`. Both costs run one
implementation of the recurrence, :func:`_tree_dp` (input grouping, table per output key,
root choice and walk-back), given a cost model:
:class:`_Bytes` or :class:`_Seconds`. Under both costs, candidates whose per-device working
set exceeds the memory cap are dropped first (:func:`fit_memory`).
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from eins.errors import PlanError
from eins.ir.plan import SELECTORS, Compilation, EqnPlan, Plan, schedule_name
from eins.ir.program import Literal, Program
from eins.cost.proxy import plan_costs, repartition_bytes
from eins.passes.cut_trees import Tree, tree_parent
from eins.cost.timecost import TimeModel, plan_seconds, working_set

__all__ = ["choose_specs", "dp_choice", "random_choice", "fit_memory"]


def dp_choice(program: Program, candidates, trees: tuple[Tree, ...],
              charge_repartition: bool = True, inputs_resident: bool = False,
              model: TimeModel | None = None):
    """Algorithm 1 per tree. Returns (choice: candidate index per eqn, tree_costs: per tree
    in ``trees`` order, what one pass of the DP charges the chosen plan, including the
    repartitioning: they add up to the plan's total, ``cost_s`` under the time cost or the
    proxy's bytes; greedy: the first pass's optima without exchanges).
    ``inputs_resident``: program inputs' join bytes are not charged (Options). ``model``: a
    :class:`~eins.cost.timecost.TimeModel` to minimize predicted seconds instead of the
    byte proxy (``charge_repartition=False`` then drops the exchange times: greedy)."""
    if model is not None:
        cm = _Seconds(program, candidates, model)

        def total(choice):
            return _total_seconds(program, candidates, choice, model)
    else:
        cm = _Bytes(program, candidates, inputs_resident)

        def total(choice):
            specs = [candidates[i][c].spec for i, c in enumerate(choice)]
            return sum(k.total for k in plan_costs(program, specs, inputs_resident))
    choice, costs = _tree_dp(program, trees, cm, charge_repartition, {})
    if not charge_repartition:   # greedy: no exchanges, nothing across trees to revise
        return choice, costs
    choice, costs = _revise(program, trees, cm, choice, costs, total)
    if len(trees) < 2:
        return choice, costs
    if SEEDS_REVISED < 1:
        return choice, _costs_of(program, trees, cm, choice)
    best = total(choice)
    ranked = sorted(((total(s), n, s) for n, s in enumerate(_seeds(program, candidates, cm,
                                                                     choice))),
                    key=lambda x: (x[0], x[1]))
    for t0, _, seed in ranked[:SEEDS_REVISED]:
        got, gcosts = _revise(program, trees, cm, seed, None, total, start=t0)
        t = total(got)
        if t < best * (1 - 1e-9):
            choice, costs, best = got, gcosts, t
    if cm.once and PRODUCER_SWEEP:
        choice, costs = _sweep(program, trees, cm, choice, costs, total)
    # a revision round charges every tree for its inputs and for feeding its root's
    # consumers, so its optima count each edge between trees twice: report what one pass
    # charges the chosen plan instead, which adds up to the plan's total
    return choice, _costs_of(program, trees, cm, choice)


def _sweep(program: Program, trees, cm, choice, costs, total):
    """Moves of a shared producer together with its readers, which the rounds cannot make:
    they optimize one tree at a time, and a tree reading a tensor that several eqns read
    takes its producer's blocks as fixed, while the producer's tree takes its readers' as
    fixed, so a plan where the producer and its readers change together can stay unseen
    (``relu(x) @ a + relu(x) @ b`` over two 4-GPU H100 nodes: 7.44 us against 7.21). So
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
    reading it wants (1x16 on dgx-h100:8: 50.78 us, dp 54.17 before; without the
    designations the re-optimized attention tree paid the q/k/v projections' shared read
    three times and looked worse). Under the time cost only (``cm.once``)."""
    producers = program.producers()
    consumers = program.consumers()
    best = total(choice)
    for t in trees:
        r = t.root
        outs = program.eqns[r].outputs
        readers = {c for v in outs for c, _ in consumers.get(id(v), ())}
        if len(readers) < 2 or len(cm.rows[r]) < 2:
            continue
        small = len(t.eqns) <= SWEEP_TREE
        sub = [u for u in trees if u is t or readers.intersection(u.eqns)]
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
            got, _ = _tree_dp(program, sub, one, True, fixed)
            got[r] = c
            if not (_part_seconds(program, cm, got, eqns, producers, consumers)
                    < before * (1 - 1e-9)):
                continue
            t0 = total(got)
            if t0 < best * (1 - 1e-9):
                got, gcosts = _revise(program, trees, cm, got, None, total, start=t0)
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


# Producer table entries a consumer candidate is tried against under the time cost: all of
# them while a producer has at most TIME_EXACT distinct output placements (every eqn of the
# paper's workloads up to p = 72 here: the DP is then exact within a tree), else the
# TIME_FANIN cheapest. With 64 and 16 (before), the 16 cheapest at p = 64 missed the
# batch-aligned entries: dp was 8% slower than plain batch parallelism on 128x1K-batch over a
# 64-GPU NVSwitch (1.23 against 1.14 ms); the batch workloads gained at p >= 24, nothing
# else changed. Planning time measured: up to 1.7x up to p = 128 (128x1K-batch on
# gb200-nvl72: 5.3 -> 8.0 s CPU), 1.9x at p = 256 (dgx-h100:32x8: 51 -> 98 s CPU).
TIME_EXACT = 1024
TIME_FANIN = 64


# Rounds of re-optimizing every tree with all other trees fixed (see _revise); each costs
# about one more pass of the DP, and they stop early at the first that does not improve.
REVISION_ROUNDS = 3

# The seeded starts (_seeds) that get the revision rounds too: the cheapest ones by the
# plan's total. With 2 the plans of every workload measured were the same as with 1 (the
# paper's at p = 6 to 72, the residual-plus-sum DAG) and planning 1x8K at p = 8 took 0.105
# s CPU against 0.083 (0.078 without seeds); at p = 72 on gb200-nvl72 2.0 -> 2.8 s.
SEEDS_REVISED = 1
# At most this many distinct seeds are built and costed, in the order of the program's
# inputs (the activations usually come first): a stack of blocks has inputs in proportion to
# its depth, and costing every seed (130 distinct ones for 32 paper blocks) took 2.5 s of
# planning against 0.3 s without seeds.
SEEDS_COSTED = 32

# Whether the tree DP pays a tensor that several eqns of one tree read (from a tree fixed
# before) once per designated delivery (_tree_dp, _shared_reads; off: each reader pays its
# own, as before), and whether the shared producers' candidates are swept with their
# readers' trees after the rounds (_sweep). Both for the time cost only; switches for
# measuring (docs/costs.md).
SHARED_READS = True
PRODUCER_SWEEP = True
# _sweep tries every candidate of the root of a producer tree of at most this many eqns (a
# norm or an elementwise op whose output several eqns read); of a larger tree only the
# candidates that deliver a reader its current blocks. Every candidate of every producer
# tree took 5.2 s of planning against 1.3 for 8x1K-batch on 32 GB200s (before per-transfer
# latency, changing no plan of the paper's workloads).
SWEEP_TREE = 1


class _Summary(NamedTuple):
    """What a consumer in the same tree reads of a producer's finished table."""
    cheapest: tuple   # (value, key) of the least entry (the first such in table order)
    entries: list     # [(value, key)] tried against a consumer reading several outputs
    per_out: list     # per output j: the cost model's index for a one-input lookup


class _Bytes:
    """The byte proxy of Section 4.3 as the cost model of :func:`_tree_dp`. Table keys are
    the candidates' output tilings; repartitioning costs the input's bytes unless the
    tilings are equal, so a one-input lookup is O(1) (see the module docstring). Each
    input is charged (the paper's Cost sums over inputs), a tensor read twice twice."""
    zero = 0
    once = False
    designate = False

    def __init__(self, program: Program, candidates, inputs_resident: bool):
        producers = program.producers()
        self.rows = []
        self.memo: dict = {}   # _tree_dp's solved trees by context
        for e, cs in zip(program.eqns, candidates):
            free = [k for k, a in enumerate(e.inputs)
                    if inputs_resident and not isinstance(a, Literal)
                    and id(a) not in producers]
            self.rows.append([(c.local.join - sum(c.join_in[k] for k in free)
                               + c.local.aggregation, c.out_key, c.in_keys) for c in cs])

    @staticmethod
    def move(have, want, atom):
        return repartition_bytes(want, have, atom)

    @staticmethod
    def summarize(table) -> _Summary:
        entries = [(v, T) for T, (v, _, _) in table.items()]
        outs: list = []
        for v, T in entries:
            if not outs:
                outs = [{} for _ in T]
            for j, tj in enumerate(T):
                if tj not in outs[j] or v < outs[j][tj][0]:
                    outs[j][tj] = (v, T)
        return _Summary(min(entries, key=lambda x: x[0]), entries, outs)

    @staticmethod
    def best_one(s: _Summary, j, want, atom):
        val, key = s.cheapest
        val += atom.type.nbytes
        hit = s.per_out[j].get(want)
        if hit is not None and hit[0] <= val:
            return hit
        return val, key


class _Seconds:
    """Predicted seconds (:mod:`eins.cost.timecost`) as the cost model of
    :func:`_tree_dp`. Table keys are the producer's block copies per function specification
    (which device holds which block), since an exchange's time depends on where every copy
    lives, not only on the tiling; a consumer is tried against the TIME_FANIN cheapest
    entries of a producer with more than TIME_EXACT of them. A tensor an eqn reads twice
    in the same blocks is charged once: one exchange delivers both (the overlay pass)."""
    zero = 0.0
    once = True
    designate = True   # _tree_dp tries designated deliveries of shared reads (SHARED_READS)

    def __init__(self, program: Program, candidates, model: TimeModel):
        # per eqn, per candidate: (local seconds, out ids, need ids)
        self.rows: list = []
        self.memo: dict = {}   # _tree_dp's solved trees by context
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
            self.rows.append(rows)
        xs = model.xseconds
        self.move = lambda have, want, atom: xs(have, want)
        self.xseconds = xs

    @staticmethod
    def summarize(table) -> _Summary:
        order = sorted(((v, T) for T, (v, _, _) in table.items()), key=lambda x: x[0])
        fanin = len(order) if len(order) <= TIME_EXACT else TIME_FANIN
        outs = [{} for _ in order[0][1]]
        for v, T in order:
            for j, oid in enumerate(T):
                if oid not in outs[j]:
                    outs[j][oid] = (v, oid, T)
        ranked = order[:fanin]
        return _Summary(ranked[0], ranked, [list(o.values())[:fanin] for o in outs])

    def best_one(self, s: _Summary, j, want, atom):
        xs = self.xseconds
        val, key = None, None
        for v, oid, TP in s.per_out[j]:
            v = v + xs(oid, want)
            if val is None or v < val:
                val, key = v, TP
        return val, key


def _tree_dp(program: Program, trees, cm, charge: bool, fixed: dict):
    """Algorithm 1 on each tree in order, under cost model ``cm`` (:class:`_Bytes` or
    :class:`_Seconds`): per eqn, per candidate J, B(J) = its local cost + the charge of
    moving each input from an eqn fixed earlier (``cm.move``) + per in-tree producer P the
    least over P's table of Opt[P, T] + the moves from T into J (``cm.best_one`` for one
    input, else a scan of ``cm.summarize``'s entries); the table keeps the least B per
    output key. ``fixed`` (eqn -> candidate) holds the choices of trees outside those being
    optimized (their inputs are charged, ``charge`` permitting); it is updated in place.
    ``cm.rows[i][ci]`` = (local cost, table key: one entry per output, the key each input
    is wanted in); ``cm.move(have, want, atom)`` prices one input's exchange; with
    ``cm.once``, inputs of an eqn reading one tensor in the same blocks are priced once, an
    input wanted in blocks a consumer fixed elsewhere already receives is free, and a tensor
    from a fixed tree that several eqns of this tree read is delivered once per designated
    set of blocks (:func:`_shared_reads`: the tree is solved again per designated delivery,
    paid once, which each of its readers wanting those blocks then gets free).
    Returns (choice per eqn, optimum per tree)."""
    producers = program.producers()
    consumers = program.consumers()
    parent = tree_parent(program)
    rows, move, once = cm.rows, cm.move, cm.once
    tree_costs = []
    for tree in trees:
        for i in tree.eqns:
            fixed.pop(i, None)
        # a tree's solution depends on the choices of the eqns around it only: rounds that
        # leave those as they were take it from the memo
        around = cm.memo.get(("around", tree.root))
        if around is None:
            around = cm.memo[("around", tree.root)] = _around(program, tree, producers,
                                                              consumers)
        context = (charge, tree.root, tuple(fixed.get(e, -1) for e in around))
        hit = cm.memo.get(context)
        if hit is not None:
            fixed.update(hit[0])
            tree_costs.append(hit[1])
            continue
        reads: dict[int, tuple] = {}   # eqn -> (in-tree producer groups, fixed inputs, got)
        for i in tree.eqns:
            eqn = program.eqns[i]
            groups: dict[int, list] = {}   # in-tree producer -> [(k, j)]
            fixed_in = []                  # (k, producer's key for input k, atom)
            for k, a in enumerate(eqn.inputs):
                if isinstance(a, Literal):
                    continue
                where = producers.get(id(a))
                if where is None:
                    continue                # program input or constant: free
                P, j = where
                if parent[P] == i:
                    groups.setdefault(P, []).append((k, j))
                elif P in fixed and charge:
                    fixed_in.append((k, rows[P][fixed[P]][1][j], a))
                # else: produced in a tree not optimized yet -> free for now
            # with cm.once, blocks a consumer fixed elsewhere already receives come free:
            # the exchange feeding that consumer serves this one too (plan_seconds and the
            # synthesize pass charge a tensor once per distinct blocks)
            got = {} if not once else {
                id(a): {rows[c][fixed[c]][2][kk] for c, kk in consumers[id(a)]
                        if c != i and c in fixed}
                for _, _, a in fixed_in}
            reads[i] = (groups, fixed_in, got)

        def table_of(i, summ, paid):
            """Eqn i's table from its in-tree producers' summaries ``summ``; ``paid``:
            {tensor id: (blocks, price)}, deliveries the tree pays once outside the tables."""
            eqn = program.eqns[i]
            groups, fixed_in, got = reads[i]
            table: dict = {}
            for ci, (B, T, want) in enumerate(rows[i]):
                for k, have, a in (_once(fixed_in, lambda f: (id(f[2]), want[f[0]]))
                                   if once else fixed_in):
                    if once and (want[k] in got[id(a)] or paid and
                                 paid.get(id(a), (None,))[0] in (want[k], _ANY)):
                        continue
                    B += move(have, want[k], a)
                chosen = {}
                for P, ks in groups.items():
                    s = summ[P]
                    if once and len(ks) > 1:
                        ks = _once(ks, lambda kj: (kj[1], want[kj[0]]))
                    if not charge:
                        val, key = s.cheapest
                    elif len(ks) == 1:
                        k, j = ks[0]
                        val, key = cm.best_one(s, j, want[k], eqn.inputs[k])
                    else:   # several outputs (or one tensor twice) into this consumer
                        val, key = None, None
                        for v, TP in s.entries:
                            v = v + sum(move(TP[j], want[k], eqn.inputs[k]) for k, j in ks)
                            if val is None or v < val:
                                val, key = v, TP
                    B += val
                    chosen[P] = key
                if T not in table or B < table[T][0]:
                    table[T] = (B, ci, chosen)
            return table

        def solve(paid, base=None, redo=()):
            """(opt, summaries) of the tree: opt[i][T] = (B, candidate index, {in-tree
            producer: its chosen table key}); with ``base``, only the eqns in ``redo`` are
            computed again (the others' tables do not depend on what changed)."""
            opt, summ = ({}, {}) if base is None else (dict(base[0]), dict(base[1]))
            for i in tree.eqns:
                if base is None or i in redo:
                    opt[i] = table_of(i, summ, paid)
                    summ[i] = cm.summarize(opt[i])
            return opt, summ

        # the root pays for feeding eqns fixed in earlier trees
        feed = (lambda c, k, t, a: move(t, rows[c][fixed[c]][2][k], a)) if charge else None
        want_of = (lambda c, k: rows[c][fixed[c]][2][k]) if once else None
        paid: dict = {}
        sol = solve(paid)
        best, key = _root_choice(sol[0], tree.root, program, consumers, fixed, feed, cm.zero,
                                 want_of)
        if once and charge and SHARED_READS and cm.designate:
            # a tensor several eqns of this tree read: one designated delivery paid here
            # once, free to each reader wanting its blocks; per tensor in turn, each
            # delivery worth designating is tried (exact when at most one set of blocks is
            # wanted by two or more readers: always for two or three readers). Designating
            # blocks w costs at least the tree with the tensor free to every reader plus
            # w's price, so w is tried only when that bound is below the best so far.
            for a, redo, options in _shared_reads(tree, reads, rows, parent, move):
                others = sum(p for x, (_, p) in paid.items() if x != a)
                free = dict(paid)
                free[a] = (_ANY, 0)
                bound = _root_choice(solve(free, sol, redo)[0], tree.root, program, consumers,
                                     fixed, feed, cm.zero, want_of)[0] + others
                for w, price in sorted(options, key=lambda o: o[1]):
                    if not bound + price < best * (1 - 1e-12):
                        break
                    trial = dict(paid)
                    trial[a] = (w, price)
                    tsol = solve(trial, sol, redo)
                    v, k = _root_choice(tsol[0], tree.root, program, consumers, fixed,
                                        feed, cm.zero, want_of)
                    v += others + price
                    if v < best * (1 - 1e-12):
                        best, key, sol, paid = v, k, tsol, trial
        _fix(sol[0], tree.root, key, fixed)
        tree_costs.append(best)
        cm.memo[context] = ({i: fixed[i] for i in tree.eqns}, best)
    return [fixed[i] for i in range(len(program.eqns))], tree_costs


def _around(program: Program, tree, producers, consumers) -> tuple:
    """The eqns outside ``tree`` whose choices :func:`_tree_dp`'s solution of it depends
    on: the producers of what it reads, the other consumers of those tensors, and the
    consumers of its root's outputs (sorted)."""
    inside = set(tree.eqns)
    out = set()
    for i in tree.eqns:
        for a in program.eqns[i].inputs:
            if isinstance(a, Literal) or id(a) not in producers:
                continue
            P = producers[id(a)][0]
            if P not in inside:
                out.add(P)
                out.update(c for c, _ in consumers.get(id(a), ()) if c not in inside)
    for v in program.eqns[tree.root].outputs:
        out.update(c for c, _ in consumers.get(id(v), ()))
    return tuple(sorted(out))


_ANY = object()   # _tree_dp: a tensor delivered free in whatever blocks its readers want


def _shared_reads(tree, reads, rows, parent, move) -> list:
    """Tensors from fixed trees that several eqns of ``tree`` read (``reads``: per eqn,
    what :func:`_tree_dp` found it reads), in the order first read. Per tensor: (its id, the
    eqns whose tables depend on its delivery: its readers and their ancestors in the tree,
    the deliveries worth designating: [(blocks, exchange price)] for the blocks that at
    least two readers have candidates wanting, that no consumer fixed elsewhere already
    receives, and whose exchange costs anything)."""
    by: dict = {}   # tensor id -> (have, atom, got, {reader: blocks its rows want})
    for i in tree.eqns:
        _, fixed_in, got = reads[i]
        for k, have, a in fixed_in:
            wants = by.setdefault(id(a), (have, a, got[id(a)], {}))[3]
            wants.setdefault(i, set()).update(r[2][k] for r in rows[i])
    out = []
    for x, (have, a, got, wants) in by.items():
        if len(wants) < 2:
            continue
        count: dict = {}
        for i in wants:
            for w in wants[i]:
                count[w] = count.get(w, 0) + 1
        options = []
        for w, n in count.items():
            if n >= 2 and w not in got:
                price = move(have, w, a)
                if price > 0:
                    options.append((w, price))
        if not options:
            continue
        redo = set()
        for i in wants:
            while i is not None and i not in redo:
                redo.add(i)
                i = parent[i]
        out.append((x, redo, options))
    return out


def _once(items, key) -> list:
    """``items`` without those whose ``key`` an earlier item has (first kept, in order)."""
    seen, out = set(), []
    for it in items:
        kk = key(it)
        if kk not in seen:
            seen.add(kk)
            out.append(it)
    return out


def _root_choice(opt, r, program, consumers, fixed, feed, zero, want_of=None):
    """The key of tree root ``r`` whose cost, plus ``feed(consumer, input, block key, var)``
    for each consumer fixed in an earlier tree (None: not charged), is least: (that cost,
    the key). Both cost models (bytes, seconds) choose roots this way.
    ``want_of(consumer, input)``: the blocks a fixed consumer wants; given, an output wanted
    in the same blocks (by one consumer twice, or by several) is fed once."""
    users = [(c, k, j, v) for j, v in enumerate(program.eqns[r].outputs)
             for c, k in consumers.get(id(v), ())]
    if want_of is not None:
        # fixed consumers wanting an output in the same blocks are fed by one exchange
        users = _once(users, lambda u: (u[2], want_of(u[0], u[1])) if u[0] in fixed
                      else (u[0], u[2], u[1]))
    best = None
    for T, (v, _, _) in opt[r].items():
        extra = zero
        if feed is not None:
            for c, k, j, a in users:
                if c in fixed:
                    extra += feed(c, k, T[j], a)
        if best is None or v + extra < best[0]:
            best = (v + extra, T)
    return best


def _fix(opt, root, key, fixed):
    """Trace the chosen table entries back from a tree's root."""
    stack = [(root, key)]
    while stack:
        i, T = stack.pop()
        _, ci, chosen = opt[i][T]
        fixed[i] = ci
        stack.extend(chosen.items())


def _seeds(program: Program, candidates, cm, base) -> list:
    """Starting plans for the revision rounds besides the DP's: per program input x and
    axis a, the plan that splits x along a and then lets every eqn keep its producers'
    blocks (the candidate reading the most input bytes exactly as they were produced, or as
    the seed splits x; ties: the most pieces of x, then the least local cost); an eqn
    matching nothing keeps ``base``'s choice. Distinct seeds only, the first SEEDS_COSTED
    in input order. An eqn's pick depends
    only on its producers' keys and on which of its inputs are x (and a): picks are
    memoized on that, so eqns that do not see x are not scored again for every seed (on a
    stack of blocks, whose inputs grow with its eqns, the seeds were quadratic in depth)."""
    producers = program.producers()
    rows = cm.rows
    ins = [[(k, a, producers.get(id(a))) for k, a in enumerate(e.inputs)
            if not isinstance(a, Literal)] for e in program.eqns]
    memo: dict = {}
    out: list = []
    for x in program.inputs:
        for axis in range(len(x.type.shape)):
            choice: list = []
            for i in range(len(program.eqns)):
                haves = tuple(rows[w[0]][choice[w[0]]][1][w[1]] if w is not None else a is x
                              for _, a, w in ins[i])
                key = (i, haves, axis if any(a is x for _, a, _ in ins[i]) else -1)
                arg = memo.get(key)
                if arg is None:
                    arg = memo[key] = _seed_pick(candidates[i], rows[i], ins[i], haves,
                                                 cm.move, axis, base[i])
                choice.append(arg)
            if choice != list(base) and choice not in out:
                out.append(choice)
                if len(out) == SEEDS_COSTED:
                    return out
    return out


def _seed_pick(cands, rows, ins, haves, move, axis, default) -> int:
    """One eqn's candidate in a seed (:func:`_seeds`): ``haves`` per non-literal input is the
    producer's key, or for a program input whether it is the seed's split input."""
    best, arg = None, default
    for ci, c in enumerate(cands):
        local, _, want = rows[ci]
        score, pieces = 0, 0
        for (k, a, w), have in zip(ins, haves):
            if w is not None:
                if not move(have, want[k], a):
                    score += a.type.nbytes
            elif have and _split_along(c.in_keys[k], axis):
                score += a.type.nbytes
                pieces = len(c.in_keys[k])
        if score and (best is None or (score, pieces, -local) > best):
            best, arg = (score, pieces, -local), ci
    return arg


def _costs_of(program: Program, trees, cm, choice) -> list:
    """Per tree, the cost a first pass of :func:`_tree_dp` charges the fixed plan
    ``choice``: the DP run with each eqn's chosen candidate as its only one."""
    one = copy.copy(cm)
    one.rows = [[r[c]] for r, c in zip(cm.rows, choice)]
    one.memo = {}
    return _tree_dp(program, trees, one, True, {})[1]


def _split_along(boxes, axis: int) -> bool:
    """``boxes`` (one input's blocks) cut along ``axis`` only, into at least two."""
    if len(boxes) < 2:
        return False
    first = next(iter(boxes))
    return all(b.lo[d] == first.lo[d] and b.hi[d] == first.hi[d]
               for b in boxes for d in range(len(first.lo)) if d != axis)


def _revise(program: Program, trees, cm, choice, costs, total, start=None):
    """After Algorithm 1's pass over the trees, up to REVISION_ROUNDS rounds in which every
    tree is optimized again with all the others fixed (its inputs from them and its root's
    consumers in them are all charged), so the across-tree choices of the first pass
    (Section 4.5: trees not optimized yet enter free) are revised. A round is kept only when
    it decreases ``total(choice)`` (the plan's whole cost under the model: predicted seconds,
    or the proxy's bytes); the rounds stop at the first that does not. On a program that is
    one tree there is nothing to revise: the first pass is already optimal."""
    if len(trees) < 2:
        return choice, costs
    best = total(choice) if start is None else start
    for _ in range(REVISION_ROUNDS):
        nxt, ncosts = _tree_dp(program, trees, cm, True, dict(enumerate(choice)))
        t = total(nxt)
        if not t < best * (1 - 1e-9):
            break
        choice, costs, best = nxt, ncosts, t
    return choice, costs


def _total_seconds(program, candidates, choice, model) -> float:
    specs = [candidates[i][c].spec for i, c in enumerate(choice)]
    return sum(plan_seconds(program, specs, model.devices, model.topo, model))


def random_choice(candidates, seed: int):
    """One candidate per eqn, uniformly at random (``numpy.random.default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    return [int(rng.integers(len(c))) for c in candidates]


def choose_specs(state: Compilation) -> Compilation:
    """Fill ``state.plan`` with the selector named in ``state.options``, minimizing
    ``options.cost`` ("time": predicted seconds, :mod:`eins.cost.timecost`; "proxy": the
    paper's bytes) among the candidates that fit the per-device memory cap."""
    opts = state.options
    if opts.selector not in SELECTORS:
        raise PlanError(f"unknown selector {opts.selector!r}; choose one of {list(SELECTORS)}")
    prog = state.program
    topo = _topology(opts, state.devices)
    limit = opts.memory_limit if opts.memory_limit is not None else (
        topo.memory if topo is not None else None)
    # the optimized schedule bounces over relays where they beat a slow direct route: so
    # does its cost (cost/timecost.py _Links), and the DP picks plans for that schedule
    relays = schedule_name(opts.schedule) == "optimized"
    model = TimeModel(prog, state.devices, topo, relays) if topo is not None else None
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


