"""Incremental lowering of a re-cut plan family (eins/passes/relower.py, issue 36): each
batch's program lowered from the family's first lowering runs to exactly what the physical
passes from scratch give, passes the verifier, is priced the same, and keeps the family's
code for the eqns the re-cut cannot reach."""
from dataclasses import replace

import numpy as np
import pytest

import eins
from eins.cost.predict import predict
from eins.ir.device import Kernel, Load
from eins.models import llama
from eins.passes import PHYSICAL, PLANNING, overlay, place, run_passes
from eins.passes.rebalance import recut, runtime_operands, specialize
from eins.passes.overlay import moves_nothing
from eins.passes.relower import Family, relower, relower_device
from eins.passes.synthesize.preamble import naive_program
from eins.passes.verify import verify
from eins.runtime.numpy_backend import execute
from helpers import SPREAD, input_arrays, packed_call

CFG = llama.TINY
S, P = 64, 8
STREAM = [(64,), (10, 30, 64), (3, 5, 40, 41, 64), (50, 64), (8, 16, 24, 32, 40, 48, 64)]
LOWER = tuple(p for p in PHYSICAL if p is not verify)


def family(plan):
    rng = np.random.default_rng(0)
    w = llama.init_weights(CFG, rng)
    x = rng.standard_normal((S, CFG.d_model)).astype(np.float32)
    ends = llama.padded_ends(STREAM[1], 8, S)
    cos, sin = llama.rope_tables(S, CFG.head_dim, ends)
    low = eins.distribute(llama.packed_block_fn(CFG), devices=P,
                          tuning=SPREAD).lower(x, w, cos, sin, ends)
    ops = runtime_operands(low.program)
    arrays = input_arrays(x, w, cos, sin, ends)
    comp = replace(low.compilation, program=specialize(low.program, arrays, ops), plan=None)
    if plan is not None:
        comp = replace(comp, options=replace(comp.options, plan=plan))
    return run_passes(comp, PLANNING), ops, (x, w)


def batch(x, w, ends):
    return packed_call(CFG, S, x, w, ends)


# the attention split by its kv heads (its boxes do not depend on the ends: no re-cut moves
# them) or by its sequence over every device (each batch's ends move the cuts)
@pytest.mark.parametrize("split", [{"heads_kv": 2}, {"sequence": P}],
                         ids=["heads_kv", "sequence"])
def test_relowered_equals_lowered_from_scratch(split):
    planned, ops, arrays = family(None)
    (att, _), = ops.items()
    planned, ops, arrays = family({att: split})
    assert any(len(p.spec.fspecs) > 1 for p in planned.plan.eqn_plans)   # distributed
    fam = Family(planned)
    moves = 0
    for ends in STREAM:
        call = batch(*arrays, ends)
        args = input_arrays(*call)
        comp = recut(planned, args, ops)
        got = relower(fam, comp, ops)
        verify(got)
        full = run_passes(comp, LOWER)
        assert got.device.num_instructions() == full.device.num_instructions()
        assert predict(got)["total_ms"] == predict(full)["total_ms"]
        assert [x.predicted_s for x in got.exchange.exchanges] == \
            [x.predicted_s for x in full.exchange.exchanges]
        outs, _ = execute(got.device, args)
        want, _ = execute(full.device, args)
        for a, b in zip(outs, want):
            np.testing.assert_array_equal(a, b)
        # float32 sums in another order than one device's (as test_packed's stream)
        np.testing.assert_allclose(outs[0], eins.jit(llama.block_fn(CFG, ends))(*call[:4]),
                                   rtol=1e-5, atol=1e-5)
        # unpriced: the same program, its new exchanges without a simulated time; where
        # the attention's boxes are the family's (its heads split) nothing is new
        bare = relower(fam, comp, ops, priced=False)
        assert bare.device.as_text() == got.device.as_text()
        # what a call runs: the same instructions and buffers, no exchange built for the
        # inputs read where they were written
        dev = relower_device(fam, comp, ops)
        assert (dev.code, dev.bufs) == (bare.device.code, bare.device.bufs)
        assert dev.exchange is None
        moved = comp.plan.eqn_plans[att].spec.fspecs != planned.plan.eqn_plans[att].spec.fspecs
        assert any(x.predicted_s is None for x in bare.exchange.exchanges) == moved
        moves += moved
    # the family was planned on STREAM[1]: that batch alone keeps its boxes
    assert moves == (0 if "heads_kv" in split else len(STREAM) - 1)


def test_relower_keeps_the_family_code_before_the_recut_eqn():
    planned, ops, _ = family(None)
    (att, _), = ops.items()
    planned, ops, arrays = family({att: {"sequence": P}})
    fam = Family(planned)
    comp = recut(planned, input_arrays(*batch(*arrays, STREAM[2])), ops)
    got = relower(fam, comp, ops)
    # every device: an eqn the re-cut cannot reach keeps the family's very instructions
    # (its kernels and exchanges are not lowered again); the attention's are new
    for d in planned.devices:
        ids = {id(x) for x in got.device.code[d]}
        redone = {c for c, code in fam.lowerer.chunk_code.items()
                  if code.get(d) and not all(id(x) in ids for x in code[d])}
        assert att in redone and 0 not in redone
        assert len(redone) <= 3, redone   # the attention, its consumer, the outputs at most


def test_a_rank_relowers_its_own_instructions_alone():
    """A rank of devices="world" re-lowers its own device only: each instruction equal to
    the whole re-lowering's for that device, and its peers' layouts (what the gather and the
    re-layout of Sharded inputs read) and the tag count equal to a whole lowering's."""
    planned, ops, _ = family(None)
    (att, _), = ops.items()
    planned, ops, arrays = family({att: {"sequence": P}})
    whole = Family(planned)
    ranks = {r: Family(planned, r) for r in planned.devices}
    with pytest.raises(ValueError, match="rank 3's family re-lowers through relower"):
        relower_device(ranks[3], recut(planned, input_arrays(*batch(*arrays, STREAM[0])), ops),
                       ops)
    for ends in STREAM[:3]:
        comp = recut(planned, input_arrays(*batch(*arrays, ends)), ops)
        full = relower(whole, comp, ops, priced=False).device
        scratch = run_passes(comp, LOWER).device
        assert full.num_instructions() > 0
        for r, fam in ranks.items():
            one = relower(fam, comp, ops, priced=False).device
            assert set(one.code) <= {r}
            assert one.code.get(r, []) == full.code.get(r, [])
            assert one.bufs.get(r, {}) == full.bufs.get(r, {})
            assert one.store_layout() == full.store_layout() == scratch.store_layout()
            assert one.load_layout() == full.load_layout() == scratch.load_layout()
            assert one.tag_count() == full.tag_count() > 0


def _loads(dprog, d) -> list:
    return sorted((ins.source, repr(ins.box)) for ins in dprog.code.get(d, [])
                  if isinstance(ins, Load))


def test_a_recut_program_loads_only_its_own_blocks():
    """Attention reading the program's inputs, split by query sequence: a re-cut batch loads
    exactly the blocks its own cut reads (what the physical passes from scratch load), not
    also the family's first cut's, on the whole program and on each rank (whose peers'
    load table, which the re-layout of Sharded inputs reads, lists every block it loads)."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 32, 8)).astype(np.float32) for _ in range(3))
    low = eins.distribute(lambda q, k, v, e: eins.attention(q, k, v, causal=True, segments=e),
                          devices=2, plan={0: {"sequence": 2}}).lower(
        q, k, v, llama.padded_ends((16, 32), 8, 32))
    ops = runtime_operands(low.program)
    whole = Family(low.compilation)
    ranks = {r: Family(low.compilation, r) for r in (0, 1)}
    for ends in [(5, 20, 32), (2, 3, 30, 32), (12, 32)]:
        args = input_arrays(q, k, v, llama.padded_ends(ends, 8, 32))
        comp = recut(low.compilation, args, ops)
        scratch = run_passes(comp, LOWER).device
        got = relower(whole, comp, ops, priced=False).device
        assert got.num_instructions() == scratch.num_instructions()
        for r, fam in ranks.items():
            one = relower(fam, comp, ops, priced=False).device
            assert _loads(got, r) == _loads(one, r) == _loads(scratch, r)
            assert _loads(one, r) == sorted((s, repr(b)) for s, b in one.load_layout()[r])
        outs, _ = execute(got, args)
        want = eins.jit(lambda q, k, v: eins.attention(q, k, v, causal=True,
                                                       segments=ends))(q, k, v)
        np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-6)


def test_an_exchange_that_moves_nothing_gets_an_empty_body_and_no_instruction():
    """``Exchange.local`` (each block read where its producer wrote it: the token-wise eqns
    of the sequence split, cut alike): synthesis gives it the naive body the general path
    gives (no action) and lowering emits nothing for it, each kernel reading its producer's
    kernel output as it is; the attention's key and value exchanges are not local."""
    planned, ops, _ = family(None)
    (att, _), = ops.items()
    planned, ops, arrays = family({att: {"sequence": P}})
    comp = recut(planned, input_arrays(*batch(*arrays, STREAM[2])), ops)
    pre = overlay(place(comp)).exchange
    got = run_passes(comp, LOWER)
    kernels = {(d, ins.eqn, ins.fspec): ins for d, code in got.device.code.items()
               for ins in code if isinstance(ins, Kernel)}
    bodies = {(x.eqn, x.input): x for x in got.exchange.exchanges}
    assert len(bodies) > len(pre.exchanges) / 2   # the rest served by an earlier exchange
    local = 0
    for x in pre.exchanges:
        bodied = bodies.get((x.eqn, x.input))
        if bodied is None:
            continue
        sites = [got.placement[x.eqn][f] if x.eqn >= 0 else bodied.membership[p][0]
                 for f, (p, _) in enumerate(x.needs)]
        if x.eqn >= 0:   # told from the blocks alone (all cut along the sequence here)
            assert moves_nothing(comp.plan, got.placement, x.eqn, x.input,
                                 (x.producer, x.out_pos)) == x.local(sites)
        fixed = {p.name: p.members for p in x.preamble.partitions}
        assert bodied.program == naive_program(x.preamble, fixed)
        assert bodied.local(sites) == (not bodied.program.actions and x.local(sites))
        if not x.local(sites) or x.eqn < 0:
            continue
        local += 1
        assert not x.local(sites[1:] + sites[:1])   # each block needed on another device
        fspecs = comp.plan.eqn_plans[x.eqn].spec.fspecs
        made = comp.plan.eqn_plans[x.producer].spec.fspecs
        for f, cp in enumerate(x.copies):
            reads = kernels[(sites[f], x.eqn, fspecs[f])].ins[x.input]
            assert reads == kernels[(cp.device, x.producer, made[cp.fspec])].outs[x.out_pos]
    assert local >= 10
    assert not any(x.local(got.placement[att]) for x in pre.for_eqn(att)[1:])
