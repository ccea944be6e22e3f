"""The capacity program's windows under the optimized schedule (issue 36,
eins/passes/windows.py): synthesis relays a block through a device whose own block reads
other rows of it (8 GPUs of dgx-v100-paper, where some pairs have no NVLink), so a relayed
buffer is needed under several windows; its send moves the union of their rows, each later
hop only its receiver's, and the bytes are exactly what the program's own routes read.

A reference for that, independent of the pass: the same rows computed as concrete sets of
positions from the call's table (:func:`route_rows`), not as symbolic windows."""
import numpy as np
import pytest

import eins
from eins.ir.device import Window
from eins.ir.types import Box
from eins.kernels.window import window_copy
from eins.models import llama
from eins.passes import PHYSICAL, run_passes
from eins.passes.capacity import capacity
from eins.passes.rebalance import recut, runtime_operands
from eins.passes.windows import window_bytes, windows
from eins.runtime.numpy_backend import execute
from helpers import SPREAD, input_arrays, packed_call, stream_stats

S, H, HKV, D, P = 24, 4, 2, 8, 8
TOPOLOGY = "dgx-v100-paper"
# the scalings at equal tokens (3 rows a device), the attention re-cut by query sequence
PLAN = {0: {"d1": P}, 1: {"d1": P}, 2: {"d1": P}, 3: {"sequence": P}, 4: {"d1": P}}
BATCHES = [(5, 11, 24), (24,), (1, 2, 3, 20, 24), (12, 24), (6, 8, 14, 19, 24),
           (4, 8, 12, 16, 24)]
ALL = None   # every row


def f(q, k, v, e):
    return eins.attention(q * 2.0, k * 2.0, v * 2.0, segments=e) * 2.0


def qkv(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype)
                 for s in ((H, S, D), (HKV, S, D), (HKV, S, D)))


def family():
    q, k, v = qkv()
    low = eins.distribute(f, devices=P, plan=PLAN, schedule="optimized",
                          topology=TOPOLOGY).lower(q, k, v, llama.padded_ends(BATCHES[0], 6, S))
    ops = runtime_operands(low.program)
    cap = capacity(low.compilation, ops)
    return low, ops, cap, windows(run_passes(cap.comp, PHYSICAL).device, cap)


def _join(a, b):
    return ALL if a is ALL or b is ALL else a | b


def _meet(a, b):
    return b if a is ALL else a if b is ALL else a & b


def route_rows(dprog, cap, arrays, relays=True):
    """({(device, buffer): sequence positions its readers read}, {(device, buffer):
    positions that may be nonzero}) for one call, as sets (ALL: every row): a capacity
    block reads its rows of q and its keys of k and v from its table row and writes its
    rows; a slice, concat, ⊕ or send asks its sources for what its destination is asked;
    anything else reads everything. ``relays=False``: sends ask nothing (the rows a
    device's own blocks read)."""
    recv_of = {(i.peer, d, i.tag): i.dst for d, c in dprog.code.items() for i in c
               if i.kind == "recv"}
    send_of = {(d, i.peer, i.tag): i.src for d, c in dprog.code.items() for i in c
               if i.kind == "send"}

    def block(ins):
        if ins.kind != "kernel" or ins.eqn not in cap.reads:
            return None
        t = arrays[cap.inputs[ins.eqn]][ins.fspec.inputs[-1].lo[0]]
        reads = {n: set(range(t[2 * pair], t[2 * pair + 1]))
                 for n, (pair, _) in cap.reads[ins.eqn].items()}
        return reads, set(range(t[0], t[1]))

    def fixed_point(step):
        got = None
        while True:
            new = {}
            step(got or {}, new)
            if new == got:
                return got
            got = new

    def ask(need, new):
        for d, code in dprog.code.items():
            for ins in code:
                if ins.kind in ("slice", "concat", "agg"):
                    srcs = (ins.src,) if ins.kind == "slice" else ins.srcs
                    asks = [(s, need.get((d, ins.dst), set())) for s in srcs]
                elif ins.kind == "send":
                    dst = (ins.peer, recv_of[(d, ins.peer, ins.tag)])
                    asks = [(ins.src, need.get(dst, set()) if relays else set())]
                elif ins.kind == "kernel":
                    b = block(ins)
                    asks = [(a, b[0].get(n, ALL) if b else ALL)
                            for n, a in enumerate(ins.ins) if isinstance(a, str)]
                else:
                    asks = [(a, ALL) for a in ins.uses()]
                for a, rows in asks:
                    new[(d, a)] = _join(new.get((d, a), set()), rows)
    need = fixed_point(ask)
    full = need if relays else route_rows(dprog, cap, arrays)[0]

    def hold(sup, new):
        for d, code in dprog.code.items():
            for ins in code:
                if ins.kind == "kernel":
                    b = block(ins)
                    for n, o in enumerate(ins.outs):
                        new[(d, o)] = b[1] if b and n == 0 else ALL
                elif ins.kind == "slice":
                    new[(d, ins.dst)] = sup.get((d, ins.src), ALL)
                elif ins.kind == "concat" or (ins.kind == "agg" and ins.op == "sum"):
                    rows = set()
                    for s in ins.srcs:
                        rows = _join(rows, sup.get((d, s), ALL))
                    new[(d, ins.dst)] = rows
                elif ins.kind == "recv":
                    src = sup.get((ins.peer, send_of[(ins.peer, d, ins.tag)]), ALL)
                    new[(d, ins.dst)] = _meet(full.get((d, ins.dst), ALL), src)
                else:
                    for b in ins.defs():
                        new[(d, b)] = ALL
    return need, fixed_point(hold)


def _bytes(info, rows):
    """Bytes of buffer ``info``'s sequence positions in ``rows`` (its axis -2)."""
    box = info.box
    mine = set(range(box.lo[-2], box.hi[-2]))
    return len(_meet(mine, rows)) * box.size // box.shape[-2] * info.dtype.itemsize


def route_bytes(dprog, cap, arrays) -> dict:
    """{(source, destination): bytes}: each send the positions its receiver is asked for
    and its source may hold nonzero."""
    need, sup = route_rows(dprog, cap, arrays)
    recv_of = {(i.peer, d, i.tag): i.dst for d, c in dprog.code.items() for i in c
               if i.kind == "recv"}
    out = {}
    for d, code in dprog.code.items():
        for ins in code:
            if ins.kind == "send":
                rows = _meet(need.get((ins.peer, recv_of[(d, ins.peer, ins.tag)]), ALL),
                             sup.get((d, ins.src), ALL))
                n = _bytes(dprog.bufs[d][ins.src], rows)
                if n:
                    out[(d, ins.peer)] = out.get((d, ins.peer), 0) + n
    return out


def direct_bytes(dprog, cap, arrays) -> int:
    """Bytes if every device got the positions its own blocks read straight from the
    block's holder: per received buffer, its own readers' rows that may be nonzero."""
    own, _ = route_rows(dprog, cap, arrays, relays=False)
    _, sup = route_rows(dprog, cap, arrays)
    return sum(_bytes(dprog.bufs[d][i.dst], _meet(own.get((d, i.dst), set()),
                                                   sup.get((d, i.dst), ALL)))
               for d, c in dprog.code.items() for i in c if i.kind == "recv")


def hops(dprog) -> int:
    """The most sends any block crosses: a received buffer sent on is one more."""
    recv_of = {(i.peer, d, i.tag): i.dst for d, c in dprog.code.items() for i in c
               if i.kind == "recv"}
    depth: dict = {}
    for _ in range(P):
        for d, code in dprog.code.items():
            for i in code:
                if i.kind == "send":
                    dst = (i.peer, recv_of[(d, i.peer, i.tag)])
                    depth[dst] = max(depth.get(dst, 0), depth.get((d, i.src), 0) + 1)
    return max(depth.values())


def test_a_window_is_a_union_of_intervals():
    """By hand: the intervals of a window of three, one empty, two overlapping, merged;
    clipped to a buffer's box; and its text."""
    w = Window(-2, "win4", ((0, 0),), ((0, 1),), ((((1, 0),), ((1, 1),)),
                                                  (((2, 0), (0, 0)), ((2, 1),))))
    table = np.array([[3, 7], [12, 15], [5, 9]])
    # [3, 7) | [12, 15) | [max(5, 3), 9) = [5, 9): [3, 9) and [12, 15)
    assert w.intervals(table) == [(3, 9), (12, 15)]
    assert w.spans(Box((0, 6, 0), (2, 13, 4)), table) == [(0, 3), (6, 7)]
    assert w.spans(Box((0, 9, 0), (2, 12, 4)), table) == []
    assert Window(0, "t", ((0, 1),), ((0, 0),)).intervals(table) == []   # [7, 3): empty
    assert w.text() == ("axis -2 in [max(win4[0,0]), min(win4[0,1])) | [max(win4[1,0]), "
                        "min(win4[1,1])) | [max(win4[2,0],win4[0,0]), min(win4[2,1]))")


def test_a_window_side_of_three_cells_is_named_by_the_gpu_copy():
    """The GPU copy kernel reads a side's first and last table cell (the windows pass
    intersects at most two per side); a window with three is named, not copied wrongly."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    w = Window(0, "t", ((0, 0), (1, 0), (2, 0)), ((0, 1),))
    src = torch.zeros((4, 2))
    with pytest.raises(eins.EinsError, match="window side of 3 and 1 table cells"):
        window_copy(src, torch.zeros((4, 2)), torch.zeros((3, 2), dtype=torch.int64),
                    w, Box((0, 0), (4, 2)), interpret=True)


def test_relayed_sends_move_the_rows_their_route_reads():
    """Under the optimized schedule on dgx-v100-paper the capacity program relays q, k and v
    blocks (a device forwards what it received) and its sends into relays carry windows of
    several intervals. Per batch the result equals eins.jit, and the bytes between every
    two devices are exactly the rows the receiver's blocks and those it forwards to read
    (route_bytes): the relayed sends moved their whole buffer before. Each row crosses at
    most the routes' two hops, so the bytes are at most twice those of sending every
    device's rows straight from their holder (1.0-1.32x over 40 random batches). A program
    per cut, synthesized for the cut's own blocks, routes and places them otherwise, so no
    fixed program matches its bytes per pair (docs/stages.md)."""
    low, ops, cap, dprog = family()
    relayed = {(d, i.src) for d, c in dprog.code.items() for i in c if i.kind == "send"
               and i.src in {r.dst for r in c if r.kind == "recv"}}
    assert relayed and hops(dprog) == 2
    unions = [i for c in dprog.code.values() for i in c if i.kind == "send"
              and i.window is not None and i.window.more]
    assert unions
    q, k, v = qkv()
    for ends in BATCHES:
        e = llama.padded_ends(ends, 6, S)
        cut = recut(low.compilation, [q, k, v, e], ops)
        arrays = [q, k, v, e] + cap.tables(cut)
        (got,), st = execute(dprog, arrays)
        np.testing.assert_allclose(got, eins.jit(f)(q, k, v, e), rtol=1e-12, atol=1e-12)
        moved = {p: n for p, n in st.bytes_moved.items() if n}
        assert moved == {p: n for p, n in window_bytes(dprog, arrays).items() if n}
        assert moved == route_bytes(dprog, cap, arrays)
        # a row crosses at most two hops; a relay's own rows and its receivers' rows it
        # forwards are counted once each
        assert sum(moved.values()) <= 2 * direct_bytes(dprog, cap, arrays)


def test_interpret_stream_through_relays():
    """The generated GPU program (Triton's interpreter) under the optimized schedule: the
    sends into relays are copy kernels of several intervals; each batch equals eins.jit, no
    kernel is compiled nor graph captured after the first, and the bytes of the last call's
    windows are the rows its routes read."""
    pytest.importorskip("triton")
    q, k, v = qkv(7, np.float32)
    d = eins.distribute(f, devices=P, plan=PLAN, backend="interpret", rebalance=True,
                        schedule="optimized", topology=TOPOLOGY)
    ref = eins.jit(f)
    first = None
    for n, ends in enumerate(BATCHES[:5], 1):
        e = llama.padded_ends(ends, 6, S)
        np.testing.assert_allclose(d(q, k, v, e), ref(q, k, v, e), rtol=2e-5, atol=2e-5)
        st, first = stream_stats(d, first, n)
        assert st["graph_captures"] == 1 and st["lowerings"] == 1
    dprog, cap = d.last.device_program, d.last.capacity
    assert any(i.window is not None and i.window.more
               for c in dprog.code.values() for i in c if i.kind == "send")
    low = d.lower(q, k, v, e)
    arrays = [q, k, v, e] + cap.tables(recut(low.compilation, [q, k, v, e],
                                             runtime_operands(low.program)))
    assert {p: n for p, n in window_bytes(dprog, arrays).items() if n} == \
        route_bytes(dprog, cap, arrays)


def test_the_tiny_block_relays_its_rope_outputs_windowed():
    """The TINY LLaMA block at p=8 on dgx-v100-paper, attention split by query sequence:
    synthesis relays the rope outputs (q, k) and v into the attention's capacity blocks;
    each call's bytes per device pair are the rows its routes read, and the result equals
    eins.jit on the batch's static ends."""
    cfg, s = llama.TINY, 32
    rng = np.random.default_rng(0)
    w = llama.init_weights(cfg, rng, "float32")
    x = (rng.standard_normal((s, cfg.d_model)) / 2).astype(np.float32)
    low = eins.distribute(llama.packed_block_fn(cfg), devices=P, topology=TOPOLOGY,
                          tuning=SPREAD, schedule="optimized").lower(
        *packed_call(cfg, s, x, w, (10, 20, 32)))
    ops = runtime_operands(low.program)
    cap = capacity(low.compilation, ops)
    dprog = windows(run_passes(cap.comp, PHYSICAL).device, cap)
    assert hops(dprog) == 2 and any(i.window is not None and i.window.more
                                    for c in dprog.code.values() for i in c if i.kind == "send")
    for ends in [(10, 20, 32), (32,), (3, 7, 30, 32)]:
        args = packed_call(cfg, s, x, w, ends)
        arrays = input_arrays(*args)
        arrays += cap.tables(recut(low.compilation, arrays, ops))
        (got,), st = execute(dprog, arrays)
        np.testing.assert_allclose(got, eins.jit(llama.block_fn(cfg, ends))(*args[:4]),
                                   rtol=1e-4, atol=1e-4)
        moved = {p: n for p, n in st.bytes_moved.items() if n}
        assert moved == route_bytes(dprog, cap, arrays)
        assert sum(moved.values()) <= 2 * direct_bytes(dprog, cap, arrays)
