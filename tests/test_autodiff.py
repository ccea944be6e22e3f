"""eins.vjp / grad / value_and_grad / checkpoint: the API on pytrees, composition with jit,
make_ir and distribute, the forward/backward marks, checkpointing, and the errors."""
import numpy as np
import pytest

from helpers import SPREAD, accumulation, assert_close, assert_splits

import eins
from eins.autodiff import saved_bytes
from eins.errors import EinsError, TraceError
from eins.ir.primitive import Primitive, register, unregister
from eins.tracing import bind


def mlp_params(rng, d=16, h=32, o=8):
    return {"w1": (rng.standard_normal((d, h)) / 4).astype(np.float32),
            "w2": (rng.standard_normal((h, o)) / 6).astype(np.float32),
            "g": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)}


def mlp_loss(p, x, y):
    h = eins.gelu(eins.rms_norm(x, p["g"]) @ p["w1"])
    return eins.mean((h @ p["w2"] - y) ** 2)


def numpy_mlp_grads(p, x, y):
    """The MLP's loss and gradients written out by hand in float64."""
    f = np.float64
    w1, w2, g = (np.asarray(p[k], f) for k in ("w1", "w2", "g"))
    x, y = np.asarray(x, f), np.asarray(y, f)
    r = 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    xn = x * r * g
    a = xn @ w1
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (a + 0.044715 * a ** 3))
    h = 0.5 * a * (1 + t)
    e = h @ w2 - y
    loss = np.mean(e ** 2)
    de = 2 * e / e.size
    dw2 = h.T @ de
    dh = de @ w2.T
    da = dh * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * c * (1 + 3 * 0.044715 * a * a))
    dw1 = xn.T @ da
    dg = np.sum((da @ w1.T) * x * r, axis=0)
    return loss, {"w1": dw1, "w2": dw2, "g": dg}


@pytest.fixture(scope="module")
def mlp():
    rng = np.random.default_rng(0)
    p = mlp_params(rng)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = rng.standard_normal((64, 8)).astype(np.float32)
    return p, x, y


def test_value_and_grad_of_a_dict_of_weights(mlp):
    p, x, y = mlp
    v, g = eins.value_and_grad(mlp_loss)(p, x, y)
    want_v, want_g = numpy_mlp_grads(p, x, y)
    assert sorted(g) == ["g", "w1", "w2"]
    np.testing.assert_allclose(v, want_v, rtol=1e-5)
    for k in g:
        assert g[k].dtype == np.float32 and g[k].shape == p[k].shape
        np.testing.assert_allclose(g[k], want_g[k], rtol=1e-4, atol=1e-6)


def test_grad_argnums_tuple_and_has_aux(mlp):
    p, x, y = mlp

    def loss(p, x, y):
        value = mlp_loss(p, x, y)
        return value, {"twice": value * 2}

    (gp, gx), aux = eins.grad(loss, argnums=(0, 1), has_aux=True)(p, x, y)
    (v, aux2), gp2 = eins.value_and_grad(loss, has_aux=True)(p, x, y)
    np.testing.assert_allclose(aux["twice"], 2 * v, rtol=1e-6)
    np.testing.assert_allclose(aux2["twice"], 2 * v, rtol=1e-6)
    assert gx.shape == x.shape
    for k in gp:
        np.testing.assert_array_equal(gp[k], gp2[k])
    # the input gradient against differences of the loss along a random direction
    d = np.random.default_rng(1).standard_normal(x.shape)
    f = eins.jit(lambda x: mlp_loss({k: v.astype(np.float64) for k, v in p.items()}, x,
                                    y.astype(np.float64)))
    gx64 = eins.grad(lambda x: mlp_loss({k: v.astype(np.float64) for k, v in p.items()}, x,
                                        y.astype(np.float64)))(x.astype(np.float64))
    eps = 1e-6
    fd = (f(x + eps * d) - f(x - eps * d)) / (2 * eps)
    np.testing.assert_allclose(np.sum(gx64 * d), fd, rtol=1e-6)
    np.testing.assert_allclose(gx, gx64, rtol=1e-3, atol=1e-6)


def test_vjp_inside_and_outside_a_trace():
    x = np.linspace(-1, 1, 12).reshape(3, 4)
    ct = np.arange(12.0).reshape(3, 4)
    out, f = eins.vjp(eins.tanh, x)
    np.testing.assert_allclose(out, np.tanh(x))
    (gx,) = f(ct)
    np.testing.assert_allclose(gx, ct * (1 - np.tanh(x) ** 2), rtol=1e-12)

    @eins.jit
    def inside(x, ct):
        out, f = eins.vjp(lambda t: {"a": eins.sin(t), "b": t * 3.0}, x)
        return f({"a": ct, "b": ct})[0]

    np.testing.assert_allclose(inside(x, ct), ct * np.cos(x) + 3 * ct, rtol=1e-12)
    # has_aux, and an output that is the primal itself
    out, f, aux = eins.vjp(lambda t: (t, {"n": eins.sum(t)}), x, has_aux=True)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_allclose(aux["n"], x.sum())
    np.testing.assert_array_equal(f(ct)[0], ct)



def test_make_ir_prints_the_backward_eqns_marked():
    w = eins.ShapeDtype((4, 3), "float32")
    x = eins.ShapeDtype((2, 4), "float32")
    text = str(eins.make_ir(eins.grad(lambda w, x: eins.sum(x @ w)))(w, x))
    lines = [ln for ln in text.splitlines() if " = " in ln]
    assert all(ln.rstrip().endswith(("# fwd", "# bwd")) for ln in lines), text
    assert any("einsum" in ln and ln.endswith("# bwd") for ln in lines), text
    # a program without a gradient prints as before: no marks
    assert "# fwd" not in str(eins.make_ir(lambda w, x: x @ w)(w, x))


def test_plan_table_and_predicted_time_mark_each_eqn(mlp):
    p, x, y = mlp
    low = eins.distribute(eins.value_and_grad(mlp_loss), devices=4, tuning=SPREAD).lower(p, x, y)
    assert_splits(low)
    phases = [r["phase"] for r in low.plan_table()]
    assert phases == [e.phase for e in low.program.eqns]
    assert {"fwd", "bwd"} == set(phases)
    assert phases.index("bwd") > 0 and "fwd" not in phases[phases.index("bwd"):]
    pt = low.predicted_time()
    rows = pt["per_eqn"]
    assert [r["phase"] for r in rows] == phases
    # the table splits the step into its passes, which add up to the total
    passes = {ln.split()[0]: float(ln.split()[1]) for ln in str(pt).splitlines()
              if ln.split()[0] in ("forward", "backward", "total")}
    assert passes["forward"] > 0 and passes["backward"] > 0
    assert abs(passes["forward"] + passes["backward"] - passes["total"]) <= 0.002
    planned = low.as_text("planned")
    assert "# bwd: split" in planned and "# fwd: split" in planned


def same_values(program, got, want):
    """Every leaf equal within the tolerance rule for the program's accumulations."""
    n, depth = accumulation(program)
    for a, b in zip(eins.tree_flatten(got)[0], eins.tree_flatten(want)[0]):
        assert_close(a, b, n=n, depth=depth)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("schedule", ["naive", "optimized"])
def test_distributed_gradients_equal_jit(mlp, p, schedule):
    params, x, y = mlp
    vg = eins.value_and_grad(mlp_loss)
    v, g = eins.jit(vg)(params, x, y)
    d = eins.distribute(vg, devices=p, schedule=schedule, backend="numpy", tuning=SPREAD)
    v2, g2 = d(params, x, y)
    low = d.lower(params, x, y)
    assert_splits(low)
    same_values(low.program, (v2, g2), (v, g))


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", ["naive", "optimized"])
def test_distributed_gradients_on_the_interpreter(mlp, p, schedule):
    pytest.importorskip("triton")
    params, x, y = mlp
    vg = eins.value_and_grad(mlp_loss)
    v, g = eins.jit(vg)(params, x, y)
    d = eins.distribute(vg, devices=p, schedule=schedule, backend="interpret", tuning=SPREAD)
    low = d.lower(params, x, y)
    assert_splits(low)
    same_values(low.program, d(params, x, y), (v, g))


def test_checkpoint_saves_only_its_inputs_and_keeps_the_gradients():
    rng = np.random.default_rng(2)
    ws = [(rng.standard_normal((32, 32)) / 6).astype(np.float32) for _ in range(3)]
    x = rng.standard_normal((64, 32)).astype(np.float32)

    def layer(h, w):
        return eins.tanh(eins.silu(h @ w) * 1.5)

    def loss(ws, x, remat):
        h = x
        for w in ws:
            h = eins.checkpoint(layer)(h, w) if remat else layer(h, w)
        return eins.sum(h * h)

    plain = eins.make_ir(eins.grad(lambda ws, x: loss(ws, x, False)))(ws, x)
    remat = eins.make_ir(eins.grad(lambda ws, x: loss(ws, x, True)))(ws, x)
    assert saved_bytes(remat) < saved_bytes(plain)
    # what crosses the boundary: each layer's input (x is an argument, not saved) and the
    # last layer's output, which the loss's own backward reads
    act = 64 * 32 * 4
    assert saved_bytes(remat) == 3 * act
    assert any(e.phase == "bwd" and e.prim == "silu" for e in remat.eqns)
    g0 = eins.grad(lambda ws, x: loss(ws, x, False))(ws, x)
    g1 = eins.grad(lambda ws, x: loss(ws, x, True))(ws, x)
    for a, b in zip(g0, g1):
        np.testing.assert_allclose(b, a, rtol=1e-6)
    # outside a gradient it is the function itself
    np.testing.assert_array_equal(eins.jit(lambda ws, x: loss(ws, x, True))(ws, x),
                                  eins.jit(lambda ws, x: loss(ws, x, False))(ws, x))


def test_second_derivative():
    x = np.linspace(-1.5, 1.5, 7)
    d2 = eins.grad(lambda t: eins.sum(eins.grad(lambda u: eins.sum(eins.sin(u) * u))(t)))(x)
    np.testing.assert_allclose(d2, 2 * np.cos(x) - x * np.sin(x), rtol=1e-12)


def test_unused_argument_gets_zeros_and_integer_outputs_no_cotangent():
    x = np.arange(6.0).reshape(2, 3)
    g = eins.grad(lambda a, b: eins.sum(a * 2.0), argnums=(0, 1))(x, x + 1)
    np.testing.assert_array_equal(g[1], np.zeros((2, 3)))

    def f(t):
        vals, idx = eins.top_k(t, 2)
        return eins.sum(vals * eins.astype(idx, "float64"))

    # the values' cotangents (times their index) go back where they came from; the
    # indices themselves are integers and send none
    gx = eins.grad(f)(np.array([[0.3, 0.9, 0.1], [0.5, 0.2, 0.7]]))
    np.testing.assert_array_equal(gx, [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])


def test_errors_name_the_problem():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(EinsError, match=r"float scalar \(shape \(\)\).*got float32 of shape "
                                        r"\(2, 3\)"):
        eins.grad(lambda t: t * 2)(x)
    with pytest.raises(EinsError, match="must be floats.*int64"):
        eins.grad(lambda t: eins.sum(t * 1.0))(np.arange(3))
    with pytest.raises(TraceError, match="argnums 2 out of range"):
        eins.grad(lambda a, b: eins.sum(a), argnums=2)(x, x)
    with pytest.raises(TraceError, match="expects a function"):
        eins.grad(3)
    with pytest.raises(TraceError, match="has_aux=True.*pair"):
        eins.grad(lambda t: eins.sum(t), has_aux=True)(x)
    with pytest.raises(EinsError, match="cotangent 0 has shape \\(3,\\)"):
        eins.vjp(lambda t: t * 2.0, x)[1](np.ones(3, np.float32))



def test_a_primitive_without_a_backward_rule_is_a_clear_error():
    def abstract(x):
        return (x,)

    register(Primitive("ruleless", abstract, lambda x: (np.array(x),)))
    try:
        x = np.ones((2, 3), np.float32)
        with pytest.raises(EinsError, match=r"cannot differentiate 'ruleless': the primitive "
                                            r"has no backward rule.*test_autodiff.py:\d+"):
            eins.grad(lambda t: eins.sum(bind("ruleless", t)))(x)
    finally:
        unregister("ruleless")
