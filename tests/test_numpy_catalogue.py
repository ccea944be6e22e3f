"""A catalogue of numpy idioms found in model code (activations, norms, masks, RoPE, KV
caches, quantized weights, losses, sampling, ...): each traces under eins.jit and equals
numpy on the same data, dtype and shape included (issue 33 part 4). What cannot trace
(data-dependent shapes, control flow on traced values, item assignment) is refused with an
error that says why and what to write instead."""
import numpy as np
import pytest

import eins
from eins.errors import EinsError, TraceError
from helpers import assert_close

R = np.random.default_rng(0)
X = R.standard_normal((4, 8)).astype(np.float32)           # activations [tokens, d]
W = R.standard_normal((8, 8)).astype(np.float32) / 3
G = (1 + R.standard_normal(8) / 10).astype(np.float32)     # norm gains
S = R.standard_normal((2, 4, 6, 6)).astype(np.float32)     # attention scores [B, H, S, S]
Q = R.standard_normal((2, 6, 4, 8)).astype(np.float32)     # [B, S, H, D]
IDS = R.integers(0, 8, size=(4,)).astype(np.int64)
Y = R.integers(0, 8, size=(4,)).astype(np.int32)
W8 = R.integers(-128, 128, size=(8, 8)).astype(np.int8)     # int8 weights
PIX = R.integers(0, 256, size=(4, 8)).astype(np.uint8)      # uint8 pixels / packed int4
CACHE = R.standard_normal((2, 10, 8)).astype(np.float32)    # KV cache [B, L, d]
NEW = R.standard_normal((2, 1, 8)).astype(np.float32)
POS = np.arange(6)
BAD = X.copy()
BAD[0, 1], BAD[2, 3] = np.nan, np.inf


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), -1, keepdims=True))


CATALOGUE = [
    ("linear", lambda x, w: x @ w + 0.5, (X, W)),
    ("relu", lambda x: np.maximum(x, 0), (X,)),
    ("leaky relu", lambda x: np.where(x > 0, x, 0.01 * x), (X,)),
    ("gelu tanh", lambda x: 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3))),
     (X,)),
    ("silu", lambda x: x / (1 + np.exp(-x)), (X,)),
    ("softplus log1p", lambda x: np.log1p(np.exp(x)), (X,)),
    ("softplus logaddexp", lambda x: np.logaddexp(0, x), (X,)),
    ("softmax", softmax, (X,)),
    ("log softmax", log_softmax, (X,)),
    ("layer norm", lambda x, g: (x - x.mean(-1, keepdims=True)) /
     np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g, (X, G)),
    ("rms norm", lambda x, g: x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + 1e-6) * g,
     (X, G)),
    ("l2 normalize", lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True), (X,)),
    ("cosine similarity", lambda a, b: (a @ b.T) / (np.linalg.norm(a, axis=1)[:, None] *
                                                    np.linalg.norm(b, axis=1)[None, :]),
     (X, W)),
    ("frobenius norm", lambda w: np.linalg.norm(w), (W,)),
    ("max-abs norm", lambda x: np.linalg.norm(x, ord=np.inf, axis=-1), (X,)),
    ("embedding gather", lambda e, i: e[i], (W, IDS)),
    ("cross entropy", lambda x, y: -np.take_along_axis(log_softmax(x), y[:, None].astype(
        np.int64), 1).mean(), (X, Y)),
    ("accuracy", lambda x, y: (np.argmax(x, -1) == y).mean(), (X, Y)),
    ("qkv split", lambda x: np.split(x @ np.ones((8, 24), np.float32), 3, axis=-1)[1], (X,)),
    ("array_split", lambda x: np.array_split(x, 3, axis=1)[0], (X,)),
    ("heads reshape transpose", lambda q: q.reshape(2, 6, 32).reshape(2, 6, 4, 8)
     .transpose(0, 2, 1, 3), (Q,)),
    ("swapaxes", lambda q: np.swapaxes(q, 1, 2), (Q,)),
    ("causal mask constant", lambda s: np.where(np.triu(np.ones((6, 6), bool), 1), -np.inf, s),
     (S,)),
    ("tril on scores", lambda s: np.tril(s), (S,)),
    ("triu offset", lambda s: np.triu(s, 2), (S,)),
    ("padding mask where", lambda s, m: np.where(m[:, None, None, :], s, -1e9),
     (S, np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool))),
    ("masks and", lambda x: np.where((x > -0.5) & (x < 0.5), x, 0.0), (X,)),
    ("masks or, not", lambda x: np.where(~((x < -1) | (x > 1)), x, 0.0), (X,)),
    ("masks xor", lambda x: ((x > 0) ^ (x[::-1] > 0)).astype(np.float32), (X,)),
    ("rope rotate half", lambda q: np.concatenate([-q[..., 4:], q[..., :4]], -1), (Q,)),
    ("rope split halves", lambda q: np.concatenate(np.split(q, 2, -1)[::-1], -1), (Q,)),
    ("rope interleaved", lambda q: np.stack([-q[..., 1::2], q[..., ::2]], -1).reshape(q.shape),
     (Q,)),
    ("rope tables", lambda q: q * np.cos(POS)[None, :, None, None] +
     q[..., ::-1] * np.sin(POS)[None, :, None, None], (Q,)),
    ("positions modulo", lambda x: x[:, :6] + (POS % 3)[None, :], (X,)),
    ("sliding window band", lambda s: np.where(np.abs(POS[:, None] - POS[None, :]) < 3, s, 0.0),
     (S,)),
    ("clip", lambda x: np.clip(x, -0.5, 0.5), (X,)),
    ("clip method", lambda x: x.clip(min=0), (X,)),
    ("softcap", lambda x: 30.0 * np.tanh(x / 30.0), (X,)),
    ("quantize int8", lambda x: np.clip(np.round(x * 64), -128, 127).astype(np.int8), (X,)),
    ("dequantize int8", lambda w, x: x @ (w.astype(np.float32) * 0.01), (W8, X)),
    ("uint8 pixels", lambda p: p / 255.0, (PIX,)),
    ("unpack int4", lambda p: ((p >> 4) & 15).astype(np.float32) - (p & 15), (PIX,)),
    ("floor quantize", lambda x: np.floor(x * 4) / 4, (X,)),
    ("ceil div", lambda x: np.ceil(x * 3), (X,)),
    ("floor division", lambda x: x // 0.5, (X,)),
    ("integer floor division", lambda i: i // 3 - i % 3, (Y,)),
    ("sign sqrt", lambda x: np.sign(x) * np.abs(x) ** 0.5, (X,)),
    ("nan_to_num", lambda x: np.where(np.isnan(x) | np.isinf(x), 0.0, x), (BAD,)),
    ("isfinite all", lambda x: np.isfinite(x).all(-1), (BAD,)),
    ("any above", lambda x: np.any(x > 1.5, axis=0), (X,)),
    ("expm1 log2", lambda x: np.expm1(x) + np.log2(np.abs(x) + 1) + np.exp2(x), (X,)),
    ("cumsum", lambda x: np.cumsum(x, axis=-1), (X,)),
    ("cumsum method flattened", lambda x: x.cumsum(), (X,)),
    ("prod", lambda x: np.prod(1 + x / 10, axis=0), (X,)),
    ("expand_dims", lambda x: np.expand_dims(x, 1) * np.expand_dims(x, 0), (X,)),
    ("newaxis", lambda x: x[:, None, :] - x[None, :, :], (X,)),
    ("squeeze", lambda x: np.squeeze(x[:1, None]), (X,)),
    ("ravel", lambda x: x.ravel() @ np.ones(32, np.float32), (X,)),
    ("flatten", lambda q: q.flatten()[::7], (Q,)),
    ("broadcast_to", lambda g: np.broadcast_to(g, (4, 8)) * 2, (G,)),
    ("gqa repeat kv", lambda q: np.repeat(q, 2, axis=2), (Q,)),
    ("tile", lambda g: np.tile(g, (2, 1)), (G,)),
    ("causal conv pad", lambda x: np.pad(x, ((2, 0), (0, 0))), (X,)),
    ("flip", lambda x: np.flip(x, -1), (X,)),
    ("reverse slice", lambda x: x[::-1], (X,)),
    ("roll", lambda x: np.roll(x, 1, axis=-1), (X,)),
    ("zeros_like ones_like", lambda x: np.zeros_like(x) + np.ones_like(x) * x, (X,)),
    ("full_like -inf", lambda s: np.maximum(np.full_like(s, -np.inf), s), (S,)),
    ("arange positions", lambda e: e[np.arange(4)] + np.arange(8), (W,)),
    ("eye residual", lambda x, w: x @ (w + np.eye(8, dtype=np.float32)), (X, W)),
    ("top-k by sort", lambda x: np.sort(x, -1)[..., -3:], (X,)),
    ("top-k by argsort", lambda x: np.argsort(-x, -1)[..., :3], (X,)),
    # JAX's functional update; numpy's own spelling is the reference (REFERENCE below)
    ("kv cache update", lambda c, n: c.at[:, 3:4].set(n), (CACHE, NEW)),
    ("kv cache append", lambda c, n: np.concatenate([c, n], 1), (CACHE, NEW)),
    ("einsum scores", lambda q: np.einsum("bshd,bthd->bhst", q, q) / np.sqrt(8), (Q,)),
    ("stack heads", lambda q: np.stack([q[:, :, 0], q[:, :, 1]], 0), (Q,)),
    ("hstack vstack", lambda x: np.vstack([np.hstack([x, x]), np.hstack([x, x])]), (X,)),
    ("std mean axes", lambda s: np.std(s, axis=(2, 3)) + np.mean(s, axis=(0, 1)).sum(), (S,)),
    ("degrees atan2 hypot", lambda x: np.degrees(np.arctan2(x, 1.0)) + np.hypot(x, x), (X,)),
    ("reciprocal fmax", lambda x: np.reciprocal(np.fmax(np.abs(x), 0.1)), (X,)),
    # the multi-output ufuncs return numpy's tuples: (a, b) unpacks them
    ("divmod ufunc", lambda x: np.stack(np.divmod(x, 0.75)), (X,)),
    ("modf split", lambda x: np.stack(np.modf(x * 3)), (X,)),
    ("frexp mantissa and exponent", lambda x: np.frexp(x)[0] * np.frexp(x)[1], (X,)),
    ("ldexp power-of-two scale", lambda x, y: np.ldexp(x, y), (X, Y[:, None])),
    ("spacing tolerance", lambda x: np.abs(x) <= 4 * np.spacing(np.abs(x)) + 1, (X,)),
    ("gcd lcm of positions", lambda y: np.lcm(y, 6) + np.gcd(y, 4), (Y,)),
    ("bitwise_count packed bits", lambda p: np.bitwise_count(p).astype(np.int32).sum(-1),
     (PIX,)),
]


def _set_rows(c, n):
    c = c.copy()
    c[:, 3:4] = n
    return c


REFERENCE = {"kv cache update": _set_rows}   # numpy arrays have no .at


@pytest.mark.parametrize("name,fn,args", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_idiom_traces_and_matches_numpy(name, fn, args):
    with np.errstate(all="ignore"):
        want = np.asarray(REFERENCE.get(name, fn)(*args))
    got = np.asarray(eins.jit(fn)(*args))
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    assert_close(got, want, n=64)


def test_the_catalogue_holds_64_idioms_or_more():
    assert len({c[0] for c in CATALOGUE}) == len(CATALOGUE) >= 64


# ------------------------------------------------------------------------------ refused
def _if_positive(x):
    if x.sum() > 0:
        return x
    return -x


def _assign(x):
    x[0] = 0.0
    return x


def _to_float(x):
    return x * float(x.max())


REFUSED = [
    ("boolean mask index", lambda x: x[x > 0], EinsError,
     r"data-dependent number of elements: use np.where\(mask, x, 0\)"),
    ("nonzero", lambda x: np.nonzero(x > 0), TraceError,
     r"numpy.nonzero on a traced array: its result's shape depends on the values.*"
     r"np.where\(cond, x, 0\)"),
    ("unique", lambda x: np.unique(x), TraceError,
     r"numpy.unique on a traced array: its result's shape depends on the values.*sort"),
    ("where without x and y", lambda x: np.where(x > 0), TraceError,
     r"numpy.where\(condition\) without x and y returns indices"),
    ("control flow", _if_positive, TraceError,
     r"Python control flow \(if/while/bool\) cannot depend on it: compute both branches "
     r"and pick with np.where\(cond, a, b\)"),
    ("item assignment", _assign, TraceError,
     r"traced arrays are immutable; build the new value instead, x = x.at\[0\].set\(value\) "
     r"or eins.where"),
    ("float of a traced value", _to_float, TraceError, r"float\(\) of a traced array"),
    ("vecdot", lambda x: np.vecdot(x, x), TraceError,
     r"numpy.vecdot cannot run on a traced array; write np.einsum"),
    ("a float exponent to ldexp", lambda x: np.ldexp(x, x), EinsError,
     r"ldexp: numpy's ldexp is not defined for float32 and float32"),
    ("ufunc reduce", lambda x: np.maximum.reduce(x), TraceError,
     r"numpy.maximum.reduce cannot run on a traced array; write np.max"),
    ("median", lambda x: np.median(x), TraceError,
     r"numpy.median cannot run on a traced array; write np.sort\(x, axis\)"),
    ("a misspelt function", lambda x: np.nanargmax(x), TraceError,
     r"numpy.nanargmax cannot run on a traced array; the closest traced: np.argmax"),
]


@pytest.mark.parametrize("name,fn,err,pattern", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_cannot_trace_says_why_and_what_to_write(name, fn, err, pattern):
    with pytest.raises(err, match=pattern) as e:
        eins.jit(fn)(X)
    assert "test_numpy_catalogue.py:" in str(e.value)


def test_divmod_operator_traces():
    a, b = eins.jit(lambda x: divmod(x, 0.75))(X)
    assert_close(a, X // 0.75, n=1)
    assert_close(b, X % 0.75, n=1)


# ------------------------------------------------------------------------------ the docs
def test_the_docs_list_what_traces_from_the_registry():
    import os
    import re
    import textwrap
    from eins import numpy_api
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "numpy.md"), encoding="utf-8") as f:
        doc = f.read()
    block = re.search(r"<!-- traced:begin -->\n(.*?)\n<!-- traced:end -->", doc, re.S).group(1)
    listed = re.findall(r"`np\.([\w.]+)`", block)
    assert listed == numpy_api.traced_names()
    assert block == textwrap.fill(", ".join(f"`np.{n}`" for n in listed), 92)
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        assert "docs/numpy.md" in f.read()
    # every traced name is a numpy function or ufunc that exists
    for n in listed:
        obj = np
        for part in n.split("."):
            obj = getattr(obj, part, None)
        assert obj is not None or n == "astype", n
