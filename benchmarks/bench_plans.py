"""dp against hand-written plans, greedy and random plans, by predicted time (issue 10).

    python benchmarks/bench_plans.py [--quick] [--json PATH] [--optimized] [--sizes 2,4,8]
                                     [--few-tokens] [--calibration]

Shape-only (ShapeDtype) at paper sizes, 8 devices. For every topology (dgx-a100:8,
dgx-h100:8, dgx-v100-paper) and workload (the 7 LLaMA token workloads, chains A-E):

- the predicted time in ms of ``dp`` (cost="time"), ``dp-proxy`` (the paper's byte proxy),
  ``greedy``, every hand-written strategy that applies (eins.models.strategies: token /
  sequence parallel, DeepSpeed-Ulysses, Megatron TP, batch parallel; row sharding and the 3D
  algorithm for chains) and the best of 20 random plans. These are the time cost of each
  plan, which equals ``predicted_time()["total_ms"]`` under the naive schedule (asserted by
  tests/test_plan_time.py) and costs no lowering;
- ``ok``: dp is no slower than every hand-written plan and the best random plan (ties
  within 1%), the target of issue 10;
- with ``--optimized``: dp's plan lowered with schedule="optimized" (synthesized exchange
  programs) next to the naive schedule, through ``predicted_time()``.

Training rows (5., ``--training`` alone): a LLaMA-8B-sized training step (eins/models/train.py:
embedding, ``--train-layers`` blocks of the paper config (default 32), head over 128,256
tokens, cross-entropy, AdamW; bfloat16; 8 sequences of ``--train-seq`` tokens (default
8192: one per GPU, as torchtitan's LLaMA-3-8B run); activation checkpointing per block
unless ``--no-remat``) on
dgx-h100:8: ``dp`` against hand-written data parallel, FSDP-like sharding, Megatron TP and
sequence parallel (eins.models.strategies.TRAINING_STRATEGIES, each a ``plan=`` of the
forward's and the backward's matmuls and attention), by predicted time (``ok``: dp no slower
than each, ties within 1%); with dp's measured planning time (wall and CPU) and its peak
memory per GPU with activations counted (the lowered device program's live bytes,
``predicted_time()["peak_bytes"]``; target: within 80 GB).

Then: planning time of the paper block (1x8K) at p = 8 (best of 5; target 0.1 s); the
paper block with 1,048,576 tokens on dgx-h100:8 (its largest per-eqn working set against
the 80 GB cap); and, per cost, the Spearman correlation between the cost of 20 random plans
and their ``predicted_time()`` (lowered, naive schedule; with ``--optimized`` the optimized
schedule, where the time cost is no longer exact by construction).
``--quick``: dgx-a100:8, 1x1K and chain C, 4 random plans, correlations on chain C alone
(for the test suite). ``--sizes 2,4,8``: part 1 on the switch presets (dgx-a100, dgx-h100) at
each of these GPU counts (``dgx-a100:4`` on 4 devices...); dgx-v100-paper stays at its 8;
then whether dp at each p is predicted no slower than at every smaller p (issue 38).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import eins  # noqa: E402
from eins.errors import PlanError  # noqa: E402
from eins.ir.plan import Compilation, Options  # noqa: E402
from eins.models import chains, llama, strategies, train  # noqa: E402
from eins.passes import PLANNING, run_passes  # noqa: E402

TOPOLOGIES = ("dgx-a100:8", "dgx-h100:8", "dgx-v100-paper")
P = 8


def workloads(quick):
    out = []
    for name, wl in llama.WORKLOADS.items():
        if not quick or name == "1x1K":
            out.append((name, wl.function(llama.PAPER), wl(llama.PAPER),
                        strategies.LLAMA_STRATEGIES))
    for c in chains.CHAINS:
        if not quick or c == "C":
            ch = chains.chain(c)
            out.append((f"chain {c}", ch.fn, ch.shape_args(), strategies.CHAIN_STRATEGIES))
    return out


def spearman(x, y) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for val in np.unique(v):   # ties share their mean rank
            m = v == val
            r[m] = r[m].mean()
        return r
    a, b = ranks(x), ranks(y)
    if a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def lower(fn, args, topo, p=P, **kw):
    return eins.distribute(fn, devices=p, topology=topo, **kw).lower(*args)


def compare(name, fn, args, strats, topo, nrandom, optimized, p=P):
    prog = eins.make_ir(fn)(*args)
    row = {"workload": name, "topology": topo, "p": p}
    dp = lower(fn, args, topo, p)
    row["dp"] = dp.plan.cost_s * 1e3
    row["dp-proxy"] = lower(fn, args, topo, p, cost="proxy").plan.cost_s * 1e3
    row["greedy"] = lower(fn, args, topo, p, selector="greedy").plan.cost_s * 1e3
    hand = {}
    for sname, strat in strats.items():
        plan = strat(prog, p)
        if plan is None:
            continue
        try:
            hand[sname] = lower(fn, args, topo, p, plan=plan).plan.cost_s * 1e3
        except PlanError as e:   # e.g. does not fit the memory cap
            hand[sname] = f"error: {e}"
    row["hand"] = hand
    rnd = [lower(fn, args, topo, p, selector="random", seed=s).plan.cost_s * 1e3
           for s in range(nrandom)]
    row["random_best"] = min(rnd)
    beaten = [v for v in hand.values() if isinstance(v, float)] + [row["random_best"]]
    row["ok"] = all(row["dp"] <= v * 1.01 for v in beaten)
    if optimized:
        opt = lower(fn, args, topo, p, schedule="optimized")   # the default budget
        row["dp-naive-predicted"] = dp.predicted_time()["total_ms"]
        row["dp-optimized-predicted"] = opt.predicted_time()["total_ms"]
    return row


def monotone(rows) -> list:
    """[(case, ok)] per (preset, workload, p) with a smaller p measured: dp's cost at p is
    at most its cost at every smaller p (issue 38: more GPUs are never predicted slower)."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["topology"].partition(":")[0], r["workload"]), {})[r["p"]] = r["dp"]
    out = []
    for (topo, wl), costs in by.items():
        for p, c in costs.items():
            worse = [q for q, v in costs.items() if q < p and c > v * (1 + 1e-9)]
            if any(q < p for q in costs):
                out.append((f"{topo} {wl} p={p} slower than p={worse}" if worse else
                            f"{topo} {wl} p={p}", not worse))
    return out


def planning_time(reps=5) -> tuple[float, float]:
    """Best of ``reps`` runs of the planning passes: (wall seconds, CPU seconds; the CPU time
    is what to read on a shared, loaded machine)."""
    wl = llama.WORKLOADS["1x8K"]
    prog = eins.make_ir(wl.function(llama.PAPER))(*wl(llama.PAPER))
    wall = cpu = float("inf")
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        run_passes(Compilation(prog, tuple(range(P)), Options(topology="dgx-a100:8")),
                   PLANNING)
        wall = min(wall, time.perf_counter() - t)
        cpu = min(cpu, time.process_time() - c)
    return wall, cpu


def million_tokens() -> dict:
    wl = llama.Workload("1x1M", 1, 1 << 20)
    low = eins.distribute(wl.function(llama.PAPER), devices=P,
                          topology="dgx-h100:8").lower(*wl(llama.PAPER))
    pt = low.predicted_time()   # lowered: the device program's exact peak of live buffers
    return {"eqn_peak_bytes": low.plan.eqn_peak_bytes, "limit": low.plan.memory_limit,
            "fits": low.plan.eqn_peak_bytes <= low.plan.memory_limit,
            "device_peak_bytes": max(pt["peak_bytes"].values()), "device_fits": pt["fits"],
            "predicted_ms": low.plan.cost_s * 1e3,
            "splits": {e.prim: ep.splits for e, ep in zip(low.program.eqns,
                                                          low.plan.eqn_plans)
                       if e.prim in ("attention", "matmul")}}


def correlations(quick, nrandom, optimized) -> list[dict]:
    out = []
    for name, fn, args, _ in workloads(quick):
        if name != "1x1K" and not name.startswith("chain") or quick and name == "1x1K":
            continue   # (the quick run lowers one chain only)
        costs = {"proxy": [], "time": []}
        pred = []
        for s in range(nrandom):
            low = lower(fn, args, "dgx-a100:8", selector="random", seed=s,
                        schedule="optimized" if optimized else "naive",
                        synthesis_budget_s=0.05)
            costs["proxy"].append(low.cost_bytes)
            costs["time"].append(low.plan.cost_s)
            pred.append(low.predicted_time()["total_ms"])
        out.append({"workload": name, **{c: spearman(v, pred) for c, v in costs.items()}})
        print(f"   {name:14s} proxy {out[-1]['proxy']:6.2f}   time {out[-1]['time']:6.2f}",
              flush=True)
    return out


# The plan check of issue 39 (--calibration): each topology planned on the data sheet's
# roofline and on a machine profile (the measured H200's; the published figures' for H100
# and A100 servers; the H200 shared by 8 logical devices)
CALIBRATIONS = (("hgx-h200:8", "h200"), ("hgx-h200:8/1", "h200"),
                ("dgx-h100:8", "h100-published"), ("dgx-a100:8", "a100-published"))


def calibration_check(quick=False) -> list[dict]:
    """Per (topology, profile, workload): dp's plan on the data sheet and on the profile,
    whether they differ (the eqns whose splits changed), and both plans' predicted ms under
    the profile (``gain``: how much faster the calibrated plan is predicted to run)."""
    rows = []
    print("calibration: dp planned on the data sheet and on the machine profile, both "
          "plans priced by the profile (ms)")
    for topo, prof in CALIBRATIONS[:1] if quick else CALIBRATIONS:
        for name, fn, args, _ in workloads(quick):
            sheet = lower(fn, args, topo, profile="none")
            cal = lower(fn, args, topo, profile=prof)
            splits = [ep.splits for ep in sheet.plan.eqn_plans]
            changed = [i for i, (a, b) in enumerate(zip(splits, cal.plan.eqn_plans))
                       if a != b.splits]
            old = lower(fn, args, topo, profile=prof, plan=dict(enumerate(splits)))
            r = {"topology": topo, "profile": prof, "workload": name,
                 "sheet_ms": sheet.plan.cost_s * 1e3, "old_plan_ms": old.plan.cost_s * 1e3,
                 "calibrated_ms": cal.plan.cost_s * 1e3, "changed_eqns": changed,
                 "changed_ops": sorted({sheet.program.eqns[i].prim for i in changed})}
            r["gain"] = 1 - r["calibrated_ms"] / r["old_plan_ms"]
            rows.append(r)
            print(f"   {topo:13s} {prof:15s} {name:13s} sheet {r['sheet_ms']:9.3f} | that "
                  f"plan calibrated {r['old_plan_ms']:9.3f} | dp calibrated "
                  f"{r['calibrated_ms']:9.3f} ({100 * r['gain']:5.1f} % faster) | "
                  f"{len(changed)} eqns changed {r['changed_ops']}", flush=True)
    return rows


# Few tokens through the paper block, where each exchange's latency outweighs its bytes
# (--few-tokens): single sequences of 16, 64 and 256 tokens, 8 packed sequences of 64, and a
# batch of 8 sequences of 16, on servers and a cluster of two.
FEW_TOKENS = (("1x16", 1, 16, True), ("1x64", 1, 64, True), ("1x256", 1, 256, True),
              ("8x64", 8, 64, True), ("8x16-batch", 8, 16, False))
FEW_TOKEN_TOPOLOGIES = ("dgx-a100:8", "dgx-h100:8", "dgx-h100:2x4", "dgx-v100", "gb200-nvl72:8")


def few_tokens(nrandom=10):
    """dp against the hand plans and the best of ``nrandom`` random plans, microseconds."""
    rows = []
    print(f"few tokens: predicted us per plan, p = {P} (best random of {nrandom})")
    for topo in FEW_TOKEN_TOPOLOGIES:
        for name, n, s, packed in FEW_TOKENS:
            wl = llama.Workload(name, n, s, packed)
            r = compare(name, wl.function(llama.PAPER), wl(llama.PAPER),
                        strategies.LLAMA_STRATEGIES, topo, nrandom, False)
            rows.append(r)
            hand = " ".join(f"{k}={v * 1e3:.2f}" for k, v in r["hand"].items()
                            if isinstance(v, float))
            print(f"   {topo:15s} {name:11s} dp {r['dp'] * 1e3:8.2f} "
                  f"{'ok ' if r['ok'] else 'MISS'} | random-best {r['random_best'] * 1e3:8.2f}"
                  f" | {hand}", flush=True)
    print(f"dp ok on {sum(r['ok'] for r in rows)} of {len(rows)}")
    return rows


def training_step(layers: int, seq: int, vocab: int = 128256, block=llama.PAPER, batch=8,
                  dtype="bfloat16", remat=True):
    """(step function, ShapeDtype arguments) of the LLaMA training step (train.step_fn;
    ``remat``: activation checkpointing per block, as torchtitan trains LLaMA-3-8B)."""
    cfg = train.LMConfig(vocab=vocab, layers=layers, block=block)
    d, sd = block.d_model, eins.ShapeDtype
    params = {"embed": sd((vocab, d), dtype), "norm": sd((d,), dtype),
              "blocks": [llama.weight_shapes(block, dtype) for _ in range(layers)],
              "head": sd((d, vocab), dtype)}
    tok, cs = sd((batch, seq), "int32"), sd((seq, block.head_dim), dtype)
    return train.step_fn(cfg, remat=remat), (params, params, params, tok, tok, cs, cs,
                                             sd((3,), dtype))


def training_rows(layers: int, seq: int, topo: str = "dgx-h100:8", **kw) -> dict:
    """dp against the hand-written training strategies (module docstring, 5.)."""
    fn, args = training_step(layers, seq, **kw)
    t, c = time.perf_counter(), time.process_time()
    dp = lower(fn, args, topo)
    plan_s, plan_cpu = time.perf_counter() - t, time.process_time() - c
    prog = dp.program
    remat = " remat" if kw.get("remat", True) else ""
    row = {"workload": f"train {layers}x{kw.get('batch', 8)}x{seq}{remat}", "topology": topo,
           "eqns": len(prog.eqns), "bwd_eqns": sum(e.phase == "bwd" for e in prog.eqns),
           "dp": dp.plan.cost_s * 1e3, "planning_s": plan_s, "planning_cpu_s": plan_cpu}
    hand = {}
    for name, strat in strategies.TRAINING_STRATEGIES.items():
        plan = strat(prog, P)
        if plan is None:
            hand[name] = "error: does not apply"
            continue
        try:
            hand[name] = lower(fn, args, topo, plan=plan).plan.cost_s * 1e3
        except PlanError as e:   # e.g. does not fit the memory cap
            hand[name] = f"error: {e}"
    row["hand"] = hand
    row["ok"] = all(row["dp"] <= v * 1.01 for v in hand.values() if isinstance(v, float))
    pt = dp.predicted_time()   # lowered: the device program's live bytes, activations too
    row["peak_bytes"] = max(pt["peak_bytes"].values())
    row["memory_limit"] = dp.plan.memory_limit
    row["fits"] = bool(pt["fits"])
    return row


def print_training(r) -> None:
    hand = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}=({v})"
                    for k, v in r["hand"].items())
    print(f"5. {r['workload']} on {r['topology']} ({r['eqns']} eqns, {r['bwd_eqns']} "
          f"backward): dp {r['dp']:.3f} ms {'ok ' if r['ok'] else 'MISS'} | {hand}\n"
          f"   dp planned in {r['planning_s']:.2f} s wall, {r['planning_cpu_s']:.2f} s CPU; "
          f"peak {r['peak_bytes'] / 1e9:.2f} GB per GPU with activations of "
          f"{r['memory_limit'] / 1e9:.0f} GB ({'fits' if r['fits'] else 'DOES NOT FIT'})",
          flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default="bench_plans.json")
    ap.add_argument("--optimized", action="store_true")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated GPU counts for the switch presets (default: 8)")
    ap.add_argument("--few-tokens", action="store_true",
                    help="only the few-token workloads (FEW_TOKENS), where latency dominates")
    ap.add_argument("--calibration", action="store_true",
                    help="only the plan check of issue 39: plans on the data sheet against "
                         "plans on machine profiles (CALIBRATIONS)")
    ap.add_argument("--training", action="store_true", help="only the training rows (5.)")
    ap.add_argument("--train-layers", type=int, default=32)
    ap.add_argument("--train-seq", type=int, default=8192)
    ap.add_argument("--no-remat", action="store_true",
                    help="the training rows without activation checkpointing")
    a = ap.parse_args(argv)
    if a.calibration:
        doc = {"calibration": calibration_check(a.quick)}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        return doc
    if a.training:
        r = training_rows(a.train_layers, a.train_seq, remat=not a.no_remat)
        print_training(r)
        with open(a.json, "w") as f:
            json.dump({"training": r}, f, indent=1)
        return {"training": r}
    if a.few_tokens:
        doc = {"few_tokens": few_tokens()}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        return doc
    topos = TOPOLOGIES[:1] if a.quick else TOPOLOGIES
    sizes = [P] if a.sizes is None else [int(n) for n in a.sizes.split(",")]
    cases = [(f"{t.partition(':')[0]}:{n}" if ":" in t else t, n if ":" in t else P)
             for t in topos for n in (sizes if ":" in t else [P])]
    nrandom = 4 if a.quick else 20
    rows = []
    print(f"1. predicted ms per plan, p = {', '.join(map(str, sorted({n for _, n in cases})))}"
          f" (time cost = predicted_time() with the naive schedule)")
    for topo, p in cases:
        for name, fn, args, strats in workloads(a.quick):
            r = compare(name, fn, args, strats, topo, nrandom, a.optimized, p)
            rows.append(r)
            hand = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}=({v})"
                            for k, v in r["hand"].items())
            extra = ""
            if a.optimized:   # never above naive (synthesize keeps the cheaper placement)
                slower = r['dp-optimized-predicted'] > r['dp-naive-predicted'] * (1 + 1e-9)
                extra = (f" | optimized {r['dp-optimized-predicted']:.3f} naive "
                         f"{r['dp-naive-predicted']:.3f}{' SLOWER' if slower else ''}")
            print(f"   {topo:15s} {name:13s} dp {r['dp']:9.3f} {'ok ' if r['ok'] else 'MISS'}"
                  f" | proxy-dp {r['dp-proxy']:9.3f} greedy {r['greedy']:9.3f} "
                  f"random-best {r['random_best']:9.3f} | {hand}{extra}", flush=True)
    mono = monotone(rows)
    if mono:
        print(f"   more GPUs never predicted slower (dp at p against dp at each smaller p of "
              f"the same preset): {sum(ok for _, ok in mono)} of {len(mono)}"
              + "".join(f"\n   SLOWER: {k}" for k, ok in mono if not ok))
    t, cpu = planning_time(2 if a.quick else 5)
    print(f"2. planning the paper block (1x8K) at p = 8: {t:.3f} s wall, {cpu:.3f} s CPU "
          f"(target 0.1 s)")
    mil = None if a.quick else million_tokens()
    if mil:
        print(f"3. 1,048,576 tokens on dgx-h100:8: largest per-eqn working set "
              f"{mil['eqn_peak_bytes'] / 1e9:.2f} GB of {mil['limit'] / 1e9:.0f} GB "
              f"({'fits' if mil['fits'] else 'DOES NOT FIT'}); device program peak "
              f"{mil['device_peak_bytes'] / 1e9:.2f} GB "
              f"({'fits' if mil['device_fits'] else 'DOES NOT FIT'}); predicted "
              f"{mil['predicted_ms']:.1f} ms; splits {mil['splits']}")
    print("4. Spearman correlation of each cost with predicted_time() over random plans")
    corr = correlations(a.quick, 3 if a.quick else 20, a.optimized)
    # --quick: one block of the paper config on 1K tokens, the rest as in the full run
    tr = training_rows(1, 1024) if a.quick else \
        training_rows(a.train_layers, a.train_seq, remat=not a.no_remat)
    print_training(tr)
    doc = {"plans": rows, "monotone": mono, "planning_s": t, "planning_cpu_s": cpu,
           "million_tokens": mil, "spearman": corr, "training": tr}
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.json}; dp ok on {sum(r['ok'] for r in rows)} of {len(rows)}")
    return doc


if __name__ == "__main__":
    main()
