"""Planning time of the logical optimizer (Section 4) on the paper's workloads, shape-only.

    python benchmarks/bench_planning.py [--devices 8] [--repeat 3]

Prints, per workload, the time to trace and the time to plan (enumerate_specs, cut_trees,
choose_specs with the "dp" selector), the number of eqns and the plan's cost proxy. The
target: the paper-sized LLaMA block (4096/32/8/128/14336) on 131,072 tokens plans in < 1 s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eins  # noqa: E402
from eins.ir.plan import Compilation  # noqa: E402
from eins.models import llama, paper_workloads  # noqa: E402
from eins.passes import PLANNING, run_passes  # noqa: E402


def _best(f, repeat):
    best, out = None, None
    for _ in range(repeat):
        t = time.perf_counter()
        out = f()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return best, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8, help="devices to plan for (default 8)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per workload, the best one reported (default 3)")
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {a.repeat}")
    if not 1 <= a.devices <= 2048:
        ap.error(f"--devices must be 1 ... 2048, got {a.devices}")
    devs = tuple(range(a.devices))
    work = paper_workloads()
    print(f"{'workload':20s} {'eqns':>5s} {'trace s':>8s} {'plan s':>8s} {'cost GB':>9s}")
    for name, fn, args in work:
        t_trace, prog = _best(lambda: eins.make_ir(fn)(*args), a.repeat)
        t_plan, st = _best(lambda: run_passes(Compilation(prog, devs), PLANNING), a.repeat)
        print(f"{name:20s} {len(prog.eqns):5d} {t_trace:8.3f} {t_plan:8.3f} "
              f"{st.plan.cost_bytes / 1e9:9.2f}")
    w = llama.WORKLOADS["1x128K"]
    t, _ = _best(lambda: eins.distribute(w.function(llama.PAPER), devices=a.devices)
                 .lower(*w.args(llama.PAPER)), a.repeat)
    print(f"\npaper-sized block, 131,072 tokens, p={a.devices}: trace + plan {t:.3f} s "
          f"(target < 1 s)")


if __name__ == "__main__":
    main()
