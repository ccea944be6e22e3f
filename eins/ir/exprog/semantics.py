"""ExProg semantics (paper Definition 5.5): declaration rules of an AST built in code, the
closure ``S*(P)`` and validity for a given membership."""
from __future__ import annotations

import math
import numbers
from collections import defaultdict, deque

from eins.errors import ExProgError
from eins.ir.exprog.cover import has_cover
from eins.ir.exprog.syntax import (
    MAX_ATOM_BYTES, Action, ExProg, action_key, agg_text, destinations, format_action,
    format_requirement, hop_fault)

# ----------------------------------------------------------------------------------------
# Static validation of an AST built in code (the parser does the same with positions)


def _whole_bytes(size) -> bool:
    """Whether ``size`` is a whole number of bytes from 1 to MAX_ATOM_BYTES: an int (numpy's
    too) or a real that is whole (2.5e8, np.float32(2**20), Fraction(10**6)); not a bool,
    a string, NaN or inf."""
    if isinstance(size, bool) or not isinstance(size, numbers.Real):
        return False
    if not isinstance(size, numbers.Integral):   # float() of a huge int would overflow
        if not math.isfinite(size) or not float(size).is_integer():
            return False
        size = float(size)
    return 0 < size <= MAX_ATOM_BYTES


def validate(prog: ExProg) -> None:
    """Raise :class:`ExProgError` if ``prog`` references undeclared atoms, sites or
    partitions, or declares an atom twice at one site or overlapping partitions (Section
    5.2's declaration rules)."""
    gpus = set(prog.gpus)
    if len(gpus) != len(prog.gpus):
        raise ExProgError(f"GPUS lists a site twice: {prog.gpus}")
    names = {}
    owner = {}
    for p in prog.partitions:
        if p.name in names:
            raise ExProgError(f"partition '{p.name}' is declared twice")
        names[p.name] = p
        if p.size < 1:
            raise ExProgError(f"partition '{p.name}' has size {p.size}; sizes are positive")
        if p.members is not None:
            if len(p.members) != p.size or len(set(p.members)) != p.size:
                raise ExProgError(f"partition '{p.name}' has size {p.size} but members "
                                  f"{p.members}")
            for m in p.members:
                if m not in gpus:
                    raise ExProgError(f"site {m} of partition '{p.name}' is not in GPUS")
                if m in owner:
                    raise ExProgError(f"site {m} is in both partition '{owner[m]}' and "
                                      f"partition '{p.name}' (partitions must be disjoint)")
                owner[m] = p.name
    total = sum(p.size for p in prog.partitions)
    if total > len(gpus):
        raise ExProgError(f"partition sizes add up to {total} but there are only "
                          f"{len(gpus)} GPUs")
    sizes, placed = {}, set()
    for d in prog.inputs:
        if d.site not in gpus:
            raise ExProgError(f"atom '{d.name}' is placed at site {d.site}, not in GPUS")
        if (d.name, d.site) in placed:
            raise ExProgError(f"atom '{d.name}' is declared twice at site {d.site}")
        placed.add((d.name, d.site))
        if d.name in sizes and sizes[d.name] != d.size:
            raise ExProgError(f"atom '{d.name}' is declared with two sizes")
        if not _whole_bytes(d.size):
            # a NaN or inf size looped the simulator; the parser takes only these
            raise ExProgError(f"atom '{d.name}' has size {d.size!r}; sizes are positive "
                              f"whole numbers of bytes, at most 2**53")
        sizes[d.name] = d.size

    def agg_ok(agg, where):
        if not agg:
            raise ExProgError(f"empty aggregate in {where}")
        for a in agg:
            if a not in sizes:
                raise ExProgError(f"unknown atom '{a}' in {where}")

    def target_ok(t, where):
        if isinstance(t, str):
            if t not in names:
                raise ExProgError(f"unknown partition '{t}' in {where}")
        elif t not in gpus:
            raise ExProgError(f"site {t} in {where} is not in GPUS")

    known = sizes.__contains__
    for r in prog.outputs:
        # the text naming a requirement only for an error (1.6M of them at 1,024 GPUs)
        fine = bool(r.agg) and all(map(known, r.agg))
        for t in r.targets if fine else ():
            if not (t in names if isinstance(t, str) else t in gpus):
                fine = False
        if not fine:
            where = f"OUT requirement '{format_requirement(r)}'"
            agg_ok(r.agg, where)
            for t in r.targets:
                target_ok(t, where)
    seen = set()
    for a in prog.actions:
        where = _Named("action", format_action, a)
        key = action_key(a)
        if key in seen:
            raise ExProgError(f"{where} is written twice (a program is a set of actions)")
        seen.add(key)
        agg_ok(a.agg, where)
        target_ok(a.source, where)
        for hop in a.hops:
            if not hop:
                raise ExProgError(f"{where} has an empty destination list")
            for d in hop:
                if isinstance(d, str) or d not in gpus:
                    raise ExProgError(f"destination {d} in {where} is not a site in GPUS")
        fault = hop_fault(a)
        if fault is not None:
            raise ExProgError(f"{where}: {fault[2]}")


class _Named:
    """``kind 'text'`` of an action, formatted only when an error message prints it."""

    __slots__ = ("kind", "fmt", "item")

    def __init__(self, kind, fmt, item):
        self.kind, self.fmt, self.item = kind, fmt, item

    def __str__(self):
        return f"{self.kind} '{self.fmt(self.item)}'"


# ----------------------------------------------------------------------------------------
# Semantics (Definition 5.5)


def known_membership(prog: ExProg, membership=None) -> dict[str, tuple[int, ...]]:
    """Members of every partition known so far: declared members, then ``membership``;
    partitions declared by size and absent from ``membership`` are left out (unchecked:
    :func:`eins.ir.exprog.membership.complete_membership` completes and checks)."""
    out = {}
    for p in prog.partitions:
        if p.members is not None:
            out[p.name] = p.members
        elif membership and p.name in membership:
            out[p.name] = tuple(membership[p.name])
    return out


class _Run:
    """One worklist evaluation of Definition 5.5's closure.

    ``instances``: one per (action, source site): ``(action index, site, agg, destinations)``;
    an action whose source is a partition has one instance per member site.
    """

    __slots__ = ("present", "fired", "instances", "order")

    def __init__(self, prog: ExProg, members: dict, unknown_sites=None):
        inst = []
        for i, a in enumerate(prog.actions):
            if isinstance(a.source, str):
                sites = members.get(a.source, unknown_sites)
                if sites is None:
                    continue  # membership unknown: the action cannot fire yet
            else:
                sites = (a.source,)
            dests = destinations(a)
            for s in sites:
                inst.append((i, s, a.agg, dests))
        self.instances = inst
        present: dict[int, set] = defaultdict(set)
        waiting: dict[tuple, list[int]] = defaultdict(list)  # (site, atom) -> instances
        for j, (_, s, agg, _) in enumerate(inst):
            for atom in agg:
                waiting[(s, atom)].append(j)
        fired = [False] * len(inst)
        order = []
        queue = deque()

        def add(x, s):
            at = present[s]
            if x not in at:
                at.add(x)
                queue.append((x, s))

        for d in prog.inputs:
            add(frozenset((d.name,)), d.site)
        while queue:
            y, s = queue.popleft()
            # an instance containing y must contain any one atom of y: scan those only
            atom = next(iter(y))
            for j in waiting.get((s, atom), ()):
                if fired[j]:
                    continue
                _, _, x, dests = inst[j]
                if y <= x and has_cover(x, present[s]):
                    fired[j] = True
                    order.append(j)
                    add(x, s)
                    for d in dests:
                        add(x, d)
        self.present = present
        self.fired = fired
        self.order = order

    def state(self) -> set:
        return {(x, s) for s, xs in self.present.items() for x in xs}

    def has(self, x, s) -> bool:
        return x in self.present.get(s, ())


def closure(prog: ExProg, membership=None) -> set:
    """The closure ``S*(P)`` of Definition 5.5: the least state containing ``S_IN`` and closed
    under firing enabled actions, as a set of ``(frozenset aggregate, site)``. Actions at a
    partition declared by size and absent from ``membership`` do not fire."""
    return _Run(prog, known_membership(prog, membership)).state()


def firing_order(prog: ExProg, membership=None) -> list[tuple[int, int]]:
    """``(action index, source site)`` in an order in which they can fire (each enabled by
    the ones before it); actions that never fire are absent."""
    run = _Run(prog, known_membership(prog, membership))
    return [run.instances[j][:2] for j in run.order]


def _problems(prog: ExProg, run: _Run, members: dict, first_only: bool):
    """Definition 5.5's well-formedness then validity, as error messages."""
    out = []
    for j, ok in enumerate(run.fired):
        if not ok:
            i, s, x, _ = run.instances[j]
            out.append(_never_enabled(prog.actions[i], s, x, run))
            if first_only:
                return out
    for r in prog.outputs:
        for t in r.targets:
            sites = (t,) if isinstance(t, int) else members.get(t)
            if sites is None:
                out.append(f"OUT requirement '{format_requirement(r)}' is not met: partition "
                           f"'{t}' has no membership")
                if first_only:
                    return out
                continue
            for s in sites:
                if not run.has(r.agg, s):
                    where = f"site {s}" if isinstance(t, int) else (
                        f"site {s} of partition {t} = {{{', '.join(map(str, sites))}}}")
                    out.append(f"OUT requirement '{format_requirement(r)}' is not met: "
                               f"{agg_text(r.agg)} is never materialized at {where}")
                    if first_only:
                        return out
    return out


def _never_enabled(a: Action, s: int, x: frozenset, run: _Run) -> str:
    present = run.present.get(s, set())
    inside = [y for y in present if y <= x]
    missing = x - frozenset().union(*inside) if inside else x
    at = f" at site {s}" if isinstance(a.source, str) else ""
    head = f"action '{format_action(a)}'{at} is never enabled: "
    if missing:
        return head + (f"atom{'s' if len(missing) > 1 else ''} {', '.join(sorted(missing))} "
                       f"of {agg_text(x)} never reach{'es' if len(missing) == 1 else ''} "
                       f"site {s}")
    held = ", ".join(sorted(agg_text(y) for y in inside))
    return head + (f"the aggregates at site {s} inside {agg_text(x)} ({held}) overlap and "
                   f"never partition it")


def is_valid(prog: ExProg, membership=None) -> bool:
    """Definition 5.5: every action enabled by the closure and every OUT requirement met,
    for the given membership of the partitions declared by size."""
    members = known_membership(prog, membership)
    return not _problems(prog, _Run(prog, members), members, first_only=True)


def problems(prog: ExProg, membership=None) -> list[str]:
    """Every reason ``prog`` is invalid under ``membership`` (empty when valid)."""
    members = known_membership(prog, membership)
    return _problems(prog, _Run(prog, members), members, first_only=False)
