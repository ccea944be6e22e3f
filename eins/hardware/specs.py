"""GPU data sheets and the units of topology files (paper Section 5.2, "Cost"): what a
GPU model's name tells about its NVLink ports, bandwidths, FLOP/s and memory, and the
default per-transfer latencies (:mod:`eins.hardware.topology` explains them).

All bandwidths are bytes/s; GB = 10**9 bytes, as in ExProg sizes.
"""
from __future__ import annotations

import re
from types import MappingProxyType

from eins.errors import TopologyError

GB = 1e9
TFLOP = 1e12

# Per GPU model: NVLink ports, NVLink bandwidth per link per direction, PCIe bandwidth per direction
# (x16 of the generation), HBM bandwidth, dense fp16/bf16 tensor FLOP/s, memory, and the dense
# float32 FLOP/s (without TF32: torch's default for matmuls) and float64 FLOP/s (tensor cores
# where the GPU has them). Public spec sheets; the preset values of issue 3 win where they are
# given.
# name: NVLink ports, then per link GB/s, PCIe GB/s, HBM GB/s, fp16/bf16 TFLOP/s, memory GB,
# float32 TFLOP/s, float64 TFLOP/s
_SPEC_ROWS = {
    "P100": (4, 20, 15.75, 732, 21.2, 16, 10.6, 5.3),
    "V100": (6, 25, 15.75, 900, 125, 32, 15.7, 7.8),
    "A100": (12, 25, 31.5, 1555, 312, 40, 19.5, 19.5),
    "A100-80GB": (12, 25, 31.5, 2039, 312, 80, 19.5, 19.5),
    "H100": (18, 25, 63, 3350, 989, 80, 67, 67),
    "H200": (18, 25, 63, 4800, 989, 141, 67, 67),
    "B200": (18, 50, 63, 8000, 2250, 180, 80, 40),
    "GB200": (18, 50, 63, 8000, 2500, 186, 80, 40),
}
GPU_SPECS = MappingProxyType({
    name: dict(links=ports, nvlink=nvl * GB, pcie=pcie * GB, hbm=hbm * GB, flops=f16 * TFLOP,
               memory=mem * GB, flops32=f32 * TFLOP, flops64=f64 * TFLOP)
    for name, (ports, nvl, pcie, hbm, f16, mem, f32, f64) in _SPEC_ROWS.items()})

# Per GPU model: the NIC (Gb/s per direction, as NICs are sold) each GPU of its usual 8-GPU
# server has for traffic between nodes: DGX-1 EDR (modelled per GPU; its 4 NICs serve 8 GPUs),
# DGX A100 HDR 200 Gb/s, DGX H100/H200/B200 NDR 400 Gb/s, GB200 800 Gb/s.
NIC_GBITS = MappingProxyType({"P100": 100, "V100": 100, "A100": 200, "A100-80GB": 200,
                              "H100": 400, "H200": 400, "B200": 400, "GB200": 800})
GBIT = 1e9 / 8  # bytes/s of one Gb/s
US = 1e-6
US_PER_S = 1e6   # JSON's microseconds back to seconds: divided by this (latency_s)

# Per-transfer latency, seconds (eins.hardware.topology's docstring): NCCL's hwLat of one
# ring step with the Simple protocol, over NVLink (NVSwitch included), PCIe and the network.
NVLINK_LATENCY_S = 3.4e-6
PCIE_LATENCY_S = 5.7e-6
NIC_LATENCY_S = 9.6e-6

# GPUs in one topology model at most (a server or a cluster): Topology.build and multi_node
# keep a route for every ordered pair of GPUs, so time and memory grow with the square of
# the count (docs/measured.md, "Behind the code's constants") and a mistyped count would
# hang or exhaust memory instead of failing.
MAX_CLUSTER_GPUS = 2048


def gpu_spec(name: str) -> tuple[str, dict]:
    """The canonical model name and spec of a GPU name as users and nvidia-smi write it
    (``"Tesla V100-SXM2-32GB"``, ``"NVIDIA H100 80GB HBM3"``, ``"h100"``, ``"H100NVL"``).
    A model is a word of the name, or begins one followed by letters: "RTX A1000" and
    "Quadro P1000" are not an A100 and a P100 (they matched as substrings)."""
    if not isinstance(name, str):
        raise TopologyError(f"GPU model must be a string such as 'H100', got {name!r}")
    words = re.findall(r"[A-Z0-9]+", name.upper())
    for key in ("GB200", "B200", "H200", "H100", "A100", "V100", "P100"):
        if any(re.fullmatch(key + r"[A-Z]*", w) for w in words):
            if key == "A100" and any(w.startswith("80G") for w in words):
                key = "A100-80GB"
            return key, GPU_SPECS[key]
    raise TopologyError(f"unknown GPU {name!r}: known models are {', '.join(GPU_SPECS)}")

