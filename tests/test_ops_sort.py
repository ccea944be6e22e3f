"""Routing (eins/ops/sorting.py): top_k breaks ties as jax.lax.top_k (lowest index first,
checked against a reference sorted by (-value, index)); argmax/argmin/argsort/sort equal
numpy's (argsort as numpy's stable kind); distributed and interpret equal jit; errors."""
import numpy as np
import pytest

import eins
from eins.errors import ShapeError, TraceError
from eins.validate_specs import check

RNG = np.random.default_rng(7)
# values on a coarse grid: ties in every row; a NaN and infinities
X = np.round(RNG.standard_normal((6, 5, 8)) * 2) / 2
X[0, 0, 3] = np.nan
X[1, 2, :2] = np.inf
X[2, 1, 5] = -np.inf


def reference_top_k(x, k):
    """Per row: the k largest, largest first, ties lowest index first, NaN largest."""
    rows = x.reshape(-1, x.shape[-1])
    idx = np.array([sorted(range(len(r)), key=lambda i: (not np.isnan(r[i]),
                                                         -r[i] if not np.isnan(r[i]) else 0,
                                                         i))[:k] for r in rows], np.int64)
    idx = idx.reshape(x.shape[:-1] + (k,))
    return np.take_along_axis(x, idx, -1), idx


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "int32"])
@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_top_k_breaks_ties_as_jax(k, dtype):
    x = X if dtype.startswith("float") else np.nan_to_num(X, posinf=9, neginf=-9) * 2
    x = x.astype(eins.bfloat16 if dtype == "bfloat16" else dtype)
    vals, idx = eins.jit(lambda x: eins.top_k(x, k))(x)
    want_v, want_i = reference_top_k(x.astype(np.float64), k)
    assert idx.dtype == np.int64 and vals.dtype == x.dtype
    np.testing.assert_array_equal(idx, want_i)
    np.testing.assert_array_equal(vals.astype(np.float64), want_v)


def test_top_k_ties_lowest_index_first():
    vals, idx = eins.top_k(np.array([1.0, 3.0, 3.0, 2.0, 3.0]), 3)
    assert idx.tolist() == [1, 2, 4] and vals.tolist() == [3.0, 3.0, 3.0]


FUNCS = {
    "argmax axis 1": lambda x: np.argmax(x, axis=1),
    "argmax all": lambda x: np.argmax(x),
    "argmax keepdims": lambda x: np.argmax(x, axis=-1, keepdims=True),
    "argmin axis 0": lambda x: np.argmin(x, axis=0),
    "argmin all keepdims": lambda x: np.argmin(x, keepdims=True),
    "x.argmax()": lambda x: x.argmax(axis=2),
    "x.argmin()": lambda x: x.argmin(),
    "argsort": lambda x: np.argsort(x, kind="stable"),
    "argsort axis 0": lambda x: np.argsort(x, axis=0, kind="stable"),
    "argsort flat": lambda x: np.argsort(x, axis=None, kind="stable"),
    "x.argsort()": lambda x: x.argsort(axis=1, kind="stable"),
    "sort": lambda x: np.sort(x),
    "sort axis 1": lambda x: np.sort(x, axis=1),
    "sort flat": lambda x: np.sort(x, axis=None),
}


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_equals_numpy(name, dtype):
    x = X if dtype == "float64" else np.nan_to_num(X, posinf=9, neginf=-9).astype(dtype) * 2
    got = eins.jit(FUNCS[name])(x)
    want = FUNCS[name](x)
    assert got.dtype == np.dtype(want.dtype) or got.dtype == np.int64
    np.testing.assert_array_equal(got, want)


def test_argsort_is_stable_whatever_kind_says():
    x = np.array([2, 1, 2, 1, 2, 1] * 20)
    np.testing.assert_array_equal(eins.jit(lambda x: np.argsort(x))(x),
                                  np.argsort(x, kind="stable"))


def program(x):
    vals, idx = eins.top_k(x, 3)
    return vals, idx, np.argmax(x, axis=2), np.argmin(x, axis=0), np.argsort(x, axis=1), \
        np.sort(x, axis=-1)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("selector", ["dp", "random"])
def test_distributed_equals_jit(p, selector):
    want = eins.jit(program)(X)
    got = eins.distribute(program, devices=p, selector=selector, seed=p)(X)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_interpret_backend_runs_the_torch_lowerings():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    x = X.astype(np.float32)
    want = eins.jit(program)(x)
    got = eins.distribute(program, devices=4, backend="interpret")(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def test_no_host_sync_inside_captured_graphs(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from test_gpu_check_capture import CaptureGuard
    guard = CaptureGuard(monkeypatch)
    x = X.astype(np.float32)
    c = eins.distribute(program, devices=2).lower(x).compile("interpret", graphs=True)
    c(x)
    guard.armed = True
    got = c(x)
    assert guard.replays > 0
    for g, w in zip(got, eins.jit(program)(x)):
        np.testing.assert_array_equal(g, w)


def test_specs_are_checked():
    for r in check(["top_k", "argmax", "argmin", "sort"]).values():
        assert r.checked >= 6 and not r.wrong and not r.missing, r.line()


def test_the_sorted_axis_is_never_split():
    from eins.ir.program import eqn_indexing
    prog = eins.make_ir(program)(eins.ShapeDtype((6, 5, 8)))
    for e in prog.eqns:
        ix = eqn_indexing(e)
        assert len(ix.shardable) == 2, (e.prim, ix.shardable)   # two of the three dims


def test_sort_flops_are_n_log_n():
    prog = eins.make_ir(lambda x: np.sort(x, axis=1))(eins.ShapeDtype((4, 1024)))
    e = prog.eqns[0]
    assert e.primitive.flops([v.type for v in e.inputs], [v.type for v in e.outputs],
                             **e.params) == 4 * 1024 * 10


BAD = [
    (lambda x: eins.top_k(x, 9), ShapeError, "k=9 is not between 0 and the last axis's length 8"),
    (lambda x: eins.top_k(x, -1), ShapeError, "k=-1 is not between 0"),
    (lambda x: eins.top_k(x, 2.5), ShapeError, "k must be an int, got 2.5"),
    (lambda x: eins.top_k(x, True), ShapeError, "k must be an int, got True"),
    (lambda x: eins.top_k(x.sum(), 1), ShapeError, "at least one dimension, got shape ()"),
    (lambda x: np.argmax(x, axis=3), ShapeError, "axis 3 is out of range for an array of rank 3"),
    (lambda x: np.argmax(x, axis=1.0), ShapeError, "axis must be an int or None, got 1.0"),
    (lambda x: np.argmin(x[:, :0], axis=1), ShapeError, "argmin of an empty sequence"),
    (lambda x: np.argmax(x, keepdims="yes"), TraceError, "keepdims must be True or False"),
    (lambda x: np.sort(x, axis=-4), ShapeError, "axis -4 is out of range"),
    (lambda x: np.sort(x, order="f"), TraceError, "order='f' sorts structured arrays"),
    (lambda x: np.argsort(x, kind="bogo"), TraceError, "unknown kind 'bogo'"),
    (lambda x: np.sort(x.sum()), ShapeError, "a 0-d array has no axis -1 to sort along"),
    (lambda x: eins.top_k("abc", 1), TraceError, "operand of type str is not an array"),
]


@pytest.mark.parametrize("k", range(len(BAD)))
def test_bad_input_is_an_error_naming_it_and_the_line(k):
    fn, exc, msg = BAD[k]
    with pytest.raises(exc) as e:
        eins.make_ir(fn)(X)
    assert msg in str(e.value)
    assert "test_ops_sort.py:" in str(e.value)
