"""The GPU runtime checked and timed (issue 8): one command, no network.

    python benchmarks/gpu_check.py                 # on a GPU machine (< 5 min on one H200)
    python benchmarks/gpu_check.py --interpret     # the CPU smoke run (tiny shapes, seconds)
    python benchmarks/gpu_check.py --out gpu.json  # where the JSON goes (default gpu_check.json)

(a) Correctness, against eins.jit: FFN; the LLaMA tiny and small blocks, packed and
    batched; chains A, B, E at test scale; p in {1, 2, 4, 8} mapped round-robin onto the
    GPUs present (all on one GPU on a one-GPU machine); naive and optimized schedules;
    eager and CUDA graphs.
(b) Speed: the paper block (LLaMA, d_model 4096) in float16 and bfloat16, 1 x 4K and
    1 x 8K tokens, p = 1 and p = 8 (mapped), weights placed and graphs on, against a plain
    PyTorch block (cuBLAS matmuls + scaled_dot_product_attention) in the same run, both
    timed with CUDA events: warm, median of ``--reps`` (>= 10) calls. Also each call's
    host<->device bytes, with x on the device and with x on the host.

``--interpret`` (the default without a GPU) runs a reduced (a) and a tiny (b) on the CPU
through backend="interpret" (Triton's interpreter); its times say nothing about a GPU, it
only shows the whole path works (tests/test_gpu_runtime.py runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import eins  # noqa: E402
from eins.models import chains, llama  # noqa: E402


def ffn(x, w1, b1, w2):
    h = eins.gelu(x @ w1 + b1, approximate=False)
    return (h * 0.5) @ w2 + x


def correctness_workloads(smoke: bool) -> dict:
    rng = np.random.default_rng(0)
    f32 = np.float32
    out = {"ffn": (ffn, (rng.standard_normal((8, 16)).astype(f32),
                         rng.standard_normal((16, 24)).astype(f32),
                         rng.standard_normal(24).astype(f32),
                         rng.standard_normal((24, 16)).astype(f32)))}
    cfgs = [("tiny", llama.TINY)] + ([] if smoke else [("small", llama.SMALL)])
    for name, cfg in cfgs:
        w = llama.init_weights(cfg, rng)
        segs = (4, 12, 16)
        cos, sin = llama.rope_tables(16, cfg.head_dim, segs)
        out[f"llama-{name}-packed"] = (llama.block_fn(cfg, segs), (
            rng.standard_normal((16, cfg.d_model)).astype(f32), w, cos, sin))
        if not smoke:
            cb, sb = llama.rope_tables(8, cfg.head_dim, None)
            out[f"llama-{name}-batched"] = (llama.block_fn(cfg, None), (
                rng.standard_normal((2, 8, cfg.d_model)).astype(f32), w, cb, sb))
    for c in (["B"] if smoke else ["A", "B", "E"]):
        ch = chains.chain(c, scale=1024)
        out[f"chain{c}"] = (ch.fn, tuple(ch.arrays(rng)))
    return out


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check_correctness(backend, smoke, rows):
    ps = [1, 2] if smoke else [1, 2, 4, 8]
    schedules = ["naive"] if smoke else ["naive", "optimized"]
    for name, (fn, args) in correctness_workloads(smoke).items():
        want = eins.jit(fn)(*args)
        for p in ps:
            for sched in schedules:
                low = eins.distribute(fn, devices=p, schedule=sched,
                                      synthesis_budget_s=0.05).lower(*args)
                for graphs in (False, True):
                    t = time.perf_counter()
                    c = low.compile(backend, graphs=graphs)
                    got = c(*args)
                    again = c(*args)   # graphs: the second call is a pure replay
                    err = max(rel_err(got, want), rel_err(again, want))
                    ok = err <= 1e-4   # float32 at test scale (sums over <= 96 terms)
                    rows.append({"section": "correctness", "workload": name, "p": p,
                                 "schedule": sched, "graphs": graphs, "rel_err": err,
                                 "ok": ok, "device_map": c.stats()["device_map"],
                                 "seconds": round(time.perf_counter() - t, 3)})
                    print(f"  {name:22s} p={p} {sched:9s} {'graphs' if graphs else 'eager ':6s}"
                          f" rel_err={err:.2e} {'ok' if ok else 'FAIL'}", flush=True)


# ----------------------------------------------------------------------------- speed
def torch_block(x, w, cos, sin, cfg, segments=None):
    """A plain PyTorch LLaMA block: cuBLAS matmuls, SDPA (causal, GQA), in x's dtype."""
    import torch
    import torch.nn.functional as F
    hq, hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def rms(t, g):
        tf = t.float()
        return (g.float() * tf * torch.rsqrt(tf.square().mean(-1, keepdim=True) + cfg.eps)
                ).to(t.dtype)

    def heads(t, n):
        return t.unflatten(-1, (n, dh)).transpose(-2, -3)

    def rope(t):
        h = dh // 2
        return t * cos + torch.cat([-t[..., h:], t[..., :h]], -1) * sin

    xn = rms(x, w["attn_norm"])
    q, k, v = rope(heads(xn @ w["wq"], hq)), rope(heads(xn @ w["wk"], hkv)), \
        heads(xn @ w["wv"], hkv)
    ends = segments or (x.shape[-2],)
    parts, start = [], 0
    for end in ends:
        parts.append(F.scaled_dot_product_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], is_causal=True,
            enable_gqa=True))
        start = end
    a = torch.cat(parts, -2).transpose(-2, -3).flatten(-2)
    h = x + a @ w["wo"]
    hn = rms(h, w["ffn_norm"])
    return h + (F.silu(hn @ w["w1"]) * (hn @ w["w3"])) @ w["w2"]


def _timer(backend):
    """(start, stop) -> milliseconds: CUDA events on the GPU, perf_counter on the CPU."""
    import torch
    if backend == "cuda":
        def run(f):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            f()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        return run

    def run_cpu(f):
        t = time.perf_counter()
        f()
        return (time.perf_counter() - t) * 1e3
    return run_cpu


def _weights(cfg, dtype, dev, gen):
    """Random block weights made on the device (norm weights near 1, projections
    ~ N(0, 1/fan_in)), without numpy copies of the paper-sized ones."""
    import torch
    from eins.runtime.gpu_ops import torch_dtype
    from eins.ir.types import as_dtype
    tdt = torch_dtype(as_dtype(dtype))
    out = {}
    for k, sd in llama.weight_shapes(cfg, dtype).items():
        r = torch.randn(sd.shape, generator=gen, device=dev, dtype=torch.float32)
        r = 1.0 + 0.1 * r if len(sd.shape) == 1 else r / sd.shape[0] ** 0.5
        out[k] = r.to(tdt)
    return out


def speed(backend, smoke, reps, rows):
    import torch
    from eins.runtime.gpu_ops import from_numpy, to_numpy
    dev = "cuda" if backend == "cuda" else "cpu"
    cfg = llama.TINY if smoke else llama.PAPER
    tokens = [16] if smoke else [4096, 8192]
    dtypes = ["float32"] if smoke else ["float16", "bfloat16"]
    ps = [1, 2] if smoke else [1, 8]
    timer = _timer(backend)
    gen = torch.Generator(device=dev).manual_seed(0)
    for dtype in dtypes:
        tw = _weights(cfg, dtype, dev, gen)
        for s in tokens:
            tx = 0.5 * torch.randn((s, cfg.d_model), generator=gen, device=dev,
                                   dtype=torch.float32).to(tw["wq"].dtype)
            tc, ts = (from_numpy(a).to(dev) for a in
                      llama.rope_tables(s, cfg.head_dim, None, dtype=dtype))
            x_host = to_numpy(tx)
            ref = torch_block(tx, tw, tc, ts, cfg)
            for _ in range(3):
                torch_block(tx, tw, tc, ts, cfg)
            t_torch = statistics.median(timer(lambda: torch_block(tx, tw, tc, ts, cfg))
                                        for _ in range(reps))
            shapes = (eins.ShapeDtype((s, cfg.d_model), dtype),
                      llama.weight_shapes(cfg, dtype),
                      eins.ShapeDtype((s, cfg.head_dim), dtype),
                      eins.ShapeDtype((s, cfg.head_dim), dtype))
            for p in ps:
                t0 = time.perf_counter()
                c = eins.distribute(llama.block_fn(cfg, None), devices=p).lower(
                    *shapes).compile(backend)
                plan_s = time.perf_counter() - t0
                c.place(tx, tw, tc, ts)
                out = c(tx, tw, tc, ts)
                err = rel_err(to_numpy(out.float()), to_numpy(ref.float()))
                for _ in range(2):
                    c(tx, tw, tc, ts)
                t_eins = statistics.median(timer(lambda: c(tx, tw, tc, ts)) for _ in range(reps))
                dev_stats = c.stats()
                c(x_host, tw, tc, ts)   # x from the host: only x moves
                host_stats = c.stats()
                row = {"section": "speed", "dtype": dtype, "tokens": s, "p": p,
                       "eins_ms": round(t_eins, 3), "torch_ms": round(t_torch, 3),
                       "ratio": round(t_eins / t_torch, 3), "rel_err_vs_torch": err,
                       "h2d_bytes_x_on_device": dev_stats["h2d_bytes"],
                       "h2d_bytes_x_on_host": host_stats["h2d_bytes"],
                       "d2h_bytes": dev_stats["d2h_bytes"],
                       "device_copy_bytes": dev_stats["total_bytes"],
                       "compile_s": round(plan_s, 2), "device_map": dev_stats["device_map"]}
                rows.append(row)
                print(f"  {dtype:8s} 1x{s:<6d} p={p} eins {t_eins:9.3f} ms  torch "
                      f"{t_torch:9.3f} ms  x{row['ratio']:.2f}  err {err:.1e}  h2d/call "
                      f"{row['h2d_bytes_x_on_device']} (x on host: "
                      f"{row['h2d_bytes_x_on_host']})", flush=True)
                del c
                if backend == "cuda":
                    torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interpret", "--cpu-smoke", action="store_true", dest="interpret",
                    help="CPU smoke run (Triton interpreter, tiny shapes)")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip-speed", action="store_true")
    a = ap.parse_args(argv)
    from eins.runtime.gpu import gpu_count
    backend = "interpret" if a.interpret or not gpu_count() else "cuda"
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    smoke = backend == "interpret"
    if smoke and not a.interpret:
        print("no GPU visible: running the CPU smoke mode (--interpret)")
    rows = []
    t = time.perf_counter()
    print(f"(a) correctness vs eins.jit on backend {backend!r}")
    check_correctness(backend, smoke, rows)
    if not a.skip_speed:
        print(f"(b) speed on backend {backend!r}"
              + (" (CPU interpreter: times mean nothing)" if smoke else ""))
        speed(backend, smoke, a.reps, rows)
    bad = [r for r in rows if r["section"] == "correctness" and not r["ok"]]
    result = {"backend": backend, "gpus": gpu_count(), "seconds": time.perf_counter() - t,
              "correct": f"{sum(r.get('ok', False) for r in rows)}/"
                         f"{sum(r['section'] == 'correctness' for r in rows)}",
              "rows": rows}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"correct {result['correct']}, {result['seconds']:.1f} s; JSON in {a.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
