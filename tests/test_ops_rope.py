"""rope: the kernel against an independent numpy formula (eager and under eins.jit, several
broadcast layouts and dtypes), errors, flops, and its join-agg specs (D never split)."""
import math

import numpy as np
import pytest

import eins
from eins.errors import DTypeError, EinsError, ShapeError
from eins.ir.types import Box, TensorType, bfloat16
from eins.ops import get_primitive
from helpers import all_decompositions, assert_close, check_specs, normal


def _ref_rope(x, cos, sin):
    """Pairs (i, i + D/2) rotate by the angle whose cos/sin are given: written per pair."""
    x64, c, s = (a.astype(np.float64) for a in (x, cos, sin))
    h = x.shape[-1] // 2
    out = np.empty(np.broadcast_shapes(x.shape, cos.shape), np.float64)
    for i in range(h):
        a, b = x64[..., i], x64[..., i + h]
        out[..., i] = a * c[..., i] - b * s[..., i]
        out[..., i + h] = b * c[..., i + h] + a * s[..., i + h]
    return out


def _tables(s, d, dtype=np.float32):
    """LLaMA/HF cos/sin tables [S, D]: the angle of pair i repeated in both halves."""
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    ang = np.outer(np.arange(s), inv)
    ang = np.concatenate([ang, ang], axis=-1)
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16, np.float64])
@pytest.mark.parametrize("xshape", [(2, 3, 5, 8), (3, 5, 8), (5, 8)])
def test_rope_matches_formula_eager_and_jit(xshape, dtype):
    x = normal(xshape, dtype)
    cos, sin = _tables(5, 8, dtype)
    want = _ref_rope(x, cos, sin)
    for got in (eins.rope(x, cos, sin), eins.jit(eins.rope)(x, cos, sin)):
        assert got.dtype == np.dtype(dtype) and got.shape == xshape
        assert_close(got, want, n=2)  # x*cos + rotate_half(x)*sin: two terms per element


def test_rope_rotates_pairs_and_keeps_norms():
    # position 0 is the identity; the rotation keeps each pair's length
    x = normal((4, 6, 8), np.float64)
    cos, sin = _tables(6, 8, np.float64)
    y = eins.rope(x, cos, sin)
    assert_close(y[:, 0], x[:, 0], n=2)
    assert_close(y[..., :4] ** 2 + y[..., 4:] ** 2, x[..., :4] ** 2 + x[..., 4:] ** 2, n=2,
                 depth=2)
    # a hand-computed case: D=2, angle 90 degrees maps (a, b) to (-b, a)
    np.testing.assert_allclose(eins.rope(np.array([[3.0, 4.0]]), np.zeros((1, 2)), np.ones((1, 2))),
                               [[-4.0, 3.0]])


def test_rope_broadcast_layouts_and_promotion():
    x = normal((2, 3, 5, 8), np.float16)
    cos, sin = (normal((2, 1, 5, 8), np.float32, i) for i in (1, 2))  # per-batch positions
    got = eins.rope(x, cos, sin)
    assert got.dtype == np.float32  # float16 promoted with float32 tables
    assert_close(got, _ref_rope(x, cos, sin), n=2)
    c1 = normal((5, 1), np.float32, 3)  # one value per position, broadcast over D
    assert_close(eins.rope(x, c1, sin), _ref_rope(x, np.broadcast_to(c1, (5, 8)), sin), n=2)


def test_rope_ir_dump():
    p = eins.make_ir(eins.rope)(eins.ShapeDtype((2, 4, 16, 8), "f16"),
                                eins.ShapeDtype((16, 8), "f16"), eins.ShapeDtype((16, 8), "f16"))
    assert "d:f16[2,4,16,8] = rope a b c" in str(p)


# --------------------------------------------------------------------------- errors
def test_odd_head_dim_is_an_error_naming_it_and_the_line():
    def f(x, c, s):
        return eins.rope(x, c, s)

    with pytest.raises(ShapeError) as e:
        eins.make_ir(f)(eins.ShapeDtype((4, 7)), eins.ShapeDtype((4, 7)), eins.ShapeDtype((4, 7)))
    msg = str(e.value)
    assert "rope" in msg and "D=7" in msg and "(4, 7)" in msg and "test_ops_rope.py:" in msg


def test_tables_that_do_not_broadcast_are_an_error():
    x = np.ones((3, 5, 8), np.float32)
    with pytest.raises(ShapeError, match=r"rope: cos of shape \(6, 8\) does not broadcast against x of shape \(3, 5, 8\)"):
        eins.rope(x, np.ones((6, 8), np.float32), np.ones((5, 8), np.float32))
    # broadcasting that would grow x is an error too
    with pytest.raises(ShapeError, match=r"rope: sin of shape \(2, 3, 5, 8\)"):
        eins.rope(x, np.ones((5, 8), np.float32), np.ones((2, 3, 5, 8), np.float32))


def test_scalar_x_and_integer_dtypes_are_errors():
    with pytest.raises(ShapeError, match=r"rope: x must have at least one dimension, got shape \(\)"):
        eins.rope(np.float32(1), np.float32(1), np.float32(1))
    i = np.ones((2, 4), np.int64)
    with pytest.raises(DTypeError, match=r"rope: needs floating-point.*int64"):
        eins.rope(i, i, i)


def test_exports_and_flops():
    assert eins.rope is eins.ops.rope and "rope" in eins.ops.__all__
    t = TensorType((2, 5, 8), np.dtype(np.float32))
    c = TensorType((5, 8), np.dtype(np.float32))
    assert get_primitive("rope").flops([t, c, c], [t]) == 3 * 80


# --------------------------------------------------------------------------- join-agg specs
def _indexing(*shapes):
    prim = get_primitive("rope")
    ins = [TensorType(s, np.dtype(np.float32)) for s in shapes]
    return prim.indexing(ins, prim.abstract(*ins))


def test_indexing_x_dims_shardable_d_not_tables_follow_their_dims():
    ix = _indexing((2, 3, 5, 8), (2, 1, 5, 8), (5, 8))
    assert ix.extents == {"a": 2, "b": 3, "c": 5, "z": 8}
    assert ix.shardable == {"a": "any", "b": "any", "c": "any"}
    with pytest.raises(EinsError, match="'z' is not shardable"):
        ix.spec({"z": ((0, 4), (4, 8))})
    spec = ix.spec({"a": ((0, 1), (1, 2)), "b": ((0, 1), (1, 3)), "c": ((0, 2), (2, 5))})
    assert len(spec) == 8 and spec.aggs == (None,)
    f = spec.fspecs[-1]  # a [1,2), b [1,3), c [2,5)
    assert f.inputs == (Box((1, 1, 2, 0), (2, 3, 5, 8)),
                        Box((1, 0, 2, 0), (2, 1, 5, 8)),  # broadcast heads dim kept whole
                        Box((2, 0), (5, 8)))
    assert f.outputs == (f.inputs[0],)


@pytest.mark.parametrize("shapes", [((2, 3, 6, 4), (6, 4), (6, 4)),
                                    ((2, 3, 6, 4), (2, 1, 6, 4), (1, 6, 1)),
                                    ((5, 6), (5, 6), (5, 6))])
def test_every_spec_recomposes_to_the_whole_result(shapes):
    arrays = [normal(s, np.float32, i) for i, s in enumerate(shapes)]
    n = check_specs("rope", arrays, {}, decomps=all_decompositions, n=2).decomps
    assert n == math.prod(min(s, 3) for s in shapes[0][:-1])
    check_specs("rope", arrays, {}, n=2,
                decomps=[{"a": tuple((i, i + 1) for i in range(shapes[0][0]))}])


def test_empty_shapes():
    e = np.ones((3, 0), np.float32)
    assert eins.rope(e, e, e).shape == (3, 0)
    assert eins.rope(np.ones((0, 4)), np.ones(4), np.ones(4)).shape == (0, 4)
