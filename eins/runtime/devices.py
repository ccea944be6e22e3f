"""Which devices exist here. Without GPUs (or without the `gpu` extra) eins runs on virtual
CPU devices, 8 by default, like the paper's 8-GPU servers."""
from __future__ import annotations

VIRTUAL_DEFAULT = 8


def visible_gpus() -> int:
    """The number of CUDA devices CuPy sees; 0 without CuPy or without a GPU."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return 0


def default_device_count() -> int:
    return visible_gpus() or VIRTUAL_DEFAULT
