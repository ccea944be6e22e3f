"""Exchange-program synthesis (paper Section 5.4): synthesis time and speedup over the naive
program for 8-way preambles on every topology preset.

    python3 benchmarks/bench_synthesize.py [--budget 0.2] [--presets dgx-h100,dgx-v100-paper]

Preambles (1 GB atoms, GPUs 0..7):
- all-reduce:      one atom with a copy on every GPU, its sum needed on every GPU;
- all-reduce-8x8:  eight atoms, each with a copy on every GPU, every sum needed everywhere;
- reduce-scatter:  eight atoms with a copy on every GPU, sum j needed at partition Sj {size 1};
- all-to-all:      atom Xij on GPU i needed at partition Sj {size 1} (a repartition, m = 1);
- example-5.3:     the paper's Example 5.3 (two partitions of size 4).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from eins.hardware.presets import PRESETS  # noqa: E402
from eins.ir.exprog import AtomDecl, ExProg, Partition, Requirement  # noqa: E402
from eins.passes.synthesize import synthesize_program  # noqa: E402
from eins.passes.synthesize.program import DEFAULT_BUDGET_S  # noqa: E402

N = 8
GPUS = tuple(range(N))


def all_reduce():
    atoms = tuple(AtomDecl(f"A{i}", i) for i in GPUS)
    return ExProg(GPUS, (), atoms, (Requirement(frozenset(a.name for a in atoms), GPUS),))


def all_reduce_8x8():
    atoms = tuple(AtomDecl(f"A{j}_{i}", i) for j in range(N) for i in GPUS)
    outs = tuple(Requirement(frozenset(f"A{j}_{i}" for i in GPUS), GPUS) for j in range(N))
    return ExProg(GPUS, (), atoms, outs)


def reduce_scatter():
    atoms = tuple(AtomDecl(f"A{j}_{i}", i) for j in range(N) for i in GPUS)
    parts = tuple(Partition(f"S{j}", 1) for j in range(N))
    outs = tuple(Requirement(frozenset(f"A{j}_{i}" for i in GPUS), (f"S{j}",))
                 for j in range(N))
    return ExProg(GPUS, parts, atoms, outs)


def all_to_all():
    atoms = tuple(AtomDecl(f"X{i}_{j}", i) for i in GPUS for j in range(N))
    parts = tuple(Partition(f"S{j}", 1) for j in range(N))
    outs = tuple(Requirement(frozenset([f"X{i}_{j}"]), (f"S{j}",)) for i in GPUS
                 for j in range(N))
    return ExProg(GPUS, parts, atoms, outs)


def example_5_3():
    atoms = tuple(AtomDecl(c, i) for i, c in enumerate("ABCDEFGH"))
    return ExProg(GPUS, (Partition("G1", 4), Partition("G2", 4)), atoms,
                  (Requirement(frozenset("ABEF"), ("G1",)),
                   Requirement(frozenset("CDGH"), ("G2",))))


PREAMBLES = {"all-reduce": all_reduce, "all-reduce-8x8": all_reduce_8x8,
             "reduce-scatter": reduce_scatter, "all-to-all": all_to_all,
             "example-5.3": example_5_3}


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help="seconds of modeled simulation per program (default %(default)s; "
                    "'synth s' is the wall-clock time it took here)")
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    args = ap.parse_args(argv)
    print(f"{'preset':<16}{'preamble':<16}{'synth s':>9}{'cands':>7}{'naive ms':>11}"
          f"{'synth ms':>11}{'speedup':>9}")
    for preset in args.presets.split(","):
        for name, make in PREAMBLES.items():
            t0 = time.perf_counter()
            r = synthesize_program(make(), preset, budget_s=args.budget)
            dt = time.perf_counter() - t0
            print(f"{preset:<16}{name:<16}{dt:9.3f}{r.evaluated:7d}{r.naive_s * 1e3:11.2f}"
                  f"{r.total_s * 1e3:11.2f}{r.naive_s / r.total_s:8.2f}x")


if __name__ == "__main__":
    main()
