"""The paper's LLaMA block, one device per torchrun rank (eins.distribute(devices="world")).

One node, 4 ranks (CPU ranks talk over gloo; on GPUs NCCL carries GPU tensors):

    torchrun --nproc-per-node=4 examples/torchrun_llama.py --check

Two nodes of 8 GPUs: the same script, unchanged, through torchrun's rendezvous (run on
every node; HOST is any one of them):

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=eins-llama examples/torchrun_llama.py \\
        --topology dgx-h100:2x8

No rank holds all the weights: each weight is passed as an ``eins.ShapeDtype`` and
``load(input_index, box)`` computes only the blocks this rank's program loads (here from a
closed-form formula, in practice from a checkpoint shard or a memory-mapped file).
"""
import argparse

import numpy as np

import eins
from eins import tolerance
from eins.ir.plan import Tuning
from eins.models import llama


def weight_block(name, box, scale):
    """Block ``box`` of weight ``name``: a smooth deterministic function of the global
    indices, so any rank computes any block without the rest."""
    grids = np.meshgrid(*[np.arange(l, h, dtype=np.float64) for l, h in zip(box.lo, box.hi)],
                        indexing="ij")
    seed = sum(map(ord, name))
    phase = sum((k + 1.7) * g for k, g in enumerate(grids))
    if len(box.lo) == 1:  # norm weights near 1
        return (1 + 0.1 * np.sin(phase + seed)).astype(np.float32)
    return (scale * np.sin(0.37 * phase + seed)).astype(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=["tiny", "small"], default="small")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--topology", default=None, help="e.g. dgx-h100:2x8 (default: dgx-a100)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--check", action="store_true", help="compare with eins.jit on rank 0")
    a = ap.parse_args()

    cfg = {"tiny": llama.TINY, "small": llama.SMALL}[a.config]
    s = a.tokens
    segments = (s // 4, s // 2, s)  # three packed sequences
    shapes = llama.weight_shapes(cfg, "float32")
    names = sorted(shapes)  # eins.tree_flatten orders dict keys: x, the weights, cos, sin
    x = np.random.default_rng(0).standard_normal((s, cfg.d_model)).astype(np.float32)
    cos, sin = llama.rope_tables(s, cfg.head_dim, segments)

    def load(k, box):
        name = names[k - 1]
        return weight_block(name, box, 1 / np.sqrt(shapes[name].shape[0]))

    # every rank gets a share (device subsets off): at these sizes the block is predicted
    # fastest whole on one device, and the example is about running on the ranks
    f = eins.distribute(llama.block_fn(cfg, segments), devices="world", load=load,
                        topology=a.topology, timeout_s=a.timeout,
                        tuning=Tuning(device_subsets=False))
    y = f(x, shapes, cos, sin)
    st = f.stats()
    print(f"rank {f.rank}/{f.world_size}: sent {st['total_bytes_sent']} bytes in "
          f"{st['transfers']} transfers ({st['batches']} batches), {st['kernels']} kernels, "
          f"peak {st['peak_bytes']} bytes, {st['seconds'] * 1e3:.1f} ms", flush=True)
    if f.rank == 0:
        low = f.lower(x, shapes, cos, sin)
        t = low.predicted_time()
        print(f"output {y.shape}, |y| = {np.linalg.norm(y):.4f}; predicted on "
              f"{t['topology']}: {t['total_ms']:.4g} ms ({t['exchange_ms']:.4g} ms exchanges)")
        if a.check:
            from eins.ir.types import Box
            w = {n: load(k + 1, Box.full(shapes[n].shape)) for k, n in enumerate(names)}
            fn = llama.block_fn(cfg, segments)
            want = eins.jit(fn)(x, w, cos, sin)
            err = float(np.max(np.abs(y - want)))
            print(f"max |distributed - eins.jit| = {err:.2e}")
            # the suite's rule: float32 eps times the block's accumulation length and depth
            n, depth = tolerance.accumulation(eins.make_ir(fn)(x, w, cos, sin))
            if not tolerance.close(y, want, n, depth):
                raise SystemExit(f"mismatch: {err}")


if __name__ == "__main__":
    main()
