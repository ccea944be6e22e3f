import numpy as np
import pytest

import eins
from eins.errors import ShapeError, TraceError
from helpers import assert_close


def test_matmul_traces_and_runs():
    def f(a, b):
        return a @ b

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(12, dtype=np.float32).reshape(3, 4)
    p = eins.make_ir(f)(a, b)
    assert str(p) == ("{ lambda  ; a:f32[2,3] b:f32[3,4]. let\n"
                      "    c:f32[2,4] = matmul a b\n"
                      "  in (c) }")
    np.testing.assert_array_equal(eins.jit(f)(a, b), a @ b)


def test_shape_error_names_shapes_and_user_line():
    def f(a, b):
        return a @ b  # the offending line

    with pytest.raises(ShapeError) as e:
        eins.make_ir(f)(eins.ShapeDtype((2, 3)), eins.ShapeDtype((4, 5)))
    msg = str(e.value)
    assert "(2, 3)" in msg and "(4, 5)" in msg and "test_tracing.py:" in msg


def test_jit_caches_per_signature():
    calls = []

    @eins.jit
    def f(a):
        calls.append(1)
        return a @ a

    a = np.eye(3, dtype=np.float32)
    f(a)
    f(a + 1)
    assert len(calls) == 1
    f(np.eye(4, dtype=np.float32))
    assert len(calls) == 2


def test_bool_of_tracer_is_a_clear_error():
    def f(a):
        if a:
            return a
        return a

    with pytest.raises(TraceError, match="control flow"):
        eins.make_ir(f)(eins.ShapeDtype((2,)))


def test_numpy_ufuncs_on_tracers_run_the_eins_operator():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    f = eins.jit(lambda x: np.exp(x) + np.ones((2, 3), np.float32) * x)
    assert_close(f(a), np.exp(a) + a, n=2)


def test_numpy_functions_without_an_eins_operator_are_clear_errors():
    a = np.ones((2, 3), np.float32)
    # a ufunc eins has no operator for, with its hint: what to write instead
    with pytest.raises(TraceError, match=r"numpy.vecdot cannot run on a traced array; write "
                                         r"np.einsum\('...i,...i->...', a, b\).*"
                                         r"test_tracing.py:\d+"):
        eins.jit(lambda x: np.vecdot(x, x))(a)
    # no hint of its own: the closest traced names, then every traced function
    with pytest.raises(TraceError, match=r"numpy.cumulative_prod cannot run on a traced array; "
                                         r"the closest traced: np.cumprod.*; numpy functions "
                                         r"eins traces: \[.*'sum'.*test_tracing.py:\d+"):
        eins.jit(lambda x: np.cumulative_prod(x, axis=0))(a)
    with pytest.raises(TraceError, match=r"no concrete value.*test_tracing.py:\d+"):
        eins.jit(lambda x: np.asarray(x))(a)


# ----------------------------------------------------------------------------- numpy protocol
X = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7


@pytest.mark.parametrize("call", [
    lambda m, x: m.sum(x),
    lambda m, x: m.sum(x, axis=1),
    lambda m, x: m.sum(x, axis=(0, 2), keepdims=True),
    lambda m, x: m.sum(x, 0, None, None, True),           # numpy's positional order
    lambda m, x: m.sum(x, axis=-1, dtype=np.float64),     # accumulates in float64
    lambda m, x: m.sum(x, out=None),
    lambda m, x: m.mean(x, axis=2, keepdims=True),
    lambda m, x: m.max(x, axis=1), lambda m, x: m.amax(x), lambda m, x: m.min(x, 0),
    lambda m, x: m.amin(x, axis=(1, 2), keepdims=True),
    lambda m, x: m.transpose(x), lambda m, x: m.transpose(x, (1, 0, 2)),
    lambda m, x: m.reshape(x, (6, 4)), lambda m, x: m.reshape(x, (-1,)),
    lambda m, x: m.where(x > 1, x, 0.0), lambda m, x: m.concatenate([x, x], axis=1),
    lambda m, x: m.einsum("abc,abd->cd", x, x), lambda m, x: m.dot(x[0], x[0].T),
    lambda m, x: m.shape(x)[0] * x, lambda m, x: x.sum(axis=1, keepdims=True, out=None),
    lambda m, x: x.mean(-1, dtype=np.float64), lambda m, x: x.max(axis=0, keepdims=True),
    lambda m, x: m.mean(x, dtype=np.int32), lambda m, x: m.sum(x > 1, dtype=np.int32),
    lambda m, x: m.concatenate([x, x], axis=-1, dtype=np.float64),   # casts first
    lambda m, x: m.astype(x, np.float16), lambda m, x: m.ndim(x) * m.size(x, 1) * x,
    # var/std: numpy's two-pass formula, ddof, keepdims, dtype, ints computed in float64
    lambda m, x: m.var(x), lambda m, x: m.std(x, axis=1),
    lambda m, x: m.var(x, axis=(0, 2), keepdims=True, ddof=1),
    lambda m, x: x.std(-1, ddof=1, keepdims=True), lambda m, x: x.var(dtype=np.float64),
    lambda m, x: m.var(x, axis=0, correction=1),
    lambda m, x: m.var((x * 7).astype(np.int32), axis=1),
    lambda m, x: (x - x.mean(-1, keepdims=True)) / m.sqrt(x.var(-1, keepdims=True) + 1e-5),
])
def test_numpy_functions_on_tracers_follow_numpys_keywords(call):
    """NEP 18: numpy's own functions on traced arrays equal numpy on the data, dtype included."""
    want = call(np, X)
    got = eins.jit(lambda x: call(np, x))(X)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, n=X.size)


@pytest.mark.parametrize("call,needle", [
    (lambda x: np.sum(x, out=np.empty(())), r"numpy.sum: out=.* not supported on traced arrays "
                                           r"\(a traced program is pure"),
    (lambda x: x.sum(out=np.empty(())), r"numpy.sum: out="),
    (lambda x: np.max(x, initial=3.0), r"numpy.max: initial=3.0 is not supported"),
    (lambda x: np.sum(x, where=x > 0), r"numpy.sum: where=.*\(mask the operand with eins.where"),
    (lambda x: x.max(dtype=np.float64), r"numpy.max: dtype=.*take no dtype"),
    (lambda x: np.reshape(x, (24,), order="F"), r"numpy.reshape: order='F' is not supported"),
    (lambda x: np.where(x > 0), r"numpy.where\(condition\) without x and y"),
    (lambda x: np.dot(x, x.T), r"numpy.dot of 3-d and 3-d traced arrays"),
    (lambda x: np.linalg.svd(x), r"numpy.linalg.svd cannot run on a traced array; no "
                                 r"decomposition traces"),
    (lambda x: np.linalg.norm(x[0], ord="nuc"), r"numpy.linalg.norm: ord='nuc' is not supported"),
    (lambda x: np.var(x, mean=x.mean()), r"numpy.var: mean=.* is not supported"),
    (lambda x: np.std(x, ddof=1, correction=1), r"numpy.std: ddof=1 and correction=1 both"),
    # an array given as out= is named by dtype and shape, not printed element by element
    (lambda x: np.concatenate([x, x], out=np.empty((4, 3, 4))),
     r"numpy.concatenate: out=<ndarray float64 \(4, 3, 4\)> is not supported on traced "
     r"arrays \(a traced program is pure"),
    (lambda x: np.einsum("abc->", x, out=np.empty(())), r"numpy.einsum: out=<ndarray float64 "
                                                       r"\(\)> is not supported"),
    (lambda x: np.einsum("abc->c", x, dtype=np.float64), r"numpy.einsum: dtype=<class "
                                                         r"'numpy.float64'> .*takes no options"),
    (lambda x: np.dot(x[0], x[0].T, out=np.empty((3, 3))), r"numpy.dot: out=<ndarray"),
    # ndarray methods: numpy's function named, not eins's handler ("handler() got ...")
    (lambda x: x.sum(foo=1), r"^numpy.sum on a traced array: got an unexpected keyword "
                             r"argument 'foo'"),
    (lambda x: x.max(1, None, None, True, 5, 6, 7), r"^numpy.max on a traced array: takes "),
])
def test_numpy_keywords_a_trace_cannot_follow_are_named(call, needle):
    with pytest.raises(TraceError, match=needle + r".*\(at test_tracing.py:\d+\)"):
        eins.jit(call)(X)


def test_numpys_older_reshape_signature_is_followed():
    # numpy < 2.1 passes np.reshape(x, newshape=...) on; numpy >= 2.4 no longer has it (its
    # own TypeError, before eins sees the call), so the handler is called as numpy did
    from eins.numpy_api import HANDLERS
    got = eins.jit(lambda x: HANDLERS["reshape"](x, newshape=(6, 4)))(X)
    np.testing.assert_array_equal(got, X.reshape(6, 4))
    with pytest.raises(TraceError, match=r"numpy.reshape: the new shape is missing \(at "
                                         r"test_tracing.py:\d+\)"):
        eins.jit(lambda x: HANDLERS["reshape"](x))(X)


def test_dict_argument_with_mixed_key_types_is_a_trace_error():
    with pytest.raises(TraceError, match=r"an argument is a dict with keys of types "
                                         r"\['int', 'str'\].*mutually sortable"):
        eins.jit(lambda d: d[1])({1: X, "a": X})
    with pytest.raises(TraceError, match="^an argument is a dict .*mutually sortable"):
        eins.make_ir(lambda d: d[1])({1: eins.ShapeDtype((2,)), "a": eins.ShapeDtype((2,))})

    def out(x):
        return {1: x, "a": x}
    with pytest.raises(TraceError, match=r"^out returned a dict with keys of types "
                                         r"\['int', 'str'\]"):   # it said "dict argument"
        eins.jit(out)(X)


def test_namedtuples_keep_their_class_in_and_out():
    """A namedtuple argument was flattened to a plain tuple (p.u failed inside the user's
    function) and a returned one came back as a tuple."""
    import collections
    P = collections.namedtuple("P", "u v")
    a = np.arange(3, dtype=np.float32)
    out = eins.jit(lambda p: P(p.u + p.v, p.u * 2))(P(a, a + 1))
    assert type(out) is P and list(out.u) == [1, 3, 5] and list(out.v) == [0, 2, 4]
    d = eins.distribute(lambda p, q: P(p.u + q[1], p.v), devices=2)(P(a, a), (a, a))
    assert type(d) is P and list(d.u) == [0, 2, 4]
    from eins.tracing import tree_flatten
    assert str(tree_flatten(P(a, (a, a)))[1]) == "P(u=*, v=(*, *))"
    # a namedtuple and a tuple of the same leaves are different signatures
    f = eins.jit(lambda t: t[0] + t[1])
    f(P(a, a))
    f((a, a))
    assert f.trace_count == 2


def test_closed_over_arrays_are_copied_at_trace_time():
    a = np.zeros((3,), np.float32)
    c = np.ones(3, np.float32)
    h = eins.jit(lambda x: x + c)
    first = h(a)
    c[:] = 5
    np.testing.assert_array_equal(h(a), first)


def test_results_never_alias_arguments():
    x = np.zeros((2, 2), np.float32)
    r = eins.jit(lambda x: x)(x)
    x[0, 0] = 9
    assert r[0, 0] == 0


# ------------------------------------- found by a bug hunt of the tracer (each a repro first)
def test_a_closed_over_array_changed_while_tracing_is_read_at_each_use():
    """Each use of a closed-over array reads the value it has there, as plain Python does
    (a mask or buffer filled in a loop); it was read once, so z got y's 1 instead of 2."""
    buf = np.zeros(3, np.float32)

    def f(x):
        buf[:] = 1.0
        y = x + buf
        buf[:] = 2.0
        z = x + buf
        return y, z, x - buf   # a second use of the unchanged value: no new constant

    x = np.zeros(3, np.float32)
    want = f(x)
    buf[:] = 0.0
    for got in (eins.jit(f)(x), eins.distribute(f, devices=3)(x)):
        buf[:] = 0.0
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    buf[:] = 0.0
    assert len(eins.make_ir(f)(x).consts) == 2
    # an array used twice, unchanged, is one constant
    w = np.arange(3.0, dtype=np.float32)
    assert len(eins.make_ir(lambda x: x * w + w)(x).consts) == 1


def test_true_division_of_bools_is_float64_as_numpys():
    m = np.array([True, False, True])
    for f in (lambda m: m / (m == False), lambda m: m / True,  # noqa: E712
              lambda m: m / m * 100000.0):
        with np.errstate(divide="ignore", invalid="ignore"):
            want = f(m)
        for got in (eins.jit(f)(m), eins.distribute(f, devices=3)(m)):
            assert got.dtype == want.dtype == np.float64
            np.testing.assert_array_equal(got, want)


def test_a_traced_value_kept_from_an_earlier_trace_is_a_clear_error():
    """It was accepted: outside any trace it printed a Tracer; in another trace it built
    a program whose output was never defined (or raised a KeyError deep inside)."""
    a = np.ones((3, 4), np.float32)
    kept = []

    def f(x):
        kept.append(x)
        return x + 1

    eins.jit(f)(a)
    with pytest.raises(TraceError, match=r"mul: a traced value was used after its trace ended "
                                         r".*\(at test_tracing.py:\d+\)"):
        kept[0] * 2
    with pytest.raises(TraceError, match=r"mul: a traced value was used after its trace "
                                         r"ended .*\(at test_tracing.py:\d+\)"):
        eins.make_ir(lambda x: (x, kept[0] * 2))(a)

    def outer(x):   # an enclosing trace's value mixed into an inner trace
        eins.make_ir(lambda y: y + x)(eins.ShapeDtype((3, 4), "float32"))
        return x

    with pytest.raises(TraceError, match=r"add: a traced value from another trace leaked in"):
        eins.make_ir(outer)(a)
    with pytest.raises(TraceError, match="returned a traced value of another trace"):
        eins.jit(lambda x: (x, kept[0]))(a)


def test_a_jitted_function_called_inside_a_trace_is_inlined():
    g = eins.jit(lambda y: y * 2)
    f = lambda x: g(x) + 1   # noqa: E731
    x = np.arange(4.0, dtype=np.float32)
    np.testing.assert_array_equal(eins.jit(f)(x), x * 2 + 1)
    np.testing.assert_array_equal(eins.distribute(f, devices=2)(x), x * 2 + 1)
    assert [e.prim for e in eins.make_ir(f)(x).eqns] == ["mul", "add"]
    assert g.trace_count == 0   # inlined: g was never traced on its own


@pytest.mark.parametrize("call", [lambda x: eins.sum([x, x]), lambda x: eins.mean(None),
                                  lambda x: eins.max("x"), lambda x: eins.softmax([x, x]),
                                  lambda x: eins.einsum("i->", [1.0, 2.0])])
def test_a_non_array_operand_of_a_reduction_softmax_or_einsum_is_a_trace_error(call):
    # a raw AttributeError ('list' object has no attribute 'shape') before
    with pytest.raises(TraceError, match=r"operand of type \w+ is not an array \(at "
                                         r"test_tracing.py:\d+\)"):
        eins.jit(call)(np.ones(3, np.float32))


def test_ndarray_methods_take_numpys_keywords():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for f in (lambda x: x.reshape(-1, order="C"), lambda x: x.reshape((4, 6), copy=None),
              lambda x: x.astype(np.float16, copy=False), lambda x: x.swapaxes(0, -1),
              lambda x: np.swapaxes(x, 1, 2)):
        got, want = eins.jit(f)(a), f(a)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TraceError, match=r"order='F' is not supported"):
        eins.jit(lambda x: x.reshape(-1, order="F"))(a)
    with pytest.raises(ShapeError, match=r"swapaxes: axis 3 is not an axis of shape \(2, 3, 4\) "
                                         r"\(at test_tracing.py:\d+\)"):
        eins.jit(lambda x: x.swapaxes(0, 3))(a)


def test_shape_dtype_size_is_exact():
    assert eins.ShapeDtype((2 ** 40, 2 ** 40)).size == 2 ** 80   # int64 wrapped to 0
    assert eins.ShapeDtype((2 ** 70,)).size == 2 ** 70           # OverflowError before
    assert eins.ShapeDtype((2, 3, 4)).ndim == 3 and eins.ShapeDtype(()).ndim == 0


def test_a_shape_dtype_outside_a_trace_is_named_at_the_users_line():
    with pytest.raises(TraceError, match=r"exp: a ShapeDtype has no data; use eins.jit or "
                                         r"eins.make_ir to trace with it \(at "
                                         r"test_tracing.py:\d+\)"):
        eins.exp(eins.ShapeDtype((2,)))


def test_len_and_iteration_of_traced_arrays():
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    first, *rest = eins.jit(lambda x: tuple(x))(a)   # iterates the leading dim, as numpy
    np.testing.assert_array_equal(first, a[0])
    assert len(rest) == 2 and eins.jit(lambda x: x * len(x))(a)[2, 1] == 15.0
    with pytest.raises(TraceError, match=r"len\(\) of a 0-d traced array \(float32\[\]\) "
                                         r"\(at test_tracing.py:\d+\)"):
        eins.jit(lambda x: len(x.sum()))(a)


def test_a_builtin_without_a_signature_is_traced_and_a_returned_array_is_a_constant():
    # inspect.signature(max) fails: the call is made as is, and max's comparisons meet the
    # tracer's clear control-flow error
    with pytest.raises(TraceError, match=r"Python control flow .*cannot depend on it"):
        eins.jit(max)(np.ones(3, np.float32), np.zeros(3, np.float32))
    const = np.arange(3.0)
    out = eins.jit(lambda x: (x + 1, const))(np.zeros(3, np.float32))
    np.testing.assert_array_equal(out[1], const)
    assert out[1] is not const and out[1].dtype == np.float64


def test_a_primitive_name_is_registered_once_and_bind_takes_the_primitive_itself():
    from eins.errors import EinsError
    from eins.ir.primitive import get_primitive, register
    from eins.tracing import bind
    add = get_primitive("add")
    assert get_primitive(add) is add
    np.testing.assert_array_equal(bind(add, np.ones(2), np.ones(2)), np.full(2, 2.0))
    with pytest.raises(EinsError, match="primitive 'add' registered twice"):
        register(add)


def test_tree_unflatten_checks_the_leaf_count():
    from eins.tracing import tree_flatten
    leaves, td = tree_flatten(((1, 2), {"w": 3}))
    assert eins.tree_unflatten(td, leaves) == ((1, 2), {"w": 3})
    for n in (2, 4):   # a bare StopIteration; extra leaves were dropped
        with pytest.raises(TraceError, match=f"the structure has 3 leaves, got {n}"):
            eins.tree_unflatten(td, list(range(n)))


@pytest.mark.parametrize("call,what", [
    (lambda x: int(x), r"int\(\) of a traced array"),
    (lambda x: float(x), r"float\(\) of a traced array"),
    (lambda x: x[:x], r"a traced array \(float32\[3\]\) used as a Python index or size"),
    (lambda x: list(range(x)), r"used as a Python index or size"),
])
def test_concrete_value_errors_say_what_was_asked(call, what):
    with pytest.raises(TraceError, match=what + r".*\(at test_tracing.py:\d+\)"):
        eins.jit(call)(np.ones(3, np.float32))


def test_a_bad_argument_is_named_as_the_user_wrote_it():
    def g(x, mode="relu", p=None):
        return x
    a = np.ones(3, np.float32)
    with pytest.raises(TraceError, match="keyword argument 'mode' of type str is not an array"):
        eins.jit(g)(a, mode="gelu")
    with pytest.raises(TraceError, match=r"keyword argument 'p'\['w'\]\[1\] of type str"):
        eins.jit(g)(a, p={"w": [a, "x"]})
    with pytest.raises(TraceError, match=r"argument 0\[1\] of type str"):
        eins.jit(g)((a, "x"))


def test_an_unsupported_operand_dtype_is_named():
    # was "dtypes ['float32', 'complex64'] do not promote": numpy promotes them
    with pytest.raises(eins.errors.DTypeError, match=r"mul: an operand's unsupported dtype "
                                                     r"'complex64'"):
        eins.jit(lambda x: x * np.complex64(1j))(np.ones(3, np.float32))


def test_two_threads_trace_at_once():
    """The trace stack is per thread: with one shared stack, each thread's operators met the
    other thread's trace and raised 'a traced value from another trace leaked in'."""
    import sys
    import threading
    errors, old = [], sys.getswitchinterval()

    def work(n):
        def f(x):
            for _ in range(300):
                x = x + 1.0
            return x
        try:
            for _ in range(3):
                assert float(eins.jit(f)(np.zeros(n + 1, np.float32))[0]) == 300.0
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(f"{type(e).__name__}: {e}")

    sys.setswitchinterval(1e-5)   # switch threads often, mid-trace
    try:
        ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors


def test_a_constant_used_again_is_compared_by_its_bits():
    from numpy.lib.stride_tricks import sliding_window_view

    from eins.tracing import same_bytes
    assert same_bytes(np.array([np.nan, -0.0]), np.array([np.nan, -0.0]))
    assert not same_bytes(np.array([0.0]), np.array([-0.0]))   # the bits, not ==
    w = np.arange(6.0, dtype=np.float32)
    assert same_bytes(np.ascontiguousarray(w[::-1]), w[::-1])   # a strided view, no copy
    assert not same_bytes(w, w.reshape(2, 3)) and not same_bytes(w, w.astype(np.float64))
    c = np.array([1 + 2j, np.nan], np.complex128)   # an itemsize of no uint: its bytes
    assert same_bytes(c, c.copy()) and not same_bytes(c, np.conj(c))
    buf = np.arange(6.0, dtype=np.float32)

    def reshaped_in_place(x):
        y = x + buf
        buf.shape = (3, 2)   # the same array, another shape: a second constant
        return y, buf * 2.0

    y, z = eins.jit(reshaped_in_place)(np.zeros(6, np.float32))
    np.testing.assert_array_equal(z, np.arange(6.0).reshape(3, 2) * 2)
    buf.shape = (6,)
    assert len(eins.make_ir(reshaped_in_place)(np.zeros(6, np.float32)).consts) == 2
    assert len(eins.make_ir(lambda x: x * w + w - w)(np.ones(6, np.float32)).consts) == 1
    # views whose memory changes though they are not writeable themselves: a read-only
    # view of a writeable base, a sliding window (its base chain ends in no ndarray)
    base = np.arange(6.0, dtype=np.float32)
    view = base[:]
    view.setflags(write=False)

    def f(x):
        y = x + view
        base[:] = 10.0
        return y, x + view

    got = eins.jit(f)(np.zeros(6, np.float32))
    assert got[0].tolist() == list(range(6)) and got[1].tolist() == [10.0] * 6
    buf = np.zeros(4, np.float32)
    win = sliding_window_view(buf, 2)

    def g(a):
        y1 = a + win
        buf[:] = 1.0
        return y1, a + win

    buf[:] = 0.0
    y1, y2 = eins.jit(g)(np.zeros((3, 2), np.float32))
    assert float(y1.sum()) == 0.0 and float(y2.sum()) == 6.0


def test_a_thread_pool_inside_a_traced_function_traces_into_it():
    """Operators on traced values join their trace from any thread (a thread-local stack
    alone made worker threads' operators look like ones after the trace ended)."""
    from concurrent.futures import ThreadPoolExecutor

    def f(x):
        with ThreadPoolExecutor(2) as ex:
            parts = list(ex.map(lambda i: eins.exp(x[i]) * 2.0, range(2)))
        return parts[0] + parts[1]

    x = np.array([[1.0, 2.0], [3.0, 0.5]], np.float32)
    np.testing.assert_allclose(eins.jit(f)(x), np.exp(x[0]) * 2 + np.exp(x[1]) * 2,
                               rtol=1e-6)


def test_a_jitted_function_inlined_in_a_trace_checks_its_arguments():
    g = eins.jit(lambda x, m: x + m)
    x = np.ones(3, np.float32)
    masked = np.ma.array(np.ones(3, np.float32), mask=[0, 1, 0])
    with pytest.raises(TraceError, match="is a numpy masked array"):
        eins.jit(lambda x: g(x, masked))(x)
    with pytest.raises(TraceError, match=r"called with 1 positional argument"):
        eins.jit(lambda x: g(x))(x)


def test_an_inlined_jitted_function_takes_what_a_plain_call_takes():
    # non-array arguments (an op name, a function) are the caller's business, as before
    g = eins.jit(lambda x, op: op(x) if callable(op) else (eins.exp(x) if op == "exp" else x))
    x = np.zeros(3, np.float32)
    np.testing.assert_array_equal(eins.jit(lambda x: g(x, "exp"))(x), np.ones(3))
    np.testing.assert_array_equal(eins.jit(lambda x: g(x, eins.exp))(x), np.ones(3))


def test_eqns_whose_results_are_never_used_are_dropped():
    """A pure program's dead eqns (and constants only they read) were planned, charged
    (20.8 us of cost_s in a bug hunt's case) and run: they are dropped when traced."""
    c = np.full(4, 3.0, np.float32)

    def f(x, w):
        h = x @ w
        unused = eins.exp(h) * c + h   # never returned  # noqa: F841
        return h + 1

    x, w = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
    prog = eins.make_ir(f)(x, w)
    assert [e.prim for e in prog.eqns] == ["matmul", "add"] and prog.consts == ()
    np.testing.assert_array_equal(eins.jit(f)(x, w), x @ w + 1)
    low = eins.distribute(f, devices=2).lower(x, w)
    assert len(low.program.eqns) == 2
    # an eqn feeding an output through another, and one of several outputs, stay
    g = lambda x, w: ((x @ w).sum(), eins.exp(x))   # noqa: E731
    assert [e.prim for e in eins.make_ir(g)(x, w).eqns] == ["matmul", "sum", "exp"]
