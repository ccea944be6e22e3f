"""Which devices exist here. Without GPUs (or without torch from a `gpu-cuda*` extra) eins
runs on virtual CPU devices, 8 by default, like the paper's 8-GPU servers."""
from __future__ import annotations

VIRTUAL_DEFAULT = 8

# DLPack's device types (dlpack.h DLDeviceType): memory a GPU kernel can read in place
DL_CUDA, DL_CUDA_MANAGED = 2, 13


def dlpack_gpu(a) -> int | None:
    """The GPU a DLPack array (a CuPy array, say) lives on, by ``__dlpack_device__``; None
    when it is elsewhere (the CPU)."""
    dev_type, dev_id = (int(v) for v in a.__dlpack_device__())
    return dev_id if dev_type in (DL_CUDA, DL_CUDA_MANAGED) else None


def visible_gpus() -> int:
    """The number of CUDA devices torch sees (the GPU runtime is built on torch, see
    eins/runtime/gpu.py); 0 without torch, without a CUDA build or without a GPU."""
    from eins.runtime.gpu import gpu_count
    return gpu_count()


def default_device_count() -> int:
    return visible_gpus() or VIRTUAL_DEFAULT
