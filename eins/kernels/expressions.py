"""One table of elementwise expressions, two dialects (Triton and numpy).

Each elementwise primitive of ``eins/ops/elementwise.py`` is written ONCE below as a neutral
Python expression over its operands (``x`` for unary ops; ``a, b`` for binary ones; ``c, x,
y`` for ``where``) using neutral function names (``exp``, ``maximum``, ``where``, ...). A
dialect is a map from neutral function names to the dialect's spelling; rendering rewrites the
calls of the parsed expression (``ast``) and unparses it, so both dialects have the same
expression tree by construction (tests/test_codegen.py checks it with recording namespaces).

dtypes follow the reference kernels: operands are cast to the *compute dtype* (float16 and
bfloat16 computed in float32, everything else in its own dtype) and the result is rounded once
to the output dtype (:func:`dtypes_for`).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

import numpy as np

from eins.kernels.build import TRITON_DTYPES
from eins.errors import EinsError
from eins.ir.rules import compute_dtype, float_dtype
from eins.ir.types import bfloat16
from eins.ir.types import result_dtype

_GELU_C = 0.7978845608028654  # sqrt(2/pi)

# name -> (operand names, neutral expression). ``params`` (gelu's approximate) pick a variant.
EXPRESSIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "neg": (("x",), "-x"),
    "abs": (("x",), "abs(x)"),
    "exp": (("x",), "exp(x)"),
    "log": (("x",), "log(x)"),
    "sqrt": (("x",), "sqrt(x)"),
    "rsqrt": (("x",), "rsqrt(x)"),
    "square": (("x",), "x * x"),
    "tanh": (("x",), "tanh(x)"),
    "sigmoid": (("x",), "1.0 / (1.0 + exp(-x))"),
    "relu": (("x",), "maximum(x, 0)"),
    "gelu[approximate=True]": (
        ("x",), f"0.5 * x * (1.0 + tanh({_GELU_C!r} * (x + 0.044715 * (x * x * x))))"),
    "gelu[approximate=False]": (("x",), "0.5 * x * (1.0 + erf(x * 0.7071067811865476))"),
    "silu": (("x",), "x / (1.0 + exp(-x))"),
    "cos": (("x",), "cos(x)"),
    "sin": (("x",), "sin(x)"),
    "add": (("a", "b"), "a + b"),
    "sub": (("a", "b"), "a - b"),
    "mul": (("a", "b"), "a * b"),
    "div": (("a", "b"), "a / b"),
    "pow": (("a", "b"), "pow(a, b)"),
    "maximum": (("a", "b"), "maximum(a, b)"),
    "minimum": (("a", "b"), "minimum(a, b)"),
    "less": (("a", "b"), "a < b"),
    "less_equal": (("a", "b"), "a <= b"),
    "greater": (("a", "b"), "a > b"),
    "greater_equal": (("a", "b"), "a >= b"),
    "equal": (("a", "b"), "a == b"),
    "not_equal": (("a", "b"), "a != b"),
    "where": (("c", "x", "y"), "where(c, x, y)"),
    "astype": (("x",), "x"),
}

# Entries that replace EXPRESSIONS' when the operands are computed as integers (or bools):
# libdevice.pow takes floats only; _ipow (eins/kernels/build.py's HEADER) squares.
INTEGER_EXPRESSIONS = {"pow": (("a", "b"), "ipow(a, b)")}

# neutral function -> spelling per dialect. numpy's ``npx`` holds the functions numpy lacks
# or spells otherwise (defined in the generated module prelude, NPX_PRELUDE); Triton's
# ``libdevice`` is triton.language.extra.libdevice.
DIALECTS: dict[str, dict[str, str]] = {
    "numpy": {"abs": "np.abs", "exp": "np.exp", "log": "np.log", "sqrt": "np.sqrt",
              "rsqrt": "npx.rsqrt", "tanh": "np.tanh", "erf": "npx.erf", "cos": "np.cos",
              "sin": "np.sin", "pow": "np.power", "ipow": "npx.ipow", "maximum": "np.maximum",
              "minimum": "np.minimum", "where": "np.where"},
    "triton": {"abs": "tl.abs", "exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt",
               "rsqrt": "tl.rsqrt", "tanh": "libdevice.tanh", "erf": "tl.erf", "cos": "tl.cos",
               "sin": "tl.sin", "pow": "libdevice.pow", "ipow": "_ipow", "maximum": "tl.maximum",
               "minimum": "tl.minimum", "where": "tl.where"},
}

# Keyword arguments a dialect's spelling needs to compute what numpy's does.
DIALECT_KEYWORDS: dict[str, dict[str, dict[str, str]]] = {
    "numpy": {},
    # tl.maximum / tl.minimum drop a NaN operand by default; np.maximum keeps it
    "triton": {f: {"propagate_nan": "tl.PropagateNan.ALL"} for f in ("maximum", "minimum")},
}

NPX_PRELUDE = '''\
class npx:
    """The functions numpy lacks or spells otherwise, as the expression table needs them."""
    @staticmethod
    def rsqrt(x):
        return 1 / np.sqrt(x)

    @staticmethod
    def erf(x):
        from eins.ir.rules import vectorized_erf  # float64, cast back as the reference
        return vectorized_erf(x).astype(np.asarray(x).dtype)

    @staticmethod
    def ipow(a, b):
        # numpy refuses an integer base to a negative integer power with a bare ValueError;
        # eins's DTypeError names the power, as the other backends do
        b = np.asarray(b)
        if b.size and (b < 0).any():
            from eins.ir.rules import negative_power_error
            raise negative_power_error(int(b.min()))
        return np.power(a, b)
'''



def key_of(prim: str, params: dict | None = None) -> str:
    """The table key of an eqn: gelu's two forms are two entries."""
    if prim == "gelu":
        return f"gelu[approximate={bool((params or {}).get('approximate', True))}]"
    return prim


def is_elementwise(prim: str) -> bool:
    return key_of(prim) in EXPRESSIONS


def _entry(prim, params):
    k = key_of(prim, params)
    if k not in EXPRESSIONS:
        raise EinsError(f"codegen: no elementwise expression for primitive {prim!r}")
    return EXPRESSIONS[k]


class _Rewrite(ast.NodeTransformer):
    def __init__(self, dialect, names):
        self.table = DIALECTS[dialect]
        self.keywords = DIALECT_KEYWORDS[dialect]
        self.names = names

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func.id
        if f not in self.table:
            raise EinsError(f"codegen: function {f!r} has no spelling in this dialect")
        node.func = ast.parse(self.table[f], mode="eval").body
        node.keywords += [ast.keyword(k, ast.parse(v, mode="eval").body)
                          for k, v in self.keywords.get(f, {}).items()]
        return node

    def visit_Name(self, node):
        if node.id in self.names:
            return ast.copy_location(ast.Name(self.names[node.id], node.ctx), node)
        return node


def render(prim: str, dialect: str, params: dict | None = None, names=None,
           integer: bool = False) -> str:
    """The expression of ``prim`` in ``dialect`` ("numpy" or "triton"); ``names`` renames the
    operands (a list in operand order, or a dict); ``integer``: the operands are computed
    as integers or bools (:data:`INTEGER_EXPRESSIONS`)."""
    if dialect not in DIALECTS:
        raise EinsError(f"codegen: unknown dialect {dialect!r}; choose one of {list(DIALECTS)}")
    operands, expr = (INTEGER_EXPRESSIONS[prim] if integer and prim in INTEGER_EXPRESSIONS
                      else _entry(prim, params))
    if names is None:
        names = {}
    elif not isinstance(names, dict):
        names = dict(zip(operands, names))
    tree = _Rewrite(dialect, names).visit(ast.parse(expr, mode="eval"))
    return ast.unparse(ast.fix_missing_locations(tree))


def operand_names(prim: str, params: dict | None = None) -> tuple[str, ...]:
    return _entry(prim, params)[0]


@dataclass(frozen=True)
class EwDtypes:
    """What one elementwise kernel casts: each operand to ``compute[k]``, the result to
    ``out``."""

    compute: tuple
    out: np.dtype


def dtypes_for(prim: str, in_dtypes, out_dtype) -> EwDtypes:
    """The casts of the reference kernel (eins/ops/elementwise.py) for these dtypes."""
    in_dtypes = [np.dtype(d) for d in in_dtypes]
    out = np.dtype(out_dtype)
    if prim == "astype":
        return EwDtypes((in_dtypes[0],), out)
    if prim == "where":  # the condition stays bool; x and y in the output dtype
        return EwDtypes((in_dtypes[0], out, out), out)
    if len(EXPRESSIONS[key_of(prim)][0]) == 1:   # a unary function
        return EwDtypes((compute_dtype(out),), out)
    common = result_dtype(*in_dtypes)
    if prim == "div":
        common = float_dtype(common)
    if prim == "add" and common == np.dtype(bool):
        # numpy's bool + bool is logical or; Triton's int1 add wraps (1 + 1 = 0): add as
        # int32, and the cast to bool (!= 0 in both dialects) makes it the or
        common = np.dtype(np.int32)
    return EwDtypes((compute_dtype(common),) * len(in_dtypes), out)


def triton_dtype(d) -> str:
    """The Triton dtype (source text) of numpy dtype ``d``: the kernel library's one map
    (``TRITON_DTYPES`` of eins/kernels/build.py)."""
    name = np.dtype(d).name
    if name not in TRITON_DTYPES:
        raise EinsError(f"codegen: dtype {name} has no Triton equivalent")
    return TRITON_DTYPES[name]


def np_dtype_expr(d) -> str:
    """Python source for dtype ``d`` in a generated module (bfloat16 via eins)."""
    d = np.dtype(d)
    if bfloat16 is not None and d == bfloat16:
        return "bfloat16"
    if d.names is not None:  # a structured dtype: the (o, lse) pairs of the lse ⊕
        return f"np.dtype({d.descr!r})"
    return f"np.{d.name}" if d.name != "bool" else "np.bool_"
