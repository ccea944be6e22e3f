"""rms_norm and rope on torch tensors: the templates ``triton_rms_norm.py.j2`` and
``triton_rope.py.j2`` with the semantics of eins/ops/norms.py and eins/ops/rope.py
(float32 statistics/products in registers, one rounding to the output dtype, which is the
operands' promoted dtype; no float32 copies of float16 tensors)."""
from __future__ import annotations

import hashlib

from eins.kernels import build
from eins.errors import DTypeError, ShapeError

_FLOATS = ("float16", "bfloat16", "float32")


def _promoted(op, *ts):
    import torch  # heavy: only the GPU path
    d = ts[0].dtype
    for t in ts[1:]:
        d = torch.promote_types(d, t.dtype)
    for t in ts:
        if build.dtype_name(t.dtype) not in _FLOATS:
            raise DTypeError(f"{op}: the Triton kernel takes float16, bfloat16 or float32, got "
                             f"{t.dtype}")
    return d


def rms_norm(x, weight, out, *, eps=1e-6, block_rows=None):
    """``out = weight * x / sqrt(mean(x*x, -1) + eps)`` over the last dim; x and out have
    contiguous rows (any row stride after flattening the leading dims). Returns ``out``."""
    d = x.shape[-1] if x.dim() else None
    if x.dim() < 1 or tuple(weight.shape) != (d,):
        raise ShapeError(f"rms_norm: weight must have shape ({d},) (x's last dim), got "
                         f"{tuple(weight.shape)} with x {tuple(x.shape)}")
    if out.shape != x.shape:
        raise ShapeError(f"rms_norm: out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
    want = _promoted("rms_norm", x, weight)
    if out.dtype != want:
        raise DTypeError(f"rms_norm: out must be {want} (x {x.dtype} with weight "
                         f"{weight.dtype}), got {out.dtype}")
    if out.numel() == 0:
        return out
    x2, o2 = x.reshape(-1, d), out.reshape(-1, d)
    if x2.stride(-1) != 1 or o2.stride(-1) != 1 or o2.data_ptr() != out.data_ptr() or \
            not weight.is_contiguous():
        raise ShapeError("rms_norm: rows of x and out must be contiguous and the leading dims "
                         "flatten")
    interpret = build.interpret_for(x, weight, out)
    name = f"rms_norm_{build.dtype_name(x.dtype)}_{build.dtype_name(out.dtype)}"
    src = build.render("triton_rms_norm.py.j2", name=name,
                        reduce_prelude=build.REDUCE_PRELUDE,
                        out_dtype=build.dtype_name(out.dtype))
    fn = build.compile_source(src, name, interpret)
    bd = build.next_pow2(d)
    br = block_rows or (16 if interpret else max(1, min(16, 4096 // bd)))
    rows = x2.shape[0]
    launch = build.launch_options(interpret, num_warps=8 if bd >= 4096 else 4)
    fn[((rows + br - 1) // br,)](x2, weight, o2, rows, d, x2.stride(0), o2.stride(0),
                                float(eps), BLOCK_R=br, BLOCK_D=bd, **launch)
    return out


def rope(x, cos, sin, out, *, block_rows=None):
    """``out = x * cos + rotate_half(x) * sin``; cos/sin broadcast against x; x and out may
    be strided views (a transposed x fuses the layout change). Returns ``out``."""
    import torch  # heavy: only the GPU path
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ShapeError(f"rope: the last dim of x must be even to rotate halves, got shape "
                         f"{tuple(x.shape)}")
    for n, t in (("cos", cos), ("sin", sin)):
        try:
            ok = tuple(torch.broadcast_shapes(x.shape, t.shape)) == tuple(x.shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ShapeError(f"rope: {n} of shape {tuple(t.shape)} does not broadcast against "
                             f"x of shape {tuple(x.shape)}")
    if out.shape != x.shape:
        raise ShapeError(f"rope: out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
    want = _promoted("rope", x, cos, sin)
    if out.dtype != want:
        raise DTypeError(f"rope: out must be {want}, got {out.dtype}")
    if out.numel() == 0:
        return out
    interpret = build.interpret_for(x, cos, sin, out)
    lead = tuple(x.shape[:-1])
    views = {"x": x, "cos": cos.expand(x.shape), "sin": sin.expand(x.shape), "out": out}
    tensors = [dict(var=v, row=build.offset_expr("r", lead, t.stride()[:-1]))
               for v, t in views.items()]
    names = [build.dtype_name(t.dtype) for t in (x, cos, sin, out)]
    src = build.render("triton_rope.py.j2", name="rope", tensors=tensors, lead=list(lead),
                        out_dtype=names[-1], last_strides="sx_d, sc_d, ss_d, so_d,")
    name = "rope_" + hashlib.sha1(src.encode()).hexdigest()[:10]
    src = src.replace("def rope(", f"def {name}(", 1)
    fn = build.compile_source(src, name, interpret)
    half = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1]
    bh = build.next_pow2(half)
    br = block_rows or (16 if interpret else max(1, min(32, 2048 // bh)))
    fn[((rows + br - 1) // br,)](x, views["cos"], views["sin"], out, rows, half,
                                x.stride(-1), views["cos"].stride(-1), views["sin"].stride(-1),
                                out.stride(-1), BLOCK_R=br, BLOCK_H=bh, **build.LAUNCH_OPTIONS)
    return out
