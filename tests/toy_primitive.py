"""A toy primitive registered from this one file, with no edit anywhere else in eins:
``softsign(x) = x / (1 + |x|)``. It is the running example of docs/adding-a-primitive.md,
which explains each field below; tests/test_toy_primitive.py runs it end to end (jit,
distribute on numpy, interpret and the ranks, validate_specs, predicted_time, the GPU
lowering, the paper API).

Importing this module registers the primitive (as importing an op family file does);
``unregister`` takes it back out (the test does, so the rest of the suite never sees it).
"""
import numpy as np

from eins.ir.primitive import Expression, Primitive, register, unregister
from eins.ir.rules import compute_dtype, float_dtype
from eins.ir.types import TensorType
from eins.ops.elementwise import elementwise_indexing, elementwise_lowering
from eins.tracing import bind

NAME = "softsign"


# 1. the shape/dtype rule: the result of a float function (ints promote, as numpy's ufuncs)
def abstract(x: TensorType):
    return (TensorType(x.shape, float_dtype(x.dtype)),)


# 2. the numpy reference kernel on whole tensors (float16/bfloat16 computed in float32)
def impl(x):
    x = np.asarray(x)
    out = float_dtype(x.dtype)
    xc = x.astype(compute_dtype(out), copy=False)
    return ((xc / (1 + np.abs(xc))).astype(out, copy=False),)


# 3. the FLOPs: an abs, an add and a divide per element
def flops(in_types, out_types):
    return 3 * out_types[0].size


# 4. the user-facing function: bind traces it (and runs it eagerly on numpy arrays)
def softsign(x):
    """``x / (1 + |x|)``, elementwise."""
    return bind(NAME, x)


PRIMITIVE = register(Primitive(
    NAME, abstract, impl, flops,
    # 5. the indexing: every dim shardable, broadcast dims whole, nothing aggregated
    indexing=elementwise_indexing,
    # 6. the elementwise expression, in neutral function names: numpy source and Triton
    #    kernels render it, and the GPU runtime fuses it with its neighbours
    expression=Expression(("x",), "x / (1.0 + abs(x))"),
    # 7. the GPU lowering: the generated Triton kernel of the expression, on every platform
    lowerings={None: elementwise_lowering(NAME)},
    # 8. front ends: a traced x.softsign() names the function; the paper's graph API
    #    applies it as graph.unary(x, "softsign")
    attr_hints={"softsign": "use toy_primitive.softsign(x)"},
    paper_names={"softsign": {}},
    # 9. the programs eins.validate_specs brute-forces its join-agg specs on
    samples=lambda arr: [("softsign 6x8", softsign, (arr(6, 8),)),
                         ("softsign f16 5x7", softsign, (arr(5, 7, dtype="float16"),))],
))


def remove():
    """Take the toy back out of the registry."""
    unregister(NAME)
