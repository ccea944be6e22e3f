"""Membership search (paper Section 5.2): a program with partitions declared by size is valid
when some membership makes it valid; :func:`check` finds one or says why none exists."""
from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable, Mapping

from eins.errors import ExProgError
from eins.ir.exprog.semantics import _never_enabled, _problems, _Run, is_valid, \
    known_membership, validate
from eins.ir.exprog.syntax import ExProg, agg_text, format_partition, format_requirement

_SEARCH_LIMIT = 200_000  # membership candidates tried before giving up


def check(prog: ExProg, membership=None) -> dict[str, tuple[int, ...]]:
    """A membership for every partition that makes ``prog`` valid (Definition 5.5; a program
    with partitions declared by size is valid when some membership makes it valid, Section
    5.2). Partitions declared by members keep theirs; ``membership`` may fix others. Raises
    :class:`ExProgError` naming the action that is never enabled or the unmet OUT requirement,
    or saying that no membership makes the program valid."""
    validate(prog)
    membership = check_membership(prog, membership)
    members = known_membership(prog, membership)
    unknown = [p for p in prog.partitions if p.name not in members]
    if not unknown:
        errs = _problems(prog, _Run(prog, members), members, first_only=True)
        if errs:
            raise ExProgError(errs[0])
        return members
    found = MembershipSearch(prog, members, unknown).find()
    return {p.name: found[p.name] for p in prog.partitions}


class MembershipSearch:
    """The search for the members of ``unknown`` partitions (declared by size), the others'
    ``members`` known. Over-approximation first: every unknown partition holding every free
    site. Adding action instances only grows the closure (monotonicity), so what fails there
    fails for every membership (:meth:`_refute`), and a requirement at a partition can only
    be met at the sites materializing it there (:meth:`_candidates`). Then a depth-first
    search over the candidate groups (:meth:`_search`), pruned by the same
    over-approximation (:meth:`_node_ok`), up to :data:`_SEARCH_LIMIT` candidates."""

    def __init__(self, prog: ExProg, members: dict, unknown: list):
        self.prog, self.members, self.unknown = prog, members, unknown
        used = {m for ms in members.values() for m in ms}
        self.free = [g for g in prog.gpus if g not in used]
        self.cover = sum(p.size for p in prog.partitions) == len(prog.gpus)
        self.unknown_names = {p.name for p in unknown}
        self.over = _Run(prog, members, unknown_sites=tuple(self.free))
        self.cand: dict[str, set] = {p.name: set(self.free) for p in unknown}
        self.why: dict[str, list[str]] = {p.name: [] for p in unknown}
        self.referenced: set[str] = set()
        self.tried = 0
        # filled by find(): the partitions searched (fewest candidates first), those no
        # requirement or action names (they cannot affect validity: filled last), and
        # whether the closure depends on the membership at all
        self.order, self.rest, self.depends = [], [], False

    def find(self) -> dict:
        """Partition name -> sites for every partition, or an ExProgError saying why none
        makes the program valid."""
        self._refute()
        self._candidates()
        self.order = sorted((p for p in self.unknown if p.name in self.referenced),
                            key=lambda p: len(self.cand[p.name]))
        self.rest = [p for p in self.unknown if p.name not in self.referenced]
        self.depends = any(isinstance(a.source, str) and a.source in self.unknown_names
                           for a in self.prog.actions)
        found = self._search(0, {}, set())
        if found is None:
            detail = "; ".join(w for p in self.order for w in self.why[p.name])
            raise ExProgError("no membership makes this program valid"
                              + (f" ({detail})" if detail else ""))
        return found

    def _at(self, sites) -> str:
        return _only_at(sites, self.free, self.prog.gpus)

    def _refute(self) -> None:
        """Raise for an action at a known site or partition that never fires, or a
        requirement there never met, even in the over-approximation."""
        prog, over = self.prog, self.over
        for j, ok in enumerate(over.fired):
            i, s, x, _ = over.instances[j]
            if not ok and prog.actions[i].source not in self.unknown_names:
                raise ExProgError(_never_enabled(prog.actions[i], s, x, over))
        for r in prog.outputs:
            for t in r.targets:
                if isinstance(t, str) and t in self.unknown_names:
                    continue
                sites = (t,) if isinstance(t, int) else self.members[t]
                for s in sites:
                    if not over.has(r.agg, s):
                        raise ExProgError(f"OUT requirement '{format_requirement(r)}' is not "
                                          f"met: {agg_text(r.agg)} is never materialized at "
                                          f"site {s}")

    def _candidates(self) -> None:
        """Narrow each unknown partition's candidate sites to those where its requirements
        can be met and its actions fire; raise where too few are left."""
        prog, over, cand = self.prog, self.over, self.cand
        byname = {p.name: p for p in prog.partitions}
        for r in prog.outputs:
            for t in r.targets:
                if t in cand:
                    self.referenced.add(t)
                    ok = {s for s in self.free if over.has(r.agg, s)}
                    size = byname[t].size
                    if len(ok) < size:
                        raise ExProgError(
                            f"no membership makes this program valid: OUT requirement "
                            f"'{format_requirement(r)}' is not met: {agg_text(r.agg)} can be "
                            f"materialized {self._at(ok)}, but partition '{t}' needs "
                            f"{size} site{'s' if size > 1 else ''}")
                    cand[t] &= ok
                    self.why[t].append(f"'{format_requirement(r)}' can be met {self._at(ok)}")
        for j, ok in enumerate(over.fired):
            i, s, x, _ = over.instances[j]
            src = prog.actions[i].source
            if src in cand:
                self.referenced.add(src)
                if not ok:
                    cand[src].discard(s)
        for p in self.unknown:
            if len(cand[p.name]) < p.size:
                reason = "; ".join(self.why[p.name] + [f"its actions can be enabled "
                                                       f"{self._at(cand[p.name])}"])
                raise ExProgError(f"no membership makes this program valid: partition "
                                  f"'{p.name}' needs {p.size} sites but {reason}")

    def _leaf(self, chosen: dict) -> dict | None:
        """``chosen`` completed by the partitions left (in site order): the membership if
        the program is valid under it."""
        left = [g for g in self.free if all(g not in ms for ms in chosen.values())]
        full = dict(chosen)
        for p in self.rest:
            full[p.name], left = tuple(left[:p.size]), left[p.size:]
        if self.cover and left:
            return None
        self.tried += 1
        mem = {**self.members, **full}
        # Without actions at unknown partitions the closure does not depend on membership,
        # so the candidate sets are exact and every leaf is valid.
        if not self.depends or is_valid(self.prog, mem):
            return mem
        return None

    def _node_ok(self, chosen: dict, taken: set) -> bool:
        """Prune a partial membership: with the unassigned partitions holding every site
        still free (again an over-approximation of any completion's closure), the assigned
        partitions' actions must fire and their requirements must be met, and so must the
        requirements at fixed sites and known partitions (else a choice that starves one
        of them shows only at the leaves: 200,000 candidates for 9 partitions)."""
        self.tried += 1
        mem = {**self.members, **chosen}
        run = _Run(self.prog, mem, unknown_sites=tuple(g for g in self.free if g not in taken))
        for j, ok in enumerate(run.fired):
            if not ok and self.prog.actions[run.instances[j][0]].source in chosen:
                return False
        for r in self.prog.outputs:
            for t in r.targets:
                sites = (t,) if isinstance(t, int) else mem.get(t, ())
                if not all(run.has(r.agg, m) for m in sites):
                    return False
        return True

    def _search(self, k: int, chosen: dict, taken: set) -> dict | None:
        """Depth first: a group for partition ``order[k]`` among its candidates not taken."""
        if self.tried > _SEARCH_LIMIT:
            raise ExProgError(f"membership search gave up after {_SEARCH_LIMIT:,} candidates "
                              f"without deciding: the program may still be valid; declare "
                              f"the partitions by their members (P {{0, 1}}) to check one "
                              f"membership directly")
        if k == len(self.order):
            return self._leaf(chosen)
        if self.depends and k > 0 and not self._node_ok(chosen, taken):
            return None
        if self.cover and not self.rest:
            # every free site must end up in a group: prune when one no longer can
            reach = set().union(*(self.cand[q.name] for q in self.order[k:]))
            if any(g not in taken and g not in reach for g in self.free):
                return None
        p = self.order[k]
        for group in itertools.combinations(sorted(self.cand[p.name] - taken), p.size):
            got = self._search(k + 1, {**chosen, p.name: group}, taken | set(group))
            if got is not None:
                return got
        return None


def check_membership(prog: ExProg, membership) -> dict[str, tuple[int, ...]]:
    """``membership`` ({partition name: sites}, None for none) as name -> tuple of int sites,
    checked against ``prog``'s partitions: known names, as many distinct sites of GPUS as
    the partition's size, a declared partition's own members, no site in two partitions
    (declared members included). Raises ExProgError naming the offending value."""
    if membership is None:
        return {}
    if not isinstance(membership, Mapping):
        raise ExProgError(f"membership must be a dict {{partition name: sites}}, got "
                          f"{membership!r}")
    byname = {p.name: p for p in prog.partitions}
    out = {}
    for name, sites in membership.items():
        p = byname.get(name)
        if p is None:
            raise ExProgError(f"membership names unknown partition {name!r}")
        if isinstance(sites, (str, bytes)) or not isinstance(sites, Iterable):
            raise ExProgError(f"membership of partition '{name}' must be a list of sites, "
                              f"got {sites!r}")
        sites = tuple(sites)
        bad = [m for m in sites if isinstance(m, bool) or not isinstance(m, numbers.Integral)]
        if bad:   # int() would read 2.9 as site 2 and '3' as site 3
            raise ExProgError(f"membership of partition '{name}' names site {bad[0]!r}; "
                              f"sites are ints")
        sites = tuple(int(m) for m in sites)
        if p.members is not None and set(sites) != set(p.members):
            raise ExProgError(f"partition '{name}' is declared as "
                              f"{format_partition(p)[len(name) + 1:]} but membership gives "
                              f"{sites}")
        if len(sites) != p.size or len(set(sites)) != p.size:
            raise ExProgError(f"membership gives partition '{name}' {len(set(sites))} sites "
                              f"{sites}; it has size {p.size}")
        if any(m not in prog.gpus for m in sites):
            raise ExProgError(f"membership of partition '{name}' {sites} is not within GPUS")
        out[name] = sites
    members = known_membership(prog, out)
    used = [m for ms in members.values() for m in ms]
    if len(used) != len(set(used)):
        raise ExProgError(f"partitions overlap in membership {members}")
    return out


def complete_membership(prog, membership=None) -> dict:
    """Partition name -> tuple of sites: ``membership`` (checked: :func:`check_membership`;
    declared members filled in), or the one :func:`check` finds for partitions declared by
    size."""
    given = check_membership(prog, membership)
    out = {p.name: tuple(p.members) for p in prog.partitions if p.members is not None}
    out.update(given)
    if any(p.name not in out for p in prog.partitions):
        out.update(check(prog, given))
    return out


def _only_at(sites, free=None, gpus=None) -> str:
    """Where something can happen among the sites considered. Where declared partitions
    hold some sites, only the free ones are considered, and the message says so: the listed
    sites are not every site where it can happen."""
    partial = free is not None and gpus is not None and len(free) < len(gpus)
    if not sites:
        where = "at no free site" if partial else "at no site"
    else:
        where = "only at {" + ", ".join(str(s) for s in sorted(sites)) + "}"
        where += " of the free sites" if partial else ""
    if partial:
        held = sorted(set(gpus) - set(free))
        where += (f" (site{'s' if len(held) > 1 else ''} " + ", ".join(map(str, held))
                  + (" belong" if len(held) > 1 else " belongs") + " to declared partitions)")
    return where
