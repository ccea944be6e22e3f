"""Calibration: a machine profile (eins/hardware/profile.py) fitted to measured kernel
times, the arithmetic behind ``eins calibrate`` (docs/costs.md, "Calibration").

A *measurement row* is one timed kernel: ``{"what", "class", "dtype", "work", "bytes",
"seconds"}`` (``work``: 16-bit tensor FLOPs and ``bytes``: HBM bytes, both as the kernel
model counts them, :func:`eins.cost.predict.kernel_work`; ``seconds``: one call as CUDA
graph replays see it, since ``graphs=True`` runs replay their kernels). Special classes:
``"launch"`` (an empty kernel: the per-kernel overhead), ``"local_copy"`` (a
device-to-device copy of ``bytes`` on one GPU) and ``"shared"`` (a program run by several
logical devices on one GPU: ``seconds`` measured, ``model_seconds`` the model's time
without the shared-GPU overhead, ``kernels`` the kernels it launches on that GPU).
``eins calibrate`` on a GPU writes such rows; :func:`rows_from_kernels` makes them from
benchmarks/gpu_kernels.py's JSON.

:func:`fit` is pure arithmetic on rows (no GPU, no torch): rows of one kernel shape (runs
and dtypes: 16-bit float and bfloat16 run at one rate) take their median time; each shape
is compute-bound or memory-bound by the data sheet's roofline, and its efficiency is the
kernel model's time at the data sheet's peak over the measured time, so that the model
priced with the fitted profile gives back each shape's median exactly. A class's shapes
form its efficiency curve; classes never measured take the median of the measured ones.
"""
from __future__ import annotations

import math
import re
import statistics
from types import MappingProxyType

import eins.ops as ops
from eins.cost.predict import B_HALF, W_HALF, kernel_work, model_seconds
from eins.errors import EinsError
from eins.hardware.profile import KERNEL_CLASSES, ClassProfile, Profile
from eins.ir.joinagg import FunctionSpec
from eins.ir.types import Box
from eins.tracing import ShapeDtype, trace

SPECIAL_CLASSES = ("launch", "local_copy", "shared")

# What benchmarks/gpu_kernels.py's rows time (the "kernel" key): the eins program its kernel
# computes, from the row's shape string and dtype.


def _matmul(shape, dt):
    m, k, n = (int(x) for x in re.search(r"(\d+)x(\d+)x(\d+)", shape).groups())
    return (lambda a, b: a @ b), (ShapeDtype((m, k), dt), ShapeDtype((k, n), dt))


def _attention(shape, dt):
    s, hq, hkv, d = (int(re.search(rf"{key}=(\d+)", shape).group(1))
                     for key in ("S", "Hq", "Hkv", "D"))
    return (lambda q, k, v: ops.attention(q, k, v, causal="causal" in shape),
            (ShapeDtype((hq, s, d), dt), ShapeDtype((hkv, s, d), dt),
             ShapeDtype((hkv, s, d), dt)))


def _rms_norm(shape, dt):
    t, d = (int(x) for x in shape.split("x"))
    return (lambda x, w: ops.rms_norm(x, w, 1e-5)), (ShapeDtype((t, d), dt), ShapeDtype((d,), dt))


def _rope_layout(shape, dt):
    h, t, d = (int(x) for x in shape.split("x"))
    return (lambda x, c, s: ops.rope(ops.transpose(ops.reshape(x, (t, h, d)), (1, 0, 2)), c, s),
            (ShapeDtype((t, h * d), dt), ShapeDtype((t, d), dt), ShapeDtype((t, d), dt)))


def _silu_mul(shape, dt):
    t, d = (int(x) for x in shape.split("x"))
    return (lambda g, u: ops.silu(g) * u), (ShapeDtype((t, d), dt), ShapeDtype((t, d), dt))


KERNEL_PROGRAMS = MappingProxyType({"matmul": _matmul, "attention": _attention,
                                    "rms_norm": _rms_norm, "rope (+layout)": _rope_layout,
                                    "fused silu*mul": _silu_mul})


def _whole(types) -> tuple:
    return tuple(Box((0,) * len(t.shape), tuple(t.shape)) for t in types)


def program_work(fn, args, topology) -> tuple[str, float, float]:
    """(kernel class, work, bytes) of ``fn(*args)`` run as ONE kernel on one device, as the
    GPU runtime launches it: layout changes folded in (views), elementwise chains fused (the
    kernel reads the program's inputs and writes its outputs once), the kernel model's
    counts for a single eqn (:func:`eins.cost.predict.kernel_work`)."""
    prog = trace(fn, args)[0]
    eqns = [e for e in prog.eqns if e.primitive.layout is None]
    classes = {e.primitive.kernel_class for e in eqns}
    if len(classes) != 1:
        raise EinsError(f"program {prog.name!r} is not one kernel class: {sorted(classes)}")
    work = nbytes = 0
    for e in eqns:
        ins = [a.type for a in e.inputs]
        spec = FunctionSpec(_whole(ins), _whole([v.type for v in e.outputs]))
        w, b = kernel_work(e, spec, topology)
        work, nbytes = work + w, nbytes + b
    if len(eqns) > 1:   # one fused kernel: the program's inputs in, its outputs out
        nbytes = sum(v.type.nbytes for v in prog.inputs) + sum(v.type.nbytes
                                                               for v in prog.outputs)
    return classes.pop(), float(work), float(nbytes)


def _graph_ms(row) -> float | None:
    """The graph-replayed time of eins's own path in a gpu_kernels row: cuBLAS through
    eins (matmul, the runtime's default), the kernel ``attention="auto"`` picked (SDPA or
    the Triton kernel), the Triton kernels of the memory-bound rows."""
    kind = row.get("kernel")
    if kind == "matmul":
        return row.get("eins_torch_graph_ms")
    if kind == "attention":
        pick = row.get("auto_picks")
        return row.get({"sdpa": "eins_sdpa_graph_ms", "triton": "eins_graph_ms"}.get(
            pick, "auto_graph_ms"))
    return row.get("eins_graph_ms")


def rows_from_kernels(kernels, topology, source="") -> list[dict]:
    """Measurement rows from benchmarks/gpu_kernels.py's JSON list (rows without a
    graph-replayed time of eins's path, such as the first H200 run's, are left out)."""
    out = []
    for r in kernels:
        ms = _graph_ms(r)
        make = KERNEL_PROGRAMS.get(r.get("kernel"))
        if not ms or make is None:
            continue
        fn, args = make(r["shape"], r["dtype"])
        cls, work, nbytes = program_work(fn, args, topology)
        out.append({"what": f"{r['kernel']} {r['shape']}", "class": cls, "dtype": r["dtype"],
                    "work": work, "bytes": nbytes, "seconds": ms / 1e3, "source": source})
    return out


def peak_seconds(work, nbytes, flops, hbm_bw) -> tuple[float, str]:
    """The kernel model's time at the data sheet's peak and what bounds it ("flops" or
    "hbm")."""
    compute = (work + W_HALF) / flops if work else 0.0
    memory = (nbytes + B_HALF) / hbm_bw
    return (compute, "flops") if compute >= memory else (memory, "hbm")


def _check_row(r):
    cls = r.get("class")
    if cls not in KERNEL_CLASSES and cls not in SPECIAL_CLASSES:
        raise EinsError(f"measurement row {r.get('what', r)!r}: unknown class {cls!r}; "
                        f"classes are {', '.join(KERNEL_CLASSES + SPECIAL_CLASSES)}")
    for key in ("work", "bytes", "seconds"):
        v = r.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0 or (key == "seconds" and v == 0):
            raise EinsError(f"measurement row {r.get('what', cls)!r}: {key} must be a "
                            f"{'positive' if key == 'seconds' else 'non-negative'} number, "
                            f"got {v!r}")


def shape_points(rows) -> list[dict]:
    """The rows of each (class, work, bytes) shape combined: {"class", "what", "work",
    "bytes", "seconds" (the median), "runs" (how many rows)}, in first-seen order
    ("shared" rows aside)."""
    groups = {}
    for r in rows:
        if r.get("class") == "shared":
            continue
        _check_row(r)
        groups.setdefault((r["class"], r["work"], r["bytes"]), []).append(r)
    return [{"class": k[0], "what": g[0].get("what", k[0]), "work": k[1], "bytes": k[2],
             "seconds": statistics.median(x["seconds"] for x in g), "runs": len(g)}
            for k, g in groups.items()]


def _curve(points) -> tuple:
    """(size, efficiency) points, sizes increasing, an efficiency per size (the median
    where shapes of one size differ), capped at 1."""
    by = {}
    for size, eff in points:
        by.setdefault(size, []).append(eff)
    return tuple((size, round(min(1.0, statistics.median(e)), 6)) for size, e in sorted(by.items()))


def fit(rows, *, flops, hbm_bw, name, gpu="", source="", folded=("view",),
        attention=None) -> Profile:
    """A :class:`Profile` from measurement rows (module docstring) for a GPU of ``flops``
    dense 16-bit FLOP/s and ``hbm_bw`` bytes/s. ``folded``: the kernel classes the GPU
    runtime folds into neighbouring launches (layout changes: strided views).
    ``attention``: the measured attention kernels for ``attention="auto"`` ({impl:
    {shape: ms}}), kept as given."""
    pts = shape_points(rows)
    launch = [p["seconds"] for p in pts if p["class"] == "launch"]
    overhead = statistics.median(launch) if launch else 0.0
    curves = {}
    for p in pts:
        if p["class"] in SPECIAL_CLASSES:
            continue
        peak, bound = peak_seconds(p["work"], p["bytes"], flops, hbm_bw)
        size = p["work"] if bound == "flops" else p["bytes"]
        busy = p["seconds"] - overhead
        if busy <= 0:
            raise EinsError(f"measurement {p['what']!r}: {p['seconds']:.3g} s is not above "
                            f"the launch overhead {overhead:.3g} s")
        curves.setdefault(p["class"], {"flops": [], "hbm": []})[bound].append(
            (size, peak / busy))
    if not curves:
        raise EinsError("no kernel measurements to fit a profile to")
    classes = {}
    for cls in sorted(curves):
        c = curves[cls]
        classes[cls] = ClassProfile(flops=_curve(c["flops"]), hbm=_curve(c["hbm"]),
                                    overhead_s=overhead,
                                    note=f"measured: {len(c['flops']) + len(c['hbm'])} shape(s)")
    flat = {b: [e for c in curves.values() for _, e in c[b]] for b in ("flops", "hbm")}
    default = ClassProfile(
        flops=((1.0, round(min(1.0, statistics.median(flat["flops"])), 6)),)
        if flat["flops"] else (),
        hbm=((1.0, round(min(1.0, statistics.median(flat["hbm"])), 6)),) if flat["hbm"] else (),
        overhead_s=overhead, note="not measured: the median of the measured classes")
    for cls in folded:
        classes[cls] = ClassProfile(folded=True, note="folded into its neighbours' launches "
                                                      "by the GPU runtime (strided views)")
    shared = [r for r in rows if r.get("class") == "shared"]
    shared_over = 0.0
    if shared:   # what each kernel of a shared GPU costs beyond the model's time
        for r in shared:
            if not r.get("kernels") or r["seconds"] <= 0:
                raise EinsError(f"shared measurement {r.get('what')!r} needs seconds and "
                                f"kernels, got {r!r:.200}")
        shared_over = max(0.0, statistics.median((r["seconds"] - r["model_seconds"])
                                                 / r["kernels"] for r in shared))
    copies = [p for p in pts if p["class"] == "local_copy"]
    copy_hbm, copy_over = default.hbm_eff(1.0), 0.0
    if copies:   # each byte read and written: 2 x bytes at the HBM bandwidth
        copy_over = overhead
        copy_hbm = min(1.0, statistics.median(2 * p["bytes"] / hbm_bw / max(
            p["seconds"] - overhead, 1e-12) for p in copies))
    return Profile(name=name, gpu_model=gpu, calibrated=True, source=source,
                   classes=MappingProxyType(classes), default=default,
                   copy_hbm=round(copy_hbm, 6), copy_overhead_s=copy_over,
                   shared_overhead_s=round(shared_over, 9),
                   shared_note=(f"fitted: {', '.join(dict.fromkeys(r['what'] for r in shared))}"
                                f" ({len(shared)} runs)" if shared else ""),
                   attention=MappingProxyType({k: MappingProxyType(dict(v))
                                               for k, v in (attention or {}).items()}))


def attention_table(kernels) -> dict:
    """{impl: {"<dtype> <shape>": ms}} of the attention kernels a gpu_kernels JSON list
    timed with graph replay (the median over runs): what ``attention="auto"`` reads from a
    profile."""
    keys = {"triton": "eins_graph_ms", "sdpa": "eins_sdpa_graph_ms",
            "cudnn": "eins_cudnn_graph_ms", "flash_attn": "eins_flash_attn_graph_ms"}
    got = {}
    for r in kernels:
        if r.get("kernel") != "attention":
            continue
        for impl, key in keys.items():
            if r.get(key):
                got.setdefault(impl, {}).setdefault(f"{r['dtype']} {r['shape']}", []).append(
                    r[key])
    return {impl: {k: round(statistics.median(v), 4) for k, v in sorted(t.items())}
            for impl, t in sorted(got.items())}


def predicted_seconds(profile, row, flops, hbm_bw) -> float:
    """The kernel model's time for one measurement row under ``profile`` (its class's
    curve and overhead; None: the data sheet's roofline), as kernel_seconds prices it."""
    entry = profile.entry(row["class"]) if profile is not None else None
    return model_seconds(row["work"], row["bytes"], flops, hbm_bw, entry)


__all__ = ["fit", "rows_from_kernels", "program_work", "shape_points", "attention_table",
           "predicted_seconds", "peak_seconds", "KERNEL_PROGRAMS", "SPECIAL_CLASSES"]
