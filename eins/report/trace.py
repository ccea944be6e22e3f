"""The predicted schedule (:mod:`eins.report.schedule`) as a Chrome / Perfetto trace: the
Trace Event Format's JSON object form (``{"traceEvents": [...]}``), which
https://ui.perfetto.dev and chrome://tracing open.

Process 0, "predicted schedule", has two tracks whose spans add up to the prediction: each
eqn's compute phase (its slowest kernel: they sum to ``predicted_time()["compute_ms"]``)
and every exchange and output gather (they sum to ``["exchange_ms"]``). Process 1,
"devices", has one track per device: its own kernel (shorter than the compute phase where
its piece is smaller) and the exchanges it sends or receives in; a counter per device
shows its live bytes. Process 2, "GPU by GPU", has one track per GPU: the same kernels and
exchanges as the rank runtime runs them, with no barrier per eqn (a GPU's kernels follow
one another; an exchange starts when the last GPU in it is free), ending at
``predicted_time()["timeline_ms"]``. Times are microseconds, as the format wants."""
from __future__ import annotations

import json
import os

from eins.errors import EinsError
from eins.report.schedule import Schedule

__all__ = ["trace_events", "write_trace", "write_text"]

SUMMARY_PID, DEVICES_PID, GPUS_PID = 0, 1, 2
COMPUTE_TID, EXCHANGE_TID = 0, 1


def _meta(pid, tid, what, name) -> dict:
    ev = {"ph": "M", "pid": pid, "name": what, "args": {"name": name}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _span(e, pid, tid) -> dict:
    args = {"eqn": e.eqn, "devices": list(e.devices)}
    if e.nbytes:
        args["bytes"] = e.nbytes
    return {"ph": "X", "pid": pid, "tid": tid, "name": e.name, "cat": e.kind,
            "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6, "args": args}


def trace_events(sched: Schedule, title: str = "eins") -> dict:
    """The trace as a JSON-ready dict."""
    evs = [_meta(SUMMARY_PID, None, "process_name", f"{title}: predicted schedule"),
           _meta(SUMMARY_PID, COMPUTE_TID, "thread_name", "eqns (slowest kernel)"),
           _meta(SUMMARY_PID, EXCHANGE_TID, "thread_name", "exchanges"),
           _meta(DEVICES_PID, None, "process_name", f"devices ({sched.topology})")]
    for d in sched.devices:
        evs.append(_meta(DEVICES_PID, d, "thread_name", f"device {d}"))
    for e in sched.events:
        if e.kind == "compute":
            evs.append(_span(e, SUMMARY_PID, COMPUTE_TID))
        elif e.kind == "kernel":
            evs.append(_span(e, DEVICES_PID, e.devices[0]))
        else:   # exchange, gather: once on the summary track, then on each device in it
            evs.append(_span(e, SUMMARY_PID, EXCHANGE_TID))
            evs.extend(_span(e, DEVICES_PID, d) for d in e.devices)
    if sched.timeline:   # the GPU-by-GPU time, as ranks run the program
        evs.append(_meta(GPUS_PID, None, "process_name",
                         f"GPU by GPU, no barrier per eqn ({sched.timeline_s * 1e3:.3f} ms)"))
        for g in sorted({g for e in sched.timeline for g in e.devices}):
            evs.append(_meta(GPUS_PID, g, "thread_name", f"GPU {g}"))
        for e in sched.timeline:
            evs.extend({"ph": "X", "pid": GPUS_PID, "tid": g, "name": e.name, "cat": e.kind,
                        "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6,
                        "args": {"eqn": e.eqn, "gpus": list(e.devices)}} for g in e.devices)
    for d, points in sched.memory.items():
        for t, b in points:
            evs.append({"ph": "C", "pid": DEVICES_PID, "tid": d, "name": f"memory dev{d}",
                        "ts": t * 1e6, "args": {"live bytes": b}})
    return {"traceEvents": evs, "displayTimeUnit": "ms",
            "otherData": {"generator": "eins", "topology": sched.topology,
                          "predicted_total_ms": sched.total_s * 1e3,
                          "predicted_timeline_ms": sched.timeline_s * 1e3,
                          "note": "a prediction (kernel model + simulated exchanges), not a "
                                  "measurement"}}


def write_trace(sched: Schedule, path, title: str = "eins") -> str:
    """Write the trace to ``path`` (a ``.json`` file); returns the path."""
    return write_text(path, json.dumps(trace_events(sched, title)), "trace")


def write_text(path, text: str, what: str) -> str:
    """Write ``text`` to ``path``; a path that cannot be written is an EinsError naming it
    (not an OSError traceback). Returns the path."""
    if not isinstance(path, (str, os.PathLike)):
        raise EinsError(f"the {what} file must be a path (str or os.PathLike), got "
                        f"{type(path).__name__} {path!r:.80}")
    path = os.fspath(path)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise EinsError(f"cannot write the {what} to {path!r}: {e.strerror or e}") from None
    return path
