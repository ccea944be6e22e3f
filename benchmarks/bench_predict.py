"""eins's predicted times against what a GPU measured: the kernel model and the paper block
on one H200 (``topology="hgx-h200:1"``) beside the device session's own measurements
(benchmarks/results/h200-2026-12-04/ by default: gpu_kernels.json, gpu_check.json).

Per row: the predicted time of the same computation lowered for one device of the
topology, the measured time of PyTorch's kernel (torch.matmul, SDPA on repeated key/value
heads, the plain PyTorch block) and of eins's own path, and predicted / measured. The last
column is the kernel model's error on that GPU: the model charges the datasheet's dense
rate (989 TFLOP/s on an H200) with an efficiency curve for small kernels
(eins/cost/predict.py), where cuBLAS and SDPA reach less. Needs no GPU.

    python benchmarks/bench_predict.py [--results DIR] [--topology NAME]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eins  # noqa: E402
from eins.models import llama  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RESULTS = os.path.join(ROOT, "benchmarks", "results", "h200-2026-12-04")


def _predicted_ms(fn, args, topology) -> float:
    low = eins.distribute(fn, devices=1, topology=topology).lower(*args)
    return low.predicted_time()["total_ms"]


def matmul_row(row, topology) -> dict:
    m, k, n = (int(x) for x in re.search(r"(\d+)x(\d+)x(\d+)", row["shape"]).groups())
    dt = row["dtype"]
    pred = _predicted_ms(lambda a, b: a @ b, (eins.ShapeDtype((m, k), dt),
                                             eins.ShapeDtype((k, n), dt)), topology)
    return {"what": f"matmul {row['shape']}", "dtype": dt, "predicted_ms": pred,
            "pytorch_ms": row["torch_ms"], "eins_ms": row.get("eins_torch_ms")}


def attention_row(row, topology) -> dict:
    s, hq, hkv, d = (int(re.search(rf"{key}=(\d+)", row["shape"]).group(1))
                     for key in ("S", "Hq", "Hkv", "D"))
    dt = row["dtype"]
    pred = _predicted_ms(lambda q, k, v: eins.attention(q, k, v, causal=True),
                         (eins.ShapeDtype((hq, s, d), dt), eins.ShapeDtype((hkv, s, d), dt),
                          eins.ShapeDtype((hkv, s, d), dt)), topology)
    return {"what": f"attention {row['shape']}", "dtype": dt, "predicted_ms": pred,
            "pytorch_ms": row["sdpa_ms"], "eins_ms": row.get("auto_ms")}


def block_row(row, topology) -> dict:
    cfg, s, dt = llama.PAPER, row["tokens"], row["dtype"]
    args = (eins.ShapeDtype((s, cfg.d_model), dt), llama.weight_shapes(cfg, dt),
            eins.ShapeDtype((s, cfg.head_dim), dt), eins.ShapeDtype((s, cfg.head_dim), dt))
    pred = _predicted_ms(llama.block_fn(cfg, None), args, topology)
    return {"what": f"paper block 1x{s}, graphs", "dtype": dt, "predicted_ms": pred,
            "pytorch_ms": row.get("torch_ms"), "eins_ms": row["eins_ms"]}


def rows(results=DEFAULT_RESULTS, topology="hgx-h200:1") -> list:
    """One dict per measured row: what, dtype, predicted_ms, pytorch_ms, eins_ms and
    predicted_vs_{pytorch,eins} (predicted / measured)."""
    with open(os.path.join(results, "gpu_kernels.json")) as f:
        kernels = json.load(f)
    with open(os.path.join(results, "gpu_check.json")) as f:
        check = json.load(f)
    out = [matmul_row(r, topology) for r in kernels
           if r.get("kernel") == "matmul" and "torch_ms" in r]
    out += [attention_row(r, topology) for r in kernels
            if r.get("kernel") == "attention" and "sdpa_ms" in r]
    out += [block_row(r, topology) for r in check["rows"]
            if r.get("section") == "speed" and r.get("p") == 1 and r.get("graphs")
            and "eins_ms" in r]
    for r in out:
        r["predicted_ms"] = round(r["predicted_ms"], 4)
        for who in ("pytorch", "eins"):
            if r.get(f"{who}_ms"):
                r[f"predicted_vs_{who}"] = round(r["predicted_ms"] / r[f"{who}_ms"], 3)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--results", default=DEFAULT_RESULTS,
                    help="a device session's output folder (gpu_kernels.json, gpu_check.json)")
    ap.add_argument("--topology", default="hgx-h200:1", help="the machine they ran on")
    args = ap.parse_args(argv)
    got = rows(args.results, args.topology)
    keys = ["what", "dtype", "predicted_ms", "pytorch_ms", "eins_ms", "predicted_vs_pytorch",
            "predicted_vs_eins"]
    widths = [max(len(k), *(len(str(r.get(k, ""))) for r in got)) for k in keys]
    print(f"predicted on {args.topology} against {os.path.relpath(args.results, ROOT)}")
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in got:
        print("  ".join(str(r.get(k, "")).ljust(w) for k, w in zip(keys, widths)))
    return got


if __name__ == "__main__":
    main()
