"""`eins demo` / `make demo`: the main job.

1. Traces the paper's LLaMA block (a small config, two packed sequences) into the SSA IR,
   prints it, runs it on numpy and checks it against a direct numpy implementation.
2. Distributes it over 8 virtual devices: prints the plan per eqn, one exchange program,
   bytes moved and peak memory per device, and checks the result against one device.
3. Plans the paper-sized block (d_model 4,096, 32/8 heads, FFN 14,336) for one sequence of
   131,072 tokens shape-only, prints the plan, the time planning took and predicted times."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

import eins
from eins.ir.exprog import to_text
from eins.ir.plan import Tuning
from eins.ir.text import format_bytes
from eins.models import llama
from eins.tolerance import accumulation, close, magnitude, tolerance


@dataclass
class DemoProblem:
    """The demo's workload: config, static segments, the block function and its arrays."""

    cfg: object
    segments: tuple
    fn: object
    args: tuple


def make_problem(seed: int = 0, seq_lens=(5, 11), dtype="float32") -> DemoProblem:
    """The small LLaMA block on ``len(seq_lens)`` sequences packed end to end."""
    cfg = llama.SMALL
    segments = tuple(int(e) for e in np.cumsum(seq_lens))
    s = segments[-1]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s, cfg.d_model)).astype(dtype)
    weights = llama.init_weights(cfg, rng, dtype)
    cos, sin = llama.rope_tables(s, cfg.head_dim, segments, cfg.rope_base, dtype)
    return DemoProblem(cfg, segments, llama.block_fn(cfg, segments), (x, weights, cos, sin))


def trace_step(p: DemoProblem):
    return eins.make_ir(p.fn)(*p.args)


def run_step(p: DemoProblem) -> np.ndarray:
    return eins.jit(p.fn)(*p.args)


def reference(p: DemoProblem) -> np.ndarray:
    return llama.reference_block(*p.args, p.cfg, p.segments)


def check(name: str, got, want, program=None, against: str = "numpy reference") -> bool:
    """``got`` equals ``want`` within eins.tolerance's bound for ``program``'s longest
    accumulation and chain length (the dtype's epsilon, not a fixed number)."""
    n, depth = accumulation(program) if program is not None else (1, 1)
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    ok = close(got, want, n, depth)
    bound = tolerance(np.asarray(got).dtype, n, depth) * 2 * magnitude(want)
    print(f"{name}: shape {tuple(np.shape(got))}, max |error| vs {against} {err:.2e} "
          f"(allowed about {bound:.1e}) -> {'OK' if ok else 'MISMATCH'}")
    return ok


def distributed_step(p: DemoProblem, devices: int = 8):
    """Plan, lower and run on ``devices`` virtual devices; prints what happened."""

    # on every device (device subsets off): a block this small is predicted fastest whole
    # on one device, which would show no distribution at all
    f = eins.distribute(p.fn, devices=devices, schedule="optimized", synthesis_budget_s=0.1,
                        tuning=Tuning(device_subsets=False))
    low = f.lower(*p.args)
    print(f"plan on {devices} devices (selector=dp):")
    print(low.as_text("planned"))
    split = sum(bool(r["splits"]) for r in low.plan_table())
    print(f"{split} of {len(low.program.eqns)} eqns split over the devices")
    print()
    moving = [x for x in low.exchanges if x.bytes_moved()]
    if moving:
        x = max(moving, key=lambda x: x.bytes_moved())
        where = f"eqn {x.eqn} {x.inputs_text()}" if x.eqn >= 0 else x.inputs_text()
        print(f"the largest exchange program ({where}, tensor {x.var_name}, "
              f"{format_bytes(x.bytes_moved())}; placement chosen by synthesis):")
        print(to_text(x.program))
        print()
    y = f(*p.args)
    st = f.stats()
    print(f"moved {format_bytes(st['total_bytes'])} in {st['transfers']} transfers; bytes "
          f"(B) from row device to column device:")
    print("      " + "".join(f"{d:>7}" for d in range(devices)))
    for s in range(devices):
        row = [st["bytes_moved"].get(f"{s}->{d}", 0) for d in range(devices)]
        print(f"  {s:>3} " + "".join(f"{b:>7}" for b in row))
    print("peak live memory per device:",
          ", ".join(f"{d}: {format_bytes(b)}" for d, b in st["peak_bytes"].items()))
    return y


def paper_step():
    """Shape-only planning of the paper-sized block on the 128K-token workload."""
    wl = llama.WORKLOADS["1x128K"]
    args = wl(llama.PAPER)
    t0 = time.perf_counter()
    low = eins.distribute(wl.function(llama.PAPER), devices=8).lower(*args)
    t1 = time.perf_counter()
    print(f"paper-sized block, {wl.tokens} tokens, 8 devices (shape-only):")
    print(low.as_text("planned"))
    print(f"planning took {t1 - t0:.3f} s")
    for topo in ("dgx-a100:8", "dgx-h100:8"):
        low = eins.distribute(wl.function(llama.PAPER), devices=8, topology=topo).lower(*args)
        t = low.predicted_time()
        peak = max(t["peak_bytes"].values())
        print(f"predicted on {topo}: {t['total_ms']:.1f} ms ({t['compute_ms']:.1f} ms kernels, "
              f"{t['exchange_ms']:.2f} ms exchanges); peak memory per GPU {peak / 1e9:.2f} GB "
              f"({'fits' if t['fits'] else 'does NOT fit'})")


def run(args=None) -> int:
    p = make_problem()
    c = p.cfg
    print(f"LLaMA block: d_model={c.d_model}, heads q/kv={c.n_heads}/{c.n_kv_heads}, "
          f"head_dim={c.head_dim}, d_ff={c.d_ff}; {len(p.segments)} packed sequences, "
          f"segments={p.segments}\n")
    prog = trace_step(p)
    print("traced IR:")
    print(prog)
    print()
    y = run_step(p)
    ok = check("single device (numpy)", y, reference(p), prog)
    print("output[0, :6]:", np.array2string(y[0, :6], precision=4))
    print()
    y8 = distributed_step(p)
    ok = check("8 virtual devices", y8, y, prog, against="one device (eins.jit)") and ok
    print()
    paper_step()
    print("\ndemo", "OK" if ok else "FAILED")
    return 0 if ok else 1
