"""Every primitive's backward rule against central finite differences in float64.

The programs are the primitives' own spec samples (``Primitive.samples``, the small programs
eins.validate_specs brute-forces): for each, ``loss = sum(fn(*args) * R)`` with a fixed random
R per float result, and ``eins.grad`` of it with respect to every float64 argument is
compared with the central differences of the reference evaluator. Agreement: 1e-6 relative
to the gradient's largest entry (at least 1)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eins
from eins import validate_specs
from eins.ir.primitive import PRIMITIVES
from eins.ir.types import is_float

_EPS = 1e-6
_RTOL = 1e-6


def _arr(*shape, dtype="float64", lo=-2.0, hi=2.0):
    rng = np.random.default_rng(abs(hash((shape, dtype, lo, hi))) % 2 ** 32)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        return rng.integers(-5, 6, size=shape).astype(dt)
    return rng.uniform(lo, hi, size=shape).astype(dt)


def _leaves(out):
    leaves, _ = eins.tree_flatten(out)
    return leaves


def _loss_of(fn, args, diff, weights):
    """loss(*diff args) = sum over float results of sum(result * R)."""
    def loss(*d):
        full = list(args)
        for k, v in zip(diff, d):
            full[k] = v
        total = 0.0
        for r, w in zip(_leaves(fn(*full)), weights):
            if w is not None:
                total = total + eins.sum(r * w)
        return total
    return loss


def _weights(fn, args):
    outs = _leaves(eins.jit(fn)(*args))
    rng = np.random.default_rng(7)
    return [rng.standard_normal(np.shape(o)) if is_float(np.asarray(o).dtype) else None
            for o in outs]


def central_differences(f, args, k):
    x = np.array(args[k], dtype=np.float64)
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        hi, lo = x.copy(), x.copy()
        hi[i] += _EPS
        lo[i] -= _EPS
        a, b = list(args), list(args)
        a[k], b[k] = hi, lo
        g[i] = (float(f(*a)) - float(f(*b))) / (2 * _EPS)
    return g


def check_gradients(fn, args):
    """eins.grad of the sample's loss against central differences, for every float64
    argument; returns the primitives the program used."""
    diff = [k for k, a in enumerate(args) if isinstance(a, np.ndarray) and a.dtype == np.float64]
    weights = _weights(fn, args)
    loss = _loss_of(fn, args, diff, weights)
    ref = eins.jit(loss)
    got = eins.grad(loss, argnums=tuple(range(len(diff))))(*[args[k] for k in diff])
    for j, k in enumerate(diff):
        fd = central_differences(ref, [args[m] for m in diff], j)
        scale = max(1.0, float(np.abs(fd).max()))
        err = float(np.abs(np.asarray(got[j]) - fd).max()) / scale
        assert err <= _RTOL, f"argument {k}: gradient off by {err:.3g} (relative)"
    program = eins.make_ir(loss)(*[args[m] for m in diff])
    return {e.prim for e in program.eqns if e.phase == "fwd"}


def _float64_samples():
    out = []
    for prim in PRIMITIVES.values():
        if prim.samples is None or prim.vjp is None and prim.transpose is None \
                and prim.name not in ("gather", "top_k"):   # their families' programs
            continue
        for label, fn, args in prim.samples(_arr):
            arrays = [a for a in args if isinstance(a, np.ndarray)]
            if any(a.dtype.kind == "f" and a.dtype != np.float64 for a in arrays):
                continue   # float32 / float16 samples: finite differences need float64
            if any(a.dtype == np.float64 for a in arrays) and _all_float64(fn, args):
                out.append(pytest.param(fn, _jitter(args), id=label))
    return out


def _all_float64(fn, args) -> bool:
    """Whether the program has a float result and every float value in it is float64 (a
    cast to float32 on the way rounds away the finite differences' steps)."""
    program = eins.make_ir(fn)(*args)
    return any(is_float(v.dtype) for v in program.outputs) and all(
        v.dtype == np.float64 for e in program.eqns for v in e.outputs if is_float(v.dtype))


def _jitter(args):
    """The float64 arguments moved by up to 1e-3: samples made with ties (sorting's) are
    points where the derivative is not defined; a rule is checked where it is."""
    rng = np.random.default_rng(11)
    return tuple(a + rng.uniform(0, 1e-3, a.shape) if isinstance(a, np.ndarray)
                 and a.dtype == np.float64 else a for a in args)


SAMPLES = _float64_samples()


@pytest.mark.parametrize("fn, args", SAMPLES)
def test_rule_matches_finite_differences(fn, args):
    check_gradients(fn, args)


@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_attention_bias_gradient_under_query_and_key_splits(kind):
    """The bias's gradient (attention_dbias) with the query and the key rows split over 4
    devices equals the finite differences and eins.grad's on one device: the blocks of an
    additive bias tile it, the ALiBi slopes are four blocks' partials summed by ⊕."""
    q, k, v = _arr(2, 4, 12, 4), _arr(2, 2, 12, 4), _arr(2, 2, 12, 4)
    w = _arr(2, 4, 12, 4, lo=-1.0, hi=1.0)
    bias = _arr(4, lo=0.1, hi=1.0) if kind == "alibi" else _arr(2, 1, 12, 12)

    def loss(b):
        return eins.sum(eins.attention(q, k, v, bias=b, window=7, softcap=3.0) * w)

    grad = eins.grad(loss)
    program = eins.make_ir(grad)(bias)
    (i,) = [n for n, e in enumerate(program.eqns) if e.prim == "attention_dbias"]
    dist = eins.distribute(grad, devices=4, plan={i: {"sequence": 2, "kv_sequence": 2}})
    (row,) = [r for r in dist.lower(bias).plan_table() if r["eqn"] == i]
    assert row["splits"] == {"sequence": 2, "kv_sequence": 2}
    assert row["agg"] == (4 if kind == "alibi" else 1)
    got = np.asarray(dist(bias))
    fd = central_differences(eins.jit(loss), [bias], 0)
    assert got.shape == bias.shape
    assert np.abs(got - fd).max() <= _RTOL * max(1.0, np.abs(fd).max())
    np.testing.assert_allclose(got, np.asarray(grad(bias)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x", [
    np.array([[1.5, -2.0, 0.5, 3.0], [0.0, 2.0, -1.0, 0.5]]),    # one zero in a row
    np.array([[0.0, 2.0, 0.0, 3.0], [1.0, 0.0, -1.0, 0.0]]),     # two zeros in each row
])
def test_prod_and_cumprod_gradients_are_exact_at_zeros(x):
    """The products' rules do not divide by a zero operand: the gradient there is the
    product of the others (central differences are exact on these multilinear functions)."""
    w = np.random.default_rng(3).standard_normal(x.shape)
    for f in (lambda a: eins.sum(eins.prod(a, axis=1) * w[:, 0]),
              lambda a: eins.sum(eins.cumprod(a, axis=1) * w),
              lambda a: eins.sum(eins.cumsum(a, axis=1) * w)):
        got = np.asarray(eins.grad(f)(x))
        fd = central_differences(eins.jit(f), [x], 0)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-6)


# a primitive is differentiable when it takes and returns floats; these are the ones that
# have no rule on purpose: attention's own backward (attention_bwd, attention_dbias) has no
# second derivative
NO_RULE_YET = {"attention_bwd", "attention_dbias"}


def test_every_differentiable_primitive_has_a_checked_rule():
    float_out = set()
    for label, fn, args in validate_specs.samples():
        try:
            program = eins.make_ir(fn)(*args)
        except eins.EinsError:
            continue
        for e in program.eqns:
            if any(is_float(v.dtype) for v in e.outputs) and \
                    any(is_float(a.dtype) for a in e.inputs):
                float_out.add(e.prim)
    ruled = {n for n, p in PRIMITIVES.items() if p.vjp is not None or p.transpose is not None}
    assert float_out - NO_RULE_YET <= ruled, sorted(float_out - NO_RULE_YET - ruled)
    checked = {"astype"}   # test_astype_passes_the_cotangent_back_in_the_operand_dtype
    for param in SAMPLES:
        fn, args = param.values
        program = eins.make_ir(fn)(*args)
        checked |= {e.prim for e in program.eqns}
    assert ruled <= checked, f"rules no sample checks: {sorted(ruled - checked)}"


# ----------------------------------------------------------------------------- broadcasting
_SHAPES = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)


def _broadcast_pair(shape, mask, drop):
    """A shape broadcasting against ``shape``: some dims set to 1, some leading ones dropped."""
    other = tuple(1 if m else n for n, m in zip(shape, mask))
    return other[min(drop, len(other)):]


@settings(max_examples=25, deadline=None)
@given(shape=_SHAPES, mask=st.lists(st.booleans(), min_size=3, max_size=3),
       drop=st.integers(0, 2), op=st.sampled_from(["add", "sub", "mul", "div", "maximum",
                                                    "minimum", "pow"]))
def test_binary_rules_sum_over_broadcast_dims(shape, mask, drop, op):
    other = _broadcast_pair(shape, mask, drop)
    rng = np.random.default_rng(len(shape) * 7 + drop)
    a = rng.uniform(0.5, 2.0, shape)
    b = rng.uniform(0.5, 2.0, other)
    if op in ("maximum", "minimum"):
        b = b + 0.01   # no ties: the derivative is defined
    f = getattr(eins, op)
    check_gradients(lambda x, y: f(x, y), [a, b])
    check_gradients(lambda x, y: f(y, x), [a, b])


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
       data=st.data())
def test_reductions_and_softmax_over_any_axis(shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    keep = data.draw(st.booleans())
    x = np.random.default_rng(math.prod(shape)).standard_normal(shape)
    for fn in (lambda t: eins.sum(t, axis=axis, keepdims=keep),
               lambda t: eins.mean(t, axis=axis, keepdims=keep),
               lambda t: eins.max(t, axis=axis, keepdims=keep),
               lambda t: eins.min(t, axis=axis, keepdims=keep),
               lambda t: eins.softmax(t, axis=axis)):
        check_gradients(fn, [x])


def test_einsum_diagonal_lonely_and_broadcast_letters():
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((4, 4)), rng.standard_normal((1, 5))
    check_gradients(lambda t: eins.einsum("ii->i", t), [x])
    check_gradients(lambda t: eins.einsum("ii->", t), [x])
    check_gradients(lambda t, u: eins.einsum("ij,kj->ik", t, u), [rng.standard_normal((3, 5)), y])
    check_gradients(lambda t, u: eins.einsum("ab,cd->a", t, u),
                    [rng.standard_normal((2, 3)), rng.standard_normal((3, 2))])


def test_matmul_vectors_and_batch_broadcast():
    rng = np.random.default_rng(4)
    check_gradients(lambda a, b: a @ b, [rng.standard_normal(3), rng.standard_normal((2, 3, 4))])
    check_gradients(lambda a, b: a @ b, [rng.standard_normal((2, 3, 4)), rng.standard_normal(4)])
    check_gradients(lambda a, b: a @ b, [rng.standard_normal(4), rng.standard_normal(4)])
    check_gradients(lambda a, b: a @ b, [rng.standard_normal((1, 3, 4)),
                                         rng.standard_normal((5, 4, 2))])


def test_unary_rules_on_their_domains():
    rng = np.random.default_rng(5)
    x = rng.uniform(-2, 2, (3, 4))
    pos = rng.uniform(0.3, 2, (3, 4))
    for name in ("neg", "abs", "exp", "tanh", "sigmoid", "relu", "silu", "cos", "sin",
                 "square"):
        check_gradients(getattr(eins, name), [x])
    for name in ("log", "sqrt", "rsqrt"):
        check_gradients(getattr(eins, name), [pos])
    for approximate in (True, False):
        check_gradients(lambda t: eins.gelu(t, approximate=approximate), [x])
    check_gradients(lambda t: eins.where(t > 0, t * 3.0, t), [x])



def test_astype_passes_the_cotangent_back_in_the_operand_dtype():
    x = np.linspace(-1, 1, 6).reshape(2, 3)
    g = eins.grad(lambda t: eins.sum(eins.astype(t, "float32") * np.float32(3)))(x)
    assert g.dtype == np.float64
    np.testing.assert_array_equal(g, np.full((2, 3), 3.0))
