"""The one registry of primitives. Each operator family file registers its primitives here
with everything about them side by side (shape rule, reference kernel, flops, indexing).

It lives below both the IR and the operators (as ``jax._src.core.Primitive`` does): an
:class:`eins.ir.program.Eqn` holds its :class:`Primitive`, the tracer binds primitives by
name, and ``eins.ops`` registers them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from eins.errors import EinsError


def _default_flops(in_types, out_types, **params) -> int:
    return sum(t.size for t in out_types)


@dataclass
class Primitive:
    """A primitive operator.

    - ``abstract(*in_types, **params) -> tuple[TensorType, ...]``: the shape/dtype rule;
      raises ShapeError / DTypeError naming the offending shapes (the tracer adds the line).
    - ``impl(*arrays, **params) -> tuple[np.ndarray, ...]``: the numpy reference kernel on
      whole tensors.
    - ``flops(in_types, out_types, **params) -> int``.
    - ``indexing(in_types, out_types, **params) -> eins.ir.joinagg.Indexing``: named indices,
      shardable ones, and the join-agg spec producer (Section 3.3). None: never split.
    - ``block_impl(fspec, *blocks, **params) -> tuple``: the concrete operator f[F] on blocks;
      it knows its global boxes through ``fspec``. Default: ``impl`` on the blocks, which is
      right whenever the kernel does not depend on global positions.
    - ``partial_impl(fspec, *blocks, **params) -> tuple``: f[F] for a function specification
      whose outputs are partials of a ⊕ with its own element type (``lse``: (o, lse) pairs,
      eins.ir.joinagg.lse_pair_dtype); ``run_block(..., partial=True)`` calls it.
    - ``block_flops_fn(fspec, in_types, out_types, **params) -> int``: the FLOPs of one
      function specification (``Primitive.block_flops``): ``in_types``/``out_types`` are its
      block types, ``fspec`` holds its global boxes. Default: ``flops`` on the block types,
      right whenever the count does not depend on global positions (attention's segments
      and causal mask do).
    """

    name: str
    abstract: Callable
    impl: Callable
    flops: Callable = _default_flops
    indexing: Callable | None = None
    block_impl: Callable | None = None
    partial_impl: Callable | None = None
    block_flops_fn: Callable | None = None

    def run_block(self, fspec, *blocks, partial=False, **params):
        if partial:
            if self.partial_impl is None:
                raise EinsError(f"primitive {self.name!r} has no partial kernel (its specs "
                                f"never aggregate with a ⊕ of pairs)")
            return self.partial_impl(fspec, *blocks, **params)
        if self.block_impl is not None:
            return self.block_impl(fspec, *blocks, **params)
        return self.impl(*blocks, **params)

    def block_flops(self, fspec, in_types, out_types, **params) -> int:
        if self.block_flops_fn is not None:
            return self.block_flops_fn(fspec, in_types, out_types, **params)
        return self.flops(in_types, out_types, **params)

    def bytes_accessed(self, in_types, out_types) -> int:
        return sum(t.nbytes for t in in_types) + sum(t.nbytes for t in out_types)


PRIMITIVES: dict[str, Primitive] = {}


def register(prim: Primitive) -> Primitive:
    if prim.name in PRIMITIVES:
        raise EinsError(f"primitive {prim.name!r} registered twice")
    PRIMITIVES[prim.name] = prim
    return prim


def get_primitive(name) -> Primitive:
    """The registered primitive called ``name`` (a Primitive is returned as is)."""
    if isinstance(name, Primitive):
        return name
    try:
        return PRIMITIVES[name]
    except KeyError:
        raise EinsError(f"unknown primitive {name!r}") from None


# ----------------------------------------------------------------------------- GPU lowerings
# Each op family file registers its primitives' GPU lowering next to the reference kernel
# (the way JAX registers a primitive's lowerings beside it). Kept apart from Primitive so
# that it moves easily: a lowering only names a launcher and, for inspection, its template.
@dataclass(frozen=True)
class GpuLowering:
    """``fn(fspec, outs, ins, **params)`` runs one eqn's blocks on the GPU (the call of
    ``Primitive.run_block``, with outputs): ``ins`` are torch tensors (a literal operand as
    ``("lit", value, dtype)`` or a Python scalar), ``outs`` preallocated torch tensors it
    writes, ``fspec`` the blocks' global boxes (None: whole tensors), ``params`` the eqn's.
    CPU tensors run the same Triton kernels under Triton's interpreter. ``template``: the
    Jinja template it renders. ``partial(fspec, outs, ins, **params)``: the block of a spec
    whose outputs are ⊕ partials (``run_block(..., partial=True)``); for attention's ``lse``
    ⊕, ``outs`` = ``[pairs]``, the device IR's pair buffer (float32, a trailing axis of 2:
    what the GPU runtime passes; its lse ⊕ kernel combines them), or (o, lse) tensors,
    combined by ``eins.kernels.combine_lse``."""

    fn: Callable
    template: str | None = None
    partial: Callable | None = None


GPU_LOWERINGS: dict[str, GpuLowering] = {}


def register_gpu_lowering(prim: str, fn: Callable, template: str | None = None,
                          partial: Callable | None = None) -> None:
    if prim in GPU_LOWERINGS:
        raise EinsError(f"GPU lowering of primitive {prim!r} registered twice")
    GPU_LOWERINGS[prim] = GpuLowering(fn, template, partial)


def gpu_lowering(prim: str) -> GpuLowering | None:
    """The registered GPU lowering of ``prim``; None when the GPU path has no kernel for it."""
    return GPU_LOWERINGS.get(prim)
