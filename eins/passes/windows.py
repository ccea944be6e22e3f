"""Runtime byte counts for the capacity program's transfers (issue 36): every Send into or
out of a capacity block gets a :class:`~eins.ir.device.Window`, the rows it moves this call,
read from the call's table (eins/passes/capacity.py), so one fixed device program moves the
bytes of the call's cut.

A window is a union of intervals, each [max of one or two table entries, min of one or
two), all of one table and axis. Two facts about a buffer, found by dataflow over the whole
device program:

- ``need``: the rows its readers use. A capacity block reads only its window of each
  operand it names (``Capacity.reads``: attention's q by the block's rows, k and v by the
  keys those rows attend to); a slice, concat, ⊕ or send passes its destination's need to
  its sources; any other reader needs every row. A buffer read under several windows of
  one table and axis needs their union: under the optimized schedule synthesis relays a
  block through a device whose own block reads other rows of it (a broadcast tree, every
  device of a capacity program reading every row), so the relay needs its own rows and
  those of each device it forwards to. One interval a side (the hull) would move the
  rows between them too, which no device on the route reads. Windows of two tables or
  axes join to every row.
- ``support``: the rows that may be nonzero. A capacity block's output is zero outside its
  rows; slices keep their source's support, a concat or a ⊕-sum keeps the union of its
  sources', a received buffer holds only what its send moved; anything else may be
  nonzero anywhere.

A Send then moves its source's rows inside both its receiver's need and its source's
support (two windows intersect interval by interval: the largest lo, the smallest hi),
and the receiver's buffer holds zeros elsewhere: exact, since no reader looks at rows
outside the need and rows outside the support are zero. So a relayed send moves the rows
the devices on its route read, once per hop: the bytes of the program's own routes, which
were synthesized once for the capacity blocks and can differ from those a per-cut
program's synthesis picks for the cut's blocks (docs/stages.md). Every device that sends
windowed loads the whole table once (a few ints per block), first in its list.
"""
from __future__ import annotations

from dataclasses import replace

from eins.cost.predict import model_seconds
from eins.ir.device import BufInfo, DeviceProgram, Free, Load, Window, placed_receives
from eins.ir.types import Box

__all__ = ["windows", "window_bytes", "capacity_seconds"]

FULL = "full"   # every row: no window
MAX_PARTS = 16   # intervals of one window; beyond, every row (a kernel per count: few)


def _part_in(p, q) -> bool:
    """Interval ``p`` holds interval ``q`` for every table (q bounded by all p's bounds)."""
    return set(p[0]) <= set(q[0]) and set(p[1]) <= set(q[1])


def _union(k, axis, parts):
    """The window of ``parts`` (an interval is (los, his): [max los, min his)) on one
    table and axis, those inside another dropped; past MAX_PARTS every row."""
    parts = sorted(set(parts))
    kept = tuple(p for i, p in enumerate(parts)
                 if not any(_part_in(q, p) for j, q in enumerate(parts) if j != i))
    return (k, axis, kept) if len(kept) <= MAX_PARTS else FULL


def _meet(a, b):
    """The join of two needs (or supports) of one buffer: the union of their intervals
    where both are windows of one table and axis (a relay's receiver and the devices it
    forwards to read different rows of it), else every row."""
    if a is None:
        return b
    if b is None or a == b:
        return a
    if a == FULL or b == FULL or a[:2] != b[:2]:
        return FULL
    return _union(a[0], a[1], a[2] + b[2])


def _intersect(a, b):
    """Rows inside both (FULL is every row); windows of one table and axis intersect,
    interval by interval (the largest lo, the smallest hi)."""
    if a == FULL:
        return b
    if b == FULL:
        return a
    if a[:2] != b[:2]:
        return a   # different tables or axes: moving one window is still a superset
    parts = []
    for pa in a[2]:
        for pb in b[2]:
            los, his = tuple(sorted(set(pa[0] + pb[0]))), tuple(sorted(set(pa[1] + pb[1])))
            # the copy kernel reads two bounds a side: else pa, still a superset
            parts.append(pa if len(los) > 2 or len(his) > 2 else (los, his))
    return _union(a[0], a[1], parts)


def _windows_of(cap):
    """{(eqn, table row): ({operand: window}, {output: window})} from the capacity layout;
    a window is (table input, axis, intervals), an interval (los, his) of (row, column)
    cells."""
    out = {}
    for i, axis, n in cap.layout:
        reads = cap.reads.get(i)
        if not reads:
            continue
        k = cap.inputs[i]
        for j in range(n):
            def window(ax, p):   # one interval: columns 2p and 2p + 1 of row j
                return (k, ax, ((((j, 2 * p),), ((j, 2 * p + 1),)),))
            ins = {op: window(ax, p) for op, (p, ax) in reads.items()}
            # no output axis: the first output is not windowed (a partial over every row)
            outs = {} if axis is None else {0: window(axis, 0)}
            outs.update({o: window(ax, p) for o, (ax, p) in cap.outs.get(i, {}).items()})
            out[(i, j)] = (ins, outs)
    return out


def _analyse(dprog, blocks):
    """(need, support) per (device, buffer), as the module docstring says."""
    recv_of = {}
    send_of = {}
    for d, code in dprog.code.items():
        for ins in code:
            if ins.kind == "recv":
                recv_of[(ins.peer, d, ins.tag)] = ins.dst
            elif ins.kind == "send":
                send_of[(d, ins.peer, ins.tag)] = ins.src

    eqns = {i for i, _ in blocks}

    def block(d, ins):
        """The windows of a capacity block (its table row: its last operand's box)."""
        if ins.kind != "kernel" or ins.eqn not in eqns:
            return None
        return blocks.get((ins.eqn, ins.fspec.inputs[-1].lo[0]))

    need: dict = {}
    changed = True
    while changed:   # buffers form a DAG through sends: a few rounds reach the fixed point
        changed = False
        new: dict = {}
        for d, code in dprog.code.items():
            for ins in code:
                if ins.kind in ("slice", "concat", "agg"):
                    want = need.get((d, ins.dst))
                    srcs = (ins.src,) if ins.kind == "slice" else ins.srcs
                    demands = [(s, want) for s in srcs]
                elif ins.kind == "send":
                    dst = recv_of.get((d, ins.peer, ins.tag))
                    demands = [(ins.src, need.get((ins.peer, dst)))]
                elif ins.kind == "kernel":
                    b = block(d, ins)
                    demands = [(a, b[0].get(n, FULL) if b else FULL)
                               for n, a in enumerate(ins.ins) if isinstance(a, str)]
                else:
                    demands = [(a, FULL) for a in ins.uses()]
                for a, w in demands:
                    if w is not None:
                        key = (d, a)
                        new[key] = _meet(new.get(key), w)
        if new != need:
            need, changed = new, True
    support: dict = {}
    changed = True
    while changed:
        changed = False
        new = {}
        for d, code in dprog.code.items():
            for ins in code:
                if ins.kind == "kernel":
                    b = block(d, ins)
                    for n, o in enumerate(ins.outs):
                        new[(d, o)] = b[1].get(n, FULL) if b else FULL
                elif ins.kind == "slice":
                    new[(d, ins.dst)] = support.get((d, ins.src), FULL)
                elif ins.kind == "concat" or (ins.kind == "agg" and ins.op == "sum"):
                    got = None
                    for s in ins.srcs:
                        got = _meet(got, support.get((d, s), FULL))
                    new[(d, ins.dst)] = got
                elif ins.kind == "recv":
                    src = send_of.get((ins.peer, d, ins.tag))
                    new[(d, ins.dst)] = _intersect(need.get((d, ins.dst), FULL),
                                                   support.get((ins.peer, src), FULL))
                else:
                    for b in ins.defs():
                        new[(d, b)] = FULL
        if new != support:
            support, changed = new, True
    return need, support, recv_of


def _placement(d, agg, send_w, recv_src, support, rows_of, readers):
    """The windows of a ⊕-sum whose sources are the output copies of every block of one
    table, each zero outside its block's rows (their rows tile the axis every call), and
    each received one read by it alone (its sender writes in place: no buffer of its own),
    else None."""
    if agg.op != "sum":
        return None
    ws = []
    for s in agg.srcs:
        key = recv_src.get((d, s))
        if key is not None and readers.get((d, s)) != 1:
            return None
        w = send_w.get(key) if key is not None else support.get((d, s), FULL)
        if w in (FULL, None) or len(w[2]) != 1 or len(w[2][0][0]) != 1 or \
                len(w[2][0][1]) != 1:
            return None
        ((r0, c0),), ((r1, c1),) = w[2][0]
        if r0 != r1 or (c0, c1) != (0, 1):
            return None
        ws.append(w)
    if len({w[:2] for w in ws}) != 1 or \
            sorted(w[2][0][0][0][0] for w in ws) != list(range(rows_of[ws[0][0]])):
        return None
    return ws


def _concat_placement(d, cat, need, send_w, recv_src, bufs, readers):
    """The windows of a concat whose readers need one window of it and whose received
    sources all come windowed, each read by it alone (not relayed on: its sender writes in
    place), each source a slab of it along that window's axis: the senders write their
    rows in place, the local sources theirs (the window), else None."""
    w = need.get((d, cat.dst))
    if w in (FULL, None) or not any((d, s) in recv_src for s in cat.srcs):
        return None
    axis = w[1]
    out = bufs[cat.dst].box
    ws = []
    for s in cat.srcs:
        b = bufs[s].box
        if any(i != len(b.lo) + axis and (b.lo[i], b.hi[i]) != (out.lo[i], out.hi[i])
               for i in range(len(b.lo))):
            return None
        key = recv_src.get((d, s))
        if key is not None and (key not in send_w or readers.get((d, s)) != 1):
            return None
        ws.append(send_w[key] if key is not None else w)
    return ws


def windows(dprog: DeviceProgram, cap) -> DeviceProgram:
    """``dprog`` (the capacity program ``cap``'s lowering) with its sends windowed, and each
    ⊕-sum of every block's output copies a placement (module docstring); unchanged where
    ``cap`` names no operand windows."""
    blocks = _windows_of(cap)
    if not blocks:
        return dprog
    need, support, recv_of = _analyse(dprog, blocks)
    prog = dprog.program
    send_w, recv_src = {}, {}
    for d, code in dprog.code.items():
        for ins in code:
            if ins.kind == "send":
                dst = recv_of.get((d, ins.peer, ins.tag))
                w = _intersect(need.get((ins.peer, dst), FULL),
                               support.get((d, ins.src), FULL))
                if w not in (FULL, None):
                    send_w[(d, ins.peer, ins.tag)] = w
            elif ins.kind == "recv":
                recv_src[(d, ins.dst)] = (ins.peer, d, ins.tag)
    rows_of = {cap.inputs[i]: n for i, _, n in cap.layout}
    readers: dict = {}
    for d, code in dprog.code.items():
        for ins in code:
            for a in ins.uses():
                readers[(d, a)] = readers.get((d, a), 0) + 1
    code, bufs = {}, {d: dict(b) for d, b in dprog.bufs.items()}
    names = prog.var_names()
    for d in dprog.devices:
        out, tables, last = [], {}, {}

        def window(w):
            k, axis, ((los, his), *more) = w
            name = tables.setdefault(k, f"win{k}")
            last[name] = len(out)
            return Window(axis, name, los, his, tuple(more))
        for ins in dprog.code.get(d, []):
            if ins.kind == "send" and (d, ins.peer, ins.tag) in send_w:
                ins = replace(ins, window=window(send_w[(d, ins.peer, ins.tag)]))
            elif ins.kind == "agg":
                ws = _placement(d, ins, send_w, recv_src, support, rows_of, readers)
                if ws is not None:
                    ins = replace(ins, windows=tuple(window(w) for w in ws))
            elif ins.kind == "concat":
                ws = _concat_placement(d, ins, need, send_w, recv_src, dprog.bufs[d],
                                       readers)
                if ws is not None:
                    ins = replace(ins, windows=tuple(window(w) for w in ws))
            out.append(ins)
        loads = []
        for k, name in tables.items():
            v = prog.inputs[k]
            box = Box.full(v.shape)
            bufs.setdefault(d, {})[name] = BufInfo(names[id(v)], box, v.dtype)
            loads.append(Load(name, ("in", k), box))
        for name, at in sorted(last.items(), key=lambda x: -x[1]):
            out.insert(at + 1, Free(name))
        code[d] = loads + out
    loads = None
    if dprog.loads is not None:
        loads = {d: list(ls) for d, ls in dprog.loads.items()}
        for d in dprog.devices:
            extra = [i for i in code[d] if i.kind == "load" and i.dst.startswith("win")]
            loads[d] = [(i.source, i.box) for i in extra] + loads.get(d, [])
    return replace(dprog, code=code, bufs=bufs, loads=loads)


def window_bytes(dprog: DeviceProgram, arrays) -> dict:
    """{(source, destination): bytes} the device program's sends move for one call
    (``arrays``: the program inputs, the call's tables among them): a windowed send its
    window's rows, any other its whole buffer. What the numpy executor counts, without
    running anything."""
    moved: dict = {}
    for d, code in dprog.code.items():
        info = dprog.bufs.get(d, {})
        for ins in code:
            if ins.kind != "send":
                continue
            b = info[ins.src]
            n = b.box.size
            if ins.window is not None:
                rows = b.box.shape[ins.window.axis]
                spans = ins.window.spans(b.box, arrays[_table_input(info, ins.window, code)])
                n = n // rows * sum(z - a for a, z in spans) if rows else 0
            moved[(d, ins.peer)] = moved.get((d, ins.peer), 0) + n * b.dtype.itemsize
    return moved


def _table_input(info, window, code) -> int:
    """The program input a window's table buffer was loaded from."""
    for ins in code:
        if ins.kind == "load" and ins.dst == window.table:
            return ins.source[1]
    raise KeyError(window.table)


def _rows_bytes(info, name, window, arrays, code) -> tuple[int, int]:
    """(bytes of buffer ``name``, bytes of its rows inside ``window`` this call)."""
    b = info[name]
    size = b.box.size * b.dtype.itemsize
    if window is None:
        return size, size
    spans = window.spans(b.box, arrays[_table_input(info, window, code)])
    rows = b.box.shape[window.axis]
    return size, (size // rows * sum(z - a for a, z in spans) if rows else 0)


def capacity_seconds(dprog: DeviceProgram, arrays, topology) -> float:
    """What the windowed capacity program runs beyond a per-cut program of the same call,
    whose transfers move the same bytes (:func:`window_bytes`), priced by the kernel model
    (eins.cost.predict.model_seconds, whose B_HALF floor is each launch's), the slowest
    device's seconds: per device, a masked copy launched over the whole buffer for each
    windowed send (the window's rows, plus zeros for the other rows where it does not land
    in a placement) and for each local source of a placement (its window read and
    written). The per-cut program's own local copies (its concats) are not priced by
    eins.cost.predict either, so charging the capacity's in full errs against it."""
    placed = placed_receives(dprog)
    worst = 0.0
    for d, code in dprog.code.items():
        info = dprog.bufs.get(d, {})
        recv = {i.dst for i in code if i.kind == "recv"}
        t = 0.0
        for ins in code:
            if ins.kind == "send" and ins.window is not None:
                size, moved = _rows_bytes(info, ins.src, ins.window, arrays, code)
                zeros = 0 if (d, ins.peer, ins.tag) in placed else size - moved
                t += model_seconds(0, zeros, topology.flops, topology.hbm_bw)
            elif ins.kind in ("agg", "concat") and ins.windows is not None:
                for s, w in zip(ins.srcs, ins.windows):
                    if s not in recv:   # a local source: its window copied in place
                        _, moved = _rows_bytes(info, s, w, arrays, code)
                        t += model_seconds(0, 2 * moved, topology.flops, topology.hbm_bw)
        worst = max(worst, t)
    return worst
