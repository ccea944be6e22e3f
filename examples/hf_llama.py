"""A Hugging Face transformers LLaMA, as it is, on 8 devices (docs/torch.md).

1. A small ``LlamaForCausalLM`` built from a config (random weights, nothing downloaded) runs
   through ``eins.distribute(model, devices=8)`` on 8 virtual CPU devices; its logits are
   checked against the module's own within eins's tolerance rule.
2. The same code at LLaMA-3-8B's sizes, shape-only: the model is built on the meta device
   (no weights anywhere), planned for 8 GPUs of ``--topology``, and the plan (how each kind
   of eqn is split) and its predicted time are printed; ``--full-plan`` prints every eqn.

    .venv/bin/python examples/hf_llama.py [--layers 32] [--seq 8192] [--full-plan]
"""
import argparse
import collections
import time

import numpy as np
import torch
import transformers as T

import eins
from eins.tolerance import accumulation, close

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)


def small_model_matches():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**SMALL)).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 32))
    f8 = eins.distribute(model, devices=8)
    out = f8(ids)                                    # a CausalLMOutputWithPast, like the model's
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    conv = f8.convert(ids)                           # fn, params: what eins planned
    n, depth = accumulation(eins.make_ir(conv.fn)(conv.params, ids.numpy()))
    err = float((out.logits - want).abs().max())
    ok = close(out.logits.numpy(), want.numpy(), n=n, depth=depth)
    print(f"small LLaMA ({SMALL['num_hidden_layers']} layers) on 8 devices: "
          f"{type(out).__name__}.logits {tuple(out.logits.shape)}, max error {err:.2e} "
          f"against the module's own: {'within' if ok else 'OUTSIDE'} the tolerance")
    return ok


def plan_8b(layers, seq, topology, full_plan):
    cfg = T.LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers})
    with torch.device("meta"):                       # shapes only: no memory for weights
        model = T.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.zeros((1, seq), dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    low = eins.distribute(model, devices=8, topology=topology).lower(ids)
    took = time.perf_counter() - t0
    if full_plan:
        print(low.as_text("planned"))
    kinds = collections.Counter((r["op"], " x ".join(f"{k}/{v}" for k, v in r["splits"].items())
                                 or "whole") for r in low.plan_table())
    print(f"LLaMA-3-8B sizes ({layers} layers, 1 x {seq} tokens, bfloat16) on {topology}: "
          f"{len(low.program.eqns)} eqns, converted and planned in {took:.1f} s")
    for (op, split), count in sorted(kinds.items()):
        print(f"  {count:5d} x {op:<12} split {split}")
    pred = low.predicted_time()
    peak = max(pred["peak_bytes"].values()) / 2**30
    print(f"predicted {pred['total_ms']:.2f} ms per forward pass (compute "
          f"{pred['compute_ms']:.2f}, exchanges {pred['exchange_ms']:.2f}), peak "
          f"{peak:.2f} GiB per GPU, fits: {pred['fits']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--topology", default="dgx-h100:8")
    ap.add_argument("--full-plan", action="store_true")
    a = ap.parse_args(argv)
    np.set_printoptions(precision=3)
    ok = small_model_matches()
    plan_8b(a.layers, a.seq, a.topology, a.full_plan)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
