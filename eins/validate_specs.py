"""The spec checker: every join-agg spec of every primitive, brute-forced on small shapes.

For each registered primitive, small example programs (``SAMPLES`` below: Literal scalars,
broadcasting, uneven extents, each op's parameters) are traced; for every eqn, every spec the
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

from eins.errors import EinsError
from eins.ir.joinagg import AGG_FUNCS, aggregate, finalize, partial_dtype
from eins.ir.program import Literal
from eins.ir.types import Box, bfloat16, is_float
from eins.ir.primitive import PRIMITIVES, get_primitive

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


def _pos(*shape, dtype="float64"):
    return _arr(*shape, dtype=dtype, lo=0.5, hi=2.0)


def _ops():
    import eins.ops as o
    return o


def samples():
    """(label, fn, args): small programs exercising the primitives. Extents are chosen so
    that 2-, 3-, 4-, 6- and 8-way splits exist, some of them uneven."""
    o = _ops()
    S = []

    def add(label, fn, *args):
        S.append((label, fn, args))

    # linalg
    add("matmul 6x8@8x12", lambda a, b: o.matmul(a, b), _arr(6, 8), _arr(8, 12))
    add("matmul uneven 5x7@7x9 f32", lambda a, b: o.matmul(a, b),
        _arr(5, 7, dtype="float32"), _arr(7, 9, dtype="float32"))
    add("matmul batched broadcast", lambda a, b: o.matmul(a, b), _arr(2, 3, 4, 5), _arr(3, 5, 6))
    add("matmul batch-1 broadcast", lambda a, b: o.matmul(a, b), _arr(1, 4, 3), _arr(6, 3, 5))
    # integers: partial sums must recompose exactly (int32 contracts in int64, then casts)
    add("matmul int32", lambda a, b: o.matmul(a, b), _arr(6, 8, dtype="int32"),
        _arr(8, 4, dtype="int32"))
    if hasattr(o, "einsum"):
        for sub, shapes in [("ij,jk->ik", [(6, 8), (8, 4)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 6)]),
                            ("ii->i", [(6, 6)]), ("ij->", [(6, 4)]), ("i,j->ij", [(6,), (4,)]),
                            ("...ij,j->...i", [(2, 6, 4), (4,)]),
                            ("ij,jk,kl->il", [(4, 6), (6, 3), (3, 8)]),
                            ("ij,ij->ij", [(1, 8), (6, 8)])]:
            add(f"einsum {sub}", lambda *xs, sub=sub: o.einsum(sub, *xs),
                *(_arr(*s) for s in shapes))
        add("einsum literal", lambda x: o.einsum("ij,->ij", x, 2.0), _arr(6, 4))
    # elementwise, unary (positive inputs where the op needs them)
    for name in ("neg", "abs", "exp", "tanh", "sigmoid", "relu", "gelu", "silu", "cos", "sin",
                 "square"):
        if hasattr(o, name):
            add(f"{name} 6x8", getattr(o, name), _arr(6, 8))
    for name in ("log", "sqrt", "rsqrt"):
        if hasattr(o, name):
            add(f"{name} 6x8", getattr(o, name), _pos(6, 8))
    # elementwise, binary: same shape, broadcasting, Literal scalars on either side
    for name in ("add", "sub", "mul", "div", "maximum", "minimum", "less", "less_equal",
                 "greater", "greater_equal", "equal", "not_equal"):
        f = getattr(o, name)
        rhs = _pos if name == "div" else _arr
        add(f"{name} same", f, _arr(6, 8), rhs(6, 8))
        add(f"{name} broadcast row", f, _arr(7, 6), rhs(6))
        add(f"{name} broadcast col+row", f, _arr(5, 1), rhs(1, 8))
        add(f"{name} literal rhs", lambda x, f=f: f(x, 0.5), _arr(6, 8))
        add(f"{name} literal lhs", lambda x, f=f: f(2.0, x), rhs(9, 4))
    if hasattr(o, "pow"):
        add("pow", o.pow, _pos(6, 8), _arr(6, 8))
        add("pow literal", lambda x: o.pow(x, 2.0), _pos(6, 8))
        add("pow f32 broadcast", o.pow, _pos(4, 6, dtype="float32"), _arr(6, dtype="float32"))
    if hasattr(o, "where"):
        add("where", lambda c, x, y: o.where(c, x, y), _arr(6, 8, dtype="bool"), _arr(6, 8),
            _arr(6, 8))
        add("where broadcast+literal", lambda c, x: o.where(c, x, 0.0),
            _arr(6, 1, dtype="bool"), _arr(6, 8))
    if hasattr(o, "astype"):
        add("astype f64->f32", lambda x: o.astype(x, "float32"), _arr(6, 8))
        add("astype f32->f16", lambda x: o.astype(x, "float16"), _arr(6, 8, dtype="float32"))
    # reductions (whatever the reductions family provides)
    for name in ("sum", "mean", "max", "min"):
        if hasattr(o, name):
            f = getattr(o, name)
            add(f"{name} axis 1", lambda x, f=f: f(x, axis=1), _arr(6, 8))
            add(f"{name} axis 0 keepdims", lambda x, f=f: f(x, axis=0, keepdims=True),
                _arr(8, 6))
            add(f"{name} all", lambda x, f=f: f(x), _arr(4, 6))
            add(f"{name} int64 axis 0", lambda x, f=f: f(x, axis=0), _arr(8, 3, dtype="int64"))
    if hasattr(o, "softmax"):
        add("softmax", lambda x: o.softmax(x, axis=-1), _arr(8, 6))
    # norms
    if hasattr(o, "rms_norm"):
        add("rms_norm 3d", lambda x, w: o.rms_norm(x, w), _arr(2, 6, 5), _arr(5))
        add("rms_norm f16", lambda x, w: o.rms_norm(x, w), _arr(8, 4, dtype="float16"),
            _arr(4, dtype="float16"))
    if hasattr(o, "layer_norm"):
        add("layer_norm", lambda x, w, b: o.layer_norm(x, w, b), _arr(7, 6), _arr(6), _arr(6))
    # rope
    if hasattr(o, "rope"):
        add("rope bhsd/sd", lambda x, c, s: o.rope(x, c, s), _arr(2, 3, 8, 4), _arr(8, 4),
            _arr(8, 4))
        add("rope broadcast 1", lambda x, c, s: o.rope(x, c, s), _arr(6, 4, 8),
            _arr(6, 1, 8), _arr(6, 1, 8))
    # attention (GQA; causal; packed segments; batch)
    if hasattr(o, "attention"):
        add("attention gqa 8q/4kv", lambda q, k, v: o.attention(q, k, v),
            _arr(8, 6, 4), _arr(4, 6, 4), _arr(4, 6, 4))
        add("attention segments", lambda q, k, v: o.attention(q, k, v, segments=(3, 5, 8, 12)),
            _arr(4, 12, 4), _arr(2, 12, 4), _arr(2, 12, 4))
        add("attention batch non-causal", lambda q, k, v: o.attention(q, k, v, causal=False),
            _arr(6, 2, 5, 4), _arr(6, 1, 5, 4), _arr(6, 1, 5, 4))
        # one sequence, one kv head: only the query / key sequence splits reach p
        add("attention one sequence causal", lambda q, k, v: o.attention(q, k, v),
            _arr(2, 12, 4), _arr(1, 12, 4), _arr(1, 12, 4))
        add("attention one sequence non-causal f32",
            lambda q, k, v: o.attention(q, k, v, causal=False),
            _arr(2, 9, 4, dtype="float32"), _arr(1, 9, 4, dtype="float32"),
            _arr(1, 9, 4, dtype="float32"))
        add("attention segments one kv head",
            lambda q, k, v: o.attention(q, k, v, segments=(2, 7, 9, 16)),
            _arr(3, 16, 4), _arr(1, 16, 4), _arr(1, 16, 4))
    # shape
    if hasattr(o, "transpose"):
        add("transpose 3d", lambda x: o.transpose(x, (2, 0, 1)), _arr(4, 6, 3))
    if hasattr(o, "reshape"):
        add("reshape merge", lambda x: o.reshape(x, (24, 5)), _arr(8, 3, 5))
        add("reshape split", lambda x: o.reshape(x, (4, 2, 6)), _arr(8, 6))
        add("reshape heads", lambda x: o.reshape(x, (6, 4, 2)), _arr(6, 8))
    if hasattr(o, "concatenate"):
        add("concatenate axis 1", lambda a, b: o.concatenate([a, b], axis=1), _arr(6, 3),
            _arr(6, 5))
    if hasattr(o, "slice"):
        add("slice", lambda x: o.slice(x, (1, 2), (7, 10)), _arr(8, 12))
    if hasattr(o, "getitem"):
        add("getitem", lambda x: o.getitem(x, (slice(1, 7), 3)), _arr(8, 6))
    # families that carry their samples in their own file: spec_samples(_arr)
    for name, mod in sorted(sys.modules.items()):
        if name.startswith("eins.ops.") and hasattr(mod, "spec_samples"):
            for label, fn, args in mod.spec_samples(_arr):
                add(label, fn, *args)
    return S


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
    from eins.ir.program import eqn_indexing
    from eins.passes.enumerate_specs import balanced_intervals, eqn_candidates, index_caps
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
    from eins.passes.enumerate_specs import factorizations
    return bool(factorizations(p, caps))


def check(ops=None, ps=PS) -> dict[str, Report]:
    """Run the checker over ``ops`` (default: every registered primitive)."""
    from eins.tracing import trace
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
    import eins.ops  # noqa: F401  (registers every op family)
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
