"""Tile configs of eins's Triton attention and matmul kernels swept on a GPU (issue 9), so
that the configs in eins/kernels/{attention,matmul}.py can be chosen from
measurements instead of Triton's tutorials.

The first H200 run (benchmarks/results/h200-2026-12-04/) measured the tutorials' tiles at
2.0x SDPA's time for attention at 8K tokens and 0.33-0.75x torch.matmul's TFLOP/s at the
paper's projection shapes. This sweep times every config of a small grid at those shapes,
each call replayed from a CUDA graph (gpu_kernels.py's ``measure.graph``: the GPU's own
time) and checked against the reference (``max_err``; a config whose result is off is
marked ``ok: false``, never "fastest"). One row per (kernel, config, shape); the summary
names the fastest correct config per shape, its time against the reference (SDPA on
repeated key/value heads, ``torch.matmul``) and against the config eins uses today.

``python benchmarks/gpu_tune.py [--json out.json] [--budget-s S]`` on a GPU; each config is
one job under a watchdog (``--case-timeout-s``), the JSON rewritten after every job
(``--resume`` continues after a killed one), jobs not started within the budget listed as
skipped. ``--interpret``: tiny shapes and two configs per kernel on CPU tensors under
Triton's interpreter (a smoke test, tests/test_triton_bench.py; its times mean nothing).
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
ATTENTION_GRID = [(bm, bn, w, st) for bm, bn in ((64, 64), (64, 128), (128, 32), (128, 64),
                                                  (128, 128))
                  for w in (4, 8) for st in (2, 3)]
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
MATMUL_GRID = [(128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3),
               (256, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4),
               (128, 128, 128, 8, 8, 3), (128, 64, 64, 8, 4, 4), (64, 256, 64, 8, 4, 4),
               (256, 64, 64, 8, 4, 4), (128, 256, 32, 8, 8, 5), (256, 256, 64, 8, 8, 3)]
TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5}


def _attention_inputs(device, dtype, s, hq, hkv, d):
    import torch
    gen = torch.Generator(device=device).manual_seed(s)
    q, k, v = (torch.randn(1, h, s, d, device=device, generator=gen).to(dtype)
               for h in (hq, hkv, hkv))
    return q, k, v


def attention_jobs(device, measure, dtype, lengths, hq=4, hkv=1, d=128, grid=None):
    """[(job id, thunk -> rows)]: SDPA on repeated k/v first (the reference), then one job
    per config of ``grid`` over every length."""
    import torch
    import torch.nn.functional as F
    from eins.kernels.attention import attention, config_for
    name = str(dtype)[6:]
    cache = {}

    def inputs(s):
        if s not in cache:
            cache.clear()
            q, k, v = _attention_inputs(device, dtype, s, hq, hkv, d)
            kr, vr = (t.repeat_interleave(hq // hkv, -3) for t in (k, v))
            ref = F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(),
                                                 is_causal=True) if device == "cpu" else \
                F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
            cache[s] = (q, k, v, kr, vr, ref.float())
        return cache[s]

    def shape(s):
        return f"S={s} Hq={hq} Hkv={hkv} D={d} causal"

    def reference():
        rows = []
        for s in lengths:
            q, k, v, kr, vr, _ = inputs(s)
            rows.append({"kernel": "attention", "config": "sdpa", "shape": shape(s),
                         "dtype": name, "ms": _time(measure, lambda: F.scaled_dot_product_attention(
                             q, kr, vr, is_causal=True)), "ok": True})
        return rows

    def one(cfg):
        rows = []
        for s in lengths:
            q, k, v, _, _, ref = inputs(s)
            out = torch.empty_like(q)
            t = _time(measure, lambda: attention(q, k, v, out, causal=True, impl="triton",
                                                 config=cfg))
            err = float((out.float() - ref).abs().max())
            rows.append({"kernel": "attention", "config": list(cfg), "shape": shape(s),
                         "dtype": name, "ms": t, "max_err": err, "ok": err <= TOL[name],
                         "current": tuple(cfg) == tuple(config_for(q))})
        return rows

    return [(f"attention/{name}/sdpa", reference)] + [
        (f"attention/{name}/{'x'.join(map(str, c))}", lambda c=c: one(c))
        for c in (grid or ATTENTION_GRID)]


def matmul_jobs(device, measure, dtype, shapes, grid=None):
    """[(job id, thunk -> rows)]: torch.matmul first (the reference), then one job per
    config of ``grid`` over every shape."""
    import torch
    from eins.kernels.matmul import config_for, matmul
    name = str(dtype)[6:]
    made = {}

    def inputs(m, k, n):
        if (m, k, n) not in made:
            made.clear()
            gen = torch.Generator(device=device).manual_seed(m + k + n)
            a = torch.randn(m, k, device=device, generator=gen).to(dtype)
            b = (torch.randn(k, n, device=device, generator=gen) / math.sqrt(k)).to(dtype)
            ref = torch.matmul(a.float(), b.float()).to(dtype).float() if device == "cpu" \
                else torch.matmul(a, b).float()
            made[(m, k, n)] = (a, b, ref)
        return made[(m, k, n)]

    def reference():
        rows = []
        for label, m, k, n in shapes:
            a, b, _ = inputs(m, k, n)
            out = torch.empty(m, n, device=device, dtype=dtype)
            t = _time(measure, lambda: torch.matmul(a, b, out=out))
            rows.append({"kernel": "matmul", "config": "torch.matmul",
                         "shape": f"{label} {m}x{k}x{n}", "dtype": name, "ms": t,
                         "tflops": _tflops(2 * m * n * k, t), "ok": True})
        return rows

    def one(cfg):
        rows = []
        for label, m, k, n in shapes:
            a, b, ref = inputs(m, k, n)
            out = torch.empty(m, n, device=device, dtype=dtype)
            t = _time(measure, lambda: matmul(a, b, out, impl="triton", config=cfg))
            err = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            rows.append({"kernel": "matmul", "config": list(cfg),
                         "shape": f"{label} {m}x{k}x{n}", "dtype": name, "ms": t,
                         "tflops": _tflops(2 * m * n * k, t), "max_err": err,
                         "ok": err <= TOL[name],
                         "current": tuple(cfg) == tuple(config_for(a, b, m))})
        return rows

    return [(f"matmul/{name}/torch", reference)] + [
        (f"matmul/{name}/{'x'.join(map(str, c))}", lambda c=c: one(c))
        for c in (grid or MATMUL_GRID)]


def _time(measure, fn):
    """ms per call: graph-replayed on a GPU (the GPU's own time), else one timed call."""
    if measure.graph is not None:
        t = measure.graph(fn)
        if not isinstance(t, str):
            return round(t, 4)
        raise RuntimeError(f"CUDA graph capture failed: {t}")
    return round(measure(fn), 4)


def _tflops(flop, ms):
    return round(flop / ms / 1e9, 2) if ms else None


def jobs(device="cuda", reps=10):
    import torch
    from gpu_kernels import make_timer, matmul_shapes
    measure = make_timer(device, reps)
    if device == "cpu":
        return (attention_jobs(device, measure, torch.float16, [40], hq=2, hkv=1, d=16,
                               grid=[(32, 32, 1, 1), (16, 32, 1, 1)]) +
                matmul_jobs(device, measure, torch.float16, [("tiny", 33, 40, 24)],
                            grid=[(32, 32, 32, 4, 1, 1), (16, 32, 16, 4, 1, 1)]))
    from eins.kernels.attention import CONFIGS as ATTENTION_CONFIGS
    from eins.kernels.matmul import CONFIGS as MATMUL_CONFIGS
    # today's Hopper configs first, then the two sweeps interleaved: a budget cut leaves
    # both kernels' references, today's configs and as many others of each
    att = attention_jobs(device, measure, torch.float16, [8192, 32768],
                         grid=_first(ATTENTION_GRID, ATTENTION_CONFIGS[("sm90", 128)]))
    mm = matmul_jobs(device, measure, torch.float16, matmul_shapes(4096),
                     grid=_first(MATMUL_GRID, MATMUL_CONFIGS[("sm90", 2)]))
    return [j for pair in itertools.zip_longest(att, mm) for j in pair if j is not None]


def _first(grid, cfg):
    """``grid`` with ``cfg`` first (added if missing)."""
    return [tuple(cfg)] + [c for c in grid if tuple(c) != tuple(cfg)]


def best(rows) -> list:
    """Per (kernel, dtype, shape): the fastest correct config, the reference's time and the
    current config's, as summary rows."""
    out = []
    key = lambda r: (r["kernel"], r["dtype"], r["shape"])  # noqa: E731
    ok = [r for r in rows if "ms" in r and r.get("ok")]
    for k, group in itertools.groupby(sorted(ok, key=key), key=key):
        group = list(group)
        ref = [r for r in group if isinstance(r["config"], str)]
        tried = [r for r in group if not isinstance(r["config"], str)]
        if not tried:
            continue
        fast = min(tried, key=lambda r: r["ms"])
        cur = [r for r in tried if r.get("current")]
        row = {"kernel": k[0], "dtype": k[1], "shape": k[2], "best_config": fast["config"],
               "best_ms": fast["ms"], "configs_timed": len(tried)}
        if ref:
            row["reference"] = ref[0]["config"]
            row["reference_ms"] = ref[0]["ms"]
            row["best_vs_reference"] = round(fast["ms"] / ref[0]["ms"], 3)
        if cur:
            row["current_ms"] = cur[0]["ms"]
            row["best_vs_current"] = round(fast["ms"] / cur[0]["ms"], 3)
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    from device_harness import add_job_options, run_jobs
    from gpu_kernels import format_table
    add_job_options(ap, 120.0, 60, "tiny shapes, two configs per kernel, CPU tensors "
                                   "(smoke test)")
    args = ap.parse_args(argv)
    res = run_jobs(ap, args, lambda device: jobs(device, reps=args.reps), 60,
                   lambda rows: " ".join(f"{r['ms']}ms" for r in rows))
    summary = best(res.rows)
    print(format_table(summary))
    return res.rows, summary


if __name__ == "__main__":
    main()
