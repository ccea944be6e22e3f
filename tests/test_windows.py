"""The capacity program's windowed transfers (issue 36, eins/passes/windows.py): one fixed
device program whose sends move only the rows of each call's cut, so the bytes equal a
per-cut program's, and the interpret backend streams batches through one capture."""
from dataclasses import replace

import numpy as np
import pytest

import eins
from eins.errors import EinsError
from eins.ir.joinagg import FunctionSpec
from eins.ir.types import Box
from eins.kernels.attention import segment_rows
from eins.models import llama
from eins.passes import PHYSICAL, run_passes
from eins.passes.capacity import capacity
from eins.passes.rebalance import recut, runtime_operands
from eins.passes.verify import verify_device
from eins.passes.windows import window_bytes, windows
from eins.runtime.numpy_backend import execute
from helpers import stream_stats

S, H, HKV, D = 24, 4, 2, 8
# every eqn split into 4 by the sequence: the scalings at equal tokens, the attention re-cut
PLAN = {0: {"d1": 4}, 1: {"d1": 4}, 2: {"d1": 4}, 3: {"sequence": 4}, 4: {"d1": 4}}
BATCHES = [(5, 11, 24), (24,), (1, 2, 3, 20, 24), (12, 24), (23, 24), (4, 8, 12, 16, 24)]


def f(q, k, v, e):
    return eins.attention(q * 2.0, k * 2.0, v * 2.0, segments=e) * 2.0


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((H, S, D)), rng.standard_normal((HKV, S, D)),
            rng.standard_normal((HKV, S, D)))


def family():
    q, k, v = qkv()
    low = eins.distribute(f, devices=4, plan=PLAN).lower(q, k, v,
                                                          llama.padded_ends(BATCHES[0], 6, S))
    ops = runtime_operands(low.program)
    cap = capacity(low.compilation, ops)
    return low, ops, cap, run_passes(cap.comp, PHYSICAL).device


def overlap(a, b):
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def test_windowed_bytes_are_the_cuts():
    """Bytes moved per call, by hand: device j receives q's rows [lo_j, hi_j) and k's and
    v's keys [klo_j, hi_j) from the three devices holding them (equal 6-row pieces), and
    sends its output rows to the device holding each piece: H*D (q, out) or HKV*D (k, v)
    float64 per row. The fixed program moves exactly that for every cut, and as many bytes
    as a program lowered for that cut alone, where the capacity form without windows moves
    every block whole."""
    low, ops, cap, full = family()
    dprog = windows(full, cap)
    verify_device(dprog)
    q, k, v = qkv()
    pieces = [(6 * i, 6 * i + 6) for i in range(4)]
    seen = set()
    for ends in BATCHES:
        e = llama.padded_ends(ends, 6, S)
        cut = recut(low.compilation, [q, k, v, e], ops)
        tables = cap.tables(cut)
        want = 0
        for j, (lo, hi, klo, khi) in enumerate(tables[0].tolist()):
            for i, piece in enumerate(pieces):
                if i != j:
                    rows = overlap((lo, hi), piece)
                    want += 8 * (2 * H * D * rows + 2 * HKV * D * overlap((klo, khi), piece))
        seen.add(tuple(map(tuple, tables[0].tolist())))
        (got,), st = execute(dprog, [q, k, v, e] + tables)
        np.testing.assert_allclose(got, eins.jit(f)(q, k, v, e), rtol=1e-12, atol=1e-12)
        assert st.total_bytes == want == sum(window_bytes(dprog, [q, k, v, e] + tables).values())
        _, per = execute(run_passes(cut, PHYSICAL).device, [q, k, v, e])
        # the same bytes between every two devices (an empty window's send moves none)
        assert {p: n for p, n in st.bytes_moved.items() if n} == per.bytes_moved
        _, unwindowed = execute(full, [q, k, v, e] + tables)
        # without windows: every other device's 6-row piece of q, k, v in, of the output out
        assert unwindowed.total_bytes == 4 * 3 * 6 * 8 * (2 * H * D + 2 * HKV * D)
    assert len(seen) == len(BATCHES)   # the cuts moved; the program did not


def test_every_capacity_send_is_windowed():
    """Every send of q, k, v into a capacity block and of its output is windowed, each
    device loads the whole table once, and the text shows the window."""
    _, _, cap, full = family()
    dprog = windows(full, cap)
    sends = [i for c in dprog.code.values() for i in c if i.kind == "send"]
    assert len(sends) == len([i for c in full.code.values() for i in c if i.kind == "send"])
    assert sends and all(i.window is not None for i in sends)
    for d, code in dprog.code.items():
        assert code[0].kind == "load" and code[0].source == ("in", 4)
        assert sum(1 for i in code if i.kind == "load" and i.source == ("in", 4)
                   and i.box.shape == (4, 4)) == 1
    text = dprog.as_text()
    assert "window axis -2 in [max(win4[" in text
    # each device's q, k and v land in place (the senders' rows and its own), and its
    # output block is placed from the four blocks' rows, not summed
    assert text.count("] placed ") == 4 * 3 and text.count("agg[sum: placed by win4]") == 4
    assert "agg[sum] " not in text


def test_a_cut_outside_the_capacity_is_named():
    """A cut giving a block rows past the capacity (the whole sequence) is refused, naming
    the block and its cut, rather than moving rows no buffer holds."""
    low, ops, cap, _ = family()
    q, k, v = qkv()
    cut = recut(low.compilation, [q, k, v, llama.padded_ends((24,), 6, S)], ops)
    ep = cut.plan.eqn_plans[3]
    fs = list(ep.spec.fspecs)
    out = fs[1].outputs[0]
    fs[1] = FunctionSpec(fs[1].inputs, (Box(out.lo, out.hi[:-2] + (S + 6,) + out.hi[-1:]),))
    plans = list(cut.plan.eqn_plans)
    plans[3] = replace(ep, spec=replace(ep.spec, fspecs=tuple(fs)))
    cut = replace(cut, plan=replace(cut.plan, eqn_plans=tuple(plans)))
    with pytest.raises(EinsError, match=r"block 1's cut \[\d+, 30, .*capacity \[0, 24\)"):
        cap.tables(cut)


def test_interpret_stream_of_windowed_batches():
    """Through the interpret backend (the generated GPU program, Triton's interpreter): 30
    new batches after the first build no trace, kernel or graph; the sends into and out of
    the attention are the masked window copies; each result equals eins.jit."""
    pytest.importorskip("triton")
    rng = np.random.default_rng(7)
    q, k, v = (a.astype(np.float32) for a in qkv(7))
    d = eins.distribute(f, devices=4, plan=PLAN, backend="interpret", rebalance=True)
    ref = eins.jit(f)
    first = None
    for n in range(1, 31):
        cuts = np.sort(rng.choice(np.arange(1, S), size=rng.integers(0, 5), replace=False))
        e = llama.padded_ends(tuple(int(c) for c in cuts) + (S,), 6, S)
        np.testing.assert_allclose(d(q, k, v, e), ref(q, k, v, e), rtol=2e-5, atol=2e-5)
        st, first = stream_stats(d, first, n)
        assert st["graph_captures"] == 1 and st["lowerings"] == 1
    assert d.last.capacity is not None
    dprog = d.last.device_program
    assert sum(1 for c in dprog.code.values() for i in c
               if i.kind == "send" and i.window is not None) == 4 * 3 * 4
    # a batch with non-finite values, then a finite one: the capacity buffers' stale rows
    # (a call writes only its windows; here nan and inf left in every device's v buffer,
    # outside the next call's key windows: (9, 24) puts keys [0, 9) outside three devices')
    # never reach a result
    bad = v.copy()
    bad[:, 3:9] = np.nan
    bad[:, 15] = np.inf
    for ends in [(9, 24), (2, 5, 24), (20, 24), (12, 16, 24)]:
        d(q, k, bad, llama.padded_ends((24,), 6, S))
        e = llama.padded_ends(ends, 6, S)
        np.testing.assert_allclose(d(q, k, v, e), ref(q, k, v, e), rtol=2e-5, atol=2e-5)
    assert d.stats()["graph_captures"] == 1


def test_causal_row_ranges_stop_at_the_calls_rows():
    """With causal attention the rows after a capacity block's last give their empty key
    range at its end, so the kernel's key bound for a block stops there (the keys past it
    are another call's, stale) rather than at the end of that row's document."""
    torch = pytest.importorskip("torch")
    e = torch.tensor(llama.padded_ends((5, 20, 24), 6, S))
    r = torch.tensor([[7, 12]])
    lo, hi = segment_rows(e, 0, S, e.device, r, causal=True)
    assert lo[7:12].tolist() == [5] * 5 and hi[7:12].tolist() == [20] * 5
    assert lo[12:].tolist() == hi[12:].tolist() == [12] * 12
    assert lo[:7].tolist() == hi[:7].tolist() == [5] * 7
    _, hi_all = segment_rows(e, 0, S, e.device, r)
    assert hi_all[12:].tolist() == [20] * 12   # without causal: the document's end
