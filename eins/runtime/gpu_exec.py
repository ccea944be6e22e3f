"""A compiled program on the GPU runtime: the generated sources loaded once, inputs in and
outputs out, placed (resident) inputs, and per-call transfer counts.

Arrays in, never copied on the way in: numpy arrays and CPU tensors are host arrays (each
Load copies its block to its device: host->device bytes); torch CUDA tensors and CuPy
arrays (through DLPack) are device arrays, read in place by the Loads. On the interpret
backend the "device" is the CPU: torch CPU tensors and CuPy-module arrays on the CPU are device
arrays, numpy arrays host arrays, and anything on a GPU is refused. Results come back as
numpy arrays when every input was a host array, else as device arrays on the GPU of logical
device 0: CuPy arrays when an input was one (``cupy.from_dlpack``), torch tensors otherwise.
Shape, dtype and (on "cuda") the GPU of every input are checked first, naming the argument.

Placed inputs (:meth:`GpuExecutable.place`): their Loads run once; a later call that passes
the same object (and, for torch tensors, one not modified in place since: torch's version
counter) skips them, so with weights placed a call moves only what changed: a placed torch
tensor changed in place (an optimizer step) is moved by the next call and stays placed. A
numpy or CuPy array modified in place after ``place`` must be placed again (no version
counter).

Streams: :class:`Call` says how a call is ordered against the caller's streams.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys

import numpy as np

from eins.errors import EinsError, GpuError
from eins.hardware.specs import gpu_spec
from eins.ir.device import Kernel
from eins.ir.joinagg import is_lse_pair
from eins.codegen.generate import generate
from eins.kernels.build import INTERPRET_PRELUDE, KernelUnavailable, exec_source
from eins.runtime.devices import dlpack_gpu
from eins.runtime.gpu import (EmulatedEvent, EmulatedStream, Runtime, require_torch,
                              resolve_backend, resolve_device_map)
from eins.runtime.gpu_ops import from_numpy, numpy_dtype, to_numpy, torch_dtype
from eins.runtime.sharded import Sharded, cover
from eins.ir.types import Box


def _loads(dprog, d, source) -> list:
    """Device ``d``'s Load instructions of program inputs (``source`` "in") or constants
    ("const")."""
    return [i for i in dprog.code.get(d, []) if i.kind == "load" and i.source[0] == source]


@contextlib.contextmanager
def interpret_mode(on: bool):
    """Triton decides at decoration time (``triton.jit`` reads ``knobs.runtime.interpret``,
    which TRITON_INTERPRET sets) whether a kernel is compiled or interpreted. Setting the
    knob around the exec of the generated kernel module makes those kernels interpreted
    even when triton was imported earlier without TRITON_INTERPRET, and leaves every other
    kernel of the process as it was."""
    from triton import knobs  # heavy: only the GPU path
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
    for d in gp.device_program.devices:
        ns = {"__name__": f"eins_generated_gpu_device_{d}"}
        exec(compile(gp.sources[d], f"<eins gpu device {d}>", "exec"), ns)
        mods[d] = _Namespace(ns)
    return _Namespace(kern), mods


def _module(a) -> str:
    return type(a).__module__.split(".")[0]


def input_kind(a, backend, k):
    """'host' (copied to the devices by each Load), 'torch' (a device tensor, read in place)
    or 'cupy' (a device array, read in place through DLPack) for argument ``k``. What is a
    device depends on the backend: a GPU on "cuda", the CPU on "interpret". A CuPy-module
    array is classified by where DLPack says it lives (a real CuPy array is on a GPU)."""
    mod = _module(a)
    if mod == "torch":
        if backend == "cuda":
            return "torch" if a.is_cuda else "host"
        if a.is_cuda:
            raise GpuError(f"backend 'interpret' runs on the CPU; argument {k} is a CUDA "
                           f"tensor on {a.device} (shape {tuple(a.shape)})")
        return "torch"
    if mod == "cupy":
        if not hasattr(a, "__dlpack_device__"):
            raise GpuError(f"argument {k}: a {type(a).__name__} from module "
                           f"{type(a).__module__!r} without __dlpack_device__; eins takes "
                           f"CuPy arrays through DLPack")
        gpu = dlpack_gpu(a)
        if backend == "cuda":
            return "host" if gpu is None else "cupy"
        if gpu is not None:
            raise GpuError(f"backend 'interpret' runs on the CPU; argument {k} is a CuPy "
                           f"array on cuda:{gpu} (shape {tuple(a.shape)})")
        return "cupy"
    return "host"


def input_gpus(tensors) -> set:
    """The GPUs holding a call's device inputs ((tensor, is_host) pairs; None: a placed
    input the call does not read; a Sharded array: the GPUs of its blocks): with the
    outputs' GPU, the GPUs whose current streams the call is ordered against."""
    out = set()
    for t, host in (x for x in tensors if x is not None):
        ts = t.blocks().values() if isinstance(t, Sharded) else ([] if host else [t])
        out |= {b.device.index for b in ts if b.device.type == "cuda"}
    return out


def cupy_input_gpus(tensors, kinds) -> set:
    """The GPUs holding a call's CuPy inputs that the call reads: ``tensors`` as the call
    holds them ((tensor, is_host) pairs, None for a placed input it skips), ``kinds`` each
    argument's :func:`input_kind`."""
    return input_gpus(pair if kind == "cupy" else None for pair, kind in zip(tensors, kinds))


class Call:
    """One call's I/O, handed to the runtime: which Loads to skip, where outputs go, and
    the bytes moved.

    Ordering against the caller (docs/gpu.md, "Arrays in and out"): the call behaves like
    a torch op on the caller's current streams. It records an event on the current stream
    of every GPU it touches (the outputs' GPU and each input's), after the outputs were
    allocated and DLPack imports made torch's stream wait on the producer's; every device
    stream waits on those events before its first load. At the end each of those current
    streams waits on every device's end event. So an input or output the caller frees after
    the call returns is safe: torch's caching allocator reuses a freed block only for
    allocations on the stream that allocated it, and work on that stream (when it is the
    current one) is ordered after every device stream's reads and writes."""

    def __init__(self, exe, tensors, skip, outputs, host_out, keep=False):
        self.exe, self.tensors, self.skip = exe, tensors, skip
        self.outputs, self.host_out = outputs, host_out
        # keep: output -> {(logical device, box): its block, a tensor of its own}
        self.keep = keep
        self.kept = [{} for _ in exe.device_program.program.outputs] if keep else None
        self.stats = {"h2d_bytes": 0, "d2h_bytes": 0, "device_load_bytes": 0,
                      "loads": 0, "loads_skipped": 0, "h2d_inputs": {},
                      "resident_bytes": 0, "relayout_bytes": 0}
        # kept blocks are read later from any GPU of the map: every one's current stream
        # waits for the call, as the outputs' GPU's does
        kept_gpus = set(exe.device_map.values()) if keep and exe.backend == "cuda" else set()
        self.start = exe._caller_events(input_gpus(tensors) | kept_gpus)
        # the previous call's end events: a caller whose current stream changed between
        # calls (another stream, thread or GPU) has not waited on them, yet this call's
        # sends write the receive buffers that call's peers may still be reading
        self.previous = list(exe._ends.values())

    def begin(self, dev):
        with dev.on_stream():   # inputs written on the caller's streams are ready
            for ev in list(self.start.values()) + self.previous:
                dev.stream.wait_event(ev)

    def load(self, dev, dst, source, idx):
        kind, k = source
        if kind == "const" or self.skip[k]:
            self.stats["loads_skipped"] += 1
            return
        src, host = self.tensors[k]
        if isinstance(src, Sharded):
            self.resident(dev, dst, src, idx)
            return
        # a copy from pageable host memory (numpy, most CPU tensors) is staged before
        # cudaMemcpyAsync returns, so the caller may change the array once the call is
        # back; from PINNED memory it is truly asynchronous, and a call returning device
        # outputs does not wait for it: such a load waits for its own copy
        asynchronous = not (host and src.is_pinned())
        with dev.on_stream():
            dev.issue("load", lambda: dst.copy_(src[idx], non_blocking=asynchronous))
        nb = dst.numel() * dst.element_size()
        self.stats["h2d_bytes" if host else "device_load_bytes"] += nb
        if host:
            per = self.stats.setdefault("h2d_inputs", {})
            per[k] = per.get(k, 0) + nb
        self.stats["loads"] += 1

    def resident(self, dev, dst, src, idx):
        """A Load of a Sharded input: each piece of the box copied from the block holding
        it, on the loading device (in place) or from another one (the re-layout)."""
        box = _index_box(idx)
        held = src.blocks()
        for p in cover(src.layout, box):
            part = held[p.index][p.box.relative_to(p.block)]
            target = dst[p.box.relative_to(box)]
            with dev.on_stream():
                dev.issue("load", lambda t=target, s=part: t.copy_(s, non_blocking=True))
            nb = part.numel() * part.element_size()
            self.stats["resident_bytes" if p.holder == dev.logical else "relayout_bytes"] += nb
        self.stats["loads"] += 1

    def store(self, dev, src, k, idx):
        if self.keep:   # a block of its own, left on the device for a later call
            blk = self.exe.torch.empty_like(src)
            with dev.on_stream():
                dev.issue("store", lambda: blk.copy_(src), (src,))
            self.kept[k][(dev.logical, _index_box(idx))] = blk
            return
        out = self.outputs[k]
        with dev.on_stream():
            dev.issue("store", lambda: out[idx].copy_(src, non_blocking=not self.host_out),
                      (src,))
        if self.host_out:
            self.stats["d2h_bytes"] += src.numel() * src.element_size()

    def end(self, dev):
        with dev.on_stream():
            ev = dev.event()
        self.exe._ends[dev.logical] = ev
        self.exe._caller_wait(ev, self.start)


def check_forced_choice(dprog, choice, platform=None) -> None:
    """With a forced kernel ``choice`` (not "auto"), every whole block of a primitive whose
    GPU lowering takes the choice and checks it ahead (``GpuLowering.check_plan``:
    attention with ``"sdpa"``, which SDPA must compute exactly) must pass: a
    KernelUnavailable naming the device, the eqn and why, at compile time instead of at the
    first call. Key-split partials (outputs held as pairs) and pipelined pieces, which
    always run the Triton kernel, are not checked."""
    if choice == "auto":
        return
    eqns = dprog.program.eqns
    for d in dprog.devices:
        bufs = dprog.bufs.get(d, {})
        for ins in dprog.code.get(d, []):
            if not isinstance(ins, Kernel) or ins.acc is not None or \
                    any(is_lse_pair(bufs[o].dtype) for o in ins.outs):
                continue
            prim = eqns[ins.eqn].primitive
            low = prim.lowering(platform)
            if low is None or low.check_plan is None or low.choice is None:
                continue
            in_dtypes = [np.dtype(a[2]) if isinstance(a, tuple) else bufs[a].dtype
                         for a in ins.ins]
            why = low.check_plan(ins.fspec, in_dtypes, [bufs[o].dtype for o in ins.outs],
                                 eqns[ins.eqn].params, choice)
            if why is not None:
                raise KernelUnavailable(f"{prim.name}={choice!r}: device {d}'s block of eqn "
                                        f"{ins.eqn} is {why}; plan it otherwise or use "
                                        f"{prim.name}='auto'")


def measured_table(profile, backend, torch) -> dict | None:
    """The profile's measured attention table where it applies: on CUDA, measured on this
    GPU model (a profile of another GPU ranks its kernels for that one); else None."""
    if profile is None or not getattr(profile, "attention", None) or backend != "cuda":
        return None
    try:
        model = gpu_spec(torch.cuda.get_device_name(0))[0]
    except EinsError:
        return None
    return profile.attention if model == profile.gpu_model else None


class GpuExecutable:
    """Device program ``dprog`` generated for the GPU target and loaded on ``backend``
    ("cuda" or "interpret") with ``device_map`` {logical: physical} (default round-robin
    over the visible GPUs; the CPU on "interpret") and CUDA graphs on or off; ``attention``
    is the attention kernel (eins.ir.plan.Options.attention); ``profile`` the machine
    profile of the plan's topology, whose measured attention kernels ``attention="auto"``
    reads when they were measured on this GPU model (:func:`measured_table`)."""

    def __init__(self, dprog, backend="cuda", device_map=None, graphs=True, attention="auto",
                 profile=None):
        backend = resolve_backend(backend)
        if backend not in ("cuda", "interpret"):
            raise GpuError(f"GpuExecutable runs on backend 'cuda' or 'interpret', not "
                           f"{backend!r}")
        self.torch = require_torch()
        check_forced_choice(dprog, attention, backend)
        self.device_program, self.backend, self.graphs = dprog, backend, bool(graphs)
        self.generated = generate(dprog, "cuda")
        self.device_map = resolve_device_map(device_map, dprog.devices, backend)
        K, mods = exec_sources(self.generated, backend == "interpret")
        self.rt = Runtime(backend, self.device_map, mods, K, self.graphs, attention=attention,
                          measured=measured_table(profile, backend, self.torch))
        self.host_stream = EmulatedStream("caller") if backend == "interpret" else None
        self.placed = {}            # input k -> (object, torch version or None)
        self.place_stats = None
        self._stats = None
        self.calls = 0
        self._ends = {}             # logical device -> its end event of the last call
        self._load_consts()

    # ---- the caller's streams (events order the caller against the device streams)
    def _caller_events(self, gpus) -> dict:
        """{GPU: an event recorded now on torch's current stream there}, for the outputs'
        GPU and ``gpus`` (where inputs live); interpret: the one emulated caller stream."""
        if self.backend == "interpret":
            ev = EmulatedEvent()
            with self.host_stream:
                ev.record(self.host_stream)
            return {None: ev}
        out = {}
        for g in sorted(set(gpus) | {self.out_device.index}):
            ev = self.torch.cuda.Event()
            ev.record(self.torch.cuda.current_stream(g))
            out[g] = ev
        return out

    def _caller_wait(self, ev, start):
        """Every caller stream ``start`` was recorded on waits on ``ev``."""
        if self.backend == "interpret":
            self.host_stream.wait_event(ev)
            return
        for g in start:
            self.torch.cuda.current_stream(g).wait_event(ev)

    @property
    def out_device(self):
        """Device outputs live where logical device 0 (the first) runs."""
        first = self.device_program.devices[0]
        return self.rt.devices[first].torch_device

    # ---- inputs
    def input_tensor(self, a, k, kind=None):
        """(tensor, is_host) for argument ``k``, never copied: numpy arrays and CPU
        tensors as they are (each Load copies its block to the device), device tensors
        as they are, DLPack arrays (CuPy) through ``torch.from_dlpack``, which hands the
        producer torch's current stream on the array's GPU: the producer makes that stream
        wait on its own (DLPack's stream handshake), and the call's start event is recorded
        on that stream afterwards, so pending CuPy work that writes the input comes first.
        ``kind``: :func:`input_kind` of ``a`` where the caller has it already."""
        kind = input_kind(a, self.backend, k) if kind is None else kind
        mod = _module(a)
        if mod == "torch":
            t = a
        elif mod == "cupy":
            strides = tuple(getattr(a, "strides", ()))
            if any(st < 0 for st in strides):   # torch.from_dlpack can abort on them
                raise GpuError(f"argument {k}: a {type(a).__name__} with negative strides "
                               f"{strides}; torch takes none through DLPack: pass "
                               f"cupy.ascontiguousarray of it")
            # CuPy's __dlpack__ orders from its current stream of the current device: make
            # that the array's GPU (torch.cuda.device sets the CUDA runtime's device)
            with (self.torch.cuda.device(int(a.__dlpack_device__()[1]))
                  if kind == "cupy" and self.backend == "cuda" else contextlib.nullcontext()):
                t = self.torch.from_dlpack(a)
        else:
            arr = np.asarray(a)
            if any(st < 0 for st in arr.strides):   # torch takes no negative strides
                arr = np.ascontiguousarray(arr)
            t = from_numpy(arr)
        if kind != "host" and self.backend == "cuda":
            check_input_gpu(k, t.device, self.device_map)
        return t, kind == "host"

    def _check_inputs(self, arrays):
        prog = self.device_program.program
        if len(arrays) != len(prog.inputs):
            raise GpuError(f"expected {len(prog.inputs)} input arrays, got {len(arrays)}")
        for k, (v, a) in enumerate(zip(prog.inputs, arrays)):
            # a copy into a buffer of another dtype would cast silently; what has no shape
            # and dtype (a nested list) is a host array as numpy sees it (input_tensor)
            x = a if hasattr(a, "shape") and hasattr(a, "dtype") else np.asarray(a)
            dt = numpy_dtype(x.dtype) if _module(x) == "torch" else np.dtype(x.dtype)
            if tuple(x.shape) != v.shape or dt != np.dtype(v.dtype):
                raise GpuError(f"argument {k} ({type(a).__name__}): compiled for "
                               f"{np.dtype(v.dtype)}{list(v.shape)}, got "
                               f"{dt}{list(x.shape)}")

    def _unchanged(self, k, a):
        p = self.placed.get(k)
        return p is not None and p[0] is a and p[1] == getattr(a, "_version", None)

    def place(self, arrays):
        """Put inputs that stay the same (weights) on their devices once: every Load of
        them runs now; later calls passing the same objects skip those Loads. Ends with
        the device streams synchronized, so the arrays may be freed or changed at once."""
        self._check_inputs(arrays)
        self.placed = {}   # a place() that fails on the way has placed nothing
        tensors = [self.input_tensor(a, k) for k, a in enumerate(arrays)]
        call = Call(self, tensors, [False] * len(arrays), [], True)
        with self.torch.no_grad():
            for d, dev in self.rt.devices.items():
                call.begin(dev)
                for ins in _loads(self.device_program, d, "in"):
                    call.load(dev, dev.B[ins.dst], ins.source, _box_index(ins.box))
                call.end(dev)
        self._sync()
        self.placed = {k: (a, getattr(a, "_version", None)) for k, a in enumerate(arrays)}
        self.place_stats = dict(call.stats)
        return self.place_stats

    def _load_consts(self):
        consts = [c for _, c in self.device_program.program.consts]
        if not any(_loads(self.device_program, d, "const") for d in self.device_program.code):
            return
        call = Call(self, [], [], [], True)
        for d, dev in self.rt.devices.items():
            call.begin(dev)
            for ins in _loads(self.device_program, d, "const"):
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
    def __call__(self, arrays, keep=False):
        """Run on ``arrays`` (numpy, torch, CuPy, Sharded arrays of this backend; see the
        module docstring): numpy results when every input was a host array, else device
        arrays (CuPy when an input was); with ``keep`` every output as a Sharded array of
        the blocks the devices stored."""
        self._check_inputs(arrays)
        torch = self.torch
        kinds = ["sharded" if isinstance(a, Sharded) else input_kind(a, self.backend, k)
                 for k, a in enumerate(arrays)]
        host_out = all(k == "host" for k in kinds) and not keep
        skip = [kinds[k] != "sharded" and self._unchanged(k, a) for k, a in enumerate(arrays)]
        tensors = [None if s else (a, False) if kinds[k] == "sharded" else
                   self.input_tensor(a, k, kinds[k])
                   for k, (s, a) in enumerate(zip(skip, arrays))]
        # an input loaded this call overwrites the buffers its placed object left: a later
        # call passing the placed object again must load it again, not skip. A placed torch
        # tensor changed in place (its version moved) is loaded now and stays placed at the
        # version read here, before its load: the next call moves it only if it moves again
        replaced = {}
        for k, s in enumerate(skip):
            if not s:
                p = self.placed.pop(k, None)
                if p is not None and p[0] is arrays[k] and p[1] is not None:
                    replaced[k] = getattr(arrays[k], "_version", None)
        dev_out = torch.device("cpu") if host_out else self.out_device
        # allocated on the caller's current stream before the call's start event, which
        # every device stream waits on before it writes them
        outputs = [] if keep else [torch.empty(v.shape, dtype=torch_dtype(v.dtype),
                                               device=dev_out)
                                   for v in self.device_program.program.outputs]
        call = Call(self, tensors, skip, outputs, host_out, keep)
        launches0 = {d: dev.launches for d, dev in self.rt.devices.items()}
        replays0 = self._replays()
        # inputs that require grad (nn.Parameter weights) are read as plain data: the
        # runtime's out= kernels refuse autograd, and results carry no graph
        with torch.no_grad():
            self.rt.run(call)
        bad = self.rt.checks_failed(self.device_program.program)
        if bad is not None:
            raise bad
        if host_out:
            self._sync()
        for k, version in replaced.items():   # the call ran: its buffers hold that version
            self.placed[k] = (arrays[k], version)
        self.calls += 1
        self._stats = self._call_stats(call, launches0, replays0)
        if keep:
            return tuple(Sharded(v.shape, v.dtype, list(blocks), dict(enumerate(blocks.values())),
                                 self.backend, to_numpy)
                         for v, blocks in zip(self.device_program.program.outputs, call.kept))
        if host_out:
            return tuple(to_numpy(o) for o in outputs)
        if "cupy" in kinds:
            cupy = sys.modules[_module(arrays[kinds.index("cupy")])]
            if self.backend == "cuda":
                self._cupy_after_call(cupy, call.start, cupy_input_gpus(tensors, kinds))
            with self._on_out_device():
                # CuPy hands torch its current stream: torch's __dlpack__ makes it wait on
                # torch's current stream, which waited on every device's end event
                return tuple(cupy.from_dlpack(o) for o in outputs)
        return tuple(outputs)

    def _on_out_device(self):
        """torch's __dlpack__ exports only from the current CUDA device."""
        if self.backend != "cuda":
            return contextlib.nullcontext()
        return self.torch.cuda.device(self.out_device)

    def _cupy_after_call(self, cupy, start, gpus):
        """CuPy's current stream, on each GPU holding a CuPy input, waits on torch's
        current stream there (which waited on every device's end event). CuPy's memory
        pool, like torch's, reuses a freed block for allocations on the stream that
        allocated it, usually CuPy's current stream: without this a CuPy input freed
        after the call could be overwritten while a device stream still reads it (when
        CuPy's and torch's current streams differ). The way in is ordered by DLPack."""
        torch = self.torch
        for g in sorted(set(gpus) & set(start)):
            with cupy.cuda.Device(g):
                ptr = cupy.cuda.get_current_stream().ptr
            ts = torch.cuda.current_stream(g)
            if ptr == ts.cuda_stream:
                continue
            ev = torch.cuda.Event()
            ev.record(ts)
            cs = (torch.cuda.default_stream(g) if ptr == 0 else
                  torch.cuda.ExternalStream(ptr, device=torch.device("cuda", g)))
            cs.wait_event(ev)

    def _call_stats(self, call, launches0, replays0) -> dict:
        s = call.stats
        s["launches"] = sum(dev.launches - launches0[d] for d, dev in self.rt.devices.items())
        s["graph_replays"] = self._replays() - replays0
        s["graph_captures"] = self.captures()
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
        return s

    def captures(self) -> int:
        """Graphs captured since this executable was made (per device, or one whole)."""
        return sum(dev.captures for dev in self.rt.devices.values()) + self.rt.whole_captures

    def _replays(self):
        return sum(dev.replays for dev in self.rt.devices.values()) + self.rt.whole_replays

    def stats(self) -> dict:
        if self._stats is None:
            raise GpuError("stats() before the first call")
        return dict(self._stats)


def check_input_gpu(k, device, device_map) -> None:
    """A device input must sit on a GPU the program runs on: a logical device on another
    GPU of the map reads its blocks by peer copy, but a GPU outside the map is no part of
    the call's stream ordering (and is most likely a mistake)."""
    gpus = sorted(set(device_map.values()))
    if device.type != "cuda" or device.index not in gpus:
        raise GpuError(f"argument {k} is on {device}, but the program runs on GPU(s) {gpus} "
                       f"(device_map {dict(device_map)}); move it to one of them, e.g. "
                       f".to('cuda:{gpus[0]}')")


def _index_box(idx) -> Box:
    """The Box of a generated Load's or Store's index (``np.s_[lo:hi, ...]``; Ellipsis or
    ``()`` for a 0-d array)."""
    if idx is Ellipsis or idx == ():
        return Box((), ())
    idx = idx if isinstance(idx, tuple) else (idx,)
    return Box(tuple(s.start for s in idx), tuple(s.stop for s in idx))


def _box_index(box):
    return tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi)) or Ellipsis

