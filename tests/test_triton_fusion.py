"""Fused elementwise chains: which eqns group (program and device level), and the one
generated Triton kernel per group under the interpreter against eins.jit (numpy reference
kernels). The fused kernel rounds every intermediate to its eqn's dtype, as the unfused
kernels do, so it matches the reference to a unit of the output dtype."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.kernels import build  # noqa: E402
from eins.kernels.fusion import fused_source, fusion_groups, launch_fused  # noqa: E402
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
    # the fused kernel's bfloat16 cast rounds to nearest even under the interpreter too
    # (build.py's _to_bf16), as the GPU and ml_dtypes do: the same bits
    np.testing.assert_array_equal(out.float().numpy(), ref)
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
    rng = torch.Generator().manual_seed(0)
    gt = torch.randn(4, 8, generator=rng).half()
    ut = torch.randn(4, 8, generator=rng).half()
    s, o = torch.empty(4, 8).half(), torch.empty(4, 8).half()
    launch_fused(fk, [gt, ut], [s, o])
    # the reference silu is x * exp(-logaddexp(0, -x)), the kernel's x / (1 + exp(-x)):
    # in float32 both, they may round to float16 one ulp (2**-10 relative) apart. Unseeded
    # inputs made an exact comparison fail now and then.
    ulp = dict(rtol=2.0 ** -10, atol=2.0 ** -24)
    np.testing.assert_allclose(s.numpy(), eins.jit(eins.silu)(gt.numpy()), **ulp)
    np.testing.assert_allclose(o.numpy(), eins.jit(f)(gt.numpy(), ut.numpy()), **ulp)
    assert s.numpy().dtype == o.numpy().dtype == np.float16
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
    dprog = eins.distribute(ffn, devices=2).lower(*args).physical.device
    prog = dprog.program
    # in program order silu and mul are not adjacent (the second matmul is between them)
    assert [e.prim for e in prog.eqns][:4] == ["matmul", "silu", "matmul", "mul"]
    assert fusion_groups(prog) == [[5, 6]]
    assert fusion_groups(prog, reorder=True) == [[1, 3], [5, 6]]
    found = 0
    for d in dprog.devices:
        code, bufs = dprog.code[d], dprog.bufs[d]
        assert all(prog.eqns[code[j].eqn].prim != "silu"
                   for g in fusion_groups(prog, code, bufs) for j in g)
        for group in fusion_groups(prog, code, bufs, reorder=True):
            found += 1
            fk = fused_source(dprog.program, group, code, bufs)
            env = {n: rng.standard_normal(bufs[n].box.shape).astype(np.float32)
                   for n in fk.inputs}
            outs = [torch.empty(fk.shape) for _ in fk.outputs]
            launch_fused(fk, [torch.from_numpy(env[n]) for n in fk.inputs], outs)
            for j in group:       # the members one by one, on numpy
                k = code[j]
                assert isinstance(k, Kernel)
                vals = [env[a] if isinstance(a, str) else np.asarray(a[1], a[2]) for a in k.ins]
                env[k.outs[0]] = get_primitive(dprog.program.eqns[k.eqn].prim).impl(
                    *vals, **dprog.program.eqns[k.eqn].params)[0]
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


# ----------------------------------------------------------------- fusion in the GPU program
def _llama(dtype, p):
    """The tiny LLaMA block (packed segments) lowered on p devices, and its arguments. Planned
    without per-transfer latency (the paper's model), whose plans exchange blocks between
    the attention and its output's layout change at p = 2: the case the tests below need
    (with NCCL's latencies dp keeps those blocks in place)."""
    from eins.hardware.presets import get_topology
    from eins.models import llama
    cfg, rng, segs = llama.TINY, np.random.default_rng(5), (4, 12, 16)
    w = llama.init_weights(cfg, rng, dtype)
    x = (rng.standard_normal((16, cfg.d_model)) / 2).astype(dtype)
    cos, sin = llama.rope_tables(16, cfg.head_dim, segs, dtype=dtype)
    fn = llama.block_fn(cfg, segs)
    topo = get_topology(f"dgx-a100:{p}").without_latency()
    return fn, (x, w, cos, sin), eins.distribute(fn, devices=p, backend="interpret",
                                                 topology=topo).lower(x, w, cos, sin)


def _close(got, want, fn, args):
    from helpers import accumulation, assert_close
    n, depth = accumulation(eins.make_ir(fn)(*args))
    assert_close(np.asarray(got), np.asarray(want), n=n, depth=depth)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_llama_block_program_fuses_silu_and_mul_across_the_up_matmul(p):
    """The generated GPU program of the LLaMA block launches silu(x w1) * (x w3) as ONE
    fused kernel on every device, although the up matmul sits between silu and mul in the
    device IR (the kernel is launched at the mul); the program still equals eins.jit."""
    from eins.codegen.gpu_walk import gpu_walk
    fn, args, low = _llama("float32", p)
    dprog = low.physical.device
    prog, gp = dprog.program, low.generate("cuda")
    for d in dprog.devices:
        code, walk = dprog.code[d], gpu_walk(dprog, d)
        silu = [j for j, i in enumerate(code)
                if i.kind == "kernel" and prog.eqns[i.eqn].prim == "silu"]
        assert len(silu) == 1
        [fk] = [fk for fk in walk.fused.values() if silu[0] in fk.members]
        s, m = fk.members
        assert prog.eqns[code[m].eqn].prim == "mul" and code[s].outs[0] in code[m].ins
        between = [code[j] for j in range(s + 1, m)]
        assert any(i.kind == "kernel" and prog.eqns[i.eqn].prim == "matmul" for i in between)
        assert fk.launch_at == m and walk.positions[s] == walk.positions[m] == m
        # silu's value stays in registers: no buffer, and one launch names both eqns
        assert code[s].outs[0] not in walk.memory_plan()[0]
        assert f"# eqns [{code[s].eqn}, {code[m].eqn}] fused" in gp.sources[d]
        assert f"def {fk.name}(" in gp.sources["kernels"]
    _close(low.compile("interpret")(*args), eins.jit(fn)(*args), fn, args)


def assert_plan_keeps_until_launch(walk, code, bufs, keep, other, at, moved):
    """The static memory plan of ``walk`` keeps buffer ``keep`` alive until position ``at``
    (where a launch that ``moved`` instructions were moved to reads it), so ``other``,
    written in between, gets its own slot; planned at the moved instructions' own positions
    the two would share one (the case matters). Returns (allocated, lifetimes)."""
    from eins.codegen import memory
    allocated, slot_of, _ = walk.memory_plan()
    life = memory.lifetimes(code, walk.positions, allocated)
    assert life[keep][1] == at > life[other][0] > life[keep][0]
    assert slot_of[keep] != slot_of[other]
    own = {k: pos for k, pos in walk.positions.items() if k not in moved}
    wrong, _ = memory.plan(code, bufs, own, allocated, walk.pinned)
    assert wrong[keep] == wrong[other]
    return allocated, life


def test_memory_plan_keeps_the_inputs_of_a_fused_kernel_until_its_launch():
    """A fused chain launched at its last member reads its inputs there: the gate matmul's
    buffer (read by silu) lives until the mul, so the up matmul written in between may not
    reuse its storage. Planned by the members' own positions it would: the case matters."""
    from eins.codegen.gpu_walk import gpu_walk

    def ffn(x, w1, w3):
        return eins.silu(x @ w1) * (x @ w3)
    rng = np.random.default_rng(4)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(8, 16), (16, 24), (16, 24)]]
    low = eins.distribute(ffn, devices=1, backend="interpret").lower(*args)
    dprog = low.physical.device
    code, bufs, walk = dprog.code[0], dprog.bufs[0], gpu_walk(dprog, 0)
    [fk] = walk.fused.values()
    s, m = fk.members
    gate = code[s].ins[0]
    [up] = [a for a in code[m].ins if a != code[s].outs[0]]
    # gate is read at the launch (m), after up's write, which comes after silu (s)
    _, life = assert_plan_keeps_until_launch(walk, code, bufs, gate, up, m, fk.members)
    assert life[up][0] > s
    np.testing.assert_allclose(low.compile("interpret")(*args), eins.jit(ffn)(*args),
                               rtol=1e-5, atol=1e-5 * 16)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_float16_llama_block_program_has_no_float32_buffers(p):
    """float16 blocks stay float16 in memory: every buffer of the generated program (the
    static plan's BUFFERS) and every fused kernel's store is float16; the float32 compute of
    the elementwise chain stays in registers."""
    from eins.codegen.gpu_walk import gpu_walk
    fn, args, low = _llama("float16", p)
    dprog = low.physical.device
    gp = low.generate("cuda")
    for d in dprog.devices:
        ns = {}
        exec(gp.sources[d].split("# literal operands")[0], ns)  # noqa: S102 - our own source
        assert {np.dtype(dt) for _, dt, _ in ns["BUFFERS"].values()} == {np.dtype(np.float16)}
        for fk in gpu_walk(dprog, d).fused.values():
            stores = [ln for ln in fk.source.splitlines() if "tl.store(" in ln]
            assert len(stores) == len(fk.outputs)
            assert all(dprog.bufs[d][o].dtype == np.float16 for o in fk.outputs)
            assert ".to(tl.float16)" in fk.source and "tl.float32)  # eqn" not in fk.source
    if p == 2:
        got = low.compile("interpret")(*args)
        assert got.dtype == np.float16
        _close(got, eins.jit(fn)(*args), fn, args)


@pytest.mark.parametrize("p", [1, 2])
def test_llama_block_program_fuses_the_qk_layout_change_into_rope(p):
    """q and k: matmul -> reshape -> transpose -> rope. The reshape and transpose become a
    strided view of the matmul's buffer that the rope kernel reads directly: no kernels and
    no buffers for them, and the matmul's buffer lives until the rope (their position)."""
    from eins.codegen import memory
    from eins.codegen.gpu_walk import gpu_walk
    fn, args, low = _llama("float32", p)
    dprog = low.physical.device
    prog, gp = dprog.program, low.generate("cuda")
    for d in dprog.devices:
        code, walk, src = dprog.code[d], gpu_walk(dprog, d), gp.sources[d]
        ropes = [j for j, i in enumerate(code)
                 if i.kind == "kernel" and prog.eqns[i.eqn].prim == "rope"]
        assert len(ropes) == 2                      # q and k
        allocated = walk.memory_plan()[0]
        life = memory.lifetimes(code, walk.positions, allocated)
        for j in ropes:
            tr = next(k for k, i in enumerate(code) if code[j].ins[0] in i.defs())
            rs = next(k for k, i in enumerate(code) if code[tr].ins[0] in i.defs())
            mm = code[rs].ins[0]
            assert [prog.eqns[code[k].eqn].prim for k in (rs, tr)] == ["reshape", "transpose"]
            assert walk.folded == {**walk.folded, rs: j, tr: j}
            assert code[rs].outs[0] not in allocated and code[tr].outs[0] not in allocated
            assert life[mm][1] >= j
            shape = tuple(code[rs].fspec.outputs[0].shape)
            axes = tuple(prog.eqns[code[tr].eqn].params["axes"])
            assert f"B[{mm!r}].reshape({shape}).permute{axes}, " in src
        # the attention output's layout change: folded into the attention at p=1 (which
        # writes through its view, tests/test_gpu_epilogues.py); exchanged between the
        # devices first at p=2, so it stays a kernel there
        assert ("dev.op('transpose'" in src) == (p > 1)
    # these programs' results: test_llama_block_program_fuses_silu_and_mul_across_the_up_matmul


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_generated_aggregation_kernels_compute_the_one_agg_table(dtype):
    """The Triton ⊕ kernels of a generated program (sum, max, min: split contractions and
    reductions) take their combine from eins.ir.joinagg.AGG_FUNCS through the elementwise
    expression table; run under the interpreter the program equals eins.jit (max and min
    exactly; sum, accumulated in float32, to the accumulation's tolerance)."""
    from eins.codegen.generate import triton_kernel_sources

    def f(x, w):
        return eins.max(x @ w, axis=0), eins.min(x, axis=0)
    rng = np.random.default_rng(6)
    x, w = (rng.standard_normal((8, 8)).astype(dtype) for _ in range(2))
    d = eins.distribute(f, devices=2, plan={0: {"r0": 2}, 1: {"r0": 2}, 2: {"r0": 2}},
                        backend="interpret")
    low = d.lower(x, w)
    ks = "\n".join(triton_kernel_sources(low.generate("cuda")))
    assert "acc = acc + tl.load(p1 + offs" in ks                  # np.add: sum
    assert "acc = tl.maximum(acc, tl.load(p1 + offs" in ks        # np.maximum: max
    assert "acc = tl.minimum(acc, tl.load(p1 + offs" in ks        # np.minimum: min
    got = low.compile("interpret")(x, w)
    want = eins.jit(f)(x, w)
    np.testing.assert_array_equal(got[1], want[1])
    _close(got[0], want[0], f, (x, w))


def _layout_chain(code, prog, b):
    """The reshape/transpose kernels (in order) of ``code`` ending in buffer ``b``, and the
    buffer they start from."""
    chain, producer = [], {o: j for j, i in enumerate(code) for o in i.defs()}
    while b in producer and code[producer[b]].kind == "kernel" and \
            prog.eqns[code[producer[b]].eqn].prim in ("reshape", "transpose"):
        chain.insert(0, producer[b])
        b = code[producer[b]].ins[0]
    return chain, b


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_llama_block_program_folds_the_v_layout_change_into_attention(p, packed):
    """v: matmul -> reshape -> transpose -> attention. Where the device holds the whole
    chain (p=1; batched at p=2, split by batch), it becomes a strided view of the matmul's
    buffer (unit head-dim stride) passed to the attention launcher: no kernels, no buffers,
    the matmul's buffer lives until the attention, and no layout kernel is left (the
    attention output's folds into the attention too). Batched at p=4 the transpose alone folds (into a view of the
    gathered reshape blocks); packed at p>1 the sequence split gathers the transposed k/v
    blocks (slices, sends, concat), so no chain reads into the attention directly. Results
    equal eins.jit."""
    from eins.codegen import memory
    from eins.codegen.gpu_walk import gpu_walk
    from helpers import batched_llama
    fn, args, low = _llama("float32", p) if packed else batched_llama(p)
    if not packed and p == 4:
        # dp gathers the normalized x once for the three projections and splits them by
        # heads, so v's whole chain is local (and folds, as at p < 4); v's projection
        # forced by batch and rows keeps the case where the reshape's blocks are exchanged
        # (planned without latency, as _llama)
        from eins.hardware.presets import get_topology
        low = eins.distribute(fn, devices=4, backend="interpret",
                              topology=get_topology("dgx-a100:4").without_latency(),
                              plan={9: {"d0": 2, "d1": 2}}).lower(*args)
    dprog = low.physical.device
    prog, gp = dprog.program, low.generate("cuda")
    rs_, tr_ = "reshape", "transpose"
    for d in dprog.devices:
        code, walk, src = dprog.code[d], gpu_walk(dprog, d), gp.sources[d]
        allocated = walk.memory_plan()[0]
        life = memory.lifetimes(code, walk.positions, allocated)
        [j] = [j for j, i in enumerate(code)
               if i.kind == "kernel" and prog.eqns[i.eqn].prim == "attention"]
        chain, mm = _layout_chain(code, prog, code[j].ins[2])
        whole = False
        if packed and p > 1:
            assert chain == [] and j not in walk.views
        else:
            # batched at p=4, the reshape's blocks are exchanged (slice, send, recv, concat)
            # between the devices before the transpose: only the transpose folds there
            whole = p < 4
            prims = [prog.eqns[code[k].eqn].prim for k in chain]
            assert prims == ([rs_, tr_] if whole else [tr_])
            assert walk.folded == {**walk.folded, **{k: j for k in chain}}
            assert sorted(walk.views[j]) == [2]
            assert not {code[k].outs[0] for k in chain} & set(allocated)
            assert life[mm][1] >= j
            view = f"B[{mm!r}]"
            for k in chain:
                view += (f".reshape({tuple(code[k].fspec.outputs[0].shape)})" if
                         prog.eqns[code[k].eqn].prim == rs_ else
                         f".permute{tuple(prog.eqns[code[k].eqn].params['axes'])}")
            assert f"{view}, causal=" in src
        if whole:  # the attention's output's layout change folds too: none is launched
            assert src.count("dev.op('transpose'") == src.count("dev.op('reshape'") == 0
    _close(low.compile("interpret")(*args), eins.jit(fn)(*args), fn, args)


def _heads_attention(split):
    """attention of q, k, v: x @ w -> reshape [S, 2, 8] -> transpose [2, S, 8] each; v's
    split by ``split`` (True: [S, 8, 2] -> [2, S, 8] with the head dim strided)."""
    def f(x, wq, wk, wv):
        def heads(t):
            return t.reshape(8, 2, 8).transpose(1, 0, 2)
        v = x @ wv
        v = v.reshape(8, 8, 2).transpose(2, 0, 1) if split else heads(v)
        return eins.attention(heads(x @ wq), heads(x @ wk), v, causal=True)
    rng = np.random.default_rng(7)
    args = [(rng.standard_normal(s) / 2).astype(np.float32)
            for s in [(8, 16), (16, 16), (16, 16), (16, 16)]]
    return f, args


def test_memory_plan_keeps_a_folded_attention_operand_until_the_attention():
    """q, k and v all fold into the attention: their matmuls' buffers are read where the
    attention launches. v's matmul comes first, so planned at the layout kernels' own
    positions its storage would go to q's matmul written after it (the case matters)."""
    from eins.codegen.gpu_walk import gpu_walk
    f, args = _heads_attention(False)
    low = eins.distribute(f, devices=1, backend="interpret").lower(*args)
    dprog = low.physical.device
    code, bufs, walk = dprog.code[0], dprog.bufs[0], gpu_walk(dprog, 0)
    [j] = list(walk.views)
    assert sorted(walk.views[j]) == [0, 1, 2] and len(walk.folded) == 6
    srcs = [_layout_chain(code, dprog.program, code[j].ins[i])[1] for i in range(3)]
    vmm, qmm = srcs[2], srcs[0]
    allocated, _ = assert_plan_keeps_until_launch(walk, code, bufs, vmm, qmm, j, walk.folded)
    assert len(allocated) == 8          # x, 3 weights, 3 matmuls, the attention's output
    np.testing.assert_allclose(low.compile("interpret")(*args), eins.jit(f)(*args),
                               rtol=1e-5, atol=1e-5 * 16)


def test_a_layout_chain_with_a_strided_head_dim_stays_a_copy():
    """The attention launchers need a unit stride in the head dim: v as [S, 8, 2] ->
    [2, S, 8] would have stride 2 there, so its layout change stays kernels (a contiguous
    copy) while q's and k's fold; the result equals eins.jit."""
    from eins.codegen.gpu_walk import gpu_walk, unit_last_stride
    f, args = _heads_attention(True)
    low = eins.distribute(f, devices=1, backend="interpret").lower(*args)
    dprog = low.physical.device
    walk, src = gpu_walk(dprog, 0), low.generate("cuda").sources[0]
    [j] = list(walk.views)
    assert sorted(walk.views[j]) == [0, 1] and len(walk.folded) == 4
    assert src.count("dev.op('transpose'") == src.count("dev.op('reshape'") == 1
    np.testing.assert_allclose(low.compile("interpret")(*args), eins.jit(f)(*args),
                               rtol=1e-5, atol=1e-5 * 16)
    rs, tr = "reshape", "transpose"
    assert unit_last_stride([rs, tr], [{}, {"axes": (1, 0, 2)}])
    assert unit_last_stride([rs, rs], [{}, {}])
    assert not unit_last_stride([rs, tr], [{}, {"axes": (2, 0, 1)}])
    assert unit_last_stride([tr, tr], [{"axes": (0, 2, 1)}, {"axes": (0, 2, 1)}])
    assert not unit_last_stride([tr, rs], [{"axes": (1, 0, 2)}, {}])  # reshape may copy


def test_attention_launchers_read_the_folded_views_as_copies():
    """What a fold passes (``B[mm].reshape((S, H, D)).permute(1, 0, 2)``: strided, unit
    head-dim stride) gives the same results as contiguous copies in both launchers the
    attention lowering uses: the whole kernel and the key-split pair kernel (the
    ``partial`` lowering), which share the strided ``_launch``; so the walk folds for
    partials as well. Bitwise: the same kernel reads the same values."""
    from eins.kernels.attention import attention, attention_pairs
    g = torch.Generator().manual_seed(8)
    mq, mk, mv = (torch.randn(16, h * 8, generator=g) for h in (4, 2, 2))
    views = [m.reshape(16, m.shape[1] // 8, 8).permute(1, 0, 2) for m in (mq, mk, mv)]
    assert not views[2].is_contiguous() and views[2].stride(-1) == 1
    copies = [t.contiguous() for t in views]
    kw = dict(causal=True, segments=(4, 12, 16))
    assert torch.equal(attention(*views, **kw), attention(*copies, **kw))
    q, k, v = (t[:, 4:12] if n == 0 else t[:, :8] for n, t in enumerate(views))
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    got, want = (attention_pairs(a, b, c, torch.empty(4, 8, 8, 2), q_offset=4, **kw)
                 for a, b, c in ((q, k, v), (qc, kc, vc)))
    assert torch.equal(got, want) and torch.isfinite(got[..., 0]).all()
