"""A compiled program on the GPU runtime: the generated sources loaded once, inputs in and
outputs out, placed (resident) inputs, and per-call transfer counts.

Arrays in: numpy arrays and CPU tensors are host arrays (copied to the devices by each Load:
host->device bytes); torch CUDA tensors and CuPy arrays (through DLPack, no copy) are device
arrays. On the interpret backend the "device" is the CPU: torch CPU tensors are device
arrays and numpy arrays host arrays. Results come back as numpy arrays when every input was
a host array, else as device arrays (CuPy when an input was CuPy, torch otherwise).

Placed inputs (:meth:`GpuExecutable.place`): their Loads run once; a later call that passes
the same object (and, for torch tensors, one not modified in place since: torch's version
counter) skips them, so with weights placed a call moves only what changed. A numpy array
modified in place after ``place`` must be placed again (numpy has no version counter).
"""
from __future__ import annotations

import contextlib
import hashlib

import numpy as np

from eins.errors import GpuError
from eins.runtime.gpu import (EmulatedStream, Runtime, require_torch, resolve_backend,
                              resolve_device_map)

def _loads(dp, d, source) -> list:
    """Device ``d``'s Load instructions of program inputs (``source`` "in") or constants
    ("const")."""
    return [i for i in dp.code.get(d, []) if i.kind == "load" and i.source[0] == source]


@contextlib.contextmanager
def interpret_mode(on: bool):
    """Triton decides at decoration time (``triton.jit`` reads ``knobs.runtime.interpret``,
    which TRITON_INTERPRET sets) whether a kernel is compiled or interpreted. Setting the
    knob around the exec of the generated kernel module makes those kernels interpreted
    even when triton was imported earlier without TRITON_INTERPRET, and leaves every other
    kernel of the process as it was."""
    from triton import knobs
    old = knobs.runtime.interpret
    knobs.runtime.interpret = on
    try:
        yield
    finally:
        knobs.runtime.interpret = old


class _Namespace:
    def __init__(self, d):
        self.__dict__.update(d)


def exec_sources(gp, interpret: bool):
    """(kernel namespace, {device: module namespace}) of a GPU target's sources."""
    from eins.codegen.kernels.build import INTERPRET_PRELUDE, exec_source
    kern = {"__name__": "eins_generated_gpu_kernels"}
    src = gp.sources["kernels"]
    # registered in linecache (exec_source): without it compiled Triton could load no
    # generated kernel
    name = f"<eins gpu kernels {hashlib.sha1(src.encode()).hexdigest()[:12]}>"
    with interpret_mode(interpret):
        exec_source(src, name, kern)
        if interpret:
            # libdevice's functions are stubs under the interpreter: builtin stand-ins
            exec(compile(INTERPRET_PRELUDE, "<eins interpret libdevice>", "exec"), kern)
    mods = {}
    for d in gp.dp.devices:
        ns = {"__name__": f"eins_generated_gpu_device_{d}"}
        exec(compile(gp.sources[d], f"<eins gpu device {d}>", "exec"), ns)
        mods[d] = _Namespace(ns)
    return _Namespace(kern), mods


def _kind(a, backend):
    """'host', 'torch' (a device tensor) or 'cupy' (a device array through DLPack)."""
    mod = type(a).__module__.split(".")[0]
    if mod == "torch":
        if backend == "cuda":
            return "torch" if a.is_cuda else "host"
        if a.is_cuda:
            raise GpuError("backend 'interpret' runs on the CPU; got a CUDA tensor "
                           f"(shape {tuple(a.shape)}) as an input")
        return "torch"
    if mod == "cupy":
        if backend != "cuda":
            raise GpuError(f"backend {backend!r} runs on the CPU; got a CuPy array "
                           f"(shape {a.shape}) as an input")
        return "cupy"
    return "host"


class _Call:
    """One call's I/O, handed to the runtime: which Loads to skip, where outputs go, and
    the bytes moved."""

    def __init__(self, exe, tensors, skip, outputs, host_out):
        self.exe, self.tensors, self.skip = exe, tensors, skip
        self.outputs, self.host_out = outputs, host_out
        self.stats = {"h2d_bytes": 0, "d2h_bytes": 0, "device_load_bytes": 0,
                      "loads": 0, "loads_skipped": 0}
        self.start = exe._caller_event()

    def begin(self, dev):
        with dev.on_stream():   # inputs written on the caller's stream are ready
            dev.stream.wait_event(self.start)

    def load(self, dev, dst, source, idx):
        kind, k = source
        if kind == "const" or self.skip[k]:
            self.stats["loads_skipped"] += 1
            return
        src, host = self.tensors[k]
        with dev.on_stream():
            dev.issue("load", lambda: dst.copy_(src[idx], non_blocking=True))
        nb = dst.numel() * dst.element_size()
        self.stats["h2d_bytes" if host else "device_load_bytes"] += nb
        self.stats["loads"] += 1

    def store(self, dev, src, k, idx):
        out = self.outputs[k]
        with dev.on_stream():
            dev.issue("store", lambda: out[idx].copy_(src, non_blocking=not self.host_out),
                      (src,))
            if dev.cuda and not self.host_out and out.device == dev.torch_device:
                # the caller's stream also waits on this device's end event, so this only
                # keeps the allocator honest if the caller frees ``out`` on another stream
                out.record_stream(dev.stream)
        if self.host_out:
            self.stats["d2h_bytes"] += src.numel() * src.element_size()

    def end(self, dev):
        with dev.on_stream():
            ev = dev.event()
        self.exe._caller_wait(ev, dev)


class GpuExecutable:
    """Device program ``dp`` generated for the GPU target and loaded on ``backend``
    ("cuda" or "interpret") with ``device_map`` {logical: physical} (default round-robin
    over the visible GPUs; the CPU on "interpret") and CUDA graphs on or off; ``attention``
    is the attention kernel (eins.ir.plan.Options.attention)."""

    def __init__(self, dp, backend="cuda", device_map=None, graphs=True, attention="auto"):
        from eins.codegen.generate import generate
        backend = resolve_backend(backend)
        if backend not in ("cuda", "interpret"):
            raise GpuError(f"GpuExecutable runs on backend 'cuda' or 'interpret', not "
                           f"{backend!r}")
        self.torch = require_torch()
        self.dp, self.backend, self.graphs = dp, backend, bool(graphs)
        self.generated = generate(dp, "cuda")
        self.device_map = resolve_device_map(device_map, dp.devices, backend)
        K, mods = exec_sources(self.generated, backend == "interpret")
        self.rt = Runtime(backend, self.device_map, mods, K, self.graphs, attention=attention)
        self.host_stream = EmulatedStream("caller") if backend == "interpret" else None
        self.placed = {}            # input k -> (object, torch version or None)
        self.place_stats = None
        self._stats = None
        self.calls = 0
        self._load_consts()

    # ---- the caller's stream (events order the caller against the device streams)
    def _caller_event(self):
        if self.backend == "interpret":
            from eins.runtime.gpu import EmulatedEvent
            ev = EmulatedEvent()
            with self.host_stream:
                ev.record(self.host_stream)
            return ev
        ev = self.torch.cuda.Event()
        ev.record(self.torch.cuda.current_stream(self.out_device))
        return ev

    def _caller_wait(self, ev, dev):
        if self.backend == "interpret":
            self.host_stream.wait_event(ev)
        else:
            self.torch.cuda.current_stream(self.out_device).wait_event(ev)

    @property
    def out_device(self):
        """Device outputs live where logical device 0 (the first) runs."""
        first = self.dp.devices[0]
        return self.rt.devices[first].torch_device

    # ---- inputs
    def _tensor(self, a):
        """(tensor, is_host) for one input: no copy for numpy, CPU tensors or DLPack."""
        torch = self.torch
        kind = _kind(a, self.backend)
        if kind == "torch":
            return a, False
        if kind == "cupy":
            return torch.from_dlpack(a), False
        if type(a).__module__.split(".")[0] == "torch":
            return a, True
        from eins.runtime.gpu_ops import from_numpy
        return from_numpy(np.asarray(a)), True

    def _check_inputs(self, arrays):
        prog = self.dp.program
        if len(arrays) != len(prog.inputs):
            raise GpuError(f"expected {len(prog.inputs)} input arrays, got {len(arrays)}")

    def _unchanged(self, k, a):
        p = self.placed.get(k)
        return p is not None and p[0] is a and p[1] == getattr(a, "_version", None)

    def place(self, arrays):
        """Put inputs that stay the same (weights) on their devices once: every Load of
        them runs now; later calls passing the same objects skip those Loads."""
        self._check_inputs(arrays)
        tensors = [self._tensor(a) for a in arrays]
        call = _Call(self, tensors, [False] * len(arrays), [], True)
        for d, dev in self.rt.devices.items():
            call.begin(dev)
            for ins in _loads(self.dp, d, "in"):
                call.load(dev, dev.B[ins.dst], ins.source, _box_index(ins.box))
            call.end(dev)
        self._sync()
        self.placed = {k: (a, getattr(a, "_version", None)) for k, a in enumerate(arrays)}
        self.place_stats = dict(call.stats)
        return self.place_stats

    def _load_consts(self):
        consts = [c for _, c in self.dp.program.consts]
        if not any(_loads(self.dp, d, "const") for d in self.dp.code):
            return
        call = _Call(self, [], [], [], True)
        from eins.runtime.gpu_ops import from_numpy
        for d, dev in self.rt.devices.items():
            call.begin(dev)
            for ins in _loads(self.dp, d, "const"):
                src = from_numpy(np.asarray(consts[ins.source[1]]))
                dst, idx = dev.B[ins.dst], _box_index(ins.box)
                with dev.on_stream():
                    dev.issue("load", lambda dst=dst, src=src, idx=idx: dst.copy_(src[idx]))
            call.end(dev)
        self._sync()

    def _sync(self):
        for dev in self.rt.devices.values():
            dev.stream.synchronize()

    # ---- a call
    def __call__(self, arrays):
        self._check_inputs(arrays)
        torch = self.torch
        from eins.runtime.gpu_ops import to_numpy, torch_dtype
        kinds = [_kind(a, self.backend) for a in arrays]
        host_out = all(k == "host" for k in kinds)
        skip = [self._unchanged(k, a) for k, a in enumerate(arrays)]
        tensors = [None if s else self._tensor(a) for s, a in zip(skip, arrays)]
        dev_out = torch.device("cpu") if host_out else self.out_device
        outputs = [torch.empty(v.shape, dtype=torch_dtype(v.dtype), device=dev_out)
                   for v in self.dp.program.outputs]
        call = _Call(self, tensors, skip, outputs, host_out)
        launches0 = {d: dev.launches for d, dev in self.rt.devices.items()}
        replays0 = self._replays()
        self.rt.run(call)
        if host_out:
            self._sync()
        self.calls += 1
        s = call.stats
        s["launches"] = sum(dev.launches - launches0[d] for d, dev in self.rt.devices.items())
        s["graph_replays"] = self._replays() - replays0
        moved = sorted(self.rt.transfer_bytes.items())
        s["bytes_moved"] = {f"{a}->{b}": n for (a, b, _), n in moved}
        s["total_bytes"] = sum(self.rt.transfer_bytes.values())
        s["peer_bytes"] = sum(n for (_, _, k), n in self.rt.transfer_bytes.items() if k == "peer")
        s["local_copy_bytes"] = sum(n for (_, _, k), n in self.rt.transfer_bytes.items()
                                    if k == "local")
        s["transfers"] = self.rt.transfers
        s["buffer_bytes"] = {d: dev.bytes for d, dev in self.rt.devices.items()}
        s["backend"], s["graphs"] = self.backend, self.graphs
        s["device_map"] = dict(self.device_map)
        self._stats = s
        if host_out:
            return tuple(to_numpy(o) for o in outputs)
        if "cupy" in kinds:
            import cupy
            return tuple(cupy.from_dlpack(o) for o in outputs)
        return tuple(outputs)

    def _replays(self):
        return sum(dev.replays for dev in self.rt.devices.values()) + self.rt.whole_replays

    def stats(self) -> dict:
        if self._stats is None:
            raise GpuError("stats() before the first call")
        return dict(self._stats)


def _box_index(box):
    return tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi)) or Ellipsis

