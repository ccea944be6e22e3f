"""Which devices exist here. Without GPUs (or without torch from a `gpu-cuda*` extra) eins
runs on virtual CPU devices, 8 by default, like the paper's 8-GPU servers."""
from __future__ import annotations

import glob
import os
import sys

VIRTUAL_DEFAULT = 8

# Device nodes without which no CUDA (or ROCm) GPU is visible to a Linux process: the NVIDIA
# driver's, WSL's GPU paravirtualization, AMD's kernel fusion driver (ROCm's torch.cuda).
GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")
# Variables that hide every GPU when empty or "-1" (CUDA's, and ROCm's names for it).
VISIBLE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")

# DLPack's device types (dlpack.h DLDeviceType): memory a GPU kernel can read in place
DL_CUDA, DL_CUDA_MANAGED = 2, 13


def dlpack_gpu(a) -> int | None:
    """The GPU a DLPack array (a CuPy array, say) lives on, by ``__dlpack_device__``; None
    when it is elsewhere (the CPU)."""
    dev_type, dev_id = (int(v) for v in a.__dlpack_device__())
    return dev_id if dev_type in (DL_CUDA, DL_CUDA_MANAGED) else None


def gpu_possible() -> bool:
    """Whether this process could see a GPU at all, decided without importing torch
    (importing it to ask costs seconds, and ``backend="auto"`` asks on every machine):
    False when a visibility variable hides every device (``CUDA_VISIBLE_DEVICES=""`` or
    ``-1``), on macOS (no CUDA), and on Linux without a GPU device node; True otherwise
    (then torch is asked)."""
    for var in VISIBLE_VARS:
        v = os.environ.get(var)
        if v is not None and v.strip() in ("", "-1"):
            return False
    if sys.platform == "darwin":
        return False
    if sys.platform.startswith("linux"):
        return any(glob.glob(pattern) for pattern in GPU_NODES)
    return True   # Windows and others: no cheap test, ask torch


def visible_gpus() -> int:
    """The number of CUDA devices torch sees (the GPU runtime is built on torch, see
    eins/runtime/gpu.py); 0 without torch, without a CUDA build or without a GPU, and 0
    without importing torch where none can be present (:func:`gpu_possible`)."""
    if not gpu_possible():
        return 0
    try:
        import torch  # heavy: only where a GPU can be present
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver means "no GPU here" too
        return 0


def default_device_count() -> int:
    return visible_gpus() or VIRTUAL_DEFAULT
