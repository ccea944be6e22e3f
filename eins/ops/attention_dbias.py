"""The gradient of attention with respect to its bias: the ``attention_dbias`` primitive of
attention's backward family (eins/ops/attention_bwd.py).

``attention_dbias(q, k, v, o, lse, do, *extra, **params) -> dbias``: the cotangent of
attention's bias operand (the last of ``extra``: an additive bias ``[..., Hq|1, Sq, Sk]``,
kind ``"add"``, or ALiBi slopes ``[..., Hq]``, kind ``"alibi"``; a mask before it) for the
output cotangent ``do``, from the forward's output ``o`` and saved log-sum-exp ``lse``, in
the bias's shape and dtype. ``params`` are the forward eqn's. The final scores are
``s = softcap tanh(scale q.k / softcap) - slope |j - p| + bias`` (the bias added after the
cap), so with dS = dL/ds = P (dP - rowsum(dO o O)) (FlashAttention-2's backward, the scores
recomputed from q, k and the lse), d(bias) is dS summed over the dims along which the bias
broadcasts and d(slope_h) = -sum over the pairs (i, j) of dS_h |j - p|; a pair no row sees
(masked, outside the band or the segment) adds 0. The kernel walks the pairs in tiles
(attention_bwd_blocks.dbias_block), so beyond the gradient itself it holds O(tile^2) scores
per head.

Named indices are attention_bwd's (the forward's: batch..., heads_kv, sequence, kv_sequence,
head_dim, with their work-balanced cuts), and a block reads what attention_bwd's does (the
rows and keys of its intervals that see each other). It writes the bias gradient of its own
(batch, heads, query rows, keys) intervals, zeros for the pairs it does not read: an additive
bias's blocks tile it with no ⊕, except where a split index is one the bias broadcasts along
(a batch or head dim of 1), whose blocks each give a partial of the same box summed by ⊕
``sum``; ALiBi's slopes broadcast along the query and key rows, so a split of either sums
the blocks' partials. ``head_dim`` is never split (the scores contract it).

Segment ends as data (``segments="array"``: the ends array last, after the mask and the
bias, as attention_bwd takes it): the specs are then those of unknown ends (the forward's
equal-token cuts, every block reading the keys it would need were the sequence one
document), the kernels (numpy, Triton, the torch fallback) read each block's segments from
the operand, and ``runtime_params`` and ``aligned`` (attention_bwd's, both attention's on the
forward's operands) let the per-call rebalance re-cut this eqn with the forward and
the backward for each call's ends. Its capacity form (``Primitive.capacity``,
eins/passes/capacity.py) for a query-row split is attention_bwd's (blocks of every row and
key computing this call's rows and the keys they see, reading the backward's table): an
additive bias's gradient is written at the block's rows (zero elsewhere), ALiBi slopes' is a
partial over every row (the rows outside the cut add exactly 0), so the GPU backends run one
capacity program for every cut, by default: its Triton kernel (eins/kernels/
attention_dbias.py, the backward's options) reads the block's table row as the backward's
does, skipping the tiles outside the cut, so its work is the cut's. Its torch fallback (for
operands the kernel does not take: float64, mixed dtypes) computes the whole capacity block
with the rows and keys outside the cut zeroed, up to p times the cut's work
(``capacity_masks`` says so for those dtypes), so such a program keeps the compile-time
cuts on the GPU backends by default and runs the capacity program with ``rebalance=True``.

FLOPs are the forward's (the scores and dP = dO V^T: two matmuls of the forward's two) plus a
few per visible pair, priced at the operands' dtype as attention_bwd's (the Triton kernel's
matmuls run in it); the temporaries (``temp_bytes``) are a tile's scores, P and dP per
head.
"""
from __future__ import annotations

import numpy as np

from eins.errors import ShapeError
from eins.ir.joinagg import FunctionSpec, Indexing, JoinAggSpec
from eins.ir.primitive import GpuLowering, Primitive, get_primitive, register
from eins.ir.rules import compute_dtype, float_dtype
from eins.ir.types import Box, TensorType, result_dtype
from eins.ops import attention_blocks as blk
from eins.ops import attention_bwd_blocks as bblk
from eins.ops import attention_bwd_gpu as gpu
from eins.tracing import bind

__all__ = ["attention_dbias"]

# per visible (query, key) pair and query head beyond the two matmuls: the exp, dP - delta,
# the product with P and the sum into the gradient
PAIR_FLOPS = 4


def _bias_at(params) -> int:
    """The bias's operand index: after q, k, v, o, lse, dO and the mask where there is one."""
    return 6 + bool(bblk.opts(params)["mask"])


def _abstract(q, k, v, o, lse, do, *extra, **params):
    p = bblk.opts(params)
    if not p["bias"]:
        raise ShapeError("attention_dbias: the attention has no bias (bias= is None); it "
                         "is the gradient with respect to a bias or ALiBi slopes")
    # attention_bwd's rule: attention's shapes and options, and o, lse, dO against them
    get_primitive("attention_bwd").abstract(q, k, v, o, lse, do, *extra, **params)
    bias = extra[_bias_at(params) - 6]
    return (TensorType(bias.shape, bias.dtype),)


def _block(fspec, q, k, v, o, lse, do, *extra, **params):
    """f[F]: the bias gradient of the block's visible (query, key) pairs
    (bblk.dbias_block), written at its rows and keys inside its output box (zeros
    elsewhere). The capacity form (``rows``: its table row last) computes this call's rows
    and keys: :func:`_capacity_block`."""
    if params.get("rows"):
        return _capacity_block(fspec, q, k, v, o, lse, do, *extra, **params)
    p = bblk.opts(params)
    mask, bias = bblk.extras(extra, p)
    segments, span = bblk.kernel_segments(p, fspec, (q, k, v, o, lse, do, *extra))
    ct = compute_dtype(float_dtype(result_dtype(q.dtype, k.dtype, v.dtype, o.dtype,
                                                do.dtype, bias.dtype)))
    *batch, hq, lq, d = q.shape
    hkv = k.shape[-3]
    g = hq // hkv if hkv else 0

    def grouped(x):
        return np.asarray(x).astype(ct, copy=False).reshape(*batch, hkv, g, *x.shape[-2:])

    res = bblk.dbias_block(
        grouped(q), np.asarray(k).astype(ct, copy=False), np.asarray(v).astype(ct, copy=False),
        grouped(o), np.asarray(lse).astype(ct, copy=False).reshape(*batch, hkv, g, lq),
        grouped(do), fspec.inputs[0].lo[-2], fspec.inputs[1].lo[-2], p["causal"],
        segments, span, ct.type(bblk.scale_of(p["scale"], d)),
        off=p["offset"], window=p["window"], softcap=p["softcap"],
        **bblk.grouped_extras(p, mask, bias, hkv,
                              lambda x: np.asarray(x).astype(ct, copy=False)))
    box, inbox = fspec.outputs[0], fspec.inputs[_bias_at(params)]
    out = np.zeros(box.shape, bias.dtype)
    if p["bias"] == "alibi":
        out[...] = res.reshape(box.shape)
    else:   # the rows and keys the block read, inside its own intervals'
        r, c = inbox.lo[-2] - box.lo[-2], inbox.lo[-1] - box.lo[-1]
        out[..., r:r + bias.shape[-2], c:c + bias.shape[-1]] = res.reshape(bias.shape)
    return (out,)


def _capacity_block(fspec, q, k, v, o, lse, do, *extra, **params):
    """A capacity-form block: its rows outside this call's [lo, hi) and keys outside [klo,
    khi) read as zeros (bblk.capacity_inputs: such a row's P is 0, so it adds exactly 0 to
    a slope's sum); an additive bias's gradient zero at the rows outside (its copies are
    ⊕-summed)."""
    fspec = FunctionSpec(fspec.inputs[:-1], fspec.outputs)
    q, k, v, o, lse, do, out_r, _ = bblk.capacity_inputs(fspec, q, k, v, o, lse, do,
                                                         extra[-1])
    (out,) = _block(fspec, q, k, v, o, lse, do, *extra[:-1], **dict(params, rows=False))
    if bblk.opts(params)["bias"] == "add":   # its rows: the block's q rows, whole
        out[..., out_r, :] = 0
    return (out,)


def _impl(*ins, **params):
    whole = FunctionSpec(tuple(Box.full(np.shape(x)) for x in ins),
                         (Box.full(np.shape(ins[_bias_at(params)])),))
    return _block(whole, *ins, **params)


def _indexing(ins, outs, **params):
    """attention_bwd's named indices, cuts and read boxes; the output box of the bias's own
    intervals, ⊕ sum where blocks share it (module docstring)."""
    ix, reads = bblk.backward_reads("attention_dbias", ins, params)
    kind, shape = bblk.opts(params)["bias"], ins[_bias_at(params)].shape

    def blocks(iv):   # (a block's reads, its inputs' boxes)
        if params.get("rows"):   # the capacity form: whole blocks, each its table row
            return bblk.capacity_whole("attention_dbias", iv, reads, ins[0].shape[-2],
                                       ins[-1].shape[-1])
        return [(b, b.inputs) for b in reads(iv)]

    def producer(iv) -> JoinAggSpec:
        spec = JoinAggSpec(tuple(
            FunctionSpec(inputs, (blk.extra_box(kind, b.lo, b.hi, b.heads, b.rows, b.keys,
                                                shape),))
            for b, inputs in blocks(iv)), (None,))
        shared = any(m > 1 for m in spec.multiplicity(0).values())
        return JoinAggSpec(spec.fspecs, ("sum" if shared else None,))

    return Indexing(ix.extents, ix.shardable, producer, None, ix.balance, ix.work)


def _flops(ins, outs, **params):
    a = (*ins[:3], *ins[6:])   # the forward's operands and output among the eqn's
    att = get_primitive("attention").flops(a, (ins[3],), **params)
    return _with_pairs(att, ins[0].shape[-1], ins[2].shape[-1])


def _block_flops(fspec, ins, outs, **params):
    """From the block's global boxes alone (q's, k's and v's), as attention's."""
    att = get_primitive("attention").block_flops(fspec, ins, outs, **params)
    return _with_pairs(att, fspec.inputs[0].shape[-1], fspec.inputs[2].shape[-1])


def _with_pairs(att_flops: int, d: int, dv: int) -> int:
    """attention's FLOPs (2 (D + Dv) per pair and query head) plus PAIR_FLOPS per pair."""
    per_pair = 2 * (d + dv)
    return att_flops + (att_flops // per_pair * PAIR_FLOPS if per_pair else 0)


def _flops_dtype(in_dtypes):
    """attention_bwd's: q, k, v, o and dO's promoted dtype (the lse is float32)."""
    return get_primitive("attention_bwd").flops_dtype(in_dtypes)


def _temp_bytes(fspec, **params) -> int:
    """A tile's scores, P and dP (float32) per query head of the block."""
    q, k = fspec.inputs[0], fspec.inputs[1]
    heads = q.size // max(q.shape[-1] * q.shape[-2], 1)
    tile = min(q.shape[-2], bblk.DBIAS_TILE) * min(k.shape[-2], bblk.DBIAS_TILE)
    return 3 * 4 * heads * tile


def _accumulation(ins, outs, **params):
    """two chained accumulations (the scores and dP over the head dim; dS over the pairs and
    heads the bias broadcasts along): the second sums as many terms as dS has elements per
    bias element"""
    q, v, bias = ins[0], ins[2], ins[_bias_at(params)]
    terms = (q.size // max(q.shape[-1], 1)) * ins[1].shape[-2] // max(bias.size, 1)
    return 2, max(q.shape[-1], v.shape[-1], terms)


def _runtime_params(params, ins_types, values):
    """``Primitive.runtime_params``: attention_bwd's (the same operands: q, k, v, o, lse,
    dO, then the forward's mask, bias and runtime ends)."""
    return get_primitive("attention_bwd").runtime_params(params, ins_types, values)


def _aligned(params, ins_types, intervals):
    """``Primitive.aligned``: attention_bwd's (the same operands)."""
    return get_primitive("attention_bwd").aligned(params, ins_types, intervals)


def _capacity(params, ins_types, names):
    """``Primitive.capacity``: attention_bwd's for a query-row split (blocks of every row
    and key computing this call's rows [lo, hi) and the keys they see [klo, khi), its
    operands windowed alike, so the backward's table serves both). An additive bias's
    gradient is written at the rows (pair 0 on its axis -2, zero elsewhere); ALiBi slopes'
    is a sum over every row and key, each block's copy a partial (the rows outside its cut
    add exactly 0) that ⊕ sum adds: no output axis, the table's rows are q's."""
    form = get_primitive("attention_bwd").capacity(params, ins_types, names)
    if form is None:
        return None
    new, axis, reads = form[:3]
    if bblk.opts(params)["bias"] != "alibi":
        return new, axis, reads
    # no output axis: each window on the backward's axis, named
    return new, None, {n: (w, axis) if isinstance(w, int) else w for n, w in reads.items()}


_KERNEL_DTYPES = ("float16", "bfloat16", "float32")
_KERNEL_TAKES = ("float16, bfloat16 or float32 operands of one dtype, a float32 lse, a "
                 "float16, bfloat16 or float32 bias")


def _capacity_masks(params, ins_types) -> bool:
    """``Primitive.capacity_masks``: whether the capacity block runs the torch fallback,
    which computes it whole (up to p times the cut's work): operands the Triton kernel does
    not take (gpu.dbias_accepts's dtypes: q, k, v, o, dO of one float16, bfloat16 or
    float32 dtype, a float32 lse and bias of one of those). The kernel skips the tiles
    outside the cut, as attention_bwd's does."""
    q, k, v, o, lse, do = ins_types[:6]
    bias = ins_types[_bias_at(params)]
    names = {np.dtype(t.dtype).name for t in (q, k, v, o, do)}
    return not (len(names) == 1 and names <= set(_KERNEL_DTYPES)
                and np.dtype(lse.dtype) == np.float32
                and np.dtype(bias.dtype).name in _KERNEL_DTYPES)


def attention_dbias(q, k, v, o, lse, do, *extra, **params):
    """The cotangent of attention's bias (the last of ``extra``, in the eqn's layout, after
    the mask where there is one) for the output cotangent ``do``, from the forward's output
    ``o`` and log-sum-exp ``lse``; ``params``: the forward eqn's (attention's VJP rule binds
    it)."""
    return bind("attention_dbias", q, k, v, o, lse, do, *extra, **params)


# ----------------------------------------------------------------------------- samples
def _samples(arr):
    """The forward and the bias gradient, as a training step runs them (operands in the eqn's
    layout: slopes with q's batch dims, a full bias or mask of q's rank)."""
    def fb(**params):
        def f(q, k, v, do, *extra):
            o, lse = bind("attention_fwd", q, k, v, *extra, **params)
            return attention_dbias(q, k, v, o, lse, do, *extra, **params)
        return f

    def keep_first(m):   # every row keeps its first key
        m[..., 0] = True
        return m

    def fe(kind, mask=None):   # the ends as data, last, as a packed training step runs them
        params = dict(causal=True, segments="array", scale=None, bias=kind,
                      **({"mask": mask} if mask else {}))

        def f(q, k, v, do, *extra):
            o, lse = bind("attention_fwd", q, k, v, *extra, **params)
            return attention_dbias(q, k, v, o, lse, do, *extra, **params)
        return f

    base = dict(causal=True, segments=None, scale=None)
    return [
        ("attention_dbias bias per head, segments as data", fe("add"),
         (arr(2, 12, 4), arr(1, 12, 4), arr(1, 12, 4), arr(2, 12, 4), arr(2, 12, 12),
          np.array([3, 5, 8, 12, 12]))),
        ("attention_dbias alibi, full mask, gqa, segments as data", fe("alibi", "full"),
         (arr(4, 12, 4), arr(2, 12, 4), arr(2, 12, 4), arr(4, 12, 4),
          keep_first(arr(1, 12, 12) > 0), arr(4, lo=0.1, hi=1.0),
          np.array([2, 7, 9, 12, 12]))),
        ("attention_dbias alibi, full mask, gqa", fb(**base, mask="full", bias="alibi"),
         (arr(4, 10, 4), arr(2, 10, 4), arr(2, 10, 4), arr(4, 10, 4),
          keep_first(arr(1, 10, 10) > 0), arr(4, lo=0.1, hi=1.0))),
        ("attention_dbias bias per head, batch-broadcast, window",
         fb(**base, window=5, bias="add"),
         (arr(2, 4, 8, 4), arr(2, 2, 8, 4), arr(2, 2, 8, 4), arr(2, 4, 8, 4),
          arr(1, 4, 8, 8))),
        ("attention_dbias bias head-broadcast, segments, softcap",
         fb(**dict(base, segments=(3, 5, 8, 12)), softcap=2.0, bias="add"),
         (arr(2, 4, 12, 4), arr(2, 2, 12, 4), arr(2, 2, 12, 4), arr(2, 4, 12, 4),
          arr(2, 1, 12, 12))),
        ("attention_dbias alibi per batch, decode 3 queries, 10 keys, Dv 6",
         fb(**base, bias="alibi", offset=7, softcap=3.0),
         (arr(2, 2, 3, 4), arr(2, 1, 10, 4), arr(2, 1, 10, 6), arr(2, 2, 3, 6),
          arr(2, 2, lo=0.1, hi=1.0))),
        ("attention_dbias cross non-causal, key padding, bias",
         fb(**dict(base, causal=False), mask="keys", bias="add", offset=4),
         (arr(2, 2, 5, 4), arr(2, 1, 9, 4), arr(2, 1, 9, 4), arr(2, 2, 5, 4),
          keep_first(arr(2, 9) > 0), arr(2, 2, 5, 9))),
        ("attention_dbias alibi one kv head non-causal window f32",
         fb(**dict(base, causal=False), window=4, bias="alibi"),
         (arr(2, 9, 4, dtype="float32"), arr(1, 9, 4, dtype="float32"),
          arr(1, 9, 4, dtype="float32"), arr(2, 9, 4, dtype="float32"),
          arr(2, lo=0.1, hi=1.0, dtype="float32")))]


register(Primitive(
    "attention_dbias", _abstract, _impl, _flops, _indexing, _block, None, _block_flops,
    # its Triton kernel runs the scores' and dP's matmuls in the operands' dtype (16-bit:
    # the tensor cores), as attention_bwd's does: priced at attention_bwd's rate
    temp_bytes_fn=_temp_bytes, accumulation=_accumulation, flops_dtype=_flops_dtype,
    lowerings={None: GpuLowering(
        gpu.dbias_gpu, accepts=gpu.dbias_accepts, takes=_KERNEL_TAKES,
        fallback=gpu.dbias_torch, template="triton_attention_dbias.py.j2")},
    runtime_params=_runtime_params, aligned=_aligned, capacity=_capacity,
    capacity_masks=_capacity_masks, samples=_samples))
