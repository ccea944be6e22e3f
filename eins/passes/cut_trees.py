"""Pass 2 of logical optimization: cut the program's DAG into trees (Section 4.5).

An edge producer -> consumer stays inside a tree when every consumed output of the producer
goes to that one consumer eqn (one output, or several outputs "that all flow to the same
consumer", or one tensor used twice by it). Otherwise every edge out of the producer is cut
and the producer becomes the root of its own tree. Each eqn then has at most one in-tree
consumer, so the kept edges form a forest.

Trees are optimized one at a time in decreasing order of size: number of eqns, then bytes
produced; among equal trees the one with the later root goes first, so a producer tree comes
after the consumer trees it feeds and picks its tiling knowing their fixed demands (on the
paper's workloads this order is never worse than ordering by bytes or by root position).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from eins.ir.plan import Compilation
from eins.ir.program import Program

__all__ = ["cut_trees", "Tree", "find_trees", "tree_parent"]


@dataclass(frozen=True)
class Tree:
    """One tree of the cut program: its eqns in topological (program) order, and its root
    (the eqn whose outputs leave the tree)."""

    eqns: tuple[int, ...]
    root: int
    nbytes: int

    def __len__(self):
        return len(self.eqns)


def tree_parent(program: Program) -> list[int | None]:
    """parent[i]: the eqn that consumes eqn i's outputs inside its tree, or None (a root)."""
    consumers = program.consumers()
    parent: list[int | None] = []
    for e in program.eqns:
        users = {c for v in e.outputs for c, _ in consumers.get(id(v), ())}
        parent.append(next(iter(users)) if len(users) == 1 else None)
    return parent


def find_trees(program: Program) -> tuple[Tree, ...]:
    """The trees of ``program``, in optimization order."""
    parent = tree_parent(program)

    def root_of(i):
        while parent[i] is not None:
            i = parent[i]
        return i

    members: dict[int, list[int]] = {}
    for i in range(len(program.eqns)):
        members.setdefault(root_of(i), []).append(i)
    trees = [Tree(tuple(m), r, sum(v.type.nbytes for i in m for v in program.eqns[i].outputs))
             for r, m in members.items()]
    trees.sort(key=lambda t: (-len(t.eqns), -t.nbytes, -t.root))
    return tuple(trees)


def cut_trees(state: Compilation) -> Compilation:
    """Fill ``state.trees``.

    >>> import eins
    >>> from eins.ir.plan import Compilation, Options
    >>> prog = eins.make_ir(lambda x, w: (x @ w).sum(axis=0))(
    ...     eins.ShapeDtype((16, 4), "float32"), eins.ShapeDtype((4, 4), "float32"))
    >>> state = Compilation(prog, (0, 1), Options(cost="proxy"))
    >>> cut_trees(state).trees   # the matmul feeds only the sum: one tree, rooted at it
    (Tree(eqns=(0, 1), root=1, nbytes=272),)
    """
    return replace(state, trees=find_trees(state.program))
