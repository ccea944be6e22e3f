"""The topology presets (paper Section 5.2 and issue 3) and :func:`get_topology`, which
resolves a preset name, a preset with a GPU count or node count, or a JSON file."""
from __future__ import annotations

import dataclasses
import re
from types import MappingProxyType

from eins.errors import TopologyError
from eins.hardware.profile import Profile, load_profile
from eins.hardware.specs import GB, GBIT, GPU_SPECS, NIC_LATENCY_S
from eins.hardware.topology import Topology

DGX1V_NVIDIA_SMI = """\
        GPU0    GPU1    GPU2    GPU3    GPU4    GPU5    GPU6    GPU7
GPU0     X      NV1     NV1     NV2     NV2     SYS     SYS     SYS
GPU1    NV1      X      NV2     NV1     SYS     NV2     SYS     SYS
GPU2    NV1     NV2      X      NV2     SYS     SYS     NV1     SYS
GPU3    NV2     NV1     NV2      X      SYS     SYS     SYS     NV1
GPU4    NV2     SYS     SYS     SYS      X      NV1     NV1     NV2
GPU5    SYS     NV2     SYS     SYS     NV1      X      NV2     NV1
GPU6    SYS     SYS     NV1     SYS     NV1     NV2      X      NV2
GPU7    SYS     SYS     SYS     NV1     NV2     NV1     NV2      X
"""
"""The real DGX-1V's `nvidia-smi topo -m` matrix (issue 3), source of the ``dgx-v100`` preset."""


def _dgx_v100_paper() -> Topology:
    # Paper Section 5.2: double links on the pillars 0-4, 1-5, 2-6, 3-7; single links inside
    # each socket's quad; everything else over the one shared 15.75 GB/s bridge. The paper's
    # model has no per-transfer latency, so neither has this preset.
    links = [(i, i + 4, 50 * GB) for i in range(4)]
    for quad in ((0, 1, 2, 3), (4, 5, 6, 7)):
        links += [(a, b, 25 * GB) for k, a in enumerate(quad) for b in quad[k + 1:]]
    v = GPU_SPECS["V100"]
    return Topology.build("dgx-v100-paper", range(8), hbm_bw=v["hbm"], flops=v["flops"],
                          memory=v["memory"], links=links, bus_bw=15.75 * GB, gpu_model="V100",
                          nvlink_latency=0.0, bus_latency=0.0)


# Switch presets: (GPU model, per-GPU NVSwitch GB/s, default GPUs); HBM, FLOP/s and memory
# are the model's GPU_SPECS.
SWITCH_PRESETS = MappingProxyType({
    "dgx-a100": ("A100", 300, 8),
    "dgx-h100": ("H100", 450, 8),
    "hgx-h200": ("H200", 450, 8),
    "dgx-b200": ("B200", 900, 8),
    "gb200-nvl72": ("GB200", 900, 72),
})


# The machine profile each preset's GPU model ships with (docs/costs.md, "Calibration"):
# the H200's, fitted from the measurements of benchmarks/results/h200-2026-12-04*/. The
# other presets stay uncalibrated (the data sheet's roofline, which the paper's figures and
# docs/measured.md's predictions are computed on); the published figures of H100 and A100
# kernels ship as opt-in profiles (``profile="h100-published"``, eins/hardware/profiles/).
PRESET_PROFILES = MappingProxyType({"H200": "h200"})


def preset_profile(model: str) -> Profile | None:
    """The profile shipped for GPU ``model`` (None: none; the data sheet prices it)."""
    return load_profile(PRESET_PROFILES[model]) if model in PRESET_PROFILES else None


def _switch(name, n=None) -> Topology:
    model, bw, default = SWITCH_PRESETS[name]
    spec = GPU_SPECS[model]
    n = default if n is None else n
    label = name if n == default else f"{name}:{n}"
    topo = Topology.build(label, range(n), hbm_bw=spec["hbm"], flops=spec["flops"],
                          memory=spec["memory"], switch_bw=bw * GB, gpu_model=model)
    return dataclasses.replace(topo, profile=preset_profile(model))


PRESETS = MappingProxyType({
    "dgx-v100-paper": _dgx_v100_paper(),
    "dgx-v100": Topology.from_nvidia_smi(DGX1V_NVIDIA_SMI, gpu="V100", name="dgx-v100"),
    **{name: _switch(name) for name in SWITCH_PRESETS},
})
"""Every preset at its full size, by name; switch presets also take ``:N`` (get_topology)."""


def get_topology(name, profile=None) -> Topology:
    """A preset by name (``"dgx-h100"``), a switch preset with a GPU count
    (``"dgx-h100:4"``: GPUs 0..3, at most the machine's own count), a cluster of N such
    servers (``"dgx-h100:2x8"``: 2 nodes of 8 GPUs, GPUs 0..15, one NIC per GPU of the
    preset's :data:`PRESET_NIC_GBITS`; a fixed preset takes its own count,
    ``"dgx-v100:4x8"``), N logical devices on G of a switch preset's GPUs
    (``"hgx-h200:8/1"``: 8 devices sharing one H200, :meth:`Topology.logical`), a ``.json``
    file (:meth:`Topology.from_json`), or a Topology as is. ``profile`` (a Profile, a
    shipped profile's name or a JSON file, eins/hardware/profile.py; ``"none"``: the data
    sheet alone) replaces the topology's machine profile (the hgx-h200 preset ships one)."""
    return _get_topology(name, profile)


def _with_profile(topo, profile) -> Topology:
    if profile is None:
        return topo
    prof = None if profile == "none" else load_profile(profile)
    node = dataclasses.replace(topo.node, profile=prof) if topo.node is not None else None
    return dataclasses.replace(topo, profile=prof, node=node)


def _get_topology(name, profile=None) -> Topology:
    if isinstance(name, Topology):
        return _with_profile(name, profile)
    if str(name).endswith(".json"):
        return _with_profile(Topology.from_json(name), profile)
    base, sep, count = str(name).partition(":")
    if base not in PRESETS:
        raise TopologyError(f"unknown topology {name!r}: presets are {', '.join(PRESETS)}")
    if not sep:
        return _with_profile(PRESETS[base], profile)
    if len(count) > 20:   # int() of 4,301+ digits raises ValueError; no count is that long
        raise TopologyError(f"GPU count in {name[:60]!r}... is {len(count)} characters long; "
                            f"write N or KxN with N and K whole numbers")
    m = re.fullmatch(r"([0-9]+)x([0-9]+)", count)   # ASCII digits: int() takes others
    if m:
        return _with_profile(_cluster(base, int(m.group(1)), int(m.group(2)), name), profile)
    m = re.fullmatch(r"([0-9]+)/([0-9]+)", count)
    if m and base in SWITCH_PRESETS:   # N logical devices on G GPUs
        n, g = int(m.group(1)), int(m.group(2))
        if not 1 <= g <= SWITCH_PRESETS[base][-1] or n < g:
            raise TopologyError(f"{name!r}: N/G places N logical devices on G GPUs; G must "
                                f"be in 1..{SWITCH_PRESETS[base][-1]} and N at least G")
        # the profile first: the devices' local copies run at its copy rate
        return _with_profile(_switch(base, g), profile).logical(n, name=str(name))
    if base not in SWITCH_PRESETS:
        raise TopologyError(f"topology {base!r} has a fixed set of GPUs; only switch presets "
                            f"({', '.join(SWITCH_PRESETS)}) take a GPU count, got {name!r}")
    default = SWITCH_PRESETS[base][-1]
    if not re.fullmatch(r"[0-9]+", count) or not 1 <= int(count) <= default:
        raise TopologyError(f"GPU count {count!r} in {name!r} must be an integer in "
                            f"1..{default}")
    return _with_profile(_switch(base, int(count)), profile)


# Gb/s of each GPU's NIC in a cluster of a preset's servers (DGX A100: 8 HDR 200 Gb/s; DGX
# H100, HGX H200, DGX B200: 8 NDR 400 Gb/s, the number; GB200: 800 Gb/s; DGX-1: its 4
# EDR 100 Gb/s NICs, modelled as one per GPU).
PRESET_NIC_GBITS = MappingProxyType({"dgx-v100-paper": 100, "dgx-v100": 100, "dgx-a100": 200,
                                     "dgx-h100": 400, "hgx-h200": 400, "dgx-b200": 400,
                                     "gb200-nvl72": 800})


def _cluster(base, nodes, per_node, name) -> Topology:
    full = len(PRESETS[base].gpus)
    if base in SWITCH_PRESETS:
        if not 1 <= per_node <= full:
            raise TopologyError(f"GPUs per node {per_node} in {name!r} must be in 1..{full}")
        node = _switch(base, per_node)
    elif per_node != full:
        raise TopologyError(f"topology {base!r} has a fixed set of {full} GPUs; write "
                            f"'{base}:{nodes}x{full}', got {name!r}")
    else:
        node = PRESETS[base]
    if nodes < 1:
        raise TopologyError(f"node count {nodes} in {name!r} must be at least 1")
    return Topology.multi_node(node, nodes, PRESET_NIC_GBITS[base] * GBIT,
                               name=f"{base}:{nodes}x{per_node}",
                               nic_latency=0.0 if base == "dgx-v100-paper" else NIC_LATENCY_S)
