"""Synthesis for preambles whose IN places one atom at several sites (replicated inputs).

Definition 5.5 builds the initial state as the set ``{({A}, s) : A @ s ∈ IN}``, so ``IN: A @
0; A @ 1`` is two copies of one value, and ``eins exprog check`` and ``simulate`` accept it.
The synthesizer's search gives every atom one home, so a replicated preamble is synthesized
through reduced preambles that keep one copy of each atom: a body valid for a reduced
preamble is valid for the full one (its initial state contains the reduced one, and the
closure of Definition 5.5 only grows with the initial state). Every choice of copies is
tried when there are at most :data:`MAX_CHOICES`, otherwise that many rotations (choice
``i`` takes copy ``i mod k`` of an atom with ``k`` copies); every body found, and the full
preamble's naive program, is simulated under the full preamble, and the fastest is returned
under it, every copy declared (:func:`merge_replicated`).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace

from eins.hardware.simulate import simulate_built
from eins.passes.synthesize.preamble import (in_order_membership, naive_program, sent_bytes,
                                             tie_key)

# Reduced preambles searched per replicated preamble, each for an equal share of the budget:
# 8 covers every choice for up to three atoms held twice, and keeps each share large enough
# for the search to get past its seed families.
MAX_CHOICES = 8


def replicated(prog) -> bool:
    """Whether some atom of ``prog``'s IN is placed at more than one site."""
    names = [a.name for a in prog.inputs]
    return len(set(names)) != len(names)


def reduced_preambles(prog) -> list:
    """Preambles with one copy of each atom (see the module docstring), IN order kept."""
    copies: dict[str, list] = {}
    for a in prog.inputs:
        copies.setdefault(a.name, []).append(a)
    names = list(copies)
    total = math.prod(len(c) for c in copies.values())
    if total <= MAX_CHOICES:
        picks = list(itertools.product(*(range(len(copies[n])) for n in names)))
    else:
        picks = [tuple(i % len(copies[n]) for n in names) for i in range(MAX_CHOICES)]
    return [replace(prog, inputs=tuple(copies[n][i] for n, i in zip(names, pick)))
            for pick in picks]


def merge_replicated(prog, results, topo):
    """The fastest of ``results`` (one per :func:`reduced_preambles` preamble, each searched
    for an equal share of the budget) and the full preamble's own naive program, every body
    simulated again under the full preamble ``prog`` on ``topo``. A reduced preamble's
    times are not the full one's: its body may move a copy the full preamble already holds
    where it is needed (``B @ 1 -> 0`` with ``B @ 0`` declared), which the full naive program
    never does, and copies in place change when aggregations can start. So ``total_s`` and
    ``naive_s`` are the full preamble's simulated times, and the result is never slower than
    its naive program."""
    m0 = in_order_membership(prog)
    naive = naive_program(prog, m0)
    naive_s = simulate_built(naive, topo, m0).total_s
    # on a tie (tie_key) the body sending fewer bytes, then a synthesized one (rank 0)
    best = (naive_s, (tie_key(naive_s), sent_bytes(prog, naive.actions, m0), 1), naive, m0)
    for r in results:
        cand = replace(r.program, inputs=prog.inputs)
        t = simulate_built(cand, topo, r.membership).total_s
        key = (tie_key(t), sent_bytes(prog, cand.actions, r.membership), 0)
        if t <= naive_s and key < best[1]:   # never slower than naive, even by an ulp
            best = (t, key, cand, r.membership)
    t, _, program, membership = best
    return replace(results[0], program=program, total_s=t, naive_s=naive_s,
                   membership=dict(membership), evaluated=sum(r.evaluated for r in results),
                   elapsed_s=sum(r.elapsed_s for r in results),
                   work_s=sum(r.work_s for r in results),
                   searched=any(r.searched for r in results))
