"""Section (c) of benchmarks/gpu_check.py: a training step of the paper block on the GPU
(issue 34, part 4), against PyTorch eager autograd of the same block (cuBLAS matmuls, SDPA
forward and backward) and against ``torch.compile`` of it, in the same run.

The step: ``eins.value_and_grad`` of ``sum(block(x, w) * dy)`` with respect to the weights
and x (forward, backward: every weight gradient and the input's, as a block inside a stack
needs), so its gradients are the block's vector-Jacobian product with a fixed random ``dy``;
PyTorch computes the same with ``y.backward(dy)``. Weights placed, CUDA graphs on; timed
with CUDA events, warm, median of ``reps`` calls. The row has eins's and eager's
milliseconds, their ratio, and the largest gradient error against eager PyTorch relative
to each gradient's magnitude.

The ``adamw`` case adds AdamW (eins elementwise ops, eins/models/train.py) and keeps the
weights and moments on the GPU between steps (``outputs="devices"``, ``donate_argnums``): its
row says how many bytes of state came from the host after the first step (the target: 0).

``--interpret`` (smoke, on the CPU): the tiny block, 16 tokens, float32, through
backend="interpret"; torch.compile is not run there (its C++ build takes minutes on a CPU).
torch.compile is a case of its own (``compile/...``) after eins's 1 x 4K row.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

import eins
from eins.models import llama, train

# (dtype, tokens, p), most telling first: the target is the 1 x 4K step at p = 1
GPU_TRAIN = [("bfloat16", 4096, 1), ("bfloat16", 4096, 8), ("float16", 4096, 1),
             ("bfloat16", 8192, 1)]
SMOKE_TRAIN = [("float32", 16, 1), ("float32", 16, 2)]
TOL = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 1e-1}   # gradients vs eager PyTorch


def grad_fn(cfg):
    """(weights, x, cos, sin, dy) -> (loss, (weight grads, x grad))."""
    def loss(w, x, cos, sin, dy):
        return np.sum(llama.block(x, w, cos, sin, cfg) * dy)
    return eins.value_and_grad(loss, argnums=(0, 1))


def torch_grads(block, x, w, cos, sin, dy):
    """(weight grads dict, x grad) of PyTorch autograd through ``block``."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in w.items()}
    xg = x.detach().requires_grad_(True)
    y = block(xg, leaves, cos, sin)
    y.backward(dy)
    return {k: v.grad for k, v in leaves.items()}, xg.grad


def max_rel_err(got: dict, want: dict) -> float:
    """The largest error over the gradients, each relative to its own largest magnitude."""
    worst = 0.0
    for k, w in want.items():
        g = got[k]
        scale = float(w.float().abs().max().clamp_min(1e-30))
        worst = max(worst, float((g.float() - w.float()).abs().max()) / scale)
    return worst


def train_cases(backend, smoke, reps, torch_block, weights_fn, timer):
    """[(case id, description, thunk)]: the paper block's training step against PyTorch
    (``torch_block``, ``weights_fn`` and ``timer`` are gpu_check's)."""
    import torch  # heavy: only the GPU path
    from eins.runtime.gpu_ops import from_numpy
    dev = "cuda" if backend == "cuda" else "cpu"
    cfg = llama.TINY if smoke else llama.PAPER
    gens = []   # made on first use: listing the cases needs no GPU

    def block(x, w, cos, sin):
        return torch_block(x, w, cos, sin, cfg)

    def inputs(dtype, s):
        if not gens:
            gens.append(torch.Generator(device=dev).manual_seed(1))
        gen = gens[0]
        w = weights_fn(cfg, dtype, dev, gen)
        tdt = w["wq"].dtype
        x = (0.5 * torch.randn((s, cfg.d_model), generator=gen, device=dev)).to(tdt)
        dy = torch.randn((s, cfg.d_model), generator=gen, device=dev).to(tdt)
        cos, sin = (from_numpy(a).to(dev) for a in
                    llama.rope_tables(s, cfg.head_dim, None, dtype=dtype))
        return w, x, cos, sin, dy

    def median_ms(f, n):
        for _ in range(2):
            f()
        return statistics.median(timer(f) for _ in range(n))

    def grad_case(dtype, s, p):
        w, x, cos, sin, dy = inputs(dtype, s)
        eager_w, eager_x = torch_grads(block, x, w, cos, sin, dy)
        eager_ms = median_ms(lambda: torch_grads(block, x, w, cos, sin, dy), reps)
        t0 = time.perf_counter()
        args = (w, x, cos, sin, dy)
        c = eins.distribute(grad_fn(cfg), devices=p).lower(*args).compile(backend)
        plan_s = time.perf_counter() - t0
        c.place(*args)
        t0 = time.perf_counter()
        _, (gw, gx) = c(*args)   # warm-up (Triton compiles) and capture
        first_s = time.perf_counter() - t0
        err = max(max_rel_err(gw, eager_w), max_rel_err({"x": gx}, {"x": eager_x}))
        eins_ms = median_ms(lambda: c(*args), reps)
        eager_ms_by[(dtype, s)] = eager_ms
        row = {"eins_ms": round(eins_ms, 3), "torch_eager_ms": round(eager_ms, 3),
               "ratio_eager": round(eins_ms / eager_ms, 3), "grad_rel_err": err,
               "ok": err <= TOL[dtype], "plan_compile_s": round(plan_s, 2),
               "first_call_s": round(first_s, 2), "h2d_bytes": c.stats()["h2d_bytes"]}
        print(f"  train {dtype:8s} 1x{s:<5d} p={p} eins {eins_ms:9.3f} ms  eager "
              f"{eager_ms:9.3f} ms  x{row['ratio_eager']}  grad err {err:.2e}", flush=True)
        return row

    def compile_case(dtype, s):
        """torch.compile of the same block's forward and backward (a case of its own: its
        compile may take a minute, and a watchdog cut must not lose eins's row)."""
        w, x, cos, sin, dy = inputs(dtype, s)
        cblock = torch.compile(block)
        eager_w, _ = torch_grads(block, x, w, cos, sin, dy)
        t0 = time.perf_counter()
        got_w, _ = torch_grads(cblock, x, w, cos, sin, dy)
        compile_s = time.perf_counter() - t0
        ms = median_ms(lambda: torch_grads(cblock, x, w, cos, sin, dy), reps)
        eager = eager_ms_by.get((dtype, s))
        err = max_rel_err(got_w, eager_w)
        row = {"torch_compile_ms": round(ms, 3), "compile_s": round(compile_s, 1),
               "torch_eager_ms": None if eager is None else round(eager, 3),
               "grad_rel_err": err, "ok": err <= TOL[dtype]}
        print(f"  torch.compile {dtype:8s} 1x{s:<5d} {ms:9.3f} ms (compiled in "
              f"{compile_s:.0f} s)", flush=True)
        return row

    def adamw_case(dtype, s, p, steps=3):
        """AdamW steps with the state left on the GPU: no state bytes from the host after
        the first, and the loss of each step equal to eins.jit's on the host."""
        # the small block: this case is about where the state lives, and its reference
        # (eins.jit on the host) must stay quick
        lm = train.LMConfig(vocab=64, layers=1, block=llama.TINY if smoke else llama.SMALL)
        params = train.init_params(lm, np.random.default_rng(0), dtype)
        data = train.batches(lm, steps, 1, s)
        cs = llama.rope_tables(s, lm.block.head_dim, None, dtype=dtype)
        f = eins.distribute(train.step_fn(lm), devices=p, backend=backend,
                            outputs="devices", donate_argnums=(0, 1, 2))
        ref = eins.jit(train.step_fn(lm))
        p_, m, v = params, train.zeros_like(params), train.zeros_like(params)
        rp, rm, rv = p_, m, v
        n_state = len(eins.tree_flatten((p_, m, v))[0])
        state_h2d, errs, ms = [], [], []
        for t, (ids, tg) in enumerate(data, 1):
            sched = train.schedule(t).astype(dtype)
            t0 = time.perf_counter()
            loss, p_, m, v = f(p_, m, v, ids, tg, *cs, sched)
            got = float(loss)
            ms.append((time.perf_counter() - t0) * 1e3)
            want, rp, rm, rv = ref(rp, rm, rv, ids, tg, *cs, sched)
            errs.append(abs(got - float(want)) / max(abs(float(want)), 1e-30))
            state_h2d.append(sum(b for k, b in f.stats()["h2d_inputs"].items()
                                 if k < n_state))
        row = {"state_h2d_bytes": state_h2d, "loss_rel_err_vs_jit": max(errs),
               "step_ms": [round(x, 2) for x in ms],
               "ok": all(b == 0 for b in state_h2d[1:]) and max(errs) <= TOL[dtype]}
        print(f"  adamw {dtype:8s} 1x{s:<5d} p={p} state h2d per step {state_h2d}  loss err "
              f"{max(errs):.2e}", flush=True)
        return row

    eager_ms_by = {}   # (dtype, tokens) -> eager PyTorch's ms, for the compile rows
    out = []
    for dtype, s, p in (SMOKE_TRAIN if smoke else GPU_TRAIN):
        out.append((f"train/{dtype}/1x{s}/p{p}", {"dtype": dtype, "tokens": s, "p": p},
                    lambda d=dtype, s=s, p=p: grad_case(d, s, p)))
        if not smoke and p == 1 and s == 4096:   # (its C++ build takes minutes on a CPU)
            out.append((f"compile/{dtype}/1x{s}", {"dtype": dtype, "tokens": s},
                        lambda d=dtype, s=s: compile_case(d, s)))
    d, s = ("float32", 16) if smoke else ("float32", 256)
    out.append((f"adamw/{d}/1x{s}/p2", {"dtype": d, "tokens": s, "p": 2},
                lambda: adamw_case(d, s, 2)))
    return out


TRAIN_KEYS = ["dtype", "tokens", "p", "eins_ms", "torch_eager_ms", "torch_compile_ms",
              "ratio_eager", "grad_rel_err", "state_h2d_bytes", "ok", "seconds", "error"]


def train_summary(rows) -> dict:
    """Issue 34's GPU target, read off the rows (None where the row is missing)."""
    got = {(r["dtype"], r["tokens"], r["p"]): r for r in rows
           if r.get("section") == "train" and "ratio_eager" in r}
    r = got.get(("bfloat16", 4096, 1))
    comp = [c for c in rows if c.get("section") == "train" and "torch_compile_ms" in c
            and c.get("dtype") == "bfloat16" and c.get("tokens") == 4096]
    adam = [a for a in rows if a.get("section") == "train" and "state_h2d_bytes" in a]
    return {"issue34_train_1x4K_p1_within_1.2x_eager":
            None if r is None else bool(r["ratio_eager"] <= 1.2 and r["ok"]),
            "issue34_train_1x4K_p1_vs_torch_compile":
            None if r is None or not comp else round(r["eins_ms"] /
                                                     comp[-1]["torch_compile_ms"], 3),
            "issue34_state_stays_on_device": bool(adam[-1]["ok"]) if adam else None}
