"""ExProg syntax (paper Section 5.2): the frozen AST, small helpers shared with the simulator
and the synthesizer, and the printer. The concrete syntax is described in
:mod:`eins.ir.exprog`."""
from __future__ import annotations

from dataclasses import dataclass

from eins.ir.slots import fast_init

GB = 10**9  # ExProg sizes are decimal gigabytes
MB = 10**6
KB = 10**3
_UNITS = {"GB": GB, "MB": MB, "KB": KB, "B": 1}

# the largest atom size: the simulator divides sizes in floats, exact for whole numbers up to
# 2**53 (9 PB; an atom is at most one tensor, far below that); past it float(size) loses
# bytes, and past about 1e308 it raised OverflowError from inside the simulator
MAX_ATOM_BYTES = 2**53


@fast_init
@dataclass(frozen=True, slots=True)
class Partition:
    """``G1 {size 4}`` (members None: chosen by the compiler) or ``G1 {0, 1, 4, 5}``."""

    name: str
    size: int
    members: tuple[int, ...] | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class AtomDecl:
    """``A @ 0 (size: 1.0 GB)``; ``size`` in bytes."""

    name: str
    site: int
    size: int = GB


@fast_init
@dataclass(frozen=True, slots=True)
class Requirement:
    """``A+B @ 0, 1`` or ``A+B @ G1`` in OUT."""

    agg: frozenset
    targets: tuple  # of int sites and str partition names


@fast_init
@dataclass(frozen=True, slots=True)
class Action:
    agg: frozenset
    source: object  # int site, or str partition name
    hops: tuple = ()  # tuple of tuples of int sites

    def __str__(self):
        return format_action(self)


@fast_init
@dataclass(frozen=True, slots=True)
class ExProg:
    gpus: tuple[int, ...]
    partitions: tuple[Partition, ...]
    inputs: tuple[AtomDecl, ...]
    outputs: tuple[Requirement, ...]
    actions: tuple[Action, ...] = ()

    def __str__(self):
        return to_text(self)


# ----------------------------------------------------------------------------------------
# Small helpers shared with the simulator and the synthesizer


def agg_text(agg) -> str:
    """An aggregate as ExProg writes it: atom names sorted, joined by ``+``."""
    return "+".join(sorted(agg))


def atom_sizes(prog: ExProg) -> dict[str, int]:
    """Bytes per atom name (an atom declared at several sites has one size)."""
    return {d.name: d.size for d in prog.inputs}


def agg_size(prog_or_sizes, agg) -> int:
    """Bytes of an aggregate: ``⊕`` keeps the shape, so it is the size of any of its atoms
    (the largest, should a hand-written program disagree)."""
    sizes = prog_or_sizes if isinstance(prog_or_sizes, dict) else atom_sizes(prog_or_sizes)
    return max(sizes[a] for a in agg)


def format_size(nbytes: int) -> str:
    """Exact decimal text of a byte count (``0.5 GB``, ``2.0 KB``, ``7 B``): the shortest
    exact form, preferring the larger unit, so that parsing it gives ``nbytes`` back."""
    best = f"{nbytes} B"
    for name in ("KB", "MB", "GB"):
        unit = _UNITS[name]
        whole, rest = divmod(nbytes, unit)
        digits = len(str(unit)) - 1
        frac = str(rest).rjust(digits, "0").rstrip("0") or "0"
        text = f"{whole}.{frac} {name}"
        if len(text) <= len(best):
            best = text
    return best


def format_action(a: Action) -> str:
    """``A+B @ 0 -> 1, 2 -> 3``."""
    text = f"{agg_text(a.agg)} @ {a.source}"
    for hop in a.hops:
        text += " -> " + ", ".join(str(d) for d in hop)
    return text


def format_requirement(r: Requirement) -> str:
    return f"{agg_text(r.agg)} @ " + ", ".join(map(str, r.targets))


def format_atom(d: AtomDecl) -> str:
    text = f"{d.name} @ {d.site}"
    if d.size != GB:
        text += f" (size: {format_size(d.size)})"
    return text


def format_partition(p: Partition) -> str:
    if p.members is None:
        return f"{p.name} {{size {p.size}}}"
    return f"{p.name} {{" + ", ".join(str(m) for m in p.members) + "}"


def fill_membership(prog: ExProg, membership) -> ExProg:
    """``prog`` with every partition named in ``membership`` declared by those members
    (e.g. the result of :func:`check`), so the printed program records the placement."""
    parts = tuple(Partition(p.name, p.size, tuple(membership[p.name]))
                  if p.name in membership else p for p in prog.partitions)
    return ExProg(prog.gpus, parts, prog.inputs, prog.outputs, prog.actions)


def destinations(a: Action) -> tuple[int, ...]:
    """Every site on every hop, first-seen order: all of them receive ``a.agg``."""
    return tuple(dict.fromkeys(d for hop in a.hops for d in hop))


def action_key(a: Action) -> tuple:
    """What makes two actions the same action: the aggregate and the transfers it makes,
    each as (hop, sender, destination). A hop's site at place j is sent from place
    j mod len(previous hop) of the previous one (the simulator's round-robin relay; the
    first hop's from the source), so ``A @ 0 -> 2, 3`` is ``A @ 0 -> 3, 2`` and ``A @ 0 ->
    1, 2 -> 3, 4, 5, 6`` is ``A @ 0 -> 2, 1 -> 4, 3, 6, 5`` (1 sends to 3 and 5, 2 to 4 and
    6), while ``A @ 0 -> 1, 2 -> 4, 3`` is another action. Hashable also for an AST built
    in code with list hops."""
    edges, senders = set(), (a.source,)
    for k, hop in enumerate(a.hops):
        hop = tuple(hop)
        for j, d in enumerate(hop):
            edges.add((k, senders[j % len(senders)], d))
        senders = hop
    return (frozenset(a.agg), a.source, frozenset(edges))


def hop_fault(a: Action) -> tuple[int, int, str] | None:
    """The first destination of ``a`` that breaks a destination list's rules, as ``(hop,
    place, why)``, or None. A destination list is a set of sites (paper Definition 5.5: ``X @
    s -> D``), so a site listed twice would be charged two transfers for one arrival; and no
    transfer goes from a site to itself. Hop ``k``'s site at place ``j`` is sent from place
    ``j mod len(hop k-1)`` of the previous hop (the simulator's round-robin relay), the first
    hop's from the source, unchecked when the source is a partition."""
    senders = (a.source,)
    for k, hop in enumerate(a.hops):
        for j, d in enumerate(hop):
            if d in hop[:j]:
                return k, j, (f"site {d} appears twice in one destination list (a "
                              f"destination list is a set of sites)")
            src = senders[j % len(senders)]
            if d == src and not isinstance(src, str):
                return k, j, (f"'{agg_text(a.agg)}' would be sent from site {d} to itself "
                              f"(it is already there)")
        senders = hop
    return None


# ----------------------------------------------------------------------------------------
# Printer

_WIDTH = 96


def _section(header: str, items: list[str], sep: str) -> list[str]:
    """One section, wrapped: continuation lines are indented (and end with the separator)
    so the parser's layout rule reads them back as the same section."""
    lines, cur = [], header
    for k, item in enumerate(items):
        piece = item + (sep if k + 1 < len(items) else "")
        if cur.strip() and cur != header and len(cur) + 1 + len(piece) > _WIDTH:
            lines.append(cur.rstrip())
            cur = "   "
        cur += " " + piece
    lines.append(cur.rstrip())
    return lines


def to_text(prog: ExProg) -> str:
    """Deterministic ExProg text; ``parse(to_text(p)) == p`` for every well-declared p."""
    lines = _section("GPUS:", [str(g) for g in prog.gpus], ",")
    if prog.partitions:
        lines += _section("PARTITIONS:", [format_partition(p) for p in prog.partitions], ";")
    lines += _section("IN:", [format_atom(d) for d in prog.inputs], ";")
    lines += _section("OUT:", [format_requirement(r) for r in prog.outputs], ";")
    # Consecutive local aggregations of one aggregate print as one line (``A+B @ 0, 1``);
    # the parser expands that back into the same actions in the same order.
    acts = prog.actions
    i = 0
    while i < len(acts):
        a = acts[i]
        j = i + 1
        if not a.hops:
            while j < len(acts) and not acts[j].hops and acts[j].agg == a.agg:
                j += 1
        if j - i > 1:
            lines.append(f"{agg_text(a.agg)} @ " + ", ".join(str(b.source) for b in acts[i:j]))
        else:
            lines.append(format_action(a))
        i = j
    return "\n".join(lines) + "\n"
