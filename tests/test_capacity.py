"""The capacity program of a rebalanced plan family (issue 36, eins/passes/capacity.py): one
device program whose blocks span every cut and compute only the rows a per-call table gives
them. Run here by the numpy executor (the GPU backends run the same device IR:
tests/test_packed_interpret.py), against eins.jit and against the per-cut re-cut."""
import numpy as np
import pytest

import eins
from eins.errors import ShapeError
from eins.ir.primitive import get_primitive
from eins.ir.types import TensorType
from eins.models import llama
from eins.passes import PHYSICAL, run_passes
from eins.passes.capacity import capacity
from eins.passes.rebalance import recut, runtime_operands
from eins.runtime.numpy_backend import execute

S = 24
BATCHES = [(5, 11, 24), (24,), (1, 2, 3, 20, 24), (12, 24), (23, 24), (4, 8, 12, 16, 24)]


def attn(q, k, v, e):
    return eins.attention(q, k, v, segments=e)


def qkv(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, S, 8)).astype(dtype),
            rng.standard_normal((2, S, 8)).astype(dtype),
            rng.standard_normal((2, S, 8)).astype(dtype))


def family(plan, q, k, v):
    low = eins.distribute(attn, devices=4, plan=plan).lower(
        q, k, v, llama.padded_ends(BATCHES[0], 6, S))
    ops = runtime_operands(low.program)
    return low, ops, capacity(low.compilation, ops)


@pytest.mark.parametrize("plan", [{0: {"sequence": 4}}, {0: {"heads_kv": 2, "sequence": 2}}])
def test_capacity_program_equals_jit_for_every_cut(plan):
    q, k, v = qkv()
    low, ops, cap = family(plan, q, k, v)
    dprog = run_passes(cap.comp, PHYSICAL).device
    ref = eins.jit(attn)
    cuts = set()
    for ends in BATCHES:
        e = llama.padded_ends(ends, 6, S)
        cut = recut(low.compilation, [q, k, v, e], ops)
        tables = cap.tables(cut)
        outs, _ = execute(dprog, [q, k, v, e] + tables)
        np.testing.assert_allclose(outs[0], ref(q, k, v, e), rtol=1e-12, atol=1e-12)
        cuts.add(cut.plan.eqn_plans[0].intervals["sequence"])
    assert len(cuts) > 3   # the cuts moved; the program did not


@pytest.mark.parametrize("kw", [{"window": 5}, {"causal": False}, {"softcap": 2.0},
                                {"mask": "keys"}])
def test_capacity_program_with_attention_options(kw):
    """A window, no causal mask, a softcap, a key-padding mask (an operand before the ends
    and the table): each capacity block's rows equal the whole attention's."""
    q, k, v = qkv(5)
    if kw.get("mask"):
        m = np.random.default_rng(5).random(S) > 0.3
        m[0] = True
        kw = {"mask": m}

    def f(q, k, v, e):
        return eins.attention(q, k, v, segments=e, **kw)
    low = eins.distribute(f, devices=4, plan={0: {"sequence": 4}}).lower(
        q, k, v, llama.padded_ends((S,), 6, S))
    ops = runtime_operands(low.program)
    cap = capacity(low.compilation, ops)
    dprog = run_passes(cap.comp, PHYSICAL).device
    for ends in BATCHES[:4]:
        e = llama.padded_ends(ends, 6, S)
        tables = cap.tables(recut(low.compilation, [q, k, v, e], ops))
        outs, _ = execute(dprog, [q, k, v, e] + tables)
        np.testing.assert_allclose(outs[0], eins.jit(f)(q, k, v, e), rtol=1e-12,
                                   atol=1e-12)


def test_tables_are_the_recut_intervals():
    """Row j of the table is function specification j's query rows in the re-cut plan."""
    q, k, v = qkv(1)
    low, ops, cap = family({0: {"heads_kv": 2, "sequence": 2}}, q, k, v)
    assert [(i, axis, n) for i, axis, n in cap.layout] == [(0, -2, 4)]
    e = llama.padded_ends((1, 2, 3, 20, 24), 6, S)
    cut = recut(low.compilation, [q, k, v, e], ops)
    (table,) = cap.tables(cut)
    seq = cut.plan.eqn_plans[0].intervals["sequence"]
    # heads outer, sequence inner; each row's query rows, then the keys they attend to
    assert table[:, :2].tolist() == [list(iv) for iv in seq] * 2
    assert seq == ((0, 15), (15, 24))   # re-cut for the batch, not equal tokens
    # rows [15, 24) lie in the documents [3, 20) and [20, 24): keys from 3
    assert table[:, 2:].tolist() == [[0, 15], [3, 24]] * 2


def test_capacity_blocks_span_the_sequence_and_sum():
    """The capacity form's blocks hold every query row and key, their output copies are
    summed, and each reads its own row of the table (a program input after the family's)."""
    q, k, v = qkv(2)
    low, ops, cap = family({0: {"sequence": 4}}, q, k, v)
    prog = cap.comp.program
    assert len(prog.inputs) == len(low.program.inputs) + 1
    assert prog.inputs[-1].type == TensorType((4, 4), np.dtype(np.int64))   # rows, keys
    spec = cap.comp.plan.eqn_plans[0].spec
    assert spec.aggs == ("sum",)
    for j, f in enumerate(spec.fspecs):
        assert f.inputs[0].lo[-2] == 0 and f.inputs[0].hi[-2] == S
        assert f.inputs[1].lo[-2] == 0 and f.inputs[1].hi[-2] == S
        assert (f.inputs[-1].lo, f.inputs[-1].hi) == ((j, 0), (j + 1, 2))


@pytest.mark.parametrize("plan", [{0: {"kv_sequence": 4}}, {0: {"heads_kv": 2}}])
def test_no_capacity_form(plan):
    """A key split (its partials are lse pairs) has no capacity form; a heads split cuts
    nothing per call and needs none."""
    q, k, v = qkv(3)
    _, ops, cap = family(plan, q, k, v)
    assert ops and cap is None


def test_block_kernel_zeroes_rows_outside_the_table():
    q, k, v = qkv(4)
    e = llama.padded_ends((5, 11, 24), 6, S)
    prim = get_primitive("attention")
    want = eins.jit(attn)(q, k, v, e)
    low, _, cap = family({0: {"sequence": 4}}, q, k, v)
    eqn = cap.comp.program.eqns[0]
    f = cap.comp.plan.eqn_plans[0].spec.fspecs[1]
    (got,) = prim.run_block(f, q, k, v, e, np.array([[7, 15]]), **eqn.params)
    np.testing.assert_allclose(got[:, 7:15], want[:, 7:15], rtol=1e-12, atol=1e-12)
    assert not got[:, :7].any() and not got[:, 15:].any()


def test_bad_row_table_named():
    prim = get_primitive("attention")
    t = TensorType
    q, kv = t((4, S, 8), np.dtype(np.float32)), t((2, S, 8), np.dtype(np.float32))
    ends = t((6,), np.dtype(np.int64))
    params = dict(causal=True, segments="array", rows=True)
    with pytest.raises(ShapeError, match="row table"):
        prim.abstract(q, kv, kv, ends, t((4, 3), np.dtype(np.int64)), **params)
    with pytest.raises(ShapeError, match="row table"):
        prim.abstract(q, kv, kv, ends, t((4, 2), np.dtype(np.float32)), **params)
