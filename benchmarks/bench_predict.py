"""eins's predicted times against what one H200 measured, before and after calibration
(docs/costs.md, "Calibration"), from the device sessions' files
(benchmarks/results/h200-2026-12-04*/: gpu_kernels.json, gpu_check.json). Needs no GPU.

- Per kernel shape (matmul by projection, attention by length, rms_norm, rope with its
  layout, the fused silu*mul): the median over runs and dtypes of eins's own path timed
  with CUDA graph replay, against the kernel model at the data sheet's peak ("before") and
  priced by the fitted profile ("after").
- Per paper block (LLaMA PAPER config, graphs on, weights placed): p=1 on
  ``hgx-h200:1``, and p=8 mapped onto the one GPU (``hgx-h200:8/1``: eight logical devices
  sharing it, with the plan the run used, planned on the default topology), the median of
  eins's time over runs.

The profile (eins/hardware/profiles/h200.json, :func:`fit_profile`) is fitted to the kernel
rows (gpu_kernels.json, and a session's calibrate_rows.json where ``eins calibrate`` wrote
one) and, for the shared-GPU overhead alone, to the p=8 blocks at 4K tokens; the p=1
blocks and the p=8 blocks at 8K are predictions it was not fitted to. After a device
session, ``--results`` with its folder added and ``--write-profile`` refits the shipped
profile to every run.

    python benchmarks/bench_predict.py [--results DIR ...] [--write-profile PATH]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eins  # noqa: E402
from eins.cost import calibrate as cal  # noqa: E402
from eins.hardware.presets import get_topology  # noqa: E402
from eins.models import llama  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RESULTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results",
                                                "h200-2026-12-04*")))
FIT_TOKENS = 4096   # the p=8 blocks the shared-GPU overhead is fitted to


def _load(dirs, name) -> list:
    out = []
    for d in dirs:
        path = os.path.join(d, name)
        if os.path.exists(path):
            with open(path) as f:
                out.append((os.path.basename(d), json.load(f)))
    return out


def _block_args(tokens, dtype):
    cfg = llama.PAPER
    return (eins.ShapeDtype((tokens, cfg.d_model), dtype), llama.weight_shapes(cfg, dtype),
            eins.ShapeDtype((tokens, cfg.head_dim), dtype),
            eins.ShapeDtype((tokens, cfg.head_dim), dtype))


_PLANS: dict = {}


def block_lowered(tokens, dtype, p, profile):
    """The paper block lowered for ``p`` devices of one H200 under ``profile`` (a Profile,
    or "none": the data sheet), with the plan gpu_check.py ran (planned on the default
    topology, ``eins.distribute(devices=p)``)."""
    fn = llama.block_fn(llama.PAPER, None)
    args = _block_args(tokens, dtype)
    if p == 1:
        return eins.distribute(fn, devices=1, topology="hgx-h200:1", profile=profile).lower(
            *args)
    key = (tokens, dtype, p)
    if key not in _PLANS:
        ran = eins.distribute(fn, devices=p).lower(*args)
        _PLANS[key] = {r["eqn"]: r["splits"] for r in ran.plan_table()}
    return eins.distribute(fn, devices=p, topology=f"hgx-h200:{p}/1", profile=profile,
                           plan=_PLANS[key]).lower(*args)


def _topo(profile):
    return get_topology("hgx-h200:1", profile)


def kernel_rows(dirs=DEFAULT_RESULTS):
    """Measurement rows of every run's gpu_kernels.json (eins/cost/calibrate.py), and of
    its calibrate_rows.json where ``eins calibrate`` wrote one (a device session's)."""
    topo = _topo("none")
    rows = []
    for name, kernels in _load(dirs, "gpu_kernels.json"):
        rows += cal.rows_from_kernels(kernels, topo, source=name)
    for name, doc in _load(dirs, "calibrate_rows.json"):
        rows += [dict(r, source=name) for r in doc["rows"] if r.get("class") != "shared"]
    return rows


def block_runs(dirs=DEFAULT_RESULTS) -> dict:
    """{(tokens, dtype, p): [eins ms per run]} of gpu_check's graph-replayed speed rows."""
    out = {}
    for _, check in _load(dirs, "gpu_check.json"):
        for r in check["rows"]:
            if r.get("section") == "speed" and r.get("graphs") is True and "eins_ms" in r:
                out.setdefault((r["tokens"], r["dtype"], r["p"]), []).append(r["eins_ms"])
    return out


def _kernels_on_gpu(low) -> int:
    """Kernels the logical devices launch on their one GPU: every function specification
    of every eqn the runtime does not fold into a neighbour."""
    prof = low.compilation.topology.profile
    return sum(len(ep.spec.fspecs) for e, ep in zip(low.program.eqns, low.plan.eqn_plans)
               if prof is None or not prof.entry(e.primitive.kernel_class).folded)


def shared_rows(kernel_profile, dirs=DEFAULT_RESULTS) -> list:
    """"shared" measurement rows: the p=8 blocks at FIT_TOKENS, each run."""
    rows = []
    for (tokens, dtype, p), runs in sorted(block_runs(dirs).items()):
        if p == 1 or tokens != FIT_TOKENS:
            continue
        low = block_lowered(tokens, dtype, p, kernel_profile)
        model = low.predicted_time()["total_ms"] / 1e3
        rows += [{"what": f"paper block 1x{tokens} p={p} on one GPU", "class": "shared",
                  "dtype": dtype, "seconds": ms / 1e3, "model_seconds": model,
                  "kernels": _kernels_on_gpu(low)} for ms in runs]
    return rows


def fit_profile(dirs=DEFAULT_RESULTS):
    """The H200 profile from the committed measurements: the kernel rows, the attention
    table, then the shared-GPU overhead on top of the kernels' fit."""
    topo = _topo("none")
    rows = kernel_rows(dirs)
    table = {}
    tables = [cal.attention_table(k) for _, k in _load(dirs, "gpu_kernels.json")]
    tables += [doc.get("attention", {}) for _, doc in _load(dirs, "calibrate_rows.json")]
    for t in tables:
        for impl, got in t.items():
            for k, v in got.items():
                table.setdefault(impl, {}).setdefault(k, []).append(v)
    table = {i: {k: round(statistics.median(v), 4) for k, v in sorted(t.items())}
             for i, t in sorted(table.items())}
    names = ", ".join(os.path.basename(d) for d in dirs)
    source = (f"benchmarks/bench_predict.py --write-profile, from benchmarks/results/ "
              f"{names}: eins's kernels timed with CUDA graph replay, the median over runs "
              f"and dtypes (runs without graph-replayed times left out)")
    fit = dict(flops=topo.flops, hbm_bw=topo.hbm_bw, name="h200", gpu="H200", source=source,
               attention=table)
    kernels_only = cal.fit(rows, **fit)
    return cal.fit(rows + shared_rows(kernels_only, dirs), **fit)


def kernel_table(profile, dirs=DEFAULT_RESULTS) -> list:
    """Per kernel shape: class, what, runs, measured_ms (median), before_ms (data sheet),
    after_ms (``profile``) and after/measured."""
    topo = _topo("none")
    out = []
    for pt in cal.shape_points(kernel_rows(dirs)):
        before = cal.predicted_seconds(None, pt, topo.flops, topo.hbm_bw)
        after = cal.predicted_seconds(profile, pt, topo.flops, topo.hbm_bw)
        out.append({"class": pt["class"], "what": pt["what"], "runs": pt["runs"],
                    "measured_ms": round(pt["seconds"] * 1e3, 4),
                    "before_ms": round(before * 1e3, 4), "after_ms": round(after * 1e3, 4),
                    "after_vs_measured": round(after / pt["seconds"], 3)})
    return out


def class_table(kernels) -> list:
    """Per kernel class: the sums over its shapes of measured and predicted times."""
    out = {}
    for r in kernels:
        c = out.setdefault(r["class"], {"class": r["class"], "measured_ms": 0.0,
                                        "before_ms": 0.0, "after_ms": 0.0})
        for k in ("measured_ms", "before_ms", "after_ms"):
            c[k] += r[k]
    for c in out.values():
        c["before_vs_measured"] = round(c["before_ms"] / c["measured_ms"], 3)
        c["after_vs_measured"] = round(c["after_ms"] / c["measured_ms"], 3)
        for k in ("measured_ms", "before_ms", "after_ms"):
            c[k] = round(c[k], 4)
    return list(out.values())


def block_table(profile, dirs=DEFAULT_RESULTS) -> list:
    """Per measured paper block: tokens, dtype, p, runs, measured_ms (median), before_ms,
    after_ms and after/measured; ``fitted`` marks the rows the shared-GPU overhead was
    fitted to."""
    out = []
    for (tokens, dtype, p), runs in sorted(block_runs(dirs).items()):
        before = block_lowered(tokens, dtype, p, "none").predicted_time()["total_ms"]
        after = block_lowered(tokens, dtype, p, profile).predicted_time()["total_ms"]
        measured = statistics.median(runs)
        out.append({"what": f"paper block 1x{tokens}" + (f", p={p} on one GPU" if p > 1
                                                          else ", p=1"),
                    "dtype": dtype, "runs": len(runs), "measured_ms": measured,
                    "before_ms": round(before, 4), "after_ms": round(after, 4),
                    "after_vs_measured": round(after / measured, 3),
                    "fitted": p > 1 and tokens == FIT_TOKENS})
    return out


def _print(rows, keys):
    widths = [max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(str(r.get(k, "")).ljust(w) for k, w in zip(keys, widths)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--results", nargs="+", default=DEFAULT_RESULTS,
                    help="device sessions' output folders (gpu_kernels.json, gpu_check.json)")
    ap.add_argument("--profile", default="h200",
                    help="the profile to check (default: the shipped h200)")
    ap.add_argument("--write-profile", metavar="PATH",
                    help="fit the profile to --results and write it here")
    args = ap.parse_args(argv)
    if args.write_profile:
        fit_profile(args.results).to_json(args.write_profile)
        print(f"wrote {args.write_profile}")
    profile = get_topology("hgx-h200:1", args.write_profile or args.profile).profile
    kernels = kernel_table(profile, args.results)
    print(f"per kernel shape (median of {len(args.results)} runs' graph-replayed times; "
          f"before: the data sheet's roofline; after: profile {profile.name})")
    _print(kernels, ["class", "what", "runs", "measured_ms", "before_ms", "after_ms",
                     "after_vs_measured"])
    print("\nper kernel class (sums over its shapes)")
    classes = class_table(kernels)
    _print(classes, ["class", "measured_ms", "before_ms", "after_ms", "before_vs_measured",
                     "after_vs_measured"])
    print("\nper paper block (graphs, weights placed; fitted: the shared-GPU overhead's rows)")
    blocks = block_table(profile, args.results)
    _print(blocks, ["what", "dtype", "runs", "measured_ms", "before_ms", "after_ms",
                    "after_vs_measured", "fitted"])
    return {"kernels": kernels, "classes": classes, "blocks": blocks}


if __name__ == "__main__":
    main()
