"""Grouped-query attention (FlashAttention-style, one primitive) with causal masking, packed
sequences, sliding windows, masks, biases and score caps.

``attention(q, k, v, causal=True, segments=None, scale=None, mask=None, window=None,
softcap=None, bias=None)``: q ``[..., Hq, Sq, D]``, k ``[..., Hkv, Sk, D]``, v ``[..., Hkv,
Sk, Dv]`` with ``Hq % Hkv == 0``; query heads ``g*G .. (g+1)*G - 1`` (``G = Hq/Hkv``) use
key/value head g; the output is ``[..., Hq, Sq, Dv]``. Query row i sits at key position
``i + Sk - Sq`` (aligned at the end, as flash-attn does: decode and chunked prefill against a
KV cache); with Sq == Sk that is i. Scores are ``scale * q.k`` (``scale`` defaults to
``1/sqrt(D)``), then:
- ``softcap``: ``softcap * tanh(score / softcap)`` (Gemma 2);
- ``bias``: ALiBi slopes ``[Hq]`` or ``[..., Hq]`` (flash-attn's: ``-slope * |i' - j|``
  added), or an additive float bias ``[..., Hq or 1, Sq, Sk]`` (dims of 1 broadcast);
- visibility: ``causal`` (key j <= i'), ``window`` W (``i' - j < W``; Mistral, Gemma 2;
  without causal also ``j - i' < W``), ``segments`` (a static tuple of packed-sequence END
  positions, Sq == Sk: nothing attends across them) and ``mask``, boolean: a key-padding
  mask ``[..., Sk]`` (the batch dims of q then the keys: BERT's padding) or a full mask
  ``[..., Hq or 1, Sq, Sk]`` (True: attend). A row that sees no key gives 0.
The softmax runs in float32 (float64 for float64 inputs). The mask and the bias are operands
3 and 4 of the eqn (where given; the eqn's ``mask``/``bias`` parameters name their kinds:
``"keys"``/``"full"`` and ``"alibi"``/``"add"``); ``offset`` is ``Sk - Sq``.

Join-agg specs (Section 3.3, Example 3.10) come from a custom producer, not a Signature,
because q's head interval is derived from heads_kv's and the key rows from the query rows.
Named indices, in this order (which fixes the order of the function specifications):
- leading batch dims: shardable ``any``;
- ``heads_kv``: shardable ``any``; an interval [a, b) of kv heads takes query heads
  [a*G, b*G) of q and of the output (heads_q is not an index of its own);
- ``sequence`` (the query rows; q, the output and a full mask's or bias's rows): shardable
  ``any``. A block of query rows [lo, hi) reads the key/value rows it attends to
  (``attention_blocks.needed_keys``): from the start of lo's segment (or its window) to
  hi + offset when causal, to the end of the segment of row hi-1 when not. Cuts at segment ends give blocks of whole segments that need no other tokens (the
  only sequence split before). No ⊕: the output blocks tile the output.
- ``kv_sequence`` (the key rows of k, v and the mask's or bias's columns): shardable ``any``; split, it is contracted:
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
  (``attention_block_flops(fspec, causal, segments, off=, window=)``;
  ``Primitive.block_flops``), so the blocks of any split sum to the whole's count; causal
  counts the diagonal (L(L+1)/2 pairs per segment of length L) and a window only its band.
  A data mask's hidden pairs are counted (the cost cannot see data); the GPU kernel skips
  the key blocks a mask hides whole.

Forced plans: ``plan={i: {"sequence": 8}}`` (query split, context parallelism) or
``plan={i: {"kv_sequence": 8}}`` (key split, ring attention's partial outputs combined by ⊕)."""
from __future__ import annotations

import itertools
import math

import numpy as np

from eins.errors import DTypeError, EinsError, ShapeError
from eins.ir.joinagg import FunctionSpec, Indexing, JoinAggSpec, lse_pair_dtype
from eins.ir.primitive import GpuLowering, Primitive, Strided, register
from eins.ir.types import Box, TensorType, is_float, result_dtype
from eins.ops import attention_blocks as blk
from eins.ops import attention_gpu as gpu
from eins.ops.attention_bwd import attention_vjp
from eins.ops._common import (attention_shapes, compute_dtype, float_result,
                               is_static_sequence, static_flag, static_real, user_errors)
from eins.tracing import bind

__all__ = ["attention", "attention_block_flops"]

attention_block_flops = blk.attention_block_flops

# Query cuts at segment ends are taken when their heaviest block has at most this much more
# work than equal-work cuts anywhere: 10% of the attention's time buys not reading keys twice.
SEGMENT_CUT_SLACK = 0.10

# every parameter of the eqn and its default (an eqn bound before the options existed, or
# by another primitive's rule, may leave the new ones out); ``rows`` is set only by the
# capacity form of a rebalanced eqn (``capacity_form``), never by a user
DEFAULTS = dict(blk.DEFAULTS, rows=False)
MASK_KINDS = ("keys", "full")
BIAS_KINDS = ("alibi", "add")


class Opts:
    """The eqn's parameters with their defaults, as attributes."""
    __slots__ = tuple(DEFAULTS)

    def __init__(self, params):
        for n, v in DEFAULTS.items():
            setattr(self, n, params.get(n, v))

    def keys(self, ins):
        """(mask, bias) among the operands ``ins`` (None where not given)."""
        rest = list(ins[3:])
        mask = rest.pop(0) if self.mask else None
        bias = rest.pop(0) if self.bias else None
        return mask, bias

    def ends_operand(self, ins):
        """The runtime segment ends among the operands (the last one, after the mask and the
        bias), or None: present for ``segments="array"``, and in the eqn a rebalance
        re-indexes with one batch's static ends (``rebalance_ends``) it stays."""
        n = 3 + bool(self.mask) + bool(self.bias)
        return ins[n] if len(ins) > n else None

    def rows_operand(self, ins):
        """The capacity form's row table block (an int [1, 2] of global query rows [lo, hi)
        this block computes this call; ``capacity_form``), after the ends, or None."""
        return ins[4 + bool(self.mask) + bool(self.bias)] if self.rows else None

    @property
    def static_segments(self):
        """The segment ends the plan may use: the static tuple, None when they are data."""
        return None if isinstance(self.segments, str) else self.segments


def _check_segments(segments, s: int) -> None:
    if segments is None:
        return
    ok = (len(segments) > 0 and all(isinstance(e, int) for e in segments)
          and all(a < b for a, b in zip((0,) + tuple(segments), segments))
          and segments[-1] == s)
    if not ok:
        raise ShapeError(f"attention: segments must be strictly increasing positive end "
                         f"positions ending at the sequence length S={s}, got {segments}")


def _check_ends_type(t, s: int) -> None:
    """Runtime segment ends: a 1-D int array (its values are checked by the kernels)."""
    if t is None or len(t.shape) != 1 or t.shape[0] < 1 or t.dtype.kind not in "iu":
        got = "none" if t is None else f"{t.dtype.name} {tuple(t.shape)}"
        raise ShapeError(f"attention: segments as data must be a 1-D int array of end "
                         f"positions (padded with S={s}, as flash-attn's cu_seqlens), got {got}")


def rebalance_ends(params, ins_types, values):
    """``Primitive.runtime_params``: with ``values`` None, the operand index of the runtime
    ends (None without one); else the eqn's params for one call, the ends read from that
    operand's value (``values``: operand index -> host array) as the static tuple, so the
    indexing, FLOPs and cut points are those of this batch (eins/passes/rebalance.py). The
    operand stays: the kernels still read it."""
    o = Opts(params)
    n = 3 + bool(o.mask) + bool(o.bias)
    if len(ins_types) <= n:   # no ends operand (a family specialized to one batch keeps it)
        return None
    if values is None:
        return n
    return dict(params, segments=blk.runtime_ends(values[n], ins_types[0].shape[-2]))


def aligned_ends(params, ins_types, intervals):
    """``Primitive.aligned``: the runtime ends under which query blocks cut at
    ``intervals['sequence']`` read no key outside their own rows (a segment ends at every
    cut), as the padded ends array; None without a runtime ends operand or room for them."""
    n = rebalance_ends(params, ins_types, None)
    if n is None:
        return None
    t, sq = ins_types[n], ins_types[0].shape[-2]
    ends = [hi for _, hi in intervals.get("sequence", ((0, sq),))]
    if len(ends) > t.shape[0]:
        return None
    out = np.full(t.shape, sq, t.dtype)
    out[:len(ends)] = ends
    return {n: out}


def capacity_form(params, ins_types, names):
    """``Primitive.capacity``: a query-sequence split whose cuts move per call (the runtime
    ends) becomes blocks of every query row (so one lowering holds any cut) that compute
    only the rows [lo, hi) a per-call table gives them and write zeros elsewhere: their
    copies sum to the output. Returns (params, the output axis the table cuts, the operands'
    windows: q's rows, k's and v's keys), or None for any other rebalanced split (a key split's partials are lse pairs, not sums). A family
    planned for one batch's ends (``specialize``) gets its ends back as data."""
    if set(names) != {"sequence"} or rebalance_ends(params, ins_types, None) is None:
        return None
    # transfers windowed per call (eins/passes/windows.py): q by the block's rows (pair 0),
    # k and v by the keys those rows attend to (pair 1)
    return dict(params, segments="array", rows=True), -2, {0: 0, 1: 1, 2: 1}


def _row_range(o, ins):
    """[lo, hi) of the global query rows a capacity-form block computes (None: all)."""
    t = o.rows_operand(ins)
    if t is None:
        return None
    t = np.asarray(t).reshape(-1)
    return int(t[0]), int(t[1])


def _check_extra(name, t: TensorType, kind, q, k, hq):
    """The mask's or bias's shape and dtype for its kind (module docstring)."""
    nb = len(q.shape) - 3
    batch, sq, sk = tuple(q.shape[:nb]), q.shape[-2], k.shape[-2]
    shape = tuple(t.shape)
    if name == "mask" and t.dtype != np.bool_:
        raise DTypeError(f"attention: mask must be bool (True: attend), got {t.dtype.name} "
                         f"{shape}; an additive float mask is bias=")
    if name == "bias" and not is_float(t.dtype):   # bfloat16 (ml_dtypes) has kind "V"
        raise DTypeError(f"attention: bias must be floating point, got {t.dtype.name} {shape}")
    if kind == "keys":
        want = f"{batch + (sk,)} (q's batch dims, then the {sk} keys)"
        ok = shape == batch + (sk,)
    elif kind == "alibi":
        want = f"{batch + (hq,)} or [{hq}] (one slope per query head)"
        ok = len(shape) == nb + 1 and shape[-1] == hq and all(
            n in (1, b) for n, b in zip(shape, batch))
    else:
        want = (f"{batch + (hq, sq, sk)} (batch dims, query heads, Sq, Sk; a batch or head "
                f"dim may be 1)")
        ok = len(shape) == nb + 3 and shape[-2:] == (sq, sk) and shape[-3] in (1, hq) and all(
            n in (1, b) for n, b in zip(shape, batch))
    if not ok:
        raise ShapeError(f"attention: {name} has shape {shape}; for q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)} it must be {want}")


def _attention_abstract(q: TensorType, k: TensorType, v: TensorType, *extra, **params):
    o = Opts(params)
    attention_shapes(q.shape, k.shape, v.shape, same_length=False)
    sq, sk = q.shape[-2], k.shape[-2]
    if o.offset != sk - sq:
        raise ShapeError(f"attention: offset must be Sk - Sq = {sk - sq} (queries aligned "
                         f"with the last keys), got {o.offset}")
    if o.segments is not None and sq != sk:
        raise ShapeError(f"attention: segments need one sequence for queries and keys, got "
                         f"Sq={sq} and Sk={sk}")
    ends = o.ends_operand((q, k, v) + extra)
    if o.segments == "array" or ends is not None:
        _check_ends_type(ends, sq)
    if o.segments != "array":
        _check_segments(o.segments, sq)
    mask, bias = Opts.keys(o, (q, k, v) + extra)
    if o.rows:
        t = extra[-1] if extra else None
        # [blocks, 4]: each row's key window after its rows (eins/passes/capacity.py)
        if ends is None or t is None or len(t.shape) != 2 or t.shape[-1] not in (2, 4) or \
                t.dtype.kind not in "iu":
            raise ShapeError(f"attention: rows=True takes the runtime ends and then an int "
                             f"[blocks, 2] or [blocks, 4] row table, got operands "
                             f"{list(extra)}")
    if len(extra) != bool(o.mask) + bool(o.bias) + (ends is not None) + bool(o.rows):
        raise ShapeError(f"attention: {len(extra)} operands beyond q, k, v for mask="
                         f"{o.mask!r} and bias={o.bias!r}")
    if o.mask is not None:
        _check_extra("mask", mask, o.mask, q, k, q.shape[-3])
    if o.bias is not None:
        _check_extra("bias", bias, o.bias, q, k, q.shape[-3])
    return (TensorType(q.shape[:-1] + v.shape[-1:], float_result("attention", q, k, v)),)


def _grouped(q, k, v, ct):
    """Blocks in compute dtype with query heads grouped under their kv head."""
    *batch, hq, lq, d = q.shape
    hkv = k.shape[-3]
    g = hq // hkv if hkv else 0
    return (np.asarray(q).astype(ct, copy=False).reshape(*batch, hkv, g, lq, d),
            np.asarray(k).astype(ct, copy=False), np.asarray(v).astype(ct, copy=False))


def _grouped_extras(o, mask, bias, hkv, ct):
    """The mask, bias and slopes blocks broadcast against the grouped scores [..., Hkv, G,
    Lq, Lk] (attention_blocks.attend_block)."""
    def heads(x):   # [..., h, Lq, Lk] -> [..., Hkv, G, Lq, Lk] (h = 1 broadcasts)
        x = np.asarray(x)
        h = x.shape[-3]
        return x.reshape(*x.shape[:-3], *((hkv, h // hkv) if h > 1 else (1, 1)),
                         *x.shape[-2:])
    m = b = slopes = None
    if o.mask == "keys":
        m = np.asarray(mask)[..., None, None, None, :]
    elif o.mask == "full":
        m = heads(mask)
    if o.bias == "alibi":
        x = np.asarray(bias).astype(ct, copy=False)
        slopes = x.reshape(*x.shape[:-1], hkv, x.shape[-1] // hkv, 1, 1)
    elif o.bias == "add":
        b = heads(np.asarray(bias).astype(ct, copy=False))
    return dict(mask=m, bias=b, slopes=slopes)


def _rows(fspec):
    """The global query rows ``qa, qb`` and key rows ``ka, kb`` of a function specification."""
    qbox, kbox = fspec.inputs[0], fspec.inputs[1]
    qa, qb, ka, kb = qbox.lo[-2], qbox.hi[-2], kbox.lo[-2], kbox.hi[-2]
    return qa, qb, ka, kb


def _span(o, qb, kb):
    """The one segment's end where there are no segments: past every position."""
    return o.static_segments[-1] if o.static_segments else max(qb, kb)


def _kernel_segments(o, ins, qb, kb):
    """The ends a kernel masks with: read from the runtime operand where there is one (so
    one compiled block serves every batch), else the static tuple. ``qb``, ``kb``: the
    block's last query and key rows (the ends must cover them)."""
    ends = o.ends_operand(ins)
    if ends is None:
        return o.segments
    return blk.runtime_ends(ends, max(qb, kb))


def _scale(ct, q, scale):
    d = q.shape[-1]
    return ct.type(1.0 / math.sqrt(max(d, 1)) if scale is None else scale)


def _compute(fspec, ins, params, lse):
    o = Opts(params)
    q, k, v = ins[:3]
    mask, bias = o.keys(ins)
    qa, qb, ka, kb = _rows(fspec)
    out_dtype = result_dtype(q.dtype, k.dtype, v.dtype)
    ct = lse_pair_dtype(out_dtype)["o"] if lse else compute_dtype(out_dtype)
    qf, kf, vf = _grouped(q, k, v, ct)
    segments = _kernel_segments(o, ins, qb, kb)
    span = segments[-1] if segments else max(qb, kb)
    res = blk.attend_block(qf, kf, vf, qa, ka, o.causal, segments, span,
                           _scale(ct, q, o.scale), lse=lse, off=o.offset, window=o.window,
                           softcap=o.softcap, **_grouped_extras(o, mask, bias, k.shape[-3], ct))
    return res, out_dtype, q.shape[:-1] + v.shape[-1:]


def _attention_impl(q, k, v, *extra, **params):
    """The whole attention: the block kernel on the whole tensors."""
    whole = FunctionSpec(tuple(Box((0,) * np.ndim(x), np.shape(x)) for x in (q, k, v)), ())
    (o, _), out_dtype, shape = _compute(whole, (q, k, v) + extra, params, False)
    return (o.reshape(shape).astype(out_dtype, copy=False),)


def _attention_block(fspec, *ins, **params):
    """f[F] for one function specification of a spec without ⊕: query rows [qa, qb) with the
    key rows [ka, kb) they attend to (blk.needed_keys), all global positions."""
    o = Opts(params)
    qa, qb, ka, kb = _rows(fspec)
    if qb > qa:
        # the ends this call masks with (its runtime ones where they are data: a block a
        # rebalance cut for other ends must not compute silently wrong rows)
        segs = _kernel_segments(o, ins, qb, kb)
        lo, hi = blk.needed_keys(qa, qb, o.causal, segs, segs[-1] if segs else max(qb, kb),
                                 off=o.offset, window=o.window)
        if not segs and blk.band(o.causal, o.window)[1] is None:
            hi = min(hi, kb)   # all the keys, as many as the whole has (unknown here)
        if ka > lo or kb < hi:
            raise EinsError(f"attention: query rows [{qa}, {qb}) attend to keys [{lo}, {hi}), "
                            f"but the block holds keys [{ka}, {kb}); a key-split block "
                            f"computes a partial (run_block(..., partial=True), ⊕ lse)")
    (out, _), out_dtype, shape = _compute(fspec, ins, params, False)
    out = out.reshape(shape).astype(out_dtype)
    rows = _row_range(o, ins)
    if rows is not None:   # the capacity form: only this call's rows, zeros elsewhere
        keep = np.arange(qa, qb)
        out[..., (keep < rows[0]) | (keep >= rows[1]), :] = 0
    return (out,)


def _attention_partial(fspec, *ins, **params):
    """f[F] of a key-split spec (⊕ = lse): each query row's attention over the block's keys
    alone, as (o, lse) pairs (eins.ir.joinagg.lse_pair_dtype) that ⊕ combines exactly."""
    if Opts(params).rows:
        raise EinsError("attention: the capacity form (rows=True) has no key-split partial")
    (o, lse), out_dtype, shape = _compute(fspec, ins, params, True)
    out = np.empty(shape, lse_pair_dtype(out_dtype))
    out["o"] = o.reshape(shape)
    out["lse"] = lse.reshape(shape[:-1])[..., None]
    return (out,)


def _attention_flops(ins, outs, **params):
    """The whole attention's FLOPs (blocks: :func:`_attention_block_flops`)."""
    q, k, v = ins[:3]
    whole = FunctionSpec(tuple(Box((0,) * len(t.shape), t.shape) for t in (q, k, v)), ())
    return _attention_block_flops(whole, ins, outs, **params)


def _attention_block_flops(fspec, ins, outs, **params):
    o = Opts(params)
    # runtime ends unknown: the count of one segment, the most any batch can cost
    return blk.attention_block_flops(fspec, o.causal, o.static_segments, off=o.offset,
                                     window=o.window)



def _attention_indexing(ins, outs, **params):
    """Named indices batch..., heads_kv, sequence, kv_sequence, head_dim (module docstring)."""
    o = Opts(params)
    q, k, v = ins[:3]
    extra = [(kind, t.shape) for kind, t in zip(
        [x for x in (o.mask, o.bias) if x], ins[3:])]
    ends = o.ends_operand(ins)
    nb = len(q.shape) - 3
    batch = ["batch"] if nb == 1 else [f"batch{i}" for i in range(nb)]
    hkv, sk, d = k.shape[-3:]
    sq, dv = q.shape[-2], v.shape[-1]
    g = q.shape[-3] // hkv
    span = max(sq, sk)
    causal, segments, off, window = o.causal, o.static_segments, o.offset, o.window
    extents = dict(zip(batch, q.shape[:nb]))
    extents.update(heads_kv=hkv, sequence=sq, kv_sequence=sk, head_dim=d)
    shardable: dict[str, object] = {n: "any" for n in batch}
    shardable.update(heads_kv="any", sequence="any", kv_sequence="any")
    inner = tuple(segments[:-1]) if segments else ()
    pos = dict(off=off, window=window)
    rows_before = blk.prefix_work(causal, segments, span, sq=sq, **pos)   # rows [0, x)
    keys_before = blk.prefix_work(causal, segments, span, keys=True, sq=sq, **pos)

    def heaviest(cuts):
        return max(rows_before(b) - rows_before(a) for a, b in cuts)

    def seq_cuts(count):
        if o.segments == "array":   # unknown ends: equal tokens (the rebalance recuts)
            return blk.work_cuts(lambda x: x, sq, count)
        free = blk.work_cuts(rows_before, sq, count)
        if free is not None and inner and count - 1 <= len(inner):
            # whole segments per block (no key read by two blocks), unless that leaves the
            # heaviest block more than SEGMENT_CUT_SLACK above the free cuts' heaviest
            ends = blk.work_cuts(rows_before, sq, count, inner)
            if heaviest(ends) <= (1 + SEGMENT_CUT_SLACK) * heaviest(free):
                return ends
        return free

    def kv_cuts(count):
        if o.segments == "array":
            return blk.work_cuts(lambda x: x, sk, count)
        return blk.work_cuts(keys_before, sk, count)

    names = list(extents)

    def producer(iv) -> JoinAggSpec:
        if iv["head_dim"] != ((0, d),):
            raise EinsError(f"attention: head_dim (D={d}) is not shardable, got intervals "
                            f"{iv['head_dim']}")
        ksplit = len(iv["kv_sequence"]) > 1
        if o.rows and ksplit:
            raise EinsError("attention: the capacity form (rows=True) cannot split "
                            "kv_sequence")
        fspecs = []
        for j, combo in enumerate(itertools.product(*(iv[n] for n in names))):
            ch = dict(zip(names, combo))
            lo = [ch[n][0] for n in batch]
            hi = [ch[n][1] for n in batch]
            (ha, hb), (qa, qb) = ch["heads_kv"], ch["sequence"]
            if o.rows:   # the capacity form: every query row; the table picks this call's
                qa, qb = 0, sq
            ka, kb = blk.needed_keys(qa, qb, causal, segments, span, **pos) if qb > qa \
                else (qa, qb)
            ka, kb = min(ka, sk), min(kb, sk)
            if ksplit:   # the needed keys inside this key interval (all of it if none are)
                c, e = ch["kv_sequence"]
                ka, kb = (max(ka, c), min(kb, e)) if max(ka, c) < min(kb, e) else (c, e)
            qbox = Box((*lo, ha * g, qa, 0), (*hi, hb * g, qb, d))
            kbox = Box((*lo, ha, ka, 0), (*hi, hb, kb, d))
            vbox = Box((*lo, ha, ka, 0), (*hi, hb, kb, dv))
            obox = Box((*lo, ha * g, qa, 0), (*hi, hb * g, qb, dv))
            boxes = [blk.extra_box(kind, lo, hi, (ha * g, hb * g), (qa, qb), (ka, kb), shape)
                     for kind, shape in extra]
            if ends is not None:   # every block reads all the runtime ends
                boxes.append(Box((0,), tuple(ends.shape)))
            if o.rows:   # and its own row of the capacity form's table
                boxes.append(Box((j, 0), (j + 1, 2)))
            fspecs.append(FunctionSpec((qbox, kbox, vbox, *boxes), (obox,)))
        # the capacity form's blocks are copies of the whole output that sum to it
        agg = "lse" if ksplit else "sum" if o.rows and len(iv["sequence"]) > 1 else None
        return JoinAggSpec(tuple(fspecs), (agg,))

    return Indexing(extents, shardable, producer,
                    balance={"sequence": seq_cuts, "kv_sequence": kv_cuts},
                    work={"sequence": (lambda x: x) if o.segments == "array" else rows_before})


def _reshaped(x, shape):
    return x if tuple(x.shape) == tuple(shape) else x.reshape(shape)


def _extra_kind(name, x, q, k):
    """The kind of a mask or bias by its shape (module docstring), and ``x`` in the eqn's
    layout: a slopes vector [Hq] gains q's batch dims as 1s; a full mask or bias of fewer
    dims than q gains leading 1s. A shape of neither form is a ShapeError naming both."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ShapeError(f"attention: {name} must be an array, got {type(x).__name__}")
    nb = len(q.shape) - 3
    batch, sq, sk, hq = tuple(q.shape[:nb]), q.shape[-2], k.shape[-2], q.shape[-3]
    shape = tuple(x.shape)
    full = batch + (hq, sq, sk)
    if name == "mask" and shape == batch + (sk,):
        return "keys", x
    if name == "bias" and len(shape) == 1 and shape[0] == hq:
        return "alibi", _reshaped(x, (1,) * nb + (hq,))
    if name == "bias" and len(shape) == nb + 1 and shape[-1] == hq and all(
            n in (1, b) for n, b in zip(shape, batch)):
        return "alibi", x
    padded = (1,) * (nb + 3 - len(shape)) + shape
    if 2 <= len(shape) <= nb + 3 and padded[-2:] == (sq, sk) and all(
            n in (1, w) for n, w in zip(padded, full)):
        return ("full" if name == "mask" else "add"), _reshaped(x, padded)
    first = (f"a key-padding mask {batch + (sk,)}" if name == "mask" else
             f"ALiBi slopes ({hq},) or {batch + (hq,)}")
    raise ShapeError(f"attention: {name} has shape {shape}; for q {tuple(q.shape)} and k "
                     f"{tuple(k.shape)} it must be {first} or a full {name} ending in (Sq, Sk) "
                     f"= {(sq, sk)} whose other dims broadcast to {full[:-2]} (batch dims, "
                     f"query heads; broadcast a mask over Sq or Sk first)")


@user_errors
def attention(q, k, v, causal=True, segments=None, scale=None, mask=None, window=None,
              softcap=None, bias=None):
    """Grouped-query scaled dot-product attention (see the module docstring); ``scale``
    defaults to ``1/sqrt(D)``; the output has q's shape with v's head size."""
    ends = None
    if segments is not None and hasattr(segments, "shape") and hasattr(segments, "dtype"):
        # an array (traced or not): the ends are data, read by the kernels on every call
        ends, segments = segments, "array"
    elif segments is not None:
        # a sequence of ints (a dict or set would iterate its keys, a bool pass as 0 or 1)
        if not is_static_sequence(segments):
            raise ShapeError(f"attention: segments must be a tuple of end positions or an "
                             f"int array of them, got {segments!r}")
        if any(isinstance(e, (bool, np.bool_)) for e in segments):
            raise ShapeError(f"attention: segments must be int end positions, not bools, "
                             f"got {segments!r}")
        segments = tuple(int(e) if isinstance(e, (int, np.integer)) else e
                         for e in segments)   # the shape rule refuses the rest by name
    if window is not None:
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)) \
                or window < 1:
            raise ShapeError(f"attention: window must be a positive int (each query sees "
                             f"itself and the window - 1 keys before it), got {window!r}")
        window = int(window)
    if softcap is not None:
        softcap = static_real("attention", "softcap", softcap)
        if softcap <= 0:
            raise ShapeError(f"attention: softcap must be > 0, got {softcap}")
    params = dict(causal=static_flag("attention", "causal", causal), segments=segments,
                  scale=None if scale is None else static_real("attention", "scale", scale),
                  window=window, softcap=softcap)
    operands = [q, k, v]
    for name, x in (("mask", mask), ("bias", bias)):
        kind = None
        if x is not None:
            kind, x = _extra_kind(name, x, q, k)
            operands.append(x)
        params[name] = kind
    if ends is not None:
        operands.append(ends)
    if len(getattr(q, "shape", ())) >= 2 and len(getattr(k, "shape", ())) >= 2:
        params["offset"] = int(k.shape[-2]) - int(q.shape[-2])
    # the eqn carries an option only where given (its IR reads as before without them)
    params = {n: x for n, x in params.items()
              if n in ("causal", "segments", "scale") or x != DEFAULTS[n]}
    return bind("attention", *operands, **params)


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

    def keys_mask(*shape):   # a padding mask whose every row keeps its first key
        m = arr(*shape) > 0
        m[..., 0] = True
        return m

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
         (arr(3, 16, 4), arr(1, 16, 4), arr(1, 16, 4))),
        ("attention window 4 softcap", lambda q, k, v: att(q, k, v, window=4, softcap=2.0),
         (arr(2, 12, 4), arr(1, 12, 4), arr(1, 12, 4))),
        ("attention window non-causal segments",
         lambda q, k, v: att(q, k, v, causal=False, window=3, segments=(5, 12)),
         (arr(2, 12, 4), arr(1, 12, 4), arr(1, 12, 4))),
        ("attention decode 3 queries, 10 keys, Dv 6",
         lambda q, k, v: att(q, k, v),
         (arr(2, 2, 3, 4), arr(2, 1, 10, 4), arr(2, 1, 10, 6))),
        ("attention cross non-causal, key padding",
         lambda q, k, v, m: att(q, k, v, causal=False, mask=m),
         (arr(2, 2, 5, 4), arr(2, 1, 9, 4), arr(2, 1, 9, 4), keys_mask(2, 9))),
        ("attention full mask, alibi",
         lambda q, k, v, m, s: att(q, k, v, mask=m, bias=s),
         (arr(4, 10, 4), arr(2, 10, 4), arr(2, 10, 4), keys_mask(1, 10, 10),
          arr(4, lo=0.1, hi=1.0))),
        ("attention additive bias per head, window",
         lambda q, k, v, b: att(q, k, v, bias=b, window=5),
         (arr(2, 4, 8, 4), arr(2, 2, 8, 4), arr(2, 2, 8, 4), arr(1, 4, 8, 8)))]


def _pipeline(params):
    """``Primitive.pipeline``: keys and values along their rows, pieces joined by ``lse``;
    not with a mask or bias (operands with key columns of their own) nor in the capacity
    form (its blocks span every key)."""
    o = Opts(params)
    return None if (o.mask or o.bias or o.rows) else ((1, 2), -2)


register(Primitive(
    "attention", _attention_abstract, _attention_impl, _attention_flops, _attention_indexing,
    _attention_block, _attention_partial, _attention_block_flops,
    temp_bytes_fn=_attention_temp_bytes, accumulation=_attention_accumulation,
    kernel_class="attention",
    runtime_params=rebalance_ends, capacity=capacity_form, aligned=aligned_ends,
    pipeline=_pipeline,
    # the launchers (whole and key-split pairs, eins/kernels/attention.py ``_launch``) take
    # any q/k/v strides but a unit one in the head dim; the whole attention also writes a
    # strided output (the Triton kernel takes any output strides but a unit head-dim one;
    # the flash-attn and SDPA paths copy into it) for blocks of at most one batch dim
    # (which every path views as [B, H, S, D] without a copy)
    strided=Strided(operands=(0, 1, 2), unit_last=True, out_rank=4),
    lowerings={None: GpuLowering(
        gpu.attention_gpu, accepts=gpu.accepts, takes=gpu.TAKES,
        fallback=gpu.attention_torch, template="triton_attention.py.j2",
        partial=gpu.attention_gpu_partial, accepts_partial=gpu.accepts_partial,
        choice="impl", measured="measured", check_plan=gpu.check_plan)},
    samples=_attention_samples, vjp=attention_vjp))
