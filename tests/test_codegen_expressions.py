"""The elementwise expression table (eins/kernels/expressions.py): every elementwise primitive
has an expression, its numpy and Triton renderings have one tree, the numpy rendering
computes what the reference kernel does, and dtypes follow the reference casts."""
import numpy as np
import pytest

from eins.kernels import expressions as ex
from eins.errors import DTypeError, EinsError
from eins.ops.elementwise import BINARY, COMPARE, UNARY
from eins.ops.ufuncs import BINARY as UFUNC_BINARY, UNARY as UFUNC_UNARY
from eins.ir.primitive import get_primitive
from helpers import assert_close

# ----------------------------------------------------------------------------- expressions
# with the backward's own elementwise primitives (silu's and gelu's derivatives times g)
ALL_EW = list(UNARY) + list(BINARY) + list(COMPARE) + ["where", "astype", "silu_grad",
                                                       "gelu_grad"] + \
    list(UFUNC_UNARY) + list(UFUNC_BINARY)
# the ufuncs numpy defines on integers and bools only
INT_ONLY = {"invert", "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift",
            "gcd", "lcm", "bitwise_count"}


def _keys():
    out = []
    for prim in ALL_EW:
        if prim in ("gelu", "gelu_grad"):
            out += [(prim, {"approximate": True}), (prim, {"approximate": False})]
        else:
            out.append((prim, {}))
    return out


class Node:
    """A recorded expression tree: operators and calls build nodes."""

    def __init__(self, op, *args):
        self.op, self.args = op, args

    def key(self):
        return (self.op,) + tuple(a.key() if isinstance(a, Node) else ("const", a)
                                  for a in self.args)

    def _b(op):  # noqa: N805
        return lambda s, o: Node(op, s, o)

    def _r(op):  # noqa: N805
        return lambda s, o: Node(op, o, s)

    __add__, __sub__, __mul__, __truediv__ = _b("+"), _b("-"), _b("*"), _b("/")
    __radd__, __rsub__, __rmul__, __rtruediv__ = _r("+"), _r("-"), _r("*"), _r("/")
    __lt__, __le__, __gt__, __ge__ = _b("<"), _b("<="), _b(">"), _b(">=")
    __eq__, __ne__ = _b("=="), _b("!=")
    __and__, __or__, __xor__ = _b("&"), _b("|"), _b("^")
    __lshift__, __rshift__ = _b("<<"), _b(">>")
    __hash__ = object.__hash__

    def __neg__(self):
        return Node("neg", self)

    def __invert__(self):
        return Node("~", self)


class Recorder:
    """A fake ``np``/``tl``/``npx``/``libdevice``: attribute f is a call recording f under its
    neutral name (the inverse of the dialect table)."""

    def __init__(self, dialect, prefix):
        self.names = {}
        for k, v in ex.DIALECTS[dialect].items():   # the first of two (pow, ipow: np.power)
            if v.startswith(prefix + "."):
                self.names.setdefault(v.split(".", 1)[1], k)

    def __getattr__(self, f):
        if f == "PropagateNan":   # tl.maximum(..., propagate_nan=tl.PropagateNan.ALL)
            return type("PropagateNan", (), {"ALL": "ALL"})
        return lambda *a, **kw: Node(self.names[f], *a)


def _tree(prim, params, dialect):
    src = ex.render(prim, dialect, params)
    ns = {"np": Recorder("numpy", "np"), "npx": Recorder("numpy", "npx"),
          "tl": Recorder("triton", "tl"), "libdevice": Recorder("triton", "libdevice")}
    # the kernel helpers of eins/kernels/build.py (_fmod, _mod, ...) by their neutral names
    ns.update({v: (lambda f: lambda *a: Node(f, *a))(k)
               for k, v in ex.DIALECTS["triton"].items() if "." not in v})
    ns.update({a: Node(a) for a in ex.operand_names(prim, params)})
    r = eval(src, ns)  # noqa: S307 - our own rendering
    return r.key() if isinstance(r, Node) else r


def test_every_elementwise_primitive_has_an_expression():
    assert {p for p, _ in _keys()} == set(ex.elementwise_names())
    assert len({ex.key_of(p, q) for p, q in _keys()}) == len(_keys())   # gelu: two forms


@pytest.mark.parametrize("prim,params", _keys())
def test_numpy_and_triton_renderings_have_the_same_tree(prim, params):
    np_src, tl_src = ex.render(prim, "numpy", params), ex.render(prim, "triton", params)
    assert "tl." not in np_src and "np." not in tl_src
    assert _tree(prim, params, "numpy") == _tree(prim, params, "triton")


def test_dialect_spellings():
    # tl.maximum / tl.minimum drop a NaN operand unless told; np.maximum keeps it
    assert ex.render("maximum", "triton") == \
        "tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)"
    assert ex.render("relu", "triton") == "tl.maximum(x, 0, propagate_nan=tl.PropagateNan.ALL)"
    assert ex.render("exp", "triton") == "tl.exp(x)"
    assert ex.render("exp", "numpy") == "np.exp(x)"
    assert ex.render("where", "triton") == "tl.where(c, x, y)"
    assert ex.render("maximum", "numpy", names=["p", "q"]) == "np.maximum(p, q)"
    assert ex.render("tanh", "triton") == "libdevice.tanh(x)"


def _inputs(prim, rng, dtype):
    n = 64
    if prim == "where":
        return [rng.random(n) < 0.5, rng.standard_normal(n).astype(dtype),
                rng.standard_normal(n).astype(dtype)]
    arity = len(ex.operand_names(prim))
    if prim in INT_ONLY:
        return [rng.integers(-9, 10, n).astype(np.int32) if i == 0 else
                rng.integers(0, 5, n).astype(np.int32) for i in range(arity)]
    xs = [rng.standard_normal(n).astype(dtype) for _ in range(arity)]
    if prim in ("log", "sqrt", "rsqrt", "pow"):
        xs[0] = np.abs(xs[0]) + np.asarray(0.1, dtype)
    if prim in ("equal", "not_equal"):
        xs[1][::3] = xs[0][::3]  # some equal pairs
    return xs


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("prim,params", _keys())
def test_numpy_rendering_matches_the_reference_kernel(prim, params, dtype):
    rng = np.random.default_rng(7)
    xs = _inputs(prim, rng, dtype)
    if prim == "astype":
        params = {"dtype": np.dtype(np.float64)}
    prim_obj = get_primitive(prim)
    if prim == "nextafter" and dtype == np.float16:   # float32's next value is not float16's
        with pytest.raises(DTypeError, match="nextafter: float16 is computed in float32"):
            prim_obj.impl(*xs, **params)
        return
    want = prim_obj.impl(*xs, **params)[0]
    dts = ex.dtypes_for(prim, [x.dtype for x in xs], want.dtype)
    ns = {"np": np}
    exec(ex.NPX_PRELUDE, ns)
    for a, x, c in zip(ex.operand_names(prim, params), xs, dts.compute):
        ns[a] = x.astype(c)
    with np.errstate(all="ignore"):
        got = np.asarray(eval(ex.render(prim, "numpy", params), ns)).astype(dts.out)  # noqa: S307
    assert got.dtype == want.dtype
    assert_close(got, want, n=4, dtype=want.dtype)  # a rewritten formula: a few ulp apart


def test_dtypes_follow_the_reference_casts():
    f16, f32, i32 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.int32)
    b = np.dtype(bool)
    # bool + bool is or: added as int32 (Triton's int1 add wraps), cast back to bool (!= 0)
    assert ex.dtypes_for("add", [b, b], b) == ex.EwDtypes((i32, i32), b)
    assert ex.dtypes_for("mul", [b, b], b) == ex.EwDtypes((b, b), b)
    assert ex.dtypes_for("exp", [f16], f16) == ex.EwDtypes((f32,), f16)   # low precision in f32
    assert ex.dtypes_for("div", [i32, i32], np.float64).compute == (np.float64, np.float64)
    assert ex.dtypes_for("less", [f16, f32], np.bool_).compute == (f32, f32)
    assert ex.dtypes_for("astype", [f32], f16).compute == (f32,)
    assert ex.triton_dtype(np.bool_) == "tl.int1"
    with pytest.raises(EinsError, match="dtype complex64 has no Triton equivalent"):
        ex.triton_dtype(np.complex64)


def test_one_triton_dtype_map_and_one_accumulator_rule():
    """The expression dialect and the launchers read one dtype map (each caller keeps its
    error), and the ⊕ accumulator is one rule: float32 for 16-bit floats, else the block's
    dtype, as the generated kernels and the runtime's ⊕ launches both use it."""
    import torch
    import triton.language as tl
    from eins.kernels import build
    from eins.errors import DTypeError
    from eins.runtime.gpu_ops import triton_acc_dtype
    for name, tl_name in build.TRITON_DTYPES.items():
        assert ex.triton_dtype(np.dtype(name)) == build.tl_dtype(np.dtype(name)) == tl_name
    for n in ("uint16", "uint32", "uint64"):   # every unsigned width Triton has
        assert build.tl_dtype(getattr(torch, n)) == ex.triton_dtype(np.dtype(n)) == f"tl.{n}"
    with pytest.raises(DTypeError, match="no Triton dtype for complex64"):
        build.tl_dtype(torch.complex64)
    assert [build.acc_dtype_name(n) for n in ("float16", "bfloat16", "float32", "int8")] == \
        ["float32", "float32", "float32", "int8"]
    assert triton_acc_dtype(torch.float16) is triton_acc_dtype(torch.bfloat16) is tl.float32
    assert triton_acc_dtype(torch.float64) is tl.float64
    assert triton_acc_dtype(torch.int32) is tl.int32 and triton_acc_dtype(torch.uint16) is tl.uint16
    with pytest.raises(DTypeError, match="no Triton dtype for complex64"):
        triton_acc_dtype(torch.complex64)


def test_literals_and_identifiers_in_generated_source():
    from eins.codegen.source import ident, py
    from eins.ir.types import bfloat16
    ns = {"np": np, "bfloat16": bfloat16}
    for v in [float("-inf"), float("nan"), np.float32(1.5), np.int64(3), (1,), (2, (3.5, None)),
              np.dtype(np.float16), bfloat16, True, "s"]:
        back = eval(py(v), ns)  # noqa: S307
        if isinstance(v, float) and v != v:
            assert back != back
        elif isinstance(v, np.dtype) or v is bfloat16:
            assert np.dtype(back) == np.dtype(v)
        else:
            assert back == v and type(back) is type(v.item() if isinstance(v, np.generic) else v)
    assert [ident(n) for n in ("k12", "in", "np", "a-b")] == ["k12", "b_in", "b_np", "b_a_b"]


