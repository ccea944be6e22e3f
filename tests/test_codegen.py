"""eins/codegen: the generated numpy program computes what the numpy backend and eins.jit
compute; the generated CUDA host programs are valid Python naming exactly the device IR's
kernels and transfers; the expression table's two dialects agree (no GPU needed)."""
import ast
import importlib
import re
import sys

import numpy as np
import pytest

import eins
from eins.kernels import expressions as ex
from eins.codegen.generate import generate, triton_kernel_sources
from eins.errors import EinsError
from eins.ir.device import Kernel, Load, Recv, Send, Store
from eins.models import llama
from eins.runtime.numpy_backend import execute
from helpers import SPREAD, accumulation, assert_close, assert_splits, small_workloads

PS = [1, 2, 4, 8]


def acc(dprog):
    """The tolerance options of ``dprog``'s program: its longest accumulation and how many it
    chains (block kernels and BLAS may sum in another order than the whole-tensor run)."""
    n, depth = accumulation(dprog.program)
    return {"n": n, "depth": depth}


# the packed LLaMA block stands for both layouts here ("llama")
WORKLOADS = {("llama" if k == "llama-packed" else k): v
             for k, v in small_workloads().items() if k != "llama-batched"}
_LOWERED = {}


def lowered(name, p):
    """(device program, flat inputs) of a workload on p devices (cached per module)."""
    if (name, p) not in _LOWERED:
        fn, args = WORKLOADS[name]
        low = eins.distribute(fn, devices=p, tuning=SPREAD).lower(*args)
        if p > 1:
            assert_splits(low)
        _LOWERED[name, p] = (low.physical.device, eins.tree_flatten(args)[0])
    return _LOWERED[name, p]


# ----------------------------------------------------------------------------- numpy target
@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("p", PS)
def test_numpy_target_equals_backend_and_jit(name, p):
    dprog, flat = lowered(name, p)
    gp = generate(dprog, "numpy")
    got = gp.run(flat)
    want, stats = execute(dprog, flat)
    assert stats.kernels == sum(isinstance(i, Kernel) for c in dprog.code.values() for i in c)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        # same walk, same block kernels; only the elementwise expressions are written anew
        # (e.g. silu as x/(1+exp(-x)) instead of x*exp(-logaddexp(0,-x))): a few ulp
        assert_close(g, w, **acc(dprog))
    fn, args = WORKLOADS[name]
    ref = eins.tree_flatten(eins.jit(fn)(*args))[0]
    for g, r in zip(got, ref):
        assert_close(g, r, **acc(dprog))


def test_numpy_target_is_exactly_the_backend_without_rewritten_expressions():
    # chain B has matmuls only: the generated walk must reproduce the backend bit for bit
    dprog, flat = lowered("chainB", 4)
    got = generate(dprog, "numpy").run(flat)
    want, _ = execute(dprog, flat)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_numpy_target_writes_an_importable_package(tmp_path):
    dprog, flat = lowered("ffn", 2)
    gp = generate(dprog, "numpy")
    paths = gp.write(tmp_path / "ffn_p2")
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == [
        "__init__.py", "device_0.py", "device_1.py", "kernels.py"]
    sys.path.insert(0, str(tmp_path))
    try:
        pkg = importlib.import_module("ffn_p2")
        outs = pkg.run(flat)
        # it records the traced types and checks against them, as GeneratedProgram.run: a
        # (1, n) operand was broadcast silently into a wrong answer, a float64 one cast
        bad = [flat[0][:1], *flat[1:]]
        with pytest.raises(EinsError, match=r"input 0 has shape \(1, \d+\), expected"):
            pkg.run(bad)
        with pytest.raises(EinsError, match=r"input 1 has dtype float64, expected float32"):
            pkg.run([flat[0], flat[1].astype(np.float64), *flat[2:]])
        with pytest.raises(EinsError, match=rf"expected {len(flat)} inputs, got 1"):
            pkg.run(flat[:1])
    finally:
        sys.path.remove(str(tmp_path))
        for m in [m for m in sys.modules if m.startswith("ffn_p2")]:
            del sys.modules[m]
    np.testing.assert_array_equal(outs[0], gp.run(flat)[0])


def test_written_numpy_package_carries_the_constants(tmp_path):
    """A function closing over arrays: the package holds them (consts.npz, bfloat16 by its
    bytes) and needs no consts argument (it raised IndexError with consts=[])."""
    from eins.ir.types import bfloat16
    rng = np.random.default_rng(1)
    c32 = rng.standard_normal((4, 6)).astype(np.float32)
    cbf = rng.standard_normal((6,)).astype(bfloat16)

    def f(x):
        return (x @ c32) * cbf.astype(np.float32)

    x = rng.standard_normal((8, 4)).astype(np.float32)
    low = eins.distribute(f, devices=2).lower(x)
    paths = low.generate("numpy").write(tmp_path / "withc")
    assert "consts.npz" in {p.rsplit("/", 1)[1] for p in paths}
    sys.path.insert(0, str(tmp_path))
    try:
        pkg = importlib.import_module("withc")
        np.testing.assert_array_equal(pkg.run([x])[0], eins.jit(f)(x))
    finally:
        sys.path.remove(str(tmp_path))
        for m in [m for m in sys.modules if m.startswith("withc")]:
            del sys.modules[m]


def test_generated_numpy_code_names_each_instruction_and_eqn():
    dprog, _ = lowered("ffn", 2)
    src = generate(dprog, "numpy").sources[0]
    assert "# k" in src and "= kernel eqn" in src and "gelu[approximate=False]" in src
    assert src.count("\n    # ") == len(dprog.code[0])  # one comment per instruction


def test_run_refuses_wrong_inputs_by_name():
    dprog, flat = lowered("ffn", 2)
    gp = generate(dprog, "numpy")
    with pytest.raises(EinsError, match="expected 4 inputs, got 3"):
        gp.run(flat[:3])
    with pytest.raises(EinsError, match=r"input 0 has shape \(2, 2\), expected \(8, 16\)"):
        gp.run([np.zeros((2, 2), np.float32)] + list(flat[1:]))
    # another dtype was cast silently into float32 buffers
    with pytest.raises(EinsError, match=r"input 1 has dtype float64, expected float32"):
        gp.run([flat[0], flat[1].astype(np.float64)] + list(flat[2:]))
    torch = pytest.importorskip("torch")   # an array-like keeps its dtype for the check
    with pytest.raises(EinsError, match=r"input 1 has dtype float64, expected float32"):
        gp.run([flat[0], torch.from_numpy(flat[1].astype(np.float64))] + list(flat[2:]))
    # a nested list of the right shape failed inside the generated device code
    want = gp.run(list(flat))
    got = gp.run([flat[0].tolist()] + list(flat[1:]))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(EinsError, match=r"input 0 \(list\) is not an array of float32\[8,16\]"):
        gp.run([[[1.0], [2.0, 3.0]]] + list(flat[1:]))   # ragged


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
    dprog, _ = lowered(name, p)
    gp = generate(dprog, "cuda")
    assert set(gp.sources) == set(dprog.devices) | {"kernels"}
    for key, src in gp.sources.items():
        compile(src, f"<{key}>", "exec")
    for d in dprog.devices:
        code, src = dprog.code.get(d, []), gp.sources[d]

        def count(t):
            return sum(isinstance(i, t) for i in code)
        ew = sorted(i.eqn for i in code if isinstance(i, Kernel)
                    and ex.is_elementwise(dprog.program.eqns[i.eqn].prim))
        # layout changes feeding a rope or an attention are folded into it as views (no
        # kernel, no buffer); those after an attention too: it writes the last one's buffer
        # through its inverse view (``[B['k'].view(...).permute(...)]``)
        written = set(re.findall(r"\[B\['([^']+)'\]\.view\(", src))
        folded = [i for i in code if isinstance(i, Kernel) and dprog.program.eqns[i.eqn].prim
                  in ("reshape", "transpose") and (f"B[{i.outs[0]!r}]" not in src
                                                   or i.outs[0] in written)]
        assert _calls(src, "reshape") + _calls(src, "permute") + _calls(src, "view") == \
            len(folded)
        assert _calls(src, "op") == count(Kernel) - len(ew) - len(folded)
        # elementwise kernels run fused: every one in exactly one fused launch, or (a
        # residual add) in its matmul's launch
        fused = [int(e) for m in re.findall(r"# eqns \[([\d, ]+)\] fused", src)
                 for e in m.split(",")]
        into_mm = [int(e) for e in re.findall(r"# eqn (\d+) fused in: a @ b \+ c", src)]
        assert all(dprog.program.eqns[e].prim == "add" for e in into_mm)
        assert sorted(fused + into_mm) == ew
        assert len(re.findall("# eqns", src)) == _calls(src, "ew")
        assert _calls(src, "send") == count(Send)
        assert _calls(src, "wait") == count(Recv)
        assert _calls(src, "load") == count(Load)    # host -> device
        assert _calls(src, "store") == count(Store)  # device -> host
        # every buffer the walk touches is allocated up front; only values a fused kernel
        # keeps in registers get no memory
        tree = ast.parse(src)
        bufs = next(n for n in tree.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "BUFFERS")
        allocated = {k.value for k in bufs.value.keys}
        touched = set(re.findall(r"B\['([^']+)'\]", src)) | \
            {i.dst for i in code if isinstance(i, Recv)} | \
            {i.dst for i in code if isinstance(i, Load)} | \
            {i.src for i in code if isinstance(i, (Store, Send))}
        assert allocated == touched and allocated <= set(dprog.bufs.get(d, {}))
        inner = set(dprog.bufs.get(d, {})) - allocated
        # ... or the product of a matmul whose residual add took it in (never written)
        into_add = {a for i in code if isinstance(i, Kernel) and i.eqn in into_mm
                    for a in i.ins if isinstance(a, str)}
        # ... or an attention writing through its output's folded layout change
        through = {f.ins[0] for f in folded}
        assert all(isinstance(i, Kernel) and (ex.is_elementwise(dprog.program.eqns[i.eqn].prim)
                                              or i in folded or set(i.outs) <= into_add
                                              or set(i.outs) <= through)
                   for i in code if isinstance(i, Kernel) and set(i.outs) & inner)
        # kernel runs are captured into graphs: every stream op sits inside a segN function,
        # and no host step or transfer does
        segs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                and n.name[3:].isdigit() and n.name.startswith("seg")]
        seg_src = "\n".join(ast.unparse(s) for s in segs)
        launches = _calls(src, "ew") + _calls(src, "op")
        stream_ops = sum(_calls(src, a) for a in ("ew", "op", "agg", "slice", "concat"))
        assert sum(_calls(seg_src, a) for a in ("ew", "op", "agg", "slice", "concat")) \
            == stream_ops
        assert sum(_calls(seg_src, a) for a in ("load", "store", "send", "wait")) == 0
        assert _calls(src, "segment") == len(segs)
        if p == 1:  # loads hoisted, stores sunk: one device program is one graph
            assert len(segs) == 1
    for ksrc in triton_kernel_sources(gp):
        fn = ast.parse(ksrc).body[0]
        assert isinstance(fn, ast.FunctionDef)
        assert ast.unparse(fn.decorator_list[0]) == "triton.jit"
        assert ksrc in gp.sources["kernels"]
    # each elementwise launch names a Triton kernel that the kernel module defines
    defined = {n.name for n in ast.parse(gp.sources["kernels"]).body
               if isinstance(n, ast.FunctionDef)}
    for d in dprog.devices:
        for n in ast.walk(ast.parse(gp.sources[d])):
            if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "K" \
                    and n.attr.startswith(("fused_", "agg_")):
                assert n.attr in defined


def test_ffn_fuses_its_elementwise_chain_with_the_literal_baked_in():
    dprog, _ = lowered("ffn", 1)
    gp = generate(dprog, "cuda")
    src = gp.sources[0]
    groups = [m.split(",") for m in re.findall(r"# eqns \[([\d, ]+)\] fused", src)]
    assert max(len(g) for g in groups) >= 2     # + b1, gelu, * 0.5: one kernel
    ks = "\n".join(triton_kernel_sources(gp))
    assert "tl.full([BLOCK], 0.5, tl.float32)" in ks


def test_unknown_target_and_dialect_are_refused_by_name():
    dprog, _ = lowered("ffn", 1)
    with pytest.raises(EinsError, match="unknown target 'rocm'"):
        generate(dprog, "rocm")
    with pytest.raises(EinsError, match="unknown dialect 'cuda_c'"):
        ex.render("exp", "cuda_c")
    with pytest.raises(EinsError, match="no elementwise expression for primitive 'matmul'"):
        ex.render("matmul", "numpy")
    with pytest.raises(EinsError, match="only the numpy target runs here"):
        generate(dprog, "cuda").run([])
    with pytest.raises(EinsError, match="no lowering of primitive 'nonesuch'"):
        from eins.runtime.gpu_ops import lowering
        lowering("nonesuch")


# ----------------------------------------------------------------------------- memory plan
def _plan_of(gp, d):
    ns = {}
    exec(gp.sources[d].split("# literal operands")[0], ns)  # noqa: S102 - our own source
    return ns["SLOTS"], ns["BUFFERS"]


@pytest.mark.parametrize("name,p", [("llama", 1), ("llama", 4), ("chainB", 8)])
def test_memory_plan_shares_only_disjoint_lifetimes(name, p):
    from eins.codegen import memory
    from eins.codegen.gpu_walk import gpu_walk
    dprog, _ = lowered(name, p)
    gp = generate(dprog, "cuda")
    for d in dprog.devices:
        code = dprog.code.get(d, [])
        slots, buffers = _plan_of(gp, d)
        walk = gpu_walk(dprog, d)
        # the walk's positions: loads first, stores last, fused members at their launch
        assert all(walk.positions[j] == memory.END for j, i in enumerate(code)
                   if isinstance(i, Store))
        assert all(walk.positions[j] == -1 for j, i in enumerate(code) if isinstance(i, Load))
        life = memory.lifetimes(code, walk.positions, set(buffers))
        pinned = {i.dst for i in code if isinstance(i, (Load, Recv))}
        assert walk.pinned == pinned
        by_slot = {}
        for b, (shape, dt, k) in buffers.items():
            assert slots[k] >= int(np.prod(shape)) * np.dtype(dt).itemsize
            by_slot.setdefault(k, []).append(b)
        for k, bs in by_slot.items():
            if len(bs) > 1:
                assert not set(bs) & pinned        # loads and receives keep their own memory
                # a residual add written in place over its residual c (walk.in_place) takes
                # c's slot at c's last read: one value, one span
                group, spans = {}, {}
                for b in sorted(bs, key=lambda b: life[b]):
                    c = walk.in_place.get(b)
                    assert c is None or (c in bs and life[c][1] == life[b][0])
                    group[b] = b if c is None else group[c]
                    s0, e0 = spans.get(group[b], life[b])
                    spans[group[b]] = (min(s0, life[b][0]), max(e0, life[b][1]))
                spans = sorted(spans.values())
                assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # never overlap
    if name == "llama" and p == 1:   # the block reuses memory at all
        slots, buffers = _plan_of(gp, 0)
        assert sum(slots.values()) < sum(int(np.prod(s)) * np.dtype(t).itemsize
                                         for s, t, _ in buffers.values())


def test_memory_plan_of_the_paper_block_at_128k_tokens_is_near_its_peak():
    # shape-only: the paper block, 1 x 128K tokens, float16, one GPU
    cfg = llama.PAPER
    s = 131072
    x = eins.ShapeDtype((s, cfg.d_model), "float16")
    cs = eins.ShapeDtype((s, cfg.head_dim), "float16")
    low = eins.distribute(llama.block_fn(cfg, None), devices=1).lower(
        x, llama.weight_shapes(cfg, "float16"), cs, cs)
    slots, buffers = _plan_of(low.generate("cuda"), 0)
    allocated = sum(slots.values())
    # every block the device IR makes, each in memory of its own (values a fused kernel
    # keeps in registers and layout changes folded into rope included)
    every = sum(i.box.size * i.dtype.itemsize for i in low.physical.device.bufs[0].values())
    peak = low.predicted_time()["peak_bytes"][0]   # the numpy executor's peak, with frees
    assert allocated < 0.6 * every and allocated < 1.5 * peak


# ----------------------------------------------------------------------------- dispatch
def test_every_codegen_walk_has_one_method_per_instruction():
    from eins.codegen.gpu_walk import GpuWalk
    from eins.codegen.numpy_walk import NumpyWalk
    from eins.ir.device import INSTRUCTIONS, InstrVisitor
    for walk in (NumpyWalk, GpuWalk):
        assert issubclass(walk, InstrVisitor)
        assert all(callable(getattr(walk, "visit_" + c.kind)) for c in INSTRUCTIONS)


@pytest.mark.parametrize("module,walk", [("eins.codegen.numpy_walk", "NumpyWalk"),
                                         ("eins.codegen.gpu_walk", "GpuWalk")])
def test_a_new_instruction_without_a_codegen_method_fails_at_import(monkeypatch, module, walk):
    """Adding an instruction to the device IR without its codegen methods is an error when
    the walk's module is imported, naming the walk and the missing method."""
    import dataclasses
    import importlib.util
    from typing import ClassVar

    from eins.ir import device
    orig = importlib.import_module(module)

    @dataclasses.dataclass(frozen=True)
    class Barrier(device.Instr):
        kind: ClassVar[str] = "barrier"

    monkeypatch.setattr(device, "INSTRUCTIONS", device.INSTRUCTIONS + (Barrier,))
    spec = importlib.util.spec_from_file_location(module + "_copy", orig.__file__)

    def load():  # a fresh copy of the module (its dataclasses need it in sys.modules)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, mod)
        spec.loader.exec_module(mod)
        return mod
    with pytest.raises(TypeError, match=f"{walk} has no method for instruction "
                                        "visit_barrier"):
        load()
    monkeypatch.setattr(device, "INSTRUCTIONS", device.INSTRUCTIONS[:-1])
    mod = load()      # the same source imports with the IR it covers
    assert getattr(mod, walk).__name__ == walk


# ------------------------------------------- found by a bug hunt of the generated packages
def test_writing_a_package_again_leaves_nothing_of_the_first(tmp_path):
    """The second write overwrote each file in place: device files of a program on more
    devices, its consts.npz and __pycache__ stayed (CPython checks bytecode by whole-second
    mtime and size, so a program differing in one literal could run the old bytecode)."""
    x = np.ones((8, 8), np.float32)
    c = np.full((8, 8), 2.0, np.float32)
    first = eins.distribute(lambda x: x * c, devices=4).lower(x).generate("numpy")
    second = eins.distribute(lambda x: x * 3.0, devices=2).lower(x).generate("numpy")
    d = tmp_path / "pkg"
    first.write(str(d))
    (d / "__pycache__").mkdir()
    (d / "__pycache__" / "kernels.cpython-311.pyc").write_bytes(b"stale")
    (d / "notes.txt").write_text("the user's")
    second.write(str(d))
    assert sorted(p.name for p in d.iterdir()) == ["__init__.py", "device_0.py",
                                                  "device_1.py", "kernels.py", "notes.txt"]


def test_generated_run_refuses_what_it_cannot_read():
    low = eins.distribute(lambda x: x + 1, devices=2).lower(np.ones((2, 2), np.int32))
    g = low.generate("numpy")
    from eins.errors import EinsError, OutputError
    with pytest.raises(EinsError, match="input 0 is a numpy masked array"):
        g.run([np.ma.masked_array(np.ones((2, 2), np.int32), mask=[[1, 0], [0, 0]])])
    with pytest.raises(EinsError, match="input 0 .* is not an array of int32"):
        g.run([[[2 ** 40, 0], [0, 0]]])   # a raw OverflowError
    with pytest.raises(EinsError, match=r"wrap one array in a list: \[x\]"):
        g.run(np.ones((2, 2), np.int32))   # "expected 1 inputs, got 2"
    for bad in (None, 3, b"/tmp/x"):
        with pytest.raises(OutputError, match="the directory must be a path"):
            g.write(bad)


def test_a_fused_sum_chain_is_one_kernel_for_every_device():
    """The fused kernel's docstring and comments named the device's buffers, so each of
    8 devices got its own copy of the same kernel (8 Triton compiles)."""
    x = np.ones((16, 16), np.float32)
    f = lambda x, w: eins.relu(x @ w)   # noqa: E731
    g = eins.distribute(f, devices=8, plan={0: {"r0": 8}, 1: {"d0": 8}}).lower(x, x
                                                                             ).generate("cuda")
    assert len(g.triton) == 1


def test_numpy_target_refuses_a_negative_integer_power_as_the_backends_do():
    """The numpy target spelled integer pow as np.power, so a runtime negative exponent was
    numpy's bare ValueError where jit, the numpy backend and interpret raise DTypeError."""
    a, b = np.array([2, 3, 4], np.int32), np.array([1, -1, -3], np.int32)
    gen = eins.distribute(lambda a, b: a ** b, devices=2).lower(a, b).generate("numpy")
    with pytest.raises(eins.DTypeError, match=r"pow: an integer base to the negative integer "
                                              r"power -(1|3)"):
        gen.run([a, b])
    ok = np.array([0, 5, 2], np.int32)
    np.testing.assert_array_equal(gen.run([a, ok])[0], a ** ok)
    x = np.array([1.5, 2.0, 0.5], np.float32)       # a float pow stays np.power
    np.testing.assert_array_equal(
        eins.distribute(lambda a, b: a ** b, devices=2).lower(x, x).generate("numpy")
        .run([x, -x])[0], x ** -x)


def test_a_list_input_of_another_kind_than_the_traced_dtype_is_refused():
    """A nested list is read in the traced dtype: [[1.7, 2.9], ...] for an int32 input was
    truncated to [[1, 2], ...] without a word, where the same data as a float64 array is
    refused by name."""
    x = np.ones((2, 2), np.int32)
    gen = eins.distribute(lambda a: a * 10, devices=2).lower(x).generate("numpy")
    with pytest.raises(EinsError, match=r"input 0 \(list\) is not an array of int32\[2,2\]: "
                                        r"its values are float64, not int32"):
        gen.run([[[1.7, 2.9], [3.5, -0.9]]])
    np.testing.assert_array_equal(gen.run([[[1, 2], [3, 4]]])[0], [[10, 20], [30, 40]])
    b = np.ones(2, bool)
    gb = eins.distribute(lambda a: a, devices=1).lower(b).generate("numpy")
    np.testing.assert_array_equal(gb.run([[True, False]])[0], [True, False])
    with pytest.raises(EinsError, match=r"its values are int64, not bool"):
        gb.run([[2, 0]])
    f = np.ones(2, np.float32)    # ints for a float input are exact: taken
    gf = eins.distribute(lambda a: a * 2, devices=1).lower(f).generate("numpy")
    np.testing.assert_array_equal(gf.run([[1, 2]])[0], [2.0, 4.0])


def test_generated_run_takes_torch_tensors_as_eins_calls_do():
    """A tensor that requires grad (an nn.Parameter) or is bfloat16 went through
    np.asarray, which raised torch's raw RuntimeError; eins.distribute takes both."""
    torch = pytest.importorskip("torch")
    f = lambda x, w: x @ w  # noqa: E731
    x, w = np.ones((2, 3), np.float32), np.full((3, 2), 0.5, np.float32)
    g = eins.distribute(f, devices=2).lower(x, w).generate("numpy")
    got = g.run([x, torch.from_numpy(w).requires_grad_()])
    np.testing.assert_array_equal(got[0], x @ w)
    gb = eins.distribute(f, devices=2).lower(x.astype(eins.bfloat16), w).generate("numpy")
    got = gb.run([torch.ones(2, 3, dtype=torch.bfloat16), w])
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.full((2, 2), 1.5))


def test_run_checks_the_consts_it_is_given():
    """GeneratedProgram.run(inputs, consts): other constants than the traced ones are used
    (the program's values for them), but a wrong count, shape or dtype is named; consts for a
    program without any were silently ignored."""
    rng = np.random.default_rng(2)
    c = rng.standard_normal((4, 6)).astype(np.float32)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    gp = eins.distribute(lambda x: x @ c, devices=2).lower(x).generate("numpy")
    c2 = rng.standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(gp.run([x], [c2])[0], x @ c2, rtol=1e-5, atol=1e-5)
    with pytest.raises(EinsError, match=r"expected 1 consts, got 2"):
        gp.run([x], [c, c])
    with pytest.raises(EinsError, match=r"const 0 has shape \(6, 4\), expected \(4, 6\)"):
        gp.run([x], [c.T])
    with pytest.raises(EinsError, match=r"const 0 has dtype float64, expected float32"):
        gp.run([x], [c.astype(np.float64)])
    with pytest.raises(EinsError, match=r"consts must be a list of 1 arrays, got ndarray"):
        gp.run([x], c)
    plain = eins.distribute(lambda x: x * 2, devices=2).lower(x).generate("numpy")
    with pytest.raises(EinsError, match=r"expected 0 consts, got 1"):
        plain.run([x], [c])


def test_run_names_the_python_scalars_baked_into_the_program(tmp_path):
    """A static Python scalar of the traced call is a literal of the program, not an
    input: run([x, 2.0]) said only "expected 1 inputs, got 2"; now it names the scalar, in
    GeneratedProgram.run and in the written package's run. A traced one is an input."""
    import importlib
    import sys
    x = np.ones((4, 4), np.float32)
    traced = eins.distribute(lambda x, s: x * s, devices=2).lower(x, 2.0).generate("numpy")
    assert traced.baked == ()
    np.testing.assert_array_equal(traced.run([x, np.float32(3.0)])[0],
                                  np.full((4, 4), 3.0, np.float32))
    low = eins.distribute(lambda x, s, t: x * s + t, devices=2, static_argnums=1,
                          static_argnames="t").lower(x, 2.0, t=3)
    gp = low.generate("numpy")
    assert gp.baked == ("argument 1 = 2.0", "keyword argument 't' = 3")
    msg = (r"expected 1 inputs, got 3; the traced call's Python scalars \(argument 1 = 2\.0; "
           r"keyword argument 't' = 3\) are baked into the program as literals, not an "
           r"input: pass the arrays only$")
    with pytest.raises(EinsError, match=msg):
        gp.run([x, 2.0, 3])
    np.testing.assert_array_equal(gp.run([x])[0], np.full((4, 4), 5.0, np.float32))
    gp.write(tmp_path / "scaled")
    sys.path.insert(0, str(tmp_path))
    try:
        pkg = importlib.import_module("scaled")
        with pytest.raises(EinsError, match=msg):
            pkg.run([x, 2.0, 3])
        np.testing.assert_array_equal(pkg.run([x])[0], np.full((4, 4), 5.0, np.float32))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("scaled", None)
    # one scalar is singular; too few inputs say nothing of it
    one = eins.distribute(lambda x, s: x * s, devices=2, static_argnums=1).lower(
        x, 2.0).generate("numpy")
    with pytest.raises(EinsError, match=r"\(argument 1 = 2\.0\) is baked into the program "
                                        r"as a literal, not an input"):
        one.run([x, 2.0])
    with pytest.raises(EinsError, match=r"expected 1 inputs, got 0$"):
        one.run([])


def test_an_expression_renders_without_a_registered_primitive():
    """The kernel library renders whatever expression it is given: one that no primitive
    carries, in both dialects, with its own dtype rule."""
    from eins.ir.primitive import Expression
    e = Expression(("x",), "x / (1.0 + abs(x))")
    assert ex.render(e, "numpy") == "x / (1.0 + np.abs(x))"
    assert ex.render(e, "triton", names=["v0"]) == "v0 / (1.0 + tl.abs(v0))"
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    assert ex.dtypes_for(e, [f16], f16) == ex.EwDtypes((f32,), f16)
