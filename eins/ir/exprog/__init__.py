"""ExProg (Section 5.2): the exchange-program language. Frozen AST, parser, printer and the
semantics of Definition 5.5.

AST (fixed; the parser, printer, semantics, simulator and synthesizer all share it):

- an *aggregate* is a ``frozenset[str]`` of atom names (``A+B`` == ``B+A``);
- a *site* is an ``int`` GPU id; a *target* is a site or a partition name (``str``);
- ``Action(agg, source, hops)``: ``X @ s`` has ``hops == ()``; ``X @ s -> 1, 2`` has
  ``hops == ((1, 2),)``; the relay ``X @ s -> r -> d`` has ``hops == ((r,), (d,))``. ``source``
  may be a partition name (``X @ G1``: aggregate at every site of G1, no transfer).

Concrete syntax (what :func:`parse` reads and :func:`to_text` writes)::

    # comments run to the end of the line
    GPUS: 0, 1, 2, 3, 4, 5, 6, 7              # optional: inferred from the sites used
    PARTITIONS: G1 {size 4}; G2 {2, 3, 6, 7}  # optional; by size or by members
    IN: A @ 0 (size: 0.5 GB); B @ 1           # sizes in GB/MB/KB/B (10^9/10^6/10^3/1); default 1 GB
    OUT: A+B @ 0, 1; A @ G1
    A @ 0 -> 1; B @ 1 -> 0                    # the body: actions, separated by ';' or newlines
    A+B @ 0, 1                                # shorthand for the two actions A+B @ 0 and A+B @ 1
    A @ 0 -> 2 -> 3                           # relay through 2

Layout: the sections come first. A section continues onto the next line when that line is
indented deeper than the section's header line, when the line before ends with ``;``, ``,``
or the header's ``:``, or (GPUS/PARTITIONS) when the line can only be a site list / a
partition; the line break then separates two entries. Any other line after the sections
starts the body. (IN and OUT entries look like actions, so the body cannot be told from a
section without such a rule.) Several sections may share one line
(``IN: A @ 0; B @ 1 OUT: A+B @ 0``).

Semantics (Definition 5.5): :func:`closure`, :func:`is_valid`, :func:`check`.

Modules: :mod:`.syntax` (AST, helpers, printer), :mod:`.parser`, :mod:`.semantics`
(declaration rules, closure, validity), :mod:`.membership` (membership search).
"""
from __future__ import annotations

from eins.ir.exprog.cover import exact_cover
from eins.ir.exprog.membership import check, check_membership, complete_membership
from eins.ir.exprog.parser import parse
from eins.ir.exprog.semantics import (
    closure, firing_order, is_valid, known_membership, problems, validate)
from eins.ir.exprog.syntax import (
    GB, KB, MB, Action, AtomDecl, ExProg, Partition, Requirement, action_key, agg_size,
    agg_text, atom_sizes, destinations, fill_membership, format_action, format_atom,
    format_partition, format_requirement, format_size, hop_fault, to_text)

__all__ = ["GB", "KB", "MB", "Action", "AtomDecl", "ExProg", "Partition", "Requirement",
           "action_key", "agg_size", "agg_text", "atom_sizes", "check", "check_membership", "closure",
           "complete_membership", "destinations", "exact_cover", "fill_membership",
           "firing_order", "format_action", "format_atom", "format_partition",
           "format_requirement", "format_size", "hop_fault", "is_valid", "known_membership",
           "parse", "problems", "to_text", "validate"]
