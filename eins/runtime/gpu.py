"""The GPU runtime: what the generated per-device host programs call (every backend
executes the one device IR: docs/architecture.md; eins/codegen/templates/gpu_program.py.j2
is the walk).

One :class:`DeviceRuntime` per *logical* device of the plan owns a stream, its buffers
(allocated once, reused by every call, so captured graphs keep their addresses), and the
launches of its program. The runtime is built on PyTorch tensors, streams, events and CUDA
graphs rather than CuPy: torch's cuBLAS matmul and SDPA can be captured in
``torch.cuda.graph`` (CuPy refuses cuBLAS during stream capture, cupy issue 6290), torch
speaks DLPack both ways (CuPy arrays come in without a copy), and the very same host code
runs on torch CPU tensors with Triton's interpreter, so CI runs the whole GPU path.

Backends (``eins.distribute(..., backend=...)``):

- ``"cuda"``: torch CUDA tensors, one ``torch.cuda.Stream`` per logical device on the GPU
  the device map names, ``torch.cuda.Event`` between devices, ``torch.cuda.CUDAGraph``.
- ``"interpret"``: torch CPU tensors and Triton kernels under Triton's interpreter. Streams,
  events and graphs are emulated (:class:`EmulatedStream`, :class:`EmulatedEvent`,
  :class:`EmulatedGraph`) so that their discipline is *checked*: every launch must be issued
  inside its own device's stream context, a wait needs a recorded event, and a graph replays
  the list of launches recorded at capture without running the host program again.
- ``"numpy"``: the reference virtual devices (eins/runtime/numpy_backend.py), not this file.
- ``"auto"``: ``"cuda"`` when torch sees a GPU, else ``"numpy"``.

Graphs (``graphs=True``): when every logical device sits on one physical device, the bodies
of all device programs (everything between the loads and the stores, transfers included)
are captured once into ONE graph: the devices' streams fork from and join into one capture.
Across GPUs, each device captures each run of kernels between its transfers (a segment) and
the transfers stay host-issued copies and events (see :attr:`Runtime.one_graph`). The first
call warms up eagerly, captures, then replays; later calls only replay.

Stream discipline: every operation of a device's program (kernel, copy, load, store, send)
goes through :meth:`DeviceRuntime.issue`, which checks that the current stream is the
device's own; dependencies between devices exist only as events (a send records one on the
sender's stream, the receiver's stream waits on it).
"""
from __future__ import annotations

import contextlib
import math
import numbers
import threading

import numpy as np

from eins.codegen.generate import drive
from eins.errors import GpuError, StreamError
from eins.ir.device import Window
from eins.ir.plan import Options, name_option
from eins.ir.types import Box
from eins.kernels.build import LAUNCH_OPTIONS
from eins.kernels.window import window_copy
from eins.kernels.fusion import device_error
from eins.passes import collection_paused
from eins.runtime.devices import visible_gpus
from eins.runtime.gpu_ops import launch_or_fallback, torch_dtype, triton_acc_dtype

BACKENDS = ("auto", "numpy", "cuda", "interpret")

# pip extras, named in every "missing package" error
EXTRA_HINT = ("install the GPU extra matching the CUDA driver: pip install 'eins[gpu-cuda12]' "
              "or 'eins[gpu-cuda13]' (CPU interpreter only: pip install 'eins[test]')")


def require_torch():
    try:
        import torch  # heavy: only the GPU path
    except ImportError:
        raise GpuError(f"the GPU runtime needs PyTorch, which is not installed; "
                       f"{EXTRA_HINT}") from None
    return torch


def require_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        raise GpuError(f"the GPU runtime needs Triton, which is not installed; "
                       f"{EXTRA_HINT}") from None
    return triton


def gpu_count() -> int:
    """GPUs torch sees; 0 without torch or without a CUDA build or driver, and 0 without
    importing torch where no GPU can be present (:func:`eins.runtime.devices.visible_gpus`)."""
    return visible_gpus()


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``numpy``; the others checked."""
    name_option("backend", backend, BACKENDS, GpuError)
    if backend == "auto":
        return "cuda" if gpu_count() else "numpy"
    if backend in ("cuda", "interpret"):
        require_torch()
        require_triton()
    if backend == "cuda" and not gpu_count():
        raise GpuError("backend 'cuda': torch sees no GPU (torch.cuda.is_available() is "
                       "False; a CPU-only torch build, or no driver). Use backend='interpret' "
                       f"to run the GPU path on the CPU, or {EXTRA_HINT}")
    return backend


def check_device_map(device_map, logical) -> None:
    """Structure only (no GPU needed): a dict {logical: physical} or a sequence giving the
    physical device of each logical device in order; non-negative ints (numpy's too)."""
    if device_map is None:
        return
    if isinstance(device_map, dict):
        keys, vals = list(device_map), list(device_map.values())
        if set(keys) != set(logical):
            raise GpuError(f"device_map keys {sorted(keys, key=repr)} must be exactly the "
                           f"logical devices {list(logical)}")
    elif isinstance(device_map, (list, tuple)):
        vals = list(device_map)
        if len(vals) != len(logical):
            raise GpuError(f"device_map {vals} has {len(vals)} entries for "
                           f"{len(logical)} logical devices {list(logical)}")
    else:
        raise GpuError(f"device_map must be a dict {{logical: gpu}} or a list of gpu ids, "
                       f"got {device_map!r}")
    for v in vals:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < 0:
            raise GpuError(f"device_map entry {v!r} is not a non-negative GPU index")


def resolve_device_map(device_map, logical, backend) -> dict:
    """{logical device: physical device}. Default: round-robin over the visible GPUs, so a
    p=8 plan runs on one GPU (8 streams on it) and on 8 GPUs one device each. On the
    interpret backend every physical id is the CPU; ids only decide which transfers count
    as local copies and which as peer copies."""
    check_device_map(device_map, logical)
    n = gpu_count() if backend == "cuda" else None
    if device_map is None:
        return {d: (i % n if n else 0) for i, d in enumerate(logical)}
    m = dict(device_map) if isinstance(device_map, dict) else dict(zip(logical, device_map))
    if n is not None:
        for d, g in m.items():
            if g >= n:
                raise GpuError(f"device_map sends logical device {d} to GPU {g}, but torch "
                               f"sees {n} GPU(s) (0..{n - 1})")
    return {d: int(m[d]) for d in logical}


# ----------------------------------------------------------------------------- emulation
class _Current(threading.local):
    def __init__(self):
        self.stack = []


_CURRENT = _Current()


class EmulatedStream:
    """A stream of the interpret backend. Work runs synchronously on the CPU, but it must be
    issued inside ``with stream:`` of the stream that owns it (checked by the device)."""

    def __init__(self, name: str):
        self.name = name
        self.waited = []    # events this stream waited on, in order (for tests)

    def __enter__(self):
        _CURRENT.stack.append(self)
        return self

    def __exit__(self, *exc):
        _CURRENT.stack.pop()
        return False

    def wait_event(self, event):
        if not isinstance(event, EmulatedEvent) or not event.recorded_on:
            raise StreamError(f"stream {self.name} waits on an event that was never recorded "
                              f"({event!r})")
        self.waited.append(event)

    def synchronize(self):
        pass

    def __repr__(self):
        return f"<EmulatedStream {self.name}>"


def current_emulated_stream():
    return _CURRENT.stack[-1] if _CURRENT.stack else None


class EmulatedEvent:
    """Records which stream reached it; only the current stream may record it."""

    def __init__(self):
        self.recorded_on = None

    def record(self, stream):
        if current_emulated_stream() is not stream:
            raise StreamError(f"event recorded on {stream!r} from outside it (current: "
                              f"{current_emulated_stream()!r})")
        self.recorded_on = stream

    def __repr__(self):
        return f"<EmulatedEvent on {self.recorded_on!r}>"


class EmulatedGraph:
    """Capture records every launch (a thunk) instead of running it; replay runs the list.
    The host program is not run again on replay, exactly as with a CUDA graph."""

    def __init__(self):
        self.launches = []

    def replay(self):
        for thunk in self.launches:
            thunk()


# ----------------------------------------------------------------------------- one device
class DeviceRuntime:
    """Logical device ``logical`` on ``physical``: its stream, buffers, launches, graphs."""

    def __init__(self, rt, logical: int, physical: int, slots: dict, buffers: dict,
                 literals: dict, err_size: int = 0):
        import torch  # heavy: only the GPU path
        self.rt, self.logical, self.physical = rt, logical, physical
        self.cuda = rt.backend == "cuda"
        self.torch_device = torch.device("cuda", physical) if self.cuda else torch.device("cpu")
        if self.cuda:
            self.stream = torch.cuda.Stream(device=self.torch_device)
        else:
            self.stream = EmulatedStream(f"dev{logical}@cpu{physical}")
        self.graphs = {}
        self._recording = None
        self.launches = 0
        self.replays = 0
        self.captures = 0   # graphs recorded (CUDA or emulated): 0 on a call that only replays
        self.unwaited = {}   # emulated: data_ptr of a received buffer -> (event, sender)
        with self.on_stream():  # the caching allocator ties these blocks to this stream
            # one allocation per slot of the static memory plan; buffers are views of it
            self.slots = {k: torch.empty(max(n, 1), dtype=torch.uint8, device=self.torch_device)
                          for k, n in slots.items()}
            self.B = {}
            for n, (s, dt, k) in buffers.items():
                tdt = torch_dtype(dt)
                nb = math.prod(s) * torch.empty((), dtype=tdt).element_size()
                self.B[n] = self.slots[k][:nb].view(tdt).view(s)
            for n, (v, dt) in literals.items():
                self.B[n] = torch.full((), v, dtype=torch_dtype(dt), device=self.torch_device)
            # the checked kernels' verdicts, one int64 per eqn, zero while nothing is wrong
            # (eins/kernels/fusion.py FusedKernel.checks); kept across calls, as
            # every buffer a graph captures
            self.err = torch.zeros(err_size, dtype=torch.int64, device=self.torch_device) \
                if err_size else None
        self.bytes = sum(t.numel() for t in self.slots.values()) + \
            sum(self.B[n].element_size() for n in literals)

    # ---- streams
    def on_stream(self):
        """Make this device's stream current (and its GPU the current device)."""
        if not self.cuda:
            return self.stream
        import torch  # heavy: only the GPU path
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.torch_device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def check_stream(self, what: str):
        """Reject work issued outside this device's stream."""
        if self.cuda:
            import torch  # heavy: only the GPU path
            ok = torch.cuda.current_stream(self.torch_device) == self.stream and \
                torch.cuda.current_device() == self.physical
        else:
            ok = current_emulated_stream() is self.stream
        if not ok:
            cur = current_emulated_stream() if not self.cuda else "another stream"
            raise StreamError(f"{what} for logical device {self.logical} issued outside its "
                              f"stream (current: {cur}); every operation of a device's "
                              f"program goes on that device's stream")

    @property
    def recording(self) -> bool:
        """Whether an emulated graph is recording this device's launches right now."""
        return self._recording is not None

    def issue(self, what: str, thunk, reads=()):
        """Run (or, while an emulated graph captures, record) one operation on the stream.
        Emulated: reading a buffer that another device sent before this stream waited on
        the send's event is refused (on a GPU it would race with the copy)."""
        self.check_stream(what)
        if self.unwaited:
            for t in reads:
                hit = self.unwaited.get(t.data_ptr())
                if hit is not None:
                    raise StreamError(f"{what} on logical device {self.logical} reads a "
                                      f"buffer that device {hit[1]} sent before waiting on "
                                      f"the send's event")
        self.launches += 1
        if self._recording is not None:
            self._recording.launches.append(thunk)
        else:
            thunk()

    def event(self):
        """An event recorded on this stream now."""
        if self.cuda:
            import torch  # heavy: only the GPU path
            ev = torch.cuda.Event()
        else:
            ev = EmulatedEvent()
        self.check_stream("event record")
        ev.record(self.stream)
        return ev

    def event_on_stream(self):
        with self.on_stream():
            return self.event()

    # ---- graphs
    def segment(self, i: int, fn):
        """A run of stream work between host steps: eager, or captured once and replayed
        (or, inside the capture of the whole program, recorded as it comes)."""
        with self.on_stream():
            if not self.rt.graphs or self.rt.direct:
                fn()
                return
            g = self.graphs.get(i)
            if g is None:
                # the eager warm-up inside capture computed this call's results: replaying
                # now would run the segment a second time, which is wrong where it reads a
                # buffer it (or a buffer sharing its slot) then overwrites (an in-place
                # residual add over an earlier segment's buffer, a slot reused after its
                # last read here)
                self.graphs[i] = self.capture(fn)
                return
            g.replay()
            self.replays += 1

    def capture(self, fn):
        """Run ``fn`` (one segment of this device's program) eagerly, then record it as a
        graph (CUDA, or emulated); the eager run is this call's result."""
        # warm up eagerly first: Triton compiles and loads its modules and cuBLAS makes its
        # handle and workspace at the first launch, none of which may happen during capture
        # (emulated too, so that the interpret backend runs the sequence a GPU runs)
        fn()
        self.captures += 1
        if not self.cuda:
            g = EmulatedGraph()
            self._recording = g
            try:
                with collection_paused():   # as for a CUDA capture (below)
                    fn()
            finally:
                self._recording = None
            return g
        import torch  # heavy: only the GPU path
        g = torch.cuda.CUDAGraph()
        # No cyclic collection while a graph captures: the collector runs at any allocation
        # and may free an unrelated dropped program (this runtime's objects refer to each
        # other, so only it frees them); destroying that program's CUDA graph (its exec,
        # its pool) or unloading its Triton modules during a capture invalidates the
        # capture (pytorch/pytorch#161037: torch.cuda.graph no longer collects first).
        with collection_paused(), torch.cuda.graph(
                g, pool=self.rt.graph_pool(self.logical), stream=self.stream):
            fn()
        return g

    # ---- the operations the generated walk calls
    def ew(self, kernel, ins, outs, checked=False):
        """A fused elementwise Triton kernel (eins/kernels/fusion.py): inputs of
        their own block shapes (broadcast by static offsets), outputs of one shape;
        ``checked``: it writes its checks' verdicts to ``self.err`` (FusedKernel.checks)."""
        import triton  # heavy: only the GPU path
        n = outs[0].numel()
        blk = self.rt.K.BLOCK
        if checked and self.err is None:
            raise GpuError(f"logical device {self.logical}: a checked kernel but no check "
                           f"buffer (the module's ERR_SIZE is 0)")
        err = (self.err,) if checked else ()

        def run():
            if n:
                kernel[(triton.cdiv(n, blk),)](*ins, *outs, *err, n, BLOCK=blk,
                                               **LAUNCH_OPTIONS)
        self.issue("elementwise kernel", run, ins)

    def agg(self, kernel, dst, *srcs):
        import triton  # heavy: only the GPU path
        n = dst.numel()
        acc = triton_acc_dtype(dst.dtype)

        def run():
            if n:
                kernel[(triton.cdiv(n, self.rt.K.BLOCK),)](*srcs, dst, n, BLOCK=self.rt.K.BLOCK,
                                                           ACC=acc, **LAUNCH_OPTIONS)
        self.issue("aggregation kernel", run, srcs)

    def agg_pairs(self, kernel, dst, *srcs):
        """The lse ⊕ of key-split attention partials, (o, lse) pairs as a trailing axis of
        2 (eins.ir.joinagg): into pairs, or finalized into the output's dtype."""
        import triton  # heavy: only the GPU path
        n = dst.numel()
        blk = self.rt.K.BLOCK

        def run():
            if n:
                kernel[(triton.cdiv(n, blk),)](*srcs, dst, n, BLOCK=blk, **LAUNCH_OPTIONS)
        self.issue("aggregation kernel", run, srcs)

    def slice(self, dst, src, idx):
        self.issue("slice copy", lambda: dst.copy_(src[idx]), (src,))

    def place(self, dst, parts):
        """The local sources of a placement (a windowed ⊕-sum or concat): each one's window
        of rows into ``dst`` (masked copies of fixed shape; ``(src, None, idx)``: all of it
        into ``dst[idx]``); the senders wrote the other rows."""
        interp = not self.cuda

        def run():
            for src, win, idx in parts:
                if win is None:
                    dst[idx].copy_(src)
                    continue
                table, axis, los, his, lo, hi, _, dlo, dhi, more = win
                window_copy(src, dst, table, Window(axis, "", los, his, more), Box(lo, hi),
                            interp, False, Box(dlo, dhi))
        self.issue("place window copy", run,
                   [p[0] for p in parts] + [p[1][0] for p in parts if p[1] is not None])

    def concat(self, dst, parts):
        def run():
            for src, idx in parts:
                dst[idx].copy_(src)
        self.issue("concat copy", run, [p[0] for p in parts])

    def op(self, prim, fspec, outs, *args, **params):
        """A non-elementwise primitive through its GPU lowering (its kernel, or its torch
        fallback: eins/runtime/gpu_ops.py ``launch_or_fallback``), results written into the
        preallocated outputs (cast to the eqn's dtype); a tensor among ``params`` (a
        pipelined piece's running pairs) is read too."""
        run = launch_or_fallback(prim, fspec, outs, args, params, self.rt.attention,
                                 self.rt.kernels, self.rt.backend, self.rt.measured)
        self.issue(f"{prim} kernel", run, [a for a in (*args, *params.values())
                                            if hasattr(a, "data_ptr")])

    def load(self, dst_name, k, idx):
        """Host step: the block ``idx`` of program input ``k`` into buffer ``dst_name``
        (skipped when the input was placed and is unchanged)."""
        self.rt.io.load(self, self.B[dst_name], k, idx)

    def store(self, src_name, k, idx):
        self.rt.io.store(self, self.B[src_name], k, idx)

    def send(self, src_name, peer, dst_name, key, window=None):
        """Copy into the peer's receive buffer on this stream, then record the event the
        peer's stream will wait on. Same physical GPU: a device-local copy; else peer.
        ``window`` (table tensor, axis, los, his, box lo, box hi, fill, destination box lo,
        hi, further intervals: eins.ir.device.Window; a windowed send of
        the capacity program, eins/passes/windows.py): the masked copy kernel moves only the
        rows the table gives this call, zeros elsewhere (``fill``) or, into a placement's
        destination, nothing elsewhere (eins/kernels/window.py)."""
        src = self.B[src_name]
        other = self.rt.devices[peer]
        dst = other.B[dst_name]
        with self.on_stream():
            if window is None:
                self.issue("send copy", lambda: dst.copy_(src, non_blocking=True), (src,))
            else:
                table, axis, los, his, lo, hi, fill, dlo, dhi, more = window
                w, box, dbox = Window(axis, "", los, his, more), Box(lo, hi), Box(dlo, dhi)
                interp = not self.cuda
                if self.cuda and other.physical != self.physical:
                    self.rt.peer_access(self.torch_device, other.torch_device)
                self.issue("send window copy", lambda: window_copy(
                    src, dst, table, w, box, interp, fill, dbox), (src, table))
            ev = self.rt.mbox[key] = self.event()
        if not self.cuda:
            other.unwaited[dst.data_ptr()] = (ev, self.logical)
        # a windowed send counts its capacity (the rows a call moves: window_bytes)
        kind = "window" if window is not None else \
            "local" if other.physical == self.physical else "peer"
        self.rt.count_transfer(self.logical, peer, kind, src.numel() * src.element_size())

    def arrived(self, key) -> bool:
        return key in self.rt.mbox

    def wait(self, key):
        """The only cross-device dependency: this stream waits on the sender's event."""
        ev = self.rt.mbox.pop(key)
        with self.on_stream():
            self.stream.wait_event(ev)
        if self.unwaited:
            self.unwaited = {p: h for p, h in self.unwaited.items() if h[0] is not ev}


class Runtime:
    """Every logical device of one compiled program, plus what they share: the kernel
    module ``K``, the mailbox of events, the graph pools and the call's I/O."""

    def __init__(self, backend: str, device_map: dict, modules: dict, K, graphs: bool,
                 kernels: bool = True, attention: str = "auto", measured=None):
        self.backend, self.device_map, self.K, self.graphs = backend, device_map, K, graphs
        # the attention kernel's impl (eins/kernels/attention.py choose_impl)
        Options._check_attention(attention)
        self.attention = attention
        # the machine profile's measured attention kernels ({impl: {shape: ms}}), for
        # attention="auto" (eins/kernels/attention.py fastest_measured); None: today's rule
        self.measured = measured
        # True: attention, rms_norm, rope (Triton) and matmul (torch.matmul(out=)) through
        # eins/kernels' launchers; False: every non-elementwise op through its torch
        # fallback (Primitive.lowerings, eins/ops/*), e.g. to compare the two
        self.kernels = kernels
        self.mbox = {}
        self.io = None
        self._pools = {}
        self._peers = set()   # GPU pairs a copy kernel has written across
        self.transfer_bytes, self.transfers = {}, 0
        self.devices = {d: DeviceRuntime(self, d, device_map[d], m.SLOTS, m.BUFFERS,
                                         m.LITERALS, m.ERR_SIZE)
                        for d, m in modules.items()}
        self.modules = modules

    def graph_pool(self, logical):
        """One graph memory pool per logical device, shared by its segments: they replay in
        capture order on its one stream, which is what makes sharing safe. Logical devices
        sharing a GPU get separate pools, since their streams replay concurrently."""
        if logical not in self._pools:
            import torch  # heavy: only the GPU path
            self._pools[logical] = torch.cuda.graph_pool_handle()
        return self._pools[logical]

    def peer_access(self, a, b):
        """Let GPUs ``a`` and ``b`` reach each other's memory before a windowed copy kernel
        on one writes the other's buffer: a one-element copy each way has torch enable
        peer access (once per pair, on the eager first call, before any capture)."""
        import torch  # heavy: only the GPU path
        if (a, b) in self._peers:
            return
        self._peers.update({(a, b), (b, a)})
        torch.zeros(1, device=b).copy_(torch.zeros(1, device=a))
        torch.zeros(1, device=a).copy_(torch.zeros(1, device=b))

    def count_transfer(self, src, dst, kind, nbytes):
        self.transfers += 1
        self.transfer_bytes[(src, dst, kind)] = self.transfer_bytes.get((src, dst, kind), 0) \
            + nbytes

    # "auto": one whole graph when every logical device shares one GPU, per-segment graphs
    # otherwise; "segments": per-segment graphs always (so a one-GPU machine can exercise the
    # multi-GPU path's capture: benchmarks/gpu_check.py sets it for some cases)
    graph_mode = "auto"

    @property
    def one_graph(self) -> bool:
        """Whether the whole body of every device is one graph: when all logical devices
        share one physical device, their streams fork from and join into one capture, so
        the transfers between them (device-local copies and events) are captured too. Across
        GPUs each device captures its runs of kernels between transfers instead: a graph per
        device cannot hold both ends of a two-way exchange (an event wait inside one graph
        would see the other graph's previous launch)."""
        if self.graph_mode not in ("auto", "segments"):
            raise GpuError(f"graph_mode must be 'auto' or 'segments', got {self.graph_mode!r}")
        return self.graph_mode == "auto" and len(set(self.device_map.values())) == 1

    def run(self, io):
        """One call: every device's loads (host steps), then the devices' bodies round-robin
        until each waits on a receive (sends never wait; the lists come from one global
        topological order), eagerly, as segment graphs or as one whole graph; then the
        stores."""
        self.io, self.mbox, self.transfer_bytes, self.transfers = io, {}, {}, 0
        for d, dev in self.devices.items():
            io.begin(dev)
            if dev.err is not None:   # the checks' verdicts start clean, whatever the last
                with dev.on_stream():  # call left (one that failed after its kernels ran)
                    dev.err.zero_()
            self.modules[d].loads(dev)
        if self.graphs and self.one_graph:
            self._run_whole()
        else:
            self.drive()
        for d, dev in self.devices.items():
            self.modules[d].stores(dev)
            io.end(dev)

    def checks_failed(self, program=None):
        """The error of the checked kernels (FusedKernel.checks) of the last call, or None:
        the first eqn that failed on any device, with its most negative exponent over the
        devices. Reading a device's verdicts waits for its stream, so only programs with
        checked kernels pay it; :meth:`run` clears them before each call's loads."""
        got = None
        for dev in self.devices.values():
            if dev.err is not None:
                with dev.on_stream():
                    e = dev.err.cpu().numpy()   # a copy on the device's stream: it waits
                got = e.copy() if got is None else np.minimum(got, e)
        return None if got is None else device_error(got, program)

    def drive(self):
        """Run every device's program body once, eagerly, interleaved by the mailbox."""
        gens = {d: self.modules[d].body(dev, self.K) for d, dev in self.devices.items()}
        drive(gens, self.mbox)
        if self.mbox:
            raise GpuError(f"{len(self.mbox)} transfers were sent but never received")

    # ---- one graph for every device's body (all on one physical device)
    whole = None
    whole_replays = 0
    whole_captures = 0
    direct = False      # segments run their kernels as they come (inside the whole capture)

    def _run_whole(self):
        if self.whole is None:
            self.direct = True
            try:
                self.drive()   # warm up eagerly (compiles, workspaces, cached tables)
                counted = (dict(self.transfer_bytes), self.transfers)
                self.whole = self.capture_whole()
            finally:
                self.direct = False
            self._counted = counted
        self._replay_whole()
        self.transfer_bytes, self.transfers = dict(self._counted[0]), self._counted[1]

    def capture_whole(self):
        """Record every device's body as one graph (all devices on one GPU); ``origin`` is
        the stream the capture forks from and joins back to."""
        devs = list(self.devices.values())
        self.whole_captures += 1
        if self.backend != "cuda":
            g = EmulatedGraph()
            for dev in devs:
                dev._recording = g
            try:
                with collection_paused():
                    self.drive()
            finally:
                for dev in devs:
                    dev._recording = None
            return g
        import torch  # heavy: only the GPU path
        first = devs[0]
        self.origin = torch.cuda.Stream(device=first.torch_device)
        g = torch.cuda.CUDAGraph()
        with collection_paused(), torch.cuda.device(first.torch_device), \
                torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle(), stream=self.origin):
            fork = torch.cuda.Event()
            fork.record(self.origin)
            for dev in devs:            # every device's stream joins the capture
                with dev.on_stream():
                    dev.stream.wait_event(fork)
            failed = True
            try:
                self.drive()
                failed = False
            finally:
                # and is joined back before it ends, also when the drive raised: then the
                # capture's end reports the drive's error (not "unjoined"), and no device
                # stream is left in a capture that was never joined
                for dev in devs:
                    try:
                        self.origin.wait_event(dev.event_on_stream())
                    except Exception:
                        if not failed:
                            raise
        return g

    def _replay_whole(self):
        """The graph runs after every device's loads and before its stores."""
        devs = list(self.devices.values())
        if self.backend != "cuda":
            origin = getattr(self, "origin", None) or EmulatedStream("whole-graph")
            self.origin = origin
            ctx = origin
            done = EmulatedEvent()
        else:
            import torch  # heavy: only the GPU path
            origin = self.origin
            ctx = torch.cuda.stream(origin)
            done = torch.cuda.Event()
        for dev in devs:
            origin.wait_event(dev.event_on_stream())
        with ctx:
            self.whole.replay()
            done.record(origin)
        for dev in devs:
            with dev.on_stream():
                dev.stream.wait_event(done)
        self.whole_replays += 1
