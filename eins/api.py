"""The user-facing entry points: ``jit``, ``make_ir`` (and, from the planning layer,
``distribute``)."""
from __future__ import annotations

import functools

import numpy as np

from eins import report as plan_report
from eins.errors import EinsError, TraceError
from eins.ir.text import format_bytes
from eins.ir.types import TensorType, as_dtype, is_python_scalar
from eins.tracing import ShapeDtype, call_leaf_names, flatten_call, trace, tree_unflatten


def _data_arrays(leaves) -> list:
    """The numpy arrays among a call's leaves (the program's inputs, in order); arrays on a
    GPU are refused by name (numpy would raise its own TypeError, or copy silently)."""
    arrays = []
    for x in leaves:
        if isinstance(x, ShapeDtype):
            raise TraceError("a ShapeDtype has no data to run on; use eins.make_ir(fn) or "
                             ".lower() to trace without data")
        if is_python_scalar(x):
            continue
        where = _gpu_of(x)
        if where is not None:
            from eins.errors import GpuError
            raise GpuError(f"argument {len(arrays)} is a {type(x).__name__} on {where}; "
                           f"eins.jit and backend 'numpy' run on host arrays: compile for "
                           f"backend 'cuda' to use it in place, or copy it to the host")
        if _is_torch(x):
            arrays.append(_torch_data(x, len(arrays)))
            continue
        arrays.append(np.asarray(x))
    return arrays


def _torch_data(x, k: int) -> np.ndarray:
    """Torch tensor argument ``k`` as plain numpy data: no autograd (nn.Parameter), a lazy
    negation resolved, bfloat16 through its bits (torch's .numpy() refuses all three), a
    CUDA tensor copied to the host."""
    from eins.ir.types import torch_to_numpy
    return torch_to_numpy(x, f"argument {k}")


def _check_torch_leaf(x, k: int) -> None:
    """A torch tensor eins can read: dense, with data (not on the meta device)."""
    from eins.ir.types import check_torch_readable
    check_torch_readable(x, f"argument {k}")


def _gpu_of(x):
    """'cuda:N' for a torch CUDA tensor or a CuPy array (by its DLPack device), else None."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch" and getattr(x, "is_cuda", False):
        return str(x.device)
    if mod == "cupy" and hasattr(x, "__dlpack_device__"):
        from eins.runtime.devices import dlpack_gpu
        gpu = dlpack_gpu(x)
        return None if gpu is None else f"cuda:{gpu}"
    return None


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _array_dtype(x):
    """A leaf's dtype as numpy's (torch tensors map through the GPU runtime's table)."""
    if _is_torch(x):
        from eins.runtime.gpu_ops import numpy_dtype
        return as_dtype(numpy_dtype(x.dtype))
    return as_dtype(x.dtype)


def _abstract_leaves(args, kwargs):
    """Device arrays (torch, CuPy) as ShapeDtype for tracing: planning needs no data."""
    leaves, tree = flatten_call(args, kwargs)
    if not any(_is_torch(x) or type(x).__module__.split(".")[0] == "cupy" for x in leaves):
        return args, kwargs
    out = [ShapeDtype(tuple(x.shape), _array_dtype(x))
           if _is_torch(x) or type(x).__module__.split(".")[0] == "cupy" else x
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


def _refuse_traced(leaves, what: str) -> None:
    """A distributed (compiled) function runs a whole program on devices: called on traced
    arrays (inside eins.jit, make_ir or another distribute) it cannot join the trace, as a
    nested eins.jit does; say so instead of 'no concrete value'."""
    from eins.tracing import Tracer, user_frame
    if any(isinstance(x, Tracer) for x in leaves):
        raise TraceError(f"{what} called on traced arrays, inside a traced function: it runs "
                         f"a whole program on its devices and cannot be nested in a trace; "
                         f"call the plain function there (eins.jit functions nest) and "
                         f"distribute the outer function (at {user_frame()})")


def _is_scalar_key(k) -> bool:
    return isinstance(k[0], str)   # arrays' keys start with their shape tuple


def _masked(name: str) -> TraceError:
    return TraceError(f"{name} is a numpy masked array; eins computes on plain arrays and "
                      f"would ignore its mask: pass x.filled(value) (or np.asarray(x) to drop "
                      f"the mask on purpose)")


def _signature(args, kwargs, flat=None):
    """Cache key of one call: the argument structure, each array's shape and dtype, and the
    value of each Python scalar (scalars are baked into the program as literals).
    ``flat``: ``flatten_call(args, kwargs)`` when the caller has it already."""
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
            raise _masked(name())
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            try:
                key.append((tuple(x.shape), _array_dtype(x)))
            except EinsError as e:
                raise type(e)(f"{name()}: {e}") from None
        else:
            raise TraceError(f"{name()} of type {type(x).__name__} is not an array, "
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
        """The traced (Program, in_tree, out_tree) for these arguments (cached)."""
        return self._lookup(args, kwargs)[0]

    def _lookup(self, args, kwargs, flat=None):
        tree, key, leaves = _signature(args, kwargs, flat)
        ck = (tree, key)
        if ck not in self._cache:
            self.trace_count += 1
            # torch tensors and CuPy arrays trace as their shapes and dtypes
            self._cache[ck] = trace(self.fn, *_abstract_leaves(args, kwargs))
        return self._cache[ck], leaves

    def __call__(self, *args, **kwargs):
        from eins.tracing import Tracer, check_call, current_trace
        flat = flatten_call(args, kwargs)
        leaves, tree = flat
        if current_trace() is not None or any(isinstance(x, Tracer) for x in leaves):
            # called inside a traced function (jit of a function that calls a jitted one,
            # from its thread or a worker's): its operators join the enclosing trace, as
            # JAX inlines a nested jit. Its arity and masked arrays are checked as a call of
            # its own would; other arguments (a string, a function) are the caller's
            # business, as in a plain call
            for k, x in enumerate(leaves):
                if isinstance(x, np.ma.MaskedArray):
                    raise _masked(call_leaf_names(tree)[k])
            check_call(self.fn, args, kwargs)
            return self.fn(*args, **kwargs)
        (prog, _, out_tree), leaves = self._lookup(args, kwargs, flat)
        outs = prog.evaluate(*_data_arrays(leaves))
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
        return trace(fn, *_abstract_leaves(args, kwargs))[0]

    return wrapped


# ----------------------------------------------------------------------------- distribute
def _device_ids(devices) -> tuple[int, ...]:
    from eins.errors import PlanError, TopologyError
    from eins.hardware.topology import MAX_CLUSTER_GPUS
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


class Lowered:
    """One program lowered for a device list. Every stage is printable with
    ``as_text(stage)``: ``traced``, ``planned`` (the logical plan, Section 4), ``exchange``
    (one ExProg per consumer input, Section 5) and ``device`` (per-device instruction lists).
    The physical stages are built on first use; planning alone needs no data and no GPU."""

    STAGES = ("traced", "planned", "exchange", "device")

    def __init__(self, compilation, in_tree, out_tree, signature=None, literals=None):
        self.compilation = compilation
        self.in_tree = in_tree
        self.out_tree = out_tree
        # the call's key (_signature) and its Python scalars {leaf index: value}: literals
        # of the program, which a Compiled call must pass again unchanged
        self.signature = signature
        self.literals = dict(literals or {})
        self._physical = None
        self._dump_stem = None   # (directory, file stem) of this lowering's EINS_DUMP_DIR files
        _dump(compilation.program.name, ("traced", "planned"), self)

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
        """One dict per eqn: eqn, op, splits {index: count} (the printed index names:
        d0.. output dims, r0.. contracted; docs/stages.md), out_tiling (count per output
        dim), agg (m, partial copies per output block), cost_bytes (the proxy), seconds (the
        eqn's share of the time cost, ``plan.cost_s``; None without a topology)."""
        return self.plan.table()

    @property
    def physical(self):
        """The Compilation after the physical passes (place, overlay, synthesize, lower,
        verify), built once."""
        if self._physical is None:
            from eins.passes import PHYSICAL, run_passes
            self._physical = run_passes(self.compilation, PHYSICAL)
            _dump(self.program.name, ("exchange", "device"), self)
        return self._physical

    @property
    def exchanges(self) -> tuple:
        """Every exchange (eins.ir.exchange.Exchange), in program order (read-only)."""
        return self.physical.exchange.exchanges

    def as_text(self, stage: str = "planned") -> str:
        if stage == "traced":
            return self.program.pretty()
        if stage == "planned":
            return self.plan.pretty()
        if stage == "exchange":
            return exchange_text(self.physical.exchange)
        if stage == "device":
            return DEVICE_LEGEND + self.physical.device.as_text()
        raise EinsError(f"unknown stage {stage!r}; stages: {list(self.STAGES)}")

    def predicted_time(self) -> dict:
        """Predicted run time on the topology (:func:`eins.cost.predict.predict`): a dict
        that prints as a table (total_ms, compute_ms, exchange_ms, peak_bytes, fits...)."""
        from eins.cost.predict import predict
        return predict(self.physical)

    def explain(self, eqn=None, top: int = 3):
        """Why eqn ``eqn`` (None: each) got its spec, and its next best: eins.report."""
        return plan_report.explain(self.compilation, eqn, top)

    def report(self, path, compare=None) -> str:
        """This plan as one self-contained HTML page (eins/report/html.py)."""
        return plan_report.report(self, path, compare)

    def trace(self, path) -> str:
        """The predicted schedule as a Perfetto / Chrome trace (eins/report/trace.py)."""
        return plan_report.trace(self, path)

    def generate(self, target: str = "cuda"):
        """Generated code for the device IR (eins.codegen): ``"cuda"`` (per-device host
        programs for the GPU runtime: Triton kernels, torch lowerings, CUDA graphs; run by
        ``compile(backend="cuda"|"interpret")``) or ``"numpy"`` (the same walk in numpy).
        ``.sources``, ``.write(dir)``."""
        from dataclasses import replace

        from eins.codegen import generate
        names = call_leaf_names(self.in_tree) if self.in_tree is not None else []
        baked = tuple(f"{names[i]} = {v!r}" for i, v in sorted(self.literals.items())
                      if i < len(names))
        return replace(generate(self.physical.device, target), baked=baked)

    def compile(self, backend: str = "numpy", device_map=None, graphs: bool = True
                ) -> "Compiled":
        """Ready to run on ``backend``: "numpy" (virtual CPU devices, the reference),
        "cuda" (the GPU runtime, eins/runtime/gpu.py), "interpret" (the same GPU program on
        the CPU under Triton's interpreter) or "auto" (cuda when a GPU is visible, else
        numpy). ``device_map`` {logical device: GPU} (or a list in device order) maps the
        plan's devices onto physical GPUs, several per GPU allowed (default: round-robin
        over the visible GPUs); ``graphs`` captures each device's kernel runs into CUDA
        graphs (emulated on "interpret"). Backend and device map are chosen here, not in
        planning: the plan and its device IR do not depend on where they run."""
        return Compiled(self, backend, device_map, graphs)

    def __repr__(self):
        p = len(self.devices)
        return f"<Lowered {self.program.name} on {p} device{'s' if p != 1 else ''}, " \
               f"cost {format_bytes(self.cost_bytes)}>"


# The marks of the device stage's text (docs/stages.md explains every instruction).
DEVICE_LEGEND = (
    "# per device, its instructions in order; buffer names say where a block came from:\n"
    "#   inN load (of program input or constant `inK`/`constK`), kN kernel result, atN slice\n"
    "#   (an atom of a block), agN agg (⊕ of copies), rxN recv, blkN concat (recomposed block);\n"
    "#   name~ is a partial copy that an agg still has to combine; send/recv devD #T pair a\n"
    "#   send with its recv by the tag T; [lo:hi,...] is the block of the whole tensor.\n")


def exchange_text(xir) -> str:
    from eins.ir.exprog import to_text
    from eins.ir.text import format_bytes
    prog = xir.plan.program
    out = [f"# schedule={xir.schedule} topology={getattr(xir.topology, 'name', None)}"]
    for x in xir.exchanges:
        head = f"{x.inputs_text()}{x.serves_text()}: {x.var_name}"
        if x.eqn >= 0:
            head = f"eqn {x.eqn} ({prog.eqns[x.eqn].prim}) {head}"
        m = max((len(agg) for agg in x.cell_aggregates()), default=1)
        pred = (f", predicted {x.predicted_s * 1e3:.3g} ms (naive {x.naive_s * 1e3:.3g} ms)"
                if x.predicted_s is not None else "")
        n = len(x.cells)
        out.append(f"## {head}: {n} cell{'s' if n != 1 else ''} x up to {m} "
                   f"{'copies' if m != 1 else 'copy'}, "
                   f"{format_bytes(x.bytes_moved())} moved{pred}")
        out.append(to_text(x.program))
    return "\n".join(out)


_DUMP_STEMS: dict = {}   # (directory, program name) -> lowerings dumped there so far


def _dump(name, stages, lowered):
    """EINS_DUMP_DIR=dir writes every stage's text, numbered in pipeline order: NN-NAME-STAGE
    for the first lowering of a name in this process, NN-NAME.K-STAGE for the K-th (another
    signature of the same function, or another function of that name: two lambdas), so that
    no lowering's dump replaces an earlier one's."""
    import os
    import re
    d = os.environ.get("EINS_DUMP_DIR")
    if not d:
        return
    stem = lowered._dump_stem
    if stem is None or stem[0] != os.path.abspath(d):
        # a file name: a '/' or a NUL in a function's __name__ must not reach open()
        name = re.sub(r"[^\w.<>-]", "_", name)
        key = (os.path.abspath(d), name)
        k = _DUMP_STEMS[key] = _DUMP_STEMS.get(key, 0) + 1
        stem = lowered._dump_stem = (key[0], name if k == 1 else f"{name}.{k}")
    try:
        os.makedirs(d, exist_ok=True)
        for st in stages:
            n = Lowered.STAGES.index(st) + 1
            with open(os.path.join(d, f"{n:02d}-{stem[1]}-{st}.txt"), "w") as f:
                f.write(lowered.as_text(st) + "\n")
    except OSError as e:  # a debugging aid must not stop the computation
        import warnings
        warnings.warn(f"EINS_DUMP_DIR={d!r}: cannot write the {'/'.join(stages)} dump "
                      f"({e.strerror or e}: {e.filename or d}); the computation goes on "
                      f"without it", RuntimeWarning, stacklevel=3)


class Compiled:
    """A lowered program ready to run on its backend: callable on numpy arrays (and, on the
    GPU backends, on torch tensors and CuPy arrays); ``place(...)`` makes inputs resident;
    ``stats()`` reports the last run's transfers and memory."""

    def __init__(self, lowered: Lowered, backend: str = "numpy", device_map=None,
                 graphs: bool = True):
        from eins.ir.plan import flag_option
        from eins.runtime.gpu import check_device_map, resolve_backend
        graphs = flag_option("graphs", graphs)
        self.lowered = lowered
        self.device_program = lowered.physical.device
        self.backend = resolve_backend(backend)
        if self.backend == "numpy" and device_map is not None:   # before its shape checks
            raise EinsError(f"device_map={device_map!r} maps logical devices onto GPUs; the "
                            f"numpy backend has virtual devices only")
        check_device_map(device_map, self.device_program.devices)
        self._stats = None
        self.gpu = None
        if self.backend != "numpy":
            from eins.runtime.gpu_exec import GpuExecutable
            self.gpu = GpuExecutable(self.device_program, self.backend, device_map, graphs,
                                     attention=lowered.compilation.options.attention)

    def __call__(self, *args, **kwargs):
        tree, key, leaves = _signature(args, kwargs)
        _refuse_traced(leaves, "a compiled program")
        return self._run(tree, leaves, key)

    def _check_literals(self, key, leaves):
        """The call passes the Python scalars the program was lowered with, where it was,
        and arrays elsewhere: a scalar is a literal of the compiled program, so a new value
        would be silently ignored."""
        low = self.lowered
        if low.signature is None or len(low.signature) != len(key):
            return   # a structure mismatch: reported by _arrays
        names = call_leaf_names(low.in_tree)
        for i, (want, got) in enumerate(zip(low.signature, key)):
            if _is_scalar_key(want) and want != got:
                was = low.literals[i]
                now = (f"the Python scalar {leaves[i]!r}" if _is_scalar_key(got) else
                       f"an array {TensorType(*got)!r}")
                raise TraceError(
                    f"{names[i]}: compiled with the Python scalar {was!r} baked into the "
                    f"program, called with {now}; a new value needs its own program (lower "
                    f"again, as calling the eins.distribute function does, or pass the value "
                    f"as an array when the program is traced)")
            if not _is_scalar_key(want) and _is_scalar_key(got):
                raise TraceError(f"{names[i]}: compiled for an array "
                                 f"{TensorType(*want)!r}, got the Python scalar "
                                 f"{leaves[i]!r}")

    def _arrays(self, tree, leaves, key=None):
        if tree != self.lowered.in_tree:
            raise TraceError(f"compiled for (args, kwargs) structured as "
                             f"{self.lowered.in_tree}, called with {tree}")
        if key is not None:
            self._check_literals(key, leaves)
        if self.gpu is None:
            arrays = _data_arrays(leaves)
        else:  # device arrays stay what they are (no host round trip)
            _data_arrays([x for x in leaves if isinstance(x, ShapeDtype)])
            arrays = [x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
                      for x in leaves if not is_python_scalar(x)]
            for k, a in enumerate(arrays):
                if _is_torch(a):
                    _check_torch_leaf(a, k)
        prog = self.lowered.program
        if len(arrays) != len(prog.inputs):
            raise TraceError(f"expected {len(prog.inputs)} arrays, got {len(arrays)}")
        for k, (v, a) in enumerate(zip(prog.inputs, arrays)):
            if tuple(a.shape) != v.shape or _array_dtype(a) != v.dtype:
                got = TensorType(tuple(a.shape), _array_dtype(a))
                raise TraceError(f"argument {k}: compiled for {v.type!r}, got {got!r}")
        return arrays

    def _run(self, tree, leaves, key=None):
        arrays = self._arrays(tree, leaves, key)
        if self.gpu is not None:
            outs = self.gpu(arrays)
            self._stats = None
            return tree_unflatten(self.lowered.out_tree, list(outs))
        from eins.runtime.numpy_backend import execute
        outs, self._stats = execute(self.device_program, arrays)
        return tree_unflatten(self.lowered.out_tree, list(outs))

    def place(self, *args, **kwargs) -> dict:
        """Make inputs that stay the same across calls (weights) resident on their devices:
        takes a call's arguments, copies every block each device loads of them once, and
        returns that copy's byte counts. A later call that passes the same objects (torch
        tensors also unmodified since) moves nothing for them; other inputs, a different
        object in a placed position included, are copied on every call that passes them
        until they are placed. Such a call overwrites the placed object's device copy, so
        the placed object is copied again when passed after it, until placed again. A
        placed torch tensor changed in place (its version counter moved: an optimizer step)
        is copied by the next call that passes it and stays placed. A numpy
        array changed in place must be placed again (numpy has no version counter), as must
        a torch tensor changed without its version counter (through ``.data``, or through
        numpy memory it shares from ``torch.from_numpy``). GPU backends only (numpy copies
        nothing to a device)."""
        if self.gpu is None:
            raise EinsError("place() needs a GPU backend ('cuda' or 'interpret'); this "
                            "program was compiled for 'numpy'")
        tree, key, leaves = _signature(args, kwargs)
        return self.gpu.place(self._arrays(tree, leaves, key))

    def stats(self) -> dict:
        """The last run: bytes per (source, destination), transfers, peak live bytes per
        device, kernels run (numpy); on the GPU backends also host<->device bytes
        (h2d_bytes, d2h_bytes), loads skipped for placed inputs, launches issued and graph
        replays."""
        if self.gpu is not None:
            return self.gpu.stats()
        if self._stats is None:
            raise EinsError("stats() before the first call")
        return self._stats.as_dict()


class Distributed:
    """``eins.distribute(fn, ...)``: plans ``fn`` per input signature for the devices.
    ``lower(*arrays_or_ShapeDtypes)`` needs no data: shapes and dtypes are enough; calling
    it runs on the devices (virtual CPU devices without GPUs)."""

    def __init__(self, fn, devices, options, backend="numpy", device_map=None, graphs=True):
        self.fn = fn
        self.devices = devices
        self.options = options
        self.backend, self.device_map, self.graphs = backend, device_map, graphs
        self._cache: dict = {}
        self._compiled: dict = {}
        functools.update_wrapper(self, fn)

    def lower(self, *args, **kwargs) -> Lowered:
        from eins.ir.plan import Compilation
        from eins.passes import PLANNING, run_passes
        tree, key, leaves = _signature(args, kwargs)
        ck = (tree, key)
        if ck not in self._cache:
            targs, tkwargs = _abstract_leaves(args, kwargs)
            prog, in_tree, out_tree = trace(self.fn, targs, tkwargs)
            comp = run_passes(Compilation(prog, self.devices, self.options), PLANNING)
            self._cache[ck] = Lowered(comp, in_tree, out_tree, key, {
                i: x for i, x in enumerate(leaves) if is_python_scalar(x)})
        return self._cache[ck]

    def __call__(self, *args, **kwargs):
        tree, key, leaves = _signature(args, kwargs)
        _refuse_traced(leaves, "eins.distribute")
        if (tree, key) not in self._compiled:
            self._compiled[(tree, key)] = self.lower(*args, **kwargs).compile(
                self.backend, self.device_map, self.graphs)
        self.last = self._compiled[(tree, key)]
        return self.last._run(tree, leaves, key)

    def stats(self) -> dict:
        """The transfers and memory of the last call."""
        if not self._compiled:
            raise EinsError("stats() before the first call")
        return self.last.stats()


def _check_world_backend(backend, device_map) -> None:
    """devices='world': each rank runs its own device program with one kernel set, on its
    own GPU (LOCAL_RANK); see eins.runtime.ranks.make_kernels."""
    from eins.errors import PlanError
    from eins.ir.plan import name_option
    from eins.runtime.gpu import BACKENDS, resolve_backend
    name_option("backend", backend, BACKENDS)
    if device_map is not None:
        raise PlanError(f"device_map={device_map!r} does not apply to devices='world': each "
                        f"rank runs on GPU LOCAL_RANK modulo the GPUs it sees")
    resolve_backend(backend)   # 'cuda' without a GPU, or no torch/triton: a GpuError now


def distribute(fn, devices=8, selector="dp", seed=0, plan=None, *, max_specs=256,
               topology=None, schedule="naive", synthesis_budget_s=0.2,
               synthesis_steps=None, inputs_resident=False, cost="time", memory_limit=None,
               backend="auto", device_map=None, graphs=True, attention="auto", timeout_s=None,
               load=None, gather=True):
    """Distribute ``fn`` over ``devices`` (a count, or a list of device ids, or ``"world"``:
    one device per rank of the torch.distributed default process group, joined from
    torchrun's environment when not yet initialized; see eins.runtime.ranks).

    Logical optimization (Section 4): ``selector`` is "dp" (Algorithm 1, default), "greedy"
    or "random" (with ``seed``); ``plan`` forces specs per eqn ({eqn index: {index name:
    count or intervals}}); ``inputs_resident=True`` stops charging the join bytes of program
    inputs (weights resident across steps; the paper charges them); ``cost`` is what the DP
    minimizes: "time" (default: predicted seconds on ``topology``) or "proxy" (the paper's
    bytes); ``memory_limit`` caps each device's per-eqn working set in bytes (default: the
    topology's GPU memory).

    Physical optimization (Section 5): ``schedule`` is "naive" (default, as in the paper)
    or "optimized" (the paper's "ai": exchange programs synthesized against ``topology``
    within ``synthesis_budget_s`` seconds of modeled simulation each, or, with
    ``synthesis_steps``, within that many simulated candidates each: either way
    deterministic, the same programs on every machine whatever its speed or load);
    ``topology`` is a preset name
    ("dgx-h100:8"), a JSON file or a Topology, default dgx-a100 up to 8 devices and a
    dgx-a100:Kx8 cluster beyond (also used for predicted times).

    Running (eins/runtime/gpu.py): ``backend`` is "auto" (default: "cuda" when torch sees a
    GPU, else "numpy"), "numpy" (virtual CPU devices, the reference), "cuda" or "interpret"
    (the generated GPU program on the CPU under Triton's interpreter); ``device_map`` maps
    logical devices onto GPUs ({logical: gpu} or a list; default round-robin, so a p=8 plan
    runs on one GPU); ``graphs`` replays the devices' kernels as CUDA graphs; ``attention``
    picks the GPU backends' attention kernel: "auto" (default: flash-attn's varlen kernel if
    importable, then PyTorch's scaled_dot_product_attention where it computes exactly
    eins's attention on a fused CUDA backend, else eins's Triton kernel), "triton", "sdpa"
    or "flash_attn" (forced; a block it cannot compute exactly raises KernelUnavailable).

    With ``devices="world"`` only: ``timeout_s`` (default 300) bounds every wait, and a rank
    that exited or never sends is named in a DistributedError within it; ``load(input_index,
    box)`` provides the blocks of inputs passed as ``eins.ShapeDtype`` (so no rank holds all
    weights); ``gather=False`` returns per output a dict {Box: block} of this rank's blocks
    instead of the whole outputs on every rank. ``backend`` picks each rank's kernels:
    "numpy" (the reference kernels, gloo), "cuda" (the GPU runtime's kernels on the rank's
    GPU and stream, NCCL), "interpret" (those kernels on CPU tensors under Triton's
    interpreter, gloo) or "auto" ("cuda" when torch sees a GPU, else "numpy"); ranks run
    their kernels eagerly (``graphs`` does not apply) and ``device_map`` is refused."""
    from eins.errors import PlanError
    from eins.ir.plan import Options, flag_option, name_option
    if not callable(fn):
        raise TraceError(f"eins.distribute expects a function, got {type(fn).__name__}")
    world = isinstance(devices, str) and devices == "world"
    gather = flag_option("gather", gather)
    if not world and (timeout_s is not None or load is not None or gather is not True):
        raise PlanError("timeout_s, load and gather apply to devices='world' (one device per "
                        "torch.distributed rank)")
    devs = None if world else _device_ids(devices)
    opts = Options(selector=selector, seed=seed, plan=plan, max_specs=max_specs,
                   topology=topology, schedule=schedule,
                   synthesis_budget_s=synthesis_budget_s, synthesis_steps=synthesis_steps,
                   inputs_resident=inputs_resident, cost=cost, memory_limit=memory_limit,
                   attention=attention)
    if world:  # the devices are checked against the topology once the rank count is known
        WorldDistributed = _installed_world()
        timeout_s = 300.0 if timeout_s is None else timeout_s
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise PlanError(f"timeout_s must be a positive number of seconds, at most "
                            f"{MAX_TIMEOUT_S:,} (30 days), got {timeout_s!r}")
        if load is not None and not callable(load):
            raise PlanError(f"load must be a function load(input_index, box), got {load!r}")
        _check_world_backend(backend, device_map)
        return WorldDistributed(fn, opts, timeout_s=timeout_s, load=load, gather=gather,
                                kernels=backend)
    opts.check_devices(devs)  # fail now, not when the program first runs
    from eins.runtime.gpu import BACKENDS, check_device_map
    name_option("backend", backend, BACKENDS)
    check_device_map(device_map, devs)
    return Distributed(fn, devs, opts, backend, device_map, flag_option("graphs", graphs))


# The longest wait devices="world" takes (timeout_s): inf and 1e20 reached torch.distributed,
# whose failure ('cannot convert float infinity to integer', a C int overflow) was then
# reported as a rank that did not join; 1e13 s fails inside gloo.
MAX_TIMEOUT_S = 30 * 86400


_WORLD = []  # eins.world.WorldDistributed, installed by eins.world (imported by eins)


def install_world(cls) -> None:
    """Make ``cls`` what ``distribute(fn, devices="world")`` builds. It lives above this
    module (it subclasses Distributed and runs the rank runtime), so it installs itself."""
    _WORLD[:] = [cls]


def _installed_world():
    if not _WORLD:
        raise EinsError("devices='world' needs eins.world: import eins")
    return _WORLD[0]
