"""A LLaMA decode step (eins/models/llama.py ``decode_step``): one new token per sequence
against a KV cache of L slots, the cache updated with JAX's ``cache.at[rows, lengths].set(k)``
and read through a key-padding mask built from the traced ``lengths``, written as a model
author writes it. First a tiny one, run on 8 virtual numpy devices against one device; then
the plan and predicted time of LLaMA-3-8B's block at batch 8 with a 32K-token cache
(``decode-8x32K``, shape-only) on dgx-h100:8.

    .venv/bin/python examples/decode.py            # (~10 s)

The update is functional (a new cache, as in JAX without buffer donation), so the predicted
time includes writing each device's share of the cache once.
"""
import numpy as np

import eins
from eins.ir.plan import Tuning
from eins.models import llama

TOPOLOGY = "dgx-h100:8"


def tiny_run():
    cfg, b, slots = llama.TINY, 8, 16
    rng = np.random.default_rng(0)
    w = llama.init_weights(cfg, rng)
    lengths = rng.integers(0, slots, size=b)
    cache = (rng.standard_normal((b, slots, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
             for _ in range(2))
    cos, sin = llama.rope_tables(slots, cfg.head_dim)
    args = (rng.standard_normal((b, 1, cfg.d_model)).astype(np.float32), w, *cache,
            cos[lengths], sin[lengths], lengths)
    fn = llama.decode_fn(cfg)
    one = eins.jit(fn)(*args)
    # on all 8 devices (device subsets off): a step this tiny is predicted fastest on one
    f = eins.distribute(fn, devices=8, tuning=Tuning(device_subsets=False))
    if not any(r["splits"] for r in f.lower(*args).plan_table()):
        raise SystemExit("the plan splits no eqn: the decode step did not run distributed")
    got = f(*args)
    err = max(float(np.abs(g - o).max()) for g, o in zip(got, one))
    print(f"tiny decode step, batch {b}, {slots} cache slots, lengths {lengths.tolist()}: "
          f"8 numpy devices vs 1, max |difference| {err:.2e}")


def main():
    tiny_run()
    wl = llama.DECODE_WORKLOADS["decode-8x32K"]
    low = eins.distribute(wl.function(llama.PAPER), devices=8,
                          topology=TOPOLOGY).lower(*wl(llama.PAPER, "bfloat16"))
    t = low.predicted_time()
    print(f"\nLLaMA-3-8B block, decode batch {wl.batch}, cache {wl.cache_len} tokens, bf16, "
          f"{TOPOLOGY}: predicted {t['total_ms']:.3f} ms ({t['compute_ms']:.3f} ms kernels, "
          f"{t['exchange_ms']:.3f} ms exchanges), peak {max(t['peak_bytes'].values()) / 1e9:.2f} "
          f"GB per GPU")
    print("\nThe plan:")
    print(low.as_text("planned"))


if __name__ == "__main__":
    main()
