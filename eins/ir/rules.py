"""The shape and dtype rules that operators, kernels and cost models share (below all of
them: an operator's shape rule and its GPU launcher check with the same function).

The dtype rules, decided once:

- promotion: :func:`eins.ir.types.result_dtype` (numpy's, plus bfloat16 as float16 would
  promote, and bfloat16 with float16 giving float32 in *every* family);
- a float function's result (exp, mean, a norm): :func:`float_dtype` (numpy's ufunc rule)
  or, for families that need float operands, :func:`float_result`;
- the compute dtype of a kernel: :func:`compute_dtype` (float16 and bfloat16 computed in
  float32, as GPU kernels do; float32, float64 and integers as they are).
"""
from __future__ import annotations

import numpy as np

from eins.errors import DTypeError, ShapeError
from eins.ir.types import TensorType, bfloat16, is_float, result_dtype

__all__ = ["float_dtype", "float_result", "compute_dtype", "weak_dtype", "index_name",
           "LEAD_NAMES", "broadcast_shape", "matmul_shape", "attention_shapes",
           "vectorized_erf", "negative_power_error"]

_BOOL = np.dtype(np.bool_)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def float_dtype(d) -> np.dtype:
    """The dtype of a float function's result (numpy's ufunc rule): floats keep theirs,
    bool, int8 and uint8 -> float16, int16 -> float32, wider ints -> float64."""
    d = np.dtype(d)
    if is_float(d):
        return d
    return np.result_type(d, _F16)


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


def weak_dtype(value, against: np.dtype | None) -> np.dtype:
    """NEP 50: the dtype a Python scalar takes next to arrays of (promoted) dtype ``against``."""
    if isinstance(value, bool):
        return against if against is not None else _BOOL
    if isinstance(value, int):
        if against is None or against == _BOOL:
            d = np.dtype(np.int64)
        elif is_float(against):
            return against
        else:
            d = against
        info = np.iinfo(d)
        if not info.min <= value <= info.max:
            raise DTypeError(f"Python integer {value} is out of bounds for {d.name}")
        return d
    if isinstance(value, float):
        return against if against is not None and is_float(against) else _F64
    raise DTypeError(f"unsupported scalar {value!r} of type {type(value).__name__}")


_NAMES = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

# Index names for the leading dims of the norm, rope and attention families (their last dim
# is "z", the normalized or rotated one). Single characters, as eins.ir.joinagg.Signature
# names indices.
LEAD_NAMES = "abcefghijklmnopqrstuvwxy"


def index_name(d: int) -> str:
    """A one-character index name for dimension ``d`` (signatures name indices by letter)."""
    if d >= len(_NAMES):
        raise ShapeError(f"a tensor of rank above {len(_NAMES)} cannot be planned (eins names "
                         f"dimensions with {len(_NAMES)} letters; dimension {d} has none)")
    return _NAMES[d]


def broadcast_shape(*shapes) -> tuple | None:
    """numpy's broadcasting rule on shapes (None when they do not broadcast), for any rank:
    ``np.broadcast_shapes`` raises a RuntimeError past 32 dimensions, which numpy arrays
    (up to 64) and eins's index names (52) allow."""
    shapes = [tuple(s) for s in shapes]
    nd = max((len(s) for s in shapes), default=0)
    out = []
    for d in range(nd):
        sizes = {s[d - nd + len(s)] for s in shapes if d - nd + len(s) >= 0} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def matmul_shape(a_shape, b_shape) -> tuple[tuple, tuple]:
    """numpy's matmul shape rule on >=2-D operands: (the broadcast batch shape, the result's
    shape). The primitive's shape rule and the GPU launcher both check with it; a ShapeError
    names both shapes."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ShapeError(f"matmul: operands must be at least 2-D, got shapes {a_shape} and "
                         f"{b_shape}")
    if a_shape[-1] != b_shape[-2]:
        raise ShapeError(f"matmul: contracted dimensions differ: {a_shape} @ {b_shape} "
                         f"(K={a_shape[-1]} != K={b_shape[-2]})")
    batch = broadcast_shape(a_shape[:-2], b_shape[:-2])
    if batch is None:
        raise ShapeError(f"matmul: batch dimensions of {a_shape} and {b_shape} do not "
                         f"broadcast")
    return batch, batch + (a_shape[-2], b_shape[-1])


def attention_shapes(q_shape, k_shape, v_shape, same_length: bool = True) -> None:
    """The attention shape rule: q ``[..., Hq, Sq, D]``, k ``[..., Hkv, Sk, D]`` and v
    ``[..., Hkv, Sk, Dv]`` (the value head size may differ) with q's batch dims and head dim,
    Hq a multiple of Hkv (grouped-query attention) and, with ``same_length``, Sk == Sq. The
    primitive's shape rule and the GPU launcher both check with it."""
    q, k, v = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t) < 3:
            raise ShapeError(f"attention: {name} must be [..., heads, S, D], got shape {t}")
    if k[:-1] != v[:-1]:
        raise ShapeError(f"attention: k and v shapes differ: {k} vs {v} (only the head "
                         f"size, the last dim, may differ)")
    if q[:-3] != k[:-3]:
        raise ShapeError(f"attention: batch dims of q {q[:-3]} and k/v {k[:-3]} differ "
                         f"(q {q}, k {k})")
    if same_length and q[-2] != k[-2]:
        raise ShapeError(f"attention: sequence lengths differ: q has S={q[-2]}, k/v have "
                         f"S={k[-2]} (q {q}, k {k})")
    if q[-1] != k[-1]:
        raise ShapeError(f"attention: head dims differ: q has D={q[-1]}, k/v have D={k[-1]} "
                         f"(q {q}, k {k})")
    hq, hkv = q[-3], k[-3]
    if hkv == 0 or hq % hkv:
        raise ShapeError(f"attention: query heads Hq={hq} must be a multiple of key/value "
                         f"heads Hkv={hkv} (q {q}, k {k})")


# erf without scipy, vectorized in float64, in two polynomial pieces:
#   |x| < 2:       erf(x) = x * P(x*x/2 - 1)           (erf(x)/x is smooth in u = x*x)
#   2 <= |x| < 6:  erf(x) = 1 - exp(-x*x) * Q(6/x - 2) (erfc(x) exp(x*x) is smooth in 1/x)
#   |x| >= 6:      erf(x) = ±1 (erfc(6) < 2^-55 rounds away)
# P and Q (lowest power first) are the power forms of the Chebyshev interpolants, at 96
# nodes, of erf(sqrt(u))/sqrt(u) on u in [0, 4] and of erfc(1/s) exp(1/s^2) on s in
# [1/6, 1/2], mapped to t in [-1, 1]; computed in 160-bit arithmetic (mpmath, offline) and cut
# where the Chebyshev terms fall below 1e-17. Their coefficients stay below 1 in magnitude,
# so Horner's rule loses nothing: within 3 ulp of the correctly rounded erf (measured
# against 120-bit erf on [0, 6]); tests/test_ops_elementwise.py checks it against math.erf.
_ERF_P = (
    0.674933236039655, -0.2611118609312449, 0.11947913860985163, -0.048662777449178594,
    0.017128344571823155, -0.005234875835829019, 0.0014050914235852877,
    -0.0003351435355973672, 7.180100878173158e-05, -1.3946266834092667e-05,
    2.475801058128637e-06, -4.045225297207437e-07, 6.119735980430362e-08,
    -8.60362747515682e-09, 1.1331607171428763e-09, -1.4817692852849454e-10,
    1.7218973582855107e-11)
_ERF_Q = (
    0.17900115118139, 0.08155839001076629, -0.005039359895676036, -0.0002321579202732432,
    0.0001245932532295123, -1.7340697662314987e-05, -9.983143180397506e-08,
    6.468359897257703e-07, -1.6579377633773016e-07, 1.78856470088156e-08,
    2.6998285102269254e-09, -1.8368949839200824e-09, 4.5888938459281973e-10,
    -2.258925072325575e-11, -1.6931131519541338e-11)


def _horner(coeffs, t):
    r = np.full_like(t, coeffs[-1])
    for c in coeffs[-2::-1]:
        r *= t
        r += c
    return r


def vectorized_erf(x):
    """erf in float64, whole arrays at once (the exact GELU's Phi(x) = (1 + erf(x/sqrt 2))/2);
    see the comment above for the method and its accuracy."""
    x = np.asarray(x, np.float64)
    ax = np.abs(x)
    out = np.where(ax >= 6.0, 1.0, ax)  # NaN stays NaN, ±inf gives ±1
    small = ax < 2.0
    v = ax[small]
    out[small] = v * _horner(_ERF_P, v * v * 0.5 - 1.0)
    mid = (ax >= 2.0) & (ax < 6.0)
    v = ax[mid]
    out[mid] = 1.0 - np.exp(-v * v) * _horner(_ERF_Q, 6.0 / v - 2.0)
    return np.copysign(out, x)


def negative_power_error(power: int) -> DTypeError:
    """numpy's refusal of an integer base to the negative integer ``power``, as every
    backend reports it (the GPU kernels' check too: eins/kernels/fusion.py
    device_error); the runtimes prefix the eqn and the user's line."""
    err = DTypeError(f"pow: an integer base to the negative integer power {power}; "
                     f"cast the base to a float dtype (e.g. x.astype('float32'))")
    err.power = power   # a runtime running blocks reports the most negative of them
    return err
