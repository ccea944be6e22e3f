"""summary.txt of a device session (benchmarks/device_session.sh): the issues' targets, met
or not, every failed or skipped case, one line each, read from gpu_check.json and
gpu_kernels.json in the output folder. A gpu_check cut before it finished (its step's time
ran out) wrote no ``summary``: the targets are then computed from the rows it did write.

    python benchmarks/session_summary.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys


def _load(out, name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return e


def _gpu_check_lines(gc) -> list:
    if not isinstance(gc, dict):
        return [f"gpu_check: no results ({gc})"]
    lines = [f"gpu_check: finished={gc.get('finished')} backend={gc.get('backend')} "
             f"seconds={gc.get('seconds')}"]
    rows = gc.get("rows", [])
    summ = gc.get("summary")
    if not summ:   # cut before the end: the targets from the rows written so far
        try:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from gpu_check import summary
            summ = summary(rows)
            lines.append("  (not finished: targets from the rows written before the cut)")
        except Exception as e:   # a summary without them is still a summary
            summ = {"targets": f"not computed ({type(e).__name__}: {e})"}
    lines += [f"  {k}: {v}" for k, v in summ.items()
              if k != "issue36_packed_stream_1x32K_p8"]
    lines.append("  " + _issue36_line(summ, rows))
    if gc.get("running"):
        lines.append(f"  CUT while running: {gc['running'].get('case')}")
    for r in rows:
        if "skipped" in r:
            lines.append(f"  skipped ({r['section']}): {len(r['skipped'])} case(s)")
        elif r.get("ok") is False:
            parts = "; ".join(f"{k}: {v.get('error') or v}" for k, v in r.items()
                              if isinstance(v, dict) and v.get("ok") is False)
            lines.append(f"  FAILED {r.get('case')}: "
                         f"{r.get('error') or r.get('rel_err') or parts[:800]}")
    if any(r.get("traceback") for r in rows):
        lines.append('  (tracebacks: each failed row\'s "traceback" in gpu_check.json)')
    return lines


def _issue36_line(summ, rows) -> str:
    """Issue 36's GPU target (benchmarks/gpu_packed.py): from the summary, or from the rows
    where the summary predates it."""
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_packed import packed_target, target_line
        t = summ.get("issue36_packed_stream_1x32K_p8")
        return target_line(t if isinstance(t, dict) else packed_target(rows))
    except Exception as e:   # a summary without it is still a summary
        return f"issue36 GPU target: not computed ({type(e).__name__}: {e})"


def masked_attention_target(rows):
    """Issue 33's GPU target from gpu_kernels' ``attention_masked`` rows: whether every
    graph-replayed masked, windowed and softcapped row is within 1.3x of its anchor (SDPA
    with the same mask, or flash-attn's window/softcap), with the worst ratio; None where no
    such row was graph-replayed (no GPU, or the job did not run)."""
    timed = [r for r in rows if isinstance(r, dict) and r.get("kernel") == "attention_masked"
             and "eins_vs_anchor_graphed" in r]
    if not timed:
        return None
    return {"met": all(r["meets_1.3x_graphed"] for r in timed),
            "worst": max(r["eins_vs_anchor_graphed"] for r in timed), "rows": len(timed)}


def _gpu_kernels_lines(gk) -> list:
    if not isinstance(gk, list):
        return [f"gpu_kernels: no results ({gk})"]
    lines = [f"gpu_kernels: {len(gk)} rows",
             f"  issue33 masked/windowed/softcapped attention within 1.3x of its anchor "
             f"(graph-replayed): {masked_attention_target(gk)}"]
    for r in gk:
        if r.get("kernel") == "attention_masked" and "eins_ms" in r:
            lines.append(
                f"  attention {r.get('dtype')} {r.get('shape')}: eins "
                f"{r.get('eins_graph_ms', r.get('eins_graph_error'))} ms, sdpa "
                f"{r.get('sdpa_graph_ms', r.get('sdpa_graph_error'))} ms, flash-attn "
                f"{r.get('flash_attn_graph_ms', r.get('flash_attn_graph_error'))} ms "
                f"(graph-replayed): x{r.get('eins_vs_anchor_graphed')}")
    for r in gk:
        if r.get("kernel") == "attention" and "sdpa_ms" in r:
            lines.append(
                f"  attention {r['dtype']} {r['shape']}: eins {r['eins_ms']} ms, sdpa "
                f"{r['sdpa_ms']} ms, within 1.3x: {r.get('meets_1.3x_sdpa')}; auto picks "
                f"{r.get('auto_picks')} ({r.get('auto_ms')} ms; eins's sdpa path "
                f"{r.get('eins_sdpa_ms', r.get('sdpa_path'))})" +
                (f"; graph-replayed: eins {r.get('eins_graph_ms', r.get('eins_graph_error'))} "
                 f"ms, sdpa {r.get('sdpa_graph_ms', r.get('sdpa_graph_error'))} ms, within "
                 f"1.3x: {r.get('meets_1.3x_sdpa_graphed')}"
                 if any(k.endswith(("_graph_ms", "_graph_error")) for k in r) else ""))
    for r in gk:   # issue 39: ours in TFLOP/s, the library anchors, auto against the fastest
        if r.get("kernel") == "attention" and "eins_graph_ms" in r:
            lines.append(
                f"  issue39 attention {r['dtype']} {r['shape']}: ours "
                f"{r.get('eins_graph_tflops')} TFLOP/s ({r.get('eins_graph_pct_peak')} %), "
                f"SDPA FA2 {r.get('sdpa_flash_graph_ms', r.get('sdpa_flash_error'))} ms, "
                f"SDPA cuDNN {r.get('sdpa_cudnn_graph_ms', r.get('sdpa_cudnn_error'))} ms, "
                f"ours {r['eins_graph_ms']} ms; auto by the h200 profile picks "
                f"{r.get('auto_profile_picks')}: x{r.get('auto_profile_vs_fastest')} of the "
                f"fastest exact kernel (target <= 1.05)")
    for r in gk:
        if r.get("kernel") == "matmul" and "torch_ms" in r:
            lines.append(
                f"  matmul {r['dtype']} {r['shape']}: torch path {r['eins_torch_tflops']}, "
                f"triton {r['eins_triton_tflops']}, torch.matmul {r['torch_tflops']} TFLOP/s" +
                (f"; graph-replayed vs torch.matmul: torch path "
                 f"{r.get('torch_vs_torch_graphed')}x, triton {r.get('triton_vs_torch_graphed')}x"
                 if "torch_graph_ms" in r else ""))
    for r in gk:
        if r.get("kernel") in ("rms_norm", "rope (+layout)", "fused silu*mul") and \
                "eins_graph_ms" in r:
            lines.append(f"  {r['kernel']} {r['dtype']} {r['shape']}: graph-replayed eins "
                         f"{r['eins_graph_ms']} ms ({r.get('eins_graph_GBps')} GB/s), torch "
                         f"{r.get('torch_graph_ms', r.get('torch_graph_error'))} ms")
    for r in gk:
        if r.get("running"):
            lines.append(f"  CUT while running: {r.get('job')}")
        elif r.get("error") or "skipped" in r:
            lines.append(f"  {r.get('job')}: {r.get('error') or 'skipped ' + str(r['skipped'])}")
    return lines


def _gpu_tune_lines(rows) -> list:
    if not isinstance(rows, list):
        return [f"gpu_tune: no results ({rows})"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_tune import best
    lines = [f"gpu_tune: {len(rows)} rows"]
    for b in best(rows):
        cur = (f"x{b['best_vs_current']} of today's config" if "best_vs_current" in b else
               "today's config not timed or off")
        ref = (f"x{b['best_vs_reference']} of {b['reference']}" if "reference" in b else
               "no reference time")
        lines.append(f"  {b['kernel']} {b['dtype']} {b['shape']}: best {b['best_config']} "
                     f"{b['best_ms']} ms of {b['configs_timed']} configs; {ref}, {cur}")
    lines += [f"  CUT while running: {r.get('job')}" for r in rows if r.get("running")]
    bad = [r for r in rows if r.get("error") or r.get("ok") is False]
    if bad:
        lines.append("  failed or off: " + ", ".join(
            f"{r.get('job')}{'' if not r.get('error') else ' (' + r['error'][:60] + ')'}"
            for r in bad[:12]))
    return lines


def _calibrate_lines(out, doc) -> list:
    """The shipped h200 profile's predictions against this session's measurements: the
    kernel rows ``eins calibrate`` wrote, and the paper blocks gpu_check timed (issue 39's
    predictor targets, on data the profile was not fitted to)."""
    if not isinstance(doc, dict):
        return [f"calibrate: no rows ({doc})"]
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    from eins.cost import calibrate as cal
    from eins.hardware.profile import load_profile
    from eins.hardware.specs import gpu_spec
    _, spec = gpu_spec(doc.get("gpu", "H200"))
    prof = load_profile("h200")
    lines = [f"calibrate: {len(doc['rows'])} rows on {doc.get('gpu')}; the shipped h200 "
             f"profile's prediction / measured (target: within 15 %):"]
    for p in cal.shape_points(doc["rows"]):
        if p["class"] in cal.SPECIAL_CLASSES:
            lines.append(f"  {p['what']}: {p['seconds'] * 1e6:.2f} us")
            continue
        got = cal.predicted_seconds(prof, p, spec["flops"], spec["hbm"])
        lines.append(f"  kernel {p['class']} {p['what']}: x{got / p['seconds']:.3f}")
    gc = _load(out, "gpu_check.json")
    if not isinstance(gc, dict) or gc.get("backend") != "cuda":
        return lines + ["  blocks not predicted (no paper-block rows measured on a GPU)"]
    try:
        import bench_predict
        for b in bench_predict.block_table(prof, [out]):
            lines.append(f"  block {b['what']} {b['dtype']}: predicted {b['after_ms']} ms, "
                         f"measured {b['measured_ms']} ms, x{b['after_vs_measured']} "
                         f"(target: within 10 %)")
    except Exception as e:   # the kernel lines stand without the blocks
        lines.append(f"  blocks not predicted ({type(e).__name__}: {e})")
    return lines


def summary_lines(out: str) -> list:
    lines = _gpu_check_lines(_load(out, "gpu_check.json")) + \
        _gpu_kernels_lines(_load(out, "gpu_kernels.json"))
    rows = _load(out, "calibrate_rows.json")
    if not isinstance(rows, OSError):
        lines += _calibrate_lines(out, rows)
    tune = _load(out, "gpu_tune.json")
    return lines + (_gpu_tune_lines(tune) if not isinstance(tune, OSError) else [])


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("out_dir", help="the device session's output folder ($OUT)")
    print("\n".join(summary_lines(ap.parse_args().out_dir)))
