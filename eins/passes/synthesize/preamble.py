"""Preambles for the synthesizer (paper Section 5.2): the checks a preamble must pass before
a body is written for it, partition membership, and the naive body (Section 5.4).

The declaration rules are :func:`eins.ir.exprog.validate`'s; a preamble to synthesize for
must also list at least one site. An atom declared at several sites is a replicated input
(Definition 5.5's initial state is a set of (atom, site) pairs): the search gives each atom
one home, so :mod:`eins.passes.synthesize.replicas` synthesizes such a preamble through preambles that
keep one copy of each atom; the same atom twice at one site is a mistake.
"""
from __future__ import annotations

import math

from eins.errors import ExProgError
from eins.ir.exprog import Action, ExProg, Partition, check_membership, validate

__all__ = ["check_preamble", "in_order_membership", "merge_membership", "with_members",
           "required", "naive_program", "naive_actions", "sent_bytes", "tie_key", "TIES_PER_S"]

# Simulated times equal to the picosecond are ties (float noise), broken by the fewer bytes
# sent, then the shorter body (tie_key, sent_bytes).
TIES_PER_S = 1e12


def tie_key(t: float) -> float:
    """``t`` rounded to the tie resolution (a picosecond); an infinite time (a link of
    1e-300 Gb/s) stays infinite instead of failing round()."""
    return round(t * TIES_PER_S) if math.isfinite(t * TIES_PER_S) else math.inf


def sent_bytes(prog: ExProg, acts, membership) -> int:
    """Bytes body ``acts`` of preamble ``prog`` transfers: per action, its aggregate's size
    (its largest atom's) times the sites of its hops (partitions through ``membership``).
    Of two bodies equally fast, the one sending fewer bytes is kept: an extra copy that
    costs no time still loads the fabric."""
    size = {a.name: a.size for a in prog.inputs}
    total = 0
    for a in acts:
        n = sum(len(membership[t]) if isinstance(t, str) else 1 for hop in a.hops for t in hop)
        if n:
            total += n * max(size[x] for x in a.agg)
    return total


def check_preamble(prog: ExProg) -> None:
    """Reject a preamble no body can satisfy, naming the offending value."""
    if not isinstance(prog, ExProg):
        raise ExProgError(f"expected an ExProg preamble, got {type(prog).__name__}")
    if not prog.gpus:
        raise ExProgError("GPUS must list at least one site, got []")
    validate(prog)  # the declaration rules, the one static check of an ExProg


def in_order_membership(prog: ExProg) -> dict:
    """Declared members as given; partitions declared by size take the remaining sites in
    order (0..3, 4..7, ... for two partitions of size 4 over GPUS 0..7)."""
    taken = {m for p in prog.partitions if p.members is not None for m in p.members}
    free = [g for g in prog.gpus if g not in taken]
    out = {}
    for p in prog.partitions:
        if p.members is not None:
            out[p.name] = tuple(p.members)
        else:
            out[p.name], free = tuple(free[:p.size]), free[p.size:]
    return out


def merge_membership(prog: ExProg, membership) -> dict:
    """``membership`` checked (:func:`eins.ir.exprog.check_membership`) and completed with
    declared members; in order (:func:`in_order_membership`) when None."""
    if membership is None:
        return in_order_membership(prog)
    given = check_membership(prog, membership)
    out = {}
    for p in prog.partitions:
        m = given.get(p.name, p.members)
        if m is None:
            raise ExProgError(f"partition {p.name!r} has no membership: declare its members "
                              f"or pass them in membership")
        out[p.name] = tuple(m)
    return out


def with_members(prog: ExProg, membership: dict, actions=()) -> ExProg:
    """``prog`` with body ``actions`` and every partition's members from ``membership``."""
    parts = tuple(Partition(p.name, p.size, tuple(membership[p.name])) for p in prog.partitions)
    return ExProg(prog.gpus, parts, prog.inputs, prog.outputs, tuple(actions))


def required(prog: ExProg, membership: dict):
    """Ordered dict ``X -> [sites]`` of every OUT requirement, partitions expanded."""
    req = {}
    for r in prog.outputs:
        x = frozenset(r.agg)
        sites = req.setdefault(x, [])
        for t in r.targets:
            for s in (membership[t] if isinstance(t, str) else (t,)):
                if s not in sites:
                    sites.append(s)
    return req


def naive_program(prog: ExProg, membership=None) -> ExProg:
    """The paper's baseline body (Section 5.4): every atom copy not at a site that needs it is
    sent there, one multicast action per atom copy, then each required aggregate of two or
    more atoms is aggregated locally at each of its sites (``X @ G`` for a partition). Returns
    the preamble with this body and every partition's members filled in (``membership``, or
    in order for partitions declared by size)."""
    check_preamble(prog)
    membership = merge_membership(prog, membership)
    return with_members(prog, membership, naive_actions(prog, membership))


def naive_actions(prog: ExProg, membership: dict) -> list:
    """The body of :func:`naive_program` for a checked preamble and a full membership."""
    req = required(prog, membership)
    need = {}  # atom -> sites needing it
    for x, sites in req.items():
        for a in x:
            lst = need.setdefault(a, [])
            lst.extend(s for s in sites if s not in lst)
    acts = []
    homes = {}  # atom -> every site holding a copy (replicated inputs hold several)
    for at in prog.inputs:
        homes.setdefault(at.name, set()).add(at.site)
    for at in prog.inputs:
        if at.site != min(homes[at.name]):
            continue  # one copy sends; the others already sit where they are
        dests = tuple(sorted(s for s in need.get(at.name, ()) if s not in homes[at.name]))
        if dests:
            acts.append(Action(frozenset([at.name]), at.site, (dests,)))
    done = set()
    for r in prog.outputs:
        x = frozenset(r.agg)
        if len(x) < 2:
            continue  # a single atom is materialised by its transfer, or is at home
        for t in r.targets:
            sites = membership[t] if isinstance(t, str) else (t,)
            if all((x, s) in done for s in sites):
                continue
            done.update((x, s) for s in sites)
            acts.append(Action(x, t))
    return acts
