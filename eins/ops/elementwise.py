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
from eins.ir.primitive import Expression, GpuLowering, Primitive, register
from eins.kernels.build import numpy_dtype
from eins.kernels.fusion import launch_fused, op_source
from eins.ops._common import (broadcast_shape, compute_dtype, float_dtype, index_name,
                              negative_power_error, operands, result_dtype, static_flag,
                              unbroadcast, user_errors, vectorized_erf, weak_dtype)
from eins.tracing import Tracer, bind

_BOOL = np.dtype(np.bool_)
_F64 = np.dtype(np.float64)
_I32 = np.dtype(np.int32)


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


# ----------------------------------------------------------------------------- GPU lowering
def elementwise_lowering(name: str) -> GpuLowering:
    """The GPU lowering of elementwise primitive ``name``: the generated Triton kernel of its
    :class:`~eins.ir.primitive.Expression` (eins/kernels/fusion.py; broadcast operands read
    in place, literals baked in; a bare Python scalar takes its dtype as the tracer gives
    it, NEP 50). Chains of such eqns fuse into one kernel through
    ``fusion_groups``/``fused_source`` there."""
    def launch(fspec, outs, ins, **params):
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
        fk = op_source(name, params, operands, tuple(outs[0].shape), numpy_dtype(outs[0].dtype))
        launch_fused(fk, [t for t in ins if hasattr(t, "dtype")], [outs[0]])
    return GpuLowering(launch, template="triton_fused.py.j2")


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


_GELU_C = 0.7978845608028654  # sqrt(2/pi)


def _gelu_text(params):
    if params.get("approximate", True):
        return f"0.5 * x * (1.0 + tanh({_GELU_C!r} * (x + 0.044715 * (x * x * x))))"
    return "0.5 * x * (1.0 + erf(x * 0.7071067811865476))"


_UNARY_DEFS = {
    # name: (kernel, dtype kind, flops per element, neutral expression over x)
    "neg": (np.negative, "same_nobool", 1, "-x"),
    "abs": (np.abs, "same", 1, "abs(x)"),
    "exp": (np.exp, "float", 1, "exp(x)"),
    "log": (np.log, "float", 1, "log(x)"),
    "sqrt": (np.sqrt, "float", 1, "sqrt(x)"),
    "rsqrt": (lambda x: 1 / np.sqrt(x), "float", 2, "rsqrt(x)"),
    "square": (np.square, "same_nobool", 1, "x * x"),
    "tanh": (np.tanh, "float", 1, "tanh(x)"),
    "sigmoid": (_sigmoid, "float", 4, "1.0 / (1.0 + exp(-x))"),
    "relu": (lambda x: np.maximum(x, x.dtype.type(0)), "same_nobool", 1, "maximum(x, 0)"),
    "gelu": (_gelu, "float", 10, _gelu_text),
    "silu": (lambda x: x * _sigmoid(x), "float", 5, "x / (1.0 + exp(-x))"),
    "cos": (np.cos, "float", 1, "cos(x)"),
    "sin": (np.sin, "float", 1, "sin(x)"),
}
UNARY = tuple(_UNARY_DEFS)
# the numpy ufuncs of the elementwise primitives whose names differ from numpy's (the
# others are their own name; none: numpy has no such ufunc)
_UFUNCS = {"neg": ("negative",), "abs": ("absolute",), "rsqrt": (), "sigmoid": (),
           "relu": (), "gelu": (), "silu": (), "sub": ("subtract",), "mul": ("multiply",),
           "div": ("divide", "true_divide"), "pow": ("power",)}
_POSITIVE = ("log", "sqrt", "rsqrt")   # their validate_specs samples are positive
# the paper's graph.unary names (eins/paper.py) of the unary primitives that have more
_PAPER = {"gelu": {"gelu": {"approximate": True}, "gelu_tanh": {"approximate": True},
                   "gelu_exact": {"approximate": False}}}


# ----------------------------------------------------------------------------- backward
# d(result)/dx times the cotangent g, from the operand x and the result y
_GELU_K = 0.044715


# silu's and gelu's backward as one elementwise eqn each, ``(g, x) -> g * f'(x)`` (their
# derivatives are five to ten operations: as one eqn each, the planner sees one eqn where
# the backward of a block has a dozen, and the kernel library renders it as one kernel)
_SIG = "(1.0 / (1.0 + exp(-x)))"


def _gelu_grad_text(params):
    if params.get("approximate", True):
        t = f"tanh({_GELU_C!r} * (x + {_GELU_K!r} * (x * x * x)))"
        return (f"g * (0.5 * (1.0 + {t}) + 0.5 * x * (1.0 - {t} * {t}) * {_GELU_C!r} * "
                f"(1.0 + {3 * _GELU_K!r} * (x * x)))")
    return ("g * (0.5 * (1.0 + erf(x * 0.7071067811865476)) + x * exp(-0.5 * (x * x)) * "
            "0.3989422804014327)")


def _grad_impl(name):
    def impl(g, x, **params):
        g, x = np.asarray(g), np.asarray(x)
        out = result_dtype(g.dtype, x.dtype)
        ct = compute_dtype(out)
        g, x = g.astype(ct, copy=False), x.astype(ct, copy=False)
        with np.errstate(all="ignore"):
            if name == "silu_grad":
                s = _sigmoid(x)
                r = g * (s * (1 + x * (1 - s)))
            elif params.get("approximate", True):
                t = np.tanh(_GELU_C * (x + _GELU_K * x ** 3))
                r = g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _GELU_C
                         * (1 + 3 * _GELU_K * x * x))
            else:
                phi = 0.5 * (1 + vectorized_erf(np.asarray(x, np.float64) / np.sqrt(2)))
                r = g * (phi.astype(ct) + x * np.exp(-0.5 * x * x) * 0.3989422804014327)
        return (np.asarray(r).astype(out, copy=False),)
    return impl


def _grad_abstract(g: TensorType, x: TensorType, **params):
    if tuple(g.shape) != tuple(x.shape):
        raise ShapeError(f"cotangent of shape {g.shape} for an operand of shape {x.shape}")
    return (TensorType(x.shape, result_dtype(g.dtype, x.dtype)),)


def _silu_grad_vjp(cts, ins, outs, needs):
    """Linear in g; in x: g * silu''(x), silu'' = s(1-s)(2 + x(1-2s))."""
    c, (g, x) = cts[0], ins
    s = sigmoid(x)
    return (bind("silu_grad", c, x) if needs[0] else None,
            c * g * (s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s))) if needs[1] else None)


def _gelu_grad_vjp(cts, ins, outs, needs, *, approximate=True):
    """Linear in g; in x: g * gelu''(x)."""
    c, (g, x) = cts[0], ins
    if approximate:
        du = _GELU_C * (1.0 + 3 * _GELU_K * (x * x))
        t = tanh(_GELU_C * (x + _GELU_K * (x * x * x)))
        d2 = (1.0 - t * t) * (du - x * t * du * du + 3 * _GELU_C * _GELU_K * (x * x))
    else:
        d2 = exp(-0.5 * (x * x)) * 0.3989422804014327 * (2.0 - x * x)
    return (bind("gelu_grad", c, x, approximate=approximate) if needs[0] else None,
            c * g * d2 if needs[1] else None)


for _name, _text, _var in (("silu_grad", f"g * {_SIG} * (1.0 + x * (1.0 - {_SIG}))", None),
                           ("gelu_grad", _gelu_grad_text, lambda p: _approximate(p))):
    register(Primitive(
        _name, _grad_abstract, _grad_impl(_name), lambda i, o, **p: 10 * o[0].size,
        indexing=elementwise_indexing, expression=Expression(("g", "x"), _text, _var),
        lowerings={None: elementwise_lowering(_name)},
        vjp=_silu_grad_vjp if _name == "silu_grad" else _gelu_grad_vjp,
        samples=lambda arr, n=_name: [(n, lambda g, x: bind(n, g, x), (arr(6, 8), arr(6, 8)))]
        + ([(f"{n} exact", lambda g, x: bind(n, g, x, approximate=False),
             (arr(6, 8), arr(6, 8)))] if n == "gelu_grad" else [])))


_UNARY_VJPS = {
    "abs": lambda g, x, y: where(x > 0, g, where(x < 0, -g, 0.0)),
    "exp": lambda g, x, y: g * y,
    "log": lambda g, x, y: g / x,
    "sqrt": lambda g, x, y: g * 0.5 / y,
    "rsqrt": lambda g, x, y: g * -0.5 * y / x,
    "square": lambda g, x, y: g * (2.0 * x),
    "tanh": lambda g, x, y: g * (1.0 - y * y),
    "sigmoid": lambda g, x, y: g * (y * (1.0 - y)),
    "relu": lambda g, x, y: where(x > 0, g, 0.0),
    "gelu": lambda g, x, y, approximate=True: bind("gelu_grad", g, x, approximate=approximate),
    "silu": lambda g, x, y: bind("silu_grad", g, x),
    "cos": lambda g, x, y: -g * sin(x),
    "sin": lambda g, x, y: g * cos(x),
}


def _unary_vjp(name):
    d = _UNARY_VJPS[name]

    def vjp(cts, ins, outs, needs, **params):
        return (d(cts[0], ins[0], outs[0], **params),)
    return vjp


def _neg_transpose(cts, ins, needs):
    return (-cts[0],)


def _binary_vjp(name):
    """Each operand's cotangent, summed over the dims broadcasting stretched."""
    def parts(g, a, b, y):
        if name in ("add", "sub"):
            return g, (g if name == "add" else -g)
        if name == "mul":
            return g * b, g * a
        if name == "div":
            return g / b, -g * y / b
        if name == "pow":
            return (lambda: g * b * (a if _is_two(b) else pow(a, b - 1)),
                    lambda: g * y * log(where(a == 0, 1.0, a)))
        if name == "logaddexp":   # y = log(e^a + e^b): dy/da = e^(a - y)
            return (lambda: g * exp(a - y), lambda: g * exp(b - y))
        first = a > b if name == "maximum" else a < b
        second = b > a if name == "maximum" else b < a
        tie = where(a == b, g * 0.5, 0.0)
        return (lambda: where(first, g, tie), lambda: where(second, g, tie))

    def vjp(cts, ins, outs, needs):
        a, b = ins
        got = parts(cts[0], a, b, outs[0] if outs else None)
        return tuple(unbroadcast(p() if callable(p) else p, x.shape) if need else None
                     for p, x, need in zip(got, ins, needs))
    return vjp


def _is_two(b) -> bool:
    return is_python_scalar(b) and b == 2


def _where_vjp(cts, ins, outs, needs):
    c, x, y = ins
    g = cts[0]
    got = (None, lambda: where(c, g, 0.0), lambda: where(c, 0.0, g))
    return tuple(unbroadcast(f(), t.shape) if need else None
                 for f, t, need in zip(got, ins, needs))


def _register_unary(name, kernel, kind, per, text):
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

    if callable(text):   # gelu: its one static parameter; gelu() below checks it
        def fn(x, approximate=True):
            return bind(name, *operands(name, x), approximate=approximate)
        variant = _approximate
    else:   # no keywords: fn(x, alpha=0.1) is refused, not traced and then ignored
        def fn(x):
            return bind(name, *operands(name, x))
        variant = None

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"Elementwise {name} (numpy semantics)."
    fn = user_errors(fn)
    lo = 0.5 if name in _POSITIVE else -2.0
    register(Primitive(
        name, abstract, impl, lambda i, o, **p: per * o[0].size, elementwise_indexing,
        expression=Expression(("x",), text, variant),
        lowerings={None: elementwise_lowering(name)},
        attr_hints={name: f"use eins.{name}(x)"}, ufuncs=_UFUNCS.get(name, (name,)),
        paper_names=_PAPER.get(name, {name: {}}),
        vjp=_unary_vjp(name) if name in _UNARY_VJPS else None,
        transpose=_neg_transpose if name == "neg" else None,
        samples=lambda arr: [(f"{name} 6x8", fn, (arr(6, 8, lo=lo),))]))
    return fn


def _approximate(params) -> str:
    return f"approximate={bool(params.get('approximate', True))}"


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
    # name: (kernel, dtype kind, neutral expression over a and b)
    "add": (np.add, "same", "a + b"),
    "sub": (np.subtract, "nobool", "a - b"),
    "mul": (np.multiply, "same", "a * b"),
    "div": (np.true_divide, "float", "a / b"),
    "pow": (_power, "nobool", "pow(a, b)"),
    "maximum": (np.maximum, "same", "maximum(a, b)"),
    "minimum": (np.minimum, "same", "minimum(a, b)"),
    # -inf with -inf is -inf, equal operands a + log 2, and no difference overflows; equal
    # operands are zeroed before the difference, which both branches compute (-inf - -inf
    # would be nan, and a warning under Triton's interpreter); also the ⊕ of
    # attention_fwd's key-split log-sum-exp partials (eins.ir.joinagg)
    "logaddexp": (np.logaddexp, "float", "where(a == b, a + 0.6931471805599453, "
                  "maximum(a, b) + log(1.0 + exp(-abs(where(a == b, 0.0, a) "
                  "- where(a == b, 0.0, b)))))"),
    "less": (np.less, "compare", "a < b"),
    "less_equal": (np.less_equal, "compare", "a <= b"),
    "greater": (np.greater, "compare", "a > b"),
    "greater_equal": (np.greater_equal, "compare", "a >= b"),
    "equal": (np.equal, "compare", "a == b"),
    "not_equal": (np.not_equal, "compare", "a != b"),
}
BINARY = tuple(n for n, d in _BINARY_DEFS.items() if d[1] != "compare")
COMPARE = tuple(n for n, d in _BINARY_DEFS.items() if d[1] == "compare")


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


def _float_compute(ins, out):
    """true division computes in the operands' common float dtype."""
    return (compute_dtype(float_dtype(result_dtype(*ins))),) * len(ins)


def _add_compute(ins, out):
    """numpy's bool + bool is logical or; Triton's int1 add wraps (1 + 1 = 0): add as int32,
    and the cast to bool (!= 0 in both dialects) makes it the or."""
    common = result_dtype(*ins)
    return (compute_dtype(_I32 if common == _BOOL else common),) * len(ins)


_BINARY_EXTRAS = {
    "add": dict(residual_add=True, expression=Expression(("a", "b"), "a + b",
                                                         compute=_add_compute)),
    "div": dict(expression=Expression(("a", "b"), "a / b", compute=_float_compute)),
    # libdevice.pow takes floats only; _ipow (eins/kernels/build.py's HEADER) squares, and
    # the kernel refuses a negative integer exponent as numpy does
    "pow": dict(expression=Expression(("a", "b"), "pow(a, b)", integer="ipow(a, b)",
                                      checked=1)),
}


def _binary_samples(name, fn, kind):
    def samples(arr):
        rhs = (lambda *s: arr(*s, lo=0.5)) if name == "div" else arr
        out = [(f"{name} same", fn, (arr(6, 8), rhs(6, 8))),
               (f"{name} broadcast row", fn, (arr(7, 6), rhs(6))),
               (f"{name} broadcast col+row", fn, (arr(5, 1), rhs(1, 8))),
               (f"{name} literal rhs", lambda x: fn(x, 0.5), (arr(6, 8),)),
               (f"{name} literal lhs", lambda x: fn(2.0, x), (rhs(9, 4),))]
        if name == "pow":   # a positive base: real powers
            out = [("pow", pow, (arr(6, 8, lo=0.5), arr(6, 8))),
                   ("pow literal", lambda x: pow(x, 2.0), (arr(6, 8, lo=0.5),)),
                   ("pow f32 broadcast", pow, (arr(4, 6, dtype="float32", lo=0.5),
                                               arr(6, dtype="float32")))]
        return out
    return samples


def _register_binary(name, kernel, kind, text):
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

    def fn(a, b):
        if kind == "compare":
            known = _beyond_range(name, a, b)
            if known is not None:
                return known
        return bind(name, *operands(name, a, b))

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"Elementwise {name} with numpy broadcasting and NEP 50 scalars."
    fn = user_errors(fn)
    extras = dict(_BINARY_EXTRAS.get(name, {}))
    extras.setdefault("expression", Expression(("a", "b"), text))
    # a comparison's bool result carries no cotangent: no rule
    register(Primitive(name, abstract, impl, indexing=elementwise_indexing,
                       lowerings={None: elementwise_lowering(name)},
                       vjp=None if kind == "compare" else _binary_vjp(name),
                       paper_names={} if kind == "compare" else {name: {}},
                       ufuncs=_UFUNCS.get(name, (name,)),
                       samples=_binary_samples(name, fn, kind), **extras))
    return fn


add = _register_binary("add", *_BINARY_DEFS["add"])
sub = _register_binary("sub", *_BINARY_DEFS["sub"])
mul = _register_binary("mul", *_BINARY_DEFS["mul"])
div = _register_binary("div", *_BINARY_DEFS["div"])
_pow = _register_binary("pow", *_BINARY_DEFS["pow"])  # the primitive; pow() below checks
maximum = _register_binary("maximum", *_BINARY_DEFS["maximum"])
minimum = _register_binary("minimum", *_BINARY_DEFS["minimum"])
logaddexp = _register_binary("logaddexp", *_BINARY_DEFS["logaddexp"])
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


def _where_compute(ins, out):
    """the condition stays bool; x and y in the output dtype"""
    return (ins[0], out, out)




@user_errors
def where(c, x, y):
    """``x`` where ``c`` (bool) is true, else ``y``; numpy broadcasting and NEP 50 scalars."""
    if is_python_scalar(c):
        if not isinstance(c, bool):  # numpy would test truthiness; the rule wants a bool
            raise DTypeError(f"where: the condition must be bool, got {type(c).__name__} {c!r}")
        c = Literal(c, _BOOL)
    x, y = operands("where", x, y)
    return bind("where", c, x, y)


register(Primitive(
    "where", _where_abstract, _where_impl, indexing=elementwise_indexing,
    expression=Expression(("c", "x", "y"), "where(c, x, y)", compute=_where_compute),
    lowerings={None: elementwise_lowering("where")}, vjp=_where_vjp,
    samples=lambda arr: [
        ("where", lambda c, x, y: where(c, x, y), (arr(6, 8, dtype="bool"), arr(6, 8),
                                                   arr(6, 8))),
        ("where broadcast+literal", lambda c, x: where(c, x, 0.0),
         (arr(6, 1, dtype="bool"), arr(6, 8)))]))


# ----------------------------------------------------------------------------- astype
def _astype_abstract(x: TensorType, *, dtype):
    return (TensorType(x.shape, as_dtype(dtype)),)


def _astype_impl(x, *, dtype):
    with np.errstate(all="ignore"):
        return (np.asarray(x).astype(dtype),)




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


register(Primitive(
    "astype", _astype_abstract, _astype_impl, lambda i, o, **p: 0, elementwise_indexing,
    # the operand as it is, rounded once to the new dtype
    expression=Expression(("x",), "x", compute=lambda ins, out: (ins[0],)),
    lowerings={None: elementwise_lowering("astype")},
    # linear: the cotangent cast back (eins.autodiff casts it to the operand's dtype)
    transpose=lambda cts, ins, needs, *, dtype: (cts[0],),
    attr_hints=dict.fromkeys(["float", "half", "bfloat16", "to", "type", "double", "int",
                              "long"], "use x.astype(dtype)"),
    samples=lambda arr: [
        ("astype f64->f32", lambda x: astype(x, "float32"), (arr(6, 8),)),
        ("astype f32->f16", lambda x: astype(x, "float16"), (arr(6, 8, dtype="float32"),))]))


__all__ = list(UNARY + BINARY + COMPARE) + ["where", "astype"]
