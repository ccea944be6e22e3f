"""The GPU runtime's kernel sets for the rank runtime (eins/runtime/ranks.py; issue 13: "the
GPU kernels are the CUDA backend's").

The rank runtime walks one rank's instruction list and calls a kernel set per instruction
(load, slice, concat, ⊕, kernel, and the wire of Send/Recv). :class:`TorchKernels` is that
interface over torch tensors, with the kernels the GPU runtime's generated programs launch:

- an elementwise eqn: its Triton kernel from eins/kernels/fusion.py (a group of
  one; the rank walk has no fusion across instructions);
- ⊕: the Triton aggregation kernel of the generated programs (``triton_agg.py.j2``), the
  lse ⊕ of key-split attention included, (o, lse) pairs as a trailing axis of 2;
- every other primitive: its registered GPU launcher (cuBLAS matmul via
  ``torch.matmul(out=)``, Triton attention/norms/rope), else its torch fallback
  (``eins.runtime.gpu_ops.launch_or_fallback``, which :meth:`DeviceRuntime.op` calls too);
  a key-split attention block (outputs held as pairs) runs the Triton kernel writing its (o, lse)
  pairs (``eins.kernels.attention.attention_pairs``), and the ⊕ of the pairs is
  finalized to the output's dtype as the numpy executor does.

Two sets (:data:`KERNEL_SETS`), registered by ranks.make_kernels on first use (importing
this module needs neither torch nor triton; this module never imports ranks):

- ``"cuda"``: CUDA tensors on the rank's GPU, every operation on the rank's own stream.
  Wire ``"cuda"``: Send/Recv tensors are CUDA uint8 views, over NCCL (NCCL's stream waits on
  the current stream, so the current stream first waits on the rank's); wire ``"cpu"`` (ranks
  sharing a GPU): host copies over gloo.
- ``"interpret"``: the same kernels on CPU tensors under Triton's interpreter, over gloo: how
  CI runs this path end to end without a GPU.

No CUDA graphs here: the rank walk is eager, one launch per instruction.
"""
from __future__ import annotations

import contextlib

import numpy as np

from eins.errors import GpuError
from eins.ir.joinagg import PAIR_AGGS, is_lse_pair
from eins.kernels import build, fusion
from eins.kernels.build import LAUNCH_OPTIONS
from eins.kernels.fusion import agg_source
from eins.runtime.gpu import require_torch, require_triton, resolve_backend
from eins.runtime.gpu_ops import (from_numpy, launch_or_fallback, to_numpy, torch_dtype,
                                  triton_acc_dtype)

BLOCK = 1024  # elements per Triton program, as in the generated kernel module


def _torch():
    require_triton()
    return require_torch()


class TorchKernels:
    """The rank runtime's kernel interface (see ranks.NumpyKernels) over torch tensors on
    ``backend`` "cuda" (GPU ``device_index``) or "interpret" (the CPU)."""

    attention = "auto"   # the attention kernel's impl (eins.ir.plan.Options.attention)

    def __init__(self, backend: str, device_index: int = 0, wire: str = "cpu"):
        torch = _torch()
        if backend not in ("cuda", "interpret"):
            raise GpuError(f"TorchKernels runs on 'cuda' or 'interpret', not {backend!r}")
        if wire not in ("cpu", "cuda") or (backend == "interpret" and wire != "cpu"):
            raise GpuError(f"wire {wire!r} with backend {backend!r}: the interpret backend "
                           f"sends CPU tensors (gloo); cuda sends 'cuda' (NCCL) or 'cpu'")
        self.torch, self.name, self.wire = torch, backend, wire
        # kernel() takes a pipelined piece's running pairs (acc). Not over NCCL: a piece's
        # receives leave the batch their peer's sends were posted with, which is tested
        # on gloo and on a fake of NCCL's coalesced batches (tests/test_rank_runtime.py),
        # never on NCCL itself (no GPUs here)
        self.pieces = wire != "cuda"
        self.cuda = backend == "cuda"
        if self.cuda:
            resolve_backend("cuda")   # a clear error when torch sees no GPU
            n = torch.cuda.device_count()
            if not 0 <= device_index < n:
                raise GpuError(f"rank kernels on GPU {device_index}, but torch sees {n}")
            self.device = torch.device("cuda", device_index)
            self.stream = torch.cuda.Stream(device=self.device)
        else:
            self.device = torch.device("cpu")
            self.stream = None
        self._ew = {}     # (prim, params, operand shapes/dtypes, out) -> FusedKernel
        self._aggs = {}   # (op, count, final dtype) -> Triton kernel
        self.launches = 0

    # ---- streams: every operation runs on the rank's stream
    def _on(self):
        if not self.cuda:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self.torch.cuda.device(self.device))
        stack.enter_context(self.torch.cuda.stream(self.stream))
        return stack

    def _alloc(self, shape, dtype):
        """A block of numpy ``dtype``; an (o, lse) pair dtype is a trailing axis of 2."""
        dtype = np.dtype(dtype)
        if is_lse_pair(dtype):
            return self.torch.empty(tuple(shape) + (2,), dtype=torch_dtype(dtype["o"]),
                                    device=self.device)
        return self.torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self.device)

    # ---- the instructions
    def load(self, array, dtype):
        host = from_numpy(np.ascontiguousarray(np.asarray(array), dtype=dtype))
        with self._on():
            return host.to(self.device, non_blocking=False).contiguous()

    def slice(self, t, rel):
        with self._on():
            return t[rel].contiguous().clone()

    def concat(self, box, dtype, parts):
        with self._on():
            out = self._alloc(box.shape, dtype)
            for rel, a in parts:
                out[rel].copy_(a)
        return out

    def aggregate(self, op, arrays, dtype):
        """⊕ of equally shaped blocks with the generated programs' Triton kernel. For the
        lse ⊕ of key-split attention, (o, lse) pairs in; pairs out when ``dtype`` is the
        pair dtype, else the full aggregate finalized to ``dtype`` (as the numpy executor
        and ranks.NumpyKernels do)."""
        dtype = np.dtype(dtype)
        pairs = op in PAIR_AGGS
        final = pairs and not is_lse_pair(dtype)
        kern = self._agg_kernel(op, len(arrays), dtype if final else None)
        with self._on():
            if final:   # the pairs' trailing axis of 2 goes; o is written in ``dtype``
                dst = self._alloc(tuple(arrays[0].shape[:-1]), dtype)
            else:
                dst = self.torch.empty_like(arrays[0])
            n = dst.numel()   # pairs out: floats (the kernel halves it); final: outputs
            if n:
                grid = ((n + BLOCK - 1) // BLOCK,)
                if pairs:
                    kern[grid](*arrays, dst, n, BLOCK=BLOCK, **LAUNCH_OPTIONS)
                else:
                    kern[grid](*arrays, dst, n, BLOCK=BLOCK, ACC=triton_acc_dtype(dst.dtype),
                                **LAUNCH_OPTIONS)
        self.launches += 1
        return dst

    def _agg_kernel(self, op, count, final_dtype=None):
        key = (op, count, final_dtype)
        k = self._aggs.get(key)
        if k is None:
            name = f"agg_{op}_{count}" + (f"_final_{final_dtype.name}" if final_dtype else "")
            src = agg_source(name, op, count, final_dtype)
            k = self._aggs[key] = build.compile_source(src, name, not self.cuda)
        return k

    def kernel(self, eqn, fspec, args, out_dtypes, acc=None):
        """One eqn's block. Outputs held as (o, lse) pairs (``out_dtypes``: the buffers'
        dtypes) are a key-split block's partial: the primitive's partial launcher (attention:
        the Triton kernel with the block's global offsets, writing the pairs). ``acc``: a
        pipelined piece's running pairs (eins/passes/pipeline.py), which the kernel starts
        from (one launch, as in the generated programs)."""
        out_dtypes = [np.dtype(dt) for dt in out_dtypes]
        partial = any(is_lse_pair(dt) for dt in out_dtypes)
        shapes = [tuple(b.shape) for b in fspec.outputs]
        with self._on():
            if eqn.primitive.is_elementwise and len(eqn.outputs) == 1 and not partial:
                outs = [self._alloc(shapes[0], out_dtypes[0])]
                self._elementwise(eqn, fspec, args, outs[0])
            else:
                tensors = [self._literal(a) if isinstance(a, tuple) else a for a in args]
                outs = [self._alloc(s, dt) for s, dt in zip(shapes, out_dtypes)]
                params = dict(eqn.params, partial=True) if partial else eqn.params
                if acc is not None:
                    params = dict(params, running=acc)
                launch_or_fallback(eqn.primitive, fspec, outs, tensors, params, self.attention,
                                   platform=self.name)()
        self.launches += 1
        return outs

    def _literal(self, a):
        _, v, dt = a
        return self.torch.tensor(v, dtype=torch_dtype(dt), device=self.device)

    def _elementwise(self, eqn, fspec, args, out):
        """The eqn's Triton kernel (fusion.op_source, a group of one): literals baked into
        the source, each tensor operand broadcast against the output block by its shape."""
        operands = tuple(a if isinstance(a, tuple) else (tuple(a.shape), np.dtype(v.dtype))
                         for a, v in zip(args, eqn.inputs))
        key = (eqn.prim, repr(eqn.params), operands, tuple(out.shape),
               np.dtype(eqn.outputs[0].dtype))
        fk = self._ew.get(key)
        if fk is None:
            fk = self._ew[key] = fusion.op_source(eqn.primitive, eqn.params, operands,
                                                  tuple(out.shape), eqn.outputs[0].dtype)
        ins = {k: a.contiguous() for k, a in enumerate(args) if not isinstance(a, tuple)}
        fusion.launch_fused(fk, [ins[r] for r in fk.inputs], [out])

    # ---- the wire (Send/Recv) and the host
    def _wire_ready(self):
        """Ops on the process group's side wait for the rank's stream's work so far."""
        if self.cuda:
            if self.wire == "cuda":
                self.torch.cuda.current_stream(self.device).wait_stream(self.stream)
            else:
                self.stream.synchronize()

    def to_wire(self, t):
        self._wire_ready()
        raw = t.contiguous().reshape(-1).view(self.torch.uint8)
        if self.cuda and self.wire == "cuda":
            # NCCL reads it on the current stream: the allocator must not hand the block
            # back to this rank's stream before that read is done
            raw.record_stream(self.torch.cuda.current_stream(self.device))
        return raw if (self.wire == "cuda" or not self.cuda) else raw.cpu()

    def wire_buffer(self, nbytes):
        dev = self.device if self.wire == "cuda" else self.torch.device("cpu")
        return self.torch.empty(int(nbytes), dtype=self.torch.uint8, device=dev)

    def from_wire(self, tensor, shape, dtype):
        dtype = np.dtype(dtype)
        if is_lse_pair(dtype):
            tdt, shape = torch_dtype(dtype["o"]), tuple(shape) + (2,)
        else:
            tdt = torch_dtype(dtype)
        if self.cuda:
            if self.wire == "cuda":   # the receive completed on the current stream
                self.stream.wait_stream(self.torch.cuda.current_stream(self.device))
                # allocated on the current stream, read on this rank's: keep the block
                # from being reused there while this stream may still read it
                tensor.record_stream(self.stream)
            with self._on():
                tensor = tensor.to(self.device)
        return tensor.view(tdt).reshape(shape)

    def to_host(self, t):
        if self.cuda:
            self.stream.synchronize()
        return to_numpy(t)

    def nbytes(self, t) -> int:
        return int(t.numel() * t.element_size())


def cuda_kernels(device_index: int, wire: str) -> TorchKernels:
    """The ``"cuda"`` factory: the rank's GPU, its stream, NCCL or gloo wire."""
    return TorchKernels("cuda", device_index, wire)


def interpret_kernels(device_index: int, wire: str) -> TorchKernels:
    """The ``"interpret"`` factory: CPU tensors, Triton's interpreter, gloo."""
    return TorchKernels("interpret", 0, "cpu")


KERNEL_SETS = {"cuda": cuda_kernels, "interpret": interpret_kernels}
"""What ranks.make_kernels registers on first use (this module does not import ranks)."""

