"""Core value types: dtypes, tensor types (Definition 3.1), boxes and grids.

``Box`` is the paper's tensor type with explicit lower and upper bounds (half-open);
a whole, zero-bounded tensor of shape ``s`` is ``Box.full(s)``. ``Grid`` is a tiling that is
a product of per-dimension cut points; the overlay of two grids (Section 5.3) unions them.
"""
from __future__ import annotations

import bisect
import itertools
import math
import operator
from dataclasses import dataclass

import numpy as np

from eins.errors import DTypeError, GpuError
from eins.ir.slots import fast_init

try:  # bfloat16 for numpy, as JAX does it
    import ml_dtypes

    bfloat16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # an extra (eins[bf16], and the GPU and test extras): as_dtype says so
    bfloat16 = None

_NAMES = {
    "float16": np.dtype(np.float16), "f16": np.dtype(np.float16), "half": np.dtype(np.float16),
    "float32": np.dtype(np.float32), "f32": np.dtype(np.float32), "float": np.dtype(np.float32),
    "float64": np.dtype(np.float64), "f64": np.dtype(np.float64), "double": np.dtype(np.float64),
    # (numpy's "i8" and "u8" are 8-byte ints: int8 and uint8 go by their names only)
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),   # int8 with uint8 promotes to it
    "int32": np.dtype(np.int32), "i32": np.dtype(np.int32),
    "int64": np.dtype(np.int64), "i64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_), "bool_": np.dtype(np.bool_),
}
if bfloat16 is not None:
    _NAMES.update({"bfloat16": bfloat16, "bf16": bfloat16})

SUPPORTED_DTYPES = tuple(dict.fromkeys(_NAMES.values()))
FLOAT_DTYPES = tuple(d for d in SUPPORTED_DTYPES if d.kind in "fV" or d == bfloat16)
# how the "unsupported dtype" errors (here and gpu_ops.numpy_dtype) list what eins computes in
SUPPORTED_NAMES = [d.name for d in SUPPORTED_DTYPES]


def as_dtype(d) -> np.dtype:
    """Normalize a dtype given as a numpy dtype, a numpy scalar type or a name."""
    if isinstance(d, str):
        if d in _NAMES:
            return _NAMES[d]
        if d in ("bfloat16", "bf16"):   # only without ml_dtypes
            raise DTypeError(f"dtype {d!r} needs the ml_dtypes package (numpy has no "
                             f"bfloat16): pip install ml_dtypes, or eins's extra 'eins[bf16]'")
        try:   # numpy's other spellings of a supported dtype: "f4", "<f8", "i8", "?"
            nd = np.dtype(d)
        except TypeError:
            nd = None
        if nd is None or nd.newbyteorder("=") not in SUPPORTED_DTYPES:
            what = f"{d!r}" if nd is None or nd.name == d else f"{d!r} ({nd.name})"
            raise DTypeError(f"unsupported dtype {what}; supported: "
                             f"{sorted(set(_NAMES))}") from None
    else:
        try:
            nd = np.dtype(d)
        except TypeError:
            raise DTypeError(f"unsupported dtype {d!r:.80}; supported: "
                             f"{SUPPORTED_NAMES}") from None
    if nd not in SUPPORTED_DTYPES and nd.newbyteorder("=") in SUPPORTED_DTYPES:
        native = nd.newbyteorder("=")
        raise DTypeError(f"dtype {nd.str!r} ({native.name}) is in the non-native byte order; "
                         f"eins computes in the machine's: pass x.astype({native.str!r})")
    if nd not in SUPPORTED_DTYPES:
        raise DTypeError(
            f"unsupported dtype {nd.name!r}; supported: "
            f"{SUPPORTED_NAMES}")
    return nd


def is_python_scalar(x) -> bool:
    """Whether ``x`` is a Python number (bool, int, float, complex; not a numpy scalar).
    Python numbers are weakly typed (NEP 50): they become literals of the program, not
    inputs. complex counts so that every Python number takes one path; eins has no complex
    dtype, so using one raises DTypeError (:func:`eins.ops.elementwise.weak_dtype`)."""
    return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


def is_torch_tensor(x) -> bool:
    """A torch tensor, recognized without importing torch."""
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def check_torch_readable(t, what: str = "a value") -> None:
    """A torch tensor whose data eins can read: dense (torch.strided) and with data (not on
    the meta device); else a GpuError that calls it ``what`` (``"argument 0"``), rather
    than torch's own error from deep inside the conversion."""
    import torch  # optional: only a torch tensor reaches here
    if t.layout != torch.strided:
        raise GpuError(f"{what} is a torch tensor of layout {t.layout}; eins reads dense "
                       f"tensors (torch.strided): pass x.to_dense()")
    if t.device.type == "meta":
        raise GpuError(f"{what} is a torch tensor on the meta device: it has shape and "
                       f"dtype but no data (use eins.ShapeDtype and .lower() to plan without "
                       f"data)")


def torch_to_numpy(t, what: str = "a value") -> np.ndarray:
    """A torch tensor's data as a numpy array on the host: no autograd (nn.Parameter), a
    lazy negation resolved, bfloat16 through its bits (torch's .numpy() refuses all three),
    a CUDA tensor copied to the host. The one conversion of the tracer (a torch tensor used
    as a constant), eins.jit, the generated numpy programs and the GPU runtime; a sparse
    or meta tensor is an error naming it as ``what`` (:func:`check_torch_readable`)."""
    import torch  # optional: only a torch tensor reaches here
    check_torch_readable(t, what)
    t = t.detach().resolve_neg().resolve_conj().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy()


def is_float(d) -> bool:
    d = np.dtype(d)
    return d.kind == "f" or d == bfloat16


def dtype_name(d) -> str:
    return np.dtype(d).name


_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)


def result_dtype(*dtypes, op: str = "promote") -> np.dtype:
    """The one dtype promotion rule of eins: numpy's, plus bfloat16 (which numpy cannot
    promote with float16 or ints): bfloat16 behaves as float16 would, except that bfloat16
    with float16 gives float32 (neither holds the other; JAX's rule too). Every operator
    family uses it. Raises DTypeError naming ``op`` when the dtypes do not promote."""
    dts = [np.dtype(d) for d in dtypes]
    try:
        if bfloat16 is not None and bfloat16 in dts:
            others = [d for d in dts if d != bfloat16]
            if not others:
                return bfloat16
            res = as_dtype(np.result_type(_F16, *others))
            if res == _F16:
                return _F32 if _F16 in others else bfloat16
            return res
        return as_dtype(np.result_type(*dts))
    except (TypeError, np.exceptions.DTypePromotionError, DTypeError):
        pass
    # numpy does not promote them, or promotes them to a dtype eins does not support: name
    # the operand that brought it in (complex64, a string, a datetime), not what numpy made
    for d in dts:
        try:
            as_dtype(d)
        except DTypeError as bad:
            raise DTypeError(f"{op}: an operand's {bad}") from None
    # not reached: eins's dtypes promote among themselves (tests/test_errors.py checks)
    raise DTypeError(f"{op}: dtypes {[d.name for d in dts]} do not promote to a dtype eins "
                     f"supports")


@dataclass(frozen=True, slots=True)
class TensorType:
    """Shape and dtype of a whole (zero-bounded) tensor; the abstract value while tracing."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __repr__(self):
        return f"{dtype_name(self.dtype)}[{','.join(map(str, self.shape))}]"


@fast_init
@dataclass(frozen=True, slots=True)
class Box:
    """Definition 3.1: a tensor type with lower bounds ``lo`` (inclusive) and upper bounds
    ``hi`` (exclusive) per dimension."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    def __post_init__(self):
        # C-level map, no generator: boxes are made by the thousand (a call's pieces, a plan)
        if len(self.lo) != len(self.hi) or any(map(operator.gt, self.lo, self.hi)):
            raise ValueError(f"malformed box lo={self.lo} hi={self.hi}")

    @staticmethod
    def full(shape) -> "Box":
        return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def rank(self) -> int:
        return len(self.lo)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(operator.sub, self.hi, self.lo))

    @property
    def size(self) -> int:
        """|I(T)|, the number of indices (elements)."""
        # map over C's subtraction: no generator frame (a million calls planning 1,024 GPUs)
        return math.prod(map(operator.sub, self.hi, self.lo))

    def contains(self, other: "Box") -> bool:
        # C-level maps, no generator: a pipelined re-cut asks for every part it pieces
        return all(map(operator.le, self.lo, other.lo)) and \
            all(map(operator.le, other.hi, self.hi))

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(map(max, self.lo, other.lo))   # C-level maps: a plan's reads take many
        hi = tuple(map(min, self.hi, other.hi))
        if self.rank and any(map(operator.ge, lo, hi)):
            return None
        return Box(lo, hi)

    def relative_to(self, outer: "Box") -> tuple[slice, ...]:
        """Slices that cut this box out of an array holding ``outer``."""
        return tuple(slice(l - o, h - o) for l, h, o in zip(self.lo, self.hi, outer.lo))

    def __repr__(self):
        return "[" + ",".join(f"{l}:{h}" for l, h in zip(self.lo, self.hi)) + "]"


def tiling_error(boxes, whole: Box) -> str | None:
    """Why ``boxes`` do not tile ``whole`` (each inside it, none overlapping another,
    together all of it), or None when they do. A box given twice overlaps itself."""
    boxes = tuple(boxes)
    if sum(b.size for b in boxes) != whole.size:
        return f"blocks {boxes} do not tile {whole}"
    if not whole.rank:
        return None
    lo = np.array([b.lo for b in boxes], dtype=np.int64).reshape(len(boxes), whole.rank)
    hi = np.array([b.hi for b in boxes], dtype=np.int64).reshape(len(boxes), whole.rank)
    if (lo < np.array(whole.lo)).any() or (hi > np.array(whole.hi)).any():
        return f"blocks {boxes} do not tile {whole}"
    if len(boxes) < 2 or _covered_once(lo, hi):
        return None
    # pairwise overlaps at once (a plan at p = 72 has thousands of pairs per eqn); the
    # grid count above already cleared the common case, so this names an overlapping pair
    ext = np.minimum(hi[:, None], hi[None]) - np.maximum(lo[:, None], lo[None])
    inter = np.clip(ext, 0, None).prod(axis=2)
    np.fill_diagonal(inter, 0)
    if inter.any():
        x, y = (int(t[0]) for t in np.nonzero(inter))
        return f"blocks {boxes[x]} and {boxes[y]} overlap"
    return None


def _covered_once(lo, hi) -> bool:
    """Whether every cell of the grid cut at the boxes' bounds lies in exactly one box: then
    no two boxes overlap (an overlap is a union of such cells). Counted with a difference
    array (each box adds at its 2**rank corners, prefix sums along every axis), linear in
    the boxes where the pairwise test is quadratic (a concat of 1,024 blocks). False when
    not so, or when the grid has too many cells to count: the caller tests pairwise."""
    solid = (hi > lo).all(axis=1)   # an empty box overlaps nothing
    lo, hi = lo[solid], hi[solid]
    n = len(lo)
    cuts = [np.unique(np.concatenate([lo[:, d], hi[:, d]])) for d in range(lo.shape[1])]
    # left out: the dimensions where every non-empty box spans the same one interval
    dims = [d for d, c in enumerate(cuts) if len(c) > 2]
    if not dims:
        return n < 2
    cuts = [cuts[d] for d in dims]
    lo, hi, rank = lo[:, dims], hi[:, dims], len(dims)
    cells = math.prod(len(c) - 1 for c in cuts)
    if rank > 8 or cells > max(64 * n, 4096):
        return False
    ilo = [np.searchsorted(c, lo[:, d]) for d, c in enumerate(cuts)]
    ihi = [np.searchsorted(c, hi[:, d]) for d, c in enumerate(cuts)]
    diff = np.zeros(tuple(len(c) for c in cuts), dtype=np.int64)
    for corner in itertools.product((0, 1), repeat=rank):
        idx = tuple(ihi[d] if up else ilo[d] for d, up in enumerate(corner))
        np.add.at(diff, idx, -1 if sum(corner) % 2 else 1)
    for d in range(rank):
        np.cumsum(diff, axis=d, out=diff)
    return bool((diff[tuple(slice(0, -1) for _ in range(rank))] == 1).all())


@dataclass(frozen=True, slots=True)
class Grid:
    """A tiling that is a product of per-dimension cut points. ``cuts[d]`` starts at the
    dimension's lower bound and ends at its upper bound."""

    cuts: tuple[tuple[int, ...], ...]

    @staticmethod
    def of_boxes(boxes) -> "Grid":
        """The coarsest grid whose cut points include every box's bounds."""
        boxes = list(boxes)
        rank = boxes[0].rank
        cuts = tuple(
            tuple(sorted({b.lo[d] for b in boxes} | {b.hi[d] for b in boxes}))
            for d in range(rank))
        return Grid(cuts)

    def overlay(self, other: "Grid") -> "Grid":
        return Grid(tuple(tuple(sorted(set(a) | set(b))) for a, b in zip(self.cuts, other.cuts)))

    def boxes(self) -> list[Box]:
        per_dim = [list(zip(c[:-1], c[1:])) for c in self.cuts]
        # C-level maps, no generator per cell: an exchange's overlay asks on every re-cut
        first, second = operator.itemgetter(0), operator.itemgetter(1)
        return [Box(tuple(map(first, combo)), tuple(map(second, combo)))
                for combo in itertools.product(*per_dim)]

    def cells_within(self, box: Box) -> list[int]:
        """Positions in ``boxes()`` of the cells inside ``box``, whose bounds must be cut
        points (as every block's are in an overlay). Found by bisection: no scan over cells."""
        spans, stride = [None] * len(self.cuts), 1
        for d in reversed(range(len(self.cuts))):
            c = self.cuts[d]
            lo, hi = bisect.bisect_left(c, box.lo[d]), bisect.bisect_left(c, box.hi[d])
            if c[lo] != box.lo[d] or hi >= len(c) or c[hi] != box.hi[d]:
                raise ValueError(f"box {box} does not align with the grid's cuts {self.cuts}")
            spans[d] = (range(lo, hi), stride)
            stride *= len(c) - 1
        out = [0]   # row-major, the last dimension fastest (itertools.product's order)
        for r, s in spans:
            out = [o + i * s for o in out for i in r]
        return out

    def __repr__(self):
        return "Grid(" + " x ".join(str(len(c) - 1) for c in self.cuts) + ")"


def split_even(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """Near-equal intervals of [0, n): the first ``n % parts`` get one more element."""
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)
