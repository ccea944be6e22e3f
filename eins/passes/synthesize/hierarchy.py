"""Hierarchical synthesis on ``KxG`` rail clusters (issue 38): a candidate body for the
whole-cluster search, built from per-node and cross-node searches.

Under a fixed membership a preamble's requirements split, per (aggregate, target site), into
its *node-local* part (every atom of the aggregate sits in the target's node) and its
*cross-node* part (the rest):

- the node-local part of each node is a preamble on that node's G GPUs. Nodes whose parts
  are equal once a GPU is named by its position inside its node (and atoms renamed in IN
  order, :func:`~eins.passes.synthesize.caches.canonical`) form a class; each class is
  searched once, on the cluster's server topology (``topo.node``: G GPUs, cheap to
  simulate), and its body renamed onto every node of the class: the reuse of intra-node
  programs that every node shares;
- the cross-node part is one preamble on all the sites, searched on the cluster by the
  seeds of the hierarchical family, the rail-aware ones (:class:`~eins.passes.synthesize.
  patterns.Rail`) first, without a climb.

A cluster's GPU k of node n is GPU ``n * G + k`` (:meth:`eins.hardware.topology.Topology.
multi_node`), which the renaming relies on.

The closure is monotone in the program (proof of Theorem 5.6), so the union of the parts'
valid bodies is a valid body of the whole preamble; the caller simulates it once and keeps it
only where it is faster (:func:`eins.passes.synthesize.program._search`), so it can never
make a body slower. The sub-searches run without this candidate (``hierarchical`` off), so
it does not recurse.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from eins.ir.exprog import Action, AtomDecl, ExProg, Requirement
from eins.passes.synthesize.caches import canonical
from eins.passes.synthesize.patterns import normalise
from eins.passes.synthesize.preamble import required

__all__ = ["HierBody", "applies", "split", "hierarchical_body", "node_searches"]

# Class searches run in this process (node-local preambles searched on one node): a test
# reads it to see that a class of equal nodes is searched once.
_COUNT = {"node_searches": 0}


def node_searches() -> int:
    """How many node-local class searches :func:`hierarchical_body` has run in this
    process (one per class of equal nodes, per call)."""
    return _COUNT["node_searches"]


@dataclass(frozen=True)
class HierBody:
    """The union body (``actions``), the node count of each node-local class
    (``classes``: one entry per class searched) and how many (aggregate, site) pairs
    went to the cross-node search (``cross``, 0: none)."""

    actions: tuple
    classes: tuple
    cross: int


def applies(prog: ExProg, topo) -> bool:
    """Whether ``prog`` spans two or more nodes of a multi-node cluster."""
    if topo.kind != "multinode" or topo.node is None:
        return False
    return len({topo.node_of(g) for g in prog.gpus}) > 1


def split(prog: ExProg, topo, membership: dict):
    """The node-local and cross-node parts of ``prog`` under ``membership``: per node, the
    ordered dict aggregate -> target sites whose atoms all sit in that node, and the
    ordered dict aggregate -> target sites of the rest."""
    home = {a.name: a.site for a in prog.inputs}
    node_of = topo.node_of
    local, cross = {}, {}
    for x, sites in required(prog, membership).items():
        nodes = {node_of(home[a]) for a in x}
        here = next(iter(nodes)) if len(nodes) == 1 else None
        for s in sites:
            if node_of(s) == here:
                local.setdefault(here, {}).setdefault(x, []).append(s)
            else:
                cross.setdefault(x, []).append(s)
    return local, cross


def _sub_preamble(prog: ExProg, gpus, reqs: dict, site) -> ExProg:
    """The preamble on ``gpus`` requiring ``reqs`` (aggregate -> sites), its atoms those
    of ``prog`` they use, in ``prog``'s IN order; every site mapped by ``site``."""
    used = {a for x in reqs for a in x}
    inputs = tuple(AtomDecl(a.name, site(a.site), a.size) for a in prog.inputs
                   if a.name in used)
    outputs = tuple(Requirement(x, tuple(site(s) for s in sites)) for x, sites in reqs.items())
    return ExProg(tuple(gpus), (), inputs, outputs)


def _rename_body(acts, atoms: dict, site):
    """Body ``acts`` with atoms renamed by ``atoms`` and int sites mapped by ``site``."""
    return [Action(frozenset(atoms[n] for n in a.agg), site(a.source),
                   tuple(tuple(site(d) for d in hop) for hop in a.hops)) for a in acts]


def hierarchical_body(prog: ExProg, topo, membership: dict, synth, tuning) -> HierBody | None:
    """The hierarchical candidate body of ``prog`` on multi-node ``topo`` under
    ``membership`` (see the module docstring), or None where it does not apply (one node,
    or no node-local requirement: the cross-node search would be the whole search).
    ``synth(preamble, topology, tuning, families)`` searches one sub-preamble (of the
    pattern ``families`` if not None) and returns its
    :class:`~eins.passes.synthesize.program.SynthResult`; it gets ``tuning`` with
    ``hierarchical`` off."""
    if not applies(prog, topo):
        return None
    local, cross = split(prog, topo, membership)
    if not local:
        return None
    sub = replace(tuning, hierarchical=False)
    # the cross-node search tries its seeds, the rail ones first, within the budget, and
    # does not climb: on the 8x8 and 16x8 blocks every win over the whole-cluster search
    # came from a rail seed, and a climb on a cluster-wide preamble cost as much as the
    # whole search again (docs/measured.md)
    cross_tuning = replace(sub, rail_patterns=True, patience=0)
    server = topo.node
    g = len(server.gpus)
    classes = {}   # canonical node-local preamble -> [(node, its atom renaming)]
    for n, reqs in local.items():
        # the node's own sites of the preamble (a preamble may use part of a node)
        gpus = [server.gpus[s - n * g] for s in prog.gpus if topo.node_of(s) == n]
        pre = _sub_preamble(prog, gpus, reqs, lambda s: server.gpus[s - n * g])
        canon, ren = canonical(pre)
        classes.setdefault(canon, []).append((n, ren))
    acts = []
    pos = {gpu: k for k, gpu in enumerate(server.gpus)}
    for canon, members in classes.items():
        _COUNT["node_searches"] += 1
        body = synth(canon, server, sub, None).program.actions
        for n, ren in members:
            back = {v: k for k, v in ren.items()}
            acts += _rename_body(body, back,
                                 lambda s, n=n: n * g + pos[s] if isinstance(s, int) else s)
    if cross:
        pre = _sub_preamble(prog, prog.gpus, cross, lambda s: s)
        acts += synth(pre, topo, cross_tuning, ("hier",)).program.actions
    return HierBody(tuple(normalise(acts)), tuple(len(m) for m in classes.values()),
                    sum(len(s) for s in cross.values()))
