"""A LLaMA decode step (issue 33 part 5): one new token per sequence against a KV cache,
the cache updated with ``.at[].set`` and read through a key-padding mask, equal to the block
run on each sequence's whole prefix (an independent numpy computation), distributed over 8
devices, and ``eins plan decode-8x32K``."""
import json

import numpy as np
import pytest

import eins
from eins.cli import main
from eins.errors import ShapeError
from eins.models import llama
from helpers import SPREAD, assert_close, assert_splits

CFG = llama.TINY


def _prefix_kv(x, w, cfg):
    """Keys and values of every token of ``x [S, d]`` (one sequence), numpy float64: rope'd
    keys [S, Hkv, dh] and values [S, Hkv, dh], as the block computes them."""
    f = np.float64
    xs = x.astype(f)
    xn = w["attn_norm"].astype(f) * xs / np.sqrt(np.mean(xs * xs, -1, keepdims=True) + cfg.eps)
    hkv, dh = cfg.n_kv_heads, cfg.head_dim
    cos, sin = llama.rope_tables(len(x), dh, dtype="float64")
    k = (xn @ w["wk"].astype(f)).reshape(len(x), hkv, dh)
    v = (xn @ w["wv"].astype(f)).reshape(len(x), hkv, dh)
    rot = np.concatenate([-k[..., dh // 2:], k[..., :dh // 2]], -1)
    return k * cos[:, None] + rot * sin[:, None], v


def _problem(lengths=(5, 0, 9), slots=12, seed=0):
    rng = np.random.default_rng(seed)
    w = llama.init_weights(CFG, rng, "float64")
    b = len(lengths)
    seqs = [rng.standard_normal((n + 1, CFG.d_model)) for n in lengths]
    # the caches hold each prefix's keys and values, and garbage past them
    ck = rng.standard_normal((b, slots, CFG.n_kv_heads, CFG.head_dim)) * 100
    cv = rng.standard_normal((b, slots, CFG.n_kv_heads, CFG.head_dim)) * 100
    for r, (n, s) in enumerate(zip(lengths, seqs)):
        k, v = _prefix_kv(s[:n], w, CFG) if n else (None, None)
        if n:
            ck[r, :n], cv[r, :n] = k, v
    x = np.stack([s[-1:] for s in seqs])                       # [B, 1, d]: the new tokens
    cos, sin = llama.rope_tables(max(lengths) + 1, CFG.head_dim, dtype="float64")
    ids = np.asarray(lengths, np.int64)
    args = (x, w, ck, cv, cos[ids], sin[ids], ids)
    want = np.stack([llama.reference_block(s, w, *llama.rope_tables(len(s), CFG.head_dim,
                                                                    dtype="float64"), CFG)[-1:]
                     for s in seqs])
    return args, want, seqs, w


def test_a_decode_step_equals_the_block_on_the_whole_prefix():
    args, want, seqs, w = _problem()
    out, ck, cv = eins.jit(llama.decode_fn(CFG))(*args)
    assert_close(out, want, n=CFG.d_ff, depth=6)
    # the new token's key and value sit at slot lengths[b]; the other slots are unchanged
    for r, s in enumerate(seqs):
        n = len(s) - 1
        k, v = _prefix_kv(s, w, CFG)
        assert_close(ck[r, n], k[n], n=CFG.d_model, depth=2)
        assert_close(cv[r, n], v[n], n=CFG.d_model, depth=2)
        keep = np.arange(ck.shape[1]) != n
        np.testing.assert_array_equal(ck[r, keep], args[2][r, keep])


def test_decode_distributed_over_8_devices_equals_one_device():
    args, want, _, _ = _problem(lengths=(3, 7, 0, 11, 4, 9, 1, 6), slots=16, seed=1)
    fn = llama.decode_fn(CFG)
    one = eins.jit(fn)(*args)
    low = eins.distribute(fn, devices=8, tuning=SPREAD).lower(*args)
    assert_splits(low)
    got = low.compile()(*args)
    for g, o in zip(got, one):
        assert_close(g, o, n=CFG.d_ff, depth=6)
    assert_close(got[0], want, n=CFG.d_ff, depth=6)
    assert low.predicted_time()["total_ms"] > 0


def test_decode_step_refuses_more_than_one_token():
    args = list(_problem()[0])
    args[0] = np.concatenate([args[0], args[0]], 1)
    with pytest.raises(ShapeError, match=r"x must be \[B, 1, 16\] \(one new token per sequence\), "
                                         r"got shape \(3, 2, 16\)"):
        eins.jit(llama.decode_fn(CFG))(*args)


def test_eins_plan_decode_workload(capsys):
    rc = main(["plan", "decode-8x32K", "--devices", "8", "--topology", "dgx-h100:8", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and not err
    got = json.loads(out)
    wl = llama.DECODE_WORKLOADS["decode-8x32K"]
    assert (wl.batch, wl.cache_len) == (8, 32768)
    low = eins.distribute(wl.function(llama.PAPER), devices=8,
                          topology="dgx-h100:8").lower(*wl(llama.PAPER))
    assert got["dp"]["total_ms"] == pytest.approx(low.predicted_time()["total_ms"], rel=1e-12)
    assert got["dp"]["fits"]
    att = [e for e in low.program.eqns if e.prim == "attention"]
    assert len(att) == 1 and att[0].inputs[0].type.shape == (8, 32, 1, 128)
    assert att[0].inputs[1].type.shape == (8, 8, 32768, 128) and att[0].params["mask"] == "keys"
