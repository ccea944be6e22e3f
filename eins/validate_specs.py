"""The spec checker: every join-agg spec of every primitive, brute-forced on small shapes.

For each registered primitive, small example programs (its ``Primitive.samples``, declared in
its op family file: Literal scalars, broadcasting, uneven extents, each op's parameters) are
traced; for every eqn, every spec the
enumerator (:mod:`eins.passes.enumerate_specs`) produces for p in {1, 2, 3, 4, 6, 8} is run
as Definition 3.7 says: join (``prim.run_block(fspec, *input blocks)`` on numpy), aggregate
equal output boxes with the spec's ⊕, recompose, and compare with the whole-tensor result.
Blocks aggregated with a ⊕ of pairs (``lse``) run the partial kernel and must return the
pair dtype; their full aggregate is finalized to the output dtype (eins.ir.joinagg).

- **wrong**: a spec that computes a different result, raises, has the wrong number of
  function specifications (Section 3.3: one per combination of intervals), a box that is not
  a projection of its tensor, output blocks that break the tiling condition (Definition 3.6),
  repeated output boxes without ⊕, or blocks of the wrong shape or dtype.
- **missing**: an index the operator declares not shardable although splitting it in two
  gives the right result (a spec the operator could offer but does not), and a p for which
  the enumerator fell back to fewer pieces though the sample's extents would allow p.
- **untested**: a registered primitive no sample exercises.

Also ``python -m eins.validate_specs [--op NAME ...] [--p 1,2,3]``; exit status 1 if a spec
is wrong or an op is untested.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

import numpy as np

import eins.ops  # noqa: F401  (registers every op family)
from eins.errors import EinsError
from eins.ir.joinagg import AGG_FUNCS, aggregate, finalize, partial_dtype
from eins.ir.primitive import PRIMITIVES, get_primitive
from eins.ir.program import Literal, eqn_indexing
from eins.ir.types import Box, bfloat16, is_float
from eins.passes.enumerate_specs import (balanced_intervals, eqn_candidates, factorizations,
                                         index_caps)
from eins.tracing import trace

PS = (1, 2, 3, 4, 6, 8)


# ----------------------------------------------------------------------------- samples
def _arr(*shape, dtype="float64", lo=-2.0, hi=2.0, seed=None):
    rng = np.random.default_rng(seed if seed is not None else (hash(shape) & 0xFFFF))
    dt = np.dtype(dtype) if dtype != "bfloat16" else bfloat16
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        return rng.integers(-5, 6, size=shape).astype(dt)
    return rng.uniform(lo, hi, size=shape).astype(dt)


def samples():
    """(label, fn, args): small programs exercising the primitives, each primitive's own
    (``Primitive.samples``, declared in its op family file). Extents are chosen so that 2-,
    3-, 4-, 6- and 8-way splits exist, some of them uneven."""
    out = []
    for prim in list(PRIMITIVES.values()):
        if prim.samples is not None:
            out += prim.samples(_arr)
    return out


# ----------------------------------------------------------------------------- checking
@dataclass
class Report:
    op: str
    checked: int = 0
    wrong: list = field(default_factory=list)
    missing: list = field(default_factory=list)

    @property
    def untested(self) -> bool:
        return self.checked == 0

    def line(self) -> str:
        status = "UNTESTED" if self.untested else ("WRONG" if self.wrong else "ok")
        return (f"{self.op:14s} {status:8s} {self.checked:5d} specs checked, "
                f"{len(self.wrong)} wrong, {len(self.missing)} missing")


def _tol(dtype):
    dt = np.dtype(dtype)
    if not is_float(dt):
        return 0.0, 0.0
    if dt == np.float64:
        return 1e-9, 1e-9
    if dt == np.float32:
        return 1e-4, 1e-5
    return 2e-2, 2e-2   # float16 / bfloat16


def _close(got, want) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False
    rtol, atol = _tol(want.dtype)
    if rtol == 0.0:
        return bool(np.array_equal(got, want))
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                            atol=atol, equal_nan=True))


def run_spec(eqn, spec, values):
    """Definition 3.7 on numpy: join, aggregate, recompose. Returns the list of outputs, or
    raises EinsError describing the first structural problem."""
    prim = eqn.primitive
    whole_in = [Box.full(np.shape(v)) for v in values]
    outs = [[] for _ in eqn.outputs]
    mult = [spec.multiplicity(j) for j in range(len(eqn.outputs))]
    for f in spec.fspecs:
        # a block aggregated with a ⊕ of pairs (lse) is computed as pairs (its partial kernel)
        want_dt = [partial_dtype(spec.aggs[j], v.dtype) if mult[j][f.outputs[j]] > 1
                   else v.dtype for j, v in enumerate(eqn.outputs)]
        partial = any(d != v.dtype for d, v in zip(want_dt, eqn.outputs))
        if len(f.inputs) != len(values) or len(f.outputs) != len(eqn.outputs):
            raise EinsError(f"{f!r}: arity differs from the eqn's")
        blocks = []
        for b, w, v in zip(f.inputs, whole_in, values):
            if b.rank != w.rank or not w.contains(b):
                raise EinsError(f"input box {b!r} is not a projection of {w!r}")
            blocks.append(np.asarray(v)[b.relative_to(w)])
        res = prim.run_block(f, *blocks, partial=partial, **eqn.params)
        if len(res) != len(eqn.outputs):
            raise EinsError(f"block kernel returned {len(res)} outputs, expected "
                            f"{len(eqn.outputs)}")
        for j, (b, r, var) in enumerate(zip(f.outputs, res, eqn.outputs)):
            w = Box.full(var.shape)
            if b.rank != w.rank or not w.contains(b):
                raise EinsError(f"output box {b!r} is not a projection of {w!r}")
            r = np.asarray(r)
            if r.shape != b.shape:
                raise EinsError(f"{f!r}: block kernel output {j} has shape {r.shape}, box "
                                f"{b!r} has {b.shape}")
            if r.dtype != want_dt[j]:
                raise EinsError(f"{f!r}: block kernel output {j} has dtype {r.dtype}, "
                                f"expected {want_dt[j]}")
            outs[j].append((b, r))
    spec.check_tiling([v.shape for v in eqn.outputs])
    results = []
    for j, var in enumerate(eqn.outputs):
        groups: dict = {}
        for b, r in outs[j]:
            groups.setdefault(b, []).append(r)
        full = np.zeros(var.shape, dtype=var.dtype)
        for b, rs in groups.items():
            if len(rs) > 1:
                if spec.aggs[j] is None or spec.aggs[j] not in AGG_FUNCS:
                    raise EinsError(f"output {j}: box {b!r} appears {len(rs)} times but ⊕ is "
                                    f"{spec.aggs[j]!r}")
                r = finalize(spec.aggs[j], aggregate(spec.aggs[j], rs), var.dtype)
            else:
                r = rs[0]
            full[b.relative_to(Box.full(var.shape))] = r
        results.append(full)
    return results


def sample_values(prog, args):
    """Every variable's whole value (id(var) -> array), evaluating eqn by eqn."""
    env = {id(v): c for v, c in prog.consts}
    env.update({id(v): np.asarray(a) for v, a in zip(prog.inputs, args)})
    for e in prog.eqns:
        ins = [np.asarray(a.value, a.dtype) if isinstance(a, Literal) else env[id(a)]
               for a in e.inputs]
        for v, r in zip(e.outputs, e.primitive.impl(*ins, **e.params)):
            env[id(v)] = np.asarray(r)
    return env


def check_eqn(eqn, ins, wants, report: Report, label: str, ps=PS):
    """Check every enumerated spec of one eqn for every p; record into ``report``."""
    ix = eqn_indexing(eqn)
    caps = index_caps(ix)
    for p in ps:
        cands, q = eqn_candidates(eqn, p, max_specs=10 ** 6)
        if q < p and _reachable(p, list(caps.values())):
            report.missing.append(f"{label}: p={p}: enumerator fell back to {q} pieces")
        for c in cands:
            report.checked += 1
            expect = math.prod(len(iv) for iv in c.intervals.values())
            where = f"{label}: p={p} split {c.counts or 'whole'}"
            if len(c.spec.fspecs) != expect:
                report.wrong.append(f"{where}: {len(c.spec.fspecs)} function specifications, "
                                    f"expected {expect} (one per combination of intervals)")
                continue
            try:
                got = run_spec(eqn, c.spec, ins)
            except Exception as ex:   # a spec that crashes is a wrong spec; report, go on
                report.wrong.append(f"{where}: {type(ex).__name__}: {ex}")
                continue
            for j, (g, w) in enumerate(zip(got, wants)):
                if np.shape(g) != np.shape(w):   # the shape rule and the kernel disagree
                    report.wrong.append(f"{where}: output {j} has shape {np.shape(g)} (the "
                                        f"shape rule's), the whole result {np.shape(w)}")
                elif not _close(g, w):
                    err = np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))
                    report.wrong.append(f"{where}: output {j} differs from the whole result "
                                        f"(max abs error {err:.3g})")
    # indices declared not shardable although a 2-way split would be right
    for name, n in ix.extents.items():
        if name in ix.shardable or n < 2:
            continue
        try:
            spec = ix.producer(ix.full({name: balanced_intervals(n, "any", 2)}))
            if len(spec.fspecs) != 2 or len({f.inputs for f in spec.fspecs}) < 2:
                continue
            got = run_spec(eqn, spec, ins)
        except Exception:
            continue
        if all(_close(g, w) for g, w in zip(got, wants)):
            report.missing.append(f"{label}: index {name!r} (extent {n}) is not shardable, "
                                  f"yet a 2-way split is correct")


def _reachable(p, caps) -> bool:
    return bool(factorizations(p, caps))


def check(ops=None, ps=PS) -> dict[str, Report]:
    """Run the checker over ``ops`` (default: every registered primitive)."""
    names = list(PRIMITIVES) if ops is None else list(ops)
    for n in names:
        get_primitive(n)  # unknown name -> EinsError naming it
    reports = {n: Report(n) for n in names}
    for label, fn, args in samples():
        prog = trace(fn, args)[0]
        if not any(e.prim in reports for e in prog.eqns):
            continue
        env = sample_values(prog, args)
        for e in prog.eqns:
            if e.prim not in reports:
                continue
            ins = [np.asarray(a.value, a.dtype) if isinstance(a, Literal) else env[id(a)]
                   for a in e.inputs]
            wants = [env[id(v)] for v in e.outputs]
            check_eqn(e, ins, wants, reports[e.prim], label, ps)
    return reports


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eins.validate_specs",
                                 description="Check every join-agg spec of every primitive.")
    ap.add_argument("--op", action="append", help="primitive name (repeatable); default all")
    ap.add_argument("--p", default=",".join(map(str, PS)),
                    help="comma-separated device counts (default %(default)s)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list missing specs too")
    a = ap.parse_args(argv)
    try:
        ps = tuple(int(x) for x in a.p.split(","))
    except ValueError:
        ap.error(f"--p must be comma-separated ints, got {a.p!r}")
    try:
        reports = check(a.op, ps)
    except EinsError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    bad = False
    for r in reports.values():
        print(r.line())
        for w in r.wrong:
            print(f"    wrong: {w}")
        if a.verbose:
            for m in r.missing:
                print(f"    missing: {m}")
        bad |= bool(r.wrong) or r.untested
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
