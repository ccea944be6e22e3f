"""The user-facing entry points: ``jit``, ``make_ir`` and ``distribute``. What they
return lowers, as JAX's ``jit(f).lower(x)`` does, to the stage objects of
:mod:`eins.stages`; the calls' arguments are classified by :mod:`eins.arguments`.

>>> import numpy as np, eins
>>> f = eins.jit(lambda x, w: x @ w)
>>> f(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)).shape
(2, 4)
>>> low = eins.distribute(lambda x, w: x @ w, devices=2).lower(
...     eins.ShapeDtype((8, 8), "float32"), eins.ShapeDtype((8, 8), "float32"))
>>> low.devices
(0, 1)
"""
from __future__ import annotations

import functools

import numpy as np

from eins.arguments import (StaticArgs, StaticValues, abstract_leaves, data_arrays, device_ids,
                            masked, refuse_traced, signature)
from eins.errors import EinsError, PlanError, TraceError
from eins.hardware.net import resolve_topology
from eins.ir.plan import Compilation, Options, flag_option, name_option
from eins.passes import PLANNING, run_passes
from eins.passes.families import families_option
from eins.progress import set_verbose, step
from eins.runtime.gpu import BACKENDS, check_device_map, resolve_backend
from eins.runtime.sharded import resident_options
from eins.stages import Lowered, Traced
from eins.tracing import (Tracer, call_leaf_names, check_call, current_trace, flatten_call,
                          trace, tree_unflatten)

__all__ = ["jit", "make_ir", "distribute", "Jitted", "Distributed"]


class Staged:
    """What :class:`Jitted` and :class:`Distributed` share: static arguments (JAX's
    ``static_argnums`` / ``static_argnames``: :class:`eins.arguments.StaticArgs`), use on
    methods (``self`` is static, by identity), and a clear refusal to be pickled."""

    def _init_static(self, fn, static_argnums, static_argnames):
        self.static = StaticArgs(fn, static_argnums, static_argnames)

    def _split(self, args, kwargs, bound):
        """(args, kwargs, StaticValues, cache key part) of a call."""
        args, kwargs, values, key = self.static.split(args, kwargs, bound)
        return args, kwargs, StaticValues(self.static, values, key, bound), key

    def _trace(self, args, kwargs, statics):
        """Trace ``fn`` on a call's traced part; device arrays (torch, CuPy) as their shapes
        and dtypes."""
        return trace(StaticArgs.bind(self.fn, statics.values), *abstract_leaves(args, kwargs),
                     name=getattr(self.fn, "__name__", "fn"))

    def __get__(self, obj, objtype=None):
        """On a method: the call passes the instance as ``self``, a static argument."""
        return self if obj is None else BoundMethod(self, obj)

    API = "eins.jit"

    def __reduce_ex__(self, protocol):
        raise TraceError(f"{self.API}({getattr(self.fn, '__name__', 'fn')}) cannot be "
                         f"pickled: it holds traced programs, which it rebuilds on demand; "
                         f"pickle the plain function and apply {self.API} again after loading")


class BoundMethod:
    """A jitted or distributed method of one instance: called (or lowered) with the
    instance as its static first argument."""

    def __init__(self, staged, obj):
        self.staged, self.obj = staged, obj
        functools.update_wrapper(self, staged.fn)

    def __call__(self, *args, **kwargs):
        return self.staged._call((self.obj,) + args, kwargs, bound=True)

    def lower(self, *args, **kwargs):
        return self.staged._lower((self.obj,) + args, kwargs, bound=True)

    def __getattr__(self, name):   # stats(), trace_count, devices: the function's
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.staged, name)


class Jitted(Staged):
    """``eins.jit(fn)``: traces ``fn`` once per input signature and runs the program on
    numpy; ``lower(*args)`` is that trace as a stage object (:class:`eins.stages.Traced`)."""

    def __init__(self, fn, static_argnums=(), static_argnames=()):
        self.fn = fn
        self._init_static(fn, static_argnums, static_argnames)
        self._cache: dict = {}
        self.trace_count = 0
        functools.update_wrapper(self, fn)

    def lower(self, *args, **kwargs) -> Traced:
        """The program traced for these arguments (cached per signature): ``as_text()``
        prints it, ``compile()`` runs it."""
        return self._lower(args, kwargs)

    def _lower(self, args, kwargs, bound=False) -> Traced:
        return self._lookup(*self._split(args, kwargs, bound))[0]

    def _lookup(self, args, kwargs, statics, skey, flat=None):
        tree, key, leaves = signature(args, kwargs, flat)
        ck = (tree, key, skey)
        if ck not in self._cache:
            self.trace_count += 1
            prog, in_tree, out_tree = self._trace(args, kwargs, statics)
            self._cache[ck] = Traced(prog, in_tree, out_tree, key, statics)
        return self._cache[ck], leaves

    def __call__(self, *args, **kwargs):
        return self._call(args, kwargs)

    def _call(self, args, kwargs, bound=False):
        dargs, dkwargs, statics, skey = self._split(args, kwargs, bound)
        flat = flatten_call(dargs, dkwargs)
        leaves, tree = flat
        if current_trace() is not None or any(isinstance(x, Tracer) for x in leaves):
            # called inside a traced function (jit of a function that calls a jitted one,
            # from its thread or a worker's): its operators join the enclosing trace, as
            # JAX inlines a nested jit. Its arity and masked arrays are checked as a call of
            # its own would; other arguments (a string, a function) are the caller's
            # business, as in a plain call
            for k, x in enumerate(leaves):
                if isinstance(x, np.ma.MaskedArray):
                    raise masked(call_leaf_names(tree)[k])
            check_call(self.fn, args, kwargs)
            return self.fn(*args, **kwargs)
        traced, leaves = self._lookup(dargs, dkwargs, statics, skey, flat)
        outs = traced.program.evaluate(*data_arrays(leaves, traced.program.inputs, tree))
        return tree_unflatten(traced.out_tree, list(outs))


_FRONTENDS = []  # (accepts, wrap): eins.frontends, a layer above, installs nn.Module's


def jit(fn=None, *, static_argnums=(), static_argnames=()):
    """Trace ``fn`` per input signature into the SSA IR and execute it on numpy. Usable as
    ``@eins.jit``, ``@eins.jit(static_argnames="n")`` or ``eins.jit(fn)``, on functions and
    methods. Python scalar arguments (bool, int, float) are traced as weakly typed runtime
    values, as in JAX: a new value reuses the program. ``static_argnums`` /
    ``static_argnames`` make arguments static instead (shapes, axes, flags, strings: any
    hashable value), part of the cache key, as in JAX."""
    if fn is None:
        return functools.partial(jit, static_argnums=static_argnums,
                                 static_argnames=static_argnames)
    for accepts, wrap in _FRONTENDS:   # a torch nn.Module: eins/frontends/module.py
        if accepts(fn):
            return wrap(fn, "jit", {})
    if not callable(fn):
        raise TraceError(f"eins.jit expects a function, got {type(fn).__name__}")
    return Jitted(fn, static_argnums, static_argnames)


def make_ir(fn, *, static_argnums=(), static_argnames=()):
    """``make_ir(fn)(*args)`` returns the traced ``Program`` (print it for the IR dump)."""
    if not callable(fn):
        raise TraceError(f"eins.make_ir expects a function, got {type(fn).__name__}")
    static = StaticArgs(fn, static_argnums, static_argnames)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args, kwargs, values, _ = static.split(args, kwargs)
        return trace(StaticArgs.bind(fn, values), *abstract_leaves(args, kwargs),
                     name=getattr(fn, "__name__", "fn"))[0]

    return wrapped


class Distributed(Staged):
    """``eins.distribute(fn, ...)``: plans ``fn`` per input signature for the devices.
    ``lower(*arrays_or_ShapeDtypes)`` needs no data: shapes and dtypes are enough; calling
    it runs on the devices (virtual CPU devices without GPUs)."""

    API = "eins.distribute"

    def __init__(self, fn, devices, options, backend="numpy", device_map=None, graphs=True,
                 *, topology, static_argnums=(), static_argnames=(), outputs="host",
                 donate_argnums=(), rebalance=None, families=False):
        self.fn = fn
        self.devices = devices
        self.options = options
        # the Topology resolved once from options.topology (eins.hardware.net), carried
        # through planning and lowering
        self.topology = topology
        self.backend, self.device_map, self.graphs = backend, device_map, graphs
        self.outputs, self.donate_argnums = resident_options(outputs, donate_argnums)
        self.rebalance, self.families = rebalance, families
        self._init_static(fn, static_argnums, static_argnames)
        self._cache: dict = {}
        self._compiled: dict = {}
        self.trace_count = 0
        functools.update_wrapper(self, fn)

    def lower(self, *args, **kwargs) -> Lowered:
        """The program planned for these arguments (cached per signature; arrays or
        ShapeDtypes): ``as_text(stage)`` prints each stage, ``compile(backend)`` runs it."""
        return self._lower(args, kwargs)

    def _lower(self, args, kwargs, bound=False) -> Lowered:
        args, kwargs, statics, skey = self._split(args, kwargs, bound)
        tree, key, leaves = signature(args, kwargs)
        ck = (tree, key, skey)
        if ck not in self._cache:
            self.trace_count += 1
            name = getattr(self.fn, "__name__", "fn")
            with step(f"planning {name} for {len(self.devices)} devices"):
                with step("tracing"):
                    prog, in_tree, out_tree = self._trace(args, kwargs, statics)
                comp = run_passes(Compilation(prog, self.devices, self.options,
                                              self.topology), PLANNING)
            self._cache[ck] = Lowered(comp, in_tree, out_tree, key, statics)
        return self._cache[ck]

    def __call__(self, *args, **kwargs):
        return self._call(args, kwargs)

    def _call(self, args, kwargs, bound=False):
        dargs, dkwargs, _, skey = self._split(args, kwargs, bound)
        tree, key, leaves = signature(dargs, dkwargs)
        refuse_traced(leaves, "eins.distribute")
        ck = (tree, key, skey)
        if ck not in self._compiled:
            self._compiled[ck] = self._lower(args, kwargs, bound).compile(
                self.backend, self.device_map, self.graphs, self.rebalance,
                outputs=self.outputs, donate_argnums=self.donate_argnums,
                families=self.families)
        self.last = self._compiled[ck]
        return self.last.run_leaves(tree, leaves, key)

    def stats(self) -> dict:
        """The transfers and memory of the last call."""
        if not self._compiled:
            raise EinsError("stats() before the first call")
        # the function's own counts: one trace and one plan per signature it lowered, and
        # the plan families its compiled programs planned beyond their first
        more = sum(c.counts["plans"] - 1 for c in self._compiled.values())
        return dict(self.last.stats(), traces=self.trace_count, plans=len(self._cache) + more)


def _check_world_backend(backend, device_map) -> None:
    """devices='world': each rank runs its own device program with one kernel set, on its
    own GPU (LOCAL_RANK); see eins.runtime.ranks.make_kernels."""
    name_option("backend", backend, BACKENDS)
    if device_map is not None:
        raise PlanError(f"device_map={device_map!r} does not apply to devices='world': each "
                        f"rank runs on GPU LOCAL_RANK modulo the GPUs it sees")
    resolve_backend(backend)   # 'cuda' without a GPU, or no torch/triton: a GpuError now


def distribute(fn=None, devices=8, selector="dp", seed=0, plan=None, *, max_specs=256,
               topology=None, schedule="naive", synthesis_budget_s=0.2,
               synthesis_steps=None, inputs_resident=False, cost="time", memory_limit=None,
               backend="auto", device_map=None, graphs=True, attention="auto", timeout_s=None,
               load=None, gather=True, tuning=None, static_argnums=(), static_argnames=(),
               verbose=None, profile=None, outputs="host", donate_argnums=(), rebalance=None,
               families=False, pipeline=False):
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
    eins's attention on a fused CUDA backend, else eins's Triton kernel; with the profile's
    measured kernels of this GPU, the fastest), "triton", "sdpa", "cudnn" (SDPA on its cuDNN
    backend) or "flash_attn" (forced; a block it cannot compute exactly raises
    KernelUnavailable).

    With ``devices="world"`` only: ``timeout_s`` (default 300) bounds every wait, and a rank
    that exited or never sends is named in a DistributedError within it; ``load(input_index,
    box)`` provides the blocks of inputs passed as ``eins.ShapeDtype`` (so no rank holds all
    weights); ``gather=False`` returns per output a dict {Box: block} of this rank's blocks
    instead of the whole outputs on every rank. ``backend`` picks each rank's kernels:
    "numpy" (the reference kernels, gloo), "cuda" (the GPU runtime's kernels on the rank's
    GPU and stream, NCCL), "interpret" (those kernels on CPU tensors under Triton's
    interpreter, gloo) or "auto" ("cuda" when torch sees a GPU, else "numpy"); ranks run
    their kernels eagerly (``graphs`` does not apply) and ``device_map`` is refused.

    ``rebalance``: re-cut attention whose ``segments`` are an int array argument for each
    call's boundaries (``Lowered.compile``'s; default: on "numpy", and on the GPU backends
    where a capacity program exists; with ``devices="world"`` on every kernel set, each
    rank re-lowering its own instructions per new cut: docs/stages.md). ``families``: keep
    the DP's plan and the sequence split at equal cuts (on "numpy" also that split with
    every token-wise eqn at whole-block balanced cuts, which ``"block"`` asks for by name),
    and run each call on the one estimated fastest for its ends (``Lowered.compile``'s; not
    with ``devices="world"``).

    ``pipeline``: a kernel whose keys arrive from other devices (attention split by query
    rows) runs in pieces, one per arriving block, each joined into a running (o, lse)
    accumulator as its block is there, its receives posted one piece ahead
    (eins/passes/pipeline.py), and the predicted time GPU by GPU prices the transfers
    under those pieces; every backend runs it, ranks over NCCL refuse it (default False:
    docs/stages.md says why it is not yet the default).

    ``tuning`` (an :class:`eins.ir.plan.Tuning`, default ``Tuning()``): the search's inner
    switches, for measuring what each buys; plans depend on them.

    State across calls (a training step's weights and optimizer state), as JAX's jit:
    ``outputs="devices"`` returns every output as an :class:`eins.Sharded` array left on
    the devices in the blocks the plan stored; passed back as an argument, each device
    reads the parts it holds in place and receives the others from the devices holding
    them, with no host round trip (``stats()``: ``h2d_bytes``, ``resident_bytes``,
    ``relayout_bytes``); ``np.asarray(s)`` brings one to the host. ``donate_argnums``:
    positional arguments whose Sharded arrays a call consumes (released when it returns;
    using one again is an error), so the state is held once, not twice.

    As in JAX: usable as a decorator (``@eins.distribute`` or ``@eins.distribute(devices=4)``,
    on functions and methods); Python scalar arguments are traced as runtime values (a new
    value reuses the plan); ``static_argnums`` / ``static_argnames`` make arguments static
    (part of the cache key: shapes, axes, flags).

    ``verbose`` (0 / False, 1 / True, 2, or "warning", "info", "debug"; default: as
    ``EINS_VERBOSE`` says, else warnings only) sets the ``eins`` logger's level: planning,
    synthesis, lowering, codegen and Triton compilation log their times, and on a terminal
    a step past a second draws a progress bar (eins.progress).

    ``profile``: the machine profile pricing kernels on ``topology`` (a shipped name such as
    "h200", a JSON file written by ``eins calibrate``, a Profile, or "none" for the data
    sheet alone; default: the topology's own, docs/costs.md "Calibration"): predicted
    times, and so plans, depend on it."""
    if verbose is not None:
        set_verbose(verbose)
    if fn is None:   # @eins.distribute(devices=4): the options checked now, as without @
        make = functools.partial(
            distribute, devices=devices, selector=selector, seed=seed, plan=plan,
            max_specs=max_specs, topology=topology, schedule=schedule,
            synthesis_budget_s=synthesis_budget_s, synthesis_steps=synthesis_steps,
            inputs_resident=inputs_resident, cost=cost, memory_limit=memory_limit,
            backend=backend, device_map=device_map, graphs=graphs, attention=attention,
            timeout_s=timeout_s, load=load, gather=gather, tuning=tuning,
            static_argnums=static_argnums, static_argnames=static_argnames,
            profile=profile, outputs=outputs, donate_argnums=donate_argnums,
            rebalance=rebalance, families=families, pipeline=pipeline)  # verbose: set
        if not (isinstance(devices, str) and devices == "world"):   # world joins a group
            make(_decorated)
        return make
    for accepts, wrap in _FRONTENDS:   # a torch nn.Module: eins/frontends/module.py
        if accepts(fn):
            return wrap(fn, "distribute", locals())
    if not callable(fn):
        raise TraceError(f"eins.distribute expects a function, got {type(fn).__name__}")
    world = isinstance(devices, str) and devices == "world"
    gather = flag_option("gather", gather)
    if not world and (timeout_s is not None or load is not None or gather is not True):
        raise PlanError("timeout_s, load and gather apply to devices='world' (one device per "
                        "torch.distributed rank)")
    devs = None if world else device_ids(devices)
    opts = Options(selector=selector, seed=seed, plan=plan, max_specs=max_specs,
                   topology=topology, schedule=schedule,
                   synthesis_budget_s=synthesis_budget_s, synthesis_steps=synthesis_steps,
                   inputs_resident=inputs_resident, cost=cost, memory_limit=memory_limit,
                   attention=attention, profile=profile, pipeline=pipeline,
                   **({} if tuning is None else {"tuning": tuning}))
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
        if families_option(families):   # each rank would choose, and all alike
            raise PlanError(f"families={families!r} is not available with devices='world' "
                            f"(each rank re-cuts the DP's plan for a call's segment ends); "
                            f"leave it False")
        return WorldDistributed(fn, opts, timeout_s=timeout_s, load=load, gather=gather,
                                kernels=backend, static_argnums=static_argnums,
                                static_argnames=static_argnames, outputs=outputs,
                                donate_argnums=donate_argnums,
                                rebalance=None if rebalance is None else
                                flag_option("rebalance", rebalance))
    # the devices fit the topology (the given one, or the default: dgx-a100 up to 8
    # devices, a cluster of them beyond): a TopologyError now, not when the program first
    # runs; the one resolution of this function's topology
    topo = resolve_topology(opts.topology, devs, opts.profile)
    name_option("backend", backend, BACKENDS)
    if backend != "auto":   # 'cuda' without a GPU: a GpuError now, not after planning
        resolve_backend(backend)
    check_device_map(device_map, devs)
    return Distributed(fn, devs, opts, backend, device_map, flag_option("graphs", graphs),
                       topology=topo, static_argnums=static_argnums,
                       static_argnames=static_argnames, outputs=outputs,
                       donate_argnums=donate_argnums,
                       rebalance=None if rebalance is None else flag_option("rebalance",
                                                                            rebalance),
                       families=families_option(families, backend if backend != "auto"
                                                else None))


def _decorated(*args, **kwargs):
    """What ``@eins.distribute(...)`` checks its options with before it has a function."""


# The longest wait devices="world" takes (timeout_s): torch.distributed fails on inf and
# 1e20 ('cannot convert float infinity to integer', a C int overflow), which reads as a rank
# that did not join; 1e13 s fails inside gloo.
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
