"""The pieces of a pipelined device program (eins/passes/pipeline.py makes them): which
operands an eqn's kernel may run in pieces along (``Primitive.pipeline``), and, read back
from the device IR, each device's pieces of such an eqn with the receives each one reads,
which the time model prices (eins.cost.predict.Timeline.pipelined); and where the generated
GPU programs wait for those receives (:func:`receives_where_read`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from eins.ir.device import Concat, Kernel, Recv, Slice
from eins.ir.joinagg import is_lse_pair, partial_dtype

__all__ = ["OP", "Piece", "pair_itemsize", "pieced", "pieces_of", "pipeline_operands",
           "receives_where_read", "running_dtype", "under_pieces"]

OP = "lse"   # the ⊕ joining the pieces (the operator's key-split partials)


def pieced(eqn):
    """``(operands, axis)`` along which ``eqn``'s kernel may run in pieces
    (``Primitive.pipeline``), or None."""
    fn = eqn.primitive.pipeline
    return None if fn is None else fn(eqn.params)


def pipeline_operands(eqn) -> tuple:
    """The operands :func:`pieced` names (none where it is None)."""
    got = pieced(eqn)
    return () if got is None else got[0]


def pair_itemsize(eqn) -> int:
    """Bytes per element of a piece's running (o, lse) pairs."""
    return running_dtype(eqn.outputs[0].dtype).itemsize


def running_dtype(dtype):
    """The dtype of the running (o, lse) pairs of a pieced output block of ``dtype``: its
    pairs, or the block's own where it is pairs already (a key-split block's partial)."""
    return dtype if is_lse_pair(dtype) else partial_dtype(OP, dtype)


def under_pieces(eqn, inputs, serves) -> bool:
    """Whether an exchange delivering ``inputs`` of pieced eqn ``eqn`` (and, with
    ``serves``, blocks a later eqn reads too) is received under its pieces: it brings
    pieced operands alone, to this eqn alone. The others hold their GPUs as before."""
    return not serves and set(inputs) <= set(pipeline_operands(eqn))


@dataclass(frozen=True)
class Piece:
    """One piece of a pipelined kernel on one device: its Kernel and the receives (peer,
    bytes) whose parts it reads, posted before the piece before it (module docstring)."""
    kernel: Kernel
    recvs: tuple


def pieces_of(dprog) -> dict:
    """{eqn: {device: [Piece]}} of every pipelined eqn of ``dprog`` (an eqn with a piece on
    some device), every device running one of its kernels listed (a kernel left whole is
    one piece, with the receives of the parts it stitches)."""
    prog = dprog.program
    out: dict = {ins.eqn: {} for code in dprog.code.values() for ins in code
                 if type(ins) is Kernel and ins.acc is not None}
    if not out:
        return out
    for d, code in dprog.code.items():
        bufs = dprog.bufs.get(d, {})
        recv_of = {}
        made = {}
        for ins in code:
            if type(ins) is Recv:
                recv_of[ins.dst] = ins
            elif type(ins) is Slice and ins.src in recv_of:
                recv_of[ins.dst] = recv_of[ins.src]
            elif type(ins) is Concat:
                made[ins.dst] = ins.srcs
            elif type(ins) is Kernel and ins.eqn in out:
                how = pieced(prog.eqns[ins.eqn])
                rs = []
                for a in how[0]:
                    for b in made.get(ins.ins[a], (ins.ins[a],)):
                        r = recv_of.get(b)
                        if r is not None:
                            rs.append((r.peer, bufs[b].box.size * bufs[b].dtype.itemsize))
                out[ins.eqn].setdefault(d, []).append(Piece(ins, tuple(rs)))
    return out


def receives_where_read(dprog):
    """``dprog`` with each receive moved to just before the first instruction that reads
    (or frees) its buffer, for the generated GPU programs (eins/codegen/generate.py), whose
    receive is a wait on the copy the sender writes straight into the buffer: there is
    nothing to post ahead, so a pipelined piece's receives wait where the piece reading them
    starts, and the pieces before it run while the copies land. ``dprog`` itself when it has
    no pieces."""
    if not any(type(i) is Kernel and i.acc is not None for c in dprog.code.values() for i in c):
        return dprog
    code = {}
    for d, instrs in dprog.code.items():
        out, waiting = [], {}   # buffer -> (its receive's place in instrs, the receive)
        for n, ins in enumerate(instrs):
            if type(ins) is Recv:
                waiting[ins.dst] = (n, ins)
                continue
            due = [waiting.pop(x) for x in ins.uses() + ins.ends() if x in waiting]
            out += [r for _, r in sorted(due, key=lambda t: t[0])]
            out.append(ins)
        code[d] = out + [r for _, r in waiting.values()]
    return replace(dprog, code=code)
