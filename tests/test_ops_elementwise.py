"""Elementwise operators against independent numpy/math formulas: broadcasting, dtypes
(float16, bfloat16, float32, int32, bool), NEP 50 scalars, edge shapes, errors, and every
join-agg spec against the whole-tensor result."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eins
from eins.errors import DTypeError, ShapeError
from eins.ir.types import TensorType
from eins.ops import get_primitive
from helpers import assert_close, both, check_specs, rand

BF16 = eins.bfloat16


def close(got, want, dtype):
    """Within a few ulp of ``dtype``: numpy's and libm's transcendental functions differ
    between CPUs by a few ulp (the n=4 of the tolerance), nothing is accumulated."""
    assert_close(got, want, n=4, dtype=dtype)


# ----------------------------------------------------------------------------- unary
def _erf(x):
    return np.vectorize(math.erf)(x)


UNARY_REF = {  # independent float64 formulas
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
    "tanh": np.tanh, "cos": np.cos, "sin": np.sin,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
}
FLOAT_DTYPES = [np.float16, BF16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", sorted(UNARY_REF))
@pytest.mark.parametrize("shape", [(3, 4), (), (1,), (0, 2)])
def test_unary_float(name, dtype, shape):
    positive = name in ("log", "sqrt", "rsqrt")
    x = rand(shape, dtype, 0.1 if positive else -3, 3)
    got = both(getattr(eins, name), x)
    assert got.dtype == np.dtype(dtype) and got.shape == shape
    close(got, UNARY_REF[name](x.astype(np.float64)), dtype)


@pytest.mark.parametrize("dtype,want", [(np.int32, np.float64), (np.bool_, np.float16),
                                        (np.int64, np.float64)])
def test_unary_float_promotes_ints_like_numpy(dtype, want):
    x = rand((5,), dtype)
    got = both(eins.exp, x)
    assert got.dtype == want == np.exp(x).dtype
    close(got, np.exp(x.astype(np.float64)), want)


def test_gelu_exact_and_default():
    x = rand((7,), np.float64, -4, 4)
    exact = both(lambda a: eins.gelu(a, approximate=False), x)
    np.testing.assert_allclose(exact, 0.5 * x * (1 + _erf(x / math.sqrt(2))), rtol=1e-14)
    close(both(eins.gelu, x), UNARY_REF["gelu"](x), np.float64)
    assert np.max(np.abs(exact - both(eins.gelu, x))) < 1e-3  # the two forms are near
    p = eins.make_ir(lambda a: eins.gelu(a, approximate=False))(eins.ShapeDtype((2,)))
    assert p.eqns[0].params == {"approximate": False}


def test_vectorized_erf_matches_math_erf_to_rounding_including_tails():
    """The exact GELU's erf (whole arrays, two polynomial pieces) against the standard
    library's correctly rounded-to-an-ulp erf: a dense grid over |x| <= 7, both piece
    boundaries (2, 6) and their neighbours, tiny and subnormal values, and specials."""
    from eins.ops.elementwise import vectorized_erf as vec_erf
    grid = np.linspace(0.0, 7.0, 70001)[1:]
    edges = np.array([2.0, 6.0])
    tiny = np.geomspace(5e-324, 1e-3, 400)
    pos = np.concatenate([grid, edges, np.nextafter(edges, 0), np.nextafter(edges, 8), tiny])
    x = np.concatenate([pos, -pos])
    want = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(vec_erf(x), want, rtol=1e-15, atol=0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan])
    got = vec_erf(special)
    np.testing.assert_array_equal(got, [0.0, -0.0, 1.0, -1.0, np.nan])
    assert np.signbit(got[1]) and not np.signbit(got[0])
    assert vec_erf(np.float64(0.5)) == math.erf(0.5) and vec_erf(np.ones((2, 0))).shape == (2, 0)
    # the exact GELU in its tails: x * Phi(x) -> x, and -> 0 (true value at -9: -1e-18;
    # 1 + erf(x / sqrt 2) cancels to 0 there, well inside float64's absolute rounding)
    g = eins.gelu(np.array([-40.0, -9.0, -5.0, 9.0, 40.0]), approximate=False)
    want = [-40.0 * math.erfc(40 / math.sqrt(2)) / 2, -9.0 * math.erfc(9 / math.sqrt(2)) / 2,
            -5.0 * math.erfc(5 / math.sqrt(2)) / 2, 9.0, 40.0]
    np.testing.assert_allclose(g, want, rtol=1e-9, atol=1e-17)


def test_sigmoid_is_stable_at_extremes():
    x = np.array([-1000.0, 0.0, 1000.0], np.float32)
    np.testing.assert_array_equal(eins.sigmoid(x), [0.0, 0.5, 1.0])
    np.testing.assert_array_equal(eins.silu(x), [-0.0, 0.0, 1000.0])


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.int32])
def test_dtype_preserving_unary(dtype):
    x = rand((3, 4), dtype, -3, 3)
    xf = x.astype(np.float64)
    for name, ref in [("neg", lambda v: -v), ("abs", np.abs), ("square", lambda v: v * v),
                      ("relu", lambda v: np.where(v > 0, v, 0))]:
        got = both(getattr(eins, name), x)
        assert got.dtype == np.dtype(dtype), name
        close(got, ref(xf), dtype)


def test_abs_of_bool_and_operators():
    b = np.array([True, False])
    np.testing.assert_array_equal(both(eins.abs, b), b)
    x = rand((2, 3))
    np.testing.assert_array_equal(eins.jit(lambda a: (-a, abs(a)))(x), (-x, np.abs(x)))


@pytest.mark.parametrize("name", ["neg", "square", "relu"])
def test_bool_unary_errors(name):
    with pytest.raises(DTypeError, match=f"{name}: not defined for dtype bool"):
        eins.make_ir(getattr(eins, name))(eins.ShapeDtype((2,), "bool"))


def test_unary_flops():
    t = TensorType((3, 4), np.dtype(np.float32))
    assert get_primitive("exp").flops([t], [t]) == 12
    assert get_primitive("gelu").flops([t], [t], approximate=True) > 12


# ----------------------------------------------------------------------------- binary
BIN_REF = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
           "maximum": np.maximum, "minimum": np.minimum}
CMP_REF = {"less": np.less, "less_equal": np.less_equal, "greater": np.greater,
           "greater_equal": np.greater_equal, "equal": np.equal, "not_equal": np.not_equal}
SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3)), ((1,), ()),
          ((0, 3), (1, 3))]


@pytest.mark.parametrize("name", sorted(BIN_REF) + ["pow"])
@pytest.mark.parametrize("sa,sb", SHAPES)
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.int32])
def test_binary(name, sa, sb, dtype):
    a = rand(sa, dtype, 0.5, 2, seed=1)
    b = rand(sb, dtype, 0.5, 2, seed=2)
    if name == "pow" and np.dtype(dtype).kind == "i":
        b = np.abs(b)  # ints to negative powers are an error in numpy
    if name == "div" and np.dtype(dtype).kind == "i":
        b = np.where(b == 0, 1, b).astype(dtype)
    got = both(getattr(eins, name), a, b)
    ref = np.power if name == "pow" else BIN_REF[name]
    want = ref(a.astype(np.float64), b.astype(np.float64))
    want_dtype = np.float64 if (name == "div" and np.dtype(dtype).kind == "i") else dtype
    assert got.dtype == np.dtype(want_dtype) and got.shape == want.shape
    close(got, want, want_dtype)


@pytest.mark.parametrize("name", sorted(CMP_REF))
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.int32, np.bool_])
def test_compare(name, dtype):
    a = rand((3, 4), dtype, -2, 2, seed=3).round().astype(dtype)
    b = rand((4,), dtype, -2, 2, seed=4).round().astype(dtype)
    got = both(getattr(eins, name), a, b)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, CMP_REF[name](a.astype(np.float64), b.astype(np.float64)))


def test_compare_operators():
    a, b = rand((3,), seed=5), rand((3,), seed=6)
    got = eins.jit(lambda x, y: (x < y, x <= y, x > y, x >= y, x == y, x != y))(a, b)
    want = (a < b, a <= b, a > b, a >= b, a == b, a != b)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_arithmetic_operators_and_reflected():
    a, b = rand((2, 3), seed=7), rand((3,), seed=8)
    got = eins.jit(lambda x, y: (x + y, x - y, x * y, x / y, 2.0 - x, 3.0 / y, 2.0 ** y,
                                 abs(x) ** 2))(a, b)
    want = (a + b, a - b, a * b, a / b, 2.0 - a, 3.0 / b, 2.0 ** b, np.abs(a) ** 2)
    for g, w in zip(got, want):
        assert_close(g, w, n=2)
        assert g.dtype == w.dtype


@pytest.mark.parametrize("dtype,scalar,want", [
    (np.float16, 2.0, np.float16), (BF16, 2.0, BF16), (np.float32, 3, np.float32),
    (np.int32, 2, np.int32), (np.int32, 2.5, np.float64), (np.bool_, 1, np.int64),
    (np.bool_, True, np.bool_), (np.int32, True, np.int32)])
def test_nep50_weak_scalars(dtype, scalar, want):
    x = rand((3,), dtype)
    # numpy is the reference, except for bfloat16, which numpy does not promote weakly
    up = (lambda a: a.astype(np.float64)) if dtype is BF16 else (lambda a: a)
    for fn, ref in [(lambda a: eins.add(a, scalar), lambda a: up(a) + scalar),
                    (lambda a: eins.mul(scalar, a), lambda a: scalar * up(a))]:
        got = both(fn, x)
        assert got.dtype == np.dtype(want)
        close(got, ref(x), want)
    jitted = eins.jit(lambda a: (a + scalar, scalar * a))(x)
    assert jitted[0].dtype == jitted[1].dtype == np.dtype(want)
    if dtype is not BF16:  # numpy itself agrees (ml_dtypes bfloat16 is not NEP 50 aware)
        assert (x + scalar).dtype == np.dtype(want)


def test_scalar_becomes_a_literal_of_the_array_dtype():
    p = eins.make_ir(lambda a: a * 0.5)(eins.ShapeDtype((2,), "float16"))
    lit = p.eqns[0].inputs[1]
    assert lit.value == 0.5 and lit.dtype == np.float16


def test_mixed_dtype_promotion():
    a, b = rand((2,), np.float16), rand((2,), np.int32)
    assert both(eins.add, a, b).dtype == np.float64 == (a + b).dtype
    assert both(eins.add, rand((2,), BF16), rand((2,), np.float16)).dtype == np.float32
    assert both(eins.add, rand((2,), BF16), rand((2,), np.float32)).dtype == np.float32
    assert both(eins.mul, rand((2,), BF16), rand((2,), np.bool_)).dtype == BF16


def test_bool_logic_like_numpy():
    a = np.array([True, False, True])
    b = np.array([True, True, False])
    np.testing.assert_array_equal(both(eins.add, a, b), a + b)
    np.testing.assert_array_equal(both(eins.mul, a, b), a * b)
    np.testing.assert_array_equal(both(eins.maximum, a, b), np.maximum(a, b))


def test_both_python_scalars():
    assert np.asarray(eins.add(2, 3)) == 5 and np.asarray(eins.add(2, 3)).dtype == np.int64
    assert np.asarray(eins.div(1, 4)) == 0.25


@pytest.mark.parametrize("fn,args,exc,msg", [
    (eins.add, ((2, 3), (4,)), ShapeError, r"add: shapes \(2, 3\) and \(4,\) do not broadcast"),
    (eins.less, ((5,), (2, 3)), ShapeError, r"less: shapes \(5,\) and \(2, 3\) do not"),
    (eins.sub, (((2,), "bool"), ((2,), "bool")), DTypeError, "sub: not defined for dtype bool"),
    (eins.pow, (((2,), "bool"), ((2,), "bool")), DTypeError, "pow: not defined for dtype bool"),
])
def test_binary_errors(fn, args, exc, msg):
    sds = [eins.ShapeDtype(*a) if isinstance(a[0], tuple) else eins.ShapeDtype(a) for a in args]
    with pytest.raises(exc, match=msg) as e:
        eins.make_ir(lambda x, y: fn(x, y))(*sds)
    assert "test_ops_elementwise.py:" in str(e.value)


def test_scalar_out_of_range_error():
    with pytest.raises(DTypeError, match="add: Python integer 1099511627776 is out of bounds "
                                         "for int32"):
        eins.make_ir(lambda a: a + 2 ** 40)(eins.ShapeDtype((2,), "int32"))


def test_unsupported_scalar_error():
    with pytest.raises(DTypeError, match=r"mul: unsupported scalar \(1\+2j\)"):
        eins.make_ir(lambda a: a * (1 + 2j))(eins.ShapeDtype((2,)))


# ----------------------------------------------------------------------------- where / astype
@pytest.mark.parametrize("sc,sx,sy", [((3, 4), (3, 4), (3, 4)), ((4,), (3, 1), ()),
                                      ((1, 4), (3, 4), (4,))])
def test_where(sc, sx, sy):
    c = rand(sc, np.bool_, seed=9)
    x, y = rand(sx, np.float16, seed=10), rand(sy, np.float32, seed=11)
    got = both(eins.where, c, x, y)
    want = np.where(c, x.astype(np.float64), y.astype(np.float64))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_where_with_scalars():
    c = np.array([True, False, True])
    x = rand((3,), BF16)
    got = both(lambda cc, xx: eins.where(cc, xx, 0.0), c, x)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.astype(np.float32), np.where(c, x.astype(np.float32), 0))


def test_where_errors():
    with pytest.raises(DTypeError, match="where: the condition must be bool, got float32"):
        eins.make_ir(eins.where)(eins.ShapeDtype((2,)), eins.ShapeDtype((2,)),
                                 eins.ShapeDtype((2,)))
    with pytest.raises(ShapeError, match=r"where: shapes \(2,\) and \(3,\) and \(2,\)"):
        eins.make_ir(eins.where)(eins.ShapeDtype((2,), "bool"), eins.ShapeDtype((3,)),
                                 eins.ShapeDtype((2,)))
    # a Python scalar condition: named as such, not "not ... a Python scalar"
    with pytest.raises(DTypeError, match="where: the condition must be bool, got int 1"):
        eins.where(1, np.ones(2), np.zeros(2))
    with pytest.raises(DTypeError, match="where: the condition must be bool, got float 0.0"):
        eins.where(0.0, np.ones(2), np.zeros(2))
    np.testing.assert_array_equal(eins.where(False, np.ones(2), np.zeros(2)), np.zeros(2))


@pytest.mark.parametrize("src", [np.float32, np.float16, BF16, np.int32, np.bool_])
@pytest.mark.parametrize("dst", ["float16", "bfloat16", "float32", "int32", "bool"])
def test_astype(src, dst):
    x = rand((2, 3), src, -3, 3)
    got = both(lambda a: eins.astype(a, dst), x)
    want = x.astype(eins.ir.types.as_dtype(dst))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_astype_method_and_errors():
    x = rand((2,))
    np.testing.assert_array_equal(eins.jit(lambda a: a.astype("float16"))(x), x.astype(np.float16))
    with pytest.raises(DTypeError, match="unsupported dtype 'complex64'"):
        eins.make_ir(lambda a: a.astype("complex64"))(eins.ShapeDtype((2,)))
    # same dtype: no eqn at all
    assert eins.make_ir(lambda a: a.astype("float32"))(eins.ShapeDtype((2,))).eqns == ()


# ----------------------------------------------------------------------------- specs
def test_broadcasting_past_32_dims_and_the_rank_limit_of_planning():
    # np.broadcast_shapes stops at 32 dims: a raw RuntimeError from inside numpy, though
    # numpy arrays go to 64; planning names dims with 52 letters: a rank above is named
    x, y = np.ones((2,) + (1,) * 39, np.float32), np.arange(3, dtype=np.float32)
    for f in (lambda a, b: a * b + 1.0, lambda a, b: eins.where(a > 0, b, a)):
        got, want = eins.jit(f)(x, y), f(x, y)
        assert got.shape == want.shape == (2,) + (1,) * 38 + (3,)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(eins.distribute(lambda a, b: a * b, devices=2)(x, y), x * y)
    with pytest.raises(ShapeError, match=r"mul: a tensor of rank above 52 cannot be planned "
                                         r"\(eins names dimensions with 52 letters; dimension "
                                         r"52 has none\) \(at test_ops_elementwise.py:\d+\)"):
        eins.distribute(lambda a: a * 2.0, devices=2)(np.ones((1,) * 53, np.float32))
    with pytest.raises(ShapeError, match=r"add: shapes \(2, 2, 3\) and \(4, 3\) do not "):
        eins.add(np.ones((2, 2, 3)), np.ones((4, 3)))


def test_broadcast_signature_marks_size1_dims_unindexed():
    from eins.ops.elementwise import broadcast_signature
    assert broadcast_signature([(2, 1, 4), (3, 1), ()], (2, 3, 4)) == "a_c,b_,->abc"


@pytest.mark.parametrize("name", ["exp", "neg", "relu", "gelu", "silu", "sigmoid", "rsqrt",
                                  "square", "abs", "tanh", "cos", "sin", "sqrt", "log"])
def test_unary_specs(name):
    x = rand((4, 3), np.float32, 0.1, 2)
    assert check_specs(name, [x], ps=(2, 3, 4)).decomps >= 3


@pytest.mark.parametrize("name", sorted(BIN_REF) + ["pow"] + sorted(CMP_REF))
def test_binary_specs_with_broadcasting(name):
    a, b = rand((4, 1, 3), np.float32, 0.5, 2, seed=1), rand((2, 3), np.float32, 0.5, 2, seed=2)
    assert check_specs(name, [a, b]).decomps >= 4
    # a Literal (shape ()) operand has the empty subscript
    check_specs(name, [a, np.asarray(1.5, np.float32)])


def test_where_and_astype_specs():
    c = rand((3, 4), np.bool_)
    check_specs("where", [c, rand((4,)), np.asarray(0.0, np.float32)])
    check_specs("astype", [rand((3, 4))], {"dtype": np.dtype(np.float16)})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=0, max_size=3),
       st.lists(st.booleans(), min_size=3, max_size=3),
       st.sampled_from(["add", "mul", "maximum", "less"]))
def test_broadcast_property(shape, drop, name):
    """Random broadcasting pairs: result equals numpy's, and every spec recomposes."""
    a = rand(tuple(shape), np.float32, seed=1)
    sb = tuple(1 if d else n for n, d in zip(shape, drop))[1:] if shape else ()
    b = rand(sb, np.float32, seed=2)
    got = eins.jit(getattr(eins, name))(a, b)
    ref = {"add": np.add, "mul": np.multiply, "maximum": np.maximum, "less": np.less}[name]
    np.testing.assert_array_equal(got, ref(a, b))
    check_specs(name, [a, b], ps=(2,))


@pytest.mark.parametrize("name", ["neg", "abs", "exp", "relu", "square", "add", "maximum",
                                  "less", "div"])
def test_kernels_return_fresh_arrays(name):
    # impl skips the cast copies when dtypes already agree; its result must still be a new
    # array that shares no memory with an operand (the runtime may reuse operand buffers)
    prim = get_primitive(name)
    x = rand((3, 4), np.float32)
    y = np.zeros((3, 4), np.float32) if name != "div" else np.ones((3, 4), np.float32)
    args = (x,) if name in ("neg", "abs", "exp", "relu", "square") else (x, y)
    (out,) = prim.impl(*args)
    assert not any(np.shares_memory(out, a) for a in args)
    ref = {"neg": np.negative, "abs": np.abs, "exp": np.exp, "relu": lambda v: np.maximum(v, 0),
           "square": np.square, "add": np.add, "maximum": np.maximum, "less": np.less,
           "div": np.divide}[name](*args)
    np.testing.assert_array_equal(out, ref)
    assert out.dtype == ref.dtype


def test_integer_to_negative_power_is_a_clear_error():
    with pytest.raises(DTypeError, match=r"pow: an integer base to the negative integer power "
                                         r"-2; cast the base to a float dtype"):
        eins.jit(lambda x, e: x ** e)(np.arange(3), np.array([1, -2, 0]))
    np.testing.assert_array_equal(eins.pow(np.arange(3), 2), [0, 1, 4])

    def f(x):
        return x ** -1
    # an exponent known while tracing (a literal, a numpy constant) fails there, at the line
    for g, power in ((f, -1), (lambda x: eins.pow(x, np.array([2, -3])), -3)):
        with pytest.raises(DTypeError, match=rf"negative integer power {power}; .* \(at "
                                             rf"test_ops_elementwise.py:"
                                             rf"{g.__code__.co_firstlineno + (g is f)}\)"):
            eins.make_ir(g)(eins.ShapeDtype((2,), "int32"))


def test_python_int_at_the_int32_bounds_stays_int32():
    """NEP 50: a Python int next to an int32 array takes int32 when it fits, the bounds
    included (2**31 - 1 and -2**31), and is an error one past them."""
    x = np.array([0, -5], np.int32)
    y = eins.jit(lambda x: x + 2147483647)(x)
    assert y.dtype == np.int32 and y.tolist() == [2147483647, 2147483642]
    y = eins.jit(lambda x: x * -2147483648)(np.array([1], np.int32))
    assert y.dtype == np.int32 and y.tolist() == [-2147483648]
    with pytest.raises(DTypeError, match="2147483648 is out of bounds for int32"):
        eins.jit(lambda x: x + 2147483648)(x)
    with pytest.raises(DTypeError, match="-2147483649 is out of bounds for int32"):
        eins.jit(lambda x: x + -2147483649)(x)


@pytest.mark.parametrize("fn", [
    lambda x: x == 2**40, lambda x: x != 2**40, lambda x: x < 2**40, lambda x: x <= -2**40,
    lambda x: x > -2**40, lambda x: x >= 2**63, lambda x: 2**40 > x, lambda x: -2**40 >= x,
    lambda x: eins.equal(2**70, x)])
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_comparing_with_an_int_the_dtype_cannot_hold_is_numpys_answer(fn, dtype):
    """numpy 2 (NEP 50) compares by value where arithmetic refuses (x + 2**40 above):
    int32 == 2**40 is all False; eins raised 'out of bounds for int32'."""
    x = np.array([1, -5, np.iinfo(dtype).max, np.iinfo(dtype).min], dtype)
    want = fn(x)
    for got in (eins.jit(fn)(x), eins.distribute(fn, devices=2)(x)):
        assert got.dtype == np.bool_ and got.tolist() == want.tolist()
