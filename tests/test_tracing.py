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
    with pytest.raises(TraceError, match=r"numpy.floor cannot run on a traced array.*"
                                         r"test_tracing.py:\d+"):
        eins.jit(lambda x: np.floor(x))(a)
    with pytest.raises(TraceError, match=r"no concrete value.*test_tracing.py:\d+"):
        eins.jit(lambda x: np.cumsum(x))(a)


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
