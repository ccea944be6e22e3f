"""Training on packed batches through attention's bias (issue 36): the gradient with respect
to an additive bias or ALiBi slopes (``attention_dbias``) takes the segment ends as data, as
the gradients of q, k and v do, and is re-cut per call with them. A stream of batches whose
documents end elsewhere each time runs through ONE compiled ``eins.value_and_grad``; every
batch's loss and gradients (bias or slopes, q, k, v) equal ``eins.jit`` on that batch's
static ends and torch.autograd of the same packed attention (a same-document causal mask
built in torch)."""
import math
import warnings

import numpy as np
import pytest

import eins
from eins import tolerance
from eins.errors import EinsError
from eins.ir.types import TensorType
from eins.models import llama
from eins.ops import get_primitive
from eins.ops.attention_dbias import PAIR_FLOPS
from eins.passes import PHYSICAL, run_passes
from eins.passes.capacity import capacity
from eins.passes.rebalance import recut, runtime_operands
from eins.passes.verify import verify_device
from eins.passes.windows import windows
from eins.runtime.numpy_backend import execute
from eins.tracing import bind
from helpers import SPREAD, assert_close, assert_splits, input_arrays

S, H, HKV, D = 32, 4, 2, 8
# each batch's documents end elsewhere (three, four, one long one, many short ones)
STREAM = [(10, 20, S), (3, 5, 17, S), (S,), (1, 2, 3, 4, 5, S)]
DB = get_primitive("attention_dbias")
FWD = get_primitive("attention_fwd")


def operands(kind, dtype, seed=0):
    """(bias or slopes, q, k, v, the loss's weights t)."""
    rng = np.random.default_rng(seed)
    q, t = (rng.standard_normal((H, S, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((HKV, S, D)).astype(dtype) for _ in range(2))
    bias = (rng.uniform(0.1, 1.0, H) if kind == "alibi"
            else rng.standard_normal((H, S, S))).astype(dtype)
    return bias, q, k, v, t


def loss_of(t, segments):
    """sum(attention(q, k, v, segments, bias) * t): ``segments`` an array (the packed ends
    as data) or a static tuple."""
    def loss(bias, q, k, v, *e):
        return eins.sum(eins.attention(q, k, v, segments=e[0] if e else segments,
                                       bias=bias) * t)
    return loss


def grad_fn(t, segments=None):
    return eins.value_and_grad(loss_of(t, segments), argnums=(0, 1, 2, 3))


def torch_value_and_grad(kind, bias, q, k, v, t, ends):
    """The packed attention in torch, float64 (kv heads repeated, ALiBi as -slope |j - i|,
    a causal same-document mask), differentiated by torch.autograd."""
    torch = pytest.importorskip("torch")
    tb, tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True)
                      for x in (bias, q, k, v))
    doc = torch.searchsorted(torch.tensor(ends), torch.arange(S), right=True)
    mask = torch.ones(S, S, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
    kk, vv = (a.repeat_interleave(H // HKV, 0) for a in (tk, tv))
    scores = tq @ kk.transpose(1, 2) / math.sqrt(D)
    if kind == "alibi":
        dist = (torch.arange(S)[None, :] - torch.arange(S)[:, None]).abs().double()
        scores = scores - tb[:, None, None] * dist
    else:
        scores = scores + tb
    out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vv
    value = (out * torch.tensor(t, dtype=torch.float64)).sum()
    value.backward()
    return float(value.detach()), [a.grad.numpy() for a in (tb, tq, tk, tv)]


def dbias_eqn(d) -> int:
    (i,) = [n for n, e in enumerate(d.last.lowered.program.eqns)
            if e.prim == "attention_dbias"]
    return i


def dbias_cut(d, args, name="sequence"):
    """The attention_dbias eqn's intervals of ``name`` in the re-cut for ``args``."""
    low = d.last.lowered
    ops = runtime_operands(low.program)
    i = dbias_eqn(d)
    assert i in ops   # the dbias eqn takes the ends from a program input: it is re-cut
    return recut(low.compilation, input_arrays(*args), ops).plan.eqn_plans[i].intervals[name]


def check_stream(kind, d, dtype, name="sequence", after=None):
    """Every batch of STREAM through ``d`` (one compiled value_and_grad): the loss and the
    gradients of the bias, q, k and v equal eins.jit's on the batch's static ends and
    torch's; one trace and one plan, a re-cut per batch whose dbias cuts move. ``after``
    gets ``d.stats()`` after each batch."""
    bias, q, k, v, t = operands(kind, dtype)
    n_acc, depth = tolerance.accumulation(eins.make_ir(grad_fn(t))(
        bias, q, k, v, llama.padded_ends((S,), 8, S)))
    cuts = []
    for n, ends in enumerate(STREAM, 1):
        e = llama.padded_ends(ends, 8, S)
        value, grads = d(bias, q, k, v, e)
        want_value, want = eins.jit(grad_fn(t, ends))(bias, q, k, v)
        torch_value, torch_grads = torch_value_and_grad(kind, bias, q, k, v, t, ends)
        assert_close(float(value), float(want_value), n=n_acc, depth=depth, dtype=dtype)
        assert_close(float(value), torch_value, n=n_acc, depth=depth, dtype=dtype)
        for j, (g, w, tg) in enumerate(zip(grads, want, torch_grads)):
            assert_close(g, w, n=n_acc, depth=depth, err_msg=f"{ends} grad {j}")
            assert_close(g, tg, n=n_acc, depth=depth, dtype=dtype, err_msg=f"{ends} grad {j}")
        st = d.stats()
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 1, n)
        if after is not None:
            after(st)
        cuts.append(dbias_cut(d, (bias, q, k, v, e), name))
    assert_splits(d.last.lowered)
    assert len(cuts[0]) > 1 and len(set(cuts)) >= 3, cuts   # the dbias cuts moved
    return cuts


@pytest.mark.parametrize("devices", [4, 8])
@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_numpy_stream_of_packed_batches_equals_static_jit_and_torch(kind, devices):
    d = eins.distribute(grad_fn(operands(kind, np.float32)[-1]), devices=devices,
                        backend="numpy", tuning=SPREAD)
    check_stream(kind, d, np.float32)


@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_interpret_stream_of_packed_batches_through_one_capacity_program(kind):
    """On "interpret" (the Triton forward, backward and bias gradient under the
    interpreter) with the DEFAULT rebalance: attention_dbias has a capacity form too (an
    additive bias's gradient written at the block's rows, ALiBi slopes' a partial sum each
    block adds to) and a Triton kernel that reads its table row and skips the tiles outside
    its cut (tests/test_attention_dbias_triton.py counts them), so its form masks nothing
    and every batch runs ONE capacity program by default (one lowering, no graph captured
    or kernel compiled after the first batch), the forward, the backward and the bias
    gradient sharing one table, the bias gradient's blocks all run by its Triton kernel;
    each batch equals eins.jit and torch, the cuts moving."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from eins.kernels.attention_dbias import LAUNCHES
    d = eins.distribute(grad_fn(operands(kind, np.float32)[-1]), devices=4,
                        backend="interpret", tuning=SPREAD)
    counts = []
    launches = LAUNCHES["attention_dbias"]
    cuts = check_stream(kind, d, np.float32, after=lambda st: counts.append(
        (st["kernel_compiles"], st["graph_captures"], st["lowerings"])))
    assert len(counts) == len(STREAM) and len(set(counts)) == 1, counts
    assert counts[0][2] == 1 and counts[0][1] >= 1
    cap = d.last.capacity
    assert cap is not None and d.last.rebalance is True and not cap.masks
    i = dbias_eqn(d)
    assert i in cap.inputs and len(set(cap.inputs.values())) == 1   # one shared table
    assert len(set(cuts)) >= 3
    # every capacity block of every call (the first call's eager warm-up too) ran the
    # kernel, not the torch fallback
    blocks = len(cap.comp.plan.eqn_plans[i].spec.fspecs)
    assert blocks == 4 and LAUNCHES["attention_dbias"] - launches == \
        blocks * (len(STREAM) + 1)


def test_a_bias_gradient_the_kernel_does_not_take_keeps_the_compile_time_cuts():
    """float64: attention_dbias's torch fallback runs (the Triton kernel takes float16,
    bfloat16 and float32) and computes its whole capacity block, as costly as attention's
    backward p times over, so by default such a program keeps its compile-time cuts on
    interpret (no re-cut, one lowering) and still equals eins.jit on each batch's static
    ends: its kernels read the ends."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    bias, q, k, v, t = operands("alibi", np.float64)
    d = eins.distribute(grad_fn(t), devices=4, backend="interpret", tuning=SPREAD)
    for ends in STREAM[:2]:
        value, grads = d(bias, q, k, v, llama.padded_ends(ends, 8, S))
        want_value, want = eins.jit(grad_fn(t, ends))(bias, q, k, v)
        np.testing.assert_allclose(float(value), float(want_value), rtol=1e-12)
        for g, w in zip(grads, want):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=str(ends))
    st = d.stats()
    assert d.last.rebalance is False and d.last.capacity is None
    assert (st["rebalances"], st["lowerings"]) == (0, 1)


def bias_grads(kind):
    """The forward saving its lse and the bias gradient, between elementwise eqns (eqns 0-2,
    4, 6, 7: split by rows, so the attention blocks' operands arrive in pieces written in
    place, leaving their other rows as earlier calls left them)."""
    params = dict(causal=True, segments="array", scale=None, bias=kind)

    def f(bias, q, k, v, do, e):
        q, k, v = q * 2.0, k * 2.0, v * 2.0
        o, lse = bind("attention_fwd", q, k, v, bias, e, **params)
        db = bind("attention_dbias", q, k, v, o, lse, do * 1.0, bias, e, **params)
        return db * 2.0, lse * 3.0
    return f


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("float64", 1e-9)],
                         ids=["triton-kernels", "torch-fallbacks"])
@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_interpret_capacity_bias_gradient_never_reads_stale_rows(kind, dtype, tol):
    """The capacity program of the bias gradient on interpret (float32: by default, the
    Triton kernels; float64: rebalance=True, the torch fallbacks), each finite batch after
    one with nan and inf in rows 3-8 and 15 of q, k, v and dO: a call writes only its
    windows, so the capacity buffers keep those values outside them, which the bias
    gradient's kernels must never multiply (they read the rows and keys outside the cut as
    zeros: a slope's partial sum adds exactly 0 for them). Each finite batch equals
    eins.jit, with no RuntimeWarning, through one lowering and one capture."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from eins.kernels.attention_dbias import LAUNCHES
    n_s = 24
    plan = {i: {"b": 4} for i in (0, 1, 2, 4, 7)}
    plan[3] = plan[5] = {"sequence": 4}
    if kind == "add":
        plan[6] = {"b": 4}
    rng = np.random.default_rng(0)
    q, do = (rng.standard_normal((H, n_s, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((HKV, n_s, D)).astype(dtype) for _ in range(2))
    bias = (rng.uniform(0.1, 1.0, H) if kind == "alibi"
            else rng.standard_normal((H, n_s, n_s))).astype(dtype)
    f = bias_grads(kind)
    d = eins.distribute(f, devices=4, plan=plan, backend="interpret",
                        rebalance=True if dtype == "float64" else None)
    ref = eins.jit(f)
    launches = LAUNCHES["attention_dbias"]
    bad = [x.copy() for x in (q, k, v, do)]
    for x in bad:
        x[:, 3:9] = np.nan
        x[:, 15] = np.inf
    for ends in [(9, n_s), (2, 5, n_s), (20, n_s), (12, 16, n_s)]:
        with warnings.catch_warnings():   # nan and inf in the call's own rows: numpy warns
            warnings.simplefilter("ignore", RuntimeWarning)
            d(bias, *bad, llama.padded_ends((n_s,), 6, n_s))
        e = llama.padded_ends(ends, 6, n_s)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = d(bias, q, k, v, do, e)
        for a, b in zip(got, ref(bias, q, k, v, do, e)):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=str(ends))
    st = d.stats()
    assert (st["lowerings"], st["graph_captures"], st["rebalances"]) == (1, 1, 8)
    cap = d.last.capacity
    assert cap is not None and cap.inputs[3] == cap.inputs[5]   # one table for both
    assert cap.masks == (dtype == "float64")
    # the kernel ran every block of every call (the eager first call's too) in float32
    ran = LAUNCHES["attention_dbias"] - launches
    assert ran == (0 if dtype == "float64" else 4 * (8 + 1)), ran


@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_numpy_capacity_program_of_the_bias_gradient(kind):
    """attention_dbias's capacity form on the numpy block kernels (the capacity program run
    by the numpy executor): for each batch's cut, every output equals eins.jit; the forward
    and the bias gradient share one table, whose rows are the cut's query rows and keys
    (ALiBi's form names no output axis, its blocks' slopes being partials over every row:
    the rows come from q's box; an additive bias's gradient is cut by the rows, axis -2)."""
    n_s = 24
    plan = {i: {"b": 4} for i in (0, 1, 2, 4, 7)}
    plan[3] = plan[5] = {"sequence": 4}
    rng = np.random.default_rng(1)
    q, do = (rng.standard_normal((H, n_s, D)) for _ in range(2))
    k, v = (rng.standard_normal((HKV, n_s, D)) for _ in range(2))
    bias = rng.uniform(0.1, 1.0, H) if kind == "alibi" else rng.standard_normal((H, n_s, n_s))
    f = bias_grads(kind)
    low = eins.distribute(f, devices=4, plan=plan).lower(bias, q, k, v, do,
                                                         llama.padded_ends((n_s,), 6, n_s))
    ops = runtime_operands(low.program)
    cap = capacity(low.compilation, ops)
    assert cap.inputs[3] == cap.inputs[5] and cap.masks   # its torch fallback: whole blocks
    assert dict((i, a) for i, a, _ in cap.layout) == {3: -2, 5: None if kind == "alibi"
                                                      else -2}
    dprog = windows(run_passes(cap.comp, PHYSICAL).device, cap)
    verify_device(dprog)
    seen = set()
    for ends in [(5, 11, n_s), (n_s,), (1, 2, 3, 20, n_s), (12, n_s)]:
        arrays = [bias, q, k, v, do, llama.padded_ends(ends, 6, n_s)]
        cut = recut(low.compilation, arrays, ops)
        tables = cap.tables(cut)
        iv = cut.plan.eqn_plans[5].intervals["sequence"]
        assert [tuple(r[:2]) for r in tables[0].tolist()] == [tuple(x) for x in iv]
        got, _ = execute(dprog, arrays + tables)
        for a, b in zip(got, eins.jit(f)(*arrays)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=str(ends))
        seen.add(iv)
    assert len(seen) == 4


@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_capacity_blocks_are_priced_at_their_whole_work(kind):
    """The torch fallback computes a capacity block whole (rows outside the cut zeroed, not
    skipped): the capacity program prices each dbias block so, at the FLOPs of the whole
    eqn (every row and key, one document: the most any batch costs), which the
    compile-time blocks share (their FLOPs sum to it)."""
    f = bias_grads(kind)
    n_s = 24
    plan = {3: {"sequence": 4}, 5: {"sequence": 4}}
    args = operands(kind, np.float64)[:4]
    bias = args[0][..., :n_s, :n_s] if kind == "add" else args[0]
    q, k, v = (x[..., :n_s, :] for x in args[1:])
    low = eins.distribute(f, devices=4, plan=plan).lower(bias, q, k, v, q,
                                                         llama.padded_ends((n_s,), 6, n_s))
    cap = capacity(low.compilation, runtime_operands(low.program))
    e = cap.comp.program.eqns[5]
    ins = [a.type for a in e.inputs]
    outs = [a.type for a in e.outputs]
    whole = DB.flops(ins[:-1], outs, **dict(e.params, rows=False))
    fspecs = cap.comp.plan.eqn_plans[5].spec.fspecs
    assert len(fspecs) == 4
    assert [DB.block_flops(fs, ins, outs, **e.params) for fs in fspecs] == [whole] * 4
    planned = low.compilation.plan.eqn_plans[5].spec.fspecs
    e0 = low.program.eqns[5]
    cut = [DB.block_flops(fs, [a.type for a in e0.inputs], outs, **e0.params)
           for fs in planned]
    assert sum(cut) == whole and max(cut) < whole


SPLITS = [{"sequence": 4}, {"kv_sequence": 4}, {"sequence": 2, "kv_sequence": 2}]


@pytest.mark.parametrize("rebalance", [True, False], ids=["recut", "compile-time-cuts"])
@pytest.mark.parametrize("backend", ["numpy", "interpret"])
@pytest.mark.parametrize("split", SPLITS, ids=["-".join(s) for s in SPLITS])
@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_forced_splits_of_the_bias_gradient(kind, split, backend, rebalance):
    """The dbias eqn forced to a query split, a key split (ALiBi's partials summed by the
    ⊕; an additive bias's blocks tile it) or both, re-cut per batch (its cuts move with
    the ends) or at the compile-time cuts (blocks holding pairs of other documents, which
    the kernels mask by the ends they read from the array): each batch equals eins.jit on
    its static ends (float64: the torch fallbacks on interpret)."""
    if backend == "interpret":
        pytest.importorskip("torch")
        pytest.importorskip("triton")
    bias, q, k, v, t = operands(kind, np.float64, seed=1)
    g = grad_fn(t)
    i = [n for n, e in enumerate(eins.make_ir(g)(bias, q, k, v, llama.padded_ends(
        (S,), 8, S)).eqns) if e.prim == "attention_dbias"][0]
    d = eins.distribute(g, devices=4, plan={i: split}, backend=backend, rebalance=rebalance)
    cuts = []
    for ends in STREAM:
        e = llama.padded_ends(ends, 8, S)
        value, grads = d(bias, q, k, v, e)
        want_value, want = eins.jit(grad_fn(t, ends))(bias, q, k, v)
        np.testing.assert_allclose(value, want_value, rtol=1e-12)
        for j, (a, b) in enumerate(zip(grads, want)):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"{ends} {j}")
        if rebalance:
            cuts.append(tuple(dbias_cut(d, (bias, q, k, v, e), n) for n in split))
    assert dbias_eqn(d) == i and d.last.lowered.plan.eqn_plans[i].splits == split
    assert d.stats()["rebalances"] == (len(STREAM) if rebalance else 0)
    assert len(set(cuts)) >= (3 if rebalance else 0), cuts


def remat_grad_fn(t):
    """grad_fn with the attention checkpointed (its forward, attention_fwd, recomputed in
    the backward)."""
    att = eins.checkpoint(lambda bias, q, k, v, e: eins.attention(q, k, v, segments=e,
                                                                 bias=bias))
    return eins.value_and_grad(lambda bias, q, k, v, e: eins.sum(att(bias, q, k, v, e) * t),
                               argnums=(0, 1, 2, 3))


@pytest.mark.parametrize("kw", [dict(families=True), dict(schedule="optimized"),
                                dict(remat=True)], ids=["families", "optimized", "remat"])
@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_numpy_bias_gradient_with_families_schedule_and_checkpoint(kind, kw):
    """The packed bias gradient with the other features on: two plan families chosen per
    batch, the optimized schedule, the attention checkpointed. Each batch equals eins.jit
    on its static ends."""
    bias, q, k, v, t = operands(kind, np.float64, seed=2)
    kw = dict(kw)
    g = remat_grad_fn(t) if kw.pop("remat", False) else grad_fn(t)
    d = eins.distribute(g, devices=4, tuning=SPREAD, **kw)
    for n, ends in enumerate(STREAM, 1):
        value, grads = d(bias, q, k, v, llama.padded_ends(ends, 8, S))
        want_value, want = eins.jit(grad_fn(t, ends))(bias, q, k, v)
        np.testing.assert_allclose(value, want_value, rtol=1e-12)
        for j, (a, b) in enumerate(zip(grads, want)):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"{ends} {j}")
        st = d.stats()
        assert (st["traces"], st["rebalances"]) == (1, n)
        assert st["plans"] == (2 if kw.get("families") else 1)


# ------------------------------------------------------------------------------ the eqn
def eqn_types(kind, ends=(S,)):
    """The attention_dbias eqn's operand types and params, the ends as data, and the ends
    array of one batch."""
    bias, q, k, v, t = operands(kind, np.float64)
    e = llama.padded_ends(ends, 8, S)
    params = dict(causal=True, segments="array", scale=None, bias=kind)
    o, lse = FWD.impl(q, k, v, bias, e, **params)
    ins = [TensorType(np.shape(x), np.asarray(x).dtype) for x in (q, k, v, o, lse, t, bias, e)]
    return ins, params, (q, k, v, o, lse, t, bias, e)


@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_flops_with_unknown_ends_and_with_the_batch_s(kind):
    """Unknown ends: one causal document of S (its S (S + 1) / 2 pairs per query head);
    re-cut for a batch (runtime_params): that batch's documents' pairs. Per pair and head:
    the scores' and dP's 2 (D + Dv) FLOPs plus PAIR_FLOPS."""
    ins, params, _ = eqn_types(kind)
    per_pair = 2 * (D + D) + PAIR_FLOPS
    assert DB.flops(ins, DB.abstract(*ins, **params), **params) == \
        H * per_pair * S * (S + 1) // 2
    assert DB.runtime_params(params, ins, None) == 7   # the ends: after the bias
    batch = DB.runtime_params(params, ins, {7: llama.padded_ends((10, 20, S), 8, S)})
    assert batch["segments"] == (10, 20, S)
    pairs = 55 + 55 + 12 * 13 // 2
    assert DB.flops(ins, DB.abstract(*ins, **batch), **batch) == H * per_pair * pairs


def test_aligned_ends_sit_at_the_query_cuts():
    """``aligned``: the ends array (at the eqn's ends operand, after o, lse and dO) under
    which query blocks cut at [0, 12), [12, 20), [20, 32) read no other block's keys."""
    ins, params, _ = eqn_types("add")
    got = DB.aligned(params, ins, {"sequence": ((0, 12), (12, 20), (20, 32))})
    assert list(got) == [7]
    np.testing.assert_array_equal(got[7], [12, 20, 32, 32, 32, 32, 32, 32])


@pytest.mark.parametrize("kind", ["add", "alibi"])
def test_torch_fallback_reads_the_ends_like_the_numpy_blocks(kind):
    """On the blocks of a batch's re-cut (query, key and both splits) and on the whole, the
    torch fallback, reading the ends tensor on the device, equals the numpy block kernel
    and the eqn of static ends."""
    torch = pytest.importorskip("torch")
    ends = (3, 5, 17, S)
    ins, params, whole = eqn_types(kind, ends)
    batch = DB.runtime_params(params, ins, {7: whole[-1]})
    ix = DB.indexing(ins, DB.abstract(*ins, **batch), **batch)
    low = DB.lowering()
    for split in ({"sequence": ix.balance["sequence"](4)},
                  {"kv_sequence": ix.balance["kv_sequence"](3)},
                  {"sequence": ix.balance["sequence"](2),
                   "kv_sequence": ix.balance["kv_sequence"](2)}):
        for f in ix.spec(split).fspecs:
            blocks = [np.ascontiguousarray(x[tuple(slice(a, c) for a, c in zip(b.lo, b.hi))])
                      for x, b in zip(whole, f.inputs)]
            (want,) = DB.run_block(f, *blocks, **batch)   # the re-cut eqn's params
            (got,) = low.fallback(f, *(torch.from_numpy(x) for x in blocks), **batch)
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    static = dict(params, segments=ends)
    (want,) = DB.impl(*whole[:-1], **static)
    (got,) = low.fallback(None, *(torch.from_numpy(np.asarray(x)) for x in whole), **params)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(DB.impl(*whole, **params)[0], want, rtol=1e-12, atol=1e-12)


def test_ends_that_do_not_cover_the_sequence_are_named():
    """A batch's ends that stop short of S are an EinsError naming them (a wrong boundary
    would give a wrong gradient, not an error, later)."""
    bias, q, k, v, t = operands("add", np.float64)
    d = eins.distribute(grad_fn(t), devices=4, tuning=SPREAD)
    d(bias, q, k, v, llama.padded_ends((S,), 8, S))
    with pytest.raises(EinsError, match=r"segments \[5, 9, 9, 9, 9, 9, 9, 9\] must be"):
        d(bias, q, k, v, np.array([5, 9, 9, 9, 9, 9, 9, 9], np.int32))
