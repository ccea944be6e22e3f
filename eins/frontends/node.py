"""What a converter of the ATen table (eins/frontends/aten.py, eins/frontends/sdpa.py) is
given about its node, and the helpers the converters share."""
from __future__ import annotations

import string

import numpy as np

import eins.ops as ops
from eins.errors import UnsupportedOpError

# letters for einsum subscripts built here (52 dims are more than any tensor has)
LETTERS = string.ascii_letters


class Node:
    """What a converter knows of its node: the recorded output ``shapes`` and ``dtypes``
    (one per output; ``shape``/``dtype`` the first), ``notes`` shared by one trace (GQA:
    which values repeat another's heads), ``memo`` kept across traces (facts about the
    constants, which live as long as the conversion), and :meth:`fail`."""

    def __init__(self, op: str, shapes, dtypes, where: str, notes: dict, memo: dict):
        self.op, self.shapes, self.dtypes, self.where = op, shapes, dtypes, where
        self.notes, self.memo = notes, memo

    @property
    def shape(self):
        return self.shapes[0]

    @property
    def dtype(self):
        return self.dtypes[0]

    def fail(self, why: str):
        raise UnsupportedOpError(f"eins cannot map {self.op} {why} ({self.where})")


def is_traced(x) -> bool:
    """A value computed from the module's inputs or parameters (not folded to a constant)."""
    return hasattr(x, "shape") and not isinstance(x, np.ndarray)


def dim_of(d, nd):
    return d + nd if d < 0 else d


def dims_of(dims, nd):
    """ATen's ``dim`` argument (an int, a list, or None/[] for every dim) as a tuple."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None
    if isinstance(dims, int):
        dims = [dims]
    return tuple(dim_of(d, nd) for d in dims)


def note(cx, kind, value, fact):
    """Remember ``fact`` of a traced ``value`` for this trace (keyed by identity; the value
    is kept, so its id is never reused by another object meanwhile)."""
    cx.notes.setdefault(kind, {})[id(value)] = (value, fact)


def noted(cx, kind, value):
    hit = cx.notes.get(kind, {}).get(id(value))
    return hit[1] if hit is not None and hit[0] is value else None


def wider(cx, x):
    """``x`` in the result's dtype when that is wider (``half_to_float``, ``dtype=``):
    computed there, as torch does, not rounded to x's dtype first."""
    return x if np.dtype(x.dtype) == cx.dtype else ops.astype(x, cx.dtype)
