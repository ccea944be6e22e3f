"""``eins.jit(module)`` and ``eins.distribute(module, devices=...)`` on a ``torch.nn.Module``.

The first call with a given signature (the tensors' shapes, dtypes and devices, the other
values as they are, and the names, shapes, dtypes and devices of the module's parameters
and buffers) converts the module with :func:`eins.from_torch` on that call's arguments and
plans it; a later call with the same signature reuses both. Every call reads the module's
parameters as they are then (``Converted.refresh``): one changed in place (an optimizer
step) or rebound (a new ``nn.Parameter``, new ``.data``) is read again, ``.double()``
converts again, and so does a changed non-persistent buffer (folded into the program).
Calls take torch tensors and return torch tensors, in the module output's own structure
(a transformers ``ModelOutput`` with its ``logits``). On a GPU backend the parameters are
placed on their devices (``Compiled.place``) at the first call and again after a change.
"""
from __future__ import annotations

import inspect
import itertools
import sys

from eins.api import distribute, jit
from eins.errors import EinsError, PlanError
from eins.frontends.torch import Converted, torch_leaves
from eins.runtime.gpu_ops import from_numpy
from eins.runtime.sharded import resident_options

__all__ = ["is_module", "wrap_module", "ModuleFunction"]


def is_module(obj) -> bool:
    """Whether ``obj`` is a torch ``nn.Module``, without importing torch: when torch is not
    loaded, nothing can be one."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def wrap_module(module, kind: str, options: dict):
    """What ``eins.jit`` (``kind="jit"``) or ``eins.distribute`` (``kind="distribute"``, with
    its arguments ``options``, from its ``locals()``) return for an nn.Module."""
    names = [n for n in inspect.signature(distribute).parameters if n != "fn"]
    return ModuleFunction(module, kind, {n: options[n] for n in names if n in options})


def _placeholder(*args, **kwargs):   # a function to check distribute's options against
    return None


def _tensors(args, kwargs) -> list:
    """The call's tensors in its order (its other values are baked into the conversion)."""
    import torch  # heavy: already loaded (the module is a torch one)
    return [x for x in torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs)))
            if isinstance(x, torch.Tensor)]


class ModuleFunction:
    """A module as an eins function (module docstring): call it like the module;
    ``lower(...)`` plans without running (meta tensors are fine); ``convert(...)`` is the
    :class:`eins.frontends.torch.Converted` (``.fn``, ``.params``) for those arguments."""

    def __init__(self, module, kind, options):
        self.module, self.kind, self.options = module, kind, dict(options)
        if kind == "distribute":
            distribute(_placeholder, **self.options)   # bad options fail now, not later
            outputs, donate = resident_options(self.options.get("outputs", "host"),
                                               self.options.get("donate_argnums", ()))
            if outputs != "host" or donate:
                what = (f"outputs={outputs!r}" if outputs != "host"
                        else f"donate_argnums={donate!r}")
                raise PlanError(f"{what} does not apply to an nn.Module: its calls take and "
                                f"return torch tensors (on the inputs' device), and its "
                                f"parameters stay the module's; for results left on the "
                                f"devices as eins.Sharded, distribute the function "
                                f"eins.from_torch returns")
        self._entries: dict = {}
        self.last = None

    def _key(self, args, kwargs, state):
        """The call's signature and the module's ``state``'s (names, shapes, dtypes, devices
        of its parameters and buffers: a conversion holds them, so ``.double()``, a
        parameter of another shape, or untied weights convert again)."""
        import torch  # heavy: already loaded (the module is a torch one)
        leaves, spec = torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))
        sig = tuple((tuple(x.shape), str(x.dtype), str(x.device))
                    if isinstance(x, torch.Tensor) else ("value", repr(x))
                    for x in leaves)
        # torch's shapes, dtypes and devices hash as they are: no text per tensor
        return str(spec), sig, tuple((name, t.shape, t.dtype, t.device)
                                     for name, t in state.items())

    def _entry(self, args, kwargs):
        """The conversion for this call, its parameters as the module holds them now (the
        module's parameters and buffers walked once a call)."""
        state = dict(itertools.chain(self.module.named_parameters(),
                                     self.module.named_buffers()))
        key = self._key(args, kwargs, state)
        e = self._entries.get(key)
        fresh = None if e is None else e["conv"].refresh(state)
        if fresh is None:   # first seen, or a folded buffer changed: convert (again)
            conv = Converted(self.module, args, kwargs)
            inner = (jit(conv.flat_fn) if self.kind == "jit"
                     else distribute(conv.flat_fn, **self.options))
            e = self._entries[key] = {"conv": conv, "inner": inner, "compiled": None,
                                      "placed": False}
        elif fresh:   # parameters read again: new arrays, placed again on a GPU backend
            e["placed"] = False
        return e

    def convert(self, *args, **kwargs) -> Converted:
        return self._entry(args, kwargs)["conv"]

    def lower(self, *args, **kwargs):
        """The inner function's ``lower`` on the converted parameters and these arguments
        (eins.distribute: a Lowered, planned; eins.jit: the traced program)."""
        e = self._entry(args, kwargs)
        return e["inner"].lower(e["conv"].params, *_tensors(args, kwargs))

    def __call__(self, *args, **kwargs):
        e = self._entry(args, kwargs)
        conv = e["conv"]
        xs = _tensors(args, kwargs)
        if conv.shape_only:
            raise EinsError(f"{conv.name} was converted from meta tensors: its parameters "
                            f"and some constants have shapes but no values; plan it with "
                            f".lower(...), or build it on a real device to run it")
        if self.kind == "jit" or self.options.get("devices") == "world":
            out = e["inner"](conv.params, *xs)   # devices="world": each rank runs its part
            self.last = e["inner"]
        else:
            if e["compiled"] is None:
                inner = e["inner"]
                e["compiled"] = inner.lower(conv.params, *xs).compile(
                    inner.backend, inner.device_map, inner.graphs)
            if e["compiled"].gpu is not None and not e["placed"]:
                e["compiled"].place(conv.params, *xs)   # weights resident on their devices
                e["placed"] = True
            self.last = e["compiled"]
            out = self.last(conv.params, *xs)
        return self._to_torch(conv, out, args, kwargs)

    def stats(self) -> dict:
        """The transfers and memory of the last call (eins.distribute only)."""
        if self.kind == "jit" or self.last is None:
            raise EinsError("stats() before the first call of an eins.distribute module")
        return self.last.stats()

    def _to_torch(self, conv, out, args, kwargs):
        import torch  # heavy: already loaded (the module is a torch one)
        pytree = torch.utils._pytree
        device = next((x.device for x in pytree.tree_leaves((args, kwargs))
                       if isinstance(x, torch.Tensor)), torch.device("cpu"))
        # a None output (MultiheadAttention's weights with need_weights=False) is a leaf
        # of the export's spec: it stays None
        leaves = [x if x is None or isinstance(x, torch.Tensor) else from_numpy(x).to(device)
                  for x in torch_leaves(conv.out_spec, out)]
        return pytree.tree_unflatten(leaves, conv.out_spec)
