"""Linear algebra: matmul (numpy semantics with batch broadcasting) and einsum.

Everything about each primitive sits together: shape rule, numpy kernel, flops, indexing.
"""
from __future__ import annotations

import math

import numpy as np

from eins.errors import EinsumError, GpuError, ShapeError, TraceError
from eins.ir.joinagg import signature_indexing
from eins.ir.primitive import GpuLowering, Primitive, register
from eins.ir.program import Literal
from eins.ir.types import TensorType, result_dtype
from eins.kernels.matmul import matmul as matmul_kernel
from eins.kernels.torch_rules import common, one_float_dtype
from eins.ops._common import (array_operand, bool_contraction, compute_dtype, matmul_shape,
                              operands, user_errors)
from eins.tracing import abstractify, bind, not_an_array

__all__ = ["matmul", "einsum"]

_LETTERS = "abcdefgh"  # batch index names; i, j, k are the matrix indices


def _matmul_sig(a_shape, b_shape):
    """Signature of a >=2-D matmul: batch dims broadcast numpy-style; a size-1 batch dim
    against a larger one is '_' (not indexed)."""
    nb = max(len(a_shape), len(b_shape)) - 2
    a_b = (1,) * (nb - (len(a_shape) - 2)) + tuple(a_shape[:-2])
    b_b = (1,) * (nb - (len(b_shape) - 2)) + tuple(b_shape[:-2])
    a_sub, b_sub, o_sub, o_batch = "", "", "", []
    for d, (x, y) in enumerate(zip(a_b, b_b)):
        c = _LETTERS[d]
        n = max(x, y)
        o_sub += c
        o_batch.append(n)
        if d >= nb - (len(a_shape) - 2):
            a_sub += c if x == n else "_"
        if d >= nb - (len(b_shape) - 2):
            b_sub += c if y == n else "_"
    return f"{a_sub}ij,{b_sub}jk->{o_sub}ik | sum(j)", tuple(o_batch)


def _matmul_abstract(a: TensorType, b: TensorType):
    _, shape = matmul_shape(a.shape, b.shape)
    return (TensorType(shape, result_dtype(a.dtype, b.dtype)),)


def _matmul_impl(a, b):
    out_dtype = result_dtype(a.dtype, b.dtype)
    comp = compute_dtype(out_dtype)  # accumulate low precision in float32
    if comp == out_dtype:
        return (np.matmul(a, b),)
    return (np.matmul(a.astype(comp), b.astype(comp)).astype(out_dtype),)


def _matmul_flops(ins, outs):
    return 2 * outs[0].size * ins[0].shape[-1]


def _matmul_indexing(ins, outs):
    sig, _ = _matmul_sig(ins[0].shape, ins[1].shape)
    return signature_indexing(sig, [t.shape for t in ins], [t.shape for t in outs])


def _matmul_gpu(fspec, outs, ins, impl="torch"):
    """GPU lowering: cuBLAS through torch.matmul(out=) (capturable, fp32 accumulation, no
    upcast copies), or the Triton template with ``impl="triton"``
    (eins/kernels/matmul.py). A third operand is a residual the generated walk fused
    in (``a @ b + c``, one ``torch.addmm``/``baddbmm``: eins/codegen/gpu_walk.py)."""
    matmul_kernel(ins[0], ins[1], outs[0], impl=impl, add=ins[2] if len(ins) > 2 else None)


def _matmul_gpu_accepts(outs, ins, params) -> bool:
    """float16/bfloat16/float32 operands of one dtype, at least 2-D."""
    return one_float_dtype(outs, ins) and min(a.dim() for a in ins) >= 2


def _matmul_torch(fspec, a, b, c=None):
    """The torch fallback: ``a @ b``; ``c``: a residual the generated walk fused in
    (eins/codegen/gpu_walk.py), added after the product is rounded to its dtype, as the two
    eqns do unfused."""
    import torch  # heavy: only the GPU path
    a, b = common(a, b)
    if a.dtype == torch.bool:
        r = bool_contraction(torch.matmul, a, b)
    elif not a.dtype.is_floating_point:   # no integer GEMM on CUDA: exact float64 limbs
        r = int_contraction(torch.matmul, a, b, terms=a.shape[-1]).to(a.dtype)
    else:
        r = a.matmul(b)   # cuBLAS on the GPU: fp16/bf16 on tensor cores, fp32 accumulation
    return (r,) if c is None else (r + c.to(r.dtype),)


def _matmul_samples(arr):
    mm = matmul
    return [
        ("matmul 6x8@8x12", mm, (arr(6, 8), arr(8, 12))),
        ("matmul uneven 5x7@7x9 f32", mm, (arr(5, 7, dtype="float32"),
                                           arr(7, 9, dtype="float32"))),
        ("matmul batched broadcast", mm, (arr(2, 3, 4, 5), arr(3, 5, 6))),
        ("matmul batch-1 broadcast", mm, (arr(1, 4, 3), arr(6, 3, 5))),
        # integers: partial sums must recompose exactly (int32 contracts in int64, then casts)
        ("matmul int32", mm, (arr(6, 8, dtype="int32"), arr(8, 4, dtype="int32")))]


register(Primitive(
    "matmul", _matmul_abstract, _matmul_impl, _matmul_flops, _matmul_indexing,
    residual_epilogue=True, ufuncs=("matmul",),
    lowerings={None: GpuLowering(_matmul_gpu, accepts=_matmul_gpu_accepts,
                                 fallback=_matmul_torch, template="triton_matmul.py.j2",
                                 takes="float16, bfloat16 or float32 operands of one dtype, "
                                       "at least 2-D")},
    attr_hints=dict.fromkeys(["dot", "matmul", "mm", "bmm"], "use x @ y or eins.matmul(x, y)"),
    samples=_matmul_samples))


def _matmul_ranks(a, b):
    """The operands' ranks; a TraceError naming the operand's type for anything that is not
    an array, ShapeDtype or traced value (a list, None, a Python scalar)."""
    ranks = []
    for which, x in (("a", a), ("b", b)):
        try:
            ranks.append(len(abstractify(x, f"matmul operand {which}").shape))
        except TraceError:
            raise not_an_array("matmul", x, f"operand {which}",
                               f" or ShapeDtype: {x!r:.80}") from None
    return ranks


def _matmul_operands(a, b):
    """The ranks, with a 0-d operand or a contracted-length mismatch named in the user's
    shapes (the rule on the promoted matrices would print (1, 3) @ (4, 1) for (3,) @ (4,))."""
    ra, rb = _matmul_ranks(a, b)
    sa, sb = tuple(a.shape), tuple(b.shape)
    if ra == 0 or rb == 0:
        raise ShapeError(f"matmul: operands must be at least 1-D, got shapes {sa} and {sb}")
    ka, kb = sa[-1], sb[0] if rb == 1 else sb[-2]
    if ka != kb:
        raise ShapeError(f"matmul: contracted dimensions differ: {sa} @ {sb} (K={ka} != "
                         f"K={kb})")
    return ra, rb


@user_errors
def matmul(a, b):
    """numpy's matmul: 1-D operands are promoted to matrices and the added axis removed."""
    a_vec, b_vec = (r == 1 for r in user_errors(_matmul_operands)(a, b))
    if a_vec:
        a = bind("reshape", a, shape=(1,) + tuple(a.shape))
    if b_vec:
        b = bind("reshape", b, shape=tuple(b.shape) + (1,))
    out = bind("matmul", a, b)
    if a_vec and b_vec:
        return bind("reshape", out, shape=tuple(out.shape[:-2]))
    if a_vec:
        return bind("reshape", out, shape=tuple(out.shape[:-2]) + (out.shape[-1],))
    if b_vec:
        return bind("reshape", out, shape=tuple(out.shape[:-1]))
    return out


# ----------------------------------------------------------------------------- einsum
class EinsumShapeError(EinsumError, ShapeError):
    """An einsum whose subscripts do not fit its operands' shapes (both kinds of error)."""


_ALPHA = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def parse_einsum(subscripts, shapes):
    """numpy's einsum rules. Returns (input terms, output term, letter extents), with every
    ``...`` replaced by fresh letters and the output made explicit (implicit mode: the
    ellipsis dims, then the letters that appear exactly once, in ASCII order)."""
    shapes = [tuple(s) for s in shapes]
    where = f"einsum {subscripts!r} with operand shapes {shapes}"
    if not isinstance(subscripts, str):
        raise EinsumError(f"einsum: subscripts must be a string, got {subscripts!r}")
    text = subscripts.replace(" ", "")
    if text.count("->") > 1:
        raise EinsumError(f"{where}: more than one '->'")
    lhs, arrow, rhs = text.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise EinsumError(f"{where}: {len(terms)} input terms for {len(shapes)} operands")
    for t in terms + ([rhs] if arrow else []):
        body = t.replace("...", "", 1)
        bad = [c for c in body if c not in _ALPHA]
        if bad:
            raise EinsumError(f"{where}: invalid character {bad[0]!r} in term {t!r} "
                              f"(letters and one '...' only)")
    used = set(text) & set(_ALPHA)
    fresh = [c for c in _ALPHA if c not in used]
    # rank of the ellipsis: the most dims any operand leaves to it
    ell_rank = 0
    for t, s in zip(terms, shapes):
        n = len(t.replace("...", ""))
        if "..." in t:
            if n > len(s):
                raise EinsumShapeError(f"{where}: term {t!r} names {n} dims but the operand "
                                       f"has shape {s}")
            ell_rank = max(ell_rank, len(s) - n)
        elif n != len(s):
            raise EinsumShapeError(f"{where}: term {t!r} names {n} dims but the operand has "
                                   f"rank {len(s)} (shape {s})")
    if ell_rank > len(fresh):
        raise EinsumError(f"{where}: too many dims under '...'")
    ell = "".join(fresh[:ell_rank])
    ins = []
    for t, s in zip(terms, shapes):
        if "..." in t:
            k = len(s) - len(t.replace("...", ""))
            t = t.replace("...", ell[ell_rank - k:])
        ins.append(t)
    letters = "".join(ins)
    if arrow:
        if "..." not in rhs and ell_rank and any("..." in t for t in terms):
            raise EinsumError(f"{where}: the output has no '...' but the operands have "
                              f"{ell_rank} dims under '...'")
        out = rhs.replace("...", ell)
        for c in out:
            if out.count(c) > 1:
                raise EinsumError(f"{where}: output letter {c!r} repeated in {rhs!r}")
            if c not in letters:
                raise EinsumError(f"{where}: output letter {c!r} appears in no input term")
    else:
        out = ell + "".join(sorted(c for c in set(letters) - set(ell) if letters.count(c) == 1))
    extents: dict[str, int] = {}
    for t, s in zip(ins, shapes):
        for c, n in zip(t, s):
            if n != 1:
                if extents.get(c, n) != n and extents[c] != 1:
                    raise EinsumShapeError(f"{where}: letter {c!r} has sizes {extents[c]} and "
                                           f"{n}")
                extents[c] = n
            else:
                extents.setdefault(c, 1)
    return ins, out, extents


def _einsum_norm(ins, out):
    return ",".join(ins) + "->" + out


def _einsum_abstract(*xs: TensorType, subscripts):
    ins, out, ext = parse_einsum(subscripts, [x.shape for x in xs])
    dt = result_dtype(*[x.dtype for x in xs], op="einsum") if xs else np.dtype(np.float64)
    return (TensorType(tuple(ext[c] for c in out), dt),)


def _alone(terms, out, shapes):
    """Per operand, the axes of contracted letters no other operand carries at a size above
    1 (numpy broadcasting): those its einsum sums within the operand first."""
    axes = []
    for i, (t, s) in enumerate(zip(terms, shapes)):
        axes.append(tuple(
            d for d, c in enumerate(t) if c not in out and t.count(c) == 1 and s[d] > 1
            and all(n == 1 for j, u in enumerate(terms) if j != i
                    for e, n in zip(u, shapes[j]) if e == c)))
    return axes


def _einsum_impl(*xs, subscripts):
    xs = [np.asarray(x) for x in xs]
    out = result_dtype(*[x.dtype for x in xs], op="einsum")
    comp = compute_dtype(out)
    xs = [x.astype(comp, copy=False) for x in xs]
    if len(xs) > 1 and comp.kind == "f":
        # a letter only one operand carries is summed there first, always: numpy's einsum
        # does so for some shapes and not for others ('abc,axcb->' of (1,5,1) and (1,4,1,5)
        # summed x*inf products as they come, a block of it x first), so an inf met a
        # value of the other sign, or not, by the block's shape (such letters are not
        # shardable: _einsum_indexing)
        ins, rhs = subscripts.split("->")
        for i, ax in enumerate(_alone(ins.split(","), rhs, [x.shape for x in xs])):
            if ax:
                xs[i] = xs[i].sum(axis=ax, keepdims=True)
    # Three or more operands: numpy contracts them pairwise along a path it picks by shape
    # (fast), which reassociates each product over a sum; inf does not survive that (inf *
    # (2 - 1) is inf, inf * 2 - inf * 1 nan), so a block could meet an inf with a value of
    # the other sign, or not, by its shape. With a non-finite operand the einsum is its
    # definition instead, the sum of every term's product, which each block sums a part of
    # (the same inf / nan on every plan; slower: the product of all extents).
    fast = len(xs) > 2 and (comp.kind != "f" or all(np.isfinite(x).all() for x in xs))
    res = np.einsum(subscripts, *xs, optimize=fast)
    return (np.asarray(res).astype(out),)  # always a copy: 'ii->i' is a view of its operand


def _einsum_flops(ins, outs, *, subscripts):
    _, _, ext = parse_einsum(subscripts, [t.shape for t in ins])
    n = 1
    for e in ext.values():
        n *= e
    return max(1, len(ins)) * n


def _einsum_indexing(ins, outs, *, subscripts):
    """The signature is the einsum itself: a size-1 occurrence of a letter whose extent is
    larger (numpy broadcasting) is '_'; contracted letters aggregate with sum.

    A contracted letter of a float einsum of several operands that only one operand
    carries is not shardable: numpy's and torch's einsum sum it within that operand first
    (``'ab,a->a'`` is ``a.sum(1) * b``), so a split of it changes how inf and nan combine:
    ``sum_blocks(sum_block(x) * inf)`` is nan where ``sum(x) * inf`` is -inf (x of mixed
    signs), and the result depended on the plan. Integer and bool einsums have no such
    values and keep the letter shardable."""
    terms, out, ext = parse_einsum(subscripts, [t.shape for t in ins])
    sub = [''.join(c if n == ext[c] else "_" for c, n in zip(t, x.shape))
           for t, x in zip(terms, ins)]
    contracted = sorted(set("".join(terms)) - set(out))
    sig = ",".join(sub) + "->" + out + f" | sum({''.join(contracted)})"
    shardable = None
    if len(ins) > 1 and np.dtype(outs[0].dtype).kind not in "biu":
        alone = {c for c in contracted if sum(c in t for t in sub) == 1}
        shardable = {c: "any" for c in ext if c not in alone}
    return signature_indexing(sig, [t.shape for t in ins], [outs[0].shape], shardable)


def int_bits(*xs) -> int:
    """The bits an integer contraction of torch tensors ``xs`` (ints and bools) must keep:
    64 with an int64 operand, else 32 (an int32 result, which numpy wraps)."""
    import torch  # heavy: only the GPU path
    return 64 if any(x.dtype == torch.int64 for x in xs) else 32


def int_contraction(product, x, y, terms: int, bits: int | None = None):
    """numpy's integer matmul or einsum of two torch tensors (``product`` of two float64
    tensors: torch.matmul, or a two-operand torch.einsum), exact modulo ``2**bits`` as an
    int64 tensor (the caller casts it to the eqn's dtype; ``bits`` defaults to
    :func:`int_bits` of the operands). cuBLAS has no integer GEMM, so torch's int32 and int64
    matmul and bmm raise on CUDA (pytorch/pytorch issue 44428). Instead each operand is
    split into ``w``-bit limbs of its two's complement (0 <= limb < 2**w) and every pair of
    limbs that reaches below ``2**bits`` is one float64 product: exact, since each of its
    sums of ``terms`` products of limbs stays below 2**53 (``w`` is the widest that
    guarantees it), on tensor cores, capturable in a CUDA graph. The partial products are
    shifted into place and added in int64, which wraps as numpy's integers do. ``terms``:
    how many products one output element sums (the contracted extent; for an einsum the
    product of the extents of every letter absent from the output)."""
    import torch  # heavy: only the GPU path
    bits = int_bits(x, y) if bits is None else bits
    terms = max(1, int(terms))
    w = 32
    while w and terms * (2 ** w - 1) ** 2 > 2 ** 53:
        w -= 1
    if not w:
        raise GpuError(f"integer contraction over {terms} terms: too many to sum exactly in "
                       f"float64 limbs")
    mask = 2 ** w - 1

    def limbs(t):
        t = t.to(torch.int64)
        return [((t >> (w * i)) & mask).to(torch.float64) for i in range(-(-bits // w))]

    xs, ys = limbs(x), limbs(y)
    out = None
    for i, xi in enumerate(xs):
        for j, yj in enumerate(ys):
            shift = w * (i + j)
            if shift >= bits:
                continue
            part = product(xi, yj).to(torch.int64) << shift
            out = part if out is None else out.add_(part)
    return out


def int_einsum(subscripts: str, *xs):
    """numpy's integer einsum of torch tensors in int64 (exact modulo 2**64, or 2**32 when
    no operand is int64), for an explicit ``subscripts`` (``'ij,jk->ik'``, as a traced
    eqn carries it): one operand is torch's own (sums and diagonals, no GEMM); more are
    contracted a pair at a time, left to right, each pair by :func:`int_contraction`,
    keeping the letters a later operand or the output still needs."""
    import torch  # heavy: only the GPU path
    ins, out = subscripts.split("->")
    terms = ins.split(",")
    if len(terms) == 1:
        return torch.einsum(subscripts, xs[0].to(torch.int64))
    bits = int_bits(*xs)   # of the operands: the pairs' int64 results need no more
    extent = {}
    for t, x in zip(terms, xs):
        for c, n in zip(t, x.shape):
            extent[c] = max(extent.get(c, 1), n)
    acc, acc_term = xs[0], terms[0]
    for k in range(1, len(terms)):
        later = set("".join(terms[k + 1:])) | set(out)
        both = acc_term + terms[k]
        keep = "".join(dict.fromkeys(c for c in both if c in later)) if k < len(terms) - 1 \
            else out
        n = math.prod(extent[c] for c in set(both) - set(keep))
        sub = f"{acc_term},{terms[k]}->{keep}"
        acc = int_contraction(lambda p, q, sub=sub: torch.einsum(sub, p, q), acc, xs[k],
                              terms=n, bits=bits)
        acc_term = keep
    return acc


def _einsum_gpu(fspec, outs, ins, *, subscripts):
    """GPU lowering: ``torch.einsum`` (cuBLAS contractions, fp32 accumulation for 16-bit
    operands, capturable) in the operands' own dtype when they share the output's, so no
    upcast copies; operands of other dtypes are first cast to the output's (as numpy's
    promotion would). The result is copied into the preallocated output (einsum has no
    ``out=``)."""
    import torch  # heavy: only the GPU path
    out = outs[0]
    if out.dtype == torch.bool:
        out.copy_(bool_contraction(lambda *ts: torch.einsum(subscripts, *ts), *ins))
        return
    if not out.dtype.is_floating_point:
        out.copy_(int_einsum(subscripts, *ins))
        return
    out.copy_(torch.einsum(subscripts, *einsum_operands(subscripts, ins, out.dtype)))


def einsum_operands(subscripts, ins, dtype) -> list:
    """The float operands ``torch.einsum`` takes to compute what the numpy kernel does:
    the output's ``dtype``, except for float16/bfloat16 einsums that round an intermediate
    (three or more operands, contracted pairwise, or a letter only one operand carries,
    which torch sums within that operand first, as ``_einsum_impl`` does): those in
    float32, rounded once when copied to the output. In the 16-bit dtype each intermediate
    was rounded to it: ``'ab,a->'`` of [[2048, 1], [-2048, 0]] and [1, 1] in float16 summed
    the rows to 2048 and -2048 and returned 0, where eins.jit returns 1 (float32 throughout,
    rounded once). A single contraction of two operands keeps their dtype (cuBLAS
    accumulates in float32), with no upcast copies."""
    import torch  # heavy: only the GPU path
    if dtype in (torch.float16, torch.bfloat16):
        shapes = [tuple(t.shape) for t in ins]
        terms, out, _ = parse_einsum(subscripts, shapes)
        if len(ins) > 2 or (len(ins) == 2 and any(_alone(terms, out, shapes))):
            dtype = torch.float32
    return [t if t.dtype == dtype else t.to(dtype) for t in ins]


def _einsum_torch(fspec, *xs, subscripts):
    """The torch fallback (the runtime's kernel launchers off: eins/runtime/gpu.py
    ``Runtime.kernels``): ``torch.einsum`` in the operands' common dtype."""
    import torch  # heavy: only the GPU path
    xs = common(*xs)
    if xs[0].dtype == torch.bool:
        return (bool_contraction(lambda *ts: torch.einsum(subscripts, *ts), *xs),)
    if not xs[0].dtype.is_floating_point:
        return (int_einsum(subscripts, *xs).to(xs[0].dtype),)
    dt = xs[0].dtype
    return (torch.einsum(subscripts, *einsum_operands(subscripts, xs, dt)).to(dt),)


def _einsum_samples(arr):
    out = [(f"einsum {sub}", lambda *xs, sub=sub: einsum(sub, *xs),
            tuple(arr(*s) for s in shapes))
           for sub, shapes in [("ij,jk->ik", [(6, 8), (8, 4)]),
                               ("bij,bjk->bik", [(2, 3, 4), (2, 4, 6)]),
                               ("ii->i", [(6, 6)]), ("ij->", [(6, 4)]),
                               ("i,j->ij", [(6,), (4,)]), ("...ij,j->...i", [(2, 6, 4), (4,)]),
                               ("ij,jk,kl->il", [(4, 6), (6, 3), (3, 8)]),
                               ("ij,ij->ij", [(1, 8), (6, 8)])]]
    return out + [("einsum literal", lambda x: einsum("ij,->ij", x, 2.0), (arr(6, 4),))]


register(Primitive("einsum", _einsum_abstract, _einsum_impl, _einsum_flops, _einsum_indexing,
                   lowerings={None: GpuLowering(_einsum_gpu, fallback=_einsum_torch)},
                   samples=_einsum_samples))


@user_errors
def einsum(subscripts, *args):
    """numpy's einsum: any number of operands, contraction, batch (repeated) letters,
    implicit output when ``->`` is absent, ``...`` broadcasting. The traced eqn carries the
    explicit form (``...`` replaced by fresh letters)."""
    @user_errors
    def run():
        xs = operands("einsum", *args)
        for x in xs:   # Python scalars are Literals by now: anything else needs a shape
            if not isinstance(x, Literal):
                array_operand("einsum", x)
        ins, out, _ = parse_einsum(subscripts, [tuple(getattr(x, "shape", ())) for x in xs])
        return bind("einsum", *xs, subscripts=_einsum_norm(ins, out))

    return run()
