"""Source text for the generated modules (eins/codegen/generate.py): Python literals of
parameter values, boxes and function specifications, buffer names as identifiers, the walk's
step record and instruction comments, and the Jinja environment every generated module's
template renders in."""
from __future__ import annotations

import keyword
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from eins.kernels import expressions as ex
from eins.ir.device import format_instr, placed_receives

_TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
_ENV = Environment(loader=FileSystemLoader(_TEMPLATES), trim_blocks=True, lstrip_blocks=True,
                   keep_trailing_newline=True, undefined=StrictUndefined)
_RESERVED = {"np", "cp", "K", "B", "S", "dev", "self", "inputs", "consts", "outputs", "mbox", "Box",
             "FunctionSpec", "bfloat16", "program", "r"}


# ----------------------------------------------------------------------------- templates
def render_template(template: str, /, **ctx) -> str:
    return _ENV.get_template(template).render(**ctx)




# ----------------------------------------------------------------------------- literals
def py(v) -> str:
    """Python source for a parameter value inside a generated module."""
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        return ex.np_dtype_expr(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(py(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, list):
        return "[" + ", ".join(py(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{py(k)}: {py(x)}" for k, x in v.items()) + "}"
    if isinstance(v, np.generic):
        return py(v.item())
    if isinstance(v, float) and not math.isfinite(v):
        return f"float({str(v)!r})"
    return repr(v)


def box_src(b) -> str:
    return f"Box({py(tuple(b.lo))}, {py(tuple(b.hi))})"


def fspec_src(f) -> str:
    ins = "(" + "".join(box_src(b) + ", " for b in f.inputs) + ")"
    outs = "(" + "".join(box_src(b) + ", " for b in f.outputs) + ")"
    return f"FunctionSpec({ins}, {outs})"


def slices_src(sl) -> str:
    return ", ".join(f"{s.start}:{s.stop}" for s in sl) or "..."


def box_slices(b) -> str:
    """The global box ``b`` as slices of the whole tensor."""
    return ", ".join(f"{lo}:{hi}" for lo, hi in zip(b.lo, b.hi)) or "..."


def kwargs_src(params) -> str:
    return ", ".join(f"{k}={py(params[k])}" for k in sorted(params))


def ident(name: str) -> str:
    """A buffer name as a Python identifier (the device IR's names normally already are)."""
    if name.isidentifier() and not keyword.iskeyword(name) and name not in _RESERVED:
        return name
    return "b_" + re.sub(r"\W", "_", name)


def eqn_texts(prog) -> list[str]:
    """Each eqn's line of the program's printed form (comments in the generated code)."""
    lines = prog.pretty().splitlines()[1:1 + len(prog.eqns)]
    return [ln.strip() for ln in lines]


# ----------------------------------------------------------------------------- the walks
def is_ew(eqn) -> bool:
    """Whether ``eqn`` is elementwise (its kernel is its primitive's expression, fused on
    the GPU)."""
    return eqn.primitive.is_elementwise


@dataclass
class Step:
    """One step of a device's generated walk: its comment and lines; a GPU walk's graph
    segment holds its kernel steps in ``comments``."""

    comment: str
    lines: list
    kind: str          # "host" (Load/Store), "comm" (Send/Recv), "kernel" (on the stream)
    segment: int | None = None
    comments: list = field(default_factory=list)


def instr_comment(ins, bufs, texts):
    """The instruction as the device IR prints it; a Kernel's comment names its eqn as traced
    (instead of its function specification)."""
    return format_instr(ins, bufs, texts[ins.eqn] if ins.kind == "kernel" else None)


def recv_names(dprog):
    """(sender, receiver, tag) -> the receive buffer's name on the receiver: the placement's
    destination for a windowed send into one (the sender writes its rows in place)."""
    names = {(ins.peer, d, ins.tag): ins.dst for d in dprog.devices
             for ins in dprog.code.get(d, []) if ins.kind == "recv"}
    names.update(placed_receives(dprog))
    return names
