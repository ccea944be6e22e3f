"""Elementwise operators: unary math, binary arithmetic with numpy broadcasting, comparisons,
``where`` and ``astype``.

Every primitive is a pure map over aligned indices, so its join-agg specs (Section 3.3) come
from one einsum-like signature: the output's dims are indices ``a, b, c, ...``; an input dim
that is broadcast (size 1 against a larger output dim) is ``_`` (kept whole, never indexed);
a scalar (``Literal``, shape ``()``) has the empty subscript. Every index is shardable
``any`` and nothing is aggregated.

dtypes follow numpy 2 (NEP 50): a Python scalar is "weak" and takes the array's dtype
(``f16_array + 2.0`` stays float16); it becomes a ``Literal`` of that dtype before ``bind``.
Unary float functions on ints/bools promote as numpy's ufuncs do (bool -> float16,
ints -> float64). bfloat16 (ml_dtypes) does not promote with float16 in numpy; here the
pair promotes to float32, as in JAX's type lattice. Low-precision floats are computed in
float32 and rounded once, as GPU kernels do.
"""
from __future__ import annotations

import functools

import numpy as np

from eins.errors import DTypeError, ShapeError
from eins.ir.joinagg import signature_indexing
from eins.ir.program import Literal
from eins.ir.types import TensorType, as_dtype, is_python_scalar
from eins.ir.primitive import Primitive, register, register_gpu_lowering
from eins.ops._common import (BINARY, COMPARE, UNARY, broadcast_shape, compute_dtype,
                              float_dtype, index_name, negative_power_error, operands,
                              result_dtype, static_flag, user_errors, vectorized_erf,
                              weak_dtype)
from eins.tracing import Tracer, bind

__all__ = list(UNARY + BINARY + COMPARE) + ["where", "astype"]

_BOOL = np.dtype(np.bool_)
_F64 = np.dtype(np.float64)


# ----------------------------------------------------------------------------- broadcasting
def broadcast_shapes(op, *shapes):
    out = broadcast_shape(*shapes)
    if out is None:
        raise ShapeError(f"{op}: shapes {' and '.join(str(tuple(s)) for s in shapes)} do not "
                         f"broadcast")
    return out


def broadcast_signature(in_shapes, out_shape) -> str:
    """``"ab,_b->ab"`` style: inputs aligned to the right, broadcast dims are ``_``."""
    r = len(out_shape)
    names = [index_name(d) for d in range(r)]
    subs = []
    for s in in_shapes:
        off = r - len(s)
        subs.append("".join(names[off + d] if n == out_shape[off + d] else "_"
                            for d, n in enumerate(s)))
    return ",".join(subs) + "->" + "".join(names)


def elementwise_indexing(ins, outs, **params):
    """Every output index shardable ``any``; broadcast dims unindexed; nothing aggregated."""
    sig = broadcast_signature([t.shape for t in ins], outs[0].shape)
    return signature_indexing(sig, [t.shape for t in ins], [t.shape for t in outs])


# ----------------------------------------------------------------------------- unary
def _unary_rule(name, kind):
    def abstract(x: TensorType, **params):
        if kind == "float":
            return (TensorType(x.shape, float_dtype(x.dtype)),)
        if kind in ("same_nobool",) and x.dtype == _BOOL:
            raise DTypeError(f"{name}: not defined for dtype bool (operand shape {x.shape})")
        return (TensorType(x.shape, x.dtype),)
    return abstract


def _gelu(x, approximate=True):
    if approximate:  # Hendrycks & Gimpel's tanh form
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + vectorized_erf(np.asarray(x, np.float64) / np.sqrt(2)).astype(x.dtype))


def _sigmoid(x):
    # exp(-log(1 + exp(-x))) never overflows
    return np.exp(-np.logaddexp(0, -x))


_UNARY_DEFS = {
    # name: (kernel, dtype kind, flops per element)
    "neg": (np.negative, "same_nobool", 1),
    "abs": (np.abs, "same", 1),
    "exp": (np.exp, "float", 1),
    "log": (np.log, "float", 1),
    "sqrt": (np.sqrt, "float", 1),
    "rsqrt": (lambda x: 1 / np.sqrt(x), "float", 2),
    "square": (np.square, "same_nobool", 1),
    "tanh": (np.tanh, "float", 1),
    "sigmoid": (_sigmoid, "float", 4),
    "relu": (lambda x: np.maximum(x, x.dtype.type(0)), "same_nobool", 1),
    "gelu": (_gelu, "float", 10),
    "silu": (lambda x: x * _sigmoid(x), "float", 5),
    "cos": (np.cos, "float", 1),
    "sin": (np.sin, "float", 1),
}


def _register_unary(name, kernel, kind, per):
    abstract = _unary_rule(name, kind)

    @functools.lru_cache(maxsize=None)
    def dtypes(d):
        """(result, compute) dtypes for operand dtype ``d``: the shape rule's, once per dtype
        rather than once per block."""
        out = abstract(TensorType((), d))[0].dtype
        return out, compute_dtype(out)

    def impl(x, **params):
        x = np.asarray(x)
        out, cd = dtypes(x.dtype)
        with np.errstate(all="ignore"):  # log(0), sqrt(-1): inf/nan as numpy gives them
            # the kernel allocates its result: no cast copies when the dtypes already agree
            res = kernel(x.astype(cd, copy=False), **params)
            return (np.asarray(res).astype(out, copy=False),)

    register(Primitive(name, abstract, impl, lambda i, o, **p: per * o[0].size,
                       elementwise_indexing))

    if name == "gelu":   # its one static parameter; gelu() below checks it
        def fn(x, approximate=True):
            return bind(name, *operands(name, x), approximate=approximate)
    else:   # no keywords: fn(x, alpha=0.1) is refused, not traced and then ignored
        def fn(x):
            return bind(name, *operands(name, x))

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"Elementwise {name} (numpy semantics)."
    return user_errors(fn)


neg = _register_unary("neg", *_UNARY_DEFS["neg"])
abs = _register_unary("abs", *_UNARY_DEFS["abs"])  # noqa: A001 - eins.abs, like numpy's
exp = _register_unary("exp", *_UNARY_DEFS["exp"])
log = _register_unary("log", *_UNARY_DEFS["log"])
sqrt = _register_unary("sqrt", *_UNARY_DEFS["sqrt"])
rsqrt = _register_unary("rsqrt", *_UNARY_DEFS["rsqrt"])
square = _register_unary("square", *_UNARY_DEFS["square"])
tanh = _register_unary("tanh", *_UNARY_DEFS["tanh"])
sigmoid = _register_unary("sigmoid", *_UNARY_DEFS["sigmoid"])
relu = _register_unary("relu", *_UNARY_DEFS["relu"])
_gelu_fn = _register_unary("gelu", *_UNARY_DEFS["gelu"])
silu = _register_unary("silu", *_UNARY_DEFS["silu"])
cos = _register_unary("cos", *_UNARY_DEFS["cos"])
sin = _register_unary("sin", *_UNARY_DEFS["sin"])


@user_errors
def gelu(x, approximate=True):
    """GELU: ``approximate=True`` is the tanh form, ``False`` the exact ``x * Phi(x)``."""
    return _gelu_fn(x, approximate=static_flag("gelu", "approximate", approximate))


# ----------------------------------------------------------------------------- binary
def _binary_rule(name, kind):
    def abstract(a: TensorType, b: TensorType):
        shape = broadcast_shapes(name, a.shape, b.shape)
        dt = result_dtype(a.dtype, b.dtype, op=name)
        if kind == "compare":
            return (TensorType(shape, _BOOL),)
        if kind == "nobool" and dt == _BOOL:
            raise DTypeError(f"{name}: not defined for dtype bool (operand shapes {a.shape} "
                             f"and {b.shape})")
        if kind == "float":   # true division: numpy's resolver sends bool, as ints, to float64
            dt = _F64 if dt == _BOOL else float_dtype(dt)
        return (TensorType(shape, dt),)
    return abstract


def _power(a, b):
    """np.power, with a clear error where numpy refuses integers to negative powers."""
    _int_power_check(a.dtype, b.dtype, b)
    return np.power(a, b)


def _int_power_check(da, db, b) -> None:
    """numpy refuses an integer base to a negative integer power; ``b`` is the exponent's
    values (an array, or at trace time the exponent known then, where the error then names
    the user's line: :func:`pow`)."""
    b = np.asarray(b)
    if np.dtype(da).kind in "iu" and np.dtype(db).kind in "iu" and b.size and (b < 0).any():
        raise negative_power_error(int(b.min()))


_BINARY_DEFS = {
    "add": (np.add, "same"),
    "sub": (np.subtract, "nobool"),
    "mul": (np.multiply, "same"),
    "div": (np.true_divide, "float"),
    "pow": (_power, "nobool"),
    "maximum": (np.maximum, "same"),
    "minimum": (np.minimum, "same"),
    "less": (np.less, "compare"),
    "less_equal": (np.less_equal, "compare"),
    "greater": (np.greater, "compare"),
    "greater_equal": (np.greater_equal, "compare"),
    "equal": (np.equal, "compare"),
    "not_equal": (np.not_equal, "compare"),
}


# a comparison with the scalar on the left is the mirrored one with it on the right
_MIRROR = {"less": "greater", "less_equal": "greater_equal", "greater": "less",
           "greater_equal": "less_equal", "equal": "equal", "not_equal": "not_equal"}


def _beyond_range(name, a, b):
    """numpy 2 (NEP 50) compares an integer array with a Python int its dtype cannot hold
    by value (``int32_array == 2**40`` is all False, ``< 2**40`` all True) where arithmetic
    refuses it: the comparison's known result (every element the same), built from the
    array itself (``x == x`` is all True for integers), or None when it is an ordinary one."""
    if is_python_scalar(b) and not is_python_scalar(a):
        x, v, op = a, b, name
    elif is_python_scalar(a) and not is_python_scalar(b):
        x, v, op = b, a, _MIRROR[name]
    else:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not hasattr(x, "dtype"):
        return None
    dt = np.dtype(x.dtype)
    if dt.kind not in "iu":
        return None
    info = np.iinfo(dt)
    if info.min <= v <= info.max:
        return None
    above = v > info.max          # then every element is below v
    truth = {"equal": False, "not_equal": True, "less": above, "less_equal": above,
             "greater": not above, "greater_equal": not above}[op]
    return bind("equal" if truth else "not_equal", x, x)


def _register_binary(name, kernel, kind):
    abstract = _binary_rule(name, kind)

    @functools.lru_cache(maxsize=None)
    def dtypes(da, db):
        """(result, compute) dtypes for operand dtypes ``da, db``: the shape rule's (its dtype
        checks included), once per pair rather than once per block."""
        out = abstract(TensorType((), da), TensorType((), db))[0].dtype
        common = result_dtype(da, db)
        if kind == "float":
            common = float_dtype(common)
        return out, compute_dtype(common)

    def impl(a, b):
        a, b = np.asarray(a), np.asarray(b)
        out, cd = dtypes(a.dtype, b.dtype)
        with np.errstate(all="ignore"):  # x/0: inf/nan as numpy gives them
            # the ufunc allocates its result: no cast copies when the dtypes already agree
            res = kernel(a.astype(cd, copy=False), b.astype(cd, copy=False))
            return (np.asarray(res).astype(out, copy=False),)

    register(Primitive(name, abstract, impl, indexing=elementwise_indexing))

    def fn(a, b):
        if kind == "compare":
            known = _beyond_range(name, a, b)
            if known is not None:
                return known
        return bind(name, *operands(name, a, b))

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"Elementwise {name} with numpy broadcasting and NEP 50 scalars."
    return user_errors(fn)


add = _register_binary("add", *_BINARY_DEFS["add"])
sub = _register_binary("sub", *_BINARY_DEFS["sub"])
mul = _register_binary("mul", *_BINARY_DEFS["mul"])
div = _register_binary("div", *_BINARY_DEFS["div"])
_pow = _register_binary("pow", *_BINARY_DEFS["pow"])  # the primitive; pow() below checks
maximum = _register_binary("maximum", *_BINARY_DEFS["maximum"])
minimum = _register_binary("minimum", *_BINARY_DEFS["minimum"])
less = _register_binary("less", *_BINARY_DEFS["less"])
less_equal = _register_binary("less_equal", *_BINARY_DEFS["less_equal"])
greater = _register_binary("greater", *_BINARY_DEFS["greater"])
greater_equal = _register_binary("greater_equal", *_BINARY_DEFS["greater_equal"])
equal = _register_binary("equal", *_BINARY_DEFS["equal"])
not_equal = _register_binary("not_equal", *_BINARY_DEFS["not_equal"])


@user_errors
def pow(a, b):  # noqa: A001
    """Elementwise pow with numpy broadcasting and NEP 50 scalars. An integer base to a
    negative integer exponent known while tracing (a Python int, a numpy constant) is
    refused here, at the user's line; numpy would refuse it only when the program runs."""
    known = is_python_scalar(b) or isinstance(b, (np.ndarray, np.generic))
    if known:
        da = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
        _int_power_check(da, np.asarray(b).dtype, b)
    return _pow(a, b)


# ----------------------------------------------------------------------------- where
def _where_abstract(c: TensorType, x: TensorType, y: TensorType):
    if c.dtype != _BOOL:
        raise DTypeError(f"where: the condition must be bool, got {c.dtype.name} "
                         f"(shape {c.shape})")
    shape = broadcast_shapes("where", c.shape, x.shape, y.shape)
    return (TensorType(shape, result_dtype(x.dtype, y.dtype, op="where")),)


def _where_impl(c, x, y):
    x, y = np.asarray(x), np.asarray(y)
    out = result_dtype(x.dtype, y.dtype)
    return (np.asarray(np.where(c, x.astype(out, copy=False), y.astype(out, copy=False))),)


register(Primitive("where", _where_abstract, _where_impl, indexing=elementwise_indexing))


@user_errors
def where(c, x, y):
    """``x`` where ``c`` (bool) is true, else ``y``; numpy broadcasting and NEP 50 scalars."""
    if is_python_scalar(c):
        if not isinstance(c, bool):  # numpy would test truthiness; the rule wants a bool
            raise DTypeError(f"where: the condition must be bool, got {type(c).__name__} {c!r}")
        c = Literal(c, _BOOL)
    x, y = operands("where", x, y)
    return bind("where", c, x, y)


# ----------------------------------------------------------------------------- astype
def _astype_abstract(x: TensorType, *, dtype):
    return (TensorType(x.shape, as_dtype(dtype)),)


def _astype_impl(x, *, dtype):
    with np.errstate(all="ignore"):
        return (np.asarray(x).astype(dtype),)


register(Primitive("astype", _astype_abstract, _astype_impl, lambda i, o, **p: 0,
                   elementwise_indexing))


@user_errors
def astype(x, dtype):
    """Cast to ``dtype`` (a numpy dtype or a name such as ``"bfloat16"``)."""
    if dtype is None:   # numpy reads None as float64; eins asks for the dtype by name
        raise DTypeError("astype: dtype None names no dtype (numpy would take it as "
                         "float64); pass one, e.g. 'float32'")
    dtype = as_dtype(dtype)
    if isinstance(x, Tracer) and x.dtype == dtype:
        return x
    return bind("astype", *operands("astype", x), dtype=dtype)


# ----------------------------------------------------------------------------- GPU lowering
def _elementwise_gpu(prim, fspec, outs, ins, **params):
    """GPU lowering of one elementwise eqn: the generated Triton kernel of
    eins/kernels/fusion.py (the Triton dialect of eins/kernels/expressions.py;
    broadcast operands read in place, literals baked in; a bare Python scalar takes its
    dtype as the tracer gives it, NEP 50). Chains of such eqns fuse into one kernel through
    ``fusion_groups``/``fused_source`` there."""
    from eins.kernels.build import numpy_dtype
    from eins.kernels.fusion import launch_fused, op_source
    tdts = [numpy_dtype(t.dtype) for t in ins if hasattr(t, "dtype")]
    against = result_dtype(*tdts) if tdts else None
    operands = []
    for t in ins:
        if isinstance(t, tuple) and len(t) == 3 and t[0] == "lit":
            operands.append(t)
        elif is_python_scalar(t):
            operands.append(("lit", t, weak_dtype(t, against)))
        else:
            operands.append((tuple(t.shape), numpy_dtype(t.dtype)))
    fk = op_source(prim, params, operands, tuple(outs[0].shape), numpy_dtype(outs[0].dtype))
    launch_fused(fk, [t for t in ins if hasattr(t, "dtype")], [outs[0]])


for _name in UNARY + BINARY + COMPARE + ("where", "astype"):
    register_gpu_lowering(_name, functools.partial(_elementwise_gpu, _name), "triton_fused.py.j2")
