"""The GPU target's walk (``GpuWalk``): each device-IR instruction of a device as a line of
its host program (eins/runtime/gpu.py runs it), with the launch-level fusion decided here:
elementwise chains as one Triton kernel each, residual adds in their matmul's launch, final
⊕ sums in the chain that reads them, layout changes folded into strided views; and the
static memory plan of the buffers the walk touches (eins/codegen/memory.py)."""
from __future__ import annotations

import re


from eins.kernels import expressions as ex
from eins.codegen import memory
from eins.codegen.source import (Step, box_slices, eqn_texts, fspec_src, instr_comment, is_ew,
                                 kwargs_src, py, recv_names, slices_src)
from eins.errors import EinsError
from eins.ir.device import InstrVisitor, def_use, placed_receives
from eins.ir.joinagg import PAIR_AGGS, is_lse_pair
from eins.ir.primitive import get_primitive
from eins.kernels import fusion
from eins.kernels.matmul import one_call


def _idx(sl) -> str:
    """Slices as an index expression of the generated module (``np.s_[...]``)."""
    return f"np.s_[{slices_src(sl)}]"


_BUF_REF = re.compile(r"B\[('[^']+')\]|dev\.(?:load|store|send)\(('[^']+')")


def _touched(steps, bufs, pinned) -> set:
    """Buffers the generated walk reads or writes (plus the pinned ones: every receive
    buffer, which the sender fills): values that stay in registers inside a fused kernel get
    no memory, nor do literals (not device buffers: ``LITERALS``)."""
    out = set(pinned)
    for st in steps:
        for line in st.lines + [ln for c in st.comments for ln in c.lines]:
            for m in _BUF_REF.finditer(line):
                out.add(eval(m.group(1) or m.group(2)))  # noqa: S307 - our own repr
    return out & set(bufs)


def _group_segments(steps):
    """Maximal runs of stream work ("kernel") between host steps and transfers become graph
    segments (each captured once and replayed)."""
    grouped, seg, nseg = [], None, 0
    for s in steps:
        if s.kind == "kernel":
            if seg is None:
                seg = Step("", [], "segment", segment=nseg)
                nseg += 1
                grouped.append(seg)
            seg.comments.append(s)
        else:
            seg = None
            grouped.append(s)
    return grouped


def _b(n) -> str:
    return f"B[{n!r}]"


def unit_last_stride(prims, params) -> bool:
    """Whether a layout chain (``prims``: its primitives or their names, each with a
    :class:`~eins.ir.primitive.Layout`; ``params``, from its source to its reader) of a
    contiguous buffer ends with a unit stride in its last axis: its reshapes (layouts
    without a permutation) come first (torch views of a contiguous tensor, contiguous
    again; a reshape after a transpose could copy) and its transposes together leave the
    last axis last."""
    perm = None
    for prim, prm in zip(prims, params):
        axes = get_primitive(prim).layout.perm(prm)
        if axes is None:
            if perm is not None:
                return False
        else:
            axes = tuple(axes)
            perm = tuple(range(len(axes))) if perm is None else perm
            perm = tuple(perm[a] for a in axes)
    return perm is None or perm[-1] == len(perm) - 1


def _strided(eqn):
    """The eqn's primitive's strided operands (None: it reads contiguous buffers)."""
    return eqn.primitive.strided


def _layout(eqn):
    """The eqn's primitive's layout view (None: not a view)."""
    return eqn.primitive.layout


class GpuWalk(InstrVisitor):
    """The GPU host walk of device ``d`` (eins/runtime/gpu.py runs it), one ``visit_<kind>``
    per instruction (:class:`eins.ir.device.InstrVisitor`). Loads are hoisted to the front
    and Stores sunk to the end: every buffer is allocated once (the static memory plan of
    eins/codegen/memory.py), so this only removes host steps from between kernels, and a p=1
    program becomes a single graph segment. Frees are dropped for the same reason.
    Elementwise kernels of one block shape become one fused Triton
    kernel (eins/kernels/fusion.py, ``reorder=True``; a lone one is a group of one),
    launched at its LAST member: a fused chain may jump items that do not read it (the up
    matmul between silu and mul), so its inputs are read there. A reshape/transpose chain
    feeding a rope's x, or an attention's q/k/v, becomes a strided view passed to that
    kernel (:meth:`_fold_layouts`); one after an attention, into the view the attention
    writes (:meth:`_fold_output`). A residual add of a matmul's block runs in the matmul's
    launch, one cuBLAS addmm (:meth:`_fuse_residuals`); the final sum ⊕ of a block that
    only a fused chain reads (the residual add after a contraction-split projection), in
    the chain's kernel as its first step (:meth:`_fuse_sums`).

    After :meth:`run`: ``loads``, ``body`` (graph segments), ``stores`` (the steps);
    ``positions[j]``, where instruction j runs in the walk (-1: the hoisted loads, ``END``:
    the sunk stores, a fused member's or ⊕'s launch, a folded layout change's reader),
    ``fused`` (launch position -> FusedKernel), ``folded`` (layout kernel -> its reader's
    position), ``views`` (reader position -> {operand: (view expression, folded kernels)}),
    ``out_views`` (writer position -> (view expression, folded kernels)), ``residual``
    (launch position -> (matmul, add, residual buffer)), ``in_place`` ({add output: residual}
    written over it, eins/codegen/memory.py), and ``pinned``, the buffers filled
    from outside this device's stream (loads, receives): what the memory plan needs. ``needs``
    collects the Triton kernels launched (shared by the devices), ``lits`` the literal
    operands of non-elementwise kernels (scalar tensors made once at setup), ``fspecs`` the
    function specifications named."""

    def __init__(self, dprog, d, texts, recv_names, needs=None):
        self.d, self.prog, self.texts, self.recv_names = d, dprog.program, texts, recv_names
        self.bufs = dprog.bufs.get(d, {})
        self.instrs = dprog.code.get(d, [])
        # windowed sends into a placement: the receiver's buffers the senders skip
        self.placed = placed_receives(dprog)
        self.placed_boxes = {k: dprog.bufs[k[1]][b].box for k, b in self.placed.items()}
        self.placed_bufs = {i.dst for i in self.instrs if i.kind == "recv"
                            and (i.peer, d, i.tag) in self.placed}
        self.needs = {"fused": {}, "agg": set()} if needs is None else needs
        self.fspecs, self.lits = {}, {}
        self.checked = set()   # eqns a launched kernel checks (FusedKernel.checks)
        self.loads, self.body, self.stores = [], [], []
        self.positions, self.pinned = {}, set()
        self.fused, self.launch = {}, {}
        for g in fusion.fusion_groups(self.prog, self.instrs, self.bufs, min_size=1, reorder=True):
            fk = fusion.fused_source(self.prog, g, self.instrs, self.bufs)
            self.fused[fk.launch_at] = fk  # the last member: every member's operands exist
            for m in g:
                self.launch[m] = fk.launch_at
        self.residual = {}
        self._fuse_residuals()
        self._fuse_sums()
        self.views, self.folded, self.out_views = {}, {}, {}
        self._fold_layouts()
        self.in_place = memory.in_place_residuals(
            self.instrs, self.bufs, self.residual,
            lambda k: self.launch.get(k, self.folded.get(k, k)), one_call)

    def _fuse_residuals(self):
        """A residual add into the matmul before it (:func:`eins.kernels.fusion.
        residual_adds`): ONE launch, ``dev.op('matmul', F, [r], a, b, c)``, cuBLAS's
        addmm/baddbmm with the add as the GEMM's epilogue (eins/kernels/matmul.py).
        The pair launches at the matmul when ``c`` is written before it, else at the add;
        ``positions`` moves both there, which the memory plan reads (operands kept alive
        until the launch). ``residual``: launch position -> (matmul, add, c)."""
        singles = [a for a, fk in self.fused.items() if fk.members == (a,)]
        producer, _ = def_use(self.instrs)
        for j, a, c in fusion.residual_adds(self.prog, self.instrs, self.bufs, singles):
            k = producer.get(c)
            at = j if k is None or self.launch.get(k, k) < j else a
            del self.fused[a]
            self.launch[j] = self.launch[a] = at
            self.residual[at] = (j, a, c)

    def _fuse_sums(self):
        """The final ⊕ of a block whose only reader is a fused chain (the residual add after
        a contraction-split projection: :func:`eins.kernels.fusion.sum_heads`)
        becomes the chain kernel's first step: one launch reads the partials, sums them as
        the ⊕ kernel does and runs the chain; the sum never gets a buffer. The ⊕ moves to
        the chain's launch (``positions``), which the memory plan reads: the partials stay
        alive until then. Runs after :meth:`_fuse_residuals`, which keeps the adds it takes
        (the ⊕ then stays its own kernel)."""
        groups = [list(fk.members) for fk in self.fused.values()]
        for heads, g in fusion.sum_heads(self.instrs, self.bufs, groups):
            fk = fusion.fused_source(self.prog, g, self.instrs, self.bufs, heads=heads)
            self.fused[fk.launch_at] = fk
            for h in heads:
                self.launch[h] = fk.launch_at

    def _fold_layouts(self):
        """A q/k layout change fused into rope: a chain of reshape/transpose kernels whose
        values only the next one (and finally a rope's x) reads becomes a torch view of its
        source (the same reshape/permute their torch fallbacks in eins/ops/shape.py
        return), passed straight to the rope kernel, which reads strided x (Triton,
        eins/kernels/norms.py): no copies, no buffers. The same for an attention's
        q, k and v (whole or key-split: both launchers of eins/kernels/attention.py
        take any strides but the head dim's, which must be 1; a chain whose view would
        stride the head dim stays kernels, copying). The folded kernels run (read their
        source) at their reader's position, which the memory plan keeps the source alive
        until."""
        producer, readers = def_use(self.instrs)
        for j, ins in enumerate(self.instrs):
            st = _strided(self.prog.eqns[ins.eqn]) if ins.kind == "kernel" else None
            if st is None:
                continue
            for i in st.operands:
                if i < len(ins.ins) and isinstance(ins.ins[i], str):
                    self._fold_operand(j, i, st.unit_last, producer, readers)
        for j, ins in enumerate(self.instrs):
            st = _strided(self.prog.eqns[ins.eqn]) if ins.kind == "kernel" else None
            if st is not None and st.out_rank is not None:
                self._fold_output(j, readers)

    def _fold_output(self, j, readers):
        """The layout chain AFTER kernel ``j`` (an attention's [H, S, D] -> transpose ->
        reshape [S, H*D]): values only the next layout kernel reads, the last one's buffer
        written by ``j`` itself through the inverse view (``B[last].view(S, H, D).permute(1,
        0, 2)``): no copy kernels, no buffers between. Only the longest part of the chain
        whose inverse is a view of the contiguous buffer (its reshapes first, ``.view``,
        which never copies) with a unit stride in the last (head) axis folds."""
        ins, chain = self.instrs[j], []
        o = ins.outs[0]
        if len(ins.outs) != 1 or is_lse_pair(self.bufs[o].dtype) or \
                len(self.bufs[o].box.shape) > _strided(self.prog.eqns[ins.eqn]).out_rank:
            return
        while len(readers.get(o, ())) == 1:
            k = readers[o][0]
            nxt = self.instrs[k]
            if k in self.folded or nxt.kind != "kernel" or len(nxt.outs) != 1 or \
                    _layout(self.prog.eqns[nxt.eqn]) is None:
                break
            chain.append(k)
            o = nxt.outs[0]
        inv = []   # the inverse chain, from the last buffer back: (prim, params, suffix)
        for k in reversed(chain):
            e = self.prog.eqns[self.instrs[k].eqn]
            shape = tuple(self.bufs[self.instrs[k].ins[0]].box.shape)
            prm, suffix = e.primitive.layout.inverse(shape, e.params)
            inv.append((e.primitive, prm, suffix))
        while inv and not unit_last_stride([p for p, _, _ in inv], [q for _, q, _ in inv]):
            inv.pop(0)        # fold less: the chain's tail stays kernels
            chain.pop()
        if chain:
            for k in chain:
                self.folded[k] = j
            expr = _b(self.instrs[chain[-1]].outs[0]) + "".join(x for _, _, x in inv)
            self.out_views[j] = (expr, chain)

    def _fold_operand(self, j, i, unit, producer, readers):
        """Fold the layout chain feeding operand ``i`` of kernel ``j`` (if any) into a view;
        ``unit``: only where the view keeps a unit stride in its last axis (else the chain
        stays kernels, copying into contiguous buffers)."""
        chain, b = [], self.instrs[j].ins[i]
        while b in producer and len(readers[b]) == 1:
            src = self.instrs[producer[b]]
            if src.kind != "kernel" or _layout(self.prog.eqns[src.eqn]) is None \
                    or len(src.outs) != 1 or not isinstance(src.ins[0], str):
                break
            chain.append(producer[b])
            b = src.ins[0]
        if not chain:
            return
        eqns = [self.prog.eqns[self.instrs[k].eqn] for k in reversed(chain)]
        if unit and not unit_last_stride([e.primitive for e in eqns], [e.params for e in eqns]):
            return
        expr = _b(b)
        for k, e in zip(reversed(chain), eqns):
            expr += e.primitive.layout.view(self.instrs[k].fspec, e.params)
            self.folded[k] = j
        self.views.setdefault(j, {})[i] = (expr, sorted(chain))

    def run(self):
        for j, ins in enumerate(self.instrs):
            self.positions[j] = self.launch.get(j, self.folded.get(j, j))
            self.visit(ins, j, instr_comment(ins, self.bufs, self.texts))
        self.body = _group_segments(self.body)
        return self

    def visit_load(self, ins, j, c):
        self.positions[j] = -1
        self.pinned.add(ins.dst)
        self.loads.append(Step(c, [f"dev.load({ins.dst!r}, {py(tuple(ins.source))}, "
                                    f"np.s_[{box_slices(ins.box)}])"], "host"))

    def visit_store(self, ins, j, c):
        self.positions[j] = memory.END
        self.stores.append(Step(c, [f"dev.store({ins.src!r}, {ins.output}, "
                                     f"np.s_[{box_slices(ins.box)}])"], "host"))

    def visit_free(self, ins, j, c):
        pass  # the static memory plan decides when storage is reused

    def visit_slice(self, ins, j, c):
        sl = _idx(ins.box.relative_to(self.bufs[ins.src].box))
        self.body.append(Step(c, [f"dev.slice({_b(ins.dst)}, {_b(ins.src)}, {sl})"],
                               "kernel"))

    def _place(self, ins, c):
        """A placement (a windowed ⊕-sum or concat): the local sources' rows copied in, the
        senders having written theirs; its buffer is its own (pinned: written from their
        sends on)."""
        self.pinned.add(ins.dst)
        dst = self.bufs[ins.dst].box
        parts = []
        for s, w in zip(ins.srcs, ins.windows):
            if s in self.placed_bufs:
                continue
            if w is None:
                parts.append(f"({_b(s)}, None, {_idx(self.bufs[s].box.relative_to(dst))})")
            else:
                parts.append(f"({_b(s)}, {self._window(w, s, False, dst=dst)}, None)")
        self.body.append(Step(c, [f"dev.place({_b(ins.dst)}, [{', '.join(parts)}])"],
                              "kernel"))

    def visit_concat(self, ins, j, c):
        if ins.windows is not None:
            self._place(ins, c)
            return
        parts = ", ".join(f"({_b(s)}, {_idx(self.bufs[s].box.relative_to(ins.box))})"
                          for s in ins.srcs)
        self.body.append(Step(c, [f"dev.concat({_b(ins.dst)}, [{parts}])"], "kernel"))

    def visit_agg(self, ins, j, c):
        if j in self.launch:
            return   # computed by the fused chain that reads it (_fuse_sums)
        if ins.windows is not None:
            self._place(ins, c)
            return
        # lse: (o, lse) pairs in; pairs out, or the full aggregate finalized to the output's
        # dtype (a non-pair buffer)
        out = self.bufs[ins.dst].dtype
        pairs = ins.op in PAIR_AGGS
        op = f"{ins.op}_final_{out.name}" if pairs and not is_lse_pair(out) else ins.op
        self.needs["agg"].add((op, len(ins.srcs)))
        call = "agg_pairs" if pairs else "agg"
        self.body.append(Step(c, [f"dev.{call}(K.agg_{op}_{len(ins.srcs)}, {_b(ins.dst)}, "
                                   f"{', '.join(_b(s) for s in ins.srcs)})"], "kernel"))

    def visit_send(self, ins, j, c):
        key = (self.d, ins.peer, ins.tag)
        dst = self.recv_names[key]
        # a windowed send: the masked copy kernel reads its bounds from the table buffer;
        # into a placement's destination, only its rows (no zeros: the others write theirs)
        win = "" if ins.window is None else \
            f", window={self._window(ins.window, ins.src, key not in self.placed, key)}"
        self.body.append(Step(c, [f"dev.send({ins.src!r}, {ins.peer}, {dst!r}, "
                                   f"({self.d}, {ins.peer}, {ins.tag}){win})"], "comm"))

    def _window(self, w, src, fill, key=None, dst=None) -> str:
        """The window argument of a windowed copy (eins/runtime/gpu.py ``send``, ``place``):
        ``dst``, the box it lands in (a placement's destination; a send's: ``key``'s)."""
        box = self.bufs[src].box
        if dst is None:
            dst = self.placed_boxes.get(key, box)
        return (f"({_b(w.table)}, {py(w.axis)}, {py(w.los)}, {py(w.his)}, "
                f"{py(tuple(box.lo))}, {py(tuple(box.hi))}, {fill}, {py(tuple(dst.lo))}, "
                f"{py(tuple(dst.hi))}, {py(w.more)})")

    def visit_recv(self, ins, j, c):
        if (ins.peer, self.d, ins.tag) in self.placed:
            # the sender writes straight into the placement's destination: no buffer here
            key = f"({ins.peer}, {self.d}, {ins.tag})"
            self.body.append(Step(c, [f"while not dev.arrived({key}):  # dev{ins.peer} has "
                                       f"not sent yet", "    yield", f"dev.wait({key})"],
                                  "comm"))
            return
        self.pinned.add(ins.dst)
        key = f"({ins.peer}, {self.d}, {ins.tag})"
        self.body.append(Step(c, [f"while not dev.arrived({key}):  # dev{ins.peer} has not "
                                   f"sent yet", "    yield", f"dev.wait({key})"], "comm"))

    def visit_kernel(self, ins, j, c):
        if j in self.folded:
            return  # a view of its source, made where its reader (a rope) runs
        if j in self.launch:
            fk = self.fused.get(j)
            if fk is not None:  # the group's last member launches the group
                self._launch_fused(fk)
            elif j in self.residual:
                self._launch_residual(*self.residual[j])
            return
        eqn = self.prog.eqns[ins.eqn]
        if is_ew(eqn):
            raise EinsError(f"codegen: elementwise kernel of eqn {ins.eqn} with "
                            f"{len(ins.outs)} outputs has no fused kernel")
        fs = self.fspecs.setdefault(fspec_src(ins.fspec), f"F{len(self.fspecs)}")
        args = []
        for a in ins.ins:
            if isinstance(a, str):
                args.append(_b(a))
            else:
                name = f"_lit{len(self.lits)}"
                self.lits[name] = (py(a[1]), ex.np_dtype_expr(a[2]))
                args.append(_b(name))
        kw = kwargs_src(eqn.params)
        if any(is_lse_pair(self.bufs[o].dtype) for o in ins.outs):
            kw += ", partial=True"   # a key-split block: its (o, lse) pairs
        if ins.acc is not None:   # a pipelined piece: the kernel starts from these pairs
            kw += f", running={_b(ins.acc)}"
        outs = "[" + ", ".join(_b(o) for o in ins.outs) + "]"
        before, after = [], []
        for i, (expr, ks) in sorted(self.views.get(j, {}).items()):
            args[i] = expr   # operands that are views of their layout change's source
            before += ks
        if j in self.out_views:   # the output: a view of its layout change's result
            outs, after = f"[{self.out_views[j][0]}]", self.out_views[j][1]
        if before or after:
            c = "\n        # ".join(
                [instr_comment(self.instrs[k], self.bufs, self.texts) for k in sorted(before)]
                + [c + "    (the layout changes around it fused in)"]
                + [instr_comment(self.instrs[k], self.bufs, self.texts) for k in after])
        self.body.append(Step(c, [f"dev.op({eqn.prim!r}, {fs}, {outs}, {', '.join(args)}"
                                   f"{', ' + kw if kw else ''})"], "kernel"))

    def _launch_residual(self, j, a, c):
        """Matmul ``j`` with the residual add ``a`` (operand ``c``) fused in: one launch
        writing the add's output (:meth:`_fuse_residuals`), in place over ``c`` where
        ``in_place`` says so (the output then shares c's slot: :meth:`memory_plan`)."""
        mm, add = self.instrs[j], self.instrs[a]
        r = add.outs[0]
        how = f"in place: {r} IS {c}'s storage, one GEMM" if r in self.in_place else "one addmm"
        fs = self.fspecs.setdefault(fspec_src(mm.fspec), f"F{len(self.fspecs)}")
        comment = "\n        # ".join(instr_comment(self.instrs[k], self.bufs, self.texts)
                                      for k in (j, a))
        self.body.append(Step(comment, [
            f"dev.op({self.prog.eqns[mm.eqn].prim!r}, {fs}, "
            f"[{_b(c if r in self.in_place else r)}], "
            f"{', '.join(_b(x) for x in mm.ins)}, {_b(c)})  "
            f"# eqn {add.eqn} fused in: a @ b + c, {how}"], "kernel"))

    def _launch_fused(self, fk):
        self.needs["fused"][fk.name] = fk.source
        eqns = [self.instrs[m].eqn for m in fk.members if self.instrs[m].kind == "kernel"]
        sums = [self.instrs[m].dst for m in fk.members if self.instrs[m].kind == "agg"]
        comment = "\n        # ".join(instr_comment(self.instrs[m], self.bufs, self.texts)
                                      for m in fk.members)
        first = f" after the ⊕ of {', '.join(sums)}" if sums else ""
        checked = ", checked=True" if fk.checks else ""
        self.checked.update(fk.checks)
        self.body.append(Step(comment, [
            f"dev.ew(K.{fk.name}, [{', '.join(_b(a) for a in fk.inputs)}], "
            f"[{', '.join(_b(o) for o in fk.outputs)}]{checked})  # eqns {eqns} fused{first}"],
            "kernel"))

    def memory_plan(self):
        """(the buffers allocated, slot of each, bytes of each slot): every buffer the walk
        touches, sharing storage where lifetimes in walk positions are disjoint."""
        touched = _touched(self.loads + self.body + self.stores, self.bufs, self.pinned)
        slot_of, slots = memory.plan(self.instrs, self.bufs, self.positions, touched,
                                     self.pinned, self.in_place)
        return touched, slot_of, slots


def gpu_walk(dprog, d, needs=None) -> GpuWalk:
    """Device ``d``'s GPU walk of ``dprog``, run (see :class:`GpuWalk`)."""
    return GpuWalk(dprog, d, eqn_texts(dprog.program), recv_names(dprog), needs).run()
