"""What the generated GPU walk (eins/codegen/generate.py) folds into a launch's output side.

Residual adds fused into their matmul (``GpuWalk._fuse_residuals``): ``c + a @ b`` becomes
one cuBLAS addmm/baddbmm launch (``matmul(..., add=c)``, eins/kernels/matmul.py)
where the matmul's block is the final value, read by that add alone, and ``c`` has the
block's shape and dtype. The layout change after an attention (``GpuWalk._fold_output``):
the attention writes the [S, H*D] buffer through its inverse view, no copy kernels. The
final sum ⊕ after a contraction-split projection (``GpuWalk._fuse_sums``): computed by the
residual add's fused Triton kernel as its first step, as the ⊕ kernel computes it. The
generated programs run under the interpret backend (torch CPU: addmm is the same call) and
equal eins.jit."""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.kernels.matmul import matmul  # noqa: E402
from eins.errors import DTypeError, GpuError, ShapeError  # noqa: E402
from helpers import (accumulation, assert_close, batched_llama, eps,  # noqa: E402
                     torch_eps)
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
    want = a.double() @ b.double() + c.double()
    assert matmul(a, b, c, add=c) is c       # the one-call path may write in place
    tol = (2 + 2 * 5) * torch_eps(torch.float32) * float(want.abs().max())   # as above, k=5
    np.testing.assert_allclose(c.double().numpy(), want.numpy(), rtol=0, atol=tol)


# ----------------------------------------------------------------------------- the walk
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_llama_block_program_fuses_each_residual_add_into_its_matmul(dtype, p, monkeypatch):
    """The LLaMA block's two residual adds (after the o and down projections) launch no
    elementwise kernel: each is one addmm with its matmul, at the matmul's position (the
    residual exists by then), on every device; the program equals eins.jit."""
    from eins.codegen.gpu_walk import gpu_walk
    fn, args, low = _llama(dtype, p)
    dprog = low.physical.device
    prog, gp = dprog.program, low.generate("cuda")
    adds = [i for i, e in enumerate(prog.eqns) if e.prim == "add"]
    assert len(adds) == 2
    for d in dprog.devices:
        code, src, walk = dprog.code[d], gp.sources[d], gpu_walk(dprog, d)
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
    assert len(calls) == 2 * len(dprog.devices)
    _close(got, eins.jit(fn)(*args), fn, args)


SUM_FUSED = re.compile(r"# eqns \[([\d, ]+)\] fused after the ⊕ of ([\w, ]+)")


def _contraction_split(dtype, p):
    """The tiny LLaMA block with Megatron-style row splits of the o and down projections
    (r0: the contracted dim) on p devices: each device's matmul is a partial product that
    the sum ⊕ combines before the residual add."""
    fn, args, low = _llama(dtype, 1)
    prog = low.physical.device.program
    mms = [i for i, e in enumerate(prog.eqns) if e.prim == "matmul"]
    wo, w2 = mms[3], mms[6]
    assert [prog.eqns[i + 1].prim for i in (wo, w2)] == ["add", "add"]
    low = eins.distribute(fn, devices=p, plan={wo: {"r0": p}, w2: {"r0": p}},
                          backend="interpret").lower(*args)
    assert low.plan_table()[wo]["agg"] == low.plan_table()[w2]["agg"] == p
    return fn, args, low, (wo + 1, w2 + 1)


def _count_launches(monkeypatch):
    from collections import Counter
    from eins.runtime import gpu
    counts, real = Counter(), gpu.DeviceRuntime.issue
    monkeypatch.setattr(gpu.DeviceRuntime, "issue", lambda self, what, thunk, reads=():
                        (counts.update([what]), real(self, what, thunk, reads))[1])
    return counts


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("p", [2, 4])
def test_a_contraction_split_sum_runs_in_its_residual_adds_kernel(dtype, p, monkeypatch):
    """The partial products cannot take the add as an addmm epilogue (nothing fuses there),
    but the final sum ⊕ of each block runs inside the residual add's fused kernel: no ⊕
    launch, no buffer for the sum, the partials read (and kept alive) at the add's launch.
    The program equals eins.jit; each device launches 2 kernels fewer (no aggregation)."""
    fn, args, low, adds = _contraction_split(dtype, p)
    from eins.codegen.gpu_walk import gpu_walk
    dprog = low.physical.device
    prog, gp = dprog.program, low.generate("cuda")
    for d in dprog.devices:
        code, src, walk = dprog.code[d], gp.sources[d], gpu_walk(dprog, d)
        assert FUSED.findall(src) == [] and "dev.agg(" not in src
        assert [int(e) for e, _ in SUM_FUSED.findall(src)] == list(adds)
        allocated = walk.memory_plan()[0]
        aggs = [j for j, i in enumerate(code) if i.kind == "agg"]
        assert len(aggs) == 2
        for j in aggs:
            [fk] = [fk for fk in walk.fused.values() if j in fk.members]
            h, a = fk.members
            assert h == j and prog.eqns[code[a].eqn].prim == "add" and code[j].dst in code[a].ins
            assert walk.positions[j] == walk.positions[a] == fk.launch_at == a
            assert code[j].dst not in allocated and set(code[j].srcs) <= allocated
            assert fk.inputs[:p] == code[j].srcs and fk.outputs == code[a].outs
    counts = _count_launches(monkeypatch)
    got = low.compile("interpret", graphs=False)(*args)    # eager: each launch runs once
    assert counts["aggregation kernel"] == 0 and counts["elementwise kernel"] == 3 * p
    _close(got, eins.jit(fn)(*args), fn, args)
    _close(low.compile("numpy")(*args), eins.jit(fn)(*args), fn, args)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_fused_sum_rounds_exactly_as_the_sum_kernel(dtype, monkeypatch):
    """The reduction is unchanged: the fused kernel accumulates the 4 partials in float32,
    in the ⊕ kernel's order, and rounds once to the block's dtype, so the program's output
    is bit for bit the one of the unfused program (the ⊕ kernel, then the add)."""
    from eins.kernels import fusion
    fn, args, low, _ = _contraction_split(dtype, 4)
    c = low.compile("interpret")
    assert not any("dev.agg(" in c.gpu.generated.sources[d] for d in range(4))
    fused = np.asarray(c(*args))
    monkeypatch.setattr(fusion, "sum_heads", lambda *a: [])
    c = low.compile("interpret")
    assert all(c.gpu.generated.sources[d].count("dev.agg(K.agg_sum_4") == 2 for d in range(4))
    unfused = np.asarray(c(*args))
    assert fused.dtype == unfused.dtype and fused.tobytes() == unfused.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_sum_and_add_kernel_compiles_for_sm90(dtype, monkeypatch):
    """The fused ⊕-then-chain kernels a run launches compile ahead of time for sm_90 (the
    H200; no GPU needed) with the argument types they were launched with, 64-bit offsets."""
    from eins.runtime import gpu
    from eins.runtime.gpu_exec import exec_sources
    from test_gpu_check_compile import SMEM_SM90, aot_compile, narrow_offsets
    fn, args, low, _ = _contraction_split(dtype, 2)
    c = low.compile("interpret")
    seen, real = {}, gpu.DeviceRuntime.ew

    def spy(self, kernel, ins, outs):
        seen.setdefault(kernel.__name__, (ins, outs))
        return real(self, kernel, ins, outs)
    monkeypatch.setattr(gpu.DeviceRuntime, "ew", spy)
    c(*args)
    K, _ = exec_sources(c.gpu.generated, interpret=False)
    sums = [k for k in seen if "⊕" in getattr(K, k).src]
    # two: after the o and the down projection, each one kernel for both devices (their
    # source names no device's buffers)
    assert len(sums) == 2
    for name in sums:
        ins, outs = seen[name]
        kern = aot_compile(getattr(K, name), list(ins) + list(outs) + [outs[0].numel()],
                           {"BLOCK": K.BLOCK})
        assert kern.metadata.shared <= SMEM_SM90 and not narrow_offsets(kern.asm["ttir"])


def _sum_programs():
    rng = np.random.default_rng(6)
    x, y, w, r = (rng.standard_normal(s).astype(np.float32)
                  for s in [(8, 32), (32, 8), (32, 8), (8, 8)])
    return {   # name: (fn, args, the eqn lists fused after a sum on device 0, aggs left)
        "residual add": (lambda x, y, r: x @ y + r, (x, y, r), ["1"], 0),
        "add, cast, scalar op": (lambda x, y, r: (x @ y + r).astype(np.float16) * 2.0,
                                 (x, y, r), ["1, 2, 3"], 0),
        # the sum read twice, both reads inside the one chain: it stays in registers
        "read twice in the chain": (lambda x, y, r: ((s := x @ y) + r) * s, (x, y, r),
                                    ["1, 2"], 0),
        # silu, the up matmul, mul: the chain launches at the mul
        "across a matmul": (lambda x, y, w: eins.silu(x @ y) * (x @ w), (x, y, w),
                            ["1, 3"], 0),
        # also a program output: the stored block gets a ⊕ of its own, which stays
        "also an output": (lambda x, y, r: ((s := x @ y), s + r), (x, y, r), ["1"], 1),
        # also a matmul's operand in the same row blocks: the add's exchange serves the
        # matmul too, so its one ⊕ block is read by two kernels and stays a ⊕ kernel
        "also a matmul's": (lambda x, y, r: ((s := x @ y) + r, s @ r), (x, y, r), [], 1),
    }


@pytest.mark.parametrize("name", list(_sum_programs()))
def test_sums_fuse_into_the_chain_that_alone_reads_them(name):
    """Small programs whose matmul is split along its contraction at p=2: the sum ⊕ of a
    block read only by one fused chain runs in that chain; a ⊕ of a block something else
    reads (a store, another kernel) stays a ⊕ kernel. Each equals eins.jit."""
    fn, args, want, left = _sum_programs()[name]
    low = eins.distribute(fn, devices=2, plan={0: {"r0": 2}}, backend="interpret").lower(*args)
    src = low.generate("cuda").sources[0]
    assert [e for e, _ in SUM_FUSED.findall(src)] == want
    assert src.count("dev.agg(") == left
    got, ref = low.compile("interpret")(*args), eins.jit(fn)(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    ref if isinstance(ref, tuple) else (ref,)):
        _close(g, w, fn, args)


def test_memory_plan_keeps_the_partials_of_a_fused_sum_until_its_launch():
    """silu(sum) * (x @ w3): the chain launches at the mul, after the up matmul, so the
    sum's local partial lives until then and the up matmul's block, written in between,
    gets its own slot (planned at the ⊕'s own position, the two would share one)."""
    from eins.codegen.gpu_walk import gpu_walk
    fn, args, _, _ = _sum_programs()["across a matmul"]
    low = eins.distribute(fn, devices=2, plan={0: {"r0": 2}}, backend="interpret").lower(*args)
    dprog = low.physical.device
    code, bufs, walk = dprog.code[0], dprog.bufs[0], gpu_walk(dprog, 0)
    [j] = [j for j, i in enumerate(code) if i.kind == "agg"]
    [fk] = [fk for fk in walk.fused.values() if j in fk.members]
    [part] = [s for s in code[j].srcs if s not in walk.pinned]     # not the received one
    up = [i.outs[0] for i in code if i.kind == "kernel" and dprog.program.eqns[i.eqn].prim ==
          "matmul"][1]
    assert_plan_keeps_until_launch(walk, code, bufs, part, up, fk.launch_at,
                                   set(fk.members[:-1]))


def _toy_device(extra=(), op="sum", partial=False, sum_shape=(4, 4), part_dtype=np.float16):
    """A device list: a sum ⊕ of a local and a received partial, then an add that reads
    it (instruction 2), then ``extra`` instructions."""
    from eins.ir.device import Agg, BufInfo, Kernel, Recv
    from eins.ir.types import Box

    def info(shape, dt=np.float16, part=False):
        return BufInfo("v", Box((0,) * len(shape), tuple(shape)), np.dtype(dt), part)
    bufs = {"a": info(sum_shape, part_dtype), "rx": info(sum_shape, part_dtype),
            "s": info(sum_shape, part=partial), "c": info((4, 4)), "o": info((4, 4)),
            "o2": info((4, 4)), "w": info((4, 4))}
    code = [Recv("rx", 1, 0), Agg("s", ("a", "rx"), op), Kernel(("o",), ("s", "c"), 0, None),
            *extra]
    return code, bufs


def test_sum_heads_takes_only_a_final_sum_the_chain_alone_reads():
    """The rule itself, on hand-made device lists: a ⊕ fuses into the group of its readers
    only when it is a full aggregate of an elementwise ⊕ (sum, max, min; not lse pairs),
    no send, store or kernel outside the group reads it, and its partials, itself and the
    group share one block shape and dtype."""
    from eins.kernels.fusion import sum_heads
    from eins.ir.device import Kernel, Send, Store
    from eins.ir.types import Box
    assert sum_heads(*_toy_device(), [[2]]) == [([1], [2])]
    assert sum_heads(*_toy_device(op="max"), [[2]]) == [([1], [2])]
    second = Kernel(("o2",), ("s", "o"), 1, None)
    assert sum_heads(*_toy_device([second]), [[2, 3]]) == [([1], [2, 3])]
    refused = {
        "sent on": (_toy_device([Send("s", 1, 1)]), [[2]]),
        "a program output": (_toy_device([Store("s", 0, Box((0, 0), (4, 4)))]), [[2]]),
        "read by a kernel of another group": (_toy_device([second]), [[2], [3]]),
        "read by a kernel of no group": (_toy_device([Kernel(("o2",), ("s", "w"), 1, None)]),
                                         [[2]]),
        "read by no group": (_toy_device(), []),
        "a partial aggregate": (_toy_device(partial=True), [[2]]),
        "the lse pair ⊕": (_toy_device(op="lse"), [[2]]),
        "a broadcast operand of the chain": (_toy_device(sum_shape=(4,)), [[2]]),
        "partials of another dtype": (_toy_device(part_dtype=np.float32), [[2]]),
    }
    for why, ((code, bufs), groups) in refused.items():
        assert sum_heads(code, bufs, groups) == [], why


def test_fused_source_refuses_a_head_that_is_not_an_elementwise_sum():
    from eins.kernels.fusion import fused_source
    from eins.errors import EinsError
    fn, args, low, _ = _contraction_split("float32", 2)
    dprog = low.physical.device
    code, bufs = dprog.code[0], dprog.bufs[0]
    add = max(j for j, i in enumerate(code) if i.kind == "kernel"
              and dprog.program.eqns[i.eqn].prim == "add")
    with pytest.raises(EinsError, match=r"head 0 of group \[%d\] is not an elementwise ⊕"
                       % add):
        fused_source(dprog.program, [add], code, bufs, heads=[0])


def _fused_adds(f, args, p=1):
    low = eins.distribute(f, devices=p, backend="interpret").lower(*args)
    src = low.generate("cuda").sources[0]
    got = low.compile("interpret")(*args)
    want = eins.jit(f)(*args)
    n, depth = accumulation(eins.make_ir(f)(*args))
    # the narrowest operand's dtype: a float64 residual does not make the float32 GEMM exact
    dt = min((np.asarray(a).dtype for a in args), key=lambda d: -eps(d))
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        assert_close(g, w, n=n, depth=depth, dtype=dt)
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
    from eins.codegen.gpu_walk import gpu_walk
    rng = np.random.default_rng(4)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(8, 16), (16, 8)] * 2]
    low, fused = _fused_adds(lambda x, w1, y, w2: (x @ w1) + (y @ w2), args)
    dprog = low.physical.device
    code, walk = dprog.code[0], gpu_walk(dprog, 0)
    [(at, (j, a, c))] = walk.residual.items()
    mms = [k for k, i in enumerate(code) if i.kind == "kernel" and
           dprog.program.eqns[i.eqn].prim == "matmul"]
    assert len(mms) == 2 and at == j == mms[1] and c == code[mms[0]].outs[0]


def test_a_residual_written_after_the_matmul_moves_the_launch_to_the_add():
    """h @ w + rms_norm(y): the residual is written after the matmul, so the pair launches
    at the add, where h (the matmul's operand) is read: the memory plan keeps h alive until
    then, so the rms_norm's output written in between gets its own slot (planned at the
    matmul's own position, the two would share one)."""
    from eins.codegen.gpu_walk import gpu_walk

    def f(x0, w, y, g):
        h = eins.silu(x0)
        return h @ w + eins.rms_norm(y, g)
    rng = np.random.default_rng(5)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(8, 8), (8, 8), (8, 8), (8,)]]
    low, fused = _fused_adds(f, args)
    assert len(fused) == 1
    dprog = low.physical.device
    code, bufs, walk = dprog.code[0], dprog.bufs[0], gpu_walk(dprog, 0)
    [(at, (j, a, c))] = walk.residual.items()
    assert at == a > j and walk.positions[j] == a
    h = code[j].ins[0]
    assert_plan_keeps_until_launch(walk, code, bufs, h, c, a, {j})


# ----------------------------------------------------------------------------- attention out
def _writes_through(src):
    """The output views the generated walk passes to attention launches."""
    return re.findall(r"dev\.op\('attention', \w+, \[(B\['\w+'\][^\]]*)\]", src)


def test_llama_block_p1_program_launches_no_layout_copy():
    """p=1, float16: the attention writes [S, H*D] through ``view(S, H, D).permute(1, 0, 2)``
    of the o projection's input, so the transpose and reshape after it launch nothing and
    own no buffers; with the residual adds in their matmuls, the block is 13 launches (it
    was 17: a transpose copy, a reshape copy and two add kernels more)."""
    from eins.codegen.gpu_walk import gpu_walk
    fn, args, low = _llama("float16", 1)
    dprog = low.physical.device
    code, prog, src, walk = dprog.code[0], dprog.program, low.generate("cuda").sources[0], \
        gpu_walk(dprog, 0)
    [(j, (expr, chain))] = walk.out_views.items()
    assert prog.eqns[code[j].eqn].prim == "attention"
    assert [prog.eqns[code[k].eqn].prim for k in chain] == ["transpose", "reshape"]
    last = code[chain[-1]].outs[0]
    assert _writes_through(src) == [f"B[{last!r}].view((16, 4, 4)).permute(1, 0, 2)"]
    allocated = walk.memory_plan()[0]
    assert last in allocated and not {code[j].outs[0], code[chain[0]].outs[0]} & allocated
    assert all(walk.positions[k] == j for k in chain)
    launches = re.findall(r"dev\.(?:op\('(\w+)'|(ew)|agg)", src)
    names = sorted(a or b for a, b in launches)
    assert names == sorted(["rms_norm"] * 2 + ["matmul"] * 7 + ["rope"] * 2 +
                           ["attention", "ew"])
    _close(low.compile("interpret")(*args), eins.jit(fn)(*args), fn, args)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_batched_llama_block_attention_writes_its_output_layout(p):
    """Batched (2 x 8): the attention block [B, H, S, D] writes [B, S, H*D] through
    ``view(B, S, H, D).permute(0, 2, 1, 3)`` on every device (split by batch at p=2, by
    batch and heads at p=4, where the view is of the device's head block); equal to
    eins.jit."""
    fn, args, low = batched_llama(p)
    dprog = low.physical.device
    gp = low.generate("cuda")
    for d in dprog.devices:
        [view] = _writes_through(gp.sources[d])
        assert view.endswith(".permute(0, 2, 1, 3)") and ".view((" in view
    _close(low.compile("interpret")(*args), eins.jit(fn)(*args), fn, args)


@pytest.mark.parametrize("split", ["kv_sequence", "sequence", "heads_kv"])
def test_split_attention_of_the_llama_block(split):
    """Key-split attention blocks write (o, lse) pairs for the lse ⊕: their output never
    folds (the ⊕ reads it, and it is no [H, S, D] block); query-split blocks are whole
    attentions whose rows are exchanged before the layout change, which stays; a head split
    writes each device's heads through a permuted view of its block of the head merge. All
    equal eins.jit."""
    from eins.codegen.gpu_walk import gpu_walk
    from eins.ir.joinagg import is_lse_pair
    fn, args, low = _llama("float32", 1)
    prog = low.physical.device.program
    att = next(i for i, e in enumerate(prog.eqns) if e.prim == "attention")
    low = eins.distribute(fn, devices=2, plan={att: {split: 2}},
                          backend="interpret").lower(*args)
    dprog = low.physical.device
    gp = low.generate("cuda")
    for d in dprog.devices:
        walk, code = gpu_walk(dprog, d), dprog.code[d]
        atts = [j for j, i in enumerate(code)
                if i.kind == "kernel" and dprog.program.eqns[i.eqn].prim == "attention"]
        pairs = [j for j in atts if is_lse_pair(dprog.bufs[d][code[j].outs[0]].dtype)]
        assert bool(pairs) == (split == "kv_sequence") == ("partial=True" in gp.sources[d])
        assert sorted(walk.out_views) == (atts if split == "heads_kv" else [])
        if split == "heads_kv":
            # a permuted view of the block it feeds: of the head merge's [S, H/2*D] block
            # (.view((16, 2, 4)) first) or, where dp splits that reshape by rows instead,
            # of the transpose's [S, H/2, D] block
            assert _writes_through(gp.sources[d])[0].endswith(".permute(1, 0, 2)")
    _close(low.compile("interpret")(*args), eins.jit(fn)(*args), fn, args)


def _attention_then(layout):
    """x @ w -> heads [2, S, 8] for q, k, v -> attention -> ``layout`` of its output."""
    def f(x, wq, wk, wv):
        def heads(t):
            return t.reshape(8, 2, 8).transpose(1, 0, 2)
        return layout(eins.attention(heads(x @ wq), heads(x @ wk), heads(x @ wv),
                                     causal=True))
    rng = np.random.default_rng(7)
    args = [(rng.standard_normal(s) / 2).astype(np.float32)
            for s in [(8, 16), (16, 16), (16, 16), (16, 16)]]
    return f, args


@pytest.mark.parametrize("name,layout,folds,kept", [
    # the head dim moved off the last axis: the attention cannot write it, a copy stays
    ("head dim first", lambda y: y.transpose(2, 0, 1), 0, 1),
    # reshape then transpose: the inverse would reshape a permuted view (it could copy),
    # so only the reshape folds and the transpose stays a kernel
    ("reshape, transpose", lambda y: y.reshape(2, 8, 2, 4).transpose(0, 2, 1, 3), 1, 1),
    ("transpose, reshape", lambda y: y.transpose(1, 0, 2).reshape(8, 16), 2, 0),
])
def test_an_output_layout_folds_only_where_the_inverse_is_a_view(name, layout, folds, kept):
    from eins.codegen.gpu_walk import gpu_walk
    f, args = _attention_then(layout)
    low = eins.distribute(f, devices=1, backend="interpret").lower(*args)
    dprog = low.physical.device
    walk, src = gpu_walk(dprog, 0), low.generate("cuda").sources[0]
    assert sum(len(ch) for _, ch in walk.out_views.values()) == folds, name
    assert src.count("dev.op('transpose'") + src.count("dev.op('reshape'") == kept, name
    np.testing.assert_allclose(low.compile("interpret")(*args), eins.jit(f)(*args),
                               rtol=1e-5, atol=1e-5 * 16)


def test_memory_plan_starts_the_written_through_buffer_at_the_attention():
    """The attention writes the reshape's buffer when it runs: h, read after the attention
    (by the rms_norm) but before the layout kernels' own positions, must not share its
    storage. Planned at the layout kernels' own positions the two would share a slot (the
    case matters)."""
    from eins.codegen import memory
    from eins.codegen.gpu_walk import gpu_walk

    def f(x, wq, wk, wv, x2, g):
        h = eins.silu(x2)
        def heads(t):
            return t.reshape(8, 2, 8).transpose(1, 0, 2)
        y = eins.attention(heads(x @ wq), heads(x @ wk), heads(x @ wv), causal=True)
        n = eins.rms_norm(h, g)
        return y.transpose(1, 0, 2).reshape(8, 16) * n
    rng = np.random.default_rng(8)
    args = [(rng.standard_normal(s) / 2).astype(np.float32)
            for s in [(8, 16), (16, 16), (16, 16), (16, 16), (8, 16), (16,)]]
    low = eins.distribute(f, devices=1, backend="interpret").lower(*args)
    dprog = low.physical.device
    code, bufs, walk = dprog.code[0], dprog.bufs[0], gpu_walk(dprog, 0)
    [(j, (_, chain))] = walk.out_views.items()
    last = code[chain[-1]].outs[0]
    h = next(i.outs[0] for i in code if i.kind == "kernel" and dprog.program.eqns[i.eqn].prim
             == "silu")
    allocated, slot_of, _ = walk.memory_plan()
    life = memory.lifetimes(code, walk.positions, allocated)
    assert life[last][0] == j < life[h][1] < chain[0]
    assert slot_of[last] != slot_of[h]
    own = {k: pos for k, pos in walk.positions.items() if k not in chain}
    wrong, _ = memory.plan(code, bufs, own, allocated, walk.pinned)
    assert wrong[last] == wrong[h]
    np.testing.assert_allclose(low.compile("interpret")(*args), eins.jit(f)(*args),
                               rtol=1e-5, atol=1e-5 * 16)


@pytest.mark.parametrize("batch", [(), (2,)])
def test_flash_attn_path_writes_through_a_strided_output(batch, monkeypatch):
    """flash-attn's varlen path (eins/kernels/flash.py, not installed here) copies
    its result into ``out``: through the folded output view too. A stand-in module
    computes the same attention in torch (per packed segment, causal), so the strided and
    the contiguous ``out`` must hold the same values."""
    from eins.kernels import flash

    class FakeFlashAttn:
        @staticmethod
        def flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, dropout, *, softmax_scale,
                                   causal):
            out = torch.zeros_like(q)
            g = q.shape[1] // k.shape[1]
            for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]):
                qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
                ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
                s = (qs @ ks.transpose(-1, -2)) * softmax_scale
                if causal:
                    s = s.masked_fill(torch.ones(b - a, b - a).triu(1).bool(), float("-inf"))
                out[a:b] = (s.softmax(-1) @ vs).transpose(0, 1)
            return out
    monkeypatch.setattr(flash, "flash_attn_module", lambda: FakeFlashAttn)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(*batch, 4, 16, 8, generator=g)
    k, v = (torch.randn(*batch, 2, 16, 8, generator=g) for _ in range(2))
    buf = torch.full((*batch, 16, 32), float("nan"))
    nb = len(batch)
    view = buf.view(*batch, 16, 4, 8).permute(*range(nb), nb + 1, nb, nb + 2)
    assert not view.is_contiguous() and view.stride(-1) == 1
    kw = dict(causal=True, segments=(4, 12, 16), scale=8 ** -0.5)
    flash.varlen(q, k, v, view, **kw)
    want = flash.varlen(q, k, v, torch.empty_like(q), **kw)
    assert torch.equal(view, want) and not buf.isnan().any()


# ----------------------------------------------------------------------------- in place
HOW = re.compile(r"# eqn (\d+) fused in: a @ b \+ c, (in place|one addmm)")


def _addmm_aliasing(monkeypatch):
    """Records, for each torch.addmm/baddbmm the runtime calls, whether ``out`` is ``c``'s
    memory (the in-place form: aten's copy of c into out is then a no-op)."""
    seen = []
    for name in ("addmm", "baddbmm"):
        real = getattr(torch, name)

        def wrap(c, a, b, *, out, real=real):
            assert out.data_ptr() not in (a.data_ptr(), b.data_ptr())   # a, b never c
            seen.append(out.data_ptr() == c.data_ptr())
            return real(c, a, b, out=out)
        monkeypatch.setattr(torch, name, wrap)
    return seen


def assert_plan_sound(walk, code, bufs):
    """No two buffers of one slot are alive at once (lifetimes in walk positions), but for
    an add's output written in place over its residual, which takes the slot at the very
    launch that last reads the residual. Returns (slot_of, lifetimes)."""
    from eins.codegen import memory
    allocated, slot_of, _ = walk.memory_plan()
    life = memory.lifetimes(code, walk.positions, allocated)
    by_slot = {}
    for b in sorted(allocated & set(life)):
        by_slot.setdefault(slot_of[b], []).append(b)
    for group in by_slot.values():
        for x in group:
            for y in group:
                if x < y and walk.in_place.get(y) != x and walk.in_place.get(x) != y:
                    assert life[x][1] < life[y][0] or life[y][1] < life[x][0], (x, y)
    for r, c in walk.in_place.items():
        assert slot_of[r] == slot_of[c] and life[c][1] == life[r][0]
    return slot_of, life


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_llama_blocks_second_residual_add_writes_over_its_residual(dtype, monkeypatch):
    """LLaMA p=1: the second residual add (h + ffn @ w2) runs IN PLACE, ``addmm(h, a, w2,
    out=h)``: h, the first add's output, is last read there and is a plain buffer, so the
    add's output takes its slot. The first (x + attn @ wo) stays out of place: its residual
    is the block's input x, a Load (a placed input that must survive across calls). The
    plan stays sound and the program equals eins.jit."""
    from eins.codegen.gpu_walk import gpu_walk
    fn, args, low = _llama(dtype, 1)
    dprog = low.physical.device
    prog, code, bufs = dprog.program, dprog.code[0], dprog.bufs[0]
    src, walk = low.generate("cuda").sources[0], gpu_walk(dprog, 0)
    adds = [i for i, e in enumerate(prog.eqns) if e.prim == "add"]
    assert [(int(e), how) for e, how in HOW.findall(src)] == \
        [(adds[0], "one addmm"), (adds[1], "in place")]
    (j1, a1, c1), (j2, a2, c2) = sorted(walk.residual.values())
    [load] = [i for i in code if c1 in i.defs()]
    assert load.kind == "load" and c1 in walk.pinned
    assert c2 == code[a1].outs[0] and walk.in_place == {code[a2].outs[0]: c2}
    assert f"[B[{c2!r}]], {', '.join(f'B[{x!r}]' for x in code[j2].ins)}, B[{c2!r}])" in src
    assert_plan_sound(walk, code, bufs)
    seen = _addmm_aliasing(monkeypatch)
    got = low.compile("interpret", graphs=False)(*args)    # eager: each launch runs once
    assert seen == [False, True]
    _close(got, eins.jit(fn)(*args), fn, args)


def _residual_then(read_again):
    def f(x, s, v, w, u):
        h = x @ s     # not elementwise: a silu(x) would fuse with the add instead
        y = v @ w + h
        return y @ (h if read_again else u)     # h read again after the fused launch?
    rng = np.random.default_rng(8)
    return f, [(rng.standard_normal(s) / 2).astype(np.float32)
               for s in [(8, 8), (8, 8), (8, 16), (16, 8), (8, 8)]]


@pytest.mark.parametrize("read_again", [False, True])
def test_a_residual_read_after_the_launch_stays_out_of_place(read_again, monkeypatch):
    """h = x @ s; h + v @ w, then a matmul by h again (or by another input): read again,
    the residual must survive the launch, so the add writes its own buffer (``out`` is not
    c, another slot, the residual alive past the launch); read last there, the add writes
    over it (one slot). Both equal eins.jit."""
    from eins.codegen.gpu_walk import gpu_walk
    f, args = _residual_then(read_again)
    low = eins.distribute(f, devices=1, backend="interpret").lower(*args)
    dprog = low.physical.device
    code, bufs, src, walk = dprog.code[0], dprog.bufs[0], low.generate("cuda").sources[0], \
        gpu_walk(dprog, 0)
    [(at, (j, a, c))] = walk.residual.items()
    r = code[a].outs[0]
    assert [how for _, how in HOW.findall(src)] == ["one addmm" if read_again else "in place"]
    assert walk.in_place == ({} if read_again else {r: c})
    slot_of, life = assert_plan_sound(walk, code, bufs)
    assert (slot_of[r] == slot_of[c]) is not read_again
    assert (life[c][1] > at) is read_again and life[r][0] == at
    seen = _addmm_aliasing(monkeypatch)
    got = low.compile("interpret", graphs=False)(*args)
    assert seen == [not read_again]
    _close(got, eins.jit(f)(*args), f, args)
