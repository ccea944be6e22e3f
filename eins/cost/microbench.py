"""The micro-benchmarks of ``eins calibrate`` on a GPU: measurement rows
(eins/cost/calibrate.py) for each kernel class, timed as ``graphs=True`` runs see them (each
call captured ``CALLS`` times in one CUDA graph, replayed, median of ``reps`` replays):

- matmul by shape class (eins's launcher, cuBLAS through torch: square, the paper block's
  projections, skinny);
- attention by length (4 query heads, 1 key/value head, head dim 128, causal), through
  ``attention="auto"``'s pick; every exact kernel the machine has (ours, SDPA on its flash
  and cuDNN backends, flash-attn) also goes to the profile's attention table;
- memory-bound kernels: rms_norm, rope with its q/k layout, a fused elementwise chain, at
  sizes beyond the L2 cache;
- the per-kernel launch overhead under graph replay, and local device-to-device copies.

``quick`` leaves out the longest attentions (64K, 128K). ``device="cpu"`` runs tiny shapes under Triton's interpreter with wall-clock times: a smoke
test of every row (tests/test_calibrate.py), whose times mean nothing.
"""
from __future__ import annotations

import statistics
import time

from eins.cost.calibrate import KERNEL_PROGRAMS, program_work
from eins.kernels import fusion, norms, sdpa
from eins.kernels.attention import attention, choose_impl
from eins.kernels.matmul import matmul
from eins.tracing import trace

CALLS = 10


def graph_replay_seconds(torch, fn, reps: int, calls: int = CALLS) -> float:
    """The median seconds per call of ``fn`` captured ``calls`` times in one CUDA graph and
    replayed ``reps`` times (the GPU's own time, what eins's graphs=True runs see). Warmed
    up on the capture's own stream first (compiled, cached, cuBLAS's per-stream workspace
    allocated), as torch's graph docs advise; a failed capture raises."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # the outer context restores the caller's stream even when capture_end raises
    # (torch.cuda.graph's exit then leaves its capture stream current)
    with torch.cuda.stream(torch.cuda.current_stream()):
        with torch.cuda.graph(g, stream=side):
            for _ in range(calls):
                fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    del g
    return statistics.median(times)


def make_timer(device: str, reps: int):
    """``timed(fn) -> seconds per call``: graph-replayed on a GPU, wall clock on the CPU."""
    import torch  # heavy: only the calibration run

    def timed(fn):
        if device == "cpu":
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        return graph_replay_seconds(torch, fn, reps)
    return timed


def _row(kind, shape, dtype, seconds, topology, **extra) -> dict:
    fn, args = KERNEL_PROGRAMS[kind](shape, dtype)
    cls, work, nbytes = program_work(fn, args, topology)
    return {"what": f"{kind} {shape}", "class": cls, "dtype": dtype, "work": work,
            "bytes": nbytes, "seconds": seconds, **extra}


def matmul_rows(torch, timed, dev, dt, topology, shapes) -> list:
    rows = []
    for m, k, n in shapes:
        a, b = (torch.randn(*s, device=dev).to(dt) for s in ((m, k), (k, n)))
        out = torch.empty(m, n, device=dev, dtype=dt)
        t = timed(lambda: matmul(a, b, out))
        rows.append(_row("matmul", f"{m}x{k}x{n}", str(dt)[6:], t, topology))
    return rows


def attention_rows(torch, timed, dev, dt, topology, lengths, hq=4, hkv=1, d=128):
    """Rows of ``attention="auto"``'s pick, and {impl: {shape: ms}} of every exact kernel."""
    rows, table = [], {}
    for s in lengths:
        q = torch.randn(1, hq, s, d, device=dev).to(dt)
        k, v = (torch.randn(1, hkv, s, d, device=dev).to(dt) for _ in range(2))
        out = torch.empty_like(q)
        shape = f"S={s} Hq={hq} Hkv={hkv} D={d} causal"
        where = dict(causal=True, segments=None, lse=None, q_offset=0, k_offset=0)
        pick = choose_impl(q, k, v, out, **where)
        impls = ["triton"] + (["sdpa"] if sdpa.why_not(q, k, out, auto=dev != "cpu", v=v,
                                                      **where) is None else [])
        if sdpa.why_not(q, k, out, v=v, **where) is None and \
                sdpa.cudnn_why_not(q, k, v, True) is None:
            impls.append("cudnn")
        impls += [pick] if pick not in impls else []
        got = {}
        for impl in impls:
            got[impl] = timed(lambda impl=impl: attention(q, k, v, out, causal=True, impl=impl))
            table.setdefault(impl, {})[f"{str(dt)[6:]} {shape}"] = round(got[impl] * 1e3, 4)
        rows.append(_row("attention", shape, str(dt)[6:], got[pick], topology, impl=pick))
    return rows, table


def memory_rows(torch, timed, dev, dt, topology, tokens, d) -> list:
    x, gate = (torch.randn(tokens, d, device=dev).to(dt) for _ in range(2))
    w = torch.randn(d, device=dev).to(dt)
    out = torch.empty_like(x)
    name = str(dt)[6:]
    rows = [_row("rms_norm", f"{tokens}x{d}", name,
                 timed(lambda: norms.rms_norm(x, w, out, eps=1e-5)), topology)]
    hd = 128
    xh = x.view(tokens, d // hd, hd).transpose(0, 1)
    cos, sin = (torch.randn(tokens, hd, device=dev).to(dt) for _ in range(2))
    ro = torch.empty(d // hd, tokens, hd, device=dev, dtype=dt)
    rows.append(_row("rope (+layout)", f"{d // hd}x{tokens}x{hd}", name,
                     timed(lambda: norms.rope(xh, cos, sin, ro)), topology))
    fn, args = KERNEL_PROGRAMS["fused silu*mul"](f"{tokens}x{d}", name)
    prog = trace(fn, args)[0]
    fk = fusion.fused_source(prog, fusion.fusion_groups(prog)[0])
    rows.append(_row("fused silu*mul", f"{tokens}x{d}", name,
                     timed(lambda: fusion.launch_fused(fk, [x, gate], [out])), topology))
    return rows


def overhead_rows(torch, timed, dev, sizes) -> list:
    """The launch overhead (a one-element kernel) and local copies of ``sizes`` bytes."""
    one = torch.zeros(1, device=dev)
    rows = [{"what": "launch", "class": "launch", "dtype": "float32", "work": 0.0,
             "bytes": 0.0, "seconds": timed(lambda: one.add_(1))}]
    for n in sizes:
        a, b = (torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(2))
        rows.append({"what": f"local copy {n} B", "class": "local_copy", "dtype": "uint8",
                     "work": 0.0, "bytes": float(n), "seconds": timed(lambda: b.copy_(a))})
    return rows


def run(topology, device="cuda", reps=20, dtypes=("float16", "bfloat16"), quick=False,
        log=print) -> tuple[list, dict]:
    """Every measurement row and the attention table on this machine's GPU 0."""
    import torch  # heavy: only the calibration run
    dev = "cuda" if device != "cpu" else "cpu"
    timed = make_timer(dev, reps)
    shapes = ([(64, 64, 64)] if dev == "cpu" else
              [(1024, 1024, 1024), (512, 4096, 4096), (4096, 4096, 1024), (4096, 4096, 4096),
               (4096, 4096, 14336), (4096, 14336, 4096), (16384, 4096, 4096)])
    # quick: the lengths a 128K attention's 30 ms calls would not crowd out
    lengths = [64] if dev == "cpu" else [2048, 4096, 8192, 16384, 32768] + (
        [] if quick else [65536, 131072])
    rows, table = [], {}
    for name in dtypes:
        dt = getattr(torch, name)
        rows += matmul_rows(torch, timed, dev, dt, topology, shapes)
        log(f"calibrate: matmul {name} done")
        got, t = attention_rows(torch, timed, dev, dt, topology, lengths)
        rows += got
        for impl, v in t.items():
            table.setdefault(impl, {}).update(v)
        log(f"calibrate: attention {name} done")
        rows += memory_rows(torch, timed, dev, dt, topology, *((64, 256) if dev == "cpu" else
                                                              (16384, 4096)))
    rows += overhead_rows(torch, timed, dev, [1 << 10] if dev == "cpu" else
                          [1 << 20, 1 << 23, 1 << 26, 1 << 28])
    return rows, table
