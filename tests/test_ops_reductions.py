"""Reductions and softmax against independent numpy formulas (axes, keepdims, dtypes, edge
shapes), every error message, and every join-agg spec against the whole-tensor result."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eins
from eins.errors import DTypeError, ShapeError
from eins.ir.types import Box, TensorType
from eins.ops import get_primitive
import helpers
from helpers import assert_close, both, check_specs

BF16 = eins.bfloat16


def rand(shape, dtype=np.float32, seed=0):
    return helpers.rand(shape, dtype, -3.0, 3.0, seed, ints=(-9, 9))


def close(got, want, dtype, n):
    """``n``: how many elements each result sums (the accumulation the tolerance follows)."""
    assert_close(got, want, n=n, dtype=dtype)


AXES = [None, 0, 1, -1, (0, 2), (2, 0), (), (0, 1, 2)]


# ----------------------------------------------------------------------------- sum/max/min/mean
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.int32, np.bool_])
def test_reductions(axis, keepdims, dtype):
    x = rand((2, 3, 4), dtype)
    xf = x.astype(np.float64)
    for name, ref in [("sum", np.sum), ("max", np.max), ("min", np.min), ("mean", np.mean)]:
        got = both(lambda a: getattr(eins, name)(a, axis, keepdims=keepdims), x)
        want = ref(xf, axis=axis, keepdims=keepdims)
        assert got.shape == want.shape, name
        if dtype is not BF16:  # numpy's own dtype rule (ml_dtypes has no sum/mean rule)
            assert got.dtype == getattr(np, name)(x, axis=axis, keepdims=keepdims).dtype, name
        else:
            assert got.dtype == BF16
        close(got, want, got.dtype, x.size)


def test_sum_int_and_bool_accumulate_in_int64():
    assert both(eins.sum, np.ones((3,), np.int32)).dtype == np.int64
    assert both(eins.sum, np.ones((3,), bool)) == 3
    assert both(eins.mean, np.array([True, False])).dtype == np.float64


def test_low_precision_sum_accumulates_in_float32():
    x = np.full((4096,), 1.0, np.float16)  # float16 accumulation would stall at 2048
    assert both(eins.sum, x) == 4096


def test_tracer_methods():
    x = rand((2, 3))
    got = eins.jit(lambda a: (a.sum(), a.mean(0), a.max(1, keepdims=True), a.min(axis=-1)))(x)
    want = (x.sum(), x.mean(0), x.max(1, keepdims=True), x.min(-1))
    for g, w in zip(got, want):
        assert_close(g, w, n=x.size)


def test_0d_and_size1():
    z = np.asarray(2.5, np.float32)
    assert both(eins.sum, z) == 2.5 and both(eins.mean, z) == 2.5 and both(eins.max, z) == 2.5
    one = rand((1, 1))
    np.testing.assert_array_equal(both(lambda a: eins.sum(a, 0), one), one.sum(0))


def test_sum_of_empty_axis():
    x = np.zeros((0, 3), np.float32)
    np.testing.assert_array_equal(both(lambda a: eins.sum(a, 0), x), np.zeros(3))


def test_mean_records_the_global_count():
    p = eins.make_ir(lambda a: eins.mean(a, (0, 2)))(eins.ShapeDtype((2, 3, 5)))
    assert p.eqns[0].params == {"axis": (0, 2), "keepdims": False, "count": 10}


@pytest.mark.parametrize("call,msg", [
    (lambda a: eins.sum(a, 3), r"sum: axis 3 is out of range for shape \(2, 3\)"),
    (lambda a: eins.max(a, (0, -2)), r"max: repeated axis in \(0, -2\) for shape \(2, 3\)"),
    (lambda a: eins.mean(a, 1.5), r"mean: axis must be an int, a tuple of ints or None, got 1.5"),
    (lambda a: eins.min(a[:0], 0), r"min: zero-size reduction over axis \(0,\) of shape \(0, 3\)"),
    (lambda a: eins.mean(a[:0], 0), r"mean: empty reduction over axis \(0,\) of shape \(0, 3\)"),
])
def test_reduction_errors(call, msg):
    with pytest.raises(ShapeError, match=msg) as e:
        eins.make_ir(call)(eins.ShapeDtype((2, 3)))
    assert "test_ops_reductions.py:" in str(e.value)


def test_mean_count_mismatch_error():
    prim = get_primitive("mean")
    with pytest.raises(ShapeError, match=r"mean: count 5 is not the number of reduced elements "
                                         r"\(3\)"):
        prim.abstract(TensorType((2, 3), np.dtype(np.float32)), axis=(1,), keepdims=False,
                      count=5)


def test_flops():
    t, o = TensorType((4, 5), np.dtype(np.float32)), TensorType((4,), np.dtype(np.float32))
    assert get_primitive("sum").flops([t], [o], axis=(1,), keepdims=False) == 20
    assert get_primitive("mean").flops([t], [o], axis=(1,), keepdims=False, count=5) == 24


# ----------------------------------------------------------------------------- softmax
def _softmax_ref(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_softmax(axis, dtype):
    x = rand((3, 5), dtype)
    got = both(lambda a: eins.softmax(a, axis), x)
    assert got.dtype == np.dtype(dtype)
    close(got, _softmax_ref(x.astype(np.float64), axis), dtype, x.shape[axis])
    close(got.astype(np.float64).sum(axis), np.ones(x.shape[1 - axis % 2]), dtype, x.shape[axis])


def test_softmax_is_stable_and_int_promotes():
    x = np.array([[1000.0, 1000.0], [-1000.0, 0.0]], np.float32)
    assert_close(both(eins.softmax, x), np.array([[0.5, 0.5], [0.0, 1.0]]), n=2, dtype=x.dtype)
    i = np.array([1, 2, 3], np.int32)
    got = both(eins.softmax, i)
    assert got.dtype == np.float64
    assert_close(got, _softmax_ref(i.astype(np.float64), 0), n=3)


@pytest.mark.parametrize("shape,axis", [((0, 3), 0), ((3, 0), -1), ((2, 0, 4), 2)])
def test_softmax_of_empty_shapes(shape, axis):
    # an empty axis (or an empty other dim) gives an empty result, as rms_norm's does; the
    # kernel's max over an empty axis was a raw numpy ValueError
    x = np.zeros(shape, np.float16)
    for run in (eins.jit, lambda f: eins.distribute(f, devices=3, backend="numpy")):
        got = run(lambda a: eins.softmax(a, axis))(x)
        assert got.shape == shape and got.dtype == np.float16


@pytest.mark.parametrize("shape,axis,dtype,exc,msg", [
    ((), -1, "float32", ShapeError, r"softmax: operand must have at least one dimension"),
    ((2, 3), 2, "float32", ShapeError, r"softmax: axis 2 is out of range for shape \(2, 3\)"),
    ((2, 3), (0, 1), "float32", ShapeError, r"softmax: axis must be an int, got \(0, 1\)"),
    ((2,), -1, "bool", DTypeError, r"softmax: not defined for dtype bool"),
])
def test_softmax_errors(shape, axis, dtype, exc, msg):
    with pytest.raises(exc, match=msg):
        eins.make_ir(lambda a: eins.softmax(a, axis))(eins.ShapeDtype(shape, dtype))


# ----------------------------------------------------------------------------- specs
@pytest.mark.parametrize("name,agg", [("sum", "sum"), ("max", "max"), ("min", "min"),
                                      ("mean", "sum")])
@pytest.mark.parametrize("axis,keepdims", [((1,), False), ((0, 2), True), ((0, 1, 2), False)])
def test_reduction_specs(name, agg, axis, keepdims):
    x = rand((4, 3, 5), np.float64)
    params = {"axis": axis, "keepdims": keepdims}
    if name == "mean":
        params["count"] = int(np.prod([x.shape[d] for d in axis]))
    # splitting a reduced index gives several partial copies of one output box
    assert check_specs(name, [x], params, ps=(2, 3), n=x.size).copies > 1
    ins = [TensorType(x.shape, x.dtype)]
    prim = get_primitive(name)
    spec = prim.indexing(ins, prim.abstract(*ins, **params), **params).spec(
        {"abc"[axis[0]]: ((0, 1), (1, x.shape[axis[0]]))})
    assert spec.aggs == (agg,)


def test_reduction_spec_without_split_reduced_index_has_no_agg():
    ins = [TensorType((4, 6), np.dtype(np.float32))]
    idx = get_primitive("sum").indexing(ins, [TensorType((4,), ins[0].dtype)], axis=(1,),
                                        keepdims=False)
    spec = idx.spec({"a": ((0, 2), (2, 4))})
    assert spec.aggs == (None,) and len(spec) == 2
    assert spec.fspecs[1].inputs[0] == Box((2, 0), (4, 6))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_softmax_specs(axis):
    x = rand((4, 3, 5), np.float64)
    assert check_specs("softmax", [x], {"axis": axis}, ps=(2, 3), n=x.shape[axis]).copies == 1
    idx = get_primitive("softmax").indexing([TensorType(x.shape, x.dtype)],
                                            [TensorType(x.shape, x.dtype)], axis=axis)
    assert "abc"[axis] not in idx.shardable and len(idx.shardable) == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_reduction_property(shape, data):
    """Random axes: result equals numpy's and every 2-way/3-way spec recomposes."""
    x = rand(tuple(shape), np.float64, seed=len(shape))
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1)))))
    keepdims = data.draw(st.booleans())
    name = data.draw(st.sampled_from(["sum", "max", "min", "mean"]))
    got = eins.jit(lambda a: getattr(eins, name)(a, axes, keepdims=keepdims))(x)
    assert_close(got, getattr(np, name)(x, axis=axes, keepdims=keepdims), n=x.size)
    params = {"axis": axes, "keepdims": keepdims}
    if name == "mean":
        params["count"] = int(np.prod([shape[d] for d in axes]))
    check_specs(name, [x], params, n=x.size)


def test_bfloat16_sums_accumulate_in_float32():
    """A bfloat16 sum is computed in float32 and rounded once: 4,096 ones sum to 4096
    exactly (accumulated in bfloat16, with 8 significant bits, a running sum stops growing
    at 256), and so does each row of a [2, 4096] sum over axis 1."""
    import ml_dtypes
    x = np.ones((2, 4096), ml_dtypes.bfloat16)
    got = eins.jit(lambda x: eins.sum(x, 1))(x)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), [4096.0, 4096.0])
