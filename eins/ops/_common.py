"""What the operator families share at trace time: operands (NEP 50 scalars), static
parameters and the user-error wrapper; the shape and dtype rules are :mod:`eins.ir.rules`
(re-exported here). The family files import from here (never from each other for these).
"""
from __future__ import annotations

import collections.abc
import functools
import math
import re

import numpy as np

from eins.errors import DTypeError, EinsError, TraceError
from eins.ir.program import Literal
from eins.ir.types import is_python_scalar, is_torch_tensor, result_dtype, torch_to_numpy
from eins.ir.rules import (LEAD_NAMES, attention_shapes, broadcast_shape,  # noqa: F401
                            compute_dtype, float_dtype, float_result, index_name, matmul_shape,
                            negative_power_error, vectorized_erf, weak_dtype)
from eins.tracing import is_weak, not_an_array, user_frame, weak_cast

__all__ = ["result_dtype", "float_dtype", "float_result", "compute_dtype", "weak_dtype",
           "operands", "index_name", "LEAD_NAMES", "user_errors", "matmul_shape",
           "attention_shapes", "broadcast_shape", "static_flag", "static_real",
           "is_static_sequence", "vectorized_erf",
           "bool_contraction", "array_operand"]

def operands(op, *xs):
    """Turn Python scalars into Literals whose dtype follows NEP 50 against the arrays, and
    cast traced Python scalars (weakly typed) the same way."""
    arrays = [np.dtype(x.dtype) for x in xs
              if not is_python_scalar(x) and not is_weak(x) and hasattr(x, "dtype")]
    against = result_dtype(*arrays, op=op) if arrays else None
    out = []
    for x in xs:
        if is_python_scalar(x):
            try:
                out.append(Literal(x, weak_dtype(x, against)))
            except DTypeError as e:
                raise DTypeError(f"{op}: {e}") from None
        else:
            out.append(weak_cast(x, against) if is_weak(x) else x)
    return out


def static_flag(op: str, name: str, value) -> bool:
    """A static on/off parameter (``causal``, ``keepdims``): True or False (numpy's bools
    and the ints 0 and 1 too). Anything else is refused: ``bool("False")`` is True."""
    if isinstance(value, (bool, np.bool_)) or (
            isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise TraceError(f"{op}: {name} must be True or False, got {value!r}")


def is_static_sequence(x) -> bool:
    """Whether ``x`` is a sequence of static values as numpy takes one (a tuple, list, range
    or 1-d array), not a string, and not a dict or set, whose iteration yields only keys."""
    return not isinstance(x, (str, bytes)) and (
        isinstance(x, collections.abc.Sequence) or (isinstance(x, np.ndarray) and x.ndim == 1))


def static_real(op: str, name: str, value, minimum: float | None = None) -> float:
    """A static real parameter (``scale``, ``eps``): a Python or numpy int or float,
    finite, and at least ``minimum`` where given (TraceError, as for every static parameter
    eins cannot trace with)."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        value = value.item()   # a 0-d array, as float() took it
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise TraceError(f"{op}: {name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise TraceError(f"{op}: {name} must be finite, got {value!r}")
    if minimum is not None and v < minimum:
        raise TraceError(f"{op}: {name} must be at least {minimum}, got {value!r}")
    return v


def user_errors(fn):
    """Errors from checks a public function makes before ``bind`` name the user's line too,
    like the shape rules ``bind`` runs."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if any(map(_has_torch, args)) or any(map(_has_torch, kwargs.values())):
            args = tuple(map(_host, args))
            kwargs = {k: _host(v) for k, v in kwargs.items()}
        try:
            return fn(*args, **kwargs)
        except EinsError as e:
            where = user_frame()
            if where and "(at " not in str(e):
                raise type(e)(f"{e} (at {where})") from None
            raise
        except TypeError as e:
            if e.__traceback__.tb_next is not None:
                raise     # raised inside fn: not a call its signature refuses
            raise _call_error(wrapped.__name__, e) from None
    return wrapped


def _has_torch(x) -> bool:
    return is_torch_tensor(x) or (isinstance(x, (list, tuple)) and any(map(is_torch_tensor, x)))


def _host(x):
    """A torch tensor operand (a constant of the traced function, or an eager call's
    operand) as its numpy data, as a numpy array there would be; in a list or tuple too
    (``eins.concatenate``)."""
    if is_torch_tensor(x):
        return torch_to_numpy(x, "an operand")
    if isinstance(x, (list, tuple)) and any(map(is_torch_tensor, x)):
        return type(x)(torch_to_numpy(y, "an operand") if is_torch_tensor(y) else y
                       for y in x)
    return x


# torch's spelling of a keyword -> eins's (numpy's): named in the error of a call using it
_TORCH_KEYWORDS = {"dim": "axis", "keepdim": "keepdims", "is_causal": "causal",
                   "epsilon": "eps"}


def _call_error(name: str, e: TypeError) -> TraceError:
    """A call of ``eins.<name>`` its signature refuses (an unknown keyword, too many or
    too few arguments) as a TraceError naming the public function and the user's line,
    not the internal function's qualified name."""
    why = re.sub(r"^[\w.<>]+\(\) ", "", str(e))
    hint = ""
    m = re.search(r"unexpected keyword argument '(\w+)'", why)
    if m and m.group(1) in _TORCH_KEYWORDS:
        hint = f" (eins spells it {_TORCH_KEYWORDS[m.group(1)]}=)"
    where = user_frame()
    return TraceError(f"eins.{name}(): {why}{hint}" + (f" (at {where})" if where else ""))


def array_operand(op: str, x):
    """``x`` when it is an array (traced, numpy, a ShapeDtype: anything with a shape and a
    dtype), else a TraceError naming its type, for the functions that read the operand's
    shape before ``bind`` checks it (reductions, softmax)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    raise not_an_array(op, x)


def bool_contraction(product, *xs):
    """numpy's bool matmul or einsum on torch tensors (``product`` of the operands, the GPU
    lowerings of both): any of the ands, which torch lacks (no bool bmm). Computed on 0/1
    float32 copies: a sum of ones is never rounded to zero, so ``!= 0`` is exact."""
    import torch  # heavy: only the GPU path
    return product(*(x.to(torch.float32) for x in xs)) != 0
