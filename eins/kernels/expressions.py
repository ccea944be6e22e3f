"""Elementwise expressions, two dialects (Triton and numpy).

Each elementwise primitive carries its :class:`~eins.ir.primitive.Expression`, declared in
its op family file beside its other rules: a neutral Python expression over its operands
(``x`` for unary ops; ``a, b`` for binary ones; ``c, x, y`` for ``where``) using neutral
function names (``exp``, ``maximum``, ``where``, ...). A dialect is a map from neutral
function names to the dialect's spelling; rendering rewrites the calls of the parsed
expression (``ast``) and unparses it, so both dialects have the same expression tree by
construction (tests/test_codegen_expressions.py checks it with recording namespaces). This module
renders whatever expression it is given; it knows no primitive by name.

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
from eins.ir.primitive import PRIMITIVES, Expression, get_primitive
from eins.ir.rules import compute_dtype
from eins.ir.types import bfloat16
from eins.ir.types import result_dtype

# the neutral math functions numpy spells np.<name> (its ufunc) and Triton libdevice.<f>,
# but for _TL_MATH's, which are triton.language builtins
_NP_MATH = {"floor": "floor", "ceil": "ceil", "trunc": "trunc", "rint": "rint",
            "cbrt": "cbrt", "signbit": "signbit", "exp2": "exp2", "expm1": "expm1",
            "log2": "log2", "log10": "log10", "log1p": "log1p", "tan": "tan",
            "asin": "arcsin", "acos": "arccos", "atan": "arctan", "sinh": "sinh",
            "cosh": "cosh", "asinh": "arcsinh", "acosh": "arccosh", "atanh": "arctanh",
            "atan2": "arctan2", "hypot": "hypot", "copysign": "copysign",
            "nextafter": "nextafter"}
_TL_MATH = ("floor", "ceil", "exp2", "log2")

# neutral function -> spelling per dialect. numpy's ``npx`` holds the functions numpy lacks
# or spells otherwise (defined in the generated module prelude, NPX_PRELUDE); Triton's
# ``libdevice`` is triton.language.extra.libdevice.
DIALECTS: dict[str, dict[str, str]] = {
    "numpy": {"abs": "np.abs", "exp": "np.exp", "log": "np.log", "sqrt": "np.sqrt",
              "rsqrt": "npx.rsqrt", "tanh": "np.tanh", "erf": "npx.erf", "cos": "np.cos",
              "sin": "np.sin", "pow": "np.power", "ipow": "npx.ipow", "maximum": "np.maximum",
              "minimum": "np.minimum", "where": "np.where", **{
                  f: f"np.{n}" for f, n in _NP_MATH.items()},
              "fmod": "np.fmod", "mod": "np.remainder", "floordiv": "np.floor_divide",
              "gcd": "np.gcd", "lcm": "np.lcm", "popcount": "np.bitwise_count"},
    "triton": {"abs": "tl.abs", "exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt",
               "rsqrt": "tl.rsqrt", "tanh": "libdevice.tanh", "erf": "tl.erf", "cos": "tl.cos",
               "sin": "tl.sin", "pow": "libdevice.pow", "ipow": "_ipow", "maximum": "tl.maximum",
               "minimum": "tl.minimum", "where": "tl.where", "floor": "tl.floor",
               "ceil": "tl.ceil", "exp2": "tl.exp2", "log2": "tl.log2", **{
                   f: f"libdevice.{f}" for f in _NP_MATH if f not in _TL_MATH},
               "fmod": "_fmod", "mod": "_mod", "floordiv": "_floordiv",
               "gcd": "_gcd", "lcm": "_lcm", "popcount": "_popcount"},
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



def expression(prim) -> Expression:
    """The expression of primitive ``prim`` (a name or a Primitive; an Expression is itself);
    an EinsError naming it when it has none (it is not elementwise)."""
    if isinstance(prim, Expression):
        return prim
    p = PRIMITIVES.get(prim) if isinstance(prim, str) else prim
    if p is None or p.expression is None:
        name = prim if isinstance(prim, str) else prim.name
        raise EinsError(f"codegen: no elementwise expression for primitive {name!r}")
    return p.expression


def key_of(prim, params: dict | None = None) -> str:
    """The name of an eqn's expression: a primitive with variants (gelu's two forms) has
    one name per variant, ``gelu[approximate=True]``."""
    e = expression(prim)
    name = get_primitive(prim).name
    return name if e.variant is None else f"{name}[{e.variant(params or {})}]"


def is_elementwise(prim) -> bool:
    p = PRIMITIVES.get(prim) if isinstance(prim, str) else prim
    return p is not None and p.expression is not None


def elementwise_names() -> list:
    """The registered primitives that have an expression."""
    return [n for n, p in PRIMITIVES.items() if p.expression is not None]


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


def render(prim, dialect: str, params: dict | None = None, names=None,
           integer: bool = False) -> str:
    """The expression of ``prim`` (:func:`expression`) in ``dialect`` ("numpy" or "triton");
    ``names`` renames the operands (a list in operand order, or a dict); ``integer``: the
    operands are computed as integers or bools (the expression's ``integer`` form, where
    it has one)."""
    if dialect not in DIALECTS:
        raise EinsError(f"codegen: unknown dialect {dialect!r}; choose one of {list(DIALECTS)}")
    e = expression(prim)
    operands, expr = e.operands, e.source(params, integer)
    if names is None:
        names = {}
    elif not isinstance(names, dict):
        names = dict(zip(operands, names))
    tree = _Rewrite(dialect, names).visit(ast.parse(expr, mode="eval"))
    return ast.unparse(ast.fix_missing_locations(tree))


def operand_names(prim, params: dict | None = None) -> tuple[str, ...]:
    return expression(prim).operands


@dataclass(frozen=True)
class EwDtypes:
    """What one elementwise kernel casts: each operand to ``compute[k]``, the result to
    ``out``."""

    compute: tuple
    out: np.dtype


def dtypes_for(prim, in_dtypes, out_dtype) -> EwDtypes:
    """The casts of the reference kernel for these dtypes: the expression's own ``compute``
    rule where it has one, else a unary function computes in the compute dtype of its
    result and any other expression in that of its operands' common dtype."""
    in_dtypes = [np.dtype(d) for d in in_dtypes]
    out = np.dtype(out_dtype)
    e = expression(prim)
    if e.compute is not None:
        return EwDtypes(tuple(np.dtype(c) for c in e.compute(in_dtypes, out)), out)
    if len(e.operands) == 1:
        return EwDtypes((compute_dtype(out),), out)
    return EwDtypes((compute_dtype(result_dtype(*in_dtypes)),) * len(in_dtypes), out)


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
