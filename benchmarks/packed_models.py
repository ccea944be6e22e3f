"""The baselines of benchmarks/bench_packed.py that eins cannot run as plans (several boxes
per device), priced by the same kernel model as eins's plans (eins.cost.predict), and the
cuts of the equal-token baseline.

Zig-zag context parallelism, as ring attention runs it: the sequence is cut into 2p equal
chunks, device d holds chunks d and 2p-1-d (``zigzag_ms``), or, as Megatron/Transformer
Engine's packed (THD) format does, every document is cut into 2p equal chunks (padded to a
multiple of 2p) and device d holds chunks d and 2p-1-d of each (``zigzag_doc_ms``). K and V
go around a ring in p-1 steps; step t computes each device's queries against the keys it
holds at that step (one varlen kernel, other documents' keys skipped) while the next step's
K/V travel. A step ends when every device has both computed and received, so the time is
the sum over steps of max(slowest device's kernel, the step's transfer).

The whole-block cuts this file once modelled are a family of the library now
(eins/passes/blockcut.py).
"""
from __future__ import annotations

from eins.cost.predict import kernel_work, model_seconds
from eins.ir.joinagg import FunctionSpec
from eins.ir.types import Box

__all__ = ["equal_cuts", "zigzag_ms", "zigzag_doc_ms"]


def equal_cuts(s, n):
    b = [s * k // n for k in range(n + 1)]
    return list(zip(b[:-1], b[1:]))


def _whole(e):
    ix = e.primitive.indexing([a.type for a in e.inputs], [v.type for v in e.outputs],
                              **e.params)
    whole, = ix.spec({}).fspecs
    return whole


def _rows(box, a, b):
    """``box`` with its sequence dim (the second last) cut to rows [a, b)."""
    return Box(box.lo[:-2] + (a,) + box.lo[-1:], box.hi[:-2] + (b,) + box.hi[-1:])


def _entry(e, topo):
    prof = getattr(topo, "profile", None)
    return prof.entry(e.primitive.kernel_class) if prof is not None else None


def _kernel(e, topo, pieces):
    """Seconds of one kernel over the (query rows, key rows) ``pieces`` of attention eqn
    ``e`` (the kernel model on their summed work and bytes); 0 when none sees a key."""
    whole = _whole(e)
    q, k, v = whole.inputs[:3]
    work = nbytes = 0.0
    for (qa, qb), (ka, kb) in pieces:
        f = FunctionSpec((_rows(q, qa, qb), _rows(k, ka, kb), _rows(v, ka, kb))
                         + whole.inputs[3:], (_rows(whole.outputs[0], qa, qb),))
        w, b = kernel_work(e, f, topo)
        if w:
            work, nbytes = work + w, nbytes + b
    if not work:
        return 0.0
    return model_seconds(work, nbytes, topo.flops, topo.hbm_bw, _entry(e, topo))


def _ring(steps, comm):
    """The ring's time: per step the slowest device or the transfer to the next step."""
    last = len(steps) - 1
    return sum(max(max(devs), comm if t < last else 0.0) for t, devs in enumerate(steps))


def zigzag_ms(e, topo, s, p):
    """Attention eqn ``e`` (a batch's, its ends static) as fixed zig-zag context
    parallelism over ``p`` devices on ``s`` tokens (module docstring), in ms."""
    chunks = equal_cuts(s, 2 * p)
    own = [(chunks[d], chunks[2 * p - 1 - d]) for d in range(p)]
    steps = [[_kernel(e, topo, [(qc, kc) for qc in own[d] for kc in own[(d - t) % p]])
              for d in range(p)] for t in range(p)]
    k, v = e.inputs[1].type, e.inputs[2].type
    comm = (k.nbytes + v.nbytes) / p / topo.bandwidth(0, 1)   # a device's two chunks
    return _ring(steps, comm) * 1e3


def zigzag_doc_ms(e, topo, ends, p):
    """Attention eqn ``e`` as per-document zig-zag (Transformer Engine's THD format): every
    document of ``ends`` padded to a multiple of 2p and cut into 2p chunks of c rows.
    Device d's queries (chunks d, 2p-1-d of each document) against the keys it holds at
    step t (chunks r, 2p-1-r, r = d-t mod p): c*c pairs per chunk pair below the diagonal,
    c(c+1)/2 on it. Priced at the batch's own FLOPs per visible pair and bytes per row.
    -> (ms, padded tokens)."""
    whole = _whole(e)
    w_all, _ = kernel_work(e, whole, topo)
    starts = (0,) + tuple(ends[:-1])
    lengths = [b - a for a, b in zip(starts, ends)]
    per_pair = w_all / sum(n * (n + 1) // 2 for n in lengths)
    s = ends[-1]
    q, k, v = whole.inputs[:3]
    size = e.inputs[0].type.dtype.itemsize
    q_row, o_row = (b.size * size / b.shape[-2] for b in (q, whole.outputs[0]))
    kv_row = (k.size + v.size) * e.inputs[1].type.dtype.itemsize / s
    cs = [-(-n // (2 * p)) for n in lengths]
    held = 2 * sum(cs)   # rows of each document's chunks a device holds

    def pairs(i, j, c):
        return c * c if j < i else (c * (c + 1) // 2 if j == i else 0)

    entry = _entry(e, topo)
    steps = []
    for t in range(p):
        devs = []
        for d in range(p):
            r = (d - t) % p
            n = sum(pairs(i, j, c) for c in cs for i in (d, 2 * p - 1 - d)
                    for j in (r, 2 * p - 1 - r))
            nbytes = held * (q_row + o_row + kv_row)
            devs.append(model_seconds(n * per_pair, nbytes, topo.flops, topo.hbm_bw, entry)
                        if n else 0.0)
        steps.append(devs)
    comm = held * kv_row / topo.bandwidth(0, 1)
    return _ring(steps, comm) * 1e3, 2 * p * sum(cs)
