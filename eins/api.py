"""The user-facing entry points: ``jit``, ``make_ir`` (and, from the planning layer,
``distribute``)."""
from __future__ import annotations

import functools

import numpy as np

from eins.errors import EinsError, TraceError
from eins.ir.types import as_dtype
from eins.tracing import ShapeDtype, trace, tree_flatten, tree_unflatten


def _signature(args, kwargs):
    """Cache key of one call: the argument structure, each array's shape and dtype, and the
    value of each Python scalar (scalars are baked into the program as literals)."""
    leaves, tree = tree_flatten((tuple(args), dict(kwargs)))
    key = []
    for x in leaves:
        if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
            key.append(("scalar", type(x).__name__, x))
        elif isinstance(x, ShapeDtype):
            key.append((x.shape, x.dtype))
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            try:
                key.append((tuple(x.shape), as_dtype(x.dtype)))
            except EinsError as e:
                raise type(e)(f"argument {len(key)}: {e}") from None
        else:
            raise TraceError(f"argument {len(key)} of type {type(x).__name__} is not an array, "
                             f"ShapeDtype or Python scalar: {x!r:.80}")
    return tree, tuple(key), leaves


class Jitted:
    """``eins.jit(fn)``: traces ``fn`` once per input signature and runs the program on numpy."""

    def __init__(self, fn):
        self.fn = fn
        self._cache: dict = {}
        self.trace_count = 0
        functools.update_wrapper(self, fn)

    def lower(self, *args, **kwargs):
        """The traced Program for these arguments (cached)."""
        tree, key, _ = _signature(args, kwargs)
        ck = (tree, key)
        if ck not in self._cache:
            self.trace_count += 1
            self._cache[ck] = trace(self.fn, args, kwargs)
        return self._cache[ck]

    def __call__(self, *args, **kwargs):
        prog, _, out_tree = self.lower(*args, **kwargs)
        _, _, leaves = _signature(args, kwargs)
        arrays = []
        for x in leaves:
            if isinstance(x, ShapeDtype):
                raise TraceError("a ShapeDtype has no data to run on; use eins.make_ir(fn) or "
                                 ".lower() to trace without data")
            if not (isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)):
                arrays.append(np.asarray(x))
        outs = prog.evaluate(*arrays)
        return tree_unflatten(out_tree, list(outs))


def jit(fn=None):
    """Trace ``fn`` per input signature into the SSA IR and execute it on numpy.
    Usable as ``@eins.jit`` or ``eins.jit(fn)``."""
    if fn is None:
        return jit
    if not callable(fn):
        raise TraceError(f"eins.jit expects a function, got {type(fn).__name__}")
    return Jitted(fn)


def make_ir(fn):
    """``make_ir(fn)(*args)`` returns the traced ``Program`` (print it for the IR dump)."""
    if not callable(fn):
        raise TraceError(f"eins.make_ir expects a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return trace(fn, args, kwargs)[0]

    return wrapped


# ----------------------------------------------------------------------------- distribute
def _device_ids(devices) -> tuple[int, ...]:
    from eins.errors import PlanError
    if isinstance(devices, bool):
        raise PlanError(f"devices must be a device count or a list of device ids, got {devices!r}")
    if isinstance(devices, (int, np.integer)):
        if devices < 1:
            raise PlanError(f"devices must be at least 1, got {devices}")
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


class Lowered:
    """One program planned for a device list: every stage so far is printable
    (``as_text``); ``plan`` is the planned IR (:class:`eins.ir.plan.Plan`)."""

    STAGES = ("traced", "planned")

    def __init__(self, compilation, in_tree, out_tree):
        self.compilation = compilation
        self.in_tree = in_tree
        self.out_tree = out_tree

    @property
    def program(self):
        return self.compilation.program

    @property
    def plan(self):
        return self.compilation.plan

    @property
    def devices(self) -> tuple[int, ...]:
        return self.compilation.devices

    @property
    def cost_bytes(self) -> int:
        """The cost proxy of Section 4.3 summed over every eqn, in bytes."""
        return self.plan.cost_bytes

    def plan_table(self) -> list[dict]:
        """One dict per eqn: eqn, op, splits {index: count}, out_tiling (count per output
        dim), agg (m), cost_bytes."""
        return self.plan.table()

    def as_text(self, stage: str = "planned") -> str:
        from eins.errors import EinsError
        if stage == "traced":
            return self.program.pretty()
        if stage == "planned":
            return self.plan.pretty()
        raise EinsError(f"unknown stage {stage!r}; stages: {list(self.STAGES)}")

    def __repr__(self):
        return f"<Lowered {self.program.name} on {len(self.devices)} devices, " \
               f"cost {self.cost_bytes} bytes>"


class Distributed:
    """``eins.distribute(fn, ...)``: plans ``fn`` per input signature for the devices.
    ``lower(*arrays_or_ShapeDtypes)`` needs no data: shapes and dtypes are enough."""

    def __init__(self, fn, devices, options):
        self.fn = fn
        self.devices = devices
        self.options = options
        self._cache: dict = {}
        functools.update_wrapper(self, fn)

    def lower(self, *args, **kwargs) -> Lowered:
        from eins.ir.plan import Compilation
        from eins.passes import PLANNING, run_passes
        tree, key, _ = _signature(args, kwargs)
        ck = (tree, key)
        if ck not in self._cache:
            prog, in_tree, out_tree = trace(self.fn, args, kwargs)
            comp = run_passes(Compilation(prog, self.devices, self.options), PLANNING)
            self._cache[ck] = Lowered(comp, in_tree, out_tree)
        return self._cache[ck]


def distribute(fn, devices=8, selector="dp", seed=0, plan=None, *, max_specs=256,
               topology=None, schedule="naive"):
    """Distribute ``fn`` over ``devices`` (a count, or a list of device ids) with the logical
    optimizer of Section 4: ``selector`` is "dp" (Algorithm 1, default), "greedy" or
    "random" (with ``seed``); ``plan`` forces specs per eqn ({eqn index: {index name:
    count or intervals}}). ``topology`` and ``schedule`` are kept for the physical lowering."""
    from eins.errors import PlanError
    from eins.ir.plan import SCHEDULES, SELECTORS, Options
    if not callable(fn):
        raise TraceError(f"eins.distribute expects a function, got {type(fn).__name__}")
    if selector not in SELECTORS:
        raise PlanError(f"unknown selector {selector!r}; choose one of {list(SELECTORS)}")
    if plan is not None and not isinstance(plan, dict):
        raise PlanError(f"plan must be a dict {{eqn index: {{index: count}}}}, got {plan!r}")
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    if isinstance(max_specs, bool) or not isinstance(max_specs, int) or max_specs < 1:
        raise PlanError(f"max_specs must be a positive int, got {max_specs!r}")
    opts = Options(selector=selector, seed=int(seed), plan=plan, max_specs=max_specs,
                   topology=topology, schedule=schedule)
    return Distributed(fn, _device_ids(devices), opts)
