"""Golden files of the traced IR's text (tests/fixtures/ir/*.txt): every variable's dtype and
shape and every eqn's params, stable across runs.

Regenerate after an intended printer change with ``EINS_REGEN_IR=1 pytest tests/test_ir_dump.py``
and review the diff."""
import os
import subprocess
import sys

import numpy as np
import pytest

import eins
import eins as es
from eins.models import chains, llama

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ir")
S = eins.ShapeDtype
TINY = llama.TINY


def ffn_graph():
    graph = es.createGraph()
    x = graph.insertTensor(es.tensorDesc([8, 4], "float32"))
    w1 = graph.insertTensor(es.tensorDesc([4, 16], "float32"))
    w2 = graph.insertTensor(es.tensorDesc([16, 4], "float32"))
    hidden = graph.unary(graph.matmul(x, w1), "relu", 0.0)
    graph.save(graph.matmul(hidden, w2))
    return es.compileGraph(graph).program


def llama_single():
    return eins.make_ir(llama.block_fn(TINY))(
        S((8, TINY.d_model), "float32"), llama.weight_shapes(TINY, "float32"),
        S((8, TINY.head_dim), "float32"), S((8, TINY.head_dim), "float32"))


def llama_packed_f16():
    return eins.make_ir(llama.block_fn(TINY, segments=(3, 8)))(
        S((8, TINY.d_model), "float16"), llama.weight_shapes(TINY, "float16"),
        S((8, TINY.head_dim), "float16"), S((8, TINY.head_dim), "float16"))


def llama_batch_bf16():
    return eins.make_ir(llama.block_fn(TINY))(
        S((2, 4, TINY.d_model), "bfloat16"), llama.weight_shapes(TINY, "bfloat16"),
        S((4, TINY.head_dim), "bfloat16"), S((4, TINY.head_dim), "bfloat16"))


def chain_b():
    c = chains.chain("B", scale=1024)
    return eins.make_ir(c.fn)(*c.shape_args("float16"))


_TABLE = np.linspace(0.0, 1.0, 6).reshape(2, 3).astype(np.float32)


def literals_consts():
    def f(params, x, k):
        y = (x[:, 1:] @ _TABLE.T) * k - 0.5   # a slice, a constant, two literals
        return {"y": eins.tanh(y), "s": params["w"].T.astype("float64").sum(axis=0)}
    # k static: a literal of the program (a traced Python scalar would be an input)
    return eins.make_ir(f, static_argnums=2)({"w": S((3, 2), "float32")}, S((4, 4), "float32"),
                                             2.0)


CASES = {
    "ffn_paper_graph": ffn_graph,
    "llama_tiny_single": llama_single,
    "llama_tiny_packed_f16": llama_packed_f16,
    "llama_tiny_batch_bf16": llama_batch_bf16,
    "chain_B_scale1024": chain_b,
    "literals_consts": literals_consts,
}


@pytest.mark.parametrize("name", list(CASES))
def test_ir_dump_matches_golden(name):
    text = str(CASES[name]()) + "\n"
    path = os.path.join(FIXTURES, name + ".txt")
    if os.environ.get("EINS_REGEN_IR"):
        os.makedirs(FIXTURES, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        expected = f.read()
    assert text == expected, f"IR of {name} differs from {path} (EINS_REGEN_IR=1 regenerates)"
    assert str(CASES[name]()) + "\n" == text  # a second trace prints the same


def test_dump_shows_types_and_params():
    text = str(llama_packed_f16())
    assert "segments=(3,8)" in text and "causal=True" in text
    assert "a:f16[8,16]" in text and "f16[4,8,4]" in text  # every var with dtype and shape


def test_dump_stable_across_processes():
    # a fresh interpreter (another hash seed, other object ids) prints the same text
    code = ("import sys; sys.path.insert(0, %r); import test_ir_dump as t; "
            "print(t.llama_single())" % os.path.dirname(__file__))
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(os.path.dirname(__file__)), check=True)
    assert out.stdout == str(llama_single()) + "\n"
