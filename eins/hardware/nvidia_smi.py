"""Topologies from ``nvidia-smi topo -m``: :meth:`Topology.from_nvidia_smi` reads the
matrix it prints (the connection of every pair of GPUs) and a GPU model's data sheet."""
from __future__ import annotations

import math
import numbers
import re

from eins.errors import TopologyError
from eins.hardware.specs import GBIT, NIC_GBITS, gpu_spec

# `nvidia-smi topo -m` connection kinds that go over PCIe (through switches, host bridges or
# the inter-socket link); the simulator does not distinguish them.
_PCIE_KINDS = frozenset({"SYS", "NODE", "PHB", "PXB", "PIX", "SOC"})


class NvidiaSmiForm:
    """The ``nvidia-smi topo -m`` reader of :class:`~eins.hardware.topology.Topology`, which
    inherits it (``cls`` is Topology: its :meth:`build` and :meth:`multi_node` make the
    result)."""

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
        nv, ncols = nvlink_counts(parse_matrix(text), model, spec["links"])
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


def parse_matrix(text: str) -> list[list[str]]:
    """The GPU-to-GPU block of the matrix ``nvidia-smi topo -m`` prints: row i holds GPUi's
    entries for GPU0..GPUn-1 (NIC columns, CPU/NUMA affinity and the legend dropped)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # nvidia-smi colours its output on a tty
    ncols = None
    rows = {}
    for ln in text.splitlines():
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
    return [rows[i] for i in range(ncols)]


def nvlink_counts(rows: list[list[str]], model: str, ports: int) -> tuple[dict, int]:
    """``({(i, j): NVLinks between GPUi and GPUj}, GPU count)`` of a :func:`parse_matrix`
    matrix, checked: X on the diagonal, symmetric, at most a ``model``'s ``ports`` NVLinks
    per pair, every other entry a PCIe kind."""
    ncols = len(rows)
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
                if not 1 <= nv[(i, j)] <= ports:
                    shown = e if len(e) <= 12 else e[:12] + "..."
                    raise TopologyError(f"nvidia-smi entry GPU{i}/GPU{j} is {shown!r}: a "
                                        f"{model} has {ports} NVLink ports, so "
                                        f"NV1..NV{ports}")
            elif e not in _PCIE_KINDS:
                raise TopologyError(f"unknown nvidia-smi connection {e!r} between GPU{i} "
                                    f"and GPU{j} (expected NV#, "
                                    f"{', '.join(sorted(_PCIE_KINDS))})")
    return nv, ncols
