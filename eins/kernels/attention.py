"""Flash attention on torch tensors: the Triton template ``triton_attention.py.j2`` and its
launchers ``attention`` and ``combine_lse`` (signatures in eins/kernels/__init__.py).

Semantics are eins's ``attention`` primitive (eins/ops/attention.py): q ``[..., Hq, Sq, D]``,
k ``[..., Hkv, Sk, D]``, v ``[..., Hkv, Sk, Dv]``, query head h reads key/value head
``h // (Hq/Hkv)``; softmax in float32; ``segments`` are packed-sequence END positions
(global, the eqn's own), nothing attends across them; ``window`` W lets the query at key
position p see keys ``(p - W, p]`` (and, not causal, ``[p, p + W)``); ``softcap`` caps the
scores (Gemma 2); ``mask`` (bool) and ``bias`` (float) come with their kinds (``mask_kind``
"keys" ``[..., Sk]`` or "full" ``[..., Hq or 1, Sq, Sk]``; ``bias_kind`` "alibi" slopes
``[..., Hq]`` or "add" ``[..., Hq or 1, Sq, Sk]``; batch dims of 1 broadcast). Beyond the primitive, for a block of a sequence-split attention
(the planner side, eins/ops/attention.py): ``q_offset``/``k_offset`` are the global
positions of the blocks' first query and key rows, and ``lse`` receives each row's natural
log-sum-exp of its scaled scores, so two key-split partials combine exactly
(:func:`combine_lse`).
"""
from __future__ import annotations

import math
import re

import numpy as np

from eins.errors import DTypeError, ShapeError
from eins.kernels import build, flash, sdpa
from eins.ir.plan import ATTENTION_IMPLS
from eins.ir.rules import attention_shapes

TEMPLATE = "triton_attention.py.j2"
_LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per (GPU generation, head dim), chosen ahead of
# time (never autotuned in the hot path). Hopper (sm90) and Ampere (sm80) share the tile
# shapes of Triton's fused-attention tutorial: no config of a sweep on one H200 was
# notably faster (docs/measured.md, "Behind the code's constants"). Ampere gets fewer
# stages for D=128 (less shared memory per block).
CONFIGS = {
    ("sm90", 64): (128, 64, 4, 3), ("sm90", 128): (128, 64, 8, 3),
    ("sm80", 64): (128, 64, 4, 3), ("sm80", 128): (128, 64, 8, 2),
}
# float32 (exact IEEE dots on the CUDA cores, no tensor cores): smaller tiles. The 16-bit
# tiles above need 225 KB of shared memory at D=128 in float32 (sm_90 allows 227 KB, sm_80
# 163 KB); these need 72 KB there (ptxas for sm_90, Triton 3.9).
CONFIGS_FP32 = {64: (64, 32, 4, 2), 128: (64, 32, 4, 2)}
INTERPRET_CONFIG = (32, 32, 1, 1)  # small blocks: the interpreter runs each one in numpy


def config_for(q) -> tuple:
    major, _ = build.cuda_capability(q)
    if major == 0:
        return INTERPRET_CONFIG
    gen = "sm90" if major >= 9 else "sm80"
    d = q.shape[-1]
    if q.element_size() >= 4:
        return CONFIGS_FP32[64 if d <= 64 else 128]
    return CONFIGS[(gen, 64 if d <= 64 else 128)]


def _source(name, dtype, causal, segments, write_lse, interpret=False, pairs=False,
            variant=(False, False, None, None), running=False):
    fp32 = build.dtype_name(dtype) in ("float32", "float64")
    window, softcap, mask, bias = variant
    return build.render(TEMPLATE, name=name, reduce_prelude=build.REDUCE_PRELUDE,
                         dtype=build.dtype_name(dtype), causal=causal, segments=segments,
                         write_lse=write_lse, pairs=pairs, running=running, window=window,
                         softcap=softcap,
                         mask=mask, bias=bias,
                         tanh="_ld_tanh" if interpret else "libdevice.tanh",
                         up=build.dot_upcast(dtype, interpret),
                         dot_kw=', input_precision="ieee"' if fp32 else "")


def attention_source(dtype, *, causal=True, segments=False, write_lse=False,
                     pairs=False, window=False, softcap=False, mask=None, bias=None,
                     running=False) -> str:
    """The generated Triton source of one attention specialization (for inspection and for
    host programs that write their kernels to files)."""
    variant = (bool(window), bool(softcap), mask, bias)
    return _source(_kernel_name(dtype, causal, segments, write_lse, pairs, variant, running),
                   dtype, causal, bool(segments), write_lse, pairs=pairs, variant=variant,
                   running=running)


def _kernel_name(dtype, causal, segments, write_lse, pairs=False,
                 variant=(False, False, None, None), running=False):
    window, softcap, mask, bias = variant
    return (f"attn_{build.dtype_name(dtype)}{'_causal' if causal else ''}"
            f"{'_seg' if segments else ''}{'_lse' if write_lse else ''}"
            f"{'_pairs' if pairs else ''}{'_run' if running else ''}{'_win' if window else ''}"
            f"{'_cap' if softcap else ''}{f'_m{mask}' if mask else ''}"
            f"{f'_b{bias}' if bias else ''}")


LAUNCHES = {"attention": 0, "attention_pairs": 0, "combine_lse": 0}
"""Triton launches of this module's kernels by kind, since import (tests read them to show
that a path ran the Triton kernel, not a torch fallback)."""


def _compiled(dtype, causal, segments, write_lse, interpret, pairs=False,
              variant=(False, False, None, None), running=False):
    name = _kernel_name(dtype, causal, segments, write_lse, pairs, variant, running)
    src = _source(name, dtype, causal, segments, write_lse, interpret, pairs, variant, running)
    return (build.compile_source(src, name, interpret),
            build.compile_source(src, name + "_combine", interpret))


_ROWS: dict = {}


def is_runtime(segments) -> bool:
    """Whether ``segments`` are data (a tensor of ends), not a static tuple."""
    return segments is not None and hasattr(segments, "shape")


def in_window(table, a, n, device, col=0):
    """[n] bool: whether positions a .. a+n-1 lie in [table[col], table[col+1]) of a capacity
    form's table row (a device tensor: no host sync, so a captured graph replays new
    tables)."""
    import torch  # heavy: only the GPU path
    t = table.reshape(-1).to(device=device, dtype=torch.int64)
    pos = torch.arange(a, a + n, device=device)
    return (pos >= t[col]) & (pos < t[col + 1])


def same_segment(ends, qa, lq, ka, lk, device):
    """[Lq, Lk] bool: whether query position qa + i and key position ka + j lie in one
    segment of the runtime ``ends`` (searched on the device: no host sync, so a captured
    graph replays new ends)."""
    import torch  # heavy: only the GPU path
    ends = ends.reshape(-1).to(device=device, dtype=torch.int64)
    seg = [torch.searchsorted(ends, torch.arange(lo, lo + n, device=device), right=True)
           for lo, n in ((qa, lq), (ka, lk))]
    return seg[0][:, None] == seg[1][None, :]


def lse_outside_rows(lse, rows, qa):
    """``lse`` [..., Lq] of query rows from ``qa`` with 0 at the rows outside the capacity
    form's [lo, hi) (a device tensor: no host sync): the blocks' lse copies are ⊕-summed, so
    a row a block does not compute must add 0, not the -inf of a row that sees no key."""
    import torch  # heavy: only the GPU path
    return torch.where(in_window(rows, qa, lse.shape[-1], lse.device), lse,
                       torch.zeros((), dtype=lse.dtype, device=lse.device))


def segment_rows(segments, q_offset, sq, device, rows=None, causal=False):
    """Per query row, the global [start, end) of its segment, as two int32 tensors. Static
    ends are cached (one table per eqn, so a captured CUDA graph reuses it); a tensor of
    runtime ends (nondecreasing, padded with S) is searched on the device with no host
    sync, so a captured graph replays whatever ends the tensor holds. ``rows``: a device
    tensor [lo, hi) of the global positions this call computes (a capacity-form block);
    every other row gets an empty range, at the start of row lo's segment before lo and at
    the end of row hi-1's after (both monotone, as the kernel's key bounds need), so it
    sees no key and its key blocks are skipped. ``causal``: the rows after hi-1 get their
    empty range at hi instead (ROW_HI then drops there, which the causal kernel's bounds
    allow: no row before hi sees a key at or past it), so a block's keys stop at hi, the
    keys this call's rows attend to: a capacity buffer's other keys may be stale
    (eins/passes/windows.py). A table row with the key window [klo, khi) after [lo, hi)
    moves both empty ranges inside it (a sliding window's rows see fewer keys than their
    segments), so no block's key bounds reach a key outside it; the in-table rows' own
    ranges stay their segments (the kernels bound them by the window)."""
    import torch  # heavy: only the GPU path
    if is_runtime(segments):
        ends = segments.to(device=device, dtype=torch.int64)
        pos = _positions(q_offset, sq, device)
        i = torch.searchsorted(ends, pos, right=True).clamp_(max=ends.numel() - 1)
        before = torch.cat([ends.new_zeros(1), ends[:-1]])
        lo, hi = before[i], ends[i]
        if rows is not None:
            r = rows.reshape(-1).to(device=device, dtype=torch.int64)
            pick = torch.stack([r[0], (r[1] - 1).clamp(min=0)]).clamp(max=ends[-1] - 1)
            k = torch.searchsorted(ends, pick, right=True).clamp_(max=ends.numel() - 1)
            first, last = before[k[0]], ends[k[1]]
            if causal:
                last = torch.maximum(r[1], first)
            if r.numel() >= 4:   # the keys its rows see [klo, khi) (a sliding window: fewer)
                first = torch.maximum(first, r[2])
                last = torch.maximum(torch.minimum(last, r[3]), first)
            first = torch.where(r[1] > r[0], first, last)   # no rows: one empty range for all
            lo = torch.where(pos < r[0], first, torch.where(pos >= r[1], last, lo))
            hi = torch.where(pos < r[0], first, torch.where(pos >= r[1], last, hi))
        return lo.to(torch.int32), hi.to(torch.int32)
    if rows is not None:
        raise ShapeError("attention: a row table (rows=) needs the segments as a tensor")
    key = (tuple(segments), int(q_offset), int(sq), str(device))
    hit = _ROWS.get(key)
    if hit is None:
        ends = np.asarray(segments, np.int64)
        pos = np.arange(q_offset, q_offset + sq)
        k = np.searchsorted(ends, pos, side="right")  # the segment holding each position
        starts = np.concatenate([[0], ends[:-1]])
        hit = (torch.as_tensor(starts[k].astype(np.int32), device=device),
               torch.as_tensor(ends[k].astype(np.int32), device=device))
        _ROWS[key] = hit
    return hit


def _positions(q_offset, sq, device):
    key = ("pos", int(q_offset), int(sq), str(device))
    hit = _ROWS.get(key)
    if hit is None:
        import torch  # heavy: only the GPU path
        hit = _ROWS[key] = torch.arange(q_offset, q_offset + sq, device=device)
    return hit


def _check(q, k, v, out, segments, lse, q_offset, k_offset, opts=None):
    attention_shapes(q.shape, k.shape, v.shape, same_length=False)  # the primitive's rule
    if not (q.dtype == k.dtype == v.dtype):
        raise DTypeError(f"attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if build.dtype_name(q.dtype) not in ("float16", "bfloat16", "float32"):
        raise DTypeError(f"attention: the Triton kernel takes float16, bfloat16 or float32, "
                         f"got {q.dtype}")
    import torch  # heavy: only the GPU path
    oshape = tuple(q.shape[:-1]) + (v.shape[-1],)
    if out is not None and (tuple(out.shape) != oshape or
                            out.dtype not in (q.dtype, torch.float32)):
        raise ShapeError(f"attention: out must be {oshape} {q.dtype} (or float32, "
                         f"for a partial), got {tuple(out.shape)} {out.dtype}")
    if lse is not None:
        if tuple(lse.shape) != tuple(q.shape[:-1]) or lse.dtype != torch.float32:
            raise ShapeError(f"attention: lse must be float32 {tuple(q.shape[:-1])}, got "
                             f"{lse.dtype} {tuple(lse.shape)}")
        if not lse.is_contiguous():
            raise ShapeError("attention: lse must be contiguous")
    if k_offset < 0 or (q_offset < 0 and segments is not None):
        raise ShapeError(f"attention: offsets must be >= 0, got q_offset={q_offset}, "
                         f"k_offset={k_offset}")
    _check_options(q, k, **(opts or {}))
    if is_runtime(segments):
        if segments.dim() != 1 or segments.numel() < 1 or segments.dtype.is_floating_point:
            raise ShapeError(f"attention: runtime segments must be a 1-D int tensor of end "
                             f"positions, got {segments.dtype} {tuple(segments.shape)}")
    elif segments is not None:
        segs = tuple(segments)
        ok = (len(segs) > 0 and all(isinstance(e, (int, np.integer)) for e in segs)
              and all(a < b for a, b in zip((0,) + segs, segs)))
        if not ok:
            raise ShapeError(f"attention: segments must be strictly increasing positive end "
                             f"positions, got {segments}")
        end = max(q_offset + q.shape[-2], k_offset + k.shape[-2])
        if segs[-1] < end:
            raise ShapeError(f"attention: segments {segs} end at {segs[-1]}, before the "
                             f"blocks' last position {end}")


def _check_options(q, k, window=None, softcap=None, mask=None, mask_kind=None, bias=None,
                   bias_kind=None):
    """The options' types and shapes against the blocks (the primitive's shape rule checks
    them at trace time; this is the launcher's own guard)."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ShapeError(f"attention: window must be a positive int, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ShapeError(f"attention: softcap must be > 0, got {softcap!r}")
    nb = q.dim() - 3
    for name, x, kind, kinds in (("mask", mask, mask_kind, ("keys", "full")),
                                 ("bias", bias, bias_kind, ("alibi", "add"))):
        if (x is None) != (kind is None) or (kind is not None and kind not in kinds):
            raise ShapeError(f"attention: {name} and {name}_kind={kind!r} go together, "
                             f"kind one of {list(kinds)}")
        if x is None:
            continue
        want = {"keys": nb + 1, "full": nb + 3, "alibi": nb + 1, "add": nb + 3}[kind]
        if x.dim() != want:
            raise ShapeError(f"attention: a {kind} {name} has {want} dims for q "
                             f"{tuple(q.shape)}, got {tuple(x.shape)}")


def options_why_not(q, v, window=None, softcap=None, mask_kind=None, bias_kind=None,
                    **_) -> str | None:
    """Why a library kernel (SDPA, flash-attn) does not run these options, or None: they
    take none of the window, score cap, mask, bias or a value head size of its own here
    (the Triton kernel and the torch fallback do)."""
    named = [n for n, x in (("window", window), ("softcap", softcap), ("mask", mask_kind),
                            ("bias", bias_kind)) if x is not None]
    if named:
        return f"{', '.join(named)} (the Triton kernel takes them)"
    if v.shape[-1] != q.shape[-1]:
        return f"a value head size {v.shape[-1]} != {q.shape[-1]}"
    return None


IMPLS = ATTENTION_IMPLS
"""attention()'s ``impl`` values (``eins.distribute(..., attention=...)`` passes one down)."""


def check_impl(impl) -> str:
    """``impl`` if it names an attention path, else a ShapeError naming it."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ShapeError(f"attention: impl must be one of {list(IMPLS)}, got {impl!r}")
    return impl


_KEY = re.compile(r"(\w+) S=(\d+) Hq=(\d+) Hkv=(\d+) D=(\d+)( causal)?$")


def fastest_measured(table, candidates, dtype, s, d, causal) -> str | None:
    """The fastest of ``candidates`` (exact kernels for this block) by a measured table
    ({impl: {"<dtype> S=<len> Hq=.. Hkv=.. D=<d>[ causal]": ms}}, a machine profile's
    ``attention``): at the measured length nearest ``s`` (in log) that every candidate with
    rows of this dtype, head dim and mask was timed at. None when fewer than two candidates
    were measured so (then the rule of :func:`choose_impl` decides)."""
    rows = {}
    for impl in candidates:
        for key, ms in (table or {}).get(impl, {}).items():
            m = _KEY.match(key)
            if m and m.group(1) == dtype and int(m.group(5)) == d and \
                    bool(m.group(6)) == bool(causal):
                rows.setdefault(impl, {})[int(m.group(2))] = ms
    if len(rows) < 2:
        return None
    common = set.intersection(*(set(r) for r in rows.values()))
    if not common:
        return None
    near = min(common, key=lambda n: (abs(math.log(n) - math.log(max(s, 1))), n))
    return min(rows, key=lambda impl: (rows[impl][near], impl))


def choose_impl(q, k, v, out, *, causal, segments, lse, q_offset, k_offset,
                impl="auto", measured=None, opts=None) -> str:
    """The path :func:`attention` takes: ``"flash_attn"``, ``"sdpa"``, ``"cudnn"`` or
    ``"triton"``.

    ``impl="auto"``: flash-attn's varlen kernel where it imports and applies (the one library
    kernel that also takes packed segments), else PyTorch's SDPA where it computes exactly our
    attention on a fused CUDA backend (eins/kernels/sdpa.py: CUDA float16/bfloat16,
    no segments, no lse, a whole square causal mask or no mask), else the Triton kernel (CPU
    tensors always: the interpreter). Library kernels come first because they are tuned per
    GPU and ours is not (benchmarks/gpu_kernels.py times both against SDPA and records
    this choice). With a ``measured`` table (a machine profile's, measured on this GPU),
    ``"auto"`` takes the fastest exact kernel there (:func:`fastest_measured`), cuDNN's
    SDPA backend among them. A forced ``impl`` that does not apply is a KernelUnavailable
    naming why."""
    check_impl(impl)
    where = dict(causal=causal, segments=segments, lse=lse, q_offset=q_offset,
                 k_offset=k_offset)
    if impl == "triton":
        return "triton"
    if is_runtime(segments):   # the library kernels take host-side boundaries
        if impl != "auto":
            raise build.KernelUnavailable(f"attention: {impl} does not apply here: segments "
                                          f"as data (only the Triton kernel reads them from "
                                          f"a tensor)")
        return "triton"
    why = options_why_not(q, v, **(opts or {}))
    if why is not None:
        if impl != "auto":
            raise build.KernelUnavailable(f"attention: {impl} does not apply here: {why}")
        return "triton"
    if impl == "cudnn":
        why = sdpa.why_not(q, k, out, v=v, **where) or sdpa.cudnn_why_not(q, k, v, causal)
        if why is not None:
            raise build.KernelUnavailable(f"attention: SDPA's cuDNN backend does not compute "
                                          f"this attention exactly: {why}")
        return "cudnn"
    if impl == "auto" and measured:
        exact = ["triton"]
        if out is None or out.dtype == q.dtype:
            exact += ["flash_attn"] if flash.why_not(q, k, lse, q_offset, k_offset) is None \
                else []
        if sdpa.why_not(q, k, out, auto=True, v=v, **where) is None:
            exact.append("sdpa")
        if sdpa.why_not(q, k, out, v=v, **where) is None and \
                sdpa.cudnn_why_not(q, k, v, causal) is None:
            exact.append("cudnn")
        pick = fastest_measured(measured, exact, build.dtype_name(q.dtype), q.shape[-2],
                                q.shape[-1], causal)
        if pick is not None:
            return pick
    if impl in ("auto", "flash_attn"):
        why = flash.why_not(q, k, lse, q_offset, k_offset)
        if why is None and out is not None and out.dtype != q.dtype:
            why = f"out is {out.dtype} for {q.dtype} inputs"
        if why is None:
            return "flash_attn"
        if impl == "flash_attn":
            raise build.KernelUnavailable(f"attention: flash-attn does not apply here: {why}")
    why = sdpa.why_not(q, k, out, auto=impl == "auto", v=v, **where)
    if why is None:
        return "sdpa"
    if impl == "sdpa":
        raise build.KernelUnavailable(f"attention: SDPA does not compute this attention "
                                      f"exactly: {why}")
    return "triton"


def attention(q, k, v, out=None, *, causal=True, segments=None, scale=None, lse=None,
              q_offset=0, k_offset=0, impl="auto", config=None, measured=None, window=None,
              softcap=None, mask=None, mask_kind=None, bias=None, bias_kind=None,
              rows=None, running=None):
    """Flash attention (see the module docstring); returns ``out``. ``impl``: "auto",
    "triton", "sdpa", "cudnn" or "flash_attn" (:func:`choose_impl`, which reads the
    ``measured`` table under "auto"). ``q_offset`` is the key position of the first query
    row (a KV cache's decode step: the cache length). ``rows``: with segments as a tensor,
    a device tensor [lo, hi) of global query positions: only those rows are computed, the
    others are 0 (:func:`segment_rows`; Triton only). ``running``: a pipelined piece's
    running (o, lse) pairs (:func:`attention_pairs`): ``out`` is their ⊕ with this block's
    attention, finalized (Triton only)."""
    import torch  # heavy: only the GPU path
    check_impl(impl)
    if running is not None and impl not in ("auto", "triton"):
        raise build.KernelUnavailable(f"attention: {impl} does not apply here: running "
                                      f"pairs (only the Triton kernel starts from them)")
    if running is not None and (rows is not None or lse is not None):
        raise ShapeError("attention: running pairs go with neither a row table (rows=) nor "
                         "an lse output (a pipelined piece writes its pairs or its output)")
    opts = dict(window=window, softcap=softcap, mask=mask, mask_kind=mask_kind, bias=bias,
                bias_kind=bias_kind)
    _check(q, k, v, out, segments, lse, q_offset, k_offset, opts)
    if out is None:
        out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)
    if q.numel() == 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return out
    path = "triton" if running is not None else choose_impl(
        q, k, v, out, causal=causal, segments=segments, lse=lse, q_offset=q_offset,
        k_offset=k_offset, impl=impl, measured=measured, opts=opts)
    if path == "flash_attn":
        return flash.varlen(q, k, v, out, causal=causal, segments=segments, scale=scale)
    if path in ("sdpa", "cudnn"):
        return sdpa.sdpa(q, k, v, out, causal=causal, scale=scale,
                         backend="cudnn" if path == "cudnn" else None)
    if rows is not None and path != "triton":
        raise build.KernelUnavailable(f"attention: {path} does not apply here: a row table "
                                      f"(only the Triton kernel reads one)")
    _launch(q, k, v, out, build.as_bhsd(out), lse, causal, segments, scale, q_offset,
            k_offset, config, pairs=False, opts=opts, rows=rows, running=running)
    return out


def attention_pairs(q, k, v, pairs, *, causal=True, segments=None, scale=None, q_offset=0,
                    k_offset=0, config=None, window=None, softcap=None, mask=None,
                    mask_kind=None, bias=None, bias_kind=None, running=None):
    """A key-split block's partial straight into the device IR's pair layout: ``pairs``
    ``[..., Hq, Sq, D, 2]`` (contiguous float32, as eins.ir.joinagg.lse_pair_dtype keeps
    partials of float16/bfloat16/float32 attention) receives each row's
    attention over this block's keys alone at ``[..., 0]`` and the row's float32 natural
    log-sum-exp, repeated over the head dim, at ``[..., 1]`` (eins.ir.joinagg's (o, lse)
    pairs, which the lse ⊕ kernel of the generated programs combines). Rows that see none of
    the keys get (0, -inf), the ⊕'s identity. ``running``: a pipelined piece's running
    pairs (the keys before this block's, in the same layout; may be ``pairs`` itself),
    which the kernel's online softmax starts from, so ``pairs`` receives their ⊕ with this
    block's. Returns ``pairs``."""
    import torch  # heavy: only the GPU path
    opts = dict(window=window, softcap=softcap, mask=mask, mask_kind=mask_kind, bias=bias,
                bias_kind=bias_kind)
    _check(q, k, v, None, segments, None, q_offset, k_offset, opts)
    want = tuple(q.shape[:-1]) + (v.shape[-1], 2)
    if tuple(pairs.shape) != want or pairs.dtype != torch.float32:
        raise ShapeError(f"attention_pairs: pairs must be float32 {want}, got "
                         f"{tuple(pairs.shape)} {pairs.dtype}")
    if not pairs.is_contiguous():
        raise ShapeError("attention_pairs: pairs must be contiguous")
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)
    if q.numel() == 0:
        return pairs
    # the o half as [B, H, S, D] with a head-dim stride of 2: its strides address the pairs
    o4 = build.as_bhsd(pairs[..., 0])
    _launch(q, k, v, pairs, o4, None, causal, segments, scale, q_offset, k_offset, config,
            pairs=True, opts=opts, running=running)
    return pairs


def as_b4(x, q, kind):
    """A mask or bias as [batch, heads, rows, keys] strides over q's flattened batch dims
    (0 where broadcast): keys masks [..., Sk] and ALiBi slopes [..., Hq] too."""
    import torch  # heavy: only the GPU path
    nb = q.dim() - 3
    batch = tuple(q.shape[:nb])
    if kind == "keys":
        x = x.expand(*batch, x.shape[-1]).reshape(-1, 1, 1, x.shape[-1])
    elif kind == "alibi":
        x = x.expand(*batch, x.shape[-1]).reshape(-1, x.shape[-1], 1, 1)
    else:
        x = x.expand(*batch, *x.shape[nb:]).reshape(-1, *x.shape[nb:])
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)   # a byte per element, loaded as ints
    return x, tuple(st if n > 1 else 0 for st, n in zip(x.stride(), x.shape))


def _launch(q, k, v, out, o4, lse, causal, segments, scale, q_offset, k_offset, config,
            pairs, opts=None, rows=None, running=None):
    o = opts or {}
    window, softcap = o.get("window"), o.get("softcap")
    mask, mask_kind, bias, bias_kind = (o.get(n) for n in ("mask", "mask_kind", "bias",
                                                            "bias_kind"))
    interpret = build.interpret_for(q, k, v, out)
    seg = segments is not None
    variant = (window is not None, softcap is not None, mask_kind, bias_kind)
    fwd, _ = _compiled(q.dtype, bool(causal), seg, lse is not None, interpret, pairs, variant,
                       running is not None)
    q4, k4, v4 = (build.as_bhsd(t) for t in (q, k, v))
    unit = 2 if pairs else 1
    if o4.data_ptr() != out.data_ptr() or (o4.stride(-1) != unit) or q4.stride(-1) != 1 \
            or k4.stride(-1) != 1 or v4.stride(-1) != 1:
        raise ShapeError("attention: tensors must have a unit stride in the head dim and "
                         "batch dims that flatten (contiguous tensors do)")
    bm, bn, warps, stages = config or config_for(q)
    nb, hq, sq, d = q4.shape
    sk, dv = k4.shape[-2], v4.shape[-1]
    m4, mst = as_b4(mask, q, mask_kind) if mask is not None else (q4, (0, 0, 0, 0))
    b4, bst = as_b4(bias, q, bias_kind) if bias is not None else (q4, (0, 0, 0, 0))
    wl = window - 1 if window is not None else 0
    a4 = build.as_bhsd(_running_pairs(running, q, v)[..., 0]) if running is not None else q4
    if seg:
        row_lo, row_hi = segment_rows(segments, q_offset, sq, q.device, rows, bool(causal))
    else:
        row_lo = row_hi = q4  # never read
    grid = (triton_cdiv(sq, bm), nb * hq)
    launch = build.launch_options(interpret, num_warps=warps, num_stages=stages)
    fwd[grid](q4, k4, v4, out if pairs else o4, lse if lse is not None else q4, row_lo,
              row_hi, m4, b4, q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0),
              k4.stride(1), k4.stride(2), v4.stride(0), v4.stride(1), v4.stride(2),
              o4.stride(0), o4.stride(1), o4.stride(2), *mst, *bst, hq, sq, sk,
              int(q_offset), int(k_offset), scale * _LOG2E, scale,
              float(softcap) if softcap is not None else 1.0, wl, wl,
              a4, a4.stride(0), a4.stride(1), a4.stride(2),
              G=hq // k4.shape[1], D=d, BLOCK_D=max(16, build.next_pow2(d)), DV=dv,
              BLOCK_DV=max(16, build.next_pow2(dv)), BLOCK_M=bm, BLOCK_N=bn, **launch)
    LAUNCHES["attention_pairs" if pairs else "attention"] += 1


def _running_pairs(running, q, v):
    """``running`` checked: a pipelined piece's running (o, lse) pairs, contiguous float32
    ``[..., Hq, Sq, Dv, 2]`` (the device IR's pair layout, as :func:`attention_pairs`
    writes them)."""
    import torch  # heavy: only the GPU path
    want = tuple(q.shape[:-1]) + (v.shape[-1], 2)
    if tuple(running.shape) != want or running.dtype != torch.float32 or \
            not running.is_contiguous() or running.device != q.device:
        raise ShapeError(f"attention: running pairs must be contiguous float32 {want} on "
                         f"{q.device}, got {tuple(running.shape)} {running.dtype} on "
                         f"{running.device}")
    return running


def triton_cdiv(a, b):
    return (a + b - 1) // b


def combine_lse(o1, lse1, o2, lse2, out, lse_out):
    """``out, lse_out = (o1, lse1) ⊕ (o2, lse2)``: the exact combination of two attention
    partials over disjoint key sets (each normalized over its own keys, with its float32 row
    log-sum-exp). ``out`` may be ``o1`` or ``o2`` (in place). Rows with no key in either
    partial come out 0 with lse -inf. Returns ``(out, lse_out)``."""
    import torch  # heavy: only the GPU path
    for n, t in (("o2", o2), ("out", out)):
        if t.shape != o1.shape:
            raise ShapeError(f"combine_lse: {n} has shape {tuple(t.shape)}, o1 "
                             f"{tuple(o1.shape)}")
    for n, t in (("lse1", lse1), ("lse2", lse2), ("lse_out", lse_out)):
        if tuple(t.shape) != tuple(o1.shape[:-1]) or t.dtype != torch.float32:
            raise ShapeError(f"combine_lse: {n} must be float32 {tuple(o1.shape[:-1])}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    for n, t in (("o1", o1), ("o2", o2), ("out", out), ("lse1", lse1), ("lse2", lse2),
                 ("lse_out", lse_out)):
        if not t.is_contiguous():
            raise ShapeError(f"combine_lse: {n} must be contiguous")
    interpret = build.interpret_for(o1, o2, out, lse1, lse2, lse_out)
    _, comb = _compiled(o1.dtype, False, False, False, interpret)
    d = o1.shape[-1]
    rows = o1.numel() // max(d, 1)
    br = 16 if interpret else 32
    comb[(triton_cdiv(rows, br),)](o1, lse1, o2, lse2, out, lse_out, rows, D=d, BLOCK_R=br,
                                  BLOCK_D=build.next_pow2(max(d, 1)), **build.LAUNCH_OPTIONS)
    LAUNCHES["combine_lse"] += 1
    return out, lse_out
