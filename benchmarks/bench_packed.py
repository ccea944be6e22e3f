"""Packed batches whose boundaries change every step (issue 36): a stream of batches of
packed documents through the paper's block on dgx-h100:8, predicted per batch for five ways
of splitting attention, and the host time eins spends per batch.

    python benchmarks/bench_packed.py [--batches 200] [--tokens 32768 131072] [--oracle N]

Document lengths are log-normal, ``exp(N(mu, sigma))`` tokens, cut at the batch length; a
batch is documents packed end to end until the tokens are full (the last one cut to fit).
Parameters: median 1,536 tokens (mu = ln 1536) and sigma 1.4 (p90 ~9K, p99 ~40K tokens):
the shape reported for long-context SFT/pre-training mixes, whose lengths peak at 1-1.5K
tokens with a tail past 16K (Yao et al., "Hierarchical Balance Packing", arXiv 2503.07680,
Sec. 1 and Fig. 1; SlimPack, arXiv 2509.26246, Sec. 1). These two figures are chosen to
that description, not fitted to a released length table (none was at hand): change them
with --median and --sigma.

Per batch, each column is the predicted time of one block (eins.cost.predict: per eqn the
slowest device's kernel plus the simulated exchange programs feeding it):
- ``dynamic``: the plan family (planned once, the ends as data) re-cut for the batch
  (eins/passes/rebalance.py) and lowered;
- ``oracle``: the batch planned from scratch with its ends static (the DP on this batch);
  with ``--oracle N`` only every N-th batch (the DP is the slow part);
- ``equal``: the family with attention cut at equal tokens every batch (fixed cuts; the
  kernels still skip other documents' keys, as flash-attn's varlen does);
- ``zigzag``: fixed zig-zag context parallelism (device d holds chunks d and 2p-1-d of
  2p equal chunks, K/V passed around a ring, overlapped with compute): the equal-token
  plan's time with its attention replaced by the zig-zag attention's, each device's kernel
  time from the same kernel model on its two chunks, its ring traffic at the NVLink
  bandwidth; eins cannot run this split (one box per device), so it is modeled here;
- ``heads``: attention split by kv heads (Ulysses), planned per batch with that forced.
``host_ms``: rebalance plus lowering of the dynamic column, this CPU: what a compiled
program's call with new boundaries runs (``recut``, then, for boxes not among the last 16
seen, ``relower`` from the family's first lowering, unpriced), in this process's CPU time
(other load on the machine does not count); the families' first lowerings are in the
"planned in" time. A batch whose attention is split by heads keeps the family's boxes (the
kernels read the ends as data), so it is never lowered again.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import replace

import numpy as np

import eins
from eins.cost.predict import kernel_seconds, predict
from eins.models import llama
from eins.passes import PHYSICAL, PLANNING, run_passes
from eins.passes.families import bucket
from eins.passes.rebalance import recut, recut_key, runtime_operands, specialize
from eins.passes.relower import Family, relower
from eins.passes.verify import verify
from eins.stages import Compiled
from eins.tracing import ShapeDtype

TOPOLOGY = "dgx-h100:8"
P = 8
MAX_SEGMENTS = 512
LOWER = tuple(p for p in PHYSICAL if p is not verify)
RECUT_CACHE = Compiled.RECUT_CACHE   # device programs kept per distinct cut


def stream(n, tokens, median, sigma, seed=0):
    """``n`` batches of segment ends, documents from the log-normal packed to ``tokens``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ends, at = [], 0
        while at < tokens:
            length = int(min(max(1, round(rng.lognormal(math.log(median), sigma))), tokens))
            at = min(tokens, at + length)
            ends.append(at)
        if len(ends) > MAX_SEGMENTS:   # merge the smallest tail into the last document
            ends = ends[:MAX_SEGMENTS - 1] + [tokens]
        out.append(tuple(ends))
    return out


def args_for(tokens, cfg, with_ends):
    x, w, cs, sn = llama.Workload("packed", 1, tokens).args(cfg)
    return (x, w, cs, sn) + ((ShapeDtype((MAX_SEGMENTS,), "int32"),) if with_ends else ())


def lowered_time(comp):
    return predict(run_passes(comp, LOWER))


def attention_ms(pt, i):
    e = pt["per_eqn"][i]
    return e["compute_ms"] + e["exchange_ms"]


def with_cuts(comp, i, cuts):
    """``comp`` with eqn ``i``'s query split at ``cuts`` (its other splits kept)."""
    e = comp.program.eqns[i]
    ix = e.primitive.indexing([a.type for a in e.inputs], [v.type for v in e.outputs],
                              **e.params)
    ep = comp.plan.eqn_plans[i]
    iv = dict(ep.intervals, sequence=tuple(cuts))
    plans = list(comp.plan.eqn_plans)
    plans[i] = replace(ep, intervals=iv, spec=ix.spec(iv))
    return replace(comp, plan=replace(comp.plan, eqn_plans=tuple(plans)))


def equal_cuts(s, n):
    b = [s * k // n for k in range(n + 1)]
    return list(zip(b[:-1], b[1:]))


def zigzag_ms(comp, i, topo, s):
    """Zig-zag CP's attention: per device its two chunks' kernels (the kernel model on
    their boxes, keys from their segments' starts), the ring's K/V traffic overlapped."""
    e = comp.program.eqns[i]
    ix = e.primitive.indexing([a.type for a in e.inputs], [v.type for v in e.outputs],
                              **e.params)
    chunks = equal_cuts(s, 2 * P)
    per_dev = []
    for d in range(P):
        t = 0.0
        for c in (chunks[d], chunks[2 * P - 1 - d]):
            for f in ix.spec({"sequence": (c,)}).fspecs:
                t += kernel_seconds(e, f, topo)
        per_dev.append(t)
    k = e.inputs[1].type
    kv_bytes = 2 * k.nbytes * (P - 1) / P   # K and V, all but its own share
    ring = kv_bytes / topo.bandwidth(0, 1)
    return max(max(per_dev), ring) * 1e3


def run(tokens, n, median, sigma, oracle_every, cfg=llama.PAPER):
    batches = stream(n, tokens, median, sigma, seed=tokens)
    fam = eins.distribute(llama.packed_block_fn(cfg), devices=P, topology=TOPOLOGY)
    t0 = time.perf_counter()
    low = fam.lower(*args_for(tokens, cfg, True))
    ops = runtime_operands(low.program)
    (att, (_, k)), = ops.items()
    arrays = [None] * len(low.program.inputs)
    # the family: planned once, for the first batch's ends (the DP's choice of splits)
    arrays[k] = llama.padded_ends(batches[0], MAX_SEGMENTS, tokens)
    first = replace(low.compilation, program=specialize(low.program, arrays, ops), plan=None)
    family = run_passes(first, PLANNING)
    # the second family: attention split by query sequence (what the rebalance re-cuts)
    seqfam = run_passes(replace(first, options=replace(
        first.options, plan={att: {"sequence": P}})), PLANNING)
    # each family's first lowering, which every batch's re-lowering starts from
    lowered = {id(f): Family(f) for f in (family, seqfam)}
    programs = {}   # (family, recut_key) -> device program, as Compiled keeps them
    family_s = time.perf_counter() - t0
    topo = family.topology
    print(f"\n## 1x{tokens // 1024}K tokens, p={P} on {TOPOLOGY}: {n} batches, "
          f"documents log-normal median {median}, sigma {sigma}; family planned in "
          f"{family_s:.2f} s: attention split "
          f"{family.plan.eqn_plans[att].splits} (DP), {{'sequence': {P}}} (a batch whose "
          f"documents all fit {tokens // P} tokens)")
    print(f"{'batch':>5} {'docs':>4} {'longest':>7} {'dynamic':>8} {'oracle':>8} "
          f"{'equal':>8} {'zigzag':>8} {'heads':>8} {'host_ms':>7}   (ms; host_ms: CPU)")
    rows = []
    for b, ends in enumerate(batches):
        arrays[k] = llama.padded_ends(ends, MAX_SEGMENTS, tokens)
        t = time.process_time()
        longest = max(b - a for a, b in zip((0,) + ends, ends))
        # the batch's family by its bucket (the library's rule, eins/passes/families.py):
        # documents that fit a device's share go whole to the devices (the sequence
        # family); a longer one takes the DP's family
        chosen = seqfam if bucket(arrays[k], P) == 0 else family
        comp = recut(chosen, arrays, ops)
        key = (id(chosen), recut_key(comp, ops))
        new = key not in programs
        if new:   # what a Compiled call runs: a new cut is lowered once
            while len(programs) >= RECUT_CACHE:
                programs.pop(next(iter(programs)))
            programs[key] = relower(lowered[id(chosen)], comp, ops, priced=False).device
        programs[key] = programs.pop(key)   # most recent last
        host = (time.process_time() - t) * 1e3
        dyn = predict(relower(lowered[id(chosen)], comp, ops))   # priced, outside the timing
        comp = recut(seqfam, arrays, ops) if chosen is not seqfam else comp
        eq_pt = lowered_time(with_cuts(comp, att, equal_cuts(tokens, P)))
        zz = eq_pt["total_ms"] - attention_ms(eq_pt, att) + zigzag_ms(comp, att, topo,
                                                                        tokens)
        oracle = heads = None
        if b % oracle_every == 0:
            stat = eins.distribute(llama.block_fn(cfg, ends), devices=P, topology=TOPOLOGY)
            oracle = stat.lower(*args_for(tokens, cfg, False)).predicted_time()["total_ms"]
            hs = eins.distribute(llama.block_fn(cfg, ends), devices=P, topology=TOPOLOGY,
                                 plan={att: {"heads_kv": P}})
            heads = hs.lower(*args_for(tokens, cfg, False)).predicted_time()["total_ms"]
        row = dict(dynamic=dyn["total_ms"], oracle=oracle, equal=eq_pt["total_ms"],
                   zigzag=zz, heads=heads, host=host, lowered=new)
        rows.append(row)

        def f(v):
            return f"{v:8.3f}" if v is not None else f"{'-':>8}"
        print(f"{b:5d} {len(ends):4d} {longest:7d} {f(row['dynamic'])} {f(oracle)} "
              f"{f(row['equal'])} {f(zz)} {f(heads)} {host:7.2f}", flush=True)
    summary(rows)
    return rows


def summary(rows):
    tot = {c: sum(r[c] for r in rows) for c in ("dynamic", "equal", "zigzag")}
    with_oracle = [r for r in rows if r["oracle"] is not None]
    dyn_o = sum(r["dynamic"] for r in with_oracle)
    orc = sum(r["oracle"] for r in with_oracle)
    heads = sum(r["heads"] for r in with_oracle)
    hosts = sorted(r["host"] for r in rows[1:]) or [rows[0]["host"]]
    worse_eq = sum(r["dynamic"] > r["equal"] * 1.0001 for r in rows)
    worse_zz = sum(r["dynamic"] > r["zigzag"] * 1.0001 for r in rows)
    print(f"stream: dynamic {tot['dynamic']:.1f} ms; oracle (on {len(with_oracle)} batches) "
          f"{orc:.1f} ms vs dynamic {dyn_o:.1f} ms there ({dyn_o / orc - 1:+.1%}); "
          f"equal tokens {tot['equal'] / tot['dynamic']:.2f}x dynamic, zig-zag "
          f"{tot['zigzag'] / tot['dynamic']:.2f}x, heads {heads / dyn_o:.2f}x; batches where "
          f"dynamic is slower: {worse_eq} vs equal, {worse_zz} vs zig-zag")
    low = sorted(r["host"] for r in rows[1:] if r["lowered"])
    if low:
        print(f"batches lowered again (a new cut): {len(low)} of {len(rows) - 1}, host CPU "
              f"median {statistics.median(low):.2f} ms, max {low[-1]:.2f} ms")
    print(f"host CPU per batch (rebalance + lowering, after the first): median "
          f"{statistics.median(hosts):.2f} ms, p90 {hosts[int(0.9 * (len(hosts) - 1))]:.2f} ms, "
          f"max {hosts[-1]:.2f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--median", type=float, default=1536.0)
    ap.add_argument("--sigma", type=float, default=1.4)
    ap.add_argument("--oracle", type=int, default=1,
                    help="re-plan from scratch every N-th batch (default every batch)")
    a = ap.parse_args(argv)
    if a.batches < 1 or a.oracle < 1 or a.median <= 0 or a.sigma < 0:
        ap.error("--batches and --oracle must be >= 1, --median > 0, --sigma >= 0")
    for tokens in a.tokens:
        run(tokens, a.batches, a.median, a.sigma, a.oracle)


if __name__ == "__main__":
    main()
