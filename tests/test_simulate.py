"""The exchange-program simulator (issue 3; paper Section 5.2, Examples 5.1-5.3).

Programs are built from the AST directly so these tests do not depend on the parser. Expected
times are hand formulas: a lone transfer takes bytes / bandwidth, an aggregation takes
(operand bytes read + result bytes written) / HBM bandwidth.
"""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eins.errors import ExProgError, TopologyError
from eins.hardware.fair_share import max_min_rates, route_fair_rates
from eins.hardware.simulate import simulate
from eins.hardware.presets import get_topology
from eins.hardware.topology import Topology
from eins.ir.exprog import (Action, AtomDecl, ExProg, Partition, Requirement, action_key,
                             hop_fault)

GB = 1e9
H100_LINK, H100_HBM = 450 * GB, 3350 * GB
NVLINK_LAT = 3.4e-6   # the default per-transfer latency over NVLink/NVSwitch (NCCL's model)


def _bare(name):
    """A preset under the paper's model (no per-transfer latency): Examples 5.1-5.3 and the
    hand formulas of this file; the latency has tests of its own below."""
    return get_topology(name).without_latency()
V100_HBM = 900 * GB


def act(agg, src, *hops):
    return Action(frozenset(agg.split("+")), src, tuple(tuple(h) for h in hops))


def prog(gpus, atoms, outs, actions, partitions=()):
    """atoms: {name: site} or {name: (site, bytes)}; outs: [(agg, targets)]."""
    decls = tuple(AtomDecl(n, *(v if isinstance(v, tuple) else (v,))) for n, v in atoms.items())
    reqs = tuple(Requirement(frozenset(a.split("+")), tuple(t)) for a, t in outs)
    return ExProg(tuple(gpus), tuple(partitions), decls, reqs, tuple(actions))


EX51 = prog([0, 1], {"A": 0, "B": 1}, [("A+B", [0, 1])],
            [act("A", 0, [1]), act("B", 1, [0]), act("A+B", 0), act("A+B", 1)])

EX52_ACTIONS = [act("A", 0, [1]), act("B", 1, [0]), act("C", 2, [3]), act("D", 3, [2]),
                act("A+B", 0, [2]), act("A+B", 1, [3]), act("C+D", 2, [0]),
                act("C+D", 3, [1])] + [act("A+B+C+D", s) for s in range(4)]
EX52 = prog(range(4), {"A": 0, "B": 1, "C": 2, "D": 3}, [("A+B+C+D", [0, 1, 2, 3])],
            EX52_ACTIONS)

EX53 = prog(range(8), dict(zip("ABCDEFGH", range(8))),
            [("A+B+E+F", ["G1"]), ("C+D+G+H", ["G2"])],
            [act("A", 0, [1]), act("B", 1, [0]), act("C", 2, [3]), act("D", 3, [2]),
             act("E", 4, [5]), act("F", 5, [4]), act("G", 6, [7]), act("H", 7, [6]),
             act("A+B", 0, [4]), act("A+B", 1, [5]), act("C+D", 2, [6]), act("C+D", 3, [7]),
             act("E+F", 4, [0]), act("E+F", 5, [1]), act("G+H", 6, [2]), act("G+H", 7, [3]),
             act("A+B+E+F", "G1"), act("C+D+G+H", "G2")],
            partitions=(Partition("G1", 4), Partition("G2", 4)))
EX53_MEMBERS = {"G1": (0, 1, 4, 5), "G2": (2, 3, 6, 7)}


def test_example_5_1_peer_to_peer_swap():
    r = simulate(EX51, _bare("dgx-h100"))
    xfer = GB / H100_LINK  # both directions at once: 2.22 ms
    agg = 3 * GB / H100_HBM  # read A and B, write A+B: 0.90 ms
    assert r.total_s == pytest.approx(xfer + agg, rel=1e-9)
    assert r.total_s * 1e3 == pytest.approx(3.1, rel=0.02)
    assert r.transfer_s * 1e3 == pytest.approx(2.2, rel=0.02)
    kinds = sorted((e.kind, e.sites) for e in r.timeline)
    assert kinds == [("aggregate", (0,)), ("aggregate", (1,)),
                     ("transfer", (0, 1)), ("transfer", (1, 0))]
    ag = [e for e in r.timeline if e.kind == "aggregate"]
    assert all(e.bytes == 3 * GB and e.start_s == pytest.approx(xfer) for e in ag)
    assert r.resource_bytes["egress:0"] == r.resource_bytes["ingress:1"] == GB


def test_example_5_2_recursive_doubling():
    r = simulate(EX52, _bare("dgx-h100"))
    round_ = GB / H100_LINK + 3 * GB / H100_HBM
    assert r.total_s == pytest.approx(2 * round_, rel=1e-9)
    assert r.total_s * 1e3 == pytest.approx(6.2, rel=0.02)
    assert r.transfer_s == pytest.approx(2 * GB / H100_LINK, rel=1e-9)
    assert sum(e.kind == "transfer" for e in r.timeline) == 8
    # the final aggregation reads the two partial aggregates, not four atoms
    finals = [e for e in r.timeline if e.kind == "aggregate" and e.index >= 8]
    assert len(finals) == 4 and all(e.bytes == 3 * GB for e in finals)


def test_transfer_time_is_the_union_of_overlapping_transfers():
    """transfer_s is the length of the union of the transfers' intervals: a 1 GB and a 2 GB
    transfer on disjoint H100 ports start together, so transfers are active for the longer
    one's 2 GB / 450 GB/s (not the sum); a later, disjoint transfer adds its own length."""
    p = prog([0, 1, 2, 3], {"A": (0, GB), "C": (2, 2 * GB)}, [("A", [1]), ("C", [3])],
             [act("A", 0, [1]), act("C", 2, [3])])
    r = simulate(p, _bare("dgx-h100"))
    assert r.total_s == pytest.approx(2 * GB / H100_LINK, rel=1e-9)
    assert r.transfer_s == pytest.approx(2 * GB / H100_LINK, rel=1e-9)
    # A relays 0 -> 1 -> 2 (two back-to-back 1 GB hops) while C's 3 GB go 2 -> 3 on other
    # ports: C's interval covers both hops, so transfers are active for 3 GB / link
    p = prog([0, 1, 2, 3], {"A": (0, GB), "C": (2, 3 * GB)}, [("A", [2]), ("C", [3])],
             [act("A", 0, [1], [2]), act("C", 2, [3])])
    r = simulate(p, _bare("dgx-h100"))
    assert r.transfer_s == pytest.approx(3 * GB / H100_LINK, rel=1e-9)
    assert r.total_s == pytest.approx(3 * GB / H100_LINK, rel=1e-9)


def test_dataflow_not_program_order():
    rev = EX52.__class__(EX52.gpus, EX52.partitions, EX52.inputs, EX52.outputs,
                         tuple(reversed(EX52.actions)))
    assert simulate(rev, _bare("dgx-h100")).total_s == pytest.approx(simulate(EX52, _bare("dgx-h100")).total_s)


def test_example_5_3_on_dgx_v100_paper():
    r = simulate(EX53, "dgx-v100-paper", membership=EX53_MEMBERS)
    expect = GB / (25 * GB) + 3 * GB / V100_HBM + GB / (50 * GB) + 3 * GB / V100_HBM
    assert r.total_s == pytest.approx(expect, rel=1e-9)
    assert r.total_s * 1e3 == pytest.approx(67, rel=0.02)
    assert "pcie" not in r.resource_bytes  # no transfer touches the bridge
    assert r.resource_bytes["link:0->4"] == GB and r.resource_bytes["link:0->1"] == GB
    assert r.membership == EX53_MEMBERS


def test_example_5_3_finds_membership_itself():
    r = simulate(EX53, "dgx-v100-paper")  # membership from eins.ir.exprog.check
    assert r.membership == EX53_MEMBERS
    assert r.total_s * 1e3 == pytest.approx(67, rel=0.02)


def test_wrong_membership_is_an_error():
    with pytest.raises(ExProgError, match=r"action `A\+B\+E\+F @ G1` is never enabled at "
                                          r"site 2"):
        simulate(EX53, "dgx-v100-paper", membership={"G1": (0, 1, 4, 2), "G2": (5, 3, 6, 7)})
    p = prog(range(2), {"A": 0}, [("A", [1])], [])
    with pytest.raises(ExProgError, match="OUT requirement A @ 1 is not met at site 1"):
        simulate(p, _bare("dgx-h100:2"), membership={})
    with pytest.raises(ExProgError, match=r"membership gives partition 'G1' 2 sites \(0, 1\); "
                                          r"it has size 4"):
        simulate(EX53, "dgx-v100-paper", membership={"G1": (0, 1), "G2": (2, 3, 6, 7)})


@pytest.mark.parametrize("membership,msg", [
    # simulate took each of these and returned a time; check() refused them
    ({"G1": (1, 2), "G2": (2,)}, r"partitions overlap in membership"),
    ({"G1": (2, 2)}, r"membership gives partition 'G1' 1 sites \(2, 2\); it has size 2"),
    ({"G1": (0, 1), "NOPE": (5,)}, r"membership names unknown partition 'NOPE'"),
    ({"G1": (0, 1.5)}, r"membership of partition 'G1' names site 1.5; sites are ints"),
    ({"G1": 0}, r"membership of partition 'G1' must be a list of sites, got 0"),
    ([("G1", (0, 1))], r"membership must be a dict \{partition name: sites\}, got \["),
])
def test_simulate_checks_the_membership_as_check_does(membership, msg):
    from eins.ir.exprog import check
    from eins.ir.exprog import parse
    p = parse("GPUS: 0, 1, 2, 3\nPARTITIONS: G1 {size 2}; G2 {size 1}\nIN: A @ 0\n"
                "OUT: A @ G1; A @ G2\nA @ 0 -> 1, 2, 3")
    for run in (lambda: check(p, membership), lambda: simulate(p, _bare("dgx-h100:4"), membership)):
        with pytest.raises(ExProgError, match=msg):
            run()


@pytest.mark.parametrize("change,msg", [
    # an AST built in code: simulate simulated these (a NaN or inf size looped forever)
    (dict(inputs=(AtomDecl("A", 0, -GB),)), r"atom 'A' has size -1000000000(\.0)?; sizes "
                                            r"are positive whole numbers of bytes"),
    (dict(inputs=(AtomDecl("A", 0, float("nan")),)), r"atom 'A' has size nan"),
    (dict(inputs=(AtomDecl("A", 0, float("inf")),)), r"atom 'A' has size inf"),
    (dict(inputs=(AtomDecl("A", 0, "1"),)), r"atom 'A' has size '1'"),
    (dict(outputs=(Requirement(frozenset("A"), (3,)),)), r"site 3 in OUT requirement 'A @ 3' "
                                                         r"is not in GPUS"),
])
def test_simulate_validates_an_ast_built_in_code(change, msg):
    fields = dict(gpus=(0, 1), partitions=(), inputs=(AtomDecl("A", 0),),
                  outputs=(Requirement(frozenset("A"), (1,)),),
                  actions=(Action(frozenset("A"), 0, ((1,),)),))
    assert simulate(ExProg(**fields), _bare("dgx-h100:2")).total_s == pytest.approx(GB / H100_LINK)
    fields.update(change)
    with pytest.raises(ExProgError, match=msg):
        simulate(ExProg(**fields), _bare("dgx-h100:2"))
    with pytest.raises(ExProgError, match=r"simulate takes an ExProg \(eins.ir.exprog.parse "
                                          r"reads one from text\), got str"):
        simulate("IN: A @ 0\nOUT: A @ 1", _bare("dgx-h100:2"))


def test_two_flows_on_one_link_share_it():
    # both cross the directed link 0->4 (50 GB/s): 25 GB/s each
    p = prog(range(8), {"A": 0, "B": 0}, [("A", [4]), ("B", [4])],
             [act("A", 0, [4]), act("B", 0, [4])])
    r = simulate(p, "dgx-v100-paper")
    assert [e.end_s for e in r.timeline] == pytest.approx([2 * GB / (50 * GB)] * 2)
    # the opposite direction is a separate resource: no sharing
    p = prog(range(8), {"A": 0, "B": 4}, [("A", [4]), ("B", [0])],
             [act("A", 0, [4]), act("B", 4, [0])])
    assert simulate(p, "dgx-v100-paper").total_s == pytest.approx(GB / (50 * GB))


def test_rates_recomputed_when_a_flow_finishes():
    # 1 GB and 0.5 GB on one 50 GB/s link: both at 25 until the small one is done (20 ms),
    # then the big one has 0.5 GB left at 50 GB/s (10 ms)
    p = prog(range(8), {"A": 0, "B": (0, GB // 2)}, [("A", [4]), ("B", [4])],
             [act("A", 0, [4]), act("B", 0, [4])])
    ends = sorted(e.end_s for e in simulate(p, "dgx-v100-paper").timeline)
    assert ends == pytest.approx([0.020, 0.030])


def test_pcie_bridge_shared_by_both_directions():
    p = prog(range(8), {"A": 0, "B": 5}, [("A", [5]), ("B", [0])],
             [act("A", 0, [5]), act("B", 5, [0])])
    r = simulate(p, "dgx-v100-paper")
    assert r.total_s == pytest.approx(2 * GB / (15.75 * GB))
    assert r.resource_bytes["pcie"] == 2 * GB


def test_multicast_divides_source_egress():
    p = prog(range(4), {"A": 0}, [("A", [1, 2, 3])], [act("A", 0, [1, 2, 3])])
    r = simulate(p, _bare("dgx-h100:4"))
    assert r.total_s == pytest.approx(GB / (H100_LINK / 3))
    assert sorted(e.sites for e in r.timeline) == [(0, 1), (0, 2), (0, 3)]


def test_max_min_is_not_equal_split():
    # ingress:1 is shared by three flows (150 each); the 0->2 flow shares egress:0 with the
    # 0->1 flow, which is held at 150 elsewhere, so it gets the remaining 300 (not 225)
    p = prog(range(5), {"A": 0, "B": 0, "C": 3, "D": 4}, [("A", [1]), ("B", [2]), ("C", [1]),
             ("D", [1])], [act("A", 0, [1]), act("B", 0, [2]), act("C", 3, [1]),
                           act("D", 4, [1])])
    r = simulate(p, _bare("dgx-h100:5"))
    end = {e.sites: e.end_s for e in r.timeline}
    assert end[(0, 2)] == pytest.approx(GB / (300 * GB))
    assert end[(0, 1)] == end[(3, 1)] == pytest.approx(GB / (150 * GB))


def test_max_min_rates_directly():
    class F:
        def __init__(self, *res):
            self.resources = res
    f1, f2, f3 = F("a"), F("a", "b"), F("b")
    max_min_rates([f1, f2, f3], {"a": 10.0, "b": 4.0})
    # b saturates first at 2 each; then f1 takes what is left of a: 8
    assert (f1.rate, f2.rate, f3.rate) == pytest.approx((8.0, 2.0, 2.0))


def test_relay():
    # 0 -> 4 on the 50 GB/s pillar, then 4 -> 5 on a 25 GB/s single link
    p = prog(range(8), {"A": 0}, [("A", [5])], [act("A", 0, [4], [5])])
    r = simulate(p, "dgx-v100-paper")
    assert r.total_s == pytest.approx(GB / (50 * GB) + GB / (25 * GB))
    assert [(e.sites, e.start_s) for e in r.timeline] == [((0, 4), 0.0),
                                                           ((4, 5), pytest.approx(0.02))]


def test_relay_through_several_sites_round_robin():
    p = prog(range(8), {"A": 0}, [("A", [3, 5, 7])], [act("A", 0, [1, 4], [3, 5, 7])])
    r = simulate(p, _bare("dgx-h100"))
    assert sorted(e.sites for e in r.timeline) == [(0, 1), (0, 4), (1, 3), (1, 7), (4, 5)]


@pytest.mark.parametrize("action,msg", [
    # a destination list is a set: two copies of relay 0 would be charged twice
    (act("A", 0, [1, 1]), "action 'A @ 0 -> 1, 1': site 1 appears twice in one destination "
                          "list (a destination list is a set of sites)"),
    (act("A", 0, [0, 1]), "action 'A @ 0 -> 0, 1': 'A' would be sent from site 0 to itself "
                          "(it is already there)"),
    (act("A", 0, [1], [1]), "action 'A @ 0 -> 1 -> 1': 'A' would be sent from site 1 to "
                            "itself (it is already there)"),
])
def test_simulate_rejects_bad_destination_lists(action, msg):
    # an AST built in code, not parsed: simulate validates it first
    p = prog(range(2), {"A": 0}, [("A", [1])], [action])
    with pytest.raises(ExProgError) as info:
        simulate(p, _bare("dgx-h100:2"))
    assert str(info.value) == msg


def test_simulate_rejects_an_action_written_twice():
    a = act("A", 0, [1])
    with pytest.raises(ExProgError, match=r"action 'A @ 0 -> 1' is written twice \(a program "
                                          r"is a set of actions\)"):
        simulate(prog(range(2), {"A": 0}, [("A", [1])], [a, a]), _bare("dgx-h100:2"))
    # once, it is one 1 GB transfer
    assert simulate(prog(range(2), {"A": 0}, [("A", [1])], [a]),
                    _bare("dgx-h100:2")).total_s == pytest.approx(GB / H100_LINK)


def test_one_aggregation_shared_by_two_actions():
    p = prog(range(3), {"A": 0, "B": 0}, [("A+B", [1, 2])],
             [act("A+B", 0, [1]), act("A+B", 0, [2])])
    r = simulate(p, _bare("dgx-h100:3"))
    assert sum(e.kind == "aggregate" for e in r.timeline) == 1
    assert r.total_s == pytest.approx(3 * GB / H100_HBM + GB / (H100_LINK / 2))


def test_arrival_releases_waiters_of_a_slower_aggregation():
    # GPU 1 starts aggregating P+Q at 1 ms while its HBM is shared with a big R+S (so at
    # 5 GB/s: done at 61 ms); GPU 0's idle HBM makes P+Q by 31 ms and it arrives at 1 at
    # 32 ms. The forward 1 -> 2 starts then, not when GPU 1's own aggregation ends. Each
    # transfer waits the NVLink latency first: Q reaches 0 at 1 ms + L, P+Q reaches 1 at
    # 32 ms + 2L and 2 at 33 ms + 3L.
    t = Topology.build("t", [0, 1, 2], hbm_bw=10 * GB, flops=1, memory=1,
                       links=[(0, 1, 100 * GB), (1, 2, 100 * GB), (0, 2, 100 * GB)])
    p = prog([0, 1, 2], {"P": (0, GB // 10), "Q": (1, GB // 10), "R": (1, GB), "S": (1, GB)},
             [("P+Q", [2]), ("R+S", [1])],
             [act("P", 0, [1]), act("Q", 1, [0]), act("R+S", 1), act("P+Q", 0, [1]),
              act("P+Q", 1, [2])])
    r = simulate(p, t)
    fwd, = [e for e in r.timeline if e.sites == (1, 2)]
    assert (fwd.start_s, fwd.end_s) == pytest.approx((0.032 + 2 * NVLINK_LAT,
                                                      0.033 + 3 * NVLINK_LAT), rel=1e-12)
    aggs = {e.sites: e for e in r.timeline if e.kind == "aggregate" and e.index >= 3}
    assert aggs[(0,)].end_s == pytest.approx(0.031 + NVLINK_LAT, rel=1e-12)


def test_concurrent_aggregations_share_hbm():
    p = prog([0], {"A": 0, "B": 0, "C": 0, "D": 0}, [("A+B", [0]), ("C+D", [0])],
             [act("A+B", 0), act("C+D", 0)])
    r = simulate(p, _bare("dgx-h100:1"))
    assert r.total_s == pytest.approx(6 * GB / H100_HBM)
    assert r.transfer_s == 0.0


def test_received_aggregate_is_forwarded_without_aggregation():
    p = prog(range(3), {"A": 0, "B": 0}, [("A+B", [2])],
             [act("A+B", 0, [1]), act("A+B", 1, [2])])
    r = simulate(p, _bare("dgx-h100:3"))
    assert [e.kind for e in r.timeline] == ["aggregate", "transfer", "transfer"]
    assert r.total_s == pytest.approx(3 * GB / H100_HBM + 2 * GB / H100_LINK)


def test_partition_source_aggregates_at_every_member():
    p = prog(range(4), {"A": 0, "B": 1}, [("A+B", ["G"])],
             [act("A", 0, [1, 3]), act("B", 1, [0, 3]), act("A+B", "G")],
             partitions=(Partition("G", 2, (1, 3)), Partition("H", 2, (0, 2))))
    r = simulate(p, _bare("dgx-h100:4"))
    assert sorted(e.sites for e in r.timeline if e.kind == "aggregate") == [(1,), (3,)]


def test_never_enabled_action_is_named():
    p = prog(range(2), {"A": 0, "B": 1}, [("A+B", [0])], [act("A+B", 0)])
    with pytest.raises(ExProgError, match=r"action `A\+B @ 0` is never enabled at site 0.*"
                                          r"present: A\)"):
        simulate(p, _bare("dgx-h100:2"))


def test_unknown_atom_and_gpu_outside_topology():
    p = prog(range(2), {"A": 0}, [("A", [1])], [act("A+Z", 0, [1])])
    with pytest.raises(ExProgError, match=r"unknown atom 'Z' in action 'A\+Z @ 0 -> 1'"):
        simulate(p, _bare("dgx-h100:2"))
    p = prog(range(6), {"A": 0}, [("A", [5])], [act("A", 0, [5])])
    with pytest.raises(ExProgError, match="uses GPU 4 but topology 'dgx-h100:4'"):
        simulate(p, "dgx-h100:4")
    p = prog(range(2), {"A": 0}, [("A", [1])], [act("A", 0, [1]), act("A", 1, [7])])
    with pytest.raises(ExProgError, match=r"destination 7 in action 'A @ 1 -> 7' is not a site "
                                          r"in GPUS"):   # validate: GPUS are (0, 1)
        simulate(p, _bare("dgx-h100:2"))
    with pytest.raises(TopologyError, match="unknown topology 'tpu'"):
        simulate(p, "tpu")


def test_custom_topology_object():
    # 1 GB each way over a 1 GB/s link after its latency, then A+B at 10 GB/s of HBM
    t = Topology.build("slow", [0, 1], hbm_bw=10 * GB, flops=1, memory=1, links=[(0, 1, GB)])
    r = simulate(EX51, t)
    assert r.total_s == pytest.approx(NVLINK_LAT + 1.0 + 0.3, rel=1e-12)


def test_a_transfer_waits_its_routes_latency_first():
    # dgx-h100:2: 1 GB at 450 GB/s after NCCL's NVLink step latency, then A+B in HBM
    r = simulate(EX51, "dgx-h100:2")
    assert r.total_s == pytest.approx(NVLINK_LAT + GB / H100_LINK + 3 * GB / H100_HBM,
                                      rel=1e-12)
    # the timeline entry spans the latency and the bytes
    x = [e for e in r.timeline if e.kind == "transfer"]
    assert [e.end_s - e.start_s for e in x] == pytest.approx(
        [NVLINK_LAT + GB / H100_LINK] * 2, rel=1e-12)


def test_latency_draws_on_no_bandwidth():
    # A (1 GB) leaves GPU 0 at 0 and B (1 GB) at 0.5 s (after a 0.5 s aggregation at GPU 0),
    # both to GPU 1 over one 1 GB/s link with a 0.25 s latency. A flows alone from 0.25 to
    # 0.75 s (0.5 GB: the link is not shared while B waits out its latency), then they share
    # it: A's last 0.5 GB at 0.5 GB/s ends at 1.75 s; B has 0.5 GB left and ends at 2.25 s.
    t = Topology.build("lat", [0, 1], hbm_bw=6 * GB, flops=1, memory=1, links=[(0, 1, GB)],
                       nvlink_latency=0.25)
    p = prog([0, 1], {"A": (0, GB), "B": (0, GB), "C": (0, GB)}, [("A", [1]), ("B+C", [1])],
             [act("A", 0, [1]), act("B+C", 0, [1])])
    r = simulate(p, t)
    ends = {e.text: e.end_s for e in r.timeline if e.kind == "transfer"}
    assert ends == pytest.approx({"A @ 0 -> 1": 1.75, "B+C @ 0 -> 1": 2.25}, rel=1e-12)


def test_a_relay_pays_both_hops_latency_and_a_cluster_route_its_segments():
    r = simulate(prog([0, 1, 2], {"A": 0}, [("A", [2])], [act("A", 0, [1], [2])]),
                 "dgx-h100:3")
    assert r.total_s == pytest.approx(2 * (NVLINK_LAT + GB / H100_LINK), rel=1e-12)
    # dgx-h100:2x2: GPU 0 -> 3 crosses node 0 to GPU 1 (rail 1), then the network (PXN)
    topo = get_topology("dgx-h100:2x2")
    assert topo.route_latency(0, 3) == pytest.approx(NVLINK_LAT + 9.6e-6, rel=1e-12)
    assert topo.route_latency(0, 2) == pytest.approx(9.6e-6, rel=1e-12)
    r = simulate(prog(range(4), {"A": 0}, [("A", [3])], [act("A", 0, [3])]), topo)
    assert r.total_s == pytest.approx(NVLINK_LAT + 9.6e-6 + GB / (400 * GB / 8), rel=1e-12)
    # the paper's own preset and model have none
    assert get_topology("dgx-v100-paper").route_latency(0, 5) == 0.0
    assert simulate(EX51, get_topology("dgx-h100:2").without_latency()).total_s == \
        pytest.approx(GB / H100_LINK + 3 * GB / H100_HBM, rel=1e-12)


def test_chrome_trace(tmp_path):
    r = simulate(EX52, _bare("dgx-h100"))
    path = tmp_path / "t.json"
    r.to_chrome_trace(path)
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(r.timeline) == 8 + 4 + 4  # transfers, 2 rounds of aggs
    for e, t in zip(xs, r.timeline):
        assert e["ts"] == pytest.approx(t.start_s * 1e6)
        assert e["dur"] == pytest.approx((t.end_s - t.start_s) * 1e6)
        assert e["cat"] == t.kind and e["pid"] == t.sites[0]
        assert e["tid"] == (0 if t.kind == "aggregate" else t.sites[1] + 1)
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(r.total_s * 1e6)


def test_to_dict():
    d = simulate(EX51, _bare("dgx-h100")).to_dict()
    assert d["total_ms"] == pytest.approx(1e3 * (GB / H100_LINK + 3 * GB / H100_HBM))
    assert d["timeline"][0]["action"] in ("A @ 0 -> 1", "B @ 1 -> 0")
    json.dumps(d)


def test_paper_example_files():
    from eins.ir.exprog import parse
    import pathlib
    d = pathlib.Path(__file__).parent.parent / "examples" / "exprog"
    for name, topo, ms in (("example_5_1", _bare("dgx-h100"), 3.1), ("example_5_2", _bare("dgx-h100"), 6.2),
                           ("example_5_3", "dgx-v100-paper", 67)):
        r = simulate(parse((d / f"{name}.exprog").read_text()), topo)
        assert r.total_s * 1e3 == pytest.approx(ms, rel=0.02), name


_SITES = st.integers(0, 3)


@st.composite
def _programs(draw):
    """Mostly well-formed programs: each action aggregates disjoint aggregates already
    reachable at its source; sometimes one arbitrary action that may never be enabled."""
    atoms = {n: draw(_SITES) for n in "ABCD"}
    reach = {g: {frozenset(n) for n, s in atoms.items() if s == g} for g in range(4)}
    acts = []
    for _ in range(draw(st.integers(1, 7))):
        src = draw(_SITES)
        have = sorted(reach[src], key=sorted)
        if not have:
            continue
        parts = draw(st.lists(st.sampled_from(have), min_size=1, max_size=3))
        agg = frozenset()
        for y in parts:
            if not (y & agg):
                agg |= y
        hops = draw(st.lists(st.lists(_SITES, min_size=1, max_size=2, unique=True),
                             max_size=2))
        a = act("+".join(sorted(agg)), src, *hops)
        # a body is a set (destinations too: 'A @ 1 -> 2, 3' is 'A @ 1 -> 3, 2'); no
        # self-sends
        if hop_fault(a) is not None or action_key(a) in {action_key(b) for b in acts}:
            continue
        acts.append(a)
        for g in {src, *(d for h in hops for d in h)}:
            reach[g].add(agg)
    if draw(st.booleans()):
        agg = draw(st.sets(st.sampled_from("ABCD"), min_size=1, max_size=4))
        acts.insert(draw(st.integers(0, len(acts))), act("+".join(sorted(agg)), draw(_SITES)))
    return prog(range(4), atoms, [], list({action_key(b): b for b in acts}.values()))


@settings(max_examples=150, deadline=None)
@given(_programs())
def test_final_state_is_the_closure(p):
    """The simulator's dataflow reaches exactly Definition 5.5's closure, and it fails (naming
    an action) exactly when the program is not well-formed."""
    from eins.ir.exprog import closure, problems
    if problems(p):
        with pytest.raises(ExProgError, match="is never enabled"):
            simulate(p, "dgx-v100-paper", membership={})
    else:
        r = simulate(p, "dgx-v100-paper", membership={})
        assert r.state == closure(p)
        assert all(e.end_s <= r.total_s + 1e-12 for e in r.timeline)


def test_route_fair_rates_equal_max_min_rates_per_flow():
    # the simulator's per-route progressive filling gives every flow on a route exactly (bit
    # for bit) the rate the per-flow reference max_min_rates gives it, on random contention
    # patterns (repeated routes, a resource twice on one route, near-equal capacities)
    import numpy as np
    rng = np.random.default_rng(7)

    class F:
        def __init__(self, res):
            self.resources = res

    for _ in range(300):
        nres = int(rng.integers(1, 12))
        cap = rng.choice([1.0, 3.0, 7.5, 1.0 + 1e-12, 2.0 / 3.0], nres) * \
            rng.choice([1.0, 1e9, 1e11], nres)
        routes = {tuple(int(r) for r in rng.integers(0, nres, int(rng.integers(1, 4))))
                  for _ in range(int(rng.integers(1, 10)))}
        routes = sorted(routes)
        weights = [int(w) for w in rng.integers(1, 5, len(routes))]
        got = route_fair_rates(routes, weights, cap)
        flows = [F(tuple(f"r{r}" for r in rt)) for rt, w in zip(routes, weights)
                 for _ in range(w)]
        max_min_rates(flows, {f"r{i}": float(c) for i, c in enumerate(cap)})
        want = [f.rate for f in flows]
        assert list(np.repeat(got, weights)) == want
