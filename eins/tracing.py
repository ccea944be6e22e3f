"""Tracing pure Python functions into the SSA IR (eins.ir.program), and pytrees.

``trace(fn, args, kwargs)`` calls ``fn`` on :class:`Tracer` objects; every primitive call goes
through :func:`bind`, which applies the primitive's shape rule and records an ``Eqn``. Outside
a trace, ``bind`` runs the reference kernel eagerly on numpy arrays.
"""
from __future__ import annotations

import inspect
import math
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass

import numpy as np

from eins.errors import (DTypeError, EinsError, PromotionWarning, ShapeError,
                         TraceAttributeError, TraceError)
from eins.ir.primitive import PRIMITIVES, get_primitive
from eins.ir.program import Eqn, Literal, Program, Var
from eins.ir.pytree import (TreeDef, call_leaf_names, flatten_call,  # noqa: F401
                            tree_flatten, tree_unflatten)  # re-exported: eins.tracing's pytrees
from eins.ir.simplify import simplify
from eins.ir.rules import weak_dtype
from eins.ir.scalars import fold_scalar_casts, is_traced_scalar, scalar_dtype
from eins.ir.types import TensorType, as_dtype, is_python_scalar

_EINS_DIR = os.path.dirname(os.path.abspath(__file__))
_NUMPY_DIR = os.path.dirname(os.path.abspath(np.__file__))


# ----------------------------------------------------------------------------- shapes
def check_shape(shape, what) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints; anything else (2.5, '4', True, a bare int)
    is a ShapeError naming it: a mistake, not a size to round, parse or wrap."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise ShapeError(f"{what} shape must be a tuple of ints, got {shape!r}") from None
    for s in dims:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise ShapeError(f"{what} shape must be a tuple of ints, got {shape!r} "
                             f"(dimension {s!r} is a {type(s).__name__})")
    out = tuple(int(s) for s in dims)
    if any(s < 0 for s in out):
        raise ShapeError(f"{what} shape {out} has a negative dimension")
    return out


@dataclass(frozen=True)
class ShapeDtype:
    """Stands in for an array of this shape and dtype wherever one is accepted (tracing and
    planning without data)."""

    shape: tuple
    dtype: object = "float32"

    def __post_init__(self):
        shape = check_shape(self.shape, "ShapeDtype")
        object.__setattr__(self, "shape", shape)
        if self.dtype is None:  # np.dtype(None) would silently be float64
            raise DTypeError(f"ShapeDtype{shape}: dtype is None; give a dtype or its name "
                             f"('float32', 'bf16', ...)")
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
            return math.prod(self.shape)   # exact: np.prod in int64 wraps past 2**63


def abstractify(x, what="argument") -> TensorType:
    """The TensorType of an array-like argument; clear errors for anything else."""
    if isinstance(x, ShapeDtype):
        return TensorType(x.shape, x.dtype)
    if isinstance(x, Tracer):
        return x._var.type
    if isinstance(x, np.ndarray) or isinstance(x, np.generic):
        try:
            return TensorType(tuple(x.shape), as_dtype(x.dtype))
        except EinsError as e:
            raise type(e)(f"{what}: {e}") from None
    if hasattr(x, "__cuda_array_interface__") and hasattr(x, "dtype"):
        return TensorType(tuple(x.shape), as_dtype(x.dtype))
    raise TraceError(f"{what} of type {type(x).__name__} is not an array, ShapeDtype or "
                     f"Python scalar: {x!r:.80}")


# ----------------------------------------------------------------------------- source lines
def user_frame() -> str | None:
    """``file:line`` of the innermost frame outside the eins package and numpy (the user's
    code; eins/models counts as user code)."""
    f = sys._getframe(1)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        in_eins = (path.startswith(_EINS_DIR + os.sep)
                   and os.sep + "models" + os.sep not in path[len(_EINS_DIR):])
        if not in_eins and path != _NUMPY_DIR and not path.startswith(_NUMPY_DIR + os.sep):
            return f"{os.path.basename(path)}:{f.f_lineno}"
        f = f.f_back
    return None


# ----------------------------------------------------------------------------- traced scalars
# a value of each Python scalar kind, for the NEP 50 rule (weak_dtype) of a traced one
_KIND_VALUE = {np.dtype(np.bool_): False, np.dtype(np.int64): 0, np.dtype(np.float64): 0.0}


def is_weak(x) -> bool:
    """Whether ``x`` is a weakly typed traced value (a traced Python scalar argument)."""
    return isinstance(x, Tracer) and x._weak is not None


def weak_cast(x: "Tracer", against) -> "Tracer":
    """Traced scalar ``x`` next to arrays of promoted dtype ``against`` (None: no array):
    cast to the dtype its literal would take (NEP 50), so ``x_f32 * s`` stays float32."""
    if against is None:
        return x
    kind = _KIND_VALUE.get(np.dtype(x.dtype))
    if kind is None:
        return x
    d = weak_dtype(kind, against)
    if d == x.dtype:
        return x
    out = bind("astype", x, dtype=d)
    x._ctx.weak_casts.add(id(x._ctx.eqns[-1]))   # the eqn fold_scalar_casts may fold
    return out


def static_hint(x, sep: str = " (", end: str = ")") -> str:
    """For a traced scalar: which argument it is and how to make it static (JAX's
    ``static_argnums`` / ``static_argnames``), between ``sep`` and ``end``; "" for any
    other value."""
    name = x._origin if isinstance(x, Tracer) else None
    if not name:
        return ""
    m = re.match(r"(?:argument (\d+)|keyword argument ('[^']*'))", name)
    how = (f"static_argnums=({m.group(1)},)" if m and m.group(1) else
           f"static_argnames=({m.group(2)},)" if m else "static_argnums")
    return (f"{sep}{name} is a Python scalar traced as a runtime value (a new value reuses "
            f"the program); to use it as a static value (a shape, an axis, a parameter, an "
            f"if), mark it static: {how} on eins.jit / eins.distribute{end}")


# ----------------------------------------------------------------------------- tracing
class TraceContext:
    def __init__(self):
        self.live = False   # while its function runs: a Tracer of it may be used
        self.eqns: list[Eqn] = []
        self.weak_casts: set = set()   # ids of the eqns weak_cast made
        self.consts: list[tuple[Var, np.ndarray]] = []
        self._const_ids: dict[int, tuple[Var, np.ndarray]] = {}
        self._keep: list = []
        # what bind marks each new eqn: "fwd", or "bwd" while eins.autodiff emits a backward
        self.phase = "fwd"
        # id(eqn) -> its eins.checkpoint region (an int), for eqns recorded inside one
        self.remat: dict[int, int] = {}

    def const(self, arr: np.ndarray) -> Var:
        """The constant holding ``arr``'s value now. One array used again is one constant,
        unless its data changed in between (a buffer filled inside the traced function):
        each use reads the value the array has at that point, as plain Python would."""
        key = id(arr)
        hit = self._const_ids.get(key)
        if hit is not None and same_bytes(hit[1], arr):
            return hit[0]
        v = Var(TensorType(tuple(arr.shape), as_dtype(arr.dtype)))
        # A copy, as JAX does: mutating the array after tracing does not change the program.
        data = np.array(arr, copy=True)
        self._const_ids[key] = (v, data)
        self._keep.append(arr)  # keeps id(arr) unique while tracing
        self.consts.append((v, data))
        return v


_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` holds exactly ``a``'s data (shape, dtype and every element's bits: NaNs
    and signed zeros included), compared as unsigned ints of the itemsize: no copy of a
    non-contiguous ``b``: a weight used many times is compared each time."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    u = _UINTS.get(a.dtype.itemsize)
    if u is None:   # no dtype eins supports: compare the bytes
        return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    return bool(np.array_equal(a.view(u), b.view(u)))


class _Traces(threading.local):
    """The traces in progress, per thread: two threads tracing at once each see their own.
    An operator on traced values joins their trace, whichever thread runs it (a thread pool
    inside a traced function); one on plain arrays joins this thread's current trace."""

    def __init__(self):
        self.stack: list[TraceContext] = []


_TRACES = _Traces()


def current_trace() -> TraceContext | None:
    stack = _TRACES.stack
    return stack[-1] if stack else None


class Tracer:
    """A traced value. Supports Python's operators through eins.ops."""

    # _origin: for a Python scalar argument traced as a runtime value, and what only such
    # values compute (s * 2, s > 0), the argument's name as the user wrote it; else None.
    # _weak: the same where the dtype is the argument's own kind (not s > 0): weakly typed
    # (NEP 50), next to arrays it takes their dtype, as the literal would
    __slots__ = ("_var", "_ctx", "_weak", "_origin")
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """numpy ufuncs on traced arrays (``np.exp(x)``, ``ndarray + x``) run the eins
        operator of the same meaning; the others are a clear error."""
        prim = ufunc_primitive(ufunc.__name__)
        # the multi-output ufuncs and a few others are compositions of primitives
        composite = _np_api().COMPOSITE_UFUNCS.get(ufunc.__name__) if prim is None else None
        if method != "__call__" or kwargs or (prim is None and composite is None):
            way = prim if prim is not None else composite
            raise TraceError(f"{_np_api().ufunc_refusal(ufunc, method, kwargs, way)} "
                             f"(at {user_frame()})")
        if composite is not None:
            return composite(*inputs)
        # the operator's public function (NEP 50 scalars, its checks), else the primitive
        fn = getattr(_ops(), prim.name, None)
        return fn(*inputs) if fn is not None else bind(prim, *inputs)

    def __array_function__(self, func, types, args, kwargs):
        """numpy functions on traced arrays (``np.sum(x)``, ``np.reshape(x, s)``): see
        :mod:`eins.numpy_api`."""
        return _np_api().array_function(func, args, kwargs)

    def __array__(self, *args, **kwargs):
        raise TraceError(f"a traced array ({self._var.type!r}) has no concrete value to turn "
                         f"into a numpy array; use eins operators inside the traced function "
                         f"(at {user_frame()})")

    def __init__(self, var: Var, ctx: TraceContext, weak: str | None = None,
                 origin: str | None = None):
        self._var = var
        self._ctx = ctx
        self._weak = weak
        self._origin = origin or weak

    shape = property(lambda self: self._var.shape)
    dtype = property(lambda self: self._var.dtype)
    ndim = property(lambda self: len(self._var.shape))
    size = property(lambda self: self._var.type.size)

    def __repr__(self):
        # shown in every "got {value!r}" of a static parameter's check: say what to do
        return f"Tracer<{self._var.type!r}>{static_hint(self)}"

    def __reduce_ex__(self, protocol):
        raise TraceError(f"a traced array ({self._var.type!r}) cannot be pickled: it has no "
                         f"value while tracing; return it from the function and pickle the "
                         f"result (at {user_frame()})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """torch functions on traced arrays (``torch.relu(x)``): torch calls this for any
        argument that defines it; eins cannot run torch's operators while tracing."""
        name = getattr(func, "__name__", str(func))
        ours = getattr(_ops(), name, None) or getattr(_np_api(), name, None)
        hint = f"eins.{name}" if ours is not None else "the eins or numpy operator"
        raise TraceError(f"torch.{name} cannot run on a traced array; use {hint} inside "
                         f"the traced function (torch tensors are fine as arguments and "
                         f"constants) (at {user_frame()})")

    def __len__(self):
        if not self.shape:
            raise TraceError(f"len() of a 0-d traced array ({self._var.type!r}) (at "
                             f"{user_frame()})")
        return self.shape[0]

    def __bool__(self):
        raise TraceError(
            f"a traced array ({self._var.type!r}) has no concrete value; Python control flow "
            f"(if/while/bool) cannot depend on it: compute both branches and pick with "
            f"np.where(cond, a, b), or decide on static values (shapes, Python arguments)"
            f"{static_hint(self, '; ', '')} (at {user_frame()})")

    def _no_value(what):
        def f(self):
            raise TraceError(f"{what.format(f'a traced array ({self._var.type!r})')}: it has "
                             f"no concrete value while tracing{static_hint(self, '; ', '')} "
                             f"(at {user_frame()})")
        return f

    __float__ = _no_value("float() of {}")
    __int__ = _no_value("int() of {}")
    __index__ = _no_value("{} used as a Python index or size (a slice bound, range(), ...)")
    __complex__ = _no_value("complex() of {}")
    del _no_value

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    # arithmetic: defined in eins.ops; looked up late to avoid an import cycle
    def __add__(self, o): return _ops().add(self, o)
    def __radd__(self, o): return _ops().add(o, self)
    def __sub__(self, o): return _ops().sub(self, o)
    def __rsub__(self, o): return _ops().sub(o, self)
    def __mul__(self, o): return _ops().mul(self, o)
    def __rmul__(self, o): return _ops().mul(o, self)
    def __truediv__(self, o): return _ops().div(self, o)
    def __rtruediv__(self, o): return _ops().div(o, self)
    def __pow__(self, o): return _ops().pow(self, o)
    def __rpow__(self, o): return _ops().pow(o, self)
    def __matmul__(self, o): return _ops().matmul(self, o)
    def __rmatmul__(self, o): return _ops().matmul(o, self)
    def __neg__(self): return _ops().neg(self)
    def __pos__(self): return self
    def __abs__(self): return _ops().abs(self)
    def __lt__(self, o): return _ops().less(self, o)
    def __le__(self, o): return _ops().less_equal(self, o)
    def __gt__(self, o): return _ops().greater(self, o)
    def __ge__(self, o): return _ops().greater_equal(self, o)
    def __eq__(self, o): return _ops().equal(self, o)
    def __ne__(self, o): return _ops().not_equal(self, o)
    __hash__ = object.__hash__

    # numpy's meaning of the bitwise, shift, remainder and floor-division operators
    # (eins/ops/ufuncs.py): & | ^ ~ combine boolean masks as numpy's do
    def __and__(self, o): return _ops().bitwise_and(self, o)
    def __rand__(self, o): return _ops().bitwise_and(o, self)
    def __or__(self, o): return _ops().bitwise_or(self, o)
    def __ror__(self, o): return _ops().bitwise_or(o, self)
    def __xor__(self, o): return _ops().bitwise_xor(self, o)
    def __rxor__(self, o): return _ops().bitwise_xor(o, self)
    def __invert__(self): return _ops().invert(self)
    def __lshift__(self, o): return _ops().left_shift(self, o)
    def __rlshift__(self, o): return _ops().left_shift(o, self)
    def __rshift__(self, o): return _ops().right_shift(self, o)
    def __rrshift__(self, o): return _ops().right_shift(o, self)
    def __mod__(self, o): return _ops().remainder(self, o)
    def __rmod__(self, o): return _ops().remainder(o, self)
    def __floordiv__(self, o): return _ops().floor_divide(self, o)
    def __rfloordiv__(self, o): return _ops().floor_divide(o, self)
    def __divmod__(self, o): return _ops().floor_divide(self, o), _ops().remainder(self, o)
    def __rdivmod__(self, o): return _ops().floor_divide(o, self), _ops().remainder(o, self)

    def __getitem__(self, idx): return _ops().getitem(self, idx)

    @property
    def at(self):
        """JAX's functional update: ``x.at[idx].set(v)`` / ``.add(v)`` (eins.ops.gather)."""
        return _ops().at(self)

    def __setitem__(self, idx, value):
        raise TraceError(
            f"item assignment (x[{_shown_index(idx)}] = ...) on a traced array "
            f"({self._var.type!r}): traced arrays are immutable; build the new value instead, "
            f"x = x.at[{_shown_index(idx)}].set(value) or eins.where(mask, value, x) "
            f"(at {user_frame()})")

    def __getattr__(self, name):
        # only reached when normal lookup fails: numpy/torch methods eins does not trace
        if name.startswith("__") or name in ("_var", "_ctx"):
            raise AttributeError(name)   # protocols (hasattr(x, "__dlpack__")) stay silent
        hint = attr_hint(name)
        raise TraceAttributeError(
            f"a traced array ({self._var.type!r}) has no attribute {name!r}"
            f"{'; ' + hint if hint else ''} (at {user_frame()})")

    def __setattr__(self, name, value):
        if name in Tracer.__slots__:
            object.__setattr__(self, name, value)
            return
        raise TraceAttributeError(f"cannot set attribute {name!r} of a traced array "
                                  f"({self._var.type!r}) (at {user_frame()})")

    @property
    def T(self): return _ops().transpose(self)

    def transpose(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return _ops().transpose(self, axes or None)

    def reshape(self, *shape, order="C", copy=None):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _np_api().HANDLERS["reshape"](self, shape, order=order, copy=copy)

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        # a traced program is pure: every cast is a new value whatever order/copy say
        return _ops().astype(self, dtype)

    def swapaxes(self, axis1, axis2): return _np_api().HANDLERS["swapaxes"](self, axis1, axis2)

    # ndarray's reduction methods, with numpy's keywords (out, dtype, keepdims, ...)
    def sum(self, *a, **k): return _np_api().call("sum", (self,) + a, k)
    def mean(self, *a, **k): return _np_api().call("mean", (self,) + a, k)
    def max(self, *a, **k): return _np_api().call("max", (self,) + a, k)
    def min(self, *a, **k): return _np_api().call("min", (self,) + a, k)
    def var(self, *a, **k): return _np_api().call("var", (self,) + a, k)
    def std(self, *a, **k): return _np_api().call("std", (self,) + a, k)
    def argmax(self, *a, **k): return _np_api().call("argmax", (self,) + a, k)
    def argmin(self, *a, **k): return _np_api().call("argmin", (self,) + a, k)
    def argsort(self, *a, **k): return _np_api().call("argsort", (self,) + a, k)
    def take(self, *a, **k): return _np_api().call("take", (self,) + a, k)
    def prod(self, *a, **k): return _np_api().call("prod", (self,) + a, k)
    def cumsum(self, *a, **k): return _np_api().call("cumsum", (self,) + a, k)
    def cumprod(self, *a, **k): return _np_api().call("cumprod", (self,) + a, k)
    def any(self, *a, **k): return _np_api().call("any", (self,) + a, k)
    def all(self, *a, **k): return _np_api().call("all", (self,) + a, k)
    def clip(self, *a, **k): return _np_api().call("clip", (self,) + a, k)
    def round(self, *a, **k): return _np_api().call("round", (self,) + a, k)
    def squeeze(self, *a, **k): return _np_api().call("squeeze", (self,) + a, k)
    def repeat(self, *a, **k): return _np_api().call("repeat", (self,) + a, k)
    def ravel(self, *a, **k): return _np_api().call("ravel", (self,) + a, k)
    def flatten(self, *a, **k): return _np_api().call("ravel", (self,) + a, k)
    def nonzero(self, *a, **k): return _np_api().call("nonzero", (self,) + a, k)


_NO_VALUE = "it has no concrete value while tracing; return it from the function instead"
# the hints of the attributes no primitive answers for (each primitive declares its own:
# Primitive.attr_hints)
_ATTR_HINTS = {
    **dict.fromkeys(["item", "tolist", "tobytes", "numpy", "cpu", "cuda", "detach",
                     "block_until_ready", "copy", "fill", "data"], _NO_VALUE),
    "clamp": "use x.clip(lo, hi) or np.clip(x, lo, hi)",
    "nbytes": "use x.size * x.dtype.itemsize", "itemsize": "use x.dtype.itemsize",
}


def attr_hint(name: str) -> str:
    """What to use instead of numpy/torch attribute ``name`` of a traced array ("" when
    there is no hint): the primitives' own hints, then the general ones."""
    for p in PRIMITIVES.values():
        if name in p.attr_hints:
            return p.attr_hints[name]
    return _ATTR_HINTS.get(name, "")


def _shown_index(idx) -> str:
    parts = idx if isinstance(idx, tuple) else (idx,)

    def one(i):
        if isinstance(i, slice):
            return ":".join("" if v is None else repr(v) for v in (i.start, i.stop)) + (
                f":{i.step!r}" if i.step is not None else "")
        return "..." if i is Ellipsis else "<traced>" if isinstance(i, Tracer) else f"{i!r:.20}"
    return ", ".join(one(i) for i in parts)


_INSTALLED = {}  # "ops": eins.ops, "numpy": eins.numpy_api (see install_operators)


def install_operators(namespace, kind: str = "ops") -> None:
    """Make ``namespace`` the tracer's ``kind`` of operators: ``"ops"`` (the module
    ``eins.ops``: ``x + y`` on a Tracer calls ``namespace.add``), ``"numpy"`` (the module
    ``eins.numpy_api``: ``np.sum(x)`` and ``x.sum(...)``) or ``"autodiff"`` (the module
    ``eins.autodiff``, whose ``vjp`` the backward rules of backward primitives use). The operators live above the
    tracer, so they install themselves when imported (as JAX's lax defines its Tracer's
    operators) instead of the tracer importing them."""
    _INSTALLED[kind] = namespace


def _installed(kind: str):
    ns = _INSTALLED.get(kind)
    if ns is None:
        raise TraceError(f"no {kind} operators are installed for traced arrays: import eins")
    return ns


def operators(kind: str = "ops"):
    """An installed namespace (:func:`install_operators`): ``"ops"`` (``eins.ops``) or
    ``"autodiff"`` (``eins.autodiff``), for code below them that builds programs at trace
    time (the primitives' backward rules)."""
    return _installed(kind)


def _ops():
    return _installed("ops")


def _np_api():
    return _installed("numpy")


def ufunc_primitive(name: str):
    """The primitive numpy ufunc ``name`` means on a traced array (its ``ufuncs``), or
    None (see Tracer.__array_ufunc__)."""
    for p in PRIMITIVES.values():
        if name in p.ufuncs:
            return p
    return None


def bind(prim_name, *args, **params):
    """Apply a primitive (a registered name or a :class:`~eins.ir.primitive.Primitive`).
    Arguments are Tracers, numpy arrays or ``Literal``s. Returns one value (or a tuple for
    multi-output primitives: ``params`` may not change that)."""
    prim = get_primitive(prim_name)
    prim_name = prim.name
    ctx = None
    for a in args:
        if isinstance(a, Tracer):
            if ctx is None:
                ctx = a._ctx
            elif a._ctx is not ctx:
                raise TraceError(_leaked(prim_name, ended=False))
    if ctx is None:
        ctx = current_trace()
    elif not ctx.live:
        raise TraceError(_leaked(prim_name, ended=True))
    if ctx is None:
        # eager: run the reference kernel now
        vals = [np.asarray(a.value, a.dtype) if isinstance(a, Literal) else a for a in args]
        for v in vals:
            if isinstance(v, ShapeDtype):
                raise TraceError(f"{prim_name}: a ShapeDtype has no data; use eins.jit or "
                                 f"eins.make_ir to trace with it (at {user_frame()})")
        types = [abstractify(v, f"{prim_name} operand") for v in vals]
        _abstract(prim, types, params)  # same checks and messages as under tracing
        outs = prim.impl(*vals, **params)
        return outs[0] if len(outs) == 1 else tuple(outs)
    atoms = []
    for a in args:
        if isinstance(a, Tracer):
            atoms.append(a._var)
        elif isinstance(a, Literal):
            atoms.append(a)
        elif isinstance(a, (np.ndarray, np.generic)):
            atoms.append(ctx.const(np.asarray(a)))
        else:
            raise not_an_array(prim_name, a)
    for k, v in params.items():
        if any(isinstance(x, Tracer) for x in tree_flatten(v)[0]):
            x = next(x for x in tree_flatten(v)[0] if isinstance(x, Tracer))
            raise TraceError(f"{prim_name}: parameter {k} must be a static value, got a "
                             f"traced value {x!r} (at {user_frame()})")
    out_types = _abstract(prim, [a.type for a in atoms], params)
    outs = tuple(Var(t) for t in out_types)
    source = user_frame()
    ctx.eqns.append(Eqn(prim, tuple(atoms), outs, dict(params), source, ctx.phase))
    _promotion_check(prim_name, atoms, out_types, args, source)
    # what only traced scalars (and literals) compute comes from them (for the hint to mark
    # them static), and is weakly typed too where it keeps their dtype, as in JAX
    tr = [a for a in args if isinstance(a, Tracer)]
    src = (tr[0] if tr and all(a._origin for a in tr) and not any(
        isinstance(a, (np.ndarray, np.generic)) for a in args) else None)
    weak = src if src is not None and all(a._weak for a in tr) else None
    tracers = tuple(Tracer(v, ctx, weak._weak if weak is not None and v.dtype == weak.dtype
                           else None, src._origin if src is not None else None)
                    for v in outs)
    return tracers[0] if len(tracers) == 1 else tracers


_F64 = np.dtype(np.float64)
_PROMOTED: set = set()   # (user line, primitive) warned of already


def _promotion_check(prim_name, atoms, out_types, args, source) -> None:
    """Warn once per user line when an eqn makes float64 of arrays all 32-bit or narrower
    because a 64-bit scalar (a numpy float64 constant) joined them (numpy 2's rule)."""
    if not any(t.dtype == _F64 for t in out_types):
        return
    arrays = [a for a in atoms if a.shape != ()]
    scalars = [a for a, x in zip(atoms, args) if a.shape == () and a.dtype == _F64
               and not is_weak(x) and not isinstance(a, Literal)]
    if not arrays or not scalars or any(a.dtype.itemsize > 4 for a in arrays):
        return
    if (source, prim_name) in _PROMOTED:
        return
    _PROMOTED.add((source, prim_name))
    kinds = sorted({a.dtype.name for a in arrays})
    file, _, line = (source or "?:0").rpartition(":")
    warnings.warn_explicit(
        f"{prim_name} makes float64 from {' and '.join(kinds)} arrays because of a float64 "
        f"scalar (a numpy float64 such as np.sqrt(n) or np.float64(x): numpy 2 promotes the "
        f"whole result, doubling memory and time) (at {source}); write it as "
        f"np.float32(...) or a Python float, which takes the arrays' dtype",
        PromotionWarning, file or "?", int(line) if line.isdigit() else 0)


def not_an_array(op: str, x, what: str = "operand", shown: str = "") -> TraceError:
    """The error for ``x`` where operator ``op`` needs an array, naming the user's line; a
    list or tuple (nested lists of numbers passed as an array) gets what to do instead.
    ``shown``: what the message says ``x`` is not (after "is not an array")."""
    hint = ("; a list or tuple is a pytree, its numbers traced scalars, not an array: pass "
            "np.asarray(...) as the argument (or build it with eins.stack)"
            if isinstance(x, (list, tuple)) else "")
    where = user_frame()
    return TraceError(f"{op}: {what} of type {type(x).__name__} is not an array{shown}"
                      f"{f' (at {where})' if where else ''}{hint}")


def _leaked(what: str, ended: bool) -> str:
    """The error of a traced value used outside the trace that made it: kept (in a list or
    a global) from an earlier eins.jit / make_ir call, or mixed with another trace's."""
    where = user_frame()
    at = f" (at {where})" if where else ""
    if ended:
        return (f"{what}: a traced value was used after its trace ended (it was kept from an "
                f"earlier eins.jit or eins.make_ir call){at}; return it from the traced "
                f"function instead")
    return (f"{what}: a traced value from another trace leaked in (kept from an earlier or "
            f"enclosing eins.jit / eins.make_ir call){at}; pass it as an argument instead")


def _abstract(prim, types, params):
    try:
        return tuple(prim.abstract(*types, **params))
    except EinsError as e:
        where = user_frame()
        msg = str(e) + (f" (at {where})" if where else "")
        raise type(e)(msg) from None


def check_call(fn, args, kwargs):
    """A clear TraceError (naming the function's signature) instead of Python's bare
    TypeError when ``fn`` is called with the wrong number or names of arguments."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and the like: let the call itself complain
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(fn, "__name__", "fn")
        got = f"{len(args)} positional" + (f" and keyword {sorted(kwargs)}" if kwargs else "")
        raise TraceError(f"{name}{sig} called with {got} argument(s): {e}") from None


def trace(fn, args, kwargs=None, name=None):
    """Trace ``fn(*args, **kwargs)``. Array leaves (numpy arrays, ShapeDtype) become program
    inputs, and so do Python scalars (bool, int, float), as weakly typed 0-d inputs: a new
    value reuses the program, as in JAX (:func:`fold_scalar_casts` gives such an input the
    dtype it is used in). Returns (Program, in_treedef, out_treedef)."""
    kwargs = kwargs or {}
    leaves, in_tree = flatten_call(args, kwargs)
    ctx = TraceContext()
    in_vars, tracer_leaves = [], []
    names = None
    for i, x in enumerate(leaves):
        if is_traced_scalar(x):
            names = names or call_leaf_names(in_tree)
            v = Var(TensorType((), scalar_dtype(x, names[i])))
            in_vars.append(v)
            tracer_leaves.append(Tracer(v, ctx, weak=names[i]))
            continue
        if is_python_scalar(x):   # complex: a literal, which the operators refuse by name
            tracer_leaves.append(x)
            continue
        t = abstractify(x, f"argument {i} of {getattr(fn, '__name__', 'fn')}")
        v = Var(t)
        in_vars.append(v)
        tracer_leaves.append(Tracer(v, ctx))
    targs, tkwargs = tree_unflatten(in_tree, tracer_leaves)
    check_call(fn, targs, tkwargs)
    _TRACES.stack.append(ctx)
    ctx.live = True
    try:
        result = fn(*targs, **tkwargs)
    finally:
        ctx.live = False
        _TRACES.stack.pop()
    try:
        out_leaves, out_tree = tree_flatten(result)
    except TraceError as e:
        raise TraceError(f"{getattr(fn, '__name__', 'fn')} returned a {e}") from None
    out_vars = []
    for o in out_leaves:
        if isinstance(o, Tracer):
            if o._ctx is not ctx:
                raise TraceError(f"{getattr(fn, '__name__', 'fn')} returned a traced value "
                                 f"of another trace (kept from an earlier or enclosing "
                                 f"eins.jit / eins.make_ir call); compute it inside the "
                                 f"function or pass it in as an argument")
            out_vars.append(o._var)
        elif isinstance(o, (np.ndarray, np.generic)):
            try:
                out_vars.append(ctx.const(np.asarray(o)))
            except EinsError as e:
                raise type(e)(f"{getattr(fn, '__name__', 'fn')} returned a constant array "
                              f"output: {e}") from None
        else:
            raise TraceError(f"{getattr(fn, '__name__', 'fn')} returned a {type(o).__name__}; "
                             f"outputs must be arrays")
    in_vars, eqns, out_vars = fold_scalar_casts(in_vars, ctx.eqns, out_vars, ctx.weak_casts)
    # merged repeats and unused eqns never reach the planner (eins/ir/simplify.py)
    eqns, consts, out_vars = simplify(eqns, ctx.consts, out_vars)
    prog = Program(tuple(in_vars), eqns, tuple(out_vars), consts,
                   name or getattr(fn, "__name__", "fn"))
    return prog, in_tree, out_tree
