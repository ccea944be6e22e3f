"""The GPU runtime's generic lowering machinery: the one launch-or-fallback choice of a
primitive's block (both the GPU runtime, eins/runtime/gpu.py, and the rank runtime,
eins/runtime/gpu_ranks.py, call :func:`launch_or_fallback`), and dtype/array conversions
between numpy, torch and CuPy.

Each primitive's GPU lowering (:class:`eins.ir.primitive.GpuLowering`) is declared in its
op family file (eins/ops/*) beside its reference kernel: a kernel launcher (Triton, cuBLAS
through ``torch.matmul(out=)``), the check of when it applies, and a torch fallback. Every
op is a torch library call or a Triton launch, so it is capturable in ``torch.cuda.graph``.
Key-split blocks (outputs held as (o, lse) pairs) go to the lowering's ``partial`` launcher
where it applies, else to the fallback with ``partial=True``.
"""
from __future__ import annotations

import numpy as np

from eins.errors import GpuError
from eins.ir.primitive import PRIMITIVES, get_primitive
from eins.ir.types import bfloat16, torch_to_numpy
from eins.kernels.build import KernelUnavailable, acc_dtype_name, dtype_name, tl_dtype
from eins.kernels.torch_rules import numpy_dtype, torch_dtype  # noqa: F401


def from_numpy(a):
    """A numpy array as a CPU tensor, sharing memory (bfloat16 through an int16 view)."""
    import torch  # heavy: only the GPU path
    a = np.asarray(a)
    if a.dtype == np.dtype(bfloat16):
        # np.ascontiguousarray makes a 0-d array 1-d: keep the shape
        bits = np.ascontiguousarray(a).view(np.int16).reshape(a.shape)
        return torch.from_numpy(bits).view(torch.bfloat16)
    if not a.flags.writeable:  # torch warns on read-only memory; we never write inputs
        a = a.copy()
    return torch.from_numpy(a)


def to_numpy(t):
    return torch_to_numpy(t)


def triton_acc_dtype(tdt):
    """The Triton dtype ⊕ accumulates in over blocks of torch dtype ``tdt``: the kernel
    library's one rule (:func:`eins.kernels.build.acc_dtype_name`)."""
    import triton.language as tl  # heavy: only the GPU path
    return getattr(tl, tl_dtype(acc_dtype_name(dtype_name(tdt)))[len("tl."):])


# ----------------------------------------------------------------------------- lowering
def launcher(prim, fspec, outs, args, params, choice="auto", platform=None, measured=None):
    """A thunk running the primitive's GPU kernel (its lowering's ``fn``) that writes
    straight into the eqn's output buffers (no temporary, no copy), or None where it does
    not apply (the lowering's ``accepts`` refuses these tensors, or it has only a fallback).

    ``params["partial"]``: a key-split block whose output is a buffer of (o, lse) pairs (a
    trailing axis of 2, float32): the lowering's ``partial`` launcher where
    ``accepts_partial`` takes the tensors. ``choice``: the runtime's kernel choice for the
    lowering's ``choice`` keyword (attention's ``impl``, eins.ir.plan.Options.attention); a
    forced one (not "auto") that ``accepts`` refuses is a KernelUnavailable, never the
    fallback. ``measured``: the runtime's measured kernel table, passed to the lowering's
    ``measured`` keyword under ``choice="auto"``."""
    p = get_primitive(prim)
    low = p.lowering(platform)
    if low is None:
        return None
    params = dict(params)
    if params.pop("partial", False):
        fn = low.partial
        if fn is None or (low.accepts_partial is not None
                          and not low.accepts_partial(outs, args, params)):
            return None
        return lambda: fn(fspec, outs, args, **params)
    if low.fn is None:
        return None
    if low.accepts is not None and not low.accepts(outs, args, params):
        if low.choice is not None and choice != "auto":
            got = sorted({str(getattr(t, "dtype", type(t).__name__))
                          for t in list(args) + list(outs)})
            takes = f" (it takes {low.takes})" if low.takes else ""
            raise KernelUnavailable(
                f"{p.name}={choice!r}: no such kernel for operands {got}{takes}; "
                f"{p.name}='auto' runs the torch lowering there")
        return None
    if low.choice is not None:
        params[low.choice] = choice
    if low.measured is not None and measured and choice == "auto":
        params[low.measured] = measured
    fn = low.fn
    return lambda: fn(fspec, outs, args, **params)


def lowering(prim, platform=None):
    """The torch fallback of primitive ``prim`` (where :func:`launcher` does not apply); a
    GpuError naming the primitive when it has none."""
    p = PRIMITIVES.get(prim) if isinstance(prim, str) else prim
    low = None if p is None else p.lowering(platform)
    if low is None or low.fallback is None:
        name = prim if isinstance(prim, str) else prim.name
        raise GpuError(f"the GPU runtime has no lowering of primitive {name!r} yet; declare "
                       f"a GpuLowering with a fallback in its op family file (eins/ops/*)")
    return low.fallback


def launch_or_fallback(prim, fspec, outs, args, params, choice="auto", kernels=True,
                       platform=None, measured=None):
    """The one launch-or-fallback choice of a block: a thunk running the primitive's kernel
    into ``outs`` (:func:`launcher`; skipped with ``kernels=False``, e.g. to compare the two
    paths), else its torch fallback with the results copied into ``outs`` (cast to their
    dtypes; a result of the output's size but another shape, reshaped)."""
    direct = (launcher(prim, fspec, outs, args, params, choice, platform, measured)
              if kernels else None)
    if direct is not None:
        return direct
    fn = lowering(prim, platform)

    def run():
        res = fn(fspec, *args, **params)
        for o, r in zip(outs, res):
            o.copy_(r.reshape(o.shape) if r.shape != o.shape and r.numel() == o.numel()
                    else r)
    return run
