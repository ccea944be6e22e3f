"""Grouped-query attention (FlashAttention-style, one primitive) with causal masking and
packed sequences.

``attention(q, k, v, causal=True, segments=None, scale=None)``: q ``[..., Hq, S, D]``, k and v
``[..., Hkv, S, D]`` with ``Hq % Hkv == 0``; query heads ``g*G .. (g+1)*G - 1`` (``G =
Hq/Hkv``) use key/value head g. ``segments`` is a static tuple of packed-sequence END
positions (the last one is S); a token attends only to tokens of its own segment (and only to
earlier ones when ``causal``). The softmax runs in float32 (float64 for float64 inputs).

Join-agg specs (Section 3.3, Example 3.10) come from a custom producer, not a Signature,
because q's head interval is derived from heads_kv's and the key rows from the query rows.
Named indices, in this order (which fixes the order of the function specifications):
- leading batch dims: shardable ``any``;
- ``heads_kv``: shardable ``any``; an interval [a, b) of kv heads takes query heads
  [a*G, b*G) of q and of the output (heads_q is not an index of its own);
- ``sequence`` (the query rows; q and the output): shardable ``any``. A block of query rows
  [lo, hi) reads the key/value rows it attends to (``attention_blocks.needed_keys``): from
  the start of lo's segment to hi when causal, to the end of the segment of row hi-1 when
  not. Cuts at segment ends give blocks of whole segments that need no other tokens (the
  only sequence split before). No ⊕: the output blocks tile the output.
- ``kv_sequence`` (the key rows of k and v): shardable ``any``; split, it is contracted:
  a function specification computes each query row's attention over its key interval alone
  (``partial_impl``), as (o, lse) pairs, and the spec's ⊕ is ``lse`` (eins.ir.joinagg):
  (o1, l1) ⊕ (o2, l2) = ((w1 o1 + w2 o2)/(w1 + w2), m + log(w1 + w2)), m = max(l1, l2),
  w = exp(l - m); associative and commutative, exact (the softmax of a union of disjoint
  key sets), identity (0, -inf) for a row that sees none of the keys. The full aggregate is
  finalized to the output dtype (its ``o``). With both sequence indices split, a block reads
  the keys of its interval that its query rows need (all of the interval if none).
- ``head_dim``: never (the scores contract it inside the kernel).
Unsplit, the spec and the kernel are those of the whole tensor (no lse, no pairs).

Decisions:
- **Causal balance by cut position, not zig-zag.** The enumerator splits ``sequence`` into
  contiguous intervals of near-equal *work* (``Indexing.balance``: visible keys per row,
  ``attention_blocks.work_cuts``; each piece off by at most one row's work), e.g. causal
  p=4 cuts at S*sqrt(k/4). Zig-zag (device d takes chunks d and 2p-1-d) would need two
  function specifications per device, which Definition 3.6 (one per processor), the DP's
  piece count, placement and the per-eqn kernel time (max over function specifications)
  do not model; equal-work contiguous cuts balance the attention as well with one box per
  device. The price: blocks hold unequal numbers of rows (causal, p=8, one sequence: 35%
  of S on the first device, 6.5% on the last), so a consumer split evenly by rows
  repartitions the output. With packed segments, the cuts are segment ends (no key read
  twice) when that is balanced within ``SEGMENT_CUT_SLACK`` (10%) of the free cuts.
  ``kv_sequence`` is split the same way by work per key column.
- **Partials are pairs per element** (a numpy structured dtype (o, lse), float32, or float64
  for float64 outputs), so ⊕ stays elementwise (Definition 3.7) and every decompose,
  recompose, transfer and memory count of the device IR handles them unchanged; the price is
  8 bytes per partial element where FlashAttention's split-KV packs one lse per row
  (about 4), which the cost proxy charges (``joinagg.partial_itemsize``).
- FLOPs of a block count its own visible (query, key) pairs
  (``attention_block_flops(fspec, causal, segments)``; ``Primitive.block_flops``), so the
  blocks of any split sum to the whole's count; causal counts the diagonal (L(L+1)/2 pairs
  per segment of length L).

Forced plans: ``plan={i: {"sequence": 8}}`` (query split, context parallelism) or
``plan={i: {"kv_sequence": 8}}`` (key split, ring attention's partial outputs combined by ⊕).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from eins.errors import EinsError, ShapeError
from eins.ir.joinagg import FunctionSpec, Indexing, JoinAggSpec, lse_pair_dtype
from eins.ir.primitive import GpuLowering, Primitive, Strided, register
from eins.kernels import attention as flash
from eins.kernels import build, sdpa
from eins.kernels.attention import attention_pairs
from eins.kernels.torch_rules import compute_type, float_pairs, one_float_dtype
from eins.ir.types import Box, TensorType, result_dtype
from eins.ops import attention_blocks as blk
from eins.ops.attention_bwd import attention_vjp
from eins.ops._common import (attention_shapes, compute_dtype, float_result,
                               is_static_sequence, static_flag, static_real, user_errors)
from eins.tracing import bind

__all__ = ["attention", "attention_block_flops"]

attention_block_flops = blk.attention_block_flops

# Query cuts at segment ends are taken when their heaviest block has at most this much more
# work than equal-work cuts anywhere: 10% of the attention's time buys not reading keys twice.
SEGMENT_CUT_SLACK = 0.10


def _check_segments(segments, s: int) -> None:
    if segments is None:
        return
    ok = (len(segments) > 0 and all(isinstance(e, int) for e in segments)
          and all(a < b for a, b in zip((0,) + tuple(segments), segments))
          and segments[-1] == s)
    if not ok:
        raise ShapeError(f"attention: segments must be strictly increasing positive end "
                         f"positions ending at the sequence length S={s}, got {segments}")


def _attention_abstract(q: TensorType, k: TensorType, v: TensorType, *, causal, segments,
                        scale):
    attention_shapes(q.shape, k.shape, v.shape)
    _check_segments(segments, q.shape[-2])
    return (TensorType(q.shape, float_result("attention", q, k, v)),)


def _attend(q, k, v, causal, scale):
    """One segment, whole: q [..., Hkv, G, L, D], k/v [..., Hkv, L, D], in compute dtype."""
    s = np.einsum("...hgld,...hmd->...hglm", q, k) * scale
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
    # a row whose scores are all -inf (a -inf in k) sees no key: 0, as in every block kernel
    # and the Triton kernel; an unseen (-inf score) inf/nan value adds nothing
    return blk.softmax_values(s, v)[0]


def _attention_impl(q, k, v, *, causal, segments, scale):
    out_dtype = result_dtype(q.dtype, k.dtype, v.dtype)
    ct = compute_dtype(out_dtype)
    *batch, hq, s, d = q.shape
    hkv = k.shape[-3]
    g = hq // hkv
    sc = ct.type(1.0 / math.sqrt(max(d, 1)) if scale is None else scale)  # D=0: no scores
    # group query heads under their kv head: [..., Hkv, G, S, D] against [..., Hkv, S, D]
    qf = np.asarray(q).astype(ct, copy=False).reshape(*batch, hkv, g, s, d)
    kf = np.asarray(k).astype(ct, copy=False)
    vf = np.asarray(v).astype(ct, copy=False)
    out = np.empty(qf.shape, ct)
    start = 0
    for end in (segments or (s,)):
        if end == start:  # S == 0
            continue
        out[..., start:end, :] = _attend(qf[..., start:end, :], kf[..., start:end, :],
                                         vf[..., start:end, :], causal, sc)
        start = end
    return (out.reshape(q.shape).astype(out_dtype, copy=False),)


def _grouped(q, k, v, ct):
    """Blocks in compute dtype with query heads grouped under their kv head."""
    *batch, hq, lq, d = q.shape
    hkv = k.shape[-3]
    g = hq // hkv if hkv else 0
    return (np.asarray(q).astype(ct, copy=False).reshape(*batch, hkv, g, lq, d),
            np.asarray(k).astype(ct, copy=False), np.asarray(v).astype(ct, copy=False))


def _rows(fspec):
    """The global query rows ``qa, qb`` and key rows ``ka, kb`` of a function specification."""
    qbox, kbox = fspec.inputs[0], fspec.inputs[1]
    qa, qb, ka, kb = qbox.lo[-2], qbox.hi[-2], kbox.lo[-2], kbox.hi[-2]
    return qa, qb, ka, kb


def _attention_block(fspec, q, k, v, *, causal, segments, scale):
    """f[F] for one function specification of a spec without ⊕: query rows [qa, qb) with the
    key rows [ka, kb) they attend to (blk.needed_keys), all global positions."""
    qa, qb, ka, kb = _rows(fspec)
    s = segments[-1] if segments else max(qb, kb)
    if qb > qa:
        lo, hi = blk.needed_keys(qa, qb, causal, segments, s)
        if ka > lo or kb < hi:
            raise EinsError(f"attention: query rows [{qa}, {qb}) attend to keys [{lo}, {hi}), "
                            f"but the block holds keys [{ka}, {kb}); a key-split block "
                            f"computes a partial (run_block(..., partial=True), ⊕ lse)")
    ends = (0,) + tuple(segments or (s,))
    if (qa, qb) == (ka, kb) and qa in ends and qb in ends:
        # whole segments with exactly their own keys (the unsplit case, and sequence cuts at
        # segment ends): the whole-tensor kernel on re-based segment ends
        local = tuple(e - qa for e in ends if qa < e <= qb)
        return _attention_impl(q, k, v, causal=causal, segments=local or None, scale=scale)
    out_dtype = result_dtype(q.dtype, k.dtype, v.dtype)
    ct = compute_dtype(out_dtype)
    qf, kf, vf = _grouped(q, k, v, ct)
    o, _ = blk.attend_block(qf, kf, vf, qa, ka, causal, segments, s, _scale(ct, q, scale))
    return (o.reshape(q.shape).astype(out_dtype, copy=False),)


def _attention_partial(fspec, q, k, v, *, causal, segments, scale):
    """f[F] of a key-split spec (⊕ = lse): each query row's attention over the block's keys
    alone, as (o, lse) pairs (eins.ir.joinagg.lse_pair_dtype) that ⊕ combines exactly."""
    qa, qb, ka, kb = _rows(fspec)
    s = segments[-1] if segments else max(qb, kb)
    out_dtype = result_dtype(q.dtype, k.dtype, v.dtype)
    pair = lse_pair_dtype(out_dtype)
    ct = pair["o"]
    qf, kf, vf = _grouped(q, k, v, ct)
    o, lse = blk.attend_block(qf, kf, vf, qa, ka, causal, segments, s,
                              _scale(ct, q, scale), lse=True)
    out = np.empty(q.shape, pair)
    out["o"] = o.reshape(q.shape)
    out["lse"] = lse.reshape(q.shape[:-1])[..., None]
    return (out,)


def _scale(ct, q, scale):
    d = q.shape[-1]
    return ct.type(1.0 / math.sqrt(max(d, 1)) if scale is None else scale)


def _attention_flops(ins, outs, *, causal, segments, scale):
    """The whole attention's FLOPs (blocks: :func:`_attention_block_flops`)."""
    q = ins[0]
    s = q.shape[-2]
    lead = math.prod(q.shape[:-2])
    return 4 * lead * q.shape[-1] * blk.block_pairs(0, s, 0, s, causal, segments, s)


def _attention_block_flops(fspec, ins, outs, *, causal, segments, scale):
    return blk.attention_block_flops(fspec, causal, segments)


def _attention_indexing(ins, outs, *, causal, segments, scale):
    """Named indices batch..., heads_kv, sequence, kv_sequence, head_dim (module docstring)."""
    q, k, _ = ins
    nb = q.ndim - 3
    batch = ["batch"] if nb == 1 else [f"batch{i}" for i in range(nb)]
    hkv, s, d = k.shape[-3:]
    g = q.shape[-3] // hkv
    extents = dict(zip(batch, q.shape[:nb]))
    extents.update(heads_kv=hkv, sequence=s, kv_sequence=s, head_dim=d)
    shardable: dict[str, object] = {n: "any" for n in batch}
    shardable.update(heads_kv="any", sequence="any", kv_sequence="any")
    inner = tuple(segments[:-1]) if segments else ()

    rows_before = blk.prefix_work(causal, segments, s)            # work of rows [0, x)
    keys_before = blk.prefix_work(causal, segments, s, keys=True)  # of key columns [0, x)

    def heaviest(cuts):
        return max(rows_before(b) - rows_before(a) for a, b in cuts)

    def seq_cuts(count):
        free = blk.work_cuts(rows_before, s, count)
        if free is not None and inner and count - 1 <= len(inner):
            # whole segments per block (no key read by two blocks), unless that leaves the
            # heaviest block more than SEGMENT_CUT_SLACK above the free cuts' heaviest
            ends = blk.work_cuts(rows_before, s, count, inner)
            if heaviest(ends) <= (1 + SEGMENT_CUT_SLACK) * heaviest(free):
                return ends
        return free

    def kv_cuts(count):
        return blk.work_cuts(keys_before, s, count)

    names = list(extents)

    def producer(iv) -> JoinAggSpec:
        if iv["head_dim"] != ((0, d),):
            raise EinsError(f"attention: head_dim (D={d}) is not shardable, got intervals "
                            f"{iv['head_dim']}")
        ksplit = len(iv["kv_sequence"]) > 1
        fspecs = []
        for combo in itertools.product(*(iv[n] for n in names)):
            ch = dict(zip(names, combo))
            lo = [ch[n][0] for n in batch]
            hi = [ch[n][1] for n in batch]
            (ha, hb), (qa, qb) = ch["heads_kv"], ch["sequence"]
            ka, kb = blk.needed_keys(qa, qb, causal, segments, s) if qb > qa else (qa, qb)
            if ksplit:   # the needed keys inside this key interval (all of it if none are)
                c, e = ch["kv_sequence"]
                ka, kb = (max(ka, c), min(kb, e)) if max(ka, c) < min(kb, e) else (c, e)
            qbox = Box((*lo, ha * g, qa, 0), (*hi, hb * g, qb, d))
            kvbox = Box((*lo, ha, ka, 0), (*hi, hb, kb, d))
            fspecs.append(FunctionSpec((qbox, kvbox, kvbox), (qbox,)))
        return JoinAggSpec(tuple(fspecs), ("lse" if ksplit else None,))

    return Indexing(extents, shardable, producer,
                    balance={"sequence": seq_cuts, "kv_sequence": kv_cuts})




@user_errors
def attention(q, k, v, causal=True, segments=None, scale=None):
    """Grouped-query scaled dot-product attention (see the module docstring); ``scale``
    defaults to ``1/sqrt(D)``; the output has q's shape."""
    if segments is not None:
        # a sequence of ints (a dict or set would iterate its keys, a bool pass as 0 or 1)
        if not is_static_sequence(segments):
            raise ShapeError(f"attention: segments must be a tuple of end positions, got "
                             f"{segments!r}")
        if any(isinstance(e, (bool, np.bool_)) for e in segments):
            raise ShapeError(f"attention: segments must be int end positions, not bools, "
                             f"got {segments!r}")
        segments = tuple(int(e) if isinstance(e, (int, np.integer)) else e
                         for e in segments)   # the shape rule refuses the rest by name
    return bind("attention", q, k, v, causal=static_flag("attention", "causal", causal),
                segments=segments,
                scale=None if scale is None else static_real("attention", "scale", scale))


def _attention_gpu(fspec, outs, ins, *, causal, segments, scale, impl="auto", measured=None):
    """GPU lowering: the flash-attention launcher (eins/kernels/attention.py: the
    Triton kernel, or a library kernel where ``impl`` picks one that computes this block
    exactly, the fastest by the ``measured`` table where one is given) on the block; the
    eqn's segments are global, and the block's global query/key positions come from its
    function spec, so a block masks exactly as the whole would."""
    q_off = fspec.inputs[0].lo[-2] if fspec is not None else 0
    k_off = fspec.inputs[1].lo[-2] if fspec is not None else 0
    flash(*ins, outs[0], causal=causal, segments=segments, scale=scale, q_offset=q_off,
          k_offset=k_off, impl=impl, measured=measured)


def _attention_gpu_partial(fspec, outs, ins, *, causal, segments, scale):
    """GPU lowering of a key-split block (⊕ = lse), the Triton flash-attention kernel with the
    block's global query/key offsets (causal masks and segments as the whole's). ``outs`` is
    either the device IR's pair buffer alone, ``[pairs]`` float32 ``[..., Hq, Sq, D, 2]``
    (eins.ir.joinagg.lse_pair_dtype as a trailing axis: what the GPU runtime and the rank
    kernel sets hold; the generated lse ⊕ kernel combines them), or ``(o, lse)``: o of q's
    shape in q's dtype or float32, lse float32 ``[..., Hq, Sq]``, which
    ``eins.kernels.combine_lse`` combines."""
    kw = dict(causal=causal, segments=segments, scale=scale, q_offset=fspec.inputs[0].lo[-2],
              k_offset=fspec.inputs[1].lo[-2])
    if len(outs) == 1:
        attention_pairs(*ins, outs[0], **kw)
        return
    o, lse = outs
    flash(*ins, o, lse=lse, impl="triton", **kw)


def _attention_torch(fspec, q, k, v, *, causal, segments, scale, partial=False):
    """The torch fallback: a block of query rows ``[qa, qb)`` with key rows ``[ka, kb)``
    (global positions from ``fspec``; eins/ops/attention_blocks.attend_block in torch):
    grouped-query attention per packed segment, in float32 (float64 stays), rows that see no
    key giving o = 0 and lse = -inf. ``partial``: a key-split block, returned as (o, lse)
    pairs along a trailing axis of 2 (the lse ⊕'s layout), lse repeated over the head dim as
    the reference does."""
    import torch  # heavy: only the GPU path
    qa, ka = fspec.inputs[0].lo[-2], fspec.inputs[1].lo[-2]
    lq, lk = q.shape[-2], k.shape[-2]
    s = segments[-1] if segments else max(qa + lq, ka + lk)
    d = q.shape[-1]
    ct = compute_type(q, k, v)
    sc = 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)
    *batch, hq, _, _ = q.shape
    hkv = k.shape[-3]
    g = hq // hkv if hkv else 0
    qf = q.to(ct).reshape(*batch, hkv, g, lq, d)
    kf, vf = k.to(ct).unsqueeze(-3), v.to(ct).unsqueeze(-3)   # broadcast over the group
    out = torch.zeros(qf.shape, dtype=ct, device=q.device)
    lse = torch.full(qf.shape[:-1], float("-inf"), dtype=ct, device=q.device)
    start = 0
    for end in (tuple(segments) if segments else (s,)):
        a, b, c, e = max(qa, start), min(qa + lq, end), max(ka, start), min(ka + lk, end)
        if causal:
            e = min(e, b)   # keys after the block's last query are never seen
        start = end
        if b <= a or e <= c:
            continue
        scores = (qf[..., a - qa:b - qa, :] @ kf[..., c - ka:e - ka, :].transpose(-1, -2)) * sc
        if causal:
            seen = torch.arange(c, e, device=q.device)[None, :] <= \
                torch.arange(a, b, device=q.device)[:, None]
            scores = scores.masked_fill(~seen, float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m)
        den = p.sum(dim=-1, keepdim=True)
        safe = torch.where(den > 0, den, torch.ones_like(den))
        # den == 0: the row sees no key, 0 even where a value is inf (0 * inf = nan)
        out[..., a - qa:b - qa, :] = torch.where(den == 0, torch.zeros_like(den),
                                                 (p / safe) @ vf[..., c - ka:e - ka, :])
        # den == 0: no visible key; a nan den (nan scores) keeps a nan lse
        lse[..., a - qa:b - qa] = torch.where(den == 0, torch.full_like(m, float("-inf")),
                                              m + torch.log(den))[..., 0]
    o = out.reshape(q.shape)
    if not partial:
        return (o,)
    return (torch.stack([o, lse.reshape(q.shape[:-1]).unsqueeze(-1).expand(q.shape)], -1),)


def _attention_check_plan(fspec, in_dtypes, out_dtypes, params, choice):
    """With ``choice="sdpa"`` or ``"cudnn"``, a whole block must be one SDPA computes exactly
    (eins/kernels/sdpa.py ``why_not``, whose checks read shapes, dtypes and offsets only):
    checked when the program is loaded. Key-split partials always run Triton, and
    flash-attn's checks need the tensors' device, so they stay at call time."""
    if choice not in ("sdpa", "cudnn"):
        return None
    import torch  # heavy: only the GPU path
    q, k = (torch.empty(b.shape, dtype=build.torch_dtype(dt), device="meta")
            for b, dt in zip(fspec.inputs[:2], in_dtypes[:2]))
    out = torch.empty(fspec.outputs[0].shape, device="meta",
                      dtype=build.torch_dtype(out_dtypes[0]))
    why = sdpa.why_not(q, k, out, causal=params["causal"], segments=params["segments"],
                       lse=None, q_offset=fspec.inputs[0].lo[-2],
                       k_offset=fspec.inputs[1].lo[-2])
    return None if why is None else f"one SDPA does not compute exactly: {why}"


def _attention_temp_bytes(fspec, **params) -> int:
    """What a GPU flash-attention kernel keeps in HBM: the running max and sum (float32) per
    query row and head, O(S), not the S x S scores of the numpy reference kernel (the
    virtual CPU devices are not capped)."""
    q = fspec.inputs[0]
    return 8 * q.size // max(q.shape[-1], 1)


def _attention_accumulation(ins, outs, **params):
    """three chained accumulations: q.k over the head dim, the softmax and p.v over the
    keys"""
    return 3, max(ins[1].shape[-2:])


def _attention_samples(arr):
    att = attention
    return [
        ("attention gqa 8q/4kv", lambda q, k, v: att(q, k, v),
         (arr(8, 6, 4), arr(4, 6, 4), arr(4, 6, 4))),
        ("attention segments", lambda q, k, v: att(q, k, v, segments=(3, 5, 8, 12)),
         (arr(4, 12, 4), arr(2, 12, 4), arr(2, 12, 4))),
        ("attention batch non-causal", lambda q, k, v: att(q, k, v, causal=False),
         (arr(6, 2, 5, 4), arr(6, 1, 5, 4), arr(6, 1, 5, 4))),
        # one sequence, one kv head: only the query / key sequence splits reach p
        ("attention one sequence causal", lambda q, k, v: att(q, k, v),
         (arr(2, 12, 4), arr(1, 12, 4), arr(1, 12, 4))),
        ("attention one sequence non-causal f32",
         lambda q, k, v: att(q, k, v, causal=False),
         (arr(2, 9, 4, dtype="float32"), arr(1, 9, 4, dtype="float32"),
          arr(1, 9, 4, dtype="float32"))),
        ("attention segments one kv head",
         lambda q, k, v: att(q, k, v, segments=(2, 7, 9, 16)),
         (arr(3, 16, 4), arr(1, 16, 4), arr(1, 16, 4)))]


_ONE_FLOAT = "float16, bfloat16 or float32 operands of one dtype"

register(Primitive(
    "attention", _attention_abstract, _attention_impl, _attention_flops, _attention_indexing,
    _attention_block, _attention_partial, _attention_block_flops,
    temp_bytes_fn=_attention_temp_bytes, accumulation=_attention_accumulation,
    kernel_class="attention",
    # the launchers (whole and key-split pairs, eins/kernels/attention.py ``_launch``) take
    # any q/k/v strides but a unit one in the head dim; the whole attention also writes a
    # strided output (the Triton kernel takes any output strides but a unit head-dim one;
    # the flash-attn and SDPA paths copy into it) for blocks of at most one batch dim
    # (which every path views as [B, H, S, D] without a copy)
    strided=Strided(operands=(0, 1, 2), unit_last=True, out_rank=4),
    lowerings={None: GpuLowering(
        _attention_gpu, accepts=lambda o, i, p: one_float_dtype(o, i), takes=_ONE_FLOAT,
        fallback=_attention_torch, template="triton_attention.py.j2",
        partial=_attention_gpu_partial, accepts_partial=lambda o, i, p: float_pairs(o, i),
        choice="impl", measured="measured", check_plan=_attention_check_plan)},
    samples=_attention_samples, vjp=attention_vjp))
