"""The traced IR: SSA, jaxpr-like. ``Var``, ``Literal``, ``Eqn``, ``Program``.

A ``Program`` holds whole (zero-bounded) tensors only. Printing gives a stable, jaxpr-like
dump; ``evaluate`` runs it on numpy with each primitive's reference kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eins.errors import DTypeError, EinsError, IndexRangeError
from eins.ir.joinagg import affine_indexing
from eins.ir.primitive import Primitive
from eins.ir.types import TensorType, dtype_name

_DTYPE_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
                "int32": "i32", "int64": "i64", "bool": "bool"}


def short_dtype(d) -> str:
    n = dtype_name(d)
    return _DTYPE_SHORT.get(n, n)


@dataclass(frozen=True, slots=True, eq=False)
class Var:
    """An SSA variable: one whole tensor. Identity is the object (each trace makes new ones)."""

    type: TensorType

    @property
    def shape(self):
        return self.type.shape

    @property
    def dtype(self):
        return self.type.dtype

    def __repr__(self):
        return f"Var({self.type!r})"


@dataclass(frozen=True, slots=True)
class Literal:
    """A Python scalar folded into the program (shape ``()``)."""

    value: object
    dtype: np.dtype

    @property
    def type(self):
        return TensorType((), self.dtype)

    @property
    def shape(self):
        return ()

    def __repr__(self):
        return f"{self.value!r}:{short_dtype(self.dtype)}"


Atom = Var | Literal


@dataclass(frozen=True, slots=True, eq=False)
class Eqn:
    """One primitive application: ``outputs = primitive[params](inputs)``. ``source`` is the
    user's ``file:line`` that created it (for error messages and dumps). The eqn holds its
    :class:`~eins.ir.primitive.Primitive` (as JAX's ``JaxprEqn`` does), so running it needs
    no lookup in the operator library; ``prim`` is its name. ``phase`` is ``"fwd"`` or
    ``"bwd"``: whether the tracer recorded it in a forward pass or in the backward pass of
    a gradient (:mod:`eins.autodiff`), shown by the printed stages and the cost tables."""

    primitive: Primitive
    inputs: tuple
    outputs: tuple
    params: dict = field(default_factory=dict)
    source: str | None = None
    phase: str = "fwd"

    @property
    def prim(self) -> str:
        """The primitive's name (``"matmul"``)."""
        return self.primitive.name


def eqn_indexing(eqn: Eqn):
    """The operator's :class:`~eins.ir.joinagg.Indexing` for this eqn's types. An operator
    without one (never split) gets an Indexing without indices, whose only spec is one whole
    function specification, so every pass treats it like any other operator."""
    prim = eqn.primitive
    ins, outs = [a.type for a in eqn.inputs], [v.type for v in eqn.outputs]
    if prim.indexing is None:
        return affine_indexing({}, {}, [[None] * t.ndim for t in ins],
                               [[None] * t.ndim for t in outs],
                               [t.shape for t in ins], [t.shape for t in outs])
    try:
        return prim.indexing(ins, outs, **eqn.params)
    except EinsError as e:   # e.g. a rank past the index names: say which eqn, and where
        where = f" (at {eqn.source})" if eqn.source and "(at " not in str(e) else ""
        raise type(e)(f"{eqn.prim}: {e}{where}") from None


def format_param(v) -> str:
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        return short_dtype(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (tuple, list)):
        inner = ",".join(format_param(x) for x in v)
        return f"({inner}{',' if len(v) == 1 else ''})"
    return str(v)


class Namer:
    """Gives variables short, stable names in order of first appearance: a..z, ba, bb, ..."""

    def __init__(self):
        self.names: dict[int, str] = {}

    def __call__(self, v) -> str:
        if isinstance(v, Literal):
            return repr(v.value)
        key = id(v)
        if key not in self.names:
            self.names[key] = _name_of(len(self.names))
        return self.names[key]

    def decl(self, v) -> str:
        return f"{self(v)}:{short_dtype(v.dtype)}[{','.join(map(str, v.shape))}]"


def _name_of(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    s = ""
    i += 0
    while True:
        s = letters[i % 26] + s
        i = i // 26
        if i == 0:
            break
        i -= 1  # bijective base 26: a..z, aa..zz, ...
    return s


@dataclass(eq=False)
class Program:
    """A traced program: ``consts`` (closed-over arrays), ``inputs``, ``eqns``, ``outputs``."""

    inputs: tuple
    eqns: tuple
    outputs: tuple
    consts: tuple = ()          # ((Var, np.ndarray), ...)
    name: str = "fn"

    @property
    def has_backward(self) -> bool:
        """Whether some eqn belongs to a backward pass (then the dumps mark every eqn)."""
        return any(e.phase != "fwd" for e in self.eqns)

    def pretty(self, annotate=None) -> str:
        """The jaxpr-like text. ``annotate(i, eqn) -> str`` adds a comment per eqn; a program
        with backward eqns marks each eqn ``fwd`` or ``bwd`` in that comment."""
        n = Namer()
        marked = self.has_backward
        constvars = " ".join(n.decl(v) for v, _ in self.consts)
        invars = " ".join(n.decl(v) for v in self.inputs)
        lines = [f"{{ lambda {constvars} ; {invars}. let"]
        for i, e in enumerate(self.eqns):
            outs = " ".join(n.decl(v) for v in e.outputs)
            params = ""
            if e.params:
                params = "[" + " ".join(f"{k}={format_param(e.params[k])}"
                                        for k in sorted(e.params)) + "]"
            args = " ".join(n(a) for a in e.inputs)
            line = f"    {outs} = {e.prim}{params} {args}".rstrip()
            note = annotate(i, e) if annotate is not None else ""
            if marked:
                note = f"{e.phase}: {note}" if note else e.phase
            if note:
                line += f"    # {note}"
            lines.append(line)
        outs = " ".join(n(v) for v in self.outputs)
        lines.append(f"  in ({outs}) }}")
        return "\n".join(lines)

    def __str__(self):
        return self.pretty()

    __repr__ = __str__

    def eqn_where(self, i: int) -> str:
        """Eqn ``i`` as a runtime error names it: its number, primitive and the user's line."""
        e = self.eqns[i]
        return f"eqn {i} ({e.prim})" + (f" at {e.source}" if e.source else "")

    def eqn_error(self, i: int, err: EinsError) -> EinsError:
        """``err``, raised by eqn ``i``'s kernel at run time (a value it refuses: integer
        ** -1), as every runtime reports it: the same type, prefixed by :meth:`eqn_where`."""
        return type(err)(f"{self.eqn_where(i)}: {err}")

    def evaluate(self, *args):
        """Run on numpy arrays with the reference kernels; returns a tuple of outputs."""
        env: dict[int, np.ndarray] = {}
        for v, c in self.consts:
            env[id(v)] = c
        for v, a in zip(self.inputs, args):
            env[id(v)] = np.asarray(a)

        def read(a):
            if isinstance(a, Literal):
                return np.asarray(a.value, dtype=a.dtype)
            return env[id(a)]

        for i, e in enumerate(self.eqns):
            try:
                outs = e.primitive.impl(*[read(a) for a in e.inputs], **e.params)
            except (DTypeError, IndexRangeError) as err:   # a value the kernel refuses
                raise self.eqn_error(i, err) from None
            for v, o in zip(e.outputs, outs):
                env[id(v)] = o
        # a result never aliases an argument or a constant (as with JAX's buffers)
        passthrough = {id(v) for v in self.inputs} | {id(v) for v, _ in self.consts}
        return tuple(np.array(read(v)) if isinstance(v, Var) and id(v) in passthrough
                     else read(v) for v in self.outputs)

    def var_names(self) -> dict[int, str]:
        """id(var) -> the name ``pretty()`` prints for it."""
        n = Namer()
        for v, _ in self.consts:
            n(v)
        for v in self.inputs:
            n(v)
        for e in self.eqns:
            for v in e.outputs:
                n(v)
        return dict(n.names)

    def consumers(self) -> dict[int, list[tuple[int, int]]]:
        """id(var) -> [(eqn index, input position), ...]."""
        out: dict[int, list[tuple[int, int]]] = {}
        for i, e in enumerate(self.eqns):
            for k, a in enumerate(e.inputs):
                if isinstance(a, Var):
                    out.setdefault(id(a), []).append((i, k))
        return out

    def producers(self) -> dict[int, tuple[int, int]]:
        """id(var) -> (eqn index, output position) for every eqn output."""
        return {id(v): (i, k) for i, e in enumerate(self.eqns) for k, v in enumerate(e.outputs)}
