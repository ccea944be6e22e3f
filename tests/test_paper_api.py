"""The paper's graph API (Section 2): the listing runs verbatim and builds the tracer's IR."""
import math

import numpy as np
import pytest

import eins as es
import eins
from eins.errors import DTypeError, EinsError, ShapeError
from helpers import assert_close

tokens, d_model, d_ff = 8, 4, 16
dtype = np.float32


def _listing():
    # ---- Section 2, verbatim (with `import eins as es`) ----
    graph = es.createGraph()
    x = graph.insertTensor(
        es.tensorDesc([tokens, d_model], dtype))
    w1 = graph.insertTensor(
        es.tensorDesc([d_model, d_ff], dtype))
    w2 = graph.insertTensor(
        es.tensorDesc([d_ff, d_model], dtype))
    act = graph.matmul(x, w1)
    hidden = graph.unary(act, "relu", 0.0)
    y = graph.matmul(hidden, w2)
    graph.save(y)
    es.compileGraph(graph)
    # ---- end of the listing ----
    return graph, x, w1, w2, y


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((tokens, d_model)).astype(dtype),
            rng.standard_normal((d_model, d_ff)).astype(dtype),
            rng.standard_normal((d_ff, d_model)).astype(dtype))


def test_listing_runs_verbatim_then_load_execute_offload():
    graph, x, w1, w2, y = _listing()
    compiled = es.compileGraph(graph, device=[0], schedule_mode="naive")
    X, W1, W2 = _arrays()
    compiled.load(x, X)
    compiled.load(w1, W1)
    compiled.load(w2, W2)
    compiled.execute()
    Y = compiled.offload(y)
    assert isinstance(Y, np.ndarray) and Y.shape == (tokens, d_model) and Y.dtype == dtype
    assert_close(Y, np.maximum(X @ W1, 0) @ W2, n=max(d_model, d_ff), depth=2)


def test_graph_builds_the_tracers_ir():
    graph, *_ = _listing()
    compiled = es.compileGraph(graph, schedule_mode="ai")

    def ffn(x, w1, w2):
        return eins.relu(x @ w1) @ w2

    sds = [eins.ShapeDtype(s, dtype) for s in [(8, 4), (4, 16), (16, 4)]]
    assert str(compiled.program) == str(eins.make_ir(ffn)(*sds))
    assert [e.prim for e in compiled.program.eqns] == ["matmul", "relu", "matmul"]


def test_dtype_by_name_and_tensor_types():
    g = es.createGraph()
    a = g.insertTensor(es.tensorDesc([2, 3], "float16"))
    b = g.insertTensor(es.tensorDesc((3, 5), np.float16))
    c = g.matmul(a, b)
    assert c.shape == (2, 5) and c.dtype == np.float16
    assert "f16[2,5] = matmul" in str(es.compileGraph(g.save(c).graph).program)


def test_leaky_relu_slope_parameter():
    g = es.createGraph()
    a = g.insertTensor(es.tensorDesc([5], "float64"))
    r = g.save(g.unary(a, "relu", 0.1))
    cg = es.compileGraph(g)
    v = np.array([-2.0, -0.5, 0.0, 0.5, 3.0])
    cg.load(a, v)
    cg.execute()
    assert_close(cg.offload(r), np.array([-0.2, -0.05, 0.0, 0.5, 3.0]))


@pytest.mark.parametrize("name,formula", [
    ("neg", lambda v: -v), ("abs", np.abs), ("exp", np.exp), ("log", np.log),
    ("sqrt", np.sqrt), ("rsqrt", lambda v: 1 / np.sqrt(v)), ("square", lambda v: v * v),
    ("tanh", np.tanh), ("sigmoid", lambda v: 1 / (1 + np.exp(-v))),
    ("silu", lambda v: v / (1 + np.exp(-v))), ("cos", np.cos), ("sin", np.sin),
    ("relu", lambda v: np.maximum(v, 0)),
    ("gelu_tanh", lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))),
    ("gelu_exact", lambda v: 0.5 * v * (1 + np.vectorize(math.erf)(v / np.sqrt(2)))),
])
def test_unary_names(name, formula):
    g = es.createGraph()
    a = g.insertTensor(es.tensorDesc([4], "float64"))
    r = g.save(g.unary(a, name, 0.0))
    cg = es.compileGraph(g)
    v = np.array([0.3, 1.0, 2.5, 4.0])
    cg.load(a, v)
    cg.execute()
    assert_close(cg.offload(r), formula(v), n=4)  # libm and polynomial forms: a few ulp


def test_unary_with_parameter_pow_and_scale():
    g = es.createGraph()
    a = g.insertTensor(es.tensorDesc([3], "float64"))
    p = g.save(g.unary(a, "pow", 3.0))
    s = g.save(g.unary(a, "scale", -2.0))
    cg = es.compileGraph(g)
    cg.load(a, [1.0, 2.0, 0.5])
    cg.execute()
    assert_close(cg.offload(p), np.array([1.0, 8.0, 0.125]), n=2)
    assert_close(cg.offload(s), np.array([-2.0, -4.0, -1.0]))


def test_binary_and_einsum():
    g = es.createGraph()
    a = g.insertTensor(es.tensorDesc([2, 3], "float64"))
    b = g.insertTensor(es.tensorDesc([3], "float64"))
    s = g.save(g.binary(a, b, "add"))
    e = g.save(g.einsum("ij,j->i", a, b))
    cg = es.compileGraph(g)
    A, B = np.arange(6.0).reshape(2, 3), np.array([1.0, -1.0, 2.0])
    cg.load(a, A)
    cg.load(b, B)
    cg.execute()
    assert_close(cg.offload(s), A + B)
    assert_close(cg.offload(e), A @ B, n=3)


def test_load_casts_same_kind():
    graph, x, w1, w2, y = _listing()
    cg = es.compileGraph(graph)
    X, W1, W2 = (a.astype(np.float64) for a in _arrays(1))
    for t, v in ((x, X), (w1, W1), (w2, W2)):
        cg.load(t, v)
    cg.execute()
    assert cg.offload(y).dtype == np.float32


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("mode", ["naive", "ai"])
def test_compile_graph_distributes(mode):
    """compileGraph(graph, device=[...]) plans and runs on those (virtual) devices."""
    graph, x, w1, w2, y = _listing()
    compiled = es.compileGraph(graph, device=[0, 1, 2, 3], schedule_mode=mode)
    assert compiled.lowered.devices == (0, 1, 2, 3)
    X, W1, W2 = _arrays(1)
    for t, a in ((x, X), (w1, W1), (w2, W2)):
        compiled.load(t, a)
    compiled.execute()
    assert_close(compiled.offload(y), np.maximum(X @ W1, 0) @ W2, n=max(d_model, d_ff),
                 depth=2)
    assert "split" in compiled.lowered.as_text("planned")


def test_compile_errors():
    graph, *_ = _listing()
    with pytest.raises(EinsError, match="schedule_mode must be one of \\['naive', 'ai'\\], "
                                        "got 'fast'"):
        es.compileGraph(graph, schedule_mode="fast")
    with pytest.raises(EinsError, match=r"devices \[0, 0\] name a device twice"):
        es.compileGraph(graph, device=[0, 0])
    with pytest.raises(EinsError, match=r"device id -1 in \[-1\] is not a non-negative int"):
        es.compileGraph(graph, device=-1)
    with pytest.raises(EinsError, match="saves no tensor"):
        es.compileGraph(es.createGraph())
    with pytest.raises(EinsError, match="expects a graph"):
        es.compileGraph("graph")


def test_graph_building_errors():
    g = es.createGraph()
    a = g.insertTensor(es.tensorDesc([2, 3], "float32"))
    with pytest.raises(ShapeError) as e:
        g.matmul(a, a)  # the offending line
    msg = str(e.value)
    assert "matmul" in msg and "(2, 3)" in msg and "test_paper_api.py:" in msg
    with pytest.raises(EinsError, match="unknown operator 'swish'"):
        g.unary(a, "swish", 0.0)
    with pytest.raises(EinsError, match="unary 'exp' takes no parameter; got 0.5"):
        g.unary(a, "exp", 0.5)
    with pytest.raises(EinsError, match="expects es.tensorDesc"):
        g.insertTensor([2, 3])
    with pytest.raises(ShapeError, match="non-negative ints, got \\[2, -1\\]"):
        es.tensorDesc([2, -1], "float32")
    with pytest.raises(DTypeError, match="unsupported dtype 'complex64'"):
        es.tensorDesc([2], "complex64")
    other = es.createGraph().insertTensor(es.tensorDesc([3, 2], "float32"))
    with pytest.raises(EinsError, match="belongs to another graph"):
        g.matmul(a, other)


def test_runtime_errors():
    graph, x, w1, w2, y = _listing()
    cg = es.compileGraph(graph)
    X, W1, W2 = _arrays()
    with pytest.raises(ShapeError, match=r"shape \(4, 8\) for GraphTensor\(#0, float32\[8,4\]\)"):
        cg.load(x, X.T)
    with pytest.raises(DTypeError, match="complex128 cannot be cast to the declared float32"):
        cg.load(x, X.astype(np.complex128))
    cg.load(x, X)
    with pytest.raises(EinsError, match=r"inputs not loaded: \[GraphTensor\(#1"):
        cg.execute()
    cg.load(w1, W1)
    cg.load(w2, W2)
    with pytest.raises(EinsError, match="call execute\\(\\) first"):
        cg.offload(y)
    cg.execute()
    act = graph.matmul(x, w1)
    with pytest.raises(EinsError, match="was not saved"):
        cg.offload(act)
    with pytest.raises(EinsError, match="not an inserted tensor"):
        cg.load(y, X)


# ------------------------------------------------- found by a bug hunt of the paper API
def test_compile_graph_takes_a_numpy_integer_as_one_device_id():
    g = es.createGraph()
    a = g.insertTensor(es.tensorDesc([4, 4]))
    g.save(g.unary(a, "exp"))
    ids = np.array([3, 0, 5])
    # np.int64(3) was read as a count (devices 0, 1, 2) and np.int64(0) refused
    assert es.compileGraph(g, device=ids[0]).devices == (3,)
    assert es.compileGraph(g, device=ids[1]).devices == (0,)
    with pytest.raises(EinsError, match="device must be a device id or a list of them, got "
                                        "True"):
        es.compileGraph(g, device=True)
    # the advice for ids past the default topology is now followable
    c = es.compileGraph(g, device=list(range(16)), topology="dgx-h100:2x8")
    assert c.lowered.predicted_time()["topology"] == "dgx-h100:2x8"


def test_graph_operator_names_must_be_strings():
    g = es.createGraph()
    a = g.insertTensor(es.tensorDesc([4]))
    with pytest.raises(EinsError, match=r"unary: unknown operator \['relu'\]"):
        g.unary(a, ["relu"])   # TypeError: unhashable type: 'list'
    with pytest.raises(EinsError, match=r"binary: unknown operator \['add'\]"):
        g.binary(a, a, ["add"])


def test_tensor_desc_dtype_none_is_an_error_not_float64():
    with pytest.raises(DTypeError, match="tensorDesc: dtype is None"):
        es.tensorDesc([2], None)
    assert es.tensorDesc([2]).dtype == np.float32


def test_load_copies_the_array():
    """load kept a reference: changing the array before execute changed the result."""
    g = es.createGraph()
    a = g.insertTensor(es.tensorDesc([3]))
    y = g.unary(a, "neg")
    g.save(y)
    c = es.compileGraph(g, device=[0, 1])
    x = np.ones(3, np.float32)
    c.load(a, x)
    x[:] = 5.0
    c.execute()
    np.testing.assert_array_equal(c.offload(y), -np.ones(3, np.float32))
