"""The GPU runtime (eins/runtime/gpu.py) end to end on the CPU: backend="interpret" runs the
generated GPU host programs and their Triton kernels (Triton's interpreter, torch CPU
tensors) and must equal eins.jit; streams, events and graphs are emulated and checked."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the test extra installs torch (CPU) and triton

import eins  # noqa: E402
from eins.errors import GpuError, StreamError  # noqa: E402
from eins.ir.device import Load, Send, Store  # noqa: E402
from eins.ir.plan import Tuning  # noqa: E402
from eins.models import llama  # noqa: E402
from eins.runtime import gpu  # noqa: E402
from eins.runtime.gpu_exec import GpuExecutable  # noqa: E402
from helpers import accumulation, assert_close, ffn, small_workloads  # noqa: E402

F32 = np.float32


WORKLOADS = small_workloads()
_WANT = {}


def want(name):
    if name not in _WANT:
        fn, args = WORKLOADS[name]
        _WANT[name] = eins.jit(fn)(*args)
    return _WANT[name]


def compiled(name, p, schedule="naive", graphs=True, **kw):
    fn, args = WORKLOADS[name]
    # on all p devices: with device subsets (the default) workloads this small run on one
    kw.setdefault("tuning", Tuning(device_subsets=False))
    d = eins.distribute(fn, devices=p, schedule=schedule, synthesis_budget_s=0.05,
                        backend="interpret", graphs=graphs, **kw)
    return d.lower(*args).compile("interpret", kw.get("device_map"), graphs)


def close(got, want, fn, args):
    """``got`` equals ``want`` up to the shared tolerance rule (tests/helpers.assert_close)
    for the accumulations of ``fn`` traced on ``args``."""
    n, depth = accumulation(eins.make_ir(fn)(*args))
    assert_close(np.asarray(got), np.asarray(want), n=n, depth=depth)


# (p, schedule, graphs): eager and graphs under the naive schedule at every p; graphs under
# the optimized schedule where it has exchanges worth synthesizing (p = 4, 8)
RUNS = [(p, "naive", g) for p in (1, 2, 4, 8) for g in (False, True)] + \
    [(p, "optimized", True) for p in (4, 8)]


@pytest.mark.parametrize("run", RUNS,
                         ids=lambda r: f"p{r[0]}-{r[1]}-{'graphs' if r[2] else 'eager'}")
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_interpret_equals_jit(name, run):
    p, schedule, graphs = run
    c = compiled(name, p, schedule, graphs)
    _, args = WORKLOADS[name]
    got = c(*args)
    close(got, want(name), *WORKLOADS[name])
    st = c.stats()
    assert st["graphs"] is graphs and st["backend"] == "interpret"
    if graphs:  # captured once, then replayed on this very call: all logical devices share
        # the CPU, so the whole program is one graph
        assert c.gpu.rt.whole is not None and st["graph_replays"] == 1


def _count(dprog, kind):
    return sum(isinstance(i, kind) for code in dprog.code.values() for i in code)


@pytest.mark.parametrize("spread", [False, True], ids=["one-device", "four-devices"])
def test_graph_replay_recomputes_without_the_host_program(spread):
    # one physical device: the whole program is one graph (transfers inside); four: each
    # device's runs of kernels between transfers are graphs, transfers issued by the host
    m = {d: d for d in range(4)} if spread else None
    c = compiled("llama-packed", 4, graphs=True, device_map=m)
    fn, args = WORKLOADS["llama-packed"]
    c(*args)
    x2 = (2 * args[0]).astype(F32)
    got = c(x2, *args[1:])
    close(got, eins.jit(fn)(x2, *args[1:]), fn, args)
    st = c.stats()
    dprog = c.device_program
    rt = c.gpu.rt
    # a replay issues no kernel from Python: only loads, stores (and sends between graphs)
    assert st["launches"] == (st["loads"] + _count(dprog, Store)
                              + (_count(dprog, Send) if spread else 0))
    assert st["transfers"] == _count(dprog, Send) and st["total_bytes"] > 0
    if spread:
        assert rt.whole is None and st["graph_replays"] == \
            sum(len(d.graphs) for d in rt.devices.values()) > 4
    else:
        assert rt.whole is not None and st["graph_replays"] == 1
        assert all(not d.graphs for d in rt.devices.values())
    eager = compiled("llama-packed", 4, graphs=False)
    eager(*args)
    assert eager.stats()["launches"] > st["launches"]  # eagerly, every kernel is issued


def _load_bytes(dprog, k):
    """Bytes of every Load of program input k, over all devices."""
    prog = dprog.program
    return sum(int(np.prod(i.box.shape)) * prog.inputs[k].dtype.itemsize
               for code in dprog.code.values() for i in code
               if isinstance(i, Load) and i.source == ("in", k))


def test_place_then_a_call_moves_only_the_changed_input():
    c = compiled("llama-packed", 2)
    fn, (x, w, cos, sin) = WORKLOADS["llama-packed"]
    dprog = c.device_program
    nin = len(dprog.program.inputs)
    placed = c.place(x, w, cos, sin)
    assert placed["h2d_bytes"] == sum(_load_bytes(dprog, k) for k in range(nin))
    x2 = (x + 1).astype(F32)
    got = c(x2, w, cos, sin)
    close(got, eins.jit(fn)(x2, w, cos, sin), fn, (x, w, cos, sin))
    st = c.stats()
    assert st["h2d_bytes"] == _load_bytes(dprog, 0) > 0     # x only; weights stay resident
    assert st["d2h_bytes"] == x.nbytes                     # the output, once
    # a new weight object is moved again (and used)
    w2 = dict(w, wq=(w["wq"] * 0.5).astype(F32))
    got = c(x2, w2, cos, sin)
    close(got, eins.jit(fn)(x2, w2, cos, sin), fn, (x, w, cos, sin))
    flat = eins.tree_flatten((x2, w2, cos, sin))[0]
    kq = next(k for k, a in enumerate(flat) if a is w2["wq"])
    assert c.stats()["h2d_bytes"] == _load_bytes(dprog, 0) + _load_bytes(dprog, kq)


@pytest.mark.parametrize("graphs", [True, False])
def test_the_placed_object_after_another_in_its_place_is_loaded_again(graphs):
    """A call passing another object where a placed one was loads it into the same device
    buffers. The placed object, passed again, was then skipped: the result used the other
    weight (max error 4.3 on this 8 x 8 matmul). It is loaded again now, until placed
    again."""
    rng = np.random.default_rng(0)
    x, w = (rng.random((8, 8)).astype(F32) for _ in range(2))
    zeros = np.zeros((8, 8), F32)
    c = eins.distribute(lambda a, b: a @ b, devices=2).lower(x, w).compile("interpret",
                                                                           graphs=graphs)
    c.place(x, w)
    np.testing.assert_array_equal(c(x, zeros), np.zeros((8, 8), F32))
    np.testing.assert_allclose(c(x, w), x @ w, rtol=1e-6)
    w_bytes = _load_bytes(c.device_program, 1)
    assert c.stats()["h2d_bytes"] == w_bytes > 0          # w moved again, x stays placed
    np.testing.assert_allclose(c(x, w), x @ w, rtol=1e-6)
    assert c.stats()["h2d_bytes"] == w_bytes              # not resident until placed again
    c.place(x, w)
    c(x, w)
    assert c.stats()["h2d_bytes"] == 0


def test_placed_torch_weight_modified_in_place_is_moved_again():
    c = compiled("ffn", 2)
    fn, args = WORKLOADS["ffn"]
    ts = [torch.from_numpy(a.copy()) for a in args]
    c.place(*ts)
    out = c(*ts)
    assert isinstance(out, torch.Tensor)               # device arrays in, device arrays out
    assert c.stats()["h2d_bytes"] == 0 and c.stats()["device_load_bytes"] == 0
    ts[1].mul_(2)                                      # torch's version counter moves
    out = c(*ts)
    close(out.numpy(), eins.jit(fn)(*[t.numpy() for t in ts]), fn, args)
    assert c.stats()["device_load_bytes"] == _load_bytes(c.device_program, 1)
    # and it stays placed at its new version: it was reloaded on every later call
    out = c(*ts)
    close(out.numpy(), eins.jit(fn)(*[t.numpy() for t in ts]), fn, args)
    assert c.stats()["device_load_bytes"] == 0
    ts[1].add_(1)
    out = c(*ts)
    close(out.numpy(), eins.jit(fn)(*[t.numpy() for t in ts]), fn, args)
    assert c.stats()["device_load_bytes"] == _load_bytes(c.device_program, 1)


def test_numpy_in_numpy_out_torch_in_torch_out():
    c = compiled("chainB", 2)
    _, args = WORKLOADS["chainB"]
    out = c(*args)
    assert isinstance(out, np.ndarray)
    st = c.stats()
    assert st["h2d_bytes"] == sum(_load_bytes(c.device_program, k) for k in range(len(args)))
    tout = c(*[torch.from_numpy(a) for a in args])
    assert isinstance(tout, torch.Tensor)
    np.testing.assert_array_equal(tout.numpy(), out)   # the very same kernels
    assert c.stats()["h2d_bytes"] == 0 and c.stats()["d2h_bytes"] == 0


def test_distribute_traces_and_runs_torch_arguments():
    fn, args = WORKLOADS["ffn"]
    f = eins.distribute(fn, devices=2, backend="interpret")
    out = f(*[torch.from_numpy(a) for a in args])   # traced from the tensors' shapes/dtypes
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    close(out.numpy(), want("ffn"), fn, args)
    assert f.stats()["h2d_bytes"] == 0


def test_eight_logical_devices_on_one_physical_device():
    c = compiled("llama-packed", 8)    # the default map: all 8 on physical device 0
    _, args = WORKLOADS["llama-packed"]
    close(c(*args), want("llama-packed"), *WORKLOADS["llama-packed"])
    st = c.stats()
    assert set(st["device_map"].values()) == {0}
    assert st["peer_bytes"] == 0 and st["local_copy_bytes"] == st["total_bytes"] > 0
    streams = {id(d.stream) for d in c.gpu.rt.devices.values()}
    assert len(streams) == 8                               # each logical device its own
    from eins.runtime.numpy_backend import execute
    _, ref = execute(c.device_program, eins.tree_flatten(args)[0])
    assert st["total_bytes"] == ref.total_bytes and st["transfers"] == ref.transfers
    # two physical devices: transfers across them are peer copies, the rest local
    m = {d: d // 4 for d in range(8)}
    c2 = compiled("llama-packed", 8, device_map=m)
    close(c2(*args), want("llama-packed"), *WORKLOADS["llama-packed"])
    s2 = c2.stats()
    assert s2["device_map"] == m and s2["peer_bytes"] > 0 and s2["local_copy_bytes"] > 0
    assert s2["peer_bytes"] + s2["local_copy_bytes"] == ref.total_bytes
    cross = sum(b for k, b in ref.bytes_moved.items() if m[k[0]] != m[k[1]])
    assert s2["peer_bytes"] == cross


def _device0(c):
    return c.gpu.rt.devices[c.device_program.devices[0]]


def test_an_op_issued_outside_its_stream_is_rejected():
    c = compiled("ffn", 2)
    dev0, dev1 = c.gpu.rt.devices[0], c.gpu.rt.devices[1]
    out = dev0.B[next(iter(dev0.B))]
    with pytest.raises(StreamError, match="logical device 0 issued outside its stream"):
        dev0.slice(out, out, Ellipsis)                       # no stream at all
    with dev1.on_stream():
        with pytest.raises(StreamError, match="current: <EmulatedStream dev1"):
            dev0.slice(out, out, Ellipsis)                   # device 1's stream
    with pytest.raises(StreamError, match="never recorded"):
        dev1.stream.wait_event(gpu.EmulatedEvent())
    with pytest.raises(StreamError, match="recorded on .* from outside it"):
        gpu.EmulatedEvent().record(dev1.stream)


def test_a_generated_program_with_a_misplaced_kernel_is_rejected():
    # run segment 0's kernels directly instead of through dev.segment (which enters the
    # device's stream): the first kernel is refused
    c = compiled("ffn", 1, graphs=False)
    gp = c.gpu.generated
    src = gp.sources[0]
    assert "    dev.segment(0, seg0)\n" in src
    gp.sources[0] = src.replace("    dev.segment(0, seg0)\n", "    seg0()\n")
    bad = GpuExecutable(c.device_program, "interpret", graphs=False)
    from eins.runtime.gpu_exec import exec_sources
    bad.rt.K, bad.rt.modules = exec_sources(gp, True)
    _, args = WORKLOADS["ffn"]
    with pytest.raises(StreamError, match="kernel for logical device 0 issued outside"):
        bad(list(args))
    gp.sources[0] = src


def test_reading_a_received_buffer_before_waiting_on_its_event_is_rejected():
    # drop device 1's waits from its generated program: its first read of a received
    # block is refused (on a GPU it would race with the sender's copy); the proxy's plan
    # of this FFN sends device 0's partial product to device 1
    c = compiled("ffn", 2, graphs=False, cost="proxy")
    gp = c.gpu.generated
    src = gp.sources[1]
    assert "    dev.wait((0, 1, " in src
    import re
    gp.sources[1] = re.sub(r"\n    dev\.wait\(\(0, 1, \d+\)\)", "", src)
    from eins.runtime.gpu_exec import exec_sources
    bad = GpuExecutable(c.device_program, "interpret", graphs=False)
    bad.rt.K, bad.rt.modules = exec_sources(gp, True)
    gp.sources[1] = src
    _, args = WORKLOADS["ffn"]
    with pytest.raises(StreamError, match="logical device 1 reads a buffer that device 0 "
                                          "sent before waiting"):
        bad(list(args))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_ffn(dtype):
    rng = np.random.default_rng(1)
    dt = np.dtype(eins.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    args = [(rng.standard_normal(s) / 4).astype(dt) for s in [(8, 16), (16, 24), (24,),
                                                                (24, 16)]]
    c = eins.distribute(ffn, devices=2, backend="interpret").lower(*args).compile("interpret")
    got = c(*args)
    ref = eins.jit(ffn)(*args)
    assert got.dtype == ref.dtype == dt
    # fp16/bf16 matmuls accumulate in float32 but round their output once more than the
    # reference (which rounds only at the eqn's end): a few units of the dtype's epsilon,
    # which the shared rule allows per chained step
    close(got, ref, ffn, args)


def test_device_map_takes_numpy_ints():
    # ids that come from numpy (np.arange, an array's elements) are GPU indices too; they
    # were refused as "not a non-negative GPU index"
    fn, args = WORKLOADS["ffn"]
    m = list(np.zeros(2, np.int64))
    c = compiled("ffn", 2, device_map=m)
    close(c(*args), want("ffn"), fn, args)
    assert c.stats()["device_map"] == {0: 0, 1: 0}


def test_clear_errors(monkeypatch):
    fn, args = WORKLOADS["ffn"]
    with pytest.raises(eins.PlanError, match="unknown backend 'rocm'"):
        eins.distribute(fn, devices=2, backend="rocm")
    with pytest.raises(eins.PlanError, match=r"unknown backend array\(\['numpy'"):
        eins.distribute(fn, devices=2, backend=np.array(["numpy", "cuda"]))  # raw ValueError
    with pytest.raises(GpuError, match=r"device_map keys \[0, 5\] must be exactly"):
        eins.distribute(fn, devices=2, device_map={0: 0, 5: 0})
    with pytest.raises(GpuError, match="device_map entry -1 is not"):
        eins.distribute(fn, devices=2, device_map=[0, -1])
    with pytest.raises(GpuError, match=r"device_map entry np.True_ is not|entry True is not"):
        eins.distribute(fn, devices=2, device_map=[0, np.bool_(True)])
    with pytest.raises(GpuError, match="has 1 entries for 2 logical devices"):
        eins.distribute(fn, devices=2, device_map=[0])
    low = eins.distribute(fn, devices=2).lower(*args)
    for dm in ([0, 0], [0]):   # [0] got the entry-count error, not the backend's
        with pytest.raises(eins.EinsError, match="numpy backend has virtual devices only"):
            low.compile("numpy", device_map=dm)
    with pytest.raises(eins.EinsError, match="place\\(\\) needs a GPU backend"):
        low.compile("numpy").place(*args)
    if not gpu.gpu_count():
        with pytest.raises(GpuError, match=r"backend 'cuda': torch sees no GPU.*gpu-cuda12"):
            low.compile("cuda")
    monkeypatch.setattr(gpu, "gpu_count", lambda: 1)
    with pytest.raises(GpuError, match="sends logical device 1 to GPU 3, but torch sees 1"):
        gpu.resolve_device_map([0, 3], (0, 1), "cuda")
    assert gpu.resolve_device_map(None, tuple(range(8)), "cuda") == {d: 0 for d in range(8)}
    class FakeCupy:   # a CuPy array (DLPack says: on GPU 0) on the CPU backend is refused
        shape, dtype = (8, 16), np.dtype(np.float32)

        def __dlpack_device__(self):
            return (2, 0)
    FakeCupy.__module__ = "cupy._core.core"
    c = low.compile("interpret")
    with pytest.raises(GpuError, match=r"backend 'interpret' runs on the CPU; argument 0 is "
                                       r"a CuPy array on cuda:0 \(shape \(8, 16\)\)"):
        c(FakeCupy(), *args[1:])
    import sys
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(GpuError, match=r"needs Triton.*eins\[gpu-cuda13\]"):
        low.compile("interpret")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(GpuError, match=r"needs PyTorch.*eins\[gpu-cuda12\]"):
        low.compile("interpret")


def test_auto_is_numpy_without_a_gpu(monkeypatch):
    monkeypatch.setattr(gpu, "gpu_count", lambda: 0)
    assert gpu.resolve_backend("auto") == "numpy"
    monkeypatch.setattr(gpu, "gpu_count", lambda: 2)
    assert gpu.resolve_backend("auto") == "cuda"


def test_gpu_check_smoke_mode_runs_and_reports(tmp_path):
    import importlib.util
    import json
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    inp_args = mod.correctness_workloads(True)["ffn"][1]
    out = tmp_path / "gc.json"
    # the packed stream's smoke (~35 s here) runs in tests/test_gpu_check_session.py
    assert mod.main(["--interpret", "--reps", "1", "--out", str(out), "--skip-packed"]) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["issue36_packed_stream_1x32K_p8"] == {"state": "not run",
                                                                  "why": "no stream row"}
    corr = [r for r in res["rows"] if r["section"] == "correctness"]
    assert res["backend"] == "interpret" and corr and all(r["ok"] for r in corr)
    (inp,) = [r for r in res["rows"] if r["section"] == "inputs"]
    loads = sum(_load_bytes(eins.distribute(ffn, devices=2).lower(*inp_args).physical.device,
                            k) for k in range(4))
    assert inp["numpy"]["out_type"] == "numpy.ndarray" and inp["numpy"]["h2d_bytes"] == loads
    assert inp["torch"]["out_type"] == "torch.Tensor" and inp["torch"]["zero_copy"]
    assert inp["torch"]["h2d_bytes"] == 0 and inp["torch"]["device_load_bytes"] == loads
    assert inp["placed"]["same_objects"]["h2d_bytes"] == 0
    assert 0 < inp["placed"]["new_host_x"]["h2d_bytes"] < loads
    assert inp["ok"] and res["summary"]["inputs_ok"] is True
    assert {(r["p"], r["graphs"]) for r in corr} == {(1, False), (1, True), (2, False),
                                                      (2, True), (2, "segments")}
    sp = [r for r in res["rows"] if r["section"] == "speed"]
    assert sp and all(r["rel_err_vs_torch"] < 1e-5 for r in sp)   # the PyTorch block agrees
    xbytes = 16 * llama.TINY.d_model * 4
    for r in sp:   # weights placed, x on the device: nothing crosses; x from the host: x,
        assert r["h2d_bytes_x_on_device"] == 0   # in whole or in blocks, at most once a device
        assert xbytes <= r["h2d_bytes_x_on_host"] <= r["p"] * xbytes


# --------------------------------------------- found by a bug hunt on backend "interpret"
@pytest.mark.parametrize("split", [2, 3, 4])
def test_bool_partials_combine_with_or(split):
    """A bool matmul or einsum with its contraction split combined its partial copies in
    int1 (True + True = False: XOR); the ⊕ accumulates bools in int32 now."""
    rng = np.random.default_rng(split)
    a, b = rng.random((3, 8)) < 0.6, rng.random((8, 2)) < 0.6
    fns = {"matmul": lambda a, b: a @ b,
           "einsum": lambda a, b: eins.einsum("ij,jk->ik", a, b),
           "sum, max, min": lambda a, b: (eins.sum(a, 1), eins.max(a, 1), eins.min(a, 1))}
    for name, fn in fns.items():
        n = len(eins.make_ir(fn)(a, b).eqns)
        low = eins.distribute(fn, devices=4, plan={i: {"r0": split} for i in range(n)}
                              ).lower(a, b)
        want = eins.jit(fn)(a, b)
        for graphs in (True, False):
            got = low.compile("interpret", graphs=graphs)(a, b)
            for g, w in zip(got if isinstance(got, tuple) else (got,),
                            want if isinstance(want, tuple) else (want,)):
                assert g.dtype == w.dtype, name
                np.testing.assert_array_equal(g, w, err_msg=name)
    ones = np.ones((2, 4), bool)   # every partial True: an even count came back False
    got = eins.distribute(lambda a, b: a @ b, devices=4, plan={0: {"r0": split}}
                          ).lower(ones, ones.T).compile("interpret")(ones, ones.T)
    assert got.all()


def test_softmax_and_mean_of_ints_compute_in_float64():
    """They were computed in float32 and returned as float64: 100000001 became 1e8."""
    a = np.array([[100000001, 3], [100000002, 5], [100000004, 6]], np.int32)
    for fn in (lambda a: eins.mean(a, 0), lambda a: eins.mean(a), lambda a: eins.softmax(a, 0),
               lambda a: eins.mean(a > 4, 1)):
        want = eins.jit(fn)(a)
        got = eins.distribute(fn, devices=1).lower(a).compile("interpret")(a)
        assert got.dtype == want.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-15)


def test_a_0d_bfloat16_input_or_constant_keeps_its_shape():
    # np.ascontiguousarray made the 0-d bfloat16 array 1-d: "output with shape [] doesn't
    # match the broadcast shape [1]"
    from eins.ir.types import bfloat16
    x = np.ones((3, 2), bfloat16)
    s = np.array(2.0, bfloat16)
    got = eins.distribute(lambda x, s: x * s, devices=1).lower(x, s).compile("interpret")(x, s)
    np.testing.assert_array_equal(got.astype(np.float32), np.full((3, 2), 2.0, np.float32))
    c = np.array(3.0, bfloat16)
    got = eins.distribute(lambda x: x * c, devices=2).lower(x).compile("interpret")(x)
    np.testing.assert_array_equal(got.astype(np.float32), np.full((3, 2), 3.0, np.float32))


@pytest.mark.parametrize("p", [1, 3])
def test_a_0d_transpose_runs(p):
    # x.T of a 0-d value is a transpose eqn with axes=(); the torch lowering called
    # permute(*()), which raised TypeError (permute() missing "dims")
    x = np.full((), 3.0, np.float32)
    f = lambda x: (x + 1).T  # noqa: E731
    got = eins.distribute(f, devices=p, backend="interpret")(x)
    assert got.shape == () and got == eins.jit(f)(x) == 4.0


def test_each_gpu_extra_installs_a_torch_built_for_its_cuda():
    """PyPI's torch wheels bundle CUDA 12.8 up to torch 2.10 and CUDA 13.0 from 2.11 (their
    nvidia-* requirements, read with pip install --dry-run on 2026-12-04): an unbounded
    torch in the CUDA 12 extra resolved to 2.14, whose CUDA 13 runtime a CUDA 12 driver
    cannot load. Each extra bounds torch on its side and takes the matching CuPy."""
    import os
    import tomllib
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert "torch>=2.5,<2.11" in extras["gpu-cuda12"] and "cupy-cuda12x" in extras["gpu-cuda12"]
    assert "torch>=2.11" in extras["gpu-cuda13"] and "cupy-cuda13x" in extras["gpu-cuda13"]
    assert not any("flash" in r for e in ("gpu-cuda12", "gpu-cuda13") for r in extras[e])
