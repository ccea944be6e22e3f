"""Multi-node topologies (issue 13, part 3): N servers joined by one NIC per GPU,
rail-optimized; presets `NAME:NxG`, JSON, `nvidia-smi topo -m` plus a node count; used by
the planner's physical passes, the synthesizer and predicted_time()."""
import json
import pathlib

import numpy as np
import pytest

import eins
from eins.errors import TopologyError
from eins.hardware.simulate import simulate
from eins.hardware.presets import get_topology
from eins.hardware.topology import Topology
from eins.ir import exprog

GB = 1e9
FIX = pathlib.Path(__file__).parent / "fixtures" / "nvidia_smi"


def test_dgx_h100_2x8_routes_and_capacities():
    t = get_topology("dgx-h100:2x8")
    assert t.name == "dgx-h100:2x8" and t.kind == "multinode" and t.nodes == 2
    assert t.gpus == tuple(range(16)) and t.gpus_per_node == 8 and t.node_of(9) == 1
    # inside a node: the NVSwitch fabric, renumbered per node
    assert t.route(9, 15) == ("egress:9", "ingress:15") and t.bandwidth(9, 15) == 450 * GB
    # the same rail: the two NICs; 400 Gb/s = 50 GB/s per direction
    assert t.route(3, 11) == ("nic-out:3", "nic-in:11") and t.bandwidth(3, 11) == 50 * GB
    # another rail: over NVLink to the source node's GPU on the destination's rail, then its NIC
    assert t.route(3, 12) == ("egress:3", "ingress:4", "nic-out:4", "nic-in:12")
    assert t.capacity["nic-out:4"] == t.capacity["nic-in:12"] == 50 * GB
    assert len(t.routes) == 16 * 15


def test_cluster_presets_and_bad_names():
    a = get_topology("dgx-a100:3x4")
    assert a.gpus == tuple(range(12)) and a.nic_bw == 200 / 8 * GB
    assert a.route(0, 4) == ("nic-out:0", "nic-in:4")  # 4 GPUs per node: GPU 4 is node 1's 0
    v = get_topology("dgx-v100:2x8")
    assert v.route(0, 8 + 3) == ("link:0->3", "nic-out:3", "nic-in:11")
    assert v.capacity["pcie@node1"] == 15.75 * GB
    for bad, match in [("dgx-h100:2x9", "GPUs per node 9"), ("dgx-h100:0x8", "node count 0"),
                       ("dgx-v100:2x4", "fixed set of 8 GPUs; write 'dgx-v100:2x8'")]:
        with pytest.raises(TopologyError, match=match):
            get_topology(bad)
    with pytest.raises(TopologyError, match="a node must be one server"):
        Topology.multi_node(get_topology("dgx-h100:2x8"), 2, 50 * GB)
    for nic in (0, float("inf"), True, "50"):
        with pytest.raises(TopologyError, match="NIC bandwidth must be a positive, finite "
                                                "number, got "):
            Topology.multi_node(get_topology("dgx-h100"), 2, nic)
    # ASCII digits only: int() also reads '²'-like and Arabic-Indic digits
    for bad in ("dgx-h100:\u00b2", "dgx-h100:\u0663", "dgx-h100:\u06632x8"):
        with pytest.raises(TopologyError, match="GPU count .* must be an integer in 1..8"):
            get_topology(bad)


def test_simulated_transfer_across_nodes_is_the_nic_time():
    """One 1 GB block: within a node at 450 GB/s; across nodes at the 50 GB/s NIC; each
    after its latency (NCCL's: 3.4 us over NVLink, 9.6 us over the network, both for a
    transfer to another rail, which crosses its node first)."""
    t = get_topology("dgx-h100:2x8")
    nv, nic = 3.4e-6, 9.6e-6
    for dst, want in [(1, nv + 1 / 450), (8, nic + 1 / 50), (9, nv + nic + 1 / 50)]:
        prog = exprog.parse(f"IN: A @ 0\nOUT: A @ {dst}\nA @ 0 -> {dst}\n")
        assert simulate(prog, t).total_s == pytest.approx(want, rel=1e-12)
    # two transfers leaving node 0 for the rail of GPU 9 share GPU 1's NIC: half speed each
    # once B's 9.6 us have passed (B flows alone until A's 13 us have), so the NIC is busy
    # from 9.6 us on
    prog = exprog.parse("IN: A @ 0; B @ 1\nOUT: A @ 9; B @ 9\nA @ 0 -> 9; B @ 1 -> 9\n")
    assert simulate(prog, t).total_s == pytest.approx(nic + 2 / 50, rel=1e-12)


def test_json_round_trip_and_user_cluster_from_nvidia_smi(tmp_path):
    t = get_topology("dgx-h100:2x8")
    doc = t.to_dict()
    assert doc["nodes"] == 2 and doc["nic_gbps"] == 50
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))
    u = get_topology(str(p))
    assert dict(u.routes) == dict(t.routes) and dict(u.capacity) == dict(t.capacity)
    text = (FIX / "dgx_h100.txt").read_text()
    c = Topology.from_nvidia_smi(text, gpu="H100", nodes=4)
    assert c.gpus == tuple(range(32)) and c.nic_bw == 50 * GB and c.name == "nvidia-smi:4x8"
    assert c.route(0, 31) == ("egress:0", "ingress:7", "nic-out:7", "nic-in:31")
    c2 = Topology.from_nvidia_smi(text, gpu="H100", nodes=2, nic_gbits=200)
    assert c2.bandwidth(0, 8) == 25 * GB
    with pytest.raises(TopologyError, match="positive number of Gb/s"):
        Topology.from_nvidia_smi(text, gpu="H100", nodes=2, nic_gbits=-1)
    with pytest.raises(TopologyError, match="'nodes' must be a positive int"):
        Topology.from_dict({**doc, "nodes": 0})


def test_a_cluster_past_the_model_limit_fails_at_once(capsys):
    """Every GPU pair has a route, so a mistyped node count used to hang or exhaust memory
    (dgx-h100:3000x8 was killed by the OOM killer); past MAX_CLUSTER_GPUS it is an error
    naming the count, from presets, the CLI (nvidia-smi --nodes too) and distribute."""
    from eins.cli import main
    from eins.hardware.specs import MAX_CLUSTER_GPUS
    assert MAX_CLUSTER_GPUS == 2048 and len(get_topology("dgx-h100:256x8").gpus) == 2048
    for name, total in [("dgx-h100:257x8", 2056), ("dgx-h100:99999999999x8", 799999999992)]:
        with pytest.raises(TopologyError, match=rf"'{name}': \d+ nodes x 8 GPUs is {total} "
                                                rf"GPUs; a cluster model holds at most 2048"):
            get_topology(name)
    with pytest.raises(TopologyError, match="99999999999 nodes x 8 GPUs"):
        eins.distribute(lambda x: x + 1, devices=2, topology="dgx-h100:99999999999x8")
    with pytest.raises(TopologyError, match="device ids up to 4999 need a topology with 5000 "
                                            "GPUs; a cluster model holds at most 2048"):
        eins.distribute(lambda x: x + 1, devices=5000)
    capsys.readouterr()
    assert main(["topology", "parse", str(FIX / "dgx_h100.txt"), "--gpu", "H100",
                 "--nodes", "100000"]) == 2
    assert "100000 nodes x 8 GPUs is 800000 GPUs" in capsys.readouterr().err


def test_cli_parses_a_cluster(tmp_path):
    from eins.cli import main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["topology", "parse", str(FIX / "dgx_h100.txt"), "--gpu", "H100",
                     "--nodes", "2", "--json"]) == 0
    doc = json.loads(buf.getvalue())
    assert doc["nodes"] == 2 and doc["nic_gbps"] == 50
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["topology", "show", "dgx-h100:2x8"]) == 0
    assert "2 nodes of 8" in buf.getvalue() and "400 Gb/s" in buf.getvalue()
    assert main(["topology", "parse", str(FIX / "dgx_h100.txt"), "--gpu", "H100",
                 "--nic-gbits", "400"]) == 2
    for bad in ("inf", "nan", "-1"):   # inf was accepted
        assert main(["topology", "parse", str(FIX / "dgx_h100.txt"), "--gpu", "H100",
                     "--nodes", "2", "--nic-gbits", bad]) == 2


def _ffn_low(devices, **kw):
    def ffn(x, w1, w2):
        return eins.relu(x @ w1) @ w2
    args = [eins.ShapeDtype(s, "float16") for s in [(4096, 1024), (1024, 4096), (4096, 1024)]]
    return eins.distribute(ffn, devices=devices, topology="dgx-h100:2x8", **kw).lower(*args)


@pytest.mark.parametrize("schedule", ["naive", "optimized"])
def test_predicted_exchange_across_nodes_is_slower_than_within(schedule):
    """The same plan on two GPUs of one node and on two GPUs of different nodes (the
    planner, the synthesizer and predicted_time() all see the cluster)."""
    # the proxy moves data for this FFN; the time cost would replicate the small weights
    kw = dict(schedule=schedule, synthesis_budget_s=0.05, cost="proxy")
    within = _ffn_low([0, 1], **kw)
    across = _ffn_low([0, 8], **kw)
    def splits(low):   # the plan, without each eqn's time (which sees the NIC)
        return [{k: v for k, v in r.items() if k != "seconds"} for r in low.plan_table()]
    assert splits(within) == splits(across)
    assert across.plan.cost_s > within.plan.cost_s
    tw, ta = within.predicted_time(), across.predicted_time()
    assert tw["topology"] == ta["topology"] == "dgx-h100:2x8"
    assert ta["exchange_ms"] > 4 * tw["exchange_ms"] > 0
    assert ta["compute_ms"] == tw["compute_ms"]


def test_default_topology_beyond_8_devices_is_a_dgx_a100_cluster():
    from eins.hardware.net import resolve_topology
    assert resolve_topology(None, range(8)).name == "dgx-a100"
    t = resolve_topology(None, range(12))
    assert t.name == "dgx-a100:2x8" and t.nic_bw == 25 * GB
    assert resolve_topology(None, range(100)).name == "dgx-a100:13x8"
    with pytest.raises(TopologyError, match="default covers 128 .*'dgx-h100:17x8'"):
        resolve_topology(None, range(129))


def test_sixteen_virtual_devices_on_the_default_cluster_equal_jit():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((32, 16)).astype(np.float32), \
        rng.standard_normal((16, 32)).astype(np.float32)
    f = eins.distribute(lambda x, w: x @ w, devices=16)
    np.testing.assert_allclose(f(x, w), x @ w, rtol=1e-5, atol=1e-5)
    assert f.lower(x, w).physical.exchange.topology.name == "dgx-a100:2x8"


def test_synthesizer_beats_naive_allreduce_on_a_cluster():
    """An all-reduce of 1 GB atoms over 2 nodes of 8: sending every atom everywhere crosses
    the 50 GB/s NICs 8 times per GPU; the synthesizer's programs reduce inside nodes first."""
    from eins.passes.synthesize import synthesize_program
    names = [f"A{i}" for i in range(16)]
    src = ("GPUS: " + ", ".join(map(str, range(16))) + "\nIN: "
           + "; ".join(f"{n} @ {i}" for i, n in enumerate(names)) + "\nOUT: "
           + "+".join(names) + " @ " + ", ".join(map(str, range(16))) + "\n")
    t = get_topology("dgx-h100:2x8")
    r = synthesize_program(exprog.parse(src), t, steps=30)  # not a clock: same under load
    assert r.total_s < r.naive_s / 2
    assert simulate(r.program, t, r.membership).total_s == pytest.approx(r.total_s)
