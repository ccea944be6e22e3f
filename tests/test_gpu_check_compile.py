"""GPU readiness checks that need no GPU: Triton compiles the GPU path's kernels for Hopper
(sm_90, the H200) ahead of time on this CPU machine, with ptxas from Triton's wheel.

The interpreter accepts things the compiler rejects (a kernel whose source Triton cannot read
back, a shared-memory footprint over the chip's limit, a dtype tl.dot refuses), so these tests
compile the kernels exactly as a GPU would launch them: the generated elementwise kernels of a
real program (argument types recorded from an interpreted run) and the flash-attention and
matmul templates at the paper's head dim with their Hopper tile configs."""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import eins  # noqa: E402
from eins.models import llama  # noqa: E402

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
SMEM_SM90 = 232448   # bytes of shared memory one block may use on sm_90 (227 KB)


def aot_compile(fn, args, constexprs, num_warps=4, num_stages=3, enable_fp_fusion=True):
    """Compile JIT function ``fn`` (compiled mode) for sm_90 as a launch with ``args``
    (tensors, ints, floats, in the order of its non-constexpr parameters) would: the
    signature, constants and attributes come from Triton's own launch binder, so pointers
    aligned to 16 bytes and ints divisible by 16 carry ``tt.divisibility`` and ints equal to
    1 are constants, as on the GPU. Without those hints Triton can prove no alignment: it
    neither vectorizes nor pipelines the loads (no cp.async, one stage of shared memory), so
    a footprint measured without them is not the launch's (the 16-bit matmul: 48 KB instead
    of its 144 KB)."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(H200)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kw = dict(constexprs, num_warps=num_warps, num_stages=num_stages)
    names = [p.name for p in fn.params]
    params = [n for n in names if n not in constexprs]
    assert len(args) == len(params), f"{len(args)} arguments for parameters {params}"
    bound, spec, _ = binder(**dict(zip(params, args)), **kw)
    # spec: per parameter (type or "constexpr", attribute code)
    sig = {n: t for n, (t, _) in zip(names, spec)}
    consts = {(i,): bound[n] for i, (n, (t, _)) in enumerate(zip(names, spec))
              if t == "constexpr"}
    attrs = {(i,): backend.parse_attr(a) for i, (t, a) in enumerate(spec)
             if t != "constexpr" and isinstance(a, str)}
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages,
                                     "enable_fp_fusion": enable_fp_fusion})
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=H200,
                          options=options.__dict__)


def registers_and_spills(kern) -> tuple:
    """(registers per thread, bytes of local memory per thread) of ``kern``'s sm_90 cubin,
    read by the cuobjdump in Triton's wheel; local memory in a kernel without arrays of its
    own is register spills."""
    import os
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kern.asm["cubin"])
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
    (regs, local), = re.findall(r"REG:(\d+).*?LOCAL:(\d+)", out)
    return int(regs), int(local)


def tensor_core_pipelined(kern) -> tuple:
    """(Hopper warpgroup MMAs, asynchronous global-to-shared copies) in ``kern``'s PTX: a
    16-bit dot on sm_90's tensor cores is ``wgmma.mma_async``; a software-pipelined loop
    loads through ``cp.async``."""
    ptx = kern.asm["ptx"]
    return (len(re.findall(r"\bwgmma\.mma_async", ptx)),
            len(re.findall(r"\bcp\.async\.c[ag]", ptx)))


def _attention_times_two(q, k, v):
    return eins.attention(q, k, v, causal=True, segments=(5, 16)) * 2.0


def _checked_power(a, b):
    return (a + 1) ** b * 2


def _cases():
    """(name, fn, args, plan): the tiny LLaMA block at p=2 (fused elementwise chains), a
    float16 matmul split along its contraction (the sum ⊕ kernel) and a key-split attention
    (the lse ⊕ kernel on (o, lse) pairs)."""
    rng = np.random.default_rng(0)
    cfg = llama.TINY
    w = llama.init_weights(cfg, rng)
    cos, sin = llama.rope_tables(8, cfg.head_dim, None)
    f16 = np.float16
    q = rng.standard_normal((8, 16, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 16, 8)).astype(np.float32) for _ in range(2))
    return [("llama-tiny", llama.block_fn(cfg, None), (
                rng.standard_normal((8, cfg.d_model)).astype(np.float32), w, cos, sin), None),
            ("matmul-r0", lambda x, y: x @ y, (rng.standard_normal((4, 64)).astype(f16),
                                                rng.standard_normal((64, 4)).astype(f16)),
             {0: {"r0": 4}}),
            ("attention-kv", _attention_times_two, (q, k, v), {0: {"kv_sequence": 2}}),
            ("int-pow-checked", _checked_power, (np.arange(64, dtype=np.int32),
                                                 np.arange(64, dtype=np.int32) % 5), None)]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_generated_kernel_module_loads_and_compiles_for_sm90(monkeypatch, case):
    """The generated kernel module decorates in compiled mode (it once failed there: Triton
    could not read the exec'd source back) and every elementwise and ⊕ kernel a run
    launches compiles for sm_90 with the argument types it was launched with."""
    from eins.runtime import gpu
    from eins.runtime.gpu_exec import exec_sources
    name, fn, args, plan = case
    c = eins.distribute(fn, devices=4 if plan else 2, plan=plan, schedule="naive",
                        synthesis_budget_s=0.05).lower(*args).compile("interpret")
    seen = {}
    for meth in ("ew", "agg", "agg_pairs"):
        orig = getattr(gpu.DeviceRuntime, meth)

        def spy(self, kernel, *rest, _orig=orig, _m=meth, **kw):
            seen.setdefault(kernel.__name__, (_m, rest + ((self.err,) if kw else ())))
            return _orig(self, kernel, *rest, **kw)
        monkeypatch.setattr(gpu.DeviceRuntime, meth, spy)
    c(*args)
    want = {"llama-tiny": {"ew"}, "matmul-r0": {"agg"}, "attention-kv": {"agg_pairs"},
            "int-pow-checked": {"ew"}}[name]
    if name == "int-pow-checked":   # the checked kernel: its error buffer is an argument
        assert any(len(rest) == 3 for _, rest in seen.values()), seen
    assert want <= {m for m, _ in seen.values()}, seen
    K, _ = exec_sources(c.gpu.generated, interpret=False)
    for kname, (meth, rest) in seen.items():
        kfn = getattr(K, kname)
        assert type(kfn).__name__ == "JITFunction", (kname, type(kfn))
        if meth == "ew":
            ins, outs, *err = rest    # err: the check buffer of a checked kernel
            targs = list(ins) + list(outs) + err + [outs[0].numel()]
        else:
            dst, *srcs = rest
            targs = list(srcs) + [dst, dst.numel()]
        ce = {"BLOCK": K.BLOCK}
        if "ACC" in kfn.arg_names:
            ce["ACC"] = triton.language.float32
        kern = aot_compile(kfn, targs, ce)
        assert kern.metadata.shared <= SMEM_SM90
        assert not narrow_offsets(kern.asm["ttir"]), (kname, narrow_offsets(kern.asm["ttir"]))


def narrow_offsets(ttir: str) -> list:
    """The pointer offsets of a flat-index kernel (elementwise, ⊕) that are not 64-bit:
    ``tt.addptr`` lines whose offset is computed (not a constant) and 32-bit. At the paper's
    1 x 128K tokens a flat index reaches 128K x 14336 = 1.9e9 elements (pairs: twice that),
    past 2**31."""
    bad = []
    for line in ttir.splitlines():
        m = re.search(r"tt\.addptr %[\w.]+, (%[\w.]+) : [^,]+, (tensor<\d+x)?(i\d+)", line)
        if m and not m.group(1).startswith("%cst") and m.group(3) != "i64":
            bad.append(line.strip())
    return bad


def test_narrow_offsets_flags_int32_flat_indices():
    """The checker itself: a flat-index kernel with int32 offsets is flagged, its int64
    twin is not."""
    src = '''
@triton.jit
def k32(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)
'''
    from eins.kernels import build
    z = torch.zeros(8)
    narrow = aot_compile(build.compile_source(src, "k32", False), [z, z, 8], {"BLOCK": 256})
    assert narrow_offsets(narrow.asm["ttir"])
    wide = src.replace("tl.program_id(0)", "tl.program_id(0).to(tl.int64)").replace("k32", "k64")
    assert not narrow_offsets(aot_compile(build.compile_source(wide, "k64", False),
                                          [z, z, 8], {"BLOCK": 256}).asm["ttir"])


class _Recorder:
    """Stands in for a compiled kernel: ``kernel[grid](*args, **kw)`` records the launch."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def test_kernel_templates_compile_for_sm90_with_their_hopper_configs():
    """The launchers, told they run on an sm_90 GPU, pick their Hopper tile configs; each
    kernel they would launch compiles for sm_90 as its launch would (see aot_compile) within
    the chip's shared memory and registers, spilling none, with every grid dimension inside
    CUDA's limits: flash attention at head dim 128 in its fullest variant (bfloat16, a
    key-split block with packed segments, offsets and lse) and in the paper block's
    (float16, causal), the Triton matmul at a paper shape and at ragged ones, rms_norm at
    d_model 4096, rope and the lse combine. The 16-bit attention and matmul kernels run on the tensor cores (wgmma) with
    their loads pipelined (cp.async, one shared-memory buffer per stage).

    Run in a fresh process without TRITON_INTERPRET: with it set when triton is imported,
    triton.language's own helpers (the reduce combine functions the templates use) are
    interpreted functions, which a compiled kernel cannot call."""
    # {case: (kernel, bytes of shared memory, wgmma count, cp.async count, registers,
    # bytes of local memory)}
    got = in_fresh_process("compile_templates_for_sm90")
    assert set(got) == {"attn_bf16_seg_lse", "attn_f16_causal", "combine", "matmul_4096",
                        "matmul_ragged", "matmul_batched", "rms_norm", "rope"}, got
    assert all(0 <= b <= SMEM_SM90 for _, b, *_ in got.values()), got
    # no kernel spills registers to local memory, and each fits sm_90's 255 per thread
    assert all(regs <= 255 and local == 0 for *_, regs, local in got.values()), got
    for case in ("attn_bf16_seg_lse", "attn_f16_causal", "matmul_4096", "matmul_ragged",
                 "matmul_batched"):
        _, shared, wgmma, cp_async, _, _ = got[case]
        assert wgmma > 0 and cp_async > 0, (case, got[case])
    # pipelined: the kernels' stages each hold a tile in shared memory. Attention (128 x 64
    # key blocks, head dim 128, 16-bit, 3 stages): the q tile (32 KB) and a k and a v tile
    # (16 KB each) per stage; the matmul's 128 x 256 x 32 tiles (tuned on an H200): an 8 KB
    # and a 16 KB one per stage, 5 stages
    # per stage
    assert got["attn_f16_causal"][1] == 32768 + 3 * 2 * 16384, got
    assert got["matmul_4096"][1] == 5 * (8192 + 16384), got


def in_fresh_process(body: str) -> dict:
    """``body()`` of this module run in a fresh Python without TRITON_INTERPRET (see the
    test above), its printed dict."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here,
                                         env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", "import test_gpu_check_compile as t; "
                        f"print(t.{body}())"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return eval(p.stdout.strip().splitlines()[-1])


def recording():
    """Makes the launchers compile kernels for sm_90 and record their launches instead of
    running them: -> the list their recorders are appended to."""
    from eins.kernels import build
    real, recs = build.compile_source, []

    def compiled(source, name, interpret):
        r = _Recorder(real(source, name, False))
        recs.append(r)
        return r
    build.compile_source = compiled
    build.interpret_for = lambda *t: False
    build.cuda_capability = lambda t: (9, 0)
    return recs


def compiled_launches(launches) -> dict:
    """{case: (kernel name, shared bytes, wgmma instructions, cp.async instructions,
    registers per thread, local bytes)} of each recorded launch compiled for sm_90 (its
    grid checked against CUDA's limits)."""
    out = {}
    for name, (fn, (grid, args, kw)) in launches.items():
        assert grid[0] < 2**31 and all(g <= 65535 for g in grid[1:]), grid
        kw = dict(kw)
        opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kw}
        kern = aot_compile(fn, args, kw, **opts)
        out[name] = ((fn.__name__, kern.metadata.shared) + tensor_core_pipelined(kern)
                     + registers_and_spills(kern))
    return out


def compile_templates_for_sm90() -> dict:
    """The body of the test above (in its own process): :func:`compiled_launches`."""
    from eins.kernels import attention, combine_lse
    from eins.kernels.matmul import matmul
    from eins.kernels.norms import rms_norm, rope
    recs = recording()
    f16, bf16 = torch.float16, torch.bfloat16

    def z(*shape, dt=f16):
        return torch.zeros(shape, dtype=dt)
    s, d = 256, 128
    launches = {}

    def case(name, run):
        before = sum(len(r.calls) for r in recs)
        run()
        calls = [(r.fn, c) for r in recs for c in r.calls]
        assert len(calls) == before + 1, (name, len(calls) - before)
        launches[name] = calls[-1]
    case("attn_bf16_seg_lse", lambda: attention(
        z(4, s, d, dt=bf16), z(1, s, d, dt=bf16), z(1, s, d, dt=bf16),
        z(4, s, d, dt=torch.float32), causal=True, segments=(100, 1024),
        lse=z(4, s, dt=torch.float32), q_offset=512, k_offset=256, impl="triton"))
    case("attn_f16_causal", lambda: attention(z(4, 1024, d), z(1, 1024, d), z(1, 1024, d),
                                              z(4, 1024, d), causal=True, impl="triton"))
    case("combine", lambda: combine_lse(z(4, s, d), z(4, s, dt=torch.float32), z(4, s, d),
                                        z(4, s, dt=torch.float32), z(4, s, d),
                                        z(4, s, dt=torch.float32)))
    case("matmul_4096", lambda: matmul(z(4096, 4096), z(4096, 1024), z(4096, 1024),
                                       impl="triton"))
    case("matmul_ragged", lambda: matmul(z(300, 4096), z(4096, 1000), z(300, 1000),
                                         impl="triton"))
    case("matmul_batched", lambda: matmul(z(3, 200, 96), z(3, 96, 72), z(3, 200, 72),
                                          impl="triton"))
    case("rms_norm", lambda: rms_norm(z(8, 4096), z(4096), z(8, 4096), eps=1e-5))
    case("rope", lambda: rope(z(s, 4, d, dt=bf16).transpose(0, 1), z(s, d, dt=bf16),
                              z(s, d, dt=bf16), z(4, s, d, dt=bf16)))
    return compiled_launches(launches)


def test_training_and_capacity_kernels_compile_for_sm90_without_spilling():
    """Attention's backward (its delta, dK/dV and dQ kernels), the bias gradient's (delta,
    then ALiBi slopes' or an additive bias's) and the forward reading the capacity row
    table, which had only run under the interpreter, compile for sm_90 as the launchers would launch them at head dim 128 in
    16-bit: plain causal, and the packed training variant (segments as a tensor, the
    capacity row table, a window and a softcap); within shared memory and 255 registers
    with no spills, and their matmuls on the tensor cores with pipelined loads."""
    got = in_fresh_process("compile_backward_for_sm90")
    assert set(got) == {f"{c}:{k}" for c, ks in (
        ("fwd_bf16_rows", ("fwd",)), ("bwd_f16_causal", ("delta", "dkdv", "dq")), ("bwd_bf16_rows", ("delta", "dkdv", "dq")),
        ("dbias_alibi_bf16_rows", ("delta", "dbias")), ("dbias_add_f16", ("delta", "dbias")),
        ("dbias_add_bf16_rows", ("delta", "dbias")))
        for k in ks}, got
    assert all(0 <= b <= SMEM_SM90 for _, b, *_ in got.values()), got
    assert all(regs <= 255 and local == 0 for *_, regs, local in got.values()), got
    for case, (_, _, wgmma, cp_async, _, _) in got.items():
        if not case.endswith(":delta"):   # delta is a row sum: no matmul
            assert wgmma > 0 and cp_async > 0, (case, got[case])


def compile_backward_for_sm90() -> dict:
    """The body of the test above (in its own process): :func:`compiled_launches`, each
    case's launches named ``case:kernel`` by the kernel name's last part."""
    from eins.kernels import attention
    from eins.kernels.attention_bwd import attention_bwd
    from eins.kernels.attention_dbias import attention_dbias
    recs = recording()
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    s, d = 256, 128
    ends = torch.tensor([100, 200, 256, 256], dtype=torch.int32)
    table = torch.tensor([[64, 192, 0, 192]])
    launches = {}

    def case(name, run):
        before = sum(len(r.calls) for r in recs)
        run()
        calls = [(r.fn, c) for r in recs for c in r.calls][before:]
        for fn, c in calls:
            kind = fn.__name__.rsplit("_", 1)[1]
            launches[f"{name}:{kind if name.startswith(('bwd', 'dbias')) else 'fwd'}"] = (fn, c)

    def ins(dt):   # q, k, v, o, lse, do: 4 query heads on 1 kv head
        return (torch.zeros(4, s, d, dtype=dt), torch.zeros(1, s, d, dtype=dt),
                torch.zeros(1, s, d, dtype=dt), torch.zeros(4, s, d, dtype=dt),
                torch.zeros(4, s, dtype=f32), torch.zeros(4, s, d, dtype=dt))

    def grads(dt):
        return (torch.zeros(4, s, d, dtype=dt), torch.zeros(1, s, d, dtype=dt),
                torch.zeros(1, s, d, dtype=dt))
    case("fwd_bf16_rows", lambda: attention(
        *ins(bf16)[:3], torch.zeros(4, s, d, dtype=bf16), causal=True, segments=ends,
        rows=table, window=64, softcap=30.0, lse=torch.zeros(4, s, dtype=f32),
        impl="triton"))
    case("bwd_f16_causal", lambda: attention_bwd(*ins(f16), *grads(f16), causal=True))
    case("bwd_bf16_rows", lambda: attention_bwd(*ins(bf16), *grads(bf16), causal=True,
                                                segments=ends, rows=table, window=64,
                                                softcap=30.0))
    case("dbias_alibi_bf16_rows", lambda: attention_dbias(
        *ins(bf16), torch.zeros(4), torch.zeros(4), bias_kind="alibi", causal=True,
        segments=ends, rows=table))
    case("dbias_add_bf16_rows", lambda: attention_dbias(
        *ins(bf16), torch.zeros(4, s, s, dtype=bf16), torch.zeros(4, s, s, dtype=bf16),
        bias_kind="add", causal=True, segments=ends, rows=table, window=64, softcap=30.0))
    case("dbias_add_f16", lambda: attention_dbias(
        *ins(f16), torch.zeros(4, s, s, dtype=f16), torch.zeros(4, s, s, dtype=f16),
        bias_kind="add", causal=True))
    return compiled_launches(launches)
