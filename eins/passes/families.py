"""Plan families kept per bucket of the length distribution (issue 36): where one plan
family cannot serve every batch well (attention split by query sequence suits batches of
short documents, whose cuts fall at document ends and move no keys; a batch with one long
document suits a heads split), a compiled program keeps a few families, each planned once
by the DP for the first batch of its bucket, and re-cuts each batch within its bucket's
family (eins/passes/rebalance.py).

The rule a batch's bucket follows: its longest document against one device's share of the
tokens. Bucket 0 holds the batches whose every document fits a share (``longest * p <=
S``: whole documents per device are possible); bucket k > 0 those whose longest document
needs up to 2**k shares (``longest * p <= S * 2**k``). So p devices make at most
``1 + log2(p)`` buckets (4 for p = 8), and a bucket is a coarse property of the batch that
its family's plan depends on (whether a sequence split can keep documents whole, how many
devices one document spans), not its exact boundaries, which the rebalance follows.

The runtime operand is read as the padded ends array a packed program takes
(``Primitive.runtime_params``: end positions, nondecreasing, padded with S).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from eins.passes import PLANNING, run_passes
from eins.passes.rebalance import specialize

__all__ = ["bucket", "FamilyCache"]


def bucket(ends, pieces: int) -> int:
    """The bucket of a batch whose padded segment ends are ``ends`` on ``pieces`` devices
    (module docstring): 0 when its longest document fits one device's share of the S
    tokens, else the least k with ``longest * pieces <= S * 2**k``."""
    e = np.asarray(ends, np.int64).reshape(-1)
    s = int(e[-1])
    longest = int(np.max(np.diff(np.concatenate([[0], e])))) if e.size else 0
    if s <= 0 or longest * pieces <= s:
        return 0
    return math.ceil(math.log2(longest * pieces / s))


class FamilyCache:
    """The families of one lowered program (``base``: its planned Compilation, the shapes
    alone's plan; ``operands``: its runtime operands, eins.passes.rebalance
    .runtime_operands), one per bucket, each planned by the DP for the first batch that
    falls in it (:func:`specialize` on that batch's values, then the planning passes).
    ``planned``: how many families were planned."""

    def __init__(self, base, operands):
        self.base, self.operands = base, operands
        self.families: dict = {}
        self.pieces = len(base.devices)

    def key(self, arrays) -> int:
        """A call's bucket (``arrays``: its program inputs, host arrays for the runtime
        operands): the largest over the runtime operands (one array, as a rule)."""
        return max(bucket(np.asarray(arrays[k]), self.pieces)
                   for _, k in self.operands.values())

    def family(self, arrays):
        """(bucket, its planned family, whether this call planned it)."""
        b = self.key(arrays)
        hit = self.families.get(b)
        if hit is not None:
            return b, hit, False
        prog = specialize(self.base.program, arrays, self.operands)
        comp = run_passes(replace(self.base, program=prog, plan=None), PLANNING)
        self.families[b] = comp
        return b, comp, True

    @property
    def planned(self) -> int:
        return len(self.families)
