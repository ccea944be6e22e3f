"""eins's dtype rules on torch tensors: what the GPU lowerings of the op family files
(eins/ops/*) compute in, and the dtype maps between numpy and torch with the runtime's
errors. One place, so the torch fallbacks and the Triton launchers cannot disagree with the
reference kernels."""
from __future__ import annotations

import numpy as np

from eins.errors import DTypeError, GpuError
from eins.ir.rules import compute_dtype, float_dtype
from eins.ir.types import SUPPORTED_NAMES, result_dtype
from eins.kernels import build


def torch_dtype(dt):
    """The torch dtype of a numpy dtype: the kernels' name-based map
    (``eins.kernels.build.torch_dtype``), so the runtime and the Triton launchers
    cannot disagree."""
    try:
        return build.torch_dtype(np.dtype(dt))
    except DTypeError as e:
        raise GpuError(f"dtype {np.dtype(dt)} has no torch equivalent on the GPU runtime") from e


def numpy_dtype(tdt):
    """The numpy dtype of a torch dtype (the kernels' map; bfloat16 is ml_dtypes'). A dtype
    eins does not compute in (torch.int16, uint8, complex64, float8, ...) is the DTypeError
    a numpy array of it gets, naming the supported dtypes."""
    try:
        return build.numpy_dtype(tdt)
    except DTypeError:
        raise DTypeError(f"unsupported torch dtype {tdt}; supported: "
                         f"{SUPPORTED_NAMES}: cast it first, e.g. "
                         f"x.to(torch.float32)") from None


def compute_type(*xs):
    """The torch dtype a lowering computes in: eins's rule for the eqn's float result (the
    operands' promoted dtype, a float function's result of it, float16 and bfloat16 computed
    in float32). Ints promote to float64, as numpy's softmax of int32 is float64: float32
    rounded 100000001 to 1e8."""
    return torch_dtype(compute_dtype(float_dtype(result_dtype(
        *(numpy_dtype(x.dtype) for x in xs)))))


def common(*xs):
    """The operands in their common dtype by eins's rule (numpy's, eins.ir.types.result_dtype),
    the eqn's dtype: torch.promote_types differs (int32 with float16 is float16 there, float64
    in numpy), which computed a float64 result in float16."""
    dt = torch_dtype(result_dtype(*(numpy_dtype(x.dtype) for x in xs)))
    return [x if x.dtype == dt else x.to(dt) for x in xs]


def one_float_dtype(outs, ins) -> bool:
    """Whether a launcher that takes float16/bfloat16/float32 tensors of one dtype and one
    output applies: every operand and the output are such tensors, all of one dtype."""
    import torch  # heavy: only the GPU path
    ts = list(ins) + list(outs)
    floats = (torch.float16, torch.bfloat16, torch.float32)
    return len(outs) == 1 and all(getattr(t, "dtype", None) in floats for t in ts) and \
        all(t.dtype == outs[0].dtype for t in ts)


def float_pairs(outs, ins) -> bool:
    """Whether a partial launcher writing (o, lse) pairs applies: one float32 output with a
    trailing axis of 2, float16/bfloat16/float32 operands of one dtype."""
    import torch  # heavy: only the GPU path
    floats = (torch.float16, torch.bfloat16, torch.float32)
    ts = list(ins)
    return len(outs) == 1 and outs[0].dtype == torch.float32 and outs[0].dim() > 0 and \
        outs[0].shape[-1] == 2 and all(getattr(t, "dtype", None) in floats for t in ts) and \
        all(t.dtype == ts[0].dtype for t in ts)
