"""Arrays that stay on the devices between calls, as JAX's ``jax.Array`` does: what a
program compiled with ``outputs="devices"`` returns instead of whole host arrays.

A :class:`Sharded` is one program output as its device program left it: the blocks its
Stores wrote, each on the device that computed it (the layout: ``(device, Box)`` for every
block of every device; the buffers: the blocks this process holds, all of them on the
virtual devices and the GPU backends, this rank's on ``devices="world"``). Passed back to a
compiled program, each Load of it is served where the data already is
(:func:`cover`): a block on the loading device itself is read in place (no host-to-device
bytes), a part held by another device is copied from there (a device-to-device transfer,
the re-layout), and the host is never involved. ``np.asarray(s)`` (or ``s.gather()``)
assembles the whole array on the host.

Donation (``donate_argnums``): a donated Sharded's blocks are released when the call that
consumed it returns, so a training step holds one copy of its state, not two; using it
afterwards is an error naming it, as JAX's "donated buffer" is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eins.errors import EinsError, LoweringError, PlanError
from eins.ir.types import Box, as_dtype

__all__ = ["Sharded", "Piece", "cover", "box_index", "resident_options", "OUTPUTS"]


def box_index(box: Box) -> tuple:
    """The slices that cut ``box`` out of the whole array."""
    return tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))


@dataclass(frozen=True)
class Piece:
    """Part ``box`` of block ``block`` (number ``index`` of the layout), held by device
    ``holder``."""

    index: int
    holder: int
    block: Box
    box: Box


def cover(layout, box: Box) -> list[Piece]:
    """The pieces of the layout's blocks that make up ``box``. The blocks of a layout tile
    the array (a program stores each element of an output once), so the pieces tile
    ``box``; anything else is a LoweringError."""
    pieces = []
    for i, (holder, block) in enumerate(layout):
        part = block.intersect(box)
        if part is not None and part.size:
            pieces.append(Piece(i, holder, block, part))
    if box.size and sum(p.box.size for p in pieces) != box.size:
        raise LoweringError(f"the blocks {[b for _, b in layout]} do not cover {box!r} once")
    return pieces


class Sharded:
    """An array kept on the devices (see the module docstring). ``shape``, ``dtype``,
    ``layout`` (every block as ``(device, Box)``), ``where`` (the memory the blocks live in:
    ``"numpy"``, ``"interpret"``, ``"cuda"`` or ``"world"``); ``blocks()`` the held buffers
    {layout index: array}. ``np.asarray(s)``, ``float(s)``, ``s.gather()`` bring it to the
    host (on ``"world"`` every rank calls them together: a point-to-point gather)."""

    def __init__(self, shape, dtype, layout, buffers: dict, where: str, to_host,
                 gather=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = as_dtype(dtype)
        self.layout = tuple(layout)
        self._buffers = dict(buffers)
        self.where = where
        self._to_host = to_host          # a held buffer -> numpy
        self._gather = gather            # world: the collective assembling the whole array
        self._donated_at = None

    # ---- the array's face
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d Sharded array")
        return self.shape[0]

    def __repr__(self):
        state = " donated" if self._donated_at else ""
        devs = sorted({d for d, _ in self.layout})
        return (f"<Sharded {self.dtype}{list(self.shape)} in {len(self.layout)} block(s) on "
                f"{self.where} devices {devs}{state}>")

    # ---- the blocks
    def blocks(self) -> dict:
        """{layout index: buffer} of the blocks this process holds."""
        self.check_alive("this Sharded array")
        return dict(self._buffers)

    def check_alive(self, name: str) -> None:
        if self._donated_at is not None:
            raise EinsError(f"{name} was donated to an earlier call ({self._donated_at}) and "
                            f"its device buffers are released; pass that call's output "
                            f"instead")

    def donate(self, where: str) -> None:
        """Release the blocks (donate_argnums): ``where`` names the call for the error."""
        self._buffers = {}
        self._donated_at = where

    @property
    def donated(self) -> bool:
        return self._donated_at is not None

    # ---- to the host
    def gather(self) -> np.ndarray:
        """The whole array on the host (a device-to-host copy of every block)."""
        self.check_alive("this Sharded array")
        if self._gather is not None:
            return self._gather(self)
        out = np.empty(self.shape, self.dtype)
        for i, (_, box) in enumerate(self.layout):
            if i not in self._buffers:
                raise EinsError(f"block {box!r} of {self!r} is not held by this process")
            out[box_index(box)] = self._to_host(self._buffers[i])
        return out

    def __array__(self, dtype=None, copy=None):
        a = self.gather()
        return a if dtype is None else a.astype(dtype)

    def __float__(self):
        return float(self.gather())

    def item(self):
        return self.gather().item()


OUTPUTS = ("host", "devices")


def resident_options(outputs, donate_argnums) -> tuple[str, tuple[int, ...]]:
    """``outputs`` ("host": whole arrays to the caller; "devices": :class:`Sharded` arrays
    left on the devices) and ``donate_argnums`` (an int or a sequence of positional argument
    numbers) checked, as (outputs, sorted tuple of argnums); a PlanError naming the value."""
    if not isinstance(outputs, str) or outputs not in OUTPUTS:
        raise PlanError(f"unknown outputs {outputs!r}; choose one of {list(OUTPUTS)}")
    nums = (donate_argnums,) if isinstance(donate_argnums, (int, np.integer)) \
        else donate_argnums
    try:
        nums = tuple(nums)
    except TypeError:
        raise PlanError(f"donate_argnums must be an int or a sequence of ints, got "
                        f"{donate_argnums!r}") from None
    for n in nums:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
            raise PlanError(f"donate_argnums: {n!r} in {donate_argnums!r} is not a "
                            f"non-negative positional argument number")
    return outputs, tuple(sorted({int(n) for n in nums}))
