"""The numpy target's walk: each device-IR instruction of a device as plain numpy lines
(``NumpyWalk``), which the ``numpy_program.py.j2`` template lays out, and each elementwise
eqn's numpy kernel (``ew_kernel``, for ``numpy_kernels.py.j2``). The same walk as the GPU
target's (eins/codegen/gpu_walk.py); ``GeneratedProgram.run`` (eins/codegen/generate.py)
executes it on the CPU."""
from __future__ import annotations

from eins.kernels import expressions as ex
from eins.kernels.fusion import agg_prim
from eins.codegen.source import (Step, box_slices, fspec_src, ident, instr_comment, is_ew,
                                 kwargs_src, py, slices_src)
from eins.ir.device import InstrVisitor
from eins.ir.joinagg import sums_in_float32
from eins.ir.pieces import OP


def ew_kernel(prog, i, texts, name):
    """What the numpy-dialect templates need for eqn ``i``'s elementwise kernel."""
    eqn = prog.eqns[i]
    names = ex.operand_names(eqn.primitive, eqn.params)
    dts = ex.dtypes_for(eqn.primitive, [a.dtype for a in eqn.inputs], eqn.outputs[0].dtype)
    return dict(name=name, eqn=i, text=texts[i], args=list(names),
                expr=ex.render(eqn.primitive, "numpy", eqn.params,
                               integer=all(c.kind in "biu" for c in dts.compute)),
                out=ex.np_dtype_expr(dts.out),
                casts=[(a, ex.np_dtype_expr(c)) for a, c in zip(names, dts.compute)])


class NumpyWalk(InstrVisitor):
    """The numpy target's lines for each instruction of device ``d`` (one ``visit_<kind>``
    per instruction: :class:`eins.ir.device.InstrVisitor`). ``fspecs`` collects the function
    specifications the kernels name."""

    def __init__(self, dprog, d, fspecs):
        self.prog, self.d, self.fspecs = dprog.program, d, fspecs
        self.bufs = dprog.bufs.get(d, {})

    def visit_load(self, ins):
        src = "inputs" if ins.source[0] == "in" else "consts"
        return [f"{ident(ins.dst)} = np.array({src}[{ins.source[1]}][{box_slices(ins.box)}])"]

    def visit_slice(self, ins):
        sl = slices_src(ins.box.relative_to(self.bufs[ins.src].box))
        return [f"{ident(ins.dst)} = np.array({ident(ins.src)}[{sl}])"]

    def visit_concat(self, ins):
        bufs = self.bufs
        lines = [f"{ident(ins.dst)} = np.empty({py(ins.box.shape)}, "
                 f"{ex.np_dtype_expr(bufs[ins.dst].dtype)})"]
        for s in ins.srcs:
            lines.append(f"{ident(ins.dst)}[{slices_src(bufs[s].box.relative_to(ins.box))}]"
                         f" = {ident(s)}")
        return lines

    def visit_agg(self, ins):
        prim = agg_prim(ins.op)
        if prim is None or sums_in_float32(ins.op, self.bufs[ins.dst].dtype):
            # lse: pairs, then finalize; a 16-bit float sum: in float32, rounded once
            # (eins.ir.joinagg.aggregate, as the GPU's ⊕ kernels)
            srcs = ", ".join(ident(s) for s in ins.srcs)
            return [f"{ident(ins.dst)} = K.agg({ins.op!r}, "
                    f"{ex.np_dtype_expr(self.bufs[ins.dst].dtype)}, {srcs})"]
        acc = ident(ins.srcs[0])
        for s in ins.srcs[1:]:
            acc = f"np.{prim}({acc}, {ident(s)})"  # the numpy ufunc itself
        return [f"{ident(ins.dst)} = {acc}"]

    def visit_send(self, ins):
        return [f"mbox[({self.d}, {ins.peer}, {ins.tag})] = np.array({ident(ins.src)})"]

    def visit_recv(self, ins):
        key = f"({ins.peer}, {self.d}, {ins.tag})"
        return [f"while {key} not in mbox:", "    yield", f"{ident(ins.dst)} = mbox.pop({key})"]

    def visit_kernel(self, ins):
        eqn = self.prog.eqns[ins.eqn]
        args = [ident(a) if isinstance(a, str) else f"np.asarray({py(a[1])}, "
                f"{ex.np_dtype_expr(a[2])})" for a in ins.ins]
        outs = "".join(ident(o) + ", " for o in ins.outs)
        if is_ew(eqn):
            return [f"{outs}= K.ew_eqn{ins.eqn}({', '.join(args)}),"]
        fs = self.fspecs.setdefault(fspec_src(ins.fspec), f"F{len(self.fspecs)}")
        kw = kwargs_src(eqn.params)
        if ins.acc is not None:   # a pipelined piece: its partial, ⊕ the running pairs
            out, = ins.outs
            return [f"_part, = K.block({eqn.prim!r}, {fs}, {py((self.bufs[ins.acc].dtype,))}, "
                    f"{', '.join(args)}{', ' + kw if kw else ''})",
                    f"{ident(out)} = K.agg({OP!r}, {ex.np_dtype_expr(self.bufs[out].dtype)}, "
                    f"{ident(ins.acc)}, _part)", "del _part"]
        dts = py(tuple(self.bufs[o].dtype for o in ins.outs))  # pairs for lse partials
        return [f"{outs}= K.block({eqn.prim!r}, {fs}, {dts}, {', '.join(args)}"
                f"{', ' + kw if kw else ''})"]

    def visit_store(self, ins):
        return [f"outputs[{ins.output}][{box_slices(ins.box)}] = {ident(ins.src)}"]

    def visit_free(self, ins):
        return [f"del {ident(ins.buf)}"]


def numpy_steps(dprog, d, texts, fspecs):
    """Device ``d``'s steps: each instruction's comment and numpy lines."""
    walk, bufs = NumpyWalk(dprog, d, fspecs), dprog.bufs.get(d, {})
    return [Step(instr_comment(ins, bufs, texts), walk.visit(ins), "x")
            for ins in dprog.code.get(d, [])]
