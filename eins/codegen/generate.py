"""Render a device program (eins/ir/device.py) as source code, one module per device plus a
shared kernel module (every backend executes the one device IR: docs/architecture.md).

``generate(dprog, target)``: target "cuda" gives per-device host programs for the GPU
runtime (eins/runtime/gpu.py): every buffer allocated once, Loads first and Stores last, the
device's instructions in order on its own stream, Triton kernels for elementwise eqns and ⊕
(expressions from eins/kernels/expressions.py), each primitive's GPU lowering for the
others, runs of kernels captured into CUDA graphs, transfers as copies ordered by events;
the same sources run on a GPU (backend "cuda") and on the CPU under Triton's interpreter
(backend "interpret", eins/runtime/gpu_exec.py). Target "numpy" gives the SAME walk in plain
numpy, which ``GeneratedProgram.run`` executes on the CPU (devices run round-robin,
exchanging through a mailbox, as eins/runtime/numpy_backend.py does).

Each target's walk is one :class:`eins.ir.device.InstrVisitor` (``NumpyWalk`` of
eins/codegen/numpy_walk.py, ``GpuWalk`` of eins/codegen/gpu_walk.py, which also decides the
GPU launches' fusion and the memory plan): one ``visit_<kind>`` method per device-IR
instruction, checked when its module is imported, so a new instruction is one method per
target. The memory plan and fusion read only what every instruction declares (``uses()``,
``defs()``, ``ends()``) and the walk's positions. Both write their lines with the text
helpers of eins/codegen/source.py. This module renders the walks into the templates
(:func:`generate`) and holds the result (:class:`GeneratedProgram`, ``write``/``run``).
"""
from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass

import numpy as np

from eins.errors import EinsError, OutputError
from eins.kernels import expressions as ex
from eins.kernels import build
from eins.kernels.fusion import agg_source
from eins.codegen.gpu_walk import GpuWalk
from eins.codegen.numpy_walk import ew_kernel, numpy_steps
from eins.codegen.source import eqn_texts, is_ew, py, recv_names, render_template
from eins.ir.joinagg import is_lse_pair
from eins.ir.pieces import receives_where_read
from eins.ir.types import TensorType, as_dtype, is_torch_tensor, torch_to_numpy

TARGETS = ("cuda", "numpy")


# ----------------------------------------------------------------------------- the result
@dataclass
class GeneratedProgram:
    """Generated sources: ``sources[d]`` per device, ``sources["kernels"]`` shared."""

    target: str
    sources: dict
    device_program: object   # the DeviceProgram these sources were generated from
    triton: tuple = ()   # CUDA target: each Triton kernel's source (also in sources["kernels"])
    # the call's Python scalars baked into the program as literals ("argument 1 = 2.0"):
    # not inputs of run(), which says so when it is given one too many
    baked: tuple = ()

    def write(self, directory) -> list[str]:
        """Write a Python package: kernels.py, device_<d>.py, and __init__.py (numpy target:
        with ``run(inputs)``, which checks the inputs against the traced types it records,
        and consts.npz, the arrays the function closed over). A directory that cannot be
        made or written is an OutputError naming it."""
        if not isinstance(directory, (str, os.PathLike)) or isinstance(directory, bytes):
            raise OutputError(f"write: the directory must be a path (str or os.PathLike), got "
                              f"{directory!r}")
        try:
            os.makedirs(directory, exist_ok=True)
            _clear_package(directory)
            paths = []
            for key, src in self.sources.items():
                path = os.path.join(directory, "kernels.py" if key == "kernels"
                                    else f"device_{key}.py")
                with open(path, "w") as f:
                    f.write(src)
                paths.append(path)
            init = os.path.join(directory, "__init__.py")
            devs = [k for k in self.sources if k != "kernels"]
            prog = self.device_program.program
            with open(init, "w") as f:
                f.write(_init_source(self.target, devs, prog, self.baked))
            paths.append(init)
            if self.target == "numpy" and prog.consts:
                paths.append(os.path.join(directory, "consts.npz"))
                write_consts(paths[-1], [c for _, c in prog.consts])
        except OSError as e:
            why = "it is a file" if os.path.isfile(directory) else (e.strerror or str(e))
            raise OutputError(f"cannot write the generated {self.target} package to "
                              f"{os.fspath(directory)!r}: {why}") from None
        return paths

    def _numpy_only(self):
        if self.target != "numpy":
            raise EinsError(f"codegen: only the numpy target runs here (this is {self.target!r};"
                            f" the GPU runtime runs the cuda target: "
                            f"compile(backend='cuda' or 'interpret'))")

    def modules(self):
        """Exec the generated sources (numpy target): (kernel namespace, {device: namespace})."""
        self._numpy_only()
        kern = {"__name__": "eins_generated_kernels"}
        exec(compile(self.sources["kernels"], "<eins kernels>", "exec"), kern)
        K = type("Kernels", (), {})()
        K.__dict__.update(kern)
        devs = {}
        for d in self.device_program.devices:
            ns = {"__name__": f"eins_generated_device_{d}"}
            exec(compile(self.sources[d], f"<eins device {d}>", "exec"), ns)
            ns["K"] = K
            devs[d] = ns
        return K, devs

    def run(self, inputs, consts=None):
        """Execute the numpy target: devices round-robin, each until it waits on a receive
        (sends never wait), as eins/runtime/numpy_backend.py. Returns the outputs tuple."""
        self._numpy_only()
        prog = self.device_program.program
        traced = [c for _, c in prog.consts]
        # other constants than the traced ones are checked as the inputs are (they were
        # ignored when the program had none, and cast or broadcast into its buffers)
        consts = traced if consts is None else check_inputs(consts, signature(traced), "const")
        inputs = check_inputs(inputs, signature(prog.inputs), baked=self.baked)
        _, devs = self.modules()
        outputs = [np.zeros(v.shape, v.dtype) for v in prog.outputs]
        mbox = {}
        gens = {d: ns["program"](inputs, consts, outputs, mbox) for d, ns in devs.items()}
        drive(gens, mbox)
        return tuple(outputs)


def signature(values) -> tuple:
    """((shape, dtype name), ...) of program inputs or outputs: what a written package
    records of its inputs and outputs."""
    return tuple((tuple(v.shape), np.dtype(v.dtype).name) for v in values)


def _clear_package(directory) -> None:
    """Remove what an earlier write of a generated package left in ``directory``: its
    modules (device files of a program on more devices stayed behind), consts.npz and
    __pycache__, whose bytecode CPython checks by whole-second mtime and size only (a
    program differing in one literal, written in the same second, ran the old bytecode).
    Files of other names are the user's and stay."""
    for name in ["kernels.py", "__init__.py", "consts.npz"]:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            os.remove(path)
    for path in glob.glob(os.path.join(glob.escape(os.fspath(directory)), "device_*.py")):
        os.remove(path)
    shutil.rmtree(os.path.join(directory, "__pycache__"), ignore_errors=True)


def check_inputs(inputs, sig, what: str = "input", baked=()) -> list:
    """``inputs`` as numpy arrays of the traced types ``sig`` (:func:`signature`), or an
    EinsError naming the input (``what``: "input", or "const" for the constants
    :meth:`GeneratedProgram.run` may be given): a nested list is read in its traced dtype;
    an array of another dtype or shape is refused (it was cast or broadcast silently into
    the buffers, or failed inside the device code). ``baked``: the Python scalars of the
    traced call that are literals of the program, named where the count is wrong."""
    if isinstance(inputs, (str, bytes, dict, np.ndarray)) or not hasattr(inputs, "__len__"):
        wrap = " (wrap one array in a list: [x])" if isinstance(inputs, np.ndarray) else ""
        raise EinsError(f"generated program: {what}s must be a list of {len(sig)} arrays, got "
                        f"{type(inputs).__name__}{wrap}")
    if len(inputs) != len(sig):
        hint = "" if not baked or len(inputs) <= len(sig) else (
            f"; the traced call's Python scalar{'s' if len(baked) > 1 else ''} "
            f"({'; '.join(baked)}) {'are' if len(baked) > 1 else 'is'} baked into the program "
            f"as {'literals' if len(baked) > 1 else 'a literal'}, not an input: pass the "
            f"arrays only")
        raise EinsError(f"generated program: expected {len(sig)} {what}s, got "
                        f"{len(inputs)}{hint}")
    arrays = []
    for k, ((shape, name), x) in enumerate(zip(sig, inputs)):
        dt = as_dtype(name)
        if isinstance(x, np.ma.MaskedArray):   # np.asarray would drop the mask
            raise EinsError(f"generated program: {what} {k} is a numpy masked array; the "
                            f"program computes on plain arrays and would ignore its mask: "
                            f"pass x.filled(value)")
        if is_torch_tensor(x):   # requires_grad, bfloat16, CUDA: np.asarray refuses them
            x = torch_to_numpy(x, f"generated program: {what} {k}")
        try:
            # an array-like keeps its dtype (checked below); lists take the traced one, when
            # their values are the traced dtype's: 1.7 for an int32 input is not truncated
            a = np.asarray(x) if hasattr(x, "dtype") else np.asarray(x, dt)
            if not hasattr(x, "dtype") and dt.kind in "biu":
                raw = np.asarray(x)
                if raw.size and (raw.dtype.kind not in "biu" or (
                        dt.kind == "b" and raw.dtype.kind != "b")):
                    raise ValueError(f"its values are {raw.dtype}, not {dt.name} (the list "
                                     f"would be truncated or cast)")
        except (TypeError, ValueError, OverflowError) as e:
            raise EinsError(f"generated program: {what} {k} ({type(x).__name__}) is not an "
                            f"array of {TensorType(tuple(shape), dt)!r}: {e}") from None
        if a.shape != tuple(shape):
            raise EinsError(f"generated program: {what} {k} has shape {a.shape}, expected "
                            f"{tuple(shape)}")
        if a.dtype != dt:
            raise EinsError(f"generated program: {what} {k} has dtype {a.dtype}, expected "
                            f"{dt} (cast it: np.asarray(x, {name!r}))")
        arrays.append(a)
    return arrays


def write_consts(path, consts) -> None:
    """The program's constants (arrays closed over by the traced function) as an .npz of
    their bytes (bfloat16 has no npy type), read back by :func:`load_consts`."""
    arrs = [np.ascontiguousarray(c) for c in consts]
    np.savez(path, **{f"c{k}": a.reshape(-1).view(np.uint8) for k, a in enumerate(arrs)})


def load_consts(path, sig) -> list:
    """The constants :func:`write_consts` wrote, of the types ``sig`` (:func:`signature`)."""
    with np.load(path) as z:
        return [z[f"c{k}"].view(as_dtype(name)).reshape(shape)
                for k, (shape, name) in enumerate(sig)]


def drive(gens: dict, mbox: dict):
    """Round-robin: a round in which no device finishes and no message moves is a deadlock
    (impossible for lists from one global topological order; a generator bug otherwise)."""
    gens = dict(gens)
    while gens:
        before = frozenset(mbox)
        finished = []
        for d, g in gens.items():
            try:
                next(g)
            except StopIteration:
                finished.append(d)
        for d in finished:
            del gens[d]
        if gens and not finished and frozenset(mbox) == before:
            raise EinsError(f"generated program deadlocked: devices {sorted(gens)} all wait")
    if mbox:
        raise EinsError(f"generated program: {len(mbox)} messages were never received")


def _init_source(target, devs, prog, baked=()) -> str:
    imports = "\n".join(f"from . import device_{d}" for d in devs)
    table = ", ".join(f"{d}: device_{d}" for d in devs)
    if target == "cuda":
        # run through eins: GpuExecutable(generated_program, backend=...) execs these
        # sources (the interpret backend must decorate the kernels in interpreter mode)
        body = f"DEVICES = {{{table}}}\n"
    else:
        consts = tuple((tuple(np.shape(c)), np.asarray(c).dtype.name) for _, c in prog.consts)
        body = (f"DEVICES = {{{table}}}\n"
                f"INPUTS = {signature(prog.inputs)!r}   # (shape, dtype) of each input\n"
                f"OUTPUTS = {signature(prog.outputs)!r}\n"
                f"CONSTS = {consts!r}   # in consts.npz\n"
                f"BAKED = {tuple(baked)!r}   # the traced call's Python scalars, now "
                f"literals\n\n\n"
                "def run(inputs):\n"
                '    """The outputs (a tuple of numpy arrays) for ``inputs``: one numpy array\n'
                '    (or nested list) per input, of the shapes and dtypes in INPUTS."""\n'
                "    import os\n\n"
                "    import numpy as np\n\n"
                "    from eins.codegen.generate import check_inputs, drive, load_consts\n"
                "    from eins.ir.types import as_dtype\n"
                "    inputs = check_inputs(inputs, INPUTS, baked=BAKED)\n"
                "    consts = (load_consts(os.path.join(os.path.dirname(__file__), "
                "'consts.npz'), CONSTS)\n"
                "              if CONSTS else [])\n"
                "    outputs = [np.zeros(s, as_dtype(dt)) for s, dt in OUTPUTS]\n"
                "    mbox = {}\n"
                "    for m in DEVICES.values():\n"
                "        m.K = kernels\n"
                "    drive({d: m.program(inputs, consts, outputs, mbox) for d, m in "
                "DEVICES.items()}, mbox)\n"
                "    return tuple(outputs)\n")
    return (f'"""eins generated program ({target} target)."""\nfrom . import kernels\n'
            f"{imports}\n\n{body}")


def generate(dprog, target: str = "cuda") -> GeneratedProgram:
    """Render device program ``dprog`` for ``target`` ("cuda" or "numpy")."""
    if target not in TARGETS:
        raise EinsError(f"codegen: unknown target {target!r}; choose one of {list(TARGETS)}")
    prog = dprog.program
    if prog is None:
        raise EinsError("codegen: the device program has no traced program attached")
    texts = eqn_texts(prog)
    sources = {}
    used_ew = sorted({ins.eqn for d in dprog.devices for ins in dprog.code.get(d, [])
                      if ins.kind == "kernel" and is_ew(prog.eqns[ins.eqn])})
    if target == "numpy":
        kernels = []
        for i in used_ew:
            kernels.append(ew_kernel(prog, i, texts, f"ew_eqn{i}"))
        sources["kernels"] = render_template("numpy_kernels.py.j2", kernels=kernels,
                                             npx_prelude=ex.NPX_PRELUDE)
        for d in dprog.devices:
            fspecs = {}
            steps = numpy_steps(dprog, d, texts, fspecs)
            sources[d] = render_template(
                "numpy_program.py.j2", device=d, ndev=len(dprog.devices), steps=steps,
                fspecs=[(n, s) for s, n in fspecs.items()])
        return GeneratedProgram(target, sources, dprog)

    dprog = receives_where_read(dprog)   # a receive is a wait there: where it is read
    receivers = recv_names(dprog)
    needs = {"fused": {}, "agg": set()}
    for d in dprog.devices:
        walk = GpuWalk(dprog, d, texts, receivers, needs).run()
        bufs = dprog.bufs.get(d, {})
        touched, slot_of, slots = walk.memory_plan()
        sources[d] = render_template(
            "gpu_program.py.j2", device=d, ndev=len(dprog.devices), steps=walk.body,
            loads=walk.loads, stores=walk.stores,
            ninstr=len(walk.instrs), slots=sorted(slots.items()),
            buffers=[_gpu_buffer(n, i, slot_of[n]) for n, i in bufs.items() if n in touched],
            literals=list(walk.lits.items()), fspecs=[(n, s) for s, n in walk.fspecs.items()],
            checked=sorted(walk.checked), neqns=len(prog.eqns))
    triton_sources = [src for _, src in sorted(needs["fused"].items())]
    for op, n in sorted(needs["agg"]):
        base, _, out = op.partition("_final_")   # lse_final_<dtype>: writes the output
        triton_sources.append(agg_source(f"agg_{op}_{n}", base, n, out or None))
    triton_sources = [s.rstrip("\n") + "\n" for s in triton_sources]
    sources["kernels"] = render_template(
        "gpu_kernels.py.j2", triton_sources=[s.rstrip("\n") for s in triton_sources],
        helpers=build.KERNEL_HELPERS.rstrip("\n"))
    return GeneratedProgram(target, sources, dprog, tuple(triton_sources))


def _gpu_buffer(name, info, slot):
    """(name, shape, dtype, slot) of a device buffer; (o, lse) pairs are a trailing axis of
    2 of their float dtype (the layout the lse ⊕ kernel reads)."""
    if is_lse_pair(info.dtype):
        return name, py(tuple(info.box.shape) + (2,)), ex.np_dtype_expr(info.dtype["o"]), slot
    return name, py(tuple(info.box.shape)), ex.np_dtype_expr(info.dtype), slot


def triton_kernel_sources(gp: GeneratedProgram) -> list[str]:
    """The ``@triton.jit`` kernels of a CUDA target's kernel module, each as its own source."""
    return list(gp.triton)
