"""The priced DP against the best plan once synthesized (issue 38 item 2, target: within 1 %).

    python benchmarks/bench_priced.py [--quick] [--sample N] [--json PATH]

Per case (FFN, matmul chains and the TINY LLaMA block at p = 2, 4, 8 on dgx-a100,
dgx-v100-paper and dgx-h100:2x2 / 2x4), under ``schedule="optimized"``:

- ``dp``: the DP's plan, lowered through place, overlay and synthesize and predicted;
- ``best``: the least prediction over every plan, found so: every combination of the
  enumerated candidates (all of them where there are at most ``--exhaustive`` combinations,
  else ``--sample`` random ones, dp's own among them) is priced by its synthesized exchange
  bodies at the naive placement (each distinct exchange synthesized once:
  :class:`eins.passes.priced.Synthesized`, the price the DP uses), and the plans whose price
  is within ``--margin`` of the least price are lowered and predicted in full (the synthesize
  pass may move exchanges, which only lowers a plan's prediction below its price);
- the gap ``dp / best - 1`` (ok when at most 1 %).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from collections import namedtuple
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eins  # noqa: E402
from eins.cost.predict import predict  # noqa: E402
from eins.cost.timecost import TimeModel, plan_seconds  # noqa: E402
from eins.ir.plan import Compilation, EqnPlan, Options, Plan  # noqa: E402
from eins.models import llama  # noqa: E402
from eins.passes import PHYSICAL, PLANNING, run_passes  # noqa: E402
from eins.passes.priced import Synthesized, plan_exchanges  # noqa: E402

S = eins.ShapeDtype
TOL = 0.01


def ffn(x, w1, w2):
    return eins.relu(x @ w1) @ w2


def ffn_gelu(x, w1, b1, w2):   # tests/helpers.py's: a bias, an exact gelu, a residual
    h = eins.gelu(x @ w1 + b1, approximate=False)
    return (h * 0.5) @ w2 + x


def chain3(a, b, c):
    return (a @ b) @ c


def chain4(a, b, c, d):
    return (a @ b) @ (c @ d)


TINY_1x64 = llama.Workload("1x64", 1, 64)


WORKLOADS = {
    "ffn-256": (ffn, (S((256, 4096), "f16"), S((4096, 14336), "f16"), S((14336, 4096), "f16"))),
    "ffn-gelu-256": (ffn_gelu, (S((256, 4096), "f16"), S((4096, 14336), "f16"),
                                S((14336,), "f16"), S((14336, 4096), "f16"))),
    "ffn-64": (ffn, (S((64, 1024), "f16"), S((1024, 4096), "f16"), S((4096, 1024), "f16"))),
    "chain3": (chain3, (S((4096, 1024), "f16"), S((1024, 4096), "f16"), S((4096, 512), "f16"))),
    "chain4": (chain4, (S((2048, 2048), "f16"),) * 4),
    "tiny-1x64": (TINY_1x64.function(llama.TINY), TINY_1x64.args(llama.TINY)),
}
TOPOLOGIES = {2: ("dgx-a100", "dgx-v100-paper"), 4: ("dgx-a100", "dgx-v100-paper", "dgx-h100:2x2"),
              8: ("dgx-a100", "dgx-v100-paper", "dgx-h100:2x4")}
QUICK = (("ffn-64", "dgx-a100", 2), ("chain3", "dgx-v100-paper", 2), ("ffn-64", "dgx-h100:2x2", 4))


def cases(quick: bool = False, only=None):
    if quick:
        return list(QUICK)
    if only:   # "case,topology,p" each
        return [(w, t, int(p)) for w, t, p in (c.split(",") for c in only)]
    return [(w, t, p) for p, ts in TOPOLOGIES.items() for t in ts for w in WORKLOADS]


def _program(name):
    fn, args = WORKLOADS[name]
    return eins.make_ir(fn)(*args)


def _options(topo, steps):
    return Options(topology=topo, schedule="optimized", synthesis_steps=steps)


def predicted(state, specs_of) -> float:
    """The prediction (s) of the plan of ``state`` with per-eqn candidates ``specs_of``,
    after place, overlay, synthesize and lower."""
    plan = state.plan
    eqn_plans = tuple(EqnPlan(c.intervals, c.spec, ep.cost, None)
                      for c, ep in zip(specs_of, plan.eqn_plans))
    st = replace(state, plan=replace(plan, eqn_plans=eqn_plans))
    return predict(run_passes(st, PHYSICAL[:4]))["total_ms"] * 1e-3


def compare(name: str, topo: str, p: int, exhaustive: int = 20000, sample: int = 2000,
            margin: float = 0.03, steps: int | None = 16, seed: int = 0) -> dict:
    """dp's synthesized prediction against the best plan's (see the module docstring)."""
    t0 = time.process_time()
    prog = _program(name)
    opts = _options(topo, steps)
    st = run_passes(Compilation(prog, tuple(range(p)), opts), PLANNING)
    dp_specs = [c for c in _chosen(st)]
    dp = predicted(st, dp_specs)
    cands = st.candidates
    total = math.prod(len(c) for c in cands)
    model = Synthesized(TimeModel(prog, st.devices, st.topology, True), st.topology, opts)
    if total <= exhaustive:
        combos = itertools.chain(itertools.product(*cands), [tuple(dp_specs)])
        mode = "exhaustive"
    else:
        combos = _samples(cands, dp_specs, sample, random.Random(seed))
        mode = f"sample {sample}"
    priced = []
    for combo in combos:
        specs = [c.spec for c in combo]
        for c, n in plan_exchanges(prog, specs, model):
            model.price(c, n)
        priced.append((sum(plan_seconds(prog, specs, st.devices, st.topology, model)), combo))
    priced.sort(key=lambda t: t[0])
    least = priced[0][0]
    near = [combo for t, combo in priced if t <= least * (1 + margin)][:64]
    best = min([dp] + [predicted(st, list(combo)) for combo in near])
    gap = dp / best - 1
    return {"case": name, "topology": topo, "p": p, "plans": total, "mode": mode,
            "lowered": len(near), "dp_ms": dp * 1e3, "best_ms": best * 1e3,
            "dp_price_ms": st.plan.cost_s * 1e3, "least_price_ms": least * 1e3,
            "gap": gap, "ok": gap <= TOL, "cpu_s": time.process_time() - t0}


def _chosen(st):
    """dp's choice per eqn: its entry of ``st.candidates`` where it has one (a plan on a
    device subset picks from the smaller p's candidates), else its own (intervals, spec)."""
    out = []
    for cs, ep in zip(st.candidates, st.plan.eqn_plans):
        hit = next((c for c in cs if c.spec is ep.spec or c.intervals == ep.intervals), None)
        out.append(hit if hit is not None else _Pick(ep.intervals, ep.spec))
    return out


_Pick = namedtuple("_Pick", "intervals spec")   # a candidate's fields predicted() reads


def _samples(cands, dp, n, rng):
    """``n`` plans: every plan differing from dp's in one eqn (up to n / 2), the rest half
    changing 2 to 4 eqns of dp's, half uniformly random."""
    near = [tuple(dp[:i]) + (c,) + tuple(dp[i + 1:]) for i, cs in enumerate(cands) for c in cs
            if c is not dp[i]]
    rng.shuffle(near)
    out = near[:n // 2]
    while len(out) < n:
        if len(out) % 2:
            out.append(tuple(rng.choice(c) for c in cands))
            continue
        combo = list(dp)
        for i in rng.sample(range(len(cands)), min(len(cands), rng.randint(2, 4))):
            combo[i] = rng.choice(cands[i])
        out.append(tuple(combo))
    return out + [tuple(dp)]


def show(r: dict) -> str:
    return (f"   {r['case']:10s} {r['topology']:15s} p={r['p']}  dp {r['dp_ms']:9.5f} ms  best "
            f"{r['best_ms']:9.5f}  gap {100 * r['gap']:+6.2f} %  {'ok' if r['ok'] else 'MISS'}"
            f"  ({r['mode']} of {r['plans']} plans, {r['lowered']} lowered; dp price "
            f"{r['dp_price_ms']:.5f}, least price {r['least_price_ms']:.5f}; "
            f"{r['cpu_s']:.1f} CPU s)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three small cases")
    ap.add_argument("--exhaustive", type=int, default=20000,
                    help="enumerate every plan up to this many combinations")
    ap.add_argument("--sample", type=int, default=2000, help="random plans otherwise")
    ap.add_argument("--margin", type=float, default=0.03,
                    help="lower the plans priced within this of the least price")
    ap.add_argument("--steps", type=int, default=16, help="synthesis steps per exchange")
    ap.add_argument("--cases", nargs="+", metavar="CASE,TOPOLOGY,P",
                    help="only these cases (e.g. ffn-gelu-256,dgx-v100-paper,8)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    print(f"schedule='optimized': dp's plan predicted once synthesized, against the best "
          f"plan's (target: within {100 * TOL:.0f} %)")
    rows = []
    for name, topo, p in cases(a.quick, a.cases):
        r = compare(name, topo, p, a.exhaustive, a.sample, a.margin, a.steps)
        rows.append(r)
        print(show(r), flush=True)
    worst = max(rows, key=lambda r: r["gap"])
    print(f"dp within {100 * TOL:.0f} % on {sum(r['ok'] for r in rows)} of {len(rows)} cases; "
          f"worst gap {100 * worst['gap']:+.2f} % ({worst['case']} {worst['topology']} "
          f"p={worst['p']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
