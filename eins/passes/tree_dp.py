"""Algorithm 1's recurrence on the trees of :mod:`eins.passes.cut_trees` (Section 4.5),
under a cost model: :class:`Bytes` (the paper's proxy, Section 4.3) or :class:`Seconds`
(predicted seconds, :mod:`eins.cost.timecost`). :mod:`eins.passes.choose_specs` runs it
for the first pass over the trees and for every revision round.

Per candidate spec J of an eqn, B(J) = its local cost + the charge of moving each input
from an eqn fixed earlier + per in-tree producer P the least over P's table of
Opt[P, T] + the moves from T into J; the table keeps the least B per output key, and the
root's entry (plus what feeding consumers fixed in earlier trees costs) is traced back.
Because the repartition term is a sum over inputs, each producer is minimized on its own:
the t^n product of input tilings is never enumerated.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

from eins.cost.proxy import repartition_bytes
from eins.cost.timecost import TimeModel
from eins.ir.plan import Tuning
from eins.ir.program import Literal, Program
from eins.passes.cut_trees import tree_parent

__all__ = ["Summary", "Bytes", "Seconds", "TreeDP", "tree_dp"]


class Summary(NamedTuple):
    """What a consumer in the same tree reads of a producer's finished table."""
    cheapest: tuple   # (value, key) of the least entry (the first such in table order)
    entries: list     # [(value, key)] tried against a consumer reading several outputs
    per_out: list     # per output j: the cost model's index for a one-input lookup


class Bytes:
    """The byte proxy of Section 4.3 as a cost model of :class:`TreeDP`. Table keys are
    the candidates' output tilings; repartitioning costs the input's bytes unless the
    tilings are equal, so a one-input lookup is O(1): min(Opt[producer, in_k(J)],
    min_T Opt[producer, T] + |input|). Each input is charged (the paper's Cost sums over
    inputs), a tensor read twice twice."""
    zero = 0
    once = False
    designate = False
    ranked = False   # Summary.entries in table order

    def __init__(self, program: Program, candidates, inputs_resident: bool):
        producers = program.producers()
        self.rows = []
        self.memo: dict = {}   # TreeDP's solved trees by context
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
    def summarize(table) -> Summary:
        entries = [(v, T) for T, (v, _, _) in table.items()]
        outs: list = []
        for v, T in entries:
            if not outs:
                outs = [{} for _ in T]
            for j, tj in enumerate(T):
                if tj not in outs[j] or v < outs[j][tj][0]:
                    outs[j][tj] = (v, T)
        return Summary(min(entries, key=lambda x: x[0]), entries, outs)

    @staticmethod
    def best_one(s: Summary, j, want, atom):
        val, key = s.cheapest
        val += atom.type.nbytes
        hit = s.per_out[j].get(want)
        if hit is not None and hit[0] <= val:
            return hit
        return val, key


class Seconds:
    """Predicted seconds (:mod:`eins.cost.timecost`) as a cost model of :class:`TreeDP`.
    Table keys are the producer's block copies per function specification (which device
    holds which block), since an exchange's time depends on where every copy lives, not
    only on the tiling; a consumer is tried against the ``tuning.time_fanin`` cheapest
    entries of a producer with more than ``tuning.time_exact`` of them. A tensor an eqn
    reads twice in the same blocks is charged once: one exchange delivers both (the overlay
    pass). ``designate``: the tree DP tries designated deliveries of shared reads
    (``tuning.shared_reads``)."""
    zero = 0.0
    once = True
    ranked = True   # Summary.entries and per_out cheapest first

    def __init__(self, program: Program, candidates, model: TimeModel, tuning: Tuning):
        # per eqn, per candidate: (local seconds, out ids, need ids)
        self.rows: list = []
        self.memo: dict = {}   # TreeDP's solved trees by context
        self.designate = tuning.shared_reads
        self.exact, self.fanin = tuning.time_exact, tuning.time_fanin
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
        self.xseconds = model.xseconds

    def move(self, have, want, atom):
        return self.xseconds(have, want)

    def summarize(self, table) -> Summary:
        order = sorted(((v, T) for T, (v, _, _) in table.items()), key=lambda x: x[0])
        fanin = len(order) if len(order) <= self.exact else self.fanin
        outs = [{} for _ in order[0][1]]
        for v, T in order:
            for j, oid in enumerate(T):
                if oid not in outs[j]:
                    outs[j][oid] = (v, oid, T)
        ranked = order[:fanin]
        return Summary(ranked[0], ranked, [list(o.values())[:fanin] for o in outs])

    def best_one(self, s: Summary, j, want, atom):
        xs = self.xseconds
        val, key = None, None
        for v, oid, TP in s.per_out[j]:
            if val is not None and not v < val:
                # entries come cheapest first and an exchange costs >= 0: no later entry
                # can be less (most of the exchanges a large cluster would price)
                break
            v = v + xs(oid, want)
            if val is None or v < val:
                val, key = v, TP
        return val, key


def tree_dp(program: Program, trees, cm, charge: bool, fixed: dict):
    """Algorithm 1 on each tree of ``trees`` in order under cost model ``cm``; ``fixed``
    (eqn -> candidate, updated in place) holds the choices of trees outside those being
    optimized. Returns (choice per eqn, optimum per tree). See :class:`TreeDP`."""
    return TreeDP(program, cm, charge, fixed).run(trees)


_ANY = object()   # a tensor delivered free in whatever blocks its readers want

# per program: (producers, consumers, tree parents), read-only. The revision rounds and the
# producer sweep build a TreeDP per re-solve (hundreds on a training program of thousands
# of eqns); building these each time made planning quadratic in the program's length.
_STRUCTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _structure(program: Program):
    hit = _STRUCTURES.get(program)
    if hit is None:
        hit = _STRUCTURES[program] = (program.producers(), program.consumers(),
                                      tree_parent(program))
    return hit


class TreeDP:
    """Algorithm 1 on trees under cost model ``cm`` (:class:`Bytes` or :class:`Seconds`).

    ``cm.rows[i][ci]`` = (local cost, table key: one entry per output, the key each input
    is wanted in); ``cm.move(have, want, atom)`` prices one input's exchange. ``fixed``
    (eqn -> candidate) holds the choices of trees outside those being optimized: their
    outputs are charged as inputs (``charge`` permitting) and the root pays for feeding
    them; it is updated in place. With ``cm.once``, inputs of an eqn reading one tensor in
    the same blocks are priced once, an input wanted in blocks a consumer fixed elsewhere
    already receives is free, and (``cm.designate``) a tensor from a fixed tree that several
    eqns of this tree read is delivered once per designated set of blocks
    (:func:`shared_reads`: the tree is solved again per designated delivery, paid once,
    which each of its readers wanting those blocks then gets free)."""

    def __init__(self, program: Program, cm, charge: bool, fixed: dict):
        self.program, self.cm, self.charge, self.fixed = program, cm, charge, fixed
        self.producers, self.consumers, self.parent = _structure(program)
        self.rows, self.once = cm.rows, cm.once

    def run(self, trees):
        """(choice per eqn, optimum per tree) after solving each tree in order."""
        tree_costs = [self.solve_tree(tree) for tree in trees]
        return [self.fixed[i] for i in range(len(self.program.eqns))], tree_costs

    def solve_tree(self, tree):
        """Fix the eqns of ``tree`` to its optimum given ``fixed``; returns the optimum."""
        cm, fixed = self.cm, self.fixed
        for i in tree.eqns:
            fixed.pop(i, None)
        # a tree's solution depends on the choices of the eqns around it only: rounds that
        # leave those as they were take it from the memo
        near = cm.memo.get(("around", tree.root))
        if near is None:
            near = cm.memo[("around", tree.root)] = around(self.program, tree, self.producers,
                                                           self.consumers)
        context = (self.charge, tree.root, tuple(fixed.get(e, -1) for e in near))
        hit = cm.memo.get(context)
        if hit is not None:
            fixed.update(hit[0])
            return hit[1]
        reads = self.reads(tree)
        paid: dict = {}
        sol = self.solve(tree, reads, paid)
        best, key = self.root_choice(sol[0], tree.root)
        if self.once and self.charge and cm.designate:
            # a tensor several eqns of this tree read: one designated delivery paid here
            # once, free to each reader wanting its blocks; per tensor in turn, each
            # delivery worth designating is tried (exact when at most one set of blocks is
            # wanted by two or more readers: always for two or three readers). Designating
            # blocks w costs at least the tree with the tensor free to every reader plus
            # w's price, so w is tried only when that bound is below the best so far.
            for a, redo, options in shared_reads(tree, reads, self.rows, self.parent,
                                                 cm.move):
                others = sum(p for x, (_, p) in paid.items() if x != a)
                free = dict(paid)
                free[a] = (_ANY, 0)
                bound = self.root_choice(self.solve(tree, reads, free, sol, redo)[0],
                                         tree.root)[0] + others
                for w, price in sorted(options, key=lambda o: o[1]):
                    if not bound + price < best * (1 - 1e-12):
                        break
                    trial = dict(paid)
                    trial[a] = (w, price)
                    tsol = self.solve(tree, reads, trial, sol, redo)
                    v, k = self.root_choice(tsol[0], tree.root)
                    v += others + price
                    if v < best * (1 - 1e-12):
                        best, key, sol, paid = v, k, tsol, trial
        fix(sol[0], tree.root, key, fixed)
        cm.memo[context] = ({i: fixed[i] for i in tree.eqns}, best)
        return best

    def reads(self, tree) -> dict:
        """Per eqn of ``tree``: (in-tree producer -> [(input k, output j)], the inputs from
        fixed eqns [(k, producer's key for input k, atom)], per such tensor the blocks that
        consumers fixed elsewhere already receive (``cm.once`` only))."""
        rows, fixed, once = self.rows, self.fixed, self.once
        out: dict[int, tuple] = {}
        for i in tree.eqns:
            groups: dict[int, list] = {}
            fixed_in = []
            for k, a in enumerate(self.program.eqns[i].inputs):
                if isinstance(a, Literal):
                    continue
                where = self.producers.get(id(a))
                if where is None:
                    continue                # program input or constant: free
                P, j = where
                if self.parent[P] == i:
                    groups.setdefault(P, []).append((k, j))
                elif P in fixed and self.charge:
                    fixed_in.append((k, rows[P][fixed[P]][1][j], a))
                # else: produced in a tree not optimized yet -> free for now
            # with cm.once, blocks a consumer fixed elsewhere already receives come free:
            # the exchange feeding that consumer serves this one too (plan_seconds and the
            # synthesize pass charge a tensor once per distinct blocks)
            got = {} if not once else {
                id(a): {rows[c][fixed[c]][2][kk] for c, kk in self.consumers[id(a)]
                        if c != i and c in fixed}
                for _, _, a in fixed_in}
            out[i] = (groups, fixed_in, got)
        return out

    def table(self, i, reads, summ, paid) -> dict:
        """Eqn i's table {output key: (B, candidate index, {in-tree producer: its chosen
        table key})} from its in-tree producers' summaries ``summ``; ``paid``: {tensor id:
        (blocks, price)}, deliveries the tree pays once outside the tables."""
        cm, once, charge, move = self.cm, self.once, self.charge, self.cm.move
        eqn = self.program.eqns[i]
        groups, fixed_in, got = reads[i]
        table: dict = {}
        for ci, (B, T, want) in enumerate(self.rows[i]):
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
                        if cm.ranked and val is not None and not v < val:
                            break   # entries cheapest first (see Seconds.best_one)
                        v = v + sum(move(TP[j], want[k], eqn.inputs[k]) for k, j in ks)
                        if val is None or v < val:
                            val, key = v, TP
                B += val
                chosen[P] = key
            if T not in table or B < table[T][0]:
                table[T] = (B, ci, chosen)
        return table

    def solve(self, tree, reads, paid, base=None, redo=()):
        """(opt, summaries) of the tree: opt[i][T] = (B, candidate index, {in-tree
        producer: its chosen table key}); with ``base``, only the eqns in ``redo`` are
        computed again (the others' tables do not depend on what changed)."""
        opt, summ = ({}, {}) if base is None else (dict(base[0]), dict(base[1]))
        for i in tree.eqns:
            if base is None or i in redo:
                opt[i] = self.table(i, reads, summ, paid)
                summ[i] = self.cm.summarize(opt[i])
        return opt, summ

    def feed(self, c, k, t, a):
        """The root pays for feeding eqn ``c``, fixed in an earlier tree, its input ``k``."""
        return self.cm.move(t, self.rows[c][self.fixed[c]][2][k], a)

    def want_of(self, c, k):
        """The blocks fixed consumer ``c`` wants its input ``k`` in."""
        return self.rows[c][self.fixed[c]][2][k]

    def root_choice(self, opt, r):
        """(cost, key) of root ``r``'s least entry, feeding fixed consumers included."""
        return root_choice(opt, r, self.program, self.consumers, self.fixed,
                           self.feed if self.charge else None, self.cm.zero,
                           self.want_of if self.once else None)


def around(program: Program, tree, producers, consumers) -> tuple:
    """The eqns outside ``tree`` whose choices its solution (:class:`TreeDP`) depends on:
    the producers of what it reads, the other consumers of those tensors, and the
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


def shared_reads(tree, reads, rows, parent, move) -> list:
    """Tensors from fixed trees that several eqns of ``tree`` read (``reads``: per eqn,
    :meth:`TreeDP.reads`), in the order first read. Per tensor: (its id, the eqns whose
    tables depend on its delivery: its readers and their ancestors in the tree, the
    deliveries worth designating: [(blocks, exchange price)] for the blocks that at least
    two readers have candidates wanting, that no consumer fixed elsewhere already receives,
    and whose exchange costs anything)."""
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


def root_choice(opt, r, program, consumers, fixed, feed, zero, want_of=None):
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


def fix(opt, root, key, fixed):
    """Trace the chosen table entries back from a tree's root into ``fixed``."""
    stack = [(root, key)]
    while stack:
        i, T = stack.pop()
        _, ci, chosen = opt[i][T]
        fixed[i] = ci
        stack.extend(chosen.items())
