"""The Triton flash-attention kernel under Triton's interpreter (torch CPU tensors) against
eins's numpy reference kernel (eins/ops/attention.py) and an independent numpy
log-sum-exp. Tolerances follow the dtype: the kernel rounds the probabilities to the input
dtype before the PV product (as every flash kernel does) and the output once more."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from eins.kernels import (KernelUnavailable, attention, attention_source,  # noqa: E402
                                  combine_lse)
from eins.kernels.attention import attention_pairs  # noqa: E402
from eins.errors import DTypeError, GpuError, ShapeError  # noqa: E402
from eins.ir.joinagg import aggregate  # noqa: E402
from eins.ir.primitive import get_primitive  # noqa: E402
from eins.ops.attention_gpu import attention_gpu_partial, lse_join  # noqa: E402
from helpers import torch_eps  # noqa: E402

attention_impl = get_primitive("attention").impl  # the numpy reference kernel


def tol(dtype, ref):
    """Two roundings of a value of the output's magnitude (probabilities, then the output),
    plus float32 accumulation over the keys."""
    return 4 * torch_eps(dtype) * max(1.0, float(np.abs(ref).max())) + 1e-5


def qkv(b, hq, hkv, s, d, dtype, seed=0, sk=None):
    g = torch.Generator().manual_seed(seed)
    sk = s if sk is None else sk
    mk = lambda h, n: torch.randn(b, h, n, d, generator=g).to(dtype)  # noqa: E731
    return mk(hq, s), mk(hkv, sk), mk(hkv, sk)


def ref(q, k, v, **kw):
    f = lambda t: t.float().numpy()  # noqa: E731 - the same values, computed in fp32
    return attention_impl(f(q), f(k), f(v), scale=kw.pop("scale", None), **kw)[0]


def ref_lse(q, k, v, causal, segments, scale=None):
    """Row log-sum-exp of the masked scaled scores, written out independently."""
    q, k = q.double().numpy(), k.double().numpy()
    s_len, d = q.shape[-2], q.shape[-1]
    g = q.shape[-3] // k.shape[-3]
    k = np.repeat(k, g, axis=-3)
    sc = 1 / math.sqrt(d) if scale is None else scale
    s = np.einsum("bhid,bhjd->bhij", q, k) * sc
    pos = np.arange(s_len)
    seg = np.searchsorted(np.asarray(segments or (s_len,)), pos, side="right")
    ok = seg[:, None] == seg[None, :]
    if causal:
        ok &= pos[None, :] <= pos[:, None]
    s = np.where(ok, s, -np.inf)
    m = s.max(-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segments", [None, (9, 30, 37)])
def test_gqa_matches_reference(dtype, causal, segments):
    # 4 query heads on 2 kv heads, S=37 (not a multiple of the 32-row block), two batches
    q, k, v = qkv(2, 4, 2, 37, 16, dtype)
    out = attention(q, k, v, causal=causal, segments=segments)
    r = ref(q, k, v, causal=causal, segments=segments)
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_allclose(out.float().numpy(), r, atol=tol(dtype, r), rtol=0)


@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16),
                                     (128, torch.float16)])
def test_head_dims_64_and_128(d, dtype):
    q, k, v = qkv(1, 2, 1, 40, d, dtype, seed=1)
    out = attention(q, k, v, causal=True, segments=(17, 40), scale=0.1)
    r = ref(q, k, v, causal=True, segments=(17, 40), scale=0.1)
    np.testing.assert_allclose(out.float().numpy(), r, atol=tol(dtype, r), rtol=0)


def test_small_blocks_and_odd_head_dim():
    # D=24 is padded to a 32-wide block; 16-row blocks give 3 blocks with a ragged last one
    q, k, v = qkv(1, 3, 1, 41, 24, torch.float32, seed=2)
    out = attention(q, k, v, causal=True, segments=(5, 23, 41), config=(16, 16, 1, 1))
    r = ref(q, k, v, causal=True, segments=(5, 23, 41))
    np.testing.assert_allclose(out.numpy(), r, atol=tol(torch.float32, r), rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_lse_output(causal):
    q, k, v = qkv(1, 4, 2, 37, 16, torch.float32, seed=3)
    lse = torch.empty(1, 4, 37)
    attention(q, k, v, causal=causal, segments=(20, 37), lse=lse)
    np.testing.assert_allclose(lse.numpy(), ref_lse(q, k, v, causal, (20, 37)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("segments", [None, (21, 48)])
def test_key_split_pair_combines_to_the_whole(segments):
    """Two key blocks [0, 24) and [24, 48) at their global offsets, each with its lse,
    combined by ⊕ equal the whole attention and its lse."""
    q, k, v = qkv(1, 4, 2, 48, 16, torch.float32, seed=4)
    whole_lse = torch.empty(1, 4, 48)
    whole = attention(q, k, v, causal=True, segments=segments, lse=whole_lse)
    parts = []
    for lo, hi in ((0, 24), (24, 48)):
        lse = torch.empty(1, 4, 48)
        o = attention(q, k[..., lo:hi, :].contiguous(), v[..., lo:hi, :].contiguous(),
                      causal=True, segments=segments, lse=lse, k_offset=lo)
        parts += [o, lse]
    # rows 0..23 see no key of the second block: 0 output, lse -inf
    assert torch.all(parts[3][..., :24] == float("-inf"))
    assert torch.all(parts[2][..., :24, :] == 0)
    out, lse = torch.empty_like(whole), torch.empty_like(whole_lse)
    combine_lse(*parts, out, lse)
    np.testing.assert_allclose(out.numpy(), whole.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(lse.numpy(), whole_lse.numpy(), atol=1e-5, rtol=0)
    # in place into the first partial
    combine_lse(parts[0], parts[1], parts[2], parts[3], parts[0], parts[1])
    np.testing.assert_allclose(parts[0].numpy(), whole.numpy(), atol=1e-5, rtol=0)


def test_query_split_block_uses_global_positions():
    q, k, v = qkv(1, 2, 1, 48, 16, torch.float16, seed=5)
    whole = attention(q, k, v, causal=True, segments=(30, 48))
    lower = attention(q[..., 20:, :].contiguous(), k, v, causal=True, segments=(30, 48),
                      q_offset=20)
    assert torch.equal(lower, whole[..., 20:, :])


@pytest.mark.parametrize("offset", [14, 15, 30])
def test_query_block_offsets_just_below_a_key_block(offset):
    """Causal query blocks whose first row sits one or two positions before a 16-key block
    boundary: the unmasked middle key blocks must stop before the first row's first future
    key (row 14 must not see key 15), so the rows equal the whole attention's."""
    q, k, v = qkv(1, 2, 1, 48, 16, torch.float32, seed=8)
    whole = ref(q, k, v, causal=True, segments=None)
    part = attention(q[..., offset:, :].contiguous(), k, v, causal=True, q_offset=offset,
                     config=(16, 16, 1, 1))
    r = whole[..., offset:, :]
    np.testing.assert_allclose(part.numpy(), r, atol=tol(torch.float32, r), rtol=0)


def test_key_blocks_outside_the_segment_are_never_read():
    """Queries of the first segment with the second segment's keys set to NaN: the kernel
    must skip those key blocks entirely (a masked NaN inside a visited block would poison
    the PV product)."""
    q, k, v = qkv(1, 1, 1, 64, 16, torch.float32, seed=6)
    k2, v2 = k.clone(), v.clone()
    k2[..., 32:, :] = float("nan")
    v2[..., 32:, :] = float("nan")
    out = attention(q[..., :32, :].contiguous(), k2, v2, causal=False, segments=(32, 64),
                    config=(16, 16, 1, 1))
    r = ref(q, k, v, causal=False, segments=(32, 64))[..., :32, :]
    np.testing.assert_allclose(out.numpy(), r, atol=tol(torch.float32, r), rtol=0)


def test_batch_dims_flatten_and_out_argument():
    q, k, v = (t.reshape(2, 1, *t.shape[1:]) for t in qkv(2, 2, 2, 19, 16, torch.float32, 7))
    out = torch.full_like(q, 7.0)
    res = attention(q, k, v, out, causal=False)
    assert res is out
    r = ref(q, k, v, causal=False, segments=None)
    np.testing.assert_allclose(out.numpy(), r, atol=tol(torch.float32, r), rtol=0)


def test_source_is_specialized():
    src = attention_source(torch.float16, causal=True, segments=True, write_lse=True)
    assert "def attn_float16_causal_seg_lse(" in src and "ROW_LO" in src
    plain = attention_source(torch.float16, causal=False)
    assert "kpos[None, :] <= qpos" not in plain and "tl.store(LSE" not in plain


def test_bad_inputs_name_the_values():
    q, k, v = qkv(1, 3, 2, 8, 16, torch.float32)
    with pytest.raises(ShapeError, match="Hq=3"):
        attention(q, k, v)
    q, k, v = qkv(1, 2, 1, 8, 16, torch.float32)
    with pytest.raises(DTypeError, match="one dtype"):
        attention(q, k.half(), v)
    with pytest.raises(ShapeError, match=r"segments \(4, 6\) end at 6"):
        attention(q, k, v, segments=(4, 6))
    with pytest.raises(ShapeError, match="lse must be float32"):
        attention(q, k, v, lse=torch.empty(1, 2, 8, dtype=torch.float16))
    with pytest.raises(ShapeError, match="impl"):
        attention(q, k, v, impl="xformers")
    with pytest.raises(KernelUnavailable, match="not on a GPU"):
        attention(q, k, v, impl="flash_attn")
    with pytest.raises(KernelUnavailable, match=r"\['cpu', 'meta'\]"):
        attention(q, k, v, torch.empty_like(q, device="meta"))


def test_random_blocks_of_random_segmentations():
    """Random lengths, segment ends, causal flags, query blocks [a, b) and key splits at c:
    the two key partials of the query block, combined, equal those rows of the whole
    reference (offsets, masks, block skipping and unmasked middle blocks all exercised)."""
    rng = np.random.default_rng(11)
    for case in range(5):
        s = int(rng.integers(20, 70))
        cuts = sorted(set(int(c) for c in rng.integers(1, s, size=int(rng.integers(0, 4)))))
        segments = tuple(cuts) + (s,) if cuts else None
        causal = bool(case % 2)
        a = int(rng.integers(0, s - 1))
        b = int(rng.integers(a + 1, s + 1))
        c = int(rng.integers(1, s))
        q, k, v = qkv(1, 2, 1, s, 16, torch.float32, seed=100 + case)
        whole = ref(q, k, v, causal=causal, segments=segments)[..., a:b, :]
        qb = q[..., a:b, :].contiguous()
        parts = []
        for lo, hi in ((0, c), (c, s)):
            lse = torch.empty(1, 2, b - a)
            o = attention(qb, k[..., lo:hi, :].contiguous(), v[..., lo:hi, :].contiguous(),
                          causal=causal, segments=segments, lse=lse, q_offset=a, k_offset=lo,
                          config=(16, 16, 1, 1))
            parts += [o, lse]
        out, lse = torch.empty_like(qb), torch.empty(1, 2, b - a)
        combine_lse(*parts, out, lse)
        np.testing.assert_allclose(out.numpy(), whole, atol=tol(torch.float32, whole), rtol=0,
                                   err_msg=f"S={s} segments={segments} causal={causal} "
                                           f"q=[{a},{b}) split={c}")


def test_flash_attn_cu_seqlens_cover_every_batch_row():
    from eins.kernels import flash
    cu, longest = flash.cu_seqlens((3, 8), batch=2, s=8, device="cpu")
    assert cu.tolist() == [0, 3, 8, 11, 16] and longest == 5
    q = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    assert flash.why_not(q, q, None, 0, 0) == "tensors are not on a GPU"


def test_flash_attn_varlen_path_layout(monkeypatch):
    """The flash-attn path's layout (tokens [B*S, H, D], cu_seqlens over batch x segments,
    the result written back to [B, H, S, D]) against the reference, with a stand-in for
    flash_attn_varlen_func that attends each cu_seqlens range with the numpy kernel."""
    from types import SimpleNamespace

    from eins.kernels import flash
    calls = []

    def varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout, softmax_scale, causal):
        calls.append((cu_q.tolist(), max_q, causal))
        out = torch.empty_like(q)
        for lo, hi in zip(cu_q.tolist()[:-1], cu_q.tolist()[1:]):
            f = lambda t: t[lo:hi].transpose(0, 1).float().numpy()  # noqa: E731 [H, L, D]
            o = attention_impl(f(q), f(k), f(v), causal=causal, segments=None,
                               scale=softmax_scale)[0]
            out[lo:hi] = torch.from_numpy(o).transpose(0, 1).to(q.dtype)
        return out
    monkeypatch.setattr(flash, "flash_attn_module",
                        lambda: SimpleNamespace(flash_attn_varlen_func=varlen_func))
    monkeypatch.setattr(flash, "why_not", lambda *a: None)
    q, k, v = qkv(2, 4, 2, 12, 16, torch.float16, seed=9)
    out = attention(q, k, v, causal=True, segments=(5, 12))
    assert calls == [([0, 5, 12, 17, 24], 7, True)]
    r = ref(q, k, v, causal=True, segments=(5, 12))
    np.testing.assert_allclose(out.float().numpy(), r, atol=tol(torch.float16, r), rtol=0)
    # impl="triton" never takes it
    attention(q, k, v, causal=True, segments=(5, 12), impl="triton")
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pairs_layout_is_the_partial_with_its_lse(dtype):
    """attention_pairs writes a key block's partial straight into the device IR's (o, lse)
    pair layout (float32, a trailing axis of 2, lse repeated over the head dim): the same
    values as the (o, lse) launcher, query and key blocks at global offsets, causal, packed
    segments, grouped-query heads; rows that see no key of the block are (0, -inf)."""
    q, k, v = qkv(2, 4, 2, 40, 8, dtype, seed=7)
    segments = (13, 40)
    qs, ks = slice(8, 40), slice(16, 29)   # query rows 8..39 with keys 16..28
    qb = q[..., qs, :].contiguous()
    kb, vb = k[..., ks, :].contiguous(), v[..., ks, :].contiguous()
    kw = dict(causal=True, segments=segments, q_offset=8, k_offset=16)
    pairs = torch.full(tuple(qb.shape) + (2,), float("nan"))
    attention_pairs(qb, kb, vb, pairs, **kw)
    o, lse = torch.empty(qb.shape), torch.empty(qb.shape[:-1])
    attention(qb, kb, vb, o, lse=lse, impl="triton", **kw)
    assert torch.equal(pairs[..., 0], o)
    assert torch.equal(pairs[..., 1], lse[..., None].expand(o.shape))
    # independent check of the lse: rows 8..15 see none of keys 16..28 (causal)
    assert torch.all(pairs[..., :8, :, 1] == float("-inf"))
    assert torch.all(pairs[..., :8, :, 0] == 0)
    # rows 16..39 against an independent float64 lse over keys 16..28 alone
    rows = range(16, 40)
    np.testing.assert_allclose(pairs[..., [r - 8 for r in rows], 0, 1].numpy(),
                               _lse_over(q, k, rows, range(16, 29), segments),
                               atol=1e-4, rtol=0)


def _lse_over(q, k, rows, keys, segments):
    """The causal, segment-masked row log-sum-exp of ``rows`` over ``keys`` only (float64)."""
    qd, kd = q.double().numpy(), np.repeat(k.double().numpy(), q.shape[1] // k.shape[1], 1)
    ends = np.asarray(segments)
    out = np.empty(qd.shape[:2] + (len(rows),))
    for i, r in enumerate(rows):
        ks = [j for j in keys if j <= r and np.searchsorted(ends, j, side="right") ==
              np.searchsorted(ends, r, side="right")]
        s = np.einsum("bhd,bhjd->bhj", qd[:, :, r], kd[:, :, ks]) / math.sqrt(q.shape[-1])
        m = s.max(-1, keepdims=True)
        out[..., i] = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    return out


def test_pairs_bad_buffers_are_named():
    q, k, v = qkv(1, 2, 1, 8, 4, torch.float32)
    with pytest.raises(ShapeError, match=r"float32 \(1, 2, 8, 4, 2\), got \(1, 2, 8, 4\)"):
        attention_pairs(q, k, v, torch.empty(1, 2, 8, 4))
    with pytest.raises(ShapeError, match="torch.float16"):
        attention_pairs(q, k, v, torch.empty(1, 2, 8, 4, 2, dtype=torch.float16))
    with pytest.raises(ShapeError, match="contiguous"):
        attention_pairs(q, k, v, torch.empty(1, 2, 8, 2, 4).transpose(-1, -2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_running_pairs_start_the_softmax_of_the_next_keys(dtype, causal):
    """A pipelined piece (eins/passes/pipeline.py): the kernel starts its online softmax
    from the running (o, lse) pairs of the keys before, into pairs again or finalized: the
    pieces in any order equal the whole attention; rows no piece so far saw (causal, other
    segments) stay (0, -inf) until one does."""
    q, k, v = qkv(2, 4, 2, 40, 8, dtype, seed=3)
    kw = dict(causal=causal, segments=(13, 40))
    want = ref(q, k, v, **kw)
    for order in ([(24, 40), (0, 11), (11, 24)], [(0, 11), (11, 24), (24, 40)]):
        run = None
        for lo, hi in order[:-1]:
            nxt = torch.full(tuple(q.shape) + (2,), float("nan"))
            attention_pairs(q, k[..., lo:hi, :], v[..., lo:hi, :], nxt, k_offset=lo,
                            running=run, **kw)
            run = nxt
        lo, hi = order[-1]
        out = torch.empty(q.shape, dtype=dtype)
        attention(q, k[..., lo:hi, :], v[..., lo:hi, :], out, k_offset=lo, running=run,
                  **kw)
        np.testing.assert_allclose(out.float().numpy(), want, atol=tol(dtype, want), rtol=0)
    # causal, keys 24..39 alone: rows 0..23 see none of them, (0, -inf)
    if causal:
        first = torch.empty(tuple(q.shape) + (2,))
        attention_pairs(q, k[..., 24:, :], v[..., 24:, :], first, k_offset=24, **kw)
        assert torch.all(first[..., :24, :, 1] == float("-inf"))
        assert torch.all(first[..., :24, :, 0] == 0)


def test_running_pairs_bad_buffers_and_impls_are_named():
    q, k, v = qkv(1, 2, 1, 8, 4, torch.float32)
    with pytest.raises(ShapeError, match=r"running pairs must be contiguous float32 "
                                         r"\(1, 2, 8, 4, 2\) on cpu, got \(1, 2, 8, 4\)"):
        attention(q, k, v, running=torch.zeros(1, 2, 8, 4))
    with pytest.raises(ShapeError, match="running pairs go with neither a row table"):
        attention(q, k, v, running=torch.zeros(1, 2, 8, 4, 2), lse=torch.zeros(1, 2, 8))
    with pytest.raises(GpuError, match=r"running pairs join into a pair buffer alone"):
        attention_gpu_partial(None, [torch.empty(1, 2, 8, 4), torch.empty(1, 2, 8)],
                              [q, k, v], running=torch.zeros(1, 2, 8, 4, 2))
    with pytest.raises(KernelUnavailable, match="sdpa does not apply here: running pairs"):
        attention(q, k, v, running=torch.zeros(1, 2, 8, 4, 2), impl="sdpa")


def test_the_fallbacks_join_is_the_reference_lse_combine():
    """attention's torch fallback joins a piece's running pairs as eins.ir.joinagg's
    reference ⊕ does: rows neither side saw (0, -inf), a nan lse kept nan (review65)."""
    pair = np.dtype([("o", np.float32), ("lse", np.float32)])
    a, b = np.zeros((5, 3), pair), np.zeros((5, 3), pair)
    a["o"] = np.arange(15, dtype=np.float32).reshape(5, 3)
    b["o"] = -1.5
    a["lse"] = np.array([0.5, -np.inf, -np.inf, np.nan, 2.0], np.float32)[:, None]
    b["lse"] = np.array([1.0, 0.25, -np.inf, 1.0, -np.inf], np.float32)[:, None]
    a["o"][2] = np.nan   # a side with no visible key: its o is never read
    want = aggregate("lse", [a, b])
    o, lse = lse_join(*(torch.from_numpy(np.ascontiguousarray(x[f])) if f == "o" else
                        torch.from_numpy(np.ascontiguousarray(x[f][:, 0]))
                        for x in (a, b) for f in ("o", "lse")))
    np.testing.assert_allclose(o.numpy(), want["o"], rtol=1e-6, atol=0)
    np.testing.assert_array_equal(lse.numpy(), want["lse"][:, 0])
