"""The per-call rebalance of a plan family (issue 36): a program whose eqns take a static
parameter as data on every call (attention's ``segments`` as an int array:
``Primitive.runtime_params``) is planned once; each call re-cuts those eqns for its own
values without re-tracing or re-running the DP.

What stays (the plan family, decided at compile time): every eqn's split, i.e. which indices
are split and into how many intervals (``EqnPlan.splits``), and every other eqn's spec.
What a call decides: the rebalanced eqns' interval positions, from the operator's own
balance rule (``Indexing.balance``) on the call's values, and so their boxes. For attention
that is the DP's rule itself: contiguous query blocks of equal causal work, cut at segment
ends when that costs at most ``SEGMENT_CUT_SLACK`` (10%) over free cuts (whole documents per
device read no key twice). Equal causal work rather than zig-zag: one box per device is what
the plan, the placement and the time model describe, and contiguous cuts at segment ends
move no keys at all; rather than whole segments only: one long document would then leave
devices idle.

Where several families are compiled (say attention split by heads, by query sequence
re-cut per call, and by query sequence at fixed cuts: ``recut(..., balance=False)`` keeps
the family's cut positions and re-derives only the boxes, the keys each block reads, from
the call's ends), ``choose`` picks one per call by an estimate about as cheap as the
re-cut: the family's first lowering's predicted time with its re-cut eqns' kernels priced
again on the call's boxes (``recut_seconds``) and, for what the boxes moved, the bytes each
device's new boxes read beyond its first ones (and its consumers lack of its first
outputs), received at its narrowest link (``moved_seconds``). It is exact for a family
whose boxes the call does not move (a heads split: the kernels read the ends as data, so
only their work changes); simulating a call's exchanges instead costs about as much as
lowering them.

``recut`` is cheap: the operator's balance is O(p log n) per split index (binary search on
a closed-form prefix of work), the rest is one spec producer call per rebalanced eqn. The
physical lowering of the result (place .. lower) is the caller's (eins/stages.py), cached
by the resulting boxes.
"""
from __future__ import annotations

from dataclasses import replace

from eins.cost.predict import kernel_seconds, out_itemsizes, predict
from eins.errors import EinsError
from eins.ir.program import Program

__all__ = ["runtime_operands", "recut", "recut_key", "specialize", "recut_seconds",
           "moved_seconds", "Choice", "estimates", "fastest", "choose"]


def runtime_operands(program) -> dict:
    """{eqn index: (operand index, program input index)} for each eqn whose primitive takes
    a parameter as data (``Primitive.runtime_params``) fed straight from a program input
    (one the host holds at call time). An eqn whose data is computed inside the program
    keeps its compile-time cuts."""
    where = {id(v): k for k, v in enumerate(program.inputs)}
    out = {}
    for i, e in enumerate(program.eqns):
        fn = e.primitive.runtime_params
        if fn is None:
            continue
        n = fn(e.params, [a.type for a in e.inputs], None)
        if n is not None and id(e.inputs[n]) in where:
            out[i] = (n, where[id(e.inputs[n])])
    return out


def _host(x):
    """A call's argument as a host numpy array (a torch tensor is copied to the host: the
    boundaries are a few ints)."""
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    if hasattr(x, "get"):   # CuPy
        return x.get()
    return x


def specialize(program, arrays, operands=None):
    """``program`` with its runtime-parameter eqns' params written from one call's values
    (``arrays``: its program inputs; only the runtime operands are read). Planned, it gives a
    family chosen for a representative batch rather than for the worst any batch could be
    (attention's FLOPs with unknown ends are those of one document); ``recut`` then re-cuts
    it per batch. Its own boxes fit that batch only."""
    operands = runtime_operands(program) if operands is None else operands
    eqns = list(program.eqns)
    for i, (n, k) in operands.items():
        e = eqns[i]
        eqns[i] = replace(e, params=e.primitive.runtime_params(
            e.params, [a.type for a in e.inputs], {n: _host(arrays[k])}))
    return Program(program.inputs, tuple(eqns), program.outputs, program.consts, program.name)


def recut(comp, arrays, operands=None, balance=True):
    """The planned Compilation ``comp`` with its runtime-parameter eqns re-cut for one call
    (``arrays``: the call's program inputs): each such eqn gets the call's static params
    (so its FLOPs and boxes are this batch's), the same split counts, and intervals from its
    operator's balance on them (not ``balance``: the family's intervals, fixed cuts). The
    costs recorded in the plan stay the family's."""
    if comp.plan is None:
        raise EinsError("recut needs a planned Compilation")
    operands = runtime_operands(comp.program) if operands is None else operands
    if not operands:
        return comp
    prog = comp.program
    eqns, plans = list(prog.eqns), list(comp.plan.eqn_plans)
    for i, (n, k) in operands.items():
        e = eqns[i]
        ins = [a.type for a in e.inputs]
        params = e.primitive.runtime_params(e.params, ins, {n: _host(arrays[k])})
        ix = e.primitive.indexing(ins, [v.type for v in e.outputs], **params)
        ep = plans[i]
        iv = dict(ep.intervals)
        for name, count in ep.splits.items():
            if balance and name in ix.balance:
                cuts = ix.balance[name](count)
                if cuts is None:
                    raise EinsError(f"eqn {i} ({e.prim}): {name} cannot be cut {count} ways "
                                    f"for this call")
                iv[name] = tuple(cuts)
        eqns[i] = replace(e, params=params)
        plans[i] = replace(ep, intervals=iv, spec=ix.spec(iv))
    new_prog = Program(prog.inputs, tuple(eqns), prog.outputs, prog.consts, prog.name)
    plan = replace(comp.plan, program=new_prog, eqn_plans=tuple(plans))
    return replace(comp, program=new_prog, plan=plan, placement=None, exchange=None,
                   device=None)


def recut_key(comp, operands) -> tuple:
    """What a recut Compilation's lowering depends on: the rebalanced eqns' function
    specifications (their boxes). Two calls with equal keys share one device program."""
    return tuple((i, comp.plan.eqn_plans[i].spec.fspecs) for i in sorted(operands))


def recut_seconds(comp, operands) -> float:
    """Seconds of the kernels of ``comp``'s re-cut eqns (``operands``' keys) on its boxes:
    per eqn the slowest GPU's, as eins.cost.predict charges them."""
    topo, total = comp.topology, 0.0
    for i in operands:
        e, spec = comp.program.eqns[i], comp.plan.eqn_plans[i].spec
        sizes = out_itemsizes(e, spec)
        total += topo.busy_seconds([kernel_seconds(e, f, topo, sizes) for f in spec.fspecs],
                                   comp.devices)
    return total


def _outside(box, other) -> int:
    """Elements of ``box`` not in ``other``."""
    common = box.intersect(other)
    return box.size - (common.size if common is not None else 0)


def moved_seconds(first, comp, operands, inbound) -> float:
    """Per re-cut eqn, the slowest device's receiving of what its boxes in ``comp`` read
    beyond those in ``first`` (the family's first lowering), plus the slowest device's of
    the output its consumers read there that its new boxes no longer write (a later
    exchange: its own slowest device), at ``inbound[device]`` bytes/s."""
    total = 0.0
    for i in operands:
        e = comp.program.eqns[i]
        old, new = first.plan.eqn_plans[i].spec.fspecs, comp.plan.eqn_plans[i].spec.fspecs
        reads = writes = 0.0
        for d, f, g in zip(first.placement[i], old, new):
            n = sum(_outside(b, a) * x.type.dtype.itemsize
                    for x, a, b in zip(e.inputs, f.inputs, g.inputs))
            m = sum(_outside(a, b) * v.type.dtype.itemsize
                    for v, a, b in zip(e.outputs, f.outputs, g.outputs))
            reads, writes = max(reads, n / inbound[d]), max(writes, m / inbound[d])
        total += reads + writes
    return total


class Choice:
    """One compiled family for :func:`choose`: ``planned`` (its planned Compilation),
    ``lowered`` (its first lowering, priced: ``base`` is its predicted seconds but for its
    re-cut eqns' kernels), and ``balance`` (re-cut per call, or keep its cuts)."""

    def __init__(self, planned, lowered, operands, balance=True):
        self.planned, self.lowered, self.balance = planned, lowered, balance
        self.base = predict(lowered)["total_ms"] / 1e3 - recut_seconds(lowered, operands)
        topo = lowered.topology
        self.inbound = {d: min((topo.bandwidth(s, d) for s in lowered.devices if s != d),
                               default=float("inf")) for d in lowered.devices}

    def estimate(self, comp, operands) -> float:
        """Predicted seconds of this family re-cut as ``comp`` (module docstring)."""
        return (self.base + recut_seconds(comp, operands)
                + moved_seconds(self.lowered, comp, operands, self.inbound))


def estimates(choices, arrays, operands) -> list:
    """[(re-cut Compilation, estimated seconds)] of each family among ``choices``
    (:class:`Choice`) for this call (``arrays``)."""
    out = []
    for c in choices:
        comp = recut(c.planned, arrays, operands, c.balance)
        out.append((comp, c.estimate(comp, operands)))
    return out


def fastest(ests) -> int:
    """The index of the smallest estimate among :func:`estimates`' ``ests``; the first on
    a tie."""
    return min(range(len(ests)), key=lambda n: ests[n][1])


def choose(choices, arrays, operands):
    """-> (index, re-cut Compilation, estimated seconds) of the family among ``choices``
    (:class:`Choice`) whose re-cut for this call (``arrays``) is estimated fastest; the
    first on a tie."""
    ests = estimates(choices, arrays, operands)
    n = fastest(ests)
    return (n,) + ests[n]
