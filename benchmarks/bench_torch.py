"""Converting LLaMA-3-8B's shape-only export and planning it at p = 8 (issue 35's target:
at most 30 s on the reference 2-core CPU). The model is built on the meta device from its
configuration (no weights anywhere), exported by ``torch.export``, converted by
``eins.from_torch`` and planned by ``eins.distribute(...).lower``; each phase is timed, in
wall-clock and in this process's CPU seconds (the machine is shared: under load the
wall-clock time counts other jobs' time too), and the total printed. ``--layers`` and ``--seq`` change the size (the default is the whole model,
32 layers, at 8,192 tokens); ``--json PATH`` writes the numbers.

    .venv/bin/python benchmarks/bench_torch.py [--layers 32] [--seq 8192] [--p 8]
"""
import argparse
import json
import time

import torch
import transformers as T

import eins

# LLaMA-3-8B (meta-llama/Meta-Llama-3-8B's config.json)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--p", type=int, default=8)
    ap.add_argument("--topology", default="dgx-h100:8")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg = T.LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": a.layers})
    clock = [(time.perf_counter(), time.process_time())]

    def lap():
        clock.append((time.perf_counter(), time.process_time()))
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.zeros((a.batch, a.seq), dtype=torch.long, device="meta")
    lap()
    f = eins.distribute(model, devices=a.p, topology=a.topology)
    conv = f.convert(ids)                       # torch.export + folding + mapping
    lap()
    low = f.lower(ids)                          # trace + plan (the DP) at p devices
    lap()
    pred = low.predicted_time()
    lap()

    def took(i, j, k):
        return round(clock[j][k] - clock[i][k], 2)
    out = {"layers": a.layers, "seq": a.seq, "batch": a.batch, "p": a.p,
           "topology": a.topology, "eqns": len(low.program.eqns),
           "params": sum(v.size for v in conv.params.values()),
           "build_s": took(0, 1, 0), "convert_s": took(1, 2, 0), "plan_s": took(2, 3, 0),
           "convert_and_plan_s": took(1, 3, 0), "convert_and_plan_cpu_s": took(1, 3, 1),
           "predict_s": took(3, 4, 0), "predicted_ms": round(pred["total_ms"], 2),
           # the streaming peak (an input block held from its load to its last use) and
           # the peak with the weights held on the GPUs, as a placed model runs
           "peak_gb": round(max(pred["peak_bytes"].values()) / 1e9, 2),
           "placed_peak_gb": round(max(pred["placed_peak_bytes"].values()) / 1e9, 2)}
    for k, v in out.items():
        print(f"{k:>20}: {v}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
