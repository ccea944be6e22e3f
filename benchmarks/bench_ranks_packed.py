"""Packed batches on the rank runtime (issue 36): a stream of batches whose segment ends are
an int array through ``eins.distribute(..., devices="world")`` under torchrun (gloo, numpy
kernels, this machine's CPU), and the host time each rank spends per batch re-cutting the
plan and lowering its own program (``stats()["rebalance_seconds"]``).

    python benchmarks/bench_ranks_packed.py [--ranks 2 4] [--batches 20] [--tokens 256]
                                            [--sequence]

``--sequence`` forces attention's split by query sequence over every rank (the split
whose boxes each batch moves); by default the DP chooses (a heads split moves none).

``--paper TOKENS`` runs nothing under torchrun: for the paper block at 1xTOKENS on
dgx-h100:N for each N of ``--ranks``, attention split by query sequence over N, it times
in this process (CPU time) what a rank does per batch with a new cut, the re-cut and rank
0's own re-lowering, against re-lowering every device's program (what a single-process
numpy program does per new cut).

Without torchrun's environment it launches ``torchrun --nproc-per-node=N`` for each N and
prints a summary per N from every rank's record. The block is the TINY LLaMA block (the
paper block's function, so its eqns, at sizes the numpy kernels run in milliseconds; its
plan at these sizes is its own, not the paper block's).
Document lengths are bench_packed's ``stream`` with the long-context parameters it drew
before its fitted default (sigma 1.4, median 1,536 of 32K tokens), the median scaled to
the batch, so that the rank runtime's measurements in docs/measured.md stay comparable.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

import eins
from eins.ir.plan import Tuning
from eins.models import llama
from eins.passes.rebalance import recut, runtime_operands
from eins.passes.relower import Family, relower

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_packed import MAX_SEGMENTS, args_for, stream  # noqa: E402  (this directory's)


def rank_main(out, batches, tokens, sequence):
    """One rank: the stream, and per batch (new cut?, rebalance ms, run ms)."""
    cfg = llama.TINY
    rng = np.random.default_rng(0)
    w = llama.init_weights(cfg, rng)
    x = rng.standard_normal((tokens, cfg.d_model)).astype(np.float32)
    fn = llama.packed_block_fn(cfg)
    plan = None
    if sequence:
        e = llama.padded_ends((tokens,), tokens, tokens)
        prog = eins.make_ir(fn)(x, w, *llama.rope_tables(tokens, cfg.head_dim, e), e)
        plan = {i: {"sequence": int(os.environ["WORLD_SIZE"])}
                for i in runtime_operands(prog)}
    f = eins.distribute(fn, devices="world", timeout_s=120, plan=plan,
                        tuning=Tuning(device_subsets=False))
    rows = []
    for ends in stream(batches, tokens, 1536 * tokens / 32768, 1.4):
        e = llama.padded_ends(ends, tokens, tokens)   # room for any batch
        cos, sin = llama.rope_tables(tokens, cfg.head_dim, e)
        before = f.counts["lowerings"]
        f(x, w, cos, sin, e)
        st = f.stats()
        rows.append((st["lowerings"] > before, st["rebalance_seconds"] * 1e3,
                     st["seconds"] * 1e3))
    with open(os.path.join(out, f"rank{f.rank}.json"), "w") as fh:
        json.dump(rows, fh)
    os._exit(0)   # the other ranks may still be writing; skip the group's teardown


def launch(n, batches, tokens, sequence) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix=f"ranks{n}-")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                    "--master-addr=127.0.0.1", f"--master-port={port}", __file__,
                    "--rank-out", out, "--batches", str(batches), "--tokens", str(tokens)]
                   + (["--sequence"] if sequence else []),
                   env=env, check=True, capture_output=True)
    got = {}
    for r in range(n):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            got[r] = json.load(fh)
    return got


def summary(n, ranks) -> str:
    def stats(xs):
        return (f"median {np.median(xs):.2f}, p90 {np.percentile(xs, 90):.2f}, "
                f"max {max(xs):.2f}" if xs else "none")
    lines = [f"{n} ranks:"]
    for r, rows in sorted(ranks.items()):
        rows = rows[1:]   # the first batch also builds the family's lowering
        new = [ms for fresh, ms, _ in rows if fresh]
        kept = [ms for fresh, ms, _ in rows if not fresh]
        run = [ms for _, _, ms in rows]
        lines.append(f"  rank {r}: new cut ({len(new)}) {stats(new)} ms; kept cut "
                     f"({len(kept)}) {stats(kept)} ms; run {stats(run)} ms")
    return "\n".join(lines)


def paper(tokens, n, batches) -> str:
    """Per new cut of the paper block at p = n: re-cut + rank 0's re-lowering, and re-cut +
    the whole program's, CPU ms (alternating which goes first)."""
    cfg = llama.PAPER
    args = args_for(tokens, cfg, True)
    fn = llama.packed_block_fn(cfg)
    ops = runtime_operands(eins.make_ir(fn)(*args))
    comp = eins.distribute(fn, devices=n, topology=f"dgx-h100:{n}",
                           plan={i: {"sequence": n} for i in ops}).lower(*args).compilation
    fams = {"rank": Family(comp, 0), "whole": Family(comp)}
    times = {k: [] for k in fams}
    (_, k), = ops.values()
    for b, ends in enumerate(stream(batches, tokens, 1536 * tokens / 32768, 1.4)):
        arrays = [None] * len(comp.program.inputs)
        arrays[k] = llama.padded_ends(ends, MAX_SEGMENTS, tokens)
        for name in sorted(fams, reverse=b % 2 == 1):
            t0 = time.process_time()
            relower(fams[name], recut(comp, arrays, ops), ops, priced=False)
            times[name].append((time.process_time() - t0) * 1e3)
    return (f"paper block 1x{tokens} on dgx-h100:{n}, {batches} batches: " + "; ".join(
        f"{name} median {np.median(t):.2f} p90 {np.percentile(t, 90):.2f} max {max(t):.2f} ms"
        for name, t in times.items()))


def main(argv=None):
    ap = argparse.ArgumentParser(description="Streams packed batches through the rank "
                                 "runtime under torchrun and prints each rank's host time "
                                 "per batch for re-cutting the plan and lowering its program.")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--sequence", action="store_true",
                    help="split attention by query sequence over every rank")
    ap.add_argument("--paper", type=int, metavar="TOKENS",
                    help="time the paper block's per-batch lowering in this process")
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)   # set by the launch
    a = ap.parse_args(argv)
    if a.rank_out:
        rank_main(a.rank_out, a.batches, a.tokens, a.sequence)
        return
    if a.paper:
        for n in a.ranks:
            print(paper(a.paper, n, a.batches), flush=True)
        return
    for n in a.ranks:
        print(summary(n, launch(n, a.batches, a.tokens, a.sequence)), flush=True)


if __name__ == "__main__":
    main()
