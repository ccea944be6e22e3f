"""The rank runtime's instruction walk (eins.runtime.ranks.run_rank) in one process: each
rank in a thread over an in-memory point-to-point layer with torch.distributed's interface,
in both shapes of what ``batch_isend_irecv`` returns: one Work per op (gloo) and one Work for
the whole batch (NCCL coalesces). tests/test_ranks.py runs the same walk over real gloo
under torchrun; NCCL needs GPUs, so its branch is checked here."""
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import eins  # noqa: E402
from eins.errors import DistributedError, DTypeError, EinsError  # noqa: E402
from eins.ir.device import Free, Recv, Send  # noqa: E402
from eins.kernels.attention import LAUNCHES  # noqa: E402
from eins.runtime.numpy_backend import execute  # noqa: E402
from eins.runtime.ranks import NumpyKernels, make_kernels, planned_sends, run_rank  # noqa: E402


class _Work:
    def __init__(self, ready, finish=lambda: None):
        self.ready, self.finish = ready, finish

    def is_completed(self):
        return self.ready()

    def wait(self, timeout=None):
        if not self.ready_within(timeout.total_seconds() if timeout else None):
            raise RuntimeError("Timed out waiting for the peer")
        self.finish()
        return True


class _Wire:
    """Messages by (source, destination, tag); a receive waits on the condition."""

    def __init__(self, drop_from=None):
        self.msgs, self.cv, self.drop_from = {}, threading.Condition(), drop_from


class FakeDist:
    """One rank's view of the wire, with the parts of torch.distributed that run_rank uses."""

    def __init__(self, wire, rank, coalesce):
        self.wire, self.rank, self.coalesce = wire, rank, coalesce
        self.batches = []

    @staticmethod
    def P2POp(op, tensor, peer, tag=0):
        return (op, tensor, peer, tag)

    def isend(self):  # markers, as torch.distributed's functions are
        pass

    def irecv(self):
        pass

    def batch_isend_irecv(self, ops):
        self.batches.append(len(ops))
        wire, works = self.wire, []
        for op, t, peer, tag in ops:
            if op == self.isend:
                if self.rank != wire.drop_from:
                    with wire.cv:
                        wire.msgs[(self.rank, peer, tag)] = t.clone()
                        wire.cv.notify_all()
                works.append(_work(lambda: True))
            else:
                key = (peer, self.rank, tag)
                works.append(_work(lambda key=key: key in wire.msgs,
                                   lambda key=key, t=t: t.copy_(wire.msgs[key]), wire.cv))
        if self.coalesce:
            return [_work(lambda: all(w.is_completed() for w in works),
                          lambda: [w.wait() for w in works], wire.cv)]
        return works


def _work(ready, finish=lambda: None, cv=None):
    w = _Work(ready, finish)
    if cv is None:
        w.ready_within = lambda timeout: ready()
    else:
        def within(timeout):
            with cv:
                return cv.wait_for(ready, timeout)
        w.ready_within = within
    return w


def fn(x, w1, w2):
    return eins.relu(x @ w1) @ w2


def setup():
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 32), (32, 8))]
    low = eins.distribute(fn, devices=2, cost="proxy").lower(*args)
    dprog = low.physical.device

    def source(kind, k, box):
        assert kind == "in"
        return args[k][tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))]
    return args, dprog, source


@pytest.mark.parametrize("coalesce", [False, True], ids=["gloo", "nccl-coalesced"])
def test_ranks_in_threads_equal_jit_and_send_the_planned_bytes(coalesce):
    args, dprog, source = setup()
    assert any(planned_sends(dprog, r) for r in dprog.devices), \
        "a plan without transfers tests nothing"
    wire = _Wire()
    comms = {r: FakeDist(wire, r, coalesce) for r in dprog.devices}
    got, errors = {}, []

    def rank(r):
        try:
            got[r] = run_rank(dprog, r, source, timeout_s=20, comm=comms[r])
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in dprog.devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    out = np.zeros((8, 8), np.float32)
    for r in dprog.devices:
        stored, stats = got[r]
        for o, box, a in stored:
            assert o == 0
            out[tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))] = a
        assert stats.bytes_sent == planned_sends(dprog, r)
        assert stats.batches == len(comms[r].batches)
        assert stats.transfers == sum(1 for ins in dprog.code[r] if ins.kind == "send")
    want = eins.jit(fn)(*args)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * 16 * 32)


def _run_ranks(dprog, source, coalesce, comm=None, kernels=None):
    """Every rank of ``dprog`` in a thread; {rank: (stored, stats)}. ``comm(wire, rank)``
    and ``kernels(rank)``: a rank's point-to-point layer and kernel set, if not the
    defaults."""
    wire = _Wire()
    comms = {r: FakeDist(wire, r, coalesce) if comm is None else comm(wire, r)
             for r in dprog.devices}
    got, errors = {}, []

    def rank(r):
        try:
            got[r] = run_rank(dprog, r, source, timeout_s=20, comm=comms[r],
                              kernels=None if kernels is None else kernels(r))
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in dprog.devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return got


def _concat2(x, w):
    return eins.concatenate([x @ w, x @ w], axis=1)


@pytest.mark.parametrize("coalesce", [False, True], ids=["gloo", "nccl-coalesced"])
def test_a_rank_forwarding_a_block_it_receives_waits_for_it(coalesce):
    """A relay in an optimized schedule is ``rx = recv; send rx -> peer`` on one rank: the
    send joined the receive's pending run and read rx before the run was posted (KeyError
    'rx26' under torchrun, found by a bug hunt; greedy plans of the LLaMA block had 34)."""
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((6, 10)).astype(np.float32),
            rng.standard_normal((10, 9)).astype(np.float32)]
    # planned without per-transfer latency: with it, these small blocks go direct
    from eins.hardware.presets import get_topology
    low = eins.distribute(_concat2, devices=4, selector="greedy", schedule="optimized",
                          topology=get_topology("dgx-a100:4").without_latency(),
                          synthesis_steps=200).lower(*args)
    dprog = low.physical.device
    forwards = [(r, i) for r in dprog.devices for i, ins in enumerate(dprog.code[r])
                if ins.kind == "send" and any(
                    p.kind == "recv" and p.dst == ins.src for p in dprog.code[r][:i])]
    assert forwards, "a plan without a forwarded block tests nothing"

    def source(kind, k, box):
        return args[k][tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))]

    got = _run_ranks(dprog, source, coalesce)
    out = np.zeros((6, 18), np.float32)
    for r in dprog.devices:
        for o, box, a in got[r][0]:
            out[tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))] = a
    np.testing.assert_allclose(out, eins.jit(_concat2)(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("coalesce", [False, True], ids=["gloo", "nccl-coalesced"])
def test_a_peer_that_never_sends_is_named(coalesce):
    args, dprog, source = setup()
    r = next(d for d in dprog.devices if any(isinstance(i, Recv) for i in dprog.code[d]))
    first = next(i for i in dprog.code[r] if isinstance(i, Recv))
    wire = _Wire(drop_from=first.peer)
    # only rank r runs; its peer's sends never arrive
    with pytest.raises(DistributedError, match=rf"rank {r}: receiving .*from rank "
                                               rf"{first.peer} \(transfer #{first.tag}\).*"
                                               rf"rank {first.peer}.* did not complete it "
                                               rf"within 0.2 s"):
        run_rank(dprog, r, source, timeout_s=0.2, comm=FakeDist(wire, r, coalesce))


def _power(a, b):
    return a ** b


def test_a_value_the_kernel_refuses_names_the_eqn_and_the_users_line():
    """A rank's kernel refusing a value (an integer base to a negative integer power) is
    numpy's error prefixed with the eqn and the user's line, as eins.jit's."""
    a = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
    b = np.array([[1, -1, 2, 0], [0, 1, -2, 1]], np.int32)
    dprog = eins.distribute(_power, devices=2, plan={0: {"d0": 2}}).lower(a, b).physical.device
    assert not any(planned_sends(dprog, r) for r in dprog.devices)   # each rank runs alone

    def source(kind, k, box):
        return (a, b)[k][tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))]
    line = _power.__code__.co_firstlineno + 1
    for r, power in zip(dprog.devices, (-1, -2)):
        with pytest.raises(DTypeError, match=rf"^eqn 0 \(pow\) at test_rank_runtime.py:{line}: "
                                             rf"pow: an integer base to the negative integer "
                                             rf"power {power};"):
            run_rank(dprog, r, source, timeout_s=5, comm=FakeDist(_Wire(), r, False))
    with pytest.raises(DTypeError, match=rf"^eqn 0 \(pow\) at test_rank_runtime.py:{line}: "):
        eins.jit(_power)(a, b)


class _Logged(NumpyKernels):
    """The numpy kernels, each call logged (``("kernel", its eqn, joins a running
    accumulator)``) in ``log``."""

    def __init__(self, log):
        self.log = log

    def kernel(self, eqn, fspec, args, out_dtypes, acc=None):
        self.log.append(("kernel", eqn.prim, acc is not None))
        return super().kernel(eqn, fspec, args, out_dtypes, acc)


class _LoggedDist(FakeDist):
    """FakeDist whose receives log ``("wait", tag)`` when waited for."""

    def __init__(self, wire, rank, coalesce, log):
        super().__init__(wire, rank, coalesce)
        self.log = log

    def batch_isend_irecv(self, ops):
        works = super().batch_isend_irecv(ops)
        for (op, _, _, tag), w in zip(ops, works):
            if op == self.irecv:
                w.finish = lambda f=w.finish, tag=tag: (self.log.append(("wait", tag)), f())
        return works


def _attention(q, k, v):
    return eins.attention(q * 1.0, k * 1.5, v + 0.5, causal=True)


def test_a_pipelined_kernel_waits_for_each_block_where_it_reads_it():
    """pipeline="always" (eins/passes/pipeline.py): the rank holding query rows [22, 32)
    runs its attention on its own keys first, then on rank 0's, whose receives it posted
    before the first piece and waits for only when the second reads them."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((h, 32, 4)).astype(np.float32) for h in (4, 2, 2))
    plan = {0: {"d1": 2}, 1: {"d1": 2}, 2: {"d1": 2}, 3: {"sequence": 2}}
    low = eins.distribute(_attention, devices=2, plan=plan, pipeline="always").lower(q, k, v)
    dprog = low.physical.device
    args = (q, k, v)

    def source(kind, k_, box):
        return args[k_][tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))]

    logs = {r: [] for r in dprog.devices}
    got = _run_ranks(dprog, source, False, comm=lambda w, r: _LoggedDist(w, r, False, logs[r]),
                     kernels=lambda r: _Logged(logs[r]))
    out = np.zeros((4, 32, 4), np.float32)
    for r in dprog.devices:
        for _, box, a in got[r][0]:
            out[tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))] = a
    np.testing.assert_allclose(out, eins.jit(_attention)(*args), rtol=1e-5, atol=1e-5)
    log = [e for e in logs[1] if e[0] == "wait" or e[1] == "attention"]
    recv_tags = [i.tag for i in dprog.code[1] if isinstance(i, Recv)]
    assert len(recv_tags) == 2 and \
        log == [("kernel", "attention", False)] + [("wait", t) for t in recv_tags] + \
        [("kernel", "attention", True)]


@pytest.mark.parametrize("coalesce", [False, True], ids=["gloo", "nccl-coalesced"])
def test_pipelined_ranks_equal_jit_and_count_the_executors_peak(coalesce):
    """A receive posted ahead of the piece that reads it counts from its post, as the
    numpy executor counts it from its place in the list: the same peak per device."""
    rng = np.random.default_rng(4)
    args = tuple(rng.standard_normal((h, 32, 4)).astype(np.float32) for h in (4, 2, 2))
    plan = {0: {"d1": 4}, 1: {"d1": 4}, 2: {"d1": 4}, 3: {"sequence": 4}}
    dprog = eins.distribute(_attention, devices=4, plan=plan,
                            pipeline="always").lower(*args).physical.device
    assert any(getattr(i, "acc", None) for c in dprog.code.values() for i in c)

    def source(kind, k_, box):
        return args[k_][tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))]

    got = _run_ranks(dprog, source, coalesce)
    out = np.zeros((4, 32, 4), np.float32)
    for r in dprog.devices:
        for _, box, a in got[r][0]:
            out[tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))] = a
    np.testing.assert_allclose(out, eins.jit(_attention)(*args), rtol=1e-5, atol=1e-5)
    _, stats = execute(dprog, list(args))
    assert {r: got[r][1].peak_bytes for r in dprog.devices} == stats.peak_bytes


class _OneAtATime:
    """A kernel set whose kernels and ⊕ run one thread at a time: Triton's interpreter
    switches a process-wide setting around each launch (eins/kernels/build.py), so the
    ranks of one process (threads here; torchrun's are processes) take turns."""

    LOCK = threading.Lock()

    def __init__(self, kernel_set):
        self.set = kernel_set

    def __getattr__(self, name):
        return getattr(self.set, name)

    def kernel(self, *args):
        with self.LOCK:
            return self.set.kernel(*args)

    def aggregate(self, *args):
        with self.LOCK:
            return self.set.aggregate(*args)


def test_the_gpu_kernel_set_runs_pipelined_ranks():
    """The GPU runtime's kernel set (interpret: its Triton kernels on the CPU) runs a piece
    as the Triton attention kernel started from the running pairs: equal to jit."""
    pytest.importorskip("triton")
    rng = np.random.default_rng(6)
    args = tuple(rng.standard_normal((h, 32, 4)).astype(np.float32) for h in (4, 2, 2))
    plan = {0: {"d1": 4}, 1: {"d1": 4}, 2: {"d1": 4}, 3: {"sequence": 4}}
    dprog = eins.distribute(_attention, devices=4, plan=plan,
                            pipeline="always").lower(*args).physical.device
    pieced = {r for r, c in dprog.code.items() for i in c if getattr(i, "acc", None)}
    assert len(pieced) >= 2

    def source(kind, k_, box):
        return args[k_][tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))]

    kernels = {r: _OneAtATime(make_kernels("interpret")) for r in dprog.devices}
    before = sum(LAUNCHES.values())
    got = _run_ranks(dprog, source, False, kernels=kernels.get)
    # every attention block, pieces included, ran the Triton kernel (no torch fallback)
    blocks = sum(1 for c in dprog.code.values() for i in c if i.kind == "kernel"
                 and dprog.program.eqns[i.eqn].prim == "attention")
    assert sum(LAUNCHES.values()) - before == blocks
    out = np.zeros((4, 32, 4), np.float32)
    for r in dprog.devices:
        for _, box, a in got[r][0]:
            out[tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))] = a
    np.testing.assert_allclose(out, eins.jit(_attention)(*args), rtol=1e-5, atol=1e-5)
    for r in pieced:   # a piece is one launch: the kernel starts from the running pairs
        code = dprog.code[r]
        count = {k: sum(1 for i in code if i.kind == k) for k in ("kernel", "agg")}
        assert kernels[r].set.launches == count["kernel"] + count["agg"]


@pytest.mark.parametrize("coalesce", [False, True], ids=["gloo", "nccl-coalesced"])
def test_a_block_received_and_never_read_is_freed_once_it_lands(coalesce):
    """``recv dead; free dead`` in one run of transfers: the free waits for the receive
    (a KeyError once receives were waited for where first read; found by review)."""
    args, dprog, source = setup()
    r = next(d for d in dprog.devices if any(isinstance(i, Recv) for i in dprog.code[d]))
    code = dprog.code[r]
    at = next(n for n, i in enumerate(code) if isinstance(i, Recv))
    first = code[at]
    peer = dprog.code[first.peer]
    sent = next(n for n, i in enumerate(peer) if isinstance(i, Send) and i.tag == first.tag)
    peer.insert(sent + 1, Send(peer[sent].src, r, 999))
    code[at + 1:at + 1] = [Recv("dead", first.peer, 999), Free("dead")]
    dprog.bufs[r]["dead"] = dprog.bufs[r][first.dst]
    got = _run_ranks(dprog, source, coalesce)
    out = np.zeros((8, 8), np.float32)
    for d in dprog.devices:
        for _, box, a in got[d][0]:
            out[tuple(slice(lo, hi) for lo, hi in zip(box.lo, box.hi))] = a
    np.testing.assert_allclose(out, eins.jit(fn)(*args), rtol=1e-5, atol=1e-5 * 16 * 32)


def test_a_kernel_set_without_pieces_is_refused_before_any_transfer():
    rng = np.random.default_rng(5)
    args = tuple(rng.standard_normal((h, 32, 4)).astype(np.float32) for h in (4, 2, 2))
    plan = {0: {"d1": 2}, 1: {"d1": 2}, 2: {"d1": 2}, 3: {"sequence": 2}}
    dprog = eins.distribute(_attention, devices=2, plan=plan,
                            pipeline="always").lower(*args).physical.device

    class Custom:   # a registered kernel set whose kernel() takes no running pairs
        name = "custom"

    dist = FakeDist(_Wire(), 1, False)
    with pytest.raises(EinsError, match=r"rank 1: .*pipelined pieces .*the custom kernel set "
                                        r"does not run \(its `pieces`"):
        run_rank(dprog, 1, lambda *a: None, kernels=Custom(), comm=dist)
    assert dist.batches == []   # nothing posted

    class OverNccl(Custom):   # as the GPU kernel set over NCCL (TorchKernels.pieces)
        name, wire, pieces = "cuda", "cuda", False

    with pytest.raises(EinsError, match=r"the cuda kernel set does not run over NCCL"):
        run_rank(dprog, 1, lambda *a: None, kernels=OverNccl(), comm=dist)
    assert dist.batches == []
