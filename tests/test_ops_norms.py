"""rms_norm and layer_norm: kernels against independent numpy formulas, eagerly and under
eins.jit, dtypes, errors, flops, and their join-agg specs (leading dims split, last dim not)."""
import math

import numpy as np
import pytest

import eins
from eins.errors import DTypeError, EinsError, ShapeError
from eins.ir.types import Box, TensorType, bfloat16
from eins.ops import get_primitive
from helpers import all_decompositions, assert_close, check_specs, normal


def _ref_rms(x, w, eps):
    x64 = x.astype(np.float64)
    return w.astype(np.float64) * x64 / np.sqrt((x64 ** 2).sum(-1, keepdims=True) / x.shape[-1] + eps)


def _ref_ln(x, w, b, eps):
    x64 = x.astype(np.float64)
    mu = x64.sum(-1, keepdims=True) / x.shape[-1]
    var = ((x64 - mu) ** 2).sum(-1, keepdims=True) / x.shape[-1]
    return (x64 - mu) / np.sqrt(var + eps) * w.astype(np.float64) + b.astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16, np.float64])
@pytest.mark.parametrize("shape", [(7,), (3, 8), (2, 3, 5)])
def test_rms_norm_matches_formula_eager_and_jit(shape, dtype):
    x, w = normal(shape, dtype), normal(shape[-1:], dtype, 1)
    want = _ref_rms(x, w, 1e-6)
    for got in (eins.rms_norm(x, w), eins.jit(lambda x, w: eins.rms_norm(x, w))(x, w)):
        assert got.dtype == np.dtype(dtype) and got.shape == shape
        assert_close(got, want, n=shape[-1])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16])
def test_layer_norm_matches_formula_eager_and_jit(dtype):
    x = normal((2, 3, 6), dtype) * 3 + 1
    w, b = normal((6,), dtype, 1), normal((6,), dtype, 2)
    want = _ref_ln(x, w, b, 1e-5)
    for got in (eins.layer_norm(x, w, b),
                eins.jit(lambda x, w, b: eins.layer_norm(x, w, b, eps=1e-5))(x, w, b)):
        assert got.dtype == np.dtype(dtype) and got.shape == x.shape
        assert_close(got, want, n=x.shape[-1], depth=2)  # the mean, then the variance


def test_eps_is_used():
    x = np.array([[1e-3, -1e-3]], np.float32)
    w = np.ones(2, np.float32)
    assert_close(eins.rms_norm(x, w, eps=1e-6), _ref_rms(x, w, 1e-6), n=2)
    assert_close(eins.rms_norm(x, w, eps=0.0), np.array([[1.0, -1.0]]), n=2, dtype=x.dtype)
    assert_close(eins.layer_norm(x, w, w * 0, eps=1.0), _ref_ln(x, w, w * 0, 1.0), n=2, depth=2)


def test_float16_statistics_are_computed_in_float32():
    # x*x = 90000 overflows float16 (max 65504); a float16 kernel would return zeros
    x = np.full((2, 4), 300.0, np.float16)
    w = np.ones(4, np.float16)
    assert_close(eins.rms_norm(x, w), np.ones((2, 4)), n=4, dtype=x.dtype)
    x[:, 0] = -300.0
    assert_close(eins.layer_norm(x, w, w * 0), _ref_ln(x, w, w * 0, 1e-5), n=4, depth=2)


def test_result_dtype_promotes_with_weight():
    x = normal((2, 4), np.float16)
    w = normal((4,), np.float32, 1)
    got = eins.rms_norm(x, w)
    assert got.dtype == np.float32
    assert_close(got, _ref_rms(x, w, 1e-6), n=4)
    assert eins.layer_norm(x, w, x[0]).dtype == np.float32


def test_ir_dump_shows_eps():
    p = eins.make_ir(lambda x, w: eins.rms_norm(x, w, eps=1e-5))(
        eins.ShapeDtype((4, 8), "bf16"), eins.ShapeDtype((8,), "bf16"))
    assert "c:bf16[4,8] = rms_norm[eps=1e-05] a b" in str(p)


# --------------------------------------------------------------------------- errors
def test_weight_shape_error_names_shapes_and_line():
    def f(x, w):
        return eins.rms_norm(x, w)

    with pytest.raises(ShapeError) as e:
        eins.make_ir(f)(eins.ShapeDtype((4, 8)), eins.ShapeDtype((4,)))
    msg = str(e.value)
    assert "rms_norm" in msg and "(8,)" in msg and "(4,)" in msg and "(4, 8)" in msg
    assert "test_ops_norms.py:" in msg


def test_layer_norm_bias_shape_error():
    x, w = np.ones((3, 5), np.float32), np.ones(5, np.float32)
    with pytest.raises(ShapeError, match=r"layer_norm: bias must have shape \(5,\).*\(1, 5\)"):
        eins.layer_norm(x, w, np.ones((1, 5), np.float32))
    with pytest.raises(ShapeError, match=r"layer_norm: weight must have shape \(5,\).*\(6,\)"):
        eins.layer_norm(x, np.ones(6, np.float32), w)


def test_scalar_x_is_an_error():
    with pytest.raises(ShapeError, match=r"rms_norm: x must have at least one dimension.*\(\)"):
        eins.rms_norm(np.float32(2.0), np.ones((), np.float32))


def test_integer_operands_are_an_error():
    with pytest.raises(DTypeError, match=r"rms_norm: needs floating-point.*int32"):
        eins.rms_norm(np.ones((2, 3), np.int32), np.ones(3, np.int32))


def test_bfloat16_with_float16_is_float32_in_every_family():
    # one promotion rule (eins.ir.types.result_dtype): neither holds the other, so float32
    S = eins.ShapeDtype
    x, h = S((2, 4), "bfloat16"), S((2, 4), "float16")
    w = S((4,), "float16")
    q, k = S((1, 2, 4), "bfloat16"), S((1, 2, 4), "float16")
    cases = {
        "add": (lambda a, b: a + b, (x, h)),
        "concatenate": (lambda a, b: eins.concatenate([a, b]), (x, h)),
        "matmul": (lambda a, b: a @ b.T, (x, h)),
        "rms_norm": (lambda a, b: eins.rms_norm(a, b), (x, w)),
        "layer_norm": (lambda a, b: eins.layer_norm(a, b, b), (x, w)),
        "attention": (lambda a, b: eins.attention(a, b, b), (q, k)),
    }
    for name, (fn, args) in cases.items():
        out = eins.make_ir(fn)(*args).outputs[0]
        assert out.dtype == np.float32, name
    got = eins.layer_norm(np.ones((2, 3), bfloat16), np.ones(3, np.float16),
                          np.zeros(3, np.float16))
    assert got.dtype == np.float32 and np.allclose(got, 0.0)


def test_exports():
    assert eins.rms_norm is eins.ops.rms_norm and eins.layer_norm is eins.ops.layer_norm
    assert {"rms_norm", "layer_norm"} <= set(eins.ops.__all__)


def test_flops():
    t = TensorType((4, 8), np.dtype(np.float32))
    w = TensorType((8,), np.dtype(np.float32))
    assert get_primitive("rms_norm").flops([t, w], [t], eps=1e-6) == 4 * 32
    assert get_primitive("layer_norm").flops([t, w, w], [t], eps=1e-6) == 8 * 32


# --------------------------------------------------------------------------- join-agg specs
def _indexing(name, *shapes, **params):
    prim = get_primitive(name)
    ins = [TensorType(s, np.dtype(np.float32)) for s in shapes]
    return prim.indexing(ins, prim.abstract(*ins, **params), **params)


def test_indexing_names_leading_dims_shardable_and_last_dim_not():
    ix = _indexing("rms_norm", (2, 3, 8), (8,), eps=1e-6)
    assert ix.extents == {"a": 2, "b": 3, "z": 8}
    assert ix.shardable == {"a": "any", "b": "any"}
    with pytest.raises(EinsError, match="'z' is not shardable"):
        ix.spec({"z": ((0, 4), (4, 8))})
    spec = ix.spec({"a": ((0, 1), (1, 2)), "b": ((0, 2), (2, 3))})
    assert len(spec) == 4 and spec.aggs == (None,)
    f = spec.fspecs[1]  # a in [0,1), b in [2,3): x and out blocks, the weight whole
    assert f.inputs == (Box((0, 2, 0), (1, 3, 8)), Box((0,), (8,)))
    assert f.outputs == (Box((0, 2, 0), (1, 3, 8)),)
    ln = _indexing("layer_norm", (5, 8), (8,), (8,), eps=1e-5)
    assert ln.shardable == {"a": "any"}
    assert ln.spec({"a": ((0, 2), (2, 5))}).fspecs[1].inputs == (
        Box((2, 0), (5, 8)), Box((0,), (8,)), Box((0,), (8,)))


@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 4), (6,)])
def test_every_spec_recomposes_to_the_whole_result(shape):
    x = normal(shape, np.float32)
    w, b = normal(shape[-1:], np.float32, 1), normal(shape[-1:], np.float32, 2)
    tol = {"n": shape[-1], "depth": 2}  # rows split, each row's sums whole
    n = check_specs("rms_norm", [x, w], {"eps": 1e-6}, decomps=all_decompositions, **tol)
    assert n.decomps == max(1, math.prod(min(s, 3) for s in shape[:-1]))
    check_specs("layer_norm", [x, w, b], {"eps": 1e-5}, decomps=all_decompositions, **tol)
    # uneven and unit intervals too
    if len(shape) == 2:
        check_specs("rms_norm", [x, w], {"eps": 1e-6}, **tol, decomps=[
            {"a": ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))}, {"a": ((0, 4), (4, 5))}])


def test_empty_shapes():
    w = np.ones(0, np.float32)
    assert eins.rms_norm(np.ones((3, 0), np.float16), w).shape == (3, 0)
    assert eins.layer_norm(np.ones((3, 0), np.float32), w, w).shape == (3, 0)
    assert eins.rms_norm(np.ones((0, 4), np.float32), np.ones(4, np.float32)).shape == (0, 4)
