"""Render a device program (eins/ir/device.py) as source code, one module per device plus a
shared kernel module (DESIGN.md: every backend executes the one device IR).

``generate(dp, target)``: target "cuda" gives CuPy host programs that launch Triton kernels
and CuPy ports in each device's instruction order, kernel runs captured into CUDA graphs and
transfers as ``memcpyPeerAsync`` ordered by events; target "numpy" gives the SAME walk in
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
from eins.ir.joinagg import PAIR_AGGS, is_lse_pair

TARGETS = ("cuda", "numpy")
_TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
_ENV = Environment(loader=FileSystemLoader(_TEMPLATES), trim_blocks=True, lstrip_blocks=True,
                   keep_trailing_newline=True, undefined=StrictUndefined)
_RESERVED = {"np", "cp", "K", "B", "S", "self", "inputs", "consts", "outputs", "mbox", "Box",
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


def _scalar_suffix(scalars) -> str:
    """Kernels taking some operands as scalars are separate specializations."""
    return "_s" + "".join("1" if s else "0" for s in scalars) if any(scalars) else ""


def _triton_ew_source(prog, i, texts, scalars) -> str:
    """The Triton kernel of elementwise eqn ``i`` (operands marked in ``scalars`` are kernel
    arguments, the others pointers to contiguous blocks of the output's shape)."""
    eqn = prog.eqns[i]
    names = ex.operand_names(eqn.prim, eqn.params)
    dts = ex.dtypes_for(eqn.prim, [a.dtype for a in eqn.inputs], eqn.outputs[0].dtype)
    operands = [dict(name=a, arg=f"{a}_val" if sc else f"{a}_ptr", scalar=sc,
                     compute=ex.triton_dtype(c))
                for a, c, sc in zip(names, dts.compute, scalars)]
    comp = sorted({np.dtype(c).name for c in dts.compute})
    return render_template(
        "triton_elementwise.py.j2", name=f"ew_eqn{i}{_scalar_suffix(scalars)}",
        operands=operands, eqn=i, text=texts[i], expr=ex.render(eqn.prim, "triton", eqn.params),
        compute_note="/".join(comp), out_dtype=dts.out.name, out_tl=ex.triton_dtype(dts.out))


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


def _cuda_steps(dp, d, texts, fspecs, recv_names, needs):
    """The CUDA host walk; ``needs`` collects the Triton kernels it launches."""
    prog = dp.program
    bufs = dp.bufs.get(d, {})
    steps = []

    def b(n):
        return f"B[{n!r}]"

    for ins in dp.code.get(d, []):
        c = _fmt(ins, bufs, texts)
        kind = "kernel"
        if isinstance(ins, Load):
            src = "inputs" if ins.source[0] == "in" else "consts"
            sl = box_slices(ins.box)
            lines = [f"{b(ins.dst)}.set(np.ascontiguousarray({src}[{ins.source[1]}][{sl}]), "
                     f"stream=S)  # host -> device"]
            kind = "host"
        elif isinstance(ins, Slice):
            outer = bufs[ins.src].box
            pair = (2,) if is_lse_pair(bufs[ins.src].dtype) else ()  # (o, lse) interleaved
            st = strides(outer.shape + pair)
            off = sum((l - o) * s for l, o, s in zip(ins.box.lo, outer.lo, st))
            lines = [f"self.copy({b(ins.src)}, {b(ins.dst)}, {off}, 0, "
                     f"{py(ins.box.shape + pair)}, {py(st)}, {py(strides(ins.box.shape + pair))})"]
        elif isinstance(ins, Concat):
            dst_st = strides(ins.box.shape)
            lines = []
            for s in ins.srcs:
                sb = bufs[s].box
                off = sum((l - o) * t for l, o, t in zip(sb.lo, ins.box.lo, dst_st))
                lines.append(f"self.copy({b(s)}, {b(ins.dst)}, 0, {off}, {py(sb.shape)}, "
                             f"{py(strides(sb.shape))}, {py(dst_st)})")
        elif isinstance(ins, Agg):
            # lse: pairs in; the full aggregate (a non-pair buffer) is finalized
            final = ins.op in PAIR_AGGS and not is_lse_pair(bufs[ins.dst].dtype)
            op = f"{ins.op}_final_{bufs[ins.dst].dtype.name}" if final else ins.op
            name = f"agg_{op}_{len(ins.srcs)}"
            needs["agg"].add((op, len(ins.srcs)))
            lines = [f"self.agg(K.{name}, {b(ins.dst)}, {', '.join(b(s) for s in ins.srcs)})"]
        elif isinstance(ins, Send):
            dst = recv_names[(d, ins.peer, ins.tag)]
            lines = [f"cp.cuda.runtime.memcpyPeerAsync(self.peers[{ins.peer}].B[{dst!r}].data.ptr, "
                     f"{ins.peer}, {b(ins.src)}.data.ptr, DEV, {b(ins.src)}.nbytes, S.ptr)",
                     f"self.mbox[({d}, {ins.peer}, {ins.tag})] = self.record()  "
                     f"# dev{ins.peer} waits on it"]
            kind = "comm"
        elif isinstance(ins, Recv):
            key = f"({ins.peer}, {d}, {ins.tag})"
            lines = [f"while {key} not in self.mbox:  # dev{ins.peer} has not sent yet",
                     "    yield", "self.dev.use()", f"S.wait_event(self.mbox.pop({key}))"]
            kind = "comm"
        elif isinstance(ins, Kernel):
            eqn = prog.eqns[ins.eqn]
            label = f"eqn{ins.eqn} {eqn.prim}"
            outs = "[" + ", ".join(b(o) for o in ins.outs) + "]"
            if _is_ew(eqn):
                out_shape = bufs[ins.outs[0]].box.shape
                scalars = tuple(not isinstance(a, str) for a in ins.ins)
                same = all(bufs[a].box.shape == out_shape for a in ins.ins if isinstance(a, str))
                args = [b(a) if isinstance(a, str) else py(a[1]) for a in ins.ins]
                if same:
                    needs["ew"].add((ins.eqn, scalars))
                    sfx = _scalar_suffix(scalars)
                    lines = [f"self.triton_kernel({label!r}, K.ew_eqn{ins.eqn}{sfx}, "
                             f"{b(ins.outs[0])}, {', '.join(args)})"]
                else:  # a size-1 broadcast operand: the CuPy fallback
                    needs["fb"].add(ins.eqn)
                    lines = [f"self.array_kernel({label!r}, K.fb_eqn{ins.eqn}, {outs}, "
                             f"{', '.join(args)})  # broadcast operand: CuPy fallback"]
            else:
                fs = fspecs.setdefault(fspec_src(ins.fspec), f"F{len(fspecs)}")
                args = [b(a) if isinstance(a, str) else
                        f"cp.asarray({py(a[1])}, {ex.np_dtype_expr(a[2])})" for a in ins.ins]
                kw = kwargs_src(eqn.params)
                if any(is_lse_pair(bufs[o].dtype) for o in ins.outs):
                    kw += ", partial=True"   # a key-split block: its (o, lse) pairs
                lines = [f"self.array_kernel({label!r}, K.port({eqn.prim!r}), {outs}, {fs}, "
                         f"{', '.join(args)}{', ' + kw if kw else ''})"]
        elif isinstance(ins, Store):
            sl = box_slices(ins.box)
            lines = [f"outputs[{ins.output}][{sl}] = {b(ins.src)}.get(stream=S)  # device -> host"]
            kind = "host"
        elif isinstance(ins, Free):
            lines = [f"self.free({ins.buf!r})"]
            kind = "free"
        else:
            raise EinsError(f"codegen: unknown instruction {ins!r}")
        steps.append(_Step(c, lines, kind))
    # group maximal runs of stream work into graph segments
    grouped, seg = [], None
    for s in steps:
        if s.kind == "free" and seg is not None:  # a Free joins the open kernel run
            seg.comments.append(s)
        elif s.kind == "free":  # nor does one open a run of its own
            grouped.append(s)
        elif s.kind == "kernel":
            if seg is None:
                seg = _Step("", [], "segment", segment=sum(1 for g in grouped
                                                            if g.segment is not None))
                grouped.append(seg)
            seg.comments.append(s)
        else:
            seg = None
            grouped.append(s)
    return grouped


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
                            f" the CUDA target needs cupy and triton on a GPU)")

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
        body = (f"DEVICES = {{{table}}}\n\n\n"
                "def run(inputs, consts, out_shapes, graphs=True):\n"
                "    \"\"\"Run on the GPUs; out_shapes: [(shape, dtype)] per output.\"\"\"\n"
                "    import numpy as np\n"
                "    outputs = [np.zeros(s, dt) for s, dt in out_shapes]\n"
                "    devs = {}\n"
                "    for d, m in DEVICES.items():\n"
                "        m.K = kernels\n"
                "        devs[d] = m.Device()\n"
                "    return kernels.drive(devs, inputs, consts, outputs, graphs)\n")
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
    needs = {"ew": set(), "agg": set(), "fb": set()}
    for d in dp.devices:
        fspecs = {}
        steps = _cuda_steps(dp, d, texts, fspecs, recv_names, needs)
        bufs = dp.bufs.get(d, {})
        sources[d] = render_template(
            "cuda_graph.py.j2", device=d, ndev=len(dp.devices), steps=steps,
            ninstr=len(dp.code.get(d, [])),
            buffers=[_cuda_buffer(n, i) for n, i in bufs.items()],
            fspecs=[(n, s) for s, n in fspecs.items()])
    triton_sources = []
    for i, scalars in sorted(needs["ew"]):
        triton_sources.append(_triton_ew_source(prog, i, texts, scalars))
    for op, n in sorted(needs["agg"]):
        base, _, out = op.partition("_final_")   # lse_final_<dtype>: writes the output
        triton_sources.append(render_template(
            "triton_agg.py.j2", name=f"agg_{op}_{n}", op=base, nsrc=n, final=bool(out),
            out_dtype=ex.triton_dtype(out) if out else None))
    for nd in range(1, 5):
        triton_sources.append(render_template("triton_copy.py.j2", name=f"copy_{nd}d", ndim=nd))
    fallbacks = []
    for i in sorted(needs["fb"]):
        fallbacks.append(_ew_kernel(prog, i, texts, f"fb_eqn{i}"))
    triton_sources = [s.rstrip("\n") + "\n" for s in triton_sources]
    sources["kernels"] = render_template(
        "cuda_kernels.py.j2", ports=render_template("cupy_ports.py.j2"),
        triton_sources=[s.rstrip("\n") for s in triton_sources], fallbacks=fallbacks)
    return GeneratedProgram(target, sources, dp, tuple(triton_sources))


def _cuda_buffer(name, info):
    """(name, shape, dtype) of a device buffer; (o, lse) pairs are a trailing axis of 2."""
    if is_lse_pair(info.dtype):
        return name, py(tuple(info.box.shape) + (2,)), ex.np_dtype_expr(info.dtype["o"])
    return name, py(tuple(info.box.shape)), ex.np_dtype_expr(info.dtype)


def triton_kernel_sources(gp: GeneratedProgram) -> list[str]:
    """The ``@triton.jit`` kernels of a CUDA target's kernel module, each as its own source."""
    return list(gp.triton)
