"""Packed batches (issue 36: segment ends as an int array, re-cut per call) combined with
the other features users turn on: outputs kept on the devices and fed back (donated),
the optimized schedule, plan families, rebalance=False, other ends signatures, the per-cut
cache and its counters. Every batch equals eins.jit on that batch's static ends."""
import numpy as np
import pytest

import eins
from eins.cost.predict import predict
from eins.errors import EinsError
from eins.models import llama
from eins.passes import PHYSICAL, run_passes
from eins.passes.rebalance import recut, recut_key, runtime_operands
from eins.passes.windows import window_bytes
from eins.rebalanced import FamilyRun
from eins.runtime.numpy_backend import execute
from eins.runtime.sharded import Sharded
from helpers import SPREAD, assert_close, input_arrays, packed_call

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


TINY_S = 32
# each batch's documents end elsewhere; the fifth repeats the second's ends
TINY_STREAM = [(TINY_S,), (10, 20, TINY_S), (3, 5, 17, TINY_S), (16, TINY_S),
               (10, 20, TINY_S), (1, 2, 3, 4, 5, TINY_S)]


def tiny_weights(seed=5):
    rng = np.random.default_rng(seed)
    w = llama.init_weights(llama.TINY, rng)
    return (rng.standard_normal((TINY_S, llama.TINY.d_model)) / 2).astype(np.float32), w


def program_cut(d, arrays):
    """The re-cut Compilation the last call of ``d`` ran: its family's (families=True), or
    the one plan's re-cut for the ends among ``arrays`` (its program inputs)."""
    if d.last.last_cut is not None:
        return d.last.last_cut
    low = d.last.lowered
    return recut(low.compilation, arrays, runtime_operands(low.program))


@pytest.mark.parametrize("schedule,families,rebalance", [
    ("naive", False, None), ("naive", True, None), ("optimized", False, None),
    ("optimized", True, None), ("naive", False, False)])
def test_numpy_resident_donated_loop(schedule, families, rebalance):
    """A training-style loop on numpy: the packed block's output kept on the devices and
    donated as the next batch's input, the ends elsewhere every batch, attention split by
    query sequence and re-cut each call. Each step equals eins.jit chained on the host;
    after the first the input is found on the devices (no host bytes); the donated state
    is released; the device transfers are those of the batch's cut lowered from scratch
    (run on the same inputs); nothing traced or planned after the first call. With
    rebalance=False: the compile-time cuts' one program for every batch."""
    cfg, p = llama.TINY, 4
    x, w = tiny_weights()
    d = eins.distribute(llama.packed_block_fn(cfg), devices=p, backend="numpy",
                        tuning=SPREAD, outputs="devices", donate_argnums=0,
                        schedule=schedule, families=families, rebalance=rebalance)
    want = x
    for n, ends in enumerate(TINY_STREAM, 1):
        args = packed_call(cfg, TINY_S, x, w, ends)
        host = input_arrays(np.asarray(x), *args[1:])   # before the call donates x
        y = d(*args)
        want = eins.jit(llama.block_fn(cfg, ends))(want, *args[1:4])
        assert isinstance(y, Sharded) and y.where == "numpy"
        assert_close(np.asarray(y), want, n=64, depth=4 * n)
        if n > 1:
            assert x.donated
            with pytest.raises(EinsError, match="donated"):
                np.asarray(x)
        st = d.stats()
        assert (st["traces"], st["plans"]) == (1, 1 + families)
        assert (st["h2d_inputs"].get(0, 0) > 0) == (n == 1)
        if rebalance is False:
            assert (st["rebalances"], st["lowerings"]) == (0, 1)
        else:
            assert st["rebalances"] == n
            _, whole = execute(run_passes(program_cut(d, host), PHYSICAL).device, host)
            assert st["bytes_moved"] == whole.as_dict()["bytes_moved"], (n, ends)
            # the other inputs' loads from the host are the cut's, x's found on the devices
            want_loads, got_loads = dict(whole.h2d_inputs), dict(st["h2d_inputs"])
            x_bytes = want_loads.pop(0)
            assert got_loads.pop(0, 0) == (x_bytes if n == 1 else 0)
            assert st["resident_bytes"] + st["relayout_bytes"] == (x_bytes if n > 1 else 0)
            assert got_loads == want_loads, (n, ends)
        x = y
    att = [r for r in d.last.lowered.plan_table() if r["op"] == "attention"]
    assert families or att[0]["splits"] == {"sequence": p}   # the cuts really move


@pytest.mark.parametrize("schedule,families,rebalance", [
    ("naive", False, None), ("optimized", True, None), ("naive", False, False)])
def test_interpret_resident_donated_loop(schedule, families, rebalance):
    """The loop above on the GPU program under Triton's interpreter: the capacity program
    (one family, or each of the family set), or rebalance=False's compile-time cuts. One
    graph capture per family run, no kernel built after the first call; each step equals
    eins.jit chained on the host, its input found on the devices, and with a rebalance the
    device transfers are the batch's cut lowered from scratch (the windowed sends move
    only the cut's rows)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    cfg, p = llama.TINY, 4
    x, w = tiny_weights()
    d = eins.distribute(llama.packed_block_fn(cfg), devices=p, backend="interpret",
                        tuning=SPREAD, outputs="devices", donate_argnums=0,
                        schedule=schedule, families=families, rebalance=rebalance)
    want, first = x, None
    for n, ends in enumerate(TINY_STREAM[:4], 1):
        args = packed_call(cfg, TINY_S, x, w, ends)
        host = input_arrays(np.asarray(x), *args[1:])
        y = d(*args)
        want = eins.jit(llama.block_fn(cfg, ends))(want, *args[1:4])
        assert isinstance(y, Sharded) and y.where == "interpret"
        assert_close(np.asarray(y), want, n=64, depth=4 * n)
        assert n == 1 or x.donated
        st = d.stats()
        first = first or st
        assert (st["traces"], st["plans"]) == (1, 1 + families)
        assert st["rebalances"] == (0 if rebalance is False else n)
        assert st["kernel_compiles"] == first["kernel_compiles"]
        assert st["graph_captures"] == 1 and st["lowerings"] == first["lowerings"]
        assert (st["h2d_inputs"].get(0, 0) > 0) == (n == 1)
        if rebalance is not False:
            # the GPU runtime counts a windowed send at its capacity; window_bytes counts
            # the rows this call's tables let it move
            cut = program_cut(d, host)
            _, whole = execute(run_passes(cut, PHYSICAL).device, host)
            moved = window_bytes(d.last.device_program, host + d.last.capacity.tables(cut))
            assert {k: b for k, b in moved.items() if b} == whole.bytes_moved, (n, ends)
        x = y


def test_numpy_families_alternate_on_resident_state():
    """families=True with the output kept on the devices and donated back, over batches
    that alternate the family (the DP's heads split for long documents, equal query cuts
    for short ones), so each call reads the state another family stored: every step equals
    eins.jit chained on the host, its input found on the devices, its transfers those of
    its family's cut lowered from scratch."""
    s, p = 512, 4
    x, w = wide_weights(s)
    d = eins.distribute(llama.packed_block_fn(WIDE), devices=p, topology="dgx-h100:4",
                        tuning=SPREAD, families=True, backend="numpy", outputs="devices",
                        donate_argnums=0)
    # documents ending at the equal cuts take them; the others the heads split (predicted
    # 0.033 ms against 0.036 for the equal cuts' key transfers on (51, 128, 256, 512))
    stream = [(512,), (128, 256, 384, 512), (5, 17, 412, 512), tuple(range(64, 513, 64))]
    want = x
    for n, ends in enumerate(stream, 1):
        args = packed_call(WIDE, s, x, w, ends)
        host = input_arrays(np.asarray(x), *args[1:])
        y = d(*args)
        want = eins.jit(llama.block_fn(WIDE, ends))(want, *args[1:4])
        assert_close(np.asarray(y), want, n=512, depth=4 * n)
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 2, n)
        assert (st["h2d_inputs"].get(0, 0) > 0) == (n == 1)
        _, whole = execute(run_passes(d.last.last_cut, PHYSICAL).device, host)
        assert st["bytes_moved"] == whole.as_dict()["bytes_moved"], (n, ends)
        x = y
    assert [c.family for c in d.last.choices] == ["dp", "equal", "dp", "equal"]


def bare_qkv(s=48, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, s, 8)), rng.standard_normal((2, s, 8)),
            rng.standard_normal((2, s, 8)))


def attend(q, k, v, e):
    return eins.attention(q, k, v, causal=True, segments=e)


static_attend = eins.jit(lambda q, k, v, segs: eins.attention(q, k, v, causal=True,
                                                               segments=segs),
                         static_argnames=("segs",))


def test_recut_cache_evicts_the_oldest_cut_and_lowers_it_again():
    """40 batches through one compiled program on numpy, more distinct cuts than
    RECUT_CACHE: a cut among the last RECUT_CACHE seen reuses its program, any other is
    lowered (again, once evicted). lowerings counts exactly that (a least-recently-used
    model of the cache, keyed as the program keys its cuts), the cache never holds more
    than RECUT_CACHE programs, and every batch, a re-lowered one included, equals eins.jit
    on its ends and moves the bytes of its cut lowered from scratch."""
    s, p = 48, 4
    q, k, v = bare_qkv(s)
    d = eins.distribute(attend, devices=p, plan={0: {"sequence": p}}, backend="numpy")
    rng = np.random.default_rng(3)
    stream = [tuple(sorted({int(a) for a in rng.integers(1, s, rng.integers(1, 6))})) + (s,)
              for _ in range(24)]
    stream += stream[:4] + [stream[(7 * n) % 24] for n in range(12)]   # recent and evicted
    cap = FamilyRun.RECUT_CACHE
    kept, lowered, relowered = [], 1, 0   # 1: the plan's own program, at compile
    for n, ends in enumerate(stream, 1):
        e = llama.padded_ends(ends, 6, s)
        np.testing.assert_allclose(d(q, k, v, e), static_attend(q, k, v, segs=ends),
                                   rtol=1e-12, atol=1e-12)
        low = d.last.lowered
        ops = runtime_operands(low.program)
        cut = recut(low.compilation, [q, k, v, e], ops)
        key = recut_key(cut, ops)
        if key in kept:
            kept.remove(key)
        else:
            lowered += 1
            relowered += key in {recut_key(recut(low.compilation, [q, k, v, llama.padded_ends(
                b, 6, s)], ops), ops) for b in stream[:n - 1]}
            kept = kept[-(cap - 1):]
        kept.append(key)
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 1, n)
        assert st["lowerings"] == lowered, (n, ends)
        _, whole = execute(run_passes(cut, PHYSICAL).device, [q, k, v, e])
        assert st["bytes_moved"] == whole.as_dict()["bytes_moved"], (n, ends)
    assert len(set(kept)) == len(kept) == cap
    assert relowered > 0 and lowered - 1 > cap   # evicted cuts came back


@pytest.mark.parametrize("families", [False, True])
def test_ends_of_another_length_or_dtype_are_another_signature(families):
    """Ends padded to another maximum count, or given as int32 instead of int64, are a new
    signature of the same distributed function: traced, planned and compiled for it once,
    then re-cut per call like the first; each batch equals eins.jit on its ends."""
    s, p = 48, 4
    q, k, v = bare_qkv(s)
    d = eins.distribute(attend, devices=p, backend="numpy", families=families,
                        plan=None if families else {0: {"sequence": p}})
    forms = [(6, np.int64), (8, np.int64), (6, np.int32), (6, np.int64), (8, np.int64)]
    batches = [(5, 11, 48), (30, 40, 48), (1, 2, 3, 20, 48), (47, 48), (12, 24, 36, 48)]
    seen = []
    for n, ((m, dtype), ends) in enumerate(zip(forms, batches), 1):
        e = llama.padded_ends(ends, m, s).astype(dtype)
        np.testing.assert_allclose(d(q, k, v, e), static_attend(q, k, v, segs=ends),
                                   rtol=1e-12, atol=1e-12)
        seen += [(m, dtype)] if (m, dtype) not in seen else []
        st = d.stats()
        # the function's traces and plans: one per signature (two plans with families)
        assert (st["traces"], st["plans"]) == (len(seen), len(seen) * (1 + families))
        assert st["rebalances"] == sum(f == (m, dtype) for f in forms[:n])   # this program's
        assert d.last.lowered.program.inputs[3].type.shape == (m,)
    assert d.trace_count == 3   # one per signature: (6,) int64, (8,) int64, (6,) int32


def test_float_ends_at_call_time_are_named():
    """Float ends are refused with the value's dtype named, at the user's line."""
    s = 48
    q, k, v = bare_qkv(s)
    d = eins.distribute(attend, devices=4, backend="numpy")
    with pytest.raises(EinsError, match=r"1-D int array.*got float64 \(6,\).*test_packed_combos"):
        d(q, k, v, llama.padded_ends((5, 48), 6, s).astype(np.float64))


def test_interpret_per_cut_programs_keep_earlier_outputs(monkeypatch):
    """Without a capacity form (a key-sequence split) rebalance=True runs a program per
    cut on the GPU backends, each with its own buffers. Outputs kept on the devices and fed
    back as the next queries cross those programs, and a program evicted from the cut
    cache (RECUT_CACHE 2 here) or run again for a repeated cut leaves every earlier kept
    output as it was: each equals eins.jit chained on the host at the end of the stream."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    monkeypatch.setattr(FamilyRun, "RECUT_CACHE", 2)
    s = 32
    q, k, v = (a.astype(np.float32) for a in bare_qkv(s, seed=2))
    k, v = np.concatenate([k, k]), np.concatenate([v, v])   # as many kv heads as q heads
    d = eins.distribute(attend, devices=4, plan={0: {"kv_sequence": 4}}, backend="interpret",
                        rebalance=True, outputs="devices")
    stream = [(5, 11, 32), (32,), (1, 2, 3, 20, 32), (16, 32), (5, 11, 32), (32,)]
    x, want, kept = q, q, []
    for ends in stream:
        e = llama.padded_ends(ends, 6, s)
        x = d(x, k, v, e)
        want = eins.jit(attend)(want, k, v, e)
        kept.append((x, want))
    for n, (got, ref) in enumerate(kept):
        assert_close(np.asarray(got), ref, n=s, depth=3 * (n + 1))
    st = d.stats()
    assert (st["lowerings"], st["graph_captures"]) == (7, 6)   # every cut new to the two kept


def attention_extras(s, seed=4):
    """name -> attention keyword arguments beyond the ends: score options, and masks and
    biases (operands before the ends in the eqn)."""
    rng = np.random.default_rng(seed)
    return {"noncausal": {"causal": False}, "window": {"window": 5},
            "softcap": {"softcap": 3.0}, "key_mask": {"mask": rng.random(s) > 0.2},
            "full_mask": {"mask": rng.random((4, s, s)) > 0.3},
            "alibi": {"bias": rng.random(4)},
            "bias_and_mask": {"bias": rng.standard_normal((4, s, s)),
                              "mask": rng.random((4, s, s)) > 0.3}}


@pytest.mark.parametrize("extra", ["noncausal", "window", "softcap", "key_mask", "full_mask",
                                   "alibi", "bias_and_mask"])
@pytest.mark.parametrize("plan", [{"sequence": 4}, {"kv_sequence": 4},
                                  {"heads_kv": 2, "sequence": 2}])
def test_numpy_rebalance_with_attention_options(extra, plan):
    """Array ends beside attention's other options, masks and biases, re-cut per call
    along each split: every batch equals eins.jit on its static ends."""
    s = 48
    q, k, v = bare_qkv(s)
    kw = attention_extras(s)[extra]
    names = sorted(k_ for k_ in kw if isinstance(kw[k_], np.ndarray))
    opts = {k_: x for k_, x in kw.items() if k_ not in names}

    def f(q, k, v, e, *xs):
        return eins.attention(q, k, v, segments=e, **opts, **dict(zip(names, xs)))

    ref = eins.jit(lambda q, k, v, *xs, segs: eins.attention(
        q, k, v, segments=segs, **opts, **dict(zip(names, xs))), static_argnames=("segs",))
    d = eins.distribute(f, devices=4, plan={0: plan}, backend="numpy")
    xs = [kw[n] for n in names]
    for n, ends in enumerate([(5, 11, 48), (48,), (1, 2, 3, 20, 48), (30, 40, 48)], 1):
        e = llama.padded_ends(ends, 6, s)
        np.testing.assert_allclose(d(q, k, v, e, *xs), ref(q, k, v, *xs, segs=ends),
                                   rtol=1e-12, atol=1e-12)
        assert d.stats()["rebalances"] == n


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
@pytest.mark.parametrize("families", [False, True])
def test_ends_kept_on_the_devices_and_donated(backend, families):
    """Ends that an earlier eins program left on the devices (a Sharded array, as a
    device-side data loader would) and that the call donates: each call re-cuts from
    them and equals eins.jit on those ends; the donated ends are released."""
    if backend == "interpret":
        pytest.importorskip("torch")
        pytest.importorskip("triton")
    s = 32
    q, k, v = (a.astype(np.float32) for a in bare_qkv(s, seed=2))
    keep = eins.distribute(lambda e: e + 0, devices=4, backend=backend, outputs="devices")
    d = eins.distribute(attend, devices=4, backend=backend, families=families,
                        plan=None if families else {0: {"sequence": 4}}, donate_argnums=3)
    for n, ends in enumerate([(5, 11, 32), (32,), (1, 2, 3, 20, 32)], 1):
        e = keep(llama.padded_ends(ends, 6, s))
        assert isinstance(e, Sharded)
        got = d(q, k, v, e)
        assert_close(np.asarray(got), static_attend(q, k, v, segs=ends), n=s, depth=3)
        assert e.donated and d.stats()["rebalances"] == n


@pytest.mark.parametrize("families", [False, True])
def test_placed_inputs_stay_resident_in_per_cut_programs(families):
    """place() on a GPU backend whose calls run a program per cut (a key-sequence split
    has no capacity form): the placed q, k and v are made resident in the program of the
    placed call's cut and in each program built for a later cut, so every call loads only
    its new ends. place() used to fill the compile-time cuts' executable, which no call
    runs, and every call loaded q, k and v again. place() counts no rebalance."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    s = 32
    q, k, v = (a.astype(np.float32) for a in bare_qkv(s, seed=2))
    plan = {0: {"kv_sequence": 4}}
    low = eins.distribute(attend, devices=4, plan=plan, backend="interpret").lower(
        q, k, v, llama.padded_ends((s,), 6, s))
    c = low.compile("interpret", rebalance=True, families=families)
    e0 = llama.padded_ends((5, 11, s), 6, s)
    placed = c.place(q, k, v, e0)
    assert {i for i, b in placed["h2d_inputs"].items() if b} == {0, 1, 2, 3}
    assert c.counters()["rebalances"] == 0
    for n, ends in enumerate([(5, 11, s), (s,), (1, 2, 3, 20, s), (16, s)], 1):
        e = llama.padded_ends(ends, 6, s)
        assert_close(np.asarray(c(q, k, v, e)), static_attend(q, k, v, segs=ends), n=s,
                     depth=3)
        st = c.stats()
        assert st["h2d_inputs"] == {3: 4 * e.nbytes}, (n, ends)   # the ends, per device
        assert st["loads_skipped"] > 0 and st["rebalances"] == n
