"""Join-agg specs (Definitions 3.5-3.7) and the einsum-like signatures most operators use
to produce them (Section 3.3).

An operator's ``indexing(*in_types, **params)`` returns an :class:`Indexing`: its named
indices with their extents, which of them are shardable (``"any"`` or a tuple of allowed cut
positions), and a producer that turns one interval decomposition of the shardable indices
into a :class:`JoinAggSpec` with one :class:`FunctionSpec` per combination of intervals.
Both builders, :func:`signature_indexing` and :func:`affine_indexing` (boxes affine in the
intervals, e.g. reshape's merged dims), share one producer.
"""
from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from eins.errors import EinsError
from eins.ir.memo import Memo
from eins.ir.slots import fast_init
from eins.ir.types import Box, tiling_error

def lse_pair_dtype(dtype) -> np.dtype:
    """The element type of a partial under ⊕ = ``lse``: the pair (o, lse) of a partial
    attention output and its row's log-sum-exp, in float64 for float64 outputs and float32
    otherwise (the softmax's compute dtype)."""
    return _LSE_PAIRS[np.float64 if np.dtype(dtype) == np.float64 else np.float32]


# the two pair dtypes, built once: a pipelined kernel's pieces ask for theirs on every call
_LSE_PAIRS = {ct: np.dtype([("o", ct), ("lse", ct)]) for ct in (np.float32, np.float64)}


def is_lse_pair(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.names == ("o", "lse")


def _lse_combine(a, b):
    """(o1, l1) ⊕ (o2, l2) = ((w1 o1 + w2 o2) / (w1 + w2), m + log(w1 + w2)), with
    m = max(l1, l2) and w = exp(l - m): the softmax over the union of two disjoint key sets
    from the softmaxes over each. (0, -inf) is its identity (a row with no visible key)."""
    la, lb = a["lse"], b["lse"]
    m = np.maximum(la, lb)
    shift = np.where(np.isfinite(m), m, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        wa, wb = np.exp(la - shift), np.exp(lb - shift)
        den = wa + wb
        out = np.empty(np.broadcast_shapes(a.shape, b.shape), a.dtype)
        # den == 0: neither side sees a key (the identity); a nan den (a nan lse) stays nan
        safe = np.where(den == 0, 1, den)
        out["o"] = np.where(den == 0, 0, (wa * a["o"] + wb * b["o"]) / safe)
        out["lse"] = np.where(den == 0, -np.inf, shift + np.log(safe))
    return out


# The aggregation operations ⊕ (binary, associative, commutative, elementwise). sum, max and
# min act on the output's own values; ``lse`` acts on (o, lse) pairs (:func:`lse_pair_dtype`):
# a spec aggregated with it has its partial blocks computed as pairs, and the full aggregate
# is finalized to the output's dtype (:func:`finalize`), so the sequence-split attention of
# eins/ops/attention.py combines exactly.
AGG_FUNCS: dict[str, Callable] = {
    "sum": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "lse": _lse_combine,
    # the log-sum-exp of a union of disjoint key sets from each set's (attention_fwd's saved
    # lse under a key split, eins/ops/attention_bwd.py); -inf is its identity
    "logaddexp": np.logaddexp,
}
# the ⊕ an einsum-like Signature may name (``lse`` needs a kernel that returns pairs)
SIGNATURE_AGGS = ("sum", "max", "min")
# ⊕ whose partials have their own element type: op -> output dtype -> partial dtype
PAIR_AGGS: dict[str, Callable] = {"lse": lse_pair_dtype}


def partial_dtype(op: str | None, dtype) -> np.dtype:
    """The dtype of a partial block (one still to be ⊕-combined) of an output of ``dtype``."""
    return PAIR_AGGS[op](dtype) if op in PAIR_AGGS else np.dtype(dtype)


def partial_itemsize(op: str | None, dtype) -> int:
    """Bytes per element of a partial block: what the aggregation moves."""
    return partial_dtype(op, dtype).itemsize


def atom_itemsize(spec, j: int, dtype) -> int:
    """Bytes per element of output ``j`` of ``spec`` as its blocks are written and moved:
    the output dtype's, or a partial's when the output is aggregated from partials whose ⊕
    has an element type of its own (attention's (o, lse) pairs; the overlay's rule)."""
    op = spec.aggs[j]
    if op is not None and max(spec.multiplicity(j).values(), default=1) > 1:
        return partial_itemsize(op, dtype)
    return np.dtype(dtype).itemsize


def sums_in_float32(op: str, dtype) -> bool:
    """Whether ⊕ ``op`` over blocks of ``dtype`` accumulates in float32 and rounds once: a
    sum of 16-bit floats (float16, bfloat16), as the GPU's ⊕ kernels do (their ``ACC``)."""
    dt = np.dtype(dtype)
    return op == "sum" and dt.itemsize == 2 and dt.kind not in "iub"


def aggregate(op: str, blocks):
    """⊕ over a list of equally shaped blocks (partials, for ``lse``: see :func:`finalize`).
    A sum of float16 or bfloat16 blocks accumulates in float32 and is rounded once at the
    end (:func:`sums_in_float32`), so every backend combines the same way."""
    f = AGG_FUNCS[op]
    dt = getattr(blocks[0], "dtype", None)
    if dt is not None and sums_in_float32(op, dt):
        acc = np.asarray(blocks[0], np.float32)
        for b in blocks[1:]:
            acc = acc + np.asarray(b, np.float32)
        return acc.astype(dt)
    acc = blocks[0]
    for b in blocks[1:]:
        acc = f(acc, b)
    return acc


def finalize(op: str | None, block, dtype):
    """A ⊕-combined block as a value of ``dtype``: the ``o`` of an ``lse`` pair, cast; a block
    that already has ``dtype`` (every other ⊕, or a partial kept as a pair) unchanged."""
    dtype = np.dtype(dtype)
    if block.dtype == dtype:
        return block
    if op in PAIR_AGGS and is_lse_pair(block.dtype) and not is_lse_pair(dtype):
        return block["o"].astype(dtype)
    return block.astype(dtype)   # pairs into pairs of another float: field by field


def box_counts(boxes: list) -> dict[Box, int]:
    """{box: how often it occurs in ``boxes``}, in first-appearance order, the first of
    equal boxes as the key. Counted by object first (a spec's producer repeats one Box
    object across the function specifications sharing it: at 1,024 devices a thousand
    entries, a few distinct), so only distinct objects are hashed by value."""
    objs = {id(b): b for b in boxes}
    out: dict = {}
    for i, n in Counter(map(id, boxes)).items():
        b = objs[i]
        out[b] = out.get(b, 0) + n
    return out


@fast_init
@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """Definition 3.5: input boxes -> output boxes, each a projection of the whole type."""

    inputs: tuple[Box, ...]
    outputs: tuple[Box, ...]

    def __repr__(self):
        ins = " x ".join(map(repr, self.inputs))
        outs = " x ".join(map(repr, self.outputs))
        return f"{ins} -> {outs}"


@dataclass(frozen=True, slots=True)
class JoinAggSpec:
    """Definition 3.6: a set of function specifications, with ⊕ (``aggs[j]``, a key of
    ``AGG_FUNCS``, or None when the j-th output is never aggregated) per output."""

    fspecs: tuple[FunctionSpec, ...]
    aggs: tuple[str | None, ...]

    def __len__(self):
        return len(self.fspecs)

    def out_tiling(self, j: int = 0) -> tuple[Box, ...]:
        """out(J): the distinct j-th output boxes, in first-appearance order."""
        return tuple(box_counts([f.outputs[j] for f in self.fspecs]))

    def in_blocks(self, k: int) -> tuple[Box, ...]:
        """in_k(J): the distinct k-th input boxes, in first-appearance order."""
        return tuple(box_counts([f.inputs[k] for f in self.fspecs]))

    def multiplicity(self, j: int = 0) -> dict[Box, int]:
        """How many function specifications produce each distinct j-th output box (m)."""
        return box_counts([f.outputs[j] for f in self.fspecs])

    def check_tiling(self, out_shapes) -> None:
        """The tiling condition of Definition 3.6 for every output."""
        for j, shape in enumerate(out_shapes):
            err = tiling_error(self.out_tiling(j), Box.full(shape))
            if err:
                raise EinsError(f"output {j}: {err}")


Intervals = dict[str, tuple[tuple[int, int], ...]]

_new, _set = object.__new__, object.__setattr__   # a checked Box's fields, set directly


@dataclass(frozen=True)
class Indexing:
    """An operator's named indices (ordered, with extents), the shardable ones, and its spec
    producer. ``spec(intervals)`` fills unmentioned indices with one whole interval."""

    extents: dict[str, int]
    shardable: dict[str, object]          # name -> "any" | tuple of allowed cut positions
    producer: Callable[[Intervals], JoinAggSpec]
    # name -> (output j, dimension d) it indexes first, or None for a contracted/reduced
    # index; None when the operator did not say (eins.ir.text names indices from it)
    dims: dict | None = None
    # name -> count -> intervals (or None): how the enumerator splits that index into
    # ``count`` pieces, for indices whose positions carry unequal work (causal attention's
    # sequence); other indices get near-equal lengths (enumerate_specs.balanced_intervals)
    balance: dict = field(default_factory=dict)
    # name -> f(x): the work of that index's positions [0, x), in the unit ``balance``
    # equalizes (causal attention: the visible (query, key) pairs of query rows [0, x)), for
    # cuts that weigh it against other work (eins/passes/blockcut.py)
    work: dict = field(default_factory=dict)

    def full(self, intervals: Intervals) -> Intervals:
        """``intervals`` with every unmentioned index as one whole interval (no checks)."""
        out = {n: ((0, e),) for n, e in self.extents.items()}
        out.update((n, tuple(iv)) for n, iv in intervals.items())
        return out

    def spec(self, intervals: Intervals) -> JoinAggSpec:
        for n, iv in intervals.items():
            if n not in self.shardable and len(iv) > 1:
                raise EinsError(f"index {n!r} is not shardable")
        return self.producer(self.full(intervals))


_SIG = re.compile(r"^\s*([^|]*?)\s*->\s*([^|]*?)\s*(?:\|\s*(.*))?$")


@dataclass(frozen=True)
class Signature:
    """An einsum-like signature such as ``"ij,jk->ik | sum(j)"``.

    Each character names one dimension's index; ``_`` marks a dimension that is not indexed
    (broadcast of size 1, or kept whole). Indices that appear in inputs but in no output are
    contracted and aggregated with the op named after ``|`` (default ``sum``)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    agg: str = "sum"

    @staticmethod
    def parse(text: str) -> "Signature":
        m = _SIG.match(text)
        if not m:
            raise EinsError(f"malformed signature {text!r}")
        ins = tuple(s.strip() for s in m.group(1).split(","))
        outs = tuple(s.strip() for s in m.group(2).split(","))
        agg = "sum"
        if m.group(3):
            am = re.match(r"(\w+)\s*\(\s*(\w*)\s*\)$", m.group(3).strip())
            if not am or am.group(1) not in SIGNATURE_AGGS:
                raise EinsError(f"malformed aggregation in signature {text!r}")
            agg = am.group(1)
            out_idx = set("".join(outs))
            contracted = {c for c in "".join(ins) if c != "_" and c not in out_idx}
            if am.group(2) and set(am.group(2)) != contracted:
                raise EinsError(f"signature {text!r} aggregates over {am.group(2)!r}, but its "
                                f"contracted indices are {''.join(sorted(contracted))!r}")
        return Signature(ins, outs, agg)


def _small_ints(maps, shape, used, intervals) -> bool:
    """Whether every bound an operand's maps give is a Python int of magnitude below 2**62
    (then int64 arithmetic gives the same ints)."""
    if not all(type(n) is int and abs(n) < 2**62 for n in shape):
        return False
    for m in maps:
        if m is None:
            continue
        name, scale, off = m
        if type(scale) is not int or type(off) is not int:
            return False
        ends = [x for iv in intervals[name] for x in iv]
        if not all(type(x) is int for x in ends) or \
                max(map(abs, ends)) * abs(scale) + abs(off) >= 2**62:
            return False
    return True


def _product_boxes(maps, shape, used, intervals, sizes) -> list:
    """The boxes of one operand per combination of the intervals of ``used`` (in
    itertools.product order), bounds ``a * scale + offset`` computed per dimension over all
    combinations at once; each box built unchecked (bounds already in order)."""
    total = math.prod(sizes)
    at = np.arange(total)
    pick, stride = {}, total
    for n, c in zip(used, sizes):
        stride //= c
        pick[n] = (at // stride) % c
    lo = np.empty((total, len(maps)), dtype=np.int64)
    hi = np.empty((total, len(maps)), dtype=np.int64)
    for d, (m, n) in enumerate(zip(maps, shape)):
        if m is None:
            lo[:, d], hi[:, d] = 0, n
        else:
            name, scale, off = m
            iv = np.asarray(intervals[name], dtype=np.int64)[pick[name]]
            lo[:, d] = iv[:, 0] * scale + off
            hi[:, d] = iv[:, 1] * scale + off
    out = []
    for l, h in zip(lo.tolist(), hi.tolist()):
        b = _new(Box)
        _set(b, "lo", tuple(l))
        _set(b, "hi", tuple(h))
        out.append(b)
    return out


def signature_indexing(sig: Signature | str, in_shapes, out_shapes,
                       shardable: dict[str, object] | None = None) -> Indexing:
    """Indexing derived from a signature. By default every named index is shardable ``any``;
    pass ``shardable`` to restrict (an index left out is never split)."""
    if isinstance(sig, str):
        sig = Signature.parse(sig)
    extents: dict[str, int] = {}
    for subs, shape in list(zip(sig.inputs, in_shapes)) + list(zip(sig.outputs, out_shapes)):
        if len(subs) != len(shape):
            raise EinsError(f"signature {subs!r} does not match shape {tuple(shape)}")
        for c, n in zip(subs, shape):
            if c == "_":
                continue
            if extents.setdefault(c, n) != n:
                raise EinsError(f"index {c!r} has extents {extents[c]} and {n}")
    if shardable is None:
        shardable = {c: "any" for c in extents}

    def maps(subs):
        return [None if c == "_" else (c, 1, 0) for c in subs]

    return affine_indexing(extents, shardable, [maps(s) for s in sig.inputs],
                           [maps(s) for s in sig.outputs], in_shapes, out_shapes, sig.agg)


# (an operand's maps, its indices numbered in order, and shape; its indices' intervals;
# how the other split indices repeat its boxes) -> its box per function specification: the
# boxes depend on these alone, so operands of one layout (a block's activations cut along
# the tokens, across its eqns and across calls cut alike; its weights, never cut) share one
# list of Box objects, built once (within a call that re-cuts a plan, for that call:
# eins.ir.memo); at most 4,096 lists and 2^18 boxes in all (a plan on 512 devices keeps
# lists of thousands: the count alone let it hold ~67 MB after planning)
OPERAND_BOXES = Memo("operand boxes", 4096, weight=len, room=1 << 18)


def affine_indexing(extents, shardable, in_maps, out_maps, in_shapes, out_shapes,
                    agg="sum") -> Indexing:
    """An Indexing whose boxes are affine in the index intervals (signatures are the case
    ``scale = 1, offset = 0``).

    ``in_maps[k][d]`` / ``out_maps[j][d]`` is None (the dim is kept whole) or
    ``(name, scale, offset)``: an interval ``[a, b)`` of index ``name`` covers
    ``[a*scale + offset, b*scale + offset)`` of that dim. Indices that appear in no output
    are aggregated with ``agg`` when split. One FunctionSpec per combination of intervals.
    """
    names = list(extents)
    out_names = {m[0] for maps in out_maps for m in maps if m is not None}
    contracted = [n for n in names if n not in out_names]

    # scales >= 0 map ordered intervals to ordered bounds: boxes built from intervals
    # checked once (below) skip Box's own checks, most of building a thousand-device spec
    ascending = all(m is None or m[1] >= 0 for maps in (*in_maps, *out_maps) for m in maps)

    def box(maps, shape, choice, checked):
        lo, hi = [], []
        for m, n in zip(maps, shape):
            if m is None:
                lo.append(0)
                hi.append(n)
            else:
                name, scale, off = m
                a, b = choice[name]
                lo.append(a * scale + off)
                hi.append(b * scale + off)
        if not checked:
            return Box(tuple(lo), tuple(hi))
        out = _new(Box)
        _set(out, "lo", tuple(lo))
        _set(out, "hi", tuple(hi))
        return out

    def uses(maps) -> list:   # the indices an operand's maps read, in ``names`` order
        return [n for n in names if any(m is not None and m[0] == n for m in maps)]

    in_used, out_used = [uses(m) for m in in_maps], [uses(m) for m in out_maps]

    def layout(maps, shape, used):   # an operand's maps with its indices as positions
        return (tuple(None if m is None else (used.index(m[0]), m[1], m[2]) for m in maps),
                tuple(shape))

    in_keys = [layout(*a) for a in zip(in_maps, in_shapes, in_used)]
    out_keys = [layout(*a) for a in zip(out_maps, out_shapes, out_used)]

    def operand_boxes(maps, shape, used, intervals, counts, total, key):
        """One operand's box per function specification (in itertools.product order of
        ``names``): each distinct box built once, from the intervals of the indices its maps
        ``used`` (an operand missing a split index repeats its boxes: on a thousand devices
        most function specifications share their operands' boxes). An operand of the same
        layout (``key``), of any eqn or call, with the same intervals takes the same boxes
        (OPERAND_BOXES): those of an activation cut along its tokens, say, whatever its indices
        are named."""
        try:
            ivs = tuple(intervals[n] for n in used)
            # where the split indices it misses repeat its boxes, in which order
            fill = None if math.prod(map(len, ivs)) == total else \
                tuple((n in used, c) for n, c in zip(names, counts))
            key = (key, ivs, fill)
            hit = OPERAND_BOXES.get(key)
        except TypeError:   # intervals given as lists: not kept
            key = hit = None
        if hit is not None:
            return hit
        boxes = _operand_boxes(maps, shape, used, intervals, counts, total)
        if key is not None:
            OPERAND_BOXES.put(key, boxes)
        return boxes

    def _operand_boxes(maps, shape, used, intervals, counts, total):
        checked = ascending and all(a <= b for n in used for a, b in intervals[n])
        sizes = [len(intervals[n]) for n in used]
        if checked and math.prod(sizes) > 16 and _small_ints(maps, shape, used, intervals):
            boxes = _product_boxes(maps, shape, used, intervals, sizes)
        else:
            boxes = [box(maps, shape, dict(zip(used, combo)), checked)
                     for combo in itertools.product(*(intervals[n] for n in used))]
        if len(boxes) == total:
            return boxes
        if len(boxes) == 1:   # an operand no split index cuts (a weight)
            return boxes * total
        at = np.arange(total)
        idx = np.zeros(total, dtype=np.int64)
        stride = total
        for n, c in zip(names, counts):
            stride //= c
            if n in used:
                idx = idx * c + (at // stride) % c
        return [boxes[i] for i in idx.tolist()]

    def producer(intervals: Intervals) -> JoinAggSpec:
        counts = [len(intervals[n]) for n in names]
        total = math.prod(counts)
        ins = [operand_boxes(m, s, u, intervals, counts, total, k)
               for m, s, u, k in zip(in_maps, in_shapes, in_used, in_keys)]
        outs = [operand_boxes(m, s, u, intervals, counts, total, k)
                for m, s, u, k in zip(out_maps, out_shapes, out_used, out_keys)]
        # per function specification its boxes: the operands' lists transposed
        fspecs = [FunctionSpec(i, o) for i, o in zip(zip(*ins) if ins else [()] * total,
                                                      zip(*outs) if outs else [()] * total)]
        split = any(len(intervals[c]) > 1 for c in contracted)
        return JoinAggSpec(tuple(fspecs), tuple(agg if split else None for _ in out_shapes))

    dims = {n: next(((j, d) for j, maps in enumerate(out_maps)
                     for d, m in enumerate(maps) if m is not None and m[0] == n), None)
            for n in extents}
    return Indexing(dict(extents), dict(shardable), producer, dims)
