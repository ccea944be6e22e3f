"""Arrays in and out of a compiled GPU program (issue 8 part 2; eins/runtime/gpu_exec.py) on
the CPU: backend="interpret", whose device is the CPU. Device arrays (torch tensors, DLPack
arrays) come in without a copy and results go back as the same kind of array; host arrays
(numpy) are copied by the Loads and results come back as numpy; wrong inputs are refused
naming the argument; a call is ordered against the caller's stream.

CuPy is not installed here: a small stand-in package named ``cupy`` (arrays that DLPack says
live on the CPU, over a torch tensor or a numpy array) goes on sys.path. To the interpret
backend it is what a real CuPy array is to "cuda": a device array from another library."""
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import eins  # noqa: E402
from eins.errors import GpuError, TraceError  # noqa: E402
from eins.ir.device import Load  # noqa: E402
from eins.runtime.gpu_exec import (GpuExecutable, check_input_gpu,  # noqa: E402
                                   cupy_input_gpus, input_kind)
from helpers import accumulation, assert_close, small_workloads  # noqa: E402

FN, ARGS = small_workloads()["ffn"]   # x (8, 16), w1 (16, 24), b1 (24,), w2 (24, 16)
WANT = eins.jit(FN)(*ARGS)

FAKE_CUPY = '''
"""A stand-in for CuPy: arrays over a torch CPU tensor or a numpy array (``base``, shared),
exported through the base's own __dlpack__; ``calls`` logs the DLPack traffic."""
import numpy

calls = []


class ndarray:
    def __init__(self, base):
        self.base = base

    @property
    def shape(self):
        return tuple(self.base.shape)

    @property
    def dtype(self):
        d = self.base.dtype
        return d if isinstance(d, numpy.dtype) else numpy.dtype(str(d).split(".")[-1])

    @property
    def strides(self):   # in bytes, as CuPy's
        b = self.base
        return b.strides if isinstance(b, numpy.ndarray) else \
            tuple(s * b.element_size() for s in b.stride())

    def __dlpack__(self, **kwargs):
        calls.append(("__dlpack__", kwargs))
        return self.base.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.base.__dlpack_device__()


def from_dlpack(x):
    import torch
    calls.append(("from_dlpack", {}))
    return ndarray(torch.from_dlpack(x))
'''


@pytest.fixture
def cupy(tmp_path, monkeypatch):
    """The stand-in ``cupy`` package, importable for this test only."""
    pkg = tmp_path / "cupy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_CUPY))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "cupy" not in sys.modules
    import cupy as mod
    assert mod.__file__.startswith(str(tmp_path))
    yield mod
    sys.modules.pop("cupy", None)


def compiled(p=2, graphs=True):
    return eins.distribute(FN, devices=p).lower(*ARGS).compile("interpret", graphs=graphs)


def close(got):
    n, depth = accumulation(eins.make_ir(FN)(*ARGS))
    assert_close(np.asarray(got), WANT, n=n, depth=depth)


def load_bytes(c, k=None):
    """Bytes of every Load of program input k (all inputs: None), over all devices."""
    dprog = c.device_program
    return sum(int(np.prod(i.box.shape)) * dprog.program.inputs[i.source[1]].dtype.itemsize
               for code in dprog.code.values() for i in code
               if isinstance(i, Load) and i.source[0] == "in"
               and (k is None or i.source[1] == k))


def data_ptr(a):
    b = getattr(a, "base", a)
    return b.data_ptr() if isinstance(b, torch.Tensor) else b.ctypes.data


@pytest.mark.parametrize("over", ["torch", "numpy"])
def test_dlpack_arrays_come_in_without_a_copy_and_results_go_back_as_them(cupy, over):
    """A DLPack array on the device (here the CPU) is read in place: torch.from_dlpack
    shares its memory (over a torch tensor, or over numpy's own __dlpack__), no host->device
    bytes; the results are arrays of the same library, built by its from_dlpack."""
    bases = [torch.from_numpy(a.copy()) if over == "torch" else a.copy() for a in ARGS]
    xs = [cupy.ndarray(b) for b in bases]
    c = compiled()
    assert [input_kind(x, "interpret", k) for k, x in enumerate(xs)] == ["cupy"] * 4
    for k, x in enumerate(xs):   # the tensor the Loads read is the array's own memory
        t, host = c.gpu.input_tensor(x, k)
        assert not host and t.data_ptr() == data_ptr(x)
    cupy.calls.clear()
    out = c(*xs)
    assert isinstance(out, cupy.ndarray) and out.shape == WANT.shape
    close(out.base.numpy())
    st = c.stats()
    assert st["h2d_bytes"] == 0 and st["d2h_bytes"] == 0
    assert st["device_load_bytes"] == load_bytes(c) > 0
    # one export per input (a CPU array gets no stream), one import of the result
    assert [w for w, _ in cupy.calls] == ["__dlpack__"] * 4 + ["from_dlpack"]
    assert all("stream" not in kw for _, kw in cupy.calls)


def test_one_dlpack_input_makes_every_result_a_device_array(cupy):
    """Mixed inputs: numpy weights are host arrays (copied by their Loads), the DLPack x is
    read in place; one device input makes the results device arrays (of x's library)."""
    c = compiled()
    x = cupy.ndarray(torch.from_numpy(ARGS[0].copy()))
    out = c(x, *ARGS[1:])
    assert isinstance(out, cupy.ndarray)
    close(out.base.numpy())
    st = c.stats()
    assert st["h2d_bytes"] == load_bytes(c) - load_bytes(c, 0)
    assert st["device_load_bytes"] == load_bytes(c, 0)
    torch_out = c(torch.from_numpy(ARGS[0].copy()), *ARGS[1:])   # torch in: torch out
    assert type(torch_out) is torch.Tensor
    np.testing.assert_array_equal(torch_out.numpy(), out.base.numpy())


def test_the_gpus_of_a_calls_cupy_inputs_are_read_from_its_tensor_pairs():
    """After a call with CuPy inputs on "cuda", CuPy's stream on each GPU holding one waits
    on the call. The call holds its inputs as (tensor, is_host) pairs, None where a placed
    input is skipped: on the H200 (2026-12-04) the pairs were read as tensors and every
    call with a CuPy input raised AttributeError ('tuple' object has no attribute
    'device'); on the CPU that branch does not run, so its GPU choice is checked here."""
    class OnGpu:
        def __init__(self, g):
            self.device = torch.device("cuda", g)
    tensors = [(OnGpu(1), False), None, (OnGpu(3), False), (OnGpu(0), False),
               (torch.zeros(2), True)]
    kinds = ["cupy", "cupy", "cupy", "torch", "host"]
    assert cupy_input_gpus(tensors, kinds) == {1, 3}
    assert cupy_input_gpus([None, None], ["cupy", "cupy"]) == set()


def test_placed_dlpack_weights_are_not_read_again(cupy):
    c = compiled()
    xs = [cupy.ndarray(torch.from_numpy(a.copy())) for a in ARGS]
    placed = c.place(*xs)
    assert placed["device_load_bytes"] == load_bytes(c) and placed["h2d_bytes"] == 0
    x2 = cupy.ndarray(torch.from_numpy(ARGS[0] + 1))   # a new x object: only x is read
    out = c(x2, *xs[1:])
    assert c.stats()["device_load_bytes"] == load_bytes(c, 0)
    assert c.stats()["loads_skipped"] > 0
    want = eins.jit(FN)(ARGS[0] + 1, *ARGS[1:])
    n, depth = accumulation(eins.make_ir(FN)(*ARGS))
    assert_close(out.base.numpy(), want, n=n, depth=depth)


def test_wrong_inputs_are_refused_naming_the_argument(cupy):
    c = compiled()
    small = cupy.ndarray(torch.zeros(4, 16))
    with pytest.raises(TraceError, match=r"argument 0: compiled for float32\[8,16\], got "
                                         r"float32\[4,16\]"):
        c(small, *ARGS[1:])
    w64 = torch.from_numpy(ARGS[1].astype(np.float64))
    with pytest.raises(TraceError, match=r"argument 1: compiled for float32\[16,24\], got "
                                         r"float64\[16,24\]"):
        c(ARGS[0], w64, *ARGS[2:])
    # the executable checks too (a copy into a float32 buffer would cast silently)
    with pytest.raises(GpuError, match=r"argument 1 \(Tensor\): compiled for float32\[16, "
                                       r"24\], got float64\[16, 24\]"):
        c.gpu([ARGS[0], w64, *ARGS[2:]])
    with pytest.raises(GpuError, match=r"argument 0 \(ndarray\): compiled for float32\[8, "
                                       r"16\], got float32\[4, 16\]"):
        c.gpu([small, *ARGS[1:]])
    with pytest.raises(GpuError, match="expected 4 input arrays, got 3"):
        c.gpu(list(ARGS[:3]))

    class NoDevice:   # a "CuPy" object that does not speak DLPack
        shape, dtype = (8, 16), np.dtype(np.float32)
    NoDevice.__module__ = "cupy._core.core"
    with pytest.raises(GpuError, match=r"argument 0: a NoDevice from module "
                                       r"'cupy._core.core' without __dlpack_device__"):
        c.gpu([NoDevice(), *ARGS[1:]])


def test_gpu_arrays_are_refused_on_the_cpu_backend(cupy):
    """A real CuPy array (DLPack: on cuda:1) or a CUDA tensor cannot run on "interpret"."""
    on_gpu = cupy.ndarray(torch.zeros(8, 16))
    on_gpu.__dlpack_device__ = lambda: (2, 1)
    with pytest.raises(GpuError, match=r"backend 'interpret' runs on the CPU; argument 0 is "
                                       r"a CuPy array on cuda:1 \(shape \(8, 16\)\)"):
        input_kind(on_gpu, "interpret", 0)
    assert input_kind(on_gpu, "cuda", 0) == "cupy"

    class CudaTensor:   # what input_kind reads of a torch CUDA tensor
        is_cuda, device, shape = True, torch.device("cuda", 2), (8, 16)
    CudaTensor.__module__ = "torch"
    with pytest.raises(GpuError, match=r"argument 3 is a CUDA tensor on cuda:2"):
        input_kind(CudaTensor(), "interpret", 3)
    assert input_kind(CudaTensor(), "cuda", 3) == "torch"


def test_what_is_a_host_array_depends_on_the_backend(cupy):
    """On "cuda" the CPU is the host: CPU tensors and CPU DLPack arrays are copied by the
    Loads like numpy arrays; on "interpret" the CPU is the device."""
    t = torch.zeros(2)
    assert input_kind(t, "cuda", 0) == "host" and input_kind(t, "interpret", 0) == "torch"
    cpu = cupy.ndarray(t)
    assert input_kind(cpu, "cuda", 0) == "host" and input_kind(cpu, "interpret", 0) == "cupy"
    z = np.zeros(2)
    assert input_kind(z, "cuda", 0) == "host" == input_kind(z, "interpret", 0)


def test_an_input_on_a_gpu_outside_the_device_map_is_refused():
    cuda = torch.device
    check_input_gpu(0, cuda("cuda", 1), {0: 0, 1: 1})   # another GPU of the map: peer reads
    with pytest.raises(GpuError, match=r"argument 2 is on cuda:3, but the program runs on "
                                       r"GPU\(s\) \[0\] \(device_map \{0: 0, 1: 0\}\); move "
                                       r"it to one of them, e.g. .to\('cuda:0'\)"):
        check_input_gpu(2, cuda("cuda", 3), {0: 0, 1: 0})
    with pytest.raises(GpuError, match="argument 1 is on cpu, but the program runs on"):
        check_input_gpu(1, cuda("cpu"), {0: 0})


def test_inputs_that_require_grad_run_as_plain_data():
    """nn.Parameter weights: the runtime's out= kernels refuse autograd, so a call reads
    them under no_grad; the results carry no graph."""
    c = compiled()
    ts = [torch.from_numpy(a.copy()).requires_grad_(True) for a in ARGS]
    out = c(*ts)
    assert not out.requires_grad and out.grad_fn is None
    close(out.numpy())
    c.place(*ts)
    close(c(*ts).numpy())


def test_strided_host_and_device_inputs():
    """Views are read as they are (a negative-stride numpy view is made contiguous first:
    torch takes no negative strides)."""
    c = compiled()
    rev = np.ascontiguousarray(ARGS[0][::-1])[::-1]   # ARGS[0]'s values, negative stride
    assert rev.strides[0] < 0
    close(c(rev, *ARGS[1:]))
    wt = torch.from_numpy(np.ascontiguousarray(ARGS[1].T)).T   # a transposed view
    assert not wt.is_contiguous()
    close(c(torch.from_numpy(ARGS[0]), wt, *map(torch.from_numpy, ARGS[2:])).numpy())


@pytest.mark.parametrize("graphs", [False, True])
def test_a_call_is_ordered_against_the_callers_stream(graphs):
    """Every device stream waits on the event the call recorded on the caller's stream
    before its first load, and the caller's stream waits on every device's end event
    before the call returns (what makes freeing an input or output after the call safe)."""
    c = compiled(p=4, graphs=graphs)
    exe = c.gpu
    before = len(exe.host_stream.waited)
    waits = {d: len(dev.stream.waited) for d, dev in exe.rt.devices.items()}
    c(*[torch.from_numpy(a) for a in ARGS])
    ends = exe.host_stream.waited[before:]
    devs = exe.rt.devices.values()
    assert len(ends) == len(devs) == 4
    assert {ev.recorded_on for ev in ends} == {dev.stream for dev in devs}
    for d, dev in exe.rt.devices.items():
        first = dev.stream.waited[waits[d]]   # the first wait of this call
        assert first.recorded_on is exe.host_stream


def test_the_executable_alone_takes_every_kind(cupy):
    """GpuExecutable without Compiled: numpy in, numpy out; torch in, torch out."""
    exe = GpuExecutable(eins.distribute(FN, devices=2).lower(*ARGS).physical.device,
                        "interpret")
    (out,) = exe(list(ARGS))
    assert isinstance(out, np.ndarray)
    close(out)
    (tout,) = exe([torch.from_numpy(a) for a in ARGS])
    assert type(tout) is torch.Tensor
    np.testing.assert_array_equal(tout.numpy(), out)


def test_gpu_arrays_are_refused_by_jit_and_the_numpy_backend(cupy):
    """numpy would raise its own TypeError for them (or, for a CPU DLPack object, make an
    object array): the error names the argument and where it lives."""
    on_gpu = cupy.ndarray(torch.zeros(16, 24))
    on_gpu.__dlpack_device__ = lambda: (2, 0)
    on_gpu.__cuda_array_interface__ = {}   # what tracing takes a GPU array by
    with pytest.raises(GpuError, match=r"argument 1 is a ndarray on cuda:0; eins.jit and "
                                       r"backend 'numpy' run on host arrays"):
        eins.jit(FN)(ARGS[0], on_gpu, *ARGS[2:])
    c = eins.distribute(FN, devices=2).lower(*ARGS).compile("numpy")
    with pytest.raises(GpuError, match=r"argument 1 is a ndarray on cuda:0"):
        c(ARGS[0], on_gpu, *ARGS[2:])

    class CudaTensor:   # what the check reads of a torch CUDA tensor
        is_cuda, device = True, torch.device("cuda", 1)
        shape, dtype = (24, 16), torch.float32
    CudaTensor.__module__ = "torch"
    with pytest.raises(GpuError, match=r"argument 3 is a CudaTensor on cuda:1"):
        c(*ARGS[:3], CudaTensor())
    close(c(*[torch.from_numpy(a) for a in ARGS]))   # CPU tensors are host arrays there


def test_gpu_check_inputs_record_where_cupy_imports(cupy):
    """benchmarks/gpu_check.py's inputs case on the CPU with a CuPy that imports: real CuPy
    arrays are on a GPU, so on "interpret" the record says so; the other parts run."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check_inputs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = mod.inputs_check("interpret")
    assert row["cupy"].startswith("importable; its arrays are on a GPU")
    assert row["ok"] and row["numpy"]["ok"] and row["torch"]["ok"] and row["placed"]["ok"]
    s = mod.summary([dict(row, section="inputs")])
    assert s["inputs_ok"] is True and s["inputs_cupy"].startswith("importable")


def test_a_call_is_ordered_against_every_gpu_holding_an_input_it_reads():
    """The caller's current stream of each GPU holding a device input the call reads gets
    the call's start event and waits on its end (host inputs and placed inputs, which the
    call does not read, add none)."""
    from eins.runtime.gpu_exec import input_gpus

    class OnGpu:   # what input_gpus reads of a device tensor
        def __init__(self, g):
            self.device = torch.device("cuda", g)
    tensors = [(OnGpu(1), False), (torch.zeros(2), True), None, (OnGpu(3), False),
               (OnGpu(1), False)]
    assert input_gpus(tensors) == {1, 3}
    assert input_gpus([(torch.zeros(2), False), None]) == set()   # interpret: the CPU


def test_a_dlpack_array_with_negative_strides_is_refused_naming_it(cupy):
    """CuPy exports a reversed view's negative strides through DLPack, which torch cannot
    import (torch 2.13 aborts the whole process on it): refused by name before the import."""
    c = compiled()
    rev = np.ascontiguousarray(ARGS[1][::-1])[::-1]   # ARGS[1]'s values, negative stride
    x = cupy.ndarray(rev)
    assert x.strides[0] < 0
    with pytest.raises(GpuError, match=r"argument 1: a ndarray with negative strides "
                                       r"\(-96, 4\)"):
        c(ARGS[0], x, *ARGS[2:])


def test_the_executable_names_an_input_that_is_no_array():
    """GpuExecutable called directly with a nested list (no shape or dtype): numpy's view
    of it is checked like any host array, naming the argument, not an AttributeError."""
    exe = GpuExecutable(eins.distribute(FN, devices=2).lower(*ARGS).physical.device,
                        "interpret")
    with pytest.raises(GpuError, match=r"argument 0 \(list\): compiled for float32\[8, 16\], "
                                       r"got float64\[8, 16\]"):
        exe([ARGS[0].tolist(), *ARGS[1:]])


@pytest.mark.parametrize("kind", ["bfloat16", "requires_grad", "neg_view"])
def test_torch_tensors_the_numpy_backend_reads_as_plain_data(kind):
    """torch's .numpy() refuses bfloat16, tensors that require grad (nn.Parameter) and lazy
    negated views; the numpy backend read them with np.asarray and raised torch's own
    TypeError/RuntimeError. They are read as plain data, as on the GPU backends."""
    def g(x, y):
        return x * y + x

    rng = torch.Generator().manual_seed(0)
    a, b = torch.rand(4, 8, generator=rng), torch.rand(4, 8, generator=rng)
    if kind == "bfloat16":
        a, b = a.bfloat16(), b.bfloat16()
    elif kind == "requires_grad":
        a = torch.nn.Parameter(a)
    else:   # the imaginary part of a conjugate: a lazily negated view of -a
        a = torch.complex(torch.zeros_like(a), -a).conj().imag
        assert a.is_neg()
    want = eins.jit(g)(*(t.detach().resolve_neg().float().numpy().astype(
        "float32" if kind != "bfloat16" else eins.ir.types.bfloat16) for t in (a, b)))
    for backend in ("numpy", "interpret"):
        got = eins.distribute(g, devices=2, backend=backend)(a, b)
        got = got if isinstance(got, np.ndarray) else (
            got.float().numpy().astype(want.dtype))
        # the interpreter's bfloat16 casts round as the GPU's (build.py's _to_bf16): exact
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_torch_tensors_without_dense_data_are_refused_by_name(backend):
    b = torch.rand(4, 8)
    f = eins.distribute(lambda x, y: x * y, devices=2, backend=backend)
    with pytest.raises(GpuError, match=r"argument 0 is a torch tensor on the meta device: it "
                                       r"has shape and dtype but no data"):
        f(torch.empty(4, 8, device="meta"), b)
    with pytest.raises(GpuError, match=r"argument 1 is a torch tensor of layout "
                                       r"torch.sparse_coo; eins reads dense tensors"):
        f(b, b.to_sparse())


def test_torch_tensors_without_dense_data_are_refused_everywhere_they_are_read():
    """Found by fuzzing: only eins.distribute/jit arguments were checked; a meta or sparse
    tensor passed to a generated numpy program (run() or a written package), closed over as
    a constant or given to an eager eins op raised torch's own NotImplementedError ('Cannot
    copy out of meta tensor') or TypeError ('can't convert Sparse layout tensor')."""
    x = np.ones((4, 8), np.float32)
    meta, sparse = torch.empty(4, 8, device="meta"), torch.ones(4, 8).to_sparse()
    gp = eins.distribute(lambda a: a * 2, devices=2).lower(x).generate("numpy")
    np.testing.assert_array_equal(gp.run([torch.ones(4, 8)])[0], 2 * x)
    with pytest.raises(GpuError, match=r"generated program: input 0 is a torch tensor on "
                                       r"the meta device"):
        gp.run([meta])
    with pytest.raises(GpuError, match=r"generated program: input 0 is a torch tensor of "
                                       r"layout torch.sparse_coo"):
        gp.run([sparse])
    for t, why in ((meta, "on the meta device"), (sparse, "of layout torch.sparse_coo")):
        with pytest.raises(GpuError, match=f"an operand is a torch tensor {why}"):
            eins.jit(lambda a: a + t)(x)
        with pytest.raises(GpuError, match=f"an operand is a torch tensor {why}"):
            eins.silu(t)


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "complex64", "float8_e4m3fn"])
def test_torch_tensors_of_a_dtype_eins_does_not_support_are_named_with_the_supported(dtype):
    """A torch tensor of a dtype eins does not compute in raised GpuError 'torch dtype
    torch.int16 has no numpy equivalent' (int16 has one, and no supported dtype was named),
    where a numpy int16 array gets the DTypeError listing them; a bug hunt of backend
    'interpret'. Now the same DTypeError, at distribute, jit, a compiled call and place."""
    tdt = getattr(torch, dtype, None)
    if tdt is None:
        pytest.skip(f"this torch has no {dtype}")
    bad = torch.zeros(4, 8, dtype=tdt)
    ok = torch.rand(4, 8)
    msg = (rf"argument 0: unsupported torch dtype torch\.{dtype}; supported: \['float16', "
           r"'float32', 'float64', 'int8', 'uint8', 'int16', 'int32', 'int64', 'bool', "
           r"'bfloat16'\]: cast it first")
    for backend in ("numpy", "interpret"):
        with pytest.raises(eins.DTypeError, match=msg):
            eins.distribute(lambda x, y: x * y, devices=2, backend=backend)(bad, ok)
    with pytest.raises(eins.DTypeError, match=msg):
        eins.jit(lambda x, y: x * y)(bad, ok)
    x = np.zeros((4, 8), np.float32)
    c = eins.distribute(lambda x, y: x * y, devices=2).lower(x, x).compile("interpret")
    for call in (c, c.place):
        with pytest.raises(eins.DTypeError, match=msg):
            call(bad, ok)


def test_jit_and_make_ir_take_torch_tensors_as_distribute_does():
    """eins.jit(f)(torch_tensor) said 'argument 0 of type Tensor is not an array' while
    eins.distribute ran it: jit and make_ir trace torch tensors by shape and dtype and jit
    runs on their data (results are numpy arrays: jit runs on numpy)."""
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    got = eins.jit(lambda x: x * 2 + 1)(torch.nn.Parameter(t))
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, t.numpy() * 2 + 1)
    got = eins.jit(lambda x: x * 2)(t.bfloat16())
    assert got.dtype == eins.ir.types.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), t.numpy() * 2)
    assert "f32[2,3]" in str(eins.make_ir(lambda x: x * 2)(t))


def test_torch_tensors_inside_a_traced_function_are_constants_like_numpy_arrays():
    """A closed-over torch tensor (a weight, torch.tensor(2.0)) raised numpy's 'Cannot
    interpret torch.float32 as a data type' from eins.ops._common.operands, and one in
    matmul 'operand of type Parameter is not an array'; eins.exp(torch_tensor) failed too."""
    w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(3, 2))
    bias = torch.ones(2, dtype=torch.bfloat16)

    def f(x):
        h = (x * torch.tensor(2.0)) @ w + bias.float()
        return eins.concatenate([h, torch.zeros(4, 1)], axis=1)

    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    want = np.concatenate([(x * 2) @ w.detach().numpy() + 1, np.zeros((4, 1))], axis=1)
    np.testing.assert_array_equal(eins.jit(f)(x), want)
    np.testing.assert_array_equal(eins.distribute(f, devices=2)(x), want)
    np.testing.assert_array_equal(eins.exp(torch.zeros(2)), [1.0, 1.0])   # eager
