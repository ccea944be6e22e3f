"""What the capacity program's fixed transfers cost (issue 36): the paper block on packed
batches, attention split by query sequence over p devices, its predicted exchange time as a
program per cut (each device gets its rows and the keys they attend to) and as the one
capacity program the GPU backends run (every device gets all of q, k and v; the output
leaves as p copies that a reduce-scatter sums).

    python benchmarks/bench_capacity.py [--batches 5] [--tokens 32768]

Batches come from bench_packed's log-normal stream, keeping those whose documents all fit a
device's share (bucket 0: the sequence family's; --bucket picks another, the family still
split by query sequence). Per batch: the per-cut program's total
predicted time and exchange time; the capacity program's estimated total (the per-cut
compute, which the capacity kernels do too, plus the capacity exchanges; its own predicted
compute counts every row of the capacity blocks, which the kernel skips, so it is not
used); and rebalance off's (this batch's compute at equal-token cuts plus the transfers of
the plan made from shapes, keys from 0). Prediction only: eins.cost.predict on dgx-h100:8.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from bench_packed import MAX_SEGMENTS, P, TOPOLOGY, args_for, stream
import eins
from eins.cost.predict import predict
from eins.models import llama
from eins.passes import PHYSICAL, PLANNING, run_passes
from eins.passes.capacity import capacity
from eins.passes.families import bucket
from eins.passes.rebalance import recut, runtime_operands, specialize
from eins.passes.verify import verify
from packed_models import equal_cuts

LOWER = tuple(p for p in PHYSICAL if p is not verify)


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


def run(tokens, n, which=0, cfg=llama.PAPER):
    batches = [b for b in stream(400 * n, tokens, 1536.0, 1.4, seed=tokens)
               if bucket(llama.padded_ends(b, MAX_SEGMENTS, tokens), P) == which][:n]
    low = eins.distribute(llama.packed_block_fn(cfg), devices=P, topology=TOPOLOGY).lower(
        *args_for(tokens, cfg, True))
    ops = runtime_operands(low.program)
    (att, (_, k)), = ops.items()
    arrays = [None] * len(low.program.inputs)
    arrays[k] = llama.padded_ends(batches[0], MAX_SEGMENTS, tokens)
    first = replace(low.compilation, program=specialize(low.program, arrays, ops), plan=None)
    fam = run_passes(replace(first, options=replace(first.options,
                                                    plan={att: {"sequence": P}})), PLANNING)
    cap = predict(run_passes(capacity(fam, ops).comp, LOWER))
    # rebalance off: the family planned from shapes (equal-token cuts, keys from 0: valid
    # for any ends), its transfers fixed
    off = predict(run_passes(replace(low.compilation, plan=None, options=replace(
        low.compilation.options, plan={att: {"sequence": P}})), PLANNING + LOWER))
    print(f"## 1x{tokens // 1024}K tokens, p={P} on {TOPOLOGY}, bucket {which}, attention split "
          f"{fam.plan.eqn_plans[att].splits}: capacity program exchanges "
          f"{cap['exchange_ms']:.3f} ms (attention's {cap['per_eqn'][att]['exchange_ms']:.3f}"
          f" ms in, the next eqn's {cap['per_eqn'][att + 1]['exchange_ms']:.3f} ms)")
    print(f"rebalance off (equal tokens, keys from 0): exchanges {off['exchange_ms']:.3f} ms")
    print(f"{'batch':>5} {'docs':>4} {'cut_total':>9} {'cut_exch':>8} {'cap_total':>9} "
          f"{'off_total':>9} {'cap/cut':>7} {'off/cut':>7}   (ms, predicted)")
    for b, ends in enumerate(batches):
        arrays[k] = llama.padded_ends(ends, MAX_SEGMENTS, tokens)
        cut = recut(fam, arrays, ops)
        per = predict(run_passes(cut, LOWER))
        est = per["total_ms"] - per["exchange_ms"] + cap["exchange_ms"]
        # off: this batch's compute at equal-token cuts, the shapes' plan's transfers
        eq = predict(run_passes(with_cuts(cut, att, equal_cuts(tokens, P)), LOWER))
        est_off = eq["total_ms"] - eq["exchange_ms"] + off["exchange_ms"]
        print(f"{b:5d} {len(ends):4d} {per['total_ms']:9.3f} {per['exchange_ms']:8.3f} "
              f"{est:9.3f} {est_off:9.3f} {est / per['total_ms']:7.2f} "
              f"{est_off / per['total_ms']:7.2f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768])
    ap.add_argument("--bucket", type=int, default=0,
                    help="the batches' bucket (eins/passes/families.py; default 0)")
    a = ap.parse_args(argv)
    if a.batches < 1:
        ap.error("--batches must be >= 1")
    for tokens in a.tokens:
        run(tokens, a.batches, a.bucket)


if __name__ == "__main__":
    main()
