"""Shape operators: reshape, transpose, concatenate, slice, getitem — results against numpy,
every error message, and every join-agg spec against the whole-tensor result."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eins
from eins.errors import DTypeError, ShapeError, TraceError
from eins.ir.types import Box, TensorType
from eins.ops import get_primitive
from helpers import SPREAD, assert_splits, both, check_specs


def arr(shape, dtype=np.float32, seed=0):
    a = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * 1.5 - 3
    return a.astype(dtype)


DTYPES = [np.float16, eins.bfloat16, np.float32, np.int32, np.bool_]


# ----------------------------------------------------------------------------- reshape
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src,dst", [((2, 3, 4), (6, 4)), ((6, 4), (2, 3, 4)), ((2, 3, 4), (-1,)),
                                     ((24,), (2, -1, 3)), ((6, 4), (4, 6)), ((), (1, 1)),
                                     ((1, 5), (5,)), ((0, 3), (3, 0))])
def test_reshape(dtype, src, dst):
    x = arr(src, dtype)
    got = both(lambda a: eins.reshape(a, dst), x)
    want = x.reshape(dst)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_reshape_tracer_method_and_int_shape():
    x = arr((2, 3))
    np.testing.assert_array_equal(eins.jit(lambda a: a.reshape(3, 2))(x), x.reshape(3, 2))
    np.testing.assert_array_equal(eins.jit(lambda a: a.reshape(6))(x), x.reshape(6))


@pytest.mark.parametrize("dst,msg", [((5,), r"cannot reshape \(2, 3\) \(size 6\) into \(5,\)"),
                                     ((-1, -1), "at most one -1"),
                                     ((-1, 4), r"cannot reshape \(2, 3\)"),
                                     ((-2, 3), "negative dimension")])
def test_reshape_errors(dst, msg):
    with pytest.raises(ShapeError, match=msg):
        eins.make_ir(lambda a: eins.reshape(a, dst))(eins.ShapeDtype((2, 3)))
    with pytest.raises(ShapeError, match=msg):
        eins.reshape(arr((2, 3)), dst)


def test_reshape_error_names_user_line():
    with pytest.raises(ShapeError, match="test_ops_shape.py:"):
        eins.make_ir(lambda a: eins.reshape(a, (5,)))(eins.ShapeDtype((2, 3)))


@pytest.mark.parametrize("call,exc,msg", [
    (lambda a: eins.reshape(a, a), TraceError,
     r"reshape: shape must be static Python ints, got a traced array \(float32\[2,3\]\)"),
    (lambda a: eins.reshape(a, (3, a[0, 0])), TraceError,
     r"reshape: shape must be static Python ints, got a traced array \(float32\[\]\) in "
     r"shape \(3, Tracer<float32\[\]>\)"),
    (lambda a: eins.reshape(a, (3, "2")), ShapeError, r"reshape: shape must be ints, got '2'"),
    (lambda a: eins.transpose(a, (0, 1.0)), ShapeError, r"transpose: axes must be ints, got 1.0"),
    (lambda a: eins.transpose(a, a), TraceError, r"transpose: axes must be static Python ints"),
    (lambda a: eins.concatenate([a, a], axis=a[0, 0]), TraceError,
     r"concatenate: axis must be static Python ints, got a traced array \(float32\[\]\)"),
])
def test_shape_parameters_must_be_static_ints(call, exc, msg):
    with pytest.raises(exc, match=msg + r".*\(at test_ops_shape.py:\d+\)"):
        eins.jit(call)(arr((2, 3)))


def test_reshape_to_its_own_shape_is_no_eqn():
    prog = eins.make_ir(lambda a: (a.reshape(2, 3), eins.reshape(a, (-1, 3))))(arr((2, 3)))
    assert prog.eqns == () and prog.outputs == (prog.inputs[0],) * 2


@pytest.mark.parametrize("src,dst,n_idx", [((2, 3, 4), (6, 4), 2), ((6, 4), (2, 3, 4), 2),
                                           ((2, 3, 4), (24,), 1), ((6, 4), (4, 6), 0),
                                           ((1, 6, 1), (2, 1, 3), 1), ((4, 6), (4, 2, 3), 2)])
def test_reshape_specs(src, dst, n_idx):
    x = arr(src)
    ins = [TensorType(src, x.dtype)]
    outs = get_primitive("reshape").abstract(*ins, shape=dst)
    idx = get_primitive("reshape").indexing(ins, outs, shape=dst)
    assert len(idx.shardable) == n_idx
    check_specs("reshape", [x], {"shape": dst}, whole=True)


def test_reshape_merge_maps_leading_interval():
    ins = [TensorType((4, 3), np.dtype(np.float32))]
    idx = get_primitive("reshape").indexing(ins, [TensorType((12,), ins[0].dtype)], shape=(12,))
    spec = idx.spec({"a": ((0, 1), (1, 4))})
    assert [f.inputs[0] for f in spec.fspecs] == [Box((0, 0), (1, 3)), Box((1, 0), (4, 3))]
    assert [f.outputs[0] for f in spec.fspecs] == [Box((0,), (3,)), Box((3,), (12,))]
    assert spec.aggs == (None,)


# ----------------------------------------------------------------------------- transpose
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axes", [((2, 3), None), ((2, 3, 4), (1, 2, 0)),
                                        ((2, 3, 4), (-1, 0, 1)), ((5,), None), ((), None),
                                        ((1, 3, 1), (2, 0, 1))])
def test_transpose(dtype, shape, axes):
    x = arr(shape, dtype)
    got = both(lambda a: eins.transpose(a, axes), x)
    want = np.transpose(x, axes)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_transpose_methods():
    x = arr((2, 3, 4))
    np.testing.assert_array_equal(eins.jit(lambda a: a.T)(x), x.T)
    np.testing.assert_array_equal(eins.jit(lambda a: a.transpose(2, 0, 1))(x), x.transpose(2, 0, 1))
    np.testing.assert_array_equal(eins.jit(lambda a: a.transpose((1, 0, 2)))(x),
                                  x.transpose(1, 0, 2))


def test_transpose_error():
    with pytest.raises(ShapeError, match=r"axes \(0, 0\) are not a permutation of the 2"):
        eins.make_ir(lambda a: eins.transpose(a, (0, 0)))(eins.ShapeDtype((2, 3)))


@pytest.mark.parametrize("shape,axes", [((4, 6), (1, 0)), ((2, 3, 4), (2, 0, 1))])
def test_transpose_specs(shape, axes):
    check_specs("transpose", [arr(shape)], {"axes": axes}, ps=(2, 3, 4), whole=True)


# ----------------------------------------------------------------------------- concatenate
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concatenate(axis):
    xs = [arr((2, 3)), arr((2, 3), seed=1) + 7]
    if axis == 0:
        xs.append(arr((1, 3)))
    got = both(lambda *a: eins.concatenate(a, axis=axis), *xs)
    np.testing.assert_array_equal(got, np.concatenate(xs, axis=axis))


def test_concatenate_promotes_dtypes():
    a, b = arr((2, 2), np.int32), arr((1, 2), np.float16)
    got = both(lambda x, y: eins.concatenate([x, y]), a, b)
    assert got.dtype == np.concatenate([a, b]).dtype == np.float64
    np.testing.assert_array_equal(got, np.concatenate([a, b]))
    c = arr((1, 2), eins.bfloat16)
    got = both(lambda x, y: eins.concatenate([x, y]), b, c)  # numpy cannot promote these
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.concatenate([b.astype(np.float32), c.astype(np.float32)]))


@pytest.mark.parametrize("shapes,axis,msg", [
    ([(2, 3), (2, 4)], 0, r"shapes \[\(2, 3\), \(2, 4\)\] differ outside axis 0"),
    ([(2, 3), (3,)], 0, "different ranks"),
    ([(2, 3)], 2, "axis 2 out of range"),
    ([(), ()], 0, "zero-dimensional"),
])
def test_concatenate_errors(shapes, axis, msg):
    with pytest.raises(ShapeError, match=msg):
        eins.make_ir(lambda *a: eins.concatenate(a, axis))(*[eins.ShapeDtype(s) for s in shapes])


def test_concatenate_empty_error():
    with pytest.raises(ShapeError, match="at least one operand"):
        eins.concatenate([])
    # the primitive's own shape rule, for a bind that bypasses eins.concatenate's check
    from eins.tracing import bind
    with pytest.raises(ShapeError, match=r"concatenate: needs at least one operand \(at "
                                         r"test_ops_shape.py:\d+\)"):
        bind("concatenate", axis=0)


def test_concatenate_specs():
    xs = [arr((4, 3, 2)), arr((4, 1, 2)) + 100]
    n = check_specs("concatenate", xs, {"axis": 1}, ps=(2, 3), whole=True)
    assert n.decomps > 2
    idx = get_primitive("concatenate").indexing(
        [TensorType(x.shape, x.dtype) for x in xs], [TensorType((4, 4, 2), xs[0].dtype)], axis=1)
    assert sorted(idx.shardable) == ["a", "c"]  # the concat axis is not shardable


# ----------------------------------------------------------------------------- slice / getitem
def test_slice():
    x = arr((4, 5))
    got = both(lambda a: eins.slice(a, (1, 0), (3, 5)), x)
    np.testing.assert_array_equal(got, x[1:3, 0:5])


@pytest.mark.parametrize("start,limit,msg", [((0,), (1,), "one entry per dimension"),
                                             ((0, 3), (1, 2), "out of bounds"),
                                             ((0, 0), (1, 9), "out of bounds")])
def test_slice_errors(start, limit, msg):
    with pytest.raises(ShapeError, match=msg):
        eins.make_ir(lambda a: eins.slice(a, start, limit))(eins.ShapeDtype((4, 5)))


@pytest.mark.parametrize("start,limit", [((1, 0), (3, 5)), ((0, 2), (4, 5)), ((1, 1), (4, 4)),
                                         ((1, 2), (1, 5))])   # an empty one: one whole block
def test_slice_specs(start, limit):
    check_specs("slice", [arr((4, 5))], {"start": start, "limit": limit}, ps=(2, 3), whole=True)


def test_an_empty_slice_distributes():
    x = arr((4, 6))
    for f in (lambda a: a[2:2] + 1.0, lambda a: a[:, 3:3] * 2.0):
        got = eins.distribute(f, devices=2)(x)
        assert got.shape == f(x).shape and got.dtype == x.dtype


IDX = [np.s_[1], np.s_[-1], np.s_[1:3], np.s_[:, 1:], np.s_[..., :2], np.s_[None, 1],
       np.s_[:, None, -2:], np.s_[2, 3], np.s_[..., 1], np.s_[-3:-1, ..., None], np.s_[5:2],
       np.s_[:], np.s_[-100:100], np.s_[0, ..., 1, None]]


@pytest.mark.parametrize("idx", IDX)
def test_getitem(idx):
    x = arr((4, 5, 3))
    got = both(lambda a: a[idx], x)
    want = x[idx]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_getitem_0d_and_bf16():
    x = arr((3,), eins.bfloat16)
    np.testing.assert_array_equal(both(lambda a: a[1], x), x[1])
    z = arr((), np.float32)
    np.testing.assert_array_equal(both(lambda a: a[None], z), z[None])


def test_getitem_traces_slice_then_reshape():
    p = eins.make_ir(lambda a: a[1, :2])(eins.ShapeDtype((4, 5)))
    assert [e.prim for e in p.eqns] == ["slice", "reshape"]
    assert p.eqns[0].params == {"start": (1, 0), "limit": (2, 2)}


@pytest.mark.parametrize("idx,exc,msg", [
    (np.s_[::0], ShapeError, "slice step cannot be zero"),
    (np.s_[4], ShapeError, "index 4 is out of bounds for dimension 0 of shape"),
    (np.s_[0, 0, 0], ShapeError, "too many indices"),
    (np.s_[..., ...], ShapeError, "one ellipsis"),
    ("a", TraceError, "only static ints, slices, None and ... are supported"),
    ([0.5, 1.5], DTypeError, "indices must be integers"),   # a list is an array index
])
def test_getitem_errors(idx, exc, msg):
    with pytest.raises(exc, match=msg):
        eins.make_ir(lambda a: a[idx])(eins.ShapeDtype((4, 5)))


@pytest.mark.parametrize("idx", [np.s_[::2], np.s_[::-1], np.s_[1::3, ::-2], np.s_[..., 4:0:-2],
                                 np.s_[None, -1::-3, 1], np.s_[3:1:-1, None, ::2],
                                 np.s_[5:9:2], np.s_[::-1, [0, 2]]])
def test_step_slices_match_numpy(idx):
    a = np.arange(20, dtype=np.float32).reshape(4, 5)
    want = a[idx]
    got = eins.jit(lambda x: x[idx])(a)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    # split over two devices, the same values
    d = eins.distribute(lambda x: x[idx] * 1, devices=2, tuning=SPREAD)
    assert_splits(d.lower(a))
    np.testing.assert_array_equal(d(a), want)


def test_getitem_with_traced_float_index_is_an_error():
    # a traced integer index is a gather (tests/test_ops_gather.py); a float one is refused
    with pytest.raises(DTypeError, match="indices must be integers"):
        eins.make_ir(lambda a, i: a[i])(eins.ShapeDtype((4, 5)), eins.ShapeDtype((), "float32"))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_getitem_property(shape, data):
    x = arr(tuple(shape))
    idx = []
    for n in shape:
        if data.draw(st.booleans()):
            idx.append(None)  # a new axis, consuming no dimension
        if data.draw(st.booleans()):
            idx.append(data.draw(st.integers(-n, n - 1)))
        else:
            idx.append(slice(data.draw(st.integers(-5, 5)), data.draw(st.integers(-5, 5))))
    idx = tuple(idx)
    np.testing.assert_array_equal(eins.jit(lambda a: a[idx])(x), x[idx])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms())
def test_reshape_specs_property(shape, rnd):
    """Random reshapes: every spec for 2-way and 3-way splits equals the whole result."""
    x = arr(tuple(shape))
    dims = list(shape)
    rnd.shuffle(dims)
    check_specs("reshape", [x], {"shape": tuple(dims)}, whole=True)
    check_specs("reshape", [x], {"shape": (int(np.prod(shape)),)}, whole=True)
