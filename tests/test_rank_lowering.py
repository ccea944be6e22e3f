"""A rank of ``devices="world"`` lowers only its own device (issue 38): each rank's device IR
equals the whole lowering's instructions for that device, built without the others'."""
import importlib

import numpy as np
import pytest

import eins
from eins.errors import LoweringError
from eins.passes.lower import lower_exchanges
from eins.passes.verify import verify_device
from eins.runtime.ranks import gather_tag, plan_hash, store_layout

# the module, not the pass function eins.passes re-exports under the same name
LOWER = importlib.import_module("eins.passes.lower")
BUILT = ("Agg", "Concat", "Kernel", "Load", "Recv", "Send", "Slice", "Store")


def mlp(x, w1, w2):
    return (eins.relu(x @ w1) @ w2).sum(axis=0)


def args_for(p):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((8 * p, 32)).astype(np.float32),
            rng.standard_normal((32, 16)).astype(np.float32),
            rng.standard_normal((16, 8)).astype(np.float32))


def lowered(p, schedule="naive", plan=None):
    # the first matmul's rows split p ways unless told: its partial sums then move
    plan = {0: {"d0": p}} if plan is None else plan
    return eins.distribute(mlp, devices=p, schedule=schedule, plan=plan).lower(*args_for(p))


@pytest.mark.parametrize("p,schedule,plan", [
    (2, "naive", None), (8, "optimized", None), (8, "naive", None),
    (4, "naive", {0: {"d1": 4}, 2: {"r0": 2}}),   # partial sums on 2 of 4 devices
    (4, "optimized", {0: {"d0": 2, "d1": 2}}),
])
def test_each_rank_lowers_its_own_instructions_alone(p, schedule, plan):
    low = lowered(p, schedule, plan)
    full = low.physical.device
    xir = low.physical.exchange
    assert full.tags > 0   # the plans move data: the tags below are checked on real sends
    for r in full.devices:
        one = lower_exchanges(xir, r)
        assert set(one.code) <= {r} and set(one.bufs) <= {r}
        assert one.code.get(r, []) == full.code.get(r, [])
        assert one.bufs.get(r, {}) == full.bufs.get(r, {})
        # what the rank runtime needs of its peers: their stores, loads and the tag count
        assert store_layout(one) == store_layout(full)
        assert one.load_layout() == full.load_layout()
        assert gather_tag(one) == gather_tag(full) == 1 + max(
            i.tag for c in full.code.values() for i in c if i.kind == "send")
        verify_device(one)
        assert plan_hash(one) == plan_hash(full)
        assert low.rank_device(r).code.get(r, []) == full.code.get(r, [])


@pytest.mark.parametrize("p", [2, 8])
def test_a_rank_builds_only_its_own_instructions(p, monkeypatch):
    low = lowered(p)
    xir = low.physical.exchange
    full = low.physical.device
    built = []
    for name in BUILT:
        cls = getattr(LOWER, name)
        monkeypatch.setattr(LOWER, name,
                            lambda *a, _cls=cls, **k: built.append(_cls) or _cls(*a, **k))
    total = 0
    for r in full.devices:
        built.clear()
        one = lower_exchanges(xir, r)
        mine = [i for i in full.code.get(r, []) if i.kind != "free"]
        assert len(built) == len(mine) > 0
        assert [c.kind for c in built] == [i.kind for i in mine]
        assert one.num_instructions() == len(full.code.get(r, []))
        total += len(built)
    # the ranks' shares add up to the whole program: none built another's instructions
    assert total == sum(i.kind != "free" for c in full.code.values() for i in c)


def test_rank_lowered_programs_run_like_the_whole():
    from eins.runtime.numpy_backend import execute
    low = lowered(4, plan={0: {"d1": 4}, 2: {"r0": 2}})
    full = low.physical.device
    x = args_for(4)
    whole = execute(full, list(x))[0][0]
    np.testing.assert_allclose(whole, np.asarray(mlp_np(*x)), rtol=1e-5, atol=1e-5)
    for r in full.devices:   # stitched from the ranks' own programs, the same program
        full.code[r] = lower_exchanges(low.physical.exchange, r).code.get(r, [])
    assert execute(full, list(x))[0][0].tolist() == whole.tolist()


def mlp_np(x, w1, w2):
    return (np.maximum(x @ w1, 0) @ w2).sum(axis=0)


def test_a_rank_outside_the_plan_is_refused():
    low = lowered(2)
    with pytest.raises(LoweringError, match="rank 5 is not a device of the plan"):
        lower_exchanges(low.physical.exchange, 5)


def test_a_rank_program_is_checked_on_its_own_instructions():
    low = lowered(4, plan={0: {"d1": 4}, 2: {"r0": 2}})
    one = lower_exchanges(low.physical.exchange, 1)
    code = one.code[1]
    k = next(n for n, i in enumerate(code) if i.kind == "kernel")
    del code[k]   # a kernel's output is never written: its reader reads a dead buffer
    with pytest.raises(LoweringError, match="device 1 instruction .* which is not live"):
        verify_device(one)


@pytest.mark.parametrize("schedule", ["naive", "optimized"])
def test_a_rank_reads_the_shared_schedules_and_fires_no_program(schedule, monkeypatch):
    """What every rank derives alike (each exchange program's firing order over all devices,
    the peers' loads) is built once per exchange IR (exchange_schedules); a rank's lowering
    after it fires no exchange program, so its own work follows its own instructions."""
    low = lowered(8, schedule)
    xir = low.physical.exchange
    full = low.physical.device
    fired = LOWER.exchange_schedules(xir)
    assert 0 < fired <= len(xir.exchanges)
    calls = []
    real = LOWER.fired_actions
    monkeypatch.setattr(LOWER, "fired_actions", lambda *a: calls.append(a) or real(*a))
    for r in full.devices:
        one = lower_exchanges(xir, r)
        assert one.code.get(r, []) == full.code.get(r, [])
        assert one.load_layout() == full.load_layout()
    assert calls == []
    # a fresh exchange IR (another process) fires its programs again, once each
    LOWER.exchange_schedules(type(xir)(
        xir.plan, xir.placement, xir.exchanges, xir.schedule, xir.topology))
    assert len(calls) == fired
