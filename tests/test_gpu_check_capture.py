"""Graph-capture legality of the GPU path, checked on the CPU (backend "interpret").

On a GPU, everything a device program issues inside a captured segment (or the whole-program
graph) runs during ``torch.cuda.graph`` capture, where a host synchronization (``.item()``,
``.cpu()``, ``.numpy()``, a tensor's truth value) or a copy from host memory is an error
(cudaErrorStreamCaptureUnsupported). The emulated graph replays exactly those operations, so
these tests run programs with graphs on and make each such call raise while a graph replays,
from the second call on (the first call warms up: caches such as the segment tables of
attention fill there, before capture)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.models import llama  # noqa: E402
from eins.runtime import gpu  # noqa: E402
from helpers import SPREAD, assert_splits  # noqa: E402

SYNCS = [(torch.Tensor, n) for n in ("item", "cpu", "numpy", "tolist", "__bool__", "__int__",
                                     "__float__", "__repr__")] + \
        [(torch, n) for n in ("as_tensor", "tensor", "from_numpy")]


class CaptureGuard:
    """While armed and a graph replays, every call in SYNCS raises."""

    def __init__(self, monkeypatch):
        self.armed, self.replaying, self.replays = False, 0, 0
        for owner, name in SYNCS:
            monkeypatch.setattr(owner, name, self._guard(getattr(owner, name), name))
        orig = gpu.EmulatedGraph.replay
        guard = self

        def replay(g):
            guard.replaying += 1
            guard.replays += guard.armed
            try:
                orig(g)
            finally:
                guard.replaying -= 1
        monkeypatch.setattr(gpu.EmulatedGraph, "replay", replay)

    def _guard(self, fn, name):
        def wrapped(*a, **k):
            if self.armed and self.replaying:
                raise AssertionError(f"{name} inside a captured graph: a host sync or host "
                                     f"copy that CUDA graph capture refuses")
            return fn(*a, **k)
        return wrapped


def _attention_times_two(q, k, v):
    return eins.attention(q, k, v, causal=True, segments=(5, 16)) * 2.0


def _cases():
    rng = np.random.default_rng(3)
    cfg = llama.TINY
    w = llama.init_weights(cfg, rng)
    segs = (4, 12, 16)
    cos, sin = llama.rope_tables(16, cfg.head_dim, segs)
    block = (llama.block_fn(cfg, segs),
             (rng.standard_normal((16, cfg.d_model)).astype(np.float32), w, cos, sin), None)
    q = rng.standard_normal((8, 16, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 16, 8)).astype(np.float32) for _ in range(2))
    kv = (_attention_times_two, (q, k, v), {0: {"kv_sequence": 2, "sequence": 2}})
    # one GPU: the whole program is one graph; two GPUs (device_map): per-segment graphs
    return [("block-p2-one-gpu", *block, 2, None), ("block-p2-two-gpus", *block, 2, [0, 1]),
            ("kv-split-p4-one-gpu", *kv, 4, None)]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_no_host_sync_inside_captured_graphs(monkeypatch, case):
    name, fn, args, plan, p, device_map = case
    guard = CaptureGuard(monkeypatch)
    want = eins.jit(fn)(*args)
    low = eins.distribute(fn, devices=p, plan=plan, synthesis_budget_s=0.05,
                          tuning=SPREAD).lower(*args)
    assert_splits(low)   # transfers between the devices inside the graphs
    c = low.compile("interpret", graphs=True, device_map=device_map)
    c(*args)             # warm-up, capture and a first replay
    guard.armed = True
    got = c(*args)       # replays only: on a GPU this code ran inside the capture
    assert guard.replays > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_the_guard_catches_a_planted_item_call(monkeypatch):
    """The check itself: a lowering that reads a value back to the host fails it."""
    import dataclasses
    from eins.ir.primitive import get_primitive
    prim = get_primitive("transpose")
    orig = prim.lowering().fallback

    def syncing(fspec, x, *, axes):
        if x.abs().sum().item() < 0:   # never true, but a host sync all the same
            raise AssertionError
        return orig(fspec, x, axes=axes)
    monkeypatch.setitem(prim.lowerings, None,
                        dataclasses.replace(prim.lowering(), fallback=syncing))
    name, fn, args, plan, p, device_map = _cases()[0]
    guard = CaptureGuard(monkeypatch)
    # planned without per-transfer latency, whose plan keeps a transpose kernel (with it,
    # the transposes fold into views)
    from eins.hardware.presets import get_topology
    c = eins.distribute(fn, devices=p, synthesis_budget_s=0.05,
                        topology=get_topology(f"dgx-a100:{p}").without_latency()
                        ).lower(*args).compile("interpret", graphs=True)
    c(*args)
    guard.armed = True
    with pytest.raises(AssertionError, match="item inside a captured graph"):
        c(*args)


def test_segment_graphs_forced_on_one_gpu_match_and_replay_per_segment():
    """graph_mode "segments" runs the multi-GPU capture path (per-segment graphs, host-issued
    transfers and events) with every logical device on one GPU, so a one-GPU machine checks
    it; an unknown mode is refused by name."""
    name, fn, args, plan, p, device_map = _cases()[0]
    want = eins.jit(fn)(*args)
    # on all p devices: with device subsets (the default) a case this small runs on one
    c = eins.distribute(fn, devices=p, synthesis_budget_s=0.05,
                        tuning=SPREAD).lower(*args).compile("interpret", graphs=True)
    rt = c.gpu.rt
    rt.graph_mode = "segments"
    for _ in range(2):
        np.testing.assert_allclose(np.asarray(c(*args)), np.asarray(want), rtol=1e-4,
                                   atol=1e-5)
    assert rt.whole is None and rt.whole_replays == 0
    # the first call warms up and captures (its results are the warm-up's), the second
    # replays each segment once
    assert all(len(d.graphs) > 1 and d.replays == len(d.graphs)
               for d in rt.devices.values())
    rt.graph_mode = "whole-ish"
    with pytest.raises(gpu.GpuError, match="whole-ish"):
        c(*args)


@pytest.mark.parametrize("p", [2, 4])
def test_segment_graphs_first_call_is_the_warm_up_not_a_second_run(p):
    """On a GPU a segment is warmed up eagerly, then captured (capture runs nothing). A
    replay right after would run the segment twice in the first call: wrong where it reads a
    buffer of an earlier segment that it then overwrites (an in-place residual add, a slot
    reused after its last read here). The emulated capture warms up the same way, so the
    block's first call at p = 2 and 4 (per-segment graphs) checks it: with the extra replay
    its error was O(1)."""
    name, fn, args, plan, _, _ = _cases()[0]
    want = eins.jit(fn)(*args)
    low = eins.distribute(fn, devices=p, synthesis_budget_s=0.05, tuning=SPREAD).lower(*args)
    assert_splits(low)
    c = low.compile("interpret", graphs=True)
    c.gpu.rt.graph_mode = "segments"
    ran = []
    orig = gpu.DeviceRuntime.capture

    def counting(dev, f):
        def g():
            ran.append(dev.logical)
            f()
        return orig(dev, g)
    gpu.DeviceRuntime.capture = counting
    try:
        first = c(*args)
    finally:
        gpu.DeviceRuntime.capture = orig
    np.testing.assert_allclose(np.asarray(first), np.asarray(want), rtol=1e-4, atol=1e-5)
    # each segment ran eagerly once and was recorded once, never replayed in that call
    ngraphs = sum(len(d.graphs) for d in c.gpu.rt.devices.values())
    assert len(ran) == 2 * ngraphs
    assert all(d.replays == 0 for d in c.gpu.rt.devices.values())
    np.testing.assert_allclose(np.asarray(c(*args)), np.asarray(want), rtol=1e-4, atol=1e-5)
