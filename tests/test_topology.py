"""Hardware models (issue 3, paper Section 5.2 "Cost")."""
import json
import pathlib
import re

import numpy as np

import pytest

from eins.errors import TopologyError
from eins.hardware.presets import DGX1V_NVIDIA_SMI, PRESETS, get_topology
from eins.hardware.specs import NIC_LATENCY_S, NVLINK_LATENCY_S, gpu_spec
from eins.hardware.topology import Topology

FIX = pathlib.Path(__file__).parent / "fixtures" / "nvidia_smi"
GB = 1e9

# The issue's DGX-1V matrix, transcribed independently of the module: (a, b) -> NV count.
DGX1V_NV = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2,
            (2, 3): 2, (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2,
            (5, 7): 1, (6, 7): 2}


@pytest.mark.parametrize("name,bw,hbm,tflops,mem,n", [
    ("dgx-a100", 300, 1555, 312, 40, 8),
    ("dgx-h100", 450, 3350, 989, 80, 8),
    ("hgx-h200", 450, 4800, 989, 141, 8),
    ("dgx-b200", 900, 8000, 2250, 180, 8),
    ("gb200-nvl72", 900, 8000, 2500, 186, 72),
])
def test_switch_presets(name, bw, hbm, tflops, mem, n):
    t = get_topology(name)
    assert t is PRESETS[name] and t.kind == "switch"
    assert t.gpus == tuple(range(n))
    assert t.hbm_bw == hbm * GB and t.flops == tflops * 1e12 and t.memory == mem * GB
    # contention only at endpoints: source egress, destination ingress
    assert t.route(0, n - 1) == ("egress:0", f"ingress:{n - 1}")
    assert t.capacity["egress:0"] == t.capacity[f"ingress:{n - 1}"] == bw * GB
    assert set(t.capacity) == {f"{k}:{g}" for k in ("egress", "ingress") for g in range(n)}
    assert t.route(3, 3) == ()


def test_switch_preset_gpu_count():
    t = get_topology("dgx-h100:4")
    assert t.gpus == (0, 1, 2, 3) and t.name == "dgx-h100:4"
    assert t.bandwidth(0, 3) == 450 * GB
    with pytest.raises(TopologyError, match="GPU 4 is not in topology 'dgx-h100:4'"):
        t.route(0, 4)
    assert get_topology("gb200-nvl72:16").gpus == tuple(range(16))


def test_dgx_v100_paper_preset():
    t = get_topology("dgx-v100-paper")
    assert t.hbm_bw == 900 * GB and t.kind == "mesh"
    for a in range(8):
        for b in range(8):
            if a == b:
                continue
            same_quad = (a < 4) == (b < 4)
            if abs(a - b) == 4:  # the double-link pillars
                assert t.route(a, b) == (f"link:{a}->{b}",) and t.bandwidth(a, b) == 50 * GB
            elif same_quad:
                assert t.route(a, b) == (f"link:{a}->{b}",) and t.bandwidth(a, b) == 25 * GB
            else:  # one bridge, both directions share it
                assert t.route(a, b) == ("pcie",)
    assert t.capacity["pcie"] == 15.75 * GB
    assert t.route(0, 5) == t.route(5, 0) == t.route(3, 6)
    assert t.route(0, 4) != t.route(4, 0)  # directed links


def _check_dgx1v(t):
    assert t.gpus == tuple(range(8)) and t.kind == "mesh" and t.gpu_model == "V100"
    assert t.hbm_bw == 900 * GB
    for a in range(8):
        for b in range(8):
            if a == b:
                continue
            n = DGX1V_NV.get((min(a, b), max(a, b)))
            if n is None:
                assert t.route(a, b) == ("pcie",)
            else:
                assert t.route(a, b) == (f"link:{a}->{b}",)
                assert t.bandwidth(a, b) == n * 25 * GB
    assert t.capacity["pcie"] == 15.75 * GB


def test_dgx_v100_preset_is_the_issue_matrix():
    _check_dgx1v(get_topology("dgx-v100"))
    # the module's matrix is the issue's, row by row
    issue = ["X NV1 NV1 NV2 NV2 SYS SYS SYS", "NV1 X NV2 NV1 SYS NV2 SYS SYS",
             "NV1 NV2 X NV2 SYS SYS NV1 SYS", "NV2 NV1 NV2 X SYS SYS SYS NV1",
             "NV2 SYS SYS SYS X NV1 NV1 NV2", "SYS NV2 SYS SYS NV1 X NV2 NV1",
             "SYS SYS NV1 SYS NV1 NV2 X NV2", "SYS SYS SYS NV1 NV2 NV1 NV2 X"]
    rows = [" ".join(ln.split()[1:]) for ln in DGX1V_NVIDIA_SMI.splitlines()[1:]]
    assert rows == issue


def test_nvidia_smi_dgx1v_with_nic_and_affinity_columns():
    t = Topology.from_nvidia_smi((FIX / "dgx1v.txt").read_text(), gpu="Tesla V100-SXM2-32GB")
    _check_dgx1v(t)
    assert not any("mlx" in r for r in t.capacity)


@pytest.mark.parametrize("fixture,gpu,nv,bw", [
    ("dgx_a100.txt", "A100-SXM4-40GB", 12, 300),
    ("dgx_h100.txt", "NVIDIA H100 80GB HBM3", 18, 450),
])
def test_nvidia_smi_nvswitch(fixture, gpu, nv, bw):
    t = Topology.from_nvidia_smi((FIX / fixture).read_text(), gpu=gpu)
    assert t.kind == "switch" and t.gpus == tuple(range(8))
    assert t.route(2, 7) == ("egress:2", "ingress:7")
    assert t.capacity["egress:2"] == nv * 25 * GB == bw * GB
    assert "pcie" not in t.capacity
    ref = get_topology("dgx-a100" if nv == 12 else "dgx-h100")
    assert (t.hbm_bw, t.flops, t.memory) == (ref.hbm_bw, ref.flops, ref.memory)


def test_nvidia_smi_b200_link_generation():
    # NVLink 5 links are 50 GB/s each: NV18 on a B200 is 900 GB/s
    text = (FIX / "dgx_h100.txt").read_text()
    assert Topology.from_nvidia_smi(text, gpu="B200").capacity["egress:0"] == 900 * GB


def test_nvidia_smi_errors():
    text = (FIX / "dgx1v.txt").read_text()
    # nodes=True was read as one node (True == 1), a NIC speed without nodes was dropped
    for nodes in (True, 0, -2, 2.5, "2"):
        with pytest.raises(TopologyError, match=f"node count must be a positive int, got "
                                                f"{re.escape(repr(nodes))}"):
            Topology.from_nvidia_smi(text, gpu="V100", nodes=nodes)
    with pytest.raises(TopologyError, match="nic_gbits=100 describes the NICs between nodes"):
        Topology.from_nvidia_smi(text, gpu="V100", nic_gbits=100)
    assert len(Topology.from_nvidia_smi(text, gpu="V100", nodes=np.int64(2)).gpus) == 16
    with pytest.raises(TopologyError, match="unknown GPU 'RTX 4090'"):
        Topology.from_nvidia_smi(text, gpu="RTX 4090")
    # a header with a gap was reported as "GPU rows [0, 2], expected GPU0..GPU0"
    gap = "\tGPU0\tGPU2\nGPU0\t X \tNV1\nGPU2\tNV1\t X \n"
    with pytest.raises(TopologyError, match="header names GPU2 where GPU1 was expected"):
        Topology.from_nvidia_smi(gap, gpu="V100")
    with pytest.raises(TopologyError, match="no `nvidia-smi topo -m` matrix"):
        Topology.from_nvidia_smi("hello\n", gpu="V100")
    bad = DGX1V_NVIDIA_SMI.replace("GPU0     X      NV1", "GPU0     X      NV3")
    with pytest.raises(TopologyError, match="not symmetric: GPU0/GPU1 is 'NV3'"):
        Topology.from_nvidia_smi(bad, gpu="V100")
    bad = DGX1V_NVIDIA_SMI.replace("SYS", "QPI")
    with pytest.raises(TopologyError, match="unknown nvidia-smi connection 'QPI'"):
        Topology.from_nvidia_smi(bad, gpu="V100")
    bad = "\n".join(DGX1V_NVIDIA_SMI.splitlines()[:-1])
    with pytest.raises(TopologyError, match=r"GPU rows \[0, 1, 2, 3, 4, 5, 6\]"):
        Topology.from_nvidia_smi(bad, gpu="V100")
    # an NV count beyond the GPU's NVLink ports (a 400-digit one overflowed float; a
    # 300-digit one made an infinite link that looped the simulator)
    for nv in ("NV7", "NV" + "9" * 400):
        bad = DGX1V_NVIDIA_SMI.replace("NV1", nv)
        with pytest.raises(TopologyError, match=r"GPU0/GPU1 is 'NV.{1,13}': a V100 has 6 "
                                                r"NVLink ports, so NV1..NV6$"):
            Topology.from_nvidia_smi(bad, gpu="V100")
    with pytest.raises(TopologyError, match="NIC bandwidth must be a positive number of Gb/s, "
                                            "got 1e"):
        Topology.from_nvidia_smi(DGX1V_NVIDIA_SMI, gpu="V100", nodes=2, nic_gbits=1e308)


def test_gpu_names():
    assert gpu_spec("NVIDIA A100-SXM4-80GB")[0] == "A100-80GB"
    assert gpu_spec("NVIDIA GB200")[0] == "GB200"  # not B200
    assert gpu_spec("h200")[0] == "H200"
    assert gpu_spec("Tesla V100-SXM2-32GB")[0] == "V100"
    assert gpu_spec("NVIDIA H100 80GB HBM3")[0] == "H100"
    assert gpu_spec("NVIDIA H100 NVL")[0] == gpu_spec("H100NVL")[0] == "H100"
    assert gpu_spec("NVIDIA A100-SXM4-40GB")[0] == "A100"


@pytest.mark.parametrize("name", ["RTX A1000", "Quadro P1000", "NVIDIA A10", "A1000"])
def test_gpu_names_are_words_not_substrings(name):
    """'RTX A1000' was planned as an A100 (312 TFLOP/s) and 'Quadro P1000' as a P100: the
    model was found as a substring of the name."""
    with pytest.raises(TopologyError, match=rf"unknown GPU '{name}': known models are P100"):
        gpu_spec(name)


@pytest.mark.parametrize("count", ["9" * 5000, "9" * 5000 + "x8", "2x" + "8" * 5000])
def test_a_gpu_count_of_thousands_of_digits_is_a_topology_error(count):
    # int() of 4,301+ digits raised a bare ValueError from get_topology
    with pytest.raises(TopologyError, match=r"is \d+ characters long"):
        get_topology("dgx-h100:" + count)


def test_a_gpu_model_that_is_not_a_string_is_refused():
    with pytest.raises(TopologyError, match=r"GPU model must be a string such as 'H100', got "
                                            r"\['H100'\]"):
        gpu_spec(["H100"])


def test_get_topology_errors():
    with pytest.raises(TopologyError, match="unknown topology 'dgx-h300'"):
        get_topology("dgx-h300")
    with pytest.raises(TopologyError, match="'dgx-v100' has a fixed set of GPUs"):
        get_topology("dgx-v100:4")
    with pytest.raises(TopologyError, match="GPU count '9' in 'dgx-h100:9' must be"):
        get_topology("dgx-h100:9")
    with pytest.raises(TopologyError, match="GPU count 'x'"):
        get_topology("dgx-h100:x")


def test_from_json(tmp_path):
    p = tmp_path / "box.json"
    p.write_text(json.dumps({"name": "box", "gpus": 3, "gpu": "H100", "hbm_gbps": 1000,
                             "links": [[0, 1, 50], [1, 2, 25]], "bus_gbps": 10}))
    t = Topology.from_json(p)
    assert t.name == "box" and t.gpus == (0, 1, 2)
    assert t.hbm_bw == 1000 * GB and t.flops == 989e12  # explicit value wins over the model
    assert t.route(1, 0) == ("link:1->0",) and t.capacity["link:1->0"] == 50 * GB
    assert t.bandwidth(2, 1) == 25 * GB
    assert t.route(0, 2) == t.route(2, 0) == ("pcie",) and t.capacity["pcie"] == 10 * GB

    p.write_text(json.dumps({"gpus": [0, 1, 2, 3], "hbm_gbps": 3350, "tflops": 989,
                             "memory_gb": 80, "switch_gbps": 450}))
    t = Topology.from_json(p)
    assert t.kind == "switch" and t.route(3, 0) == ("egress:3", "ingress:0")
    assert t.memory == 80 * GB


@pytest.mark.parametrize("doc,msg", [
    ({"gpus": 2, "gpu": "V100", "linkz": []}, "unknown key 'linkz'"),
    ({"gpus": "eight", "gpu": "V100"}, "'gpus' must be a count or a list of ints, got 'eight'"),
    ({"gpus": 2, "hbm_gbps": 900, "tflops": 1}, "missing 'memory_gb'"),
    ({"gpus": 2, "gpu": "V100", "links": [[0, 5, 25]]}, "link 0<->5 needs two distinct GPUs"),
    ({"gpus": 2, "gpu": "V100", "links": [[0, 1]]}, r"a link is \[a, b, gbps\], got \[0, 1\]"),
    ({"gpus": 2, "gpu": "V100", "switch_gbps": -1},
     "'switch_gbps' must be a positive, finite number, got -1$"),
    ({"gpus": 2, "gpu": "V100", "switch_gbps": 5, "bus_gbps": 1}, "excludes"),
    # an infinite bandwidth (or one that is infinite in bytes/s) looped the simulator
    ({"gpus": 2, "gpu": "V100", "switch_gbps": 1e300},
     "'switch_gbps' must be a positive, finite number, got 1e\\+300$"),
    ({"gpus": 2, "gpu": "V100", "links": [[0, 1, 1e300]]},
     "the GB/s of link 0<->1 must be a positive, finite number, got 1e\\+300$"),
    ({"gpus": 2, "gpu": "V100", "links": [[0, 1, 25]], "bus_gbps": 1e300},
     "'bus_gbps' must be a positive, finite number, got 1e\\+300$"),
    ({"gpus": 2, "gpu": "V100", "hbm_gbps": 1e300}, "'hbm_gbps' must be a positive, finite"),
    ({"gpus": 2, "gpu": "V100", "memory_gb": 10 ** 400},
     r"'memory_gb' must be a positive, finite number, got 1000000000000000000000000000000000000\.\.\.$"),
    ({"gpus": 2, "gpu": "V100", "switch_gbps": 5, "nodes": 2, "nic_gbps": 1e300},
     "'nic_gbps' must be a positive, finite number, got 1e\\+300$"),
    # strings, lists and booleans are not numbers (True would have been 1 GB/s)
    ({"gpus": 2, "gpu": "V100", "switch_gbps": "450"}, "'switch_gbps' must be a positive, "
                                                       "finite number, got '450'$"),
    ({"gpus": 2, "gpu": "V100", "switch_gbps": True}, "'switch_gbps' .* got True$"),
    ({"gpus": 2, "gpu": "V100", "links": [[0, 1, True]]}, "link 0<->1 .* got True$"),
    ({"gpus": 2, "gpu": "V100", "links": None}, r"'links' must be a list of \[a, b, gbps\], "
                                                "got None$"),
    ({"gpus": [True, False], "gpu": "V100", "switch_gbps": 5},
     "GPU ids are non-negative ints, got True in the GPU list$"),
    ({"gpus": 2, "gpu": "V100", "nodes": 2, "links": [[0.0, 1.0, 50]]},
     r"GPU ids are non-negative ints, got 0.0 in link \[0.0, 1.0, 50\]$"),
    # a negative count built an empty GPU list ("got []"); a negative id was accepted
    ({"gpus": -2, "gpu": "V100", "switch_gbps": 5}, "'gpus' is -2; a count must be at least 1$"),
    ({"gpus": 0, "gpu": "V100", "switch_gbps": 5}, "'gpus' is 0; a count must be at least 1$"),
    ({"gpus": [-1, 0], "gpu": "V100", "switch_gbps": 5},
     "GPU ids are non-negative ints, got -1 in the GPU list$"),
    ({"gpus": 2, "gpu": "V100", "links": [[0, -1, 50]]},
     r"GPU ids are non-negative ints, got -1 in link \[0, -1, 50\]$"),
    ({"gpus": 2, "gpu": "V100", "links": [[0, 1, 50], [1, 0, 10]]},
     r"link 1<->0 is given twice \(one link per pair of GPUs; both directions\)$"),
    ({"name": ["my", "server"], "gpus": 2, "gpu": "V100", "switch_gbps": 5},
     r"'name' must be a string, got \['my', 'server'\]$"),
    # a route per pair of GPUs: a mistyped count built for minutes and gigabytes
    ({"gpus": 10 ** 12, "gpu": "V100", "switch_gbps": 5},
     "'gpus' is 1000000000000; a topology model holds at most 2048 GPUs$"),
    ({"gpus": list(range(3000)), "gpu": "V100", "switch_gbps": 5},
     r"3000 GPUs; a topology model holds at most 2048 \(it keeps a route"),
    ({"gpus": 2, "gpu": "V100", "switch_gbps": 5, "nvlink_latency_us": -1},
     r"'nvlink_latency_us' must be a finite number at least 0, got -1$"),
    ({"gpus": 2, "gpu": "V100", "links": [[0, 1, 5]], "bus_latency_us": "2"},
     r"'bus_latency_us' must be a finite number at least 0, got '2'$"),
    ({"gpus": 2, "gpu": "V100", "switch_gbps": 5, "nic_latency_us": 1e400},
     r"'nic_latency_us' must be a finite number at least 0, got inf$"),
    ({"gpus": 2, "gpu": "V100", "switch_gbps": 5, "nvlink_latency_us": True},
     r"'nvlink_latency_us' must be a finite number at least 0, got True$"),
])
def test_from_json_errors(tmp_path, doc, msg):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(TopologyError, match=msg):
        Topology.from_json(p)


def test_from_json_bad_files(tmp_path):
    with pytest.raises(TopologyError, match="cannot read topology file"):
        Topology.from_json(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(TopologyError, match="is not JSON"):
        Topology.from_json(tmp_path / "x.json")
    # JSON that Python's parser refuses with other errors than JSONDecodeError
    (tmp_path / "deep.json").write_text("[" * 100_000)
    with pytest.raises(TopologyError, match="is not JSON: nested too deeply$"):
        Topology.from_json(tmp_path / "deep.json")
    (tmp_path / "digits.json").write_text('{"gpus": ' + "9" * 5000 + "}")
    with pytest.raises(TopologyError, match="is not JSON: Exceeds the limit"):
        Topology.from_json(tmp_path / "digits.json")


def test_build_takes_any_iterable_of_gpu_ids():
    # the 2,048-GPU check called len() on a generator
    for ids in ((g for g in range(4)), iter([0, 1, 2, 3]), map(int, "0123"), range(4)):
        t = Topology.build("t", ids, hbm_bw=1, flops=1, memory=1, switch_bw=1)
        assert t.gpus == (0, 1, 2, 3)
    with pytest.raises(TopologyError, match="over 2048 GPUs; a topology model holds at most"):
        Topology.build("t", (g for g in range(10 ** 9)), hbm_bw=1, flops=1, memory=1,
                       switch_bw=1)


def test_unlinked_pair_without_bus(tmp_path):
    """A topology where some pair has no path is refused when built, naming the pair (the
    naive program, the baseline synthesis must beat, sends directly)."""
    with pytest.raises(TopologyError, match=r"GPUs 0 and 2 are not connected \(2 pair\(s\)"):
        Topology.build("two", [0, 1, 2], hbm_bw=1, flops=1, memory=1, links=[(0, 1, 5.0)])
    t = Topology.build("two", [0, 1, 2], hbm_bw=1, flops=1, memory=1, links=[(0, 1, 5.0)],
                       bus_bw=1.0)
    assert t.route(0, 2) == ("pcie",)
    with pytest.raises(TopologyError, match="GPU 5 is not in topology 'two'"):
        t.route(0, 5)


def test_latency_defaults_json_and_describe(tmp_path):
    """Per-transfer latency: NCCL's model by default (3.4 us NVLink/NVSwitch, 5.7 us PCIe,
    9.6 us network), none on the paper's preset, set per class in JSON, written back by
    to_dict where not the default, and shown by describe."""
    assert get_topology("dgx-h100:2").route_latency(0, 1) == 3.4e-6
    assert get_topology("dgx-v100").route_latency(0, 5) == 5.7e-6     # over the bus
    assert get_topology("dgx-v100").route_latency(0, 1) == 3.4e-6
    assert get_topology("dgx-v100-paper").route_latency(0, 5) == 0.0
    assert get_topology("dgx-a100:2x2").route_latency(1, 2) == pytest.approx(13e-6)
    doc = {"gpus": 2, "gpu": "H100", "switch_gbps": 450, "nvlink_latency_us": 1.5,
           "nodes": 2, "nic_latency_us": 0}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    t = Topology.from_json(p)
    assert t.route_latency(0, 1) == pytest.approx(1.5e-6) and t.route_latency(0, 2) == 0.0
    assert t.route_latency(0, 3) == pytest.approx(1.5e-6)        # PXN: NVLink, then the NIC
    back = t.to_dict()
    assert (back["nvlink_latency_us"], back["nic_latency_us"]) == (1.5, 0.0)
    assert "bus_latency_us" not in back        # a switch has no bus
    assert dict(Topology.from_dict(back).latency) == dict(t.latency)
    assert "latency" not in json.dumps(get_topology("dgx-h100:2x2").to_dict())  # defaults
    assert "  latency per transfer: 3.4 us NVLink, 5.7 us bus" in \
        get_topology("dgx-v100").describe()
    assert "  latency per transfer: none" in get_topology("dgx-v100-paper").describe()
    assert "9.6 us latency per send" in get_topology("dgx-h100:2x4").describe()
    bare = get_topology("dgx-h100:2x4").without_latency()
    assert bare.name == "dgx-h100:2x4, no latency" and bare.route_latency(0, 5) == 0.0
    assert bare.capacity == get_topology("dgx-h100:2x4").capacity
    with pytest.raises(TopologyError, match="the NIC latency must be a finite number at least 0, got -1e-06"):
        Topology.multi_node(get_topology("dgx-h100:2"), 2, 50e9, nic_latency=-1e-6)


@pytest.mark.parametrize("us", [7.7, 12.345, 1 / 3, 3.399999999999999, 0.1])
def test_latencies_round_trip_through_json_bit_for_bit(us):
    """to_dict wrote round(seconds / 1e-6, 9) and from_dict multiplied by 1e-6: 7.7 us came
    back 1 ulp off, and 3.399999999999999 us, within 1e-9 of the default, was not written
    at all (the default came back). Now from_dict divides by 1e6 (correctly rounded) and
    every latency is written where it is not exactly the default, as a number that
    divides back to it."""
    for base, keys in (("dgx-v100", ("nvlink_latency_us", "bus_latency_us")),
                       ("dgx-h100:2x4", ("nvlink_latency_us", "nic_latency_us"))):
        doc = get_topology(base).to_dict()
        for k, key in enumerate(keys):
            doc[key] = us * (k + 1)
        t = Topology.from_dict(doc)
        back = Topology.from_dict(json.loads(json.dumps(t.to_dict())))
        assert dict(back.latency) == dict(t.latency)
        assert set(keys) <= set(t.to_dict())
    # the documented defaults, read from JSON, are the constants themselves (3.4 * 1e-6 was
    # 1 ulp below NVLINK_LATENCY_S, and to_dict then wrote it back out)
    t = Topology.from_dict({"gpus": 2, "gpu": "H100", "switch_gbps": 450, "nodes": 2,
                            "nvlink_latency_us": 3.4, "nic_latency_us": 9.6})
    assert t.class_latency("nvlink") == NVLINK_LATENCY_S == 3.4e-6
    assert t.class_latency("nic") == NIC_LATENCY_S == 9.6e-6
    assert "latency" not in json.dumps(t.to_dict())


def test_describe():
    d = get_topology("dgx-v100-paper").describe()
    lines = d.splitlines()
    assert "8 GPUs (V100)" in lines[0] and "HBM 900 GB/s" in lines[1]
    assert "15.75 GB/s" in d
    row0 = next(ln for ln in lines if ln.startswith("GPU0")).split()
    assert row0 == ["GPU0", "X", "25", "25", "25", "50", "bus", "bus", "bus"]
    d = get_topology("dgx-h100:4").describe()
    assert "4 GPUs" in d and "450 GB/s egress" in d and "HBM 3350 GB/s" in d
    # one GPU is singular, and a node of one GPU holds GPU n (it said 'GPUs 1n..1n+0')
    assert get_topology("dgx-h100:1").describe().startswith("topology dgx-h100:1: 1 GPU (H100)")
    d = get_topology("dgx-h100:2x1").describe()
    assert "2 GPUs (H100) in 2 nodes of 1 (node n holds GPU n)" in d
    assert "(node n holds GPUs 3n..3n+2)" in get_topology("dgx-h100:2x3").describe()


def test_nvidia_smi_full_mesh_of_direct_links():
    # HGX A100 4-GPU: NV4 between every pair uses all 12 of each GPU's NVLink ports, so the
    # links are direct (100 GB/s per pair), not a 100 GB/s-per-GPU switch
    text = ("\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tNV4\tNV4\tNV4\t0-31\t0\nGPU1\tNV4\t X \tNV4\tNV4\t0-31\t0\n"
            "GPU2\tNV4\tNV4\t X \tNV4\t0-31\t0\nGPU3\tNV4\tNV4\tNV4\t X \t0-31\t0\n")
    t = Topology.from_nvidia_smi(text, gpu="A100")
    assert t.kind == "mesh" and "pcie" not in t.capacity
    assert t.route(0, 3) == ("link:0->3",) and t.capacity["link:0->3"] == 100 * GB


def test_nvidia_smi_single_gpu():
    t = Topology.from_nvidia_smi("\tGPU0\tCPU Affinity\tNUMA Affinity\n"
                                 "GPU0\t X \t0-15\t0\n", gpu="NVIDIA H200")
    assert t.gpus == (0,) and t.memory == 141 * GB and t.route(0, 0) == ()
