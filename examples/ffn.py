"""The paper's two-layer FFN, Y = ReLU(X W1) W2, written twice: with the paper's graph API
(Section 2, verbatim) and as a plain Python function traced by eins. Both build the same IR."""
import numpy as np

import eins
import eins as es

tokens, d_model, d_ff = 16, 8, 32
dtype = np.float32

# --- the paper's listing (Section 2) ---
graph = es.createGraph()
x = graph.insertTensor(es.tensorDesc([tokens, d_model], dtype))
w1 = graph.insertTensor(es.tensorDesc([d_model, d_ff], dtype))
w2 = graph.insertTensor(es.tensorDesc([d_ff, d_model], dtype))
act = graph.matmul(x, w1)
hidden = graph.unary(act, "relu", 0.0)
y = graph.matmul(hidden, w2)
graph.save(y)
compiled = es.compileGraph(graph, device=[0], schedule_mode="naive")

rng = np.random.default_rng(0)
X = rng.standard_normal((tokens, d_model)).astype(dtype)
W1 = rng.standard_normal((d_model, d_ff)).astype(dtype)
W2 = rng.standard_normal((d_ff, d_model)).astype(dtype)
compiled.load(x, X)
compiled.load(w1, W1)
compiled.load(w2, W2)
compiled.execute()
Y = compiled.offload(y)


# --- the same computation as a traced function ---
@eins.jit
def ffn(x, w1, w2):
    return eins.relu(x @ w1) @ w2


print(compiled.program)
assert str(compiled.program) == str(eins.make_ir(ffn.fn)(X, W1, W2))
np.testing.assert_allclose(Y, ffn(X, W1, W2), rtol=1e-6)
np.testing.assert_allclose(Y, np.maximum(X @ W1, 0) @ W2, rtol=1e-5, atol=1e-5)
print("graph API and eins.jit agree with numpy:", Y.shape)
