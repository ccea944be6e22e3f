"""numpy's other ufuncs (eins/ops/ufuncs.py): each against numpy itself on every dtype it is
defined on (values, dtype and shape), numpy's refusals as DTypeErrors naming the ufunc, the
Python operators on traced arrays, and the Triton kernels (the fused GPU programs, under the
interpreter) against numpy."""
import numpy as np
import pytest

import eins
from eins.errors import DTypeError
from eins.ops.ufuncs import BINARY, UNARY
from helpers import assert_close

R = np.random.default_rng(5)
FLOAT = np.concatenate([R.standard_normal(40) * 3, [0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5,
                                                    np.inf, -np.inf, np.nan]]).astype(np.float32)
INTS = np.concatenate([R.integers(-100, 100, 40), [0, 1, -1, 7, -7, 127, -128]])
DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64", "bool"]


def operand(dtype, seed=0):
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return np.random.default_rng(seed).random(50) < 0.5
    if dt.kind in "iu":
        v = np.random.default_rng(seed).permutation(INTS)[:50]
        info = np.iinfo(dt)
        return np.clip(v, info.min, info.max).astype(dt)
    return np.random.default_rng(seed).permutation(FLOAT)[:50].astype(dt)


def defined(ufunc, dtype) -> bool:
    try:
        ufunc.resolve_dtypes((np.dtype(dtype),) * ufunc.nin + (None,))
        return True
    except TypeError:
        return False


CASES = [(n, d) for n, spec in {**UNARY, **BINARY}.items() for d in DTYPES]


@pytest.mark.parametrize("name,dtype", CASES)
def test_each_ufunc_equals_numpys_on_every_dtype(name, dtype):
    ufunc = {**UNARY, **BINARY}[name][0]
    xs = [operand(dtype, s) for s in range(ufunc.nin)]
    if name in ("left_shift", "right_shift"):
        xs[1] = np.abs(xs[1]) % 5    # shifts within the width
    fn = lambda *a: ufunc(*a)  # noqa: E731 - numpy's own call, traced through __array_ufunc__
    if name == "nextafter" and dtype == "float16":   # float32's next value is not float16's
        with pytest.raises(DTypeError, match="nextafter: float16 is computed in float32"):
            eins.jit(fn)(*xs)
        return
    if not defined(ufunc, dtype):
        with pytest.raises(DTypeError, match=f"{name}: numpy's {ufunc.__name__} is not defined "
                                             f"for {dtype}"):
            eins.jit(fn)(*xs)
        return
    with np.errstate(all="ignore"):
        want = ufunc(*xs)
    got = eins.jit(fn)(*xs)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, n=2)


def test_python_operators_are_numpys():
    a, b = operand("int32", 1), operand("int32", 2)
    b = np.where(b == 0, 3, b)
    m, n = a > 0, b > 0
    f = eins.jit(lambda a, b, m, n: (a // b, a % b, a & b, a | b, a ^ b, ~a, a >> 2, a << 1,
                                     m & n, m | n, ~m, m ^ n, divmod(a, b)[1]))
    want = (a // b, a % b, a & b, a | b, a ^ b, ~a, a >> 2, a << 1, m & n, m | n, ~m, m ^ n,
            divmod(a, b)[1])
    for g, w in zip(f(a, b, m, n), want):
        np.testing.assert_array_equal(g, w)
        assert g.dtype == w.dtype


def test_bfloat16_computes_in_float32_and_keeps_its_dtype():
    from eins.ir.types import bfloat16
    x = operand("float32").astype(bfloat16)
    got = eins.jit(lambda x: np.log1p(np.abs(x)) + np.floor(x))(x)
    assert got.dtype == bfloat16
    xf = x.astype(np.float32)
    assert_close(got, (np.log1p(np.abs(xf)).astype(bfloat16).astype(np.float32) +
                       np.floor(xf)).astype(bfloat16), n=4, dtype=bfloat16)


def _all_of(kind, dtype):
    """One function applying every ufunc of ``kind`` defined on ``dtype`` (fused into few
    kernels), the numpy results and the arguments."""
    table = UNARY if kind == 1 else BINARY
    names = [n for n, s in table.items() if defined(s[0], dtype)]
    xs = [operand(dtype, s) for s in range(kind)]
    if kind == 2 and np.dtype(dtype).kind in "iu":
        xs[1] = np.abs(xs[1]) % 5
    if kind == 1 and np.dtype(dtype).kind in "iu":
        # numpy's integer reciprocal of 0 is the platform's 1 / 0 (INT_MIN on x86); the
        # GPU kernel's is 0: an integer 1 / 0 has no value to agree on
        xs[0] = np.where(xs[0] == 0, 3, xs[0]).astype(dtype)

    def f(*a):
        return tuple(table[n][0](*a) for n in names)
    return names, f, xs


@pytest.mark.parametrize("kind", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "int32", "bool"])
def test_triton_kernels_under_the_interpreter(kind, dtype):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    names, f, xs = _all_of(kind, dtype)
    with np.errstate(all="ignore"):
        want = f(*xs)
    got = eins.distribute(f, devices=2, backend="interpret")(*xs)
    for n, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, n
        assert_close(g, w, n=4, err_msg=n) if np.dtype(w.dtype).kind == "f" else \
            np.testing.assert_array_equal(g, w, err_msg=n)


# the ufuncs written as compositions of the primitives (eins/ops/ufuncs.py COMPOSITE_UFUNCS)
EDGES = np.array([0.0, -0.0, -2.0, 2.0, 0.5, -0.5, 1e-45, 1e-40, 3e38, -3.4028235e38,
                  65504.0, -65504.0, 6e-8, np.inf, -np.inf, np.nan])
COMPOSITES = [("modf", np.modf), ("frexp", np.frexp), ("spacing", np.spacing),
              ("ldexp", np.ldexp), ("divmod", np.divmod)]


def _composite_args(name, dtype):
    x = operand(dtype)
    if np.dtype(dtype).kind == "f":
        with np.errstate(all="ignore"):
            x = np.concatenate([x, EDGES.astype(dtype)])
    if name == "ldexp":
        return x, np.random.default_rng(3).integers(-40, 40, x.shape).astype(np.int32)
    if name == "divmod":
        y = operand(dtype, 1) if np.dtype(dtype) == np.bool_ else np.concatenate(
            [operand(dtype, 1), x[50:]]).astype(dtype)
        return x, np.where(y == 0, 3, y).astype(dtype) if dtype != "bool" else np.ones_like(x)
    return (x,)


def _same(g, w):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, w)
    if w.dtype.kind == "f":   # the signs of zeros and infinities too
        keep = ~np.isnan(w)
        np.testing.assert_array_equal(np.signbit(g[keep]), np.signbit(w[keep]))


@pytest.mark.parametrize("name,ufunc", COMPOSITES, ids=[c[0] for c in COMPOSITES])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int8", "int32", "bool"])
def test_composite_ufuncs_equal_numpys_bit_for_bit(name, ufunc, dtype):
    xs = _composite_args(name, dtype)
    fn = lambda *a: ufunc(*a)  # noqa: E731 - numpy's own call, traced through __array_ufunc__
    try:
        with np.errstate(all="ignore"):
            want = ufunc(*xs)
    except TypeError:
        with pytest.raises(DTypeError, match=f"{name}: numpy's {name} is not defined"):
            eins.jit(fn)(*xs)
        return
    got = eins.jit(fn)(*xs)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _same(np.asarray(g), np.asarray(w))


def test_ldexp_rounds_once_at_the_ends_of_the_range():
    x = np.array([1e-300, 5e-324, 1.0, 3.0, 1.5, 0.75, -0.0, np.inf])
    e = np.array([2000, 1074, 1023, -1075, 1023, -1073, 5, -3000])
    _same(eins.jit(lambda x, e: np.ldexp(x, e))(x, e), np.ldexp(x, e))
    with pytest.raises(DTypeError, match="ldexp: numpy's ldexp is not defined for float32 "
                                         "and float32"):
        eins.jit(lambda x: np.ldexp(x, x))(FLOAT)


def test_composite_and_integer_ufuncs_under_the_triton_interpreter():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    x = np.concatenate([FLOAT, EDGES.astype(np.float32)])
    e = np.random.default_rng(3).integers(-40, 40, x.shape).astype(np.int32)
    a, b = operand("int32", 1), operand("int32", 2)

    def f(x, e, a, b):
        return (*np.modf(x), *np.frexp(x), np.spacing(x), np.ldexp(x, e), *np.divmod(a, b),
                np.gcd(a, b), np.lcm(a, b), np.bitwise_count(a))
    with np.errstate(all="ignore"):
        want = f(x, e, a, b)
    got = eins.distribute(f, devices=2, backend="interpret")(x, e, a, b)
    for g, w in zip(got, want):
        _same(np.asarray(g), w)


def test_composite_ufuncs_differentiate_through_their_primitives():
    # d modf(x)[0] = 1, d frexp(x)[0] = 2 ** -exponent, d ldexp(x, e) = 2 ** e, spacing
    # and the integral part are piecewise constant (0)
    x = np.linspace(-3.3, 3.1, 12)
    e = np.arange(12) - 6
    cases = [(lambda x: np.sum(np.modf(x)[0] + 2 * np.modf(x)[1]), np.ones_like(x)),
             (lambda x: np.sum(np.frexp(x)[0]), 2.0 ** -np.frexp(x)[1]),
             (lambda x: np.sum(np.ldexp(x, e)), 2.0 ** e),
             (lambda x: np.sum(np.spacing(x)), np.zeros_like(x))]
    for f, want in cases:
        np.testing.assert_array_equal(eins.grad(f)(x), want)
