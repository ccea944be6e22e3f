"""Common-subexpression and dead-code elimination on the traced IR (eins/ir/simplify.py):
what the user wrote twice is planned and run once, what nothing reads is dropped, and
nothing that differs is merged."""
import os

import numpy as np
import pytest

import eins
from eins.ir.primitive import get_primitive
from eins.ir.program import Eqn, Literal, Var
from eins.ir.types import TensorType
from eins.ir.simplify import eliminate_common

rng = np.random.default_rng(0)
X = rng.standard_normal((16, 8)).astype(np.float32)
W = rng.standard_normal((8, 8)).astype(np.float32)


def centered_twice(x, w):
    mu = x.mean(axis=-1, keepdims=True)
    a = (x - mu) @ w
    b = (x - mu) @ w          # the same expression again
    return a + b


def prims(prog):
    return [e.prim for e in prog.eqns]


def test_a_repeated_expression_is_one_eqn():
    prog = eins.make_ir(centered_twice)(X, W)
    assert prims(prog) == ["mean", "sub", "matmul", "add"]
    add = prog.eqns[-1]
    assert add.inputs[0] is add.inputs[1] is prog.eqns[2].outputs[0]
    text = str(prog)
    assert text.count("= sub ") == 1 and text.count("= matmul ") == 1


def test_results_unchanged_single_and_distributed():
    want = centered_twice(X, W)
    np.testing.assert_allclose(eins.jit(centered_twice)(X, W), want, rtol=1e-5, atol=1e-5)
    f4 = eins.distribute(centered_twice, devices=4, backend="numpy")
    np.testing.assert_allclose(f4(X, W), want, rtol=1e-5, atol=1e-5)
    assert len(f4.lower(X, W).plan_table()) == 4   # planned once


def test_unused_eqn_disappears():
    def f(x, w):
        unused = x @ w                # noqa: F841 (left in on purpose)
        kept = x * 2.0
        return kept
    prog = eins.make_ir(f)(X, W)
    assert prims(prog) == ["mul"]


def test_a_merge_leaves_no_dead_eqn():
    def f(x):
        a = np.exp(x)
        b = np.exp(x)
        return a * b
    prog = eins.make_ir(f)(X)
    assert prims(prog) == ["exp", "mul"]
    np.testing.assert_allclose(eins.jit(f)(X), np.exp(X) ** 2, rtol=1e-5)


def test_different_literals_and_params_are_not_merged():
    def f(x):
        return (x * 2.0, x * 3.0, x * 0.0, x * -0.0, x.sum(axis=0), x.sum(axis=1),
                x.sum(axis=0, keepdims=True))
    prog = eins.make_ir(f)(X)
    assert prims(prog) == ["mul"] * 4 + ["sum"] * 3
    outs = eins.jit(f)(X)
    # x * -0.0 has the opposite sign of x * 0.0 everywhere: kept apart, each as numpy has it
    np.testing.assert_array_equal(np.signbit(outs[2]), np.signbit(X * np.float32(0.0)))
    np.testing.assert_array_equal(np.signbit(outs[3]), np.signbit(X * np.float32(-0.0)))
    assert (np.signbit(outs[2]) != np.signbit(outs[3])).all()


def test_different_inputs_are_not_merged_and_equal_outputs_are_shared():
    def f(x, y):
        return x + y, y + x, x + y
    y = X + 1
    prog = eins.make_ir(f)(X, y)
    assert prims(prog) == ["add", "add"]              # x + y twice is one; y + x its own
    assert prog.outputs[0] is prog.outputs[2]
    a, b, c = eins.jit(f)(X, y)
    np.testing.assert_array_equal(a, c)


def test_the_merge_is_visible_in_the_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("EINS_DUMP_DIR", str(tmp_path))
    eins.distribute(centered_twice, devices=2, backend="numpy").lower(X, W)
    traced = [f for f in os.listdir(tmp_path) if f.endswith("-traced.txt")]
    assert len(traced) == 1
    text = (tmp_path / traced[0]).read_text()
    assert text.count("= matmul ") == 1 and text.count("= sub ") == 1


@pytest.mark.parametrize("v1, v2, merged", [(1.0, 1.0, True), (0.0, -0.0, False),
                                           (float("nan"), float("nan"), True),
                                           (1, True, False), (2, 2.0, False)])
def test_literal_keys_are_exact(v1, v2, merged):
    """Literals compare by type and bits: 1 and True, 2 and 2.0 are different literals."""
    x = Var(TensorType((2,), np.dtype("float32")))
    mul = get_primitive("mul")
    eqns = [Eqn(mul, (x, Literal(v, np.dtype("float32"))),
                (Var(TensorType((2,), np.dtype("float32"))),)) for v in (v1, v2)]
    kept, outs = eliminate_common(eqns, (eqns[0].outputs[0], eqns[1].outputs[0]))
    assert len(kept) == (1 if merged else 2)
    assert (outs[0] is outs[1]) == merged


def test_uncomparable_params_are_not_merged():
    x = Var(TensorType((2,), np.dtype("float32")))
    neg = get_primitive("neg")
    eqns = [Eqn(neg, (x,), (Var(x.type),), {"table": np.arange(3)}) for _ in range(2)]
    kept, _ = eliminate_common(eqns, tuple(e.outputs[0] for e in eqns))
    assert len(kept) == 2
