"""Residual adds fused into their matmul (``GpuWalk._fuse_residuals`` of
eins/codegen/generate.py): ``c + a @ b`` becomes one cuBLAS addmm/baddbmm launch
(``matmul(..., add=c)``, eins/codegen/kernels/matmul.py) where the matmul's block is the
final value, read by that add alone, and ``c`` has the block's shape and dtype. The generated
programs run under the interpret backend (torch CPU: addmm is the same call) and equal
eins.jit."""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.codegen.kernels.matmul import matmul  # noqa: E402
from eins.errors import DTypeError, GpuError, ShapeError  # noqa: E402
from helpers import torch_eps  # noqa: E402
from test_triton_fusion import _close, _llama, assert_plan_keeps_until_launch  # noqa: E402

FUSED = re.compile(r"# eqn (\d+) fused in: a @ b \+ c")


def _rand(shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sa,sb", [((9, 13), (13, 7)),              # addmm
                                   ((2, 9, 13), (13, 7)),           # rows of every batch
                                   ((2, 9, 13), (2, 13, 7)),        # baddbmm
                                   ((9, 13), (3, 13, 7))])          # broadcast: matmul, add
def test_matmul_with_add_is_the_product_plus_the_residual(impl, dtype, sa, sb):
    a, b = _rand(sa, dtype, 0), _rand(sb, dtype, 1)
    shape = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (sa[-2], sb[-1])
    c = _rand(shape, dtype, 2)
    out = torch.empty(shape, dtype=dtype)
    assert matmul(a, b, out, impl=impl, add=c) is out
    want = (a.double() @ b.double() + c.double()).numpy()
    k = sa[-1]
    # at most two roundings to the dtype (product, sum) plus float32 accumulation
    tol = (2 * torch_eps(dtype) + 2 * k * torch_eps(torch.float32)) * float(np.abs(want).max())
    np.testing.assert_allclose(out.double().numpy(), want, rtol=0, atol=tol)


def test_matmul_add_is_one_addmm_or_baddbmm_call(monkeypatch):
    calls = []
    for name in ("addmm", "baddbmm", "matmul"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _f=real, _n=name, **k: (calls.append(_n),
                                                                             _f(*a, **k))[1])
    f16 = torch.float16
    for sa, sb, want in [((4, 5), (5, 3), ["addmm"]), ((2, 4, 5), (5, 3), ["addmm"]),
                         ((2, 4, 5), (2, 5, 3), ["baddbmm"]), ((4, 5), (2, 5, 3), ["matmul"])]:
        calls.clear()
        a, b = _rand(sa, f16, 0), _rand(sb, f16, 1)
        shape = (2, 4, 3) if len(sa) + len(sb) > 4 else (4, 3)
        matmul(a, b, torch.empty(shape, dtype=f16), add=torch.zeros(shape, dtype=f16))
        assert calls == want, (sa, sb)


def test_matmul_add_refuses_a_broadcast_other_dtype_or_aliased_residual():
    a, b, out = _rand((4, 5), torch.float32, 0), _rand((5, 3), torch.float32, 1), \
        torch.empty(4, 3)
    with pytest.raises(ShapeError, match=r"add has shape \(3,\); it must be out's, \(4, 3\)"):
        matmul(a, b, out, add=torch.zeros(3))
    with pytest.raises(DTypeError, match="add has dtype torch.float16"):
        matmul(a, b, out, add=torch.zeros(4, 3, dtype=torch.float16))
    with pytest.raises(GpuError, match="add may not share memory with out"):
        matmul(a, b, out, impl="triton", add=out)
    c = _rand((4, 3), torch.float32, 2)
    want = a @ b + c
    torch.addmm(c, a, b, out=c)     # the one-call path may even write in place
    torch.testing.assert_close(c, want)


# ----------------------------------------------------------------------------- the walk
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_llama_block_program_fuses_each_residual_add_into_its_matmul(dtype, p, monkeypatch):
    """The LLaMA block's two residual adds (after the o and down projections) launch no
    elementwise kernel: each is one addmm with its matmul, at the matmul's position (the
    residual exists by then), on every device; the program equals eins.jit."""
    from eins.codegen.generate import gpu_walk
    fn, args, low = _llama(dtype, p)
    dp = low.physical.device
    prog, gp = dp.program, low.generate("cuda")
    adds = [i for i, e in enumerate(prog.eqns) if e.prim == "add"]
    assert len(adds) == 2
    for d in dp.devices:
        code, src, walk = dp.code[d], gp.sources[d], gpu_walk(dp, d)
        assert sorted(int(e) for e in FUSED.findall(src)) == adds
        assert not re.search(r"# eqns \[[\d, ]*\b(%s)\b" % "|".join(map(str, adds)), src)
        for at, (j, a, c) in walk.residual.items():
            assert prog.eqns[code[j].eqn].prim == "matmul" and code[j].outs[0] in code[a].ins
            assert at == j and walk.positions[a] == walk.positions[j] == j
            assert code[j].outs[0] not in walk.memory_plan()[0]     # never written
    calls = []
    real = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    got = low.compile("interpret", graphs=False)(*args)   # eager: each launch runs once
    assert len(calls) == 2 * len(dp.devices)
    _close(got, eins.jit(fn)(*args), fn, args)


def test_a_matmul_split_along_its_contraction_keeps_its_residual_add():
    """Megatron-style row splits of the o and down projections (r0: the contracted dim)
    make each device's matmul a partial product that the sum ⊕ still needs: the add cannot
    run before it, so nothing fuses there (the add stays a kernel after the ⊕); the other
    adds of such a program still may. The program equals eins.jit."""
    fn, args, low = _llama("float16", 1)
    prog = low.physical.device.program
    mms = [i for i, e in enumerate(prog.eqns) if e.prim == "matmul"]
    wo, w2 = mms[3], mms[6]
    assert [prog.eqns[i + 1].prim for i in (wo, w2)] == ["add", "add"]
    low = eins.distribute(fn, devices=2, plan={wo: {"r0": 2}, w2: {"r0": 2}},
                          backend="interpret").lower(*args)
    assert low.plan_table()[wo]["agg"] == low.plan_table()[w2]["agg"] == 2
    dp = low.physical.device
    gp = low.generate("cuda")
    for d in dp.devices:
        src = gp.sources[d]
        assert FUSED.findall(src) == [] and src.count("dev.agg(K.agg_sum_2") == 2
        assert re.search(r"# eqns \[%d\] fused" % (wo + 1), src)
        assert re.search(r"# eqns \[%d\] fused" % (w2 + 1), src)
    _close(low.compile("interpret")(*args), eins.jit(fn)(*args), fn, args)


def _fused_adds(f, args, p=1):
    low = eins.distribute(f, devices=p, backend="interpret").lower(*args)
    src = low.generate("cuda").sources[0]
    got = low.compile("interpret")(*args)
    want = eins.jit(f)(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-3, atol=2e-3)
    return low, [int(e) for e in FUSED.findall(src)]


def test_residual_adds_that_must_not_fuse_stay_elementwise_kernels():
    rng = np.random.default_rng(3)
    x, w, r = (rng.standard_normal(s).astype(np.float32) for s in [(8, 16), (16, 8), (8, 8)])
    bias = rng.standard_normal(8).astype(np.float32)
    def used_twice(x, w, r):
        m = x @ w
        return m + r, m * 2.0

    def an_output(x, w, r):
        m = x @ w
        return m, m + r

    def plus_itself(x, w, r):
        m = x @ w
        return m + m

    cases = {
        "product used twice": used_twice,
        "product is an output": an_output,
        "a product plus itself": plus_itself,
        "broadcast residual": lambda x, w, r: (x @ w) + r[0],
        "add in a longer chain": lambda x, w, r: ((x @ w) + r) * 2.0,
    }
    for name, f in cases.items():
        _, fused = _fused_adds(f, (x, w, r))
        assert fused == [], name
    _, fused = _fused_adds(lambda x, w, b: x @ w + b, (x, w, bias))
    assert fused == []                              # a bias row: broadcast
    _, fused = _fused_adds(lambda x, w, r: x @ w + r, (x, w, r.astype(np.float64)))
    assert fused == []                              # a float64 sum of a float32 product
    # the control: the plain residual fuses
    _, fused = _fused_adds(lambda x, w, r: r + x @ w, (x, w, r))
    assert len(fused) == 1


def test_two_products_added_fuse_into_the_later_matmul():
    """(x @ w1) + (y @ w2): the second matmul takes the add (the first product, its
    residual, exists by then), launched where the second matmul is."""
    from eins.codegen.generate import gpu_walk
    rng = np.random.default_rng(4)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(8, 16), (16, 8)] * 2]
    low, fused = _fused_adds(lambda x, w1, y, w2: (x @ w1) + (y @ w2), args)
    dp = low.physical.device
    code, walk = dp.code[0], gpu_walk(dp, 0)
    [(at, (j, a, c))] = walk.residual.items()
    mms = [k for k, i in enumerate(code) if i.kind == "kernel" and
           dp.program.eqns[i.eqn].prim == "matmul"]
    assert len(mms) == 2 and at == j == mms[1] and c == code[mms[0]].outs[0]


def test_a_residual_written_after_the_matmul_moves_the_launch_to_the_add():
    """h @ w + rms_norm(y): the residual is written after the matmul, so the pair launches
    at the add, where h (the matmul's operand) is read: the memory plan keeps h alive until
    then, so the rms_norm's output written in between gets its own slot (planned at the
    matmul's own position, the two would share one)."""
    from eins.codegen.generate import gpu_walk

    def f(x0, w, y, g):
        h = eins.silu(x0)
        return h @ w + eins.rms_norm(y, g)
    rng = np.random.default_rng(5)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(8, 8), (8, 8), (8, 8), (8,)]]
    low, fused = _fused_adds(f, args)
    assert len(fused) == 1
    dp = low.physical.device
    code, bufs, walk = dp.code[0], dp.bufs[0], gpu_walk(dp, 0)
    [(at, (j, a, c))] = walk.residual.items()
    assert at == a > j and walk.positions[j] == a
    h = code[j].ins[0]
    assert_plan_keeps_until_launch(walk, code, bufs, h, c, a, {j})
