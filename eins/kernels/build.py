"""Render a Triton template, compile it once per (source, mode), and pick the mode from the
tensors: CUDA tensors get compiled Triton kernels, CPU tensors Triton's interpreter.

Why the mode is chosen per launch rather than by ``TRITON_INTERPRET``: ``triton.jit`` reads
that variable when a function is *decorated*, so a generated kernel is compiled (exec'd) here
inside ``triton.knobs.runtime.scope()`` with ``interpret`` set as the tensors need. The
standard-library helpers of ``triton.language`` (``tl.sum``, ``tl.max``, ``tl.zeros``,
``tl.cdiv``) were decorated when triton was imported, in whatever mode the process had then,
and an interpreted kernel cannot call compiled helpers; the templates therefore use only
builtins (``tl.reduce`` with the standard combine functions, passed but never called from
interpreted code; ``tl.full``), which work in both modes. The generated source is registered
in ``linecache`` because both the compiler and the interpreter read a kernel's source back
with ``inspect``.
"""
from __future__ import annotations

import hashlib
import linecache
import os

import numpy as np
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from eins.errors import DTypeError, EinsError
from eins.ir.types import as_dtype

# Every launch names Triton's fused multiply-add option: on, as the kernels were written
# for. Triton 3.9 defaults it on but warns that 3.10 turns it off by default
# (TRITON_DEFAULT_FP_FUSION), which would change the kernels' speed and rounding with an
# upgrade. The interpreter ignores launch options.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def launch_options(interpret: bool, **compiled) -> dict:
    """A launch's keyword options: :data:`LAUNCH_OPTIONS`, plus ``compiled`` (num_warps,
    num_stages) for a compiled kernel."""
    return dict(LAUNCH_OPTIONS) if interpret else dict(LAUNCH_OPTIONS, **compiled)


_TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
_ENV = Environment(loader=FileSystemLoader(_TEMPLATES), trim_blocks=True, lstrip_blocks=True,
                   keep_trailing_newline=True, undefined=StrictUndefined)

# @triton.jit helpers the generated kernels call (the Triton dialect of
# eins/kernels/expressions.py spells integer ** as _ipow; fused kernels cast to bfloat16
# through _to_bf16): in HEADER, and in the generated package's kernel module
# (templates/gpu_kernels.py.j2).
KERNEL_HELPERS = """\
@triton.jit
def _ipow(x, b):
    # integer x ** b by squaring: wrapping products, as numpy's. For b < 0 (numpy raises)
    # the truncated x ** b: 1 for x == 1, +-1 for x == -1, else 0; the kernel calling it
    # also records the exponent for its caller to raise numpy's error (fusion.py's
    # FusedKernel.checks), so no call returns these values
    r = x * 0 + 1
    a = x
    e = tl.where(b < 0, 0, b)
    for _ in tl.static_range(64):
        r = tl.where((e & 1) != 0, r * a, r)
        a = a * a
        e = e >> 1
    odd = (b & 1) != 0
    neg = tl.where(x == 1, r, tl.where(x == -1, tl.where(odd, -r, r), r * 0))
    return tl.where(b < 0, neg, r)


@triton.jit
def _fmod(a, b):
    # C's fmod (numpy's): the remainder with a's sign; integers by zero give 0, as numpy
    if a.dtype.is_floating():
        return libdevice.fmod(a, b)
    safe = tl.where(b == 0, 1, b)
    return tl.where(b == 0, 0, a % safe)


@triton.jit
def _mod(a, b):
    # numpy's remainder: the sign of b (fmod moved by b where the signs differ); a float
    # zero remainder takes b's sign; integers by zero give 0
    if a.dtype.is_floating():
        r = libdevice.fmod(a, b)
        r = tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
        return tl.where(r == 0, libdevice.copysign(r * 0, b), r)
    safe = tl.where(b == 0, 1, b)
    r = a % safe
    r = tl.where((r != 0) & ((r < 0) != (safe < 0)), r + safe, r)
    return tl.where(b == 0, 0, r)


@triton.jit
def _floordiv(a, b):
    # numpy's floor_divide: floats as npy_divmod ((a - fmod(a, b)) / b, moved down where the
    # remainder's sign differs from b's, then rounded); integers floor, by zero give 0
    if a.dtype.is_floating():
        m = libdevice.fmod(a, b)
        d = (a - m) / b
        d = tl.where((m != 0) & ((b < 0) != (m < 0)), d - 1.0, d)
        f = tl.floor(d)
        f = tl.where(d - f > 0.5, f + 1.0, f)
        f = tl.where(d == 0, libdevice.copysign(d * 0, a / b), f)
        return tl.where(b == 0, a / b, f)
    safe = tl.where(b == 0, 1, b)
    q = a // safe
    r = a - q * safe
    q = tl.where((r != 0) & ((r < 0) != (safe < 0)), q - 1, q)
    return tl.where(b == 0, 0, q)


@triton.jit
def _gcd(a, b):
    # numpy's gcd: Euclid's algorithm on |a|, |b|; 96 steps cover any int64 pair (the
    # Fibonacci worst case), and a finished element stays put (b == 0)
    a = tl.abs(a)
    b = tl.abs(b)
    for _ in range(96):
        safe = tl.where(b == 0, 1, b)
        r = tl.where(b == 0, 0, a % safe)
        a = tl.where(b == 0, a, b)
        b = r
    return a


@triton.jit
def _lcm(a, b):
    # numpy's lcm: |a / gcd(a, b) * b|, 0 where either is 0
    g = _gcd(a, b)
    return tl.where(g == 0, 0, tl.abs(a // tl.where(g == 0, 1, g) * b))


@triton.jit
def _popcount(x):
    # numpy's bitwise_count: the set bits of |x| (an arithmetic shift still reads each bit)
    a = tl.abs(x)
    n = (a & 1).to(tl.uint8)
    for k in tl.static_range(1, x.dtype.primitive_bitwidth):
        n += ((a >> k) & 1).to(tl.uint8)
    return n


@triton.jit
def _to_bf16(x):
    # every cast to bfloat16 of a fused kernel; the interpreter's prelude replaces it
    return x.to(tl.bfloat16)


@triton.jit
def _to_dtype(x, dt: tl.constexpr):
    # a kernel's final cast to its output's element type (resolved when compiled): to
    # bfloat16 through _to_bf16, as the fused kernels cast
    if dt == tl.bfloat16:
        return _to_bf16(x)
    return x.to(dt)


"""

HEADER = ("import triton\nimport triton.language as tl\n"
          "from triton.language.extra import libdevice\n\n\n" + KERNEL_HELPERS)

# combine functions for tl.reduce (tl.sum / tl.max are standard-library jit functions; see
# the module docstring). The interpreter recognizes these two by identity and reduces with
# numpy (any other combine function it calls once per element: 100x slower); compiled
# Triton inlines them as usual. Every template that reduces includes this prelude.
REDUCE_PRELUDE = """\
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max


"""

# triton.language.extra.libdevice holds stubs that the CUDA backend replaces when it
# compiles; under the interpreter they return None. The interpreter therefore gets stand-ins
# for the two functions the Triton dialect of eins/kernels/expressions.py spells through
# libdevice (tanh, pow), written with builtins, within a few ulps of numpy for float32 and
# narrower (tests/test_triton_semantics.py; float64 pow keeps exp2(b log2 a)'s error, up to
# ~1e-13 relative). Compiled kernels use CUDA's libdevice. It
# also gets its own _to_bf16 (KERNEL_HELPERS): its casts to bfloat16 from ints, bools and
# float64 reinterpret the values as bits.
INTERPRET_PRELUDE = """\
@triton.jit
def _ld_tanh(x):
    # tanh|x| = -em / (2 + em), em = expm1(-2|x|) by Kahan's (u - 1) * y / log(u), u = e**y:
    # accurate to a few ulps where (1 - e**-2|x|) / (1 + e**-2|x|) cancels (there tanh(1e-8) is 0)
    y = -2.0 * tl.abs(x)
    u = tl.exp(y)
    edge = (u == 1.0) | (u == 0.0)
    uc = tl.where(edge, 0.5, u)            # no 0/0 or log(0) in the branch not taken
    em = tl.where(u == 1.0, y, tl.where(u == 0.0, -1.0, (uc - 1.0) * y / tl.log(uc)))
    r = -em / (2.0 + em)
    # tanh(-0.0) is -0.0 and tanh(nan) the same nan, as numpy's
    return tl.where((x == 0) | (x != x), x, tl.where(x < 0, -r, r))


@triton.jit
def _ld_pow(a, b):
    # C's pow (what libdevice.pow computes), edge cases included: pow(1, nan) = 1,
    # pow(-1, +-inf) = 1, pow(-inf, 0.5) = inf, pow(-0.0, -1) = -inf
    absa = tl.abs(a)
    # |a| = 0 or inf takes its limit (0 or inf by b's sign, nan for a nan b), not
    # exp2(b * log2 0): numpy warns on log2(0) and 0 * inf under the interpreter
    edge = (absa == 0) | (absa == float("inf"))
    safe = tl.where(edge, 2.0, absa)
    # exp2(b * log2|a|) multiplies log2's rounding error by b * log2|a| (66 float32 ulps at
    # 10.0 ** 20): float32 and narrower compute it in float64 (float64 keeps that error)
    if a.dtype == tl.float64:
        m = tl.exp2(b * tl.log2(safe))
    else:
        m = tl.exp2(b.to(tl.float64) * tl.log2(safe.to(tl.float64))).to(a.dtype)
    lim = tl.where(tl.where(absa == 0, b > 0, b < 0), 0.0, float("inf"))
    m = tl.where(edge, tl.where(b != b, float("nan"), lim), m)
    b_int = tl.floor(b) == b
    odd = b_int & (tl.floor(b * 0.5) * 2.0 != b)
    if a.dtype == tl.float64:
        neg = a.to(tl.int64, bitcast=True) < 0   # the sign bit: -0.0 too
    else:
        neg = a.to(tl.float32).to(tl.int32, bitcast=True) < 0
    m = tl.where(neg & odd, -m, m)
    m = tl.where((a < 0) & (b_int == 0) & (absa != float("inf")), float("nan"), m)
    m = tl.where((absa == 1.0) & (tl.abs(b) == float("inf")), 1.0, m)
    m = tl.where(a == 1.0, 1.0, m)
    return tl.where(b == 0, 1.0, m)


@triton.jit
def _to_bf16(x):
    # the interpreter converts only float32 and float16 to bfloat16, and truncates (any
    # other dtype's values it took as bfloat16 bits): through float32, then rounded to
    # nearest even on the bits, as the GPU's cvt.rn.bf16.f32 and numpy's ml_dtypes round
    if x.dtype == tl.bfloat16:
        return x
    if x.dtype == tl.float32 or x.dtype == tl.float16:
        f = x.to(tl.float32)
        b = f.to(tl.uint32, bitcast=True)
    else:
        # ints, bools, float64: to float32 rounding to odd (truncate, then set the last bit
        # when inexact), so the rounding to bfloat16 below is the one correct rounding
        d = x.to(tl.float64)
        if x.dtype == tl.int64:   # past 2**53 the float64 rounds too: to odd as well
            back = d.to(tl.int64)
            big = tl.abs(d) >= 9223372036854775808.0   # 2**63: back would wrap (bf16: 2**63)
            inexact = (back != x) & (big == 0)
            db = d.to(tl.uint64, bitcast=True)
            db = tl.where(inexact & ((back > x) == (x > 0)), db - 1, db)
            d = tl.where(inexact, db | 1, db).to(tl.float64, bitcast=True)
        f = d.to(tl.float32)
        b = f.to(tl.uint32, bitcast=True)
        back = f.to(tl.float64)
        inexact = back != d
        b = tl.where(inexact & (tl.abs(back) > tl.abs(d)), b - 1, b)
        b = tl.where(inexact, b | 1, b)
        f = b.to(tl.float32, bitcast=True)
    r = b + 0x7FFF + ((b >> 16) & 1)
    r = tl.where(f != f, (b & 0x80000000) | 0x7FC00000, r)   # NaN: numpy's quiet NaN
    return (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def _np_math(fn):
    # the other libdevice functions, as numpy's on the interpreter's numpy-backed tensors
    # (the interpreter has no extern calls; compiled kernels call CUDA's libdevice)
    def call(*xs):
        import numpy as np
        from triton.runtime.interpreter import TensorHandle
        t = next(x for x in xs if isinstance(x, tl.tensor))
        dt = t.handle.data.dtype
        data = [x.handle.data if isinstance(x, tl.tensor) else np.asarray(x, dt) for x in xs]
        with np.errstate(all="ignore"):
            r = np.asarray(fn(*data))
        sc = tl.int1 if r.dtype == np.bool_ else t.dtype.scalar
        r = r if r.dtype == np.bool_ else r.astype(dt)
        ty = tl.block_type(sc, t.shape) if t.type.is_block() else sc
        return tl.tensor(TensorHandle(r, sc), ty)
    return call


class libdevice:
    import numpy as _n
    tanh = _ld_tanh
    pow = _ld_pow
    trunc, rint, cbrt = _np_math(_n.trunc), _np_math(_n.rint), _np_math(_n.cbrt)
    signbit, expm1 = _np_math(_n.signbit), _np_math(_n.expm1)
    log10, log1p, tan = _np_math(_n.log10), _np_math(_n.log1p), _np_math(_n.tan)
    asin, acos, atan = _np_math(_n.arcsin), _np_math(_n.arccos), _np_math(_n.arctan)
    sinh, cosh = _np_math(_n.sinh), _np_math(_n.cosh)
    asinh, acosh, atanh = _np_math(_n.arcsinh), _np_math(_n.arccosh), _np_math(_n.arctanh)
    atan2, hypot = _np_math(_n.arctan2), _np_math(_n.hypot)
    copysign, nextafter, fmod = _np_math(_n.copysign), _np_math(_n.nextafter), _np_math(_n.fmod)
    del _n


"""

_COMPILED: dict = {}


class KernelUnavailable(EinsError, RuntimeError):
    """Triton or torch is missing, or the tensors are on a device no kernel runs on."""


def need_torch_triton():
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        raise KernelUnavailable(f"the Triton kernels need torch and triton ({e.name} is "
                                f"missing): install the extra 'gpu-cuda12' or 'gpu-cuda13' on "
                                f"a GPU machine, or 'test' for the CPU interpreter") from None


def render(template: str, **ctx) -> str:
    return _ENV.get_template(template).render(**ctx)


def exec_source(source: str, filename: str, ns: dict) -> dict:
    """Exec ``source`` into ``ns`` as the file ``filename``, registered in ``linecache``:
    compiled Triton (and the interpreter) read a @jit function's source back at decoration
    and refuse one without it ("@jit functions should be defined in a Python file")."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), ns)
    return ns


# kernels built in this process: a source compiled (exec'd into a Triton JIT function), and on
# CUDA each Triton specialization compiled to a binary (its post-compile hook)
COUNTS = {"kernel_compiles": 0}


def _count_compile(*args, **kwargs):
    COUNTS["kernel_compiles"] += 1
    return False


def count_jit_compiles() -> None:
    """Count Triton's own compilations of a specialization (CUDA; the interpreter compiles
    nothing), unless the user installed a post-compile hook of their own."""
    from triton import knobs  # heavy: only the GPU path
    if knobs.runtime.jit_post_compile_hook is None:
        knobs.runtime.jit_post_compile_hook = _count_compile


def compile_source(source: str, name: str, interpret: bool):
    """Exec ``HEADER + source`` once per (source, mode); return its kernel ``name``."""
    key = (source, name, bool(interpret))
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    need_torch_triton()
    from triton import knobs  # heavy: only the GPU path
    COUNTS["kernel_compiles"] += 1
    full = HEADER + (INTERPRET_PRELUDE if interpret else "") + source
    digest = hashlib.sha1(full.encode()).hexdigest()[:12]
    filename = f"<eins-triton-{name}-{digest}>"
    ns: dict = {"__name__": f"eins_triton_{name}_{digest}"}
    with knobs.runtime.scope():
        knobs.runtime.interpret = bool(interpret)
        exec_source(full, filename, ns)
    if name not in ns:
        raise EinsError(f"generated Triton source defines no kernel {name!r}")
    _COMPILED[key] = ns[name]
    return ns[name]


def kernel(template: str, name: str, interpret: bool, **ctx):
    """Render ``template`` (its kernel is called ``name``) and compile it."""
    return compile_source(render(template, name=name, **ctx), name, interpret)


def interpret_for(*tensors) -> bool:
    """True (the interpreter) when every tensor is on the CPU, False when all are on CUDA."""
    kinds = {t.device.type for t in tensors if t is not None}
    if kinds == {"cpu"}:
        return True
    if kinds == {"cuda"}:
        return False
    raise KernelUnavailable(f"Triton kernels need all tensors on one CUDA device or all on the "
                            f"CPU (interpreter), got devices {sorted(kinds)}")


def cuda_capability(t) -> tuple:
    """(major, minor) of the tensor's GPU; (0, 0) on the CPU."""
    if t.device.type != "cuda":
        return (0, 0)
    import torch  # heavy: only the GPU path
    return torch.cuda.get_device_capability(t.device)


# dtype name -> Triton dtype: the one map of the launchers (:func:`tl_dtype`) and of the
# Triton dialect of eins/kernels/expressions.py (``triton_dtype``). Triton has every unsigned
# width (tl.uint8 ... tl.uint64, in 3.6 as in 3.9).
TRITON_DTYPES = {"float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32",
                 "float64": "tl.float64", "bool": "tl.int1", "int8": "tl.int8",
                 "int16": "tl.int16", "int32": "tl.int32", "int64": "tl.int64",
                 "uint8": "tl.uint8", "uint16": "tl.uint16", "uint32": "tl.uint32",
                 "uint64": "tl.uint64"}


def dtype_name(d) -> str:
    """A torch or numpy dtype's name ("float16", "bfloat16", ...)."""
    s = str(d)
    return s[len("torch."):] if s.startswith("torch.") else np.dtype(d).name


def tl_dtype(d) -> str:
    """The Triton dtype (source text) of a torch or numpy dtype, or of a dtype's name."""
    n = d if isinstance(d, str) else dtype_name(d)
    if n not in TRITON_DTYPES:
        raise DTypeError(f"no Triton dtype for {n}")
    return TRITON_DTYPES[n]


def acc_dtype_name(name: str) -> str:
    """The dtype (by name) that a ⊕ over blocks of dtype ``name`` accumulates in, its
    kernel's ``ACC``: float32 for float16 and bfloat16 (one rounding at the end; also the
    only way Triton's interpreter adds bfloat16 correctly), int32 for bool (a sum of bools
    cast back to bool is their or, as numpy's), the block's own dtype otherwise.
    The one rule of the generated fused kernels (eins/kernels/fusion.py) and the
    runtime's ⊕ launches (``triton_acc_dtype`` of eins/runtime/gpu_ops.py)."""
    if name == "bool":   # int1 addition wraps (True + True = False): numpy's bool sum is or
        return "int32"
    return "float32" if name in ("float16", "bfloat16") else name


def numpy_dtype(d) -> np.dtype:
    """The numpy dtype of a torch (or numpy) dtype; bfloat16 is ml_dtypes'."""
    return as_dtype(dtype_name(d))


def torch_dtype(d):
    """The torch dtype of a numpy dtype (bfloat16 from ml_dtypes included)."""
    import torch  # heavy: only the GPU path
    n = dtype_name(d)
    t = getattr(torch, "bool" if n == "bool" else n, None)
    if t is None:
        raise DTypeError(f"no torch dtype for {n}")
    return t


def dot_upcast(dtype, interpret: bool) -> str:
    """Source to append to ``tl.dot`` operands: triton 3.9's interpreter multiplies bfloat16
    operands as their raw uint16 bits, so interpreted bf16 dots take float32 copies in
    registers (exactly what the tensor cores compute: bf16 products are exact in fp32).
    Compiled kernels keep native bf16 dots."""
    return ".to(tl.float32)" if interpret and dtype_name(dtype) == "bfloat16" else ""


# A limit of the interpreter worked around: triton 3.9's interpreter truncates float32 ->
# bfloat16 casts, where compiled kernels (and numpy's ml_dtypes) round to nearest even.
# Every kernel's cast to bfloat16 goes through _to_bf16 (the fused kernels') or _to_dtype
# (the templates' final stores: matmul, attention, norms, rope, ⊕), which the interpreter's
# prelude makes round; compiled, both are the plain cast. (An attention's lse pairs and
# intermediate casts of other dtypes are not affected.)


def offset_expr(idx: str, shape, strides) -> str:
    """Source for the element offset of flat (row-major) index ``idx`` over ``shape`` in a
    tensor with ``strides`` (0 where it broadcasts): shapes are static per eqn, so the
    decomposition is rendered into the kernel as constants."""
    terms = []
    inner = 1
    for n, st in reversed(list(zip(shape, strides))):
        if n > 1 and st != 0:
            q = idx if inner == 1 else f"({idx} // {inner})"
            terms.append(f"({q} % {n}) * {st}")
        inner *= n
    return " + ".join(reversed(terms)) if terms else f"{idx} * 0"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def as_bhsd(t):
    """Attention's ``[..., H, S, D]`` tensor as a ``[B, H, S, D]`` view (a copy only if the
    batch dims do not flatten); the Triton and SDPA paths view their operands alike."""
    return t.reshape((-1,) + tuple(t.shape[-3:]))
