"""A Mixtral-style sparse MoE block (eins/models/moe.py: top_k routing, tokens grouped per
expert with a static capacity, one matmul per expert, results added back with .at[].add)
against its dense form (every expert on every token), and an embedding lookup (a gather)
against the one-hot matmul it used to need: plans and predicted times, shape-only
(eins.ShapeDtype) at Mixtral-8x7B and LLaMA-3-8B sizes on dgx-h100:8.

    .venv/bin/python examples/moe.py            # the table and the sparse block's plan (~5 s)

The DP splits the expert matmuls by expert (``d0/8``: each device holds its experts'
weights, the tokens travel to them by the exchange): expert parallelism, not written down.
"""
from dataclasses import replace

import numpy as np

import eins
from eins.models import moe

TOPOLOGY = "dgx-h100:8"
TOKENS = 4096          # tokens in the MoE batch
VOCAB, D_MODEL, EMB_TOKENS = 128256, 4096, 8192   # LLaMA-3-8B's embedding, 8K tokens


def moe_lowered(cfg, sparse, tokens=TOKENS):
    h = eins.ShapeDtype((tokens, cfg.d_model), "bfloat16")
    w = {k: eins.ShapeDtype(s, "bfloat16") for k, s in moe.weight_shapes(cfg).items()}
    return eins.distribute(moe.block_fn(cfg, sparse), devices=8,
                           topology=TOPOLOGY).lower(h, w)


def embedding(table, ids):
    return table[ids]


def one_hot_embedding(table, ids):
    return (ids[:, None] == np.arange(table.shape[0])).astype(table.dtype) @ table


def embedding_lowered(fn):
    table = eins.ShapeDtype((VOCAB, D_MODEL), "bfloat16")
    ids = eins.ShapeDtype((EMB_TOKENS,), "int64")
    return eins.distribute(fn, devices=8, topology=TOPOLOGY).lower(table, ids)


def expert_splits(low) -> list:
    """The chosen splits of the expert matmuls (the einsums over the expert index)."""
    return [r["splits"] for r, e in zip(low.plan_table(), low.program.eqns)
            if e.prim == "einsum" and e.params["subscripts"].startswith("ec")]


def main():
    dense = moe_lowered(moe.MIXTRAL, sparse=False).predicted_time()["total_ms"]
    print(f"Mixtral-8x7B MoE FFN, {TOKENS} tokens, bf16, {TOPOLOGY}: predicted ms")
    print(f"  {'dense (every expert, every token)':50s} {dense:8.3f}")
    sparse_low = None
    for cf in (1.0, 1.25):
        cfg = replace(moe.MIXTRAL, capacity_factor=cf)
        low = moe_lowered(cfg, sparse=True)
        t = low.predicted_time()["total_ms"]
        label = f"sparse, capacity factor {cf} ({moe.capacity(cfg, TOKENS)} slots/expert)"
        print(f"  {label:50s} {t:8.3f}   {t / dense:.2f}x dense, experts split "
              f"{expert_splits(low)[0]}")
        sparse_low = sparse_low or low
    g = embedding_lowered(embedding).predicted_time()["total_ms"]
    o = embedding_lowered(one_hot_embedding).predicted_time()["total_ms"]
    print(f"LLaMA-3-8B embedding, {EMB_TOKENS} tokens, bf16, {TOPOLOGY}: gather {g:.4f} ms, "
          f"one-hot matmul {o:.3f} ms ({g / o:.4f}x)")
    print("\nThe sparse block's plan (capacity factor 1.0):")
    print(sparse_low.as_text("planned"))


if __name__ == "__main__":
    main()
