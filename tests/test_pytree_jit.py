"""jit caching and retracing, pytrees of arguments and results, Python scalars as literals,
closed-over arrays as constants, ShapeDtype with dtype names."""
import numpy as np
import pytest

import eins
from eins.ir.program import Literal
from eins.ir.types import TensorType
from eins.tracing import TreeDef, tree_flatten, tree_unflatten
from helpers import assert_close


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------------- pytrees
def test_tree_flatten_roundtrip_and_order():
    a, b, c, d = object(), object(), object(), object()
    tree = {"z": [a, (b,)], "a": c, "n": None, "m": {"k": d}}
    leaves, td = tree_flatten(tree)
    assert leaves == [c, d, a, b]          # dict keys sorted: a, m, n (none), z
    assert td.num_leaves == 4
    assert str(td) == "{'a': *, 'm': {'k': *}, 'n': None, 'z': [*, (*,)]}"   # what errors show
    back = tree_unflatten(td, leaves)
    assert back == tree and isinstance(back["z"], list) and isinstance(back["z"][1], tuple)
    assert tree_flatten(5) == ([5], TreeDef("leaf"))


def test_nested_arguments_and_results():
    @eins.jit
    def f(params, xs):
        w, (b,) = params["w"], params["rest"]
        return {"y": [xs[0] @ w + b, xs[1] @ w], "s": (xs[0],)}

    w, b = f32(3, 4), f32(4, seed=1)
    x0, x1 = f32(2, 3, seed=2), f32(5, 3, seed=3)
    out = f({"w": w, "rest": (b,)}, [x0, x1])
    assert set(out) == {"y", "s"} and isinstance(out["y"], list) and isinstance(out["s"], tuple)
    assert_close(out["y"][0], x0 @ w + b, n=4)  # 3 products and the bias
    assert_close(out["y"][1], x1 @ w, n=3)
    np.testing.assert_array_equal(out["s"][0], x0)
    prog = eins.make_ir(f.fn)({"w": w, "rest": (b,)}, [x0, x1])
    # inputs in flattening order: params (sorted: rest, w), then xs
    assert [v.shape for v in prog.inputs] == [(4,), (3, 4), (2, 3), (5, 3)]


def test_keyword_arguments():
    @eins.jit
    def f(x, *, scale_by):
        return x * scale_by

    x = f32(3)
    assert_close(f(x, scale_by=x), x * x)


# ----------------------------------------------------------------------------- jit cache
def test_jit_cache_hits_and_retraces():
    calls = []

    @eins.jit
    def f(x, y, s):
        calls.append(1)
        return x * s + y

    x, y = f32(2, 3), f32(2, 3, seed=1)
    assert_close(f(x, y, 2.0), x * 2 + y, n=2)
    f(x + 1, y, 2.0)                                   # same signature: cached
    assert f.trace_count == 1 and len(calls) == 1
    # a new scalar value is a runtime input, as in JAX: no new trace
    assert_close(f(x, y, 3.0), x * 3 + y, n=2)
    assert f.trace_count == 1
    f(f32(4, 3), f32(4, 3), 3.0)                       # new shape
    assert f.trace_count == 2
    out = f(x.astype(np.float64), y.astype(np.float64), 3.0)   # new dtype
    assert f.trace_count == 3 and out.dtype == np.float64
    assert_close(f(x, y, 3), x * 3 + y, n=2)          # an int is another kind than a float
    assert f.trace_count == 4
    f(x, y, 2.0)                                       # everything seen before
    f(x.astype(np.float64), y.astype(np.float64), 3.0)
    assert_close(f(x, y, -7), x * -7 + y, n=2)
    assert f.trace_count == 4 and len(calls) == 4


def test_scalar_cache_keys_keep_the_sign_of_zero_and_match_a_nan():
    """0.0 == -0.0 (with equal hashes), yet x / 0.0 and x / -0.0 differ in sign. A traced
    scalar carries its value's bits at run time; a static one is its own program for each
    sign of zero, while calls with nan (never equal to itself) share one program."""
    j = eins.jit(lambda x, c: x / c)
    a = np.ones(2, np.float32)
    assert list(j(a, 0.0)) == [np.inf, np.inf]
    assert list(j(a, -0.0)) == [-np.inf, -np.inf]
    assert np.isnan(j(a, float("nan"))).all()
    assert j.trace_count == 1
    s = eins.jit(lambda x, c: x / c, static_argnums=1)
    assert list(s(a, 0.0)) == [np.inf, np.inf]
    assert list(s(a, -0.0)) == [-np.inf, -np.inf]
    assert s.trace_count == 2
    for _ in range(3):
        assert np.isnan(s(a, float("nan"))).all()
    assert s.trace_count == 3
    d = eins.distribute(lambda x, c: x / c, devices=2)
    assert list(d(a, 0.0)) == [np.inf, np.inf] and list(d(a, -0.0)) == [-np.inf, -np.inf]
    assert list(d(a, 0.5)) == [2.0, 2.0]
    assert d.trace_count == 1


def test_jit_retraces_on_structure_change():
    @eins.jit
    def f(xs):
        return xs[0] + xs[1]

    a = f32(2)
    f((a, a))
    f([a, a])          # list vs tuple: another tree
    assert f.trace_count == 2


# ----------------------------------------------------------------------------- literals, consts
def test_static_python_scalars_become_literals_and_traced_ones_inputs():
    def f(x, k):
        return x * k + 1.5

    prog = eins.make_ir(f, static_argnums=1)(eins.ShapeDtype((2,), "float32"), 3.0)
    assert len(prog.inputs) == 1                       # the static scalar is not an input
    lits = [a for e in prog.eqns for a in e.inputs if isinstance(a, Literal)]
    assert sorted(l.value for l in lits) == [1.5, 3.0]
    assert "3.0" in str(prog) and "1.5" in str(prog)
    # the literal keeps the array's dtype (numpy's weak scalar promotion)
    assert prog.outputs[0].dtype == np.float32
    # traced (the default, as in JAX): a 0-d input of the dtype its literal would have
    prog = eins.make_ir(f)(eins.ShapeDtype((2,), "float32"), 3.0)
    assert [v.type for v in prog.inputs] == [TensorType((2,), np.float32),
                                             TensorType((), np.float32)]
    assert [a.value for e in prog.eqns for a in e.inputs if isinstance(a, Literal)] == [1.5]
    assert prog.outputs[0].dtype == np.float32 and [e.prim for e in prog.eqns] == ["mul", "add"]


def test_closed_over_arrays_become_constants():
    table = np.arange(6, dtype=np.float32).reshape(2, 3)

    def f(x):
        return x @ table + table[0]

    x = f32(4, 2)
    prog = eins.make_ir(f)(x)
    assert len(prog.inputs) == 1
    # the constant holds a copy of the array's value (mutating it later changes nothing)
    assert any(c is not table and np.array_equal(c, table) for _, c in prog.consts)
    assert str(prog).startswith("{ lambda a:f32[2,3]")  # constants are declared first
    assert_close(eins.jit(f)(x), x @ table + table[0], n=x.shape[1] + 1)


def test_shape_dtype_accepts_dtype_names():
    for name, dt, short in [("float16", np.float16, "f16"), ("bfloat16", eins.bfloat16, "bf16"),
                            ("float32", np.float32, "f32"), ("int32", np.int32, "i32")]:
        sd = eins.ShapeDtype((2, 3), name)
        assert sd.dtype == np.dtype(dt) and sd.shape == (2, 3)
        assert eins.ShapeDtype((2, 3), np.dtype(dt)) == sd
        prog = eins.make_ir(lambda a, b: a @ b)(sd, eins.ShapeDtype((3, 1), name))
        assert f"c:{short}[2,1] = matmul a b" in str(prog)


def test_bfloat16_runs_on_numpy():
    x = f32(2, 3).astype(eins.bfloat16)
    y = eins.jit(lambda a: a + a)(x)
    assert y.dtype == eins.bfloat16
    assert_close(y, 2 * x.astype(np.float32), dtype=eins.bfloat16)


def test_jit_with_shape_dtype_is_refused():
    with pytest.raises(eins.TraceError, match="ShapeDtype has no data"):
        eins.jit(lambda a: a)(eins.ShapeDtype((2,), "float32"))


def test_tree_roundtrip_property():
    from hypothesis import given, settings, strategies as st

    leaves = st.integers(0, 9)
    trees = st.recursive(leaves, lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.tuples(kids, kids),
        st.dictionaries(st.sampled_from("abcd"), kids, max_size=3), st.none()), max_leaves=12)

    @settings(max_examples=60, deadline=None)
    @given(trees)
    def check(tree):
        flat, td = tree_flatten(tree)
        assert td.num_leaves == len(flat)
        assert tree_unflatten(td, flat) == tree
        # unflatten with other leaves puts them in the same places
        doubled = tree_unflatten(td, [2 * x for x in flat])
        assert tree_flatten(doubled)[0] == [2 * x for x in flat]
        assert tree_flatten(doubled)[1] == td

    check()
