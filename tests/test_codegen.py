"""eins/codegen: the generated numpy program computes what the numpy backend and eins.jit
compute; the generated CUDA host programs are valid Python naming exactly the device IR's
kernels and transfers; the expression table's two dialects agree (no GPU needed)."""
import ast
import importlib
import sys

import numpy as np
import pytest

import eins
from eins.codegen import expressions as ex
from eins.codegen.generate import generate, triton_kernel_sources
from eins.errors import EinsError
from eins.ir.device import Kernel, Load, Recv, Send, Store
from eins.models import chains, llama
from eins.ops.elementwise import BINARY, COMPARE, UNARY
from eins.ops.registry import get_primitive
from eins.runtime.numpy_backend import execute
from helpers import accumulation, assert_close

PS = [1, 2, 4, 8]


def acc(dp):
    """The tolerance options of ``dp``'s program: its longest accumulation and how many it
    chains (block kernels and BLAS may sum in another order than the whole-tensor run)."""
    n, depth = accumulation(dp.program)
    return {"n": n, "depth": depth}


def ffn(x, w1, b1, w2):
    # a size-1 broadcast operand (b1) and a scalar literal (0.5) on purpose
    h = eins.gelu(x @ w1 + b1, approximate=False)
    return (h * 0.5) @ w2 + x


def _workloads():
    rng = np.random.default_rng(0)
    f32 = np.float32
    ffn_args = (rng.standard_normal((8, 16)).astype(f32), rng.standard_normal((16, 24)).astype(f32),
                rng.standard_normal(24).astype(f32), rng.standard_normal((24, 16)).astype(f32))
    cfg = llama.TINY
    w = llama.init_weights(cfg, rng)
    segs = (4, 12, 16)
    x = rng.standard_normal((16, cfg.d_model)).astype(f32)
    cos, sin = llama.rope_tables(16, cfg.head_dim, segs)
    c = chains.chain("B", scale=1024)
    return {"ffn": (ffn, ffn_args),
            "llama": (llama.block_fn(cfg, segs), (x, w, cos, sin)),
            "chainB": (c.fn, tuple(c.arrays()))}


WORKLOADS = _workloads()
_LOWERED = {}


def lowered(name, p):
    """(device program, flat inputs) of a workload on p devices (cached per module)."""
    if (name, p) not in _LOWERED:
        fn, args = WORKLOADS[name]
        low = eins.distribute(fn, devices=p).lower(*args)
        _LOWERED[name, p] = (low.physical.device, eins.tree_flatten(args)[0])
    return _LOWERED[name, p]


# ----------------------------------------------------------------------------- numpy target
@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("p", PS)
def test_numpy_target_equals_backend_and_jit(name, p):
    dp, flat = lowered(name, p)
    gp = generate(dp, "numpy")
    got = gp.run(flat)
    want, stats = execute(dp, flat)
    assert stats.kernels == sum(isinstance(i, Kernel) for c in dp.code.values() for i in c)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        # same walk, same block kernels; only the elementwise expressions are written anew
        # (e.g. silu as x/(1+exp(-x)) instead of x*exp(-logaddexp(0,-x))): a few ulp
        assert_close(g, w, **acc(dp))
    fn, args = WORKLOADS[name]
    ref = eins.tree_flatten(eins.jit(fn)(*args))[0]
    for g, r in zip(got, ref):
        assert_close(g, r, **acc(dp))


def test_numpy_target_is_exactly_the_backend_without_rewritten_expressions():
    # chain B has matmuls only: the generated walk must reproduce the backend bit for bit
    dp, flat = lowered("chainB", 4)
    got = generate(dp, "numpy").run(flat)
    want, _ = execute(dp, flat)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_numpy_target_writes_an_importable_package(tmp_path):
    dp, flat = lowered("ffn", 2)
    gp = generate(dp, "numpy")
    paths = gp.write(tmp_path / "ffn_p2")
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == [
        "__init__.py", "device_0.py", "device_1.py", "kernels.py"]
    sys.path.insert(0, str(tmp_path))
    try:
        pkg = importlib.import_module("ffn_p2")
        outs = pkg.run(flat, [], [(v.shape, v.dtype) for v in dp.program.outputs])
    finally:
        sys.path.remove(str(tmp_path))
        for m in [m for m in sys.modules if m.startswith("ffn_p2")]:
            del sys.modules[m]
    np.testing.assert_array_equal(outs[0], gp.run(flat)[0])


def test_generated_numpy_code_names_each_instruction_and_eqn():
    dp, _ = lowered("ffn", 2)
    src = generate(dp, "numpy").sources[0]
    assert "# k" in src and "= kernel eqn" in src and "gelu[approximate=False]" in src
    assert src.count("\n    # ") == len(dp.code[0])  # one comment per instruction


def test_run_refuses_wrong_inputs_by_name():
    dp, flat = lowered("ffn", 2)
    gp = generate(dp, "numpy")
    with pytest.raises(EinsError, match="expected 4 inputs, got 3"):
        gp.run(flat[:3])
    with pytest.raises(EinsError, match=r"input 0 has shape \(2, 2\), expected \(8, 16\)"):
        gp.run([np.zeros((2, 2), np.float32)] + list(flat[1:]))


def test_a_deadlocked_walk_is_reported():
    from eins.codegen.generate import drive

    def waits_forever():
        while True:
            yield

    with pytest.raises(EinsError, match=r"deadlocked: devices \[0\]"):
        drive({0: waits_forever()}, {})


# ----------------------------------------------------------------------------- cuda target
def _calls(src, attr, kw=None):
    """Calls ``<anything>.attr(...)`` (with keyword ``kw`` if given) in the syntax tree."""
    return sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
               and (kw is None or any(k.arg == kw for k in n.keywords))
               for n in ast.walk(ast.parse(src)))


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("p", PS)
def test_cuda_sources_compile_and_name_exactly_the_ir(name, p):
    dp, _ = lowered(name, p)
    gp = generate(dp, "cuda")
    assert set(gp.sources) == set(dp.devices) | {"kernels"}
    for key, src in gp.sources.items():
        compile(src, f"<{key}>", "exec")
    for d in dp.devices:
        code, src = dp.code.get(d, []), gp.sources[d]

        def count(t):
            return sum(isinstance(i, t) for i in code)
        launches = _calls(src, "triton_kernel") + _calls(src, "array_kernel")
        assert launches == count(Kernel)
        assert _calls(src, "memcpyPeerAsync") == count(Send)
        assert _calls(src, "wait_event") == count(Recv)
        assert _calls(src, "set", "stream") == count(Load)   # host -> device
        assert _calls(src, "get", "stream") == count(Store)  # device -> host
        # every buffer the IR describes is allocated up front
        tree = ast.parse(src)
        bufs = next(n for n in tree.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "BUFFERS")
        assert {k.value for k in bufs.value.keys} == set(dp.bufs.get(d, {}))
        # kernel runs are captured into graphs: every launch sits inside a segN function
        segs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                and n.name[3:].isdigit() and n.name.startswith("seg")]
        inside = sum(_calls(ast.unparse(s), "triton_kernel")
                     + _calls(ast.unparse(s), "array_kernel") for s in segs)
        assert inside == launches
        assert _calls(src, "segment") == len(segs)
    for ksrc in triton_kernel_sources(gp):
        fn = ast.parse(ksrc).body[0]
        assert isinstance(fn, ast.FunctionDef)
        assert ast.unparse(fn.decorator_list[0]) == "triton.jit"
        assert ksrc in gp.sources["kernels"]
    # each elementwise launch names a Triton kernel (or fallback) that the kernel module defines
    defined = {n.name for n in ast.parse(gp.sources["kernels"]).body
               if isinstance(n, ast.FunctionDef)}
    for d in dp.devices:
        for n in ast.walk(ast.parse(gp.sources[d])):
            if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "K" \
                    and n.attr.startswith(("ew_", "fb_", "agg_")):
                assert n.attr in defined


def test_ffn_uses_the_fallback_for_the_broadcast_bias_and_a_scalar_kernel_arg():
    dp, _ = lowered("ffn", 2)
    gp = generate(dp, "cuda")
    ks = gp.sources["kernels"]
    assert "def fb_eqn" in ks                     # x @ w1 + b1: b1 is broadcast
    scal = [k for k in triton_kernel_sources(gp) if "_val" in k]
    assert scal and "b = b_val.to(tl.float32)" in scal[0]  # h * 0.5: 0.5 a kernel argument


def test_unknown_target_and_dialect_are_refused_by_name():
    dp, _ = lowered("ffn", 1)
    with pytest.raises(EinsError, match="unknown target 'rocm'"):
        generate(dp, "rocm")
    with pytest.raises(EinsError, match="unknown dialect 'cuda_c'"):
        ex.render("exp", "cuda_c")
    with pytest.raises(EinsError, match="no elementwise expression for primitive 'matmul'"):
        ex.render("matmul", "numpy")
    with pytest.raises(EinsError, match="only the numpy target runs here"):
        generate(dp, "cuda").run([])


# ----------------------------------------------------------------------------- expressions
ALL_EW = list(UNARY) + list(BINARY) + list(COMPARE) + ["where", "astype"]


def _keys():
    out = []
    for prim in ALL_EW:
        if prim == "gelu":
            out += [("gelu", {"approximate": True}), ("gelu", {"approximate": False})]
        else:
            out.append((prim, {}))
    return out


class Node:
    """A recorded expression tree: operators and calls build nodes."""

    def __init__(self, op, *args):
        self.op, self.args = op, args

    def key(self):
        return (self.op,) + tuple(a.key() if isinstance(a, Node) else ("const", a)
                                  for a in self.args)

    def _b(op):  # noqa: N805
        return lambda s, o: Node(op, s, o)

    def _r(op):  # noqa: N805
        return lambda s, o: Node(op, o, s)

    __add__, __sub__, __mul__, __truediv__ = _b("+"), _b("-"), _b("*"), _b("/")
    __radd__, __rsub__, __rmul__, __rtruediv__ = _r("+"), _r("-"), _r("*"), _r("/")
    __lt__, __le__, __gt__, __ge__ = _b("<"), _b("<="), _b(">"), _b(">=")
    __eq__, __ne__ = _b("=="), _b("!=")
    __hash__ = object.__hash__

    def __neg__(self):
        return Node("neg", self)


class Recorder:
    """A fake ``np``/``tl``/``npx``/``libdevice``: attribute f is a call recording f under its
    neutral name (the inverse of the dialect table)."""

    def __init__(self, dialect, prefix):
        self.names = {v.split(".", 1)[1]: k for k, v in ex.DIALECTS[dialect].items()
                      if v.startswith(prefix + ".")}

    def __getattr__(self, f):
        return lambda *a: Node(self.names[f], *a)


def _tree(prim, params, dialect):
    src = ex.render(prim, dialect, params)
    ns = {"np": Recorder("numpy", "np"), "npx": Recorder("numpy", "npx"),
          "tl": Recorder("triton", "tl"), "libdevice": Recorder("triton", "libdevice")}
    ns.update({a: Node(a) for a in ex.operand_names(prim, params)})
    r = eval(src, ns)  # noqa: S307 - our own rendering
    return r.key() if isinstance(r, Node) else r


def test_every_elementwise_primitive_has_an_expression():
    assert {ex.key_of(p, q) for p, q in _keys()} == set(ex.EXPRESSIONS)


@pytest.mark.parametrize("prim,params", _keys())
def test_numpy_and_triton_renderings_have_the_same_tree(prim, params):
    np_src, tl_src = ex.render(prim, "numpy", params), ex.render(prim, "triton", params)
    assert "tl." not in np_src and "np." not in tl_src
    assert _tree(prim, params, "numpy") == _tree(prim, params, "triton")


def test_dialect_spellings():
    assert ex.render("exp", "triton") == "tl.exp(x)"
    assert ex.render("exp", "numpy") == "np.exp(x)"
    assert ex.render("where", "triton") == "tl.where(c, x, y)"
    assert ex.render("maximum", "numpy", names=["p", "q"]) == "np.maximum(p, q)"
    assert ex.render("tanh", "triton") == "libdevice.tanh(x)"


def _inputs(prim, rng, dtype):
    n = 64
    if prim == "where":
        return [rng.random(n) < 0.5, rng.standard_normal(n).astype(dtype),
                rng.standard_normal(n).astype(dtype)]
    arity = 1 if prim in UNARY or prim == "astype" else 2
    xs = [rng.standard_normal(n).astype(dtype) for _ in range(arity)]
    if prim in ("log", "sqrt", "rsqrt", "pow"):
        xs[0] = np.abs(xs[0]) + np.asarray(0.1, dtype)
    if prim in ("equal", "not_equal"):
        xs[1][::3] = xs[0][::3]  # some equal pairs
    return xs


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("prim,params", _keys())
def test_numpy_rendering_matches_the_reference_kernel(prim, params, dtype):
    rng = np.random.default_rng(7)
    xs = _inputs(prim, rng, dtype)
    if prim == "astype":
        params = {"dtype": np.dtype(np.float64)}
    prim_obj = get_primitive(prim)
    want = prim_obj.impl(*xs, **params)[0]
    dts = ex.dtypes_for(prim, [x.dtype for x in xs], want.dtype)
    ns = {"np": np}
    exec(ex.NPX_PRELUDE, ns)
    for a, x, c in zip(ex.operand_names(prim, params), xs, dts.compute):
        ns[a] = x.astype(c)
    with np.errstate(all="ignore"):
        got = np.asarray(eval(ex.render(prim, "numpy", params), ns)).astype(dts.out)  # noqa: S307
    assert got.dtype == want.dtype
    assert_close(got, want, n=4, dtype=want.dtype)  # a rewritten formula: a few ulp apart


def test_dtypes_follow_the_reference_casts():
    f16, f32, i32 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.int32)
    assert ex.dtypes_for("exp", [f16], f16) == ex.EwDtypes((f32,), f16)   # low precision in f32
    assert ex.dtypes_for("div", [i32, i32], np.float64).compute == (np.float64, np.float64)
    assert ex.dtypes_for("less", [f16, f32], np.bool_).compute == (f32, f32)
    assert ex.dtypes_for("astype", [f32], f16).compute == (f32,)
    assert ex.triton_dtype(np.bool_) == "tl.int1"
    with pytest.raises(EinsError, match="dtype complex64 has no Triton equivalent"):
        ex.triton_dtype(np.complex64)


# ----------------------------------------------------------------------------- CuPy ports
def _ports_with_numpy():
    from eins.codegen.generate import render_template
    ns = {"xp": np}
    exec(render_template("cupy_ports.py.j2"), ns)
    return ns


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_cupy_ports_run_with_numpy_equal_the_block_kernels(name):
    # the ports' text, with xp = numpy, on every non-elementwise Kernel of the 4-device IR
    ns = _ports_with_numpy()
    dp, _ = lowered(name, 4)
    prog = dp.program
    rng = np.random.default_rng(3)
    seen = set()
    for d in dp.devices:
        for ins in dp.code.get(d, []):
            if not isinstance(ins, Kernel) or ex.is_elementwise(prog.eqns[ins.eqn].prim):
                continue
            eqn = prog.eqns[ins.eqn]
            blocks = [rng.standard_normal(b.shape).astype(v.dtype)
                      for b, v in zip(ins.fspec.inputs, eqn.inputs)]
            want = get_primitive(eqn.prim).run_block(ins.fspec, *blocks, **eqn.params)
            got = ns["port"](eqn.prim)(ins.fspec, *blocks, **eqn.params)
            for g, w, v in zip(got, want, eqn.outputs):
                assert_close(np.asarray(g, v.dtype), w, **acc(dp))
            seen.add(eqn.prim)
    assert seen  # every workload has some


def test_a_primitive_without_a_port_is_named():
    ns = _ports_with_numpy()
    with pytest.raises(NotImplementedError, match="no CuPy port of primitive 'cumsum'"):
        ns["port"]("cumsum")


# ------------------------------------------------------------------ CUDA target, emulated
# No GPU here: run the generated CUDA host programs and the real Triton kernel bodies on
# numpy through small stand-ins for the parts of cupy, triton and triton.language they use.
# This checks the walk (allocation, offsets/strides of every copy, which peer buffer each
# send fills, graph segments, frees) and the kernels' index arithmetic; it cannot check CUDA
# itself (streams, events, capture), which the stand-ins only mimic in program order.
import types  # noqa: E402


class T(np.ndarray):
    """A Triton block value: a numpy array with ``.to(dtype)``."""

    def to(self, dt):
        return np.asarray(self).astype(dt).view(T)


def _t(x):
    return np.asarray(x).view(T)


class _Ptr:
    """A pointer into a flat buffer, plus offsets."""

    def __init__(self, flat, idx=0):
        self.flat, self.idx = flat, idx

    def __add__(self, off):
        return _Ptr(self.flat, np.asarray(self.idx) + np.asarray(off))


def _load(p, mask=None):
    idx = np.asarray(p.idx)
    m = np.ones(idx.shape, bool) if mask is None else np.asarray(mask)
    vals = p.flat[np.where(m, idx, 0)]
    return _t(np.where(m, vals, np.zeros((), vals.dtype)))


def _store(p, val, mask=None):
    idx = np.asarray(p.idx)
    m = np.ones(idx.shape, bool) if mask is None else np.asarray(mask)
    v = np.broadcast_to(np.asarray(val), idx.shape)
    p.flat[idx[m]] = v[m]


class _Jit:
    """@triton.jit: ``kernel[grid](*args)`` runs the body once per program id."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kw):
            conv = [_Ptr(a.a.reshape(-1)) if hasattr(a, "data_ptr") else _t(a) for a in args]
            for pid in range(grid[0]):
                _TL.pid = pid
                self.fn(*conv, **kw)
        return launch


def _fake_tl():
    from eins.ops.elementwise import _erf
    tl = types.ModuleType("triton.language")
    tl.pid = 0
    tl.constexpr = int
    tl.program_id = lambda axis: tl.pid
    tl.arange = lambda a, b: _t(np.arange(a, b))
    tl.load, tl.store = _load, _store
    tl.zeros_like = lambda x: _t(np.zeros_like(np.asarray(x)))
    for f in ("exp", "log", "sqrt", "abs", "cos", "sin", "maximum", "minimum", "where"):
        setattr(tl, f, (lambda g: lambda *a: _t(g(*[np.asarray(x) for x in a])))(getattr(np, f)))
    tl.rsqrt = lambda x: _t(1 / np.sqrt(np.asarray(x)))
    tl.erf = lambda x: _t(_erf(np.asarray(x)).astype(np.asarray(x).dtype))
    for name, dt in [("float16", np.float16), ("float32", np.float32), ("float64", np.float64),
                     ("int1", np.bool_), ("int32", np.int32), ("int64", np.int64)]:
        setattr(tl, name, np.dtype(dt))
    return tl


_TL = _fake_tl()


class _CpArray(np.ndarray):
    _registry: dict = {}

    def set(self, host, stream=None):
        self[...] = host

    def get(self, stream=None):
        return np.array(self).view(np.ndarray)

    @property
    def data(self):
        _CpArray._registry[id(self)] = self
        return types.SimpleNamespace(ptr=id(self))


class _Stream:
    def __init__(self, non_blocking=False):
        self.ptr = id(self)

    def synchronize(self):
        pass

    def wait_event(self, ev):
        assert isinstance(ev, _Event)

    def begin_capture(self):
        pass

    def end_capture(self):
        # the stand-in ran the captured kernels eagerly; replaying them is then a no-op
        return types.SimpleNamespace(launch=lambda stream=None: None)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Event:
    def __init__(self, disable_timing=False):
        pass

    def record(self, stream):
        pass


def _memcpy_peer(dst, dst_dev, src, src_dev, nbytes, stream):
    d, s = _CpArray._registry[dst], _CpArray._registry[src]
    assert d.nbytes == s.nbytes == nbytes and d.dtype == s.dtype and dst_dev != src_dev
    d[...] = s


def _fake_modules():
    cp = types.ModuleType("fakecupy")
    cp.__getattr__ = lambda name: getattr(np, name)
    cp.empty = lambda s, dt: np.empty(s, dt).view(_CpArray)
    cp.asarray = lambda a, dt=None: np.asarray(a, dt).view(_CpArray)
    cp.lib = np.lib
    Stream = _Stream
    Stream.null = _Stream()
    cp.cuda = types.SimpleNamespace(
        Device=lambda d: types.SimpleNamespace(use=lambda: None), Stream=Stream, Event=_Event,
        runtime=types.SimpleNamespace(memcpyPeerAsync=_memcpy_peer, CUDARuntimeError=RuntimeError,
                                      deviceCanAccessPeer=lambda a, b: 1,
                                      deviceEnablePeerAccess=lambda peer: None),
        set_allocator=lambda malloc: None,
        MemoryAsyncPool=lambda: types.SimpleNamespace(malloc=None))
    torch = types.ModuleType("torch")  # Triton's stream comes from torch.cuda
    torch.cuda = types.SimpleNamespace(stream=lambda s: _Stream(), ExternalStream=lambda ptr: ptr)
    triton = types.ModuleType("triton")
    triton.jit = _Jit
    triton.cdiv = lambda a, b: -(-a // b)
    triton.language = _TL
    extra = types.ModuleType("triton.language.extra")
    extra.libdevice = types.SimpleNamespace(
        tanh=lambda x: _t(np.tanh(np.asarray(x))),
        pow=lambda a, b: _t(np.power(np.asarray(a), np.asarray(b))))
    return {"cupy": cp, "triton": triton, "triton.language": _TL, "torch": torch,
            "triton.language.extra": extra}


def run_cuda_emulated(gp, flat, graphs, monkeypatch, devs=None):
    """Run the CUDA target's sources on the stand-ins (again on ``devs`` if given)."""
    for name, mod in _fake_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    kern = types.ModuleType("eins_gen_kernels")
    exec(compile(gp.sources["kernels"], "<kernels>", "exec"), kern.__dict__)
    if devs is None:
        devs = {}
        for d in gp.dp.devices:
            m = types.ModuleType(f"eins_gen_dev{d}")
            exec(compile(gp.sources[d], f"<device {d}>", "exec"), m.__dict__)
            m.K = kern
            devs[d] = m.Device()
    outs = [np.zeros(v.shape, v.dtype) for v in gp.dp.program.outputs]
    run_cuda_emulated.devices = devs
    return kern.drive(devs, flat, [], outs, graphs=graphs)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("p", [1, 4, 8])
def test_cuda_target_emulated_on_numpy_equals_the_backend(name, p, graphs, monkeypatch):
    dp, flat = lowered(name, p)
    got = run_cuda_emulated(generate(dp, "cuda"), flat, graphs, monkeypatch)
    want, _ = execute(dp, flat)
    for g, w in zip(got, want):
        assert_close(g, w, **acc(dp))


def test_emulated_triton_copy_kernel_moves_a_strided_box(monkeypatch):
    # copy_3d on its own: box [1:3, 0:2, 2:5] of a (3, 4, 5) array into a (2, 2, 3) array
    dp, _ = lowered("chainB", 1)
    for name, mod in _fake_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    kern = types.ModuleType("k")
    exec(compile(generate(dp, "cuda").sources["kernels"], "<kernels>", "exec"), kern.__dict__)
    src = np.arange(60, dtype=np.float32).reshape(3, 4, 5).view(_CpArray)
    dst = np.zeros((2, 2, 3), np.float32).view(_CpArray)
    off = 1 * 20 + 0 * 5 + 2
    kern.copy_3d[(1,)](kern.ptr(src), kern.ptr(dst), 12, off, 0, 2, 20, 6, 2, 5, 3, 3, 1, 1,
                       BLOCK=8)  # one program of 8: only the box's first 8 elements
    box = np.asarray(src)[1:3, 0:2, 2:5]
    np.testing.assert_array_equal(np.asarray(dst).ravel(), np.r_[box.ravel()[:8], np.zeros(4)])
    kern.copy_3d[(2,)](kern.ptr(src), kern.ptr(dst), 12, off, 0, 2, 20, 6, 2, 5, 3, 3, 1, 1,
                       BLOCK=8)  # two programs: the mask keeps the second inside the box
    np.testing.assert_array_equal(np.asarray(dst), box)
    assert np.asarray(src).sum() == np.arange(60).sum()  # the source is untouched


def test_emulated_frees_release_buffers_and_graphs_capture_each_kernel_run(monkeypatch):
    from eins.ir.device import Free
    dp, flat = lowered("llama", 4)
    gp = generate(dp, "cuda")
    first = run_cuda_emulated(gp, flat, False, monkeypatch)
    devs = run_cuda_emulated.devices
    for d, dev in devs.items():
        freed = {i.buf for i in dp.code[d] if isinstance(i, Free)}
        assert freed and {n for n, b in dev.B.items() if b is None} == freed
    # a second eager run on the same devices allocates the freed buffers again
    again = run_cuda_emulated(gp, [2 * a for a in flat], False, monkeypatch, devs)
    want, _ = execute(dp, [2 * a for a in flat])
    assert_close(again[0], want[0], **acc(dp))
    assert not np.allclose(again[0], first[0])
    run_cuda_emulated(gp, flat, True, monkeypatch)
    for d, dev in run_cuda_emulated.devices.items():
        assert all(b is not None for b in dev.B.values())  # graphs hold the addresses
        nseg = gp.sources[d].count("self.segment(")
        assert len(dev.captured) == nseg > 0


def test_float16_ffn_on_both_targets(monkeypatch):
    rng = np.random.default_rng(1)
    args = [(rng.standard_normal(s) / 4).astype(np.float16)
            for s in [(8, 16), (16, 24), (24,), (24, 16)]]
    dp = eins.distribute(ffn, devices=4).lower(*args).physical.device
    want, _ = execute(dp, args)
    assert want[0].dtype == np.float16
    for got in (generate(dp, "numpy").run(args),
                run_cuda_emulated(generate(dp, "cuda"), args, False, monkeypatch)):
        assert got[0].dtype == np.float16
        # elementwise ops compute in float32 and round once; one float16 ulp apart at most
        assert_close(got[0], want[0], **acc(dp))


def test_cuda_capture_without_torch_is_refused_by_name(monkeypatch):
    dp, flat = lowered("ffn", 2)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    mods = _fake_modules()
    del mods["torch"]
    gp = generate(dp, "cuda")
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    kern = types.ModuleType("k")
    exec(compile(gp.sources["kernels"], "<kernels>", "exec"), kern.__dict__)
    devs = {}
    for d in dp.devices:
        m = types.ModuleType(f"d{d}")
        exec(compile(gp.sources[d], f"<device {d}>", "exec"), m.__dict__)
        m.K = kern
        devs[d] = m.Device()
    outs = [np.zeros(v.shape, v.dtype) for v in dp.program.outputs]
    with pytest.raises(RuntimeError, match="Triton launches into a CUDA graph needs torch"):
        kern.drive(devs, flat, [], outs, graphs=True)
    # eagerly, without torch, Triton launches on the default stream between synchronizations
    for d in dp.devices:
        devs[d] = type(devs[d])()
    got = kern.drive(devs, flat, [], [np.zeros(v.shape, v.dtype) for v in dp.program.outputs],
                     graphs=False)
    assert_close(got[0], execute(dp, flat)[0][0], **acc(dp))


def test_cuda_package_written_to_disk_runs_on_the_stand_ins(tmp_path, monkeypatch):
    dp, flat = lowered("llama", 2)
    gp = generate(dp, "cuda")
    gp.write(tmp_path / "llama_cuda")
    for name, mod in _fake_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        pkg = importlib.import_module("llama_cuda")
        outs = pkg.run(flat, [], [(v.shape, v.dtype) for v in dp.program.outputs], graphs=True)
    finally:
        for m in [m for m in sys.modules if m.startswith("llama_cuda")]:
            del sys.modules[m]
    assert_close(outs[0], execute(dp, flat)[0][0], **acc(dp))


def test_literals_and_identifiers_in_generated_source():
    from eins.codegen.generate import ident, py
    from eins.ir.types import bfloat16
    ns = {"np": np, "bfloat16": bfloat16}
    for v in [float("-inf"), float("nan"), np.float32(1.5), np.int64(3), (1,), (2, (3.5, None)),
              np.dtype(np.float16), bfloat16, True, "s"]:
        back = eval(py(v), ns)  # noqa: S307
        if isinstance(v, float) and v != v:
            assert back != back
        elif isinstance(v, np.dtype) or v is bfloat16:
            assert np.dtype(back) == np.dtype(v)
        else:
            assert back == v and type(back) is type(v.item() if isinstance(v, np.generic) else v)
    assert [ident(n) for n in ("k12", "in", "np", "a-b")] == ["k12", "b_in", "b_np", "b_a_b"]
