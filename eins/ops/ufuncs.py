"""numpy's other elementwise ufuncs on floats, integers and bools: rounding (``floor``,
``ceil``, ``trunc``, ``rint``), ``sign``, the rest of the exponentials, logarithms and trig
functions, predicates (``isnan``, ``isinf``, ``isfinite``, ``signbit``), integer and
floor division (``floor_divide``, ``remainder``, ``fmod``), ``logaddexp2``, the bitwise and
logical operators (``&``, ``|``, ``^``, ``~``, ``<<``, ``>>``), ``fmax``/``fmin``,
``heaviside`` and the rest. One primitive per ufunc, named as numpy names it, each with its
numpy reference kernel (the ufunc itself), its neutral expression (the Triton kernel and the
numpy source of the fused kernels, eins/kernels/expressions.py) and the elementwise
join-agg specs of eins/ops/elementwise.py (a pure map over aligned elements).

dtypes are numpy's own: the ufunc's type resolution on the operands' common dtype
(``np.floor(int8)`` is int8, ``np.sin(int8)`` float16, ``np.invert(float32)`` a DTypeError
naming the ufunc and the dtype); float16 and bfloat16 are computed in float32 and rounded
once, as every other elementwise kernel.
"""
from __future__ import annotations

import functools

import numpy as np

from eins.errors import DTypeError
from eins.ir.primitive import Expression, Primitive, register
from eins.ir.types import TensorType, bfloat16
from eins.ops._common import compute_dtype, operands, ops, result_dtype, unbroadcast, user_errors
from eins.ops.elementwise import broadcast_shapes, elementwise_indexing, elementwise_lowering
from eins.tracing import bind

_BOOL = np.dtype(np.bool_)
_F32 = np.dtype(np.float32)
_LOW = tuple(d for d in (np.dtype(np.float16), bfloat16) if d is not None)

# name: (numpy ufunc, neutral expression, integer/bool form or None, flops per element)
UNARY = {
    "floor": (np.floor, "floor(x)", "x", 1),
    "ceil": (np.ceil, "ceil(x)", "x", 1),
    "trunc": (np.trunc, "trunc(x)", "x", 1),
    "rint": (np.rint, "rint(x)", None, 1),
    "sign": (np.sign, "where(x > 0, 1, where(x < 0, -1, x))", None, 2),
    "fabs": (np.fabs, "abs(x)", None, 1),
    "positive": (np.positive, "x", None, 0),
    "reciprocal": (np.reciprocal, "1.0 / x", "where(abs(x) == 1, x, 0)", 1),
    "cbrt": (np.cbrt, "cbrt(x)", None, 1),
    "exp2": (np.exp2, "exp2(x)", None, 1),
    "expm1": (np.expm1, "expm1(x)", None, 1),
    "log2": (np.log2, "log2(x)", None, 1),
    "log10": (np.log10, "log10(x)", None, 1),
    "log1p": (np.log1p, "log1p(x)", None, 1),
    "tan": (np.tan, "tan(x)", None, 1),
    "arcsin": (np.arcsin, "asin(x)", None, 1),
    "arccos": (np.arccos, "acos(x)", None, 1),
    "arctan": (np.arctan, "atan(x)", None, 1),
    "sinh": (np.sinh, "sinh(x)", None, 1),
    "cosh": (np.cosh, "cosh(x)", None, 1),
    "arcsinh": (np.arcsinh, "asinh(x)", None, 1),
    "arccosh": (np.arccosh, "acosh(x)", None, 1),
    "arctanh": (np.arctanh, "atanh(x)", None, 1),
    "deg2rad": (np.deg2rad, "x * 0.017453292519943295", None, 1),
    "radians": (np.radians, "x * 0.017453292519943295", None, 1),
    "rad2deg": (np.rad2deg, "x * 57.29577951308232", None, 1),
    "degrees": (np.degrees, "x * 57.29577951308232", None, 1),
    # x - x is nan for inf and nan, 0 for every finite x
    "isnan": (np.isnan, "x != x", "x != x", 1),
    "isinf": (np.isinf, "(x == x) & (x - x != x - x)", "x != x", 3),
    "isfinite": (np.isfinite, "x - x == x - x", "x == x", 2),
    "signbit": (np.signbit, "signbit(x)", "x < 0", 1),
    "logical_not": (np.logical_not, "x == 0", "x == 0", 1),
    "invert": (np.invert, "~x", "~x", 1),
    "bitwise_count": (np.bitwise_count, "popcount(x)", "popcount(x)", 8),
    "conjugate": (np.conjugate, "x", None, 0),
}

BINARY = {
    "floor_divide": (np.floor_divide, "floordiv(a, b)", None, 4),
    "remainder": (np.remainder, "mod(a, b)", None, 4),
    "fmod": (np.fmod, "fmod(a, b)", None, 1),
    # logaddexp is eins/ops/elementwise.py's (with its VJP and the lse ⊕'s role)
    "logaddexp2": (np.logaddexp2,
                   "where(a == b, a + 1.0, "
                   "maximum(a, b) + log1p(exp2(-abs(a - b))) * 1.4426950408889634)", None, 7),
    "arctan2": (np.arctan2, "atan2(a, b)", None, 1),
    "hypot": (np.hypot, "hypot(a, b)", None, 1),
    "copysign": (np.copysign, "copysign(a, b)", None, 1),
    "nextafter": (np.nextafter, "nextafter(a, b)", None, 1),
    "bitwise_and": (np.bitwise_and, "a & b", "a & b", 1),
    "bitwise_or": (np.bitwise_or, "a | b", "a | b", 1),
    "bitwise_xor": (np.bitwise_xor, "a ^ b", "a ^ b", 1),
    "left_shift": (np.left_shift, "a << b", "a << b", 1),
    # Euclid's algorithm: a loop of remainders per element (numpy's own, on the GPU too)
    "gcd": (np.gcd, "gcd(a, b)", "gcd(a, b)", 64),
    "lcm": (np.lcm, "lcm(a, b)", "lcm(a, b)", 66),
    "right_shift": (np.right_shift, "a >> b", "a >> b", 1),
    "logical_and": (np.logical_and, "(a != 0) & (b != 0)", None, 3),
    "logical_or": (np.logical_or, "(a != 0) | (b != 0)", None, 3),
    "logical_xor": (np.logical_xor, "(a != 0) != (b != 0)", None, 3),
    # the other operand where one is nan (maximum keeps a nan)
    "fmax": (np.fmax, "where(b != b, a, where(a != a, b, maximum(a, b)))", None, 3),
    "fmin": (np.fmin, "where(b != b, a, where(a != a, b, minimum(a, b)))", None, 3),
    "heaviside": (np.heaviside, "where(a != a, a, where(a < 0, 0, where(a > 0, 1, b)))",
                  None, 3),
    "float_power": (np.float_power, "pow(a, b)", None, 1),
}

# the samples' operands: positive for these (their domains), integers for the bitwise ones
_POSITIVE = {"log2", "log10", "cbrt", "reciprocal", "float_power"}
_UNIT = {"arcsin", "arccos", "arctanh", "log1p", "tan"}
_INTS = {"invert", "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift",
         "gcd", "lcm", "bitwise_count"}

_RANGES = {"arccosh": (1.1, 3.0), "left_shift": (0, 5), "right_shift": (0, 5),
           "gcd": (-40, 40), "lcm": (-40, 40), "bitwise_count": (-40, 40)}


# ----------------------------------------------------------------------------- backward
# Each float ufunc's VJP (eins.autodiff): the output's cotangent g times the derivative, in
# the operators themselves (x: the operand, y: the result). Piecewise-constant ufuncs
# (rounding, sign, floor division, heaviside) have derivative 0 where it is defined.
_LN2, _LN10 = 0.6931471805599453, 2.302585092994046
_DEG = 0.017453292519943295


def _zero(g, x, y):
    return g * 0.0


UNARY_VJPS = {
    "floor": _zero, "ceil": _zero, "trunc": _zero, "rint": _zero, "sign": _zero,
    "fabs": lambda g, x, y: ops().where(x > 0, g, ops().where(x < 0, -g, 0.0)),
    "positive": lambda g, x, y: g,
    "conjugate": lambda g, x, y: g,
    "reciprocal": lambda g, x, y: -g * y * y,
    "cbrt": lambda g, x, y: g / (3.0 * y * y),
    "exp2": lambda g, x, y: g * y * _LN2,
    "expm1": lambda g, x, y: g * (y + 1.0),
    "log2": lambda g, x, y: g / (x * _LN2),
    "log10": lambda g, x, y: g / (x * _LN10),
    "log1p": lambda g, x, y: g / (x + 1.0),
    "tan": lambda g, x, y: g * (y * y + 1.0),
    "arcsin": lambda g, x, y: g * ops().rsqrt(1.0 - x * x),
    "arccos": lambda g, x, y: -g * ops().rsqrt(1.0 - x * x),
    "arctan": lambda g, x, y: g / (x * x + 1.0),
    "sinh": lambda g, x, y: g * ops().cosh(x),
    "cosh": lambda g, x, y: g * ops().sinh(x),
    "arcsinh": lambda g, x, y: g * ops().rsqrt(x * x + 1.0),
    "arccosh": lambda g, x, y: g * ops().rsqrt(x * x - 1.0),
    "arctanh": lambda g, x, y: g / (1.0 - x * x),
    "deg2rad": lambda g, x, y: g * _DEG, "radians": lambda g, x, y: g * _DEG,
    "rad2deg": lambda g, x, y: g / _DEG, "degrees": lambda g, x, y: g / _DEG,
}


def _zero3(g, a, b, y):
    return g * 0.0


def _copysign_da(g, a, b, y):
    o = ops()   # y = |a| with b's sign: dy/da = +1 where a's sign is y's, else -1
    return o.where(o.signbit(a) == o.signbit(y), g, -g)


BINARY_VJPS = {   # name: (d/da, d/db) as functions of (g, a, b, y)
    "floor_divide": (_zero3, _zero3),
    "heaviside": (_zero3, lambda g, a, b, y: ops().where(a == 0, g, 0.0)),
    "remainder": (lambda g, a, b, y: g, lambda g, a, b, y: -g * ops().floor_divide(a, b)),
    "fmod": (lambda g, a, b, y: g, lambda g, a, b, y: -g * ops().trunc(a / b)),
    "logaddexp2": (lambda g, a, b, y: g * ops().exp2(a - y),
                   lambda g, a, b, y: g * ops().exp2(b - y)),
    "arctan2": (lambda g, a, b, y: g * b / (a * a + b * b),
                lambda g, a, b, y: -g * a / (a * a + b * b)),
    "hypot": (lambda g, a, b, y: g * a / y, lambda g, a, b, y: g * b / y),
    "copysign": (_copysign_da, _zero3),
    "nextafter": (lambda g, a, b, y: g, _zero3),
    "fmax": (lambda g, a, b, y: ops().where(a > b, g, ops().where(a == b, g * 0.5, 0.0)),
             lambda g, a, b, y: ops().where(b > a, g, ops().where(a == b, g * 0.5, 0.0))),
    "fmin": (lambda g, a, b, y: ops().where(a < b, g, ops().where(a == b, g * 0.5, 0.0)),
             lambda g, a, b, y: ops().where(b < a, g, ops().where(a == b, g * 0.5, 0.0))),
    "float_power": (lambda g, a, b, y: g * b * ops().float_power(a, b - 1.0),
                    lambda g, a, b, y: g * y * ops().log(ops().where(a > 0, a, 1.0))),
}


def _vjp(name):
    if name in UNARY_VJPS:
        d = UNARY_VJPS[name]
        return lambda cts, ins, outs, needs: (d(cts[0], ins[0], outs[0]),)
    if name not in BINARY_VJPS:
        return None
    da, db = BINARY_VJPS[name]

    def vjp(cts, ins, outs, needs):
        a, b = ins
        return tuple(unbroadcast(d(cts[0], a, b, outs[0]), x.shape) if need else None
                     for d, x, need in zip((da, db), ins, needs))
    return vjp

@functools.lru_cache(maxsize=None)
def loop_dtypes(name, ufunc, dtypes):
    """(operand dtypes, result dtype) of ``ufunc`` on operands of ``dtypes``: numpy's type
    resolution, float16 and bfloat16 resolved as float32 with float results in their own
    dtype; a DTypeError naming the ufunc where numpy defines none."""
    low = next((d for d in dtypes if d in _LOW), None)
    if low is not None and name == "nextafter":
        raise DTypeError(f"nextafter: {low.name} is computed in float32, whose next value is "
                         f"not {low.name}'s; cast to float32 first")
    asked = tuple(_F32 if d in _LOW else d for d in dtypes)
    try:
        res = ufunc.resolve_dtypes(asked + (None,) * ufunc.nout)
    except (TypeError, np.exceptions.DTypePromotionError):
        shown = " and ".join(d.name for d in dtypes)
        raise DTypeError(f"{name}: numpy's {ufunc.__name__} is not defined for {shown}"
                         f"{' (integers and bools only)' if name in _INTS else ''}") from None
    ins, out = tuple(np.dtype(d) for d in res[:ufunc.nin]), np.dtype(res[-1])
    if low is not None and out == _F32:
        out = low
    return ins, out


def _common(name, dtypes):
    return (result_dtype(*dtypes, op=name),) * len(dtypes)


def _register(name, ufunc, text, integer, per):
    n = ufunc.nin
    names = ("x",) if n == 1 else ("a", "b")

    def abstract(*ts: TensorType):
        shape = broadcast_shapes(name, *(t.shape for t in ts)) if n > 1 else ts[0].shape
        dts = _common(name, [t.dtype for t in ts])
        return (TensorType(shape, loop_dtypes(name, ufunc, dts)[1]),)

    def compute(ins, out):
        """the operands in numpy's loop dtypes (float16/bfloat16 as float32)"""
        loop, _ = loop_dtypes(name, ufunc, _common(name, ins))
        return tuple(compute_dtype(d) for d in loop)

    def impl(*xs):
        xs = [np.asarray(x) for x in xs]
        loop, out = loop_dtypes(name, ufunc, _common(name, [x.dtype for x in xs]))
        with np.errstate(all="ignore"):   # inf, nan and integer division by 0, as numpy's
            res = ufunc(*(x.astype(compute_dtype(d), copy=False) for x, d in zip(xs, loop)))
            return (np.asarray(res).astype(out, copy=False),)

    def fn(*xs):
        return bind(name, *operands(name, *xs))

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"numpy's {ufunc.__name__}, elementwise (numpy broadcasting and dtypes)."
    fn = user_errors(fn)

    def samples(arr):
        dt = "int32" if name in _INTS else "float64"
        lo, hi = _RANGES.get(name, (0.1, 3.0) if name in _POSITIVE else
                             (-0.9, 0.9) if name in _UNIT else (-2.0, 2.0))
        mk = (lambda *s: arr(*s, dtype=dt, lo=lo, hi=hi))
        if n == 1:
            return [(f"{name} 6x8", fn, (mk(6, 8),))]
        return [(f"{name} broadcast", fn, (mk(6, 8), mk(8))),
                (f"{name} col+row", fn, (mk(5, 1), mk(1, 8)))]

    register(Primitive(
        name, abstract, impl, lambda i, o, **p: per * o[0].size, elementwise_indexing,
        expression=Expression(names, text, integer=integer, compute=compute),
        lowerings={None: elementwise_lowering(name)},
        ufuncs=(ufunc.__name__,), samples=samples, vjp=_vjp(name)))
    return fn


_FUNCS = {name: _register(name, *spec) for name, spec in {**UNARY, **BINARY}.items()}
globals().update(_FUNCS)

__all__ = list(_FUNCS) + ["modf", "frexp", "ldexp", "spacing"]


# ----------------------------------------------------------------------------- composites
# The multi-output ufuncs and the ones that read a float's exponent, written exactly with
# the primitives above (a product by a power of two is exact, so is a power of two itself)

# float dtype: (frexp's exponent of its smallest normal, explicit mantissa bits, largest)
_EXPONENTS = {np.dtype(d): (int(np.finfo(d).minexp) + 1, int(np.finfo(d).nmant),
                            float(np.finfo(d).max)) for d in (np.float16, np.float32, np.float64)}
if bfloat16 is not None:
    _EXPONENTS[bfloat16] = (-125, 7, (2.0 - 2.0 ** -7) * 2.0 ** 127)


def _resolve(name, ufunc, *xs):
    """numpy's result dtypes of ``ufunc`` on ``xs`` (float16/bfloat16 kept), or a DTypeError
    naming the ufunc where numpy defines none."""
    dts = tuple(np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype for x in xs)
    low = next((d for d in dts if d in _LOW), None)
    asked = tuple(_F32 if d in _LOW else d for d in dts)
    try:
        res = ufunc.resolve_dtypes(asked + (None,) * ufunc.nout)
    except (TypeError, np.exceptions.DTypePromotionError):
        raise DTypeError(f"{name}: numpy's {name} is not defined for "
                         f"{' and '.join(d.name for d in dts)}") from None
    return tuple(low if low is not None and np.dtype(d) == _F32 else np.dtype(d)
                 for d in res[ufunc.nin:])


def _cast(x, dt):
    o = ops()
    return o.astype(x, dt) if hasattr(x, "dtype") else np.asarray(x, dt)


def _pow2(o, k):
    """2 ** k for the integer-valued floats ``k`` (exact: exp2 of an integer)."""
    return o.exp2(k)


def _scaled(o, x, k):
    """x * 2 ** k in two exact halves, so that neither power overflows where the product
    does not (a subnormal scaled up, a large value scaled down)."""
    h = o.floor(k * 0.5)
    return x * _pow2(o, h) * _pow2(o, k - h)


@user_errors
def frexp(x):
    """numpy's frexp: (mantissa, exponent) with x = mantissa * 2 ** exponent, |mantissa| in
    [0.5, 1); (x, 0) for 0, inf and nan. The exponent is int32, as numpy's."""
    o = ops()
    mdt, _ = _resolve("frexp", np.frexp, x)
    x = _cast(x, mdt)
    a = o.abs(x)
    ok = o.isfinite(x) & (x != 0)
    a1, x1 = o.where(ok, a, 1), o.where(ok, x, 1)
    e = o.floor(o.log2(a1)) + 1          # a rounded log2 may be one off: moved below
    m = _scaled(o, x1, -e)
    big, small = o.abs(m) >= 1, o.abs(m) < 0.5
    m = o.where(big, m * 0.5, o.where(small, m * 2, m))
    e = o.where(big, e + 1, o.where(small, e - 1, e))
    return o.where(ok, m, x), o.astype(o.where(ok, e, 0), np.int32)


@user_errors
def ldexp(x, e):
    """numpy's ldexp: x * 2 ** e, rounded once (a subnormal or infinite result too)."""
    o = ops()
    (dt,) = _resolve("ldexp", np.ldexp, x, e)
    m, ex = frexp(_cast(x, dt))
    # beyond +-2200 every float over- or underflows: the clip keeps the sum an int32
    t = _cast(o.minimum(o.maximum(_cast(e, np.int64), -2200), 2200), np.int32) + ex
    t = _cast(t, dt)
    # m in [0.5, 1): 2m * 2 ** (t - 1) keeps the power finite up to the largest float, m *
    # 2 ** t keeps it a (subnormal) float down to the smallest
    y = o.where(t >= 1, (m * 2) * _pow2(o, t - 1), m * _pow2(o, t))
    return o.where(o.isfinite(m) & (m != 0), y, m)   # 0, inf and nan stay (no 0 * inf)


@user_errors
def modf(x):
    """numpy's modf: (fractional part, integral part), both with x's sign (-0.0 for -2.0's
    fraction, +-0.0 for +-inf's)."""
    o = ops()
    (dt, _) = _resolve("modf", np.modf, x)
    x = _cast(x, dt)
    i = o.trunc(x)
    frac = o.where(o.isinf(x), 0, x - i)
    return o.copysign(frac, x), i


@user_errors
def spacing(x):
    """numpy's spacing: the distance from x to the next float away from zero (negative for
    negative x; the smallest subnormal at +-0, inf at the largest float, nan at inf)."""
    o = ops()
    (dt,) = _resolve("spacing", np.spacing, x)
    x = _cast(x, dt)
    emin, bits, largest = _EXPONENTS[dt]
    _, e = frexp(x)
    e = _cast(o.maximum(o.where(x == 0, emin, e), emin), dt)
    p = _pow2(o, e - (bits + 1))
    a = o.abs(x)   # noqa: F841 - float16's power-of-two test
    p = o.where(o.isfinite(x), p, np.nan)
    if dt != np.dtype(np.float16):
        return o.where(a == largest, o.copysign(np.inf, x), o.where(x < 0, -p, p))
    # numpy's float16 spacing is positive, and at a negative power of two the step toward
    # zero (half the step away from it, or the smallest subnormal)
    p = o.where((x < 0) & (_pow2(o, e - 1) == a), o.maximum(p * 0.5, 2.0 ** -24), p)
    return o.where(x == largest, np.inf, p)


def divmod_(a, b):
    """numpy's divmod: (floor_divide(a, b), remainder(a, b))."""
    return _FUNCS["floor_divide"](a, b), _FUNCS["remainder"](a, b)


# numpy ufuncs with no primitive of their own, run as the functions above on traced arrays
COMPOSITE_UFUNCS = {"divmod": divmod_, "modf": modf, "frexp": frexp, "ldexp": ldexp,
                    "spacing": spacing}
