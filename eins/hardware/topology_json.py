"""Topologies as JSON files: :meth:`Topology.from_json` reads the schema its docstring
gives, :meth:`Topology.to_dict` writes it (``from_dict(t.to_dict())`` rebuilds ``t``, bit
for bit). Unknown keys are errors, so a typo does not pass silently."""
from __future__ import annotations

import json
import math

from eins.errors import TopologyError
from eins.hardware.checks import gpu_id, latency_s, positive, short
from eins.hardware.specs import (GB, GBIT, GPU_SPECS, MAX_CLUSTER_GPUS, NIC_GBITS,
                                 NIC_LATENCY_S, NVLINK_LATENCY_S, PCIE_LATENCY_S, TFLOP,
                                 US_PER_S, gpu_spec)


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


class JsonForm:
    """The JSON reader and writer of :class:`~eins.hardware.topology.Topology`, which
    inherits them (``cls`` is Topology: its :meth:`build` and :meth:`multi_node` make the
    result)."""

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
                vals[skey] = positive(name, repr(key), doc[key], unit)
            elif skey in spec:
                vals[skey] = spec[skey]
            else:
                raise TopologyError(f"topology {name!r}: missing {key!r} (or a 'gpu' model)")
        links = []
        raw = doc.get("links", [])
        if not isinstance(raw, list):
            raise TopologyError(f"topology {name!r}: 'links' must be a list of [a, b, gbps], "
                                f"got {short(raw)}")
        for ln in raw:
            if not (isinstance(ln, list) and len(ln) == 3):
                raise TopologyError(f"topology {name!r}: a link is [a, b, gbps], got "
                                    f"{short(ln)}")
            a, b = (gpu_id(name, g, f"link {short(ln)}") for g in ln[:2])
            links.append((a, b, positive(name, f"the GB/s of link {a}<->{b}", ln[2], GB)))
        sw, bus = (None if doc.get(k) is None else positive(name, repr(k), doc[k], GB)
                   for k in ("switch_gbps", "bus_gbps"))
        if sw is not None and (links or bus is not None):
            raise TopologyError(f"topology {name!r}: 'switch_gbps' excludes 'links' and "
                                f"'bus_gbps'")
        f32, f64 = (None if doc.get(k) is None else positive(name, repr(k), doc[k], TFLOP)
                    for k in ("tflops_fp32", "tflops_fp64"))
        lat = {arg: latency_s(name, repr(key), doc[key], US_PER_S)
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
            nic_bw = positive(name, "'nic_gbps'", nic, GB)
        lat = ({} if "nic_latency_us" not in doc else
               {"nic_latency": latency_s(name, "'nic_latency_us'", doc["nic_latency_us"],
                                        US_PER_S)})
        return cls.multi_node(node, nodes, nic_bw, name=name, **lat)


    def to_dict(self) -> dict:
        """This topology in the JSON schema of :meth:`from_json` (``from_dict(t.to_dict())``
        rebuilds it)."""
        if self.physical:
            raise TopologyError(f"topology {self.name!r} maps logical devices onto shared GPUs; "
                                f"it has no JSON form (write its GPUs' topology and the "
                                f"'preset:N/G' form)")
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

