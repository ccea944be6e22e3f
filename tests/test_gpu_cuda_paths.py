"""CUDA-only branches of the GPU runtime (eins/runtime/gpu.py, gpu_exec.py) checked on the
CPU with stand-in objects: what a real GPU would do differently from the interpret backend
(asynchronous copies from pinned memory, capture ending on an error) is what these stand-ins
record."""
import contextlib

import pytest

torch = pytest.importorskip("torch")

from eins.runtime import gpu  # noqa: E402
from eins.runtime.gpu_exec import _Call  # noqa: E402


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
    call = _Call.__new__(_Call)
    call.skip, call.tensors = [False], [(_Src(pinned), host)]
    call.stats = {"h2d_bytes": 0, "device_load_bytes": 0, "loads": 0}
    dst = _Dst()
    call.load(_Dev(), dst, ("in", 0), Ellipsis)
    assert dst.copies == [want]
