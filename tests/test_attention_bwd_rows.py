"""The Triton attention backward reading a capacity block's row table (issue 36): a block
holding every row and key (capacity buffers whose rows outside this call's window hold
stale values) and its table row [lo, hi, klo, khi] computes exactly what a block holding
only rows [lo, hi) and keys [klo, khi) computes, writes zeros everywhere else, never lets
a stale value into a result or a RuntimeWarning, and does that block's work: the tiles it
multiplies are the per-cut block's, counted in Triton's interpreter."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from triton.runtime.interpreter import InterpreterBuilder  # noqa: E402

from eins.errors import ShapeError  # noqa: E402
from eins.kernels.attention_bwd import attention_bwd, key_rows  # noqa: E402
from eins.models import llama  # noqa: E402

S, H, HKV, D = 64, 4, 2, 16


def visible(ends, causal, window=None):
    """[S, S] bool: whether query position i sees key position j (same segment, causal,
    sliding window)."""
    doc = np.searchsorted(np.asarray(ends), np.arange(S), side="right")
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    v = doc[:, None] == doc[None, :]
    if causal:
        v &= j <= i
    if window is not None:
        v &= (j >= i - (window - 1)) & (causal or (j <= i + window - 1))
    return v


def forward(q, k, v, vis, scale):
    """o and the natural lse of every row (torch, float32), from the visibility ``vis``."""
    kk, vv = (x.repeat_interleave(H // HKV, 0) for x in (k, v))
    s = (q @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.tensor(vis), float("-inf"))
    return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)


def inputs(seed, ends, causal, window=None):
    rng = np.random.default_rng(seed)
    q, do = (torch.tensor(rng.standard_normal((H, S, D)), dtype=torch.float32)
             for _ in range(2))
    k, v = (torch.tensor(rng.standard_normal((HKV, S, D)), dtype=torch.float32)
            for _ in range(2))
    o, lse = forward(q, k, v, visible(ends, causal, window), D ** -0.5)
    return q, k, v, o, lse, do


def key_window(ends, lo, hi, causal, window=None):
    """[klo, khi): the keys rows [lo, hi) see (their union, an interval)."""
    seen = np.flatnonzero(visible(ends, causal, window)[lo:hi].any(0))
    return (int(seen[0]), int(seen[-1]) + 1) if len(seen) else (lo, lo)


class Dots:
    """The multiply-adds of every tl.dot the interpreter runs while counting."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = InterpreterBuilder.create_dot

        def count(builder, a, b, *rest):
            self.n += a.data.shape[-2] * a.data.shape[-1] * b.data.shape[-1]
            return real(builder, a, b, *rest)

        monkeypatch.setattr(InterpreterBuilder, "create_dot", count)

    def during(self, fn):
        before = self.n
        fn()
        return self.n - before


def per_cut(ins, e, lo, hi, klo, khi, **kw):
    """The per-cut block: rows [lo, hi) and keys [klo, khi) only, at their offsets."""
    q, k, v, o, lse, do = ins
    r, c = slice(lo, hi), slice(klo, khi)
    blk = (q[:, r], k[:, c], v[:, c], o[:, r], lse[:, r].contiguous(), do[:, r])
    grads = [torch.empty_like(x) for x in blk[:3]]
    attention_bwd(*blk, *grads, segments=e, q_offset=lo, k_offset=klo, **kw)
    return grads


def stale(ins, lo, hi, klo, khi):
    """The capacity buffers: this call's rows and keys, another call's values (nan, inf,
    huge) elsewhere."""
    q, k, v, o, lse, do = (x.clone() for x in ins)
    junk = torch.tensor([float("nan"), float("inf"), 3e38, -float("inf")])
    for x in (q, o, do, lse):
        rows = torch.ones(S, dtype=torch.bool)
        rows[lo:hi] = False
        x[:, rows] = junk[torch.arange(int(rows.sum())) % 4].reshape(
            (1, -1) + (1,) * (x.dim() - 2))
    for x in (k, v):
        keys = torch.ones(S, dtype=torch.bool)
        keys[klo:khi] = False
        x[:, keys] = junk[torch.arange(int(keys.sum())) % 4].reshape(1, -1, 1)
    return q, k, v, o, lse, do


CASES = [((10, 40, 64), (16, 48), {}), ((10, 40, 64), (13, 45), {}),
         ((64,), (32, 48), {}), ((3, 5, 17, 64), (0, 16), {}),
         ((20, 64), (7, 30), {"causal": False}), ((20, 64), (24, 50), {"window": 5}),
         ((20, 64), (30, 50), {"window": 5}), ((20, 64), (30, 50), {"window": 5, "causal": False}),
         ((33, 64), (16, 40), {"softcap": 2.0}), ((10, 40, 64), (21, 21), {})]


@pytest.mark.parametrize("ends,rows,kw", CASES)
def test_row_table_is_the_per_cut_block(monkeypatch, ends, rows, kw):
    """For each table row: dQ of rows [lo, hi) and dK, dV of keys [klo, khi) equal the
    per-cut block's, every other row and key is exactly 0 although the buffers hold nan,
    inf and 3e38 there, no RuntimeWarning is raised, and the interpreter multiplies as
    much as for the per-cut block (equal where the cut is tile-aligned; the capacity
    block's tiles sit at multiples of 16 from 0, the per-cut block's from lo and klo)."""
    lo, hi = rows
    causal = kw.get("causal", True)
    klo, khi = key_window(ends, lo, hi, causal, kw.get("window"))
    e = torch.tensor(llama.padded_ends(ends, 6, S))
    ins = inputs(1, ends, causal, kw.get("window"))
    dots = Dots(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = []
        cut_work = dots.during(lambda: ref.extend(per_cut(ins, e, lo, hi, klo, khi, **kw)))
        cap = stale(ins, lo, hi, klo, khi)
        grads = [torch.full_like(x, 7.0) for x in cap[:3]]
        table = torch.tensor([[lo, hi, klo, khi]])
        cap_work = dots.during(lambda: attention_bwd(*cap, *grads, segments=e, rows=table,
                                                     **kw))
    dq, dk, dv = grads
    torch.testing.assert_close(dq[:, lo:hi], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk[:, klo:khi], ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dv[:, klo:khi], ref[2], rtol=1e-5, atol=1e-5)
    for g, (a, b) in ((dq, (lo, hi)), (dk, (klo, khi)), (dv, (klo, khi))):
        assert not g[:, :a].any() and not g[:, b:].any()
    if lo % 16 == 0 and klo % 16 == 0:
        assert cap_work == cut_work
    else:   # alignment: at most one more 16x16 tile (4 dots over D) per row or column of
        # tiles, per head and pass (a 5-key window at S=64: up to 2.3x the cut's few tiles)
        assert cap_work <= cut_work + 2 * H * 16 * 16 * D * 4 * (S // 16)
    if hi > lo:
        assert cut_work > 0


def test_capacity_work_is_the_cuts_not_the_capacity(monkeypatch):
    """Four devices' table rows over one long document and short ones (the cuts the
    rebalance gives): the capacity blocks together multiply as much as the four per-cut
    blocks, about a quarter of four whole-sequence backwards (what the masked capacity
    kernel did)."""
    ends = (40, 48, 56, 64)
    ins = inputs(2, ends, True)
    e = torch.tensor(llama.padded_ends(ends, 6, S))
    dots = Dots(monkeypatch)
    cuts = [(0, 32), (32, 48), (48, 56), (56, 64)]
    cut = cap = 0
    for lo, hi in cuts:
        klo, khi = key_window(ends, lo, hi, True)
        cut += dots.during(lambda: per_cut(ins, e, lo, hi, klo, khi))
        grads = [torch.empty_like(x) for x in ins[:3]]
        table = torch.tensor([[lo, hi, klo, khi]])
        cap += dots.during(lambda: attention_bwd(*ins, *grads, segments=e, rows=table))
    whole = dots.during(lambda: attention_bwd(*ins, *[torch.empty_like(x) for x in ins[:3]],
                                              segments=e))
    assert cap == cut
    assert cap < 1.5 * whole < 4 * whole


def test_key_rows_cut_to_the_table_and_monotone():
    """Each key's rows are its segment's cut to the table's rows [lo, hi); keys outside
    [klo, khi) get an empty range (at lo before, hi after); both bounds never decrease."""
    e = torch.tensor(llama.padded_ends((10, 40, 64), 6, S))
    lo, hi = key_rows(e, 0, S, e.device, torch.tensor([[21, 35, 10, 35]]))
    assert lo[:10].tolist() == hi[:10].tolist() == [21] * 10
    assert lo[10:35].tolist() == [21] * 25 and hi[10:35].tolist() == [35] * 25
    assert lo[35:].tolist() == hi[35:].tolist() == [35] * 29
    assert torch.all(lo[1:] >= lo[:-1]) and torch.all(hi[1:] >= hi[:-1])
    plain = key_rows(e, 0, S, e.device)
    assert plain[0][10:40].tolist() == [10] * 30 and plain[1][10:40].tolist() == [40] * 30


def test_row_table_needs_the_ends_tensor():
    q, k = torch.zeros((2, S, D)), torch.zeros((1, S, D))
    lse = torch.zeros((2, S))
    with pytest.raises(ShapeError, match="row table"):
        attention_bwd(q, k, k, q, lse, q, q.clone(), k.clone(), k.clone(), segments=(S,),
                      rows=torch.tensor([[0, S, 0, S]]))
