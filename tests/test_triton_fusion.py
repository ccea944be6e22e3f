"""Fused elementwise chains: which eqns group (program and device level), and the one
generated Triton kernel per group under the interpreter against eins.jit (numpy reference
kernels). The fused kernel rounds every intermediate to its eqn's dtype, as the unfused
kernels do, so it matches the reference to a unit of the output dtype."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.codegen.kernels import build  # noqa: E402
from eins.codegen.kernels.fusion import fused_source, fusion_groups, launch_fused  # noqa: E402
from eins.errors import EinsError  # noqa: E402
from eins.ir.types import bfloat16  # noqa: E402


def swiglu_residual(x, g, u, w):
    h = eins.silu(g) * u                  # eqn 0 silu, 1 mul
    y = (h + x) * w + 1.5                 # 2 add, 3 mul (w broadcasts), 4 add (scalar)
    cast = "float32" if x.dtype == np.float16 else "float16"
    return y.astype(cast), h              # 5 astype; h escapes as an output


def run_group(prog, group, arrays, env):
    """Run the fused kernel of ``group`` on torch CPU tensors; returns {ref: array}."""
    fk = fused_source(prog, group)
    ins = [torch.from_numpy(np.ascontiguousarray(env[id(v)])) for v in fk.inputs]
    outs = [torch.empty(fk.shape, dtype=build.torch_dtype(v.dtype)) for v in fk.outputs]
    launch_fused(fk, ins, outs, block=64)
    return fk, {id(v): o.numpy() for v, o in zip(fk.outputs, outs)}


def as_np(t, dtype):
    return t.view(torch.int16).numpy().view(bfloat16) if dtype == bfloat16 else t.numpy()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_swiglu_residual_chain_is_one_kernel(dtype):
    rng = np.random.default_rng(0)
    x, g, u = (rng.standard_normal((6, 20)).astype(dtype) for _ in range(3))
    w = rng.standard_normal(20).astype(dtype)
    prog = eins.make_ir(swiglu_residual)(x, g, u, w)
    assert [e.prim for e in prog.eqns] == ["silu", "mul", "add", "mul", "add", "astype"]
    assert fusion_groups(prog) == [[0, 1, 2, 3, 4, 5]]
    env = {id(v): a for v, a in zip(prog.inputs, (x, g, u, w))}
    fk, got = run_group(prog, [0, 1, 2, 3, 4, 5], (x, g, u, w), env)
    # h (eqn 1) is a program output too, so the kernel writes it; the others stay in registers
    assert fk.outputs == (prog.eqns[1].outputs[0], prog.eqns[5].outputs[0])
    assert fk.source.count("tl.store(") == 2 and fk.source.count("tl.load(") == 4
    y_ref, h_ref = eins.jit(swiglu_residual)(x, g, u, w)
    eps = float(np.finfo(dtype).eps)  # a few units: exp's last bit may differ from numpy's
    np.testing.assert_allclose(got[id(prog.outputs[1])], h_ref, rtol=4 * eps, atol=4 * eps)
    np.testing.assert_allclose(got[id(prog.outputs[0])].astype(np.float32),
                               y_ref.astype(np.float32), rtol=8 * eps, atol=8 * eps)
    assert got[id(prog.outputs[0])].dtype == y_ref.dtype


def test_broadcast_column_scalar_tensor_and_compare_where():
    def f(a, col, s):
        z = eins.maximum(a * col, s)              # col [5, 1], s a 0-d tensor
        return eins.where(z > 0.25, z, a - 2).astype("bfloat16")
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    col = rng.standard_normal((5, 1)).astype(np.float32)
    s = np.asarray(-0.5, np.float32)
    prog = eins.make_ir(f)(a, col, s)
    groups = fusion_groups(prog)
    assert groups == [list(range(len(prog.eqns)))]
    env = {id(v): x for v, x in zip(prog.inputs, (a, col, s))}
    fk = fused_source(prog, groups[0])
    ins = [torch.from_numpy(env[id(v)]) for v in fk.inputs]
    out = torch.empty(5, 7, dtype=torch.bfloat16)
    launch_fused(fk, ins, [out])
    ref = np.asarray(eins.jit(f)(a, col, s)).astype(np.float32)
    # one bfloat16 unit: triton 3.9's interpreter truncates float32 -> bfloat16 (the GPU
    # rounds to nearest even, as ml_dtypes does)
    np.testing.assert_allclose(out.float().numpy(), ref, rtol=2 ** -7, atol=0)
    assert fk.source.count("tl.load(") == 3  # a, col, s: each loaded once


def test_gelu_tanh_and_exp_chain_float16():
    def f(x, b):
        return eins.gelu(x + b) * eins.exp(-x)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 33)).astype(np.float16)
    b = rng.standard_normal(33).astype(np.float16)
    prog = eins.make_ir(f)(x, b)
    (grp,) = fusion_groups(prog)
    fk = fused_source(prog, grp)
    out = torch.empty(4, 33, dtype=torch.float16)
    launch_fused(fk, [torch.from_numpy({id(prog.inputs[0]): x, id(prog.inputs[1]): b}[id(v)])
                      for v in fk.inputs], [out])
    ref = eins.jit(f)(x, b)
    np.testing.assert_allclose(out.numpy().astype(np.float32), ref.astype(np.float32),
                               rtol=2e-3, atol=2e-3)  # two fp16 roundings, tanh/exp ulps


def test_groups_stop_at_other_ops_and_other_shapes():
    def f(x, w):
        a = eins.silu(x) * 2.0            # 0, 1: one group
        r = eins.relu(a @ w)              # 2 matmul ends it; 3 relu
        return eins.sum(r, axis=0) + 1.0, r * 3.0   # 4 sum; 5 add on [4]; 6 mul on [8, 4]
    prog = eins.make_ir(f)(np.ones((8, 6), np.float32), np.ones((6, 4), np.float32))
    assert [e.prim for e in prog.eqns] == ["silu", "mul", "matmul", "relu", "sum", "add", "mul"]
    assert fusion_groups(prog) == [[0, 1]]
    # 5 and 6 are consecutive but of different shapes: separate singletons
    assert fusion_groups(prog, min_size=1) == [[0, 1], [3], [5], [6]]


def test_device_level_groups_cross_frees_and_write_escaping_buffers():
    from eins.ir.device import BufInfo, Free, Kernel, Send, Store
    from eins.ir.types import Box

    def f(g, u):
        return eins.silu(g) * u
    g = np.ones((4, 8), np.float16)
    prog = eins.make_ir(f)(g, u := np.ones((4, 8), np.float16))
    box = Box((0, 0), (4, 8))
    bufs = {n: BufInfo("v", box, np.dtype(np.float16)) for n in ("g", "u", "s", "o")}
    instrs = [Kernel(("s",), ("g",), 0, None), Free("g"), Kernel(("o",), ("s", "u"), 1, None),
              Send("s", 1, 0), Free("s"), Store("o", 0, box)]
    assert fusion_groups(prog, instrs, bufs) == [[0, 2]]
    fk = fused_source(prog, [0, 2], instrs, bufs)
    assert fk.inputs == ("g", "u") and fk.outputs == ("s", "o")  # s is sent: written too
    gt = torch.randn(4, 8).half()
    ut = torch.randn(4, 8).half()
    s, o = torch.empty(4, 8).half(), torch.empty(4, 8).half()
    launch_fused(fk, [gt, ut], [s, o])
    ref_s = eins.jit(eins.silu)(gt.numpy())
    np.testing.assert_array_equal(s.numpy(), ref_s)
    np.testing.assert_array_equal(o.numpy(), eins.jit(f)(gt.numpy(), ut.numpy()))
    with pytest.raises(EinsError, match="buffer table"):
        fusion_groups(prog, instrs)


def test_bad_groups_and_launches_are_refused():
    prog = eins.make_ir(lambda x, w: eins.silu(x @ w))(np.ones((2, 2), np.float32),
                                                          np.ones((2, 2), np.float32))
    with pytest.raises(EinsError, match="non-elementwise"):
        fused_source(prog, [0, 1])
    fk = fused_source(prog, [1])
    with pytest.raises(EinsError, match="takes 1 inputs"):
        launch_fused(fk, [], [torch.empty(2, 2)])


def test_groups_of_a_distributed_device_program_equal_their_members_run_one_by_one():
    """A SwiGLU FFN with a residual on 2 devices: each device's chain of elementwise kernels
    is one group; its fused kernel, fed random blocks, writes exactly what the members'
    reference kernels compute one after another."""
    from eins.ir.device import Kernel
    from eins.ops import get_primitive

    def ffn(x, w1, w3, w2):
        h = eins.silu(x @ w1) * (x @ w3)
        return x + (h @ w2) * 0.5
    rng = np.random.default_rng(3)
    shapes = [(8, 16), (16, 24), (16, 24), (24, 16)]
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    dp = eins.distribute(ffn, devices=2).lower(*args).physical.device
    prog = dp.program
    # in program order silu and mul are not adjacent (the second matmul is between them)
    assert [e.prim for e in prog.eqns][:4] == ["matmul", "silu", "matmul", "mul"]
    assert fusion_groups(prog) == [[5, 6]]
    assert fusion_groups(prog, reorder=True) == [[1, 3], [5, 6]]
    found = 0
    for d in dp.devices:
        code, bufs = dp.code[d], dp.bufs[d]
        assert all(prog.eqns[code[j].eqn].prim != "silu"
                   for g in fusion_groups(prog, code, bufs) for j in g)
        for group in fusion_groups(prog, code, bufs, reorder=True):
            found += 1
            fk = fused_source(dp.program, group, code, bufs)
            env = {n: rng.standard_normal(bufs[n].box.shape).astype(np.float32)
                   for n in fk.inputs}
            outs = [torch.empty(fk.shape) for _ in fk.outputs]
            launch_fused(fk, [torch.from_numpy(env[n]) for n in fk.inputs], outs)
            for j in group:       # the members one by one, on numpy
                k = code[j]
                assert isinstance(k, Kernel)
                vals = [env[a] if isinstance(a, str) else np.asarray(a[1], a[2]) for a in k.ins]
                env[k.outs[0]] = get_primitive(dp.program.eqns[k.eqn].prim).impl(
                    *vals, **dp.program.eqns[k.eqn].params)[0]
            for n, o in zip(fk.outputs, outs):
                np.testing.assert_allclose(o.numpy(), env[n], rtol=4e-7, atol=4e-7)
            assert fk.launch_at == group[-1]
            # nothing between the members reads a value the group makes
            made = {code[j].outs[0] for j in group}
            between = [code[j] for j in range(group[0], group[-1]) if j not in group]
            assert not any(made & set(getattr(i, "ins", ())) for i in between)
    assert found >= 2  # silu*mul on each device at least


def test_reorder_never_jumps_an_item_that_reads_the_group():
    def f(x, w):
        a = eins.silu(x)            # 0
        m = a @ w                   # 1 reads a: a must exist before it
        return a * 2.0, m           # 2
    prog = eins.make_ir(f)(np.ones((4, 4), np.float32), np.ones((4, 4), np.float32))
    assert fusion_groups(prog, reorder=True) == []

    def g(x, y, w):
        a = eins.silu(x)            # 0
        m = y @ w                   # 1 independent: jumped
        return (a * 2.0) + m        # 2, 3 read a group value
    prog = eins.make_ir(g)(*(np.ones((4, 4), np.float32),) * 3)
    assert fusion_groups(prog, reorder=True) == [[0, 2, 3]]
    assert fusion_groups(prog) == [[2, 3]]
