"""What the capacity program's transfers cost (issue 36): the paper block on packed batches,
attention split by query sequence over p devices, its predicted time as a program per cut
(each device gets its rows and the keys they attend to) and as the one capacity program
the GPU backends run, without and with windowed transfers.

    python benchmarks/bench_capacity.py [--batches 5] [--tokens 32768] [--bucket 0]
                                        [--schedule naive] [--topology dgx-h100:8]

Batches come from bench_packed's log-normal stream with its long-context parameters
(median 1,536, sigma 1.4: long documents fill every bucket), keeping those of one bucket (the
sequence family's: bucket 0, every document fits a device's share; --bucket picks another,
the family still split by query sequence). Per batch, predicted on dgx-h100:8 (eins.cost;
--topology names another) with the naive schedule (--schedule optimized: synthesized
exchanges, the capacity program's synthesized once for its capacity blocks, each per-cut
program's for its own cut):

- ``cut``: the batch re-cut and lowered for its own boxes, total and exchange ms;
- ``cap``: the capacity program without windows (every device gets all of q, k and v, the
  output leaves as p copies a reduce-scatter sums): the per-cut compute (which its kernels
  do too; its own predicted compute counts every row of its capacity blocks, which the
  kernel skips) plus its fixed exchanges;
- ``win``: the capacity program with windowed sends (eins/passes/windows.py): its sends
  move the bytes of the batch's cut (``win_MB``, from the program and the batch's table,
  against ``cut_MB``, the per-cut program's sends; ``pairs`` "=": the same bytes between
  every two devices), so its exchanges are the per-cut program's, plus what capacity costs (``capacity_seconds``: a masked copy launched over
  each capacity buffer, the ⊕-sum of the output copies). Under the optimized schedule on a
  topology with relays (dgx-v100-paper) the capacity program's routes are not the per-cut
  program's (``pairs`` "!="): ``win_total`` then still prices the per-cut program's
  exchanges, an approximation whose bytes differ by ``win_MB`` / ``cut_MB``;
- ``off``: rebalance off (this batch's compute at equal-token cuts plus the transfers of the
  plan made from shapes, keys from 0).
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
from eins.passes.windows import capacity_seconds, window_bytes, windows
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


def run(tokens, n, which=0, cfg=llama.PAPER, schedule="naive", topology=TOPOLOGY):
    batches = [b for b in stream(400 * n, tokens, 1536.0, 1.4, seed=tokens)
               if bucket(llama.padded_ends(b, MAX_SEGMENTS, tokens), P) == which][:n]
    low = eins.distribute(llama.packed_block_fn(cfg), devices=P, topology=topology,
                          schedule=schedule).lower(*args_for(tokens, cfg, True))
    ops = runtime_operands(low.program)
    (att, (_, k)), = ops.items()
    arrays = [None] * len(low.program.inputs)
    arrays[k] = llama.padded_ends(batches[0], MAX_SEGMENTS, tokens)
    first = replace(low.compilation, program=specialize(low.program, arrays, ops), plan=None)
    fam = run_passes(replace(first, options=replace(first.options,
                                                    plan={att: {"sequence": P}})), PLANNING)
    form = capacity(fam, ops)
    lowered = run_passes(form.comp, LOWER)
    cap = predict(lowered)
    win = windows(lowered.device, form)
    topo = form.comp.topology
    # rebalance off: the family planned from shapes (equal-token cuts, keys from 0: valid
    # for any ends), its transfers fixed
    off = predict(run_passes(replace(low.compilation, plan=None, options=replace(
        low.compilation.options, plan={att: {"sequence": P}})), PLANNING + LOWER))
    print(f"## 1x{tokens // 1024}K tokens, p={P} on {topology}, {schedule} schedule, bucket "
          f"{which}, attention split "
          f"{fam.plan.eqn_plans[att].splits}: capacity program exchanges "
          f"{cap['exchange_ms']:.3f} ms (attention's {cap['per_eqn'][att]['exchange_ms']:.3f}"
          f" ms in, the next eqn's {cap['per_eqn'][att + 1]['exchange_ms']:.3f} ms)")
    print(f"rebalance off (equal tokens, keys from 0): exchanges {off['exchange_ms']:.3f} ms")
    print(f"{'batch':>5} {'docs':>4} {'cut_total':>9} {'cut_exch':>8} {'cap_total':>9} "
          f"{'win_total':>9} {'off_total':>9} {'cap/cut':>7} {'win/cut':>7} {'off/cut':>7} "
          f"{'win_MB':>7} {'cut_MB':>7} {'pairs':>5}   (ms, predicted)")
    for b, ends in enumerate(batches):
        arrays[k] = llama.padded_ends(ends, MAX_SEGMENTS, tokens)
        cut = recut(fam, arrays, ops)
        lowered_cut = run_passes(cut, LOWER)
        per = predict(lowered_cut)
        est = per["total_ms"] - per["exchange_ms"] + cap["exchange_ms"]
        calls = arrays + form.tables(cut)
        est_win = per["total_ms"] + capacity_seconds(win, calls, topo) * 1e3
        # bytes per (source, destination) pair; an empty window moves none
        moved = {p: n for p, n in window_bytes(win, calls).items() if n}
        per_cut = {p: n for p, n in window_bytes(lowered_cut.device, arrays).items() if n}
        win_mb, cut_mb = sum(moved.values()) / 1e6, sum(per_cut.values()) / 1e6
        pairs = "=" if moved == per_cut else "!="
        # off: this batch's compute at equal-token cuts, the shapes' plan's transfers
        eq = predict(run_passes(with_cuts(cut, att, equal_cuts(tokens, P)), LOWER))
        est_off = eq["total_ms"] - eq["exchange_ms"] + off["exchange_ms"]
        t = per["total_ms"]
        print(f"{b:5d} {len(ends):4d} {t:9.3f} {per['exchange_ms']:8.3f} {est:9.3f} "
              f"{est_win:9.3f} {est_off:9.3f} {est / t:7.2f} {est_win / t:7.2f} "
              f"{est_off / t:7.2f} {win_mb:7.1f} {cut_mb:7.1f} {pairs:>5}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768])
    ap.add_argument("--bucket", type=int, default=0,
                    help="the batches' bucket (eins/passes/families.py; default 0)")
    ap.add_argument("--schedule", choices=("naive", "optimized"), default="naive",
                    help="the exchange programs (optimized: synthesized; default naive)")
    ap.add_argument("--topology", default=TOPOLOGY, help=f"default {TOPOLOGY}")
    a = ap.parse_args(argv)
    if a.batches < 1:
        ap.error("--batches must be >= 1")
    for tokens in a.tokens:
        run(tokens, a.batches, a.bucket, schedule=a.schedule, topology=a.topology)


if __name__ == "__main__":
    main()
