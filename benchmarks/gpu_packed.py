"""Section (e) of benchmarks/gpu_check.py: issue 36's GPU target, a stream of packed
batches whose document boundaries change every batch, through ONE compiled program.

The paper block (``llama.packed_block_fn``, bfloat16, 1 x 32K tokens) at p = 8 logical
devices on the one GPU (as the speed section's p = 8 rows), lowered once with the segment
ends as an int array (``llama.padded_ends`` to bench_packed's ``MAX_SEGMENTS``) and compiled
once for cuda with CUDA graphs on (the default rebalance: the row says which). Then 50
batches of log-normal documents (bench_packed.py's ``stream``, median 1,536 tokens at 32K
scaled to the batch length, sigma 1.4: the stream this check measured before bench_packed's
lengths were fitted to RefinedWeb's), each called with its own ends and RoPE tables
(positions restarting at each document), weights and x placed. Per batch:

- the output against an independent PyTorch reference: benchmarks/block_ref.py's block with
  ``scaled_dot_product_attention`` per document, its RoPE tables computed in torch from
  the ends (not ``llama.rope_tables``), within block_ref's ``TOL`` for the dtype;
- ``first_ms``: the call that first sees the batch's ends; ``ms``: the median of ``reps``
  (at most 3) calls after one more warm call, CUDA events around each call (host work
  included: the per-call rebalance, the ends' copy, the graph replay).

``compiled.stats()``'s ``traces``, ``plans``, ``kernel_compiles`` and ``graph_captures``
after batch 1 and after the last must be equal ("flat"; ``lowerings`` and ``rebalances``
are recorded beside them).

Then, one case each, batches in a spread order (0, 25, 12, 37, 6, ...) while the section's
budget lasts: the block compiled for that batch alone (``llama.block_fn(cfg, ends)``: the
ends a static tuple, the same distribute, graphs on), checked against the reference and
timed the same way, interleaved with the stream's program on the same batch; ``ratio`` is
the stream program's ms over the alone program's (target: at most 1.1 on every batch
timed).

``--interpret`` (smoke): the TINY block, 128 tokens, float32, 3 batches and 3 batches
alone, on Triton's interpreter with the reference in torch on the CPU (the path, not the
speed).
"""
from __future__ import annotations

import gc
import statistics
import time

import eins
from eins.ir.plan import Tuning
from eins.models import llama
from bench_packed import MAX_SEGMENTS, stream
from block_ref import TOL, timer, torch_block, weights

GPU_RUN = {"cfg": llama.PAPER, "tokens": 32768, "batches": 50, "p": 8,
           "dtype": "bfloat16"}
# the smoke's block is small enough to run on one of 8 devices: all 8 used, as at 32K
SMOKE_RUN = {"cfg": llama.TINY, "tokens": 128, "batches": 3, "p": 8,
             "dtype": "float32", "alone": 3, "rounds": 1, "warm": 0,
             "tuning": Tuning(device_subsets=False)}
FLAT = ("traces", "plans", "kernel_compiles", "graph_captures")   # must not grow
COUNTERS = FLAT + ("lowerings", "rebalances")
TARGET_RATIO = 1.1
# the documents' log-normal at 32K tokens: kept from before bench_packed's fit (whose
# documents, median 288, put a median 64 in a 32K batch instead of 10)
MEDIAN, SIGMA = 1536.0, 1.4
MIN_ALONE = 3   # batches compiled alone for the target to count as measured
PACKED_KEYS = ["case", "batch", "batches", "docs", "equal", "worst_rel_err", "flat",
               "median_ms", "alone_ms", "stream_ms", "ratio", "rel_err", "ok", "seconds",
               "error"]


def batches_of(run) -> list:
    """The run's stream of segment-end tuples (the same in every process: seeded)."""
    median = MEDIAN * run["tokens"] / 32768   # documents scale with the batch
    return stream(run["batches"], run["tokens"], median, SIGMA, seed=run["tokens"])


def spread(n: int) -> list:
    """0..n-1 ordered so that every prefix is spread over the stream (0, n/2, n/4, 3n/4,
    n/8, ...): a budget cut still leaves batches from all of it."""
    out, k = [0], 2
    while len(out) < n:
        for j in range(1, k, 2):
            if j * n // k not in out:
                out.append(j * n // k)
        k *= 2
    return out[:n]


def torch_rope(s, head_dim, ends, dtype, dev, base=10000.0):
    """(cos, sin) [s, head_dim] with positions restarting at each document, computed here
    in torch (the reference does not share ``llama.rope_tables``): angle pos * base ** (-2i
    / head_dim), the half repeated (the rotate_half layout)."""
    import torch  # heavy: only the device checks
    pos = torch.arange(s, dtype=torch.float64, device=dev)
    start = 0
    for end in ends:
        pos[start:end] -= start
        start = end
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=dev) / head_dim)
    ang = pos[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).abs().max() /
                 ref.float().abs().max().clamp_min(1e-30))


def packed_cases(backend, smoke, reps, rows=()):
    """[(case id, description, thunk)]: the stream first, then the batches compiled alone.
    ``rows``: the results so far (a resumed run's alone cases take the stream's times from
    its row when its program is not in this process)."""
    import torch  # heavy: only the device checks
    from eins.runtime.gpu_ops import from_numpy
    run = SMOKE_RUN if smoke else GPU_RUN
    cfg, s, p, dtype = run["cfg"], run["tokens"], run["p"], run["dtype"]
    dev = "cuda" if backend == "cuda" else "cpu"
    time_it = timer(backend)
    n_reps = max(1, min(reps, 3))   # 50 batches, and 2 programs per alone case
    batches = batches_of(run)
    state = {}
    tag = f"{dtype}/1x{s}/p{p}"

    def inputs():
        if "x" not in state:
            gen = torch.Generator(device=dev).manual_seed(0)
            state["w"] = weights(cfg, dtype, dev, gen)
            state["x"] = 0.5 * torch.randn((s, cfg.d_model), generator=gen, device=dev,
                                           dtype=torch.float32).to(state["w"]["wq"].dtype)
        return state["x"], state["w"]

    def batch_args(ends):
        """(eins's tables and ends, the reference's tables): eins's from llama.rope_tables
        on the padded ends, on the device; the reference's from torch_rope."""
        e = llama.padded_ends(ends, MAX_SEGMENTS, s)
        cos, sin = (from_numpy(a).to(dev) for a in
                    llama.rope_tables(s, cfg.head_dim, e, dtype=dtype))
        tdt = state["w"]["wq"].dtype
        return (cos, sin, e), torch_rope(s, cfg.head_dim, ends, tdt, dev)

    def timed(f):
        for _ in range(run.get("warm", 1)):   # warm calls
            f()
        return statistics.median(time_it(f) for _ in range(n_reps))

    def free():
        if backend == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def stream_case():
        free()
        x, w = inputs()
        shapes = (eins.ShapeDtype((s, cfg.d_model), dtype), llama.weight_shapes(cfg, dtype),
                  eins.ShapeDtype((s, cfg.head_dim), dtype),
                  eins.ShapeDtype((s, cfg.head_dim), dtype),
                  eins.ShapeDtype((MAX_SEGMENTS,), "int32"))
        t0 = time.perf_counter()
        low = eins.distribute(llama.packed_block_fn(cfg), devices=p,
                              tuning=run.get("tuning")).lower(*shapes)
        c = low.compile(backend, graphs=True)
        compile_s = time.perf_counter() - t0
        first_counts, per = None, []
        for b, ends in enumerate(batches):
            (cos, sin, e), (rc, rs) = batch_args(ends)
            if b == 0:
                c.place(x, w, cos, sin, e)   # x and the weights stay; the rest moves per call
            got = []
            t0 = time.perf_counter()
            first_ms = time_it(lambda: got.append(c(x, w, cos, sin, e)))
            wall_s = time.perf_counter() - t0
            out = got.pop()
            err = rel_err(out, torch_block(x, w, rc, rs, cfg, segments=ends))
            ms = timed(lambda: c(x, w, cos, sin, e))
            if b == 0:
                first_counts = {k: c.stats()[k] for k in COUNTERS}
                first_call_s = wall_s
            longest = max(y - a for a, y in zip((0,) + ends, ends))
            per.append({"batch": b, "docs": len(ends), "longest": longest,
                        "first_ms": round(first_ms, 3), "ms": round(ms, 3),
                        "rel_err": err, "ok": err <= TOL[dtype]})
            print(f"  batch {b:3d}: {len(ends):3d} docs (longest {longest:6d}) "
                  f"{ms:9.3f} ms (first call {first_ms:9.3f}) rel_err {err:.2e} "
                  f"{'ok' if per[-1]['ok'] else 'FAIL'}", flush=True)
            del out
        st = c.stats()
        last_counts = {k: st[k] for k in COUNTERS}
        flat = all(first_counts[k] == last_counts[k] for k in FLAT)
        state.update(compiled=c, per=per)
        att = [r["splits"] for r in low.plan_table() if r["op"] == "attention"]
        ms = [r["ms"] for r in per]
        row = {"batches": len(per), "equal": sum(r["ok"] for r in per),
               "worst_rel_err": max(r["rel_err"] for r in per), "flat": flat,
               "counters_after_batch_1": first_counts, "counters_after_last": last_counts,
               "backend": backend, "graph_replays": st["graph_replays"],
               "rebalance": c.rebalance, "capacity_program": c.capacity is not None,
               "attention_splits": att, "median_ms": round(statistics.median(ms), 3),
               "max_ms": max(ms), "compile_s": round(compile_s, 2),
               "first_call_s": round(first_call_s, 2), "per_batch": per,
               "ok": flat and all(r["ok"] for r in per)}
        print(f"  stream: {row['equal']}/{row['batches']} equal to the reference, counters "
              f"{'flat' if flat else 'GREW'} ({first_counts} -> {last_counts}), median "
              f"{row['median_ms']} ms, attention {att}", flush=True)
        return row

    def stream_ms(b):
        """The stream's per-batch ms of batch ``b`` from its row (another process ran it)."""
        got = [r for r in rows if r.get("section") == "packed" and "per_batch" in r]
        return got[-1]["per_batch"][b]["ms"] if got and b < len(got[-1]["per_batch"]) \
            else None

    def alone_case(b):
        free()
        ends = batches[b]
        x, w = inputs()
        (cos, sin, e), (rc, rs) = batch_args(ends)
        shapes = (eins.ShapeDtype((s, cfg.d_model), dtype), llama.weight_shapes(cfg, dtype),
                  eins.ShapeDtype((s, cfg.head_dim), dtype),
                  eins.ShapeDtype((s, cfg.head_dim), dtype))

        def make():
            a = eins.distribute(llama.block_fn(cfg, ends), devices=p,
                                tuning=run.get("tuning")).lower(*shapes) \
                .compile(backend, graphs=True)
            a.place(x, w, cos, sin)
            return a, a(x, w, cos, sin)   # its Triton compiles and its capture
        t0 = time.perf_counter()
        alone = None
        try:
            alone, out = make()
        except torch.OutOfMemoryError:
            pass   # retried after the handler: its traceback holds make()'s frame
        if alone is None:
            # both programs do not fit: the stream's program goes (its times from its row)
            state.pop("compiled", None)
            free()
            alone, out = make()
        compile_s = time.perf_counter() - t0
        err = rel_err(out, torch_block(x, w, rc, rs, cfg, segments=ends))
        del out
        c = state.get("compiled")
        ms_alone, ms_stream = [], []
        for _ in range(run.get("rounds", 2)):   # interleaved: a drifting clock moves both
            ms_alone.append(timed(lambda: alone(x, w, cos, sin)))
            if c is not None:
                ms_stream.append(timed(lambda: c(x, w, cos, sin, e)))
        a_ms = min(ms_alone)
        st_ms = min(ms_stream) if ms_stream else stream_ms(b)
        del alone
        free()
        row = {"batch": b, "docs": len(ends), "alone_ms": round(a_ms, 3),
               "stream_ms": None if st_ms is None else round(st_ms, 3),
               "stream_ms_from": "this case" if ms_stream else "the stream's row",
               "ratio": None if st_ms is None else round(st_ms / a_ms, 3),
               "rel_err": err, "compile_s": round(compile_s, 2), "equal": err <= TOL[dtype],
               "ok": err <= TOL[dtype] and st_ms is not None}
        print(f"  batch {b:3d} alone: {a_ms:9.3f} ms, the stream's program {st_ms} ms: "
              f"x{row['ratio']} (rel_err {err:.2e}, compiled and captured in "
              f"{compile_s:.1f} s)", flush=True)
        return row

    out = [(f"packed/stream/{tag}", {"dtype": dtype, "tokens": s, "p": p}, stream_case)]
    order = spread(len(batches))[:run.get("alone", len(batches))]
    out += [(f"packed/alone/{tag}/b{b}", {"dtype": dtype, "tokens": s, "p": p},
             lambda b=b: alone_case(b)) for b in order]
    return out


def packed_target(rows) -> dict:
    """Issue 36's GPU target read off the rows: ``state`` is "met", "not met" or "not run"
    (no stream row; or "not run on a GPU" where it ran on the interpreter: the path whole
    or broken, its times meaning nothing), with the numbers it rests on and ``why`` it is
    not met. Met: the stream ran on cuda, every batch equal to the reference, the counters
    flat after batch 1, at least MIN_ALONE batches compiled alone, every one equal to the
    reference and within TARGET_RATIO of the stream's program, no case failed."""
    st = [r for r in rows if r.get("section") == "packed" and "per_batch" in r]
    alone = [r for r in rows if r.get("section") == "packed" and "alone_ms" in r]
    # an alone case killed (its step's time ran out, or its watchdog) was cut, not failed:
    # the batches timed before it stand
    cut = [r for r in rows if r.get("section") == "packed" and "/alone/" in r.get("case", "")
           and str(r.get("error", "")).startswith("killed")]
    failed = [r for r in rows if r.get("section") == "packed" and r.get("error")
              and r not in cut]
    if not st:
        return {"state": "not run", "why": failed[0]["error"][:200] if failed else
                "no stream row"}
    s = st[-1]
    ratios = [r["ratio"] for r in alone if r.get("ratio") is not None]
    out = {"batches": s["batches"], "equal": s["equal"], "worst_rel_err": s["worst_rel_err"],
           "flat": s["flat"], "median_ms": s["median_ms"], "alone_timed": len(ratios),
           "worst_ratio": max(ratios) if ratios else None,
           "alone_equal": sum(bool(r.get("equal")) for r in alone), "alone_cut": len(cut)}
    why = []   # what fails the path (any backend) ...
    if s["equal"] < s["batches"]:
        why.append(f"{s['batches'] - s['equal']} batch(es) differ from the reference")
    if not s["flat"]:
        why.append(f"counters grew: {s['counters_after_batch_1']} -> "
                   f"{s['counters_after_last']}")
    if len(ratios) < MIN_ALONE:
        why.append(f"{len(ratios)} batch(es) timed alone, {MIN_ALONE} needed")
    if out["alone_equal"] < len(alone):
        why.append("an alone program differs from the reference")
    why += [f"{r['case']}: {r['error'][:120]}" for r in failed]
    if s.get("backend") != "cuda":   # the CPU dry run: the path, not the speed
        out["state"] = f"not run on a GPU (backend {s.get('backend')}: the path only, " \
            f"{'broken' if why else 'whole'})"
    else:   # ... and on a GPU the speed
        if ratios and max(ratios) > TARGET_RATIO:
            why.append(f"worst ratio {max(ratios)} > {TARGET_RATIO}")
        out["state"] = "not met" if why else "met"
    if why:
        out["why"] = "; ".join(why)
    return out


def target_line(t) -> str:
    """summary.txt's line of issue 36's GPU target (``t``: :func:`packed_target`)."""
    head = (f"issue36 GPU target ({GPU_RUN['batches']} packed batches at 1x"
            f"{GPU_RUN['tokens'] // 1024}K, p={GPU_RUN['p']}, one program, graphs on): "
            f"{t['state']}")
    if "batches" not in t:
        return f"{head} ({t.get('why')})"
    return (f"{head}: {t['equal']}/{t['batches']} batches equal to per-document SDPA "
            f"(worst rel err {t['worst_rel_err']:.2e}), counters "
            f"{'flat' if t['flat'] else 'GREW'} after batch 1, median {t['median_ms']} ms; "
            f"{t['alone_timed']} batch(es) compiled alone, worst ratio x{t['worst_ratio']} "
            f"(target <= {TARGET_RATIO})" + (f"; {t['alone_cut']} cut" if t["alone_cut"]
                                             else "") +
            (f"; why: {t['why']}" if t.get("why") else ""))


def packed_summary(rows) -> dict:
    """gpu_check's summary entry of issue 36's target (see :func:`packed_target`)."""
    return {"issue36_packed_stream_1x32K_p8": packed_target(rows)}
