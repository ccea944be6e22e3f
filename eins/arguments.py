"""What a call of a jitted or distributed function passes, classified: the cache key of a
call (:func:`signature`), the arrays a program runs on (:func:`data_arrays`), device arrays
traced as shapes (:func:`abstract_leaves`), and the ``devices=`` argument
(:func:`device_ids`). Every refusal names the argument as the user wrote it.

>>> import numpy as np
>>> tree, key, leaves = signature((np.ones((2, 3), np.float32), 2.0), {})
>>> key[0], key[1]
(((2, 3), dtype('float32')), ('scalar', 'float'))
>>> device_ids(3)
(0, 1, 2)
"""
from __future__ import annotations

import inspect

import numpy as np

from eins.errors import DTypeError, EinsError, GpuError, PlanError, TopologyError, TraceError
from eins.hardware.net import MAX_CLUSTER_GPUS
from eins.ir.types import as_dtype, check_torch_readable, is_python_scalar, torch_to_numpy
from eins.runtime.devices import dlpack_gpu
from eins.runtime.gpu_ops import numpy_dtype
from eins.ir.scalars import is_traced_scalar, scalar_dtype
from eins.tracing import (ShapeDtype, Tracer, call_leaf_names, check_call, flatten_call,
                          tree_unflatten, user_frame)

__all__ = ["signature", "data_arrays", "abstract_leaves", "array_dtype", "is_torch",
           "torch_data", "check_torch_leaf", "refuse_traced", "is_scalar_key", "masked",
           "device_ids"]


def data_arrays(leaves, inputs=(), tree=None) -> list:
    """The program's inputs of a call's leaves, in order, as numpy arrays: its arrays, and
    its Python scalars as 0-d arrays of their inputs' dtypes (``inputs``: the program's
    input variables; ``tree``: the call's, to name a scalar its dtype cannot hold); arrays
    on a GPU are refused by name (numpy would raise its own TypeError, or copy silently)."""
    arrays = []
    for i, x in enumerate(leaves):
        if isinstance(x, ShapeDtype):
            raise TraceError("a ShapeDtype has no data to run on; use eins.make_ir(fn) or "
                             ".lower() to trace without data")
        if is_traced_scalar(x):
            k = len(arrays)
            try:
                arrays.append(scalar_array(x, inputs[k].dtype) if k < len(inputs)
                              else np.asarray(x))
            except DTypeError as e:   # named only now: most calls never need the names
                name = call_leaf_names(tree)[i] if tree is not None else f"input {k}"
                raise DTypeError(f"{name}: {e}") from None
            continue
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


def scalar_array(x, dtype, what: str = "") -> np.ndarray:
    """Python scalar ``x`` as the 0-d input of ``dtype`` it was traced as (NEP 50's cast,
    folded into the input: :func:`eins.tracing.fold_scalar_casts`); an int its integer dtype
    cannot hold is refused, as its literal would be, rather than wrapped."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu" and not isinstance(x, bool):
        info = np.iinfo(dtype)
        if not info.min <= x <= info.max:
            raise DTypeError(f"{what + ': ' if what else ''}the Python int {x} is out of "
                             f"bounds for {dtype.name}, the dtype it was traced in")
    with np.errstate(all="ignore"):   # a float to float16 overflows to inf, as its literal
        return np.asarray(x, dtype)


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
    return is_torch(x) or type(x).__module__.split(".")[0] == "cupy"


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
    """The cache key of a Python scalar: its kind (bool, int, float), not its value, which
    is a runtime input of the program (:func:`eins.tracing.trace`); a complex, a literal of
    the program, by its value's bits."""
    if isinstance(x, complex):
        return ("scalar", "complex", x.real.hex(), x.imag.hex())
    kind = "bool" if isinstance(x, bool) else "int" if isinstance(x, int) else "float"
    if kind == "int":
        scalar_dtype(x, "")   # beyond int64: refused now (signature names the argument)
    return ("scalar", kind)


def static_key(x, what: str):
    """The cache key of a static argument's value (its own equality and hash, as JAX's
    static arguments; Python floats by their bits, so that 0.0 and -0.0 differ and a nan
    matches a nan)."""
    if isinstance(x, float):
        return ("float", x.hex())
    if type(x) is tuple:
        return ("tuple",) + tuple(static_key(v, what) for v in x)
    try:
        hash(x)
    except TypeError:
        raise TraceError(f"{what} is static (static_argnums / static_argnames) and must be "
                         f"hashable, as in JAX: got a {type(x).__name__} {x!r:.60}"
                         f"{'; pass a tuple' if isinstance(x, list) else ''}") from None
    return (type(x).__qualname__, x)


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
    array's shape and dtype, and the kind of each Python scalar (their values are runtime
    inputs, as in JAX). ``flat``: ``flatten_call(args, kwargs)`` when the caller has it
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
            try:
                key.append(_scalar_key(x))
            except EinsError as e:
                raise type(e)(f"{name()}: {e}") from None
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


class StaticArgs:
    """``static_argnums`` / ``static_argnames`` of a jit or distribute function, as JAX's:
    those arguments reach the function as the Python values they are (not traced), and
    their values are part of the cache key. A name that is a positional parameter also
    marks its position, and a position its parameter's name, as in JAX. ``split`` takes a
    call apart; ``bind`` makes the function of its traced part."""

    def __init__(self, fn, nums=(), names=()):
        nums = (nums,) if isinstance(nums, (int, np.integer, str)) else tuple(nums or ())
        names = (names,) if isinstance(names, str) else tuple(names or ())
        for n in nums:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
                raise TraceError(f"static_argnums must be ints (argument positions), got "
                                 f"{n!r}")
        for n in names:
            if not isinstance(n, str):
                raise TraceError(f"static_argnames must be strings (parameter names), got "
                                 f"{n!r}")
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):   # a builtin: take the numbers and names as given
            params = []
        kinds = inspect.Parameter
        positional = [p.name for p in params
                      if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        var_pos = any(p.kind == kinds.VAR_POSITIONAL for p in params)
        var_kw = any(p.kind == kinds.VAR_KEYWORD for p in params)
        known = {p.name for p in params if p.kind != kinds.POSITIONAL_ONLY}
        name = getattr(fn, "__name__", "fn")
        for n in nums:
            if params and not var_pos and not -len(positional) <= n < len(positional):
                raise TraceError(f"static_argnums={n} names no positional parameter of "
                                 f"{name}, which has {len(positional)}: {positional}")
        for n in names:
            if params and not var_kw and n not in known:
                raise TraceError(f"static_argnames={n!r} names no parameter of {name}; its "
                                 f"parameters: {sorted(known)}")
        nums = {int(n) % len(positional) if n < 0 and positional else int(n) for n in nums}
        self.nums = frozenset(nums | {positional.index(n) for n in names if n in positional})
        self.names = frozenset(set(names) | {positional[i] for i in nums
                                             if i < len(positional)})

    def __bool__(self):
        return bool(self.nums or self.names)

    def split(self, args, kwargs, bound=False):
        """(args, kwargs, statics, key) of a call: ``args`` with each static position
        emptied (None, so that the traced arguments keep their positions and names),
        ``kwargs`` without the static names, ``statics`` ((position or name, value), ...) and
        their cache key. ``bound``: a method's call, whose ``self`` (position 0) is static
        by identity."""
        if not self and not bound:
            return args, kwargs, (), ()
        args, statics, key = list(args), [], []
        for i in sorted(self.nums | ({0} if bound else set())):
            if i < len(args):
                statics.append((i, args[i]))
                key.append((i, ("self", id(args[i])) if bound and i == 0 else
                            static_key(args[i], f"argument {i}")))
                args[i] = None
        kwargs = dict(kwargs)
        for k in sorted(self.names):
            if k in kwargs:
                v = kwargs.pop(k)
                statics.append((k, v))
                key.append((k, static_key(v, f"keyword argument {k!r}")))
        return tuple(args), kwargs, tuple(statics), tuple(key)

    @staticmethod
    def bind(fn, statics):
        """``fn`` as a function of a call's traced part (:meth:`split`'s args and kwargs)."""
        if not statics:
            return fn
        pos = {i: v for i, v in statics if isinstance(i, int)}
        kws = {k: v for k, v in statics if isinstance(k, str)}

        def traced(*args, **kwargs):
            args = tuple(pos.get(i, a) for i, a in enumerate(args))
            check_call(fn, args, {**kwargs, **kws})
            return fn(*args, **kwargs, **kws)
        traced.__name__ = getattr(fn, "__name__", "fn")
        return traced


class StaticValues:
    """The static arguments one program was traced with (:meth:`StaticArgs.split`): a
    compiled program's call must pass them again unchanged (``check``); ``baked`` names
    them for the generated code."""

    def __init__(self, spec: StaticArgs | None = None, values=(), key=(), bound=False):
        self.spec = spec or StaticArgs(None)
        self.values, self.key, self.bound = tuple(values), tuple(key), bound
        self.obj = values[0][1] if bound else None   # a method's instance, kept alive

    @staticmethod
    def _name(where) -> str:
        return f"argument {where}" if isinstance(where, int) else f"keyword argument {where!r}"

    def baked(self) -> tuple:
        return tuple(f"{self._name(w)} = {v!r}" for w, v in self.values
                     if not (self.bound and w == 0))

    def check(self, args, kwargs):
        """``(args, kwargs)`` of a call of the compiled program with its static part emptied
        (as the program was traced: :meth:`StaticArgs.split`), or a TraceError naming the
        first static argument whose value is not the traced one."""
        if self.bound:
            args = (self.obj,) + tuple(args)
        args, kwargs, values, key = self.spec.split(args, kwargs, self.bound)
        if key != self.key:
            was, now = dict(self.values), dict(values)
            for w in sorted(set(was) | set(now), key=str):
                if w not in now:
                    raise TraceError(f"{self._name(w)} is static and was {was[w]!r} when "
                                     f"traced; pass it again")
                if w not in was or static_key(was[w], "") != static_key(now[w], ""):
                    old = repr(was[w]) if w in was else "not passed"
                    raise TraceError(f"{self._name(w)}: compiled with the static value {old}, "
                                     f"called with {now[w]!r}; a new static value needs its "
                                     f"own program (lower again, as calling the eins.jit or "
                                     f"eins.distribute function does)")
        return args, kwargs
