"""Render a device program (eins/ir/device.py) as source code, one module per device plus a
shared kernel module (DESIGN.md: every backend executes the one device IR).

``generate(dp, target)``: target "cuda" gives per-device host programs for the GPU runtime
(eins/runtime/gpu.py): Triton kernels for elementwise eqns and ⊕, torch lowerings for the
other primitives, runs of kernels captured into CUDA graphs, transfers as copies ordered by
events; the same sources run on a GPU (backend "cuda") and on the CPU under Triton's
interpreter (backend "interpret", eins/runtime/gpu_exec.py). Target "numpy" gives the SAME walk in
plain numpy, which ``GeneratedProgram.run`` executes on the CPU (devices run round-robin,
exchanging through a mailbox, as eins/runtime/numpy_backend.py does).
"""
from __future__ import annotations

import keyword
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from eins.errors import EinsError
from eins.ir.device import Agg, Concat, Free, Kernel, Load, Recv, Send, Slice, Store, format_instr
from eins.codegen import expressions as ex
from eins.codegen import memory
from eins.ir.joinagg import PAIR_AGGS, is_lse_pair

TARGETS = ("cuda", "numpy")
_TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
_ENV = Environment(loader=FileSystemLoader(_TEMPLATES), trim_blocks=True, lstrip_blocks=True,
                   keep_trailing_newline=True, undefined=StrictUndefined)
_RESERVED = {"np", "cp", "K", "B", "S", "dev", "self", "inputs", "consts", "outputs", "mbox", "Box",
             "FunctionSpec", "bfloat16", "program", "r"}


def render_template(template: str, /, **ctx) -> str:
    return _ENV.get_template(template).render(**ctx)


# ----------------------------------------------------------------------------- literals
def py(v) -> str:
    """Python source for a parameter value inside a generated module."""
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        return ex.np_dtype_expr(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(py(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, list):
        return "[" + ", ".join(py(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{py(k)}: {py(x)}" for k, x in v.items()) + "}"
    if isinstance(v, np.generic):
        return py(v.item())
    if isinstance(v, float) and not math.isfinite(v):
        return f"float({str(v)!r})"
    return repr(v)


def box_src(b) -> str:
    return f"Box({py(tuple(b.lo))}, {py(tuple(b.hi))})"


def fspec_src(f) -> str:
    ins = "(" + "".join(box_src(b) + ", " for b in f.inputs) + ")"
    outs = "(" + "".join(box_src(b) + ", " for b in f.outputs) + ")"
    return f"FunctionSpec({ins}, {outs})"


def slices_src(sl) -> str:
    return ", ".join(f"{s.start}:{s.stop}" for s in sl) or "..."


def box_slices(b) -> str:
    """The global box ``b`` as slices of the whole tensor."""
    return ", ".join(f"{lo}:{hi}" for lo, hi in zip(b.lo, b.hi)) or "..."


def kwargs_src(params) -> str:
    return ", ".join(f"{k}={py(params[k])}" for k in sorted(params))


def ident(name: str) -> str:
    """A buffer name as a Python identifier (the device IR's names normally already are)."""
    if name.isidentifier() and not keyword.iskeyword(name) and name not in _RESERVED:
        return name
    return "b_" + re.sub(r"\W", "_", name)


def strides(shape) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def eqn_texts(prog) -> list[str]:
    """Each eqn's line of the program's printed form (comments in the generated code)."""
    lines = prog.pretty().splitlines()[1:1 + len(prog.eqns)]
    return [ln.strip() for ln in lines]


# ----------------------------------------------------------------------------- kernels
def _is_ew(eqn) -> bool:
    return ex.is_elementwise(eqn.prim)


def _ew_kernel(prog, i, texts, name):
    """What the numpy-dialect templates need for eqn ``i``'s elementwise kernel."""
    eqn = prog.eqns[i]
    names = ex.operand_names(eqn.prim, eqn.params)
    dts = ex.dtypes_for(eqn.prim, [a.dtype for a in eqn.inputs], eqn.outputs[0].dtype)
    return dict(name=name, eqn=i, text=texts[i], args=list(names),
                expr=ex.render(eqn.prim, "numpy", eqn.params), out=ex.np_dtype_expr(dts.out),
                casts=[(a, ex.np_dtype_expr(c)) for a, c in zip(names, dts.compute)])


# ----------------------------------------------------------------------------- the walk
@dataclass
class _Step:
    comment: str
    lines: list
    kind: str          # "host" (Load/Store), "comm" (Send/Recv), "kernel" (on the stream)
    segment: int | None = None
    comments: list = field(default_factory=list)


def _fmt(ins, bufs, texts):
    """The instruction as the device IR prints it; a Kernel names its eqn as traced."""
    s = format_instr(ins, bufs)
    if isinstance(ins, Kernel):
        s = s.split("    #")[0] + f"    # {texts[ins.eqn]}"
    return s


def _recv_names(dp):
    """(sender, receiver, tag) -> the receive buffer's name on the receiver."""
    out = {}
    for d in dp.devices:
        for ins in dp.code.get(d, []):
            if isinstance(ins, Recv):
                out[(ins.peer, d, ins.tag)] = ins.dst
    return out


_NP_AGG = {"sum": "np.add", "max": "np.maximum", "min": "np.minimum"}


def _numpy_steps(dp, d, texts, fspecs):
    prog = dp.program
    bufs = dp.bufs.get(d, {})
    steps = []
    for ins in dp.code.get(d, []):
        c = _fmt(ins, bufs, texts)
        if isinstance(ins, Load):
            src = "inputs" if ins.source[0] == "in" else "consts"
            sl = box_slices(ins.box)
            lines = [f"{ident(ins.dst)} = np.array({src}[{ins.source[1]}][{sl}])"]
        elif isinstance(ins, Slice):
            sl = slices_src(ins.box.relative_to(bufs[ins.src].box))
            lines = [f"{ident(ins.dst)} = np.array({ident(ins.src)}[{sl}])"]
        elif isinstance(ins, Concat):
            info = bufs[ins.dst]
            lines = [f"{ident(ins.dst)} = np.empty({py(ins.box.shape)}, "
                     f"{ex.np_dtype_expr(info.dtype)})"]
            for s in ins.srcs:
                lines.append(f"{ident(ins.dst)}[{slices_src(bufs[s].box.relative_to(ins.box))}]"
                             f" = {ident(s)}")
        elif isinstance(ins, Agg) and ins.op not in _NP_AGG:  # lse: pairs, then finalize
            srcs = ", ".join(ident(s) for s in ins.srcs)
            lines = [f"{ident(ins.dst)} = K.agg({ins.op!r}, "
                     f"{ex.np_dtype_expr(bufs[ins.dst].dtype)}, {srcs})"]
        elif isinstance(ins, Agg):
            f = _NP_AGG[ins.op]
            acc = ident(ins.srcs[0])
            for s in ins.srcs[1:]:
                acc = f"{f}({acc}, {ident(s)})"
            lines = [f"{ident(ins.dst)} = {acc}"]
        elif isinstance(ins, Send):
            lines = [f"mbox[({d}, {ins.peer}, {ins.tag})] = np.array({ident(ins.src)})"]
        elif isinstance(ins, Recv):
            key = f"({ins.peer}, {d}, {ins.tag})"
            lines = [f"while {key} not in mbox:", "    yield",
                     f"{ident(ins.dst)} = mbox.pop({key})"]
        elif isinstance(ins, Kernel):
            eqn = prog.eqns[ins.eqn]
            args = [ident(a) if isinstance(a, str) else f"np.asarray({py(a[1])}, "
                    f"{ex.np_dtype_expr(a[2])})" for a in ins.ins]
            outs = "".join(ident(o) + ", " for o in ins.outs)
            if _is_ew(eqn):
                lines = [f"{outs}= K.ew_eqn{ins.eqn}({', '.join(args)}),"]
            else:
                fs = fspecs.setdefault(fspec_src(ins.fspec), f"F{len(fspecs)}")
                dts = py(tuple(bufs[o].dtype for o in ins.outs))  # pairs for lse partials
                kw = kwargs_src(eqn.params)
                lines = [f"{outs}= K.block({eqn.prim!r}, {fs}, {dts}, {', '.join(args)}"
                         f"{', ' + kw if kw else ''})"]
        elif isinstance(ins, Store):
            sl = box_slices(ins.box)
            lines = [f"outputs[{ins.output}][{sl}] = {ident(ins.src)}"]
        elif isinstance(ins, Free):
            lines = [f"del {ident(ins.buf)}"]
        else:
            raise EinsError(f"codegen: unknown instruction {ins!r}")
        steps.append(_Step(c, lines, "x"))
    return steps


def _idx(sl) -> str:
    """Slices as an index expression of the generated module (``np.s_[...]``)."""
    return f"np.s_[{slices_src(sl)}]"


_BUF_REF = re.compile(r"B\[('[^']+')\]|dev\.(?:load|store|send)\(('[^']+')")


def _touched(steps, instrs) -> set:
    """Buffers the generated walk reads or writes (plus every receive buffer, which the
    sender fills): values that stay in registers inside a fused kernel get no memory."""
    out = {i.dst for i in instrs if isinstance(i, Recv)}
    for st in steps:
        for line in st.lines + [ln for c in st.comments for ln in c.lines]:
            for m in _BUF_REF.finditer(line):
                out.add(eval(m.group(1) or m.group(2)))  # noqa: S307 - our own repr
    return out


def _group_segments(steps):
    """Maximal runs of stream work ("kernel") between host steps and transfers become graph
    segments (each captured once and replayed)."""
    grouped, seg, nseg = [], None, 0
    for s in steps:
        if s.kind == "kernel":
            if seg is None:
                seg = _Step("", [], "segment", segment=nseg)
                nseg += 1
                grouped.append(seg)
            seg.comments.append(s)
        else:
            seg = None
            grouped.append(s)
    return grouped


def _gpu_steps(dp, d, texts, fspecs, recv_names, needs, lits, launch_pos):
    """The GPU host walk of device ``d`` (eins/runtime/gpu.py runs it). Loads are hoisted to
    the front and Stores sunk to the end: every buffer is allocated once and lives for the
    whole program, so this only removes host steps from between kernels, and a p=1 program
    becomes a single graph segment. Frees are dropped for the same reason (noted in the
    module docstring). Consecutive elementwise kernels of one block shape become one fused
    Triton kernel (eins/codegen/kernels/fusion.py; a lone one is a group of one).
    ``needs`` collects the Triton kernels launched, ``lits`` the literal operands of
    non-elementwise kernels (scalar tensors made once at setup)."""
    from eins.codegen.kernels.fusion import fused_source, fusion_groups
    prog = dp.program
    bufs = dp.bufs.get(d, {})
    instrs = dp.code.get(d, [])
    fused, member = {}, set()
    for g in fusion_groups(prog, instrs, bufs, min_size=1, reorder=True):
        fk = fused_source(prog, g, instrs, bufs)
        fused[fk.launch_at] = fk   # the last member: every member's operands exist by then
        member.update(g)
        for m in g:
            launch_pos[m] = fk.launch_at
    loads, body, stores = [], [], []

    def b(n):
        return f"B[{n!r}]"

    for j, ins in enumerate(instrs):
        c = _fmt(ins, bufs, texts)
        if isinstance(ins, Load):
            loads.append(_Step(c, [f"dev.load({ins.dst!r}, {py(tuple(ins.source))}, "
                                  f"np.s_[{box_slices(ins.box)}])"], "host"))
        elif isinstance(ins, Store):
            stores.append(_Step(c, [f"dev.store({ins.src!r}, {ins.output}, "
                                   f"np.s_[{box_slices(ins.box)}])"], "host"))
        elif isinstance(ins, Free):
            continue
        elif isinstance(ins, Slice):
            sl = _idx(ins.box.relative_to(bufs[ins.src].box))
            body.append(_Step(c, [f"dev.slice({b(ins.dst)}, {b(ins.src)}, {sl})"], "kernel"))
        elif isinstance(ins, Concat):
            parts = ", ".join(f"({b(s)}, {_idx(bufs[s].box.relative_to(ins.box))})"
                              for s in ins.srcs)
            body.append(_Step(c, [f"dev.concat({b(ins.dst)}, [{parts}])"], "kernel"))
        elif isinstance(ins, Agg):
            # lse: (o, lse) pairs in; pairs out, or the full aggregate finalized to the
            # output's dtype (a non-pair buffer)
            pairs = ins.op in PAIR_AGGS
            final = pairs and not is_lse_pair(bufs[ins.dst].dtype)
            op = f"{ins.op}_final_{bufs[ins.dst].dtype.name}" if final else ins.op
            needs["agg"].add((op, len(ins.srcs)))
            call = "agg_pairs" if pairs else "agg"
            body.append(_Step(c, [f"dev.{call}(K.agg_{op}_{len(ins.srcs)}, {b(ins.dst)}, "
                                  f"{', '.join(b(s) for s in ins.srcs)})"], "kernel"))
        elif isinstance(ins, Send):
            dst = recv_names[(d, ins.peer, ins.tag)]
            body.append(_Step(c, [f"dev.send({ins.src!r}, {ins.peer}, {dst!r}, "
                                  f"({d}, {ins.peer}, {ins.tag}))"], "comm"))
        elif isinstance(ins, Recv):
            key = f"({ins.peer}, {d}, {ins.tag})"
            body.append(_Step(c, [f"while not dev.arrived({key}):  # dev{ins.peer} has not "
                                  f"sent yet", "    yield", f"dev.wait({key})"], "comm"))
        elif isinstance(ins, Kernel) and j in member:
            fk = fused.get(j)
            if fk is None:  # launched with its group's last member
                continue
            needs["fused"][fk.name] = fk.source
            eqns = [instrs[m].eqn for m in fk.members]
            comment = "\n        # ".join(_fmt(instrs[m], bufs, texts) for m in fk.members)
            body.append(_Step(comment, [
                f"dev.ew(K.{fk.name}, [{', '.join(b(a) for a in fk.inputs)}], "
                f"[{', '.join(b(o) for o in fk.outputs)}])  # eqns {eqns} fused"], "kernel"))
            continue
        elif isinstance(ins, Kernel):
            eqn = prog.eqns[ins.eqn]
            if _is_ew(eqn):
                raise EinsError(f"codegen: elementwise kernel of eqn {ins.eqn} with "
                                f"{len(ins.outs)} outputs has no fused kernel")
            else:
                fs = fspecs.setdefault(fspec_src(ins.fspec), f"F{len(fspecs)}")
                args = []
                for a in ins.ins:
                    if isinstance(a, str):
                        args.append(b(a))
                    else:
                        name = f"_lit{len(lits)}"
                        lits[name] = (py(a[1]), ex.np_dtype_expr(a[2]))
                        args.append(b(name))
                kw = kwargs_src(eqn.params)
                if any(is_lse_pair(bufs[o].dtype) for o in ins.outs):
                    kw += ", partial=True"   # a key-split block: its (o, lse) pairs
                outs = "[" + ", ".join(b(o) for o in ins.outs) + "]"
                line = (f"dev.op({eqn.prim!r}, {fs}, {outs}, {', '.join(args)}"
                        f"{', ' + kw if kw else ''})")
            body.append(_Step(c, [line], "kernel"))
        else:
            raise EinsError(f"codegen: unknown instruction {ins!r}")
    return loads, _group_segments(body), stores


# ----------------------------------------------------------------------------- the result
@dataclass
class GeneratedProgram:
    """Generated sources: ``sources[d]`` per device, ``sources["kernels"]`` shared."""

    target: str
    sources: dict
    dp: object
    triton: tuple = ()   # CUDA target: each Triton kernel's source (also in sources["kernels"])

    def write(self, directory) -> list[str]:
        """Write a Python package: kernels.py, device_<d>.py, and __init__.py with ``run``.
        A directory that cannot be made or written is an OutputError naming it."""
        from eins.errors import OutputError
        try:
            os.makedirs(directory, exist_ok=True)
            paths = []
            for key, src in self.sources.items():
                path = os.path.join(directory, "kernels.py" if key == "kernels"
                                    else f"device_{key}.py")
                with open(path, "w") as f:
                    f.write(src)
                paths.append(path)
            init = os.path.join(directory, "__init__.py")
            devs = [k for k in self.sources if k != "kernels"]
            with open(init, "w") as f:
                f.write(_init_source(self.target, devs))
            paths.append(init)
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
        for d in self.dp.devices:
            ns = {"__name__": f"eins_generated_device_{d}"}
            exec(compile(self.sources[d], f"<eins device {d}>", "exec"), ns)
            ns["K"] = K
            devs[d] = ns
        return K, devs

    def run(self, inputs, consts=None):
        """Execute the numpy target: devices round-robin, each until it waits on a receive
        (sends never wait), as eins/runtime/numpy_backend.py. Returns the outputs tuple."""
        self._numpy_only()
        prog = self.dp.program
        consts = [c for _, c in prog.consts] if consts is None else consts
        if len(inputs) != len(prog.inputs):
            raise EinsError(f"generated program: expected {len(prog.inputs)} inputs, got "
                            f"{len(inputs)}")
        for k, (v, a) in enumerate(zip(prog.inputs, inputs)):
            if tuple(np.shape(a)) != tuple(v.shape):
                raise EinsError(f"generated program: input {k} has shape {tuple(np.shape(a))},"
                                f" expected {v.shape}")
        _, devs = self.modules()
        outputs = [np.zeros(v.shape, v.dtype) for v in prog.outputs]
        mbox = {}
        gens = {d: ns["program"](inputs, consts, outputs, mbox) for d, ns in devs.items()}
        drive(gens, mbox)
        if mbox:
            raise EinsError(f"generated program: {len(mbox)} messages were never received")
        return tuple(outputs)


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


def _init_source(target, devs) -> str:
    imports = "\n".join(f"from . import device_{d}" for d in devs)
    table = ", ".join(f"{d}: device_{d}" for d in devs)
    if target == "cuda":
        # run through eins: GpuExecutable(generated_program, backend=...) execs these
        # sources (the interpret backend must decorate the kernels in interpreter mode)
        body = f"DEVICES = {{{table}}}\n"
    else:
        body = (f"DEVICES = {{{table}}}\n\n\n"
                "def run(inputs, consts, out_shapes):\n"
                "    import numpy as np\n"
                "    from eins.codegen.generate import drive\n"
                "    outputs = [np.zeros(s, dt) for s, dt in out_shapes]\n"
                "    mbox = {}\n"
                "    for m in DEVICES.values():\n"
                "        m.K = kernels\n"
                "    drive({d: m.program(inputs, consts, outputs, mbox) for d, m in "
                "DEVICES.items()}, mbox)\n"
                "    return outputs\n")
    return (f'"""eins generated program ({target} target)."""\nfrom . import kernels\n'
            f"{imports}\n\n{body}")


def generate(dp, target: str = "cuda") -> GeneratedProgram:
    """Render device program ``dp`` for ``target`` ("cuda" or "numpy")."""
    if target not in TARGETS:
        raise EinsError(f"codegen: unknown target {target!r}; choose one of {list(TARGETS)}")
    prog = dp.program
    if prog is None:
        raise EinsError("codegen: the device program has no traced program attached")
    texts = eqn_texts(prog)
    sources = {}
    used_ew = sorted({ins.eqn for d in dp.devices for ins in dp.code.get(d, [])
                      if isinstance(ins, Kernel) and _is_ew(prog.eqns[ins.eqn])})
    if target == "numpy":
        kernels = []
        for i in used_ew:
            kernels.append(_ew_kernel(prog, i, texts, f"ew_eqn{i}"))
        sources["kernels"] = render_template("numpy_kernels.py.j2", kernels=kernels,
                                             npx_prelude=ex.NPX_PRELUDE)
        for d in dp.devices:
            fspecs = {}
            steps = _numpy_steps(dp, d, texts, fspecs)
            sources[d] = render_template(
                "numpy_program.py.j2", device=d, ndev=len(dp.devices), steps=steps,
                fspecs=[(n, s) for s, n in fspecs.items()])
        return GeneratedProgram(target, sources, dp)

    recv_names = _recv_names(dp)
    needs = {"fused": {}, "agg": set()}
    for d in dp.devices:
        fspecs, lits, launch_pos = {}, {}, {}
        loads, steps, stores = _gpu_steps(dp, d, texts, fspecs, recv_names, needs, lits,
                                          launch_pos)
        bufs = dp.bufs.get(d, {})
        touched = _touched(loads + steps + stores, dp.code.get(d, []))
        slot_of, slots = memory.plan(dp.code.get(d, []), bufs, launch_pos, touched)
        sources[d] = render_template(
            "gpu_program.py.j2", device=d, ndev=len(dp.devices), steps=steps, loads=loads,
            stores=stores,
            ninstr=len(dp.code.get(d, [])), slots=sorted(slots.items()),
            buffers=[_gpu_buffer(n, i, slot_of[n]) for n, i in bufs.items() if n in touched],
            literals=list(lits.items()), fspecs=[(n, s) for s, n in fspecs.items()])
    triton_sources = [src for _, src in sorted(needs["fused"].items())]
    for op, n in sorted(needs["agg"]):
        base, _, out = op.partition("_final_")   # lse_final_<dtype>: writes the output
        triton_sources.append(render_template(
            "triton_agg.py.j2", name=f"agg_{op}_{n}", op=base, nsrc=n, final=bool(out),
            out_dtype=ex.triton_dtype(out) if out else None))
    triton_sources = [s.rstrip("\n") + "\n" for s in triton_sources]
    sources["kernels"] = render_template(
        "gpu_kernels.py.j2", triton_sources=[s.rstrip("\n") for s in triton_sources])
    return GeneratedProgram(target, sources, dp, tuple(triton_sources))


def _gpu_buffer(name, info, slot):
    """(name, shape, dtype, slot) of a device buffer; (o, lse) pairs are a trailing axis of
    2 of their float dtype (the layout the lse ⊕ kernel reads)."""
    if is_lse_pair(info.dtype):
        return name, py(tuple(info.box.shape) + (2,)), ex.np_dtype_expr(info.dtype["o"]), slot
    return name, py(tuple(info.box.shape)), ex.np_dtype_expr(info.dtype), slot


def triton_kernel_sources(gp: GeneratedProgram) -> list[str]:
    """The ``@triton.jit`` kernels of a CUDA target's kernel module, each as its own source."""
    return list(gp.triton)
