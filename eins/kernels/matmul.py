"""Batched matmul on torch tensors for eins's ``matmul`` primitive (eins/ops/linalg.py):
``out = a @ b`` with numpy batch broadcasting, float32 accumulation, the result in
``out``'s dtype (the eqn's), and no upcast copies of float16/bfloat16 operands.

Two paths, both capturable in a CUDA graph:
- ``impl="torch"`` (the default): ``torch.matmul(a, b, out=out)``, i.e.
  cuBLAS with fp32 accumulation on the tensor cores. Operands of different dtypes go to the
  Triton path (torch.matmul would need a cast copy).
- ``impl="triton"``: the template ``triton_matmul.py.j2``; tile configs per GPU generation
  are chosen ahead of time (``CONFIGS``), never autotuned in the hot path.
benchmarks/gpu_kernels.py times both (docs/measured.md).

``add=c`` (a residual add fused in by the generated walk, eins/codegen/gpu_walk.py): ``out =
a @ b + c`` for ``c`` of ``out``'s shape and dtype. On the torch path that is ONE torch call,
``torch.addmm`` / ``torch.baddbmm`` with beta = alpha = 1 (the add is the GEMM's epilogue:
fp32 accumulation, one rounding to the output dtype), on views that flatten the batch dims of
contiguous operands; other layouts (a broadcast batch) and the Triton path run the matmul,
then ``out += c``. On CUDA, torch's addmm/baddbmm first copies ``c`` into ``out`` (aten's
addmm_out_cuda_impl): out of place, the bytes of the unfused pair. So the generated walk
writes in place where it may (``out`` IS ``c``: c last read by this launch, a plain buffer
of the device's stream, :func:`one_call` true; eins/codegen/memory.py
``in_place_residuals``), where aten's copy of c onto itself is a no-op and ONE GEMM reads c
and writes the sum over it.
"""
from __future__ import annotations

import itertools
import math

from eins.kernels import build
from eins.errors import DTypeError, GpuError, ShapeError
from eins.ir.rules import matmul_shape

TEMPLATE = "triton_matmul.py.j2"

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages). 16-bit on Hopper: the fastest
# of a sweep on one H200 at the paper's projection shapes, still no faster than cuBLAS, which
# stays the default (impl="torch"; docs/measured.md, "Behind the code's constants").
# Ampere's 16-bit tiles are the tutorial's (not measured); float32 operands (exact IEEE
# dots) take smaller tiles.
CONFIGS = {
    ("sm90", 2): (128, 256, 32, 8, 8, 5),
    ("sm80", 2): (128, 128, 32, 8, 4, 4),
    ("sm90", 4): (64, 64, 32, 8, 4, 3),
    ("sm80", 4): (64, 64, 32, 8, 4, 3),
}
INTERPRET_CONFIG = (32, 32, 32, 4, 1, 1)


def config_for(a, b, m) -> tuple:
    major, _ = build.cuda_capability(a)
    if major == 0:
        return INTERPRET_CONFIG
    width = max(a.element_size(), b.element_size())
    cfg = CONFIGS[("sm90" if major >= 9 else "sm80", 2 if width <= 2 else 4)]
    if m <= 64 and cfg[0] > 64:  # skinny: don't waste half of every tile
        cfg = (64,) + cfg[1:]
    return cfg


def matmul_source(a_dtype, b_dtype, c_dtype, interpret=False) -> str:
    """The generated Triton source of one dtype specialization."""
    an, bn, cn = (build.dtype_name(d) for d in (a_dtype, b_dtype, c_dtype))
    wide = "float32" in (an, bn) or "float64" in (an, bn)
    mixed = an != bn
    name = _name(an, bn, cn)
    ups = {n: (".to(tl.float32)" if mixed else build.dot_upcast(n, interpret)) for n in (an, bn)}
    return build.render(TEMPLATE, name=name, a_dtype=an, b_dtype=bn, c_dtype=cn,
                         cast_a=ups[an], cast_b=ups[bn],
                         dot_kw=', input_precision="ieee"' if wide or mixed else "")


def _name(an, bn, cn):
    return f"matmul_{an}_{bn}_{cn}"


def _batch_plan(shape, strides_list):
    """Merge adjacent batch dims whose strides chain in every operand; returns a list of
    (size, (stride per operand)) from outer to inner."""
    dims = [(n, tuple(s[i] for s in strides_list)) for i, n in enumerate(shape) if n != 1]
    merged = []
    for n, st in dims:
        if merged:
            pn, pst = merged[-1]
            if all(ps == s * n for ps, s in zip(pst, st)):
                merged[-1] = (pn * n, st)
                continue
        merged.append((n, st))
    return merged


def _check(a, b, out):
    batch, want = matmul_shape(a.shape, b.shape)  # the primitive's own shape rule
    if tuple(out.shape) != want:
        raise ShapeError(f"matmul: out has shape {tuple(out.shape)}, expected {want}")
    for n, t in (("a", a), ("b", b), ("out", out)):
        if build.dtype_name(t.dtype) not in ("float16", "bfloat16", "float32"):
            raise DTypeError(f"matmul: {n} has dtype {t.dtype}; the GPU matmul takes float16, "
                             f"bfloat16 or float32")
    return tuple(batch)


def matmul(a, b, out, *, impl="torch", config=None, add=None):
    """``out[...] = a @ b`` (``+ add``: see the module docstring); returns ``out``."""
    batch = _check(a, b, out)
    if impl not in ("torch", "triton"):
        raise ShapeError(f"matmul: impl must be 'torch' or 'triton', got {impl!r}")
    if add is not None:
        return _matmul_add(a, b, add, out, impl, config)
    if impl == "torch" and a.dtype == b.dtype == out.dtype:
        import torch  # heavy: only the GPU path
        return torch.matmul(a, b, out=out)
    interpret = build.interpret_for(a, b, out)
    m, k = a.shape[-2:]
    n = b.shape[-1]
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    ab = a.expand(batch + (m, k))
    bb = b.expand(batch + (k, n))
    plan = _batch_plan(batch, [ab.stride()[:-2], bb.stride()[:-2], out.stride()[:-2]])
    outer = plan[:-2]
    plan = [(1, (0, 0, 0))] * (2 - len(plan[-2:])) + plan[-2:]
    an, bn, cn = (build.dtype_name(t.dtype) for t in (a, b, out))
    fn = build.compile_source(matmul_source(a.dtype, b.dtype, out.dtype, interpret),
                               _name(an, bn, cn), interpret)
    bm, bnn, bk, gm, warps, stages = config or config_for(a, b, m)
    grid = (((m + bm - 1) // bm) * ((n + bnn - 1) // bnn), plan[0][0] * plan[1][0])
    launch = build.launch_options(interpret, num_warps=warps, num_stages=stages)
    (n1, s1), (n2, s2) = plan
    # batch dims that do not merge into two strided ones (rare): one launch each
    for idx in itertools.product(*(range(o[0]) for o in outer)):
        off = [sum(i * o[1][t] for i, o in zip(idx, outer)) for t in range(3)]
        fn[grid](ab.as_strided(ab.shape, ab.stride(), ab.storage_offset() + off[0]),
                 bb.as_strided(bb.shape, bb.stride(), bb.storage_offset() + off[1]),
                 out.as_strided(out.shape, out.stride(), out.storage_offset() + off[2]),
                 m, n, k, n2, s1[0], s2[0], ab.stride(-2), ab.stride(-1), s1[1], s2[1],
                 bb.stride(-2), bb.stride(-1), s1[2], s2[2], out.stride(-2), out.stride(-1),
                 BLOCK_M=bm, BLOCK_N=bnn, BLOCK_K=bk, GROUP_M=gm, EVEN_M=m % bm == 0,
                 EVEN_N=n % bnn == 0, EVEN_K=k % bk == 0,
                 **launch)
    return out


def one_call(a_shape, b_shape) -> bool:
    """Whether ``matmul(a, b, out, add=c)`` on the torch path (operands of out's dtype,
    contiguous out) is ONE addmm/baddbmm, the only form that may write in place (``out``
    the same memory as ``c``): both operands at least 2-D, and b 2-D (the rows of every
    batch, one addmm) or the batch dims equal (one baddbmm)."""
    return len(a_shape) >= 2 and len(b_shape) >= 2 and \
        (len(b_shape) == 2 or tuple(a_shape[:-2]) == tuple(b_shape[:-2]))


def _matmul_add(a, b, c, out, impl, config):
    """``out = a @ b + c`` (``matmul(..., add=c)``)."""
    import torch  # heavy: only the GPU path
    if tuple(c.shape) != tuple(out.shape):
        raise ShapeError(f"matmul: add has shape {tuple(c.shape)}; it must be out's, "
                         f"{tuple(out.shape)} (no broadcasting)")
    if c.dtype != out.dtype:
        raise DTypeError(f"matmul: add has dtype {c.dtype}; it must be out's, {out.dtype}")
    if impl == "torch" and a.dtype == b.dtype == out.dtype and one_call(a.shape, b.shape):
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        if a.dim() == b.dim() == 2:
            return torch.addmm(c, a, b, out=out)
        # batch dims flattened (views of contiguous blocks, as every buffer is); the batch
        # count named, not -1, which a zero-size block leaves ambiguous
        nb = math.prod(a.shape[:-2])
        if b.dim() == 2 and out.is_contiguous():   # the rows of every batch: one GEMM
            torch.addmm(c.reshape(nb * m, n), a.reshape(nb * m, k), b,
                        out=out.view(nb * m, n))
            return out
        if a.shape[:-2] == b.shape[:-2] and out.is_contiguous():
            torch.baddbmm(c.reshape(nb, m, n), a.reshape(nb, m, k), b.reshape(nb, k, n),
                          out=out.view(nb, m, n))
            return out
    if out.data_ptr() == c.data_ptr() and out.numel():
        raise GpuError("matmul: add may not share memory with out outside the one-call "
                       "(addmm/baddbmm) path")
    matmul(a, b, out, impl=impl, config=config)
    return out.add_(c)
