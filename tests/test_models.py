"""The workloads: the LLaMA block against an independent numpy implementation written here from
the math (float64, explicit per-head loops and masks), and the matrix chains A–E."""
import math
import re

import numpy as np
import pytest

import eins
from eins.errors import EinsError, ShapeError
from eins.models import chains, llama
from eins.models.llama import LlamaConfig
from helpers import accumulation, assert_close


# ----------------------------------------------------------------------------- reference
def ref_rms_norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def ref_positions(seq, segments):
    """Position of each token inside its own packed sequence."""
    ends = segments or (seq,)
    pos, seg = np.zeros(seq, int), np.zeros(seq, int)
    start = 0
    for s_id, end in enumerate(ends):
        for t in range(start, end):
            pos[t], seg[t] = t - start, s_id
        start = end
    return pos, seg


def ref_rope(x, pos, base):
    """Rotate pair (i, i + D/2) of every head vector by pos * base**(-2i/D) (LLaMA/HF form)."""
    d = x.shape[-1]
    h = d // 2
    out = np.empty_like(x)
    for i in range(h):
        theta = pos * base ** (-2.0 * i / d)          # [S]
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]   # against [..., S, 1]
        a, b = x[..., i:i + 1], x[..., i + h:i + h + 1]
        out[..., i:i + 1] = a * c - b * s
        out[..., i + h:i + h + 1] = b * c + a * s
    return out


def ref_attention(q, k, v, seg):
    """q [Hq, S, D], k/v [Hkv, S, D]: causal, within-segment, grouped-query attention."""
    hq, s, d = q.shape
    group = hq // k.shape[0]
    allowed = np.array([[j <= i and seg[i] == seg[j] for j in range(s)] for i in range(s)])
    out = np.empty_like(q)
    for h in range(hq):
        g = h // group
        scores = q[h] @ k[g].T / math.sqrt(d)
        scores = np.where(allowed, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[h] = p @ v[g]
    return out


def ref_block_one(x, w, cfg, segments=None):
    """x [S, d_model], float64."""
    s = x.shape[0]
    pos, seg = ref_positions(s, segments)
    hq, hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    xn = ref_rms_norm(x, w["attn_norm"], cfg.eps)
    q = (xn @ w["wq"]).reshape(s, hq, dh).transpose(1, 0, 2)
    k = (xn @ w["wk"]).reshape(s, hkv, dh).transpose(1, 0, 2)
    v = (xn @ w["wv"]).reshape(s, hkv, dh).transpose(1, 0, 2)
    q, k = ref_rope(q, pos, cfg.rope_base), ref_rope(k, pos, cfg.rope_base)
    a = ref_attention(q, k, v, seg).transpose(1, 0, 2).reshape(s, hq * dh)
    h = x + a @ w["wo"]
    hn = ref_rms_norm(h, w["ffn_norm"], cfg.eps)
    g = hn @ w["w1"]
    return h + ((g / (1 + np.exp(-g))) * (hn @ w["w3"])) @ w["w2"]


def ref_block(x, w, cfg, segments=None):
    x = x.astype(np.float64)
    w = {k: v.astype(np.float64) for k, v in w.items()}
    if x.ndim == 3:
        return np.stack([ref_block_one(xb, w, cfg, segments) for xb in x])
    return ref_block_one(x, w, cfg, segments)


CFG = LlamaConfig(d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24)


def _data(cfg, shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(dtype), llama.init_weights(cfg, rng, dtype)


def _run(cfg, x, w, segments=None, dtype="float32"):
    s = x.shape[-2]
    cos, sin = llama.rope_tables(s, cfg.head_dim, segments, cfg.rope_base, dtype)
    return eins.jit(llama.block_fn(cfg, segments))(x, w, cos, sin)


def close_block(got, want, cfg, x, w, segments=None, dtype="float32"):
    """``got`` is the block's result within the tolerance of its longest accumulation and the
    number of accumulations it chains (read off the traced block)."""
    cos, sin = llama.rope_tables(x.shape[-2], cfg.head_dim, segments, cfg.rope_base, dtype)
    n, depth = accumulation(eins.make_ir(llama.block_fn(cfg, segments))(x, w, cos, sin))
    assert_close(got, want, n=n, depth=depth)


# ----------------------------------------------------------------------------- llama
def test_rope_tables_restart_positions_per_segment():
    cos, sin = llama.rope_tables(7, 4, segments=(3, 7), base=100.0)
    pos = np.array([0, 1, 2, 0, 1, 2, 3], float)
    # column i and i + D/2 share the angle pos * base**(-2i/D)
    for i, f in enumerate([1.0, 100.0 ** -0.5]):
        # one product and one libm call each, rounded to the tables' float32: a few eps
        assert_close(cos[:, i], np.cos(pos * f), n=4, dtype=cos.dtype)
        assert_close(cos[:, i + 2], np.cos(pos * f), n=4, dtype=cos.dtype)
        assert_close(sin[:, i + 2], np.sin(pos * f), n=4, dtype=sin.dtype)


def test_block_single_sequence_matches_reference():
    x, w = _data(CFG, (9, CFG.d_model))
    y = _run(CFG, x, w)
    assert y.shape == x.shape and y.dtype == np.float32
    close_block(y, ref_block(x, w, CFG), CFG, x, w)


def test_block_packed_segments_matches_reference():
    x, w = _data(CFG, (10, CFG.d_model), seed=1)
    segs = (3, 7, 10)
    y = _run(CFG, x, w, segs)
    close_block(y, ref_block(x, w, CFG, segs), CFG, x, w, segs)
    # the segments matter: without them the result differs
    assert not np.allclose(y, ref_block(x, w, CFG), rtol=1e-3, atol=1e-3)


def test_block_batch_dim_matches_reference_and_packing():
    x, w = _data(CFG, (3, 5, CFG.d_model), seed=2)
    y = _run(CFG, x, w)
    assert y.shape == (3, 5, CFG.d_model)
    close_block(y, ref_block(x, w, CFG), CFG, x, w)
    # three sequences packed end to end with segments give the same tokens
    packed = _run(CFG, x.reshape(15, CFG.d_model), w, (5, 10, 15))
    close_block(packed.reshape(3, 5, -1), y, CFG, x, w)


def test_block_gqa_uses_kv_head_of_the_group():
    # 8 query heads on 2 kv heads: group of 4 (the paper's 32/8 ratio)
    cfg = LlamaConfig(d_model=32, n_heads=8, n_kv_heads=2, head_dim=4, d_ff=16)
    x, w = _data(cfg, (6, 32), seed=3)
    close_block(_run(cfg, x, w), ref_block(x, w, cfg), cfg, x, w)


def test_block_float16():
    x, w = _data(CFG, (8, CFG.d_model), np.float16, seed=4)
    y = _run(CFG, x, w, dtype="float16")
    assert y.dtype == np.float16
    close_block(y, ref_block(x, w, CFG), CFG, x, w, dtype="float16")


def test_paper_config_and_weight_shapes():
    c = llama.PAPER
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (4096, 32, 8, 128, 14336)
    ws = llama.weight_shapes(c, "float16")
    assert ws["wq"].shape == (4096, 4096) and ws["wk"].shape == (4096, 1024)
    assert ws["w1"].shape == (4096, 14336) and ws["w2"].shape == (14336, 4096)
    assert all(s.dtype == np.float16 for s in ws.values())


def test_workloads_trace_at_paper_size():
    expect = {"1x1K": ((1024, 4096), None), "1x8K": ((8192, 4096), None),
              "1x128K": ((131072, 4096), None),
              "8x1K": ((8192, 4096), tuple(range(1024, 8193, 1024))),
              "128x1K": ((131072, 4096), tuple(range(1024, 131073, 1024))),
              "8x1K-batch": ((8, 1024, 4096), None), "128x1K-batch": ((128, 1024, 4096), None)}
    assert set(llama.WORKLOADS) == set(expect)
    for name, (xshape, segs) in expect.items():
        wl = llama.WORKLOADS[name]
        assert wl.segments == segs, name
        args = wl(llama.PAPER)
        assert args[0].dtype == np.float16 and args[2].shape == (xshape[-2], 128)
        prog = eins.make_ir(wl.function(llama.PAPER))(*args)
        assert prog.inputs[0].shape == xshape, name
        assert prog.outputs[0].shape == xshape and prog.outputs[0].dtype == np.float16, name
        att = [e for e in prog.eqns if e.prim == "attention"]
        assert len(att) == 1 and att[0].params["segments"] == segs, name
        assert att[0].inputs[0].shape[-3:] == (32, xshape[-2], 128), name
        assert att[0].inputs[1].shape[-3:] == (8, xshape[-2], 128), name


def test_block_errors():
    x, w = _data(CFG, (4, CFG.d_model))
    cos, sin = llama.rope_tables(4, CFG.head_dim)
    with pytest.raises(ShapeError, match=r"\[S, 16\].*\(4, 8\)"):
        llama.block(x[:, :8], w, cos, sin, CFG)
    with pytest.raises(EinsError, match="lack.*'w3'"):
        llama.block(x, {k: v for k, v in w.items() if k != "w3"}, cos, sin, CFG)
    with pytest.raises(EinsError, match="n_heads=6 must be a multiple of n_kv_heads=4"):
        LlamaConfig(n_heads=6, n_kv_heads=4)
    with pytest.raises(ShapeError, match="ending at seq=5"):
        llama.rope_tables(5, 4, segments=(2, 4))


# ----------------------------------------------------------------------------- chains
ISSUE_CHAINS = {
    "A": ((10240,) + (16384, 6144) * 4 + (10240,), "((M1 M2)((M3 M4)((M5 M6)(M7 M8))))M9"),
    "B": ((9216, 20480, 5120, 20480, 5120, 9216), "(M1 M2)((M3 M4) M5)"),
    "C": ((10240, 12288, 32768, 2048), "M1(M2 M3)"),
    "D": ((24576, 1536) + (20480,) * 6 + (1536, 24576), "(M1(M2(M3(M4(M5(M6(M7 M8)))))))M9"),
    "E": ((49152, 1024) + (20480,) * 10 + (1024, 49152),
          "(M1(M2(M3(M4(M5(M6(M7(M8(M9(M10(M11 M12)))))))))))M13"),
}


def _nospace(s):
    return s.replace(" ", "")


@pytest.mark.parametrize("name", list(ISSUE_CHAINS))
def test_chain_dims_and_parenthesization(name):
    dims, paren = ISSUE_CHAINS[name]
    c = chains.chain(name)
    assert c.dims == dims
    assert _nospace(chains.format_tree(c.tree)) == _nospace(paren)


@pytest.mark.parametrize("name", list(ISSUE_CHAINS))
def test_chain_scaled_matches_numpy_and_order(name):
    c = chains.chain(name, scale=1024)
    assert c.dims == tuple(max(1, d // 1024) for d in ISSUE_CHAINS[name][0])
    ms = c.arrays(np.random.default_rng(5), "float64")
    y = eins.jit(c.fn)(*ms)
    expect = ms[0]
    for m in ms[1:]:
        expect = expect @ m
    assert_close(y, expect, n=max(c.dims), depth=c.n - 1)
    # the IR multiplies in the fixed order: replay its eqns as a tree over input numbers
    prog = eins.make_ir(c.fn)(*c.shape_args("float16"))
    assert [e.prim for e in prog.eqns] == ["matmul"] * (c.n - 1)
    node = {id(v): i + 1 for i, v in enumerate(prog.inputs)}
    for e in prog.eqns:
        node[id(e.outputs[0])] = (node[id(e.inputs[0])], node[id(e.inputs[1])])
    assert node[id(prog.outputs[0])] == c.tree


def test_chain_paper_size_traces_and_counts_flops():
    c = chains.chain("C")
    prog = eins.make_ir(c.fn)(*c.shape_args())
    assert prog.outputs[0].shape == (10240, 2048)
    # M2 M3 first (12288x32768x2048), then M1 times it (10240x12288x2048)
    assert c.matmul_flops() == 2 * (12288 * 32768 * 2048 + 10240 * 12288 * 2048)


def test_chain_errors():
    with pytest.raises(EinsError, match="unknown matrix chain 'F'"):
        chains.chain("F")
    with pytest.raises(EinsError, match="positive int, got 0"):
        chains.chain("A", scale=0)
    with pytest.raises(EinsError, match="multiplies 3 matrices, got 2"):
        chains.chain("C").fn(np.eye(2), np.eye(2))


def test_reference_block_of_the_module_agrees_with_this_test():
    # llama.reference_block is what the demo checks against; it must agree with the
    # independent implementation above (packed and batched)
    x, w = _data(CFG, (2, 7, CFG.d_model), seed=6)
    cos, sin = llama.rope_tables(7, CFG.head_dim, (3, 7), dtype="float64")
    got = llama.reference_block(x, w, cos, sin, CFG, (3, 7))
    close_block(got, ref_block(x, w, CFG, (3, 7)), CFG, x, w, (3, 7), "float64")


# ----------------------------------------------------------------------------- demo, examples
def test_demo_traces_prints_runs_and_checks(capsys):
    from eins import demo
    assert demo.run(None) == 0
    out = capsys.readouterr().out
    assert "attention[causal=True scale=None segments=(5,16)]" in out
    assert "-> OK" in out
    split = re.search(r"^(\d+) of \d+ eqns split over the devices$", out, re.M)
    assert split and int(split.group(1)) > 0, out   # the 8-device run is distributed
    # the check can fail: a wrong reference is reported as a mismatch
    p = demo.make_problem()
    assert not demo.check("wrong", demo.run_step(p), demo.reference(p) + 1e-2, demo.trace_step(p))
    assert demo.check("right", demo.run_step(p), demo.reference(p), demo.trace_step(p))


@pytest.mark.parametrize("script", ["ffn.py", "llama_block.py", "chains.py",
                                    "compare_plans.py 1x1K"])
def test_examples_run(script):
    """Each example runs as README and docs/machines.md say (`.venv/bin/python examples/X`:
    this interpreter, eins importable from this checkout); compare_plans on its smallest
    workload only, to keep the suite fast."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script, *argv = script.split()
    r = subprocess.run([sys.executable, os.path.join(root, "examples", script), *argv],
                       env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # each example prints what it shows


# ------------------------------------------- found by a bug hunt of eins.models (each raw)
@pytest.mark.parametrize("call, match", [
    (lambda: llama.Workload("z", 2, 8)("PAPER"), "expected a LlamaConfig"),
    (lambda: llama.weight_shapes("TINY"), r"llama.weight_shapes: expected a LlamaConfig"),
    (lambda: llama.init_weights("TINY"), "expected a LlamaConfig"),
    (lambda: llama.rope_tables(8, 4, 8), r"rope_tables: segments must be a sequence of int"),
    (lambda: llama.rope_tables(0, 4), r"rope_tables: seq must be a positive int, got 0"),
    (lambda: llama.block_fn(llama.TINY, "ab"), r"llama.block_fn: segments must be a sequence"),
    (lambda: llama.Workload("z", 0, 1024), r"Workload 'z': n_seqs must be a positive int, "
                                           r"got 0"),
    (lambda: llama.Workload("z", 2, -8), r"seq_len must be a positive int, got -8"),
    (lambda: llama.Workload("z", 2, 8, packed="yes"), r"packed must be True or False"),
    (lambda: LlamaConfig(d_model=True), r"LlamaConfig.d_model must be a positive int, got "
                                        r"True"),
    (lambda: LlamaConfig(rope_base=0), r"LlamaConfig.rope_base must be a positive finite "
                                       r"number, got 0"),   # gave NaN outputs
    (lambda: LlamaConfig(eps=-1e-5), r"LlamaConfig.eps must be a positive finite number"),
])
def test_bad_model_arguments_are_named(call, match):
    with pytest.raises(EinsError, match=match):
        call()


def test_megatron_row_splits_w2_by_what_it_reads_not_its_shape():
    """With d_ff == d_model, w2's shape is w1's: the shape test split w2 by columns (k),
    which is not Megatron's row split (j, partial sums ⊕-aggregated)."""
    from eins.models import strategies
    cfg = LlamaConfig(d_model=32, n_heads=4, n_kv_heads=4, head_dim=8, d_ff=32)
    wl = llama.WORKLOADS["1x1K"]
    prog = eins.make_ir(wl.function(cfg))(*wl(cfg))
    plan = strategies.megatron(prog, 4)
    names = {id(v): k for k, v in zip(sorted(llama.weight_shapes(cfg)), prog.inputs[1:10])}
    by_weight = {names[id(prog.eqns[i].inputs[1])]: split for i, split in plan.items()
                 if prog.eqns[i].prim == "matmul"}
    assert by_weight == {"wq": {"k": 4}, "wk": {"k": 4}, "wv": {"k": 4}, "wo": {"j": 4},
                         "w1": {"k": 4}, "w3": {"k": 4}, "w2": {"j": 4}}


def test_a_strategy_the_workload_cannot_express_is_none():
    from eins.models import strategies
    wl = llama.WORKLOADS["1x1K"]
    prog = eins.make_ir(wl.function(llama.TINY))(*wl(llama.TINY))   # 8 tokens, 2 kv heads
    for name, strategy in strategies.LLAMA_STRATEGIES.items():
        assert strategy(prog, 10 ** 6) is None, name   # more pieces than any index has
        assert (strategy(prog, 2) is None) == (name == "batch parallel"), name   # no batch
    assert strategies.megatron(prog, 4) is None   # projections split 4 ways, 2 kv heads not
    assert strategies.ulysses(prog, 4) is None
    S = eins.ShapeDtype
    one = eins.make_ir(lambda x, w: x @ w)(S((1, 6)), S((6, 8)))
    assert strategies.megatron(one, 2) == {0: {"j": 2}}   # reads a program input: a row split
    assert strategies.row_sharding(one, 2) is None        # one row
    assert strategies.matmul_3d(one, 7) is None           # not a cube
    assert strategies.matmul_3d(one, 8) is None           # the one row cannot split 2 ways
    assert strategies.matmul_3d(eins.make_ir(lambda x, w: x @ w)(S((2, 6)), S((6, 8))), 8) == {
        0: {"i": 2, "j": 2, "k": 2}}


def test_model_arguments_take_numpys_numbers():
    # the validations first refused what had worked: numpy ints/floats/bools, whole floats
    cfg = LlamaConfig(d_model=np.int64(16), n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
                      eps=np.float32(1e-5), rope_base=np.int64(500000))
    assert type(cfg.d_model) is int and cfg.rope_base == 500000.0
    wl = llama.Workload("w", np.int64(2), np.int64(8), packed=np.True_)
    assert (wl.n_seqs, wl.seq_len, wl.packed) == (2, 8, True) and wl.segments == (8, 16)
    cos, _ = llama.rope_tables(np.int64(8), 4, np.array([4.0, 8.0]))
    assert cos.shape == (8, 4)
    fn = llama.block_fn(llama.TINY, np.array([4.0, 8.0]))
    args = llama.WORKLOADS["1x1K"](llama.TINY)
    x = eins.ShapeDtype((8, 16), "float16")
    assert eins.make_ir(fn)(x, args[1], eins.ShapeDtype((8, 4), "float16"),
                            eins.ShapeDtype((8, 4), "float16")).eqns
    with pytest.raises(ShapeError, match="segments must be a sequence of int"):
        llama.block_fn(llama.TINY, [4.5, 8.0])
