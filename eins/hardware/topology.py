"""Hardware models for the exchange-program simulator (paper Section 5.2, "Cost").

A :class:`Topology` describes one server: its GPUs (every GPU of a topology is the same
model, so ``hbm_bw``, ``flops`` and ``memory`` are per-GPU scalars) and an interconnect made
of *resources* that transfers share. Each resource has a capacity in bytes/s
(``capacity[resource]``) and ``route(src, dst)`` names the resources a ``src -> dst`` transfer
draws on. Three kinds of resource exist:

- ``"egress:g"`` / ``"ingress:g"``: a GPU's port into / out of an NVSwitch fabric. The paper
  models DGX-A100/H100 as fully non-blocking, so the only contention is at endpoints: a
  transfer uses the source's egress and the destination's ingress.
- ``"link:a->b"``: one direction of a point-to-point NVLink bundle (NV# links × the
  generation's per-link bandwidth). The two directions are separate resources.
- ``"pcie"``: the PCIe bridge. Decision: it is *one* resource shared by every transfer
  between GPUs without an NVLink, in both directions, because the paper gives the DGX-V100
  bridge "15.75 GB/s of total capacity shared by all such transfers".

Clusters of several such servers (``kind="multinode"``, :meth:`Topology.multi_node`) add
``"nic-out:g"`` / ``"nic-in:g"``: GPU g's network port, one NIC per GPU, rail-optimized.

Every transfer also pays a fixed *latency* before its bytes flow (``latency[resource]``
seconds, summed over its route; :meth:`Topology.route_latency`): the sending side of each
segment carries it (``egress``, ``link``, ``pcie``, ``nic-out``), so a PXN route between
nodes pays an NVLink crossing and a network send. The defaults are NCCL's own model of one
step of a ring with its Simple protocol, the bulk-copy one (``hwLat`` in NCCL's
``src/graph/tuning.cc``): 3.4 us over NVLink or NVSwitch, 5.7 us over PCIe,
9.6 us over the network. The paper's model has no latency, and the ``dgx-v100-paper`` preset
keeps none, so its numbers stay the paper's.

All bandwidths are bytes/s; GB = 10**9 bytes, as in ExProg sizes.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import numbers
import re
from dataclasses import dataclass, field
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
US_PER_S = 1e6   # JSON's microseconds back to seconds: divided by this (_latency)

# Per-transfer latency, seconds (module docstring): NCCL's hwLat of one ring step with the
# Simple protocol, over NVLink (NVSwitch included), PCIe and the network.
NVLINK_LATENCY_S = 3.4e-6
PCIE_LATENCY_S = 5.7e-6
NIC_LATENCY_S = 9.6e-6

# GPUs in one topology model at most (a server or a cluster): Topology.build and multi_node
# keep a route for every ordered pair of GPUs, so time and memory grow with the square of
# the count (2,048 GPUs, 256 DGX nodes: about 6 s and 1.4 GB here; 8,000 took 150 s and
# 21.5 GB) and a mistyped count would hang or exhaust memory instead of failing.
MAX_CLUSTER_GPUS = 2048

# `nvidia-smi topo -m` connection kinds that go over PCIe (through switches, host bridges or
# the inter-socket link); the simulator does not distinguish them.
_PCIE_KINDS = frozenset({"SYS", "NODE", "PHB", "PXB", "PIX", "SOC"})


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


def _positive(name, label, v, scale: float = 1.0, zero: bool = False) -> float:
    """``v * scale`` as a float when ``v`` is a real number (not a bool, not a string) and
    the product is positive (``zero``: or 0, as a latency may be) and finite; else a
    TopologyError naming ``label`` of topology ``name`` and ``v`` as given. An infinite
    bandwidth would leave the simulator's max-min rates at inf - inf = nan, looping."""
    f = None
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        try:
            f = float(v) * scale
        except OverflowError:   # an int beyond float's range
            f = None
    if f is None or not (0 <= f if zero else 0 < f) or not f < math.inf:
        what = "a finite number at least 0" if zero else "a positive, finite number"
        raise TopologyError(f"topology {name!r}: {label} must be {what}, got {_short(v)}")
    return f


def _latency(name, label, v, per_second: float = 1.0) -> float:
    """A latency in seconds from ``v`` in units of ``1 / per_second`` seconds (JSON's
    microseconds: ``per_second=1e6``): :func:`_positive` that also takes 0. Divided, not
    multiplied by 1e-6: a division is correctly rounded, so 3.4 us is NVLINK_LATENCY_S
    exactly (3.4 * 1e-6 is 1 ulp below it)."""
    return _positive(name, label, v, zero=True) / per_second


def _in_us(v: float) -> float:
    """Seconds ``v`` as the microseconds a JSON file holds: the shortest-looking number
    ``u`` (``round(v * 1e6, 9)`` where that suffices) for which ``u / 1e6`` (what
    :meth:`Topology.from_dict` computes) is ``v`` again, so files round-trip bit for bit.
    Some doubles are no double's quotient by 1e6 (about 4 % of arbitrary ones, none of a
    few decimal digits): for those the nearest, 1 ulp off."""
    u = v * US_PER_S
    for cand in (round(u, 9), u):
        if cand / US_PER_S == v:
            return cand
    lo = hi = u
    for _ in range(4):   # u / 1e6 is within a few ulps of v: a neighbour of u hits it
        lo, hi = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
        for cand in (lo, hi):
            if cand / US_PER_S == v:
                return cand
    return u


def _short(v) -> str:
    """``repr(v)``, cut to 40 characters (a 400-digit number in a file stays readable)."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _gpu_id(name, v, where: str) -> int:
    # non-negative: device ids are (distribute, ExProg sites), so a GPU -1 could never be used
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise TopologyError(f"topology {name!r}: GPU ids are non-negative ints, got "
                            f"{_short(v)} in {where}")
    return int(v)


def _gbps(x: float) -> str:
    return f"{x / GB:g} GB/s"


@dataclass(frozen=True, eq=False)
class Topology:
    """One server's GPUs and interconnect (see the module docstring for resources).

    ``routes`` maps every ordered pair of distinct GPUs to the resources its transfers use;
    ``kind`` is ``"switch"`` (NVSwitch fabric) or ``"mesh"`` (point-to-point links plus
    PCIe). Build one with :func:`get_topology`, :meth:`from_json` or :meth:`from_nvidia_smi`.
    """

    name: str
    gpus: tuple[int, ...]
    hbm_bw: float  # bytes/s, per GPU
    flops: float  # dense fp16/bf16 FLOP/s, per GPU
    memory: float  # bytes, per GPU
    capacity: MappingProxyType  # resource id -> bytes/s
    routes: MappingProxyType  # (src, dst) -> tuple of resource ids
    kind: str = "mesh"
    gpu_model: str = ""
    # multi-node clusters (kind "multinode"): the per-node Topology, the node count, and the
    # bytes/s of each GPU's NIC; a single server has nodes=1 and node=None
    nodes: int = 1
    node: object = None
    nic_bw: float = 0.0
    # dense float32 and float64 FLOP/s per GPU (GPU_SPECS of the model, or the JSON's
    # tflops_fp32 / tflops_fp64); 0: not known, charged at ``flops`` as 16-bit floats are
    flops32: float = 0.0
    flops64: float = 0.0
    # resource id -> seconds a transfer over it waits before its bytes flow (only nonzero
    # entries; module docstring)
    latency: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    def flops_of(self, dtype) -> float:
        """FLOP/s of a kernel computing in ``dtype``: the dense 16-bit float rate for float16
        and bfloat16, the float32 or float64 rate for those (ints and bools: float32's, as
        the GPU runs them on its CUDA cores or, matmuls, through float32 products); ``flops``
        where the rate is not known."""
        import numpy as np
        d = np.dtype(dtype)
        if d.itemsize == 2 and d.kind in "fV":   # float16, bfloat16
            return self.flops
        rate = self.flops64 if d == np.dtype(np.float64) else self.flops32
        return rate or self.flops

    @property
    def gpus_per_node(self) -> int:
        return len(self.node.gpus) if self.node is not None else len(self.gpus)

    def node_of(self, gpu: int) -> int:
        """The node (0-based) holding ``gpu``."""
        return self.gpus.index(gpu) // self.gpus_per_node

    def route(self, src: int, dst: int) -> tuple[str, ...]:
        """The resources a ``src -> dst`` transfer draws on (``()`` when ``src == dst``)."""
        for g in (src, dst):
            if g not in self.gpus:
                raise TopologyError(f"GPU {g!r} is not in topology {self.name!r} "
                                    f"(GPUs {list(self.gpus)})")
        if src == dst:
            return ()
        try:
            return self.routes[(src, dst)]
        except KeyError:
            raise TopologyError(f"topology {self.name!r} has no path from GPU {src} to GPU "
                                f"{dst}") from None

    def class_latency(self, kind: str) -> float | None:
        """The latency of a transfer over ``kind``, ``"nvlink"`` (NVSwitch ports and NVLink
        bundles), ``"bus"`` (the PCIe bridge) or ``"nic"`` (the network); None where this
        topology has no such resource."""
        prefixes = {"nvlink": ("egress:", "link:"), "bus": ("pcie",), "nic": ("nic-out:",)}[kind]
        if self.kind == "multinode" and kind != "nic":
            return self.node.class_latency(kind)
        for r in self.capacity:
            if r.startswith(prefixes):
                return self.latency.get(r, 0.0)
        return None

    def without_latency(self) -> "Topology":
        """This topology under the paper's model, with no per-transfer latency (named
        ``"<name>, no latency"``): what the paper's examples of Section 5 are computed on."""
        if not any(self.latency.values()):
            return self
        node = self.node.without_latency() if self.node is not None else None
        return dataclasses.replace(self, name=f"{self.name}, no latency", node=node,
                                   latency=MappingProxyType({}))

    def route_latency(self, src: int, dst: int) -> float:
        """Seconds a lone ``src -> dst`` transfer waits before its bytes flow: the sum of
        its route's resource latencies (0 when ``src == dst``)."""
        return sum(self.latency.get(r, 0.0) for r in self.route(src, dst))

    def bandwidth(self, src: int, dst: int) -> float:
        """Bytes/s of a lone ``src -> dst`` transfer: its route's narrowest resource."""
        r = self.route(src, dst)
        return min(self.capacity[x] for x in r) if r else float("inf")

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def build(cls, name, gpus, *, hbm_bw, flops, memory, switch_bw=None, links=(),
              bus_bw=None, gpu_model="", flops32=None, flops64=None,
              nvlink_latency=NVLINK_LATENCY_S, bus_latency=PCIE_LATENCY_S) -> "Topology":
        """A topology from its parts: ``switch_bw`` (per-GPU egress and ingress of an
        NVSwitch fabric) or ``links`` (``(a, b, bytes/s)``, both directions) plus ``bus_bw``
        (one PCIe bridge shared by every unlinked pair). ``flops32``/``flops64`` default to
        the ``gpu_model``'s (:data:`GPU_SPECS`), else unknown. ``nvlink_latency`` (NVSwitch
        or NVLink) and ``bus_latency`` (PCIe): seconds per transfer (module docstring)."""
        if not isinstance(name, str):
            raise TopologyError(f"a topology's name is a string, got {name!r}")
        n = len(gpus) if hasattr(gpus, "__len__") else None
        gpus = tuple(itertools.islice(gpus, MAX_CLUSTER_GPUS + 1))   # any iterable of ids
        if len(gpus) > MAX_CLUSTER_GPUS:
            raise TopologyError(f"topology {name!r}: {n or 'over ' + str(MAX_CLUSTER_GPUS)} "
                                f"GPUs; a topology model holds at most {MAX_CLUSTER_GPUS} (it "
                                f"keeps a route for every pair of GPUs)")
        gpus = tuple(_gpu_id(name, g, "the GPU list") for g in gpus)
        if not gpus or len(set(gpus)) != len(gpus):
            raise TopologyError(f"topology {name!r}: GPUs must be distinct and non-empty, "
                                f"got {list(gpus)}")
        hbm_bw, flops, memory = (_positive(name, label, v) for label, v in (
            ("hbm_bw", hbm_bw), ("flops", flops), ("memory", memory)))
        nvlink_latency, bus_latency = (_latency(name, label, v) for label, v in (
            ("the NVLink latency", nvlink_latency), ("the bus latency", bus_latency)))
        spec = GPU_SPECS.get(gpu_model, {})
        flops32, flops64 = (0.0 if v is None and key not in spec else
                            _positive(name, key, spec[key] if v is None else v)
                            for key, v in (("flops32", flops32), ("flops64", flops64)))
        cap, routes = {}, {}
        if switch_bw is not None:
            switch_bw = _positive(name, "switch bandwidth", switch_bw)
            for g in gpus:
                cap[f"egress:{g}"] = cap[f"ingress:{g}"] = float(switch_bw)
            for s in gpus:
                for d in gpus:
                    if s != d:
                        routes[(s, d)] = (f"egress:{s}", f"ingress:{d}")
            kind = "switch"
        else:
            kind = "mesh"
            for a, b, bw in links:
                a, b = (_gpu_id(name, g, f"link {a!r}<->{b!r}") for g in (a, b))
                if a not in gpus or b not in gpus or a == b:
                    raise TopologyError(f"topology {name!r}: link {a}<->{b} needs two "
                                        f"distinct GPUs of {list(gpus)}")
                bw = _positive(name, f"link {a}<->{b} bandwidth", bw)
                if (a, b) in routes:
                    raise TopologyError(f"topology {name!r}: link {a}<->{b} is given twice "
                                        f"(one link per pair of GPUs; both directions)")
                for s, d in ((a, b), (b, a)):
                    cap[f"link:{s}->{d}"] = float(bw)
                    routes[(s, d)] = (f"link:{s}->{d}",)
            if bus_bw is not None:
                bus_bw = _positive(name, "bus bandwidth", bus_bw)
                for s in gpus:
                    for d in gpus:
                        if s != d and (s, d) not in routes:
                            cap["pcie"] = float(bus_bw)
                            routes[(s, d)] = ("pcie",)
        lat = {r: nvlink_latency if r.startswith(("egress:", "link:")) else bus_latency
               for r in cap if r.startswith(("egress:", "link:", "pcie"))}
        unlinked = [(s, d) for s in gpus for d in gpus if s < d and (s, d) not in routes]
        if unlinked:
            # Every pair needs a path of its own: exchange programs relay around *slow*
            # links, and the naive baseline they must beat sends directly.
            s, d = unlinked[0]
            raise TopologyError(f"topology {name!r}: GPUs {s} and {d} are not connected "
                                f"({len(unlinked)} pair(s) without a path); add a link "
                                f"between them or a PCIe bus for unlinked pairs")
        return cls(name=name, gpus=gpus, hbm_bw=float(hbm_bw), flops=float(flops),
                   memory=float(memory), capacity=MappingProxyType(cap),
                   routes=MappingProxyType(routes), kind=kind, gpu_model=gpu_model,
                   flops32=flops32, flops64=flops64,
                   latency=MappingProxyType({r: v for r, v in lat.items() if v}))

    @classmethod
    def multi_node(cls, node: "Topology", nodes: int, nic_bw: float, name=None,
                   nic_latency=NIC_LATENCY_S) -> "Topology":
        """``nodes`` copies of the server ``node`` joined by one NIC of ``nic_bw`` bytes/s per
        GPU (per direction), rail-optimized: GPU i of every node hangs on rail switch i. A
        send over the network waits ``nic_latency`` seconds (module docstring).

        GPU k of node n is GPU ``n * G + k`` (G GPUs per node, k its position in
        ``node.gpus``). Inside a node, routes are the node's own (its resources renamed per
        node). Between nodes, a transfer from local GPU i to local GPU i of another node uses
        the source's ``nic-out`` and the destination's ``nic-in``; the rail fabric itself is
        non-blocking. A transfer to another rail first crosses the source node to the GPU on
        the destination's rail and leaves through that GPU's NIC, as NCCL's PXN does on
        rail-optimized clusters, so it also draws on that GPU's node-local resources."""
        label = name or f"{node.name}:{nodes}x{len(node.gpus)}"
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise TopologyError(f"topology {label!r}: the node count must be a positive int, "
                                f"got {nodes!r}")
        if node.kind == "multinode":
            raise TopologyError(f"topology {label!r}: a node must be one server, got the "
                                f"cluster {node.name!r}")
        nic_bw = _positive(label, "NIC bandwidth", nic_bw)
        nic_latency = _latency(label, "the NIC latency", nic_latency)
        g = len(node.gpus)
        if nodes * g > MAX_CLUSTER_GPUS:
            raise TopologyError(f"topology {label!r}: {nodes} nodes x {g} GPUs is "
                                f"{nodes * g} GPUs; a cluster model holds at most "
                                f"{MAX_CLUSTER_GPUS} (it keeps a route for every pair of GPUs)")
        pos = {gpu: k for k, gpu in enumerate(node.gpus)}

        def rename(r, n):
            kind, _, rest = r.partition(":")
            if kind in ("egress", "ingress"):
                return f"{kind}:{n * g + pos[int(rest)]}"
            if kind == "link":
                a, b = rest.split("->")
                return f"link:{n * g + pos[int(a)]}->{n * g + pos[int(b)]}"
            return f"{r}@node{n}"  # a shared resource of one node (its PCIe bridge)

        cap, routes, lat = {}, {}, {}
        for n in range(nodes):
            for r, c in node.capacity.items():
                cap[rename(r, n)] = c
                if node.latency.get(r):
                    lat[rename(r, n)] = node.latency[r]
            for (a, b), route in node.routes.items():
                routes[(n * g + pos[a], n * g + pos[b])] = tuple(rename(r, n) for r in route)
        total = nodes * g
        for x in range(total):
            cap[f"nic-out:{x}"] = cap[f"nic-in:{x}"] = float(nic_bw)
            if nic_latency:
                lat[f"nic-out:{x}"] = nic_latency
        for s_ in range(total):
            for d in range(total):
                if s_ // g == d // g:
                    continue
                relay = (s_ // g) * g + d % g  # the source node's GPU on the destination's rail
                hop = routes[(s_, relay)] if relay != s_ else ()
                routes[(s_, d)] = hop + (f"nic-out:{relay}", f"nic-in:{d}")
        return cls(name=label, gpus=tuple(range(total)), hbm_bw=node.hbm_bw, flops=node.flops,
                   memory=node.memory, capacity=MappingProxyType(cap),
                   routes=MappingProxyType(routes), kind="multinode",
                   gpu_model=node.gpu_model, nodes=nodes, node=node, nic_bw=float(nic_bw),
                   flops32=node.flops32, flops64=node.flops64,
                   latency=MappingProxyType(lat))

    @classmethod
    def from_json(cls, path) -> "Topology":
        """Read a topology from a JSON file. Schema (bandwidths in GB/s per direction,
        GB = 10**9 bytes)::

            {
              "name": "my-server",            # optional; default: the file name
              "gpus": 8,                      # N (ids 0..N-1) or a list of GPU ids
              "gpu": "H100",                  # optional model: defaults for the 3 below
              "hbm_gbps": 3350,               # HBM bandwidth per GPU
              "tflops": 989,                  # dense fp16/bf16 TFLOP/s per GPU
              "tflops_fp32": 67,              # optional: dense float32 and float64 TFLOP/s
              "tflops_fp64": 67,              #   (default: the 'gpu' model's, else tflops)
              "memory_gb": 80,                # memory per GPU
              "switch_gbps": 450,             # NVSwitch fabric: per-GPU egress and ingress
              "links": [[0, 4, 50], ...],     # or point-to-point links, both directions
              "bus_gbps": 15.75,              # one bridge shared by all unlinked pairs
              "nodes": 2,                     # optional: a cluster of this many such
              "nic_gbps": 50,                 # servers ('gpus' is per node), one NIC per GPU
                                              # (50 GB/s = 400 Gb/s; default NIC_GBITS[gpu])
              "nvlink_latency_us": 3.4,       # optional: microseconds per transfer over
              "bus_latency_us": 5.7,          #   NVLink/NVSwitch, the bus, the network
              "nic_latency_us": 9.6           #   (these defaults; 0 for none)
            }

        Give either ``switch_gbps`` or ``links`` (``bus_gbps`` optional); with neither, every
        pair needs the bus. Unknown keys are an error, so typos do not pass silently.
        """
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as e:
            raise TopologyError(f"cannot read topology file {str(path)!r}: {e.strerror}") from None
        except (ValueError, RecursionError) as e:
            # JSONDecodeError and UnicodeDecodeError (binary files) are ValueErrors, as is an
            # integer of more digits than Python converts; deep nesting recurses too far
            what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise TopologyError(f"topology file {str(path)!r} is not JSON: {what}") from None
        return cls.from_dict(doc, default_name=str(path))

    @classmethod
    def from_dict(cls, doc, default_name="topology") -> "Topology":
        """The parsed JSON of :meth:`from_json`."""
        keys = {"name", "gpus", "gpu", "hbm_gbps", "tflops", "memory_gb", "switch_gbps",
                "links", "bus_gbps", "nodes", "nic_gbps", "tflops_fp32", "tflops_fp64",
                "nvlink_latency_us", "bus_latency_us", "nic_latency_us"}
        if not isinstance(doc, dict):
            raise TopologyError(f"topology {default_name!r}: expected a JSON object, got "
                                f"{type(doc).__name__}")
        extra = sorted(set(doc) - keys)
        if extra:
            raise TopologyError(f"topology {default_name!r}: unknown key {extra[0]!r} "
                                f"(known: {', '.join(sorted(keys))})")
        name = doc.get("name", default_name)
        if not isinstance(name, str):
            raise TopologyError(f"topology {default_name!r}: 'name' must be a string, got "
                                f"{name!r}")
        if "nodes" in doc or "nic_gbps" in doc or "nic_latency_us" in doc:
            return cls._cluster_from_dict(doc, name)
        gpus = doc.get("gpus")
        if isinstance(gpus, int) and not isinstance(gpus, bool):
            if gpus > MAX_CLUSTER_GPUS:
                raise TopologyError(f"topology {name!r}: 'gpus' is {gpus}; a topology model "
                                    f"holds at most {MAX_CLUSTER_GPUS} GPUs")
            if gpus < 1:   # range(gpus) is empty: the error would say "got []"
                raise TopologyError(f"topology {name!r}: 'gpus' is {gpus}; a count must be "
                                    f"at least 1")
            gpus = range(gpus)
        elif not (isinstance(gpus, list) and all(isinstance(g, int) for g in gpus)):
            raise TopologyError(f"topology {name!r}: 'gpus' must be a count or a list of "
                                f"ints, got {gpus!r}")
        model, spec = gpu_spec(doc["gpu"]) if "gpu" in doc else ("", {})
        vals = {}
        for key, skey, unit in (("hbm_gbps", "hbm", GB), ("tflops", "flops", TFLOP),
                                ("memory_gb", "memory", GB)):
            if key in doc:
                vals[skey] = _positive(name, repr(key), doc[key], unit)
            elif skey in spec:
                vals[skey] = spec[skey]
            else:
                raise TopologyError(f"topology {name!r}: missing {key!r} (or a 'gpu' model)")
        links = []
        raw = doc.get("links", [])
        if not isinstance(raw, list):
            raise TopologyError(f"topology {name!r}: 'links' must be a list of [a, b, gbps], "
                                f"got {_short(raw)}")
        for ln in raw:
            if not (isinstance(ln, list) and len(ln) == 3):
                raise TopologyError(f"topology {name!r}: a link is [a, b, gbps], got "
                                    f"{_short(ln)}")
            a, b = (_gpu_id(name, g, f"link {_short(ln)}") for g in ln[:2])
            links.append((a, b, _positive(name, f"the GB/s of link {a}<->{b}", ln[2], GB)))
        sw, bus = (None if doc.get(k) is None else _positive(name, repr(k), doc[k], GB)
                   for k in ("switch_gbps", "bus_gbps"))
        if sw is not None and (links or bus is not None):
            raise TopologyError(f"topology {name!r}: 'switch_gbps' excludes 'links' and "
                                f"'bus_gbps'")
        f32, f64 = (None if doc.get(k) is None else _positive(name, repr(k), doc[k], TFLOP)
                    for k in ("tflops_fp32", "tflops_fp64"))
        lat = {arg: _latency(name, repr(key), doc[key], US_PER_S)
               for key, arg in (("nvlink_latency_us", "nvlink_latency"),
                                ("bus_latency_us", "bus_latency")) if key in doc}
        return cls.build(name, gpus, hbm_bw=vals["hbm"], flops=vals["flops"],
                         memory=vals["memory"], switch_bw=sw, links=links, bus_bw=bus,
                         gpu_model=model, flops32=f32, flops64=f64, **lat)

    @classmethod
    def _cluster_from_dict(cls, doc, name) -> "Topology":
        nodes = doc.get("nodes", 1)
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise TopologyError(f"topology {name!r}: 'nodes' must be a positive int, got "
                                f"{nodes!r}")
        node = cls.from_dict({k: v for k, v in doc.items()
                              if k not in ("nodes", "nic_gbps", "nic_latency_us")},
                             default_name=name)
        nic = doc.get("nic_gbps")
        if nic is None:
            if node.gpu_model not in NIC_GBITS:
                raise TopologyError(f"topology {name!r}: missing 'nic_gbps' (or a 'gpu' model)")
            nic_bw = NIC_GBITS[node.gpu_model] * GBIT
        else:
            nic_bw = _positive(name, "'nic_gbps'", nic, GB)
        lat = ({} if "nic_latency_us" not in doc else
               {"nic_latency": _latency(name, "'nic_latency_us'", doc["nic_latency_us"],
                                        US_PER_S)})
        return cls.multi_node(node, nodes, nic_bw, name=name, **lat)

    @classmethod
    def from_nvidia_smi(cls, text: str, gpu: str, name: str = "nvidia-smi", nodes: int = 1,
                        nic_gbits: float | None = None) -> "Topology":
        """Read the matrix printed by ``nvidia-smi topo -m``. ``gpu`` names the GPU model
        (its NVLink generation sets the per-link bandwidth; HBM, FLOP/s and memory come from
        :data:`GPU_SPECS`). ``NV#`` pairs become links of # × the per-link bandwidth; when
        every pair shows the same ``NV#`` the machine is an NVSwitch fabric with per-GPU
        egress and ingress of # × the per-link bandwidth (unless the GPU has enough NVLink
        ports for # links to every other GPU: then they are direct links); SYS, NODE, PHB,
        PXB and PIX pairs share one PCIe bridge. NIC rows and columns, the CPU/NUMA affinity
        columns and the legend are ignored.

        ``nodes > 1`` describes a cluster of that many such servers
        (:meth:`multi_node`), each GPU with a NIC of ``nic_gbits`` Gb/s (default: the GPU
        model's :data:`NIC_GBITS`)."""
        if isinstance(nodes, bool) or not isinstance(nodes, numbers.Integral) or nodes < 1:
            raise TopologyError(f"{name}: the node count must be a positive int, got "
                                f"{nodes!r}")
        nodes = int(nodes)
        if nodes == 1 and nic_gbits is not None:
            raise TopologyError(f"{name}: nic_gbits={nic_gbits!r} describes the NICs between "
                                f"nodes; give nodes > 1 with it (got nodes=1)")
        if nodes != 1:
            model = gpu_spec(gpu)[0]
            if nic_gbits is None:
                nic_gbits = NIC_GBITS[model]
            if isinstance(nic_gbits, bool) or not isinstance(nic_gbits, (int, float)) \
                    or not 0 < nic_gbits * GBIT < math.inf:
                raise TopologyError(f"NIC bandwidth must be a positive number of Gb/s, got "
                                    f"{nic_gbits!r}")
            node = cls.from_nvidia_smi(text, gpu, name=f"{name}-node")
            return cls.multi_node(node, nodes, nic_gbits * GBIT,
                                  name=f"{name}:{nodes}x{len(node.gpus)}")
        model, spec = gpu_spec(gpu)
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # nvidia-smi colours its output on a tty
        lines = text.splitlines()
        ncols = None
        rows = {}
        for ln in lines:
            toks = ln.split()
            if not toks:
                continue
            if toks[0].rstrip(":") == "Legend":
                break
            if ncols is None:
                if toks[0] == "GPU0":  # the header: GPU columns come first, then NICs etc.
                    ncols = 0
                    while ncols < len(toks) and toks[ncols] == f"GPU{ncols}":
                        ncols += 1
                    if ncols < len(toks) and re.fullmatch(r"GPU\d+", toks[ncols]):
                        raise TopologyError(
                            f"nvidia-smi header names {toks[ncols]} where GPU{ncols} was "
                            f"expected: the GPU columns must be GPU0, GPU1, ... in order")
                continue
            m = re.fullmatch(r"GPU(\d+)", toks[0])
            if m:
                if len(toks) < 1 + ncols:
                    raise TopologyError(f"nvidia-smi row {toks[0]} has {len(toks) - 1} "
                                        f"entries, expected at least {ncols}")
                rows[int(m.group(1))] = toks[1:1 + ncols]
        if not ncols:
            raise TopologyError("no `nvidia-smi topo -m` matrix found: expected a header "
                                "line starting with GPU0")
        if sorted(rows) != list(range(ncols)):
            raise TopologyError(f"nvidia-smi matrix has GPU rows {sorted(rows)}, expected "
                                f"GPU0..GPU{ncols - 1}")
        nv = {}
        for i in range(ncols):
            for j in range(ncols):
                e = rows[i][j]
                if i == j:
                    if e != "X":
                        raise TopologyError(f"nvidia-smi entry GPU{i}/GPU{j} is {e!r}, "
                                            f"expected 'X' on the diagonal")
                    continue
                if e != rows[j][i]:
                    raise TopologyError(f"nvidia-smi matrix is not symmetric: GPU{i}/GPU{j} "
                                        f"is {e!r} but GPU{j}/GPU{i} is {rows[j][i]!r}")
                m = re.fullmatch(r"NV([0-9]+)", e)
                if m:
                    nv[(i, j)] = int(m.group(1))
                    if not 1 <= nv[(i, j)] <= spec["links"]:
                        shown = e if len(e) <= 12 else e[:12] + "..."
                        raise TopologyError(f"nvidia-smi entry GPU{i}/GPU{j} is {shown!r}: a "
                                            f"{model} has {spec['links']} NVLink ports, so "
                                            f"NV1..NV{spec['links']}")
                elif e not in _PCIE_KINDS:
                    raise TopologyError(f"unknown nvidia-smi connection {e!r} between GPU{i} "
                                        f"and GPU{j} (expected NV#, "
                                        f"{', '.join(sorted(_PCIE_KINDS))})")
        kw = dict(hbm_bw=spec["hbm"], flops=spec["flops"], memory=spec["memory"],
                  gpu_model=model)
        counts = set(nv.values())
        # Every pair at the same NV# is a switch fabric, unless the GPU has the ports to
        # link every pair directly (an HGX A100 4-GPU board shows NV4 between every pair).
        if (ncols > 1 and len(nv) == ncols * (ncols - 1) and len(counts) == 1
                and min(counts) * (ncols - 1) > spec["links"]):
            return cls.build(name, range(ncols), switch_bw=counts.pop() * spec["nvlink"], **kw)
        links = [(i, j, n * spec["nvlink"]) for (i, j), n in nv.items() if i < j]
        pcie_needed = len(nv) < ncols * (ncols - 1)
        return cls.build(name, range(ncols), links=links,
                         bus_bw=spec["pcie"] if pcie_needed else None, **kw)

    def to_dict(self) -> dict:
        """This topology in the JSON schema of :meth:`from_json` (``from_dict(t.to_dict())``
        rebuilds it)."""
        if self.kind == "multinode":
            doc = {**self.node.to_dict(), "name": self.name, "nodes": self.nodes,
                   "nic_gbps": self.nic_bw / GB}
            nic = self.class_latency("nic")
            if nic is not None and nic != NIC_LATENCY_S:   # written when not the default
                doc["nic_latency_us"] = _in_us(nic)
            return doc
        doc = {"name": self.name, "gpus": list(self.gpus)}
        if self.gpu_model:
            doc["gpu"] = self.gpu_model
        doc.update(hbm_gbps=self.hbm_bw / GB, tflops=self.flops / TFLOP,
                   memory_gb=self.memory / GB)
        spec = GPU_SPECS.get(self.gpu_model, {})
        for key, skey, v in (("tflops_fp32", "flops32", self.flops32),
                             ("tflops_fp64", "flops64", self.flops64)):
            if v and v != spec.get(skey):   # written when not the model's own
                doc[key] = v / TFLOP
        for key, kind, default in (("nvlink_latency_us", "nvlink", NVLINK_LATENCY_S),
                                   ("bus_latency_us", "bus", PCIE_LATENCY_S)):
            v = self.class_latency(kind)
            if v is not None and v != default:   # written when not the default
                doc[key] = _in_us(v)
        if self.kind == "switch":
            doc["switch_gbps"] = self.capacity[f"egress:{self.gpus[0]}"] / GB
            return doc
        links = []
        for (s, d), route in self.routes.items():
            if route == (f"link:{s}->{d}",) and s < d:
                if self.capacity[f"link:{d}->{s}"] != self.capacity[route[0]]:
                    raise TopologyError(f"topology {self.name!r}: link {s}<->{d} has unequal "
                                        f"directions, which the JSON schema cannot express")
                links.append([s, d, self.capacity[route[0]] / GB])
        doc["links"] = sorted(links)
        if "pcie" in self.capacity:
            doc["bus_gbps"] = self.capacity["pcie"] / GB
        return doc

    # -- display --------------------------------------------------------------------------

    def describe(self) -> str:
        """A human-readable summary: per-GPU numbers and the interconnect."""
        if self.kind == "multinode":
            inner = [ln.replace("  interconnect:", "  inside each node:", 1)
                     for ln in self.node.describe().splitlines()[1:]]
            g = len(self.node.gpus)
            holds = f"GPUs {g}n..{g}n+{g - 1}" if g > 1 else "GPU n"
            return "\n".join(
                [f"topology {self.name}: {len(self.gpus)} GPUs"
                 + (f" ({self.gpu_model})" if self.gpu_model else "")
                 + f" in {self.nodes} nodes of {g} (node n holds {holds})",
                 *inner,
                 f"  between nodes: one {_gbps(self.nic_bw)} ({self.nic_bw / GBIT:g} Gb/s) NIC "
                 f"per GPU, rail-optimized: GPU i of every node on rail i; a transfer to "
                 f"another rail crosses its own node to that rail first (PXN); "
                 f"{self.class_latency('nic') / US:g} us latency per send"])
        out = [f"topology {self.name}: {len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}"
               + (f" ({self.gpu_model})" if self.gpu_model else ""),
               f"  per GPU: HBM {_gbps(self.hbm_bw)}, {self.flops / TFLOP:g} TFLOP/s dense "
               f"fp16/bf16"
               + "".join(f", {v / TFLOP:g} {n}" for n, v in (("fp32", self.flops32),
                                                            ("fp64", self.flops64)) if v)
               + f", memory {self.memory / GB:g} GB"]
        if self.kind == "switch":
            bw = self.capacity[f"egress:{self.gpus[0]}"]
            out.append(f"  interconnect: non-blocking NVSwitch fabric, {_gbps(bw)} egress and "
                       f"{_gbps(bw)} ingress per GPU")
            return "\n".join(out + [self._latency_line()])
        out.append("  interconnect: point-to-point links (GB/s per direction); "
                   "'bus' = the shared PCIe bridge"
                   + (f" of {_gbps(self.capacity['pcie'])} total" if "pcie" in self.capacity
                      else ""))
        w = max(5, max(len(str(g)) for g in self.gpus) + 4)
        out.append(" " * w + "".join(f"{'GPU' + str(g):>{w}}" for g in self.gpus))
        for s in self.gpus:
            cells = []
            for d in self.gpus:
                if s == d:
                    cells.append("X")
                elif (s, d) not in self.routes:
                    cells.append("-")
                elif self.routes[(s, d)] == ("pcie",):
                    cells.append("bus")
                else:
                    cells.append(f"{self.bandwidth(s, d) / GB:g}")
            out.append(f"{'GPU' + str(s):<{w}}" + "".join(f"{c:>{w}}" for c in cells))
        return "\n".join(out + [self._latency_line()])

    def _latency_line(self) -> str:
        parts = [f"{v / US:g} us {label}" for kind, label in (("nvlink", "NVLink"),
                                                             ("bus", "bus"))
                 for v in [self.class_latency(kind)] if v is not None]
        if not any(self.latency.values()):
            parts = ["none"]
        return "  latency per transfer: " + ", ".join(parts)

    def __repr__(self):
        return f"Topology({self.name!r}, {len(self.gpus)} GPUs, {self.kind})"


# -- presets ------------------------------------------------------------------------------

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
_SWITCH = {
    "dgx-a100": ("A100", 300, 8),
    "dgx-h100": ("H100", 450, 8),
    "hgx-h200": ("H200", 450, 8),
    "dgx-b200": ("B200", 900, 8),
    "gb200-nvl72": ("GB200", 900, 72),
}


def _switch(name, n=None) -> Topology:
    model, bw, default = _SWITCH[name]
    spec = GPU_SPECS[model]
    n = default if n is None else n
    label = name if n == default else f"{name}:{n}"
    return Topology.build(label, range(n), hbm_bw=spec["hbm"], flops=spec["flops"],
                          memory=spec["memory"], switch_bw=bw * GB, gpu_model=model)


PRESETS = MappingProxyType({
    "dgx-v100-paper": _dgx_v100_paper(),
    "dgx-v100": Topology.from_nvidia_smi(DGX1V_NVIDIA_SMI, gpu="V100", name="dgx-v100"),
    **{name: _switch(name) for name in _SWITCH},
})
"""Every preset at its full size, by name; switch presets also take ``:N`` (get_topology)."""


def get_topology(name) -> Topology:
    """A preset by name (``"dgx-h100"``), a switch preset with a GPU count
    (``"dgx-h100:4"``: GPUs 0..3, at most the machine's own count), a cluster of N such
    servers (``"dgx-h100:2x8"``: 2 nodes of 8 GPUs, GPUs 0..15, one NIC per GPU of the
    preset's :data:`PRESET_NIC_GBITS`; a fixed preset takes its own count,
    ``"dgx-v100:4x8"``), a ``.json`` file (:meth:`Topology.from_json`), or a Topology as
    is."""
    if isinstance(name, Topology):
        return name
    if str(name).endswith(".json"):
        return Topology.from_json(name)
    base, sep, count = str(name).partition(":")
    if base not in PRESETS:
        raise TopologyError(f"unknown topology {name!r}: presets are {', '.join(PRESETS)}")
    if not sep:
        return PRESETS[base]
    if len(count) > 20:   # int() of 4,301+ digits raises ValueError; no count is that long
        raise TopologyError(f"GPU count in {name[:60]!r}... is {len(count)} characters long; "
                            f"write N or KxN with N and K whole numbers")
    m = re.fullmatch(r"([0-9]+)x([0-9]+)", count)   # ASCII digits: int() takes others
    if m:
        return _cluster(base, int(m.group(1)), int(m.group(2)), name)
    if base not in _SWITCH:
        raise TopologyError(f"topology {base!r} has a fixed set of GPUs; only switch presets "
                            f"({', '.join(_SWITCH)}) take a GPU count, got {name!r}")
    default = _SWITCH[base][-1]
    if not re.fullmatch(r"[0-9]+", count) or not 1 <= int(count) <= default:
        raise TopologyError(f"GPU count {count!r} in {name!r} must be an integer in "
                            f"1..{default}")
    return _switch(base, int(count))


# Gb/s of each GPU's NIC in a cluster of a preset's servers (DGX A100: 8 HDR 200 Gb/s; DGX
# H100, HGX H200, DGX B200: 8 NDR 400 Gb/s, the number; GB200: 800 Gb/s; DGX-1: its 4
# EDR 100 Gb/s NICs, modelled as one per GPU).
PRESET_NIC_GBITS = MappingProxyType({"dgx-v100-paper": 100, "dgx-v100": 100, "dgx-a100": 200,
                                     "dgx-h100": 400, "hgx-h200": 400, "dgx-b200": 400,
                                     "gb200-nvl72": 800})


def _cluster(base, nodes, per_node, name) -> Topology:
    full = len(PRESETS[base].gpus)
    if base in _SWITCH:
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
