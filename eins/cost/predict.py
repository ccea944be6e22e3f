"""Predicted run time of a lowered program on a topology it need not run on.

Per eqn: the slowest device's kernel (:func:`kernel_seconds`) plus the simulated time of the
exchange programs feeding it (Section 5.2's simulator), one eqn after another. Kernels and
exchanges are not overlapped, so this is an upper-bound-style estimate; its purpose is
comparing plans and machines. The optimizer's time cost (``eins.cost.timecost``) charges
the same kernel model, so the DP and this prediction agree on compute exactly.

Kernel model (a roofline with an efficiency curve for small kernels): a kernel of ``W``
FLOPs and ``B`` HBM bytes takes ``max((W + W_HALF) / F, (B + B_HALF) / BW)`` seconds, where
``F`` is the GPU's dense fp16/bf16 rate and ``BW`` its HBM bandwidth; a kernel computing
in float32 or float64 has ``W`` scaled by ``F / Topology.flops_of(dtype)``. Equivalently the
kernel runs at ``F * W / (W + W_HALF)``: half the peak at ``W_HALF`` FLOPs, near the peak for
large matmuls; the same curve on bandwidth with ``B_HALF``. Small kernels (many devices,
short sequences) therefore pay a per-kernel floor, which is what makes over-splitting slow.
FLOPs are the operator's count for the block (``Primitive.block_flops``: attention counts
the (query, key) pairs of its own boxes, not the whole segment list).
"""
from __future__ import annotations

import numpy as np

from eins.cost.predicted import PredictedTime
from eins.ir.device import Free, Load, Recv, Send, Slice
from eins.ir.joinagg import atom_itemsize
from eins.ir.program import Literal
from eins.errors import DTypeError
from eins.ir.types import FLOAT_DTYPES, TensorType, result_dtype
from eins.ir.memo import Memo
from eins.ir.pieces import pair_itemsize, pieces_of, pipeline_operands, under_pieces

# Half-efficiency points of the kernel model (see the module docstring): a kernel of 2**30
# FLOPs (a 1024 x 1024 x 512 matmul) reaches half of the tensor-core peak, one moving 2 MiB
# half of the HBM bandwidth (both typical of cuBLAS / Triton kernels on A100/H100).
W_HALF = float(2 ** 30)
B_HALF = float(2 ** 21)


def out_itemsizes(eqn, spec) -> tuple:
    """Bytes per element of each output of ``eqn`` as ``spec`` writes them (partials whose ⊕
    has an element type of its own, attention's (o, lse) float32 pairs, at theirs): for
    :func:`kernel_seconds`, once per eqn (``spec.multiplicity`` walks every piece)."""
    return tuple(atom_itemsize(spec, j, v.dtype) for j, v in enumerate(eqn.outputs))


def kernel_work(eqn, fspec, topology, itemsizes=None, rate=None) -> tuple[float, float]:
    """(W, B) of one function specification's kernel: its FLOPs in 16-bit tensor FLOPs (a
    FLOP in float32 or float64 costs ``F / flops_of(dtype)`` of them) and its HBM bytes;
    ``itemsizes`` (:func:`out_itemsizes`, when given) charges each output at those bytes
    per element; ``rate``: ``flops_of`` the eqn's compute dtype, where known."""
    return _kernel_work(eqn, _operands(eqn), fspec, topology, itemsizes, rate)


def _operands(eqn) -> list:
    """Per input of ``eqn``: its type where a literal (whatever its block), else None and
    its dtype: what :func:`_kernel_work` types a block's inputs by."""
    return [(a.type, None) if isinstance(a, Literal) else (None, a.dtype) for a in eqn.inputs]


def _kernel_work(eqn, operands, fspec, topology, itemsizes, rate) -> tuple[float, float]:
    return scaled_work(*kernel_counts(eqn, operands, fspec, itemsizes), eqn, topology, rate)


def kernel_counts(eqn, operands, fspec, itemsizes) -> tuple:
    """(FLOPs, HBM bytes) of one function specification's kernel as the operator counts
    them (``operands``: :func:`_operands`), before :func:`scaled_work` weighs its FLOPs."""
    prim = eqn.primitive
    ins = [lit if lit is not None else TensorType(b.shape, dt)
           for (lit, dt), b in zip(operands, fspec.inputs)]
    outs = [TensorType(b.shape, v.dtype) for v, b in zip(eqn.outputs, fspec.outputs)]
    flops = prim.block_flops(fspec, ins, outs, **eqn.params)  # from the block's own boxes
    nbytes = prim.bytes_accessed(ins, outs)
    if itemsizes is not None:
        for v, t, size in zip(eqn.outputs, outs, itemsizes):
            nbytes += (size - v.dtype.itemsize) * t.size
    return flops, nbytes


def scaled_work(flops, nbytes, eqn, topology, rate) -> tuple:
    """(W, B) of :func:`kernel_work` from :func:`kernel_counts`' (FLOPs, bytes)."""
    if not flops:
        return 0, nbytes
    rate = topology.flops_of(compute_dtype(eqn)) if rate is None else rate
    return flops * topology.flops / rate, nbytes


def kernel_seconds(eqn, fspec, topology, itemsizes=None) -> float:
    """The kernel model of the module docstring for one function specification, priced by
    the topology's machine profile for the primitive's kernel class, if it has one
    (:func:`model_seconds`)."""
    return eqn_kernel_seconds(eqn, (fspec,), topology, itemsizes)[0]


def kernel_entry(eqn, topology):
    """The machine profile's entry (eins.hardware.profile.ClassProfile) for ``eqn``'s kernel
    class on ``topology``, or None without a profile (the data sheet's roofline)."""
    prof = getattr(topology, "profile", None)
    return prof.entry(eqn.primitive.kernel_class) if prof is not None else None


def eqn_kernel_seconds(eqn, fspecs, topology, itemsizes=None) -> list:
    """:func:`kernel_seconds` of each of ``fspecs`` (one eqn's), what they share (the
    compute dtype's rate, the profile's entry) looked up once."""
    entry = kernel_entry(eqn, topology)
    rate = topology.flops_of(compute_dtype(eqn))
    operands = _operands(eqn)
    return [model_seconds(*_kernel_work(eqn, operands, f, topology, itemsizes, rate),
                          topology.flops, topology.hbm_bw, entry) for f in fspecs]


def model_seconds(work, nbytes, flops, hbm_bw, entry=None, peaks=False) -> float:
    """Seconds of a kernel of ``work`` 16-bit FLOPs and ``nbytes`` HBM bytes:
    ``max((W + W_HALF) / (F e_f), (B + B_HALF) / (BW e_b)) + overhead`` (``F`` =
    ``flops``, ``BW`` = ``hbm_bw``), with the
    efficiencies and overhead of ``entry`` (an eins.hardware.profile.ClassProfile; None:
    1 and 0, the data sheet's roofline); a folded class costs nothing. The small-kernel
    floor W_HALF stays the 16-bit one. ``peaks``: at the entry's highest efficiencies
    (``ClassProfile.peaks``), not its curves' at these sizes (:func:`pieces_floor`)."""
    if entry is not None and entry.folded:
        return 0.0
    compute, memory = roofline_terms(work, nbytes, flops, hbm_bw, entry, peaks=peaks)
    return max(compute, memory) + (entry.overhead_s if entry is not None else 0.0)


def roofline_terms(work, nbytes, flops, hbm_bw, entry=None, floors=True,
                   peaks=False) -> tuple:
    """(compute, memory) seconds of :func:`model_seconds`'s kernel, its two roofline terms;
    ``floors=False``: without the small-kernel floors W_HALF and B_HALF (the running pairs'
    bytes of a pipelined piece against its FLOPs: :func:`pieces_pay`); ``peaks``: at the
    entry's highest efficiencies."""
    w_half, b_half = (W_HALF, B_HALF) if floors else (0, 0)
    if entry is None:
        compute = (work + w_half) / flops if work else 0.0
        return compute, (nbytes + b_half) / hbm_bw
    e_f, e_b = entry.peaks if peaks else (entry.flops_eff(work), entry.hbm_eff(nbytes))
    compute = (work + w_half) / (flops * e_f) if work else 0.0
    return compute, (nbytes + b_half) / (hbm_bw * e_b)


def compute_dtype(eqn):
    """The dtype an eqn's kernel computes in: its float array operands' promoted dtype
    (eins's rule; integer and bool operands, such as a mask multiplied into float16
    activations, do not count), else all its array operands', else its output's."""
    dts = [np.dtype(a.dtype) for a in eqn.inputs if not isinstance(a, Literal)]
    if eqn.primitive.flops_dtype is not None:   # the primitive says (Primitive.flops_dtype)
        return np.dtype(eqn.primitive.flops_dtype(dts))
    floats = [d for d in dts if d in FLOAT_DTYPES]
    try:
        return result_dtype(*(floats or dts)) if dts else eqn.outputs[0].dtype
    except DTypeError:   # operands an operator takes without promoting them together
        return eqn.outputs[0].dtype


def lower_bound(state) -> float:
    """A lower bound, in ms, on the predicted time of any plan of ``state``'s program on its
    devices: per eqn, the whole eqn's work and HBM bytes (:func:`kernel_work` on one
    function specification holding every input and output whole) split evenly over the
    GPUs, priced by the kernel model (:func:`model_seconds`), with no communication. A plan
    splits each eqn so that some GPU gets at least that share of the work (the pieces'
    FLOPs sum to the whole's, ``Primitive.block_flops``) and, since every output element is
    written once and every needed input element read at least once, of the bytes; the
    kernel model grows with both, and exchanges only add. (A profile whose efficiency
    curve falls with size could break this; the presets' curves rise.)"""
    prog, topo = state.program, state.topology
    gpus = len({topo.gpu_of(d) for d in state.devices}) if topo.physical else \
        len(state.devices)
    total = 0.0
    for e in prog.eqns:
        ins = [a.type for a in e.inputs]
        ix = e.primitive.indexing(ins, [v.type for v in e.outputs], **e.params)
        whole, = ix.spec({}).fspecs
        work, nbytes = kernel_work(e, whole, topo)
        total += model_seconds(work / gpus, nbytes / gpus, topo.flops, topo.hbm_bw,
                               kernel_entry(e, topo))
    return total * 1e3


def peak_memory(dprog) -> dict:
    """Peak live bytes per device of a device program, from its instruction lists alone:
    every defined buffer (its block's bytes) is live until its Free. This is exactly what
    the numpy executor measures when it runs the program (messages in flight excluded)."""
    return memory(dprog)[0]


def placed_memory(dprog) -> tuple[dict, dict]:
    """``(resident, peak)`` per device when the program's inputs stay on the devices for
    the whole call (placed with ``c.place``, a training step's weights and optimizer state,
    a CUDA graph's static input buffers): ``resident`` the bytes of the distinct input
    blocks a device loads, ``peak`` that plus the largest simultaneous live bytes of its
    other buffers. :func:`peak_memory` instead counts an input block only from its load to
    its last use, as the numpy executor holds a host argument."""
    _, resident, placed = memory(dprog)
    return resident, placed


def memory(dprog) -> tuple[dict, dict, dict]:
    """``(peak, resident, placed)`` per device (:func:`peak_memory`, :func:`placed_memory`)
    in one walk over the instructions: a 32-block program has millions."""
    peaks, resident, placed = {}, {}, {}
    # elements per Box object, by its id (dprog holds the boxes, so the ids stay theirs):
    # the buffers of a stack's layers share their template's boxes (a 32-block program has
    # a million buffers, a million BufInfos and some 12,000 boxes), and Box.size is slow
    elems = {}
    for d in dprog.devices:
        info = dprog.bufs.get(d, {})
        nb = {}
        for name, b in info.items():
            box = b.box
            n = elems.get(id(box))
            if n is None:
                n = elems[id(box)] = box.size
            nb[name] = n * b.dtype.itemsize
        held, inputs = {}, set()
        live = peak = other = other_peak = 0
        for ins in dprog.code.get(d, []):
            t = type(ins)
            if t is Free:   # frees, sends, receives and slices: most of a big program
                name = ins.buf
                n = nb[name]
                live -= n
                if name not in inputs:
                    other -= n
                continue
            if t is Send:
                continue
            if t is Recv or t is Slice:   # write their one destination, end nothing
                name = ins.dst
                n = nb[name]
                live += n
                if live > peak:
                    peak = live
                if name not in inputs:
                    other += n
                    if other > other_peak:
                        other_peak = other
                continue
            if t is Load and ins.source[0] == "in":
                inputs.add(ins.dst)
                held[(ins.source, ins.box)] = nb[ins.dst]
            for name in ins.ends():
                n = nb[name]
                live -= n
                if name not in inputs:
                    other -= n
            for name in ins.defs():
                n = nb[name]
                live += n
                if live > peak:
                    peak = live
                if name not in inputs:
                    other += n
                    if other > other_peak:
                        other_peak = other
        peaks[d] = peak
        resident[d] = sum(held.values())
        placed[d] = resident[d] + other_peak
    return peaks, resident, placed


class Timeline:
    """The program timed GPU by GPU, as the rank runtime runs it (eins/runtime/ranks.py: each
    rank its instructions in order, waiting only for the transfers it takes part in), not
    eqn by eqn: every GPU has a clock; an exchange starts when the last GPU taking part in it
    (a source or a hop of its program's actions) reaches it and holds them all for its
    simulated time (NCCL completes a posted run of transfers as one); an eqn's kernels
    advance each GPU's clock by that GPU's own kernels (devices sharing a GPU add up, as
    :meth:`~eins.hardware.topology.Topology.busy_seconds` adds them). A GPU that takes no
    part in an exchange goes on with its kernels, so a plan whose devices' loads differ from
    eqn to eqn but balance over the program (whole-block cuts of packed documents) is timed
    by its slowest GPU's sum, where the eqn-by-eqn total charges every eqn's slowest GPU.
    Never above the eqn-by-eqn total; equal to it when every eqn's kernels are balanced and
    every exchange involves every GPU."""

    def __init__(self, topology, record=False):
        self.topo = topology
        self.clock: dict = {}
        # with ``record``: (kind "exchange" or "kernel", name, start s, seconds, GPUs) per
        # span, what the predicted schedule's GPU-by-GPU tracks draw
        self.spans = [] if record else None

    def gpus(self, x) -> frozenset:
        """The GPUs taking part in exchange ``x`` (``Exchange.sites``: its actions' sources
        and hops); every GPU of the topology for an exchange without a program."""
        sites = x.sites() if x.program is not None else self.topo.gpus
        return frozenset(self.topo.gpu_of(d) for d in sites)

    def exchange(self, x, name=None) -> None:
        if x.predicted_s:
            self.hold(self.gpus(x), x.predicted_s, name)

    def hold(self, gpus, seconds, name=None) -> None:
        """``gpus`` busy together for ``seconds`` from when the last of them is free."""
        start = max((self.clock.get(g, 0.0) for g in gpus), default=0.0)
        for g in gpus:
            self.clock[g] = start + seconds
        if self.spans is not None:
            self.spans.append(("exchange", name, start, seconds, tuple(sorted(gpus))))

    def kernels(self, seconds, devices, name=None) -> None:
        if not self.topo.physical and self.spans is None and \
                len(set(devices)) == len(devices):   # a GPU each: its own kernel (one sum)
            clock = self.clock
            for t, d in zip(seconds, devices):
                clock[d] = clock.get(d, 0.0) + t
            return
        on: dict = {}
        for t, d in zip(seconds, devices):
            ts, ds = on.setdefault(self.topo.gpu_of(d), ([], []))
            ts.append(t)
            ds.append(d)
        for g, (ts, ds) in on.items():
            busy = self.topo.busy_seconds(ts, ds) if self.topo.physical else sum(ts)
            start = self.clock.get(g, 0.0)
            self.clock[g] = start + busy
            if self.spans is not None and busy:
                self.spans.append(("kernel", name, start, busy, (g,)))

    def pipelined(self, pieces, name=None) -> None:
        """One pipelined eqn (eins/passes/pipeline.py): ``pieces`` {device: [(seconds,
        ((peer, bytes), ...))]}, each device's pieces in running order with the receives
        each reads. Every peer posts its sends when it reaches the eqn (its clock now); a
        device posts the receives of its first two pieces when it reaches the eqn and
        those of piece j when piece j-1 starts (what the pieced device code says); each
        transfer's bytes flow from the route's latency after both are posted, one
        transfer at a time on the device's inbound link at the pair's bandwidth (a peer
        serving several devices at once is not slowed: as the ring's model, each moment's
        transfers are about a permutation); piece j runs once piece j-1 is done and its
        receives have arrived. No GPU is held by the transfers (the copy engines move
        them)."""
        topo = self.topo
        reached = dict(self.clock)   # when each GPU reached the eqn
        for d, ps in pieces.items():
            g = topo.gpu_of(d)
            t0 = reached.get(g, 0.0)
            done, inbound, starts = self.clock.get(g, 0.0), t0, []
            for j, (secs, recvs) in enumerate(ps):
                post = t0 if j <= 1 else starts[j - 1]
                arrived = t0
                for peer, nbytes in recvs:   # bytes flow after the route's latency
                    bw, lat = link(topo, peer, d)
                    ready = max(post, reached.get(topo.gpu_of(peer), 0.0)) + lat
                    inbound = arrived = max(inbound, ready) + nbytes / bw
                start = max(done, arrived)
                starts.append(start)
                done = start + secs
                if self.spans is not None and secs:
                    self.spans.append(("kernel", name, start, secs, (g,)))
            self.clock[g] = done

    def pieces(self, eqn, pieces, name=None) -> None:
        """:meth:`pipelined` for eqn ``eqn``'s ``pieces`` {device: [(piece fspec, its
        receives)]}, each priced by :func:`piece_seconds`."""
        size = pair_itemsize(eqn)
        self.pipelined({d: list(zip(piece_seconds(eqn, [f for f, _ in ps], self.topo, size),
                                    [r for _, r in ps])) for d, ps in pieces.items()}, name)

    def end(self) -> float:
        return max(self.clock.values(), default=0.0)


# a pipelined kernel's pieces: (the eqn, their work or None, whether they pay or None), by
# (id of the eqn, the pieces, the topology's rates): a call's estimate and its lowering ask
# for the same pieces (eins.ir.memo: a call's own entries)
_PIECE_WORK = Memo("piece work", 256)


# what every piece of an eqn's kernel shares on a topology (:class:`_PieceSetup`), by (id
# of the eqn, id of the topology): a call's families and its lowering price one eqn's
# pieces device by device, some 40 times a call of the paper block at p = 8
_PIECE_SETUP = Memo("piece setup", 64)


# (bandwidth, route latency) of a device pair, by (id of the topology, pair): the pieces'
# receives are priced per call (the topology held, so its id stays its own)
_LINKS: dict = {}


def link(topology, src, dst) -> tuple:
    """``(topology.bandwidth(src, dst), topology.route_latency(src, dst))``, remembered."""
    got = _LINKS.get((id(topology), src, dst))
    if got is None or got[0] is not topology:
        if len(_LINKS) > 1 << 16:
            _LINKS.clear()
        got = _LINKS[(id(topology), src, dst)] = (
            topology, topology.bandwidth(src, dst), topology.route_latency(src, dst))
    return got[1], got[2]


class _Key:
    """A memo key ``key`` hashed as ``probe`` (a part of it, once): a pipelined kernel's
    pieces' boxes, hashed whole on every lookup, were a third of one. Equal keys have
    equal probes; keys whose probes collide are told apart by ``key``."""
    __slots__ = ("key", "hash")

    def __init__(self, key, probe):
        self.key, self.hash = key, hash(probe)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return type(other) is _Key and self.hash == other.hash and self.key == other.key


class _PieceSetup:
    """What :func:`_piece_work` reads of an eqn and a topology, for any of its pieces: the
    16-bit FLOPs per FLOP of its compute dtype, the profile's entry (or None), its
    operands' types and bytes per element, its output's dtype, its pieced operands and
    its primitive's block FLOPs function (``typed``: whether it asks for block types)."""
    __slots__ = ("scale", "entry", "ins", "sizes", "odt", "keys", "boxed", "typed")

    def __init__(self, eqn, topology):
        prim = eqn.primitive
        self.scale = topology.flops / topology.flops_of(compute_dtype(eqn))
        self.entry = kernel_entry(eqn, topology)
        self.ins = [a.type for a in eqn.inputs]
        self.sizes = [t.dtype.itemsize for t in self.ins]
        self.odt = eqn.outputs[0].dtype
        self.keys = frozenset(pipeline_operands(eqn))
        # a pieceable operator counts a block's FLOPs from its boxes (Primitive.pipeline)
        self.boxed = prim.block_flops_fn
        self.typed = self.boxed is None or prim.bytes_fn is not None


def _piece_setup(eqn, topology) -> _PieceSetup:
    key = (id(eqn), id(topology))
    got = _PIECE_SETUP.get(key)
    if got is not None and got[0] is eqn and got[1] is topology:
        return got[2]
    setup = _PieceSetup(eqn, topology)
    _PIECE_SETUP.put(key, (eqn, topology, setup))
    return setup


def piece_work(eqn, fspecs, topology, out_itemsize) -> list:
    """(W, B) of a pipelined kernel's pieces (``fspecs``, in running order), as
    :func:`kernel_work` counts them: every piece but the last writes (o, lse) pairs of
    ``out_itemsize`` bytes per element, every piece but the first reads the running ones."""
    if len(fspecs) == 1:   # a kernel kept whole: pieces_pay never asks (two pieces or more)
        return list(_piece_work(eqn, fspecs, topology, out_itemsize))
    key = _work_key(eqn, fspecs, topology, out_itemsize)
    got = _PIECE_WORK.get(key)
    if got is not None and got[0] is eqn and got[1] is not None:
        return got[1]
    out = list(_piece_work(eqn, fspecs, topology, out_itemsize))
    _PIECE_WORK.put(key, (eqn, out, None if got is None else got[2]))
    return out


def _work_key(eqn, fspecs, topology, out_itemsize) -> _Key:
    key = (id(eqn), tuple(fspecs), topology.flops, topology.hbm_bw,
           id(getattr(topology, "profile", None)), out_itemsize)
    # hashed by the eqn, the output block (one per device) and the last piece's inputs
    return _Key(key, (key[0], len(fspecs), fspecs[0].outputs, fspecs[-1].inputs))


def _piece_work(eqn, fspecs, topology, out_itemsize, order=None, setup=None):
    """:func:`piece_work` uncached, as a generator; ``order``: the pieces to count, in that
    order (a caller may stop early); ``setup``: :func:`_piece_setup`'s, where known."""
    s = _piece_setup(eqn, topology) if setup is None else setup
    prim, params, scale, ins, sizes, odt = \
        eqn.primitive, eqn.params, s.scale, s.ins, s.sizes, s.odt
    osize = odt.itemsize
    last = len(fspecs) - 1
    # the pieces differ in their pieced operands' boxes alone (eins/passes/pipeline.py):
    # the others' bytes, and the output's, are counted once
    keys = s.keys
    f0 = fspecs[0]
    n = f0.outputs[0].size
    fixed = sum(x.size * m for k, (x, m) in enumerate(zip(f0.inputs, sizes)) if k not in keys)
    boxed, typed = s.boxed, s.typed
    for j in (range(len(fspecs)) if order is None else order):
        f = fspecs[j]
        if typed:
            tin = [TensorType(b.shape, t.dtype) for b, t in zip(f.inputs, ins)]
            tout = [TensorType(f.outputs[0].shape, odt)]
        w = (prim.block_flops(f, tin, tout, **params) if typed else
             boxed(f, None, None, **params)) * scale
        # the kernel's own bytes (every operand and result once) at the piece's sizes
        b = prim.bytes_accessed(tin, tout, **params) if prim.bytes_fn is not None else \
            fixed + sum(f.inputs[k].size * sizes[k] for k in keys) + n * osize
        b += n * (out_itemsize - osize if j != last else 0) + (n * out_itemsize if j else 0)
        yield w, b


def piece_seconds(eqn, fspecs, topology, out_itemsize) -> list:
    """Seconds of a pipelined kernel's pieces by the kernel model (:func:`piece_work`)."""
    entry = _piece_setup(eqn, topology).entry
    return [model_seconds(w, b, topology.flops, topology.hbm_bw, entry)
            for w, b in piece_work(eqn, fspecs, topology, out_itemsize)]


def pieces_floor(eqn, fspec, topology, out_itemsize) -> float:
    """A lower bound on the summed seconds of any pieces of ``eqn``'s kernel over
    ``fspec`` (:func:`piece_seconds`; eins/passes/pipeline.py), and on the kernel whole:
    its (W, B) as one piece, priced at the kernel class's highest efficiencies
    (``ClassProfile.peaks``: no piece runs faster, whatever the curve's shape), with one
    set of the small-kernel floors and one overhead. Pieces sum to the whole's FLOPs and
    at least its bytes (each reads its rows and its keys, and writes its rows), and each
    pays the floors and the overhead."""
    (w, b), = piece_work(eqn, (fspec,), topology, out_itemsize)
    return model_seconds(w, b, topology.flops, topology.hbm_bw,
                         _piece_setup(eqn, topology).entry, peaks=True)


def pieces_pay(eqn, fspecs, topology, out_itemsize) -> bool:
    """Whether ``eqn``'s kernel is worth running as the pieces ``fspecs`` on ``topology``
    (eins/passes/pipeline.py): every piece compute-bound by the kernel model (its FLOPs
    take at least as long as its bytes, the running pairs' included), so the pairs'
    traffic hides under its FLOPs and only the per-kernel floor is added. A piece of few
    visible pairs (keys of other documents than most of its rows') would spend more on the
    running pairs than its keys' transfer saves."""
    key = _work_key(eqn, fspecs, topology, out_itemsize)
    got = _PIECE_WORK.get(key)
    if got is not None and got[0] is eqn and got[2] is not None:
        return got[2]   # asked again (the call's lowering, after its estimate)
    setup = _piece_setup(eqn, topology)
    entry = setup.entry
    # the farthest pieces first: the likeliest to see few keys (a kernel kept whole
    # costs one of them)
    work = []
    for w, b in _piece_work(eqn, fspecs, topology, out_itemsize,
                            range(len(fspecs) - 1, -1, -1), setup):
        compute, memory = roofline_terms(w, b, topology.flops, topology.hbm_bw, entry,
                                         floors=False)
        if compute < memory:
            _PIECE_WORK.put(key, (eqn, None, False))
            return False
        work.append((w, b))
    _PIECE_WORK.put(key, (eqn, work[::-1], True))   # every piece counted: piece_work's
    return True


def predict(state) -> PredictedTime:
    """-> a dict that prints as a table (:class:`~eins.cost.predicted.PredictedTime`):
    {"total_ms", "compute_ms", "exchange_ms" (every exchange, the output gathers included),
    "timeline_ms" (the same kernels and exchanges timed GPU by GPU, :class:`Timeline`),
    "gather_ms" (those gathers alone), "per_eqn": [{eqn, op, phase, compute_ms, exchange_ms,
    gather_ms}] (phase: "fwd" or "bwd") (exchange_ms: the exchanges feeding the eqn; gather_ms: the
    gathers of the program outputs it produces, as the time cost charges them; the rows add
    up to the totals), "topology",
    "peak_bytes": {device: bytes}, "fits": every device's peak within the plan's memory
    limit (``memory_limit=``, else the GPU's memory) and within the GPU's memory (a limit
    above it plans as if the GPU had that much, but such a plan does not fit the GPU),
    "resident_bytes", "placed_peak_bytes" and "fits_placed": the same with the inputs held
    on the devices for the whole call (:func:`placed_memory`)}."""
    xir = state.exchange
    topo = xir.topology
    prog = state.program
    rows, compute, exchange, gather = [], 0.0, 0.0, 0.0
    line = Timeline(topo)
    # the layers of a stack repeat an eqn with the same spec object: its kernels' times are
    # computed once per what they read (the spec's boxes, the primitive, the operands'
    # types, the params); the plan holds every spec, so their ids stay theirs
    busy = {}
    pieced = pieces_of(state.device) if state.device is not None else {}
    for i, (eqn, ep) in enumerate(zip(prog.eqns, state.plan.eqn_plans)):
        sizes = out_itemsizes(eqn, ep.spec)
        try:
            key = (id(ep.spec), id(eqn.primitive), sizes,
                   tuple(a.type if isinstance(a, Literal) else a.dtype for a in eqn.inputs),
                   tuple(v.dtype for v in eqn.outputs), tuple(sorted(eqn.params.items())))
            c = busy.get(key)
        except TypeError:   # an unhashable param: priced without the memo
            key = c = None
        ks = c
        if ks is None:
            ks = eqn_kernel_seconds(eqn, ep.spec.fspecs, topo, sizes)
            if key is not None:
                busy[key] = ks
        # function specification f on the device the schedule placed it on (the optimized
        # schedule moves eqns); devices sharing a GPU add up
        c = topo.busy_seconds(ks, xir.placement[i])
        if i in pieced:   # its keys' exchanges run under its pieces (Timeline.pipelined)
            for e in xir.for_eqn(i):
                if not under_pieces(eqn, e.inputs, e.serves):
                    line.exchange(e)
            line.pieces(eqn, {d: [(p.kernel.fspec, p.recvs) for p in ps]
                              for d, ps in pieced[i].items()})
        else:
            for e in xir.for_eqn(i):
                line.exchange(e)
            line.kernels(ks, xir.placement[i])
        x = sum(e.predicted_s or 0.0 for e in xir.for_eqn(i))
        rows.append({"eqn": i, "op": eqn.prim, "phase": eqn.phase, "compute_ms": c * 1e3,
                     "exchange_ms": x * 1e3, "gather_ms": 0.0})
        compute += c
        exchange += x
    for e in xir.for_eqn(-1):   # a program output's gather, charged to its producer
        line.exchange(e)
        rows[e.producer]["gather_ms"] += (e.predicted_s or 0.0) * 1e3
        gather += e.predicted_s or 0.0
    exchange += gather
    peaks, resident, placed = memory(state.device)
    limit = state.plan.memory_limit   # memory_limit= when given, else the GPU's memory
    limit = topo.memory if limit is None else min(limit, topo.memory)
    return PredictedTime({"total_ms": (compute + exchange) * 1e3, "compute_ms": compute * 1e3,
                          "timeline_ms": line.end() * 1e3,
                          "exchange_ms": exchange * 1e3, "gather_ms": gather * 1e3,
                          "per_eqn": rows, "topology": topo.name,
                          "peak_bytes": peaks, "fits": max(peaks.values()) <= limit,
                          "resident_bytes": resident, "placed_peak_bytes": placed,
                          "fits_placed": max(placed.values()) <= limit})
