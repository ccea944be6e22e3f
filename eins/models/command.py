"""``eins plan``: plan one of the paper's workloads (shape-only) and print the plan and its
predicted time on a hardware model, with no Python to write and no GPU.

    eins plan 1x8K --devices 8 --topology dgx-h100:8 [--schedule optimized] [--compare]
    eins plan chain-C --devices 8 --topology dgx-v100-paper --json

Workloads: the LLaMA block's token workloads (``eins.models.llama.WORKLOADS``: 1x1K, 1x8K,
1x128K, 8x1K, 128x1K, 8x1K-batch, 128x1K-batch) and its decode steps against a KV cache
(``llama.DECODE_WORKLOADS``: decode-1x8K, decode-8x32K, decode-64x4K, decode-8x128K) at
``--model`` size, and the matrix chains of Section 6 (``chain-A`` .. ``chain-E``). ``--compare`` adds the predicted time of every
hand-written strategy that applies (``eins.models.strategies``).
"""
from __future__ import annotations

import json
from dataclasses import asdict

import eins
from eins.errors import EinsError, PlanError
from eins.models import chains, llama, strategies

MODELS = {"paper": llama.PAPER, "small": llama.SMALL, "tiny": llama.TINY}


def workload_names() -> list[str]:
    return list(llama.WORKLOADS) + list(llama.DECODE_WORKLOADS) + \
        [f"chain-{c}" for c in chains.CHAINS]


def workload(name: str, model: str):
    """(function, shape-only arguments, hand-written strategies) of workload ``name``."""
    if model not in MODELS:
        raise EinsError(f"unknown model {model!r}; choose one of {list(MODELS)}")
    if name in llama.WORKLOADS:
        wl, cfg = llama.WORKLOADS[name], MODELS[model]
        return wl.function(cfg), wl(cfg), strategies.LLAMA_STRATEGIES
    if name in llama.DECODE_WORKLOADS:
        # the hand-written strategies are the prefill block's (sequence and ring splits)
        wl, cfg = llama.DECODE_WORKLOADS[name], MODELS[model]
        return wl.function(cfg), wl(cfg), {}
    if name.startswith("chain-") and name[6:] in chains.CHAINS:
        ch = chains.chain(name[6:])
        return ch.fn, ch.shape_args(), strategies.CHAIN_STRATEGIES
    raise EinsError(f"unknown workload {name!r}; choose one of {workload_names()}")


def _summary(low) -> dict:
    t = low.predicted_time()
    return {"total_ms": t["total_ms"], "compute_ms": t["compute_ms"],
            "exchange_ms": t["exchange_ms"], "peak_bytes": max(t["peak_bytes"].values()),
            "fits": t["fits"], "cost_s": low.plan.cost_s, "topology": t["topology"]}


def run(args) -> int:
    fn, shapes, strats = workload(args.workload, args.model)
    kw = dict(devices=args.devices, topology=args.topology, schedule=args.schedule)
    if args.schedule == "optimized" and args.synthesis_steps is not None:
        kw["synthesis_steps"] = args.synthesis_steps
    low = eins.distribute(fn, **kw).lower(*shapes)
    out = {"workload": args.workload, "devices": args.devices, "schedule": args.schedule,
           "dp": _summary(low), "plan": low.plan_table()}
    if args.compare:
        prog = low.program
        hand = {}
        for name, strat in strats.items():
            plan = strat(prog, args.devices)
            if plan is None:
                continue   # the workload cannot express it (no batch, too few heads, ...)
            try:
                hand[name] = _summary(eins.distribute(fn, plan=plan, **kw).lower(*shapes))
            except PlanError as e:   # a forced split the planner refuses: that row says why
                hand[name] = {"error": str(e)}
        out["strategies"] = hand
    explained = None
    if getattr(args, "explain", None) is not None:
        explained = low.explain(None if args.explain == "all" else args.explain)
        out["explain"] = [asdict(x) for x in
                          (explained if args.explain == "all" else [explained])]
    written = []
    if getattr(args, "html", None):
        written.append(low.report(args.html, compare=out.get("strategies")))
    if getattr(args, "trace", None):
        written.append(low.trace(args.trace))
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(low.as_text("planned"))
    if explained is not None:
        print()
        print(explained)
        print()
    rows = [("dp", out["dp"])] + list(out.get("strategies", {}).items())
    for name, s in rows:
        if "error" in s:
            print(f"{name:>24}: {s['error']}")
            continue
        print(f"{name:>24}: predicted {s['total_ms']:.3f} ms on {s['topology']} "
              f"({s['compute_ms']:.3f} ms kernels, {s['exchange_ms']:.3f} ms exchanges, "
              f"{args.schedule} schedule); peak memory per GPU {s['peak_bytes'] / 1e9:.2f} GB "
              f"({'fits' if s['fits'] else 'does NOT fit'})")
    for path in written:
        print(f"written to {path}")
    return 0
