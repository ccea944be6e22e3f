"""Synthesizing exchange-program bodies (paper Section 5.4), one job per module:

- :mod:`.preamble`: the checks a preamble must pass, membership, and :func:`naive_program`,
  the paper's baseline (every atom copy multicast to the sites that need it, then aggregated
  locally there);
- :mod:`.patterns`: per required aggregate, the communication patterns (gather, reduce then
  broadcast, recursive doubling, rings, hierarchical) as frozen pattern keys;
- :mod:`.search`: the local search over memberships, pattern keys and relays, and the
  paper's action-level rewrites;
- :mod:`.bound`: a lower bound on every body's simulated time (the bytes each site must
  receive and send over its best rates), at which a search stops: no body is faster;
- :mod:`.caches`: process-wide caches (topology summaries, results per preamble shape);
- :mod:`.program`: :func:`synthesize_program`, the search for the least simulated time
  (:func:`eins.hardware.simulate.simulate`) under a budget of modeled simulation time or of steps (no clock is read), never slower
  than naive;
- :mod:`.schedule`: the compiler pass :func:`synthesize`, a body for every exchange the
  overlay pass built (a new ExchangeIR; overlay's is left as it is);
- :mod:`.hierarchy`: on multi-node clusters, a candidate body built from node-local parts
  searched once per class of equal nodes and a cross-node part, kept where it is faster;
- :mod:`.replicas`: preambles that place one atom at several sites (replicated inputs),
  synthesized through preambles that keep one copy of each.

The topology summary the patterns read is :class:`eins.hardware.net.Net`.
"""
from __future__ import annotations

from eins.hardware.net import resolve_topology
from eins.passes.synthesize.patterns import FAMILIES
from eins.passes.synthesize.preamble import naive_program
from eins.passes.synthesize.program import SynthResult, synthesize_program
from eins.passes.synthesize.schedule import schedule_exchanges, synthesize, synthesize_exchanges

__all__ = ["FAMILIES", "SynthResult", "naive_program", "resolve_topology", "schedule_exchanges",
           "synthesize", "synthesize_exchanges", "synthesize_program"]
