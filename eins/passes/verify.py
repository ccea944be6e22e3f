"""verify: the invariants of every stage (docs/architecture.md). Each function raises
LoweringError naming the first violation; the tests run them after every pass."""
from __future__ import annotations

import functools

from eins.errors import EinsError, LoweringError
from eins.ir.device import INSTRUCTIONS, Free, InstrVisitor, Recv, Send, Slice
from eins.ir.exchange import reuse_key
from eins.ir.joinagg import is_lse_pair
from eins.ir import exprog
from eins.ir.program import Literal, Var
from eins.ir.types import Box, tiling_error

# A concat's tiling depends on its boxes alone, and the layers of a stack repeat the same
# concats (the same block coordinates in each layer's tensors): checked once per distinct set
_concat_tiling_error = functools.lru_cache(maxsize=8192)(tiling_error)


def verify(state):
    """The verify pass: every stage present in ``state`` satisfies its invariants.

    >>> import eins
    >>> from eins.ir.plan import Compilation, Options
    >>> prog = eins.make_ir(lambda x, w: (x @ w).sum(axis=0))(
    ...     eins.ShapeDtype((16, 4), "float32"), eins.ShapeDtype((4, 4), "float32"))
    >>> state = Compilation(prog, (0, 1), Options(cost="proxy"))
    >>> from eins.passes import PIPELINE, run_passes
    >>> state = run_passes(state, PIPELINE)   # verify is the last pass: all stages hold
    >>> del state.device.code[1][7]           # device 1's send: device 0 waits forever
    >>> verify(state)
    Traceback (most recent call last):
    eins.errors.LoweringError: sends and receives do not match: [(1, 0, 0)]
    """
    verify_program(state.program)
    if state.plan is not None:
        verify_plan(state.plan)
    if state.exchange is not None and all(x.program is not None
                                          for x in state.exchange.exchanges):
        verify_exchanges(state.exchange)
    if state.device is not None:
        verify_device(state.device)
    return state


def verify_program(prog) -> None:
    """SSA: every input of every eqn is defined earlier; every output defined once."""
    defined = {id(v) for v in prog.inputs} | {id(v) for v, _ in prog.consts}
    for i, e in enumerate(prog.eqns):
        for a in e.inputs:
            if isinstance(a, Var) and id(a) not in defined:
                raise LoweringError(f"eqn {i} ({e.prim}) reads an undefined variable")
        types = e.primitive.abstract(*[a.type for a in e.inputs], **e.params)
        if tuple(types) != tuple(v.type for v in e.outputs):
            raise LoweringError(f"eqn {i} ({e.prim}): output types {[v.type for v in e.outputs]}"
                                f" differ from the shape rule's {list(types)}")
        for v in e.outputs:
            if id(v) in defined:
                raise LoweringError(f"eqn {i} ({e.prim}) redefines a variable")
            defined.add(id(v))
    for v in prog.outputs:
        if id(v) not in defined:
            raise LoweringError("a program output is never defined")


def verify_plan(plan) -> None:
    """Every eqn has a spec whose blocks are projections of its types and whose outputs tile
    (Definition 3.6), with at most one function specification per device."""
    checked = set()   # (spec, types): a stack of equal layers shares its spec objects
    eqns, eqn_plans = plan.program.eqns, tuple(plan.eqn_plans)
    if len(eqn_plans) > len(eqns):
        raise LoweringError(f"{len(eqn_plans)} eqn plans for {len(eqns)} eqns")
    for i, e in enumerate(eqns):
        ep = eqn_plans[i] if i < len(eqn_plans) else None
        if ep is None:
            raise LoweringError(f"eqn {i} ({e.prim}) has no spec")
        spec = ep.spec
        key = (id(spec), tuple(a.type for a in e.inputs), tuple(v.type for v in e.outputs))
        if key in checked:
            continue
        checked.add(key)
        if len(spec.fspecs) > len(plan.devices):
            raise LoweringError(f"eqn {i} ({e.prim}): {len(spec.fspecs)} function "
                                f"specifications for {len(plan.devices)} devices")
        for f in spec.fspecs:
            if len(f.inputs) != len(e.inputs) or len(f.outputs) != len(e.outputs):
                raise LoweringError(f"eqn {i} ({e.prim}): function specification {f} has "
                                    f"blocks for {len(f.inputs)} inputs and {len(f.outputs)} "
                                    f"outputs, the eqn {len(e.inputs)} and {len(e.outputs)}")
            for k, (b, a) in enumerate(zip(f.inputs, e.inputs)):
                if not Box.full(a.shape).contains(b):
                    raise LoweringError(f"eqn {i} ({e.prim}) input {k}: block {b} is not a "
                                        f"projection of shape {a.shape}")
        try:
            spec.check_tiling([v.shape for v in e.outputs])
        except EinsError as err:
            raise LoweringError(f"eqn {i} ({e.prim}): {err}") from None


def verify_exchanges(xir) -> None:
    """Every exchange program is valid (Definition 5.5) under its membership, its atoms
    live where the producer's placement put their copies, and the membership agrees with
    the consumer's placement."""
    # what was checked already, by the objects' ids (xir holds them all, so the ids stay
    # theirs): the layers of a stack share their exchanges' programs and atoms, and hashing
    # or walking a program of thousands of atoms again for each layer is what costs
    valid = {}   # id(program) -> the memberships it was checked under
    sited = set()   # (id(program), id(atoms), the copies' devices): its atoms' sites agree
    for x in xir.exchanges:
        where = f"exchange of {x.var_name} into eqn {x.eqn} {x.inputs_text()}"
        if x.program is None:
            raise LoweringError(f"{where} has no program")
        devs = xir.placement[x.producer]
        for cp in x.copies:
            if cp.device != devs[cp.fspec]:
                raise LoweringError(f"{where}: the copy of block {cp.box} is on device "
                                    f"{cp.device} but eqn {x.producer}'s function "
                                    f"specification {cp.fspec} runs on {devs[cp.fspec]}")
        skey = (id(x.program), id(x.atoms), tuple(cp.device for cp in x.copies))
        for a in () if skey in sited else x.program.inputs:
            if a.name not in x.atoms or not 0 <= x.atoms[a.name][1] < len(x.copies):
                raise LoweringError(f"{where}: the program's input atom {a.name} is not one of "
                                    f"the exchange's atoms {sorted(x.atoms)} with a copy "
                                    f"(of {len(x.copies)})")
            cp = x.copies[x.atoms[a.name][1]]
            if a.site != cp.device:
                raise LoweringError(f"{where}: atom {a.name} declared at {a.site} but its "
                                    f"copy is on device {cp.device}")
        sited.add(skey)
        key = tuple(sorted((k, tuple(v)) for k, v in x.membership.items()))
        checked = valid.setdefault(id(x.program), set())
        if key not in checked:
            try:
                exprog.check(x.program, x.membership)
            except EinsError as err:
                raise LoweringError(f"{where}: {err}") from None
            checked.add(key)
        if x.eqn >= 0:
            for f, (pname, _) in enumerate(x.needs):
                if pname not in x.membership:
                    raise LoweringError(f"{where}: the membership places no partition {pname} "
                                        f"(function specification {f} needs it); it places "
                                        f"{sorted(x.membership)}")
                if x.membership[pname] != (xir.placement[x.eqn][f],):
                    raise LoweringError(f"{where}: partition {pname} at {x.membership[pname]} "
                                        f"but the eqn's function specification {f} runs on "
                                        f"{xir.placement[x.eqn][f]}")
            _verify_served(xir, x, where)


def _verify_served(xir, x, where) -> None:
    """Each later eqn an exchange serves (``x.serves``) reads that variable, in those
    inputs, in the very blocks the exchange delivers, on the devices it delivers them to."""
    prog = xir.plan.program
    var = prog.eqns[x.producer].outputs[x.out_pos]
    sites, delivered = x.delivered_sites(), reuse_key(x)[2]
    for i, ks in x.serves:
        if not x.eqn < i < len(prog.eqns):
            raise LoweringError(f"{where} serves eqn {i}, which is not a later eqn")
        eqn, spec = prog.eqns[i], xir.plan.eqn_plans[i].spec
        for k in ks:
            if not 0 <= k < len(eqn.inputs) or eqn.inputs[k] is not var:
                raise LoweringError(f"{where} serves eqn {i} input {k}, which does not read "
                                    f"{x.var_name}")
            blocks = tuple(f.inputs[k] for f in spec.fspecs)
            if blocks != delivered:
                raise LoweringError(f"{where} serves eqn {i} input {k}, which needs the "
                                    f"blocks {list(blocks)}, not the delivered "
                                    f"{list(delivered)}")
        if tuple(xir.placement[i]) != sites:
            raise LoweringError(f"{where} delivers to devices {list(sites)} but eqn {i}, "
                                f"which it serves, runs on {list(xir.placement[i])}")


class _DeviceChecker(InstrVisitor):
    """The per-instruction invariants of the device IR, one method per instruction kind
    (:class:`eins.ir.device.InstrVisitor`); ``visit(ins, d, info)`` raises LoweringError.
    It collects the transfers (``sends``, ``recvs``) and the stored boxes per output
    (``stores``) for the checks across devices."""

    def __init__(self, prog):
        self.prog = prog
        self.names = prog.var_names()
        self.sends, self.recvs, self.stores = {}, {}, {}
        # (id(outer), id(inner)) -> whether the box contains the other: the layers of a
        # stack slice the same boxes (the same objects: a replay stamps its template's), and
        # a Box hashes slowly. Ids are safe while the program checked holds the boxes.
        self.contained = {}
        self.tiled = {}   # the same by ids for concats: (ids of sources' boxes, id(box)) -> error

    @staticmethod
    def holds(d, ins, buf, box, info):
        """Buffer ``buf`` is described as the block ``box`` that ``ins`` writes or reads."""
        held = info[buf].box
        if held is not box and held != box:   # a replayed layer shares its template's boxes
            raise LoweringError(f"device {d}: {ins.kind} of {box} but buffer {buf} holds "
                                f"{held}")

    def visit_load(self, ins, d, info):
        where, k = ins.source
        v = self.prog.inputs[k] if where == "in" else self.prog.consts[k][0]
        if not Box.full(v.shape).contains(ins.box):
            raise LoweringError(f"device {d}: load of {ins.box} outside {where}{k} of shape "
                                f"{v.shape}")
        self.holds(d, ins, ins.dst, ins.box, info)

    def visit_slice(self, ins, d, info):
        outer = info[ins.src].box
        key = (id(outer), id(ins.box))
        ok = self.contained.get(key)
        if ok is None:
            ok = self.contained[key] = outer.contains(ins.box)
        if not ok:
            raise LoweringError(f"device {d}: slice {ins.box} outside {info[ins.src].box}")
        self.holds(d, ins, ins.dst, ins.box, info)

    def visit_concat(self, ins, d, info):
        boxes = tuple([info[s].box for s in ins.srcs])
        # keyed by the boxes' ids (the program holds them): a Box hashes slowly, and the
        # layers of a stack concat the same box objects
        key = (tuple(map(id, boxes)), id(ins.box))
        err = self.tiled.get(key, False)
        if err is False:
            err = self.tiled[key] = _concat_tiling_error(boxes, ins.box)
        if err:
            raise LoweringError(f"device {d}: concat into {ins.dst}: {err}")
        self.holds(d, ins, ins.dst, ins.box, info)

    def visit_agg(self, ins, d, info):
        for s in ins.srcs:
            self.holds(d, ins, s, info[ins.dst].box, info)

    def visit_send(self, ins, d, info):
        key = (d, ins.peer, ins.tag)
        if key in self.sends:
            raise LoweringError(f"duplicate send {key}")
        self.sends[key] = info[ins.src]

    def visit_recv(self, ins, d, info):
        key = (ins.peer, d, ins.tag)
        if key in self.recvs:
            raise LoweringError(f"duplicate receive {key}")
        self.recvs[key] = info[ins.dst]

    def visit_kernel(self, ins, d, info):
        e = self.prog.eqns[ins.eqn]
        f = ins.fspec
        if not (len(ins.ins) == len(f.inputs) == len(e.inputs)
                and len(ins.outs) == len(f.outputs) == len(e.outputs)):
            raise LoweringError(f"device {d}: eqn {ins.eqn} ({e.prim}) has {len(e.inputs)} "
                                f"inputs and {len(e.outputs)} outputs, its kernel "
                                f"{len(ins.ins)} and {len(ins.outs)} for a function "
                                f"specification of {len(f.inputs)} and {len(f.outputs)}")
        for k, (a, b) in enumerate(zip(ins.ins, f.inputs)):
            if isinstance(a, str):
                held = info[a].box
                if held is not b and held != b or info[a].dtype != e.inputs[k].dtype:
                    raise LoweringError(
                        f"device {d}: eqn {ins.eqn} ({e.prim}) input {k} is "
                        f"{info[a].box}:{info[a].dtype}, needs {b}:{e.inputs[k].dtype}")
                if info[a].var != self.names[id(e.inputs[k])]:
                    raise LoweringError(f"device {d}: eqn {ins.eqn} ({e.prim}) input {k} is a "
                                        f"block of {info[a].var}, needs one of "
                                        f"{self.names[id(e.inputs[k])]}")
                if info[a].partial:
                    raise LoweringError(f"device {d}: eqn {ins.eqn} input {k} is a "
                                        f"partial (unaggregated) block")
            elif not isinstance(e.inputs[k], Literal):
                raise LoweringError(f"device {d}: eqn {ins.eqn} input {k} missing")
        for o, b in zip(ins.outs, f.outputs):
            self.holds(d, ins, o, b, info)
        if ins.acc is not None:   # a pipelined piece: the running pairs of its output block
            held = info[ins.acc]
            if len(f.outputs) != 1 or held.box != f.outputs[0] or \
                    not is_lse_pair(held.dtype):
                raise LoweringError(f"device {d}: eqn {ins.eqn} ({e.prim}) accumulates into "
                                    f"{ins.acc} ({held.box}:{held.dtype}), which is not (o, lse) "
                                    f"pairs of its output block {f.outputs[0]}")

    def visit_store(self, ins, d, info):
        outs = self.prog.outputs
        if not 0 <= ins.output < len(outs):
            raise LoweringError(f"device {d}: stores output {ins.output} of {len(outs)}")
        if info[ins.src].partial:
            raise LoweringError(f"device {d}: stores a partial block of output {ins.output}")
        if info[ins.src].var != self.names[id(outs[ins.output])]:
            raise LoweringError(f"device {d}: stores a block of {info[ins.src].var} as output "
                                f"{ins.output} ({self.names[id(outs[ins.output])]})")
        self.holds(d, ins, ins.src, ins.box, info)
        self.stores.setdefault(ins.output, []).append(ins.box)

    def visit_free(self, ins, d, info):
        pass


def verify_device(device_program) -> None:
    """Every send has its receive; every buffer is defined before use and used only while
    live, and holds the block its instruction writes; every kernel's inputs are blocks of
    its eqn's inputs with its function specification's boxes and dtypes; the stored blocks
    tile every output. A program lowered for one rank (``rank`` set) is checked on that
    device's instructions alone, and the stored blocks by every device's recorded stores:
    its transfers' peers are checked by theirs (each rank verifies its own)."""
    prog = device_program.program
    check = _DeviceChecker(prog)
    # each class's method found once: a 32-block program has millions of instructions
    visits = {cls: getattr(check, "visit_" + cls.kind) for cls in INSTRUCTIONS}
    sends, recvs, contained = check.sends, check.recvs, check.contained
    for d, code in device_program.code.items():
        live = set()
        discard, add = live.discard, live.add
        info = device_program.bufs.get(d, {})
        for n, ins in enumerate(code):
            t = type(ins)
            # frees, transfers and slices (most of a big program) inline, without the
            # generic calls below; each raises what its visit_ method would
            if t is Free:   # reads nothing, ends a buffer's life (visit_free checks nothing)
                discard(ins.buf)
                continue
            if t is Send:
                if ins.window is None:   # reads its source, writes nothing
                    src = ins.src
                    if src not in live:
                        _not_live(d, n, ins, src)
                    key = (d, ins.peer, ins.tag)
                    if key in sends:
                        raise LoweringError(f"duplicate send {key}")
                    sends[key] = info[src]
                    continue
            elif t is Recv:   # reads nothing, writes its destination
                dst = ins.dst
                key = (ins.peer, d, ins.tag)
                if key in recvs:
                    raise LoweringError(f"duplicate receive {key}")
                recvs[key] = info[dst]
                add(dst)
                continue
            elif t is Slice:   # visit_slice's checks; a replayed layer shares its boxes
                src, dst, box = ins.src, ins.dst, ins.box
                if src not in live:
                    _not_live(d, n, ins, src)
                outer = info[src].box
                ok = contained.get((id(outer), id(box)))
                if ok is None:
                    ok = contained[(id(outer), id(box))] = outer.contains(box)
                if not ok:
                    raise LoweringError(f"device {d}: slice {box} outside {outer}")
                held = info[dst].box
                if held is not box and held != box:
                    check.holds(d, ins, dst, box, info)
                add(dst)
                continue
            for b in ins.uses():
                if b not in live:
                    _not_live(d, n, ins, b)
            visit = visits.get(t)
            if visit is None:
                check.visit(ins, d, info)
            else:
                visit(ins, d, info)
            live.difference_update(ins.ends())
            live.update(ins.defs())
    if device_program.rank is not None:
        stored = {}
        for blocks in device_program.store_layout().values():
            for o, box in blocks:
                stored.setdefault(o, []).append(box)
        _check_stored(prog, stored)
        return
    sends, recvs = check.sends, check.recvs
    matched, wrong = len(sends) == len(recvs), None
    for key, s_info in sends.items():   # one lookup each, not two sets of a million keys
        r_info = recvs.get(key)
        if r_info is None:
            matched = False
            break
        # both ends of a replayed transfer share one BufInfo, or at least its box
        if (wrong is None and r_info is not s_info and r_info.box is not s_info.box
                and r_info.box != s_info.box):
            wrong = f"transfer {key} sends {s_info.box}, receives {r_info.box}"
    if not matched:
        missing = sorted(set(sends) ^ set(recvs))[:3]
        raise LoweringError(f"sends and receives do not match: {missing}")
    if wrong:
        raise LoweringError(wrong)
    _check_stored(prog, check.stores)


def _not_live(d, n, ins, b):
    raise LoweringError(f"device {d} instruction {n} ({ins}) reads {b}, which is not live")


def _check_stored(prog, stores) -> None:
    for o, v in enumerate(prog.outputs):
        err = tiling_error(stores.get(o, ()), Box.full(v.shape))
        if err:
            raise LoweringError(f"output {o}: stored {err}")
