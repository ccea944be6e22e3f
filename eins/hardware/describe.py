"""The human-readable summary of a topology (``eins topology show``)."""
from __future__ import annotations

from eins.hardware.specs import GB, GBIT, TFLOP, US


def _gbps(x: float) -> str:
    return f"{x / GB:g} GB/s"


class Description:
    """:meth:`describe` of :class:`~eins.hardware.topology.Topology`, which inherits it."""

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
        if self.kind == "shared":
            return self._describe_shared()
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
            return "\n".join(out + [self._latency_line(), self._profile_line()])
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
        return "\n".join(out + [self._latency_line(), self._profile_line()])

    def _describe_shared(self) -> str:
        gpus = sorted(set(self.physical))
        per = len(self.gpus) // len(gpus)
        copy = self.capacity[f"copy:{gpus[0]}"]
        return "\n".join([
            f"topology {self.name}: {len(self.gpus)} logical devices on {len(gpus)} GPU"
            f"{'s' if len(gpus) != 1 else ''}" + (f" ({self.gpu_model})" if self.gpu_model
                                                   else "")
            + f", device d on GPU d mod {len(gpus)}",
            f"  per GPU: HBM {_gbps(self.hbm_bw)}, {self.flops / TFLOP:g} TFLOP/s dense "
            f"fp16/bf16, memory {self.memory * per / GB:g} GB ({self.memory / GB:g} GB per "
            f"device)",
            f"  devices on one GPU share its compute and HBM (their kernels add up); their "
            f"transfers are local copies at {_gbps(copy)}",
            self._profile_line()])

    def _profile_line(self) -> str:
        p = self.profile
        if p is None:
            return "  kernels priced by the data sheet's roofline (no machine profile)"
        what = "measured" if p.calibrated else "not measured"
        return f"  kernels priced by machine profile {p.name!r} ({what}; eins/hardware/profile.py)"

    def _latency_line(self) -> str:
        parts = [f"{v / US:g} us {label}" for kind, label in (("nvlink", "NVLink"),
                                                             ("bus", "bus"))
                 for v in [self.class_latency(kind)] if v is not None]
        if not any(self.latency.values()):
            parts = ["none"]
        return "  latency per transfer: " + ", ".join(parts)

