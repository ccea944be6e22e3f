"""Which devices exist here. Without GPUs (or without torch from a `gpu-cuda*` extra) eins
runs on virtual CPU devices, 8 by default, like the paper's 8-GPU servers."""
from __future__ import annotations

VIRTUAL_DEFAULT = 8


def visible_gpus() -> int:
    """The number of CUDA devices torch sees (the GPU runtime is built on torch, see
    eins/runtime/gpu.py); 0 without torch, without a CUDA build or without a GPU."""
    from eins.runtime.gpu import gpu_count
    return gpu_count()


def default_device_count() -> int:
    return visible_gpus() or VIRTUAL_DEFAULT
