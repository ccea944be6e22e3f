"""A faster constructor for the frozen dataclasses built by the thousand: a big program's
instructions and buffers (a 32-block program lowers 1.6 M of them, and a replayed layer
stamps them), and what every re-cut builds anew (eins/passes/relower.py: its boxes, its
exchanges' copies, atoms and requirements, its kernels' function specifications).

A frozen dataclass's own ``__init__`` sets each field through ``object.__setattr__`` by
name, about twice the time of writing the slot directly. :func:`fast_init` gives a frozen
slotted dataclass an ``__init__`` that writes its slots directly: the same parameters,
defaults and ``__post_init__`` call, still frozen (assignment raises
``FrozenInstanceError``), equal and hashing as one built the dataclass's way
(tests/test_device_ir.py)."""
from __future__ import annotations

from dataclasses import MISSING, fields

__all__ = ["fast_init"]


def fast_init(cls):
    """Class decorator, applied after ``@dataclass(frozen=True, slots=True)``: ``cls`` with
    the direct ``__init__`` (module docstring). Refuses, naming the class, one that is not
    frozen and slotted, or has a field it would not build the same way (a default factory,
    a field left out of ``__init__`` or keyword-only)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_init takes a frozen dataclass with slots, got {cls.__name__}")
    ns, args, body = {}, [], []
    for f in fields(cls):
        if f.default_factory is not MISSING or not f.init or f.kw_only:
            raise TypeError(f"fast_init: {cls.__name__}.{f.name} has a default factory, is "
                            f"not an __init__ parameter or is keyword-only")
        ns[f"_set_{f.name}"] = cls.__dict__[f.name].__set__   # the slot's own setter
        if f.default is MISSING:
            args.append(f.name)
        else:
            ns[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
        body.append(f"    _set_{f.name}(self, {f.name})\n")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()\n")
    exec(f"def __init__(self, {', '.join(args)}):\n{''.join(body) or '    pass'}\n", ns)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init
    return cls
