"""The PyTorch reference of benchmarks/gpu_check.py's speed section: the plain PyTorch
paper block, its CUDA-event timer, random weights made on the device, the block's FLOPs and
the GPU's peak for TFLOP/s and percent-of-peak columns, and section (c), the
``torch.compile`` anchors of issue 39 (see gpu_check.py's docstring)."""
from __future__ import annotations

import functools
import gc
import statistics
import time

import eins
from eins.hardware.specs import gpu_spec
from eins.models import llama

TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}   # vs the PyTorch block


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
    # key/value heads repeated to the query heads (as LLaMA's reference code does): SDPA's
    # enable_gqa may fall back to the math kernel, whose S x S scores do not fit at 128K
    k, v = (t.repeat_interleave(hq // hkv, -3) for t in (k, v))
    # SDPA's fused kernels (flash, memory-efficient, cuDNN) take 4-D [B, H, S, D] only: the
    # [H, S, D] heads of an x without a batch dim would run its S x S math kernel
    lead = q.dim() == 3
    if lead:
        q, k, v = q[None], k[None], v[None]
    ends = segments or (x.shape[-2],)
    parts, start = [], 0
    for end in ends:
        parts.append(F.scaled_dot_product_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], is_causal=True))
        start = end
    a = torch.cat(parts, -2)
    a = (a[0] if lead else a).transpose(-2, -3).flatten(-2)
    h = x + a @ w["wo"]
    hn = rms(h, w["ffn_norm"])
    return h + (F.silu(hn @ w["w1"]) * (hn @ w["w3"])) @ w["w2"]


def timer(backend):
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


def weights(cfg, dtype, dev, gen):
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


@functools.lru_cache(maxsize=None)
def block_flops(cfg, tokens) -> int:
    """The paper block's FLOPs at ``tokens`` as eins counts them (each primitive's
    ``flops``: 2mkn per matmul, causal attention's (query, key) pairs, the elementwise
    work): the numerator of every row's TFLOP/s."""
    args = (eins.ShapeDtype((tokens, cfg.d_model), "float16"),
            llama.weight_shapes(cfg, "float16"), eins.ShapeDtype((tokens, cfg.head_dim),
                                                                  "float16"),
            eins.ShapeDtype((tokens, cfg.head_dim), "float16"))
    prog = eins.make_ir(llama.block_fn(cfg, None))(*args)
    return int(sum(e.primitive.flops([a.type for a in e.inputs], [v.type for v in e.outputs],
                                     **e.params) for e in prog.eqns))


def peak_flops(backend) -> float | None:
    """The GPU's dense 16-bit FLOP/s from its data sheet (None on the CPU or an unknown
    GPU)."""
    if backend != "cuda":
        return None
    import torch
    try:
        return gpu_spec(torch.cuda.get_device_name(0))[1]["flops"]
    except eins.EinsError:
        return None


def rate(row, key, flops, peak) -> None:
    """``row[key + "_tflops"]`` and ``row[key + "_pct_peak"]`` from ``row[key + "_ms"]``."""
    ms = row.get(key + "_ms")
    if not ms:
        return
    row[key + "_tflops"] = round(flops / (ms / 1e3) / 1e12, 1)
    if peak:
        row[key + "_pct_peak"] = round(100 * flops / (ms / 1e3) / peak, 1)


# (dtype, tokens), most telling first: issue 39's targets are 1 x 4K and 1 x 8K at p=1
GPU_ANCHORS = [("float16", 4096), ("bfloat16", 4096), ("float16", 8192), ("bfloat16", 8192)]
SMOKE_ANCHORS = [("float32", 16)]
COMPILE_MODES = ("max-autotune-no-cudagraphs", "max-autotune")


def anchor_cases(backend, smoke, reps):
    """[(case id, description, thunk)]: the PyTorch block through torch.compile in each of
    COMPILE_MODES, on the inputs and weights speed_cases makes (the same seed), timed as
    eins's block is."""
    import torch
    from eins.runtime.gpu_ops import from_numpy
    dev = "cuda" if backend == "cuda" else "cpu"
    cfg = llama.TINY if smoke else llama.PAPER
    run = timer(backend)
    made = {}

    def case(dtype, s, mode):
        if backend == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        if (dtype, s) not in made:
            made.clear()
            gen = torch.Generator(device=dev).manual_seed(0)
            tw = weights(cfg, dtype, dev, gen)
            tx = 0.5 * torch.randn((s, cfg.d_model), generator=gen, device=dev,
                                   dtype=torch.float32).to(tw["wq"].dtype)
            tc, ts = (from_numpy(a).to(dev) for a in
                      llama.rope_tables(s, cfg.head_dim, None, dtype=dtype))
            made[(dtype, s)] = (tx, tw, tc, ts, torch_block(tx, tw, tc, ts, cfg))
        tx, tw, tc, ts, ref = made[(dtype, s)]
        torch._dynamo.reset()   # each mode compiles afresh (its compile time is its own)
        fn = functools.partial(torch_block, cfg=cfg)
        compiled = (torch.compile(fn, backend="eager") if smoke else
                    torch.compile(fn, mode=mode, dynamic=False))
        t0 = time.perf_counter()
        out = compiled(tx, tw, tc, ts)
        if backend == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        err = float((out.float() - ref.float()).abs().max() /
                    ref.float().abs().max().clamp_min(1e-30))
        for _ in range(3):   # CUDA graph trees record on the first calls, then replay
            compiled(tx, tw, tc, ts)
        n = reps if s <= 8192 else max(1, min(reps, 3))
        ms = statistics.median(run(lambda: compiled(tx, tw, tc, ts)) for _ in range(n))
        row = {"compile_ms": round(ms, 3), "compile_s": round(compile_s, 1),
               "rel_err_vs_torch": err, "ok": err <= TOL[dtype],
               "compiled_with": "backend=eager (smoke)" if smoke else f"mode={mode}"}
        rate(row, "compile", block_flops(cfg, s), peak_flops(backend))
        print(f"  {dtype:8s} 1x{s:<6d} torch.compile {row['compiled_with']:<36s} "
              f"{ms:9.3f} ms ({row['compile_tflops']} TFLOP/s, "
              f"{row.get('compile_pct_peak')} % of peak), compiled in {compile_s:.1f} s",
              flush=True)
        del compiled, out
        return row

    out = []
    for dtype, s in (SMOKE_ANCHORS if smoke else GPU_ANCHORS):
        for mode in COMPILE_MODES[:1] if smoke else COMPILE_MODES:
            out.append((f"compile/{dtype}/1x{s}/{mode}",
                        {"dtype": dtype, "tokens": s, "mode": mode},
                        lambda d=dtype, s=s, m=mode: case(d, s, m)))
    return out
