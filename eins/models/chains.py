"""The paper's five matrix chains A–E (Section 6, "Two workload families") with their fixed
parenthesizations.

Chain ``X`` has dimensions ``d0 … dn``; matrix ``Mi`` (1-based) is ``d(i-1) × d(i)``. The
parenthesization is fixed and identical for every system (paper: "The parenthesization is
fixed"), so it is part of the workload: a nested tuple of matrix numbers, e.g. chain C is
``(1, (2, 3))`` = ``M1(M2 M3)``.

``scale`` divides every dimension (at least 1 remains) for test-sized versions with the same
structure.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eins.errors import EinsError
from eins.ir.types import as_dtype
from eins.tracing import ShapeDtype

__all__ = ["CHAINS", "Chain", "chain", "chain_dims", "chain_tree", "format_tree"]


def _right_nested(first: int, last: int):
    """``(first (first+1 (… (last-1 last))))``: a right-associated product."""
    tree = (last - 1, last)
    for i in range(last - 2, first - 1, -1):
        tree = (i, tree)
    return tree


# name -> (dims d0..dn, parenthesization over matrices 1..n)
_SPECS = {
    # 10240, then 16384/6144 alternating (8 values), then 10240: ((M1 M2)((M3 M4)((M5 M6)(M7 M8))))M9
    "A": ((10240,) + (16384, 6144) * 4 + (10240,),
          (((1, 2), ((3, 4), ((5, 6), (7, 8)))), 9)),
    # 9216, 20480, 5120, 20480, 5120, 9216: (M1 M2)((M3 M4) M5)
    "B": ((9216, 20480, 5120, 20480, 5120, 9216),
          ((1, 2), ((3, 4), 5))),
    # 10240 x 12288 x 32768 x 2048: M1(M2 M3)
    "C": ((10240, 12288, 32768, 2048),
          (1, (2, 3))),
    # 24576, 1536, 20480 x6, 1536, 24576: (M1(M2(M3(M4(M5(M6(M7 M8)))))))M9
    "D": ((24576, 1536) + (20480,) * 6 + (1536, 24576),
          (_right_nested(1, 8), 9)),
    # 49152, 1024, 20480 x10, 1024, 49152: (M1(M2(…(M11 M12)…)))M13
    "E": ((49152, 1024) + (20480,) * 10 + (1024, 49152),
          (_right_nested(1, 12), 13)),
}

CHAINS = tuple(_SPECS)


def _check_name(name: str) -> str:
    if name not in _SPECS:
        raise EinsError(f"unknown matrix chain {name!r}; the paper's chains are {list(CHAINS)}")
    return name


def chain_dims(name: str, scale: int = 1) -> tuple[int, ...]:
    """``d0 … dn`` of chain ``name``, each divided by ``scale`` (at least 1)."""
    if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1:
        raise EinsError(f"chain scale must be a positive int, got {scale!r}")
    return tuple(max(1, d // scale) for d in _SPECS[_check_name(name)][0])


def chain_tree(name: str):
    """The fixed parenthesization as nested pairs of 1-based matrix numbers."""
    return _SPECS[_check_name(name)][1]


def format_tree(tree, top=True) -> str:
    """``((1, 2), 3)`` -> ``(M1 M2) M3``: the paper's notation (outermost parentheses
    dropped)."""
    if isinstance(tree, int):
        return f"M{tree}"
    a, b = tree
    inner = f"{format_tree(a, False)} {format_tree(b, False)}"
    return inner if top else f"({inner})"


def _leaves(tree):
    if isinstance(tree, int):
        return [tree]
    return _leaves(tree[0]) + _leaves(tree[1])


@dataclass(frozen=True)
class Chain:
    """One chain at one scale: ``fn(*matrices)`` multiplies in the fixed order."""

    name: str
    dims: tuple[int, ...]
    tree: tuple

    @property
    def n(self) -> int:
        return len(self.dims) - 1

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((self.dims[i], self.dims[i + 1]) for i in range(self.n))

    def fn(self, *ms):
        """The chain product with the fixed parenthesization (an eins-traceable function)."""
        if len(ms) != self.n:
            raise EinsError(f"chain {self.name} multiplies {self.n} matrices, got {len(ms)}")

        def go(t):
            if isinstance(t, int):
                return ms[t - 1]
            return go(t[0]) @ go(t[1])

        return go(self.tree)

    def shape_args(self, dtype="float16"):
        """ShapeDtype arguments (to trace or plan without data)."""
        return tuple(ShapeDtype(s, dtype) for s in self.shapes)

    def arrays(self, rng=None, dtype="float32"):
        """Random matrices scaled so the product stays O(1) (entries ~ N(0, 1/rows))."""
        rng = np.random.default_rng(0) if rng is None else rng
        dt = as_dtype(dtype)
        return tuple((rng.standard_normal(s) / np.sqrt(s[0])).astype(dt) for s in self.shapes)

    def matmul_flops(self) -> int:
        """2·m·k·n summed over the products of the fixed order."""
        def go(t):
            if isinstance(t, int):
                return (self.dims[t - 1], self.dims[t]), 0
            (m, k), fa = go(t[0])
            (k2, n), fb = go(t[1])
            return (m, n), fa + fb + 2 * m * k * n
        return go(self.tree)[1]

    def __str__(self):
        return f"chain {self.name}: {format_tree(self.tree)} dims {self.dims}"


def chain(name: str, scale: int = 1) -> Chain:
    """Chain ``name`` (``"A"`` … ``"E"``) with its dimensions divided by ``scale``."""
    c = Chain(name, chain_dims(name, scale), chain_tree(name))
    assert _leaves(c.tree) == list(range(1, c.n + 1)), name  # the order of the matrices is fixed
    return c
