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
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from eins.errors import PlanError
from eins.ir.plan import SELECTORS, Compilation, EqnPlan, Plan
from eins.ir.program import Literal, Program
from eins.passes.cost import plan_costs, repartition_bytes
from eins.passes.cut_trees import Tree, tree_parent

__all__ = ["choose_specs", "dp_choice", "random_choice"]


def dp_choice(program: Program, candidates, trees: tuple[Tree, ...],
              charge_repartition: bool = True, inputs_resident: bool = False):
    """Algorithm 1 per tree. Returns (choice: candidate index per eqn, tree_costs: the DP's
    optimum per tree in ``trees`` order, including the repartitioning it charges).
    ``inputs_resident``: program inputs' join bytes are not charged (Options)."""
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
        r = tree.root
        root_users = [(c, k, j, v) for j, v in enumerate(program.eqns[r].outputs)
                      for c, k in consumers.get(id(v), ())]
        best = None
        for T, (v, _, _) in opt[r].items():
            extra = 0
            if charge_repartition:
                for c, k, j, a in root_users:
                    if c in fixed:
                        extra += repartition_bytes(candidates[c][fixed[c]].in_keys[k], T[j], a)
            if best is None or v + extra < best[0]:
                best = (v + extra, T)
        tree_costs.append(best[0])

        stack = [(r, best[1])]
        while stack:
            i, T = stack.pop()
            _, ci, chosen = opt[i][T]
            fixed[i] = ci
            stack.extend(chosen.items())
    choice = [fixed[i] for i in range(len(program.eqns))]
    return choice, tree_costs


def random_choice(candidates, seed: int):
    """One candidate per eqn, uniformly at random (``numpy.random.default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    return [int(rng.integers(len(c))) for c in candidates]


def choose_specs(state: Compilation) -> Compilation:
    """Fill ``state.plan`` with the selector named in ``state.options``."""
    opts = state.options
    if opts.selector not in SELECTORS:
        raise PlanError(f"unknown selector {opts.selector!r}; choose one of {list(SELECTORS)}")
    prog, cands = state.program, state.candidates
    if opts.selector == "random":
        choice = random_choice(cands, opts.seed)
    else:
        choice, _ = dp_choice(prog, cands, state.trees, opts.selector == "dp",
                              opts.inputs_resident)
    chosen = [cands[i][c] for i, c in enumerate(choice)]
    costs = plan_costs(prog, [c.spec for c in chosen], opts.inputs_resident)
    eqn_plans = tuple(EqnPlan(c.intervals, c.spec, k) for c, k in zip(chosen, costs))
    label = opts.selector + ("+forced" if opts.plan else "")
    plan = Plan(prog, tuple(state.devices), eqn_plans, label, sum(k.total for k in costs))
    return replace(state, plan=plan)
