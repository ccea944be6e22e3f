"""Packed batches whose boundaries change every step (issue 36): a stream of batches of
packed documents through the paper's block on dgx-h100:8, predicted per batch for eins and
for the ways of splitting attention users run, a lower bound on any plan, and the host time
eins spends per batch.

    python benchmarks/bench_packed.py [--batches 200] [--tokens 32768 131072] [--oracle N]
                                       [--families default|block] [--collections]

Document lengths are log-normal, ``exp(N(mu, sigma))`` tokens, cut at the batch length; a
batch is documents packed end to end until the tokens are full (the last one cut to fit).
Parameters fitted to a released length table of a public pre-training corpus: RefinedWeb
(Penedo et al., arXiv 2306.01116; Falcon's web-only pre-training data), as the "falcon"
source of a 20% sample of Dolma v1.7, whose per-source document-length percentiles
ModernBERT's authors published (github.com/AnswerDotAI/ModernBERT, src/data/
source_stats.jsonl, commit b115808, "Also get length of the data statistics", PR #53,
June 2024): median 288, p90 1,038, p99 3,925, mean 519, largest 119,988. The table counts
the pieces of a split at runs of non-word characters (about words, not a tokenizer's
tokens); they are taken one for one as tokens here, so the documents are somewhat shorter
in tokens than the corpus's.
The fit (``lognormal_fit``) keeps the median and the tail: mu = ln 288, sigma =
ln(3925 / 288) / z(0.99) = 1.123; it puts p90 at 1,214 (the table: 1,038) and the mean at
541 (519). For comparison, the same table's 17 sources weighted by their documents (the
whole Dolma sample, each source's percentiles interpolated in log length) give median 234
and p99 4,743 (sigma 1.29); its long documents, arXiv (median 7,383, p99 41,547: sigma
0.74) and books, are under 0.1% of its documents. The stream before this fit (median 1,536,
sigma 1.4, chosen to a description of long-context SFT mixes, not fitted) is
``--median 1536 --sigma 1.4``.

Per batch, each column is the time of one block in ms, predicted by eins.cost.predict and
timed GPU by GPU (``timeline_ms``: a clock per GPU, each GPU's kernels one after another,
an exchange holding only the GPUs it names, as the rank runtime runs a program) unless it
says otherwise; the summary also prints the eqn-by-eqn totals (``total_ms``: per eqn the
slowest device's kernel plus the exchanges feeding it, the paper's sum, what the DP
minimizes) of the columns priced both ways. benchmarks/packed_models.py holds the models
of the splits eins does not plan:
- ``dynamic``: eins, as a user's compiled program runs it: the block lowered once with
  the ends as data and compiled with ``families=True`` (eins/passes/families.py: on numpy
  three families planned from the shapes, the DP's free choice, attention split by query
  sequence over p devices at its equal-token cuts with the rest of the block fitted to
  them, and that family re-cut at whole-block cuts; ``--families block`` names the last,
  ``families="block"``, which on numpy keeps the same three). Per batch
  ``Compiled.prepare`` does what a call does before it runs: each family re-cut for the
  batch and the one of smallest estimated time GPU by GPU taken (the family's first
  lowering replayed GPU by GPU with its re-cut kernels priced again and an exchange for
  what its boxes read beyond it), then, for a cut not among the last 16, its program
  lowered (``relower_device``); the time is ``Compiled.predicted_time()``, that cut
  lowered and its exchanges simulated. The ``fam`` column says which family (d: the DP's, e: equal tokens, b:
  whole-block cuts);
- ``oracle``: the batch planned from scratch with its ends static (the DP on this batch);
  with ``--oracle N`` only every N-th batch;
- ``equal``: attention cut at p equal token ranges every batch, the rest of the block
  planned by the DP for those cuts (the family is planned on p equal documents, whose
  balanced cuts are the equal ones, so the token-wise eqns are cut where the attention is
  and nothing is repartitioned); the kernels skip other documents' keys (flash-attn's
  varlen) and a device receives only the keys its rows see;
- ``zigzag``: fixed zig-zag context parallelism as ring attention runs it (device d holds
  chunks d and 2p-1-d of 2p equal chunks; K/V around a ring in p-1 steps, each step's
  transfer overlapped with its compute, a step ending when its slowest device and its
  transfer have); the equal plan's time with its attention (kernels and exchanges)
  replaced by the ring's (that rest is taken eqn by eqn; its eqns are cut at equal
  tokens, balanced, so GPU by GPU it is the same). Modeled: eins cannot run several boxes
  per device;
- ``zz_doc``: per-document zig-zag (Transformer Engine's packed THD format, what a
  Megatron user runs on packed data): each document padded to a multiple of 2p and cut
  into 2p chunks, device d holding chunks d and 2p-1-d of every document, the same ring;
  the rest of the block scaled by the padded tokens. Modeled likewise;
- ``heads``: attention split by kv heads (Ulysses), the DP planning the rest with that
  forced, on the oracle's batches;
- ``blockcut``: the library's block family on every batch (eins/passes/blockcut.py: every
  token-wise eqn of the equal family re-cut at positions balancing each device's whole
  block, its tokens' matmuls and its rows' causal work), whether chosen or not;
- ``bound``: no plan can be faster (eins.cost.predict.lower_bound): each eqn's FLOPs and
  bytes split evenly over the p GPUs at the kernel model's rates, no communication.
The summary prints each column's stream total against ``bound`` and each baseline against
``dynamic``: over the stream, and the worst single batch. A baseline at ``x`` times the
bound cannot be beaten by more than ``x`` by any plan under this kernel model.
``host_ms``: ``Compiled.prepare`` on the batch's arguments (the library's per-call path
short of running the kernels: argument checks, the choice, the rebalance and, for boxes
not among the last 16 seen, ``relower_device`` from the family's first lowering), in
this process's CPU time (other load on the machine does not count); planning and first
lowering the families are in the "planned in" time. A batch whose attention is split by
heads keeps the family's boxes (the kernels read the ends as data), so it is lowered once.
``dynamic`` against ``oracle`` batch by batch bounds what a plan family per length bucket
could add (a bucket's family is the DP on one batch of it): the summary prints the worst.
``--pipeline``: every eins column (dynamic, oracle, heads, equal, blockcut) lowered with
``pipeline=True`` (eins/passes/pipeline.py: attention's keys from other devices received
under its pieces, one piece ahead, and timed so GPU by GPU), the modeled ring baselines
unchanged.
``--collections``: every garbage collection of Python's cyclic collector over each stream
(``gc.callbacks``), timed in CPU and counted by generation, inside ``prepare`` (in
``host_ms``) or outside it (the columns' pricing, this script's own), and the objects the
collector tracks at the end (what a full collection walks).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import time
from dataclasses import replace

import numpy as np

import eins
from eins.cost.predict import lower_bound, predict
from eins.models import llama
from eins.passes import PLANNING, run_passes
from eins.passes.families import FamilySet
from eins.passes.rebalance import recut, runtime_operands, specialize
from eins.passes.relower import Family, relower
from eins.tracing import ShapeDtype
from packed_models import equal_cuts, zigzag_doc_ms, zigzag_ms

TOPOLOGY = "dgx-h100:8"
P = 8
MAX_SEGMENTS = 512
# RefinedWeb's document lengths in ModernBERT's table (see the docstring), in words
REFINEDWEB = {"median": 288.0, "p90": 1038.0, "p99": 3925.0, "mean": 519.2669208187515}


def lognormal_fit(median, q, z):
    """(mu, sigma) of the log-normal whose median is ``median`` and whose quantile at the
    standard normal score ``z`` is ``q`` (the 99th percentile: z = 2.326)."""
    if not median > 0:
        raise ValueError(f"lognormal_fit: median must be > 0, got {median!r}")
    if not z > 0:
        raise ValueError(f"lognormal_fit: z must be > 0 (a quantile above the median), "
                         f"got {z!r}")
    if not q > median:
        raise ValueError(f"lognormal_fit: quantile {q!r} must exceed the median {median!r}")
    return math.log(median), math.log(q / median) / z


# the documents' log-normal: RefinedWeb's median and 99th percentile
MEDIAN = REFINEDWEB["median"]
SIGMA = lognormal_fit(MEDIAN, REFINEDWEB["p99"], statistics.NormalDist().inv_cdf(0.99))[1]


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


def attention_ms(pt, i):
    e = pt["per_eqn"][i]
    return e["compute_ms"] + e["exchange_ms"]


def equal_family(low, ops, tokens):
    """The equal-token family of the baselines: the DP on a program specialized for p equal
    documents with attention split by query sequence, so that its cuts are equal and the
    DP fits the rest of the block to them."""
    (att, (_, k)), = ops.items()
    arrays = [None] * len(low.program.inputs)
    arrays[k] = llama.padded_ends([b for _, b in equal_cuts(tokens, P)], MAX_SEGMENTS, tokens)
    first = replace(low.compilation, program=specialize(low.program, arrays, ops), plan=None)
    first = replace(first, options=replace(first.options, plan={att: {"sequence": P}}))
    equal = run_passes(first, PLANNING)
    assert equal.plan.eqn_plans[att].intervals["sequence"] == tuple(equal_cuts(tokens, P))
    return equal


class Collections:
    """Python's garbage collections while installed (``with``: a ``gc.callbacks`` entry),
    each timed in CPU ms under (whether ``inside`` was set, its generation)."""

    def __init__(self):
        self.inside = False
        self.log: dict = {}
        self._start = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.process_time()
        else:
            self.log.setdefault((self.inside, info["generation"]), []).append(
                (time.process_time() - self._start) * 1e3)

    def lines(self) -> list:
        out = []
        for inside in (True, False):
            for g in range(3):
                ms = self.log.get((inside, g))
                if ms:
                    out.append(f"  {'inside' if inside else 'outside'} prepare, generation "
                               f"{g}: {len(ms)} collections, {sum(ms):.1f} ms, longest "
                               f"{max(ms):.2f} ms")
        return out


def run(tokens, n, median, sigma, oracle_every, cfg=llama.PAPER, families=True, probe=None,
        pipeline=False):
    batches = stream(n, tokens, median, sigma, seed=tokens)
    fam = eins.distribute(llama.packed_block_fn(cfg), devices=P, topology=TOPOLOGY,
                          pipeline=pipeline)
    t0 = time.process_time()
    shapes = args_for(tokens, cfg, True)
    low = fam.lower(*shapes)
    ops = runtime_operands(low.program)
    (att, _), = ops.items()
    compiled = low.compile("numpy", families=families)   # what eins dynamic runs
    family_s = time.process_time() - t0
    names = list(compiled.families)
    eqfam = equal_family(low, ops, tokens)   # the baselines' equal cuts
    eq_lowered = Family(eqfam)
    # the library's block family, as compiled keeps it (a second copy, for its column)
    block = next(m for m in FamilySet(low.compilation, ops, block=True).members
                 if m.name == "block")
    topo = eqfam.topology
    splits = ", ".join(f"{n} {compiled.families[n].eqn_plans[att].splits}" for n in names)
    print(f"\n## 1x{tokens // 1024}K tokens, p={P} on {TOPOLOGY}: {n} batches, "
          f"documents log-normal median {median:g}, sigma {sigma:.4g}; traced, planned and "
          f"compiled with families={families!r}, pipeline={pipeline} in {family_s:.2f} s "
          f"CPU: attention split "
          f"{splits}; "
          f"each batch takes the one estimated fastest GPU by GPU")
    print(f"{'batch':>5} {'docs':>4} {'longest':>7} {'fam':>3} "
          + " ".join(f"{c:>8}" for c in COLUMNS) + f" {'host_ms':>7}   (ms GPU by GPU; "
          f"host_ms: CPU)")
    rows = []
    for b, ends in enumerate(batches):
        batch = shapes[:-1] + (llama.padded_ends(ends, MAX_SEGMENTS, tokens),)
        if probe is not None:
            probe.inside = True
        t = time.process_time()
        choice = compiled.prepare(*batch)   # the library's per-call path, short of running
        host = (time.process_time() - t) * 1e3
        if probe is not None:
            probe.inside = False
        # priced, outside the timing
        row = dict(host=host, lowered=choice.lowered, family=choice.family)
        timed(row, "dynamic", compiled.predicted_time())
        arrays = [None] * len(low.program.inputs)
        for _, k in ops.values():
            arrays[k] = batch[-1]
        eq = recut(eqfam, arrays, ops, balance=False)   # the equal cuts, this batch's keys
        eq_pt = timed(row, "equal", predict(relower(eq_lowered, eq, ops)))
        rest = eq_pt["total_ms"] - attention_ms(eq_pt, att)   # all but the attention
        e = eq.program.eqns[att]   # this batch's attention, its ends static
        zz_doc, padded = zigzag_doc_ms(e, topo, ends, P)
        row.update(zigzag=rest + zigzag_ms(e, topo, tokens, P),
                   zz_doc=rest * padded / tokens + zz_doc, bound=lower_bound(eq),
                   oracle=None, heads=None)
        timed(row, "blockcut", predict(block.lowered(block.choice.recut(arrays, ops))))
        if b % oracle_every == 0:
            stat = eins.distribute(llama.block_fn(cfg, ends), devices=P, topology=TOPOLOGY,
                                   pipeline=pipeline)
            timed(row, "oracle", stat.lower(*args_for(tokens, cfg, False)).predicted_time())
            hs = eins.distribute(llama.block_fn(cfg, ends), devices=P, topology=TOPOLOGY,
                                 plan={att: {"heads_kv": P}}, pipeline=pipeline)
            timed(row, "heads", hs.lower(*args_for(tokens, cfg, False)).predicted_time())
        rows.append(row)

        def f(v):
            return f"{v:8.3f}" if v is not None else f"{'-':>8}"
        longest = max(y - x for x, y in zip((0,) + ends, ends))
        print(f"{b:5d} {len(ends):4d} {longest:7d} {choice.family[0]:>3} "
              + " ".join(f(row[c]) for c in COLUMNS) + f" {host:7.2f}", flush=True)
    summary(rows, names)
    if probe is not None:
        print(f"garbage collections over the stream (CPU ms), {len(gc.get_objects())} "
              f"objects tracked at its end:")
        print("\n".join(probe.lines()))
    return rows


COLUMNS = ("dynamic", "oracle", "equal", "zigzag", "zz_doc", "heads", "blockcut", "bound")
EQN_BY_EQN = ("dynamic", "oracle", "equal", "heads", "blockcut")   # also priced so


def timed(row, column, pt):
    """Record a predicted time (eins.cost.predict.predict) in ``row``: GPU by GPU under
    ``column``, eqn by eqn (the paper's sum, what the DP minimizes) under column + "_eqn"."""
    row[column], row[column + "_eqn"] = pt["timeline_ms"], pt["total_ms"]
    return pt


def summary(rows, names):
    full = ("dynamic", "equal", "zigzag", "zz_doc", "blockcut", "bound")
    tot = {c: sum(r[c] for r in rows) for c in full}
    print(f"stream totals over {len(rows)} batches (ms, GPU by GPU): "
          + ", ".join(f"{c} {tot[c]:.1f} ({tot[c] / tot['bound']:.3f}x bound)" for c in full))
    sub = [r for r in rows if r["oracle"] is not None]
    eqn = {c: sum(r[c + "_eqn"] for r in (sub if c in ("oracle", "heads") else rows))
           for c in EQN_BY_EQN}
    print(f"eqn by eqn (the paper's sum): dynamic {eqn['dynamic']:.1f}, equal "
          f"{eqn['equal']:.1f}, blockcut {eqn['blockcut']:.1f}; on the {len(sub)} oracle "
          f"batches oracle {eqn['oracle']:.1f}, heads {eqn['heads']:.1f}")
    part = {c: sum(r[c] for r in sub) for c in ("dynamic", "oracle", "heads", "bound")}
    print(f"on the {len(sub)} batches with the oracle and heads: dynamic {part['dynamic']:.1f}"
          f", oracle {part['oracle']:.1f} (dynamic {part['dynamic'] / part['oracle'] - 1:+.2%}"
          f"), heads {part['heads']:.1f} ({part['heads'] / part['dynamic']:.3f}x dynamic), "
          f"bound {part['bound']:.1f}; oracle {part['oracle'] / part['bound']:.3f}x bound")
    for c in ("equal", "zigzag", "zz_doc", "heads", "blockcut"):
        rs = [r for r in rows if r[c] is not None]
        ratio = [r[c] / r["dynamic"] for r in rs]
        worst = min(range(len(rs)), key=ratio.__getitem__)
        slower = sum(x < 1 / 1.0001 for x in ratio)
        reach = sum(r[c] for r in rs) / sum(r["bound"] for r in rs)
        print(f"  {c:>6}: {sum(r[c] for r in rs) / sum(r['dynamic'] for r in rs):.3f}x "
              f"dynamic over the stream (no plan beats it by more than {reach:.3f}x: {c} / "
              f"bound); "
              f"worst batch {ratio[worst]:.3f}x (dynamic slower on {slower} of {len(rs)})")
    worst = max(sub, key=lambda r: r["dynamic"] / r["oracle"])
    print(f"  worst batch against the oracle: dynamic {worst['dynamic'] / worst['oracle']:.4f}x"
          f" (faster than the oracle on {sum(r['dynamic'] < r['oracle'] for r in sub)} of "
          f"{len(sub)})")
    print("families chosen: " + ", ".join(
        f"{n} {sum(r['family'] == n for r in rows)}" for n in names))
    low = sorted(r["host"] for r in rows[1:] if r["lowered"])
    if low:
        print(f"batches lowered again (a new cut): {len(low)} of {len(rows) - 1}, host CPU "
              f"median {statistics.median(low):.2f} ms, max {low[-1]:.2f} ms")
    hosts = sorted(r["host"] for r in rows[1:]) or [rows[0]["host"]]
    print(f"host CPU per batch (choice, rebalance and lowering, after the first): median "
          f"{statistics.median(hosts):.2f} ms, p90 {hosts[int(0.9 * (len(hosts) - 1))]:.2f} ms, "
          f"max {hosts[-1]:.2f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--median", type=float, default=MEDIAN)
    ap.add_argument("--sigma", type=float, default=SIGMA)
    ap.add_argument("--oracle", type=int, default=1,
                    help="re-plan from scratch every N-th batch (default every batch)")
    ap.add_argument("--families", choices=("default", "block"), default="default",
                    help="dynamic's families: the default (families=True) or the whole-block "
                         "family by name (families='block'); on numpy both keep the same three")
    ap.add_argument("--pipeline", action="store_true",
                    help="pipeline=True: attention's keys received under its pieces "
                         "(eins/passes/pipeline.py), for dynamic, oracle, heads, equal and "
                         "blockcut alike")
    ap.add_argument("--collections", action="store_true",
                    help="time every garbage collection, inside prepare or outside it")
    a = ap.parse_args(argv)
    if a.batches < 1 or a.oracle < 1 or a.median <= 0 or a.sigma < 0:
        ap.error("--batches and --oracle must be >= 1, --median > 0, --sigma >= 0")
    for tokens in a.tokens:
        probe = Collections() if a.collections else None
        with probe or contextlib.nullcontext():
            run(tokens, a.batches, a.median, a.sigma, a.oracle,
                families="block" if a.families == "block" else True, probe=probe,
                pipeline=a.pipeline)


if __name__ == "__main__":
    main()
