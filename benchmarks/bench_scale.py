"""The planner at cluster scale (issue 38): plan, lower and predict CPU time and peak memory.

    python benchmarks/bench_scale.py [--quick] [--rows NAME,...] [--json PATH]
    python benchmarks/bench_scale.py --row BLOCKS TOPOLOGY SCHEDULE   # one row, as JSON
    python benchmarks/bench_scale.py --rank-sim TOPOLOGY [TOPOLOGY ...]  # one rank's lowering
    python benchmarks/bench_scale.py --torchrun N [N ...]   # the same on N gloo ranks

Shape-only LLaMA blocks (the paper's: d_model 4,096, 32 heads, 8 kv heads, FFN 14,336) at
1 x 8,192 tokens, stacked 1, 32 or 80 deep, on dgx-h100:8, 2x8, 4x8, 8x8 and 16x8, on
gb200-nvl72 and on a 1,024-GPU cluster (dgx-h100:128x8), under both schedules. Each row runs
in its own process, so its peak memory (``ru_maxrss``) is its own, and prints:

- ``plan``: CPU seconds of tracing and the planning passes (``distribute(...).lower``);
- ``lower``: CPU seconds of the physical passes (place, overlay, synthesize, lower, verify);
- ``predict``: CPU seconds of ``predicted_time()``;
- the peak resident memory of the row's process;
- the predicted time of dp's plan (ms; ``cost_s`` for the naive schedule, which equals its
  prediction, and ``predicted_time()`` for the optimized one);
- dp at smaller p: the plan's ``cost_s`` on the first p/2, p/4, ... devices of the same
  topology (planning only, the naive schedule's cost), and ``ok`` when dp at p is predicted
  no slower than every one of them (issue 38: more GPUs are never predicted slower).

``--rank-sim`` simulates what one rank of ``devices="world"`` does on a topology of p GPUs
(the paper block, naive schedule): the plan and the exchange programs every rank builds alike
(``shared``: ``distribute(...).lower``, ``exchanged`` and
:func:`eins.passes.lower.exchange_schedules`), then per rank (three ranks: first, middle,
last) its own lowering and verification (``lower_exchanges(xir, rank)``, ``verify_device``):
the part the issue wants independent of p. ``--torchrun N`` measures the same inside each
of N real ranks (torchrun, gloo on 127.0.0.1, ``devices="world"``), on the first N GPUs of
dgx-h100:8.

The targets (measured here, not timed tests): a 32-block model, optimized, at most 30 CPU s
in all on 16x8 and at most 10 s on 8x8; one block on 1,024 GPUs at most 60 s; peak memory
at most 4 GB. ``--quick`` runs the smallest rows (one block on dgx-h100:8 and 2x8).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eins  # noqa: E402
from eins.hardware.presets import get_topology  # noqa: E402
from eins.ir.plan import Compilation, Options  # noqa: E402
from eins.models import llama  # noqa: E402
from eins.passes import PHYSICAL, PLANNING, run_passes  # noqa: E402
from eins.passes.lower import exchange_schedules, lower_exchanges  # noqa: E402
from eins.passes.verify import verify_device  # noqa: E402

WORKLOAD = llama.WORKLOADS["1x8K"]
TOPOLOGIES = ("dgx-h100:8", "dgx-h100:2x8", "dgx-h100:4x8", "dgx-h100:8x8", "dgx-h100:16x8",
              "gb200-nvl72", "dgx-h100:128x8")
# (name, blocks, topology, schedule): every topology with one block under both schedules,
# the 32-block targets on 8x8 and 16x8, and 80 blocks on 72 GB200s
ROWS = ([(f"1 {t} {s}", 1, t, s) for t in TOPOLOGIES for s in ("naive", "optimized")]
        + [(f"32 {t} {s}", 32, t, s) for t in ("dgx-h100:8", "dgx-h100:8x8", "dgx-h100:16x8")
           for s in ("naive", "optimized")]
        + [(f"80 gb200-nvl72 {s}", 80, "gb200-nvl72", s) for s in ("naive", "optimized")])
QUICK = ("1 dgx-h100:8 naive", "1 dgx-h100:8 optimized", "1 dgx-h100:2x8 naive")
TARGETS = {("32", "dgx-h100:16x8", "optimized"): 30.0, ("32", "dgx-h100:8x8", "optimized"): 10.0,
           ("1", "dgx-h100:128x8", "optimized"): 60.0, ("1", "dgx-h100:128x8", "naive"): 60.0}
PEAK_GB = 4.0


def stack_fn(cfg, n):
    def stack(x, weights, cos, sin):
        for w in weights:
            x = llama.block(x, w, cos, sin, cfg)
        return x
    return stack


def _args(blocks):
    x, w, cos, sin = WORKLOAD(llama.PAPER)
    if blocks == 1:
        return WORKLOAD.function(llama.PAPER), (x, w, cos, sin)
    return stack_fn(llama.PAPER, blocks), (x, [w] * blocks, cos, sin)


def cpu(f):
    c = time.process_time()
    out = f()
    return time.process_time() - c, out


def one_row(blocks: int, topo: str, schedule: str) -> dict:
    """Plan, lower and predict one row in this process; the plans on fewer devices after."""
    fn, args = _args(blocks)
    p = len(get_topology(topo).gpus)
    f = eins.distribute(fn, devices=p, topology=topo, schedule=schedule)
    t_plan, low = cpu(lambda: f.lower(*args))
    t_lower, _ = cpu(lambda: low.physical)
    t_pred, pt = cpu(low.predicted_time)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pieces = sorted({len(ep.spec.fspecs) for ep in low.plan.eqn_plans})
    row = {"blocks": blocks, "topology": topo, "schedule": schedule, "p": p,
           "plan_s": t_plan, "lower_s": t_lower, "predict_s": t_pred,
           "total_s": t_plan + t_lower + t_pred, "peak_bytes": peak,
           "cost_ms": low.plan.cost_s * 1e3, "predicted_ms": pt["total_ms"],
           "pieces": pieces, "exchanges": len(low.exchanges)}
    prog = low.program
    smaller = {}
    q = p // 2 if p & (p - 1) == 0 else 1 << (p.bit_length() - 1)
    while q >= 1 and (blocks == 1 or q >= p // 8):
        st = run_passes(Compilation(prog, tuple(range(q)), Options(topology=topo)), PLANNING)
        smaller[q] = st.plan.cost_s * 1e3
        q //= 2
    row["smaller_ms"] = smaller
    row["ok"] = all(row["cost_ms"] <= v * (1 + 1e-9) for v in smaller.values())
    return row


def rank_lowering(low, ranks) -> dict:
    """CPU seconds of the work every rank shares (exchange programs, their schedules) and
    per rank of ``ranks`` its own lowering plus verification."""
    t_x, xir = cpu(lambda: low.exchanged.exchange)
    t_s, _ = cpu(lambda: exchange_schedules(xir))
    own = {}
    for r in ranks:
        t_l, one = cpu(lambda r=r: lower_exchanges(xir, r))
        t_v, _ = cpu(lambda: verify_device(one))
        own[r] = {"lower_ms": t_l * 1e3, "verify_ms": t_v * 1e3,
                  "instructions": one.num_instructions()}
    return {"exchanged_s": t_x, "schedules_s": t_s, "ranks": own}


def rank_sim(topo: str) -> dict:
    """One rank's work on ``topo`` (see the module docstring), simulated in this process."""
    fn, args = _args(1)
    p = len(get_topology(topo).gpus)
    t_plan, low = cpu(lambda: eins.distribute(fn, devices=p, topology=topo).lower(*args))
    return {"topology": topo, "p": p, "plan_s": t_plan,
            **rank_lowering(low, sorted({0, p // 2, p - 1}))}


def torchrun_rank() -> None:
    """Inside one torchrun rank: plan the paper block on devices="world" and time the
    shared and the rank's own lowering; prints one JSON line per rank."""
    fn, args = _args(1)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    f = eins.distribute(fn, devices="world", topology=f"dgx-h100:{n}")
    t_plan, low = cpu(lambda: f.lower(*args))
    row = {"p": n, "rank": rank, "plan_s": t_plan, **rank_lowering(low, [rank])}
    with open(os.path.join(os.environ["BENCH_SCALE_OUT"], f"rank{rank}.json"), "w") as out:
        json.dump(row, out)


def torchrun(n: int, timeout: float = 600) -> list:
    """``torchrun --nproc-per-node=n`` of :func:`torchrun_rank`; its ranks' JSON lines."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
           "--master-addr=127.0.0.1", f"--master-port={port}", os.path.abspath(__file__),
           "--in-rank"]
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_SCALE_OUT=d)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if out.returncode:
            raise RuntimeError(f"torchrun {n}: {out.stderr[-2000:]}")
        rows = []
        for r in range(n):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                rows.append(json.load(f))
    return rows


def show_ranks(r: dict) -> str:
    own = " ".join(f"{k}:{v['lower_ms']:.1f}+{v['verify_ms']:.1f}" for k, v in r["ranks"].items())
    return (f"   p={r['p']:5d} plan {r['plan_s']:7.2f} s, shared: exchange programs "
            f"{r['exchanged_s']:6.2f} s + schedules {r['schedules_s']:5.2f} s | per rank "
            f"lower+verify ms {own}")


def run_row(name: str, timeout: float) -> dict:
    blocks, topo, schedule = name.split()
    cmd = [sys.executable, os.path.abspath(__file__), "--row", blocks, topo, schedule]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"over {timeout:.0f} s"}
    if out.returncode:
        return {"name": name, "error": out.stderr.strip().splitlines()[-1:]}
    return {"name": name, **json.loads(out.stdout.strip().splitlines()[-1])}


def show(r: dict) -> str:
    if "error" in r:
        return f"   {r['name']:32s} ERROR {r['error']}"
    key = (str(r["blocks"]), r["topology"], r["schedule"])
    target = TARGETS.get(key)
    mark = "" if target is None else (f" (target {target:.0f} s: "
                                      f"{'met' if r['total_s'] <= target else 'MISSED'})")
    smaller = " ".join(f"{q}:{v:.4f}" for q, v in r["smaller_ms"].items())
    return (f"   {r['name']:32s} plan {r['plan_s']:7.2f} lower {r['lower_s']:7.2f} predict "
            f"{r['predict_s']:6.2f} = {r['total_s']:7.2f} CPU s{mark}, peak "
            f"{r['peak_bytes'] / 2**30:5.2f} GiB | dp {r['predicted_ms']:.4f} ms "
            f"(cost {r['cost_ms']:.4f}; pieces {r['pieces']}) | smaller p {smaller} "
            f"{'ok' if r['ok'] else 'SLOWER'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the smallest rows only")
    ap.add_argument("--rows", default=None, help="comma-separated row names (see ROWS)")
    ap.add_argument("--row", nargs=3, metavar=("BLOCKS", "TOPOLOGY", "SCHEDULE"),
                    help="run one row in this process and print it as JSON")
    ap.add_argument("--rank-sim", nargs="+", metavar="TOPOLOGY",
                    help="simulate one rank's lowering on each topology")
    ap.add_argument("--torchrun", nargs="+", type=int, metavar="N",
                    help="time the lowering inside N torchrun (gloo) ranks")
    ap.add_argument("--in-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per row")
    ap.add_argument("--json", default="bench_scale.json")
    a = ap.parse_args(argv)
    if a.in_rank:
        return torchrun_rank()
    if a.rank_sim or a.torchrun:
        print("one rank of devices='world', the paper block (1 x 8,192), naive: CPU s of the "
              "plan and of what every rank builds alike, then per rank its own lowering")
        for t in a.rank_sim or ():
            print(show_ranks(rank_sim(t)), flush=True)
        for n in a.torchrun or ():
            rows = torchrun(n)
            merged = dict(rows[0], ranks={k: v for r in rows for k, v in r["ranks"].items()})
            print("  torchrun" + show_ranks(merged)[2:], flush=True)
        return None
    if a.row:
        blocks, topo, schedule = a.row
        print(json.dumps(one_row(int(blocks), topo, schedule)))
        return None
    names = [n for n, *_ in ROWS]
    if a.rows:
        names = a.rows.split(",")
    elif a.quick:
        names = list(QUICK)
    print(f"paper block(s), 1 x 8,192 tokens: CPU s per stage, peak memory, dp's predicted "
          f"time and its cost on fewer devices (ms); peak target {PEAK_GB:.0f} GiB")
    rows = []
    for n in names:
        r = run_row(n, a.timeout)
        rows.append(r)
        print(show(r), flush=True)
    good = [r for r in rows if "error" not in r]
    print(f"more GPUs never slower on {sum(r['ok'] for r in good)} of {len(good)} rows; peak "
          f"memory at most {max((r['peak_bytes'] for r in good), default=0) / 2**30:.2f} GiB")
    with open(a.json, "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
