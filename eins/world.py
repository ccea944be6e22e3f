"""``eins.distribute(fn, devices="world")``: the API over the rank runtime
(:mod:`eins.runtime.ranks`), one device per rank of the default torch.distributed process
group. It sits above both the API and the runtime: it subclasses
:class:`eins.api.Distributed` and installs itself for ``eins.distribute`` (the runtime does
not import the API)."""
from __future__ import annotations

import time

import numpy as np

from eins.api import Distributed, install_world
from eins.arguments import is_torch, refuse_traced, scalar_array, signature, torch_data
from eins.errors import DistributedError, EinsError, TraceError
from eins.hardware.net import resolve_topology
from eins.ir.types import as_dtype, is_python_scalar, is_torch_tensor, torch_to_numpy
from eins.ir.scalars import is_traced_scalar
from eins.kernels.build import COUNTS, count_jit_compiles
from eins.passes.rebalance import runtime_operands
from eins.rebalanced import RankRun
from eins.runtime.rank_state import kept_outputs, relayout, resident_source
from eins.runtime.ranks import (RankStats, check_plans, gather_outputs, init_world,
                                make_kernels, plan_hash, run_rank)
from eins.runtime.sharded import Sharded, resident_options
from eins.stages import donated_leaves
from eins.tracing import ShapeDtype, call_leaf_names, tree_unflatten

__all__ = ["WorldDistributed"]


class WorldDistributed(Distributed):
    """``eins.distribute(fn, devices="world")``: one device per rank of the default process
    group. Every rank calls it with the same arguments (each call's plan is checked to be
    the same on every rank: function, shapes, dtypes, options, static arguments and captured
    constants; the data of array arguments and the values of Python scalars, runtime inputs,
    are not compared); arguments may be ``eins.ShapeDtype`` for program inputs that
    ``load(input_index, box)`` provides block by block (the index is the input's position
    among the call's array and Python scalar leaves, in ``eins.tree_flatten`` order; the
    box is an ``eins.ir.types.Box`` with ``lo``, ``hi`` and ``shape``). A call returns the
    whole outputs on every rank (``gather=True``) or, per output, a dict {Box: block} of the
    blocks this rank computed. ``kernels`` is this rank's kernel set
    (:func:`eins.runtime.ranks.make_kernels`; its ``name`` says which)."""

    def __init__(self, fn, options, *, timeout_s, load, gather, kernels="auto",
                 static_argnums=(), static_argnames=(), outputs="host", donate_argnums=(),
                 rebalance=None):
        resident_options(outputs, donate_argnums)   # bad ones fail before joining the world
        rank, size = init_world(timeout_s)
        devices = tuple(range(size))
        # the devices are checked against the topology once the rank count is known
        super().__init__(fn, devices, options,
                         topology=resolve_topology(options.topology, devices,
                                                   options.profile),
                         static_argnums=static_argnums, static_argnames=static_argnames,
                         outputs=outputs, donate_argnums=donate_argnums,
                         rebalance=rebalance)
        self.rank, self.world_size = rank, size
        self.timeout_s = float(timeout_s)
        self.load = load
        self.gather = gather
        self.kernel_set = kernels
        self.kernels = make_kernels(kernels)   # a bad backend fails here, not at a call
        if hasattr(self.kernels, "attention"):  # the torch kernel sets' attention impl
            self.kernels.attention = options.attention
        if self.kernels.name == "cuda":   # Triton's own compilations, as Compiled counts them
            count_jit_compiles()
        self._digests = {}   # signature -> (its Lowered, the digest of its device program)
        self._stats = None
        # per signature whose program takes segment ends as data: this rank's re-cut
        # programs (None: rebalance=False, the compile-time cuts for every call)
        self._recuts: dict = {}
        self.counts = {"rebalances": 0, "lowerings": 0, "kernel_compiles": 0}

    def _call(self, args, kwargs, bound=False):
        dargs, dkwargs, _, skey = self._split(args, kwargs, bound)
        tree, key, leaves = signature(dargs, dkwargs)
        refuse_traced(leaves, "eins.distribute")
        low = self._lower(args, kwargs, bound)
        prog = low.program
        donated = donated_leaves(tree, self.donate_argnums, leaves)
        names = call_leaf_names(tree)
        # Python scalars are inputs of the program, of the dtype each was traced in
        arrays = []
        for i, x in enumerate(leaves):
            if is_python_scalar(x) and not is_traced_scalar(x):
                continue
            if isinstance(x, Sharded):
                x.check_alive(names[i])
                if x.where == "world":   # this rank's blocks, read where they are
                    arrays.append(x)
                    continue
                x = x.gather()
            arrays.append(_host_array(x, len(arrays), prog.inputs))
        for k, (v, a) in enumerate(zip(prog.inputs, arrays)):
            if isinstance(a, ShapeDtype):
                if self.load is None:
                    raise TraceError(f"argument {k} is a ShapeDtype without data: pass "
                                     f"load=fn(input_index, box) to eins.distribute, or an "
                                     f"array")
            elif tuple(a.shape) != v.shape or as_dtype(a.dtype) != v.dtype:
                raise TraceError(f"argument {k}: planned for {v.type!r}, got shape "
                                 f"{tuple(a.shape)} dtype {a.dtype}")
        # this rank's instructions alone (its peers lower theirs); the digest the ranks
        # compare is of the plan they were lowered from, which every rank holds whole
        device_program = low.rank_device(self.rank)
        # every call, not only a signature's first: ranks that each called every signature
        # once and then different ones ran different plans, and the gather swapped bytes
        hit = self._digests.get((tree, key, skey))
        if hit is None or hit[0] is not low:
            hit = self._digests[(tree, key, skey)] = (low, plan_hash(device_program))
            self.counts["lowerings"] += 1
        digest = hit[1]
        run = self._recut_run((tree, key, skey), low)
        t0 = time.perf_counter()
        if run is not None:   # the call's segment ends re-cut the plan: this rank's program
            for _, k in run.operands.values():
                if not isinstance(arrays[k], np.ndarray):
                    raise TraceError(f"{names[_leaf_of(leaves, arrays[k])]} (the segment "
                                     f"ends of a packed batch) must be an array every rank "
                                     f"holds: each rank re-cuts the plan from them; got "
                                     f"{type(arrays[k]).__name__}")
            device_program = run.program(arrays)
            digest += f" ends={run.digest(arrays)}"
        prepared = time.perf_counter() - t0
        # gather= changes what the ranks do after the program (a point-to-point gather or
        # not): rank 0 with gather=True and the others False waited out timeout_s
        check_plans(f"{digest} gather={bool(self.gather)}", self.timeout_s,
                    f"{prog.name}({', '.join(repr(v.type) for v in prog.inputs):.120})")
        consts = [c for _, c in prog.consts]
        sharded = {k: a for k, a in enumerate(arrays) if isinstance(a, Sharded)}
        compiles = COUNTS["kernel_compiles"]
        received, relaid = relayout(device_program, self.rank, sharded, self.kernels,
                                    self.timeout_s)
        stats = RankStats(self.rank)

        def source(kind, k, box):
            sl = tuple(slice(l, h) for l, h in zip(box.lo, box.hi))
            if kind == "const":
                return np.asarray(consts[k])[sl]
            a = arrays[k]
            if isinstance(a, Sharded):
                return resident_source(a, k, box, received, self.kernels, self.rank, stats)
            stats.h2d_inputs[k] = stats.h2d_inputs.get(k, 0) + box.size * a.dtype.itemsize
            if not isinstance(a, ShapeDtype):
                return np.asarray(a)[sl]
            got = self.load(k, box)
            if is_torch_tensor(got):   # a checkpoint shard: bfloat16, requires_grad, ...
                got = torch_to_numpy(got, f"rank {self.rank}: load({k}, {box!r})'s result")
            if tuple(np.shape(got)) != box.shape:
                raise DistributedError(f"rank {self.rank}: load({k}, {box!r}) returned shape "
                                       f"{tuple(np.shape(got))}, expected {box.shape}")
            return got

        keep = self.outputs == "devices"
        stored, run_stats = run_rank(device_program, self.rank, source, self.kernels,
                                     self.timeout_s, keep=keep)
        run_stats.h2d_inputs, run_stats.resident_bytes = stats.h2d_inputs, stats.resident_bytes
        run_stats.relayout_bytes = relaid
        run_stats.rebalance_seconds = prepared
        stats = run_stats
        for x in donated:   # the call ran: the state it consumed is released
            x.donate(f"a call of {prog.name}")
        if keep:   # each rank keeps its own blocks (gather= does not apply)
            outs = kept_outputs(device_program, stored, self.rank, self.kernels,
                                self.timeout_s)
        elif self.gather:
            outs = gather_outputs(device_program, stored, self.timeout_s, stats)
        else:
            outs = [dict() for _ in prog.outputs]
            for o, box, a in stored:
                outs[o][box] = a
        self.counts["kernel_compiles"] += COUNTS["kernel_compiles"] - compiles
        self._stats = stats
        self.last = low
        return tree_unflatten(low.out_tree, list(outs))

    def _recut_run(self, ck, low):
        """The signature's :class:`eins.rebalanced.RankRun` where its program takes segment
        ends as data and ``rebalance`` is not False, else None."""
        if ck not in self._recuts:
            ops = runtime_operands(low.program) if self.rebalance is not False else {}
            self._recuts[ck] = RankRun(low.compilation, ops, self.rank, self.counts) \
                if ops else None
        run = self._recuts[ck]
        if run is not None and run.comp is not low.compilation:   # lowered again
            run = self._recuts[ck] = RankRun(low.compilation, run.operands, self.rank,
                                             self.counts)
        return run

    def stats(self) -> dict:
        """This rank's last call: bytes sent and received per peer, transfers, batches,
        kernels, peak live bytes, the gather's bytes and the seconds the call took
        (``rebalance_seconds``: re-cutting and lowering for the call's segment ends); and
        the function's counts on this rank: ``traces`` and ``plans`` (one per signature),
        ``rebalances`` (calls re-cut for their segment ends), ``lowerings`` (this rank's
        device programs built: one per signature, plus, for a program re-cut per call, its
        family's first under the naive schedule and one per new cut) and
        ``kernel_compiles`` (Triton kernels built while it ran: the "interpret" and "cuda"
        kernel sets)."""
        if self._stats is None:
            raise EinsError("stats() before the first call")
        return dict(self._stats.as_dict(), traces=self.trace_count, plans=len(self._cache),
                    **self.counts)


def _leaf_of(leaves, a) -> int:
    """The index among ``leaves`` of the call's leaf that became array ``a``."""
    return next((i for i, x in enumerate(leaves) if x is a), 0)


def _host_array(x, k, inputs):
    """A call's array leaf as this rank reads it: a ShapeDtype as is (``load`` gives its
    blocks), a torch tensor as plain numpy data (:func:`eins.arguments.torch_data`: the
    kernel sets load their blocks from numpy), a Python scalar as its input's 0-d array,
    anything else through np.asarray."""
    if isinstance(x, ShapeDtype):
        return x
    if is_traced_scalar(x) and k < len(inputs):
        return scalar_array(x, inputs[k].dtype, f"argument {k}")
    return torch_data(x, k) if is_torch(x) else np.asarray(x)


install_world(WorldDistributed)
