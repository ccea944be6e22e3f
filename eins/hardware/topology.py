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
import functools
import itertools
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from eins.errors import TopologyError
from eins.hardware.checks import gpu_id, latency_s, positive
from eins.hardware.describe import Description
from eins.hardware.nvidia_smi import NvidiaSmiForm
from eins.hardware.specs import GPU_SPECS, MAX_CLUSTER_GPUS, NIC_LATENCY_S, NVLINK_LATENCY_S, \
    PCIE_LATENCY_S
from eins.hardware.topology_json import JsonForm


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


@dataclass(frozen=True, eq=False)
class Topology(JsonForm, NvidiaSmiForm, Description):
    """One server's GPUs and interconnect (see the module docstring for resources).

    ``routes`` maps every ordered pair of distinct GPUs to the resources its transfers use;
    ``kind`` is ``"switch"`` (NVSwitch fabric), ``"mesh"`` (point-to-point links plus
    PCIe), ``"multinode"`` (a cluster) or ``"shared"`` (logical devices on GPUs,
    :meth:`logical`). Build one with :func:`eins.hardware.presets.get_topology`, :meth:`from_json`
    (:mod:`.topology_json`) or :meth:`from_nvidia_smi` (:mod:`.nvidia_smi`); :meth:`describe`
    (:mod:`.describe`) summarises it.
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
    # the machine profile pricing kernels (eins.hardware.profile.Profile); None: the data
    # sheet's roofline
    profile: object = None
    # logical devices sharing GPUs (:meth:`logical`): the physical GPU of each of ``gpus``;
    # empty: every device is a GPU of its own
    physical: tuple = ()

    def flops_of(self, dtype) -> float:
        """FLOP/s of a kernel computing in ``dtype``: the dense 16-bit float rate for float16
        and bfloat16, the float32 or float64 rate for those (ints and bools: float32's, as
        the GPU runs them on its CUDA cores or, matmuls, through float32 products); ``flops``
        where the rate is not known."""
        d = np.dtype(dtype)
        if d.itemsize == 2 and d.kind in "fV":   # float16, bfloat16
            return self.flops
        rate = self.flops64 if d == np.dtype(np.float64) else self.flops32
        return rate or self.flops

    @property
    def gpus_per_node(self) -> int:
        return len(self.node.gpus) if self.node is not None else len(self.gpus)

    @functools.cached_property
    def gpu_index(self) -> dict:
        """GPU id -> its position in ``gpus`` (a lookup, where ``gpus.index`` scans: the
        synthesis bound asks for millions of routes on 1,024 GPUs)."""
        return {g: i for i, g in enumerate(self.gpus)}

    def node_of(self, gpu: int) -> int:
        """The node (0-based) holding ``gpu``."""
        i = self.gpu_index.get(gpu) if _hashable(gpu) else None
        return (self.gpus.index(gpu) if i is None else i) // self.gpus_per_node

    def route(self, src: int, dst: int) -> tuple[str, ...]:
        """The resources a ``src -> dst`` transfer draws on (``()`` when ``src == dst``)."""
        index = self.gpu_index
        for g in (src, dst):
            if not (g in index if _hashable(g) else g in self.gpus):
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

    def gpu_of(self, device: int) -> int:
        """The physical GPU running logical device ``device`` (itself unless shared)."""
        return self.physical[self.gpus.index(device)] if self.physical else device

    def busy_seconds(self, seconds, devices) -> float:
        """How long the GPUs take to run one kernel per device (``seconds[k]`` on
        ``devices[k]``): the slowest GPU, whose logical devices' kernels share its compute
        and HBM and so add up, each with the profile's ``shared_overhead_s``; without
        sharing, the slowest kernel."""
        if not self.physical:
            return max(seconds)
        over = self.profile.shared_overhead_s if self.profile is not None else 0.0
        hosted = {}
        for g in self.physical:
            hosted[g] = hosted.get(g, 0) + 1
        per = {}
        for t, d in zip(seconds, devices):
            g = self.gpu_of(d)
            # a kernel (not a folded view) of a device sharing its GPU pays the profile's
            # shared-GPU overhead
            per[g] = per.get(g, 0.0) + t + (over if t and hosted[g] > 1 else 0.0)
        return max(per.values())

    def logical(self, n: int, name: str | None = None) -> "Topology":
        """``n`` logical devices (0..n-1) on this topology's GPUs, round-robin as the GPU
        runtime's default device map puts them (device d on GPU ``gpus[d % G]``). Devices
        sharing a GPU share its compute and HBM (:meth:`busy_seconds`) and its memory;
        their transfers are local copies over a ``copy:g`` resource (each byte read and
        written: half the HBM bandwidth, times the profile's ``copy_hbm``, after its
        ``copy_overhead_s``); transfers between GPUs take this topology's routes."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise TopologyError(f"topology {self.name!r}: the logical device count must be a "
                                f"positive int, got {n!r}")
        if n > MAX_CLUSTER_GPUS:
            raise TopologyError(f"topology {self.name!r}: {n} logical devices; a topology "
                                f"model holds at most {MAX_CLUSTER_GPUS}")
        if self.physical:
            raise TopologyError(f"topology {self.name!r} already maps logical devices")
        gpus = self.gpus
        phys = tuple(gpus[d % len(gpus)] for d in range(n))
        prof = self.profile
        copy_eff = prof.copy_hbm if prof is not None else 1.0
        copy_lat = prof.copy_overhead_s if prof is not None else 0.0
        cap, lat, routes = dict(self.capacity), dict(self.latency), {}
        for g in set(phys):
            cap[f"copy:{g}"] = self.hbm_bw * copy_eff / 2
            if copy_lat:
                lat[f"copy:{g}"] = copy_lat
        for s in range(n):
            for d in range(n):
                if s != d:
                    routes[(s, d)] = ((f"copy:{phys[s]}",) if phys[s] == phys[d]
                                      else self.routes[(phys[s], phys[d])])
        per_gpu = -(-n // len(gpus))
        return dataclasses.replace(
            self, name=name or f"{self.name}:{n}/{len(gpus)}", gpus=tuple(range(n)),
            memory=self.memory / per_gpu, capacity=MappingProxyType(cap),
            routes=MappingProxyType(routes), latency=MappingProxyType(lat), physical=phys,
            kind="shared")

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
        gpus = tuple(gpu_id(name, g, "the GPU list") for g in gpus)
        if not gpus or len(set(gpus)) != len(gpus):
            raise TopologyError(f"topology {name!r}: GPUs must be distinct and non-empty, "
                                f"got {list(gpus)}")
        hbm_bw, flops, memory = (positive(name, label, v) for label, v in (
            ("hbm_bw", hbm_bw), ("flops", flops), ("memory", memory)))
        nvlink_latency, bus_latency = (latency_s(name, label, v) for label, v in (
            ("the NVLink latency", nvlink_latency), ("the bus latency", bus_latency)))
        spec = GPU_SPECS.get(gpu_model, {})
        flops32, flops64 = (0.0 if v is None and key not in spec else
                            positive(name, key, spec[key] if v is None else v)
                            for key, v in (("flops32", flops32), ("flops64", flops64)))
        cap, routes = {}, {}
        if switch_bw is not None:
            switch_bw = positive(name, "switch bandwidth", switch_bw)
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
                a, b = (gpu_id(name, g, f"link {a!r}<->{b!r}") for g in (a, b))
                if a not in gpus or b not in gpus or a == b:
                    raise TopologyError(f"topology {name!r}: link {a}<->{b} needs two "
                                        f"distinct GPUs of {list(gpus)}")
                bw = positive(name, f"link {a}<->{b} bandwidth", bw)
                if (a, b) in routes:
                    raise TopologyError(f"topology {name!r}: link {a}<->{b} is given twice "
                                        f"(one link per pair of GPUs; both directions)")
                for s, d in ((a, b), (b, a)):
                    cap[f"link:{s}->{d}"] = float(bw)
                    routes[(s, d)] = (f"link:{s}->{d}",)
            if bus_bw is not None:
                bus_bw = positive(name, "bus bandwidth", bus_bw)
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
        nic_bw = positive(label, "NIC bandwidth", nic_bw)
        nic_latency = latency_s(label, "the NIC latency", nic_latency)
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
        # one string per resource, shared by its routes (a million routes at 1,024 GPUs)
        nic_out = [f"nic-out:{x}" for x in range(total)]
        nic_in = [f"nic-in:{x}" for x in range(total)]
        for x in range(total):
            cap[nic_out[x]] = cap[nic_in[x]] = float(nic_bw)
            if nic_latency:
                lat[nic_out[x]] = nic_latency
        for s_ in range(total):
            for d in range(total):
                if s_ // g == d // g:
                    continue
                relay = (s_ // g) * g + d % g  # the source node's GPU on the destination's rail
                hop = routes[(s_, relay)] if relay != s_ else ()
                routes[(s_, d)] = hop + (nic_out[relay], nic_in[d])
        return cls(name=label, gpus=tuple(range(total)), hbm_bw=node.hbm_bw, flops=node.flops,
                   memory=node.memory, capacity=MappingProxyType(cap),
                   routes=MappingProxyType(routes), kind="multinode",
                   gpu_model=node.gpu_model, nodes=nodes, node=node, nic_bw=float(nic_bw),
                   flops32=node.flops32, flops64=node.flops64,
                   latency=MappingProxyType(lat), profile=node.profile)


    def __repr__(self):
        return f"Topology({self.name!r}, {len(self.gpus)} GPUs, {self.kind})"

