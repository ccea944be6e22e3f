"""CUDA-only branches of the GPU runtime (eins/runtime/gpu.py, gpu_exec.py) checked on the
CPU with stand-in objects: what a real GPU would do differently from the interpret backend
(asynchronous copies from pinned memory, capture ending on an error) is what these stand-ins
record."""
import contextlib

import pytest

torch = pytest.importorskip("torch")

from eins.runtime import gpu  # noqa: E402
from eins.runtime.gpu_exec import Call  # noqa: E402


class _Src:
    """A host tensor as a Load sees it: sliced, and pinned or not."""

    def __init__(self, pinned):
        self.pinned = pinned

    def is_pinned(self):
        return self.pinned

    def __getitem__(self, idx):
        return self


class _Dst:
    def __init__(self):
        self.copies = []

    def copy_(self, src, non_blocking=False):
        self.copies.append(non_blocking)

    def numel(self):
        return 4

    def element_size(self):
        return 4


class _Dev:
    def on_stream(self):
        return contextlib.nullcontext()

    def issue(self, what, thunk, reads=()):
        thunk()


@pytest.mark.parametrize("pinned,host,want", [(False, True, True), (True, True, False),
                                              (False, False, True)])
def test_a_load_from_pinned_host_memory_waits_for_its_copy(pinned, host, want):
    """From pageable memory CUDA stages the bytes before cudaMemcpyAsync returns, so a
    non-blocking load leaves the caller free to change its array; from pinned memory the
    copy is truly asynchronous, and a call returning device outputs does not synchronize:
    that load must be a blocking copy."""
    call = Call.__new__(Call)
    call.skip, call.tensors = [False], [(_Src(pinned), host)]
    call.stats = {"h2d_bytes": 0, "device_load_bytes": 0, "loads": 0}
    dst = _Dst()
    call.load(_Dev(), dst, ("in", 0), Ellipsis)
    assert dst.copies == [want]


class _Event:
    def __init__(self, *a, **k):
        self.on = None

    def record(self, stream=None):
        self.on = stream


class _Stream:
    def __init__(self, name="origin", device=None):
        self.name, self.waited = name, []

    def wait_event(self, ev):
        self.waited.append(ev)


class _Capture:
    """torch.cuda.graph as CUDA ends it: a stream forked into the capture (it waited on an
    event of the origin) and never joined back makes the capture's end fail."""

    def __init__(self, devs):
        self.devs = devs

    def __call__(self, g, pool=None, stream=None):
        self.origin = stream
        return self

    def __enter__(self):
        import gc
        self.gc_during = gc.isenabled()
        return self

    def __exit__(self, *exc):
        joined = {ev.on for ev in self.origin.waited}
        forked = [d.stream for d in self.devs if d.stream.waited]
        if any(s not in joined for s in forked):
            raise RuntimeError("CUDA error: the capture sequence contains a fork that was "
                               "not joined to the primary stream")
        return False


class _CudaDev:
    def __init__(self, i):
        self.logical, self.torch_device = i, torch.device("cpu")
        self.stream = _Stream(f"dev{i}")

    def on_stream(self):
        return contextlib.nullcontext()

    def event_on_stream(self):
        ev = _Event()
        ev.record(self.stream)
        return ev


def test_a_failed_whole_graph_capture_joins_every_stream_and_reports_its_own_error(
        monkeypatch):
    """An error inside the whole-program capture (a kernel that cannot run, say) must
    surface as itself: the device streams forked into the capture are joined back on the
    way out, so CUDA's end of capture does not fail first with an unjoined fork (which
    would also leave those streams in a capture)."""
    devs = [_CudaDev(0), _CudaDev(1)]
    capture = _Capture(devs)
    for name, value in (("Stream", _Stream), ("CUDAGraph", object), ("graph", capture),
                        ("graph_pool_handle", lambda: None), ("Event", _Event),
                        ("device", lambda d: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    rt = gpu.Runtime.__new__(gpu.Runtime)
    rt.backend, rt.devices = "cuda", {d.logical: d for d in devs}

    def drive():
        raise gpu.GpuError("no kernel for this block")
    rt.drive = drive
    with pytest.raises(gpu.GpuError, match="no kernel for this block"):
        rt.capture_whole()
    assert [ev.on for ev in rt.origin.waited] == [d.stream for d in devs]
    rt.drive = lambda: None   # and a capture that works ends joined, without an error
    rt.capture_whole()
    assert capture.gc_during is False   # no cyclic collection inside the capture


@pytest.mark.parametrize("mode", ["auto", "segments"])
def test_no_garbage_collection_while_a_graph_captures(monkeypatch, mode):
    """The collector could free another, dropped program mid-capture (runtime objects
    form cycles), destroying its CUDA graph or unloading its Triton modules, which
    invalidates the capture on a GPU: it is paused while a graph (whole-program or a
    segment) records, and on again after."""
    import gc
    import numpy as np
    import eins
    from helpers import small_workloads
    fn, args = small_workloads()["ffn"]
    c = eins.distribute(fn, devices=2).lower(*args).compile("interpret", graphs=True)
    c.gpu.rt.graph_mode = mode
    seen = []
    orig = gpu.DeviceRuntime.issue

    def issue(dev, what, thunk, reads=()):
        if dev.recording:
            seen.append(gc.isenabled())
        return orig(dev, what, thunk, reads)
    monkeypatch.setattr(gpu.DeviceRuntime, "issue", issue)
    assert gc.isenabled()
    got = c(*args)
    assert seen and not any(seen) and gc.isenabled()
    want = np.asarray(eins.jit(fn)(*args))
    assert np.abs(np.asarray(got) - want).max() <= 1e-4 * np.abs(want).max()


def test_a_call_from_another_caller_stream_still_follows_the_previous_call():
    """Call 1 on caller stream A, call 2 on caller stream B (another torch stream, thread
    or GPU): B never waited on call 1's end events, yet call 2's sends write receive
    buffers that call 1's peers may still read (eager and per-segment runs; device outputs,
    so no host sync in between). Each device stream of call 2 waits on every device's end
    event of call 1 before its first load."""
    import numpy as np
    import eins
    from helpers import small_workloads
    fn, args = small_workloads()["ffn"]
    c = eins.distribute(fn, devices=4).lower(*args).compile("interpret", graphs=False)
    exe = c.gpu
    tensors = [torch.from_numpy(a) for a in args]   # device arrays: no sync at the end
    exe.host_stream = gpu.EmulatedStream("caller A")
    c(*tensors)
    ends = {ev for ev in exe.host_stream.waited}     # call 1's end events, one per device
    assert {ev.recorded_on for ev in ends} == {d.stream for d in exe.rt.devices.values()}
    exe.host_stream = gpu.EmulatedStream("caller B")
    before = {d: len(dev.stream.waited) for d, dev in exe.rt.devices.items()}
    got = c(*tensors)
    for d, dev in exe.rt.devices.items():
        assert ends <= set(dev.stream.waited[before[d]:])
    want = np.asarray(eins.jit(fn)(*args))
    assert np.abs(got.numpy() - want).max() <= 1e-4 * np.abs(want).max()
