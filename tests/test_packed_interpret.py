"""Packed batches on the GPU program under Triton's interpreter (issue 36): one compiled
program with graphs on serves every batch's boundaries; after the first call no kernel is
built and no graph captured, and each result equals eins.jit on that batch's ends."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import eins  # noqa: E402
from eins.kernels import attention as flash_attention  # noqa: E402
from eins.kernels import KernelUnavailable  # noqa: E402
from eins.models import llama  # noqa: E402

S = 32
STREAM = [(5, 11, 32), (32,), (1, 2, 3, 20, 32), (16, 32)]


def test_interpret_stream_no_compiles_no_captures():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, S, 16)).astype(np.float32)
    k = rng.standard_normal((2, S, 16)).astype(np.float32)
    v = rng.standard_normal((2, S, 16)).astype(np.float32)
    d = eins.distribute(lambda q, k, v, e: eins.attention(q, k, v, segments=e), devices=4,
                        plan={0: {"sequence": 4}}, backend="interpret", graphs=True)
    ref = eins.jit(lambda q, k, v, segs: eins.attention(q, k, v, segments=segs),
                   static_argnames=("segs",))
    first = None
    for ends in STREAM:
        got = d(q, k, v, llama.padded_ends(ends, 6, S))
        np.testing.assert_allclose(got, ref(q, k, v, segs=ends), rtol=2e-5, atol=2e-5)
        st = d.stats()
        if first is None:
            first = st
            assert st["graph_captures"] >= 1   # the first call captures
        assert st["traces"] == 1 and st["plans"] == 1 and st["rebalances"] == 0
        assert st["kernel_compiles"] == first["kernel_compiles"]
        assert st["graph_captures"] == first["graph_captures"]
        assert st["graph_replays"] >= 1


def test_launcher_reads_ends_tensor():
    """The kernel's segments as a device tensor of padded ends equal the static tuple."""
    rng = np.random.default_rng(1)
    q, k, v = (torch.tensor(rng.standard_normal((1, 2, S, 16)), dtype=torch.float32)
               for _ in range(3))
    for ends in STREAM:
        e = torch.tensor(llama.padded_ends(ends, 6, S))
        got = flash_attention(q, k, v, segments=e, impl="triton")
        want = flash_attention(q, k, v, segments=ends, impl="triton")
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_library_kernel_refuses_ends_tensor():
    q = torch.zeros((1, 2, S, 16))
    with pytest.raises(KernelUnavailable, match="segments as data"):
        flash_attention(q, q, q, segments=torch.tensor([S]), impl="sdpa")


def test_interpret_rebalanced_stream():
    """With rebalance on, each new cut is lowered again and its program captured once
    (transfers are sized by the cuts, not by a capacity: a new cut is a new graph); a cut
    seen before replays its graph. No kernel is built after the first call, one trace and
    one plan serve every batch, and each result equals eins.jit on that batch's ends."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, S, 16)).astype(np.float32)
    k = rng.standard_normal((2, S, 16)).astype(np.float32)
    v = rng.standard_normal((2, S, 16)).astype(np.float32)
    f = lambda q, k, v, e: eins.attention(q, k, v, segments=e)  # noqa: E731
    d = eins.distribute(f, devices=4, plan={0: {"sequence": 4}}, backend="interpret",
                        graphs=True, rebalance=True)
    ref = eins.jit(f)
    first = None
    stream = STREAM + [STREAM[0], (9, 32), STREAM[2]]
    for n, ends in enumerate(stream, 1):
        e = llama.padded_ends(ends, 6, S)
        np.testing.assert_allclose(d(q, k, v, e), ref(q, k, v, e), rtol=2e-5, atol=2e-5)
        st = d.stats()
        first = first or st
        assert (st["traces"], st["plans"], st["rebalances"]) == (1, 1, n)
        assert st["kernel_compiles"] == first["kernel_compiles"]
        distinct = len(set(stream[:n]))
        assert st["lowerings"] == 1 + distinct
        assert st["graph_captures"] == distinct
