"""Helpers shared by the operator tests (``from helpers import ...``; pyproject puts tests/ on
pytest's path): the join-agg spec checker, decomposition generators, eager-vs-jit and random
inputs. They run a primitive's own pieces (abstract, impl, indexing, run_block) and
recompose by hand, so they never lean on eins.validate_specs, the code under test."""
import itertools
import math
from typing import NamedTuple

import numpy as np

import eins
from eins.ir.joinagg import aggregate, finalize, partial_dtype
from eins.ir.plan import Tuning
from eins.ir.pytree import tree_flatten
from eins.ir.types import Box, TensorType, as_dtype, split_even
from eins.models import llama
from eins.ops import get_primitive
from eins.passes.rebalance import runtime_operands


# ----------------------------------------------------------------------------- tolerances
# The rule lives in the package (eins.tolerance) so the demo and the examples check their
# results with it too; assert_close applies it relative to the result's magnitude.
from eins.tolerance import accumulation, eps, magnitude, tolerance  # noqa: E402,F401


def assert_close(got, want, *, n=1, depth=1, dtype=None, err_msg="", scale=None):
    """``got`` equals ``want`` up to :func:`tolerance` of ``dtype`` (default: the narrower
    of the two arrays' dtypes) for ``depth`` accumulations of ``n`` terms, relative to the
    largest magnitude in ``want``, or to ``scale`` where given: a sum that cancels (terms of
    both signs) is only as exact as its terms are large, so the caller passes the largest
    sum of the terms' magnitudes there. Integer and bool results must be equal."""
    got, want = np.asarray(got), np.asarray(want)
    if dtype is None:
        dtype = min((got.dtype, want.dtype), key=lambda d: (eps(d) == 0, -eps(d)))
    assert got.shape == want.shape, (got.shape, want.shape, err_msg)
    rel = tolerance(dtype, n, depth)
    if rel == 0.0:
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
        return
    w = want.astype(np.float64)
    atol = rel * (magnitude(w) if scale is None else max(scale, magnitude(w)))
    np.testing.assert_allclose(got.astype(np.float64), w, rtol=rel, atol=atol, err_msg=err_msg)


# ----------------------------------------------------------------------------- decompositions
def even_decompositions(ix, ps=(2, 3), whole=False):
    """For each p in ``ps``: each shardable index alone split p near-equal ways, then all of
    them together (indices shorter than p stay whole). ``whole`` adds the no-split case."""
    decomps = [{}] if whole else []
    for p in ps:
        split = {n: split_even(ix.extents[n], p) for n in ix.shardable if ix.extents[n] >= p}
        decomps += [{n: iv} for n, iv in split.items()] + [split]
    return decomps


def all_decompositions(ix, max_parts=3):
    """Every combination over the shardable indices of: near-equal splits into 1..max_parts
    for ``any``, every subset of the allowed cut positions otherwise."""
    options = {}
    for name, how in ix.shardable.items():
        n = ix.extents[name]
        if how == "any":
            options[name] = [split_even(n, p) for p in range(1, min(n, max_parts) + 1)]
        else:
            opts = []
            for r in range(len(how) + 1):
                for cuts in itertools.combinations(how, r):
                    pts = (0, *cuts, n)
                    opts.append(tuple(zip(pts[:-1], pts[1:])))
            options[name] = opts
    names = list(options)
    return [dict(zip(names, c)) for c in itertools.product(*(options[n] for n in names))]


# ----------------------------------------------------------------------------- spec checker
def run_spec(prim, spec, arrays, out_types, params, agg=None):
    """Definition 3.7's three steps for one join-agg spec: run every function spec on its
    input blocks, ⊕-aggregate the results that share an output box, recompose the whole
    outputs. Checks each block result's shape and dtype, and that a box computed more than
    once has an ⊕ (exactly ``agg`` when given). Returns (outputs, most copies of one box)."""
    spec.check_tiling([t.shape for t in out_types])
    parts = [dict() for _ in out_types]
    mult = [spec.multiplicity(j) for j in range(len(out_types))]
    for f in spec.fspecs:
        blocks = [a[b.relative_to(Box.full(a.shape))] for a, b in zip(arrays, f.inputs)]
        # blocks aggregated with a ⊕ of pairs (lse) are computed as pairs
        dts = [partial_dtype(spec.aggs[j], t.dtype) if mult[j][f.outputs[j]] > 1 else t.dtype
               for j, t in enumerate(out_types)]
        partial = any(d != t.dtype for d, t in zip(dts, out_types))
        res = prim.run_block(f, *blocks, partial=partial, **params)
        assert len(res) == len(out_types), (prim.name, f, len(res))
        for j, (box, r) in enumerate(zip(f.outputs, res)):
            r = np.asarray(r)
            assert r.shape == box.shape, (prim.name, f, r.shape)
            assert r.dtype == dts[j], (prim.name, f, r.dtype, dts[j])
            parts[j].setdefault(box, []).append(r)
    results, copies = [], 1
    for j, t in enumerate(out_types):
        full = np.zeros(t.shape, t.dtype)
        for box, rs in parts[j].items():
            if len(rs) > 1:
                assert spec.aggs[j] is not None, (prim.name, box)
                if agg is not None:
                    assert spec.aggs[j] == agg, (prim.name, box, spec.aggs[j])
                copies = max(copies, len(rs))
            full[box.relative_to(Box.full(t.shape))] = (
                rs[0] if len(rs) == 1 else finalize(spec.aggs[j], aggregate(spec.aggs[j], rs),
                                                    t.dtype))
        results.append(full)
    return results, copies


class SpecCheck(NamedTuple):
    decomps: int  # how many decompositions were checked
    copies: int  # the most partial results ⊕-aggregated into one output box


def check_specs(name, arrays, params=None, *, decomps=None, ps=(2, 3), whole=False, n=None,
                depth=1, agg=None, scale=None):
    """Every join-agg spec of primitive ``name`` recomposes to the whole-tensor kernel's
    result (Definition 3.7). ``decomps``: a list of interval dicts, a function of the
    indexing returning one, or None for ``even_decompositions(ix, ps, whole)``. ``n``: None
    compares exactly (splits that do not reorder any sum), else the accumulation length the
    split reorders (see :func:`tolerance`; ``depth`` chained ones). ``agg``: the ⊕ that repeated boxes
    must use. ``scale``: as :func:`assert_close`'s. Each spec has one function spec per
    combination of intervals."""
    params = {} if params is None else params
    arrays = [np.asarray(a) for a in arrays]
    prim = get_primitive(name)
    in_types = [TensorType(a.shape, as_dtype(a.dtype)) for a in arrays]
    out_types = prim.abstract(*in_types, **params)
    want = prim.impl(*arrays, **params)
    ix = prim.indexing(in_types, out_types, **params)
    if decomps is None:
        decomps = even_decompositions(ix, ps, whole)
    elif callable(decomps):
        decomps = decomps(ix)
    copies = 1
    for iv in decomps:
        spec = ix.spec(iv)
        expected_count = math.prod(len(iv.get(n, ((0, 0),))) for n in ix.extents)
        assert len(spec) == expected_count, (name, iv, len(spec))
        got, m = run_spec(prim, spec, arrays, out_types, params, agg)
        copies = max(copies, m)
        for g, w in zip(got, want):
            if n is None:
                np.testing.assert_array_equal(g, w, err_msg=f"{name} {iv}")
            else:
                assert_close(g, w, n=n, depth=depth, err_msg=f"{name} {iv}", scale=scale)
    return SpecCheck(len(decomps), copies)


# ----------------------------------------------------------------------------- distribution
# Plan on every device given (issue 38's device subsets off): at the suite's tiny shapes the
# DP would often run a whole program unsplit on one device, and a test that a distributed run
# equals the single-device one could then not fail from a distribution bug.
SPREAD = Tuning(device_subsets=False)


def assert_splits(lowered):
    """At least one eqn of the plan of ``lowered`` (a Lowered or a planned Compilation) is
    split over more than one device, so that a test of distribution fails when it silently
    stops distributing."""
    plan = lowered.plan
    assert any(r["splits"] for r in plan.table()), plan.pretty()


# ----------------------------------------------------------------------------- eager vs jit
def both(fn, *args):
    """``fn`` eagerly and under eins.jit: asserts the two agree in values and dtype and
    returns the result."""
    eager = np.asarray(fn(*args))
    jitted = np.asarray(eins.jit(fn)(*args))
    assert eager.dtype == jitted.dtype, (eager.dtype, jitted.dtype)
    np.testing.assert_array_equal(eager, jitted)
    return jitted


# ----------------------------------------------------------------------------- inputs
def rand(shape, dtype=np.float32, lo=-2.0, hi=2.0, seed=0, ints=(-5, 5)):
    """Seeded inputs: bools half True, integers uniform in ``ints`` (inclusive), floats
    uniform in [lo, hi)."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.5
    if np.dtype(dtype).kind == "i":
        return rng.integers(ints[0], ints[1] + 1, shape).astype(dtype)
    return rng.uniform(lo, hi, shape).astype(dtype)


def normal(shape, dtype, seed=0):
    """Seeded standard-normal inputs."""
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def torch_eps(dtype) -> float:
    """:func:`eps` of a torch (or numpy) dtype, for the Triton kernel tests."""
    from eins.kernels.build import numpy_dtype
    return eps(numpy_dtype(dtype))


# ----------------------------------------------------------------------------- workloads
def ffn(x, w1, b1, w2):
    # a size-1 broadcast operand (b1) and a scalar literal (0.5) on purpose
    h = eins.gelu(x @ w1 + b1, approximate=False)
    return (h * 0.5) @ w2 + x


def paper_workload(name) -> tuple:
    """(function, shape-only arguments) of the paper's block at workload ``name`` ("1x8K")."""
    wl = llama.WORKLOADS[name]
    return wl.function(llama.PAPER), wl(llama.PAPER)


def stream_stats(compiled, first, n) -> tuple:
    """``compiled``'s stats after the ``n``-th call of a stream of batches (``first``: the
    first call's, None on it), asserting that the stream traced and planned once,
    rebalanced every call and compiled no kernel after the first: -> (stats, first)."""
    st = compiled.stats()
    first = first or st
    assert (st["traces"], st["plans"], st["rebalances"]) == (1, 1, n)
    assert st["kernel_compiles"] == first["kernel_compiles"]
    return st, first


def input_arrays(*args) -> list:
    """A program's input arrays for a call: its arguments' leaves, dicts (the weights)
    flattened in the tracer's order."""
    return [np.asarray(a) for a in tree_flatten(list(args))[0]]


def packed_call(cfg, s, x, w, ends, max_segments=8) -> tuple:
    """The packed LLaMA block's arguments for one batch of ``s`` tokens whose documents end
    at ``ends``: the ends padded to ``max_segments`` (an int array, so every batch is the
    same trace) and RoPE tables restarting at each document."""
    e = llama.padded_ends(ends, max_segments, s)
    cos, sin = llama.rope_tables(s, cfg.head_dim, e)
    return (x, w, cos, sin, e)


def attention_gradient(s, seed) -> tuple:
    """A loss of packed attention (its output weighted by a fixed ``t``; 4 query heads on 2
    kv heads of dim 8, ``s`` rows, float64) and its value_and_grad with respect to q, k and
    v, the ends (6 at most) as data: -> (the gradient function, (q, k, v), t, (its forward
    eqn, its backward eqn)), the two eqns reading the ends."""
    rng = np.random.default_rng(seed)
    q, t = (rng.standard_normal((4, s, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, s, 8)) for _ in range(2))

    def f(q, k, v, e):
        return eins.sum(eins.attention(q, k, v, segments=e) * t)

    g = eins.value_and_grad(f, argnums=(0, 1, 2))
    e = llama.padded_ends((s,), 6, s)
    return g, (q, k, v), t, tuple(sorted(runtime_operands(eins.make_ir(g)(q, k, v, e))))


def batched_llama(p):
    """(fn, args, lowered) of the tiny LLaMA block batched (2 x 8, float32, no segments)
    distributed over p devices on the interpret backend: the workload of the tests of a
    batched attention's layout folds (tests/test_triton_fusion.py,
    tests/test_gpu_epilogues.py)."""
    cfg, rng = llama.TINY, np.random.default_rng(6)
    w = llama.init_weights(cfg, rng, "float32")
    x = (rng.standard_normal((2, 8, cfg.d_model)) / 2).astype(np.float32)
    cos, sin = llama.rope_tables(8, cfg.head_dim, None, dtype="float32")
    fn, args = llama.block_fn(cfg, None), (x, w, cos, sin)
    # on all p devices: with device subsets (the default) a block this small runs on one
    return fn, args, eins.distribute(fn, devices=p, backend="interpret",
                                     tuning=SPREAD).lower(*args)


def small_workloads(seed=0) -> dict:
    """name -> (fn, args) of the small programs the code-generation and GPU-runtime tests
    run at every p: the FFN, the LLaMA tiny block packed (segments 4, 12, 16) and batched
    (2 x 8), and chain B."""
    from eins.models import chains, llama
    rng = np.random.default_rng(seed)
    f32 = np.float32
    cfg = llama.TINY
    w = llama.init_weights(cfg, rng)
    segs = (4, 12, 16)
    x = rng.standard_normal((16, cfg.d_model)).astype(f32)
    cos, sin = llama.rope_tables(16, cfg.head_dim, segs)
    xb = rng.standard_normal((2, 8, cfg.d_model)).astype(f32)
    cb, sb = llama.rope_tables(8, cfg.head_dim, None)
    c = chains.chain("B", scale=1024)
    return {
        "ffn": (ffn, (rng.standard_normal((8, 16)).astype(f32),
                      rng.standard_normal((16, 24)).astype(f32),
                      rng.standard_normal(24).astype(f32),
                      rng.standard_normal((24, 16)).astype(f32))),
        "llama-packed": (llama.block_fn(cfg, segs), (x, w, cos, sin)),
        "llama-batched": (llama.block_fn(cfg, None), (xb, w, cb, sb)),
        "chainB": (c.fn, tuple(c.arrays())),
    }


def torch_llama_layer(x, w, cos, sin, mask, cfg):
    """One LLaMA layer in torch, written independently of eins/models/llama.py (HF LLaMA's
    rotate_half, repeat_interleave for the grouped heads): ``x`` [S, D], ``w`` the layer's
    weights by llama's names, ``mask`` [S, S] bool (True: attended). Also its rms norm."""
    import torch  # heavy: only the tests comparing with torch.autograd
    hq, hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    s = x.shape[0]

    def rot(a):
        return a * cos + torch.cat([-a[..., dh // 2:], a[..., :dh // 2]], -1) * sin

    xn = torch_rms(x, w["attn_norm"], cfg.eps)
    q = rot((xn @ w["wq"]).view(s, hq, dh).transpose(0, 1))
    k = rot((xn @ w["wk"]).view(s, hkv, dh).transpose(0, 1))
    v = (xn @ w["wv"]).view(s, hkv, dh).transpose(0, 1)
    k, v = (a.repeat_interleave(hq // hkv, 0) for a in (k, v))
    scores = (q @ k.transpose(1, 2) / math.sqrt(dh)).masked_fill(~mask, float("-inf"))
    h = x + (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, hq * dh) @ w["wo"]
    hn = torch_rms(h, w["ffn_norm"], cfg.eps)
    return h + (torch.nn.functional.silu(hn @ w["w1"]) * (hn @ w["w3"])) @ w["w2"]


def torch_rms(a, g, eps):
    """RMS norm in torch: g * a / sqrt(mean(a^2) + eps) over the last axis."""
    return g * a * (a.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
