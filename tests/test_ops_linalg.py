"""matmul and einsum against independent formulas (explicit loops / numpy), dtypes, numpy's
implicit-output and ellipsis rules, every einsum error, and every join-agg spec against the
whole-tensor result (contracted letters aggregate with sum)."""
import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eins
from eins.errors import EinsumError, ShapeError, TraceError
from eins.ir.types import Box, TensorType
from eins.ops import get_primitive
import helpers
from helpers import assert_close, both, check_specs, magnitude

BF16 = eins.bfloat16
S = eins.ShapeDtype


def spec_check(arrays):
    """check_specs's options here: contracted letters aggregate with sum, and the partial sums
    reorder at most every element of the largest operand (the accumulation length)."""
    return dict(n=max(np.size(a) for a in arrays), agg="sum")


def rand(shape, dtype=np.float64, seed=0):
    return helpers.rand(shape, dtype, -1.0, 1.0, seed, ints=(-4, 4))


def loop_einsum(ins, out, *arrays):
    """Reference by explicit summation over every letter (no numpy einsum)."""
    ext = {}
    for t, a in zip(ins, arrays):
        for c, n in zip(t, a.shape):
            ext[c] = max(ext.get(c, 1), n)
    letters = sorted(ext)
    res = np.zeros(tuple(ext[c] for c in out))
    for vals in itertools.product(*(range(ext[c]) for c in letters)):
        v = dict(zip(letters, vals))
        term = 1.0
        for t, a in zip(ins, arrays):
            term *= float(a[tuple(v[c] if n > 1 else 0 for c, n in zip(t, a.shape))])
        res[tuple(v[c] for c in out)] += term
    return res


# ----------------------------------------------------------------------------- einsum
CASES = [  # subscripts, shapes, explicit form (ins, out) for the loop reference
    ("ij,jk->ik", [(2, 3), (3, 4)], (["ij", "jk"], "ik")),
    ("ij,jk", [(2, 3), (3, 4)], (["ij", "jk"], "ik")),
    ("bij,bjk->bik", [(2, 2, 3), (2, 3, 2)], (["bij", "bjk"], "bik")),
    ("ij,jk,kl->il", [(2, 3), (3, 2), (2, 4)], (["ij", "jk", "kl"], "il")),
    ("ij->ji", [(2, 3)], (["ij"], "ji")),
    ("ij->", [(2, 3)], (["ij"], "")),
    ("ii", [(3, 3)], (["ii"], "")),
    ("ii->i", [(3, 3)], (["ii"], "i")),
    ("i,i", [(4,), (4,)], (["i", "i"], "")),
    ("i,j", [(2,), (3,)], (["i", "j"], "ij")),
    ("ba", [(2, 3)], (["ba"], "ab")),
    ("Ab", [(2, 3)], (["Ab"], "Ab")),
    ("...ij,jk->...ik", [(2, 2, 3), (3, 4)], (["aij", "jk"], "aik")),
    ("...ij,...jk", [(2, 1, 2, 3), (3, 3, 2)], (["abij", "bjk"], "abik")),
    ("ij,ij->ij", [(1, 3), (2, 3)], (["ij", "ij"], "ij")),
    ("bhsd,bhtd->bhst", [(1, 2, 3, 2), (1, 2, 2, 2)], (["bhsd", "bhtd"], "bhst")),
    (",ij->ij", [(), (2, 2)], (["", "ij"], "ij")),
]


@pytest.mark.parametrize("subs,shapes,ref", CASES)
def test_einsum_against_loops(subs, shapes, ref):
    arrays = [rand(s, seed=i) for i, s in enumerate(shapes)]
    got = both(lambda *xs: eins.einsum(subs, *xs), *arrays)
    want = loop_einsum(*ref, *arrays)
    n = max(a.size for a in arrays)
    assert_close(got, want, n=n)
    assert_close(got, np.einsum(subs, *arrays), n=n)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.int32, np.bool_])
def test_einsum_dtypes(dtype):
    a, b = rand((3, 4), dtype, 1), rand((4, 2), dtype, 2)
    got = both(lambda x, y: eins.einsum("ij,jk->ik", x, y), a, b)
    assert got.dtype == np.dtype(dtype)
    want = a.astype(np.float64) @ b.astype(np.float64)
    if dtype is np.bool_:
        want = want > 0
    assert_close(got, want, n=4, dtype=dtype)


def test_einsum_mixed_dtypes_and_scalar_operand():
    a, b = rand((2, 3), np.float16), rand((3,), BF16)
    assert both(lambda x, y: eins.einsum("ij,j->i", x, y), a, b).dtype == np.float32
    got = both(lambda x: eins.einsum(",i->i", 2.0, x), rand((3,), np.float16))
    assert got.dtype == np.float16  # the Python scalar is weak (NEP 50)


def test_einsum_traces_explicit_form():
    p = eins.make_ir(lambda a, b: eins.einsum("...ij,jk", a, b))(S((5, 2, 3)), S((3, 4)))
    e = p.eqns[0]
    assert e.prim == "einsum" and e.params == {"subscripts": "aij,jk->aik"}
    assert p.outputs[0].shape == (5, 2, 4)


def test_einsum_flops():
    ins = [TensorType((2, 3), np.dtype(np.float32)), TensorType((3, 4), np.dtype(np.float32))]
    out = [TensorType((2, 4), np.dtype(np.float32))]
    assert get_primitive("einsum").flops(ins, out, subscripts="ij,jk->ik") == 2 * 2 * 3 * 4


@pytest.mark.parametrize("subs,shapes,exc,needle", [
    ("ij,jk", [(2, 3), (3, 4), (4, 5)], EinsumError, "2 input terms for 3 operands"),
    ("ij,jk->iik", [(2, 3), (3, 4)], EinsumError, "output letter 'i' repeated in 'iik'"),
    ("ij,jk->iz", [(2, 3), (3, 4)], EinsumError, "output letter 'z' appears in no input term"),
    ("ijk,jk->ik", [(2, 3), (3, 4)], EinsumError, "term 'ijk' names 3 dims but the operand has "
                                                  "rank 2"),
    ("i1,jk->ik", [(2, 3), (3, 4)], EinsumError, "invalid character '1' in term 'i1'"),
    ("ij->i->j", [(2, 3)], EinsumError, "more than one '->'"),
    ("...ij->ij", [(5, 2, 3)], EinsumError, "the output has no '...'"),
    ("...ijk", [(2, 3)], EinsumError, "term '...ijk' names 3 dims but the operand has shape"),
    ("ij,jk->ik", [(2, 3), (4, 5)], ShapeError, "letter 'j' has sizes 3 and 4"),
    ("ii", [(2, 3)], ShapeError, "letter 'i' has sizes 2 and 3"),
])
def test_einsum_errors(subs, shapes, exc, needle):
    with pytest.raises(exc) as e:
        eins.make_ir(lambda *xs: eins.einsum(subs, *xs))(*[S(s) for s in shapes])
    msg = str(e.value)
    assert needle in msg
    assert repr(subs) in msg and str([tuple(s) for s in shapes]) in msg
    assert "test_ops_linalg.py:" in msg


def test_einsum_size_mismatch_is_both_einsum_and_shape_error():
    with pytest.raises(EinsumError):
        eins.einsum("i,i", np.ones(2), np.ones(3))
    with pytest.raises(ShapeError):
        eins.einsum("i,i", np.ones(2), np.ones(3))


def test_einsum_subscripts_must_be_a_string():
    with pytest.raises(EinsumError, match="subscripts must be a string, got 3"):
        eins.einsum(3, np.ones(2))


@pytest.mark.parametrize("subs,shapes,min_m", [
    ("ij,jk->ik", [(4, 6), (6, 5)], 3),
    ("bij,bjk->bik", [(3, 4, 2), (3, 2, 4)], 2),
    ("ij,jk,kl->il", [(2, 4), (4, 3), (3, 2)], 9),
    ("ij->", [(4, 3)], 9),
    ("ii->i", [(4, 4)], 1),
    ("ij,ij->ij", [(1, 3), (4, 3)], 1),
    (",ij->ij", [(), (4, 3)], 1),
])
def test_einsum_specs(subs, shapes, min_m):
    arrays = [rand(s, seed=i) for i, s in enumerate(shapes)]
    ins, out, _ = eins.ops.linalg.parse_einsum(subs, shapes)
    norm = ",".join(ins) + "->" + out
    assert check_specs("einsum", arrays, {"subscripts": norm}, **spec_check(arrays)).copies >= min_m


def test_einsum_indexing_names_and_broadcast():
    idx = get_primitive("einsum").indexing(
        [TensorType((1, 3), np.dtype(np.float32)), TensorType((4, 3), np.dtype(np.float32))],
        [TensorType((4, 3), np.dtype(np.float32))], subscripts="ij,ij->ij")
    assert idx.extents == {"i": 4, "j": 3}
    spec = idx.spec({"i": ((0, 2), (2, 4))})
    assert spec.fspecs[1].inputs == (Box((0, 0), (1, 3)), Box((2, 0), (4, 3)))  # '_' stays whole


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_einsum_property(data):
    """Random two-operand einsums: equal to numpy, and every 2-way spec recomposes."""
    letters = "abcd"
    ext = {c: data.draw(st.integers(1, 3)) for c in letters}
    t1 = "".join(data.draw(st.permutations(letters))[:data.draw(st.integers(0, 3))])
    t2 = "".join(data.draw(st.permutations(letters))[:data.draw(st.integers(0, 3))])
    pool = sorted(set(t1 + t2))
    out = "".join(c for c in pool if data.draw(st.booleans()))
    subs = f"{t1},{t2}->{out}"
    a = rand(tuple(ext[c] for c in t1), seed=1)
    b = rand(tuple(ext[c] for c in t2), seed=2)
    # the terms' magnitudes bound the rounding of a sum that cancels (a result near 0 of
    # terms near 1 is exact only to eps of the terms, not of itself)
    scale = magnitude(np.einsum(subs, np.abs(a), np.abs(b)))
    assert_close(eins.jit(lambda x, y: eins.einsum(subs, x, y))(a, b), np.einsum(subs, a, b),
                 n=a.size * b.size, scale=scale)
    check_specs("einsum", [a, b], {"subscripts": subs}, ps=(2,), scale=scale,
                **spec_check([a, b]))


# ----------------------------------------------------------------------------- matmul
@pytest.mark.parametrize("sa,sb", [((2, 3), (3, 4)), ((3,), (3, 4)), ((2, 3), (3,)),
                                   ((3,), (3,)), ((5, 2, 3), (3, 4)), ((1, 2, 3), (4, 3, 2))])
def test_matmul(sa, sb):
    a, b = rand(sa, seed=1), rand(sb, seed=2)
    got = both(eins.matmul, a, b)
    assert_close(got, np.matmul(a, b), n=sa[-1])


@pytest.mark.parametrize("bad,tname", [([[1.0, 2.0]], "list"), (None, "NoneType"),
                                       (2.0, "float"), ("ab", "str")])
def test_matmul_non_array_operand_is_a_trace_error_naming_its_type(bad, tname):
    m = rand((2, 2))
    for call, which in ((lambda: eins.matmul(bad, m), "a"), (lambda: eins.matmul(m, bad), "b")):
        with pytest.raises(TraceError, match=rf"matmul: operand {which} of type {tname} is not "
                                             rf"an array or ShapeDtype: {re.escape(repr(bad))}"
                                             rf" \(at .*test_ops_linalg.py:\d+\)"):
            call()
    # under a trace too, through the @ operator of a traced value
    with pytest.raises(TraceError, match=f"matmul: operand b of type {tname} "):
        eins.jit(lambda x: x @ bad)(m)


def test_matmul_shape_rule_errors():
    with pytest.raises(ShapeError, match=r"matmul: batch dimensions of \(2, 3, 4\) and "
                                         r"\(3, 4, 5\) do not broadcast \(at "
                                         r"test_ops_linalg.py:\d+\)"):
        eins.jit(lambda a: a @ np.ones((3, 4, 5), np.float32))(rand((2, 3, 4)))
    # eins.matmul promotes vectors; the primitive itself takes matrices only
    from eins.tracing import bind
    with pytest.raises(ShapeError, match=r"matmul: operands must be at least 2-D, got shapes "
                                         r"\(3,\) and \(3, 2\) \(at test_ops_linalg.py:\d+\)"):
        bind("matmul", rand((3,)), rand((3, 2)))


@pytest.mark.parametrize("sa,sb", [((4, 6), (6, 5)), ((3, 4, 2), (1, 2, 3))])
def test_matmul_specs(sa, sb):
    arrays = [rand(sa, seed=1), rand(sb, seed=2)]
    assert check_specs("matmul", arrays, **spec_check(arrays)).copies >= 2


# the old split sums met inf - inf, which numpy warns of
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_an_einsum_letter_of_one_operand_is_summed_first_on_every_plan(backend):
    """numpy's and torch's einsum sum a contracted letter only one operand carries within
    that operand first ('ab,a->a' is x.sum(1) * y). Split by such a letter, the blocks'
    partial sums met the other operand's inf separately: (1 - 2 + 4) * inf is inf, but
    split 3 ways inf - inf + inf is nan. numpy itself did so only for some shapes: the
    whole 'abc,axcb->' of (1,3,1) and (1,2,1,3) summed the x products as they came (nan),
    a block of it x first (-inf), so eins.jit and split plans disagreed. The kernel now
    always sums such a letter first and the planner does not split it."""
    if backend == "interpret":
        pytest.importorskip("torch")
    x, y = np.array([[1.0, -2.0, 4.0]]), np.array([np.inf])
    f = lambda x, y: np.einsum("ab,a->a", x, y)  # noqa: E731
    np.testing.assert_array_equal(eins.jit(f)(x, y), [np.inf])
    a = np.array([1.0, 2.0, -np.inf]).reshape(1, 3, 1)
    b = np.array([[1.0, 1.0, -0.5], [1.0, 1.0, 1.0]]).reshape(1, 2, 1, 3)
    g = lambda a, b: np.einsum("abc,axcb->", a, b)  # noqa: E731
    assert eins.jit(g)(a, b) == -np.inf        # (1 * 2 + ... + -inf * 0.5) summed over x first
    for sel in ("dp", "greedy", "random"):
        for p in (2, 3):
            kw = dict(devices=p, selector=sel, seed=p, backend=backend)
            np.testing.assert_array_equal(eins.distribute(f, **kw)(x, y), [np.inf])
            assert eins.distribute(g, **kw)(a, b) == -np.inf
    with pytest.raises(eins.PlanError, match=r"index 'r0' is not shardable"):
        eins.distribute(f, devices=3, plan={0: {"r0": 3}})(x, y)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_an_einsum_of_three_operands_with_inf_is_the_same_on_every_plan():
    """numpy contracts three operands pairwise along a path it picks by shape, which
    reassociates a product over a sum: a @ (b @ c) is inf * (2 - 1) = inf where the einsum's
    terms are inf * 2 and inf * -1 (nan), and a block's path could differ from the whole's.
    With a non-finite operand the kernel sums every term's product (the einsum's
    definition), so eins.jit, every plan and the generated numpy program give nan there.
    Random 3- and 4-operand einsums with one inf, -inf, nan or 0 injected: 43 of 750 split
    plans differed from jit before; none after."""
    f = lambda a, b, c: np.einsum("ab,bc,cd->ad", a, b, c)  # noqa: E731
    a, b, c = np.array([[np.inf], [1.0]]), np.array([[2.0, -1.0]]), np.ones((2, 2))
    want = [[np.nan, np.nan], [1.0, 1.0]]
    np.testing.assert_array_equal(eins.jit(f)(a, b, c), want)
    cases = [(a, b, c, want),
             (np.ones((2, 1)), b, np.array([[np.inf, 1.0], [np.inf, 1.0]]),
              [[np.nan, 1.0], [np.nan, 1.0]])]          # (a @ b) @ c would be inf * 1
    for x, y, z, w in cases:
        np.testing.assert_array_equal(eins.jit(f)(x, y, z), w)
        for sel in ("dp", "greedy", "random"):
            for p in (2, 3, 4):
                d = eins.distribute(f, devices=p, selector=sel, seed=p)
                np.testing.assert_array_equal(d(x, y, z), w)
        gen = eins.distribute(f, devices=2, selector="random", seed=1).lower(x, y, z)
        np.testing.assert_array_equal(gen.generate("numpy").run([x, y, z])[0], w)
    # finite operands keep numpy's fast path: equal up to rounding
    r = np.random.default_rng(0)
    x, y, z = r.standard_normal((3, 4)), r.standard_normal((4, 5)), r.standard_normal((5, 2))
    assert_close(eins.jit(f)(x, y, z), x @ y @ z, n=20)
