"""Planning forward + backward together (issue 34, targets): how long the DP takes and
whether the plan fits, shape-only (eins.ShapeDtype), on dgx-h100:8.

    python benchmarks/bench_training_plan.py [--layers 32] [--seq 4096] [--quick]

1. The paper block (eins/models/llama.py PAPER, workload 1x8K) forward + backward
   (``eins.value_and_grad`` of the mean of its output) at p = 8: planning time, best of 3
   (target: at most 0.5 s).
2. A LLaMA-8B training step (eins/models/llama_lm.py: embedding, ``--layers`` blocks of the
   paper config, head over a 128,256-token vocabulary, cross-entropy; bfloat16 weights and
   activations, one sequence of ``--seq`` tokens): tracing and planning time (target: at most
   10 s for 32 blocks) and the planned peak per device with activations counted
   (``predicted_time()["peak_bytes"]``, the device program's liveness: target within 80 GB).

Attention: the primitive where it has a backward rule, else the composed one (einsum and
softmax, which keeps S x S probabilities); the script prints which. Times are wall and CPU
(process) seconds: on a shared machine the wall time counts the other processes' turns.
``--quick``: 2 layers, 512 tokens (for the test suite).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eins  # noqa: E402
from eins.ir.primitive import get_primitive  # noqa: E402
from eins.ir.text import format_bytes  # noqa: E402
from eins.models import llama, llama_lm  # noqa: E402

TOPOLOGY = "dgx-h100:8"
VOCAB = 128256


def paper_block(repeat: int, seq: int) -> float:
    """Seconds to trace and plan the paper block's forward + backward at p = 8."""
    cfg = llama.PAPER
    attn = "primitive" if get_primitive("attention").vjp is not None else "composed"
    if attn == "composed":
        print("paper block: the attention primitive has no backward rule on this branch; "
              "timing the block with composed attention")

    def loss(x, weights, cos, sin):
        return eins.mean(eins.astype(llama_lm.block(x, weights, cos, sin, cfg, attn),
                                     "float32"))

    vg = eins.value_and_grad(loss, argnums=(0, 1))
    cs = eins.ShapeDtype((seq, cfg.head_dim), "float16")
    args = (eins.ShapeDtype((seq, cfg.d_model), "float16"), llama.weight_shapes(cfg), cs, cs)
    best, cpu = float("inf"), float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        low = eins.distribute(vg, devices=8, topology=TOPOLOGY).lower(*args)
        best = min(best, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    n = len(low.program.eqns)
    bwd = sum(e.phase == "bwd" for e in low.program.eqns)
    print(f"paper block fwd+bwd at p=8: {n} eqns ({bwd} backward), traced and planned in "
          f"{best:.3f} s wall, {cpu:.3f} s CPU (best of {repeat}; target 0.5 s)")
    return best


def llama_8b(layers: int, seq: int) -> tuple[float, int]:
    cfg = llama.LlamaConfig(d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                            d_ff=14336)
    attn = "primitive" if get_primitive("attention").vjp is not None else "composed"
    vg = eins.value_and_grad(llama_lm.lm_loss_fn(cfg, attention=attn))
    params = llama_lm.lm_weight_shapes(cfg, VOCAB, layers, "bfloat16")
    tok = eins.ShapeDtype((seq,), "int64")
    cs = eins.ShapeDtype((seq, cfg.head_dim), "bfloat16")
    t0, c0 = time.perf_counter(), time.process_time()
    low = eins.distribute(vg, devices=8, topology=TOPOLOGY).lower(params, tok, tok, cs, cs)
    plan_s, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = len(low.program.eqns)
    print(f"llama-8b training step, {layers} blocks, {seq} tokens, attention {attn}: {n} eqns, "
          f"traced and planned in {plan_s:.2f} s wall, {cpu:.2f} s CPU (target 10 s)")
    t0 = time.perf_counter()
    pt = low.predicted_time()
    peak = max(pt["peak_bytes"].values())
    print(f"  lowered in {time.perf_counter() - t0:.2f} s; predicted step "
          f"{pt['total_ms']:.1f} ms; peak per device {format_bytes(peak)} with activations "
          f"counted ({'fits' if pt['fits'] else 'does NOT fit'} 80 GB); largest per-eqn "
          f"working set {format_bytes(low.plan.eqn_peak_bytes)}")
    return plan_s, peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.layers, a.seq = 2, 512
    paper_block(1 if a.quick else 3, 512 if a.quick else 8192)
    llama_8b(a.layers, a.seq)


if __name__ == "__main__":
    main()
