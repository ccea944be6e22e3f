"""What every operator family shares: the dtype rules, index naming and the user-error
wrapper. The family files import from here (never from each other for these).

The dtype rules, decided once:

- promotion: :func:`eins.ir.types.result_dtype` (numpy's, plus bfloat16 as float16 would
  promote, and bfloat16 with float16 giving float32 in *every* family);
- a float function's result (exp, mean, a norm): :func:`float_dtype` (numpy's ufunc rule)
  or, for families that need float operands, :func:`float_result`;
- the compute dtype of a kernel: :func:`compute_dtype` (float16 and bfloat16 computed in
  float32, as GPU kernels do; float32 and float64 as they are).
"""
from __future__ import annotations

import functools

import numpy as np

from eins.errors import DTypeError, EinsError, ShapeError
from eins.ir.types import TensorType, bfloat16, is_float, result_dtype
from eins.tracing import user_frame

__all__ = ["result_dtype", "float_dtype", "float_result", "compute_dtype", "index_name",
           "user_errors"]

_BOOL = np.dtype(np.bool_)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def float_dtype(d) -> np.dtype:
    """The dtype of a float function's result (numpy's ufunc rule): floats keep theirs,
    bool -> float16, ints -> float64."""
    d = np.dtype(d)
    if is_float(d):
        return d
    return _F16 if d == _BOOL else _F64


def float_result(op: str, *types: TensorType) -> np.dtype:
    """The promoted dtype of the operands (:func:`result_dtype`), which must come out
    floating point. Shared by the norm, rope and attention families."""
    d = result_dtype(*(t.dtype for t in types), op=op)
    if not is_float(d):
        raise DTypeError(f"{op}: needs floating-point operands, got dtypes "
                         f"{[t.dtype.name for t in types]}")
    return d


def compute_dtype(d) -> np.dtype:
    """The dtype a kernel computes ``d`` in: low-precision floats (float16, bfloat16) in
    float32, as GPU kernels do; every other dtype (float32, float64, ints) as is."""
    d = np.dtype(d)
    return _F32 if d in (_F16, bfloat16) else d


_NAMES = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def index_name(d: int) -> str:
    """A one-character index name for dimension ``d`` (signatures name indices by letter)."""
    if d >= len(_NAMES):
        raise ShapeError(f"tensors of rank > {len(_NAMES)} are not supported (dimension {d})")
    return _NAMES[d]


def user_errors(fn):
    """Errors from checks a public function makes before ``bind`` name the user's line too,
    like the shape rules ``bind`` runs."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EinsError as e:
            where = user_frame()
            if where and "(at " not in str(e):
                raise type(e)(f"{e} (at {where})") from None
            raise
    return wrapped
