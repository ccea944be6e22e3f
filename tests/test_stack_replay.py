"""The layers of a stack lower, verify and are predicted through their repeats (issue 38):
each fast path must give what the plain one gives, instruction by instruction, and the
distributed stack must compute what one device does."""
import gc
import weakref
from dataclasses import replace

import numpy as np
import pytest

import eins
from eins.cost.predict import kernel_seconds, memory, out_itemsizes, predict
from eins.errors import LoweringError
from eins.ir.device import Free, Send, Slice, Window
from eins.models import llama
from eins.passes import PROMOTE_AT, overlay, place, run_passes
from eins.passes.overlay import placed
from eins.passes.synthesize.caches import prog_key
from eins.passes.lower import Lowerer
from eins.passes.verify import verify_device, verify_exchanges

from tests.helpers import SPREAD, assert_splits

CFG = llama.TINY


def stack(x, weights, cos, sin):
    for w in weights:
        x = llama.block(x, w, cos, sin, CFG)
    return x


def stack_np(x, weights, cos, sin):
    for w in weights:
        x = llama.reference_block(x, w, cos, sin, CFG)
    return x


def stack_args(blocks, seq=16):
    rng = np.random.default_rng(3)
    ws = [llama.init_weights(CFG, rng, "float32") for _ in range(blocks)]
    x = (rng.standard_normal((1, seq, CFG.d_model)) / 2).astype(np.float32)
    cos, sin = llama.rope_tables(seq, CFG.head_dim, None, dtype="float32")
    return x, ws, cos, sin


def lowered(p, schedule, blocks=3, topology=None):
    topology = topology or ("dgx-h100:2x4" if p == 8 else "dgx-h100:4")
    f = eins.distribute(stack, devices=p, topology=topology, schedule=schedule, tuning=SPREAD)
    low = f.lower(*stack_args(blocks))
    assert_splits(low)
    return low


@pytest.mark.parametrize("p,schedule", [(4, "naive"), (4, "optimized"), (8, "naive"),
                                        (8, "optimized")])
def test_replayed_layers_lower_as_if_lowered_afresh(p, schedule):
    low = lowered(p, schedule)
    fast = low.physical.device
    plain_lowerer = Lowerer(low.physical.exchange, replay=False)
    plain = plain_lowerer.run()
    assert plain_lowerer.templates == {}
    assert fast.code == plain.code   # every device's instructions, in order, frees included
    assert fast.bufs == plain.bufs
    assert (fast.tags, fast.stores, fast.loads) == (plain.tags, plain.stores, plain.loads)
    assert memory(fast) == memory(plain)
    # a re-lowering's policy (eins/passes/relower.py): the second exchange of a shape
    # recorded, the third on replayed; the same program
    later = Lowerer(low.physical.exchange)
    later.RECORD_AFTER = 1
    got = later.run()
    # a built template: not a count of plain lowerings, nor a recording still pending
    assert any(not isinstance(t, (int, tuple)) for t in later.templates.values())
    assert (got.code, got.bufs, got.tags) == (plain.code, plain.bufs, plain.tags)


@pytest.mark.parametrize("p,schedule", [(4, "naive"), (8, "optimized")])
def test_frees_follow_each_buffers_last_use(p, schedule):
    """The lowering's frees are the rule's: after the instruction that reads a buffer last
    (that writes it, when nothing reads it), several there in name order."""
    dev = lowered(p, schedule).physical.device
    for d, code in dev.code.items():
        plain = [ins for ins in code if not isinstance(ins, Free)]
        last = {}
        for n, ins in enumerate(plain):
            for b in ins.uses():
                last[b] = n
            for b in ins.defs():
                last.setdefault(b, n)
        after = {}
        for b, n in last.items():
            after.setdefault(n, []).append(b)
        want = []
        for n, ins in enumerate(plain):
            want += [ins] + [Free(b) for b in sorted(after.get(n, ()))]
        assert code == want


def test_the_stack_replays_exchanges():
    """The fast path is taken: a lowering records far fewer templates than it lowers
    exchanges (the layers after the first replay theirs)."""
    low = lowered(8, "optimized")
    lowerer = Lowerer(low.physical.exchange)
    lowerer.run()
    n = len(low.physical.exchange.exchanges)
    assert 0 < len(lowerer.templates) < n / 2


@pytest.mark.parametrize("p,schedule", [(4, "optimized"), (8, "naive")])
def test_a_replayed_stack_computes_what_one_device_does(p, schedule):
    args = stack_args(3)
    low = lowered(p, schedule)
    got = np.asarray(low.compile()(*args))
    np.testing.assert_allclose(got, stack_np(*args), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("p,schedule,kind", [(4, "naive", Send), (8, "optimized", Slice)])
def test_verify_names_a_read_of_a_freed_buffer(p, schedule, kind):
    """verify_device checks sends, receives and slices on a path of their own (most of a
    big program's instructions): one reading a buffer after its free is still named."""
    dev = lowered(p, schedule).physical.device
    code = {d: list(c) for d, c in dev.code.items()}
    d, n, ins = next((d, n, i) for d, c in code.items() for n, i in enumerate(c)
                     if isinstance(i, kind))
    code[d].insert(n, Free(ins.src))
    with pytest.raises(LoweringError, match=rf"^device {d} instruction {n + 1} \(.*\) reads "
                                            rf"{ins.src}, which is not live$"):
        verify_device(replace(dev, code=code))


def test_the_passes_pause_the_collector_and_restore_it():
    """run_passes turns cyclic garbage collection off while the passes run (their objects
    are acyclic and millions) and back to what it was after, a failing pass included."""
    seen = []

    def probe(state):
        seen.append(gc.isenabled())
        return state

    def failing(state):
        raise LoweringError("a pass failed")

    assert gc.isenabled()
    run_passes(None, (probe,))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(LoweringError, match="a pass failed"):
        run_passes(None, (probe, failing))
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:   # a caller that had it off keeps it off
        run_passes(None, (probe,))
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Cycle:
    """A node of a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def test_the_passes_move_a_big_runs_survivors_to_the_oldest_generation():
    """A pass run that leaves PROMOTE_AT or more new objects hands them to the oldest
    generation (none left young for the next collections to walk); a small run leaves the
    collector as it was."""
    kept = []

    def big(state):
        kept.extend([i] for i in range(PROMOTE_AT))
        return state

    gc.collect()
    run_passes(None, (big,))
    assert gc.get_count()[0] < 1000   # nothing young left to scan
    gen2 = {id(o) for o in gc.get_objects(generation=2)}
    assert id(kept[0]) in gen2 and id(kept[-1]) in gen2

    def small(state):
        kept.append([1])
        return state

    run_passes(None, (small,))
    assert id(kept[-1]) not in {id(o) for o in gc.get_objects(generation=2)}


def test_promoted_cyclic_garbage_is_collected_by_a_loop_of_big_runs():
    """Cyclic garbage moved to the oldest generation is freed by a full collection once the
    objects so moved outnumber the live ones: a loop of big pass runs cannot pile it up."""
    dead = []

    def big(state):
        junk = [_Cycle() for _ in range(PROMOTE_AT)]
        weakref.finalize(junk[0], dead.append, 1)
        for c in junk:   # each its own cycle: garbage once this pass returns
            c.me = c
        keep = [[i] for i in range(PROMOTE_AT)]
        return keep

    gc.collect()
    alive = len(gc.get_objects())
    runs = 0
    while not dead and runs < 2 * (alive // PROMOTE_AT + 2):   # promoted > alive by then
        run_passes(None, (big,))
        runs += 1
    assert len(dead) == runs   # every run's garbage freed by one full collection


def test_verify_names_a_windowed_send_whose_table_is_not_live():
    """A windowed send (the capacity program's) reads its window's table too: the sends'
    own path leaves it to the general check, which names the table."""
    dev = lowered(4, "naive").physical.device
    code = {d: list(c) for d, c in dev.code.items()}
    d, n, send = next((d, n, i) for d, c in code.items() for n, i in enumerate(c)
                      if isinstance(i, Send))
    code[d][n] = replace(send, window=Window(0, "win9", ((0, 0),), ((0, 1),)))
    with pytest.raises(LoweringError, match=rf"^device {d} instruction {n} \(.*\) reads "
                                            rf"win9, which is not live$"):
        verify_device(replace(dev, code=code))


def test_placed_preambles_built_once_equal_those_built_afresh():
    """``placed`` builds each moved preamble once for the layers that share it: what a later
    layer gets is what an exchange of its own preamble object would get, under two different
    moves, and the layers then share the placed preamble (synthesis keys it once)."""
    low = lowered(8, "optimized")
    xir = run_passes(low.compilation, (place, overlay)).exchange
    p = len(low.compilation.devices)
    ring = {i: tuple((d + 1) % p for d in devs) for i, devs in xir.placement.items()}
    flip = {i: tuple(reversed(devs)) for i, devs in xir.placement.items()}
    shared, n = {}, 0
    for x in xir.exchanges:
        if x.eqn < 0:
            continue
        for moved in (ring, flip):
            got = placed(x, moved)
            afresh = placed(replace(x, preamble=replace(x.preamble)), moved)
            assert got.preamble == afresh.preamble and got.copies == afresh.copies
            assert got.preamble is not x.preamble   # every site moved
            assert {a.site for a in got.preamble.inputs} <= set(moved[x.producer])
            shared.setdefault((id(x.preamble), moved is ring), set()).add(id(got.preamble))
            n += 1
    assert len(shared) < n / 2   # three layers: most exchanges share a preamble
    assert all(len(xs) == 1 for xs in shared.values())
    pre = xir.exchanges[0].preamble
    assert prog_key(pre) is prog_key(pre)
    assert prog_key(replace(pre)) == prog_key(pre)


def test_predicted_kernels_of_repeated_layers_equal_each_priced_alone():
    """predict prices an eqn's kernels once per spec object and operand types (the layers
    repeat them): every eqn's compute time is what pricing its own kernels gives."""
    low = lowered(8, "optimized")
    state, topo = low.physical, low.physical.exchange.topology
    rows = predict(state)["per_eqn"]
    specs = [ep.spec for ep in state.plan.eqn_plans]
    assert len({id(s) for s in specs}) < len(specs) / 2   # the layers share specs
    for i, (eqn, spec) in enumerate(zip(state.program.eqns, specs)):
        sizes = out_itemsizes(eqn, spec)
        alone = topo.busy_seconds([kernel_seconds(eqn, f, topo, sizes) for f in spec.fspecs],
                                  state.devices)
        assert rows[i]["compute_ms"] == alone * 1e3


def test_verify_checks_a_later_layers_exchange_under_its_own_membership():
    """verify_exchanges checks a program once per membership (the layers share programs):
    a later layer's exchange with another membership than the first's is still checked."""
    xir = lowered(8, "optimized").physical.exchange
    first = {}
    for n, x in enumerate(xir.exchanges):
        if id(x.program) in first and x.eqn >= 0:
            break
        first.setdefault(id(x.program), n)
    else:
        raise AssertionError("no two exchanges share a program")
    pname = next(iter(x.membership))
    bad = replace(x, membership={**x.membership, pname: (99,)})
    exchanges = list(xir.exchanges)
    exchanges[n] = bad
    with pytest.raises(LoweringError, match=rf"^exchange of {x.var_name} into eqn {x.eqn} "
                                            rf".*: partition '{pname}' is declared as .* but "
                                            rf"membership gives \(99,\)$"):
        verify_exchanges(replace(xir, exchanges=tuple(exchanges)))
    verify_exchanges(xir)   # as lowered, every exchange passes
