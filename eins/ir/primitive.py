"""The one registry of primitives. Each operator family file registers its primitives here
with everything about them side by side (shape rule, reference kernel, flops, indexing).

It lives below both the IR and the operators (as ``jax._src.core.Primitive`` does): an
:class:`eins.ir.program.Eqn` holds its :class:`Primitive`, the tracer binds primitives by
name, and ``eins.ops`` registers them. ``eins.ops.registry`` is the same module under its
former name."""
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
    """

    name: str
    abstract: Callable
    impl: Callable
    flops: Callable = _default_flops
    indexing: Callable | None = None
    block_impl: Callable | None = None

    def run_block(self, fspec, *blocks, **params):
        if self.block_impl is not None:
            return self.block_impl(fspec, *blocks, **params)
        return self.impl(*blocks, **params)

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
