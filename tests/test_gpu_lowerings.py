"""The GPU kernels' lowerings of the primitives on the CPU (backend="interpret": Triton's
interpreter on torch CPU tensors), each equal to eins.jit / numpy: the other primitives'
torch lowerings, attention split by queries and by keys, the paper block at 128K in linear
memory, einsum and integer contractions, and what a bug hunt on this backend found.
Split from test_gpu_runtime.py (the runtime's streams, events, graphs and placement)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the test extra installs torch (CPU) and triton

import eins  # noqa: E402
from eins.models import llama  # noqa: E402
from eins.runtime import gpu  # noqa: E402
from helpers import SPREAD, accumulation, assert_close, assert_splits  # noqa: E402

F32 = np.float32


def close(got, want, fn, args):
    """``got`` equals ``want`` up to the shared tolerance rule (tests/helpers.assert_close)
    for the accumulations of ``fn`` traced on ``args``."""
    n, depth = accumulation(eins.make_ir(fn)(*args))
    assert_close(np.asarray(got), np.asarray(want), n=n, depth=depth)


def _shapes_and_reductions(x, w, b):
    h = eins.einsum("ij,jk->ik", x, w)
    h = eins.layer_norm(h, b, b, eps=1e-5)
    s = eins.softmax(h, axis=-1)
    t = eins.transpose(eins.reshape(s, (4, 2, 24)), (1, 0, 2))
    c = eins.concatenate([t, t * 2.0], axis=2)
    m = eins.mean(c, axis=2) + eins.max(c, axis=(0, 2), keepdims=True)[0, :, 0] \
        - eins.min(c, axis=2)
    return eins.sum(m, axis=0), eins.slice(c, (0, 1, 3), (2, 4, 40))


def _ints_and_bools(a, b):
    c = a * 3 + b
    m = eins.where(c > 4, c, a - b)
    return eins.sum(m, axis=1), (a < b)


@pytest.mark.parametrize("p", [1, 4])
def test_torch_lowerings_of_the_other_primitives(p):
    # einsum, layer_norm, softmax, reshape, transpose, concatenate, slice, sum/mean/max/min,
    # integer and boolean elementwise ops: the runtime's torch lowerings and fused kernels
    rng = np.random.default_rng(5)
    cases = [(_shapes_and_reductions, (rng.standard_normal((8, 16)).astype(F32),
                                       rng.standard_normal((16, 24)).astype(F32),
                                       rng.standard_normal(24).astype(F32))),
             (_ints_and_bools, (rng.integers(-5, 5, (8, 6)).astype(np.int32),
                                rng.integers(-5, 5, (8, 6)).astype(np.int32)))]
    for fn, args in cases:
        want = eins.jit(fn)(*args)
        got = eins.distribute(fn, devices=p, backend="interpret")(*args)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            if w.dtype.kind in "ib":
                np.testing.assert_array_equal(g, w)
            else:
                close(g, w, fn, args)


@pytest.mark.parametrize("split", ["sequence", "kv_sequence", "both"])
def test_sequence_split_attention_with_the_lse_aggregation(split):
    # query blocks with global offsets (the Triton kernel) and key-split partials as
    # (o, lse) pairs combined by the lse ⊕ kernel, packed segments, grouped-query heads
    rng = np.random.default_rng(2)
    q = rng.standard_normal((8, 16, 8)).astype(F32)
    k, v = (rng.standard_normal((2, 16, 8)).astype(F32) for _ in range(2))

    def f(q, k, v):
        return eins.attention(q, k, v, causal=True, segments=(5, 16)) * 2.0

    plan = {"sequence": 4} if split == "sequence" else {"kv_sequence": 4} if (
        split == "kv_sequence") else {"sequence": 2, "kv_sequence": 2}
    for graphs in (False, True):
        d = eins.distribute(f, devices=4, plan={0: plan}, backend="interpret", graphs=graphs)
        close(d(q, k, v), eins.jit(f)(q, k, v), f, (q, k, v))
    spec = d.lower(q, k, v).physical.plan.eqn_plans[0].spec
    assert spec.aggs == (("lse",) if split != "sequence" else (None,))


# ----------------------------------------------------------------------------- key splits
def _attention_launches():
    import sys
    import eins.kernels.attention  # noqa: F401 (the module, not the launcher)
    return dict(sys.modules["eins.kernels.attention"].LAUNCHES)


def _partial_kernels(dprog):
    """Kernel instructions of every device whose outputs are (o, lse) pairs."""
    from eins.ir.device import Kernel
    from eins.ir.joinagg import is_lse_pair
    return sum(isinstance(i, Kernel) and any(is_lse_pair(dprog.bufs[d][o].dtype) for o in i.outs)
               for d, code in dprog.code.items() for i in code)


def _no_torch_attention(monkeypatch):
    """The torch lowering of attention raises: only the Triton kernels may run it."""
    import dataclasses
    from eins.ir.primitive import get_primitive

    def refuse(*a, **k):
        raise AssertionError("the torch attention lowering ran")
    prim = get_primitive("attention")
    monkeypatch.setitem(prim.lowerings, None,
                        dataclasses.replace(prim.lowering(), fallback=refuse))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("segments", [None, (5, 16)], ids=["one", "packed"])
def test_key_split_attention_runs_the_triton_kernels(segments, p, dtype, monkeypatch):
    # causal grouped-query attention with a forced kv_sequence split: each block's (o, lse)
    # partial comes from the Triton flash-attention kernel (global query/key offsets, so
    # the causal and segment masks are the whole's), the ⊕ from the Triton lse kernel,
    # finalized to the output dtype; equal to eins.jit by the dtype's tolerance
    _no_torch_attention(monkeypatch)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 16, 8)).astype(dtype)
    k, v = (rng.standard_normal((2, 16, 8)).astype(dtype) for _ in range(2))

    def f(q, k, v):
        return eins.attention(q, k, v, causal=True, segments=segments)

    d = eins.distribute(f, devices=p, plan={0: {"kv_sequence": p}}, backend="interpret",
                        graphs=False)
    low = d.lower(q, k, v)
    assert low.physical.plan.eqn_plans[0].spec.aggs == ("lse",)
    dprog = low.physical.device
    parts = _partial_kernels(dprog)
    assert parts == p
    before = _attention_launches()
    got = d(q, k, v)
    after = _attention_launches()
    assert after["attention_pairs"] - before["attention_pairs"] == parts
    assert after["attention"] == before["attention"]   # no unsplit block here
    assert got.dtype == dtype
    close(got, eins.jit(f)(q, k, v), f, (q, k, v))
    kernels = low.compile("interpret", None, False).gpu.generated.sources["kernels"]
    assert f"def agg_lse_final_{np.dtype(dtype).name}_" in kernels  # the Triton ⊕


def _llama_attention_eqn(fn, args):
    prog = eins.make_ir(fn)(*args)
    (i,) = [j for j, e in enumerate(prog.eqns) if e.prim == "attention"]
    return i


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("p", [2, 4])
def test_llama_block_with_a_key_split_attention(p, dtype, monkeypatch):
    # the LLaMA tiny block with packed segments, its attention forced to a kv_sequence
    # split (the rest planned freely), on the GPU path == eins.jit
    _no_torch_attention(monkeypatch)
    cfg, segs, s = llama.TINY, (4, 12, 16), 16
    rng = np.random.default_rng(6)
    w = llama.init_weights(cfg, rng, dtype=np.dtype(dtype).name)
    x = rng.standard_normal((s, cfg.d_model)).astype(dtype)
    cos, sin = llama.rope_tables(s, cfg.head_dim, segs, dtype=np.dtype(dtype).name)
    fn, args = llama.block_fn(cfg, segs), (x, w, cos, sin)
    i = _llama_attention_eqn(fn, args)
    d = eins.distribute(fn, devices=p, plan={i: {"kv_sequence": p}}, backend="interpret")
    low = d.lower(*args)
    assert low.physical.plan.eqn_plans[i].spec.aggs == ("lse",)
    parts = _partial_kernels(low.physical.device)
    assert parts >= p
    before = _attention_launches()["attention_pairs"]
    got = d(*args)
    # graphs: the first call runs eagerly, then captures and replays (two launches each)
    assert _attention_launches()["attention_pairs"] - before == 2 * parts
    assert got.dtype == dtype
    close(got, eins.jit(fn)(*args), fn, args)


# ----------------------------------------------------------------------------- 1 x 128K
H200_BYTES = 139 * 2 ** 30   # the memory torch reports on one H200


def _slots_and_buffers(gp, d):
    ns = {}
    exec(gp.sources[d].split("# literal operands")[0], ns)  # noqa: S102 - our own source
    return ns["SLOTS"], ns["BUFFERS"]


def _paper_block_at(s):
    cfg = llama.PAPER
    x = eins.ShapeDtype((s, cfg.d_model), "float16")
    cs = eins.ShapeDtype((s, cfg.head_dim), "float16")
    low = eins.distribute(llama.block_fn(cfg, None), devices=1).lower(
        x, llama.weight_shapes(cfg, "float16"), cs, cs)
    return low, low.generate("cuda")


def test_paper_block_at_128k_tokens_fits_one_gpu_in_linear_memory():
    # issue 9: "1x128K at p=1 runs on one GPU", attention in O(S) memory. Shape-only: the
    # paper block (float16) lowered for the GPU backend at 32K, 64K and 128K tokens; the
    # static memory plan (eins/codegen/memory.py) is what the runtime allocates
    sizes = {}
    for s in (32768, 65536, 131072):
        low, gp = _paper_block_at(s)
        slots, buffers = _slots_and_buffers(gp, 0)
        sizes[s] = sum(slots.values())
        # no buffer anywhere is S x S (scores never materialize)
        assert not [b for b in buffers.values() if sum(n >= s for n in b[0]) > 1]
    assert sizes[131072] < H200_BYTES
    # linear in S: doubling S twice adds twice the bytes the first doubling did
    assert (sizes[131072] - sizes[65536]) == 2 * (sizes[65536] - sizes[32768])
    # the attention goes to the Triton flash kernel (O(S): no temporaries), not the torch
    # lowering that forms the scores: the runtime's launcher takes it (meta tensors)
    from eins.ir.device import Kernel
    from eins.runtime.gpu_ops import launcher, torch_dtype
    dprog = low.physical.device
    bufs = dprog.bufs[0]
    (att,) = [i for i in dprog.code[0] if isinstance(i, Kernel) and
              dprog.program.eqns[i.eqn].prim == "attention"]
    meta = [torch.empty(bufs[n].box.shape, dtype=torch_dtype(bufs[n].dtype), device="meta")
            for n in att.ins + att.outs]
    eqn = dprog.program.eqns[att.eqn]
    assert launcher("attention", att.fspec, meta[3:], meta[:3], eqn.params) is not None


def test_paper_block_at_128k_with_a_key_split_attention_fits_each_gpu():
    # the same block at 128K tokens on 4 devices with its attention split along the keys:
    # every device holds (o, lse) pair partials and still needs less than the p=1 program
    from eins.ir.joinagg import is_lse_pair
    cfg, s = llama.PAPER, 131072
    x = eins.ShapeDtype((s, cfg.d_model), "float16")
    cs = eins.ShapeDtype((s, cfg.head_dim), "float16")
    fn, args = llama.block_fn(cfg, None), (x, llama.weight_shapes(cfg, "float16"), cs, cs)
    i = _llama_attention_eqn(fn, args)
    low = eins.distribute(fn, devices=4, plan={i: {"kv_sequence": 4}}).lower(*args)
    gp, dprog = low.generate("cuda"), low.physical.device
    one = sum(_slots_and_buffers(_paper_block_at(s)[1], 0)[0].values())
    for d in dprog.devices:
        slots, buffers = _slots_and_buffers(gp, d)
        assert any(is_lse_pair(b.dtype) for b in dprog.bufs[d].values())
        assert not [b for b in buffers.values() if sum(n >= s for n in b[0]) > 1]
        assert sum(slots.values()) < one < H200_BYTES


def test_bool_einsum_is_numpys():
    # torch has no bool bmm: the einsum lowering raised NotImplementedError
    p = np.array([[True, False], [True, True]])
    q = np.array([[False, True], [True, False]])
    fn = lambda x, y: np.einsum("ij,jk->ik", x, y)   # noqa: E731
    got = eins.distribute(fn, devices=2, backend="interpret")(p, q)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, fn(p, q))


@pytest.mark.parametrize("dtype", [np.float32, np.bool_, np.int32])
def test_einsum_through_the_torch_fallback_is_numpys(dtype):
    """With the runtime's kernel launchers off (Runtime.kernels, "to compare the two"),
    einsum takes its torch fallback (eins/ops/linalg.py): numpy's result there too, bool
    included."""
    rng = np.random.default_rng(4)
    p, q = ((rng.random(s) < 0.4) if dtype is np.bool_ else
            rng.integers(-3, 4, s).astype(dtype) for s in [(3, 5, 4), (3, 4, 2)])
    fn = lambda x, y: np.einsum("bij,bjk->bik", x, y)   # noqa: E731
    c = eins.distribute(fn, devices=2).lower(p, q).compile("interpret", graphs=False)
    c.gpu.rt.kernels = False
    got = c(p, q)
    assert got.dtype == fn(p, q).dtype
    np.testing.assert_array_equal(got, fn(p, q))


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("subscripts", ["abc,pqacb->q", "ij,i->", "ij,jk->"])
def test_int32_einsum_summing_one_operands_index_is_numpys(subscripts, kernels):
    """torch's int32 einsum sums an index of one operand alone (p of 'abc,pqacb->q') in
    int64, then refuses the mix: 'expected scalar type Int but found Long' (a fuzz hunt)."""
    rng = np.random.default_rng(5)
    shapes = {"abc,pqacb->q": [(2, 3, 4), (2, 5, 2, 4, 3)], "ij,i->": [(3, 4), (3,)],
              "ij,jk->": [(3, 4), (4, 2)]}[subscripts]
    xs = [rng.integers(-3, 4, s).astype(np.int32) for s in shapes]
    fn = lambda *a: np.einsum(subscripts, *a)   # noqa: E731
    want = fn(*xs)
    for p in (1, 2):
        low = eins.distribute(fn, devices=p, tuning=SPREAD).lower(*xs)
        if p > 1:
            assert_splits(low)   # partial int32 sums added across the devices
        c = low.compile("interpret", graphs=False)
        c.gpu.rt.kernels = kernels
        got = c(*xs)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("subscripts", ["ab,a->", "ab,b,a->"])
def test_half_precision_einsum_rounds_once_as_the_numpy_kernel(subscripts, dtype, kernels):
    """Found by fuzzing: the GPU einsum ran torch.einsum in float16/bfloat16, which rounds
    its intermediates to that dtype: the row sums of a letter only one operand carries (b
    of 'ab,a->') and the pairwise products of three operands. Here they are 2049 and -2048
    (in bfloat16 257 and -256), which round to +-2048 (+-256), so the result was 0 where
    eins.jit, in float32 throughout and rounded once, returns 1 (a 2% error on random
    float16 data of 80 terms, against 0.05% for one rounding)."""
    big = 2048 if dtype == "float16" else 256
    dt = eins.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x, y = np.array([[big, 1], [-big, 0]], dt), np.array([1, 1], dt)
    args = (x, y) if subscripts == "ab,a->" else (x, y, y)
    fn = lambda *a: np.einsum(subscripts, *a)   # noqa: E731
    assert float(eins.jit(fn)(*args)) == 1.0
    c = eins.distribute(fn, devices=1).lower(*args).compile("interpret", graphs=False)
    c.gpu.rt.kernels = kernels
    got = c(*args)
    assert got.dtype == dt and float(got) == 1.0


@pytest.fixture
def no_integer_gemm(monkeypatch):
    """torch as on CUDA: cuBLAS has no integer GEMM, so torch's int32/int64 matmul, mm, bmm
    and many-operand einsum raise there ('"addmm_cuda" not implemented for 'Int'',
    pytorch/pytorch issue 44428) while the CPU build computes them; on a CPU this is how a
    test sees that the GPU runtime never asks for one."""
    def refuse(name, real):
        def f(*ts, **kw):
            ops = [t for t in ts if isinstance(t, torch.Tensor)]
            if any(not t.dtype.is_floating_point and t.dtype != torch.bool for t in ops) \
                    and (name != "einsum" or len(ops) > 1):
                raise RuntimeError(f'"{name}_cuda" not implemented for {ops[0].dtype}')
            return real(*ts, **kw)
        return f
    for name in ("matmul", "mm", "bmm", "einsum"):
        monkeypatch.setattr(torch, name, refuse(name, getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "matmul", refuse("matmul", torch.Tensor.matmul))
    monkeypatch.setattr(torch.Tensor, "__matmul__", refuse("matmul", torch.Tensor.__matmul__))


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_matmul_and_einsum_need_no_integer_gemm(dtype, kernels, no_integer_gemm):
    """Integer matmul and einsum ran on torch's integer GEMM, which CUDA lacks (the GPU
    runtime raised at the first call on a GPU, a case the CPU build could not show). They
    are exact float64 products of limbs now (ops.linalg.int_contraction): numpy's wrapped
    results, values near the dtype's limits included, 3 operands, p = 1 and 2."""
    rng = np.random.default_rng(6)
    big = np.iinfo(dtype).max
    a = rng.integers(-big, big, (6, 8), dtype=dtype)
    b = rng.integers(-big, big, (8, 4), dtype=dtype)
    c = rng.integers(-9, 9, (4, 3)).astype(dtype)
    cases = [(lambda x, y: x @ y, (a, b)),
             (lambda x, y: np.einsum("ij,jk->ik", x, y), (a, b)),
             (lambda x, y, z: np.einsum("ij,jk,kl->li", x, y, z), (a, b, c)),
             (lambda x, y: np.einsum("ij,i->", x, y), (a, a[:, 0]))]
    with np.errstate(over="ignore"):
        for fn, xs in cases:
            want = fn(*xs)
            for p in (1, 2):
                cm = eins.distribute(fn, devices=p).lower(*xs).compile("interpret",
                                                                        graphs=False)
                cm.gpu.rt.kernels = kernels
                got = cm(*xs)
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(got, want)


def test_int_contraction_is_exact_with_narrow_limbs():
    """So many terms that each limb is 6 bits wide (2**40 * 63**2 < 2**53): still numpy's
    int64 product, every product of limbs a float64 GEMM."""
    from eins.ops.linalg import int_contraction
    rng = np.random.default_rng(7)
    x = rng.integers(-2 ** 63, 2 ** 63 - 1, (5, 7), dtype=np.int64)
    y = rng.integers(-2 ** 63, 2 ** 63 - 1, (7, 3), dtype=np.int64)
    seen = []

    def product(p, q):
        seen.append((p.dtype, q.dtype))
        return torch.matmul(p, q)
    got = int_contraction(product, torch.from_numpy(x), torch.from_numpy(y), terms=2 ** 40)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got.numpy(), x @ y)
    # 11 limbs of 6 bits, the pairs (i, j) with 6 (i + j) < 64
    assert len(seen) == sum(1 for i in range(11) for j in range(11) if 6 * (i + j) < 64)
    assert set(seen) == {(torch.float64, torch.float64)}
    # an int32 result needs its low 32 bits only: 2 limbs of 25 bits for 7 terms, 3 GEMMs
    seen.clear()
    x32, y32 = x.astype(np.int32), y.astype(np.int32)
    got = int_contraction(product, torch.from_numpy(x32), torch.from_numpy(y32),
                          terms=7, bits=32).to(torch.int32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got.numpy(), x32 @ y32)
    assert len(seen) == 3


@pytest.mark.parametrize("name", ["int32 @ float16", "int32 @ float32", "bool @ bool",
                                  "int32 @ bool"])
def test_matmul_operands_promote_by_eins_rule(name):
    """The runtime's matmul promoted with torch.promote_types: int32 with float16 is float16
    there, float64 in eins (numpy's rule), so a float64 result was computed in float16 (2049
    became 2048). bool @ bool raised torch's NotImplementedError ('addmm_impl_cpu_' for
    Bool); it is numpy's any(a_ik and b_kj)."""
    rng = np.random.default_rng(3)
    x = {"int32 @ float16": np.full((2, 4), 2049, np.int32),
         "int32 @ float32": np.full((2, 4), 2 ** 24 + 1, np.int32),
         "bool @ bool": rng.random((3, 4)) < 0.3,
         "int32 @ bool": rng.integers(-5, 5, (3, 4)).astype(np.int32)}[name]
    y = {"int32 @ float16": np.eye(4, dtype=np.float16),
         "int32 @ float32": np.eye(4, dtype=np.float32),
         "bool @ bool": rng.random((4, 5)) < 0.3,
         "int32 @ bool": rng.random((4, 5)) < 0.5}[name]
    want = x @ y
    for p in (1, 2):
        got = eins.distribute(lambda a, b: a @ b, devices=p, backend="interpret")(x, y)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_every_triton_launch_names_fp_fusion(monkeypatch):
    # every launch passes enable_fp_fusion=True (build.LAUNCH_OPTIONS): Triton 3.10 turns
    # fused multiply-add off by default, which would change the kernels' speed and rounding
    # with an upgrade, and 3.9 warns at every compile that does not name it. Recorded at
    # the interpreter's launch: the LLaMA block with a key-split attention (fused chains,
    # rms_norm, rope, flash-attention partials, the lse and sum ⊕), the Triton matmul,
    # combine_lse and the rank runtime's ⊕ kernels.
    import torch
    from triton.runtime import interpreter
    from eins.kernels import combine_lse
    from eins.kernels.matmul import matmul
    from eins.runtime.ranks import make_kernels
    launches = []
    real = interpreter.GridExecutor.__call__

    def record(self, *args, **kwargs):
        launches.append((self.fn.__name__, kwargs.get("enable_fp_fusion")))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", record)
    _no_torch_attention(monkeypatch)
    cfg, segs, s = llama.TINY, (4, 12, 16), 16
    rng = np.random.default_rng(6)
    w = llama.init_weights(cfg, rng)
    x = rng.standard_normal((s, cfg.d_model)).astype(F32)
    cos, sin = llama.rope_tables(s, cfg.head_dim, segs)
    fn, args = llama.block_fn(cfg, segs), (x, w, cos, sin)
    i = _llama_attention_eqn(fn, args)
    eins.distribute(fn, devices=2, plan={i: {"kv_sequence": 2}}, backend="interpret",
                    graphs=False)(*args)
    z = torch.zeros
    matmul(z(5, 7), z(7, 3), z(5, 3), impl="triton")
    combine_lse(z(2, 4, 8), z(2, 4), z(2, 4, 8), z(2, 4), z(2, 4, 8), z(2, 4))
    tk = make_kernels("interpret")
    a = tk.load(np.ones((2, 3), F32), np.dtype(F32))
    tk.aggregate("sum", [a, a], np.dtype(F32))
    names = {n for n, _ in launches}
    for kind in ("rms_norm", "rope", "attn", "agg_lse", "matmul", "combine", "agg_sum"):
        assert any(kind in n for n in names), (kind, sorted(names))
    assert all(f is True for _, f in launches), [n for n, f in launches if f is not True]
