"""The rank runtime's CPU kernel set (eins/runtime/ranks.py ``KERNELS["cpu"]``): eins's
reference operators on numpy blocks, and the wire as bytes over gloo."""
from __future__ import annotations

import numpy as np

from eins.ir.joinagg import aggregate, finalize
from eins.runtime.numpy_backend import run_block

__all__ = ["NumpyKernels"]


class NumpyKernels:
    """The CPU kernels: eins's reference operator implementations on numpy blocks (the ones
    the virtual-device executor runs). Buffers are numpy arrays; the wire is a uint8 torch
    view of their bytes (any dtype, bfloat16 included), sent over gloo."""

    name = "cpu"
    pieces = True   # kernel() takes a pipelined piece's running pairs (acc)

    def load(self, array, dtype):
        return np.ascontiguousarray(array, dtype=dtype)

    def slice(self, array, rel):
        return np.ascontiguousarray(array[rel])

    def concat(self, box, dtype, parts):
        out = np.empty(box.shape, dtype)
        for rel, a in parts:
            out[rel] = a
        return out

    def aggregate(self, op, arrays, dtype):
        # the full aggregate of a ⊕ of pairs (lse) is finalized to its buffer's dtype, as
        # the numpy executor does
        return finalize(op, aggregate(op, arrays), dtype)

    def kernel(self, eqn, fspec, args, out_dtypes, acc=None):
        return run_block(eqn, fspec, args, out_dtypes, acc)

    def to_wire(self, array):
        import torch  # heavy: only the GPU path
        return torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))

    def wire_buffer(self, nbytes):
        import torch  # heavy: only the GPU path
        return torch.empty(int(nbytes), dtype=torch.uint8)

    def from_wire(self, tensor, shape, dtype):
        return tensor.numpy().view(dtype).reshape(shape)

    def to_host(self, array):
        return np.asarray(array)

    def nbytes(self, array) -> int:
        return int(array.nbytes)
