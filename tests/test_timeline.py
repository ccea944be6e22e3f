"""The predicted time GPU by GPU (``predicted_time()["timeline_ms"]``,
eins.cost.predict.Timeline): each GPU's kernels one after another, an exchange holding only
the GPUs its program's actions name, from when the last of them reaches it; against hand
sums, and against the eqn-by-eqn total it never exceeds."""
import json
from types import SimpleNamespace as NS

import pytest

import eins
from eins.cost.predict import Timeline, kernel_seconds, out_itemsizes
from eins.cost.predicted import PredictedTime
from eins.hardware.presets import get_topology
from eins.ir.exchange import Exchange
from eins.ir.exprog.syntax import Action
from eins.models import llama
from eins.report.schedule import predicted_schedule


def exchange(seconds, *actions, membership=None):
    """An exchange's fields that the timeline reads, its sites as ``Exchange.sites``
    finds them."""
    x = NS(predicted_s=seconds, program=NS(actions=tuple(actions)),
           membership=membership or {})
    x.sites = lambda: Exchange.sites(x)
    return x


def test_gpus_not_in_an_exchange_go_on_with_their_kernels():
    line = Timeline(get_topology("dgx-h100:4"))
    line.kernels([3.0, 1.0, 1.0, 1.0], [0, 1, 2, 3])   # eqn 0: device 0 is slow
    line.kernels([1.0, 3.0, 1.0, 1.0], [0, 1, 2, 3])   # eqn 1: device 1 is
    assert line.clock == {0: 4.0, 1: 4.0, 2: 2.0, 3: 2.0}
    # device 2 sends to 3: they start at 2 and end at 2.5; 0 and 1 are not held
    line.exchange(exchange(0.5, Action(frozenset({"a"}), 2, ((3,),))))
    assert line.clock == {0: 4.0, 1: 4.0, 2: 2.5, 3: 2.5}
    # a partition's members are the sources; a relay's hops take part: 3 -> 0 -> 1
    line.exchange(exchange(1.0, Action(frozenset({"b"}), "P", ((0,), (1,))),
                           membership={"P": (3,)}))
    assert line.clock == {0: 5.0, 1: 5.0, 2: 2.5, 3: 5.0}
    line.kernels([1.0, 1.0, 1.0, 1.0], [0, 1, 2, 3])
    assert line.end() == 6.0   # eqn by eqn: 3 + 3 + 0.5 + 1 + 1 = 8.5
    # a local ⊕ (an action without hops) holds its site, which computes it; a partition
    # named in a hop holds its members
    line.exchange(exchange(0.5, Action(frozenset({"c", "d"}), 2, ()),
                           Action(frozenset({"e"}), 1, (("Q",),)), membership={"Q": (0,)}))
    assert line.clock == {0: 6.5, 1: 6.5, 2: 6.5, 3: 6.0}


def test_an_exchange_without_a_body_holds_every_gpu_and_a_free_one_none():
    line = Timeline(get_topology("dgx-h100:4"))
    line.kernels([1.0, 2.0], [0, 1])
    line.exchange(exchange(0.0, Action(frozenset({"a"}), 0, ((2,),))))   # costs nothing
    assert line.clock == {0: 1.0, 1: 2.0}
    line.exchange(NS(predicted_s=1.0, program=None, membership={}))
    assert line.clock == {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0}


def test_devices_sharing_a_gpu_share_its_clock():
    topo = get_topology("dgx-h100:2").logical(4)   # devices 0, 2 on GPU 0; 1, 3 on GPU 1
    line = Timeline(topo)
    line.kernels([1.0, 1.0, 2.0, 0.0], [0, 1, 2, 3])
    over = topo.profile.shared_overhead_s if topo.profile is not None else 0.0
    assert line.clock[topo.gpu_of(0)] == pytest.approx(3.0 + 2 * over)
    assert line.clock[topo.gpu_of(1)] == pytest.approx(1.0 + over)


@pytest.mark.parametrize("name", ["1x8K", "8x1K-batch", "1x128K"])
def test_a_balanced_plan_times_the_same_both_ways(name):
    w = llama.WORKLOADS[name]
    fn = eins.distribute(llama.block_fn(llama.PAPER), devices=8, topology="dgx-h100:8")
    t = fn.lower(*w.args(llama.PAPER)).predicted_time()
    assert t["timeline_ms"] == pytest.approx(t["total_ms"], rel=1e-12)


def test_never_above_the_eqn_by_eqn_total_and_at_least_each_gpu_kernels():
    cfg, ends = llama.PAPER, (2048, 4096, 16384)
    args = llama.Workload("x", 1, 16384).args(cfg)
    fn = eins.distribute(llama.block_fn(cfg, ends), devices=4, topology="dgx-h100:4",
                         plan={12: {"sequence": 4}})
    low = fn.lower(*args)
    assert low.program.eqns[12].prim == "attention"
    t = low.predicted_time()
    assert t["timeline_ms"] <= t["total_ms"] * (1 + 1e-12)
    # the attention's rows are balanced by causal work, so its device-by-device kernels
    # differ: the timeline is at least the busiest GPU's kernels
    state = low.physical
    per = {}
    for i, (e, ep) in enumerate(zip(low.program.eqns, low.plan.eqn_plans)):
        for d, f in zip(state.exchange.placement[i], ep.spec.fspecs):
            per[d] = per.get(d, 0.0) + kernel_seconds(e, f, state.exchange.topology,
                                                      out_itemsizes(e, ep.spec))
    assert t["timeline_ms"] >= max(per.values()) * 1e3 * (1 - 1e-12)


def test_the_table_notes_the_timeline_where_it_is_lower():
    t = PredictedTime({"total_ms": 2.0, "compute_ms": 1.5, "exchange_ms": 0.5,
                       "timeline_ms": 1.75, "topology": "dgx-h100:4"})
    assert "total           2.000 ms  GPU by GPU 1.750 ms" in str(t)
    t["timeline_ms"] = 2.0
    assert "GPU by GPU" not in str(t)


def test_kernels_are_priced_on_the_devices_the_schedule_placed_them_on():
    """Under the optimized schedule an eqn's function specifications may be moved, here
    two of them onto one shared GPU (8 logical devices on 4 GPUs): both the eqn-by-eqn
    total and the timeline charge that GPU for both (the total once charged spec f on
    device f, 40% low on this plan), so the timeline stays at or under the total."""
    cfg, ends = llama.PAPER, (2048, 4096, 16384)
    topo = get_topology("dgx-h100:4").logical(8)
    fn = eins.distribute(llama.block_fn(cfg, ends), devices=8, topology=topo,
                         plan={12: {"sequence": 8}}, schedule="optimized")
    low = fn.lower(*llama.Workload("x", 1, 16384).args(cfg))
    state, t = low.physical, low.predicted_time()
    xir = state.exchange
    def gpus(devices):
        return len({topo.gpu_of(d) for d in devices})
    # some eqn's pieces share fewer GPUs as placed than at the naive placement (f on f)
    assert any(gpus(xir.placement[i]) < gpus(low.devices[:len(xir.placement[i])])
               for i in range(len(low.program.eqns)))
    want = 0.0
    for i, (e, ep) in enumerate(zip(low.program.eqns, low.plan.eqn_plans)):
        ks = [kernel_seconds(e, f, topo, out_itemsizes(e, ep.spec)) for f in ep.spec.fspecs]
        want += topo.busy_seconds(ks, xir.placement[i])
    assert t["compute_ms"] == pytest.approx(want * 1e3, rel=1e-9)
    assert t["timeline_ms"] <= t["total_ms"] * (1 + 1e-12)
    # the predicted schedule (the plan's report and trace) charges its compute phases alike
    assert predicted_schedule(state).total_s * 1e3 == pytest.approx(t["total_ms"], rel=1e-9)


def test_the_trace_draws_each_gpu_as_the_timeline_times_it(tmp_path):
    """The plan's trace (``Lowered.trace``) has a track per GPU: the timeline's spans, a
    GPU's one after another (its kernels and the exchanges it is in never overlap), the
    last ending at ``timeline_ms``; every kernel of the plan on it once, at its GPU's
    busy time."""
    cfg, ends = llama.PAPER, (2048, 4096, 16384)
    fn = eins.distribute(llama.block_fn(cfg, ends), devices=4, topology="dgx-h100:4",
                         plan={12: {"sequence": 4}})
    low = fn.lower(*llama.Workload("x", 1, 16384).args(cfg))
    t = low.predicted_time()
    evs = json.load(open(low.trace(tmp_path / "plan.json")))["traceEvents"]
    gpu = [e for e in evs if e["ph"] == "X" and e["pid"] == 2]
    assert max(e["ts"] + e["dur"] for e in gpu) / 1e3 == pytest.approx(t["timeline_ms"],
                                                                        rel=1e-9)
    for g in {e["tid"] for e in gpu}:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu if e["tid"] == g)
        assert all(b <= c * (1 + 1e-12) for (_, b), (c, _) in zip(spans, spans[1:]))
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    state = low.physical
    for i, (e, ep) in enumerate(zip(low.program.eqns, low.plan.eqn_plans)):
        ks = [kernel_seconds(e, f, state.exchange.topology, out_itemsizes(e, ep.spec))
              for f in ep.spec.fspecs]
        mine = sorted(k["dur"] for k in kernels if k["name"] == f"eqn {i} {e.prim}")
        assert mine == pytest.approx(sorted(k * 1e6 for k in ks if k), rel=1e-9)
