"""JAX habits that just work (issue 37): Python scalars traced as weakly typed runtime
values, static_argnums / static_argnames, decorators with and without arguments and on
methods, stage objects, and clear errors for the misuses JAX users bring."""
from __future__ import annotations

import inspect
import pickle
import warnings

import numpy as np
import pytest

import eins
from eins.errors import DTypeError, EinsError, GpuError, PlanError, PromotionWarning, TraceError
from eins.ir.types import TensorType
from eins.runtime.gpu import gpu_count
from helpers import assert_close

S = eins.ShapeDtype


def _line(marker: str) -> str:
    """``test_jax_habits.py:N`` of the line carrying ``marker`` in this file."""
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()
    n = next(i for i, ln in enumerate(lines, 1) if marker in ln and "_line(" not in ln)
    return f"test_jax_habits.py:{n}"


# ----------------------------------------------------------------------------- scalars
def test_a_new_scalar_value_is_a_cached_call(monkeypatch):
    """The measured case: a new value of a Python scalar argument re-traced and re-planned.
    Now it is a runtime input: one trace, one plan, every value computed right."""
    plans = []
    monkeypatch.setattr(eins.api, "PLANNING", tuple(
        (lambda st, real=p: plans.append(1) or real(st)) if p.__name__ == "choose_specs"
        else p for p in eins.passes.PLANNING))
    traces = []

    def block(x, w, scale, eps):
        traces.append(1)
        h = x @ w * scale
        return h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + eps)

    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    d = eins.distribute(block, devices=4)
    for scale, eps in [(0.5, 1e-5), (0.25, 1e-6), (2.0, 1e-3), (-1.0, 0.5)]:
        want = x @ w * np.float32(scale)
        want = want / np.sqrt((want * want).mean(axis=-1, keepdims=True) + np.float32(eps))
        assert_close(d(x, w, scale, eps), want, n=8)
    assert len(traces) == 1 and len(plans) == 1 and d.trace_count == 1
    j = eins.jit(block)
    for scale in (0.5, 3.0, 7.0):
        j(x, w, scale, 1e-5)
    assert j.trace_count == 1 and len(traces) == 2
    # the program is float32 throughout: the scalars are float32 inputs (NEP 50)
    prog = d.lower(x, w, 0.5, 1e-5).program
    assert [v.type for v in prog.inputs][2:] == [TensorType((), np.float32)] * 2
    assert all(v.dtype == np.float32 for e in prog.eqns for v in e.outputs)


def test_traced_scalars_are_weakly_typed_as_their_literals_were():
    """NEP 50, as a literal: a float takes a float array's dtype, an int an int array's or
    a float array's; alone they are float64 / int64 / bool; what only scalars compute stays
    weak (``x * (s * 2.0)`` is float16)."""
    mk = eins.make_ir
    x16, i32 = S((2, 3), "float16"), S((2, 3), "int32")
    assert mk(lambda x, s: x * s)(x16, 0.1).outputs[0].dtype == np.float16
    assert mk(lambda x, s: x * (s * 2.0 + 1.0))(x16, 0.1).outputs[0].dtype == np.float16
    assert mk(lambda x, n: x + n)(i32, 3).outputs[0].dtype == np.int32
    assert mk(lambda x, n: x * n)(x16, 3).outputs[0].dtype == np.float16
    assert mk(lambda x, s: x * s)(i32, 0.5).outputs[0].dtype == np.float64   # numpy's rule
    both = mk(lambda x, s: (x * s, s + 1.0))(x16, 0.5)
    assert [v.dtype for v in both.outputs] == [np.float16, np.float64]
    assert mk(lambda x, b: eins.where(b, x, 0.0))(x16, True).inputs[1].dtype == np.bool_
    # the values: rounded to the array's dtype exactly as the literal was
    f = eins.jit(lambda x, s: x * s)
    x = np.ones(3, np.float16)
    assert f(x, 0.1).dtype == np.float16 and f(x, 0.1)[0] == np.float16(0.1)
    assert f(x, 70000.0)[0] == np.inf                 # float16 overflows as its literal did
    g = eins.jit(lambda x, n: x + n)
    a = np.arange(3, dtype=np.int32)
    assert list(g(a, 5)) == [5, 6, 7] and g(a, 5).dtype == np.int32
    with pytest.raises(DTypeError, match=r"^argument 1: the Python int 3000000000 is out of "
                                         r"bounds for int32, the dtype it was traced in"):
        g(a, 3_000_000_000)
    with pytest.raises(TraceError, match=r"argument 1: the Python int 100000000000000000000 "
                                         r"does not fit int64"):
        g(a, 10 ** 20)


def test_a_traced_scalar_where_a_static_value_is_needed_says_to_mark_it_static():
    x = S((4, 6), "float32")
    cases = [
        (lambda x, n: x.reshape(n, -1), (x, 2), "argument 1", "static_argnums=(1,)"),
        (lambda x, axis: eins.softmax(x, axis=axis), (x, 1), "argument 1",
         "static_argnums=(1,)"),
        (lambda x, flag=False: x * 2 if flag else x, (x,), "keyword argument 'flag'",
         "static_argnames=('flag',)"),
        (lambda x, n: [x[i] for i in range(n)][0], (x, 2), "argument 1",
         "static_argnums=(1,)"),
    ]
    for k, (fn, args, name, how) in enumerate(cases):
        kwargs = {"flag": True} if k == 2 else {}
        with pytest.raises(EinsError) as e:
            eins.make_ir(fn)(*args, **kwargs)
        msg = str(e.value)
        assert f"{name} is a Python scalar traced as a runtime value" in msg, msg
        assert f"mark it static: {how} on eins.jit / eins.distribute" in msg, msg
    # marked static, each works (and a new static value is a new trace)
    r = eins.jit(lambda x, n: x.reshape(n, -1), static_argnums=1)
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert r(a, 2).shape == (2, 12) and r(a, 3).shape == (3, 8) and r.trace_count == 2
    sm = eins.jit(lambda x, axis: eins.softmax(x, axis=axis), static_argnames="axis")
    assert_close(sm(a, axis=0).sum(axis=0), np.ones(6, np.float32), n=4)
    # a static name that is a positional parameter marks its position too, as in JAX
    assert_close(sm(a, 1).sum(axis=1), np.ones(4, np.float32), n=6)
    assert sm.trace_count == 2


def test_static_arguments_take_any_hashable_value_and_refuse_what_is_not():
    def attend(q, segments, causal):
        return eins.attention(q, q, q, causal=causal, segments=segments)
    q = np.random.default_rng(2).standard_normal((2, 8, 4)).astype(np.float32)
    f = eins.jit(attend, static_argnums=(1, 2))
    a = f(q, (4, 8), True)
    b = eins.jit(lambda q: eins.attention(q, q, q, causal=True, segments=(4, 8)))(q)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(TraceError, match=r"argument 1 is static \(static_argnums / "
                                         r"static_argnames\) and must be hashable, as in JAX: "
                                         r"got a list \[4, 8\]; pass a tuple"):
        f(q, [4, 8], True)
    with pytest.raises(TraceError, match=r"static_argnums=3 names no positional parameter of "
                                         r"attend, which has 3: \['q', 'segments', 'causal'\]"):
        eins.jit(attend, static_argnums=3)
    with pytest.raises(TraceError, match=r"static_argnames='window' names no parameter of "
                                         r"attend"):
        eins.distribute(attend, devices=2, static_argnames="window")
    with pytest.raises(TraceError, match=r"static_argnums must be ints \(argument positions\), "
                                         r"got 'segments'"):
        eins.jit(attend, static_argnums="segments")
    # a string argument, refused as an array, is fine as a static one
    act = eins.jit(lambda x, kind: getattr(eins, kind)(x), static_argnums=1)
    assert_close(act(q, "relu"), np.maximum(q, 0), n=1)


def test_compiled_programs_take_new_scalar_values_and_refuse_new_static_ones():
    f = eins.distribute(lambda x, s, n: x.reshape(n, -1) * s, devices=2, static_argnames="n")
    x = np.ones((4, 4), np.float32)
    c = f.lower(x, 2.0, n=2).compile()
    assert c(x, 5.0, n=2)[0, 0] == 5.0 and c(x, -1.5, n=2)[0, 0] == -1.5
    with pytest.raises(TraceError, match=r"keyword argument 'n': compiled with the static value "
                                         r"2, called with 8"):
        c(x, 5.0, n=8)
    with pytest.raises(TraceError, match=r"keyword argument 'n' is static and was 2 when "
                                         r"traced; pass it again"):
        c(x, 5.0)


# ----------------------------------------------------------------------------- decorators
def test_jit_and_distribute_are_decorators_with_and_without_arguments():
    x = np.arange(8, dtype=np.float32).reshape(2, 4)

    @eins.jit
    def a(x):
        return x * 2

    @eins.jit(static_argnums=1)
    def b(x, n):
        return x.reshape(n, -1)

    @eins.distribute
    def c(x):
        return x + 1

    @eins.distribute(devices=4, schedule="optimized")
    def d(x, s):
        return x * s

    np.testing.assert_array_equal(a(x), x * 2)
    assert b(x, 4).shape == (4, 2)
    np.testing.assert_array_equal(c(x), x + 1)
    np.testing.assert_array_equal(d(x, 3.0), x * 3)
    assert d.devices == (0, 1, 2, 3) and d.options.schedule == "optimized"
    assert d.__name__ == "d" and isinstance(d, eins.api.Distributed)
    with pytest.raises(PlanError, match="unknown schedule 'fast'"):
        eins.distribute(devices=2, schedule="fast")


def test_jit_and_distribute_work_on_methods():
    """``self`` is a static argument by identity: each instance traces its own program (its
    attributes are constants of it), and calls of one instance reuse it."""
    class Layer:
        def __init__(self, w):
            self.w = w

        @eins.jit
        def __call__(self, x):
            return x @ self.w

        @eins.distribute(devices=2)
        def scaled(self, x, s):
            return x @ self.w * s

    rng = np.random.default_rng(3)
    w1, w2 = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal((8, 4)).astype(np.float32)
    l1, l2 = Layer(w1), Layer(w2)
    assert_close(l1(x), x @ w1, n=4)
    assert_close(l2(x), x @ w2, n=4)
    assert_close(l1(x + 1), (x + 1) @ w1, n=4)
    assert Layer.__call__.trace_count == 2
    assert_close(l1.scaled(x, 2.0), x @ w1 * 2, n=4)
    assert_close(l2.scaled(x, 0.5), x @ w2 * 0.5, n=4)
    assert_close(l1.scaled(x, 3.0), x @ w1 * 3, n=4)
    assert Layer.scaled.trace_count == 2 and l1.scaled.trace_count == 2
    assert "peak_bytes" in l1.scaled.stats() and l1.scaled.devices == (0, 1)
    low = l1.scaled.lower(x, 1.0)
    assert low.devices == (0, 1)
    assert_close(low.compile()(x, 4.0), x @ w1 * 4, n=4)
    assert "matmul" in l2.__call__.lower(x).as_text()


def test_stage_objects_print_and_compile_as_in_jax():
    f = eins.jit(lambda x: x * 2)
    x = np.ones((2, 2), np.float32)
    low = f.lower(x)
    assert isinstance(low, eins.stages.Traced) and "mul a 2" in low.as_text()
    np.testing.assert_array_equal(low.compile()(x), x * 2)
    c = eins.distribute(lambda x: x * 2, devices=2).lower(x).compile()
    assert c.as_text().startswith("# per device") and "device 1:" in c.as_text()
    assert c.as_text("traced") == low.as_text()


# ----------------------------------------------------------------------------- errors
def test_nested_lists_passed_as_arrays_get_what_to_do():
    f = eins.jit(lambda x, w: x @ w)
    with pytest.raises(TraceError, match=r"matmul: operand b of type list is not an array or "
                                         r"ShapeDtype: .*\(at .*\); a list or tuple is a "
                                         r"pytree, its numbers traced scalars, not an array: "
                                         r"pass np.asarray\(...\)"):
        f(np.ones((2, 2), np.float32), [[1.0, 2.0], [3.0, 4.0]])
    g = eins.jit(lambda x, b: x + b)  # MARK-list-add
    with pytest.raises(TraceError) as e:
        g(np.ones((2, 2), np.float32), ([1.0, 2.0], [3.0, 4.0]))
    assert f"add: operand of type tuple is not an array (at {_line('MARK-list-add')}); a " \
           f"list or tuple is a pytree" in str(e.value)


def test_torch_functions_on_traced_arrays_are_named():
    torch = pytest.importorskip("torch")  # optional: the test extra installs it
    f = eins.jit(lambda x: torch.relu(x))  # MARK-torch
    with pytest.raises(TraceError) as e:
        f(np.ones(3, np.float32))
    assert "torch.relu cannot run on a traced array; use eins.relu inside the traced " \
           "function" in str(e.value)
    assert _line("MARK-torch") in str(e.value)
    with pytest.raises(TraceError, match=r"torch.cumsum cannot run on a traced array; use the "
                                         r"eins or numpy operator"):
        eins.jit(lambda x: torch.cumsum(x, 0))(np.ones(3, np.float32))


def test_pickling_jitted_distributed_or_traced_objects_is_a_clear_error():
    def double(x):
        return x * 2
    for obj, api in [(eins.jit(double), "eins.jit"),
                     (eins.distribute(double, devices=2), "eins.distribute")]:
        with pytest.raises(TraceError, match=rf"{api}\(double\) cannot be pickled: it holds "
                                             rf"traced programs"):
            pickle.dumps(obj)
    kept = []
    eins.make_ir(lambda x: kept.append(x) or x)(S((2,)))
    with pytest.raises(TraceError, match=r"a traced array \(float32\[2\]\) cannot be pickled"):
        pickle.dumps(kept[0])


# ----------------------------------------------------------------------------- float64 warning
def test_a_numpy_float64_scalar_in_a_float32_block_warns_once_with_the_fix():
    hd = 64

    def block(q, k):
        return (q @ k.T) * (1.0 / np.sqrt(hd))  # MARK-f64

    q = S((8, 64), "float32")
    with pytest.warns(PromotionWarning) as rec:
        prog = eins.make_ir(block)(q, q)
    assert prog.outputs[0].dtype == np.float64    # numpy 2's rule, kept: a warning only
    msgs = [str(r.message) for r in rec if r.category is PromotionWarning]
    assert len(msgs) == 1 and _line("MARK-f64") in msgs[0]
    assert "mul makes float64 from float32 arrays because of a float64 scalar" in msgs[0]
    assert "write it as np.float32(...) or a Python float" in msgs[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromotionWarning)
        eins.make_ir(block)(q, q)    # once per line: the second trace is silent
        for fix in (lambda q, k: (q @ k.T) * (1.0 / float(np.sqrt(hd))),
                    lambda q, k: (q @ k.T) * np.float32(1.0 / np.sqrt(hd)),
                    lambda q, k: (q @ k.T) * (1.0 / np.sqrt(np.float32(hd)))):
            assert eins.make_ir(fix)(q, q).outputs[0].dtype == np.float32
        # float64 on purpose (a float64 array) is not a promotion
        eins.make_ir(lambda a: a * np.float64(2.0))(S((4,), "float64"))


# ----------------------------------------------------------------------------- readable
def test_plan_text_wraps_and_repr_says_what_was_minimized():
    def mlp(x, w1, w2):
        return eins.gelu(x @ w1) @ w2
    args = (S((512, 1024)), S((1024, 4096)), S((4096, 1024)))
    low = eins.distribute(mlp, devices=8).lower(*args)
    text = low.as_text("planned")
    # past 100 columns only an eqn with its split, whose time and cost wrap below it
    long = [ln for ln in text.splitlines() if len(ln) > 100]
    assert all(" = " in ln and "    # split " in ln and ln.endswith("|") for ln in long), long
    assert "\n        #   (repartition " in text and "\n#   " in text   # wrapped
    eqn_lines = [ln for ln in text.splitlines() if " = " in ln and "# split " in ln]
    assert len(eqn_lines) == len(low.program.eqns)   # each eqn keeps its split on its line
    assert repr(low).startswith("<Lowered mlp on 8 devices, minimized time ")
    assert f"(proxy {eins.ir.text.format_bytes(low.cost_bytes)})>" in repr(low)
    by_bytes = eins.distribute(mlp, devices=8, cost="bytes").lower(*args)
    proxy = eins.distribute(mlp, devices=8, cost="proxy").lower(*args)
    assert by_bytes.plan_table() == proxy.plan_table()
    assert by_bytes.compilation.options.cost == "proxy"
    assert repr(by_bytes) == (f"<Lowered mlp on 8 devices, minimized proxy "
                              f"{eins.ir.text.format_bytes(by_bytes.cost_bytes)}>")
    rnd = eins.distribute(mlp, devices=8, selector="random").lower(*args)
    assert repr(rnd).startswith("<Lowered mlp on 8 devices, random plan, proxy ")


# ----------------------------------------------------------------------------- early checks
def test_backend_cuda_without_a_gpu_fails_at_distribute():
    if gpu_count():   # a GPU machine: the same call is accepted there
        assert eins.distribute(lambda x: x, devices=2, backend="cuda").backend == "cuda"
        return
    with pytest.raises(GpuError, match=r"backend 'cuda': torch sees no GPU"):
        eins.distribute(lambda x: x, devices=2, backend="cuda")


def test_devices_world_without_torchrun_fails_at_distribute(monkeypatch):
    pytest.importorskip("torch")  # optional: the test extra installs it
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(EinsError, match=r"devices='world': no torch.distributed process "
                                        r"group is initialized and the environment lacks "
                                        r"RANK, WORLD_SIZE"):
        eins.distribute(lambda x: x, devices="world")
