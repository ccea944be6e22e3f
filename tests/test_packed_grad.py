"""Training on packed batches (issue 36): the loss and gradients of the tiny LLaMA block whose
segment ends are an int array, through ONE compiled ``eins.value_and_grad`` for a stream of
batches whose documents end elsewhere each time. The forward that saves its log-sum-exp and
the attention backward both take the ends as data and are re-cut per call (balanced causal
work for each batch's documents); every batch's loss and gradients equal ``eins.jit`` on
that batch's static ends and torch.autograd on the same math."""
import warnings
from dataclasses import replace

import numpy as np
import pytest

import eins
from eins import tolerance
from eins.errors import EinsError
from eins.ir.joinagg import FunctionSpec
from eins.ir.program import eqn_indexing
from eins.cost.predict import predict
from eins.ir.types import Box
from eins.kernels.attention_bwd import LAUNCHES
from eins.models import llama
from eins.ops.attention_bwd import attention_fwd_ends
from eins.passes import PHYSICAL, run_passes
from eins.passes.capacity import capacity
from eins.passes.rebalance import recut, runtime_operands
from eins.passes.verify import verify_device
from eins.passes.windows import capacity_seconds, window_bytes, windows
from eins.runtime.numpy_backend import execute
from eins.runtime.sharded import Sharded
from eins.tracing import bind
from helpers import (SPREAD, assert_close, assert_splits, attention_gradient, input_arrays,
                     packed_call, torch_llama_layer)

CFG, S = llama.TINY, 32
# each batch's documents end elsewhere (one long document, many short ones, ...)
STREAM = [(10, 20, S), (3, 5, 17, S), (S,), (16, S), (1, 2, 3, 4, 5, S)]
BLOCK = llama.packed_block_fn(CFG)


def weights(seed=5):
    rng = np.random.default_rng(seed)
    w = llama.init_weights(CFG, rng)
    return (rng.standard_normal((S, CFG.d_model)) / 2).astype(np.float32), w


def loss(w, x, cos, sin, e):
    return eins.sum(BLOCK(x, w, cos, sin, e) ** 2) / S


def static_loss(ends):
    """The same loss with the batch's ends as a static tuple (traced for that batch)."""
    block = llama.block_fn(CFG, ends)
    return lambda w, x, cos, sin: eins.sum(block(x, w, cos, sin) ** 2) / S


def torch_value_and_grad(w, x, cos, sin, ends):
    """The packed block in torch (written independently: HF's rotate_half, repeated kv
    heads, a same-document causal mask), differentiated by torch.autograd."""
    torch = pytest.importorskip("torch")
    tw = {k: torch.tensor(v, requires_grad=True) for k, v in w.items()}
    t, c, s_ = (torch.tensor(a) for a in (x, cos, sin))
    doc = torch.searchsorted(torch.tensor(ends), torch.arange(S), right=True)
    mask = torch.ones(S, S, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
    y = torch_llama_layer(t, tw, c, s_, mask, CFG)
    value = (y ** 2).sum() / S
    value.backward()
    return float(value), {k: a.grad.numpy() for k, a in tw.items()}


def attention_cuts(d, args) -> dict:
    """{eqn index: its query-sequence intervals} of the re-cut eqns (those taking the ends
    as data: the forward and the backward of the attention) in the cut of ``args``."""
    low = d.last.lowered
    ops = runtime_operands(low.program)
    cut = recut(low.compilation, input_arrays(*args), ops)
    return {i: cut.plan.eqn_plans[i].intervals["sequence"] for i in ops}


def check_stream(d, tol_fn):
    """Every batch of STREAM through ``d`` (one compiled value_and_grad): its loss and
    gradients equal eins.jit's on the batch's static ends and torch's; one trace and one
    plan for all, a re-cut per batch whose attention cuts move."""
    x, w = weights()
    cuts = []
    for n, ends in enumerate(STREAM, 1):
        _, _, cos, sin, e = packed_call(CFG, S, x, w, ends)
        args = (w, x, cos, sin, e)
        value, grads = d(*args)
        want_value, want = eins.jit(eins.value_and_grad(static_loss(ends)))(w, x, cos, sin)
        torch_value, torch_grads = torch_value_and_grad(w, x, cos, sin, ends)
        n_acc, depth = tol_fn(args)
        assert_close(float(value), float(want_value), n=n_acc, depth=depth, dtype=np.float32)
        assert_close(float(value), torch_value, n=n_acc, depth=depth, dtype=np.float32)
        assert set(grads) == set(w)
        for k in w:
            assert_close(grads[k], want[k], n=n_acc, depth=depth, err_msg=f"{ends} {k}")
            assert_close(grads[k], torch_grads[k], n=n_acc, depth=depth, err_msg=f"{ends} {k}")
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 1, n)
        cuts.append(attention_cuts(d, args))
    assert_splits(d.last.lowered)
    # the forward (saving its lse) and the backward are both re-cut, by query sequence
    assert len(cuts[0]) >= 2 and all(len(iv) > 1 for iv in cuts[0].values())
    for i in cuts[0]:   # each re-cut eqn's cuts move with the documents' ends
        assert len({c[i] for c in cuts}) >= 3, [c[i] for c in cuts]
    return cuts


def accumulation_of(args):
    return tolerance.accumulation(eins.make_ir(eins.value_and_grad(loss))(*args))


def check_batch(d, w, x, cos, sin, e, ends, dtype=np.float32):
    """One batch through ``d`` (a compiled value_and_grad of ``loss``): its loss and every
    gradient equal eins.jit's on the batch's static ``ends``."""
    value, grads = d(w, x, cos, sin, e)
    want_value, want = eins.jit(eins.value_and_grad(static_loss(ends)))(w, x, cos, sin)
    n, depth = accumulation_of((w, x, cos, sin, e))
    assert_close(float(value), float(want_value), n=n, depth=depth, dtype=dtype)
    for k in w:
        assert_close(grads[k], want[k], n=n, depth=depth, err_msg=f"{ends} {k}")


@pytest.mark.parametrize("devices", [4, 8])
def test_numpy_stream_of_packed_batches_equals_static_jit_and_torch(devices):
    d = eins.distribute(eins.value_and_grad(loss), devices=devices, backend="numpy",
                        tuning=SPREAD)
    check_stream(d, accumulation_of)
    # the balanced cuts are those of each batch's ends: one document (S,) is cut at
    # equal causal work, not at the compile-time equal-token cuts
    assert d.stats()["lowerings"] == len(set(STREAM)) + 1


def test_interpret_stream_of_packed_batches_through_one_capacity_program():
    """On the interpret backend (the Triton forward and backward kernels under the
    interpreter) the gradient program re-cuts per call by default: attention_fwd and
    attention_bwd have capacity forms whose kernels read the row table (the cut's work),
    so every batch runs ONE program (one lowering, one graph capture, no kernel compiled
    after the first batch) whose per-call tables carry the cuts. Each batch's loss and
    gradients equal eins.jit on its static ends, with no RuntimeWarning (no stale row is
    multiplied); the cuts move; the program's sends move per device pair at most the bytes
    of a program lowered for that cut alone (the same rows, less the per-cut backward's
    zero rows of its dK and dV partials: test_capacity_bytes_are_the_cuts)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    d = eins.distribute(eins.value_and_grad(loss), devices=4, backend="interpret",
                        tuning=SPREAD)
    assert d.rebalance is None   # the default, decided at compile time
    first = None
    x, w = weights()
    seen = set()
    launches = LAUNCHES["attention_bwd"]
    for n, ends in enumerate(STREAM, 1):
        args = packed_call(CFG, S, x, w, ends)
        args = (args[1], args[0]) + args[2:]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_batch(d, *args, ends)
        st = d.stats()
        first = first or st
        assert (st["traces"], st["plans"], st["rebalances"], st["lowerings"]) == (1, 1, n, 1)
        assert (st["kernel_compiles"], st["graph_captures"]) == \
            (first["kernel_compiles"], first["graph_captures"]) and st["graph_captures"] >= 1
        cap, low = d.last.capacity, d.last.lowered
        assert cap is not None
        ops = runtime_operands(low.program)
        arrays = input_arrays(*args)
        cut = recut(low.compilation, arrays, ops)
        tables = cap.tables(cut)
        assert len(tables) == 1   # the forward and the backward share one table
        seen.add(tuple(map(tuple, tables[0].tolist())))
        moved = window_bytes(d.last.device_program, arrays + tables)
        per = window_bytes(run_passes(cut, PHYSICAL).device, arrays)
        assert all(n <= per.get(pair, 0) for pair, n in moved.items()), (moved, per)
        assert sum(moved.values()) < sum(per.values())
    assert len(seen) == len(set(STREAM))   # the cuts moved; the program did not
    assert d.last.rebalance is True
    assert_splits(d.last.lowered)
    windowed = [i for c in d.last.device_program.code.values() for i in c
                if i.kind == "send" and i.window is not None]
    assert len(windowed) >= 4 * 3 * 4
    # the Triton backward ran every block (the first call's eager warm-up too), not the
    # torch fallback
    assert LAUNCHES["attention_bwd"] - launches == 4 * (len(STREAM) + 1)


def test_capacity_gradient_program_is_priced_as_the_per_cut_one():
    """The paper block's training step (its value_and_grad) at 32K packed tokens on
    dgx-h100:8, attention_fwd and attention_bwd split by query rows: per batch (one
    document, two, 21), the capacity program's estimate, a program lowered for the batch's
    cut (whose work its kernels now do: tests/test_attention_bwd_rows.py counts it) plus
    what capacity costs beyond it (capacity_seconds: the windowed sends' masked copies), is
    within 6% of that per-cut program's predicted time. Its form masks nothing
    (Primitive.capacity_masks): the masked backward ran every row of its capacity block,
    which prices its attention_bwd at p times the cut's compute or more (the cut's rows
    see fewer keys with more documents)."""
    tokens, p = 32768, 8
    block = llama.packed_block_fn(llama.PAPER)

    def paper_loss(w, x, cos, sin, e):
        return eins.sum(block(x, w, cos, sin, e) ** 2)

    x, w, cos, sin = llama.Workload("packed", 1, tokens).args(llama.PAPER)
    args = (w, x, cos, sin, eins.ShapeDtype((64,), "int32"))
    f = eins.value_and_grad(paper_loss)
    prog = eins.make_ir(f)(*args)
    ops = runtime_operands(prog)
    assert sorted(prog.eqns[i].primitive.name for i in ops) == ["attention_bwd",
                                                                 "attention_fwd"]
    low = eins.distribute(f, devices=p, topology="dgx-h100:8",
                          plan={i: {"sequence": p} for i in ops}).lower(*args)
    assert runtime_operands(low.program) == ops
    form = capacity(low.compilation, ops)
    assert form is not None and not form.masks
    lowered = run_passes(form.comp, PHYSICAL)
    dprog = windows(lowered.device, form)
    bwd = next(i for i in ops if low.program.eqns[i].primitive.name == "attention_bwd")
    whole = next(r["compute_ms"] for r in predict(lowered)["per_eqn"] if r["eqn"] == bwd)
    arrays = [None] * len(low.program.inputs)
    rng = np.random.default_rng(0)
    many = tuple(int(c) for c in np.sort(rng.choice(np.arange(1, tokens), 20, replace=False)))
    for ends in [(tokens,), (tokens // 3, tokens), many + (tokens,)]:
        arrays[ops[bwd][1]] = llama.padded_ends(ends, 64, tokens)
        cut = recut(low.compilation, arrays, ops)
        per = predict(run_passes(cut, PHYSICAL))
        extra = capacity_seconds(dprog, arrays + form.tables(cut), low.compilation.topology)
        assert 0 < extra * 1e3 <= 0.06 * per["total_ms"], (ends, extra, per["total_ms"])
        cut_bwd = next(r["compute_ms"] for r in per["per_eqn"] if r["eqn"] == bwd)
        assert whole >= 0.99 * p * cut_bwd, (ends, whole, cut_bwd)


def attention_grads(q, k, v, do, e):
    """The forward saving its lse and the backward, between elementwise eqns."""
    q, k, v = q * 2.0, k * 2.0, v * 2.0
    o, lse = attention_fwd_ends(q, k, v, e)
    dq, dk, dv = bind("attention_bwd", q, k, v, o, lse, do * 1.0, e, causal=True,
                      segments="array", scale=None)
    return dq * 2.0, dk * 2.0, dv * 2.0, lse * 3.0


def test_capacity_bytes_are_the_cuts():
    """attention_fwd and attention_bwd split into 4 by query rows, everything else into 4
    equal 6-row pieces, in the capacity program (numpy executor): every output equals
    eins.jit for each batch, the forward and the backward share one table, and the bytes
    between every two devices are the per-cut program's less, by hand, the zero rows its
    backward sends: its dK and dV partials are whole-sequence blocks, so block j sends
    each other device i the 6 rows of its piece, of which those outside the keys j's rows
    see [klo_j, khi_j) are zeros, where the capacity program moves only the keys."""
    n_s, h, hkv, dh = 24, 4, 2, 8
    f = attention_grads
    plan = {i: {"d1": 4} for i in range(10)}
    plan[3] = plan[5] = {"sequence": 4}
    rng = np.random.default_rng(0)
    q, do = (rng.standard_normal((h, n_s, dh)) for _ in range(2))
    k, v = (rng.standard_normal((hkv, n_s, dh)) for _ in range(2))
    low = eins.distribute(f, devices=4, plan=plan).lower(q, k, v, do,
                                                          llama.padded_ends((n_s,), 6, n_s))
    assert [low.program.eqns[i].primitive.name for i in (3, 5)] == ["attention_fwd",
                                                                     "attention_bwd"]
    ops = runtime_operands(low.program)
    cap = capacity(low.compilation, ops)
    assert cap.inputs[3] == cap.inputs[5]
    dprog = windows(run_passes(cap.comp, PHYSICAL).device, cap)
    verify_device(dprog)
    seen = set()
    for ends in [(5, 11, 24), (24,), (1, 2, 3, 20, 24), (12, 24), (23, 24), (4, 8, 16, 24)]:
        arrays = [q, k, v, do, llama.padded_ends(ends, 6, n_s)]
        cut = recut(low.compilation, arrays, ops)
        tables = cap.tables(cut)
        got, st = execute(dprog, arrays + tables)
        for a, b in zip(got, eins.jit(f)(*arrays)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=str(ends))
        _, per = execute(run_passes(cut, PHYSICAL).device, arrays)
        zeros = {}
        for j, (_, _, klo, khi) in enumerate(tables[0].tolist()):
            for i in range(4):
                if i != j:
                    rows = 6 - max(0, min(khi, 6 * i + 6) - max(klo, 6 * i))
                    zeros[(j, i)] = 2 * hkv * dh * 8 * rows
        pairs = set(per.bytes_moved) | set(st.bytes_moved)
        assert {p: st.bytes_moved.get(p, 0) for p in pairs} == \
            {p: per.bytes_moved.get(p, 0) - zeros.get(p, 0) for p in pairs}, ends
        assert st.bytes_moved == window_bytes(dprog, arrays + tables)
        seen.add(tuple(map(tuple, tables[0].tolist())))
    assert len(seen) == 6


def test_a_shared_table_cut_apart_and_a_capacity_key_split_are_named():
    """The forward and the backward share one table because their cuts agree every call: a
    cut giving the backward other rows than the forward is refused, naming both eqns and
    both cuts, rather than windowing one by the other's rows; and the backward's capacity
    form splits query rows only (its key split's dQ partials are not the table's)."""
    f = attention_grads
    plan = {i: {"d1": 4} for i in range(10)}
    plan[3] = plan[5] = {"sequence": 4}
    q = np.zeros((4, 24, 8))
    k = np.zeros((2, 24, 8))
    low = eins.distribute(f, devices=4, plan=plan).lower(q, k, k, q,
                                                          llama.padded_ends((24,), 6, 24))
    ops = runtime_operands(low.program)
    cap = capacity(low.compilation, ops)
    cut = recut(low.compilation, [q, k, k, q, llama.padded_ends((5, 24), 6, 24)], ops)
    plans = list(cut.plan.eqn_plans)
    ep = plans[5]
    fs = list(ep.spec.fspecs)
    q0 = fs[0].inputs[0]
    moved = Box(q0.lo, q0.hi[:-2] + (q0.hi[-2] - 1,) + q0.hi[-1:])
    fs[0] = FunctionSpec((moved,) + fs[0].inputs[1:], (moved,) + fs[0].outputs[1:])
    plans[5] = replace(ep, spec=replace(ep.spec, fspecs=tuple(fs)))
    cut = replace(cut, plan=replace(cut.plan, eqn_plans=tuple(plans)))
    with pytest.raises(EinsError, match=r"eqn 5: its cut \[\[0, \d+, .* differs from that "
                                        r"of eqn 3, whose table it shares"):
        cap.tables(cut)
    e = cap.comp.program.eqns[5]
    iv = {n: ((0, x),) for n, x in eqn_indexing(e).extents.items()}
    iv["sequence"] = ((0, 12), (12, 24))
    iv["kv_sequence"] = ((0, 12), (12, 24))
    with pytest.raises(EinsError, match="attention_bwd: the capacity form .* cannot split "
                                        "kv_sequence"):
        eqn_indexing(e).spec(iv)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("float64", 1e-9)],
                         ids=["triton", "torch-fallbacks"])
def test_interpret_capacity_gradients_never_read_stale_rows(dtype, tol):
    """The capacity program on interpret, each finite batch after one with nan and inf in
    every input: a call writes only its windows, so the capacity buffers keep those values
    outside them (rows 3-8 and 15, outside the next call's windows on some device), which
    the kernels must never multiply (they load the rows and keys outside a block's table
    row as zeros: a weight 0 times a nan is nan, and numpy would warn). Each finite batch
    equals eins.jit, with no RuntimeWarning, through one lowering and one capture of the
    capacity program (the default). float64 runs the torch fallbacks, which zero the keys
    no computed row sees within its causal band (a later key of a row's own document may
    be stale too)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    plan = {i: {"d1": 4} for i in range(10)}
    plan[3] = plan[5] = {"sequence": 4}
    rng = np.random.default_rng(0)
    q, do = (rng.standard_normal((4, 24, 8)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((2, 24, 8)).astype(dtype) for _ in range(2))
    d = eins.distribute(attention_grads, devices=4, plan=plan, backend="interpret")
    ref = eins.jit(attention_grads)
    bad = [x.copy() for x in (q, k, v, do)]
    for x in bad:
        x[:, 3:9] = np.nan
        x[:, 15] = np.inf
    for ends in [(9, 24), (2, 5, 24), (20, 24), (12, 16, 24)]:
        with warnings.catch_warnings():   # nan and inf in the call's own rows: numpy warns
            warnings.simplefilter("ignore", RuntimeWarning)
            d(*bad, llama.padded_ends((24,), 6, 24))
        e = llama.padded_ends(ends, 6, 24)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = d(q, k, v, do, e)
        for a, b in zip(got, ref(q, k, v, do, e)):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=str(ends))
    st = d.stats()
    assert (st["lowerings"], st["graph_captures"]) == (1, 1) and d.last.capacity is not None


@pytest.mark.parametrize("rebalance", [True, False], ids=["capacity", "compile-time-cuts"])
def test_interpret_torch_fallbacks_read_the_ends(rebalance):
    """float64 runs the torch fallbacks of the forward and the backward (the Triton kernels
    take 16- and 32-bit floats), in their capacity forms with rebalance=True (rows outside
    a block's table row add nothing, its lse rows 0) and at the compile-time cuts without
    (blocks holding keys of other documents, masked by each call's ends, searched on the
    device): each batch equals eins.jit on its static ends, to float64 rounding, through
    one lowering, no Triton backward launched."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    before = LAUNCHES["attention_bwd"]
    rng = np.random.default_rng(5)
    w = llama.init_weights(CFG, rng, "float64")
    x = rng.standard_normal((S, CFG.d_model)) / 2
    d = eins.distribute(eins.value_and_grad(loss), devices=4, backend="interpret",
                        tuning=SPREAD, rebalance=rebalance)
    for ends in STREAM[:3]:
        _, _, cos, sin, e = packed_call(CFG, S, x, w, ends)
        cos, sin = cos.astype(np.float64), sin.astype(np.float64)
        check_batch(d, w, x, cos, sin, e, ends, np.float64)
    assert LAUNCHES["attention_bwd"] == before
    st = d.stats()
    assert (st["lowerings"], st["rebalances"]) == (1, 3 if rebalance else 0)
    assert (d.last.capacity is not None) == rebalance


def test_interpret_without_rebalance_keeps_the_compile_time_cuts():
    """With rebalance=False a gradient program keeps the compile-time cuts on the GPU
    backends (one program, no re-cut, no table), which still read each batch's ends: equal
    to the static jit."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    d = eins.distribute(eins.value_and_grad(loss), devices=4, backend="interpret",
                        tuning=SPREAD, rebalance=False)
    x, w = weights()
    for ends in STREAM[:2]:
        _, _, cos, sin, e = packed_call(CFG, S, x, w, ends)
        check_batch(d, w, x, cos, sin, e, ends)
    st = d.stats()
    assert (st["rebalances"], st["lowerings"], st["traces"]) == (0, 1, 1)
    assert d.last.capacity is None


SPLITS = [("fwd", {"sequence": 4}), ("fwd", {"kv_sequence": 4}), ("bwd", {"sequence": 4}),
          ("bwd", {"kv_sequence": 4}), ("bwd", {"sequence": 2, "kv_sequence": 2})]


@pytest.mark.parametrize("rebalance", [True, False])
@pytest.mark.parametrize("backend", ["numpy", "interpret"])
@pytest.mark.parametrize("which,split", SPLITS,
                         ids=[f"{w}-{'-'.join(s)}" for w, s in SPLITS])
def test_forced_splits_of_the_forward_and_the_backward(backend, which, split, rebalance):
    """Attention alone, its gradients of q, k and v with the forward (saving its lse) or
    the backward forced to a query split, a key split (dQ partials summed by the ⊕ where
    a cut falls inside a document) or both, re-cut per batch or at the compile-time cuts
    (the blocks then read keys of other documents, which the kernels mask by the ends they
    read from the array): each batch equals eins.jit on its static ends (float64: the
    torch fallbacks on interpret)."""
    if backend == "interpret":
        pytest.importorskip("torch")
        pytest.importorskip("triton")
    g, (q, k, v), t, (fwd, bwd) = attention_gradient(S, 2)
    d = eins.distribute(g, devices=4, plan={fwd if which == "fwd" else bwd: split},
                        backend=backend, rebalance=rebalance)
    for ends in [(S,), (10, 20, S), (3, 5, 17, S), (1, 2, 3, 4, 5, S)]:
        value, grads = d(q, k, v, llama.padded_ends(ends, 6, S))
        want_value, want = eins.jit(eins.value_and_grad(
            lambda q, k, v: eins.sum(eins.attention(q, k, v, segments=ends) * t),
            argnums=(0, 1, 2)))(q, k, v)
        np.testing.assert_allclose(value, want_value, rtol=1e-12)
        for a, b in zip(grads, want):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=str(ends))
    plan = d.last.lowered.plan.eqn_plans[fwd if which == "fwd" else bwd]
    assert plan.splits == split
    assert d.stats()["rebalances"] == (4 if rebalance else 0)


def remat_loss(w, x, cos, sin, e):
    return eins.sum(eins.checkpoint(BLOCK)(x, w, cos, sin, e) ** 2) / S


@pytest.mark.parametrize("fn,kw", [(loss, dict(families=True)),
                                   (loss, dict(schedule="optimized")),
                                   (remat_loss, {})], ids=["families", "optimized", "remat"])
def test_numpy_packed_gradients_with_families_schedule_and_checkpoint(fn, kw):
    """The packed gradient with the other features on: two plan families chosen per batch,
    the optimized schedule, the block checkpointed (its forward, attention_fwd included,
    recomputed in the backward). Each batch equals eins.jit on its static ends."""
    d = eins.distribute(eins.value_and_grad(fn), devices=4, backend="numpy", tuning=SPREAD,
                        **kw)
    x, w = weights()
    for n, ends in enumerate(STREAM[:4], 1):
        _, _, cos, sin, e = packed_call(CFG, S, x, w, ends)
        check_batch(d, w, x, cos, sin, e, ends)
        st = d.stats()
        assert (st["traces"], st["rebalances"]) == (1, n)
        assert st["plans"] == (2 if kw.get("families") else 1)


LR = np.float32(0.05)


def sgd(w, x, cos, sin, e):
    value, g = eins.value_and_grad(loss)(w, x, cos, sin, e)
    return value, {k: w[k] - LR * g[k] for k in w}


def static_sgd(ends):
    f = static_loss(ends)

    def step(w, x, cos, sin):
        value, g = eins.value_and_grad(f)(w, x, cos, sin)
        return value, {k: w[k] - LR * g[k] for k in w}
    return step


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_sgd_loop_on_the_devices_over_packed_batches_equals_the_host_loop(backend):
    """SGD over the packed stream with the weights kept on the devices and donated to the
    next step (outputs="devices", donate_argnums=0): every step's loss and the final
    weights equal eins.jit's step on each batch's static ends chained on the host; after
    the first step the weights come from the devices (no host bytes for them)."""
    if backend == "interpret":
        pytest.importorskip("torch")
        pytest.importorskip("triton")
    x, w0 = weights()
    d = eins.distribute(sgd, devices=4, backend=backend, tuning=SPREAD, outputs="devices",
                        donate_argnums=0, rebalance=True)
    w, host = w0, w0
    n_w = len(w0)
    for n, ends in enumerate(STREAM[:4], 1):
        _, _, cos, sin, e = packed_call(CFG, S, x, w0, ends)
        value, w_new = d(w, x, cos, sin, e)
        want_value, host = eins.jit(static_sgd(ends))(host, x, cos, sin)
        nacc, depth = tolerance.accumulation(eins.make_ir(sgd)(w0, x, cos, sin, e))
        depth *= n   # the weights carry every earlier step's rounding
        assert isinstance(value, Sharded) and all(isinstance(a, Sharded)
                                                  for a in w_new.values())
        assert_close(np.asarray(value), want_value, n=nacc, depth=depth, dtype=np.float32)
        for k in w0:
            assert_close(np.asarray(w_new[k]), host[k], n=nacc, depth=depth,
                         err_msg=f"step {n} {k}")
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 1, n)
        if n > 1:
            assert all(w[k].donated for k in w)
            assert sum(b for i, b in st["h2d_inputs"].items() if i < n_w) == 0
        w = w_new
