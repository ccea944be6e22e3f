"""`eins demo` / `make demo`: the main job.

Traces the paper's LLaMA block (a small config, two packed sequences) into the SSA IR, prints
the IR, runs it on numpy and checks the result against a direct numpy implementation.
Each step is its own function so later stages (planning, the distributed run) slot in."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DemoProblem:
    """The demo's workload: config, static segments, the block function and its arrays."""

    cfg: object
    segments: tuple
    fn: object
    args: tuple


def make_problem(seed: int = 0, seq_lens=(5, 11), dtype="float32") -> DemoProblem:
    """The small LLaMA block on ``len(seq_lens)`` sequences packed end to end."""
    from eins.models import llama

    cfg = llama.SMALL
    segments = tuple(int(e) for e in np.cumsum(seq_lens))
    s = segments[-1]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s, cfg.d_model)).astype(dtype)
    weights = llama.init_weights(cfg, rng, dtype)
    cos, sin = llama.rope_tables(s, cfg.head_dim, segments, cfg.rope_base, dtype)
    return DemoProblem(cfg, segments, llama.block_fn(cfg, segments), (x, weights, cos, sin))


def trace_step(p: DemoProblem):
    import eins
    return eins.make_ir(p.fn)(*p.args)


def run_step(p: DemoProblem) -> np.ndarray:
    import eins
    return eins.jit(p.fn)(*p.args)


def reference(p: DemoProblem) -> np.ndarray:
    from eins.models import llama
    return llama.reference_block(*p.args, p.cfg, p.segments)


def check(name: str, got, want, rtol=1e-4, atol=1e-4) -> bool:
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    ok = bool(np.allclose(got, want, rtol=rtol, atol=atol))
    print(f"{name}: shape {tuple(np.shape(got))}, max |error| vs numpy reference {err:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}")
    return ok


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
    ok = check("single device (numpy)", y, reference(p))
    print("output[0, :6]:", np.array2string(y[0, :6], precision=4))
    return 0 if ok else 1
