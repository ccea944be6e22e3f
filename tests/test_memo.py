"""Process-wide memo tables and the per-call scope of a compiled program's re-cut (issue 36,
eins/ir/memo.py, eins.passes.per_call): a call's entries are its own, the tables and the
collector as they were after it, and a call leaves no cyclic garbage."""
import gc

import numpy as np
import pytest

import eins
import eins.passes.families as families_mod
import eins.rebalanced as rebalanced_mod
from eins.cost.predict import predict
from eins.ir.memo import Memo, call_scope, sizes
from eins.models import llama
from eins.passes import per_call
from eins.passes.families import FamilySet
from eins.passes.rebalance import recut_key, runtime_operands
from eins.passes.relower import relower
from eins.tracing import ShapeDtype
from helpers import packed_call

# tests/test_block_family.py's block, whose mixed batches take whole-block cuts, each a new
# program (prepared, not run)
CFG = llama.LlamaConfig(d_model=256, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=4096)
S, P, MAX = 4096, 4, 16
STREAM = [(3072, S), (512, 2048, S), (1365, 2048, 3996, S), (700, 1500, 2900, S),
          (100, 1000, 2500, 3000, S), (1800, 2100, S)]


def test_a_weighed_memo_keeps_at_most_its_room():
    """With ``weight`` and ``room`` (the operand boxes': a list's length, 2^18 in all): with
    room 40, lists of 16 and 32 cannot both stay (the older goes), one of 64 is not kept."""
    m = Memo("test weighed", 10, weight=len, room=40)
    m.put("a", [0] * 16)
    assert m.get("a") is not None and m.held == 16
    m.put("b", [0] * 32)
    m.put("c", [0] * 64)
    assert (m.get("a"), m.get("c"), len(m.get("b")), m.held) == (None, None, 32, 32)
    m.put("b", [0] * 8)   # replaced: its old weight is given back
    m.put("a", [0] * 16)
    assert (len(m), m.held) == (2, 24)
    m.clear()
    assert m.held == 0
    with pytest.raises(ValueError, match="weight and room go together"):
        Memo("test a weight alone", 8, weight=len)


def test_a_memo_keeps_entries_process_wide_least_recently_used_last():
    m = Memo("test lru", 2)
    assert m.put("a", 1) == 1 and m.get("a") == 1 and m.get("b") is None
    m.put("b", 2)
    m.get("a")                 # "b" is now the least recently used
    m.put("c", 3)
    assert (m.get("a"), m.get("b"), m.get("c"), len(m)) == (1, None, 3, 2)
    m.clear()
    assert len(m) == 0 and m.get("a") is None


def test_a_calls_entries_are_its_own_and_dropped_with_it():
    m = Memo("test call", 4)
    m.put("before", 0)
    with call_scope():
        assert m.get("before") == 0          # made before the call: read as ever
        assert m.put("mine", 1) == 1 and m.get("mine") == 1
        with call_scope():                   # nested: the outermost call's
            assert m.get("mine") == 1
            m.put("inner", 2)
        assert m.get("inner") == 2
        assert len(m) == 1                   # nothing of the call's in the table
    assert (m.get("mine"), m.get("inner"), len(m)) == (None, None, 1)
    with call_scope():                       # a later call starts with nothing of it
        assert m.get("mine") is None


def test_a_memo_limit_below_one_or_a_name_taken_is_refused():
    with pytest.raises(ValueError, match=r"^Memo 'x': limit must be >= 1, got 0$"):
        Memo("x", 0)
    with pytest.raises(ValueError, match=r"^Memo 'overlays' exists already$"):
        Memo("overlays", 8)


def test_per_call_pauses_the_collector_and_restores_it():
    assert gc.isenabled()
    with per_call():
        assert not gc.isenabled()
        with per_call():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:   # a caller that had it off keeps it off
        with per_call():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_calls_recut_leaves_the_process_memos_and_the_collector_as_they_were(
        monkeypatch):
    """A stream of new cuts through a program with families: each call chooses, re-cuts
    and re-lowers (boxes, overlays and, priced, simulations of cuts no later call asks
    for) with the collector off, and leaves the process-wide tables as the first call did."""
    seen = []

    def probe(fn):
        def wrapped(*a, **k):
            seen.append(gc.isenabled())
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(families_mod, "estimates", probe(families_mod.estimates))
    monkeypatch.setattr(rebalanced_mod, "relower_device", probe(rebalanced_mod.relower_device))
    x, w, cs, sn = llama.Workload("packed", 1, S).args(CFG)
    shapes = (x, w, cs, sn, ShapeDtype((MAX,), "int32"))
    c = eins.distribute(llama.packed_block_fn(CFG), devices=P,
                        topology="dgx-h100:4").lower(*shapes).compile(families=True)
    kept = None
    for ends in STREAM:
        c.prepare(*shapes[:4], llama.padded_ends(ends, MAX, S))
        c.predicted_time()
        assert gc.isenabled()
        if kept is None:
            kept = sizes()
    assert sizes() == kept and set(kept) >= {"overlays", "operand boxes", "simulations"}
    lowered = [ch for ch in c.choices if ch.lowered]
    assert len(lowered) == len(STREAM) and {ch.family for ch in lowered} == {"dp", "block"}
    assert seen == [False] * (2 * len(STREAM))   # every estimate and relowering paused


def test_a_recut_and_its_relowering_called_alone_keep_their_entries_to_themselves():
    """The block family's whole-block re-cut (eins.passes.blockcut.recut_pairs) and a
    re-cut's relowering (eins.passes.relower.relower), as a benchmark calls them outside a
    compiled program's call, each a call of its own."""
    x, w, cs, sn = llama.Workload("packed", 1, S).args(CFG)
    shapes = (x, w, cs, sn, ShapeDtype((MAX,), "int32"))
    low = eins.distribute(llama.packed_block_fn(CFG), devices=P,
                          topology="dgx-h100:4").lower(*shapes)
    ops = runtime_operands(low.program)
    block = next(m for m in FamilySet(low.compilation, ops, block=True).members
                 if m.name == "block")
    (_, k), = ops.values()
    kept, cuts = None, set()
    for ends in STREAM:
        arrays = [None] * len(low.program.inputs)
        arrays[k] = llama.padded_ends(ends, MAX, S)
        cut = block.choice.recut(arrays, ops)
        predict(relower(block.first, cut, block.eqns))
        cuts.add(recut_key(cut, block.eqns, ops))
        kept = kept or sizes()
    assert sizes() == kept and len(cuts) == len(STREAM)   # every batch a new cut


def test_calls_of_a_packed_program_leave_no_cyclic_garbage():
    """A call (argument checks, the family choice, the re-cut's program, the run, the result
    tree) frees all it allocates by reference counting: with the collector off, a stream of
    calls leaves nothing for it to find (a recursive nested function, say, holds itself)."""
    cfg = llama.LlamaConfig(d_model=16, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=24)
    s = 256
    rng = np.random.default_rng(3)
    w = llama.init_weights(cfg, rng)
    x = (rng.standard_normal((s, cfg.d_model)) / 2).astype(np.float32)
    d = eins.distribute(llama.packed_block_fn(cfg), devices=P, topology="dgx-h100:4",
                        families=True)
    calls = [packed_call(cfg, s, x, w, e) for e in [(256,), (40, 256), (13, 100, 101, 256),
                                                   (64, 128, 192, 256), (5, 250, 256)]]
    d(*calls[0])   # compiled
    gc.collect()
    gc.disable()
    try:
        for args in calls[1:]:
            got = d(*args)
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0
    want = eins.jit(llama.block_fn(cfg, (5, 250, 256)))(*calls[-1][:4])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
