"""Generated elementwise Triton kernels keep numpy's semantics under the interpreter: bool and
NaN rules, integer powers (exact, wrapping, negative exponents refused on every backend),
bfloat16 casts rounding to nearest even, and float powers and tanh at C's edge cases."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.kernels.fusion import fused_source, launch_fused, op_source  # noqa: E402
from eins.errors import DTypeError  # noqa: E402
from eins.ir.types import bfloat16  # noqa: E402


@pytest.mark.parametrize("name", ["bool add", "bool add literal", "maximum nan", "minimum nan",
                                  "relu nan", "fused nan chain"])
def test_generated_kernels_keep_numpys_bool_and_nan_semantics(name):
    """Found under the interpreter, so in the Triton source the GPU runs too: bool + bool
    was int1 addition (True + True = False; numpy's is or), and tl.maximum / tl.minimum
    (relu is maximum(x, 0)) dropped a NaN operand where np.maximum keeps it."""
    a = np.array([True, False, True, False])
    b = np.array([True, True, False, False])
    x = np.array([np.nan, 1.0, 0.0, 3.0, -1.0, np.nan], np.float32)
    y = np.array([1.0, np.nan, -2.0, 0.0, 2.0, np.nan], np.float32)
    fn, args = {
        "bool add": (lambda p, q: p + q, (a, b)),
        "bool add literal": (lambda p: p + True, (a,)),
        "maximum nan": (eins.maximum, (x, y)),
        "minimum nan": (eins.minimum, (x, y)),
        "relu nan": (eins.relu, (x,)),
        "fused nan chain": (lambda p, q: eins.relu(eins.maximum(p, q) * 2.0) + 1.0, (x, y)),
    }[name]
    want = eins.jit(fn)(*args)
    for p in (1, 2):
        got = eins.distribute(fn, devices=p, backend="interpret")(*args)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)   # NaN where want has NaN
    if name.startswith("bool"):
        assert want.tolist() == ([True, True, True, False] if name == "bool add" else [True] * 4)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_power_is_exact_and_wraps_as_numpy(dtype):
    """libdevice.pow takes floats only: an integer x ** y failed inside Triton ('Expected
    dtype fp32, fp64 but got int32'). It is exponentiation by squaring (_ipow), wrapping
    on overflow as numpy's."""
    x = np.array([-3, -1, 0, 1, 2, 3, 7, -2, 100000, 5], dtype)
    y = np.array([3, 5, 0, 7, 31, 4, 2, 9, 3, 0], dtype)
    for fn, args in [(lambda p, q: p ** q, (x, y)), (lambda p: p ** 3 + p, (x,))]:
        want = eins.jit(fn)(*args)
        for p in (1, 2):
            got = eins.distribute(fn, devices=p, backend="interpret")(*args)
            assert got.dtype == want.dtype == dtype
            np.testing.assert_array_equal(got, want)


def _shifted_power(a, b):
    c = a + 1
    return (c ** b) * 2


def test_negative_integer_power_is_refused_on_every_backend():
    """numpy refuses an integer base to a negative integer power; the GPU kernels returned
    truncated values instead (2 ** -1 == 0: a wrong answer). Their fused kernel now checks
    the exponent and the call raises numpy's error, naming the eqn and the user's line, on
    every backend and with graphs on or off; the next call with good exponents is right."""
    a = np.array([2, 3, 4, 5, 6], np.int32)
    bad = np.array([1, -1, 2, -2, 0], np.int32)
    good = np.array([1, 3, 2, 0, 2], np.int32)
    line = _shifted_power.__code__.co_firstlineno + 2
    # the most negative exponent over all blocks, as numpy's b.min(), on every backend
    msg = (rf"^eqn 1 \(pow\) at test_triton_semantics.py:{line}: pow: an integer base to the "
           rf"negative integer power -2; cast the base to a float dtype")
    want = eins.jit(_shifted_power)(a, good)
    np.testing.assert_array_equal(want, (a + 1) ** good * 2)
    with pytest.raises(DTypeError, match=msg):
        eins.jit(_shifted_power)(a, bad)
    for p in (2, 5):   # -1 and -2 in different blocks: the numpy backend ran its first
        #                  failing block's alone and said -1 (ahead of -2 on device 0 or 1)
        with pytest.raises(DTypeError, match=msg):
            eins.distribute(_shifted_power, devices=p, backend="numpy")(a, bad)
    np.testing.assert_array_equal(
        eins.distribute(_shifted_power, devices=2, backend="numpy")(a, good), want)
    for p, graphs in [(1, False), (2, False), (2, True)]:
        c = eins.distribute(_shifted_power, devices=p, backend="interpret", graphs=graphs)
        with pytest.raises(DTypeError, match=msg):
            c(a, bad)
        np.testing.assert_array_equal(c(a, good), want)
        with pytest.raises(DTypeError, match=msg):   # the graph replays check too
            c(a, bad)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_call_failing_after_its_checks_leaves_no_verdict_behind(monkeypatch, graphs):
    """A call whose kernels recorded a negative exponent but that failed otherwise before
    its check was read (an interrupt, a transfer error) must not make the next good call
    raise: each call's verdicts start clean."""
    from eins.runtime import gpu
    a = np.array([2, 3, 4, 5, 6], np.int32)
    bad = np.array([1, -1, 2, -2, 0], np.int32)
    good = np.array([1, 3, 2, 0, 2], np.int32)
    c = eins.distribute(_shifted_power, devices=2, backend="interpret", graphs=graphs)
    want = c(a, good)
    run = gpu.Runtime.run

    def interrupted(self, io):
        run(self, io)
        raise KeyboardInterrupt
    monkeypatch.setattr(gpu.Runtime, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        c(a, bad)
    monkeypatch.setattr(gpu.Runtime, "run", run)
    np.testing.assert_array_equal(c(a, good), want)
    with pytest.raises(DTypeError, match="negative integer power -2;"):
        c(a, bad)


def test_only_tensor_exponents_of_integer_powers_are_checked():
    """The check is in the kernel only where numpy could refuse at run time: an integer
    pow whose exponent is a tensor. A literal exponent is checked at trace time; a float
    pow never refuses. Launched alone (launch_fused) a checked kernel raises too."""
    prog = eins.make_ir(_shifted_power)(np.zeros(4, np.int32), np.zeros(4, np.int32))
    fk = fused_source(prog, [0, 1, 2])
    assert fk.checks == (1,) and "err" in fk.source.split("):")[0]
    lit = eins.make_ir(lambda a: (a + 1) ** 3 * 2)(np.zeros(4, np.int32))
    flt = eins.make_ir(_shifted_power)(np.zeros(4, np.float32), np.zeros(4, np.float32))
    for prog in (lit, flt):
        fk = fused_source(prog, [0, 1, 2])
        assert fk.checks == () and "err" not in fk.source
    i32 = np.dtype(np.int32)
    fk = op_source("pow", {}, [((4,), i32), ((4,), i32)], (4,), i32)
    x = torch.tensor([2, 3, 4, 5], dtype=torch.int32)
    out = torch.empty(4, dtype=torch.int32)
    launch_fused(fk, [x, torch.tensor([0, 1, 2, 3], dtype=torch.int32)], [out])
    assert out.tolist() == [1, 3, 16, 125]
    with pytest.raises(DTypeError, match=r"^pow: an integer base to the negative integer "
                                         r"power -3;"):
        launch_fused(fk, [x, torch.tensor([0, 1, -3, 3], dtype=torch.int32)], [out])


@pytest.mark.parametrize("src", [np.int32, np.int64, np.bool_, np.float64, np.float32,
                                 np.float16])
def test_casts_to_bfloat16_keep_the_values_under_the_interpreter(src):
    """The interpreter casts to bfloat16 properly from float32 and float16 only: from ints,
    bools and float64 it kept the value's bits (int32 -7 became NaN, 1 a denormal). Fused
    kernels cast through the helper _to_bf16, which the interpreter's prelude replaces."""
    from eins.ir.types import bfloat16
    x = (np.array([-7, -1, 0, 1, 2, 100, 255, -300]) if src is not np.bool_ else
         np.array([True, False, True, True, False, True, False, True])).astype(src)
    if np.dtype(src).kind == "f":
        x = x + np.array([0, 0.5, 0, 0.25, 0, 0.5, 0, 0], src)
    fns = [lambda v: eins.astype(v, bfloat16),
           lambda v: eins.astype(v, bfloat16) * 2.0]   # a cast inside a fused chain
    # and rounded once: through float32 by rounding to nearest, 2**24 + 2**16 + 1 became
    # 2**24 (a tie in bfloat16), where numpy's one rounding gives 2**24 + 2**17
    hard = {np.int32: [2 ** 24 + 2 ** 16 + 1, -(2 ** 24 + 2 ** 16 + 1)],
            np.int64: [2 ** 24 + 2 ** 16 + 1, 2 ** 40 + 2 ** 32 + 1],
            np.float64: [1 + 2 ** -8 + 2 ** -30, -(1 + 2 ** -8 + 2 ** -30)]}.get(src, [])
    x = np.concatenate([x, np.array(hard, src)]) if hard else x
    for fn in fns:
        want = eins.jit(fn)(x)
        got = eins.distribute(fn, devices=2, backend="interpret")(x)
        assert got.dtype == want.dtype == bfloat16
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")   # 3.4e38 * 2 is inf
def test_fused_casts_to_bfloat16_round_to_nearest_even_under_the_interpreter():
    """The interpreter truncated float32 -> bfloat16 (1 + 2**-8 + 2**-10 became 1, not
    1.0078125); the GPU's conversion and numpy's (ml_dtypes) round to nearest even."""
    from eins.ir.types import bfloat16
    rng = np.random.default_rng(0)
    x = np.concatenate([np.array([1 + 2 ** -8 + 2 ** -10, 1 + 3 * 2 ** -8, 1 + 2 ** -9,
                                  -(1 + 2 ** -8 + 2 ** -10), np.nan, np.inf, -np.inf, 3.4e38,
                                  -0.0, 1e-40], np.float32),
                        (rng.standard_normal(500) * 100).astype(np.float32)])
    fn = lambda v: eins.astype(v * 2.0, bfloat16)   # noqa: E731
    want = eins.jit(fn)(x).astype(np.float32)
    got = eins.distribute(fn, devices=2, backend="interpret")(x).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[8])


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:invalid value:RuntimeWarning")   # numpy under the interpreter
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_float_power_keeps_cs_edge_cases_under_the_interpreter(dtype):
    """The interpreter's stand-in for libdevice.pow gave NaN for pow(1, nan), pow(-1, inf),
    pow(-inf, 0.5) and lost the sign of pow(-0.0, -1); tanh(-0.0) came back +0.0."""
    a = np.array([1, -1, -np.inf, -np.inf, -0.0, -0.0, -0.0, -0.0, -1, -np.inf, 2, 0, np.nan,
                  -8, 3, -2], dtype)
    b = np.array([np.nan, np.inf, 0.5, -0.5, -1, -3, 0.5, 3, -np.inf, 3, -np.inf, -1, 0,
                  2, 0.5, 3], dtype)
    fn = lambda p, q: p ** q   # noqa: E731
    with np.errstate(all="ignore"):
        want = fn(a, b)
    got = eins.distribute(fn, devices=2, backend="interpret")(a, b)
    rtol = {np.float32: 1e-6, np.float64: 1e-13, np.float16: 1e-3}[dtype]   # exp2(b log2 a)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0)   # infs, zeros and NaNs exact
    finite_or_inf = ~np.isnan(want)
    assert (np.signbit(got) == np.signbit(want))[finite_or_inf].all()
    z = np.array([-0.0, 0.0, -1.0, 1.0], dtype)
    t = eins.distribute(eins.tanh, devices=1, backend="interpret")(z)
    assert np.signbit(t).tolist() == [True, False, True, False]


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:invalid value:RuntimeWarning")   # numpy under the interpreter
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_interpreted_tanh_is_accurate_near_zero(dtype):
    """The interpreter's tanh was (1 - e**-2|x|) / (1 + e**-2|x|), which cancels near 0:
    tanh(1e-8) came back 0 and tanh(1e-6) 1.3 % off in float32 (an atol hid it)."""
    x = np.array([1e-30, 1e-8, -1e-6, 1e-5, -1e-4, 0.01, 0.3, -0.7, 3.0, 20.0, -np.inf, np.inf,
                  np.nan, -0.0, 0.0], dtype)
    got = np.asarray(eins.distribute(eins.tanh, devices=1, backend="interpret")(x))
    want = np.tanh(x)
    fin = np.isfinite(want) & (want != 0)
    ulps = np.abs(got[fin] - want[fin]) / np.spacing(np.abs(want[fin]))
    assert ulps.max() <= 4, ulps
    np.testing.assert_array_equal(got[~fin], want[~fin])
    assert (np.signbit(got) == np.signbit(want))[~np.isnan(want)].all()


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:overflow encountered:RuntimeWarning")   # the infs asked for
@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_interpreted_float_power_rounds_as_numpy(dtype):
    """exp2(b * log2|a|) in float32 was 66 float32 ulps off at 10 ** 20 and 63.0 ** 2 came
    back 3970 in float16 (numpy: 3968); narrower than float64 is computed in float64."""
    dt = eins.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.uniform(5, 15, 256), [63.0, 1000.5, 3000.25, 7.0]]).astype(dt)
    for power in (2, 3, 20):
        if dt != np.float32 and power == 20:
            continue   # past float16's range
        f = lambda x: x ** power   # noqa: E731
        got = np.asarray(eins.distribute(f, devices=1, backend="interpret")(a)).astype(
            np.float64)
        want = (a.astype(np.float64) ** power).astype(dt).astype(np.float64)  # one rounding
        fin = np.isfinite(want)
        np.testing.assert_array_equal(got[~fin], want[~fin])   # overflow: inf as numpy
        ulps = np.abs(got[fin] - want[fin]) / np.spacing(np.abs(want[fin]).astype(dt)).astype(
            np.float64)
        assert ulps.max() <= (0.5 if dt != np.float32 else 1), (power, ulps.max())
