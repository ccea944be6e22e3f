"""What a call of a jitted or distributed function passes, classified: the cache key of a
call (:func:`signature`), the arrays a program runs on (:func:`data_arrays`), device arrays
traced as shapes (:func:`abstract_leaves`), and the ``devices=`` argument
(:func:`device_ids`). Every refusal names the argument as the user wrote it.

>>> import numpy as np
>>> tree, key, leaves = signature((np.ones((2, 3), np.float32), 2.0), {})
>>> key[0], key[1]
(((2, 3), dtype('float32')), ('scalar', 'float', '0x1.0000000000000p+1'))
>>> device_ids(3)
(0, 1, 2)
"""
from __future__ import annotations

import numpy as np

from eins.errors import EinsError, GpuError, PlanError, TopologyError, TraceError
from eins.hardware.net import MAX_CLUSTER_GPUS
from eins.ir.types import as_dtype, check_torch_readable, is_python_scalar, torch_to_numpy
from eins.runtime.devices import dlpack_gpu
from eins.runtime.gpu_ops import numpy_dtype
from eins.runtime.sharded import Sharded
from eins.tracing import (ShapeDtype, Tracer, call_leaf_names, flatten_call, tree_unflatten,
                          user_frame)

__all__ = ["signature", "data_arrays", "abstract_leaves", "array_dtype", "is_torch",
           "torch_data", "check_torch_leaf", "refuse_traced", "is_scalar_key", "masked",
           "device_ids"]


def data_arrays(leaves, keep=()) -> list:
    """The numpy arrays among a call's leaves (the program's inputs, in order); arrays on a
    GPU are refused by name (numpy would raise its own TypeError, or copy silently). Leaves
    of the classes ``keep`` stay as they are (Sharded arrays a backend reads in place)."""
    arrays = []
    for x in leaves:
        if keep and isinstance(x, keep):
            arrays.append(x)
            continue
        if isinstance(x, ShapeDtype):
            raise TraceError("a ShapeDtype has no data to run on; use eins.make_ir(fn) or "
                             ".lower() to trace without data")
        if is_python_scalar(x):
            continue
        where = gpu_of(x)
        if where is not None:
            raise GpuError(f"argument {len(arrays)} is a {type(x).__name__} on {where}; "
                           f"eins.jit and backend 'numpy' run on host arrays: compile for "
                           f"backend 'cuda' to use it in place, or copy it to the host")
        if is_torch(x):
            arrays.append(torch_data(x, len(arrays)))
            continue
        arrays.append(np.asarray(x))
    return arrays


def torch_data(x, k: int) -> np.ndarray:
    """Torch tensor argument ``k`` as plain numpy data: no autograd (nn.Parameter), a lazy
    negation resolved, bfloat16 through its bits (torch's .numpy() refuses all three), a
    CUDA tensor copied to the host."""
    return torch_to_numpy(x, f"argument {k}")


def check_torch_leaf(x, k: int) -> None:
    """A torch tensor eins can read: dense, with data (not on the meta device)."""
    check_torch_readable(x, f"argument {k}")


def gpu_of(x):
    """'cuda:N' for a torch CUDA tensor or a CuPy array (by its DLPack device), else None."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch" and getattr(x, "is_cuda", False):
        return str(x.device)
    if mod == "cupy" and hasattr(x, "__dlpack_device__"):
        gpu = dlpack_gpu(x)
        return None if gpu is None else f"cuda:{gpu}"
    return None


def is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _is_device_array(x) -> bool:
    return is_torch(x) or type(x).__module__.split(".")[0] == "cupy" or isinstance(x, Sharded)


def array_dtype(x):
    """A leaf's dtype as numpy's (torch tensors map through the GPU runtime's table)."""
    if is_torch(x):
        return as_dtype(numpy_dtype(x.dtype))
    return as_dtype(x.dtype)


def abstract_leaves(args, kwargs):
    """Device arrays (torch, CuPy) as ShapeDtype for tracing: planning needs no data."""
    leaves, tree = flatten_call(args, kwargs)
    if not any(_is_device_array(x) for x in leaves):
        return args, kwargs
    out = [ShapeDtype(tuple(x.shape), array_dtype(x)) if _is_device_array(x) else x
           for x in leaves]
    return tree_unflatten(tree, out)


def _scalar_key(x) -> tuple:
    """The cache key of a Python scalar, equal exactly when the literals it bakes into a
    program are the same: floats by their bits' text (``float.hex``), so that 0.0 and -0.0
    differ (``x / 0.0`` and ``x / -0.0`` differ in sign) and a nan equals a nan (else every
    call with a nan would trace again and grow the cache)."""
    if isinstance(x, float):
        return ("scalar", "float", x.hex())
    if isinstance(x, complex):
        return ("scalar", "complex", x.real.hex(), x.imag.hex())
    return ("scalar", type(x).__name__, x)


def refuse_traced(leaves, what: str) -> None:
    """A distributed (compiled) function runs a whole program on devices: called on traced
    arrays (inside eins.jit, make_ir or another distribute) it cannot join the trace, as a
    nested eins.jit does; say so instead of 'no concrete value'."""
    if any(isinstance(x, Tracer) for x in leaves):
        raise TraceError(f"{what} called on traced arrays, inside a traced function: it runs "
                         f"a whole program on its devices and cannot be nested in a trace; "
                         f"call the plain function there (eins.jit functions nest) and "
                         f"distribute the outer function (at {user_frame()})")


def is_scalar_key(k) -> bool:
    """Whether ``k`` (one entry of a :func:`signature` key) is a Python scalar's."""
    return isinstance(k[0], str)   # arrays' keys start with their shape tuple


def masked(name: str) -> TraceError:
    """The error for a numpy masked array passed as ``name``."""
    return TraceError(f"{name} is a numpy masked array; eins computes on plain arrays and "
                      f"would ignore its mask: pass x.filled(value) (or np.asarray(x) to drop "
                      f"the mask on purpose)")


def signature(args, kwargs, flat=None):
    """(tree, key, leaves) of one call: the cache key is the argument structure, each
    array's shape and dtype, and the value of each Python scalar (scalars are baked into the
    program as literals). ``flat``: ``flatten_call(args, kwargs)`` when the caller has it
    already."""
    leaves, tree = flat or flatten_call(args, kwargs)
    key = []
    names = None   # what the user wrote for each leaf, built only for an error message

    def name():
        nonlocal names
        names = names or call_leaf_names(tree)
        return names[len(key)]
    for x in leaves:
        if is_python_scalar(x):
            key.append(_scalar_key(x))
        elif isinstance(x, ShapeDtype):
            key.append((x.shape, x.dtype))
        elif isinstance(x, np.ma.MaskedArray):   # np.asarray would drop the mask
            raise masked(name())
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            try:
                key.append((tuple(x.shape), array_dtype(x)))
            except EinsError as e:
                raise type(e)(f"{name()}: {e}") from None
        else:
            raise TraceError(f"{name()} of type {type(x).__name__} is not an array, "
                             f"ShapeDtype or Python scalar: {x!r:.80}")
    return tree, tuple(key), leaves


def device_ids(devices) -> tuple[int, ...]:
    """``devices=`` as device ids: a count ``n`` is ``0..n-1``; a list is checked (ints,
    non-negative, none twice)."""
    if isinstance(devices, (bool, str, bytes)):
        raise PlanError(f"devices must be a device count or a list of device ids, got {devices!r}")
    if isinstance(devices, (int, np.integer)):
        if devices < 1:
            raise PlanError(f"devices must be at least 1, got {devices}")
        if devices > MAX_CLUSTER_GPUS:   # before a tuple of 10**12 ids is built
            raise TopologyError(f"device ids up to {devices - 1} need a topology with "
                                f"{devices} GPUs; a cluster model holds at most "
                                f"{MAX_CLUSTER_GPUS} (it keeps a route for every pair of "
                                f"GPUs)")
        return tuple(range(int(devices)))
    try:
        ids = tuple(devices)
    except TypeError:
        raise PlanError(f"devices must be a device count or a list of device ids, got "
                        f"{devices!r}") from None
    if not ids:
        raise PlanError("devices is an empty list; name at least one device id")
    for d in ids:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise PlanError(f"device id {d!r} in {list(ids)} is not a non-negative int")
    if len(set(ids)) != len(ids):
        raise PlanError(f"devices {list(ids)} name a device twice")
    return tuple(int(d) for d in ids)
