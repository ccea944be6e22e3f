"""Process-wide caches of the synthesizer. The compiler asks for many preambles that differ
only in atom names (one per exchange of a layer), so whole results are cached per preamble
*shape*: atoms renamed ``a0, a1, ...`` in IN order. Topology summaries are cached per
topology object (weakly, so a dropped topology frees its entries).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import replace

from eins.hardware.net import Net
from eins.ir.exprog import Action, AtomDecl, ExProg, Requirement
from eins.passes.synthesize.bound import names_free, time_floor

__all__ = ["net_for", "topo_key", "canonical", "rename_prog", "RESULTS", "RESULTS_MAX",
           "cached_result", "store_result", "cached_named", "store_named", "cached_floor",
           "named_key", "Hashed", "prog_key"]

# Results kept (least recently used dropped): a Llama layer has a few dozen exchange shapes,
# each kept per shape and as named (cached_named), so 1024 holds several models' worth.
RESULTS_MAX = 1024

_NETS = weakref.WeakKeyDictionary()
_TOPO_KEYS = weakref.WeakKeyDictionary()
RESULTS: OrderedDict = OrderedDict()
# id(preamble) -> (it, its Hashed): see prog_key
_PROG_KEYS: OrderedDict = OrderedDict()


def net_for(topo, sites) -> Net:
    """:class:`~eins.hardware.net.Net` of ``topo`` over ``sites``, built once per topology
    object."""
    per = _NETS.setdefault(topo, {})
    key = tuple(sites)
    if key not in per:
        per[key] = Net(topo, key)
    return per[key]


def topo_key(topo):
    """A hashable value equal for topologies the simulator cannot tell apart, hashed once
    (:class:`Hashed`): 64 GPUs have 4,032 routes, and every cache key holds it."""
    k = _TOPO_KEYS.get(topo)
    if k is None:
        k = Hashed((topo.name, topo.gpus, topo.hbm_bw, tuple(sorted(topo.capacity.items())),
                    tuple(sorted(topo.routes.items())), tuple(sorted(topo.latency.items()))))
        _TOPO_KEYS[topo] = k
    return k


def canonical(prog: ExProg):
    """The preamble (body dropped) with atoms renamed ``a0, a1, ...`` in IN order, and the
    renaming."""
    ren = {a.name: f"a{i}" for i, a in enumerate(prog.inputs)}
    return rename_prog(replace(prog, actions=()), ren), ren


def rename_prog(prog: ExProg, ren: dict) -> ExProg:
    """``prog`` with atom names mapped by ``ren`` (names absent from it are kept)."""
    def r(x):
        return frozenset(ren.get(n, n) for n in x)

    return ExProg(prog.gpus, prog.partitions,
                  tuple(AtomDecl(ren.get(a.name, a.name), a.site, a.size) for a in prog.inputs),
                  tuple(Requirement(r(q.agg), q.targets) for q in prog.outputs),
                  tuple(Action(r(a.agg), a.source, a.hops) for a in prog.actions))


def cached_result(key):
    """The stored result for ``key`` (marked recently used), or None."""
    hit = RESULTS.get(key)
    if hit is not None:
        RESULTS.move_to_end(key)
    return hit


def store_result(key, result) -> None:
    RESULTS[key] = result
    while len(RESULTS) > RESULTS_MAX:
        RESULTS.popitem(last=False)


class Hashed:
    """A key hashed once: a preamble of thousands of atoms costs milliseconds to hash, and
    a lookup, its move to the end and a store would each hash it again."""

    __slots__ = ("key", "hash")

    def __init__(self, key):
        self.key, self.hash = key, hash(key)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return (isinstance(other, Hashed) and self.hash == other.hash
                and self.key == other.key)


def prog_key(prog) -> Hashed:
    """``Hashed(prog)``, built once per preamble object: the overlay pass hands every layer
    of a stack the same preamble object (eins.passes.overlay) and the synthesize walks look
    each one up several times, while hashing one of 64 GPUs walks thousands of atoms. Equal
    preambles that are distinct objects get equal keys (compared in full)."""
    hit = _PROG_KEYS.get(id(prog))
    if hit is not None and hit[0] is prog:   # held here, so its id is not reused
        return hit[1]
    k = Hashed(prog)
    _PROG_KEYS[id(prog)] = (prog, k)
    while len(_PROG_KEYS) > RESULTS_MAX:
        _PROG_KEYS.popitem(last=False)
    return k


def named_key(key) -> Hashed:
    """The RESULTS key of a preamble as named (``key`` holds it, not its shape)."""
    return Hashed(("named",) + key)


def cached_named(key: Hashed):
    """The stored result for a preamble as named (``key`` from :func:`named_key`), or None:
    the layers of a stack ask for equal preambles. Kept in RESULTS (cleared with it)."""
    return cached_result(key)


def store_named(key: Hashed, result) -> None:
    store_result(key, result)


def cached_floor(prog: ExProg, topo, named: ExProg | None = None) -> float:
    """:func:`~eins.passes.synthesize.bound.time_floor` of ``prog`` on ``topo`` (every
    membership), computed once per preamble as named (kept in RESULTS): the layers of a
    stack ask for equal ones. ``named``: the preamble ``prog`` is the canonical form of
    (:func:`canonical`); where the floor does not depend on atom names
    (:func:`~eins.passes.synthesize.bound.names_free`), either one's floor is both's, so
    the search of a canonical preamble and the floor of the exchange it came from are
    computed once."""
    key = Hashed(("floor", topo_key(topo), prog_key(prog)))
    hit = cached_result(key)
    alias = None
    if named is not None and named is not prog and names_free(prog):
        alias = Hashed(("floor", topo_key(topo), prog_key(named)))
        if hit is None:
            hit = cached_result(alias)
    if hit is None:
        hit = time_floor(prog, topo)
    store_result(key, hit)
    if alias is not None:
        store_result(alias, hit)
    return hit
