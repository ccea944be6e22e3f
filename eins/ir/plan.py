"""The planned IR (Section 4): the traced program with one join-agg spec per eqn and its cost.

What the physical passes read, per eqn ``i`` of ``plan.program``:

- ``plan.eqn_plans[i].spec``: the chosen :class:`~eins.ir.joinagg.JoinAggSpec`. Its
  ``fspecs[d]`` runs on ``plan.devices[d]`` under naive placement; ``spec.in_blocks(k)`` are
  the blocks input ``k`` must be delivered in, ``spec.out_tiling(j)`` the blocks output ``j``
  ends up in after ⊕ (``spec.aggs[j]``; ``spec.multiplicity(j)`` gives m per block).
- ``plan.eqn_plans[i].intervals``: the interval decomposition of each named index that
  produced the spec (whole indices included, as one interval).
- ``plan.producer_tiling(var)``: the blocks a tensor exists in before its consumer runs
  (the producer's ``out_tiling``), or ``None`` for program inputs and constants, which are
  materialized directly in whatever blocks each consumer needs (Section 4.3 (1)).

A spec may have fewer function specifications than there are devices when an operator cannot
be split ``p`` ways (see :mod:`eins.passes.enumerate_specs`); the remaining devices idle for
that eqn.
"""
from __future__ import annotations

import math
import os
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from eins.errors import PlanError
from eins.ir.joinagg import Intervals, JoinAggSpec
from eins.ir.program import Program, Var
from eins.ir.text import eqn_index_names, format_bytes, format_seconds, sort_key

if TYPE_CHECKING:   # the later stages' IRs and the machine, for field types only
    from eins.hardware.topology import Topology
    from eins.ir.device import DeviceProgram
    from eins.ir.exchange import ExchangeIR

SELECTORS = ("dp", "greedy", "random")
COSTS = ("time", "proxy", "bytes")
# "bytes" is the proxy's other name: the plan text's header says what was minimized as
# minimized=bytes
COST_ALIASES = {"bytes": "proxy"}
SCHEDULES = ("naive", "optimized", "ai")   # "ai" is the paper's name for "optimized"
SCHEDULE_ALIASES = {"ai": "optimized"}
# attention kernels of the GPU backends (eins/kernels/attention.py ``choose_impl``)
ATTENTION_IMPLS = ("auto", "triton", "sdpa", "cudnn", "flash_attn")


def schedule_name(schedule) -> str:
    """The canonical name of an exchange-program schedule (``"ai"``, the paper's
    schedule_mode, is ``"optimized"``); raises PlanError for an unknown one."""
    name_option("schedule", schedule, SCHEDULES)
    return SCHEDULE_ALIASES.get(schedule, schedule)


def name_option(name: str, v, choices, error=PlanError) -> str:
    """An option naming one of ``choices`` (``selector``, ``cost``, ``backend``, ...):
    ``v`` itself, or ``error`` naming it. A str first: an array's ``in`` test raised numpy's
    own "truth value ... is ambiguous" instead."""
    if not isinstance(v, str) or v not in choices:
        raise error(f"unknown {name} {v!r}; choose one of {list(choices)}")
    return v


def flag_option(name: str, v) -> bool:
    """An on/off option (``inputs_resident``, ``graphs``): True or False (numpy's bools too);
    a PlanError otherwise, since ``bool("no")`` is True."""
    if not isinstance(v, (bool, np.bool_)):
        raise PlanError(f"{name} must be True or False, got {v!r}")
    return bool(v)


@dataclass(frozen=True, slots=True)
class Tuning:
    """The search's inner switches (as Alpa's ``AutoShardingOption``, one frozen record):
    how hard and where the spec choice and the exchange-program synthesis look. The defaults
    are what every plan is made with; another value is for measuring or for a test that
    shows what a switch buys (docs/costs.md, "Search tuning", has the measurements). Plans
    depend on them, so they are part of :class:`Options`, never module globals.

    >>> Tuning(seeds_revised=0).revision_rounds
    3
    """

    # -- spec choice (eins/passes/choose_specs.py, eins/passes/tree_dp.py)
    # Under the time cost, a consumer candidate is tried against every entry of a producer's
    # table while it has at most this many (the DP is then exact within a tree) ...
    time_exact: int = 1024
    # ... and against only this many cheapest entries beyond.
    time_fanin: int = 64
    # Rounds re-optimizing every tree with all others fixed (they stop at the first that
    # does not improve the plan).
    revision_rounds: int = 3
    # The cheapest seeded starts (per program input, or group of inputs of one type, and
    # axis) that get the revision rounds too; 0: no seeds.
    seeds_revised: int = 1
    # At most this many distinct seeds are built and costed: same-typed inputs split
    # together first, then each input alone in input order.
    seeds_costed: int = 32
    # Time cost: a tensor that several eqns of one tree read from a fixed tree is paid once
    # per designated delivery (off: each reader pays its own).
    shared_reads: bool = True
    # Time cost: after the rounds, a shared producer's candidates are swept together with
    # its readers' trees.
    producer_sweep: bool = True
    # The sweep tries every candidate of a producer tree of at most this many eqns, of a
    # larger one only those that deliver a reader its current blocks.
    sweep_tree: int = 1
    # Under a memory cap, the values live across each eqn (a backward's saved activations:
    # eins/cost/liveness.py) count against it with the eqn's working set; up to this many
    # re-plans restrict the producers of the values live where the cap is exceeded to their
    # most sharded candidates (0: only the per-eqn working set is capped).
    memory_rounds: int = 4
    # Time cost: candidates on fewer devices (every power of two below p) and, per such
    # count, the plan on that many devices, kept when faster, so more GPUs are never
    # predicted slower (eins/passes/enumerate_specs.py, choose_specs.py).
    device_subsets: bool = True
    # An eqn's candidates include those of this many powers of two below p (p/2 ... when
    # p is one), mixed with the others by the DP; whole plans go down to one device.
    subset_levels: int = 1
    # At most this many candidates per smaller power of two (the p-piece ones stay at
    # Options.max_specs): a few ways to use fewer devices, without doubling the DP.
    subset_specs: int = 8
    # Optimized schedule on at most priced_max_p devices: rounds in which the exchanges of
    # the plan the DP picks are synthesized and the DP runs again with their simulated
    # times (eins/passes/priced.py); 0: the analytic relay cost alone.
    priced_rounds: int = 3
    priced_max_p: int = 16
    # -- exchange-program synthesis (eins/passes/synthesize)
    # The search stops at this share of its budget; the rest re-checks the winners.
    search_share: float = 0.9
    # A search stops once a candidate reaches the time floor (no body is faster); off: it
    # runs until its budget or patience is spent (same best time, within FLOOR_SLACK).
    stop_at_floor: bool = True
    # ... or once it is within this fraction of the floor (the naive body too: then there
    # is no search), since no body can gain more; the optimized walk is not compared with
    # the naive placement's when their floors show the same (0: only at the floor).
    synthesis_min_gain: float = 0.0
    # On preambles over at least scale_sites sites (a multi-node exchange, whose candidates
    # cost 5-300x an 8-GPU one's) the fraction is at least scale_min_gain: there the time
    # floor counts the bytes that must cross each node's boundary, and the searches it
    # leaves out found no faster body (docs/costs.md, "Search tuning").
    scale_min_gain: float = 0.1
    scale_sites: int = 32
    # Moves without improvement before a climb stops (halved after a kick, and for polish).
    patience: int = 150
    # Odds of a climbing move toggling relays ...
    relay_move: float = 0.15
    # ... else swapping membership (cumulative odds), else changing one group's pattern.
    swap_move: float = 0.35
    # Roots tried besides a group's targets: its largest contributors.
    extra_roots: int = 2
    # Roots that also get a reduce tree in a random order per neighbourhood.
    shuffled_roots: int = 2
    # Membership kicks after the first climb (iterated local search) ...
    restarts: int = 6
    # ... ended early by this many kicks in a row without a better state.
    fruitless_kicks: int = 3
    # Sites swapped by one kick: (fewest, most).
    kick_swaps: tuple[int, int] = (2, 3)
    # Best candidates re-checked against Definition 5.5 before falling back to naive.
    rechecked: int = 5
    # On a multi-node cluster, a preamble spanning nodes also gets a hierarchical candidate
    # (eins/passes/synthesize/hierarchy.py: node-local parts searched once per class of
    # equal nodes, the cross-node part on the cluster), kept where it is faster.
    hierarchical: bool = True
    # ... tried only where the best body found is more than this fraction above the time
    # floor: its rail seeds gain where NIC loads are uneven, which leaves bodies at twice
    # their floor or more; nearer the floor they found nothing and cost a cluster-wide
    # search (docs/measured.md, "Hierarchical synthesis"). 0: tried wherever searched.
    hierarchical_gap: float = 0.5
    # Seed and climb with the rail-aware hierarchical patterns (patterns.py Rail); on for
    # the cross-node searches of that candidate (the whole-cluster search runs without them).
    rail_patterns: bool = False

    def __post_init__(self):
        """Each field has its default's kind: a bool, a non-negative int, a probability, or
        (kick_swaps) a pair 1 <= fewest <= most; a PlanError names the value otherwise."""
        for name, f in self.__dataclass_fields__.items():
            v, default = getattr(self, name), f.default
            if isinstance(default, bool):
                ok = isinstance(v, (bool, np.bool_))
                v = bool(v) if ok else v
                kind = "True or False"
            elif isinstance(default, float):
                ok = (not isinstance(v, (bool, np.bool_)) and isinstance(
                    v, (int, float, np.integer, np.floating)) and 0 <= v <= 1)
                v = float(v) if ok else v
                kind = "a number from 0 to 1"
            elif isinstance(default, int):
                least = 1 if name == "time_fanin" else 0   # a summary keeps at least one
                ok = (not isinstance(v, (bool, np.bool_)) and isinstance(v, (int, np.integer))
                      and v >= least)
                v = int(v) if ok else v
                kind = "a positive int" if least else "a non-negative int"
            else:   # kick_swaps
                ok = (isinstance(v, tuple) and len(v) == 2 and all(
                    isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in v)
                    and 1 <= v[0] <= v[1])
                v = tuple(int(k) for k in v) if ok else v
                kind = "a pair (fewest, most) of ints with 1 <= fewest <= most"
            if not ok:
                raise PlanError(f"Tuning.{name} must be {kind}, got {v!r}")
            object.__setattr__(self, name, v)


# What planning and lowering read of a Topology (eins.hardware.topology.Topology).
_TOPOLOGY_FIELDS = ("name", "gpus", "routes", "capacity", "memory", "flops", "hbm_bw")


@dataclass(frozen=True, slots=True)
class Options:
    """Every switch of the compiler in one frozen object (docs/architecture.md, convention 7)."""

    # Which spec selector picks the plan: "dp" is Algorithm 1 with Section 4.5's tree cutting
    # (the paper's "EinDecomp"); "greedy" is the same DP without the repartition sub-cost,
    # so every eqn takes its locally cheapest spec; "random" draws each eqn's spec uniformly
    # among its valid specs (ablations of Section 6, Experiment 3).
    selector: str = "dp"
    # Seed of the "random" selector (one plan per seed).
    seed: int = 0
    # Forced specs: {eqn index: {index name: interval count or ((lo, hi), ...)}}; those eqns
    # take exactly this decomposition (hand-designed strategies, costed like any plan), the
    # others are chosen by ``selector``.
    plan: dict | None = None
    # False: the paper's proxy, whose join sub-cost charges every block of every input. True:
    # program inputs and constants (a model's weights) are resident in whatever blocks each
    # spec needs, so their join bytes are not charged; plans then replicate weights freely.
    inputs_resident: bool = False
    # What the DP minimizes: "time" (predicted seconds on ``topology``: slowest kernel plus
    # the exchanges feeding each eqn; eins.cost.timecost) or "proxy" (the paper's bytes,
    # Section 4.3; kept for the ablation).
    cost: str = "time"
    # Per-device memory cap in bytes for planning (None: the topology's GPU memory); specs
    # whose working set exceeds it are never chosen (eins.cost.timecost.working_set).
    memory_limit: int | None = None
    # Most candidate specs kept per eqn; beyond it the ones with the lowest join+aggregation
    # cost are kept, so ops with many indices (batched matmuls at large p) stay cheap to plan.
    max_specs: int = 256
    # Hardware topology: the time cost and the memory cap of planning, and the physical
    # lowering (Section 5.4): a preset name, a JSON file path or a Topology; None:
    # eins.hardware.net.resolve_topology's default. Resolved once, into
    # Compilation.topology, by eins.distribute.
    topology: object = None
    # The machine profile pricing kernels on ``topology`` (eins/hardware/profile.py): a
    # shipped profile's name ("h200"), a JSON file written by ``eins calibrate``, a Profile,
    # or "none" (the data sheet alone); None: the topology's own (the hgx-h200 preset ships
    # one).
    profile: object = None
    # Exchange-program schedule for the physical passes (Section 5.4): "naive", or
    # "optimized" (the paper's schedule_mode="ai"; both names accepted).
    schedule: str = "naive"
    # Budget of the exchange-program synthesizer per program (Section 5.4), in seconds of
    # modeled simulation: each candidate is charged its simulation's CPU cost on the
    # reference machine as the simulator's counts predict it, not a clock's reading, so the
    # programs depend only on the plan, the topology and ``seed``, never on the machine's
    # speed or load (eins/passes/synthesize/program.py; every rank of devices="world" agrees).
    synthesis_budget_s: float = 0.2
    # A step budget instead: the synthesizer stops after this many distinct simulated
    # candidates per program; None: ``synthesis_budget_s``.
    synthesis_steps: int | None = None
    # The attention kernel of the GPU backends ("cuda", "interpret"; the numpy backend runs
    # the reference kernel): "auto" (flash-attn's varlen kernel if importable, then PyTorch's
    # scaled_dot_product_attention where it computes exactly eins's attention on a fused CUDA
    # backend, else the Triton kernel; where the topology's machine profile measured the
    # exact kernels on this GPU, the fastest of them at the nearest measured length), or one
    # forced: "triton", "sdpa", "cudnn" (SDPA on its cuDNN backend), "flash_attn" (a
    # whole attention block it cannot compute exactly is a KernelUnavailable naming why).
    # Key-split blocks, whose (o, lse) partials no library returns, always run Triton. Not
    # a planning switch: plans do not depend on it.
    attention: str = "auto"
    # Pipelined key exchange (eins/passes/pipeline.py): a kernel whose keys arrive from
    # other devices runs in pieces as they arrive, where the time model says the pieces pay
    # (eins.cost.predict.pieces_pay); "always": wherever the device code allows. Every
    # backend runs such pieces (ranks over NCCL refuse them). Not a planning switch.
    pipeline: bool | str = False
    # The search's inner switches (:class:`Tuning`); the defaults make every plan.
    tuning: Tuning = Tuning()

    def __post_init__(self):
        """Every field checked where the option is given (``eins.distribute`` builds this),
        not where it is first used: one ``_check_<field>`` per field, each raising a
        PlanError that names the value (a new field adds its own ``_check_<field>``)."""
        for name in self.__dataclass_fields__:
            check = getattr(Options, f"_check_{name}", None)
            if check is not None:
                value = check(getattr(self, name))
                if value is not None:  # a check may normalize (np.int64 -> int)
                    object.__setattr__(self, name, value)

    @staticmethod
    def _check_selector(v):
        name_option("selector", v, SELECTORS)

    @staticmethod
    def _check_pipeline(v):
        if isinstance(v, str) and v == "always":
            return None
        if not isinstance(v, (bool, np.bool_)):
            raise PlanError(f"pipeline must be True, False or 'always', got "
                            f"{type(v).__name__} {v!r}")
        return bool(v)

    @staticmethod
    def _check_seed(v):
        # numpy's generators take seeds >= 0 only
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise PlanError(f"seed must be a non-negative int, got {type(v).__name__} {v!r}")
        return int(v)

    @staticmethod
    def _check_plan(v):
        if v is None:
            return None
        if not isinstance(v, dict):
            raise PlanError(f"plan must be a dict {{eqn index: {{index: count}}}}, got {v!r}")
        for k, how in v.items():
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
                raise PlanError(f"plan: keys are eqn indices (ints), got {k!r}")
            if not isinstance(how, dict):
                raise PlanError(f"plan[{k}] must be a dict {{index: count or intervals}}, "
                                f"got {how!r}")
        return None

    @staticmethod
    def _check_inputs_resident(v):
        return flag_option("inputs_resident", v)

    @staticmethod
    def _check_cost(v):
        return COST_ALIASES.get(name_option("cost", v, COSTS), v)

    @staticmethod
    def _check_memory_limit(v):
        if v is None:
            return None
        if isinstance(v, (bool, np.bool_)) or not isinstance(
                v, (int, float, np.integer, np.floating)) or not v > 0 or (
                isinstance(v, (float, np.floating)) and not math.isfinite(v)):
            raise PlanError(f"memory_limit must be a positive number of bytes, got {v!r}")
        if v != int(v):   # int() would report 1.5 as a limit of 1 byte
            raise PlanError(f"memory_limit must be a whole number of bytes, got {v!r}")
        return int(v)

    @staticmethod
    def _check_max_specs(v):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise PlanError(f"max_specs must be a positive int, got {v!r}")
        return int(v)

    @staticmethod
    def _check_topology(v):
        # the IR does not import the hardware layer: a Topology is recognized by what
        # planning reads of it (eins.hardware.net.resolve_topology resolves the name)
        if v is None or isinstance(v, (str, os.PathLike)):
            return None
        if not all(hasattr(v, a) for a in _TOPOLOGY_FIELDS):
            raise PlanError(f"topology must be a preset name, a JSON file path or a Topology, "
                            f"got {type(v).__name__} {v!r:.80}")

    @staticmethod
    def _check_profile(v):
        # the IR does not import the hardware layer: a Profile is recognized by its entry()
        if v is None or isinstance(v, (str, os.PathLike)) or hasattr(v, "entry"):
            return None
        raise PlanError(f"profile must be a profile name, a JSON file path or a Profile, "
                        f"got {type(v).__name__} {v!r:.80}")

    @staticmethod
    def _check_tuning(v):
        if not isinstance(v, Tuning):
            raise PlanError(f"tuning must be an eins.ir.plan.Tuning, got {type(v).__name__} "
                            f"{v!r:.80}")

    @staticmethod
    def _check_attention(v):
        name_option("attention", v, ATTENTION_IMPLS)

    @staticmethod
    def _check_schedule(v):
        schedule_name(v)  # the one check of the name and its "ai" alias

    @staticmethod
    def _check_synthesis_budget_s(v):
        if (isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating))
                or not math.isfinite(v) or v <= 0):
            raise PlanError(f"synthesis_budget_s must be a positive, finite number of seconds, "
                            f"got {v!r}")
        return float(v)

    @staticmethod
    def _check_synthesis_steps(v):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise PlanError(f"synthesis_steps must be a positive int (simulated candidates per "
                            f"exchange program) or None, got {type(v).__name__} {v!r}")
        return int(v)


@dataclass(frozen=True, slots=True)
class CostBreakdown:
    """The three sub-costs of Section 4.3, in bytes (elements x dtype itemsize)."""

    repartition: int = 0
    join: int = 0
    aggregation: int = 0

    @property
    def total(self) -> int:
        return self.repartition + self.join + self.aggregation

    def __add__(self, other: "CostBreakdown") -> "CostBreakdown":
        return CostBreakdown(self.repartition + other.repartition, self.join + other.join,
                             self.aggregation + other.aggregation)

    def __repr__(self):
        return (f"cost {format_bytes(self.total)} (repartition {format_bytes(self.repartition)}"
                f", join {format_bytes(self.join)}, aggregation "
                f"{format_bytes(self.aggregation)})")


@dataclass(frozen=True)
class EqnPlan:
    """One eqn's chosen decomposition: ``intervals`` per named index, the join-agg ``spec``
    the operator returned for it, its ``cost`` (the byte proxy) given its producers' chosen
    tilings, and its ``seconds``: the time cost's share of this eqn (its kernel, the
    exchanges feeding it, the gathers of the program outputs it produces; they add up to
    ``Plan.cost_s``), None when planned without a topology."""

    intervals: Intervals
    spec: JoinAggSpec
    cost: CostBreakdown = field(default_factory=CostBreakdown)
    seconds: float | None = None

    @property
    def splits(self) -> dict[str, int]:
        """{index name: interval count} for the indices split more than once."""
        return {n: len(iv) for n, iv in self.intervals.items() if len(iv) > 1}

    @property
    def pieces(self) -> int:
        """Number of function specifications (devices busy for this eqn)."""
        return len(self.spec.fspecs)

    def out_counts(self, j: int = 0) -> tuple[int, ...]:
        """Interval count per dimension of output ``j``'s tiling."""
        boxes = self.spec.out_tiling(j)
        rank = boxes[0].rank if boxes else 0
        return tuple(len({(b.lo[d], b.hi[d]) for b in boxes}) for d in range(rank))

    def agg_m(self, j: int = 0) -> int:
        """m: the number of partial copies ⊕-aggregated per block of output ``j``."""
        return max(self.spec.multiplicity(j).values(), default=1)

    def describe(self, names: dict | None = None, devices: int | None = None) -> str:
        """``split d0/8 -> out 8x1 | cost ...`` (docs/stages.md): each split index (printed
        names from ``names``, see eins.ir.text) and its interval count; the output's
        blocks per dimension; when a contracted index is split, how many partial copies
        of each output block ⊕ combines; with ``devices``, how many stay idle."""
        names = names or {}
        shown = sorted((names.get(n, n), c) for n, c in self.splits.items())
        shown.sort(key=lambda nc: sort_key(nc[0]))
        splits = " ".join(f"{n}/{c}" for n, c in shown) or "whole"
        # a scalar output (rank 0) is one block, whatever is split
        outs = " ".join("x".join(map(str, self.out_counts(j))) or "1"
                        for j in range(len(self.spec.aggs))) or "-"
        blocks = "block" if outs == "1" else "blocks"
        m = self.agg_m(0) if self.spec.aggs else 1
        agg = (f", {self.spec.aggs[0]} of {m} partial copies per block"
               if self.spec.aggs and self.spec.aggs[0] else "")
        idle = ""
        if devices is not None and self.pieces < devices:
            idle = (f", {self.pieces} piece{'s' if self.pieces > 1 else ''}: "
                    f"{devices - self.pieces} of {devices} devices idle")
        time = f"time {format_seconds(self.seconds)}, " if self.seconds is not None else ""
        return f"split {splits} -> out {outs} {blocks}{agg}{idle} | {time}{self.cost!r}"


@dataclass(frozen=True)
class Plan:
    """The planned IR: ``program`` with ``eqn_plans[i]`` for every eqn (never None here: an
    operator without shardable indices gets a one-piece spec), the ``devices`` the function
    specifications run on, the ``selector`` that chose it, and the proxy's total cost."""

    program: Program
    devices: tuple[int, ...]
    eqn_plans: tuple[EqnPlan, ...]
    selector: str
    cost_bytes: int
    cost_s: float | None = None        # the time cost's total (eins.cost.timecost)
    eqn_peak_bytes: int = 0            # the largest per-eqn working set on one device
    memory_limit: float | None = None  # the per-device cap it was planned under
    topology: str | None = None        # the name of the topology it was costed on
    minimized: str | None = None       # what the selector minimized: "time", "bytes" or None

    @property
    def cost(self) -> CostBreakdown:
        """The proxy summed over the eqns."""
        return sum((ep.cost for ep in self.eqn_plans), CostBreakdown())

    def producer_tiling(self, var) -> tuple | None:
        """The blocks ``var`` is produced in (its producer's out tiling), or None for a
        program input or constant (materialized in whatever blocks the consumer needs)."""
        if not isinstance(var, Var):
            return None
        where = self.program.producers().get(id(var))
        if where is None:
            return None
        i, j = where
        return self.eqn_plans[i].spec.out_tiling(j)

    def index_names(self) -> list[dict]:
        """Per eqn: {operator's index name: printed name} (eins.ir.text's rule)."""
        return [eqn_index_names(e) for e in self.program.eqns]

    def table(self) -> list[dict]:
        """One dict per eqn: eqn, op, phase ("fwd" or "bwd": eins.ir.program.Eqn), splits
        {printed index name: count}, out_tiling, agg (m: partial copies per output block),
        cost_bytes, seconds."""
        rows = []
        names = self.index_names()
        for i, (e, ep) in enumerate(zip(self.program.eqns, self.eqn_plans)):
            rows.append({
                "eqn": i, "op": e.prim, "phase": e.phase,
                "splits": {names[i].get(n, n): c for n, c in ep.splits.items()},
                "out_tiling": ep.out_counts(0) if e.outputs else (),
                "agg": ep.agg_m(0) if e.outputs else 1,
                "cost_bytes": ep.cost.total,
                "seconds": ep.seconds,
            })
        return rows

    def pretty(self) -> str:
        how = "".join(f" {k}={v}" for k, v in (("minimized", self.minimized),
                                                ("topology", self.topology)) if v)
        time = f"time {format_seconds(self.cost_s)}, " if self.cost_s is not None else ""
        head = (f"# plan: selector={self.selector}{how} devices={list(self.devices)} "
                f"{time}{self.cost!r}")
        p = len(self.devices)
        names = self.index_names()

        def note(i, e):
            return self.eqn_plans[i].describe(names[i], p)

        body = self.program.pretty(annotate=note)
        return "\n".join(wrap_line(line) for line in (head + "\n" + body).split("\n"))

    def __str__(self):
        return self.pretty()


TEXT_WIDTH = 100   # the planned text's lines wrap at this column


def wrap_line(line: str, width: int = TEXT_WIDTH) -> str:
    """A line of the planned text at most ``width`` columns where it can be. An eqn keeps
    its split on its own line (``... = matmul a b    # split d0/8 -> out 8x1 blocks |``),
    so that a line still says what each eqn does; the rest of its comment (time and cost)
    wraps under it. A comment line (the header) wraps in place. Continuation lines carry
    the ``#`` and an indent."""
    if len(line) <= width:
        return line
    code, sep, note = line.partition("    # ")
    if not sep or not code.strip():   # a comment line (the header): wrap it in place
        lead = line[:len(line) - len(line.lstrip())]
        first, note = lead + "# ", line.lstrip().removeprefix("# ")
        rest = lead + "#   "
    else:
        indent = code[:len(code) - len(code.lstrip())]
        split, bar, note = note.partition(" | ")
        first = f"{code}    # {split}{bar.rstrip()} " if bar else f"{code}    # "
        note = note if bar else split
        rest = indent + "    #   "
        if len(first) >= width - 10:   # no room for a word of the rest: it starts below
            return first.rstrip() + "\n" + _wrap(note, width, rest, rest)
    return _wrap(note, width, first, rest)


def _wrap(text: str, width: int, first: str, rest: str) -> str:
    # a figure stays with its name and unit ("time 3.4 us", "1.03 MiB"): no break in them
    text = _UNIT.sub(lambda m: m.group(1) + "\0" + m.group(2), text)
    text = _NAMED.sub(lambda m: m.group(1) + "\0" + m.group(2), text)
    return "\n".join(ln.replace("\0", " ") for ln in textwrap.wrap(
        text, width, initial_indent=first, subsequent_indent=rest, break_long_words=False,
        break_on_hyphens=False))


_UNIT = re.compile(r"(\d) ((?:[KMGTP]i)?B|[mun]?s|devices?|blocks?|copies|copy|pieces?)\b")
_NAMED = re.compile(r"\b(time|cost|repartition|join|aggregation|of) (\d)")


@dataclass(frozen=True)
class Compilation:
    """What the pipeline passes hand each other (``eins.passes.PIPELINE``). Each pass
    returns a copy (``dataclasses.replace``) with its own field filled and changes no value
    it was given; later passes add fields after ``plan``. ``candidates`` and ``trees`` hold
    types of the passes that make them (a pass module sits above the IR, so not named
    here)."""

    program: Program
    devices: tuple[int, ...]
    options: Options = Options()
    # options.topology resolved for the devices (eins.distribute does it once); None: the
    # planning pass resolves it (None after planning: the proxy on more devices than the
    # default topology covers, planned without one)
    topology: Topology | None = None
    # per eqn: tuple[eins.passes.enumerate_specs.Candidate, ...] (enumerate_specs)
    candidates: tuple[tuple, ...] | None = None
    # eins.passes.cut_trees.Tree in optimization order (cut_trees)
    trees: tuple | None = None
    plan: Plan | None = None                                  # (choose_specs)
    # eqn -> device per function specification (place; synthesize's final one)
    placement: Mapping[int, tuple[int, ...]] | None = None
    exchange: ExchangeIR | None = None   # preambles (overlay), then with bodies (synthesize)
    device: DeviceProgram | None = None  # (lower)
