"""Packed batches (issue 36: segment ends as an int array, re-cut per call) combined with
the other features users turn on: outputs kept on the devices and fed back (donated),
the optimized schedule, plan families, rebalance=False, other ends signatures, the per-cut
cache and its counters. Every batch equals eins.jit on that batch's static ends."""
import numpy as np
import pytest

import eins
from eins.cost.predict import predict
from eins.models import llama
from eins.passes import PHYSICAL, run_passes
from eins.rebalanced import FamilyRun
from helpers import SPREAD, packed_call

# the block of tests/test_families.py: its 4 kv heads wide enough that the family choice
# goes both ways over a stream
WIDE = llama.LlamaConfig(d_model=16, n_heads=4, n_kv_heads=4, head_dim=256, d_ff=24)


def wide_weights(s, seed=3):
    rng = np.random.default_rng(seed)
    w = llama.init_weights(WIDE, rng)
    return (rng.standard_normal((s, WIDE.d_model)) / 2).astype(np.float32), w


def test_optimized_families_estimate_and_predict_the_program_that_runs():
    """Under the optimized schedule a call runs its cut lowered whole (synthesized), so a
    family's estimates start from such a lowering and predicted_time() prices it: for a
    batch whose documents end at the equal family's cuts (its reference, so no re-cut
    cost) the estimate, predicted_time() and a from-scratch lowering's prediction agree.
    Both used the naive schedule's lowering before (0.210 ms against 0.163 ms here)."""
    s, p = 256, 8
    x, w = wide_weights(s)
    d = eins.distribute(llama.packed_block_fn(WIDE), devices=p, topology="dgx-v100-paper",
                        tuning=SPREAD, families=True, backend="numpy", schedule="optimized",
                        synthesis_steps=8)
    aligned = tuple(range(s // p, s + 1, s // p))
    for ends in [(s,), aligned]:
        args = packed_call(WIDE, s, x, w, ends)
        np.testing.assert_allclose(d(*args), eins.jit(llama.block_fn(WIDE, ends))(*args[:4]),
                                   rtol=1e-5, atol=1e-5)
        whole = predict(run_passes(d.last.last_cut, PHYSICAL))["total_ms"]
        assert d.last.predicted_time()["total_ms"] == pytest.approx(whole, rel=1e-12)
    choice = d.last.choice
    assert choice.family == "equal"
    assert choice.estimated_ms == pytest.approx(whole, rel=1e-12)


def interpret_qkv(s=32, seed=2):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, s, 16)).astype(np.float32),
            rng.standard_normal((2, s, 16)).astype(np.float32),
            rng.standard_normal((2, s, 16)).astype(np.float32))


def test_graph_captures_count_the_evicted_cuts_too(monkeypatch):
    """A key-sequence split (no capacity form) with rebalance=True captures a program per
    new cut on a GPU backend; once more cuts than RECUT_CACHE were seen the oldest is
    dropped, and its captures still count (the counter fell back to the kept programs'
    before). A kept two: the fifth batch repeats the first, evicted by then."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    monkeypatch.setattr(FamilyRun, "RECUT_CACHE", 2)
    q, k, v = interpret_qkv()
    f = lambda q, k, v, e: eins.attention(q, k, v, segments=e)  # noqa: E731
    d = eins.distribute(f, devices=4, plan={0: {"kv_sequence": 4}}, backend="interpret",
                        graphs=True, rebalance=True)
    stream = [(5, 11, 32), (32,), (1, 2, 3, 20, 32), (16, 32), (5, 11, 32)]
    for n, ends in enumerate(stream, 1):
        e = llama.padded_ends(ends, 6, 32)
        np.testing.assert_allclose(d(q, k, v, e), eins.jit(f)(q, k, v, e), rtol=2e-5,
                                   atol=2e-5)
        st = d.stats()
        # every batch's cut is new to the kept two: lowered and captured once each
        assert (st["lowerings"], st["graph_captures"], st["rebalances"]) == (n + 1, n, n)
