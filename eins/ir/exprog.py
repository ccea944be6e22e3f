"""ExProg (Section 5.2): the exchange-program language. Frozen AST, parser, printer and the
semantics of Definition 5.5.

AST (fixed; the parser, printer, semantics, simulator and synthesizer all share it):

- an *aggregate* is a ``frozenset[str]`` of atom names (``A+B`` == ``B+A``);
- a *site* is an ``int`` GPU id; a *target* is a site or a partition name (``str``);
- ``Action(agg, source, hops)``: ``X @ s`` has ``hops == ()``; ``X @ s -> 1, 2`` has
  ``hops == ((1, 2),)``; the relay ``X @ s -> r -> d`` has ``hops == ((r,), (d,))``. ``source``
  may be a partition name (``X @ G1``: aggregate at every site of G1, no transfer).
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 10**9  # ExProg sizes are decimal gigabytes


@dataclass(frozen=True, slots=True)
class Partition:
    """``G1 {size 4}`` (members None: chosen by the compiler) or ``G1 {0, 1, 4, 5}``."""

    name: str
    size: int
    members: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class AtomDecl:
    """``A @ 0 (size: 1.0 GB)``; ``size`` in bytes."""

    name: str
    site: int
    size: int = GB


@dataclass(frozen=True, slots=True)
class Requirement:
    """``A+B @ 0, 1`` or ``A+B @ G1`` in OUT."""

    agg: frozenset
    targets: tuple  # of int sites and str partition names


@dataclass(frozen=True, slots=True)
class Action:
    agg: frozenset
    source: object  # int site, or str partition name
    hops: tuple = ()  # tuple of tuples of int sites


@dataclass(frozen=True, slots=True)
class ExProg:
    gpus: tuple[int, ...]
    partitions: tuple[Partition, ...]
    inputs: tuple[AtomDecl, ...]
    outputs: tuple[Requirement, ...]
    actions: tuple[Action, ...] = ()
