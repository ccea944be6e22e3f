"""The stage objects of a lowered function, as JAX's ``jit(f).lower(x)`` and
``.compile()``: :class:`Traced` and :class:`Evaluator` for ``eins.jit`` (one program run by
the reference evaluator on numpy), :class:`Lowered` and :class:`Compiled` for
``eins.distribute`` (a program planned for a device list, then ready to run on a backend).
Each prints with ``as_text()`` and compiles (or runs) from there.

>>> import numpy as np, eins
>>> low = eins.jit(lambda x: x * 2).lower(np.ones(3, np.float32))
>>> print(low.as_text().splitlines()[0])
{ lambda  ; a:f32[3]. let
>>> low.compile()(np.arange(3, dtype=np.float32))
array([0., 2., 4.], dtype=float32)
"""
from __future__ import annotations

import os
import re
import warnings
from collections import deque
from dataclasses import replace

import numpy as np

from eins import report as plan_report
from eins.arguments import (StaticValues, array_dtype, check_torch_leaf, data_arrays,
                            is_scalar_key, is_torch, refuse_traced, scalar_array, signature)
from eins.codegen import generate
from eins.cost.predict import predict
from eins.errors import EinsError, TraceError
from eins.ir.exprog import to_text
from eins.ir.plan import flag_option
from eins.ir.text import format_bytes, format_seconds
from eins.ir.types import TensorType, is_python_scalar
from eins.kernels.build import COUNTS, count_jit_compiles
from eins.passes import PHYSICAL, collection_paused, per_call, run_passes
from eins.passes.capacity import capacity
from eins.passes.rebalance import runtime_operands
from eins.passes.lower import exchange_schedules, lower_exchanges
from eins.passes.families import BatchChoice, FamilySet, families_option
from eins.passes.verify import verify, verify_device
from eins.progress import step
from eins.rebalanced import FamilyRun
from eins.runtime.gpu import check_device_map, resolve_backend
from eins.runtime.gpu_exec import GpuExecutable
from eins.runtime.numpy_backend import execute
from eins.ir.scalars import is_traced_scalar
from eins.runtime.sharded import Sharded, resident_options
from eins.tracing import ShapeDtype, call_leaf_names, tree_unflatten

__all__ = ["Traced", "Evaluator", "Lowered", "Compiled", "exchange_text", "DEVICE_LEGEND"]


def check_structure(stage, tree, key, leaves) -> None:
    """A call of a compiled ``stage`` (a :class:`Traced` or :class:`Lowered`) has the
    argument structure it was lowered for, and passes a Python scalar of the kind it was
    traced with (bool, int, float: the dtype of its input) where it was, arrays elsewhere.
    ``key``: the call's :func:`signature` key."""
    if tree != stage.in_tree:
        raise TraceError(f"compiled for (args, kwargs) structured as {stage.in_tree}, "
                         f"called with {tree}")
    if key is None or stage.signature is None or len(stage.signature) != len(key):
        return   # a structure mismatch: reported by check_arrays
    names = call_leaf_names(stage.in_tree)
    for i, (want, got) in enumerate(zip(stage.signature, key)):
        if is_scalar_key(want) and want != got:
            now = (f"the Python {got[1]} {leaves[i]!r}" if is_scalar_key(got) else
                   f"an array {TensorType(*got)!r}")
            raise TraceError(
                f"{names[i]}: compiled for a Python {want[1]} (a runtime input of the "
                f"program), called with {now}; pass a {want[1]}, or lower again for the "
                f"new kind (as calling the eins.jit or eins.distribute function does)")
        if not is_scalar_key(want) and is_scalar_key(got):
            raise TraceError(f"{names[i]}: compiled for an array "
                             f"{TensorType(*want)!r}, got the Python scalar "
                             f"{leaves[i]!r}")


def check_arrays(program, arrays) -> None:
    """``arrays`` are as many as ``program``'s inputs, each of its input's shape and dtype."""
    if len(arrays) != len(program.inputs):
        raise TraceError(f"expected {len(program.inputs)} arrays, got {len(arrays)}")
    for k, (v, a) in enumerate(zip(program.inputs, arrays)):
        if tuple(a.shape) != v.shape or array_dtype(a) != v.dtype:
            got = TensorType(tuple(a.shape), array_dtype(a))
            raise TraceError(f"argument {k}: compiled for {v.type!r}, got {got!r}")


def _leaf_count(d) -> int:
    return 1 if d.kind == "leaf" else sum(_leaf_count(c) for c in d.children)


def donated_leaves(tree, argnums, leaves) -> list:
    """The Sharded arrays among the leaves of positional arguments ``argnums`` of a call
    structured as ``tree`` (host arrays have nothing on the devices to release); an argnum
    beyond the call's positional arguments is an error naming it."""
    if not argnums:
        return []
    args = tree.children[0].children
    if argnums[-1] >= len(args):
        raise TraceError(f"donate_argnums={argnums}: the call has {len(args)} positional "
                         f"argument{'s' if len(args) != 1 else ''}")
    starts = np.cumsum([0] + [_leaf_count(c) for c in args])
    return [x for n in argnums for x in leaves[starts[n]:starts[n + 1]]
            if isinstance(x, Sharded)]


class Traced:
    """``eins.jit(fn).lower(*args)``: the program traced for one call signature.
    ``as_text()`` prints it (the ``traced`` stage of :class:`Lowered`); ``compile()`` is the
    callable that runs it on numpy, as calling the jitted function does. ``program``,
    ``in_tree`` and ``out_tree`` are the tracer's (:func:`eins.tracing.trace`)."""

    STAGES = ("traced",)

    def __init__(self, program, in_tree, out_tree, signature=None, statics=None):
        self.program = program
        self.in_tree = in_tree
        self.out_tree = out_tree
        # the call's key (eins.arguments.signature) and its static arguments
        # (eins.arguments.StaticValues), which an Evaluator call must pass again unchanged
        self.signature = signature
        self.statics = statics or StaticValues()

    def as_text(self, stage: str = "traced") -> str:
        if stage != "traced":
            raise EinsError(f"unknown stage {stage!r} of an eins.jit lowering; stages: "
                            f"{list(self.STAGES)} (eins.distribute lowers further)")
        return self.program.pretty()

    def compile(self) -> "Evaluator":
        """The program ready to run on numpy (the reference evaluator)."""
        return Evaluator(self)

    def __repr__(self):
        return f"<Traced {self.program.name}: {len(self.program.eqns)} eqns>"


class Evaluator:
    """A :class:`Traced` program ready to run: callable on the arrays (and Python scalars)
    it was traced for; ``as_text()`` prints the program it runs."""

    def __init__(self, traced: Traced):
        self.traced = traced

    def __call__(self, *args, **kwargs):
        tree, key, leaves = signature(*self.traced.statics.check(args, kwargs))
        refuse_traced(leaves, "a compiled program")
        check_structure(self.traced, tree, key, leaves)
        arrays = data_arrays(leaves, self.traced.program.inputs, tree)
        check_arrays(self.traced.program, arrays)
        return tree_unflatten(self.traced.out_tree, list(self.traced.program.evaluate(*arrays)))

    def as_text(self, stage: str = "traced") -> str:
        return self.traced.as_text(stage)


class Lowered:
    """One program lowered for a device list. Every stage is printable with
    ``as_text(stage)``: ``traced``, ``planned`` (the logical plan, Section 4), ``exchange``
    (one ExProg per consumer input, Section 5) and ``device`` (per-device instruction lists).
    The physical stages are built on first use; planning alone needs no data and no GPU."""

    STAGES = ("traced", "planned", "exchange", "device")

    def __init__(self, compilation, in_tree, out_tree, signature=None, statics=None):
        self.compilation = compilation
        self.in_tree = in_tree
        self.out_tree = out_tree
        # the call's key (eins.arguments.signature) and its static arguments
        # (eins.arguments.StaticValues), which a Compiled call must pass again unchanged
        self.signature = signature
        self.statics = statics or StaticValues()
        self._physical = None
        self._exchanged = None
        self._ranks = {}   # rank -> its device IR alone (rank_device)
        # a Lowered is one trace and one run of the planning passes (Compiled.stats())
        self.counts = {"traces": 1, "plans": 1}
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
            with step(f"lowering {self.program.name} (exchange programs, device programs)"):
                self._physical = run_passes(self.exchanged, PHYSICAL[3:])
            _dump(self.program.name, ("exchange", "device"), self)
        return self._physical

    @property
    def exchanged(self):
        """The Compilation after place, overlay and synthesize (every exchange with its
        body; no device IR yet), built once."""
        if self._exchanged is None:
            with step(f"exchange programs of {self.program.name}"):
                self._exchanged = run_passes(self.compilation, PHYSICAL[:3])
        return self._exchanged

    def rank_device(self, rank: int):
        """The device IR of device ``rank`` alone (``lower_exchanges(xir, rank)``), verified
        on that device's instructions (and the traced, planned and exchange stages as the
        verify pass checks them): what a rank of ``devices="world"`` runs, built without
        the other devices' instructions (from :attr:`physical` when built). Kept per rank."""
        if self._physical is not None:
            return self._physical.device
        got = self._ranks.get(rank)
        if got is None:
            with step(f"lowering {self.program.name} for rank {rank}"):
                if not self._ranks:   # the plan's stages, as the verify pass checks them,
                    verify(self.exchanged)   # and what every rank derives from them alike
                    exchange_schedules(self.exchanged.exchange)
                got = lower_exchanges(self.exchanged.exchange, rank,
                                      self.compilation.options.pipeline)
                verify_device(got)
            self._ranks[rank] = got
        return got

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
        """Predicted run time on the topology (default: dgx-a100 up to 8 devices, a
        dgx-a100:Kx8 cluster beyond): per eqn the slowest device's kernel (the roofline with
        a small-kernel efficiency curve of :func:`eins.cost.predict.kernel_seconds`) plus
        the simulated exchange programs feeding it; eqns run one after another. Keys:
        total_ms, compute_ms, exchange_ms (output gathers included), gather_ms, per_eqn,
        topology, peak_bytes, fits, timeline_ms (GPU by GPU) (eins.cost.predict.predict)."""
        physical = self.physical
        with collection_paused():   # as the passes: a big program's objects are acyclic
            return predict(physical)

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
        device = self.physical.device
        with step(f"codegen ({target})"):
            return replace(generate(device, target), baked=self.statics.baked())

    def compile(self, backend: str = "numpy", device_map=None, graphs: bool = True,
                rebalance=None, *, outputs: str = "host", donate_argnums=(),
                families=False) -> "Compiled":
        """Ready to run on ``backend``: "numpy" (virtual CPU devices, the reference),
        "cuda" (the GPU runtime, eins/runtime/gpu.py), "interpret" (the same GPU program on
        the CPU under Triton's interpreter) or "auto" (cuda when a GPU is visible, else
        numpy). ``device_map`` {logical device: GPU} (or a list in device order) maps the
        plan's devices onto physical GPUs, several per GPU allowed (default: round-robin
        over the visible GPUs); ``graphs`` captures each device's kernel runs into CUDA
        graphs (emulated on "interpret"). Backend and device map are chosen here, not in
        planning: the plan and its device IR do not depend on where they run.
        ``rebalance`` (eqns taking data for a static parameter: attention's ``segments`` as
        an int array): True re-cuts them per call from the call's values, keeping the plan's
        splits (eins/passes/rebalance.py): on "numpy" a device program per distinct cut
        (cached); on the GPU backends one capacity program (eins/passes/capacity.py) whose
        kernels read each call's cut from a table, so no cut generates code or captures a
        graph, or, where an operator has no capacity form, a program per distinct cut;
        False keeps the compile-time cuts, one program for every call; None (default): True
        on "numpy" and, on the GPU backends, where the capacity program exists (its
        transfers move only each call's cut: docs/stages.md), else False.
        ``families=True`` (with the rebalance) keeps plan families planned here from the
        shapes (eins/passes/families.py: the DP's, re-cut per call; attention split by
        query sequence at equal cuts; on "numpy" also whole-block cuts, which "block" asks
        for by name) and runs each call on the one estimated fastest GPU by GPU for its
        ends; ``stats()["chosen"]`` counts the choices, ``choices`` the last ones.

        ``outputs="devices"`` leaves every output on the devices as an
        :class:`eins.runtime.sharded.Sharded` array (the blocks as the plan stored them),
        which a later call takes back without a host round trip; ``donate_argnums``: the
        positional arguments whose Sharded arrays the call consumes (their blocks are
        released when it returns), as JAX's ``donate_argnums``."""
        return Compiled(self, backend, device_map, graphs, rebalance, outputs=outputs,
                        donate_argnums=donate_argnums, families=families)

    def __repr__(self):
        """What the plan minimized first: its time cost, or the proxy's bytes."""
        p, plan = len(self.devices), self.plan
        proxy = f"proxy {format_bytes(self.cost_bytes)}"
        if plan.minimized == "time" and plan.cost_s is not None:
            what = f"minimized time {format_seconds(plan.cost_s)} ({proxy})"
        elif plan.minimized:
            what = f"minimized {proxy}"
        else:
            what = f"{plan.selector} plan, {proxy}"
        return f"<Lowered {self.program.name} on {p} device{'s' if p != 1 else ''}, {what}>"


# The marks of the device stage's text (docs/stages.md explains every instruction).
DEVICE_LEGEND = (
    "# per device, its instructions in order; buffer names say where a block came from:\n"
    "#   inN load (of program input or constant `inK`/`constK`), kN kernel result, atN slice\n"
    "#   (an atom of a block), agN agg (⊕ of copies), rxN recv, blkN concat (recomposed block);\n"
    "#   name~ is a partial copy that an agg still has to combine; send/recv devD #T pair a\n"
    "#   send with its recv by the tag T; [lo:hi,...] is the block of the whole tensor.\n")


def exchange_text(xir) -> str:
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
        warnings.warn(f"EINS_DUMP_DIR={d!r}: cannot write the {'/'.join(stages)} dump "
                      f"({e.strerror or e}: {e.filename or d}); the computation goes on "
                      f"without it", RuntimeWarning, stacklevel=3)


class Compiled:
    """A lowered program ready to run on its backend: callable on numpy arrays (and, on the
    GPU backends, on torch tensors and CuPy arrays); ``place(...)`` makes inputs resident;
    ``stats()`` reports the last run's transfers and memory."""

    # device programs kept per distinct cut (eins/rebalanced.py)
    RECUT_CACHE = FamilyRun.RECUT_CACHE
    CHOICES_KEPT = 1000   # the last calls' family choices (``choices``)

    def __init__(self, lowered: Lowered, backend: str = "numpy", device_map=None,
                 graphs: bool = True, rebalance=None, *, outputs: str = "host",
                 donate_argnums=(), families=False):
        graphs = flag_option("graphs", graphs)
        self.outputs, self.donate_argnums = resident_options(outputs, donate_argnums)
        self.lowered = lowered
        self.backend = resolve_backend(backend)
        if rebalance is not None:
            flag_option("rebalance", rebalance)
        families = families_option(families, self.backend)
        ops = runtime_operands(lowered.program)
        comp = lowered.compilation
        # the GPU backends re-cut through one capacity program (eins/passes/capacity.py):
        # one generated program and one set of graphs for every cut; numpy lowers each new
        # cut (eins/rebalanced.py says why)
        form = capacity(comp, ops) if ops and self.backend != "numpy" and \
            rebalance is not False and not families else None
        # on by default where one program serves every cut: on numpy, with families, and on
        # a GPU backend with a capacity form, whose windowed transfers move each cut's bytes
        # (docs/stages.md); elsewhere on a GPU each new cut is a new program and capture
        if rebalance is None:   # not where a capacity kernel masks p times the cut's work
            rebalance = self.backend == "numpy" or bool(families) or (
                form is not None and not form.masks)
            form = form if rebalance else None
        self.rebalance = flag_option("rebalance", rebalance)
        if families and not (self.rebalance and ops):
            raise EinsError(f"families=True picks a plan family per call from its segment "
                            f"ends; it needs rebalance on and a runtime segments array (here "
                            f"rebalance={self.rebalance}, and {'a' if ops else 'no'} runtime operand)")
        self._operands = ops if self.rebalance else {}
        self.counts = dict(lowered.counts, rebalances=0, lowerings=0, kernel_compiles=0,
                           graph_captures=0, families=1)
        self._device_map, self._graphs = device_map, graphs
        if self.backend == "numpy" and device_map is not None:   # before its shape checks
            raise EinsError(f"device_map={device_map!r} maps logical devices onto GPUs; the "
                            f"numpy backend has virtual devices only")
        check_device_map(device_map, lowered.devices)
        self._stats = None
        self._ran = False
        if self.backend == "cuda":
            count_jit_compiles()
        self._set = FamilySet(comp, ops, self.backend == "numpy", families) if families else None
        self._runs: dict = {}    # family name (None: the one family) -> its FamilyRun
        self.choices: deque = deque(maxlen=self.CHOICES_KEPT)   # BatchChoice per call
        self._last_cut = None    # (family, re-cut Compilation) of the last call
        self._last_run = None    # the last call's FamilyRun (None: no runtime operands)
        physical = None
        if form is None and not families:
            physical = lowered.physical.device
            self.counts["lowerings"] += 1
        self.device_program = physical
        self.gpu = None
        if self._operands and not families:
            self._runs[None] = FamilyRun(comp, ops, self._executable(), self.counts, form,
                                         physical)
            self.device_program = self._runs[None].device_program
            self.gpu = self._runs[None].gpu
        elif not families and self.backend != "numpy":
            self.gpu = self._executable()(physical)
        if families:
            self._family_runs()

    def _executable(self):
        """dprog -> this backend's GpuExecutable of it (None on numpy)."""
        if self.backend == "numpy":
            return None
        topo = self.lowered.compilation.topology
        return lambda dprog: GpuExecutable(
            dprog, self.backend, self._device_map, self._graphs,
            attention=self.lowered.compilation.options.attention,
            profile=getattr(topo, "profile", None))

    def _family_runs(self):
        """A FamilyRun per family of the family set (planned and first lowered already)."""
        fs, exe = self._set, self._executable()
        self.counts.update(families=len(fs.members), chosen=dict.fromkeys(fs.names, 0))
        self.counts["plans"] += fs.plans
        self.counts["lowerings"] += fs.lowerings
        for m in fs.members:
            form = capacity(m.planned, self._operands) if exe is not None else None
            self._runs[m.name] = FamilyRun(m.planned, self._operands, exe, self.counts, form,
                                           first=m.first, balance=m.balance, block=m.cutter)

    def _program_for(self, arrays):
        """(arrays, what runs them, the FamilyRun) of one call: its family's (with
        ``families``: the one estimated fastest for its runtime operands, recorded in
        ``choices``) program for its cut."""
        if self._set is None:
            run = self._runs[None]
            return run.program(arrays) + (run,)
        with per_call():   # the choice and its program: one call's work (eins.passes)
            member, cut, *got = self._set.choose(arrays)   # estimates, and which are bounds
            run, before = self._runs[member.name], self.counts["lowerings"]
            arrays, program = run.program(arrays, cut)
        self.counts["chosen"][member.name] += 1
        self._last_cut = (member, cut)
        self.choices.append(BatchChoice(sum(self.counts["chosen"].values()), member.name,
                                        got[0][member.name], *got, self.counts["lowerings"] > before))
        return arrays, program, run

    def __call__(self, *args, **kwargs):
        tree, key, leaves = signature(*self.lowered.statics.check(args, kwargs))
        refuse_traced(leaves, "a compiled program")
        return self.run_leaves(tree, leaves, key)

    @property
    def families(self) -> dict:
        """{name: the plan (eins.ir.plan.Plan) of that family} for each family kept (the
        name None: the one family of a program without ``families=True``)."""
        if self._set is not None:
            return {m.name: m.planned.plan for m in self._set.members}
        return {None: self.lowered.plan}

    @property
    def choice(self):
        """The last call's BatchChoice (eins.passes.families; families=True), or None."""
        return self.choices[-1] if self.choices else None

    @property
    def last_cut(self):
        """The Compilation the last call's family was re-cut to (families=True), or None."""
        return self._last_cut[1] if self._last_cut is not None else None

    @property
    def capacity(self):
        """The capacity form (eins.passes.capacity.Capacity: the planned compilation with its
        per-call row tables; with ``families`` the last call's family's, as
        ``device_program``), or None: a GPU backend's rebalance through one program per cut."""
        run = self._last_run or self._runs.get(None)
        return run.capacity if run is not None else None

    def as_text(self, stage: str = "device") -> str:
        """The text of one of its lowering's stages (:meth:`Lowered.as_text`); by default
        ``device``, the per-device instructions this runs."""
        return self.lowered.as_text(stage)

    def _arrays(self, tree, leaves, key=None):
        check_structure(self.lowered, tree, key, leaves)
        leaves = self._resident_leaves(tree, leaves)
        inputs = self.lowered.program.inputs
        if self.backend == "numpy":
            arrays = data_arrays(leaves, inputs, tree, keep=Sharded)
        else:  # device arrays stay what they are (no host round trip)
            data_arrays([x for x in leaves if isinstance(x, ShapeDtype)])
            arrays = [x for x in leaves if not is_python_scalar(x) or is_traced_scalar(x)]
            arrays = [scalar_array(x, inputs[k].dtype, f"argument {k}")
                      if is_traced_scalar(x) and k < len(inputs) else
                      x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
                      for k, x in enumerate(arrays)]
            for k, a in enumerate(arrays):
                if is_torch(a):
                    check_torch_leaf(a, k)
        check_arrays(self.lowered.program, arrays)
        return arrays

    def _resident_leaves(self, tree, leaves) -> list:
        """The call's leaves with each Sharded array checked (not donated earlier) and, when
        its blocks live in another memory than this backend's (a numpy-device array passed
        to "interpret"), brought to the host first."""
        where = self.backend
        names = None
        out = list(leaves)
        for i, x in enumerate(leaves):
            if isinstance(x, Sharded):
                if x.donated:
                    names = names or call_leaf_names(tree)
                    x.check_alive(names[i])
                if x.where != where:
                    out[i] = x.gather()
        return out

    def run_leaves(self, tree, leaves, key=None):
        """Run on a call already classified (:func:`eins.arguments.signature`'s tree, key
        and leaves), as ``eins.distribute``'s function does after its cache lookup."""
        donated = donated_leaves(tree, self.donate_argnums, leaves)
        arrays = self._arrays(tree, leaves, key)
        keep = self.outputs == "devices"
        run = program = None
        if self._operands:   # this call's cut: its tables, or its program
            arrays, program, run = self._program_for(arrays)
        self._last_run = run
        if run is not None and run.capacity is not None:   # with families: the call's family's
            self.device_program = run.device_program
        if self.backend != "numpy":
            gpu = program or self.gpu
            compiles = COUNTS["kernel_compiles"]
            if not self._ran:   # the first run compiles the Triton kernels (and graphs)
                with step(f"first {self.backend} run: Triton compilation"):
                    outs = gpu(arrays, keep=keep)
                self._ran = True
            else:
                outs = gpu(arrays, keep=keep)
            self.counts["kernel_compiles"] += COUNTS["kernel_compiles"] - compiles
            self.counts["graph_captures"] = sum(r.captures() for r in self._runs.values()) \
                if self._runs else self.gpu.captures()
            self._last_gpu = gpu
            self._stats = None
        else:
            outs, self._stats = execute(program or self.device_program, arrays, keep=keep)
        for x in donated:   # the call ran: the state it consumed is released
            x.donate(f"a call of {self.lowered.program.name}")
        return tree_unflatten(self.lowered.out_tree, list(outs))

    def prepare(self, *args, **kwargs):
        """The per-call work of a call with these arguments, without running it: with
        ``families``, the family choice (recorded in ``choices`` and ``stats()["chosen"]``,
        returned), and the re-cut and its program, lowered when its cut is new, as a call
        does. Only the runtime operands (the segment ends) are read: the other arguments
        may be ShapeDtypes. For timing and pricing that work on shapes too large to run
        (benchmarks/bench_packed.py). Returns the call's BatchChoice (None without
        ``families``)."""
        if not self._operands:
            raise EinsError("prepare() is the per-call rebalance of a program that takes "
                            "its segment ends as data, with rebalance on; this one runs one "
                            "program for every call")
        with per_call():   # its checks too: no collection inside the call's own work
            tree, key, leaves = signature(*self.lowered.statics.check(args, kwargs))
            refuse_traced(leaves, "a compiled program")
            check_structure(self.lowered, tree, key, leaves)
            arrays = data_arrays(leaves, self.lowered.program.inputs, tree,
                                 keep=(Sharded, ShapeDtype))
            check_arrays(self.lowered.program, arrays)
            for _, k in self._operands.values():
                if isinstance(arrays[k], ShapeDtype):
                    name = call_leaf_names(tree)[[id(x) for x in leaves].index(id(arrays[k]))]
                    raise EinsError(f"prepare(): {name} (the runtime segment ends) must be an "
                                    f"array, got {arrays[k]!r}")
            self._program_for(arrays)
        return self.choice

    def predicted_time(self) -> dict:
        """The predicted time (eins.cost.predict.predict) of the last call's program with
        ``families``: its family re-cut for the call, lowered and its exchanges simulated
        (on the GPU backends, what a per-cut program of that cut would take)."""
        if self._last_cut is None:
            raise EinsError("predicted_time() prices the last call's family and cut (with "
                            "families=True); none ran yet")
        member, cut = self._last_cut
        return member.predicted(cut)

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
        if self.backend == "numpy":
            raise EinsError("place() needs a GPU backend ('cuda' or 'interpret'); this "
                            "program was compiled for 'numpy'")
        tree, key, leaves = signature(*self.lowered.statics.check(args, kwargs))
        arrays = self._arrays(tree, leaves, key)
        got = None
        # every family's executable (the capacity program's tables are per call: zeros)
        for run in self._runs.values():
            got = run.place(arrays)
        if self.gpu is not None and not self._runs:
            got = self.gpu.place(arrays)
        return got if got is not None else {}

    def stats(self) -> dict:
        """The last run: bytes per (source, destination), transfers, peak live bytes per
        device, kernels run (numpy); on the GPU backends also host<->device bytes
        (h2d_bytes, d2h_bytes), loads skipped for placed inputs, launches issued and graph
        replays."""
        if self.backend != "numpy":
            last = getattr(self, "_last_gpu", self.gpu)
            if last is None:
                raise EinsError("stats() before the first call")
            return dict(last.stats(), **self.counters())
        if self._stats is None:
            raise EinsError("stats() before the first call")
        return dict(self._stats.as_dict(), **self.counters())

    def counters(self) -> dict:
        """What this program cost to make and keep current, over its life: ``traces`` and
        ``plans`` (its lowering: one each; with ``families=True`` one more, the family
        set's forced split), ``families`` (plan families kept: 1, or with
        ``families=True`` those of its family set), ``rebalances`` (calls re-cut for their
        runtime segments), ``lowerings`` (device programs built: the plan's, or the
        capacity program of a GPU backend, or each family's first lowering, plus one per
        new cut where a program per cut runs), ``kernel_compiles`` (Triton kernels built
        while it ran) and ``graph_captures`` (CUDA graphs recorded, emulated ones on
        "interpret"); with ``families=True``, ``chosen`` {family: calls that ran it}. A
        call with new boundaries on a program that takes them as data adds a rebalance and
        nothing else expensive."""
        out = dict(self.counts)
        if "chosen" in out:
            out["chosen"] = dict(out["chosen"])
        return out
