"""Fusion of consecutive elementwise eqns into one generated Triton kernel
(template ``triton_fused.py.j2``, expressions from eins/kernels/expressions.py's Triton
dialect).

A group (:func:`fusion_groups`, over a traced ``Program`` or one device's instruction list,
``DeviceProgram.code[d]`` with ``.bufs[d]``; ``Free`` instructions do not break it) is a
maximal run of consecutive elementwise kernels with the same output (block) shape: chains
such as silu·mul, residual adds, casts, scalar ops, and independent members that share the
launch and the loads (the ``a - 2`` feeding a later ``where``). Values used only inside the
group stay in registers; a value also used elsewhere (a later kernel, a send, a store, a
program output) is written too, so a group never has to stop at a shared intermediate.
:func:`residual_adds` picks the adds that run as their matmul's epilogue instead (one
cuBLAS addmm) and :func:`sum_heads` the final ⊕ that a group's kernel computes first.
:func:`fused_source` renders a group's kernel, :func:`launch_fused` runs it on torch
tensors.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from eins.kernels import expressions as ex
from eins.kernels import build
from eins.errors import EinsError
from eins.ir.device import def_use
from eins.ir.joinagg import AGG_FUNCS, PAIR_AGGS
from eins.ir.primitive import get_primitive
from eins.ir.program import Literal
from eins.ir.rules import negative_power_error

TEMPLATE = "triton_fused.py.j2"
BLOCK = 1024


@dataclass(frozen=True)
class _Node:
    key: int           # eqn index (program) or instruction index (device)
    eqn: int
    ins: tuple         # refs: Var / buffer name, or ("lit", value, dtype)
    out: object
    in_shapes: tuple
    in_dtypes: tuple
    out_shape: tuple
    out_dtype: np.dtype


@dataclass(frozen=True)
class _AggNode:
    """A ⊕ (Agg instruction ``key``) computed as the first step of a fused kernel."""
    key: int
    prim: str          # the elementwise primitive it applies (add for sum)
    srcs: tuple        # the partial blocks (buffer names), combined in this order
    out: str
    out_shape: tuple
    out_dtype: np.dtype


@dataclass(frozen=True)
class FusedKernel:
    """One generated kernel: ``source`` defines ``name(*inputs, *outputs, n_elements, BLOCK)``,
    or ``name(*inputs, *outputs, err, n_elements, BLOCK)`` when it ``checks`` eqns.

    ``checks``: the eqns whose inputs the kernel checks, numpy's refusals that a kernel
    cannot raise: an integer base to a negative integer power read from a tensor (a literal
    exponent is refused at trace time). ``err`` is an int64 tensor, one element per eqn of
    the program, zero before; the kernel lowers ``err[eqn]`` to its most negative exponent
    (an atomic min: the same value whichever lanes run first, numpy's ``b.min()``), and
    the caller raises :func:`device_error` after the launch (:func:`launch_fused`) or the
    call (eins/runtime/gpu_exec.py)."""

    name: str
    source: str
    inputs: tuple      # refs in argument order (Vars or buffer names)
    outputs: tuple     # refs written, in argument order
    shape: tuple       # the output block shape every member shares
    members: tuple     # the grouped eqn / instruction indices
    checks: tuple = ()  # the eqns checked through ``err``

    @property
    def launch_at(self):
        """Where to launch: the last member (every member's operands exist by then)."""
        return self.members[-1]


def _is_lit(r) -> bool:
    return isinstance(r, tuple) and len(r) == 3 and r[0] == "lit"


def _program_nodes(program):
    nodes = []
    for i, e in enumerate(program.eqns):
        if not e.primitive.is_elementwise or len(e.outputs) != 1:
            nodes.append(None)
            continue
        ins = tuple(("lit", a.value, a.dtype) if isinstance(a, Literal) else a for a in e.inputs)
        nodes.append(_Node(i, i, ins, e.outputs[0], tuple(tuple(a.shape) for a in e.inputs),
                           tuple(np.dtype(a.dtype) for a in e.inputs),
                           tuple(e.outputs[0].shape), np.dtype(e.outputs[0].dtype)))
    return nodes


def _device_nodes(program, instrs, bufs):
    """Per instruction: a node for an elementwise kernel of one output, "free" for an
    instruction that reads and writes no buffer (a Free: it never separates members), None
    for the others (they end a group, or are jumped with ``reorder``)."""
    nodes = []
    for j, ins in enumerate(instrs):
        if not ins.uses() and not ins.defs():
            nodes.append("free")
        elif ins.kind == "kernel" and program.eqns[ins.eqn].primitive.is_elementwise \
                and len(ins.outs) == 1:
            shapes = tuple(() if _is_lit(a) else tuple(bufs[a].box.shape) for a in ins.ins)
            dts = tuple(np.dtype(a[2]) if _is_lit(a) else np.dtype(bufs[a].dtype)
                        for a in ins.ins)
            o = ins.outs[0]
            nodes.append(_Node(j, ins.eqn, tuple(ins.ins), o, shapes, dts,
                               tuple(bufs[o].box.shape), np.dtype(bufs[o].dtype)))
        else:
            nodes.append(None)
    return nodes


def _nodes(program, instrs, bufs):
    if instrs is None:
        return _program_nodes(program)
    if bufs is None:
        raise EinsError("fusion: a device instruction list needs its buffer table "
                        "(DeviceProgram.bufs[d])")
    return _device_nodes(program, instrs, bufs)


def _reads(program, instrs, k) -> set:
    """Ref keys item ``k`` reads (an eqn, or an instruction of the device list: its
    ``uses()``)."""
    if instrs is None:
        return {_ref_key(a) for a in program.eqns[k].inputs}
    return set(instrs[k].uses())


def fusion_groups(program, instrs=None, bufs=None, min_size=2, reorder=False) -> list[list[int]]:
    """The fusable groups (see the module docstring), as lists of eqn indices (program) or
    instruction indices (device); groups shorter than ``min_size`` are left out.

    ``reorder=True`` also fuses across other (non-elementwise) items that do not read the
    group's values, for members that read a value of the group: silu(x @ w1) * (x @ w3)
    fuses although the second matmul sits between silu and mul. Such a group must be
    launched at its LAST member (``FusedKernel.launch_at``), and frees of its inputs in
    between deferred to after it. Without reorder, groups are runs of consecutive members
    (only frees between), which may be launched at any member's position."""
    groups, cur, made = [], [], set()
    gap = False  # an item was jumped since the last member

    def close():
        nonlocal gap
        if len(cur) >= min_size:
            groups.append([n.key for n in cur])
        cur.clear()
        made.clear()
        gap = False

    for k, n in enumerate(_nodes(program, instrs, bufs)):
        if n == "free":
            continue
        if n is None:
            if not reorder or not cur or _reads(program, instrs, k) & made:
                close()
            else:
                gap = True
            continue
        chained = any(not _is_lit(a) and _ref_key(a) in made for a in n.ins)
        if not cur or n.out_shape != cur[0].out_shape or (gap and not chained):
            close()
        cur.append(n)
        made.add(_ref_key(n.out))
    close()
    return groups


# the dtypes a matmul takes a residual add into (cuBLAS addmm/baddbmm; ml_dtypes' bfloat16
# is not numpy kind "f")
_GEMM_FLOATS = ("float16", "bfloat16", "float32", "float64")


def residual_adds(program, instrs, bufs, singles) -> list[tuple]:
    """(matmul, add, c) instruction pairs of one device's list where ``r = c + a @ b``
    (either order) runs as one matmul with an epilogue: the add is one of ``singles`` (an
    elementwise kernel fused with nothing else), the matmul's block is read by that add alone
    (so it is the final value, not a partial product a ⊕ or a send still needs), and ``c``,
    the product, the matmul's operands and ``r`` share one float dtype, ``c`` and the product
    one shape (no broadcast). Of two products added, the later matmul takes the add (the
    other product is written by then)."""
    producer, readers = def_use(instrs)

    def fits(j, m, c, out):
        mm = instrs[j]
        if mm.kind != "kernel" or not program.eqns[mm.eqn].primitive.residual_epilogue \
                or len(readers[m]) != 1 \
                or len(mm.outs) != 1 or not all(isinstance(x, str) for x in mm.ins):
            return False
        same = [bufs[x] for x in (m, c, *mm.ins)]
        return all(np.dtype(x.dtype) == out.dtype for x in same) and \
            all(tuple(x.box.shape) == tuple(out.box.shape) for x in same[:2])

    pairs = []
    for a in sorted(singles):
        add = instrs[a]
        if not program.eqns[add.eqn].primitive.residual_add or len(add.ins) != 2 or \
                not all(isinstance(x, str) for x in add.ins) or add.ins[0] == add.ins[1] \
                or np.dtype(bufs[add.outs[0]].dtype).name not in _GEMM_FLOATS:
            continue
        found = [(producer[m], add.ins[1 - i]) for i, m in enumerate(add.ins)
                 if m in producer and fits(producer[m], m, add.ins[1 - i], bufs[add.outs[0]])]
        if found:
            j, c = max(found)
            pairs.append((j, a, c))
    return pairs


def agg_prim(op) -> str | None:
    """The elementwise primitive that ⊕ ``op`` applies, from the one ⊕ table
    (``AGG_FUNCS`` of eins/ir/joinagg.py): its numpy ufunc's name (np.add -> ``add``,
    np.maximum -> ``maximum``); None for a ⊕ on pairs (lse), which has kernels of its own."""
    f = AGG_FUNCS[op]
    return f.__name__ if isinstance(f, np.ufunc) else None


def agg_source(name: str, op: str, nsrc: int, final_dtype=None) -> str:
    """The Triton ⊕ kernel ``name`` (``triton_agg.py.j2``) combining ``nsrc`` sources with
    ``op``; ``final_dtype`` (lse only): it writes the combined output in that dtype rather
    than pairs. Each accumulation line is the ⊕'s elementwise primitive's Triton expression
    on the accumulator and the next source."""
    combine = [] if agg_prim(op) is None else [
        ex.render(agg_prim(op), "triton",
                  names={"a": "acc", "b": f"tl.load(p{k} + offs, mask=mask).to(ACC)"})
        for k in range(1, nsrc)]
    return build.render("triton_agg.py.j2", name=name, op=op, nsrc=nsrc,
                        final=final_dtype is not None, combine=combine, PAIR_AGGS=PAIR_AGGS,
                        out_dtype=ex.triton_dtype(final_dtype) if final_dtype else None)


def _agg_acc(dtype) -> str:
    """The Triton dtype a ⊕ accumulates in, as the ⊕ kernel's ``ACC``
    (:func:`eins.kernels.build.acc_dtype_name`)."""
    return ex.triton_dtype(build.acc_dtype_name(np.dtype(dtype).name))


def sum_heads(instrs, bufs, groups) -> list[tuple]:
    """(Agg instructions, group) for the ⊕ that fuse into a group's kernel as its first steps
    (``groups``: lists of instruction indices, from :func:`fusion_groups`). A ⊕ fuses when
    it applies an elementwise primitive (not the pair ⊕ lse), its block is the full
    aggregate (not ``partial``: a step of a reduction still travelling), only members of the
    one group read it (not a send, a store, i.e. a program output, nor a kernel outside the
    group), and its partials and result share the group's block shape and one dtype. The
    group launches at its last member, after the ⊕; the partials are never written again
    (each buffer has one writer), so reading them there reads what the ⊕ would have."""
    _, readers = def_use(instrs)
    group_of = {m: tuple(g) for g in groups for m in g}
    heads = {}   # group -> its ⊕, in instruction order
    for j, ins in enumerate(instrs):
        # a placement (windowed ⊕) stays its own step: its sources hold only their windows
        if ins.kind != "agg" or agg_prim(ins.op) is None or ins.windows is not None:
            continue
        r = readers.get(ins.dst, [])
        out = bufs[ins.dst]
        if out.partial or not r or r[0] not in group_of or \
                any(group_of.get(k) != group_of[r[0]] for k in r):
            continue
        g = group_of[r[0]]
        shape = tuple(bufs[instrs[g[0]].outs[0]].box.shape)
        if any(tuple(bufs[b].box.shape) != shape or np.dtype(bufs[b].dtype) != out.dtype
               for b in (ins.dst, *ins.srcs)):
            continue
        heads.setdefault(g, []).append(j)
    return [(hs, list(g)) for g, hs in heads.items()]


def _ref_key(r):
    return r if isinstance(r, (str, int)) else id(r)


def _escaping(program, instrs, members, produced):
    """Refs produced in the group that something outside it reads (or a program output)."""
    inside = set(members)
    n = len(program.eqns) if instrs is None else len(instrs)
    used = set()
    for j in range(n):
        if j not in inside:
            used |= _reads(program, instrs, j)
    if instrs is None:
        used.update(_ref_key(v) for v in program.outputs)
    return [r for r in produced if _ref_key(r) in used]


def _strides_against(shape, out_shape):
    """Element strides of a contiguous operand of ``shape`` indexed by the output's dims
    (0 where it broadcasts)."""
    shape = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc if n != 1 else 0)
        acc *= n
    return tuple(reversed(st))


def _literal(value, dtype, compute) -> str:
    v = np.asarray(value, dtype=dtype).astype(compute)  # rounded to its dtype first
    if compute == np.bool_:
        src = repr(bool(v))
    elif compute.kind in "iu":
        src = repr(int(v))
    else:
        f = float(v)
        src = repr(f) if np.isfinite(f) else f"float({str(f)!r})"
    return f"tl.full([BLOCK], {src}, {ex.triton_dtype(compute)})"


def fused_source(program, group, instrs=None, bufs=None, heads=()) -> FusedKernel:
    """The fused Triton kernel of ``group`` (from :func:`fusion_groups`, or any run of
    elementwise members of one output shape, a single one included). ``heads``: Agg
    instructions of the device list (from :func:`sum_heads`) the kernel computes first;
    they become the first ``members``. Literals are baked into the source."""
    all_nodes = _nodes(program, instrs, bufs)
    nodes = [all_nodes[k] for k in group]
    if not nodes or any(n is None or n == "free" for n in nodes):
        raise EinsError(f"fusion: group {list(group)} holds a non-elementwise member")
    texts = [p.strip() for p in program.pretty().splitlines()[1:1 + len(program.eqns)]]
    eqns = [program.eqns[n.eqn] for n in nodes]
    texts = [f"eqn {n.eqn}: {texts[n.eqn]}" for n in nodes]
    for k, h in enumerate(heads):
        a = instrs[h] if instrs is not None else None
        if a is None or a.kind != "agg" or agg_prim(a.op) is None:
            raise EinsError(f"fusion: head {h} of group {list(group)} is not an "
                            f"elementwise ⊕ of the device list")
        info = bufs[a.dst]
        nodes.insert(k, _AggNode(h, agg_prim(a.op), tuple(a.srcs), a.dst,
                                 tuple(info.box.shape), np.dtype(info.dtype)))
        eqns.insert(k, None)
        # named without the device's buffers: the same chain on every device is one
        # kernel (its source, docstring included, is Triton's cache key and its name)
        texts.insert(k, f"⊕{a.op} of {len(a.srcs)} partial copies of the block")
    members = [n.key for n in nodes]
    produced = [n.out for n in nodes]
    outs = _escaping(program, instrs, members, produced) or [produced[-1]]
    return _render_nodes(nodes, eqns, texts, outs)


def _cast(value: str, dtype) -> str:
    """Triton source casting ``value`` to ``dtype``; to bfloat16 through the kernel helper
    ``_to_bf16`` (build.KERNEL_HELPERS), which the interpreter replaces with a correct one."""
    if np.dtype(dtype).name == "bfloat16":
        return f"_to_bf16({value})"
    return f"{value}.to({ex.triton_dtype(dtype)})"


def _render_nodes(nodes, eqns, texts, outs) -> FusedKernel:
    shape = nodes[0].out_shape
    if any(n.out_shape != shape for n in nodes):
        raise EinsError(f"fusion: members {[n.key for n in nodes]} mix output shapes "
                        f"{sorted({n.out_shape for n in nodes})}")
    local, inputs, args, lines, checks = {}, [], [], [], []

    def load(a, shp):
        k = _ref_key(a)
        if k not in local:  # an input of the group: loaded once
            arg = f"in{len(inputs)}"
            inputs.append(a)
            args.append(arg)
            st = _strides_against(shp, shape)
            off = "offs" if st == _strides_against(shape, shape) else \
                build.offset_expr("offs", shape, st)
            lines.append(f"v_{arg} = tl.load({arg} + {off}, mask=mask)")
            local[k] = f"v_{arg}"
        return local[k]

    for n, e in zip(nodes, eqns):
        if isinstance(n, _AggNode):
            # exactly the ⊕ kernel's arithmetic (triton_agg.py.j2): accumulate in ACC, in
            # the partials' order, one rounding to the block's dtype at the end
            acc = _agg_acc(n.out_dtype)
            parts = [load(s, n.out_shape) for s in n.srcs]
            a = f"acc{len(lines)}"
            lines.append(f"{a} = {parts[0]}.to({acc})  # ⊕ of {len(n.srcs)} partials")
            for p in parts[1:]:
                lines.append(f"{a} = " + ex.render(n.prim, "triton",
                                                   names={"a": a, "b": f"{p}.to({acc})"}))
            v = f"v{len(lines)}"
            lines.append(f"{v} = {_cast(a, n.out_dtype)}")
            local[_ref_key(n.out)] = v
            continue
        names = ex.operand_names(e.primitive, e.params)
        dts = ex.dtypes_for(e.primitive, n.in_dtypes, n.out_dtype)
        rendered = []
        for a, shp, comp in zip(n.ins, n.in_shapes, dts.compute):
            comp = np.dtype(comp)
            if _is_lit(a):
                rendered.append(_literal(a[1], a[2], comp))
                continue
            rendered.append(_cast(load(a, shp), comp))
        integer = all(np.dtype(c).kind in "iub" for c in dts.compute)
        expr = ex.render(e.primitive, "triton", e.params, names=dict(zip(names, rendered)),
                         integer=integer)
        v = f"v{len(lines)}"
        lines.append(f"{v} = {_cast(f'({expr})', n.out_dtype)}  # eqn {n.eqn}")
        checked = e.primitive.expression.checked
        if checked is not None and integer and not _is_lit(n.ins[checked]):
            # numpy refuses an integer base to a negative integer power: the kernel records
            # the exponent at err[eqn] for its caller to raise (FusedKernel.checks)
            b = rendered[checked]
            lines.append(f"tl.atomic_min(err + (offs * 0 + {n.eqn}), {b}.to(tl.int64), "
                         f"mask=mask & ({b} < 0))  # eqn {n.eqn}: a negative integer power")
            checks.append(n.eqn)
        local[_ref_key(n.out)] = v
    for j, r in enumerate(outs):
        args.append(f"out{j}")
        lines.append(f"tl.store(out{j} + offs, {local[_ref_key(r)]}, mask=mask)")
    if checks:
        args.append("err")
    body = build.render(TEMPLATE, name="fused", args=args, shape=list(shape), lines=lines,
                         texts=texts, agg=any(isinstance(n, _AggNode) for n in nodes))
    name = "fused_" + hashlib.sha1(body.encode()).hexdigest()[:12]
    return FusedKernel(name, body.replace("def fused(", f"def {name}(", 1), tuple(inputs),
                       tuple(outs), tuple(shape), tuple(n.key for n in nodes),
                       tuple(dict.fromkeys(checks)))


def device_error(err, program=None):
    """The DTypeError of a kernel's check (:attr:`FusedKernel.checks`), or None: ``err`` is
    the check tensor's values (numpy, one per eqn; several devices' combined by their
    minimum); the first eqn that failed is the one reported, named as every runtime names
    it (``Program.eqn_error``) when the caller knows the ``program``."""
    bad = np.flatnonzero(np.asarray(err) < 0)
    if not len(bad):
        return None
    i = int(bad[0])
    bad = negative_power_error(int(err[i]))
    return program.eqn_error(i, bad) if program is not None else bad


def op_source(prim, params, operands, out_shape, out_dtype) -> FusedKernel:
    """The kernel of ONE elementwise op on blocks: ``operands`` are ``(shape, dtype)`` for a
    tensor (broadcasting ones included) or ``("lit", value, dtype)`` for a literal (baked
    in); its input refs are the tensor operands' positions. The GPU lowering of
    eins/ops/elementwise.py uses it. ``prim``: a Primitive or its registered name."""
    prim = get_primitive(prim)
    ins, shapes, dts = [], [], []
    for k, a in enumerate(operands):
        if _is_lit(a):
            ins.append(a)
            shapes.append(())
            dts.append(np.dtype(a[2]))
        else:
            ins.append(k)
            shapes.append(tuple(a[0]))
            dts.append(np.dtype(a[1]))
    node = _Node(0, 0, tuple(ins), "out", tuple(shapes), tuple(dts), tuple(out_shape),
                 np.dtype(out_dtype))
    op = SimpleNamespace(primitive=prim, params=dict(params))
    return _render_nodes([node], [op], [f"{prim.name} {params or ''}".strip()], ["out"])


def launch_fused(fk: FusedKernel, inputs, outputs, block=None):
    """Run ``fk`` on torch tensors: ``inputs``/``outputs`` in ``fk.inputs``/``fk.outputs``
    order, contiguous, outputs of shape ``fk.shape``."""
    if len(inputs) != len(fk.inputs) or len(outputs) != len(fk.outputs):
        raise EinsError(f"fusion: kernel {fk.name} takes {len(fk.inputs)} inputs and "
                        f"{len(fk.outputs)} outputs, got {len(inputs)} and {len(outputs)}")
    for t in list(inputs) + list(outputs):
        if not t.is_contiguous():
            raise EinsError(f"fusion: kernel {fk.name} needs contiguous tensors, got strides "
                            f"{t.stride()} for shape {tuple(t.shape)}")
    for t in outputs:
        if tuple(t.shape) != fk.shape:
            raise EinsError(f"fusion: output of shape {tuple(t.shape)}, expected {fk.shape}")
    interpret = build.interpret_for(*inputs, *outputs)
    fn = build.compile_source(fk.source, fk.name, interpret)
    n = int(np.prod(fk.shape)) if fk.shape else 1
    if n == 0:
        return outputs
    b = block or BLOCK
    err = []
    if fk.checks:
        import torch  # heavy: only the GPU path
        err = [torch.zeros(max(fk.checks) + 1, dtype=torch.int64, device=outputs[0].device)]
    fn[((n + b - 1) // b,)](*inputs, *outputs, *err, n, BLOCK=b, **build.LAUNCH_OPTIONS)
    if err:   # a checked kernel reads its verdict back (a sync; rare: integer pow)
        bad = device_error(err[0].cpu().numpy())
        if bad is not None:
            raise bad
    return outputs
