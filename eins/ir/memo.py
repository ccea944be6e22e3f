"""Process-wide memo tables, and the per-call scope that keeps a call's entries out of them
(issue 36).

A :class:`Memo` maps a key to a value built from it, least recently used dropped beyond its
limit: the overlays of exchanges (eins/passes/overlay.py) and an affine indexing's operand
boxes (eins/ir/joinagg.py), which a stack of equal layers, or another compilation of the same
shapes, asks for again.

A compiled program that re-cuts its plan per call (eins/rebalanced.py) asks for them too,
for the boxes of that call's cut, which no later call asks for again unless it repeats the
cut (and then its program is kept whole). Kept process-wide, every call's entries would
stay until a thousand later calls pushed them out: on the paper block's packed stream at
1x128K, after 300 calls, 600 overlays and 4,096 box lists, about 100,000 objects that every
full garbage collection walks (docs/measured.md). Inside :func:`call_scope` (the per-call
work: eins.passes.per_call) a memo's new entries go to the call's own table, shared by
the call's eqns and families and dropped with it; entries made before (a family's first
lowering, at compile time) are read as ever.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from contextvars import ContextVar

__all__ = ["Memo", "call_scope", "sizes"]

# every Memo by name
_MEMOS: dict = {}
# the current call's tables, {id(memo): {key: value}} (None: outside any call)
_CALL: ContextVar = ContextVar("eins_memo_call", default=None)


class Memo:
    """Values by key, at most ``limit`` kept process-wide (least recently used dropped) and,
    with ``weight`` (a value's size: ``len`` of a list), at most ``room`` of their summed
    weights (a value heavier than ``room`` is not kept); within :func:`call_scope`, new
    ones kept for the call only. ``name`` (unique) is how :func:`sizes` reports it."""

    def __init__(self, name: str, limit: int, weight=None, room=None):
        if limit < 1:
            raise ValueError(f"Memo {name!r}: limit must be >= 1, got {limit!r}")
        if (weight is None) != (room is None):
            raise ValueError(f"Memo {name!r}: weight and room go together, got weight="
                             f"{weight!r}, room={room!r}")
        if name in _MEMOS:
            raise ValueError(f"Memo {name!r} exists already")
        self.name, self.limit, self.weight, self.room = name, limit, weight, room
        self.table: OrderedDict = OrderedDict()
        self.held = 0   # the kept values' summed weights
        _MEMOS[name] = self

    def get(self, key):
        """The value kept for ``key`` (the call's own first, in a call), or None."""
        call = _CALL.get()
        if call is not None:
            own = call.get(id(self))
            hit = own.get(key) if own is not None else None
            if hit is not None:
                return hit
        hit = self.table.get(key)
        if hit is not None:
            self.table.move_to_end(key)
        return hit

    def put(self, key, value):
        """Keep ``value`` for ``key`` (for the call only, in a call); returns it."""
        call = _CALL.get()
        if call is not None:
            call.setdefault(id(self), {})[key] = value
            return value
        w = self.weight
        if w is not None:
            if w(value) > self.room:
                return value
            if key in self.table:
                self.held -= w(self.table[key])
            self.held += w(value)
        self.table[key] = value
        while len(self.table) > self.limit or (w is not None and self.held > self.room):
            _, old = self.table.popitem(last=False)
            if w is not None:
                self.held -= w(old)
        return value

    def __len__(self) -> int:
        return len(self.table)

    def clear(self) -> None:
        self.table.clear()
        self.held = 0


@contextlib.contextmanager
def call_scope():
    """Memo entries made inside are the call's alone (module docstring); nested, the
    outermost call's."""
    if _CALL.get() is not None:
        yield
        return
    token = _CALL.set({})
    try:
        yield
    finally:
        _CALL.reset(token)


def sizes() -> dict:
    """{name: entries kept process-wide} of every Memo."""
    return {name: len(m) for name, m in _MEMOS.items()}
