"""The rank runtime: one process per device, on torch.distributed (docs/architecture.md,
"The life of a call"; issue 13).

Each rank runs only its own instruction list of the device IR. ``Send``/``Recv`` become
point-to-point operations of the default process group (gloo for CPU tensors, NCCL for GPU
tensors); a run of consecutive transfers is posted together with ``batch_isend_irecv`` (NCCL
needs a rank's concurrent sends and receives in one group, or two ranks that send to each
other first wait on each other), and each of its receives is waited for where an
instruction first reads its buffer (posted early, waited late: eins/passes/pipeline.py),
not before the next local instruction. ⊕, slicing and stitching stay local. There is no
transport of our own.

Why this cannot deadlock: the instruction lists come from one global topological order
(eins.ir.device), and a send never waits for its receiver here. Posting a run's sends and
receives together only moves sends earlier than the list has them, so every rank makes at
least the progress of the list order; waiting for a receive later than its place in the
list blocks nothing a peer waits on. Per (source, destination) pair the sends and receives
appear in the same order (lower.py emits each Send and its Recv together, with increasing
tags), which NCCL's tag-less matching needs; gloo matches by tag as well.

Planning: every rank plans the program itself, deterministically, rather than rank 0
broadcasting its plan. The traced program is on every rank anyway, the planner is
deterministic (dp and greedy; random is seeded), and planning is cheap next to a step
(docs/measured.md times it), while a broadcast plan costs rank 0 one device program per
rank on the wire and makes every rank wait on it. A hash check compares
the device programs (:func:`check_plans`): ranks whose plans differ are named in an error,
and a rank that never reaches the check is named after ``timeout_s``; it never hangs. No
planner part reads a clock: ``schedule="optimized"``'s exchange synthesis counts its budget
in modeled simulation time (eins/passes/synthesize/program.py), so ranks on machines of
different speed or load synthesize the same programs and the check only catches user errors
(different arguments or options per rank).

Every wait is bounded by ``timeout_s``: joining the process group, the plan check (made on
every call), each receive, the completion of the sends and the final gather (point to
point too, so it is bounded by ``timeout_s`` and not by the process group's own timeout).
A rank that exited makes its peers' waits fail at once (the connection closes); one that is
alive but never sends makes them time out. Either way the error names the peer rank and the
transfer (the block, its box and the transfer's tag). After such an error the process group
is in an unknown state, as after any failed collective: end the job.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import time
from datetime import timedelta
from dataclasses import dataclass, field

import numpy as np

from eins.errors import DistributedError, DTypeError, EinsError, IndexRangeError
from eins.ir.device import InstrVisitor, Send
from eins.runtime.gpu_ranks import KERNEL_SETS
from eins.runtime.gpu import resolve_backend
from eins.runtime.rank_kernels import NumpyKernels

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _dist():
    try:
        import torch  # noqa: F401
        import torch.distributed as dist  # heavy: only the GPU path
    except ImportError:
        raise DistributedError("devices='world' runs on torch.distributed: install torch "
                               "(pip install torch)") from None
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed")
    return dist


def _td(seconds):
    return timedelta(seconds=float(seconds))


# ----------------------------------------------------------------------------- the world
def init_world(timeout_s: float, backend: str | None = None) -> tuple[int, int]:
    """(rank, world size) of the default process group; joins it from torchrun's
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) when it is not yet
    initialized. ``backend`` defaults to gloo, plus NCCL for CUDA tensors where CUDA is."""
    dist = _dist()
    if not dist.is_initialized():
        missing = [k for k in ENV if k not in os.environ]
        if missing:
            raise DistributedError(
                f"devices='world': no torch.distributed process group is initialized and the "
                f"environment lacks {', '.join(missing)}; launch with `torchrun "
                f"--nproc-per-node=N script.py`, or call "
                f"torch.distributed.init_process_group() first")
        _check_env()
        if backend is None:
            import torch  # heavy: only the GPU path
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            dist.init_process_group(backend, timeout=_td(timeout_s))
        except Exception as e:  # the rendezvous' own errors: timeouts, refused connections
            raise DistributedError(
                f"rank {os.environ['RANK']} could not join the {os.environ['WORLD_SIZE']} "
                f"ranks at {where} within {timeout_s:g} s (a rank exited or never started?): "
                f"{_first_line(e)}") from None
        # the gloo group eins made, eins ends: left to the interpreter's teardown, gloo's
        # threads are killed mid-flight ("terminate called without an active exception",
        # SIGABRT after every result is written). A group with NCCL is left alone:
        # destroying it flushes NCCL work, which can hang after a failed run.
        if backend == "gloo":
            _OWN_GROUP[0] = dist.group.WORLD
            atexit.register(leave_world)
    return dist.get_rank(), dist.get_world_size()


def _check_env() -> None:
    """RANK, WORLD_SIZE and MASTER_PORT that torch.distributed could not join with, named
    (torch.distributed reports them as a rendezvous that timed out)."""
    def num(k):
        v = os.environ[k].strip()
        if not (v.isascii() and v.isdigit()):
            raise DistributedError(f"devices='world': {k}={os.environ[k]!r} is not a "
                                   f"non-negative integer")
        return int(v)
    rank, size, port = num("RANK"), num("WORLD_SIZE"), num("MASTER_PORT")
    if size < 1 or rank >= size:
        raise DistributedError(f"devices='world': RANK={rank} must be below WORLD_SIZE="
                               f"{size} (ranks are 0 ... WORLD_SIZE - 1)")
    if not 0 < port < 65536:
        raise DistributedError(f"devices='world': MASTER_PORT={port} is not a TCP port "
                               f"(1 ... 65535)")


_OWN_GROUP = [None]   # the default group init_world created (gloo only), if any


def leave_world() -> None:
    """Destroy the gloo group :func:`init_world` created, if it is still the default group
    (registered at exit; a group the caller made, or made after destroying ours, is the
    caller's)."""
    dist = _dist()
    if _OWN_GROUP[0] is not None and dist.is_initialized() and dist.group.WORLD is _OWN_GROUP[0]:
        dist.destroy_process_group()
    _OWN_GROUP[0] = None


def _first_line(e) -> str:
    s = str(e).strip().splitlines()
    return s[0][:300] if s else type(e).__name__


# ----------------------------------------------------------------------------- plan check
def plan_hash(dprog) -> str:
    """A digest of a device program's plan: the planned IR (every eqn's function
    specifications), the placement and every exchange's program and membership (what the
    lower pass builds the instructions from), or, for a device program built without one,
    every device's instruction list (boxes, kernels with their function specifications,
    peers, tags); and the traced program it runs (its input and output types, dtypes
    included, its eqns and literals: the instruction text names no dtype, so ranks called
    with float32 on one and float64 on another agreed, and gloo then aborted one rank and the
    other returned garbage), and the data of its constants (arrays the function closed over:
    a weight that differs per rank, a 0-d ``np.float32(2.0)`` against ``3.0``). Equal digests
    mean equal programs; the data of array arguments is not in it. A rank that lowered only
    its own instructions (``dprog.rank``) gets the digest of the whole program's plan."""
    h = hashlib.sha256()
    h.update(repr(tuple(dprog.devices)).encode())
    xir = dprog.exchange
    if xir is None:
        h.update(dprog.as_text().encode())
    else:
        for ep in xir.plan.eqn_plans:
            h.update(repr((ep.spec.fspecs, ep.spec.aggs)).encode())
        h.update(repr(sorted(xir.placement.items())).encode())
        for x in xir.exchanges:
            h.update(repr((x.eqn, x.inputs, x.serves, x.producer, x.out_pos, x.op, x.needs,
                           sorted(x.membership.items()))).encode())
            h.update(str(x.program).encode())
    if dprog.program is not None:
        h.update(str(dprog.program).encode())
        for _, c in dprog.program.consts:
            c = np.ascontiguousarray(c)
            h.update(repr((c.shape, c.dtype.str)).encode())
            h.update(c.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


_checks = [0]  # how many plan checks this process has made: every rank makes them in order


def check_plans(digest: str, timeout_s: float, what: str = "the program") -> None:
    """Every rank publishes ``digest`` in the process group's store and waits (at most
    ``timeout_s``) for every other rank's. Raises DistributedError naming the ranks that
    never arrive, or the ranks whose digest differs."""
    dist = _dist()
    rank, size = dist.get_rank(), dist.get_world_size()
    seq = _checks[0]
    _checks[0] += 1
    base = dist.distributed_c10d._get_default_store()
    store = dist.PrefixStore(f"eins/plan/{seq}/", base)
    keys = [str(r) for r in range(size)]
    try:
        store.set(keys[rank], digest)
        store.wait(keys, _td(timeout_s))
    except Exception as e:
        try:
            missing = [r for r in range(size) if not store.check([keys[r]])]
        except Exception:
            raise DistributedError(
                f"rank {rank}: the process group's store is unreachable at the plan check of "
                f"{what} (the process hosting it, rank 0 or the torchrun agent, exited?): "
                f"{_first_line(e)}") from None
        late = (f"rank(s) {missing} did not reach" if missing else
                "the other ranks reached only just after")   # they arrived as the wait ended
        raise DistributedError(
            f"rank {rank}: {late} the plan check of {what} within {timeout_s:g} s (exited, "
            f"crashed, or called something else)") from None
    if seq >= 2:
        # every rank is past check seq - 1, so every rank has read check seq - 2: drop this
        # rank's key of it (a check per call would otherwise grow the store without end)
        try:
            dist.PrefixStore(f"eins/plan/{seq - 2}/", base).delete_key(keys[rank])
        except Exception:   # a store without delete_key keeps the key: harmless
            pass
    got = {r: store.get(k).decode() for r, k in enumerate(keys)}
    by_digest = {}
    for r, d in got.items():
        by_digest.setdefault(d, []).append(r)
    if len(by_digest) > 1:
        groups = sorted(by_digest.values(), key=lambda rs: (-len(rs), rs))
        def shown(d):   # the digest's first 12 characters and any options after it
            h, _, opts = d.partition(" ")
            return h[:12] + (f" {opts}" if opts else "")
        parts = "; ".join(f"ranks {rs} plan {shown(got[rs[0]])}" for rs in groups)
        raise DistributedError(
            f"rank {rank}: the ranks planned {what} differently ({parts}). Every rank must call "
            f"with the same function, shapes, dtypes and options (seed, the synthesis budget and "
            f"gather included), and a packed batch with the same segment ends (ends=: they "
            f"decide each rank's cut)")


# ----------------------------------------------------------------------------- kernels
KERNELS = {"cpu": NumpyKernels}
"""Kernel sets by name. The GPU runtime's (eins/runtime/gpu_ranks.py) are registered on first
use: ``"cuda"`` and ``"interpret"`` (the same kernels on CPU tensors under Triton's
interpreter). ``factory(device_index, wire)`` returns an object with NumpyKernels' methods
over that device's tensors (``load`` and ``to_host`` convert from and to numpy). ``wire`` is
``"cuda"`` when the rank has its GPU to itself: ``to_wire`` and ``wire_buffer`` then return
CUDA uint8 tensors, which travel over NCCL; it is ``"cpu"`` when ranks share a GPU (NCCL
refuses two ranks on one GPU) or run on the CPU: they return CPU tensors, over gloo."""

ALIASES = {"numpy": "cpu"}   # eins.distribute's backend names
GPU_SETS = ("cuda", "interpret")


def register_kernels(name: str, factory) -> None:
    KERNELS[name] = factory


def _registered(name: str) -> bool:
    """Whether kernel set ``name`` is there, registering the GPU runtime's on first use
    (building a set is what needs torch and triton, not importing its module)."""
    if name in GPU_SETS and name not in KERNELS:
        for n, factory in KERNEL_SETS.items():
            KERNELS.setdefault(n, factory)
    return name in KERNELS


def make_kernels(name: str = "auto"):
    """The kernel set ``name`` for this rank: "cpu" (or "numpy"), "cuda", "interpret", or one
    registered with :func:`register_kernels`; ``"auto"`` is ``"cuda"`` when torch sees a
    GPU, else ``"cpu"``."""
    name = ALIASES.get(name, name)
    if name == "auto":
        import torch  # heavy: only the GPU path
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not _registered(name):
        raise EinsError(f"unknown kernel set {name!r}: registered are "
                        f"{sorted(set(KERNELS) | set(GPU_SETS))}")
    if name == "cpu":
        return NumpyKernels()
    if name == "interpret":
        return KERNELS[name](0, "cpu")
    if name == "cuda":
        resolve_backend("cuda")   # no GPU: says so before asking the process group anything
    import torch  # heavy: only the GPU path
    gpus = max(1, torch.cuda.device_count())
    # torchrun sets both; ranks started otherwise count as one node
    local = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ \
        else _dist().get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ \
        else _dist().get_world_size()
    return KERNELS[name](local % gpus, "cpu" if per_node > gpus else "cuda")


# ----------------------------------------------------------------------------- one rank
@dataclass
class RankStats:
    """What one rank did in one call."""

    rank: int
    bytes_sent: dict = field(default_factory=dict)      # peer -> bytes of the plan's sends
    bytes_received: dict = field(default_factory=dict)  # peer -> bytes
    transfers: int = 0                                  # sends
    batches: int = 0                                    # batch_isend_irecv calls
    kernels: int = 0
    peak_bytes: int = 0
    gather_bytes: int = 0                               # this rank's share of the final gather
    seconds: float = 0.0
    h2d_inputs: dict = field(default_factory=dict)      # input -> bytes loaded from the host
    resident_bytes: int = 0     # read from this rank's blocks of Sharded inputs
    relayout_bytes: int = 0     # Sharded inputs' pieces received from other ranks
    rebalance_seconds: float = 0.0   # re-cut and lowering for the call's segment ends

    def as_dict(self) -> dict:
        return {"rank": self.rank, "bytes_sent": dict(sorted(self.bytes_sent.items())),
                "total_bytes_sent": sum(self.bytes_sent.values()),
                "bytes_received": dict(sorted(self.bytes_received.items())),
                "transfers": self.transfers, "batches": self.batches, "kernels": self.kernels,
                "peak_bytes": self.peak_bytes, "gather_bytes": self.gather_bytes,
                "seconds": self.seconds, "h2d_bytes": sum(self.h2d_inputs.values()),
                "h2d_inputs": dict(sorted(self.h2d_inputs.items())),
                "resident_bytes": self.resident_bytes, "relayout_bytes": self.relayout_bytes,
                "rebalance_seconds": self.rebalance_seconds}


def _describe(info, name) -> str:
    b = info.get(name)
    return f"block {b.var}{b.box!r} ({name})" if b is not None else f"buffer {name}"


def _failure(e, rank, peer, what, timeout_s) -> DistributedError:
    """The error of a failed wait: ``peer`` is a rank, or words for several."""
    msg = str(e)
    who = f"rank {peer}" if isinstance(peer, int) else peer
    if "imed out" in msg or "imeout" in msg:
        why = f"{who} did not complete it within {timeout_s:g} s (alive but stuck, or " \
              f"not calling?)"
    elif "closed" in msg or "reset" in msg or "refused" in msg or "Broken pipe" in msg:
        why = f"{who} closed the connection (it exited or crashed)"
    else:
        why = f"it failed: {_first_line(e)}"
    return DistributedError(f"rank {rank}: {what}: {why}")


@dataclass(eq=False)
class _PostedSend:
    """A posted send: its wire tensor stays referenced until ``work`` completes."""

    wire: object
    what: str          # for errors: the block, the peer and the transfer's tag
    peer: int
    work: object = None


class _Rank(InstrVisitor):
    """One rank running its instruction list: its buffers and counters, and one method per
    instruction (``visit_<kind>``, :class:`eins.ir.device.InstrVisitor`). Transfers are not
    posted one by one: consecutive Sends and Recvs, and the Frees between them, collect into a
    run that :meth:`flush` posts with one ``batch_isend_irecv`` before the next other
    instruction (see the module docstring)."""

    # what joins the pending run of transfers instead of ending it (a Free waits for it)
    BATCHED = frozenset({"send", "recv", "free"})

    def __init__(self, dprog, rank, source, kern, timeout_s, comm, keep=False):
        self.dist = comm
        self.keep = keep
        self.rank, self.source, self.kern, self.timeout_s = rank, source, kern, timeout_s
        self.prog = dprog.program
        self.info = dprog.bufs.get(rank, {})
        self.stats = RankStats(rank)
        self.mem, self.live = {}, 0
        self.stored = []
        self.sends: list[_PostedSend] = []  # kept (with their wire tensors) until complete
        # the pending run: its instructions, P2P ops, its sends and receives (each with the
        # index of its op) and the buffers freed after it
        self.run, self.ops, self.run_sends, self.run_recvs, self.frees = [], [], [], [], []
        # receives posted and not yet waited for, by buffer: each is waited for where an
        # instruction first reads it (posted early, waited late: a pipelined kernel's next
        # block arrives while it computes on this one, eins/passes/pipeline.py)
        self.pending: dict = {}

    def put(self, name, arr):
        self.mem[name] = arr
        self.live += self.kern.nbytes(arr)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.live)

    def free(self, name):
        self.live -= self.kern.nbytes(self.mem.pop(name))

    def visit(self, ins):
        if self.run and (ins.kind not in self.BATCHED or (
                ins.kind == "send" and any(r.dst == ins.src for _, r, _ in self.run_recvs))):
            # a send forwarding a block this run receives (a relay: recv rx; send rx) needs
            # the data first: the run ends there, as at any other instruction
            self.flush()
        if self.pending:   # a block received: waited for where it is first read
            for name in ((ins.buf,) if ins.kind == "free" else ins.uses()):
                if name in self.pending:
                    self.arrive(name)
        return super().visit(ins)

    # -- transfers: queued into the pending run
    def visit_send(self, ins):
        wire = self.kern.to_wire(self.mem[ins.src])
        self.run.append(ins)
        self.ops.append(self.dist.P2POp(self.dist.isend, wire, ins.peer, tag=ins.tag))
        what = f"sending {_describe(self.info, ins.src)} to rank {ins.peer} " \
               f"(transfer #{ins.tag})"
        entry = _PostedSend(wire, what, ins.peer)
        self.sends.append(entry)
        self.run_sends.append((len(self.ops) - 1, entry))
        nb = wire.numel() * wire.element_size()
        self.stats.bytes_sent[ins.peer] = self.stats.bytes_sent.get(ins.peer, 0) + nb
        self.stats.transfers += 1

    def visit_recv(self, ins):
        b = self.info[ins.dst]
        wire = self.kern.wire_buffer(b.box.size * b.dtype.itemsize)
        self.run.append(ins)
        self.ops.append(self.dist.P2POp(self.dist.irecv, wire, ins.peer, tag=ins.tag))
        self.run_recvs.append((len(self.ops) - 1, ins, wire))

    def visit_free(self, ins):
        if self.run:
            self.frees.append(ins.buf)
        else:
            self.free(ins.buf)

    def flush(self):
        """Post the pending run, keep its receives for :meth:`arrive` (where an instruction
        first reads their buffers), release the buffers of the sends completed so far and
        the run's frees."""
        if not self.run:
            return
        dist, rank, timeout_s, info = self.dist, self.rank, self.timeout_s, self.info
        run, ops, recvs = self.run, self.ops, self.run_recvs
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:
            first = run[0]
            raise _failure(e, rank, first.peer, f"posting transfer #{first.tag} with rank "
                           f"{first.peer}", timeout_s) from None
        self.stats.batches += 1
        if len(works) != len(ops):
            # NCCL coalesces the batch into one Work that completes when every op does:
            # waiting for any of its receives waits for all (named together)
            for _, entry in self.run_sends:
                entry.work = works[-1]
            what = "receiving " + ", ".join(
                f"{_describe(info, ins.dst)} from rank {ins.peer} (transfer #{ins.tag})"
                for _, ins, _ in recvs)
            peers = " or ".join(f"rank {p}" for p in sorted(
                {ins.peer for _, ins, _ in recvs} | {e.peer for _, e in self.run_sends}))
            batch = [tuple(works), peers, what]   # emptied once waited for
            for _, ins, wire in recvs:
                self.post(ins, wire, batch)
        else:  # gloo: one Work per op, so a failure names its transfer
            for k, entry in self.run_sends:
                entry.work = works[k]
            for k, ins, wire in recvs:
                what = f"receiving {_describe(info, ins.dst)} from rank {ins.peer} " \
                       f"(transfer #{ins.tag})"
                self.post(ins, wire, [(works[k],), ins.peer, what])
        # completed sends release their buffers now, not at the end of the call (a
        # completed Work's wait returns at once, or raises the send's failure)
        done = [e for e in self.sends if e.work.is_completed()]
        self.wait_sends(done)
        finished = {id(e) for e in done}
        self.sends = [e for e in self.sends if id(e) not in finished]
        for name in self.frees:
            if name in self.pending:   # received and never read: its data still lands
                self.arrive(name)
            self.free(name)
        self.run, self.ops, self.run_sends, self.run_recvs, self.frees = [], [], [], [], []

    def post(self, ins, wire, batch):
        """A receive posted: pending until :meth:`arrive`; its buffer counts from now (the
        data lands in it whenever the peer sends)."""
        self.pending[ins.dst] = (ins, wire, batch)
        self.live += wire.numel() * wire.element_size()
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.live)

    def arrive(self, name):
        """Wait for the posted receive of buffer ``name`` (its run's one Work where NCCL
        coalesced it) and hold its block."""
        ins, wire, batch = self.pending.pop(name)
        works, peer, what = batch
        for w in works:
            try:
                w.wait(timeout=_td(self.timeout_s))
            except Exception as e:
                raise _failure(e, self.rank, peer, what, self.timeout_s) from None
        batch[0] = ()   # waited: the run's other receives need not wait again
        b = self.info[ins.dst]
        arr = self.kern.from_wire(wire, b.box.shape, b.dtype)
        # counted since it was posted (post): the wire's bytes, now the block's
        self.live += self.kern.nbytes(arr) - wire.numel() * wire.element_size()
        self.mem[ins.dst] = arr
        self.stats.bytes_received[ins.peer] = self.stats.bytes_received.get(ins.peer, 0) \
            + wire.numel() * wire.element_size()

    def arrive_all(self):
        """Every receive still pending (the end of the program)."""
        for name in list(self.pending):
            self.arrive(name)

    def wait_sends(self, entries):
        for s in entries:
            try:
                s.work.wait(timeout=_td(self.timeout_s))
            except Exception as e:
                raise _failure(e, self.rank, s.peer, s.what, self.timeout_s) from None

    # -- local instructions (each ends a pending run first: see visit)
    def visit_load(self, ins):
        kind, k = ins.source
        got = self.source(kind, k, ins.box)
        if isinstance(got, Resident):   # already this rank's, in its kernel set's memory
            self.put(ins.dst, got.array)
            return
        self.put(ins.dst, self.kern.load(got, self.info[ins.dst].dtype))

    def visit_slice(self, ins):
        self.put(ins.dst, self.kern.slice(self.mem[ins.src],
                                          ins.box.relative_to(self.info[ins.src].box)))

    def visit_concat(self, ins):
        info = self.info
        self.put(ins.dst, self.kern.concat(ins.box, info[ins.dst].dtype,
                                           [(info[s].box.relative_to(ins.box), self.mem[s])
                                            for s in ins.srcs]))

    def visit_agg(self, ins):
        self.put(ins.dst, self.kern.aggregate(ins.op, [self.mem[s] for s in ins.srcs],
                                              self.info[ins.dst].dtype))

    def visit_kernel(self, ins):
        args = [a if isinstance(a, tuple) else self.mem[a] for a in ins.ins]
        out_dtypes = [self.info[name].dtype for name in ins.outs]
        try:
            if ins.acc is None:
                outs = self.kern.kernel(self.prog.eqns[ins.eqn], ins.fspec, args, out_dtypes)
            else:   # a pipelined piece (eins/passes/pipeline.py): its running pairs too
                outs = self.kern.kernel(self.prog.eqns[ins.eqn], ins.fspec, args, out_dtypes,
                                        self.mem[ins.acc])
        except (DTypeError, IndexRangeError) as err:   # a value the kernel refuses, as jit
            raise self.prog.eqn_error(ins.eqn, err) from None
        for name, o in zip(ins.outs, outs):
            self.put(name, o)
        self.stats.kernels += 1

    def visit_store(self, ins):
        block = self.mem[ins.src]   # keep: stays in the kernel set's memory (a GPU's)
        self.stored.append((ins.output, ins.box, block if self.keep else self.kern.to_host(block)))


@dataclass(frozen=True)
class Resident:
    """What a ``source`` returns for a block it has in the kernel set's memory already (a
    Sharded input's): loaded as it is, not converted from the host."""

    array: object


def run_rank(dprog, rank: int, source, kernels=None, timeout_s: float = 60.0, comm=None,
             keep=False):
    """Run device ``rank``'s instruction list of device program ``dprog``. ``source(kind, k,
    box)`` returns the block ``box`` of program input (``kind="in"``) or constant
    (``"const"``) ``k`` as a host array (or :class:`Resident`). ``comm``: the point-to-point
    layer, with torch.distributed's ``P2POp``, ``isend``, ``irecv`` and
    ``batch_isend_irecv`` (default: torch.distributed itself). Returns (stored blocks
    [(output, box, host array)], RankStats); ``keep``: the stored blocks as the kernel set
    holds them (left on the rank's device)."""
    t0 = time.perf_counter()
    kernels = kernels or NumpyKernels()
    if not getattr(kernels, "pieces", False) and any(
            getattr(i, "acc", None) for i in dprog.code.get(rank, [])):
        # before any transfer: refused at its first piece, a rank would leave its peers
        # waiting on what it never sends
        how = " over NCCL" if getattr(kernels, "wire", None) == "cuda" else ""
        raise EinsError(f"rank {rank}: the program runs attention in pipelined pieces "
                        f"(pipeline=True), which the {getattr(kernels, 'name', '?')} kernel "
                        f"set does not run{how} (its `pieces` is not set); use "
                        f"pipeline=False")
    r = _Rank(dprog, rank, source, kernels, timeout_s, comm or _dist(), keep)
    for ins in dprog.code.get(rank, []):
        r.visit(ins)
    r.flush()
    r.arrive_all()
    r.wait_sends(r.sends)
    r.stats.seconds = time.perf_counter() - t0
    return r.stored, r.stats


# ----------------------------------------------------------------------------- outputs
def store_layout(dprog) -> dict:
    """rank -> [(output, box)] in the order that rank stores them (every rank knows every
    rank's: the lower pass records them for every device, also for a rank lowered alone)."""
    return dprog.store_layout()


def gather_outputs(dprog, stored, timeout_s: float, stats: RankStats | None = None) -> tuple:
    """The whole outputs on every rank: every rank sends its stored blocks (as bytes) to
    every other rank, point to point, and waits at most ``timeout_s`` for each peer's,
    naming a peer that does not deliver. Not an all_gather: a collective's wait is also
    bounded by the process group's own timeout (set by whichever distribute joined first),
    and one abandoned after ``timeout_s`` stayed queued, holding the process at exit for as
    long as that timeout."""
    import torch  # heavy: only the GPU path
    dist = _dist()
    rank, size = dist.get_rank(), dist.get_world_size()
    prog = dprog.program
    layout = store_layout(dprog)
    dtypes = [v.dtype for v in prog.outputs]
    sizes = {r: sum(b.size * dtypes[o].itemsize for o, b in blocks)
             for r, blocks in layout.items()}
    mine = np.empty(sizes.get(rank, 0), np.uint8)
    pos = 0
    for _, _, a in stored:
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        mine[pos:pos + raw.size] = raw
        pos += raw.size
    if stats is not None:
        stats.gather_bytes = pos
    tag = gather_tag(dprog)
    # a peer with nothing to send (zero-size blocks, or none) still has its blocks laid out
    raws = {r: np.empty(0, np.uint8) for r in layout}
    raws[rank] = mine
    sends, recvs = [], []
    wire = torch.from_numpy(mine)
    try:
        for r in range(size):
            if r == rank:
                continue
            if mine.size:
                sends.append((r, dist.isend(wire, r, tag=tag),
                              f"sending this rank's output blocks to rank {r} for the gather"))
            if sizes.get(r, 0):
                buf = torch.empty(sizes[r], dtype=torch.uint8)
                raws[r] = buf.numpy()
                recvs.append((r, dist.irecv(buf, r, tag=tag),
                              f"receiving rank {r}'s output blocks for the gather"))
    except Exception as e:
        raise _failure(e, rank, "a rank", "posting the gather of the outputs",
                       timeout_s) from None
    for r, w, what in recvs + sends:
        try:
            w.wait(timeout=_td(timeout_s))
        except Exception as e:
            raise _failure(e, rank, r, what, timeout_s) from None
    results = [np.zeros(v.shape, v.dtype) for v in prog.outputs]
    for r, blocks in layout.items():
        raw, pos = raws.get(r), 0
        for o, b in blocks:
            n = b.size * dtypes[o].itemsize
            results[o][tuple(slice(l, h) for l, h in zip(b.lo, b.hi))] = \
                raw[pos:pos + n].view(dtypes[o]).reshape(b.shape)
            pos += n
    return tuple(results)


def gather_tag(dprog) -> int:
    """The tag of the gather's messages: above every tag of the program's transfers, so a
    peer's gather message is never taken for one of them (or the other way round)."""
    return dprog.tag_count()


def planned_sends(dprog, rank: int) -> dict:
    """peer -> bytes that device ``rank`` sends in device program ``dprog`` (its Send
    instructions' blocks): what the rank runtime must measure."""
    info = dprog.bufs.get(rank, {})
    out = {}
    for ins in dprog.code.get(rank, []):
        if isinstance(ins, Send):
            b = info[ins.src]
            out[ins.peer] = out.get(ins.peer, 0) + b.box.size * b.dtype.itemsize
    return out
