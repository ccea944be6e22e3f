"""Every error message of issue 2's "Errors" section: shape/dtype mismatches found while tracing
name the operator, the shapes and the user's file:line; wrong number or kind of arguments to a
jitted function; unsupported dtypes; malformed einsum strings."""
import itertools
import re

import numpy as np
import pytest

import eins
from eins.errors import DTypeError, EinsError, EinsumError, ShapeError, TraceError

S = eins.ShapeDtype


def _line_of(marker):
    """``test_errors.py:N`` of the line in this file that carries ``marker``."""
    with open(__file__) as f:
        for n, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return f"test_errors.py:{n}"
    raise AssertionError(marker)


# ----------------------------------------------------------------------------- trace-time mismatches
def test_shape_mismatch_names_op_shapes_and_user_line():
    def f(x, w):
        h = x @ w
        return h + x  # MARK-add

    with pytest.raises(ShapeError) as e:
        eins.make_ir(f)(S((2, 3)), S((3, 5)))
    msg = str(e.value)
    assert msg.startswith("add:") and "(2, 5)" in msg and "(2, 3)" in msg
    assert _line_of("MARK-add") in msg


def test_matmul_mismatch_under_jit_names_line():
    @eins.jit
    def f(x, w):
        return x @ w  # MARK-matmul

    with pytest.raises(ShapeError) as e:
        f(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32))
    msg = str(e.value)
    assert "matmul" in msg and "(2, 3)" in msg and "(4, 5)" in msg
    assert _line_of("MARK-matmul") in msg


def test_mismatch_inside_a_model_names_the_model_line():
    # eins/models is user-level code: the line reported is the model's, not the operator's
    from eins.models import llama
    cfg = llama.LlamaConfig(d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=8)
    w = llama.weight_shapes(cfg, "float32")
    w["w2"] = S((9, 16))
    with pytest.raises(ShapeError) as e:
        eins.make_ir(llama.block_fn(cfg))(S((4, 16)), w, S((4, 4)), S((4, 4)))
    msg = str(e.value)
    assert "matmul" in msg and "(4, 8)" in msg and "(9, 16)" in msg and "llama.py:" in msg


def test_dtype_mismatch_names_op_and_line():
    def f(x, c):
        return eins.where(c, x, x)  # MARK-where

    with pytest.raises(DTypeError) as e:
        eins.make_ir(f)(S((3,)), S((3,), "float32"))
    msg = str(e.value)
    assert "where" in msg and "float32" in msg and "(3,)" in msg
    assert _line_of("MARK-where") in msg


def test_attention_head_mismatch():
    def f(q, k):
        return eins.attention(q, k, k)  # MARK-attn

    with pytest.raises(ShapeError) as e:
        eins.make_ir(f)(S((6, 4, 8)), S((4, 4, 8)))
    msg = str(e.value)
    assert "attention" in msg and "Hq=6" in msg and "Hkv=4" in msg
    assert _line_of("MARK-attn") in msg


# ----------------------------------------------------------------------------- calling a jitted fn
def ffn(x, w1, w2):
    return eins.relu(x @ w1) @ w2


def test_wrong_number_of_arguments():
    f = eins.jit(ffn)
    a = np.ones((2, 2), np.float32)
    with pytest.raises(TraceError, match=re.escape(
            "ffn(x, w1, w2) called with 2 positional argument(s): missing a required "
            "argument: 'w2'")):
        f(a, a)
    with pytest.raises(TraceError, match=re.escape(
            "ffn(x, w1, w2) called with 4 positional argument(s): too many positional "
            "arguments")):
        f(a, a, a, a)
    with pytest.raises(TraceError, match="unexpected keyword argument 'bias'"):
        f(a, a, a, bias=a)


def test_wrong_kind_of_argument():
    f = eins.jit(ffn)
    a = np.ones((2, 2), np.float32)
    with pytest.raises(TraceError, match="argument 1 of type str is not an array, ShapeDtype "
                                         "or Python scalar: 'w1'"):
        f(a, "w1", a)
    with pytest.raises(TraceError, match="argument 2 of ffn of type object is not an array"):
        eins.make_ir(ffn)(a, a, object())
    with pytest.raises(TraceError, match="eins.jit expects a function, got int"):
        eins.jit(3)
    with pytest.raises(TraceError, match="eins.make_ir expects a function, got str"):
        eins.make_ir("ffn")


def test_container_where_an_array_is_expected():
    # a list argument is a pytree of scalars, so the operator sees a list
    def f(x, y):
        return x + y  # MARK-list

    with pytest.raises(TraceError) as e:
        eins.jit(f)(np.ones(2, np.float32), [1.0, 2.0])
    assert "add: operand of type list is not an array" in str(e.value)
    assert _line_of("MARK-list") in str(e.value)


def test_returning_a_non_array():
    with pytest.raises(TraceError, match="f returned a str; outputs must be arrays"):
        def f(x):
            return "done"
        eins.make_ir(f)(S((2,)))


# ----------------------------------------------------------------------------- dtypes
def test_unsupported_dtype_of_an_argument():
    a = np.ones((2, 2), np.float32)
    with pytest.raises(DTypeError, match="argument 2: unsupported dtype 'complex64'"):
        eins.jit(ffn)(a, a, a.astype(np.complex64))
    with pytest.raises(DTypeError, match="argument 0 of ffn: unsupported dtype 'uint16'"):
        eins.make_ir(ffn)(a.astype(np.uint16), a, a)


def test_non_native_byte_order_is_named_as_such():
    # it said "unsupported dtype 'float32'", a dtype the same message listed as supported
    a = np.ones((2, 2), np.float32)
    nonnative = ">" if np.little_endian else "<"
    for dt in ("f4", "i8", "f2"):
        x = a.astype(nonnative + dt)
        native = np.dtype(dt)
        with pytest.raises(DTypeError, match=rf"argument 0: dtype '{re.escape(x.dtype.str)}' "
                                             rf"\({native.name}\) is in the non-native byte "
                                             rf"order; eins computes in the machine's: pass "
                                             rf"x.astype\('{re.escape(native.str)}'\)"):
            eins.jit(lambda v: v + 1)(x)
    np.testing.assert_array_equal(eins.jit(lambda v: v + 1)(a.astype("=f4")), a + 1)


def test_complex_python_scalar_argument_is_a_literal_eins_cannot_type():
    # every Python number is a weakly typed literal (one rule: eins.ir.types.is_python_scalar);
    # eins has no complex dtype, so using one names the value
    a = np.ones((2,), np.float32)
    with pytest.raises(DTypeError, match=r"mul: unsupported scalar 2j of type complex"):
        eins.jit(lambda x, c: x * c)(a, 2j)


def test_unsupported_dtype_names():
    with pytest.raises(DTypeError, match="unsupported dtype 'float8'"):
        S((2,), "float8")
    with pytest.raises(DTypeError, match="unsupported dtype 'complex64'"):
        eins.make_ir(lambda x: x.astype("complex64"))(S((2,)))


def test_a_dtype_numpy_cannot_read_is_named_with_the_supported_ones():
    with pytest.raises(DTypeError, match=r"unsupported dtype 3.5; supported: \['float16'"):
        S((2,), 3.5)
    with pytest.raises(DTypeError, match=r"unsupported dtype 3.5; supported: .* \(at "
                                         r"test_errors.py:\d+\)"):
        eins.jit(lambda x: eins.astype(x, 3.5))(np.ones(2, np.float32))


@pytest.mark.parametrize("other", [np.float64, eins.bfloat16])
def test_an_operand_dtype_numpy_cannot_promote_is_named(other):
    # float64 + datetime64 said "dtypes ... do not promote" (the datetime is what eins cannot
    # take); bfloat16 + datetime64 was numpy's raw DTypePromotionError, and bfloat16 + str
    # named 'str1024' (what numpy promoted float16 with '<U1' to), not the operand
    dt = np.array(["2020-01-01", "2020-01-02"], "M8[D]")
    x = np.ones(2, other)
    with pytest.raises(DTypeError, match=r"add: an operand's unsupported dtype "
                                         r"'datetime64\[D\]'; supported: .*\(at "
                                         r"test_errors.py:\d+\)"):
        eins.add(x, dt)
    with pytest.raises(DTypeError, match=r"add: an operand's unsupported dtype 'str32'"):
        eins.jit(lambda v: v + np.array(["a", "b"]))(x)


def test_the_supported_dtypes_promote_among_themselves():
    # why result_dtype's last error (supported operands, no supported result) cannot happen
    from eins.ir.types import SUPPORTED_DTYPES, result_dtype
    for a, b in itertools.product(SUPPORTED_DTYPES, repeat=2):
        assert result_dtype(a, b) in SUPPORTED_DTYPES


def test_numpys_other_spellings_of_a_supported_dtype_are_taken():
    # "f4", "<f8", "i8", "?" and "int" name supported dtypes; they were refused
    from eins.ir.types import as_dtype
    for name, want in [("f4", np.float32), ("<f8", np.float64), ("i8", np.int64),
                       ("?", np.bool_), ("int", np.int64), ("f2", np.float16)]:
        assert as_dtype(name) == np.dtype(want)
        assert S((2,), name).dtype == np.dtype(want)
    assert as_dtype("float") == np.dtype(np.float32)   # eins's documented alias (torch's)
    with pytest.raises(DTypeError, match=r"unsupported dtype 'u2' \(uint16\)"):
        S((2,), "u2")
    with pytest.raises(DTypeError, match="non-native byte order"):
        S((2,), ">f4" if np.little_endian else "<f4")


def test_shape_dtype_bad_shape():
    with pytest.raises(EinsError, match="tuple of ints, got 5"):
        S(5)
    with pytest.raises(EinsError, match=r"\(2, -1\) has a negative dimension"):
        S((2, -1))


# ----------------------------------------------------------------------------- einsum
@pytest.mark.parametrize("subscripts,shapes,needle", [
    ("ij,jk", [(2, 3), (3, 4), (4, 5)], "2 input terms for 3 operands"),     # operand count differs
    ("ij,jk->iik", [(2, 3), (3, 4)], "'i' repeated in 'iik'"),  # repeated output letter
    ("ij,jk->iz", [(2, 3), (3, 4)], "'z' appears in no input"),  # output letter of no operand
    ("ijk,jk->ik", [(2, 3), (3, 4)], "'ijk' names 3 dims"),  # rank differs from subscripts
    ("i1,jk->ik", [(2, 3), (3, 4)], "invalid character '1'"),  # not a letter
])
def test_malformed_einsum(subscripts, shapes, needle):
    with pytest.raises(EinsumError) as e:
        eins.make_ir(lambda *xs: eins.einsum(subscripts, *xs))(*[S(s) for s in shapes])
    assert needle in str(e.value) and repr(subscripts) in str(e.value)


def test_einsum_extent_mismatch_names_letter_and_shapes():
    with pytest.raises(ShapeError) as e:
        eins.make_ir(lambda a, b: eins.einsum("ij,jk->ik", a, b))(S((2, 3)), S((4, 5)))
    msg = str(e.value)
    assert "einsum" in msg and "letter 'j' has sizes 3 and 4" in msg
    assert "(2, 3)" in msg and "(4, 5)" in msg
    assert "test_errors.py:" in msg


# ----------------------------------------------------------------------------- control flow
def test_bool_of_tracer():
    def f(x):
        return x if x > 0 else -x  # MARK-bool

    with pytest.raises(TraceError, match="control flow") as e:
        eins.make_ir(f)(S((2,)))
    assert _line_of("MARK-bool") in str(e.value)


# ----------------------------------------------------------------------------- static parameters
W16 = S((16,))


@pytest.mark.parametrize("call,error,message", [
    # a string flag used to read as true: causal="False" ran a causal attention
    (lambda x: eins.attention(x, x, x, causal="False"), TraceError,
     "attention: causal must be True or False, got 'False'"),
    (lambda x: eins.sum(x, axis=0, keepdims="no"), TraceError,
     "sum: keepdims must be True or False, got 'no'"),
    (lambda x: eins.gelu(x, approximate=None), TraceError,
     "gelu: approximate must be True or False, got None"),
    # float() raised its own ValueError / TypeError with no op and no line
    (lambda x: eins.attention(x, x, x, scale="a"), TraceError,
     "attention: scale must be a real number, got 'a'"),
    (lambda x: eins.attention(x, x, x, scale=1j), TraceError,
     "attention: scale must be a real number, got 1j"),
    (lambda x: eins.attention(x, x, x, scale=float("nan")), TraceError,
     "attention: scale must be finite, got nan"),
    (lambda x: eins.rms_norm(x, W16, eps="a"), TraceError,
     "rms_norm: eps must be a real number, got 'a'"),
    (lambda x: eins.rms_norm(x, W16, eps=-1), TraceError,
     "rms_norm: eps must be at least 0, got -1"),
    (lambda x: eins.layer_norm(x, W16, W16, eps=float("inf")), TraceError,
     "layer_norm: eps must be finite, got inf"),
    # a dict iterated its keys, a bool passed as position 1
    (lambda x: eins.attention(x, x, x, segments={4: 1, 8: 2}), ShapeError,
     "attention: segments must be a tuple of end positions or an int array of them, "
     "got {4: 1, 8: 2}"),
    (lambda x: eins.attention(x, x, x, segments=(True, 8)), ShapeError,
     "attention: segments must be int end positions, not bools, got (True, 8)"),
    # raw TypeErrors ('NoneType' object is not iterable) and AttributeErrors ('float' object
    # has no attribute 'shape') from inside the shape ops
    (lambda x: eins.reshape(x, None), ShapeError,
     "reshape: shape must be a tuple of ints, got None"),
    (lambda x: eins.transpose(x, 1), ShapeError,
     "transpose: axes must be a tuple of ints, got 1"),
    (lambda x: eins.reshape(2.0, (1,)), TraceError,
     "reshape: operand of type float is not an array"),
    (lambda x: eins.concatenate([x, 2.0]), TraceError,
     "concatenate: operand of type float is not an array"),
    (lambda x: eins.concatenate(x), ShapeError,
     "concatenate: operands must be a tuple or list of arrays, got Tracer"),
    # & | ^ ~ are numpy's bitwise operators (masks combine with them): on floats, numpy's
    # own refusal by name, not Python's "unsupported operand type(s) for &"
    (lambda x: x & x, DTypeError, "bitwise_and: numpy's bitwise_and is not defined for "
                                  "float32 and float32 (integers and bools only)"),
    (lambda x: ~x, DTypeError, "invert: numpy's invert is not defined for float32"),
])
def test_bad_static_parameters_are_named_at_the_users_line(call, error, message):
    with pytest.raises(error) as e:
        eins.make_ir(call)(S((4, 8, 16)))
    assert str(e.value).startswith(message), str(e.value)
    assert f"(at test_errors.py:{call.__code__.co_firstlineno})" in str(e.value)   # the lambda


def test_static_parameters_still_take_numpy_scalars_ints_ranges_and_0d_arrays():
    """What numpy (and eins before these checks) took: numpy scalars, 0-d arrays for reals,
    ranges and lists for shapes, axes and segments."""
    x, w = S((4, 8, 16)), S((16,))
    for f in (lambda x, w: eins.attention(x, x, x, causal=np.True_, scale=np.float32(0.5),
                                          segments=np.array([4, 8])),
              lambda x, w: eins.attention(x, x, x, scale=np.array(0.5), segments=range(4, 9, 4)),
              lambda x, w: eins.sum(x, axis=0, keepdims=1),
              lambda x, w: eins.rms_norm(x, w, eps=0),
              lambda x, w: eins.rms_norm(x, w, eps=np.array(1e-6)),
              lambda x, w: eins.reshape(x, np.int64(512)),
              lambda x, w: eins.reshape(x, range(512, 513)),
              lambda x, w: eins.transpose(x, range(2, -1, -1)),
              lambda x, w: eins.transpose(x, [1, 0, 2])):
        eins.make_ir(f)(x, w)
    with pytest.raises(ShapeError, match="reshape: shape must be a tuple of ints, got 'ab'"):
        eins.make_ir(lambda x: eins.reshape(x, "ab"))(x)


@pytest.mark.parametrize("a,b,message", [
    # the rule on the promoted matrices printed (1, 3) @ (4, 1)
    ((3,), (4,), "matmul: contracted dimensions differ: (3,) @ (4,) (K=3 != K=4)"),
    ((2, 3), (4,), "matmul: contracted dimensions differ: (2, 3) @ (4,) (K=3 != K=4)"),
    ((3,), (4, 2), "matmul: contracted dimensions differ: (3,) @ (4, 2) (K=3 != K=4)"),
    ((), (4,), "matmul: operands must be at least 1-D, got shapes () and (4,)"),
])
def test_vector_matmul_errors_show_the_users_shapes(a, b, message):
    def f(x, y):
        return x @ y
    with pytest.raises(ShapeError) as e:
        eins.make_ir(f)(S(a), S(b))
    assert str(e.value) == f"{message} (at test_errors.py:{f.__code__.co_firstlineno + 1})"


def test_astype_none_and_masked_arrays_are_refused():
    with pytest.raises(DTypeError, match=r"astype: dtype None names no dtype \(numpy would "
                                         r"take it as float64\)"):
        eins.make_ir(lambda x: x.astype(None))(S((2,)))
    x = np.arange(4, dtype=np.float32)
    m = np.ma.masked_array(x, mask=x > 1)
    with pytest.raises(TraceError, match="argument 0 is a numpy masked array; eins computes on "
                                         "plain arrays and would ignore its mask"):
        eins.jit(lambda x: x + 1)(m)
    with pytest.raises(TraceError, match="argument 1 is a numpy masked array"):
        eins.distribute(lambda x, y: x + y, devices=2)(x, m)


# ----------------------------------------------------------------------------- calls an eins
# function's signature refuses, and numpy/torch habits on traced arrays
@pytest.mark.parametrize("call, says", [
    (lambda x: eins.sum(x, dim=0), "eins.sum(): got an unexpected keyword argument 'dim' "
                                   "(eins spells it axis=)"),
    (lambda x: eins.mean(x, 1, keepdim=True), "eins.mean(): got an unexpected keyword "
                                              "argument 'keepdim' (eins spells it keepdims=)"),
    (lambda x: eins.softmax(x, dim=-1), "eins.softmax(): got an unexpected keyword argument "
                                        "'dim'"),
    (lambda x: eins.rms_norm(x, x[0], epsilon=1e-5), "(eins spells it eps=)"),
    (lambda x: eins.transpose(x, 0, 1), "eins.transpose(): takes from 1 to 2 positional"),
    (lambda x: eins.maximum(x), "eins.maximum(): missing 1 required positional argument"),
    (lambda x: eins.slice(x, (0, 0)), "eins.slice(): missing 1 required positional argument"),
    (lambda x: eins.softmax(x, 0, axis=1), "eins.softmax(): got multiple values for argument"),
])
def test_a_call_the_signature_refuses_names_the_public_function_and_line(call, says):
    x = np.ones((3, 4), np.float32)
    with pytest.raises(TraceError) as e:
        eins.jit(lambda x: call(x))(x)  # MARK-refused-call
    assert says in str(e.value)
    assert "<locals>" not in str(e.value) and "_make_reduction" not in str(e.value)
    assert re.search(r"\(at test_errors\.py:\d+\)$", str(e.value))
    with pytest.raises(TraceError, match=re.escape(says)):   # eagerly on numpy arrays too
        call(x)


@pytest.mark.parametrize("name", ["relu", "exp", "sqrt", "tanh"])
def test_unary_ops_refuse_keywords_they_do_not_take(name):
    # relu(x, alpha=0.1) was traced with the keyword as a parameter: the numpy backend
    # raised a raw TypeError at run time and the GPU path ran plain relu, dropping alpha
    f = lambda x: getattr(eins, name)(x, alpha=0.1)  # noqa: E731  MARK-unary-kw
    with pytest.raises(TraceError, match=rf"eins\.{name}\(\): got an unexpected keyword "
                                         rf"argument 'alpha' \(at test_errors\.py:\d+\)"):
        eins.make_ir(f)(S((3, 4), "float32"))
    with pytest.raises(TraceError, match="'beta'"):
        eins.make_ir(lambda x: eins.gelu(x, approximate=True, beta=2))(S((3, 4), "float32"))
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    exact = eins.jit(lambda x: eins.gelu(x, approximate=False))(x)   # its one keyword works
    assert not np.allclose(exact, eins.jit(lambda x: eins.gelu(x))(x), atol=1e-6, rtol=0)


def test_item_assignment_on_a_traced_array_is_a_trace_error():
    def f(x):
        x[0, 1:3] = 1  # MARK-setitem
        return x

    with pytest.raises(TraceError) as e:
        eins.jit(f)(np.ones((3, 4), np.float32))
    msg = str(e.value)
    assert "x[0, 1:3] = ..." in msg and "immutable" in msg and "eins.where" in msg
    assert _line_of("MARK-setitem") in msg


@pytest.mark.parametrize("attr, hint", [
    ("item", "no concrete value"), ("tolist", "no concrete value"),
    ("permute", "x.transpose"), ("unsqueeze", "x.reshape"), ("view", "x.reshape"),
    ("float", "x.astype"), ("dot", "x @ y"), ("clamp", "x.clip(lo, hi)"),
    ("sort", "np.sort(x, axis)"), ("exp", "eins.exp(x)"), ("foo", None)])
def test_a_missing_array_method_names_itself_a_hint_and_the_line(attr, hint):
    def f(x):
        return getattr(x, attr)  # MARK-getattr

    with pytest.raises(eins.errors.TraceAttributeError) as e:
        eins.make_ir(f)(S((3, 4), "float32"))
    msg = str(e.value)
    assert f"has no attribute {attr!r}" in msg and _line_of("MARK-getattr") in msg
    assert hint is None or hint in msg
    assert isinstance(e.value, AttributeError)   # hasattr/getattr(x, n, default) still work


def test_hasattr_and_protocol_probes_on_a_traced_array_stay_silent():
    seen = {}

    def f(x):
        seen["dlpack"] = hasattr(x, "__dlpack__")
        seen["item"] = getattr(x, "item", "default")
        return x * 2

    eins.make_ir(f)(S((2,), "float32"))
    assert seen == {"dlpack": False, "item": "default"}


def test_setting_an_attribute_of_a_traced_array_is_a_trace_error():
    def f(x):
        x.foo = 1  # MARK-setattr
        return x

    with pytest.raises(TraceError, match=r"cannot set attribute 'foo' .* \(at test_errors"):
        eins.make_ir(f)(S((2,), "float32"))


def test_a_distributed_function_called_inside_a_trace_says_it_cannot_nest():
    """It said 'a traced array has no concrete value to turn into a numpy array', as if the
    user had called np.asarray; a nested eins.jit is inlined, a distribute cannot be."""
    g = eins.distribute(lambda x: x * 2, devices=2)
    x = np.ones(2, np.float32)
    with pytest.raises(TraceError, match=r"eins.distribute called on traced arrays, inside a "
                                         r"traced function: .*cannot be nested in a trace.*"
                                         r"\(at test_errors.py:\d+\)"):
        eins.jit(lambda y: g(y))(x)
    compiled = g.lower(x).compile()
    with pytest.raises(TraceError, match=r"a compiled program called on traced arrays"):
        eins.jit(lambda y: compiled(y))(x)
    # on concrete arrays inside a trace it is a constant, as any numpy result is
    np.testing.assert_array_equal(eins.jit(lambda y: y + g(x))(x), [3.0, 3.0])


def test_an_unsupported_constant_output_names_the_function():
    def make_mask(a):
        return np.arange(3, dtype=np.uint16)

    with pytest.raises(DTypeError, match=r"make_mask returned a constant array output: "
                                         r"unsupported dtype 'uint16'"):
        eins.jit(make_mask)(np.ones(2, np.float32))
